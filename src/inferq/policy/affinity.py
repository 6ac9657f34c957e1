"""Prefix-cache affinity: trade the prefill a worker's cache saves against its load.

The naive rule -- send a request where the longest prefix of its prompt is cached --
piles the fleet onto one worker: every request of a trace like Mooncake's shares its
first block (a system prompt), so the first worker to see one holds the longest
prefix of every later request. The rule here weighs the cache against load, in
tokens, as NVIDIA Dynamo's KV router does (cost = prefill blocks still to compute +
active blocks):

    cost(w) = (prompt_tokens - cached_tokens(w)) + weight x load_tokens(w)

- ``cached_tokens(w)``: the leading prompt tokens the index (:mod:`.prefix_index`)
  says ``w`` holds, at most ``prompt_tokens``;
- ``load_tokens(w)``: the ``prompt + max_tokens`` of everything ``w`` holds
  (running and assigned, from its reserved KV MiB) plus this decision's batch so far;
- ``weight = load_weight x (1 + (urgent_load_factor - 1) x (1 - slack))``, where
  ``slack`` in ``[0, 1]`` is the fraction of the request's class SLA (time to first
  token) still left: a request near its SLA weighs load up to ``urgent_load_factor``
  times more, so it takes the surer, less loaded worker over a forecast hit.

Balance mode (SGLang's cache-aware router: when ``max_load - min_load >
balance_abs_threshold`` and ``max_load > balance_rel_threshold x min_load`` it stops
following its radix trees and sends to the least loaded worker): a cached candidate
whose load exceeds the least-loaded candidate's by more than ``balance_abs_tokens``
*and* more than ``balance_rel`` times is not taken, however much it would save. So
an idle worker is never passed over for a busy one by more than those margins, and
the fleet cannot collapse onto one worker while others are idle.

The candidates are today's pick (the least-utilised worker with room in the
request's most preferred model, :class:`~inferq.policy.routing.WorkerIndex`) and the
workers of that same model that hold a prefix of the request: route preference
(smallest adequate model first), priority classes, fairness, headroom and
reservations are all decided before this rule runs and are unchanged by it. A
request that shares no prefix with any worker is routed exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferq import defaults
from inferq.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AffinityRule:
    """The affinity rule's settings (``Settings.prefix``; defaults in :mod:`inferq.defaults`).

    Attributes:
        enabled: route on prefix caches at all (False: least-utilised routing only).
        load_weight: tokens of load that weigh as much as one prefill token saved.
        balance_abs_tokens: load margin over the least-loaded candidate beyond which
            a cached worker is passed over (with ``balance_rel``), tokens.
        balance_rel: load ratio over the least-loaded candidate beyond which a cached
            worker is passed over (with ``balance_abs_tokens``).
        urgent_load_factor: the load weight's multiplier at no SLA slack left (>= 1).

    Raises:
        ConfigError: a value out of range (the message names it and the limit).
    """

    enabled: bool = True
    load_weight: float = defaults.PREFIX_LOAD_WEIGHT
    balance_abs_tokens: float = defaults.PREFIX_BALANCE_ABS_TOKENS
    balance_rel: float = defaults.PREFIX_BALANCE_REL
    urgent_load_factor: float = defaults.PREFIX_URGENT_LOAD_FACTOR

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ConfigError(f"prefix.load_weight must be >= 0, got {self.load_weight}")
        if self.balance_abs_tokens < 0:
            raise ConfigError(
                f"prefix.balance_abs_tokens must be >= 0, got {self.balance_abs_tokens}"
            )
        if self.balance_rel < 1:
            raise ConfigError(f"prefix.balance_rel must be >= 1, got {self.balance_rel}")
        if self.urgent_load_factor < 1:
            raise ConfigError(
                f"prefix.urgent_load_factor must be >= 1, got {self.urgent_load_factor}"
            )


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker as the affinity rule weighs it.

    Attributes:
        key: the caller's handle (an index into its list of batches).
        cached_tokens: leading prompt tokens its cache holds (forecast), tokens.
        load_tokens: prompt + max_tokens of what it holds and was given, tokens.
    """

    key: int
    cached_tokens: int
    load_tokens: float


def load_weight(rule: AffinityRule, slack: float) -> float:
    """The effective load weight for a request with ``slack`` (0..1) of its SLA left."""
    slack = min(1.0, max(0.0, slack))
    return rule.load_weight * (1.0 + (rule.urgent_load_factor - 1.0) * (1.0 - slack))


def overloaded(load: float, least: float, rule: AffinityRule) -> bool:
    """True when ``load`` exceeds the least-loaded ``least`` by both balance margins."""
    return load - least > rule.balance_abs_tokens and load > rule.balance_rel * least


def choose(
    default: Candidate,
    cached: Sequence[Candidate],
    prompt_tokens: int,
    rule: AffinityRule,
    slack: float,
) -> Candidate:
    """The candidate of least cost (module docstring); ``default`` on ties.

    Args:
        default: today's pick (least-utilised worker with room).
        cached: workers of the same model with room holding a prefix (any order).
        prompt_tokens: the request's prompt tokens.
        rule: the affinity settings.
        slack: fraction of the request's SLA left, 0..1.
    """
    if not rule.enabled or not cached:
        return default
    weight = load_weight(rule, slack)
    least = min([default.load_tokens, *(c.load_tokens for c in cached)])

    def cost(c: Candidate) -> float:
        return (prompt_tokens - min(c.cached_tokens, prompt_tokens)) + weight * c.load_tokens

    best, best_cost = default, cost(default)
    for c in sorted(cached, key=lambda c: c.key):
        if overloaded(c.load_tokens, least, rule):
            continue
        c_cost = cost(c)
        if c_cost < best_cost:
            best, best_cost = c, c_cost
    return best
