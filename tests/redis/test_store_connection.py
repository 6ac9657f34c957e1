"""Connection URLs: Sentinel parsing, TLS options passed through, and TLS + ACL end to end.

The end-to-end test starts its own redis-server with TLS only (a throwaway CA made with
the openssl CLI) and an ACL user limited to the ``inferq:*`` and ``rq:*`` keys, the
``rq:*`` channels and the commands inferq and RQ use, and runs submit -> dispatcher ->
worker subprocess -> result through it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from inferq.client import AsyncClient, Client
from inferq.config import Settings
from inferq.dispatcher.daemon import Dispatcher
from inferq.embedded import free_port
from inferq.errors import RedisUnavailable
from inferq.store import Store, connect, connection
from inferq.store.connection import (
    open_redis,
)

from ..fakes.servers import (
    OPENSSL,
    Server,
    make_tls,
    needs_redis_server,
    sim_worker,
    start_server,
    stop_process,
    wait_ready,
)

SECRET = "pa55-w0rd"

# --- URL parsing ---------------------------------------------------------------------


@pytest.fixture
def no_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unreachable servers fail at once (these tests check the report, not the backoff)."""
    monkeypatch.setattr(connection, "RETRIES", 0)


@needs_redis_server
def test_an_interrupted_read_never_leaves_a_reply_for_the_next_command(tmp_path: Path) -> None:
    """RQ's worker stops by raising from a signal handler while blocked in BLMOVE."""
    primary = start_server(tmp_path, "primary")
    sentinel = start_server(
        tmp_path, "sentinel", [f"sentinel monitor m 127.0.0.1 {primary.port} 1"], sentinel=True
    )
    client = open_redis(f"redis+sentinel://127.0.0.1:{sentinel.port}/m")

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        client.rpush("late", "reply")  # (nothing waits on this list: BLPOP times out)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            client.blpop(["empty"], timeout=1)
        time.sleep(1.2)  # the server has answered the abandoned BLPOP by now
        assert client.ping() is True
        client.set("probe", "value")
        assert client.get("probe") == "value"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sentinel.kill()
        primary.kill()


# --- TLS + ACL end to end ------------------------------------------------------------

#: What the restricted user may run: the commands of inferq's Lua scripts and Store, and
#: RQ's (read off rq's source and INFO commandstats over a full run), nothing else (no
#: KEYS, FLUSH*, CONFIG, DEBUG, MONITOR ...). Commands inside scripts are checked too.
ACL_COMMANDS = [
    *("ping", "hello", "info", "time", "client|setname", "client|getname", "client|list"),
    *("evalsha", "eval", "script|load", "script|exists"),
    *("multi", "exec", "watch", "unwatch", "discard"),
    *("get", "set", "del", "unlink", "exists", "expire", "pexpire", "persist", "rename"),
    *("scan", "type", "ttl"),
    *("hget", "hgetall", "hmget", "hset", "hsetnx", "hdel", "hexists", "hincrby"),
    *("hincrbyfloat", "hlen", "hkeys", "zadd", "zrem", "zrange", "zrangebyscore"),
    *("zremrangebyscore", "zincrby", "zmscore"),
    *("zremrangebyrank", "zcard", "zscore", "sadd", "srem", "smembers", "scard", "sismember"),
    *("lpush", "rpush", "lpop", "rpop", "lrange", "llen", "lrem", "ltrim", "lpos", "lmove"),
    *("blpop", "blmove"),
    *("xadd", "xrange", "xrevrange", "xread", "xlen", "xtrim"),
    *("subscribe", "unsubscribe", "publish"),
]


@pytest.fixture
def tls_acl_server(tmp_path: Path) -> Iterator[tuple[Server, str]]:
    if OPENSSL is None:
        pytest.skip("openssl not on PATH")
    tls = make_tls(tmp_path)
    tls_port = free_port()
    admin = {"ssl": True, "ssl_ca_certs": str(tls.ca), "username": "admin", "password": "adm"}
    server = start_server(
        tmp_path,
        "tls",
        [
            f"tls-cert-file {tls.cert}",
            f"tls-key-file {tls.key}",
            f"tls-ca-cert-file {tls.ca}",
            "tls-auth-clients no",
            "user default off",
            "user admin on >adm ~* &* +@all",
            f"user inferq on >{SECRET} resetkeys ~inferq:* ~rq:* resetchannels &rq:* "
            + " ".join(f"+{c}" for c in ACL_COMMANDS),
        ],
        port=0,
        tls_port=tls_port,
        admin=admin,
    )
    url = f"rediss://inferq:{SECRET}@127.0.0.1:{tls_port}/0?ssl_ca_certs={tls.ca}"
    try:
        yield server, url + "&ssl_cert_reqs=required"
    finally:
        server.kill()


@needs_redis_server
def test_acl_user_over_tls_runs_a_request_end_to_end(tls_acl_server: tuple[Server, str]) -> None:
    server, url = tls_acl_server
    namespace = f"t{uuid.uuid4().hex[:8]}"
    settings = Settings.load(redis_url=url, namespace=namespace, heartbeat_interval_s=0.2)
    admin = server.client()
    restricted = connect(url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        restricted.set("elsewhere", "1")  # the user is confined to inferq:* and rq:*
    with pytest.raises(redis.exceptions.NoPermissionError):
        restricted.execute_command("FLUSHALL")
    assert len(admin.acl_log()) == 2
    admin.acl_log_reset()
    worker = sim_worker(url, namespace, "w1")
    dispatcher = Dispatcher(Store(connect(url), settings), tick_s=0.05)
    thread = threading.Thread(target=dispatcher.run, daemon=True)
    try:
        wait_ready(admin, namespace, "w1", worker)
        thread.start()
        with Client(settings=settings) as client:
            result = client.submit("over TLS", max_tokens=8).result(timeout=30)
        assert result.status == "succeeded", result
        assert asyncio.run(_async_round_trip(settings)) == "succeeded"
    finally:
        dispatcher.stop()
        thread.join(timeout=5)
        output = stop_process(worker)
    assert "NOPERM" not in output and "Traceback" not in output, output
    keys = {k.decode() for k in admin.scan_iter(count=1000)}
    assert keys and all(k.startswith(("inferq:", "rq:")) for k in keys), keys
    assert not admin.acl_log(), admin.acl_log()  # no command was ever refused


async def _async_round_trip(settings: Settings) -> str:
    async with AsyncClient(settings=settings) as client:
        handle = await client.submit("async over TLS", max_tokens=8)
        result = await handle.result(timeout=30)
    return result.status


@needs_redis_server
@pytest.mark.usefixtures("no_retries")
def test_plaintext_and_wrong_password_are_refused(tls_acl_server: tuple[Server, str]) -> None:
    _, url = tls_acl_server
    plain = url.replace("rediss://", "redis://").split("?")[0]
    with pytest.raises(RedisUnavailable) as info:
        connect(plain)
    assert SECRET not in str(info.value)
    with pytest.raises(RedisUnavailable) as info:
        connect(url.replace(SECRET, "guess"))
    assert "guess" not in str(info.value)
