"""Connection URLs: Sentinel parsing, TLS options passed through, and TLS + ACL end to end.

The end-to-end test starts its own redis-server with TLS only (a throwaway CA made with
the openssl CLI) and an ACL user limited to the ``inferq:*`` and ``rq:*`` keys, the
``rq:*`` channels and the commands inferq and RQ use, and runs submit -> dispatcher ->
worker subprocess -> result through it.
"""

from __future__ import annotations

import pytest
from redis.asyncio.retry import Retry as AsyncRetry
from redis.connection import SSLConnection
from redis.sentinel import SentinelConnectionPool

from inferq.delivery import rq_connection
from inferq.errors import ConfigError, RedisUnavailable
from inferq.store import connect, connection
from inferq.store.connection import (
    SENTINEL_PORT,
    SentinelSSLConnection,
    connection_kwargs,
    is_sentinel_url,
    open_async_redis,
    open_redis,
    parse_sentinel_url,
    watch_failovers,
)

SECRET = "pa55-w0rd"

# --- URL parsing ---------------------------------------------------------------------


def test_sentinel_url_full_form() -> None:
    url = (
        f"redis+sentinel://app:{SECRET}@s1.example:26380,[::1]:26381,s3/mymaster/2"
        "?sentinel_password=spw&socket_timeout=1.5&ssl_ca_certs=/ca.pem"
    )
    target = parse_sentinel_url(url)
    assert target.sentinels == (("s1.example", 26380), ("::1", 26381), ("s3", SENTINEL_PORT))
    assert (target.service, target.db) == ("mymaster", 2)
    assert (target.username, target.password) == ("app", SECRET)
    assert target.sentinel_auth == {"password": "spw"}
    assert target.options == {"socket_timeout": 1.5, "ssl_ca_certs": "/ca.pem"}
    assert not target.tls and is_sentinel_url(url)


def test_sentinel_url_defaults_and_tls() -> None:
    target = parse_sentinel_url("rediss+sentinel://10.0.0.1/cache?db=3")
    assert target.sentinels == (("10.0.0.1", SENTINEL_PORT),)
    assert (target.service, target.db, target.tls) == ("cache", 3, True)
    assert target.username is None and target.password is None
    assert not is_sentinel_url("redis://h:6379/0")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (f"redis+sentinel://:{SECRET}@h:26379", "/<service name>"),
        (f"redis+sentinel://:{SECRET}@h:26379/a/b/c", "/<service name>"),
        (f"redis+sentinel://:{SECRET}@h:99999/m", "sentinel port '99999'"),
        (f"redis+sentinel://:{SECRET}@h:x1/m", "sentinel port 'x1'"),
        (f"redis+sentinel://:{SECRET}@h1,:26379/m", "has no host"),
        (f"redis+sentinel://:{SECRET}@h/m/zero", "db 'zero'"),
        (f"redis+sentinel://:{SECRET}@h/m?socket_timeout=soon", "option socket_timeout"),
    ],
)
def test_malformed_sentinel_urls_name_the_part_and_hide_the_password(url: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_redis(url)
    assert words in str(info.value) and SECRET not in str(info.value)
    assert str(info.value).startswith("redis_url: ")


@pytest.mark.parametrize(
    "url",
    [
        f"http://user:{SECRET}@host:6379/0",
        f"redis:/user:{SECRET}@host",  # a missing slash: no scheme separator at all
        f"redis://user:{SECRET}@host:port/0",
        "",
    ],
)
def test_unusable_urls_are_a_config_error_without_the_password(url: str) -> None:
    for opener in (open_redis, rq_connection, connect):
        with pytest.raises(ConfigError) as info:
            opener(url)
        assert SECRET not in str(info.value)


def test_tls_options_reach_both_connections() -> None:
    url = f"rediss://u:{SECRET}@127.0.0.1:6390/1?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem"
    for client, decode in ((open_redis(url), True), (rq_connection(url), False)):
        kwargs = client.connection_pool.connection_kwargs
        assert client.connection_pool.connection_class is SSLConnection
        assert kwargs["ssl_ca_certs"] == "/ca.pem" and kwargs["ssl_cert_reqs"] == "required"
        assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("u", SECRET, 1)
        assert kwargs["decode_responses"] is decode
        assert kwargs["retry"]._retries > 0  # the shared retry policy is kept


def test_sentinel_urls_give_sentinel_managed_pools_everywhere() -> None:
    url = f"rediss+sentinel://app:{SECRET}@127.0.0.1:26999/mymaster/4?ssl_ca_certs=/ca.pem"
    for client, decode in ((open_redis(url), True), (rq_connection(url), False)):
        pool = client.connection_pool
        assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "mymaster"
        assert pool.connection_class is SentinelSSLConnection
        kwargs = pool.connection_kwargs
        assert (kwargs["password"], kwargs["db"], kwargs["decode_responses"]) == (SECRET, 4, decode)
        sentinel = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
        assert sentinel["ssl_ca_certs"] == "/ca.pem" and sentinel["password"] is None
    aclient = open_async_redis(url)
    assert aclient.connection_pool.service_name == "mymaster"
    assert isinstance(connection_kwargs(asyncio=True)["retry"], AsyncRetry)


@pytest.fixture
def no_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unreachable servers fail at once (these tests check the report, not the backoff)."""
    monkeypatch.setattr(connection, "RETRIES", 0)


@pytest.mark.usefixtures("no_retries")
def test_no_sentinel_answering_is_redis_unavailable_without_the_password() -> None:
    with pytest.raises(RedisUnavailable) as info:
        connect(f"redis+sentinel://:{SECRET}@127.0.0.1:1,127.0.0.1:2/mymaster")
    assert str(info.value) == (
        "cannot reach Redis at redis+sentinel://:***@127.0.0.1:1,127.0.0.1:2/mymaster: "
        "no sentinel (127.0.0.1:1, 127.0.0.1:2) answered with a primary named 'mymaster'"
    )


def test_the_failover_watch_ends_with_its_pool() -> None:
    class Pool:
        pass

    pool = Pool()
    target = parse_sentinel_url("redis+sentinel://127.0.0.1:1/m")
    thread = watch_failovers(target, pool)
    assert thread.daemon and thread.is_alive()
    del pool
    thread.join(timeout=5)
    assert not thread.is_alive()


# --- TLS + ACL end to end ------------------------------------------------------------
