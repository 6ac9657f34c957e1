-- lib.lua: fragments shared by every inferq script (prepended by store.py).
-- Key templates here mirror inferq/keys.py; tests/test_keys.py checks they agree.
-- Every script reads the clock from Redis (TIME), so all hosts share one clock.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function k_req(p, id) return p .. 'req:' .. id end
local function k_queue(p, class, route) return p .. 'q:' .. class .. ':' .. route end
local function k_done(p, id) return p .. 'done:' .. id end
local function k_load(p, w) return p .. 'load:' .. w end
local function k_inflight(p, w) return p .. 'inflight:' .. w end

local function emit(p, maxlen, etype, ...)
  redis.call('XADD', p .. 'events', 'MAXLEN', '~', maxlen, '*', 'type', etype, ...)
end

local function stat(p, field, n)
  redis.call('HINCRBY', p .. 'stats', field, n or 1)
end

-- Queued counters (backpressure and tenant backlog): class and class+tenant.
local function count_queued(p, class, tenant, delta)
  redis.call('HINCRBY', p .. 'counts', 'c:' .. class, delta)
  local left = redis.call('HINCRBY', p .. 'counts', 't:' .. class .. ':' .. tenant, delta)
  if left <= 0 then redis.call('HDEL', p .. 'counts', 't:' .. class .. ':' .. tenant) end
end

-- Give back what an assigned/running request reserved on its worker.
-- Invariant: load:<w> holds exactly the slots and MiB of the ids in inflight:<w>.
local function release(p, id, worker, need_mib)
  redis.call('ZREM', p .. 'leases', id)
  if worker and worker ~= '' then
    if redis.call('SREM', k_inflight(p, worker), id) == 1 then
      redis.call('HINCRBY', k_load(p, worker), 'slots', -1)
      redis.call('HINCRBYFLOAT', k_load(p, worker), 'mib', -(tonumber(need_mib) or 0))
      redis.call('LPUSH', p .. 'wake', '1')
      redis.call('LTRIM', p .. 'wake', 0, 0)
    end
  end
end

-- Make a request final: state, result fields, notify the waiting client, expire the record.
-- Invariant: a final request is in no queue, lease or deadline index.
local function finalize(p, id, state, now, ttl_s, maxlen, extra)
  local key = k_req(p, id)
  redis.call('HSET', key, 'state', state, 'finished_ms', now)
  if extra then redis.call('HSET', key, unpack(extra)) end
  redis.call('ZREM', p .. 'deadlines', id)
  redis.call('ZREM', p .. 'leases', id)
  redis.call('EXPIRE', key, ttl_s)
  redis.call('RPUSH', k_done(p, id), state)
  redis.call('EXPIRE', k_done(p, id), ttl_s)
  stat(p, state)
end

-- Put a request back in its queue at its original position (score = submit time).
local function enqueue_again(p, id, fields)
  local class, route, tenant, submitted = fields[1], fields[2], fields[3], fields[4]
  redis.call('HSET', k_req(p, id), 'state', 'queued', 'worker', '', 'batch', '')
  redis.call('ZADD', k_queue(p, class, route), submitted, id)
  count_queued(p, class, tenant, 1)
  redis.call('LPUSH', p .. 'wake', '1')
  redis.call('LTRIM', p .. 'wake', 0, 0)
end

-- Requeue one assigned/running request after a failed or abandoned attempt.
-- penalize=1 counts the attempt towards max_attempts (a drain hand-back does not).
-- Returns 'queued', 'expired', 'dead' or 'stale' (not this attempt's to requeue).
local function requeue_one(p, id, attempt, worker, err, penalize, max_attempts, ttl_s, maxlen, now)
  local key = k_req(p, id)
  local r = redis.call('HMGET', key, 'state', 'attempts', 'worker', 'need_mib',
    'priority', 'model', 'tenant', 'submitted_ms', 'deadline_ms', 'attempt_base')
  local state = r[1]
  if state ~= 'assigned' and state ~= 'running' then return 'stale' end
  if attempt ~= '' and r[2] ~= attempt then return 'stale' end
  if worker ~= '' and r[3] ~= worker then return 'stale' end
  release(p, id, r[3], r[4])
  local attempts = tonumber(r[2]) - tonumber(r[10] or 0)
  if tonumber(r[9]) <= now then
    finalize(p, id, 'expired', now, ttl_s, maxlen,
      {'error', 'deadline passed after attempt ' .. r[2] .. ': ' .. err})
    emit(p, maxlen, 'expire', 'id', id, 'reason', 'deadline after failed attempt')
    return 'expired'
  end
  if penalize == '1' and attempts >= tonumber(max_attempts) then
    finalize(p, id, 'failed', now, ttl_s, maxlen,
      {'error', 'failed after ' .. attempts .. ' attempts: ' .. err})
    redis.call('ZADD', p .. 'dead', now, id)
    redis.call('PERSIST', key)
    emit(p, maxlen, 'dead_letter', 'id', id, 'error', err)
    return 'dead'
  end
  redis.call('HSET', key, 'last_error', err, 'excluded_worker', r[3] or '')
  enqueue_again(p, id, {r[5], r[6], r[7], r[8]})
  stat(p, 'retried')
  emit(p, maxlen, 'retry', 'id', id, 'attempt', r[2], 'worker', r[3] or '', 'error', err)
  return 'queued'
end
