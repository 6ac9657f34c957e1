"""Prefix identity of a request: the chained hashes of its prompt's fixed-size blocks.

A model server with a prefix cache (vLLM's automatic prefix caching, SGLang's radix
cache, llama.cpp's slot cache) skips the prefill of a prompt's leading tokens that a
previous request on the same server already computed. To route on that, a request
carries a *chain* of block hashes: the prompt is cut into blocks of ``block_tokens``
tokens and block ``i``'s hash covers blocks ``0..i`` (its own content and the hash
before it), so two requests share hash ``i`` exactly when they share their first
``i + 1`` blocks -- the rule of vLLM's block hashes and of llm-d's / the Gateway API
Inference Extension's router-side index. Only full blocks are hashed (a server caches
full blocks only).

Without a tokenizer a block is approximated by characters: ``block_tokens x
chars_per_token`` characters of the prompt text, as GIE's *approximate* mode does.
Chat messages are first rendered in one canonical way (:func:`chat_text`), so the
same conversation hashes the same in the client library and the gateway. A trace
with its own block ids (Mooncake's ``hash_ids``, 512-token blocks) is chained as
given (:func:`chain_ids`).

The chain is stored with the request in one compact field (:func:`encode`:
``<block_tokens>:<16 hex digits per block>``, no prompt text copied again); a
caller-supplied chain is checked by :func:`check_chain` (type, range, length).
The hash is BLAKE2b (8 bytes) truncated to 63 bits, seeded with the block size, so
chains of different block sizes never match by accident.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

from inferq import defaults
from inferq.errors import InvalidRequest, shown

#: Block hashes are integers in ``[0, 2**63)`` (they fit a signed 64-bit integer).
HASH_LIMIT = 1 << 63
_MASK = HASH_LIMIT - 1
_HEX = 16  # hex digits per stored hash
#: The stored form's parts: a block size, and lowercase hex digits (what encode writes).
_STORED = re.compile(r"[0-9]{1,6}")
_HEX_DIGITS = re.compile(r"[0-9a-f]*")


def _step(previous: int, block: bytes) -> int:
    """Hash of a block given the hash of the blocks before it (63-bit int)."""
    digest = hashlib.blake2b(previous.to_bytes(8, "little") + block, digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def chain(blocks: Iterable[bytes], block_tokens: int) -> tuple[int, ...]:
    """Chained hashes of ``blocks``: element ``i`` covers blocks ``0..i``.

    Args:
        blocks: the blocks' bytes, in prompt order.
        block_tokens: the block size in tokens; it seeds the chain, so chains of
            different block sizes never share a hash.
    """
    out: list[int] = []
    h = block_tokens
    for block in blocks:
        h = _step(h, block)
        out.append(h)
    return tuple(out)


def text_chain(
    text: str,
    block_tokens: int = defaults.PREFIX_BLOCK_TOKENS,
    chars_per_token: float = defaults.CHARS_PER_TOKEN,
    max_blocks: int = defaults.MAX_PREFIX_BLOCKS,
    session: str | None = None,
) -> tuple[int, ...]:
    """The chain of a prompt text, blocks approximated as ``block_tokens x chars_per_token``
    characters; full blocks only, the first ``max_blocks`` at most.

    Args:
        session: an affinity hint (the OpenAI ``user`` field, a session id): it becomes
            the chain's first block, so every request of the session shares at least
            that block (stickiness without a long prompt); requests of other sessions
            then share no block with it, a shared system prompt included.

    Returns:
        ``()`` for a prompt shorter than one block and no session.
    """
    size = max(1, round(block_tokens * chars_per_token))
    full = min(len(text) // size, max_blocks - (session is not None))
    data = [text[i * size : (i + 1) * size].encode("utf-8", "surrogatepass") for i in range(full)]
    if session is not None:
        data.insert(0, b"\0session\0" + session.encode("utf-8", "surrogatepass"))
    return chain(data, block_tokens)


def chat_text(messages: Iterable[Any], tools: str = "") -> str:
    """The canonical rendering of chat messages hashed for prefix identity.

    Each message is ``<|role|>\\n`` + its content + ``\\n``, then each of its tool
    calls as ``<|call|>\\n`` + name + ``\\n`` + arguments + ``\\n``: a role change
    changes the text, and a conversation's rendering at turn ``n`` is a prefix of its
    rendering at turn ``n + 1`` (what makes a multi-turn chat's earlier turns hit the
    cache). ``tools``, the declared tools' JSON (:func:`inferq.tools.tools_text`), is
    rendered as ``<|tools|>\\n`` + JSON + ``\\n`` after the leading system messages,
    where the common chat templates put them (Qwen's and Hermes' render them into the
    system turn, as does llama.cpp's generic tool format): two agents with one system
    prompt and different tools share the system prompt's blocks and no block after it,
    as on the server. Takes any objects with ``role``, ``content`` and optional
    ``tool_calls`` attributes or keys.
    """
    parts: list[str] = []
    pending = tools
    for m in messages:
        role = _get(m, "role")
        if pending and role != "system":
            parts.append(f"<|tools|>\n{pending}\n")
            pending = ""
        content = _get(m, "content")
        parts.append(f"<|{role}|>\n{content if isinstance(content, str) else ''}\n")
        for call in _get(m, "tool_calls") or ():
            function = _get(call, "function")
            parts.append(f"<|call|>\n{_get(function, 'name')}\n{_get(function, 'arguments')}\n")
    if pending:
        parts.append(f"<|tools|>\n{pending}\n")
    return "".join(parts)


def _get(obj: Any, name: str) -> Any:
    """``obj[name]`` of a mapping, else ``obj.name``; None when absent."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def chain_ids(
    ids: Sequence[int], block_tokens: int, max_blocks: int = defaults.MAX_PREFIX_BLOCKS
) -> tuple[int, ...]:
    """The chain of a trace's block ids (Mooncake's ``hash_ids``), chained as given."""
    return chain(
        (int(i).to_bytes(8, "little", signed=True) for i in ids[:max_blocks]), block_tokens
    )


