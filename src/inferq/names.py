"""The rules for names in the settings: classes, models, tenants, the namespace, cells.

Their own module so the CLI can check a namespace before it loads the settings
(pydantic; issue 15: CLI start time); :mod:`inferq.config` applies them to its fields.
"""

from __future__ import annotations

#: A class, model, tenant or namespace name: no ``:`` and no ``|``, the separators of
#: keys and queue names (:mod:`inferq.store.keys`).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
#: A cell's name: it starts every request id of the cell (see :mod:`inferq.cells`).
CELL_NAME_PATTERN = r"^[a-z0-9]{1,16}$"
