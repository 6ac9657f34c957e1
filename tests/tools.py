"""External programs some tests drive (promtool, prometheus, chromium): found or skipped.

A missing program skips its test with the install command, unless
``INFERQ_REQUIRE_TOOLS=1`` (``.ci/run`` sets it after installing them): then it fails.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require_tool(name: str, install: str) -> str:
    """The path of program ``name``; skip (or fail under INFERQ_REQUIRE_TOOLS=1) without it."""
    path = shutil.which(name)
    if path:
        return path
    reason = f"{name} is not installed ({install})"
    if os.environ.get("INFERQ_REQUIRE_TOOLS") == "1":
        pytest.fail(f"INFERQ_REQUIRE_TOOLS=1 but {reason}")
    pytest.skip(reason)
