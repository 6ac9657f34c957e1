-- remove_worker: take a worker out of the fleet, handing its requests back to their queues.
-- Used for a worker that left after draining (if_dead '0', penalize '0') and by the reaper
-- for a worker whose heartbeat lapsed (if_dead '1', penalize '1').
-- KEYS[1] worker:<w>   KEYS[2] inflight:<w>   KEYS[3] load:<w>   KEYS[4] drain:<w>
-- ARGV: 1 prefix, 2 worker id, 3 stale_before_ms (if_dead: beats older than this are dead),
--       4 if_dead, 5 penalize, 6 max_attempts, 7 result ttl s, 8 events maxlen, 9 reason, 10 event type
-- Returns {removed (1|0), requeued ids...}; 0 when the worker is alive or already gone.
-- Invariant: every request a removed worker held is requeued (or expired/dead-lettered), so
-- nothing is lost; a worker that is still beating is never reaped. Each lost worker's
-- request counts the crash (field `crashes`); from its second one it is a suspect (field
-- `suspect`): assign.lua runs it alone from then on, so a poison request that crashes its
-- worker again and again is dead-lettered alone, while one random crash costs no isolation.
-- include: clock, keys, events, requeue
local p, w = ARGV[1], ARGV[2]
local beat = redis.call('ZSCORE', p .. 'workers', w)
if ARGV[4] == '1' then
  if not beat then return {0} end  -- already removed (e.g. by another dispatcher)
  if redis.call('EXISTS', KEYS[1]) == 1 and tonumber(beat) >= tonumber(ARGV[3]) then
    return {0}
  end
end
local now = now_ms()
local out = {1}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local verdict = requeue_one(p, id, '', w, ARGV[9], ARGV[5], ARGV[6], ARGV[7], ARGV[8], now)
  if verdict ~= 'stale' then out[#out + 1] = id end
  if verdict == 'queued' and ARGV[5] == '1' then
    if redis.call('HINCRBY', k_req(p, id), 'crashes', 1) >= 2 then
      redis.call('HSET', k_req(p, id), 'suspect', '1')
    end
  end
  redis.call('SREM', KEYS[2], id)
end
local model = redis.call('HGET', KEYS[1], 'model') or ''
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], k_ctl(p, w))
redis.call('ZREM', p .. 'workers', w)
worker_changed(p, w, now)  -- dispatchers drop it from their cached fleet
redis.call('ZREMRANGEBYSCORE', p .. 'wchanged', '-inf', now - CHANGES_KEEP_MS)
emit(p, ARGV[8], ARGV[10], 'worker', w, 'model', model, 'reason', ARGV[9], 'requeued', #out - 1)
return out
