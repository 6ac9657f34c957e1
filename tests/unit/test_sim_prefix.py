"""The simulator's prefix caches (issue 22): cached prefills are skipped, the servers' LRUs
evict at their KV capacity, the report's hit and pooled figures, and the routings
compared beside ``inferq`` (least-loaded, naive affinity) on a shared-system-prompt trace."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest

from inferq.config import Settings
from inferq.latency import prefill_s
from inferq.prefix import chain_ids
from inferq.sim import SimConfig, SimPolicy, SimRequest, simulate
from inferq.sim.caches import kv_tokens, pooled_cached_tokens
from inferq.sim.policies import ALL_POLICIES
from inferq.sim.report import summarize
from inferq.sim.workload import TraceSource, assemble
from inferq.traces import MOONCAKE_BLOCK_TOKENS

SETTINGS = Settings()
MODEL = "llama-3.1-8b"
SPEC = SETTINGS.model_by_name[MODEL]
BLOCK = MOONCAKE_BLOCK_TOKENS
#: A shared first block outside the trace's chains (a system prompt).
SYSTEM_BLOCK = 0x5157_5354_454D


def static(name: str) -> SimPolicy:
    """A named policy without its scaler: the fleet stays as configured."""
    return dataclasses.replace(ALL_POLICIES[name], scaler=None, peak_fleet=False)


def req(i: int, at: float, blocks: list[int], output: int = 16) -> SimRequest:
    """A realtime request whose prompt is ``blocks`` (block ids) of BLOCK tokens each."""
    return SimRequest(
        id=f"r{i:07d}",
        arrival_s=at,
        priority="realtime",
        tenant="t",
        route=MODEL,
        prompt_tokens=len(blocks) * BLOCK,
        output_tokens=output,
        max_tokens=output,
        prefix=chain_ids(blocks, BLOCK),
        block_tokens=BLOCK,
    )


def run(requests: list[SimRequest], workers: int = 1, policy: str = "inferq", **config: int):
    cfg = SimConfig(settings=SETTINGS, fleet={MODEL: workers}, **config)
    result = simulate(requests, static(policy), cfg)
    return result, {o.request.id: o for o in result.outcomes}


# --- one server's cache ---------------------------------------------------------------


def test_a_repeated_prompt_pays_only_its_uncached_prefill() -> None:
    first = req(0, 0.0, list(range(8)))
    again = req(1, 60.0, list(range(8)))  # the same 4,096 tokens once the first is done
    longer = req(2, 120.0, [*range(8), 100, 101])  # the chat's next turn: two new blocks
    _, out = run([first, again, longer])
    assert out[first.id].cached_tokens == 0
    assert out[again.id].cached_tokens == 8 * BLOCK
    assert out[longer.id].cached_tokens == 8 * BLOCK
    # TTFT falls by exactly the prefill of what was cached (the sim server's rule).
    full = out[first.id].ttft_s
    assert full is not None and out[again.id].ttft_s is not None
    assert out[again.id].ttft_s == pytest.approx(max(0.0, full - prefill_s(SPEC, 8 * BLOCK)))
    assert out[again.id].ttft_s < full


def test_a_different_first_block_shares_nothing() -> None:
    """Block i's hash covers blocks 0..i: the same later blocks behind another first
    block are another prefix."""
    a = req(0, 0.0, [1, 2, 3, 4])
    b = req(1, 60.0, [9, 2, 3, 4])
    _, out = run([a, b])
    assert out[b.id].cached_tokens == 0


def test_the_server_evicts_least_recently_used_blocks_at_its_kv_capacity() -> None:
    cfg = SimConfig(settings=SETTINGS, fleet={MODEL: 1})
    result = simulate([req(0, 0.0, [0])], static("inferq"), cfg)
    capacity = kv_tokens(result.workers[0])
    per = 24  # blocks per prompt; prompts of distinct blocks until past the capacity
    fill = int(capacity // (per * BLOCK)) + 2
    requests = [
        req(i, 30.0 * i, list(range(1000 * (i + 1), 1000 * (i + 1) + per))) for i in range(fill)
    ]
    # The first prompt again: evicted. The last one again: still held.
    requests.append(req(fill, 30.0 * fill, list(range(1000, 1000 + per))))
    requests.append(req(fill + 1, 30.0 * (fill + 1), list(range(1000 * fill, 1000 * fill + per))))
    _, out = run(requests)
    assert out[requests[fill].id].cached_tokens == 0
    assert out[requests[fill + 1].id].cached_tokens == per * BLOCK


def test_the_report_counts_hits_and_the_pooled_reference() -> None:
    """One worker, requests one after another: the fleet is one cache, so its hit rate is
    the pooled LRU's; tokens add up."""
    requests = [req(i, 30.0 * i, [7, 8, *range(10 * i + 100, 10 * i + 103)]) for i in range(6)]
    result, out = run(requests)
    p = summarize(result, SETTINGS.classes, "inferq")["prefix"]
    assert p["requests"] == 6
    assert p["prompt_tokens"] == 6 * 5 * BLOCK
    assert p["hit_tokens"] == 5 * 2 * BLOCK  # the shared two blocks, after the first
    assert p["hit_tokens"] + p["miss_tokens"] == p["prompt_tokens"]
    assert p["hit_rate"] == pytest.approx(1 / 3)
    assert p["pooled_hit_rate"] == pytest.approx(p["hit_rate"])
    assert p["pooled_ratio"] == pytest.approx(1.0)
    assert p["imbalance"] == pytest.approx(1.0)
    assert sum(o.cached_tokens for o in out.values()) == p["hit_tokens"]


