-- queue: a queued request's place in its tenant's sub-queue, the queue's tenant index and
-- the queue's depth counter, kept together. There is no class-wide queue zset: a request
-- is indexed once (its sub-queue), so a queued request costs one zset entry, not two.
-- include: keys
-- Invariant: a queued request of (class, route, tenant) is in its tenant's sub-queue
-- tq:<class>:<n>:<route>:<tenant>, scored by its submit time; tix:<class>:<route> holds
-- exactly the tenants whose sub-queue is not empty, scored by their head's submit time
-- (so its lowest score is the queue's oldest request, and a snapshot sees every
-- backlogged tenant without reading the backlog ahead of it); counts:q:<class>|<route>
-- equals the ids in the queue's sub-queues (a delayed retry is counted by counts:c:
-- but is in no sub-queue until promote.lua puts it back).

-- A score that does not parse (a corrupt submit time) becomes 0, the queue's head: the
-- dispatcher's snapshot reads it there and quarantines it with its counters; a ZADD of it
-- would fail the calling script after its earlier writes (which a failed script keeps).
local function queue_add(p, class, route, tenant, id, score)
  local s = tonumber(score)
  if not s or s ~= s then score = 0 end
  if redis.call('ZADD', k_tqueue(p, class, route, tenant), score, id) == 1 then
    redis.call('HINCRBY', p .. 'counts', 'q:' .. class .. '|' .. route, 1)
  end
  redis.call('ZADD', k_tindex(p, class, route), 'LT', score, tenant)
end

-- Bookkeeping after an id left a tenant's sub-queue (ZREM returned 1): the tenant index
-- moves to the new head, the depth counter goes down.
local function subqueue_removed(p, class, route, tenant)
  local head = redis.call('ZRANGE', k_tqueue(p, class, route, tenant), 0, 0, 'WITHSCORES')
  if head[2] then
    redis.call('ZADD', k_tindex(p, class, route), head[2], tenant)
  else
    redis.call('ZREM', k_tindex(p, class, route), tenant)
  end
  redis.call('HINCRBY', p .. 'counts', 'q:' .. class .. '|' .. route, -1)
end

-- Take a request out of its queue (its tenant's sub-queue); returns true when it was there.
local function queue_remove(p, class, route, tenant, id)
  if redis.call('ZREM', k_tqueue(p, class, route, tenant), id) == 1 then
    subqueue_removed(p, class, route, tenant)
    return true
  end
  return false
end

-- (class, route, tenant) of a sub-queue key (tq:<class>:<len(route)>:<route>:<tenant>),
-- or nil for any other key.
local function parse_tqueue(p, key)
  local head = p .. 'tq:'
  if key:sub(1, #head) ~= head then return nil end
  local class, n, tail = key:sub(#head + 1):match('^([^:]+):(%d+):(.*)$')
  if not class then return nil end
  n = tonumber(n)
  if tail:sub(n + 1, n + 1) ~= ':' then return nil end
  return class, tail:sub(1, n), tail:sub(n + 2)
end
