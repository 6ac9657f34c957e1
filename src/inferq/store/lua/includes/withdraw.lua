-- withdraw: take a request that has not started out of dispatch, before it is made final
-- (expired, cancelled): a queued one leaves its queue, an assigned one gives back its
-- worker's reservation.
-- include: keys, queue, counts, release
-- r = HMGET of the request: state, priority, model (the route), tenant, worker, need_mib.
-- Returns true when it did, false for any other state (running or final: left alone).

local function withdraw(p, id, r)
  if r[1] == 'queued' then
    -- A record without its class, route or tenant (corrupt) names no queue and was
    -- never counted: nothing to take out (and k_tqueue would fail on the nil).
    if r[2] and r[3] and r[4] then queue_remove(p, r[2], r[3], r[4], id) end
    redis.call('ZREM', p .. 'delayed', id)
    if r[2] and r[4] then count_queued(p, r[2], r[4], -1) end
  elseif r[1] == 'assigned' then
    release(p, id, r[5], r[6])
  else
    return false
  end
  return true
end
