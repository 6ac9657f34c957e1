-- orphan: whether a request still belongs to a gateway whose liveness lease lapsed (the
-- guard of the dispatcher's cancel of a dead gateway's requests).
-- include: keys
-- Invariant: reap_callers.lua lists a lapsed gateway's live requests and the dispatcher
-- cancels them in later calls (cancel.lua, then abort.lua for a running one). Between the
-- two, a same-key retry through another gateway (or a client without one) can take the
-- request over (submit.lua's adopt), and the stalled gateway itself can renew its lease
-- (caller_lease.lua). Whichever of the reaper and the retry comes second sees the other's
-- write: a cancel that finds the request adopted or its caller's lease renewed changes
-- nothing (the retry wins); a retry after the cancel finds the request final (the cancel
-- won, before the retry's reader was tied to it). Nothing is cancelled that a live caller
-- reads, and nothing is both cancelled and kept.

-- True when request `id`'s `caller` field is `caller` and `caller`'s lease in the callers
-- zset has lapsed by `now` (ms) or is gone. A record that is not a hash is no orphan of
-- anyone's (the repair sets it aside).
local function orphan_of(p, id, caller, now)
  local held = redis.pcall('HGET', k_req(p, id), 'caller')
  if type(held) ~= 'string' or held ~= caller then return false end
  local lease = tonumber(redis.call('ZSCORE', p .. 'callers', caller))
  return lease == nil or lease <= now
end
