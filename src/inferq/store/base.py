"""What every synchronous store call stands on: the connection, the scripts, the clock."""

from __future__ import annotations

from typing import Any

from inferq.config import Settings
from inferq.store.calls import Call
from inferq.store.connection import MIN_BLOCK_S, Connection, block_limit_s
from inferq.store.glance import Glance
from inferq.store.scripts import SCRIPTS, script_source


class StoreBase(Glance):
    """A redis-py client with text replies, the deployment's settings and keys, and every
    Lua script registered on it (see :class:`~inferq.store.Store`).

    Args:
        client: a redis-py client created with ``decode_responses=True``.
        settings: limits, TTLs and the namespace.
    """

    def __init__(self, client: Connection, settings: Settings) -> None:
        super().__init__(client, settings.namespace)
        self.settings = settings
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPTS}
        self._block_limit = block_limit_s(client)

    def block_s(self, wanted_s: float) -> float:
        """How long one blocking command may block for a wait of ``wanted_s`` seconds:
        at most ``wanted_s`` and at most half the connection's socket timeout
        (:func:`~inferq.store.connection.block_limit_s`); callers wait in chunks."""
        if self._block_limit is None:
            return wanted_s
        return max(MIN_BLOCK_S, min(wanted_s, self._block_limit))

    def _call(self, call: Call, client: Any = None) -> Any:
        return self._scripts[call.script](keys=call.keys, args=call.args, client=client)
