-- requeue: put a request back in its queue after a failed or abandoned attempt.
-- include: keys, record, counts, wake, events, release, finalize

-- Put a request back in its queue at its original position (score = submit time).
local function enqueue_again(p, id, fields)
  local class, route, tenant, submitted = fields[1], fields[2], fields[3], fields[4]
  redis.call('HSET', k_req(p, id), 'state', 'queued', 'worker', '', 'batch', '')
  redis.call('ZADD', k_queue(p, class, route), submitted, id)
  count_queued(p, class, tenant, 1)
  wake(p)
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
    record_persist(p, id)
    emit(p, maxlen, 'dead_letter', 'id', id, 'error', err)
    return 'dead'
  end
  redis.call('HSET', key, 'last_error', err, 'excluded_worker', r[3] or '')
  enqueue_again(p, id, {r[5], r[6], r[7], r[8]})
  stat(p, 'retried')
  emit(p, maxlen, 'retry', 'id', id, 'attempt', r[2], 'worker', r[3] or '', 'error', err)
  return 'queued'
end
