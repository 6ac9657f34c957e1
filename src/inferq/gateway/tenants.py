"""Bearer API keys -> tenants: who may use which priority classes, and how fast.

A keys file (TOML or JSON, by its suffix) maps each key to its tenant::

    # keys.toml
    [keys."sk-acme-1"]
    tenant = "acme"
    classes = ["realtime", "standard"]   # allowed classes; omitted = all
    default_class = "standard"           # when the request names none; omitted = classifier
    requests_per_minute = 600            # omitted = no limit
    tokens_per_minute = 200000           # prompt + max_tokens, counted at admission

    [keys."sha256:9f86d08..."]           # the key's SHA-256 instead of the key itself
    tenant = "batch-jobs"
    classes = ["batch"]

Keys are compared by their SHA-256 digest, so a file may hold digests only
(``sha256:<hex>``).

Keys can also live in Redis (``inferq keys add/list/revoke``; the gateway reads them
with ``--redis-keys``): the hash ``P apikeys`` (:mod:`inferq.store.keys`) maps each
key's SHA-256 hex digest to its JSON entry (:class:`StoredKey`), so the key itself is
never stored and is shown once, when it is made. A replica caches what it read for
:data:`KEY_CACHE_S`, so a revoked key is refused by every replica within that time. A
key in the file wins over a stored key with the same digest.

Without a keys file and without ``--redis-keys`` the gateway is open: every caller is
the ``default`` tenant with every class (for a trusted network only; it logs a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
import tomllib
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inferq.config import Budget
from inferq.errors import ConfigError
from inferq.models import TENANT_PATTERN

log = logging.getLogger(__name__)

#: Prefix of a key given by its digest in the keys file.
DIGEST_PREFIX = "sha256:"
#: Prefix of the keys ``inferq keys add`` makes (then 43 URL-safe characters, 256 bits).
NEW_KEY_PREFIX = "iq-"
#: How long a gateway replica trusts what it read of a stored key, seconds (a revoked
#: key is refused by every replica within this time).
KEY_CACHE_S = 1.0
#: Digests a replica's key cache holds at most (it is emptied when full: unknown keys
#: sent by a scanner cannot grow it without bound).
KEY_CACHE_MAX = 10_000
#: Hex digits of a digest that name a stored key in listings (``inferq keys list``).
KEY_ID_LEN = 12


class ApiKey(BaseModel):
    """What one API key may do.

    Attributes:
        tenant: the tenant its requests are charged to (fairness, queue and rate limits).
        classes: the priority classes it may use; empty = all configured classes.
        default_class: the class of a request that names none; None = the key's only
            class if it allows one, else the classifier's (:attr:`implied_class`).
        requests_per_minute / tokens_per_minute: rate limits (None = unlimited).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str = Field(pattern=TENANT_PATTERN)
    classes: tuple[str, ...] = ()
    default_class: str | None = None
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)

    def allows(self, priority: str) -> bool:
        """True when the key may submit to class ``priority``."""
        return not self.classes or priority in self.classes

    @property
    def implied_class(self) -> str | None:
        """The class of a request that names none: ``default_class``, else the key's only
        class when it allows one (the classifier's choice could only be refused), else
        None (the classifier's)."""
        if self.default_class is not None:
            return self.default_class
        return self.classes[0] if len(self.classes) == 1 else None


#: The open gateway's caller (no keys file).
OPEN = ApiKey(tenant="default")


def digest(key: str) -> str:
    """The SHA-256 hex digest of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


def check_budget_keys(budgets: Mapping[str, Budget], key_ids: Collection[str]) -> None:
    """Refuse a budget whose ``key`` is the id of none of the gateway's API keys: it could
    never match a request, so the limit it was meant to set would not hold.

    Args:
        budgets: the settings' budgets by name.
        key_ids: the ids of every key the gateway accepts (file and, with
            ``--redis-keys``, Redis).

    Raises:
        ConfigError: naming ``budgets[NAME].key`` and what to do.
    """
    for name, budget in sorted(budgets.items()):
        if budget.key is not None and budget.key not in key_ids:
            raise ConfigError(
                f"budgets[{name!r}].key: {budget.key!r} is not the id of any API key of this "
                "gateway (its keys file, and with --redis-keys the stored keys: inferq keys "
                "list shows their ids); add the key first, or fix the id"
            )


class KeyRing:
    """API keys by digest.

    Args:
        keys: digest -> :class:`ApiKey`; None = the open gateway (every caller is
            :data:`OPEN`).
    """

    def __init__(self, keys: Mapping[str, ApiKey] | None) -> None:
        self._keys = dict(keys) if keys is not None else None

    @property
    def open(self) -> bool:
        """True when there is no keys file (no authentication)."""
        return self._keys is None

    def __len__(self) -> int:
        return len(self._keys or {})

    def ids(self) -> set[str]:
        """The ids of the file's keys (their digests' first :data:`KEY_ID_LEN` hex digits,
        what usage is metered under and a budget's ``key`` names)."""
        return {d[:KEY_ID_LEN] for d in self._keys or {}}

    def lookup(self, bearer: str | None) -> ApiKey | None:
        """The key's entry, :data:`OPEN` on an open gateway, None when unknown or missing."""
        if self._keys is None:
            return OPEN
        if not bearer:
            return None
        return self._keys.get(digest(bearer))

    @classmethod
    def load(cls, path: Path | None, class_names: Sequence[str]) -> KeyRing:
        """Read a keys file (``.toml`` or ``.json``); None = the open gateway.

        Raises:
            ConfigError: the file cannot be read or an entry is invalid (names the key's
                position, never the key), or names a class that is not configured.
        """
        if path is None:
            return cls(None)
        try:
            text = path.read_text()
            data: Any = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"keys file {path}: {exc}") from None
        entries = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(entries, dict):
            raise ConfigError(f"keys file {path}: expected a 'keys' table of key -> entry")
        keys: dict[str, ApiKey] = {}
        for i, (key, raw) in enumerate(entries.items()):
            tenant = raw.get("tenant") if isinstance(raw, dict) else None
            where = f"keys file {path}: entry {i + 1} (tenant {tenant!r})"
            entry = check_entry(raw, class_names, where)
            keys[
                key.removeprefix(DIGEST_PREFIX).lower()
                if key.startswith(DIGEST_PREFIX)
                else digest(key)
            ] = entry
        return cls(keys)


