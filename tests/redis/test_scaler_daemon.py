"""The scaler daemon on the real Redis with a recording backend; loads and the CLI command."""

from __future__ import annotations

import builtins
import threading

import click
import pytest
import redis
from click.testing import CliRunner

from inferq.cli.main import Context
from inferq.cli.scaler import parse_pool, scaler
from inferq.config import ModelSpec, ScalingPool, ScalingSettings, Settings
from inferq.models import Event, WorkerState
from inferq.policy.scaling import ModelLimits, ScaleDecision, ScalingConfig
from inferq.policy.scaling_inputs import (
    Tracked,
)
from inferq.scaler.daemon import Mode, Scaler, ScalerReport
from inferq.scaler.platforms.base import Platform, WorkerHandle
from inferq.store import Store

from ..builders import inference_request, worker_info
from ..conftest import REDIS_URL
from ..helpers import ready_worker

MODEL = "llama-3.1-8b"


class RecordingPlatform(Platform):
    """Launches nothing real: remembers handles, lists them until stopped."""

    name = "recording"

    def __init__(self) -> None:
        self.running: dict[str, WorkerHandle] = {}
        self.launched: list[str] = []
        self.prepared: list[str] = []
        self.stopped: list[str] = []

    def launch(self, model: str, worker_id: str) -> WorkerHandle:
        handle = WorkerHandle(worker_id, model, f"ref-{worker_id}")
        self.running[worker_id] = handle
        self.launched.append(worker_id)
        return handle

    def prepare_scale_down(self, handle: WorkerHandle) -> None:
        self.prepared.append(handle.worker_id)

    def stop(self, handle: WorkerHandle) -> None:
        self.stopped.append(handle.worker_id)
        self.running.pop(handle.worker_id, None)

    def list(self, model: str | None = None) -> builtins.list[WorkerHandle]:
        return [h for h in self.running.values() if model is None or h.model == model]


def config(**kw: object) -> ScalingConfig:
    args: dict[str, object] = {
        "limits": {MODEL: ModelLimits(1, 4, 0)},
        "up_cooldown_s": 0.0,
        "down_cooldown_s": 0.0,
        "idle_s": 0.0,
        "interval_s": 0.2,
    }
    args.update(kw)
    return ScalingConfig(**args)  # type: ignore[arg-type]


def make(store: Store, platform: Platform | None = None, **kw: object) -> Scaler:
    args: dict[str, object] = {"config": config(), "platform": platform}
    args.update(kw)
    return Scaler(store, **args)  # type: ignore[arg-type]


#: Queued standard requests that need more than one worker: at the default 256
#: output tokens an 8B worker on an H200 serves one in ~1.2 s, 8 at a time, so 200
#: queued (to clear within backlog_drain_s = 10 s or the cold start, the longer) need
#: more than one.
BACKLOG = 200


def backlog_of(store: Store, settings: Settings, n: int) -> None:
    for _ in range(n):
        store.submit(inference_request(settings, priority="standard"))


def scale_events(store: Store) -> list[Event]:
    return [e for e in store.events(count=10_000) if e.type.startswith("scale_")]


# --- the daemon ---------------------------------------------------------------------


def test_min_pool_then_backlog_launch_and_starting_workers_suppress_duplicates(
    store: Store, settings: Settings
) -> None:
    backend = RecordingPlatform()
    s = make(store, backend)
    first = s.step()
    assert first.launched == backend.launched and len(first.launched) == 1  # the minimum pool
    backlog_of(store, settings, BACKLOG)
    second = s.step()
    assert second.decisions[0].action == "up" and len(second.launched) >= 1
    launched = list(backend.launched)
    for _ in range(4):  # none of them has a heartbeat yet: all count as starting
        report = s.step()
        assert report.launched == [] and report.decisions[0].current == len(launched)
    assert backend.launched == launched
    ups = scale_events(store)
    assert [e.fields["to"] for e in ups] == ["1", str(len(launched))]
    assert ups[1].fields["workers"].split(",") == second.launched
    assert "backlog" in ups[1].fields["reason"]
    assert store.desired_workers() == {MODEL: len(launched)}


def test_scale_down_drains_an_idle_worker_and_stops_it_only_once_it_left(
    store: Store,
) -> None:
    backend = RecordingPlatform()
    busy = worker_info("busy").model_copy(update={"in_flight": 2})
    store.heartbeat(busy, ttl_s=30)
    ready_worker(store, "idle")
    for wid in ("busy", "idle"):
        backend.running[wid] = WorkerHandle(wid, MODEL, f"ref-{wid}")
    s = make(store, backend)

    report = s.step()
    assert report.drained == ["idle"]  # never the busy one
    assert store.redis.exists(store.keys.drain("idle")) == 1
    assert backend.stopped == []
    [event] = scale_events(store)
    assert (event.type, event.fields["from"], event.fields["to"]) == ("scale_down", "2", "1")

    report = s.step()  # still registered: draining, not stopped, not drained twice
    assert report.drained == [] and report.stopped == [] and backend.stopped == []
    assert report.decisions[0].current == 1

    store.remove_worker("idle", reason="drained", dead=False)  # it finished and left
    report = s.step()
    assert report.stopped == ["idle"]
    assert backend.prepared == backend.stopped == ["idle"]
    assert "idle" not in store.scaler_hash(store.keys.scaler_workers)


