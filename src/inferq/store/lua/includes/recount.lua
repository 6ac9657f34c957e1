-- recount: the queued counters set again from what is queued (quarantine.lua's repair).
-- include: keys, counts
-- Invariant (includes/counts.lua's): t:<class>:<tenant> = the tenant's ids in the class's
-- sub-queues plus its delayed retries; c:<class> = the sum over the class's tenants. One
-- walk serves both repairs, one (class, tenant) or every counter, so the "had ->
-- count_queued" step is written once (issue 24: it was written twice in quarantine.lua).

local function recount_zcard(key)
  if redis.call('TYPE', key).ok ~= 'zset' then return 0 end
  return redis.call('ZCARD', key)
end

-- The routes of a class's queues (the `queues` set's `class|route` members).
local function recount_routes(p, class)
  local out = {}
  for _, name in ipairs(redis.call('SMEMBERS', p .. 'queues')) do
    local c, route = name:match('^([^|]+)|(.+)$')
    if c == class then out[#out + 1] = route end
  end
  return out
end

-- Set the queued counters to what is queued. With `only_class` and `only_tenant`, that
-- one t:<class>:<tenant> (its sub-queues read by route, so a tenant index set aside does
-- not hide them; c:<class> and fair:live follow by count_queued's difference); without,
-- every t: and c: counter (the tenants of every tenant index and every delayed retry:
-- O(backlogged tenants + delayed)).
local function recount_queued(p, only_class, only_tenant)
  local truth, classes = {}, {}
  local function add(class, tenant, n)
    classes[class] = true
    truth[class] = truth[class] or {}
    truth[class][tenant] = (truth[class][tenant] or 0) + n
  end
  if only_class then
    add(only_class, only_tenant, 0)
    for _, route in ipairs(recount_routes(p, only_class)) do
      add(only_class, only_tenant, recount_zcard(k_tqueue(p, only_class, route, only_tenant)))
    end
  else
    for _, name in ipairs(redis.call('SMEMBERS', p .. 'queues')) do
      local class, route = name:match('^([^|]+)|(.+)$')
      local index = class and k_tindex(p, class, route)
      if index and redis.call('TYPE', index).ok == 'zset' then
        for _, tenant in ipairs(redis.call('ZRANGE', index, 0, -1)) do
          add(class, tenant, recount_zcard(k_tqueue(p, class, route, tenant)))
        end
      end
    end
  end
  if redis.call('TYPE', p .. 'delayed').ok == 'zset' then
    for _, id in ipairs(redis.call('ZRANGE', p .. 'delayed', 0, -1)) do
      local r = redis.pcall('HMGET', k_req(p, id), 'priority', 'tenant')
      if type(r) == 'table' and not r.err and r[1] and r[2]
          and (not only_class or (r[1] == only_class and r[2] == only_tenant)) then
        add(r[1], r[2], 1)
      end
    end
  end
  if not only_class then
    local counts = redis.call('HGETALL', p .. 'counts')
    for i = 1, #counts - 1, 2 do
      local class, tenant = counts[i]:match('^t:([^:]+):(.*)$')
      if class then add(class, tenant, 0) end
      class = counts[i]:match('^c:(.+)$')
      if class then classes[class] = true end
    end
  end
  for class in pairs(classes) do
    local total = 0
    for tenant, n in pairs(truth[class] or {}) do
      local had = tonumber(redis.call('HGET', p .. 'counts', 't:' .. class .. ':' .. tenant)) or 0
      if n ~= had then count_queued(p, class, tenant, n - had, true) end
      total = total + n
    end
    if not only_class then redis.call('HSET', p .. 'counts', 'c:' .. class, total) end
  end
end