def check_chain(
    value: object, field: str = "prefix_hashes", max_blocks: int = defaults.MAX_PREFIX_BLOCKS
) -> tuple[int, ...]:
    """A caller-supplied chain, checked: a list of integers in ``[0, 2**63)``, at most
    ``max_blocks`` long.

    Raises:
        InvalidRequest: (``field``) not a list or tuple, an element not an integer or
            out of range, or too long; the message names the limit.
    """
    if not isinstance(value, list | tuple):
        raise InvalidRequest(field, f"must be a list of integers, got {type(value).__name__}")
    if len(value) > max_blocks:
        raise InvalidRequest(field, f"has {len(value)} blocks, at most {max_blocks}")
    for i, h in enumerate(value):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < HASH_LIMIT:
            raise InvalidRequest(field, f"[{i}] must be an integer in [0, 2**63), got {shown(h)}")
    return tuple(value)


def encode(block_tokens: int, hashes: Sequence[int]) -> str:
    """The stored form: ``<block_tokens>:`` then 16 hex digits per hash (``""`` for none)."""
    if not hashes:
        return ""
    return f"{block_tokens}:" + "".join(f"{h:016x}" for h in hashes)


def decode(text: str) -> tuple[int, tuple[int, ...]]:
    """``(block_tokens, hashes)`` of :func:`encode`'s text; ``(0, ())`` for ``""``.

    Raises:
        ValueError: the text is not of that form.
    """
    if not text:
        return 0, ()
    size, _, digits = text.partition(":")
    if not _STORED.fullmatch(size) or not _HEX_DIGITS.fullmatch(digits):
        raise ValueError(f"bad prefix chain {text[:40]!r}")  # int() takes "-", "_", spaces
    block_tokens = int(size)
    if block_tokens < 1 or len(digits) % _HEX:
        raise ValueError(f"bad prefix chain {text[:40]!r}")
    hashes = tuple(int(digits[i : i + _HEX], 16) for i in range(0, len(digits), _HEX))
    if any(h >= HASH_LIMIT for h in hashes):
        raise ValueError("prefix hash out of range")
    return block_tokens, hashes
