-- heartbeat: publish a worker's state, extend the leases of its in-flight requests, and tell
-- it which of the attempts it runs are no longer its own.
-- KEYS[1] worker:<w>   KEYS[2] inflight:<w>   KEYS[3] drain:<w>
-- ARGV: 1 prefix, 2 worker id, 3 ttl_ms, 4 lease_ms, 5 events maxlen, 6 n (held attempts),
--       7 .. 6+2n: (request id, attempt) pairs the worker runs, then field/value pairs
-- Returns {joined (1 if the hash was absent; -1: refused, see below), drain_requested (1|0),
--          now_ms, n_lost,
--          n_lost x (lost id, lost attempt), then (id, attempt, action, reason) of each
--          held attempt with an abort pending}: lost = a held attempt that is no longer
--          assigned to or running on this worker under that attempt number (the worker was
--          declared dead and the request requeued, re-dispatched or finished elsewhere);
--          an abort pending = abort.lua marked the attempt (abort_attempt) and the attempt
--          still runs here: its control-channel command may have been lost (the list
--          expired while the worker stalled, a reply lost to a dropped connection), so
--          every beat delivers it again until the attempt ends.
-- Invariant: a live worker's hash exists and is in the workers index with its last beat;
-- while it beats, none of its requests' leases lapse; a silent worker's hash expires after ttl;
-- a worker running an attempt that is no longer its own learns it on its next beat, and
-- one running an attempt marked for an abort learns that on every beat until it ends; a
-- worker asked to drain is published `draining` whatever state its beat carries; a beat
-- numbered (beat_seq) below the one published by the same worker process (started_ms)
-- publishes nothing but its liveness: it was built first and arrived last. A process's
-- first beat (beat_seq 1) that finds the hash of another process (another started_ms) is
-- refused and writes nothing at all: two processes started under one id at once, each
-- having found no earlier one registered (Engine._replace_earlier_process), and the one
-- that beats second must not share the hash (a resent first beat carries its own
-- started_ms, so it is not refused).
-- A change of a routing field marks the worker in wchanged (includes/changed.lua).
-- include: clock, keys, events, changed
local p, w, ttl, lease_ms, maxlen = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local n = tonumber(ARGV[6])
local now = now_ms()
local joined = 1 - redis.call('EXISTS', KEYS[1])
local fields = {}
local seq, started
for i = 7 + 2 * n, #ARGV - 1, 2 do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
  if ARGV[i] == 'beat_seq' then seq = tonumber(ARGV[i + 1]) end
  if ARGV[i] == 'started_ms' then started = ARGV[i + 1] end
end
if seq and joined == 0 then
  local cur = redis.call('HMGET', KEYS[1], 'started_ms', 'beat_seq')
  if seq == 1 and cur[1] and cur[1] ~= started then return {-1, 0, now, 0} end
  if cur[1] == started and cur[2] and (tonumber(cur[2]) or 0) > seq then fields = {} end
end
-- Asked to drain (drain.lua): the hash says so from the request on, so a beat sent before
-- the worker saw the flag cannot make it routable again for a heartbeat.
local drain = redis.call('EXISTS', KEYS[3])
if drain == 1 then
  if #fields == 0 then fields = {'state', 'draining'} end
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'state' then fields[i + 1] = 'draining' end
  end
end
local changed = #fields > 0 and routing_changes(KEYS[1], fields)
if #fields > 0 then redis.call('HSET', KEYS[1], unpack(fields)) end
if changed then worker_changed(p, w, now) end
redis.call('HSET', KEYS[1], 'last_heartbeat_ms', now)
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZADD', p .. 'workers', now, w)
for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  redis.call('ZADD', p .. 'leases', 'XX', now + lease_ms, id)
end
if joined == 1 then
  local model = redis.call('HGET', KEYS[1], 'model') or ''
  emit(p, maxlen, 'worker_joined', 'worker', w, 'model', model)
end
local out = {joined, drain, now, 0}
local aborts = {}
for i = 7, 6 + 2 * n, 2 do
  local id, attempt = ARGV[i], ARGV[i + 1]
  local r = redis.call('HMGET', k_req(p, id), 'state', 'attempts', 'worker', 'abort_attempt',
    'abort_action', 'abort_reason')
  if (r[1] ~= 'assigned' and r[1] ~= 'running') or r[2] ~= attempt or r[3] ~= w then
    out[#out + 1] = id
    out[#out + 1] = attempt
    out[4] = out[4] + 1
  elseif r[4] == attempt then
    aborts[#aborts + 1] = {id, attempt, r[5] or 'cancel', r[6] or ''}
  end
end
for _, a in ipairs(aborts) do
  for _, v in ipairs(a) do out[#out + 1] = v end
end
return out
