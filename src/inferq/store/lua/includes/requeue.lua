-- requeue: put a request back in its queue after a failed or abandoned attempt.
-- include: keys, record, queue, counts, wake, events, release, finalize

-- Put a request back in its queue at its original position (score = submit time), or,
-- with delay_ms > 0, in the delayed set until now + delay_ms (promote.lua moves it back to
-- its queue then). Either way it is `queued` and counted as queued.
local function enqueue_again(p, id, fields, delay_ms, now)
  local class, route, tenant, submitted = fields[1], fields[2], fields[3], fields[4]
  redis.call('HSET', k_req(p, id), 'state', 'queued', 'worker', '', 'batch', '')
  if delay_ms and delay_ms > 0 then
    redis.call('ZADD', p .. 'delayed', now + delay_ms, id)
    redis.call('HSET', k_req(p, id), 'not_before_ms', now + delay_ms)
  else
    queue_add(p, class, route, tenant, id, submitted)
  end
  count_queued(p, class, tenant, 1, true)
  wake(p)
end

-- Output tokens `attempt` of request `id` generated, as far as Redis knows: the count of
-- the last chunk it streamed (`n` of the stream's last entry, when that entry is this
-- attempt's: field `a`), else 0 (nothing streamed, or not a stream=True request). A key of
-- another type counts 0 rather than failing the caller's script.
local function streamed_tokens(p, id, attempt)
  local key = k_stream(p, id)
  if redis.call('TYPE', key).ok ~= 'stream' then return 0 end
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
  if not last then return 0 end
  local f = {}
  for i = 1, #last[2] - 1, 2 do f[last[2][i]] = last[2][i + 1] end
  if f['a'] ~= attempt then return 0 end
  return tonumber(f['n']) or 0
end

-- Requeue one assigned/running request after a failed or abandoned attempt.
-- penalize: '1' counts the attempt towards max_attempts; '0' (a drain hand-back, an orphan)
-- does not; 'infra' (the model server's infrastructure failed: refused, 502/503/504, 429)
-- does not either, but counts in the request's `failures` and in stats `retried_infra`:
-- such retries are bounded by the deadline alone. An attempt not counted moves
-- attempt_base up by one, so `attempts - attempt_base` stays the penalised count.
-- delay_ms (optional): the retry's backoff; kind (optional): the failure's kind, for events.
-- An abort of the attempt still pending (abort.lua sent it; the worker had not carried it
-- out) is carried out here instead: the attempt ended anyway, and what the abort asked for
-- stands. A cancel or expiry is made final with its reason (a cancelled request never runs
-- again because its worker died); a preemption is requeued as one: no attempt spent, no
-- crash counted, counted in stats.preempted, its tenant charged only the tokens the attempt
-- generated (the last streamed chunk's count, else 0: vtc_keep_used, as requeue_preempted).
-- Returns 'queued', 'expired', 'dead', 'cancelled', 'preempted' or 'stale' (not this
-- attempt's to requeue).
local function requeue_one(p, id, attempt, worker, err, penalize, max_attempts, ttl_s, maxlen, now,
    delay_ms, kind)
  local key = k_req(p, id)
  local r = redis.call('HMGET', key, 'state', 'attempts', 'worker', 'need_mib',
    'priority', 'model', 'tenant', 'submitted_ms', 'deadline_ms', 'attempt_base',
    'abort_attempt', 'abort_action', 'abort_reason', 'prompt_tokens', 'abort_charged',
    'abort_weight', 'abort_tw')
  local state = r[1]
  if state ~= 'assigned' and state ~= 'running' then return 'stale' end
  if attempt ~= '' and r[2] ~= attempt then return 'stale' end
  if worker ~= '' and r[3] ~= worker then return 'stale' end
  release(p, id, r[3], r[4], now)
  if r[11] and r[11] == r[2] then
    redis.call('HDEL', key, 'abort_attempt', 'abort_action', 'abort_charged', 'abort_weight',
      'abort_tw', 'abort_reason')
    local action, reason = r[12], r[13] or ('aborted: ' .. err)
    if action == 'cancel' or action == 'expire' then
      local final = 'cancelled'
      if action == 'expire' then final = 'expired' end
      local u = finalize(p, id, final, now, ttl_s, maxlen, {'error', reason})
      emit(p, maxlen, action, 'id', id, 'reason', reason, 'usage', u)
      return final
    end
    local generated = streamed_tokens(p, id, r[2])
    vtc_keep_used(p, r[5], r[7], r[14], r[15], r[16], r[17], generated)
    if tonumber(r[9]) <= now then
      local u = finalize(p, id, 'expired', now, ttl_s, maxlen,
        {'error', 'deadline passed while preempted (attempt ' .. r[2] .. ')'})
      emit(p, maxlen, 'expire', 'id', id, 'reason', 'deadline after preemption', 'usage', u)
      return 'expired'
    end
    redis.call('HINCRBY', key, 'attempt_base', 1)
    redis.call('HINCRBY', key, 'preemptions', 1)
    enqueue_again(p, id, {r[5], r[6], r[7], r[8]})
    stat(p, 'preempted')
    emit(p, maxlen, 'preempt', 'id', id, 'worker', r[3] or '', 'attempt', r[2], 'class', r[5],
      'tenant', r[7], 'tokens', generated, 'reason', err)
    return 'preempted'
  end
  local attempts = tonumber(r[2]) - tonumber(r[10] or 0)
  if tonumber(r[9]) <= now then
    local u = finalize(p, id, 'expired', now, ttl_s, maxlen,
      {'error', 'deadline passed after attempt ' .. r[2] .. ': ' .. err})
    emit(p, maxlen, 'expire', 'id', id, 'reason', 'deadline after failed attempt', 'usage', u)
    return 'expired'
  end
  if penalize ~= '1' then
    redis.call('HINCRBY', key, 'attempt_base', 1)
    attempts = attempts - 1
  end
  if penalize == '1' and attempts >= tonumber(max_attempts) then
    local u = finalize(p, id, 'failed', now, ttl_s, maxlen,
      {'error', 'failed after ' .. attempts .. ' attempts: ' .. err})
    redis.call('ZADD', p .. 'dead', now, id)
    record_persist(p, id)
    emit(p, maxlen, 'dead_letter', 'id', id, 'error', err, 'kind', kind or '', 'usage', u)
    return 'dead'
  end
  redis.call('HSET', key, 'last_error', err, 'excluded_worker', r[3] or '')
  if penalize == 'infra' then
    redis.call('HINCRBY', key, 'failures', 1)
    stat(p, 'retried_infra')
  end
  delay_ms = tonumber(delay_ms) or 0
  enqueue_again(p, id, {r[5], r[6], r[7], r[8]}, delay_ms, now)
  stat(p, 'retried')
  emit(p, maxlen, 'retry', 'id', id, 'attempt', r[2], 'worker', r[3] or '', 'error', err,
    'kind', kind or '', 'delay_ms', delay_ms)
  return 'queued'
end
