-- fairness: carry a dispatch decision's fairness state forward, and fold idle tenants.
-- ARGV: 1 prefix, 2 idle_ms, 3 prune limit, 4 n classes, then n pairs: class, SWRR credit
--       ('' = unchanged), then triples: class, tenant, virtual-time charge (tokens / weight)
-- Returns the number of idle tenants folded.
-- Invariant: fair:vtc:<class> holds the virtual time of every tenant backlogged in the class
-- or seen within idle_ms, and nobody else (at most `limit` stale entries are folded per
-- call, so the state is bounded by the tenants of the last idle_ms, not by every tenant that
-- ever existed); fair:live:<class> mirrors the backlogged tenants' virtual time (see
-- includes/counts.lua). A folded tenant that returns starts at 0 and is lifted to the
-- lowest backlogged virtual time, as VTC lifts any returning tenant: only debt older than
-- idle_ms is forgotten. fair:new:<class> (includes/counts.lua) loses a newcomer once it is
-- charged, i.e. dispatched.
-- include: clock
local p, idle_ms, limit, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local classes = {}
for i = 5, 4 + 2 * n, 2 do
  classes[#classes + 1] = ARGV[i]
  if ARGV[i + 1] ~= '' then redis.call('HSET', p .. 'fair:classes', ARGV[i], ARGV[i + 1]) end
end
for i = 5 + 2 * n, #ARGV, 3 do
  local class, tenant = ARGV[i], ARGV[i + 1]
  local v = redis.call('ZINCRBY', p .. 'fair:vtc:' .. class, ARGV[i + 2], tenant)
  if redis.call('ZSCORE', p .. 'fair:live:' .. class, tenant) then
    redis.call('ZADD', p .. 'fair:live:' .. class, 'XX', v, tenant)
  end
  redis.call('ZREM', p .. 'fair:new:' .. class, tenant)  -- dispatched: no newcomer now
  redis.call('ZADD', p .. 'fair:seen:' .. class, now, tenant)
end
local folded = 0
for _, class in ipairs(classes) do
  local seen = p .. 'fair:seen:' .. class
  for _, tenant in ipairs(redis.call('ZRANGEBYSCORE', seen, '-inf', now - idle_ms, 'LIMIT', 0, limit)) do
    if redis.call('ZSCORE', p .. 'fair:live:' .. class, tenant) then
      redis.call('ZADD', seen, now, tenant)
    else
      redis.call('ZREM', p .. 'fair:vtc:' .. class, tenant)
      redis.call('ZREM', seen, tenant)
      folded = folded + 1
    end
  end
end
return folded
