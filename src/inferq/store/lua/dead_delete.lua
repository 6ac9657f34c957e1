-- dead_delete: remove requests from the dead letter, with their records: those dead-lettered
-- longer ago than the retention ('due'), or the given ids ('ids': `inferq dead-letter delete`).
-- ARGV: 1 prefix, 2 events maxlen, 3 mode ('due' | 'ids'), 4 retention ms (mode 'due'),
--       5 limit (mode 'due'), then (mode 'ids') the ids
-- Returns the ids removed.
-- Invariant: the dead letter holds nothing older than the retention (at most `limit` removed
-- per call, the dispatcher calls it every tick); a request leaves it only with its record
-- (hash and payload) and done list, never while it is queued again (dead_requeue removed it from `dead` first).
-- include: clock, keys, events
local p, maxlen, mode = ARGV[1], ARGV[2], ARGV[3]
local ids
if mode == 'due' then
  ids = redis.call('ZRANGEBYSCORE', p .. 'dead', '-inf', now_ms() - tonumber(ARGV[4]),
    'LIMIT', 0, tonumber(ARGV[5]))
else
  ids = {}
  for i = 6, #ARGV do ids[#ids + 1] = ARGV[i] end
end
local out = {}
for _, id in ipairs(ids) do
  if redis.call('ZREM', p .. 'dead', id) == 1 then
    redis.call('DEL', k_req(p, id), k_payload(p, id), k_done(p, id))
    out[#out + 1] = id
  end
end
if #out > 0 then
  stat(p, 'dead_deleted', #out)
  emit(p, maxlen, 'dead_delete', 'n', #out, 'reason', mode == 'due' and 'retention' or 'deleted',
    'ids', table.concat(out, ','))
end
return out
