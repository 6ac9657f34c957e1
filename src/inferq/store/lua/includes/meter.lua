-- meter: add a request that was just made final to its usage roll-up. Only finalize
-- calls it, so a request counts once: a duplicate or stale completion, a retry, a second
-- dispatcher are all refused before they reach finalize.
-- Record: hash P usage:<epoch day (UTC)>; field = JSON [epoch hour, tenant, API key id
-- ('' = none: not through the gateway), class, model (the model that served it: the
-- worker's, complete.lua's served_model; the route asked for when no worker completed it,
-- a request cancelled or expired before a result, which has no tokens and no GPU time)];
-- value = 8 integers, space-separated, in the order of inferq.usage.COUNTERS:
--   succeeded failed expired cancelled prompt_tokens cached_tokens completion_tokens gpu_ms
-- gpu_ms: the request's share of its worker's busy time (includes/gpu.lua, complete.lua's
-- gpu_ms field); 0 for a request no worker completed.
-- Cost: HGET + HSET per request; the key's EXPIRE (and a GET of P usage:retention, the
-- retention the dispatcher wrote from settings) only when the field is new, i.e. once per
-- (hour, tenant, key, class, model). A value that does not parse is moved aside (P quarantine,
-- field usage:<day>|<field>) and the count of that field restarts from this request.
-- Invariant: the roll-up of a field is the sum over the requests made final in that hour
-- with those dimensions, for as long as the day key is kept.
-- Returns this request's own usage, JSON [outcome, tenant, key id, class, model, prompt,
-- cached, completion, gpu_ms] (finalize puts it on the final event), '' for a state that
-- is not final.

local USAGE_SLOT = {succeeded = 1, failed = 2, expired = 3, cancelled = 4}
-- defaults.USAGE_RETENTION_DAYS in seconds (tests/unit/test_store_scripts.py checks they agree)
local USAGE_RETENTION_S = 35 * 86400

local function usage_parse(text)
  local v = {}
  for n in string.gmatch(text, '%S+') do
    local x = tonumber(n)
    if x == nil or x < 0 or x ~= math.floor(x) then return nil end
    v[#v + 1] = x
  end
  if #v ~= 8 then return nil end
  return v
end

local function meter(p, state, now, tenant, key, class, model, pt, cached, ct, gpu_ms)
  local slot = USAGE_SLOT[state]
  if not slot then return '' end
  pt, cached, ct = tonumber(pt) or 0, tonumber(cached) or 0, tonumber(ct) or 0
  gpu_ms = math.max(0, math.floor(tonumber(gpu_ms) or 0))
  local day = math.floor(now / 86400000)
  local ukey = p .. 'usage:' .. day
  local field = cjson.encode({math.floor(now / 3600000), tenant or '', key or '',
    class or '', model or ''})
  local old = redis.call('HGET', ukey, field)
  local v = old and usage_parse(old)
  if old and not v then
    redis.call('HSET', p .. 'quarantine', 'usage:' .. day .. '|' .. field,
      'usage roll-up value does not parse: ' .. string.sub(old, 1, 200))
  end
  v = v or {0, 0, 0, 0, 0, 0, 0, 0}
  v[slot] = v[slot] + 1
  v[5] = v[5] + pt
  v[6] = v[6] + cached
  v[7] = v[7] + ct
  v[8] = v[8] + gpu_ms
  local out = {}
  for i = 1, 8 do out[i] = string.format('%d', v[i]) end
  redis.call('HSET', ukey, field, table.concat(out, ' '))
  if not old then
    local keep = tonumber(redis.call('GET', p .. 'usage:retention')) or USAGE_RETENTION_S
    redis.call('EXPIRE', ukey, math.ceil(((day + 1) * 86400000 - now) / 1000) + keep)
  end
  return cjson.encode({state, tenant or '', key or '', class or '', model or '', pt, cached, ct,
    gpu_ms})
end
