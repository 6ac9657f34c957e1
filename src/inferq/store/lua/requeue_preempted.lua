-- requeue_preempted: a worker aborted a running request for a preemption; back to its queue.
-- ARGV: 1 prefix, 2 result ttl s, 3 events maxlen, 4 worker id,
--       then triples: id, attempt, completion tokens generated before the abort
-- Returns one verdict per tuple: 'queued', 'expired' (its deadline passed), 'cancelled'
-- (a cancel took the abort over while it was on its way: see abort.lua) or 'stale'.
-- Invariant: a preempted request goes back at its original position (score = submit time)
-- with its deadline, spends no attempt (attempt_base + 1, so max_attempts counts only
-- failures), is counted in stats.preempted and a 'preempt' event, and its tenant's virtual
-- token counter keeps only what it used (prompt + weight x generated tokens): the rest of
-- its dispatch charge is given back (never below zero, never to a counter already dropped),
-- divided by the tenant's weight (abort_tw) as the counter is virtual time.
-- include: clock, keys, counts, wake, events, release, finalize, requeue
local p, ttl, maxlen, w = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local now = now_ms()
local out = {}
for i = 5, #ARGV, 3 do
  local id, attempt, generated = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local key = k_req(p, id)
  local r = redis.call('HMGET', key, 'state', 'attempts', 'worker', 'need_mib', 'priority',
    'model', 'tenant', 'submitted_ms', 'deadline_ms', 'prompt_tokens', 'abort_charged', 'abort_weight',
    'abort_tw', 'abort_action', 'abort_reason')
  if r[1] ~= 'running' or r[2] ~= attempt or r[3] ~= w then
    out[#out + 1] = 'stale'
  elseif r[14] == 'cancel' or r[14] == 'expire' then
    -- the caller cancelled (or it expired) while the preemption was on its way: final
    release(p, id, w, r[4], now)
    redis.call('HDEL', key, 'abort_attempt', 'abort_action', 'abort_charged', 'abort_weight',
      'abort_tw', 'abort_reason')
    local final = 'cancelled'
    if r[14] == 'expire' then final = 'expired' end
    local u = finalize(p, id, final, now, ttl, maxlen, {'error', r[15] or final})
    emit(p, maxlen, r[14], 'id', id, 'reason', r[15] or final, 'usage', u)
    out[#out + 1] = final
  else
    release(p, id, w, r[4], now)
    redis.call('HDEL', key, 'abort_attempt', 'abort_action', 'abort_charged', 'abort_weight',
      'abort_tw', 'abort_reason')
    vtc_keep_used(p, r[5], r[7], r[10], r[11], r[12], r[13], generated)
    if tonumber(r[9]) <= now then
      local u = finalize(p, id, 'expired', now, ttl, maxlen,
        {'error', 'deadline passed while preempted (attempt ' .. attempt .. ')'})
      emit(p, maxlen, 'expire', 'id', id, 'reason', 'deadline after preemption', 'usage', u)
      out[#out + 1] = 'expired'
    else
      redis.call('HINCRBY', key, 'attempt_base', 1)
      redis.call('HINCRBY', key, 'preemptions', 1)
      enqueue_again(p, id, {r[5], r[6], r[7], r[8]})
      stat(p, 'preempted')
      emit(p, maxlen, 'preempt', 'id', id, 'worker', w, 'attempt', attempt, 'class', r[5],
        'tenant', r[7], 'tokens', generated)
      out[#out + 1] = 'queued'
    end
  end
end
return out
