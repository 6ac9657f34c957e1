-- caller_lease: renew a gateway's liveness lease (the gateway is the caller of the requests
-- submitted through it: it relays their answers; see reap_callers.lua).
-- KEYS[1] callers (zset: caller id -> lease expiry ms)
-- ARGV: 1 caller id, 2 ttl ms
-- Returns the lease's new expiry, Redis ms.
-- Invariant: callers scores each gateway by when its lease lapses on the one clock (Redis
-- TIME), so a gateway that stops renewing (dead: SIGKILL, OOM, a lost host) is found
-- lapsed by any dispatcher whatever the hosts' clocks say.
-- include: clock
local expiry = now_ms() + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], expiry, ARGV[1])
return expiry
