-- held: what a worker's reservation (load:<w>) must hold, recounted from inflight:<w>.
-- include: keys
-- Invariant (assign.lua's and release.lua's): load:<w> holds exactly one slot and need_mib
-- for each id of inflight:<w> still assigned to or running on w, and `isolated` names the
-- suspect among them. A record another type than a hash counts nothing (pcall).

-- slots, mib and the isolated suspect (or nil) of the ids inflight:<w> holds for w.
local function held_load(p, w)
  local slots, mib, isolated = 0, 0, nil
  local held = k_inflight(p, w)
  if redis.call('TYPE', held).ok ~= 'set' then return slots, mib, isolated end
  for _, id in ipairs(redis.call('SMEMBERS', held)) do
    local r = redis.pcall('HMGET', k_req(p, id), 'state', 'worker', 'need_mib', 'suspect')
    if type(r) == 'table' and not r.err and (r[1] == 'assigned' or r[1] == 'running')
        and r[2] == w then
      slots = slots + 1
      mib = mib + (tonumber(r[3]) or 0)
      if r[4] == '1' then isolated = id end
    end
  end
  return slots, mib, isolated
end
