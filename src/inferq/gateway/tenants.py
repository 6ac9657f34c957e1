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
(``sha256:<hex>``). Without a keys file the gateway is open: every caller is the
``default`` tenant with every class (for a trusted network only; it logs a warning).
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inferq.errors import ConfigError
from inferq.models import TENANT_PATTERN

#: Prefix of a key given by its digest in the keys file.
DIGEST_PREFIX = "sha256:"


class ApiKey(BaseModel):
    """What one API key may do.

    Attributes:
        tenant: the tenant its requests are charged to (fairness, queue and rate limits).
        classes: the priority classes it may use; empty = all configured classes.
        default_class: the class of a request that names none; None = the classifier's.
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


#: The open gateway's caller (no keys file).
OPEN = ApiKey(tenant="default")


def digest(key: str) -> str:
    """The SHA-256 hex digest of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


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
            where = f"keys file {path}: entry {i + 1} (tenant {raw.get('tenant')!r})"
            try:
                entry = ApiKey.model_validate(raw)
            except ValidationError as exc:
                err = exc.errors()[0]
                raise ConfigError(
                    f"{where}: {'.'.join(map(str, err['loc']))}: {err['msg']}"
                ) from None
            unknown = [
                c for c in (*entry.classes, entry.default_class) if c and c not in class_names
            ]
            if unknown:
                raise ConfigError(
                    f"{where}: unknown class {unknown[0]!r} (known: {', '.join(class_names)})"
                )
            if entry.default_class and not entry.allows(entry.default_class):
                raise ConfigError(
                    f"{where}: default_class {entry.default_class!r} is not in classes"
                )
            keys[
                key.removeprefix(DIGEST_PREFIX).lower()
                if key.startswith(DIGEST_PREFIX)
                else digest(key)
            ] = entry
        return cls(keys)
