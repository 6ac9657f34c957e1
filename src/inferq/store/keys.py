"""Every Redis key name of inferq, built in one place.

All keys of one deployment share the prefix ``inferq:<namespace>:``, so several
deployments (or tests) share one Redis without touching each other's data.
Lua scripts receive the prefix as ARGV and build per-request keys with the
same templates (spelled once more in ``lua/includes/keys.lua``; a test checks they agree).

Joining parts into a name must never be ambiguous, or one caller could name
another's key (tenant ``acme`` with key ``inv:42`` and tenant ``acme:inv`` with
key ``42`` would both be ``acme:inv:42``). Two rules keep every name unique:
a part a caller chooses freely (a tenant, an idempotency key) is joined with
:func:`join_parts`, which prefixes each part with its length (netstrings, D. J.
Bernstein); a part from configuration (a class or model name, matching
``NAME_PATTERN``: no ``:`` and no ``|``) may be followed by a separator, since
the first separator after it is where it ends.

Layout (P = ``inferq:<namespace>:``):

==============================  ======  =============================================
key                             type    what
==============================  ======  =============================================
P req:<id>                      hash    request record: submission, state, result
P tq:<class>:<n>:<route>:<t>    zset    one tenant's queued ids of queue (class, route), score =
                                        submit time ms (n = route length); the only queue index
P tix:<class>:<route>           zset    tenants with queued ids there, score = their head's ms
P queues                        set     ``<class>|<route>`` of every queue ever used
P deadlines                     zset    queued/assigned ids, score = deadline ms
P leases                        zset    assigned/running ids, score = lease expiry ms
P done:<id>                     list    one token pushed when the request is final
P idem:<n>.<tenant>:<m>.<key>   hash    idempotency key -> ``id``, ``fp`` (request fingerprint)
P stream:<id>                   stream  output chunks of a streamed request, capped; ``end``
P callers                       zset    live gateway (caller) ids, score = lease expiry ms
P caller:<id>                   set     the non-final requests submitted through gateway <id>
P counts                        hash    queued counts: ``c:<class>``, ``t:<class>:<tenant>``,
                                        ``q:<class>|<route>`` (ids in that queue's sub-queues)
P stats                         hash    lifetime counters (submitted, succeeded, ...)
P workers                       zset    live worker ids, score = last heartbeat ms
P wchanged                      zset    worker id -> ms of its last routing change (``changed.lua``)
P worker:<id>                   hash    heartbeat (expires after 3 intervals)
P load:<id>                     hash    reserved ``slots`` and ``mib`` of assigned work
                                        (and ``gpu_acc``/``gpu_t``: its busy time shared, gpu.lua)
P inflight:<id>                 set     request ids assigned to the worker
P drain:<id>                    string  set when the worker was asked to drain (drain.lua)
P ctl:<id>                      list    control commands to the worker (abort), TTL
P fair:classes                  hash    class -> smooth-WRR credit
P fair:vtc:<class>              zset    tenant -> virtual time (VTC counter / weight)
P fair:live:<class>             zset    backlogged tenants -> virtual time (min = VTC lift)
P fair:seen:<class>             zset    tenant -> last backlogged/served ms (idle ones folded)
P fair:new:<class>              zset    newcomers not yet dispatched -> finish tag (VTC lift)
P dead                          zset    dead-lettered ids, score = time ms
P quarantine                    hash    corrupt key -> reason
P quarantined:<key>             any     a corrupt record, renamed aside
P ratelimit...                  string  the gateway's per-tenant rate-limit windows (``limits``)
P apikeys                       hash    an API key's SHA-256 hex -> its JSON entry (gateway)
P events                        stream  capped event log
P prefixlog                     stream  placements of prefix chains (worker, chains), capped:
                                        what every dispatcher's prefix-cache index learns from
P wake                          list    dispatcher wake-up tokens
P usage:<day>                   hash    usage roll-up of epoch day <day> (UTC): field = JSON
                                        ``[hour, tenant, key id, class, model]``, value = 8
                                        counts (``inferq.usage.COUNTERS``); expires
                                        ``usage_retention_days`` after the day (``meter.lua``)
P usage:retention               string  ``usage_retention_days`` in seconds (the dispatcher)
P budget:<name>:<period>        hash    a budget's ``held`` (admitted, not final: estimates) and
                                        ``spent`` (final: metered) in period d<day> | mYYYYMM;
                                        expires 31 days after the period (``budget.lua``)
P estimates                     hash    ``<model>|<task>`` -> moving output-token mean
P estimates:seen                zset    estimates field -> last write ms (bounds the hash)
P dispatcher:beat               string  set (TTL 3 heartbeats) by each dispatcher's housekeeping
P scaler:lease                  string  the acting scaler replica's id
P scaler:desired                hash    model -> desired workers (metrics mode)
P scaler:state                  hash    model -> JSON of its scaling state (trend, cooldowns)
P scaler:workers                hash    worker id -> JSON of the scaler's tracking (idle, drain)
P metrics:lease                 string  the replica that exports the deployment-wide metrics
==============================  ======  =============================================
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "inferq"


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder for one namespace: ``Keys("prod").req("abc")`` -> ``inferq:prod:req:abc``."""

    namespace: str

    @property
    def prefix(self) -> str:
        """The ``inferq:<namespace>:`` prefix every key of this deployment starts with."""
        return f"{ROOT}:{self.namespace}:"

    def pattern(self) -> str:
        """SCAN/KEYS pattern matching every key of this deployment."""
        return self.prefix + "*"

    # requests
    def req(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def tenant_queue(self, priority: str, route: str, tenant: str) -> str:
        """A tenant's sub-queue of the queue (priority, route): its queued ids, score =
        submit time ms. A queue is the union of its tenants' sub-queues (there is no
        class-wide zset: one index entry per queued request). The route is
        length-prefixed (in bytes, as Lua's ``string.len``) since routes and tenants may
        both hold ':'."""
        return f"{self.prefix}tq:{priority}:{len(route.encode())}:{route}:{tenant}"

    def tenant_index(self, priority: str, route: str) -> str:
        """Tenants with queued requests in the queue (priority, route), score = their
        sub-queue head's submit ms (the lowest is the queue's oldest request)."""
        return f"{self.prefix}tix:{priority}:{route}"

    @property
    def queues(self) -> str:
        return f"{self.prefix}queues"

    @property
    def deadlines(self) -> str:
        return f"{self.prefix}deadlines"

    @property
    def leases(self) -> str:
        return f"{self.prefix}leases"

    def payload(self, request_id: str) -> str:
        """The request's payload (prompt or messages, JSON), apart from its hash so the
        hash stays a listpack; it shares the hash's lifetime (``lua/includes/record.lua``)."""
        return f"{self.prefix}payload:{request_id}"

    def request_id_of(self, key: str) -> str | None:
        """The id in a request hash's key (``req:<id>``), or None for any other key."""
        head = f"{self.prefix}req:"
        return key[len(head) :] if key.startswith(head) else None

    def done(self, request_id: str) -> str:
        return f"{self.prefix}done:{request_id}"

    def stream(self, request_id: str) -> str:
        """The output chunks of a streamed request (entries ``a s d n f t``, then ``end``)."""
        return f"{self.prefix}stream:{request_id}"

    @property
    def callers(self) -> str:
        """Zset of gateway processes that submit and relay requests (callers), score =
        when each one's liveness lease lapses, Redis ms (``caller_lease.lua``)."""
        return f"{self.prefix}callers"

    def caller(self, caller_id: str) -> str:
        """The non-final requests submitted through gateway ``caller_id`` (``submit.lua``
        adds, ``includes/finalize.lua`` removes, ``reap_callers.lua`` reads when its
        lease lapsed)."""
        return f"{self.prefix}caller:{caller_id}"

    def idem(self, tenant: str, key: str) -> str:
        """The idempotency key ``key`` of ``tenant`` (both caller-chosen: length-prefixed)."""
        return f"{self.prefix}idem:{join_parts(tenant, key)}"

    @property
    def counts(self) -> str:
        return f"{self.prefix}counts"

    @property
    def stats(self) -> str:
        return f"{self.prefix}stats"

    # workers
    @property
    def workers(self) -> str:
        return f"{self.prefix}workers"

    @property
    def worker_changes(self) -> str:
        """Zset worker id -> Redis ms of the last change a dispatcher's snapshot reads
        (routing fields, reservation, join, removal): ``lua/includes/changed.lua``."""
        return f"{self.prefix}wchanged"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    def load(self, worker_id: str) -> str:
        return f"{self.prefix}load:{worker_id}"

    def inflight(self, worker_id: str) -> str:
        return f"{self.prefix}inflight:{worker_id}"

    def drain(self, worker_id: str) -> str:
        return f"{self.prefix}drain:{worker_id}"

    def ctl(self, worker_id: str) -> str:
        """The worker's control channel: JSON commands (abort a running request)."""
        return f"{self.prefix}ctl:{worker_id}"

    def rq_queue_name(self, worker_id: str) -> str:
        """Name (not key) of the worker's private RQ queue; RQ adds its own prefix."""
        return f"{ROOT}:{self.namespace}:w:{worker_id}"

    # scheduling state
    @property
    def fair_classes(self) -> str:
        return f"{self.prefix}fair:classes"

    def fair_vtc(self, priority: str) -> str:
        return f"{self.prefix}fair:vtc:{priority}"

    def fair_live(self, priority: str) -> str:
        return f"{self.prefix}fair:live:{priority}"

    def fair_seen(self, priority: str) -> str:
        return f"{self.prefix}fair:seen:{priority}"

    def fair_new(self, priority: str) -> str:
        return f"{self.prefix}fair:new:{priority}"

    @property
    def dead(self) -> str:
        return f"{self.prefix}dead"

    @property
    def quarantine(self) -> str:
        return f"{self.prefix}quarantine"

    def quarantined(self, key: str) -> str:
        return f"{self.prefix}quarantined:{key}"

    @property
    def rate_limits(self) -> str:
        """Key prefix of the gateway's rate-limit counters (the ``limits`` library adds
        its own suffix: ``P ratelimit:<limit>/<tenant>``)."""
        return f"{self.prefix}ratelimit"

    @property
    def api_keys(self) -> str:
        """The gateway's API keys stored in Redis: field = the key's SHA-256 hex digest (the
        key itself is never stored), value = its JSON entry (tenant, classes, default class,
        limits, when it was added)."""
        return f"{self.prefix}apikeys"

    @property
    def events(self) -> str:
        return f"{self.prefix}events"

    @property
    def prefix_log(self) -> str:
        """Stream of placements for the prefix-cache index (``assign.lua``): one entry per
        claimed batch with prefix chains, ``w`` (worker) and ``c`` (its requests'
        encoded chains, space-separated); capped (``PREFIX_STREAM_MAXLEN``)."""
        return f"{self.prefix}prefixlog"

    @property
    def wake(self) -> str:
        return f"{self.prefix}wake"

    @property
    def delayed(self) -> str:
        """Zset of retries backing off: member = request id, score = not-before ms (Redis
        TIME); ``promote.lua`` moves each back to its queue when due."""
        return f"{self.prefix}delayed"

    def usage_day(self, day: int) -> str:
        """The usage roll-up of epoch day ``day`` (UTC), written by ``lua/includes/meter.lua``."""
        return f"{self.prefix}usage:{day}"

    @property
    def usage_retention(self) -> str:
        """Seconds a usage roll-up is kept after its day (settings, written by the dispatcher)."""
        return f"{self.prefix}usage:retention"

    def budget(self, name: str, period: str) -> str:
        """Budget ``name``'s counters in ``period`` (``d<epoch day>`` or ``mYYYYMM``, UTC),
        held by ``submit.lua`` and settled by ``lua/includes/finalize.lua``."""
        return f"{self.prefix}budget:{name}:{period}"

    @property
    def estimates(self) -> str:
        return f"{self.prefix}estimates"

    @property
    def estimates_seen(self) -> str:
        return f"{self.prefix}estimates:seen"

    @property
    def dispatcher_beat(self) -> str:
        """A dispatcher ran its housekeeping within the key's TTL (any replica sets it)."""
        return f"{self.prefix}dispatcher:beat"

    @property
    def scaler_lease(self) -> str:
        return f"{self.prefix}scaler:lease"

    @property
    def metrics_lease(self) -> str:
        return f"{self.prefix}metrics:lease"

    @property
    def scaler_desired(self) -> str:
        return f"{self.prefix}scaler:desired"

    @property
    def scaler_state(self) -> str:
        return f"{self.prefix}scaler:state"

    @property
    def scaler_workers(self) -> str:
        return f"{self.prefix}scaler:workers"


def join_parts(*parts: str) -> str:
    """Join caller-chosen parts so that no two different part lists give the same text.

    Each part is written as ``<length>.<text>`` (length in characters) and the parts
    are joined by ``:``: ``join_parts("acme", "inv:42")`` -> ``4.acme:6.inv:42``,
    ``join_parts("acme:inv", "42")`` -> ``8.acme:inv:2.42``. Reading the length first
    tells where each part ends, whatever characters it holds (netstrings, D. J.
    Bernstein, 1997).
    """
    return ":".join(f"{len(part)}.{part}" for part in parts)


def count_field_class(priority: str) -> str:
    """Field of ``P counts`` holding a class's queued count."""
    return f"c:{priority}"


def count_field_queue(priority: str, route: str) -> str:
    """Field of ``P counts`` holding the ids in a queue's sub-queues (its depth; delayed
    retries are not in it)."""
    return f"q:{priority}|{route}"


def count_field_tenant(priority: str, tenant: str) -> str:
    """Field of ``P counts`` holding one tenant's queued count in a class."""
    return f"t:{priority}:{tenant}"
