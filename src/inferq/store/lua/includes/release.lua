-- release: give back what an assigned/running request reserved on its worker.
-- include: keys, wake, changed
-- Invariant: load:<w> holds exactly the slots and MiB of the ids in inflight:<w>, and its
-- `isolated` field names a suspect only while that suspect holds the worker; a change of
-- load:<w> marks the worker in wchanged (includes/changed.lua).

local function release(p, id, worker, need_mib)
  redis.call('ZREM', p .. 'leases', id)
  if worker and worker ~= '' then
    if redis.call('SREM', k_inflight(p, worker), id) == 1 then
      redis.call('HINCRBY', k_load(p, worker), 'slots', -1)
      redis.call('HINCRBYFLOAT', k_load(p, worker), 'mib', -(tonumber(need_mib) or 0))
      if redis.call('HGET', k_load(p, worker), 'isolated') == id then
        redis.call('HDEL', k_load(p, worker), 'isolated')
      end
      worker_changed(p, worker)
      wake(p)
    end
  end
end
