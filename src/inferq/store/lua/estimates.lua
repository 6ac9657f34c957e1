-- estimates: store moving means of generated tokens per (model, task type), bounded.
-- ARGV: 1 prefix, 2 idle_ms, 3 cap, 4 prune limit, then pairs: field (<model>|<task>), mean
-- Returns the number of entries dropped.
-- Invariant: every field of `estimates` written here has an entry in estimates:seen (last
-- write, ms); entries not written for idle_ms, and the least recently written beyond `cap`,
-- are dropped from both, so the hash is bounded by the task types in use, not by every
-- task type ever named (a dropped one falls back to max_tokens until measured again).
-- include: clock
local p, idle_ms, cap, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local est, seen = p .. 'estimates', p .. 'estimates:seen'
for i = 5, #ARGV, 2 do
  redis.call('HSET', est, ARGV[i], ARGV[i + 1])
  redis.call('ZADD', seen, now, ARGV[i])
end
local drop = redis.call('ZRANGEBYSCORE', seen, '-inf', now - idle_ms, 'LIMIT', 0, limit)
local over = redis.call('ZCARD', seen) - #drop - cap
if over > 0 then
  -- (at most as many as this call wrote, so the cost stays that of the write)
  for _, f in ipairs(redis.call('ZRANGE', seen, #drop, #drop + over - 1)) do
    drop[#drop + 1] = f
  end
end
for _, f in ipairs(drop) do
  redis.call('HDEL', est, f)
  redis.call('ZREM', seen, f)
end
return #drop
