-- release: give back what an assigned/running request reserved on its worker.
-- include: clock, keys, wake, changed, gpu
-- Invariant: load:<w> holds exactly the slots and MiB of the ids in inflight:<w>, and its
-- `isolated` field names a suspect only while that suspect holds the worker; a change of
-- load:<w> marks the worker in wchanged (includes/changed.lua). A corrupt load:<w> (not a
-- hash, or slots/mib not numbers) is left as it is, never failing the caller half-way (Lua
-- does not roll back: the request would stay running in no lease and no in-flight set, for
-- ever); the mark makes the dispatcher read it, quarantine it and rebuild it from
-- inflight:<w> (quarantine.lua).
-- GPU sharing (includes/gpu.lua): before slots drops, gpu_acc is brought up to now; the
-- value is returned so complete.lua can meter the request's share of the busy time.

-- Whether load:<w> can take HINCRBY slots / HINCRBYFLOAT mib (absent counts as 0), and
-- its slots, mib, gpu_acc, gpu_t (an empty table when absent).
local function load_ok(key)
  local kind = redis.call('TYPE', key).ok
  if kind == 'none' then return true, {} end
  if kind ~= 'hash' then return false, {} end
  local v = redis.call('HMGET', key, 'slots', 'mib', 'gpu_acc', 'gpu_t')
  local mib = tonumber(v[2] or '0')
  return string.match(v[1] or '0', '^%-?%d+$') ~= nil and mib ~= nil
    and mib == mib and mib ~= math.huge and mib ~= -math.huge, v
end

-- `now`: the caller's Redis ms (absent: read here). Returns the worker's gpu_acc at the
-- release (includes/gpu.lua), or nil when the request held nothing there or the integral
-- is unknown (slots held but no gpu_t: load:<w> was rebuilt by quarantine.lua).
local function release(p, id, worker, need_mib, now)
  now = now or now_ms()
  redis.call('ZREM', p .. 'leases', id)
  local acc = nil
  if worker and worker ~= '' then
    if redis.call('SREM', k_inflight(p, worker), id) == 1 then
      local load = k_load(p, worker)
      local ok, v = load_ok(load)
      if ok then
        local known = tonumber(v[4]) ~= nil or (tonumber(v[1]) or 0) <= 0
        local at = gpu_acc_at(v[3], v[4], v[1], now)
        if known then acc = at end
        redis.call('HINCRBY', load, 'slots', -1)
        redis.call('HINCRBYFLOAT', load, 'mib', -(tonumber(need_mib) or 0))
        redis.call('HSET', load, 'gpu_acc', gpu_fmt(at), 'gpu_t', now)
        if redis.call('HGET', load, 'isolated') == id then
          redis.call('HDEL', load, 'isolated')
        end
      end
      worker_changed(p, worker, now)
      wake(p)
    end
  end
  return acc
end
