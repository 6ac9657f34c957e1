"""The CLI errors the README quotes are the ones the CLI prints: a quoted example drifted
once (the README said ``1..32768`` where ``inferq submit`` says ``1..131072``, the
default model's context), so each quote is run here and compared word for word."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .test_cli_ops import inferq

README = Path(__file__).resolve().parents[2] / "README.md"

#: Each quoted error of the README -> the ``inferq submit`` arguments that print it.
#: A new quote of an intake error in the README needs its line here.
EXAMPLES = {
    "max_tokens: 0 is outside 1..131072 (max context of llama-3.1-8b)": ["--max-tokens", "0"],
}


def _quoted_errors() -> set[str]:
    """The README's backticked intake errors (``field: value is outside ...``), with the
    line breaks of the paragraph folded to spaces."""
    quotes = re.findall(r"`([a-z_]+: [^`]*\bis outside\b[^`]*)`", README.read_text())
    return {" ".join(q.split()) for q in quotes}


def test_every_quoted_error_has_an_example() -> None:
    assert _quoted_errors() == set(EXAMPLES)


@pytest.mark.parametrize(("message", "args"), EXAMPLES.items(), ids=list(EXAMPLES))
def test_the_cli_prints_the_quoted_error(namespace: str, message: str, args: list[str]) -> None:
    out = inferq(namespace, "submit", "x", *args)
    assert out.returncode == 1
    assert out.stderr.strip() == f"error: {message}"
