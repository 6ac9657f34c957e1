"""Logging: quiet by default, one line per event, optionally JSON, passwords redacted.

Prompt text is never logged at INFO or above: log records carry request ids.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):[^@/\s]+@")


def redact(text: str) -> str:
    """Replace the password of every URL in ``text`` with ``***``."""
    return _URL_PASSWORD.sub(r"\g<scheme>\g<user>:***@", text)


class RedactingFilter(logging.Filter):
    """Rewrites each record's message with passwords redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (and exc when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "WARNING", *, json_lines: bool = False) -> None:
    """Configure the root logger once for a CLI process (stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RedactingFilter())
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        fmt = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        fmt.converter = time.gmtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
