-- reap_callers: the live requests of gateways whose liveness lease lapsed (the gateway
-- died: nobody reads their answers), for the dispatcher to cancel.
-- KEYS[1] callers (zset: caller id -> lease expiry ms)
-- ARGV: 1 prefix, 2 limit (lapsed callers read per call)
-- Returns a flat list: a caller id, the number n of its live requests, their n ids; then
-- the next caller. Lapsed callers with none left are forgotten here and not listed.
-- Invariant: caller:<id> holds exactly the non-final requests submitted through gateway
-- <id> (submit.lua adds, includes/finalize.lua removes; an id whose record is final or gone,
-- e.g. quarantined, is dropped here); a lapsed caller stays in callers until its set is
-- empty, so a request whose cancel did not happen yet (a running one waits for its
-- worker to carry out the abort) is listed again on the next call, never lost. The
-- dispatcher's cancels come in later calls and name the caller (includes/orphan.lua): a
-- request a same-key retry took over after this listing is kept, not cancelled.
-- include: clock, keys
local p, limit = ARGV[1], tonumber(ARGV[2])
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms(), 'LIMIT', 0, limit)
local final = {succeeded = true, failed = true, expired = true, cancelled = true}
local out = {}
for _, caller in ipairs(lapsed) do
  local set = k_caller(p, caller)
  local live = {}
  for _, id in ipairs(redis.call('SMEMBERS', set)) do
    -- pcall: a key of another type where the record belongs is a record gone
    local state = redis.pcall('HGET', k_req(p, id), 'state')
    if type(state) == 'string' and not final[state] then
      live[#live + 1] = id
    else
      redis.call('SREM', set, id)
    end
  end
  if #live == 0 then
    redis.call('ZREM', KEYS[1], caller)
  else
    out[#out + 1] = caller
    out[#out + 1] = #live
    for _, id in ipairs(live) do out[#out + 1] = id end
  end
end
return out
