-- submit: accept one validated request, or refuse it, in one round trip.
-- KEYS[1] req:<id>   KEYS[2] tq:<class>:<n>:<route>:<tenant> (its sub-queue)   KEYS[3] idem:<n>.<tenant>:<m>.<key>
-- (absent = none: never an empty key name, which an ACL user confined to inferq:* may not name)
-- ARGV: 1 prefix, 2 id, 3 class, 4 route, 5 tenant, 6 class_limit, 7 tenant_limit,
--       8 timeout_ms, 9 deadline_ms ('' = now + timeout), 10 idem_ttl_s, 11 events maxlen,
--       12 fingerprint of the request's fields ('' without a key),
--       13.. field/value pairs of the submission (the payload goes to payload:<id>)
--       (a ``budgets`` field is not written as given: its entries
--       'name,day|month,tokens|usd,limit,soft limit ('' none),estimate,prompt rate,
--       completion rate,gpu ms rate' are checked and held, see includes/budget.lua, and the hash keeps
--       'budget key,estimate,rates...' for finalize to settle; a ``fair_size`` field, the
--       request's VTC charge at max_tokens, is not written either: it sizes a newcomer's
--       finish tag, see includes/counts.lua)
-- Returns {'ok', id, submitted_ms, deadline_ms} | {'dup', existing_id}
--       | {'conflict', existing_id} | {'full', 'class'|'tenant', limit}
--       | {'budget', name, limit, resets_ms, used, period, unit}
-- Invariant: a request is in exactly one queue (its tenant's sub-queue, see
-- includes/queue.lua) iff its state is 'queued' and it is not a delayed retry; counts:c:<class>
-- and counts:t:<class>:<tenant> equal the queued requests they name; an idempotency key
-- maps to at most one request, of its own tenant, with the same fingerprint, and only
-- while that request's record exists (a key whose record expired is re-pointed); a
-- refused submission writes nothing; a request with a ``caller`` field (a gateway's id) is in
-- that caller's set caller:<id> until it is final (includes/finalize.lua), and its caller is
-- the latest submitter of its idempotency key: a retry through another gateway (the first
-- one died) or from a client without one takes it over, so the first gateway's lapsed lease
-- does not cancel the request the retry is reading (see reap_callers.lua).
-- include: clock, keys, record, queue, counts, events, wake, budget
local p, id, class, route, tenant = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local idem, fp = KEYS[3], ARGV[12]
local caller = false
local budgets = false
local fair_size = 0
for i = 13, #ARGV, 2 do
  if ARGV[i] == 'caller' then caller = ARGV[i + 1] end
  if ARGV[i] == 'budgets' then budgets = ARGV[i + 1] end
  if ARGV[i] == 'fair_size' then fair_size = tonumber(ARGV[i + 1]) end
end

-- The duplicate's caller becomes `caller` (none: tied to no process) unless it is final.
local function adopt(existing)
  local key = k_req(p, existing)
  -- pcall: a key of another type where the record belongs is left to the repair
  local seen = redis.pcall('HMGET', key, 'state', 'caller')
  if type(seen) ~= 'table' or seen.err then return end
  local state, old = seen[1], seen[2]
  local final = {succeeded = true, failed = true, expired = true, cancelled = true}
  if not state or final[state] or old == caller then return end
  if old then redis.call('SREM', k_caller(p, old), existing) end
  if caller then
    redis.call('HSET', key, 'caller', caller)
    redis.call('SADD', k_caller(p, caller), existing)
  else
    redis.call('HDEL', key, 'caller')
  end
end

if idem then
  -- pcall: a value of another type (a string of the old layout) is a stale pointer.
  local held = redis.pcall('HMGET', idem, 'id', 'fp')
  local existing = type(held) == 'table' and not held.err and held[1]
  if existing and redis.call('EXISTS', k_req(p, existing)) == 1 then
    if held[2] ~= fp then return {'conflict', existing} end
    adopt(existing)
    return {'dup', existing}
  end
end
local class_n = tonumber(redis.call('HGET', p .. 'counts', 'c:' .. class) or '0')
if class_n >= tonumber(ARGV[6]) then return {'full', 'class', ARGV[6]} end
local tenant_n = tonumber(redis.call('HGET', p .. 'counts', 't:' .. class .. ':' .. tenant) or '0')
if tenant_n >= tonumber(ARGV[7]) then return {'full', 'tenant', ARGV[7]} end
-- The same id again is this submission resent after a lost reply (ids are 104 random
-- and clock bits): report it as already written instead of failing a stored request.
if redis.call('EXISTS', KEYS[1]) == 1 then return {'dup', id} end

local now = now_ms()
-- Every budget is checked before anything is written: a refusal writes nothing.
local holds, kept = {}, {}
if budgets then
  for entry in string.gmatch(budgets, '%S+') do
    local name, period, unit, limit, soft, est, pr, cr, gr = string.match(entry,
      '^([^,]+),([^,]+),([^,]+),([^,]+),([^,]*),([^,]+),([^,]+),([^,]+),([^,]+)$')
    if name then
      local pid, resets = budget_period(period, now)
      local bkey = p .. 'budget:' .. name .. ':' .. pid
      local cur = redis.call('HMGET', bkey, 'spent', 'held')
      local used = (tonumber(cur[1]) or 0) + (tonumber(cur[2]) or 0)
      if used + tonumber(est) > tonumber(limit) then
        return {'budget', name, limit, tostring(resets), tostring(used), period, unit}
      end
      holds[#holds + 1] = {bkey, est, resets, tonumber(soft), used, name, limit}
      kept[#kept + 1] = table.concat({bkey, est, pr, cr, gr}, ',')
    end
  end
end
for _, h in ipairs(holds) do
  redis.call('HINCRBYFLOAT', h[1], 'held', h[2])
  -- kept a month past its period: long enough for any request admitted in it to settle
  redis.call('PEXPIREAT', h[1], h[3] + 31 * 86400000)
  if h[4] and h[5] <= h[4] and h[5] + tonumber(h[2]) > h[4] then
    emit(p, ARGV[11], 'budget_soft', 'budget', h[6], 'tenant', tenant, 'limit', h[7],
      'soft', h[4], 'used', h[5] + tonumber(h[2]))
  end
end
local deadline = tonumber(ARGV[9]) or (now + tonumber(ARGV[8]))
local fields = {}
for i = 13, #ARGV, 2 do
  if ARGV[i] == 'payload' then
    redis.call('SET', k_payload(p, id), ARGV[i + 1])
  elseif ARGV[i] == 'fair_size' then  -- a newcomer's VTC finish tag (includes/counts.lua)
  elseif ARGV[i] == 'budgets' then
    if #kept > 0 then
      fields[#fields + 1] = 'budgets'
      fields[#fields + 1] = table.concat(kept, ' ')
    end
  else
    fields[#fields + 1] = ARGV[i]
    fields[#fields + 1] = ARGV[i + 1]
  end
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('HSET', KEYS[1], 'state', 'queued', 'submitted_ms', now, 'deadline_ms', deadline,
  'attempts', 0)
queue_add(p, class, route, tenant, id, now)
if caller then redis.call('SADD', k_caller(p, caller), id) end
redis.call('SADD', p .. 'queues', class .. '|' .. route)
redis.call('ZADD', p .. 'deadlines', deadline, id)
count_queued(p, class, tenant, 1, false, fair_size)
if idem then
  redis.call('DEL', idem)
  redis.call('HSET', idem, 'id', id, 'fp', fp)
  redis.call('EXPIRE', idem, ARGV[10])
end
stat(p, 'submitted')
emit(p, ARGV[11], 'submit', 'id', id, 'class', class, 'route', route, 'tenant', tenant)
wake(p)
return {'ok', id, tostring(now), tostring(deadline)}
