"""Redis connections: the URL forms inferq accepts, TLS options, Sentinel, retries.

Every inferq process opens Redis here, through :func:`connect` (text replies) and
:func:`inferq.delivery.rq_connection` (bytes, for RQ), so one URL configures the
client, the dispatcher, the workers and the scaler alike. The error types callers
outside the store catch are named here too (:data:`CONNECTION_ERRORS`,
:data:`REPLY_ERRORS`, :data:`REDIS_ERRORS`), so nothing else imports redis.

URL forms (``INFERQ_REDIS_URL``, ``--redis-url``):

- ``redis://[[user]:password@]host[:port][/db][?option=value&...]``
- ``rediss://...``: TLS. Options are redis-py's, e.g.
  ``?ssl_ca_certs=/etc/inferq/ca.pem&ssl_cert_reqs=required`` (a private CA),
  ``ssl_certfile`` / ``ssl_keyfile`` (a client certificate),
  ``ssl_check_hostname=false``.
- ``unix:///path/to/redis.sock[?db=N]``
- ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?...]``:
  Redis Sentinel. The hosts are sentinels (default port 26379); ``service``
  is the monitored primary's name (``sentinel monitor <service> ...``). The
  user and password authenticate to the primary; ``sentinel_username`` and
  ``sentinel_password`` options authenticate to the sentinels when they
  require it. Every connection asks a sentinel where the primary is (redis-py's
  ``Sentinel.master_for``); a thread per pool follows the sentinels'
  ``+switch-master`` announcements so no client goes on writing to a demoted
  primary (:func:`watch_failovers`; synchronous clients only: an
  :class:`~inferq.client.AsyncClient` moves on its next connection error or
  READONLY reply). ``rediss+sentinel://`` does the same over TLS, to the
  sentinels and the data nodes, with the same ``ssl_*`` options.

Every connection retries a failed command with exponential backoff
(:func:`connection_kwargs`), which is also what carries the daemons across a
failover.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, SSLConnection
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection

from inferq.errors import ConfigError, RedisUnavailable, redact_text, redact_url

#: A synchronous redis-py client (text replies for inferq's own keys).
Connection = redis.Redis
#: An asyncio redis-py client (text replies).
AsyncConnection = aioredis.Redis

#: Errors meaning "Redis is not reachable right now" (retried with backoff by daemons).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
)
#: Errors meaning Redis refused a command: a script failing on a record it cannot read,
#: a key of another type than the command expects.
REPLY_ERRORS: tuple[type[BaseException], ...] = (redis.ResponseError,)
#: Every error a Redis call raises.
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError,)

#: URL schemes :func:`open_redis` accepts (the ``+sentinel`` ones name sentinels).
SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel")
#: Port of a sentinel address given without one (Redis Sentinel's default).
SENTINEL_PORT = 26379
#: Command retries after a connection error, and the backoff between them, seconds:
#: 0.05 doubling to a 2 s cap, ~3 s in all, which covers a Sentinel failover's
#: usual 1-3 s once the primary is marked down; a longer outage surfaces to the
#: daemons' own reconnect loops.
RETRIES = 6
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
#: Socket timeouts of the connections to the sentinels, seconds (unless the URL sets
#: ``socket_timeout`` / ``socket_connect_timeout``): a sentinel answers a discovery
#: query at once, and a silent one should not hold up the next in the list.
SENTINEL_TIMEOUT_S = 2.0
#: Seconds the failover watch waits for a sentinel message before checking that its
#: pool is still in use, and before trying the sentinels again when none answers.
WATCH_POLL_S = 1.0
#: redis-py's socket timeout when neither inferq nor the URL sets one, seconds
#: (``redis.connection.AbstractConnection``'s default).
REDIS_PY_SOCKET_TIMEOUT_S = 5.0
#: Shortest block of a blocking command, seconds (Redis takes decimal timeouts, ms steps).
MIN_BLOCK_S = 0.01


def block_limit_s(client: Any) -> float | None:
    """The longest a blocking command (BLPOP, BLMOVE, XREAD BLOCK) may block on ``client``
    so that its reply comes within the connection's socket timeout: half that timeout
    (the URL's ``socket_timeout``, else redis-py's 5 s), or None when reads never time out.

    A block longer than the socket timeout makes redis-py raise TimeoutError before Redis
    answers (issue 13, fault 6: ``inferq dispatcher --tick 8`` waited in 8 s BLPOPs on a
    5 s socket and spent its time in error backoff); callers wait in chunks of this.
    """
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    timeout = kwargs.get("socket_timeout", REDIS_PY_SOCKET_TIMEOUT_S)
    if timeout is None and "socket_timeout" in kwargs:
        return None  # set to None explicitly: no read timeout
    return max(MIN_BLOCK_S, float(timeout or REDIS_PY_SOCKET_TIMEOUT_S) / 2)


#: Seconds between PINGs on an idle pooled connection before reusing it.
HEALTH_CHECK_INTERVAL_S = 15
#: redis-py's Sentinel managers (untyped in redis-py, so held as Any).
_SENTINEL: Any = Sentinel
_ASYNC_SENTINEL: Any = AsyncSentinel
#: Query options that go to the sentinels rather than the data nodes.
_SENTINEL_AUTH = ("sentinel_username", "sentinel_password")
#: Query options shared by the sentinel connections (sockets and TLS).
_SHARED_PREFIXES = ("socket_", "ssl_")


class SentinelConnection(SentinelManagedConnection):
    """redis-py's sentinel-managed connection, closed when a reply read is interrupted.

    redis-py's sync ``SentinelManagedConnection.read_response`` defaults
    ``disconnect_on_error`` to False, unlike every other connection class: a read
    interrupted by an exception (RQ's worker raises ``StopRequested`` from a
    signal handler while blocked in BLMOVE) returns the connection to the pool
    with a reply still unread, and the next command gets the previous one's reply
    (measured: RQ's ``register_death`` pipeline failed with "Wrong number of
    response items"). redis/redis-py#4292 proposes the same default upstream.
    """

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("disconnect_on_error", True)
        return super().read_response(*args, **kwargs)


class SentinelSSLConnection(SentinelConnection, SSLConnection):
    """:class:`SentinelConnection` over TLS."""


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL.

    Attributes:
        sentinels: (host, port) of each sentinel, in the URL's order.
        service: the primary's name as the sentinels monitor it.
        db: database number on the primary.
        username / password: credentials of the primary (None = none).
        tls: true for ``rediss+sentinel://`` (TLS to sentinels and data nodes).
        options: redis-py connection options from the query, typed.
        sentinel_auth: ``username`` / ``password`` for the sentinels themselves.
    """

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    sentinel_auth: dict[str, str] = field(default_factory=dict)


def connection_kwargs(*, asyncio: bool = False) -> dict[str, Any]:
    """Options every inferq connection uses: text replies, retries with backoff, health checks.

    Args:
        asyncio: build the retry policy for ``redis.asyncio`` clients.
    """
    backoff = ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S)
    retry: Retry | AsyncRetry = (
        AsyncRetry(backoff, retries=RETRIES) if asyncio else Retry(backoff, retries=RETRIES)
    )
    return {
        "decode_responses": True,
        "retry": retry,
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "socket_keepalive": True,
    }


