-- expire: end requests whose deadline has passed (from the deadlines index), or the given ids.
-- ARGV: 1 prefix, 2 result ttl s, 3 events maxlen, 4 limit, 5 mode ('due' | 'ids' | 'waited'),
--       6 note_fresh_ms, then (mode 'ids') pairs: id, reason; (mode 'waited', a waiting
--       client's expiry) 7 id, 8 route, 9... the models that may serve it
-- Returns a flat list {id, waited_ms, ...} of the requests expired now.
-- Invariant: a queued or assigned request past its deadline is expired and its waiting client
-- told; a running one is left to its worker (which times it out) and leaves the index; the
-- deadlines index holds only non-final requests. A queued request a dispatcher found
-- unschedulable within note_fresh_ms (fields unschedulable, unschedulable_ms, written by
-- note_unschedulable.lua) expires with that reason, whoever expires it. A request that ran
-- and went back (a retry: last_error set by requeue) names its attempts and how the last
-- one ended: a request refused by its server until its deadline (429 for ever) says so.
-- Mode 'waited' names a missing dispatcher only when none beat within its TTL (key
-- dispatcher:beat, set by every dispatcher's housekeeping); with one running it says what
-- kept the request: no ready worker of its models (their states counted), or all busy.
-- include: clock, keys, events, withdraw, finalize
local p, ttl, maxlen, limit, mode = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local fresh_ms = tonumber(ARGV[6])
local now = now_ms()
local out = {}
-- Why a waiting client found its request still queued at its deadline (mode 'waited').
local function waited_reason(route, models)
  if redis.call('EXISTS', p .. 'dispatcher:beat') == 0 then
    return 'deadline passed with no dispatcher'
  end
  local serving = {}
  for _, m in ipairs(models) do serving[m] = true end
  local states, ready, names = {}, 0, {}
  for _, w in ipairs(redis.call('ZRANGE', p .. 'workers', 0, -1)) do
    local f = redis.call('HMGET', k_worker(p, w), 'model', 'state')
    if f[1] and serving[f[1]] and f[2] then
      if f[2] == 'ready' then ready = ready + 1 end
      if not states[f[2]] then names[#names + 1] = f[2] end
      states[f[2]] = (states[f[2]] or 0) + 1
    end
  end
  if ready > 0 then
    return 'deadline passed while queued (' .. ready .. ' ready worker(s) of ' .. route ..
      ' had no room in time)'
  end
  if #names == 0 then return 'deadline passed: no live worker serves ' .. route end
  table.sort(names)
  local parts = {}
  for _, n in ipairs(names) do parts[#parts + 1] = states[n] .. ' ' .. n end
  return 'deadline passed: no ready worker serves ' .. route .. ' (' ..
    table.concat(parts, ', ') .. ')'
end
local function expire_one(id, reason)
  local key = k_req(p, id)
  local r = redis.call('HMGET', key, 'state', 'priority', 'model', 'tenant', 'worker', 'need_mib',
    'submitted_ms', 'unschedulable', 'unschedulable_ms', 'last_error', 'attempts')
  if r[1] == 'queued' and r[8] and now - (tonumber(r[9]) or 0) <= fresh_ms then
    reason = 'deadline passed: ' .. r[8]
  end
  if not withdraw(p, id, r) then
    redis.call('ZREM', p .. 'deadlines', id)
    return
  end
  -- A submit time that does not parse must not fail the script: withdraw already took the
  -- request out of its queue and counters, and a failed script keeps that write, so every
  -- later step would fail here again and count it out once more.
  local waited = now - (tonumber(r[7]) or now)
  local err = reason .. ' (waited ' .. string.format('%.2f', waited / 1000) .. ' s)'
  if r[10] and r[10] ~= '' then
    err = err .. ' after ' .. (r[11] or '?') .. ' attempts; the last ended: ' .. r[10]
  end
  local u = finalize(p, id, 'expired', now, ttl, maxlen, {'error', err})
  emit(p, maxlen, 'expire', 'id', id, 'class', r[2] or '', 'tenant', r[4] or '', 'e2e_ms', waited,
    'reason', reason, 'usage', u)
  out[#out + 1] = id
  out[#out + 1] = waited
end
if mode == 'due' then
  local due = redis.call('ZRANGEBYSCORE', p .. 'deadlines', '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(due) do expire_one(id, 'deadline passed while ' .. (redis.call('HGET', k_req(p, id), 'state') or 'gone')) end
elseif mode == 'waited' then
  expire_one(ARGV[7], waited_reason(ARGV[8], {unpack(ARGV, 9)}))
else
  for i = 7, #ARGV, 2 do expire_one(ARGV[i], ARGV[i + 1]) end
end
return out
