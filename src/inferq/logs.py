"""Logging: quiet by default, one line per event, optionally JSON, passwords redacted.

Prompt text is never logged at INFO or above: log records carry request ids.
Redaction is applied to the finished line, so a password inside a log
argument, an exception message or a traceback is replaced by ``***`` as well
(see :func:`inferq.errors.redact_text` for the patterns).
"""

from __future__ import annotations

import json
import logging
import sys
import time

from inferq.errors import redact_text


def redact(text: str) -> str:
    """Replace the password of every URL in ``text`` with ``***``."""
    return redact_text(text)


class RedactingFilter(logging.Filter):
    """Rewrites each record's message and exception text with passwords redacted.

    For handlers inferq does not configure itself; :func:`setup_logging`'s
    formatters redact the whole formatted line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


class RedactingFormatter(logging.Formatter):
    """The standard one-line format, with passwords redacted from the finished text."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (and exc when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        if record.exc_info:
            entry["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry)


def setup_logging(level: str = "WARNING", *, json_lines: bool = False) -> None:
    """Configure the root logger once for a CLI process (stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RedactingFilter())
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        fmt = RedactingFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        fmt.converter = time.gmtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