def scheme_of(url: str) -> str:
    """The URL's scheme, lower-case.

    Raises:
        ConfigError: not a string, or a scheme inferq does not accept (password redacted).
    """
    if not isinstance(url, str):
        raise ConfigError(f"redis_url: must be a string, got {type(url).__name__}")
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        accepted = ", ".join(f"{s}://" for s in SCHEMES)
        raise ConfigError(f"redis_url: {redact_url(url)!r} must start with one of {accepted}")
    return scheme


def is_sentinel_url(url: str) -> bool:
    """True for ``redis+sentinel://`` and ``rediss+sentinel://`` URLs."""
    return isinstance(url, str) and url.lower().split("://", 1)[0].endswith("+sentinel")


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``redis+sentinel://[user:pass@]host[:port][,host[:port]...]/service[/db][?opts]``.

    Raises:
        ConfigError: a malformed URL; the message names the part and redacts the password.
    """
    scheme = scheme_of(url)
    if not scheme.endswith("+sentinel"):
        raise ConfigError(f"redis_url: {redact_url(url)!r} is not a redis+sentinel:// URL")
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    service, db = _service_and_db(url, parts.path)
    options, sentinel_auth = _query_options(url, parts.query)
    query_db = options.pop("db", 0)
    return SentinelURL(
        sentinels=tuple(_host_port(url, item) for item in hostlist.split(",")),
        service=service,
        db=query_db if db is None else db,
        username=unquote(username) or None,
        password=unquote(password) or None,
        tls=scheme.startswith("rediss"),
        options=options,
        sentinel_auth=sentinel_auth,
    )


def open_redis(url: str, *, decode_responses: bool = True) -> redis.Redis:
    """A redis-py client for any URL form above (no round trip is made).

    Args:
        url: the Redis URL.
        decode_responses: text replies (inferq) or bytes (RQ).

    Raises:
        ConfigError: the URL is malformed (the message redacts the password).
    """
    kwargs = connection_kwargs()
    kwargs["decode_responses"] = decode_responses
    if scheme_of(url).endswith("+sentinel"):
        target = parse_sentinel_url(url)
        sentinel: Any = _SENTINEL(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target))
        kwargs["connection_class"] = SentinelSSLConnection if target.tls else SentinelConnection
        client: redis.Redis = sentinel.master_for(target.service, **_primary_kwargs(target, kwargs))
        watch_failovers(target, client.connection_pool)
        return client
    try:
        return redis.Redis.from_url(url, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"redis_url: {redact_url(url)!r}: {exc}") from None


def open_async_redis(url: str) -> aioredis.Redis:
    """The ``redis.asyncio`` twin of :func:`open_redis` (text replies).

    Raises:
        ConfigError: the URL is malformed (the message redacts the password).
    """
    kwargs = connection_kwargs(asyncio=True)
    if scheme_of(url).endswith("+sentinel"):
        target = parse_sentinel_url(url)
        sentinel: Any = _ASYNC_SENTINEL(
            list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, asyncio=True)
        )
        primary = _primary_kwargs(target, kwargs)
        if target.tls:
            primary["ssl"] = True  # the pool picks the TLS flavour of its managed connection
        client: aioredis.Redis = sentinel.master_for(target.service, **primary)
        return client
    try:
        return aioredis.Redis.from_url(url, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"redis_url: {redact_url(url)!r}: {exc}") from None


def watch_failovers(target: SentinelURL, pool: Any) -> threading.Thread:
    """Re-point ``pool`` at the new primary the moment a sentinel announces a failover.

    redis-py's sentinel-managed pool asks for the primary only when a connection
    breaks or hears READONLY; after a forced failover (``SENTINEL FAILOVER``, or a
    partition) the old primary keeps accepting writes until the sentinels demote
    it, up to their 10 s INFO period, and discards them when it resyncs. A daemon
    thread subscribes to ``+switch-master`` on the sentinels (ioredis'
    ``failoverDetector`` does the same) and asks the pool for the primary's
    address, which closes the idle connections to the old one; busy ones are
    dropped when released. The thread ends when the pool is garbage-collected.

    Returns:
        The (started, daemon) watch thread.
    """
    pool_ref = weakref.ref(pool)
    thread = threading.Thread(
        target=_watch,
        args=(target, pool_ref, _sentinel_kwargs(target)),
        name=f"inferq-sentinel-watch-{target.service}",
        daemon=True,
    )
    thread.start()
    return thread


def _watch(target: SentinelURL, pool_ref: weakref.ref[Any], kwargs: dict[str, Any]) -> None:
    while pool_ref() is not None:
        for host, port in target.sentinels:
            try:
                _follow(host, port, target.service, pool_ref, kwargs)
            except (redis.RedisError, OSError):
                continue  # that sentinel is gone: listen to the next one
        time.sleep(WATCH_POLL_S)


def _follow(
    host: str, port: int, service: str, pool_ref: weakref.ref[Any], kwargs: dict[str, Any]
) -> None:
    """Listen to one sentinel until it fails or the pool is gone."""
    sentinel: Any = redis.Redis(host=host, port=port, **kwargs)
    pubsub = sentinel.pubsub(ignore_subscribe_messages=True)
    try:
        pubsub.subscribe("+switch-master")
        while pool_ref() is not None:
            message = pubsub.get_message(timeout=WATCH_POLL_S)
            if message is None:
                continue
            data = message["data"]
            words = (data.decode() if isinstance(data, bytes) else str(data)).split()
            pool = pool_ref()
            if pool is not None and words[:1] == [service]:
                pool.get_master_address()  # re-discovers; closes idle connections to the old one
    finally:
        pubsub.close()
        sentinel.close()


def explain(url: str, exc: BaseException) -> BaseException:
    """A one-line cause for an error report (the others are returned unchanged).

    redis-py's ``MasterNotFoundError`` text holds the repr of every sentinel
    client; it is summarised as the sentinels asked and the service name.
    """
    if isinstance(exc, MasterNotFoundError) and is_sentinel_url(url):
        target = parse_sentinel_url(url)
        hosts = ", ".join(f"{host}:{port}" for host, port in target.sentinels)
        return MasterNotFoundError(
            f"no sentinel ({hosts}) answered with a primary named {target.service!r}"
        )
    return exc


def _primary_kwargs(target: SentinelURL, base: dict[str, Any]) -> dict[str, Any]:
    kwargs = {**base, **target.options, "db": target.db}
    if target.username:
        kwargs["username"] = target.username
    if target.password:
        kwargs["password"] = target.password
    return kwargs


def _sentinel_kwargs(target: SentinelURL, *, asyncio: bool = False) -> dict[str, Any]:
    """Options of the connections to the sentinels.

    One attempt per sentinel and per discovery, no retry of their own: discovery
    already moves on to the next sentinel, and the data connection's retries
    repeat the discovery (redis-py's default would back off for seconds per sentinel).
    """
    shared = {k: v for k, v in target.options.items() if k.startswith(_SHARED_PREFIXES)}
    shared.setdefault("socket_timeout", SENTINEL_TIMEOUT_S)
    shared.setdefault("socket_connect_timeout", SENTINEL_TIMEOUT_S)
    shared["retry"] = AsyncRetry(NoBackoff(), 0) if asyncio else Retry(NoBackoff(), 0)
    if target.tls:
        shared["ssl"] = True
    return {**shared, **target.sentinel_auth}


def _service_and_db(url: str, path: str) -> tuple[str, int | None]:
    segments = [unquote(s) for s in path.split("/") if s]
    if not segments or len(segments) > 2:
        raise ConfigError(
            f"redis_url: {redact_url(url)!r} must end in /<service name>[/<db>] "
            "(the primary's name in `sentinel monitor`)"
        )
    if len(segments) == 1:
        return segments[0], None
    if not segments[1].isascii() or not segments[1].isdigit():
        raise ConfigError(f"redis_url: db {segments[1]!r} in {redact_url(url)!r} is not a number")
    return segments[0], int(segments[1])


def _host_port(url: str, item: str) -> tuple[str, int]:
    host, port = item, ""
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    elif ":" in item:
        host, _, port = item.rpartition(":")
    if not host:
        raise ConfigError(f"redis_url: a sentinel address in {redact_url(url)!r} has no host")
    if not port:
        return unquote(host), SENTINEL_PORT
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"redis_url: sentinel port {port!r} in {redact_url(url)!r} is invalid")
    return unquote(host), int(port)


def _query_options(url: str, query: str) -> tuple[dict[str, Any], dict[str, str]]:
    options: dict[str, Any] = {}
    auth: dict[str, str] = {}
    for name, values in parse_qs(query).items():
        value = values[0]
        if name in _SENTINEL_AUTH:
            auth[name.removeprefix("sentinel_")] = value
            continue
        parser: Any = URL_QUERY_ARGUMENT_PARSERS.get(name)
        try:
            options[name] = parser(value) if parser else value
        except (TypeError, ValueError):
            raise ConfigError(
                f"redis_url: option {name}={value!r} in {redact_url(url)!r} is invalid"
            ) from None
    return options, auth


def connect(url: str, *, check: bool = True) -> redis.Redis:
    """Open a connection pool to ``url`` (text replies).

    Any URL form of this module: ``redis://``, ``rediss://`` (TLS options in the query),
    ``unix://``, ``redis+sentinel://`` (the primary a sentinel names, followed across
    failovers).

    Raises:
        ConfigError: the URL is malformed (password redacted).
        RedisUnavailable: ``check`` is true and the server does not answer PING
            (the message carries the URL with its password redacted).
    """
    client = open_redis(url)
    if check:
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            client.close()
            raise RedisUnavailable(url, explain(url, exc)) from None
    return client


def describe_error(url: str, exc: BaseException) -> str:
    """One line for a Redis error met talking to ``url`` (passwords redacted): a lost or
    refused connection says the server cannot be reached, anything else what Redis said."""
    if isinstance(exc, redis.ConnectionError):
        return str(RedisUnavailable(url, exc))
    return f"redis: {redact_text(str(exc))}"
