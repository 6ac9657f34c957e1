"""Ids that sort by creation time: requests (the client) and batches (the dispatcher).

Minting one reads the clock and the OS random source, so it lives with the I/O, not
with the pure rules (which get their time as an argument).
"""

from __future__ import annotations

import os
import time


def new_id() -> str:
    """A 26-hex-digit id that sorts by creation time (ns clock + 40 random bits)."""
    return f"{time.time_ns():016x}{os.urandom(5).hex()}"