def check_entry(raw: Any, class_names: Sequence[str], where: str) -> ApiKey:
    """A key's entry, validated: fields, known classes, a default class it may use.

    Args:
        raw: the entry's fields (a mapping).
        class_names: the configured priority classes.
        where: how errors name the entry (never the key itself).

    Raises:
        ConfigError: ``<where>: <field>: <what is wrong>``.
    """
    try:
        entry = ApiKey.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ConfigError(f"{where}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    unknown = [c for c in (*entry.classes, entry.default_class) if c and c not in class_names]
    if unknown:
        raise ConfigError(
            f"{where}: unknown class {unknown[0]!r} (known: {', '.join(class_names)})"
        )
    if entry.default_class and not entry.allows(entry.default_class):
        raise ConfigError(f"{where}: default_class {entry.default_class!r} is not in classes")
    return entry


def new_key() -> str:
    """A fresh API key: ``iq-`` and 256 random bits (43 URL-safe characters)."""
    return NEW_KEY_PREFIX + secrets.token_urlsafe(32)


class StoredKey(BaseModel):
    """An API key's entry as stored in Redis (the value under its digest in ``P apikeys``).

    Attributes:
        key: what the key may do.
        created_s: when it was added, Unix seconds.
        note: free text for people (who holds it, what for).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: ApiKey
    created_s: float
    note: str = Field(default="", max_length=200)

    @classmethod
    def parse(cls, text: str) -> StoredKey | None:
        """The entry of a stored JSON value; None (logged) when it is not a valid entry."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            log.warning("a stored API key's entry is invalid (key refused): %s", exc.errors()[0])
            return None


def resolve_key_id(ref: str, digests: Sequence[str]) -> str:
    """The stored digest ``ref`` names: the key itself, ``sha256:<hex>``, or the start of
    its digest as ``inferq keys list`` shows it (8 hex digits at least, unique).

    Raises:
        ConfigError: nothing or more than one stored key matches.
    """
    ref = ref.strip()
    if ref.startswith(DIGEST_PREFIX):
        wanted = [ref.removeprefix(DIGEST_PREFIX).lower()]
    elif len(ref) >= 8 and all(c in "0123456789abcdef" for c in ref.lower()):
        wanted = [d for d in digests if d.startswith(ref.lower())]
    else:
        wanted = [digest(ref)]
    found = [d for d in wanted if d in digests]
    if len(found) > 1:
        raise ConfigError(f"key id {ref!r} matches {len(found)} keys: give more digits")
    if not found:
        raise ConfigError(f"no stored API key matches {ref[:KEY_ID_LEN]!r}")
    return found[0]


class StoredKeys:
    """The API keys in Redis as one gateway replica sees them: looked up per request,
    cached for :data:`KEY_CACHE_S` (found and not found alike).

    Args:
        fetch: awaits the JSON entry of a digest (None when absent); the store's
            :meth:`~inferq.store.aio.AsyncStore.api_key`.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        fetch: Callable[[str], Awaitable[str | None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._clock = clock
        self._cache: dict[str, tuple[float, ApiKey | None]] = {}

    async def lookup(self, bearer: str) -> ApiKey | None:
        """The stored key's entry, None when the key is unknown, revoked or corrupt."""
        key_digest = digest(bearer)
        now = self._clock()
        cached = self._cache.get(key_digest)
        if cached is not None and now - cached[0] < KEY_CACHE_S:
            return cached[1]
        raw = await self._fetch(key_digest)
        stored = StoredKey.parse(raw) if raw is not None else None
        entry = stored.key if stored is not None else None
        if len(self._cache) >= KEY_CACHE_MAX:
            self._cache.clear()
        self._cache[key_digest] = (now, entry)
        return entry
