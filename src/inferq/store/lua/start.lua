-- start: a worker begins a batch; only requests still assigned to it under this attempt run.
-- KEYS[1] worker:<w>
-- ARGV: 1 prefix, 2 worker id, 3 lease_ms, 4 result ttl s, 5 events maxlen, 6 token (a fresh
--       id per start call, '' for none), then pairs: id, attempt
-- Returns one verdict per pair: 'run', 'stale' (re-dispatched elsewhere or final: skip,
-- deliver nothing) or 'expired' (deadline passed before start: expired here, not run).
-- Invariant: a request runs only under the attempt that holds it, on the worker that holds it;
-- a request past its deadline never starts. It starts once per attempt: a second start of
-- it (a batch job delivered twice) is 'stale', but the same call resent by redis-py after
-- its reply was lost (same token, kept as start_token) is 'run' again, or the worker ran
-- nothing and the request sat running on it until its orphan check, a lease later.
-- include: clock, keys, events, release, finalize
local p, w, lease_ms, ttl, maxlen, token =
  ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local now = now_ms()
local out = {}
for i = 7, #ARGV, 2 do
  local id, attempt = ARGV[i], ARGV[i + 1]
  local key = k_req(p, id)
  local r = redis.call('HMGET', key, 'state', 'attempts', 'worker', 'deadline_ms', 'need_mib',
    'dispatched_ms', 'start_token')
  if r[1] == 'running' and r[2] == attempt and r[3] == w and token ~= '' and r[7] == token then
    out[#out + 1] = 'run'  -- this very call, resent
  elseif r[1] ~= 'assigned' or r[2] ~= attempt or r[3] ~= w then
    out[#out + 1] = 'stale'
  elseif tonumber(r[4]) <= now then
    release(p, id, w, r[5], now)
    local u = finalize(p, id, 'expired', now, ttl, maxlen,
      {'error', 'deadline passed before the request started (assigned to ' .. w .. ')'})
    emit(p, maxlen, 'expire', 'id', id, 'reason', 'deadline before start', 'usage', u)
    out[#out + 1] = 'expired'
  else
    redis.call('HSET', key, 'state', 'running', 'started_ms', now, 'start_token', token)
    redis.call('ZADD', p .. 'leases', now + lease_ms, id)
    out[#out + 1] = 'run'
  end
end
return out
