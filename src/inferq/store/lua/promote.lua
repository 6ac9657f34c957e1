-- promote: move delayed requests whose not-before time has come back to their queue.
-- ARGV: 1 prefix, 2 limit
-- Returns {promoted count, ms until the next delayed request is due (-1 when none)}.
-- Invariant: a delayed request (a retry backing off) is `queued` and counted as queued but
-- is in no queue until its not-before time on Redis TIME; then it returns to its queue at
-- its original position (score = submit time), and to its tenant's sub-queue
-- (includes/queue.lua). A request that left `queued` meanwhile
-- (expired, cancelled) only leaves the delayed set. A record whose submit time does not
-- parse goes back to its sub-queue's head (queue_add), where the dispatcher's snapshot
-- quarantines it with its counters (quarantine.lua). A record that is not a hash fails the
-- script before anything of its own is written (it stays in the delayed set), so the
-- dispatcher's repair finds it there and quarantines it (store/repair.py).
-- include: clock, keys, queue, wake
local p, limit = ARGV[1], tonumber(ARGV[2])
local now = now_ms()
local n = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. 'delayed', '-inf', now, 'LIMIT', 0, limit)) do
  local key = k_req(p, id)
  local r = redis.call('HMGET', key, 'state', 'priority', 'model', 'submitted_ms', 'tenant')
  redis.call('ZREM', p .. 'delayed', id)
  if r[1] == 'queued' then
    queue_add(p, r[2], r[3], r[5], id, r[4])
    redis.call('HDEL', key, 'not_before_ms')
    n = n + 1
  end
end
if n > 0 then wake(p) end
local next_due = redis.call('ZRANGE', p .. 'delayed', 0, 0, 'WITHSCORES')
local wait = -1
if next_due[2] then wait = math.max(0, tonumber(next_due[2]) - now) end
return {n, wait}
