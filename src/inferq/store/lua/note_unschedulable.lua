-- note_unschedulable: record on each queued request why no live worker or scaler pool can
-- serve it, and when a dispatcher last found so (a decision reports it every step).
-- ARGV: 1 prefix, 2 events maxlen, then pairs: id, reason
-- Returns the ids whose reason is new or changed (each gets one 'unschedulable' event).
-- Invariant: only a queued request carries a note (a gone or moved-on one is never
-- recreated or touched); unschedulable_ms is the last time a dispatcher confirmed the
-- note, so expire.lua uses it only while it is fresh.
-- include: clock, keys, events
local p, maxlen = ARGV[1], ARGV[2]
local now = now_ms()
local out = {}
for i = 3, #ARGV, 2 do
  local id, reason = ARGV[i], ARGV[i + 1]
  local key = k_req(p, id)
  local r = redis.call('HMGET', key, 'state', 'unschedulable')
  if r[1] == 'queued' then
    redis.call('HSET', key, 'unschedulable', reason, 'unschedulable_ms', now)
    if r[2] ~= reason then
      emit(p, maxlen, 'unschedulable', 'id', id, 'reason', reason)
      out[#out + 1] = id
    end
  end
end
return out
