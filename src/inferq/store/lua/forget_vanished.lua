-- forget_vanished: take off a live worker the requests whose record is gone.
-- KEYS[1] inflight:<w>   KEYS[2] load:<w>
-- ARGV: 1 prefix, 2 worker id, 3 events maxlen, 4.. ids inflight:<w> holds that the worker
--       never received (its orphan check's)
-- Returns the ids forgotten.
-- Invariant: load:<w> holds exactly the slots and MiB of the ids of inflight:<w> still
-- assigned to or running on w (includes/held.lua). A request whose record vanished while it
-- was assigned (deleted by hand, evicted by a Redis whose maxmemory-policy evicts) is never
-- released: release.lua runs only from a script that reads the record, and the worker's
-- beats extend its lease for ever, so its slot and MiB stayed reserved while the worker
-- lived. Such an id (its request key absent, checked here) leaves inflight:<w> and the
-- leases, and load:<w> is recounted from the ids left, gpu_acc brought up to now first
-- (includes/gpu.lua); each gets a `vanished` event. An id whose record exists is left to
-- the orphan check; a load:<w> that is not a hash, to quarantine.lua.
-- include: clock, keys, events, changed, gpu, held
local p, w, maxlen = ARGV[1], ARGV[2], ARGV[3]
local now = now_ms()
local out = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  if redis.call('EXISTS', k_req(p, id)) == 0 and redis.call('SREM', KEYS[1], id) == 1 then
    redis.call('ZREM', p .. 'leases', id)
    emit(p, maxlen, 'vanished', 'id', id, 'worker', w)
    out[#out + 1] = id
  end
end
if #out > 0 and redis.call('TYPE', KEYS[2]).ok == 'hash' then
  local v = redis.call('HMGET', KEYS[2], 'gpu_acc', 'gpu_t', 'slots')
  local at = gpu_acc_at(v[1], v[2], v[3], now)
  local slots, mib, isolated = held_load(p, w)
  redis.call('HSET', KEYS[2], 'slots', slots, 'mib', mib, 'gpu_acc', gpu_fmt(at), 'gpu_t', now)
  if isolated then
    redis.call('HSET', KEYS[2], 'isolated', isolated)
  else
    redis.call('HDEL', KEYS[2], 'isolated')
  end
  worker_changed(p, w, now)
end
return out