def test_pooled_reference_is_one_lru_of_the_given_capacity() -> None:
    a, b, c = (req(i, float(i), list(range(100 * i, 100 * i + 4))) for i in range(3))
    # Room for two prompts: a, b, c, then a again (evicted by c) and c again (held).
    cached = pooled_cached_tokens([a, b, c, a, c], 8 * BLOCK)
    assert cached == [0, 0, 0, 0, 4 * BLOCK]
    assert pooled_cached_tokens([a, a], 1e9) == [0, 4 * BLOCK]


def test_requests_without_a_chain_have_no_prefix_report() -> None:
    plain = dataclasses.replace(req(0, 0.0, [1, 2]), prefix=(), block_tokens=0)
    result, out = run([plain])
    assert out[plain.id].cached_tokens == 0
    assert summarize(result, SETTINGS.classes, "inferq")["prefix"] is None


# --- routing on a fleet -----------------------------------------------------------------


@cache
def mooncake_with_system_prompt() -> tuple[SimRequest, ...]:
    """The bundled Mooncake trace's first 600 requests, at its own rate, behind one shared
    512-token block: the trap of the naive rule."""
    base = assemble([TraceSource.parse("mooncake")], SETTINGS, batch_requests=0)[:600]
    shared = [
        dataclasses.replace(
            r,
            prompt_tokens=r.prompt_tokens + BLOCK,
            prefix=(SYSTEM_BLOCK, *r.prefix),
            block_tokens=BLOCK,
        )
        for r in base
    ]
    return tuple(shared)


@cache
def fleet_report(policy: str) -> dict[str, object]:
    requests = list(mooncake_with_system_prompt())
    result, _ = run(requests, workers=4, policy=policy)
    report = summarize(result, SETTINGS.classes, policy)
    assert report["prefix"] is not None
    return report["prefix"]


def test_inferq_follows_the_caches_without_piling_onto_one_worker() -> None:
    ours, least, naive = (fleet_report(p) for p in ("inferq", "least-loaded", "naive-affinity"))
    # Affinity saves prefill least-loaded routing does not ...
    assert ours["hit_rate"] > 1.5 * least["hit_rate"]
    # ... without the pile-up: every worker gets work, none much more than its share.
    per_worker = ours["prompt_tokens_per_worker"]
    assert len(per_worker) == 4 and min(per_worker.values()) > 0
    assert ours["imbalance"] <= 1.25
    assert ours["hit_rate"] <= ours["pooled_hit_rate"] + 1e-9
    # The trap the rule avoids: longest-prefix-wins sends nearly everything to one worker.
    assert naive["imbalance"] > 2.0
    assert ours["hit_rate"] > naive["hit_rate"]


def test_simulate_compares_the_prefix_baselines_beside_inferq() -> None:
    from click.testing import CliRunner

    from inferq.cli.main import cli

    out = CliRunner().invoke(
        cli,
        [
            "simulate",
            "--trace",
            "mooncake",
            "--duration",
            "120",
            "--fleet",
            f"{MODEL}:2",
            "--policy",
            "inferq",
            "--policy",
            "least-loaded",
            "--policy",
            "naive-affinity",
        ],
    )
    assert out.exit_code == 0, out.output
    for name in ("inferq", "least-loaded", "naive-affinity"):
        assert name in out.output
    assert "Prefix cache" in out.output
