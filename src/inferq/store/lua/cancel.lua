-- cancel: cancel a request that has not started.
-- ARGV: 1 prefix, 2 id, 3 result ttl s, 4 events maxlen, 5 the result's error (absent:
--       'cancelled by the caller'; the dispatcher names a lapsed gateway lease),
--       6 the lapsed gateway whose orphan this is (absent: any caller's cancel)
-- Returns the request's state after the call ('cancelled', or the state it was already in:
-- a running request is not interrupted, a final one is unchanged), 'kept' when ARGV[6]
-- names a gateway that no longer holds it (a same-key retry took it over, or the gateway
-- renewed its lease: includes/orphan.lua), or false if unknown.
-- Invariant: only queued and assigned requests become cancelled; the queue counters and
-- the worker's reservation are given back; the waiting client is told; the reaper's
-- cancel (ARGV[6]) acts only on a request its lapsed gateway still holds.
-- include: clock, keys, events, withdraw, finalize, orphan
local p, id, ttl, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local reason = ARGV[5] or 'cancelled by the caller'
local key = k_req(p, id)
local r = redis.call('HMGET', key, 'state', 'priority', 'model', 'tenant', 'worker', 'need_mib')
if not r[1] then return false end
if ARGV[6] and not orphan_of(p, id, ARGV[6], now_ms()) then return 'kept' end
if not withdraw(p, id, r) then return r[1] end
local u = finalize(p, id, 'cancelled', now_ms(), ttl, maxlen, {'error', reason})
emit(p, maxlen, 'cancel', 'id', id, 'usage', u)
return 'cancelled'
