"""What every synchronous store call stands on: the connection, the scripts, the clock."""

from __future__ import annotations

from typing import Any

from inferq.config import Settings
from inferq.store import calls
from inferq.store.calls import Call
from inferq.store.connection import MIN_BLOCK_S, Connection, block_limit_s
from inferq.store.keys import Keys
from inferq.store.scripts import SCRIPTS, script_source


class StoreBase:
    """A redis-py client with text replies, the deployment's settings and keys, and every
    Lua script registered on it (see :class:`~inferq.store.Store`).

    Args:
        client: a redis-py client created with ``decode_responses=True``.
        settings: limits, TTLs and the namespace.
    """

    def __init__(self, client: Connection, settings: Settings) -> None:
        # Typed Any: with decode_responses=True every reply is str, which redis-py's
        # stubs (bytes | str for every call) cannot express.
        self.redis: Any = client
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPTS}
        self._block_limit = block_limit_s(client)

    def block_s(self, wanted_s: float) -> float:
        """How long one blocking command may block for a wait of ``wanted_s`` seconds:
        at most ``wanted_s`` and at most half the connection's socket timeout
        (:func:`~inferq.store.connection.block_limit_s`); callers wait in chunks."""
        if self._block_limit is None:
            return wanted_s
        return max(MIN_BLOCK_S, min(wanted_s, self._block_limit))

    def close(self) -> None:
        """Close the connection pool."""
        self.redis.close()

    def _call(self, call: Call, client: Any = None) -> Any:
        return self._scripts[call.script](keys=call.keys, args=call.args, client=client)

    def now(self) -> float:
        """Redis server time, epoch seconds (the one clock every script uses)."""
        return calls.redis_time(self.redis.time())
