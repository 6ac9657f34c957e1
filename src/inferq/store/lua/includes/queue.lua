-- queue: a queued request's place in its queue, its tenant's sub-queue and the queue's
-- tenant index, kept together.
-- include: keys
-- Invariant: a queued request of (class, route, tenant) is in q:<class>:<route> and in
-- its tenant's sub-queue, both scored by its submit time; tix:<class>:<route> holds
-- exactly the tenants whose sub-queue is not empty, scored by their head's submit time,
-- so a snapshot sees every backlogged tenant without reading the backlog ahead of it.

local function queue_add(p, class, route, tenant, id, score)
  redis.call('ZADD', k_queue(p, class, route), score, id)
  redis.call('ZADD', k_tqueue(p, class, route, tenant), score, id)
  redis.call('ZADD', k_tindex(p, class, route), 'LT', score, tenant)
end

-- Take a request out of its tenant's sub-queue, moving the tenant index to the new head.
local function subqueue_remove(p, class, route, tenant, id)
  local tq = k_tqueue(p, class, route, tenant)
  if redis.call('ZREM', tq, id) == 1 then
    local head = redis.call('ZRANGE', tq, 0, 0, 'WITHSCORES')
    if head[2] then
      redis.call('ZADD', k_tindex(p, class, route), head[2], tenant)
    else
      redis.call('ZREM', k_tindex(p, class, route), tenant)
    end
  end
end

-- Take a request out of its queue and sub-queue; returns true when it was in the queue.
local function queue_remove(p, class, route, tenant, id)
  subqueue_remove(p, class, route, tenant, id)
  return redis.call('ZREM', k_queue(p, class, route), id) == 1
end