def test_a_worker_unhealthy_past_its_limit_is_drained_and_replaced(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = RecordingPlatform()
    sick = worker_info("sick").model_copy(update={"state": WorkerState.UNHEALTHY})
    store.heartbeat(sick, ttl_s=30)
    backend.running["sick"] = WorkerHandle("sick", MODEL, "ref-sick")
    s = make(store, backend, unhealthy_replace_s=100.0)
    clock = [store.now()]
    monkeypatch.setattr(s.store, "now", lambda: clock[0])
    first = s.step()
    assert first.launched and first.replaced == []  # no capacity: the pool's minimum
    assert store.redis.exists(store.keys.drain("sick")) == 0
    clock[0] += 99.0
    assert s.step().replaced == []
    clock[0] += 2.0
    assert s.step().replaced == ["sick"]
    assert store.redis.exists(store.keys.drain("sick")) == 1
    assert s.step().replaced == []  # asked once


def test_idle_time_is_kept_in_redis_so_another_replica_continues_it(store: Store) -> None:
    ready_worker(store, "w1")
    ready_worker(store, "w2")
    slow = config(idle_s=3600.0)
    platform = RecordingPlatform()
    for wid in ("w1", "w2"):  # both launched by the scaler
        platform.running[wid] = WorkerHandle(wid, MODEL, f"ref-{wid}")
    a = make(store, platform, config=slow, replica_id="a")
    assert a.step().drained == []  # idle for 0 s only
    tracked = store.scaler_hash(store.keys.scaler_workers)
    assert set(tracked) == {"w1", "w2"}
    # Pretend the idle period began an hour ago; replica b takes over and acts on it.
    old = {w: Tracked(MODEL, last_busy_at=1.0, seen_live=True) for w in tracked}
    store.redis.hset(store.keys.scaler_workers, mapping={w: t.to_json() for w, t in old.items()})
    a.close()
    b = make(store, platform, config=slow, replica_id="b")
    assert b.step().drained == ["w1"]  # longest idle first, ties by id


def test_only_the_lease_holder_acts(store: Store) -> None:
    one, two = RecordingPlatform(), RecordingPlatform()
    a = make(store, one, replica_id="a")
    b = make(store, two, replica_id="b")
    assert a.step().acting and one.launched
    for _ in range(3):
        standby = b.step()
        assert not standby.acting and standby.decisions == []
        assert a.step().acting
    assert two.launched == [] and store.redis.get(store.keys.scaler_lease) == "a"
    a.close()  # releases the lease: b takes over at once
    assert b.step().acting and two.launched
    assert not a.step().acting


def test_dry_run_acts_on_nothing_and_writes_nothing(store: Store, settings: Settings) -> None:
    backlog_of(store, settings, BACKLOG)
    seen: list[ScaleDecision] = []
    backend = RecordingPlatform()
    s = make(store, backend, mode=Mode.DRY_RUN, on_decision=seen.append)
    report = s.step()
    s.step()
    assert report.decisions[0].action == "up" and report.decisions[0].desired >= 2
    assert [d.model for d in seen] == [MODEL, MODEL]
    assert backend.launched == [] and report.launched == []
    assert scale_events(store) == []
    for key in ("scaler_lease", "scaler_desired", "scaler_state", "scaler_workers"):
        assert store.redis.exists(getattr(store.keys, key)) == 0, key


def test_metrics_mode_publishes_desired_counts_and_launches_nothing(
    store: Store, settings: Settings
) -> None:
    backlog_of(store, settings, BACKLOG)
    s = make(store, mode=Mode.METRICS)
    assert s.platform is None
    report = s.step()
    assert report.launched == []
    wanted = report.decisions[0].desired
    assert wanted >= 2 and store.desired_workers() == {MODEL: wanted}
    assert store.redis.exists(store.keys.scaler_state) == 1
    assert scale_events(store) == []


def test_metrics_mode_hold_keeps_the_published_count(store: Store) -> None:
    ready_worker(store, "w1")
    slow = config(idle_s=3600.0)
    s = make(store, mode=Mode.METRICS, config=slow)
    assert s.step().decisions[0].action == "hold"
    assert store.desired_workers() == {MODEL: 1}  # nothing published yet: the decision's
    store.redis.hset(store.keys.scaler_desired, MODEL, 3)  # asked for 3, pods still pending
    assert s.step().decisions[0].action == "hold"
    assert store.desired_workers() == {MODEL: 3}


def test_metrics_mode_quarantines_a_corrupt_desired_count(store: Store) -> None:
    store.redis.hset(store.keys.scaler_desired, MODEL, "three")
    report = make(store, mode=Mode.METRICS).step()
    assert store.keys.scaler_desired in store.quarantined()
    assert store.desired_workers() == {MODEL: report.decisions[0].desired}


def test_corrupt_records_are_quarantined_and_the_decision_goes_on(store: Store) -> None:
    k = store.keys
    store.redis.hset(k.scaler_state, MODEL, "{not json")
    store.redis.set(k.scaler_workers, "a string, not a hash")
    store.redis.hset(k.worker("bad"), mapping={"id": "bad", "model": MODEL, "vram_total_mib": "x"})
    store.redis.zadd(k.workers, {"bad": 1})
    backend = RecordingPlatform()
    report = make(store, backend).step()
    assert report.quarantined == 3
    assert set(store.quarantined()) == {k.scaler_state, k.scaler_workers, k.worker("bad")}
    assert report.launched == backend.launched and len(backend.launched) == 1
    assert store.redis.type(k.scaler_state) == "hash"  # written fresh
    assert make(store, backend).step().quarantined == 0  # and readable next time


def test_run_survives_redis_outages_with_backoff(store: Store) -> None:
    s = make(store, RecordingPlatform())
    calls: list[int] = []

    def flaky() -> ScalerReport:
        calls.append(1)
        if len(calls) < 3:
            raise redis.ConnectionError("connection refused")
        s.stop()
        return ScalerReport(acting=True)

    s.step = flaky  # type: ignore[method-assign]
    thread = threading.Thread(target=s.run)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and len(calls) == 3


def test_act_mode_needs_a_backend_and_known_models(store: Store) -> None:
    with pytest.raises(ValueError, match="needs a backend"):
        Scaler(store, config=config())
    with pytest.raises(ValueError, match="not in the registry"):
        make(store, RecordingPlatform(), models=["gpt-9"])


def test_settings_scaling_table_becomes_the_policy_config(namespace: str) -> None:
    scaling = ScalingSettings(
        pools={
            "llama-3.1-70b-awq": ScalingPool(min_workers=0, max_workers=2, gpus_per_worker=4),
            MODEL: ScalingPool(),
        },
        gpu_budget=8,
        idle_s=30,
    )
    settings = Settings.load(redis_url=REDIS_URL, namespace=namespace, scaling=scaling)
    cfg = ScalingConfig.from_settings(settings.scaling)
    assert cfg.model_priority == ("llama-3.1-70b-awq", MODEL)
    assert cfg.limits_for("llama-3.1-70b-awq") == ModelLimits(0, 2, 4)
    assert (cfg.gpu_budget, cfg.idle_s) == (8, 30)
    with pytest.raises(ValueError, match=r"scaling\.pools\['gpt-9'\]"):
        Settings.load(scaling={"pools": {"gpt-9": {}}})
    with pytest.raises(ValueError, match="min_workers"):
        ScalingPool(min_workers=3, max_workers=2)


# --- loads (pure) -------------------------------------------------------------------


def registry() -> list[ModelSpec]:
    return Settings.load().models


# --- the CLI command ----------------------------------------------------------------


@pytest.fixture
def invoke(settings: Settings):  # type: ignore[no-untyped-def]
    @click.group()
    @click.pass_context
    def group(ctx: click.Context) -> None:
        ctx.obj = Context(settings)

    group.add_command(scaler)
    runner = CliRunner()
    return lambda *args: runner.invoke(group, ["scaler", *args])


def test_cli_dry_run_prints_decisions_and_starts_nothing(invoke, store: Store) -> None:  # type: ignore[no-untyped-def]
    out = invoke("--dry-run", "--once", "--pool", f"{MODEL}=2:4", "--vram-mib", "24576")
    assert out.exit_code == 0, out.output
    assert f"{MODEL}: up 0 -> 2" in out.output and "bounds: min 2" in out.output
    assert store.desired_workers() == {} and scale_events(store) == []


def test_cli_metrics_only_writes_desired_counts(invoke, store: Store) -> None:  # type: ignore[no-untyped-def]
    out = invoke("--metrics-only", "--once", "--pool", f"{MODEL}=2:4", "--interval", "1")
    assert out.exit_code == 0, out.output
    assert store.desired_workers() == {MODEL: 2}
    assert store.redis.exists(store.keys.scaler_lease) == 0  # --once gives the lease back


def test_cli_refuses_bad_options(invoke) -> None:  # type: ignore[no-untyped-def]
    out = invoke("--pool", f"{MODEL}=3:1", "--once")
    assert out.exit_code == 2 and "min_workers (3) must be <= max_workers (1)" in out.output
    out = invoke("--pool", "llama", "--once")
    assert out.exit_code == 2 and "is not MODEL=MIN:MAX[:GPUS]" in out.output
    out = invoke("--dry-run", "--metrics-only", "--once")
    assert out.exit_code == 2 and "exclude each other" in out.output
    out = invoke("--backend", "docker", "--once")
    assert out.exit_code != 0 and "needs --docker-image" in out.output
    out = invoke("--pool", "gpt-9=1:2", "--once", "--dry-run")
    assert out.exit_code == 1 and "not in the registry" in out.output
    assert parse_pool(f"{MODEL}=0:2:4") == (
        MODEL,
        ScalingPool(min_workers=0, max_workers=2, gpus_per_worker=4),
    )
