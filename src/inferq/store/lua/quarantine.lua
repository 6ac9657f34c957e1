-- quarantine: move a corrupt record aside and drop its id from the indexes that name it.
-- KEYS[1] the corrupt key (may be absent, e.g. a queue member with no record): a request
--         hash, a tenant's sub-queue (tq:...), a heartbeat, ...
-- KEYS[2] when KEYS[1] is a request hash: its payload key (moved aside with it)
-- ARGV: 1 prefix, 2 reason, 3 events maxlen, then pairs: index key, member to remove
-- Returns 1.
-- Invariant: nothing is deleted: the record is renamed to quarantined:<key> and the reason
-- kept in the quarantine hash, where `inferq` reports it; no daemon meets it again. An id
-- taken out of a tenant's sub-queue moves the tenant index and the depth counter with it
-- (includes/queue.lua). The queued counters of every (class, tenant) it touched (an id
-- taken out of a sub-queue, a sub-queue set aside) are then recounted from what is queued:
-- the tenant's ids in the class's sub-queues plus its delayed retries
-- (includes/counts.lua's invariant; includes/recount.lua), c:<class> and fair:live following by the same
-- difference; the depth of a queue an id left (q:<class>|<route>: an id planted by hand
-- never raised it) or whose sub-queue was set aside is recounted too, and a set-aside tenant
-- index is rebuilt from the sub-queues of the class's backlogged tenants (fair:live), so
-- no queued request is left unindexed. The record cannot say
-- whether it was counted (a string, a list or a deleted key at a submitted request's key
-- was counted; an id planted with no record was not): membership can. A request key that is
-- not a hash names no class or tenant: every queued counter is recounted then (the
-- tenants of every tenant index and every delayed retry: O(backlogged tenants + delayed),
-- on this rare path only).
-- A worker's reservation (load:<w>) set aside is rebuilt from what the worker holds (its
-- inflight:<w> ids still assigned to or running on it: one slot and need_mib each, and
-- `isolated` for a suspect among them) and the worker is marked changed, so a live worker
-- goes on serving and is never promised capacity it does not have.
-- include: clock, keys, events, queue, counts, changed, recount, held
local p, reason = ARGV[1], ARGV[2]

-- counts:q:<class>|<route> set to the ids in the queue's sub-queues.
local function recount_queue(class, route)
  local n, index = 0, k_tindex(p, class, route)
  if redis.call('TYPE', index).ok == 'zset' then
    for _, tenant in ipairs(redis.call('ZRANGE', index, 0, -1)) do
      n = n + recount_zcard(k_tqueue(p, class, route, tenant))
    end
  end
  redis.call('HSET', p .. 'counts', 'q:' .. class .. '|' .. route, n)
end

-- (class, route) of a tenant index key (tix:<class>:<route>; a class holds no ':'), or nil.
local function parse_tindex(key)
  local head = p .. 'tix:'
  if key:sub(1, #head) ~= head then return nil end
  return key:sub(#head + 1):match('^([^:]+):(.+)$')
end

-- A set-aside tenant index rebuilt from the sub-queues of the class's backlogged tenants
-- (fair:live:<class>), so their requests are seen again.
local function rebuild_index(class, route)
  local index = k_tindex(p, class, route)
  for _, tenant in ipairs(redis.call('ZRANGE', p .. 'fair:live:' .. class, 0, -1)) do
    local sub = k_tqueue(p, class, route, tenant)
    if redis.call('TYPE', sub).ok == 'zset' then
      local first = redis.call('ZRANGE', sub, 0, 0, 'WITHSCORES')
      if first[2] then redis.call('ZADD', index, first[2], tenant) end
    end
  end
  recount_queue(class, route)
end

-- The worker id of a reservation key (load:<w>), or nil.
local function parse_load(key)
  local head = p .. 'load:'
  if key:sub(1, #head) ~= head then return nil end
  return key:sub(#head + 1)
end

-- load:<w> rebuilt from inflight:<w> (includes/held.lua).
local function rebuild_load(w)
  local slots, mib, isolated = held_load(p, w)
  if slots > 0 then
    redis.call('HSET', k_load(p, w), 'slots', slots, 'mib', mib)
    if isolated then redis.call('HSET', k_load(p, w), 'isolated', isolated) end
  end
  worker_changed(p, w)
end

-- A request key (it has a payload key, KEYS[2]) that is not a hash: which counters?
local unreadable = KEYS[2] ~= nil and redis.call('TYPE', KEYS[1]).ok ~= 'hash'
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('RENAME', key, p .. 'quarantined:' .. key)
    redis.call('PERSIST', p .. 'quarantined:' .. key)
  end
end
redis.call('HSET', p .. 'quarantine', KEYS[1], reason)
local touched = {}
local q_class, q_route, q_tenant = parse_tqueue(p, KEYS[1])
if q_class then
  redis.call('ZREM', k_tindex(p, q_class, q_route), q_tenant)
  recount_queue(q_class, q_route)
  touched[#touched + 1] = {q_class, q_tenant}
end
local i_class, i_route = parse_tindex(KEYS[1])
if i_class then rebuild_index(i_class, i_route) end
local load_of = parse_load(KEYS[1])
if load_of then rebuild_load(load_of) end
local queues = {}  -- class|route of each queue an id left: its depth is recounted
for i = 4, #ARGV, 2 do
  if redis.call('ZREM', ARGV[i], ARGV[i + 1]) == 1 then
    local class, route, tenant = parse_tqueue(p, ARGV[i])
    if class then
      subqueue_removed(p, class, route, tenant)
      touched[#touched + 1] = {class, tenant}
      queues[class .. '|' .. route] = {class, route}
    end
  end
end
for _, q in pairs(queues) do recount_queue(q[1], q[2]) end
if unreadable then
  recount_queued(p)
else
  for _, ct in ipairs(touched) do recount_queued(p, ct[1], ct[2]) end
end
emit(p, ARGV[3], 'quarantine', 'key', KEYS[1], 'reason', reason)
return 1
