-- quarantine: move a corrupt record aside and drop its id from the indexes that name it.
-- KEYS[1] the corrupt key (may be absent, e.g. a queue member with no record)
-- KEYS[2] when KEYS[1] is a request hash: its payload key (moved aside with it)
-- ARGV: 1 prefix, 2 reason, 3 events maxlen, then pairs: index key, member to remove
-- Returns 1.
-- Invariant: nothing is deleted: the record is renamed to quarantined:<key> and the reason
-- kept in the quarantine hash, where `inferq` reports it; no daemon meets it again. An id
-- taken out of a tenant's sub-queue moves the tenant index and the depth counter with it
-- (includes/queue.lua), and leaves the class and tenant queued counters and fair:live
-- (includes/counts.lua) as a withdrawn request does: a submitted request is counted there
-- too: only when the record is a hash in state `queued` (an id with no record, or a record
-- without a state, was never submitted, so never counted).
-- include: clock, keys, events, queue, counts
local p, reason = ARGV[1], ARGV[2]
local counted = redis.call('TYPE', KEYS[1]).ok == 'hash'
  and redis.call('HGET', KEYS[1], 'state') == 'queued'
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('RENAME', key, p .. 'quarantined:' .. key)
    redis.call('PERSIST', p .. 'quarantined:' .. key)
  end
end
redis.call('HSET', p .. 'quarantine', KEYS[1], reason)
for i = 4, #ARGV, 2 do
  if redis.call('ZREM', ARGV[i], ARGV[i + 1]) == 1 then
    local class, route, tenant = parse_tqueue(p, ARGV[i])
    if class then
      subqueue_removed(p, class, route, tenant)
      if counted then count_queued(p, class, tenant, -1) end
    end
  end
end
emit(p, ARGV[3], 'quarantine', 'key', KEYS[1], 'reason', reason)
return 1
