"""The gateway's admin endpoint: ``GET /v1/usage``, behind the admin key.

The admin key is one bearer token given to ``inferq gateway --admin-key`` (better through
``INFERQ_GATEWAY_ADMIN_KEY``: a command line is visible to every user of the host), as
the key itself or its digest ``sha256:<64 hex>``. It is compared by digest, in constant
time, and is no tenant's key: the tenants' keys (file or Redis) never open this endpoint,
and the admin key opens nothing else. Without ``--admin-key`` the endpoint answers 403.

``GET /v1/usage?by=tenant&since=24h&until=now[&cell=NAME]`` answers what
``inferq usage --json`` prints (:meth:`inferq.store.Store.usage_report`, one reading for
both): the rows by ``by`` (``tenant``, ``key``, ``class``, ``model``), their total and
the records skipped as corrupt, over whole UTC hours, priced now. ``cell`` reads that
cell's Redis, as ``inferq --cell NAME usage`` does; without it, ``redis_url``'s. A
parameter that does not parse, or one the endpoint does not know, is refused with 400
naming it (``param``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
from collections.abc import Mapping

from inferq.config import Settings
from inferq.errors import ConfigError, InvalidUsageQuery
from inferq.gateway.tenants import DIGEST_PREFIX
from inferq.store import Store, connect

#: The query parameters of ``GET /v1/usage`` and their defaults (``inferq usage``'s).
USAGE_PARAMS: dict[str, str | None] = {"by": "tenant", "since": "24h", "until": "now", "cell": None}
#: Shortest admin key accepted, characters (``inferq keys add`` makes 46).
ADMIN_KEY_MIN_LEN = 16
_HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class AdminKey:
    """The admin bearer token, held as its SHA-256 digest.

    Args:
        text: the key, or ``sha256:<64 lowercase hex>`` (its digest).

    Raises:
        ConfigError: a digest that is not 64 hex digits, or a key shorter than
            :data:`ADMIN_KEY_MIN_LEN` (names ``--admin-key``, never the key).
    """

    def __init__(self, text: str) -> None:
        text = text.strip()
        if text.startswith(DIGEST_PREFIX):
            hexdigest = text[len(DIGEST_PREFIX) :]
            if not _HEX_DIGEST.match(hexdigest):
                raise ConfigError("--admin-key: a digest is sha256: and 64 lowercase hex digits")
            self._digest = bytes.fromhex(hexdigest)
        elif len(text) < ADMIN_KEY_MIN_LEN:
            raise ConfigError(
                f"--admin-key: give at least {ADMIN_KEY_MIN_LEN} characters "
                "(inferq keys add makes one) or its sha256:<hex> digest"
            )
        else:
            self._digest = hashlib.sha256(text.encode()).digest()

    def matches(self, bearer: str | None) -> bool:
        """True when ``bearer`` is the admin key (constant-time on the digests)."""
        if not bearer:
            return False
        return hmac.compare_digest(hashlib.sha256(bearer.encode()).digest(), self._digest)


def usage_query(params: Mapping[str, str], settings: Settings) -> dict[str, str | None]:
    """The parameters of a ``GET /v1/usage``, defaults filled in; their values are parsed
    by :meth:`~inferq.store.Store.usage_report` (which names a bad one the same way).

    Raises:
        InvalidUsageQuery: an unknown parameter, or a ``cell`` that is not configured
            (its name is the ``field``).
    """
    for name in params:
        if name not in USAGE_PARAMS:
            raise InvalidUsageQuery(name, f"unknown parameter (known: {', '.join(USAGE_PARAMS)})")
    query = {name: params.get(name, default) for name, default in USAGE_PARAMS.items()}
    cell = query["cell"]
    if cell is not None and cell not in settings.cells:
        raise InvalidUsageQuery(
            "cell", f"{cell!r} is not a cell (configured: {sorted(settings.cells) or 'none'})"
        )
    return query


class UsageReader:
    """Reads usage for the endpoint: one synchronous :class:`~inferq.store.Store` per Redis
    read (``redis_url``'s, or a cell's), made on first use; call from a worker thread.

    Args:
        settings: the deployment.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stores: dict[str | None, Store] = {}
        self._lock = threading.Lock()

    def report(self, query: Mapping[str, str | None]) -> dict[str, object]:
        """:meth:`Store.usage_report` of ``query`` (from :func:`usage_query`).

        Raises:
            InvalidUsageQuery: ``by``, ``since`` or ``until`` does not parse.
            RedisUnavailable: (and the store's connection errors) Redis did not answer.
        """
        cell = query.get("cell")
        with self._lock:
            store = self._stores.get(cell)
            if store is None:
                settings = self.settings
                if cell is not None:
                    url = settings.cells[cell].redis_url
                    settings = settings.model_copy(update={"redis_url": url})
                store = self._stores[cell] = Store(connect(settings.redis_url), settings)
        return store.usage_report(str(query["by"]), str(query["since"]), str(query["until"]))

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
