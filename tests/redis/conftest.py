"""Fixtures of the tests that run real servers beside the real Redis."""

from __future__ import annotations

from .llm_server import llama_server_url as llama_server_url  # the real model server
