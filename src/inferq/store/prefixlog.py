"""The prefix log: what the prefix-cache index of every dispatcher replica learns from.

One Redis stream (``P prefixlog``, :attr:`~inferq.store.keys.Keys.prefix_log`), capped at
``PREFIX_STREAM_MAXLEN`` entries, of three kinds:

- a *placement* (``w``, ``c``): ``assign.lua`` writes one per claimed batch whose
  requests carry prefix chains, atomically with the claim (``c``: the encoded chains,
  space-separated, :func:`inferq.prefix.encode`);
- a *reset* (``w``, ``reset``): a worker writes one when it starts and when its model
  server comes back after an outage (it may have been restarted or replaced: its cache
  is empty); the index forgets the worker's blocks;
- a *miss* (``w``, ``fc``, ``got``, ``bt``): a worker writes one when its model server
  reports reusing fewer prompt tokens (``got``) than the index forecast (``fc``) by more
  than a block of ``bt`` tokens (the *precise* correction: the index shrinks its model
  of that worker's cache).

Every replica reads the stream from where it left off (one XREAD per step, not per
request) and applies the entries in order, so replicas converge on the same index; a
replica that starts replays what the stream retains. An entry that does not parse is
skipped and counted (never applied, never fatal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferq import defaults
from inferq.prefix import decode as decode_chain

#: The longest placement a claim can write, characters: a full batch of the longest
#: chains (16 hex digits a block and a short header each). A longer one was planted:
#: it is skipped before its chains are decoded (a 40 MB entry cost a step 4.7 s and 1 GB).
MAX_CHAINS_CHARS = defaults.MAX_BATCH * (defaults.MAX_PREFIX_BLOCKS * 16 + 16)


@dataclass(frozen=True, slots=True)
class PrefixEntry:
    """One entry of the prefix log.

    Attributes:
        worker: the worker it is about.
        kind: ``place``, ``reset`` or ``miss``.
        chains: (block tokens, chain) of each placed request (``place``).
        forecast_tokens / served_tokens / block_tokens: a ``miss``'s figures, tokens.
    """

    worker: str
    kind: str
    chains: tuple[tuple[int, tuple[int, ...]], ...] = ()
    forecast_tokens: int = 0
    served_tokens: int = 0
    block_tokens: int = 0


def parse_entry(fields: dict[str, str]) -> PrefixEntry:
    """The entry of a stream entry's fields.

    Raises:
        ValueError: a field is missing or does not parse.
    """
    worker = fields.get("w")
    if not worker:
        raise ValueError("prefix log entry without a worker")
    if "c" in fields:
        if len(fields["c"]) > MAX_CHAINS_CHARS:
            raise ValueError(f"prefix log placement of {len(fields['c'])} characters")
        chains = tuple(decode_chain(text) for text in fields["c"].split(" ") if text)
        return PrefixEntry(worker, "place", chains=chains)
    if "reset" in fields:
        return PrefixEntry(worker, "reset")
    if "fc" in fields:
        return PrefixEntry(
            worker,
            "miss",
            forecast_tokens=int(fields["fc"]),
            served_tokens=int(fields["got"]),
            block_tokens=int(fields["bt"]),
        )
    raise ValueError(f"prefix log entry of no known kind: {sorted(fields)}")


def decode_rows(rows: Sequence[Any]) -> list[tuple[str, dict[str, str]]]:
    """An XRANGE reply read without decoding, decoded entry by entry: an entry whose
    fields are not UTF-8 (planted: inferq writes ASCII) keeps its id with no fields, so
    :func:`parse_entries` counts it bad and the reader moves past it."""
    out: list[tuple[str, dict[str, str]]] = []
    for entry_id, fields in rows:
        try:
            decoded = {k.decode(): v.decode() for k, v in fields.items()}
        except UnicodeDecodeError:
            decoded = {}
        out.append((entry_id.decode("ascii"), decoded))
    return out


def parse_entries(rows: Sequence[Any]) -> tuple[list[PrefixEntry], str | None, int]:
    """(entries, last id read, entries that did not parse) of an XREAD/XRANGE reply's rows."""
    out: list[PrefixEntry] = []
    last: str | None = None
    bad = 0
    for entry_id, fields in rows:
        last = entry_id
        try:
            out.append(parse_entry(fields))
        except (ValueError, KeyError):
            bad += 1
    return out, last, bad
