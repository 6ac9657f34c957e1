-- release: give back what an assigned/running request reserved on its worker.
-- include: keys, wake
-- Invariant: load:<w> holds exactly the slots and MiB of the ids in inflight:<w>.

local function release(p, id, worker, need_mib)
  redis.call('ZREM', p .. 'leases', id)
  if worker and worker ~= '' then
    if redis.call('SREM', k_inflight(p, worker), id) == 1 then
      redis.call('HINCRBY', k_load(p, worker), 'slots', -1)
      redis.call('HINCRBYFLOAT', k_load(p, worker), 'mib', -(tonumber(need_mib) or 0))
      wake(p)
    end
  end
end
