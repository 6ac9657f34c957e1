-- reap_leases: requeue requests whose lease lapsed (their worker stopped extending it).
-- ARGV: 1 prefix, 2 max_attempts, 3 result ttl s, 4 events maxlen, 5 limit
-- Returns a flat list {id, verdict, ...}.
-- Invariant: no assigned or running request stays held by a worker that stopped beating
-- for longer than one lease; the requeue is fenced (see requeue_one in includes/requeue.lua).
-- A request requeued here counts a crash; from its second it is a suspect (run alone from
-- then on, see assign.lua and remove_worker.lua).
-- include: clock, keys, requeue
local p, max_attempts, ttl, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local now = now_ms()
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. 'leases', '-inf', now, 'LIMIT', 0, tonumber(ARGV[5]))) do
  local worker = redis.call('HGET', k_req(p, id), 'worker') or ''
  local verdict = requeue_one(p, id, '', '', 'lease expired on worker ' .. worker, '1',
    max_attempts, ttl, maxlen, now)
  if verdict == 'stale' then redis.call('ZREM', p .. 'leases', id) end
  if verdict == 'queued' and redis.call('HINCRBY', k_req(p, id), 'crashes', 1) >= 2 then
    redis.call('HSET', k_req(p, id), 'suspect', '1')
  end
  out[#out + 1] = id
  out[#out + 1] = verdict
end
return out
