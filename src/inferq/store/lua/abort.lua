-- abort: stop a request a worker holds (assigned or running), for a preemption or a cancel.
-- ARGV: 1 prefix, 2 result ttl s, 3 events maxlen, 4 control channel ttl ms,
--       5 the counter's weight of an output token (VTC's w_q, for the refund),
--       then 8-tuples: id, attempt, worker, action ('requeue'|'cancel'|'expire'), reason,
--       charged (VTC tokens its dispatch charged the tenant; refunded on a requeue
--       beyond what it used, see requeue_preempted.lua), the tenant's weight (the
--       counter is virtual time, tokens / weight: a refund is divided by it too),
--       orphan_of ('' = none; else the lapsed gateway the reaper cancels for: the abort
--       acts only while that gateway still holds the request, includes/orphan.lua)
-- Returns one verdict per tuple: 'done' (it had not started: requeued or made final here),
-- 'sent' (running: an abort command is on ctl:<worker> for the worker to carry out),
-- 'pending' (an abort of this attempt was already sent; a cancel or expiry still takes
-- over a pending preemption, answered 'sent'), 'stale' (not this attempt's) or 'kept'
-- (orphan_of names a gateway that no longer holds it: a retry took it over).
-- Invariant: an abort acts on exactly the (request, attempt, worker) it names; a request not
-- yet started is handled here at once (start.lua then finds its attempt stale); a running one
-- is aborted only by the worker that runs it, which writes the outcome through
-- requeue_preempted.lua or complete.lua, so a request is still final exactly once; a
-- requeue spends no attempt (attempt_base + 1) and keeps the submit-time score and deadline.
-- include: clock, keys, counts, wake, events, release, finalize, requeue, orphan
local p, ttl, maxlen, ctl_ttl, weight = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local now = now_ms()
local out = {}
for i = 6, #ARGV, 8 do
  local id, attempt, w, action, reason, charged, tw, orphan =
    ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6],
    ARGV[i + 7]
  local key = k_req(p, id)
  local r = redis.call('HMGET', key, 'state', 'attempts', 'worker', 'need_mib', 'priority',
    'model', 'tenant', 'submitted_ms', 'abort_attempt', 'abort_action')
  if (r[1] ~= 'assigned' and r[1] ~= 'running') or r[2] ~= attempt or r[3] ~= w then
    out[#out + 1] = 'stale'
  elseif orphan ~= '' and not orphan_of(p, id, orphan, now) then
    out[#out + 1] = 'kept'
  elseif r[9] == attempt and (action == 'requeue' or r[10] ~= 'requeue') then
    out[#out + 1] = 'pending'
  elseif r[1] == 'assigned' then
    release(p, id, w, r[4], now)
    if action == 'requeue' then
      redis.call('HINCRBY', key, 'attempt_base', 1)
      redis.call('HINCRBY', key, 'preemptions', 1)
      -- nothing generated: the whole charge back, in virtual time
      vtc_refund(p, r[5], r[7], tonumber(charged) / tonumber(tw))
      enqueue_again(p, id, {r[5], r[6], r[7], r[8]})
      stat(p, 'preempted')
      emit(p, maxlen, 'preempt', 'id', id, 'worker', w, 'attempt', attempt, 'class', r[5],
        'tenant', r[7], 'tokens', 0, 'reason', reason)
    else
      local state = 'cancelled'
      if action == 'expire' then state = 'expired' end
      local u = finalize(p, id, state, now, ttl, maxlen, {'error', reason})
      emit(p, maxlen, action, 'id', id, 'reason', reason, 'usage', u)
    end
    out[#out + 1] = 'done'
  else
    -- a cancel or expiry over a pending preemption takes it over: whichever command the
    -- worker carries out, the request ends final (requeue_preempted.lua reads the action)
    redis.call('HSET', key, 'abort_attempt', attempt, 'abort_action', action,
      'abort_charged', charged, 'abort_weight', weight, 'abort_tw', tw, 'abort_reason', reason)
    local ctl = k_ctl(p, w)
    redis.call('RPUSH', ctl, cjson.encode({id = id, attempt = tonumber(attempt),
      action = action, reason = reason}))
    redis.call('PEXPIRE', ctl, ctl_ttl)
    emit(p, maxlen, 'abort', 'id', id, 'worker', w, 'attempt', attempt, 'action', action,
      'reason', reason)
    out[#out + 1] = 'sent'
  end
end
return out
