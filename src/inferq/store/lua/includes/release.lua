-- release: give back what an assigned/running request reserved on its worker.
-- include: keys, wake, changed
-- Invariant: load:<w> holds exactly the slots and MiB of the ids in inflight:<w>, and its
-- `isolated` field names a suspect only while that suspect holds the worker; a change of
-- load:<w> marks the worker in wchanged (includes/changed.lua). A corrupt load:<w> (not a
-- hash, or slots/mib not numbers) is left as it is, never failing the caller half-way (Lua
-- does not roll back: the request would stay running in no lease and no in-flight set, for
-- ever); the mark makes the dispatcher read it, quarantine it and rebuild it from
-- inflight:<w> (quarantine.lua).

-- Whether load:<w> can take HINCRBY slots / HINCRBYFLOAT mib (absent counts as 0).
local function load_ok(key)
  local kind = redis.call('TYPE', key).ok
  if kind == 'none' then return true end
  if kind ~= 'hash' then return false end
  local v = redis.call('HMGET', key, 'slots', 'mib')
  local mib = tonumber(v[2] or '0')
  return string.match(v[1] or '0', '^%-?%d+$') ~= nil and mib ~= nil
    and mib == mib and mib ~= math.huge and mib ~= -math.huge
end

local function release(p, id, worker, need_mib)
  redis.call('ZREM', p .. 'leases', id)
  if worker and worker ~= '' then
    if redis.call('SREM', k_inflight(p, worker), id) == 1 then
      local load = k_load(p, worker)
      if load_ok(load) then
        redis.call('HINCRBY', load, 'slots', -1)
        redis.call('HINCRBYFLOAT', load, 'mib', -(tonumber(need_mib) or 0))
        if redis.call('HGET', load, 'isolated') == id then
          redis.call('HDEL', load, 'isolated')
        end
      end
      worker_changed(p, worker)
      wake(p)
    end
  end
end
