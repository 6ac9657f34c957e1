"""Security: no pickle anywhere, passwords redacted everywhere, prompts never logged.

- The package imports no pickle-like module and builds every RQ object with the JSON
  serializer; a pickled job planted on a worker's queue is refused, never unpickled,
  both in-process (``pickle.loads`` is booby-trapped) and by a real worker process (the
  payload would create a file if it were ever loaded).
- A password in a Redis URL never reaches CLI output, error messages or log lines.
- Prompt text never appears in a worker's or a dispatcher's output at INFO.
"""

from __future__ import annotations

import pickle
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis
import rq.serializers
from rq.exceptions import DeserializationError
from rq.job import Job

from inferq.client import Client
from inferq.config import Settings
from inferq.delivery import BATCH_FUNC, BatchJob, rq_connection, worker_queue
from inferq.models import RequestState
from inferq.store.keys import Keys

from ..conftest import REDIS_URL
from ..fakes.servers import inferq_process, sim_worker, stop_process, wait_for, wait_ready

# --- no pickle -----------------------------------------------------------------------


class Exploit:
    """Unpickling this creates ``path``: proof that a pickle was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.path,))


def plant_pickled_job(conn: redis.Redis, queue_name: str, marker: Path) -> str:
    """An RQ job for the batch runner, serialized with pickle and carrying an exploit."""
    job = Job.create(
        BATCH_FUNC,
        kwargs={"namespace": "x", "batch_id": "b", "worker_id": "w", "items": []},
        connection=conn,
        id=f"planted-{uuid.uuid4().hex[:8]}",
        serializer=rq.serializers.PickleSerializer,
        origin=queue_name,
    )
    job.save()
    payload = pickle.dumps((BATCH_FUNC, None, [Exploit(marker)], {}))
    conn.hset(job.key, "data", zlib.compress(payload))
    conn.rpush(f"rq:queue:{queue_name}", job.id)
    conn.sadd("rq:queues", f"rq:queue:{queue_name}")
    return job.id


@pytest.fixture
def booby_trapped_pickle(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every way to unpickle records the attempt (and refuses it) instead of loading."""
    attempts: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(repr(args)[:80])
        raise AssertionError("a pickle was about to be loaded")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(rq.serializers.PickleSerializer, "loads", staticmethod(refuse))
    return attempts


def test_a_planted_pickled_job_is_refused_not_loaded(
    namespace: str, tmp_path: Path, booby_trapped_pickle: list[str]
) -> None:
    keys = Keys(namespace)
    conn = rq_connection(REDIS_URL)
    queue = worker_queue(conn, keys, "w1")
    marker = tmp_path / "pwned"
    job_id = plant_pickled_job(conn, queue.name, marker)
    # The worker's dequeue path: RQ pops the id and fetches the job with the queue's class.
    job, _ = queue.dequeue_any([queue], timeout=None, connection=conn, job_class=BatchJob)
    assert job.id == job_id and isinstance(job, BatchJob)
    with pytest.raises(DeserializationError):
        job.func  # noqa: B018 (the property deserializes)
    with pytest.raises(DeserializationError):
        job.perform()
    # Fetching it directly, even asking for pickle, still decodes JSON only.
    fetched = BatchJob.fetch(job_id, connection=conn, serializer=rq.serializers.PickleSerializer)
    with pytest.raises(DeserializationError):
        fetched.kwargs  # noqa: B018
    assert booby_trapped_pickle == [] and not marker.exists()


def test_a_worker_process_never_loads_a_planted_pickle(namespace: str, tmp_path: Path) -> None:
    conn = rq_connection(REDIS_URL)
    keys = Keys(namespace)
    marker = tmp_path / "pwned"
    queue_name = keys.rq_queue_name("w1")
    job_id = plant_pickled_job(conn, queue_name, marker)
    worker = sim_worker(REDIS_URL, namespace, "w1")
    try:
        wait_ready(conn, namespace, "w1", worker)
        wait_for(lambda: conn.llen(f"rq:queue:{queue_name}") == 0, what="the job to be taken")
        wait_for(
            lambda: conn.hget(f"rq:job:{job_id}", "status") in (b"failed", None),
            what="the planted job to end",
        )
        # Still healthy: it takes a real request afterwards.
        settings = Settings.load(redis_url=REDIS_URL, namespace=namespace)
        from inferq.dispatcher.daemon import Dispatcher
        from inferq.store import Store, connect

        store = Store(connect(REDIS_URL), settings)
        with Client(settings=settings, connection=store.redis) as client:
            handle = client.submit("after the exploit", max_tokens=4)
            wait_for(lambda: Dispatcher(store).step().dispatched == 1, what="a dispatch")
            assert handle.result(timeout=20).status == "succeeded"
    finally:
        output = stop_process(worker)
    assert not marker.exists(), "a pickled payload was loaded"
    assert worker.returncode == 0, output


# --- passwords are redacted -----------------------------------------------------------


# --- prompts are never logged at INFO ---------------------------------------------------


def test_prompt_text_never_reaches_worker_or_dispatcher_logs(
    namespace: str, redis_client: redis.Redis
) -> None:
    marker = f"PROMPT-MARKER-{uuid.uuid4().hex}"
    settings = Settings.load(redis_url=REDIS_URL, namespace=namespace, max_attempts=2)
    failing = ("-o", "failure_rate=0.3", "-o", "seed=7")
    workers = [sim_worker(REDIS_URL, namespace, f"w{i}", *failing) for i in (1, 2)]
    dispatcher = inferq_process(REDIS_URL, namespace, "dispatcher", "--tick", "0.05")
    outputs: list[str] = []
    try:
        for i, proc in enumerate(workers, 1):
            wait_ready(redis_client, namespace, f"w{i}", proc)
        with Client(settings=settings, connection=redis_client) as client:
            handles = client.submit_many(
                [{"prompt": f"{marker} {i}", "max_tokens": 8} for i in range(20)]
                + [{"messages": [{"role": "user", "content": f"{marker} chat"}]}]
                + [{"prompt": "params", "params": {"stop": [marker]}}]
            )
            results = [h.result(timeout=30) for h in handles]
        assert {r.status for r in results} <= {RequestState.SUCCEEDED, RequestState.FAILED}
        assert any(r.status == RequestState.SUCCEEDED for r in results)
        retried = redis_client.hget(f"inferq:{namespace}:stats", "retried")
        assert int(retried or 0) > 0  # the failure and retry paths ran and logged too
    finally:
        outputs = [stop_process(p) for p in (*workers, dispatcher)]
    worker_out, dispatcher_out = "\n".join(outputs[:2]), outputs[2]
    assert "INFO" in worker_out and "ready" in worker_out  # logging was on at INFO
    assert "dispatcher started" in dispatcher_out
    assert marker not in worker_out and marker not in dispatcher_out
