"""Model routes: an exact model name, or a size requirement such as ``>=13b``.

Pure functions over the registry; no I/O. A size requirement is served by the
smallest adequate model (the design brief's cost rule); an exact name by that
model, or by its configured fallbacks when the priority class allows degrading.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from inferq.config import ModelSpec
from inferq.errors import ContextLengthExceeded, InvalidRequest, UnknownRoute

_SIZE = re.compile(r"^>=\s*(\d+(?:\.\d+)?)\s*[bB]$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True, slots=True)
class Route:
    """A parsed route: exactly one of ``model`` (exact name) or ``min_params_b`` is set."""

    text: str
    model: str | None = None
    min_params_b: float | None = None

    def satisfied_by(self, spec: ModelSpec) -> bool:
        """True when ``spec`` serves this route without degrading."""
        if self.model is not None:
            return spec.name == self.model
        assert self.min_params_b is not None
        return spec.params_b >= self.min_params_b


def parse_route(text: str) -> Route:
    """Parse ``"llama-3.1-8b"`` or ``">=13b"`` (billions of parameters).

    Raises:
        InvalidRequest: (field ``model``) the text is neither form.
    """
    if not isinstance(text, str):
        raise InvalidRequest("model", f"must be a string, got {type(text).__name__}")
    stripped = text.strip()
    size = _SIZE.match(stripped)
    if size:
        min_b = float(size.group(1))
        if min_b <= 0:
            raise InvalidRequest("model", f"size requirement {text!r} must be above 0b")
        return Route(text=f">={size.group(1)}b", min_params_b=min_b)
    if _NAME.match(stripped):
        return Route(text=stripped, model=stripped)
    raise InvalidRequest(
        "model",
        f"{text!r} is neither a model name (letters, digits, '.', '_', '-', at most 64) "
        "nor a size requirement like '>=13b'",
    )


def candidates(route: Route, registry: Sequence[ModelSpec], *, degrade: bool = False) -> list[str]:
    """Models that may serve ``route``, most preferred first.

    Size requirements list every adequate model, smallest first (cheapest). An
    exact name lists itself, then its fallbacks when ``degrade`` is true.
    """
    if route.model is not None:
        names = [route.model]
        if degrade:
            spec = next((m for m in registry if m.name == route.model), None)
            if spec is not None:
                names.extend(spec.fallbacks)
        return names
    adequate = [m for m in registry if route.satisfied_by(m)]
    return [m.name for m in sorted(adequate, key=lambda m: (m.params_b, m.name))]


def served(
    route: Route, registry: Sequence[ModelSpec], available: Collection[str], *, degrade: bool
) -> bool:
    """True when a model in ``available`` (live workers' models, scaler pools) may serve
    ``route`` (its fallbacks too when ``degrade``): the gateway's 503 rule and the CLI's
    note on a request that nothing serves now."""
    return not set(candidates(route, registry, degrade=degrade)).isdisjoint(available)


def check_known(route: Route, registry: Sequence[ModelSpec]) -> list[ModelSpec]:
    """Registry models that serve ``route`` (without degrading), smallest first.

    Raises:
        UnknownRoute: no model in the registry serves the route.
    """
    by_name = {m.name: m for m in registry}
    specs = [by_name[n] for n in candidates(route, registry) if n in by_name]
    if not specs:
        known = ", ".join(sorted(by_name))
        if route.model is not None:
            raise UnknownRoute("model", f"unknown model {route.text!r} (registry: {known})")
        largest = max(m.params_b for m in registry)
        raise UnknownRoute("model", f"no model has {route.text} parameters (largest: {largest:g}b)")
    return specs


# --- the context rule of intake (shared by the client and the simulator) ---------------


def default_max_tokens(default: int, prompt_tokens: int, specs: Sequence[ModelSpec]) -> int:
    """``max_tokens`` of a submission that gives none: ``default``, lowered to the room the
    route's largest context leaves after the prompt (at least 1; a prompt that fills the
    context is then refused by :func:`check_context`).

    Args:
        default: ``Settings.default_max_tokens``.
        prompt_tokens: the prompt's (estimated) tokens.
        specs: the models serving the route (:func:`check_known`).
    """
    max_context = max(s.max_context for s in specs)
    return min(default, max(1, max_context - prompt_tokens))


#: What a context refusal says of its prompt count: intake counts with tiktoken's
#: ``cl100k_base`` when installed, else characters / ``chars_per_token``, never with the
#: served model's own tokenizer, so a prompt near the limit may be judged either way
#: (the simulator words its refusals the same, so it refuses exactly what intake does).
ESTIMATED = "an estimate, not the model's tokenizer"


def check_context(
    max_tokens: int,
    prompt_tokens: int,
    specs: Sequence[ModelSpec],
    route: str,
    *,
    counted_by: str | None = None,
) -> None:
    """Refuse a submission no model of its route could ever hold: the intake rule.

    ``max_tokens`` must be in 1..the largest ``max_context`` of the route's models,
    and ``prompt_tokens + max_tokens`` must fit that context (the model server would
    refuse it: vLLM and llama.cpp reject a request whose prompt plus ``max_tokens``
    exceeds the context window). :func:`inferq.intake.build_request` and the
    simulator's workload (:mod:`inferq.sim.workload`) both call this, so the
    simulator refuses exactly what a client is refused.

    Args:
        max_tokens: the requested output cap (an int; intake checks the type first).
        prompt_tokens: the prompt's (estimated) tokens.
        specs: the models serving the route (:func:`check_known`), non-empty.
        route: the route's text, for the message.
        counted_by: the model whose tokenizer counted ``prompt_tokens`` (the message
            says so); None: an estimate (the message says that).

    Raises:
        InvalidRequest: field ``max_tokens`` out of 1..the max context, naming the limit.
        ContextLengthExceeded: field ``prompt`` when the prompt alone fills the context,
            ``max_tokens`` when the two together overflow it; the message says whether
            the prompt's count is an estimate or the model's tokenizer's.
    """
    max_context = max(s.max_context for s in specs)
    how = ESTIMATED if counted_by is None else f"counted with {counted_by}'s tokenizer"
    about = "~" if counted_by is None else ""
    if not 1 <= max_tokens <= max_context:
        shown = (
            repr(max_tokens)
            if abs(max_tokens) < 10**18
            else f"an integer of {max_tokens.bit_length()} bits"
        )
        raise InvalidRequest(
            "max_tokens", f"{shown} is outside 1..{max_context} (max context of {route})"
        )
    if prompt_tokens >= max_context:  # no max_tokens could fit: the prompt is to blame
        raise ContextLengthExceeded(
            "prompt",
            f"{about}{prompt_tokens} tokens ({how}) leave no room for output in the max "
            f"context of {route} ({max_context} tokens)",
        )
    if prompt_tokens + max_tokens > max_context:
        raise ContextLengthExceeded(
            "max_tokens",
            f"prompt ({about}{prompt_tokens} tokens, {how}) + max_tokens {max_tokens} "
            f"exceeds the max context of {route} ({max_context} tokens)",
        )
