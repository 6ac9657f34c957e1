"""The ``INFERQ_*`` environment variables: every name inferq reads, and typos among them.

The settings read one variable per field, ``INFERQ_<FIELD>`` in any case
(pydantic-settings' default); the CLI and the daemons read a few more by their exact
name (``INFERQ_CONFIG``, ``INFERQ_CELL``, ...). Any other ``INFERQ_`` name is ignored,
so a typo (``INFERQ_REDIS_ULR``) used to leave the default in place without a word:
:func:`warnings` names each such variable and the closest known name, and the CLI
prints them on stderr once per call (issue 15).

:func:`connection_only` is what lets a command that needs only the Redis URL and the
namespace (``inferq queues``) skip loading the settings (pydantic). This module
imports nothing heavy: the CLI reads it before it knows whether it needs the settings.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

from inferq.names import NAME_PATTERN

PREFIX = "INFERQ_"

#: The fields of :class:`~inferq.config.Settings`, each read from ``INFERQ_<FIELD>``
#: (tests/unit/test_envvars.py checks the list against the class).
SETTINGS_FIELDS = (
    "redis_url",
    "namespace",
    "classes",
    "models",
    "classifier",
    "default_priority",
    "default_model",
    "max_prompt_bytes",
    "default_max_tokens",
    "max_attempts",
    "result_ttl_s",
    "idempotency_ttl_s",
    "dead_letter_ttl_s",
    "events_maxlen",
    "heartbeat_interval_s",
    "lease_s",
    "gateway_lease_s",
    "chars_per_token",
    "scaling",
    "prefix",
    "prices",
    "budgets",
    "usage_retention_days",
    "usage_metrics_by_tenant",
    "cells",
    "default_cell",
)

#: Variables the package reads outside the settings, by exact name (the same test
#: checks that every ``INFERQ_`` name in the package's source is known).
PROCESS_VARIABLES = (
    "INFERQ_CONFIG",
    "INFERQ_CELL",
    "INFERQ_METRICS_HOST",
    "INFERQ_DOCKER_NETWORK",
    "INFERQ_GATEWAY_KEYS",
    "INFERQ_GATEWAY_REDIS_KEYS",
    "INFERQ_GATEWAY_ADMIN_KEY",
)

#: Read by inferq's own tests, benchmarks and CI (.ci/run), not by the package: known,
#: so a CI run's every CLI call does not warn about them.
PROJECT_VARIABLES = (
    "INFERQ_BENCH_NAMESPACE",
    "INFERQ_DASHBOARD_SCREENSHOT",
    "INFERQ_IMAGES",
    "INFERQ_REQUIRE_LLM",
    "INFERQ_REQUIRE_TOOLS",
    "INFERQ_TEST_OUTAGE_S",
    "INFERQ_TEST_REDIS_URL",
)

SETTINGS_VARIABLES = tuple(PREFIX + field.upper() for field in SETTINGS_FIELDS)
KNOWN = (*SETTINGS_VARIABLES, *PROCESS_VARIABLES, *PROJECT_VARIABLES)
_SUFFIXES = [name[len(PREFIX) :] for name in KNOWN]


def unknown(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``(name, closest known name or None)`` for each ``INFERQ_*`` variable (any case)
    of ``environ`` that inferq does not read, sorted by name.

    A settings variable is known in any case, as the settings read it; the others
    only as spelled in :data:`PROCESS_VARIABLES` and :data:`PROJECT_VARIABLES`.
    """
    out: list[tuple[str, str | None]] = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(PREFIX) or upper in SETTINGS_VARIABLES or name in KNOWN:
            continue
        # Compared without the prefix that every name shares (it would make any two close).
        close = difflib.get_close_matches(upper[len(PREFIX) :], _SUFFIXES, n=1, cutoff=0.6)
        out.append((name, PREFIX + close[0] if close else None))
    return out


def warnings(environ: Mapping[str, str]) -> list[str]:
    """One line per unknown ``INFERQ_*`` variable (see :func:`unknown`), for stderr."""
    return [
        f"warning: {name} is not a variable inferq reads (ignored)"
        + (f"; did you mean {close}?" if close else "")
        for name, close in unknown(environ)
    ]


def connection_only(environ: Mapping[str, str]) -> tuple[str | None, str | None] | None:
    """``(INFERQ_REDIS_URL, INFERQ_NAMESPACE)`` of ``environ`` (None where unset) when the
    environment gives no other setting and no settings file; otherwise None.

    The settings are then their defaults but for those two (what
    :meth:`~inferq.config.Settings.load` without a file would build), provided the
    namespace is a valid name (see :func:`valid_namespace`). A variable in another
    case than upper (``inferq_namespace``, which the settings read too) gives None:
    which of two spellings wins is pydantic-settings' business.
    """
    found: dict[str, str] = {}
    for name, value in environ.items():
        upper = name.upper()
        if not upper.startswith(PREFIX):
            continue
        if upper == "INFERQ_CONFIG" or (upper in SETTINGS_VARIABLES and name != upper):
            return None
        if upper in ("INFERQ_REDIS_URL", "INFERQ_NAMESPACE"):
            if not value:  # the settings take "" as given, the CLI's options as unset
                return None
            found[upper] = value
        elif upper in SETTINGS_VARIABLES:
            return None
    return found.get("INFERQ_REDIS_URL"), found.get("INFERQ_NAMESPACE")


def valid_namespace(namespace: str) -> bool:
    """Whether the settings would accept ``namespace`` (:data:`~inferq.names.NAME_PATTERN`)."""
    return re.fullmatch(NAME_PATTERN, namespace) is not None
