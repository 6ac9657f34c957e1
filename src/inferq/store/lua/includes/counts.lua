-- counts: the queued counters (backpressure and tenant backlog): class and class+tenant.
-- Invariant: c:<class> and t:<class>:<tenant> equal the queued requests they name.

local function count_queued(p, class, tenant, delta)
  redis.call('HINCRBY', p .. 'counts', 'c:' .. class, delta)
  local left = redis.call('HINCRBY', p .. 'counts', 't:' .. class .. ':' .. tenant, delta)
  if left <= 0 then redis.call('HDEL', p .. 'counts', 't:' .. class .. ':' .. tenant) end
end
