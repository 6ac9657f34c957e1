"""A prompt's tokens counted with the served model's own tokenizer, when it is known.

A model of the registry may name its Hugging Face tokenizer (``tokenizer =
"/path/to/tokenizer.json"`` in its ``[[models]]`` entry: the file every Hugging Face
model repository carries, the one vLLM and TGI load). With the optional ``tokenizers``
library installed (``pip install "inferq[tokenizer]"``) intake then counts a prompt with
it, so the context check, the rate limits' tokens and the KV booking use the model's
count instead of an estimate. Without a tokenizer named, without the library, or when
the file does not load (logged once per file), the count is
:mod:`inferq.policy.estimate`'s and the refusals say it is an estimate.

A chat's count is its messages' text counted by the tokenizer plus
``defaults.TOKENS_PER_MESSAGE`` a message for the chat template's markers (the template
itself is the server's), so it stays close, not exact.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inferq.config import ModelSpec

log = logging.getLogger(__name__)

#: The library that reads a tokenizer.json (the ``tokenizer`` extra).
LIBRARY = "tokenizers"


@dataclass(frozen=True, slots=True)
class ModelTokenizer:
    """A loaded tokenizer and whose it is.

    Attributes:
        model: the registry name of the model (for messages: "counted with X's tokenizer").
        count: the tokens of a text (no special tokens added).
    """

    model: str
    count: Callable[[str], int]


@functools.cache
def available() -> bool:
    """True when the ``tokenizers`` library is installed (looked up once)."""
    return importlib.util.find_spec(LIBRARY) is not None


def tokenizer_for(specs: Sequence[ModelSpec]) -> ModelTokenizer | None:
    """The tokenizer that counts for a route served by ``specs``: the one tokenizer file
    all of them name (a route over models of different tokenizers has no single count);
    None when they name none or different ones, the library is missing or the file does
    not load."""
    paths = {spec.tokenizer for spec in specs}
    if len(paths) != 1:
        return None
    [path] = paths
    if path is None or not available():
        return None
    count = _load(path)
    if count is None:
        return None
    return ModelTokenizer(model="/".join(sorted(spec.name for spec in specs)), count=count)


@functools.lru_cache(maxsize=32)
def _load(path: str) -> Callable[[str], int] | None:
    """The counting function of the tokenizer.json at ``path``, loaded once; None (and a
    warning, once) when it does not load."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:  # a missing file or one of another format: the estimate serves
        log.warning("tokenizer %s does not load (%s): prompts are estimated instead", path, exc)
        return None

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count
