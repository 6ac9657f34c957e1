-- requeue: send assigned/running requests back to their queue after a failed or abandoned
-- attempt (model server error, drain hand-back, lost worker, lapsed lease).
-- ARGV: 1 prefix, 2 max_attempts, 3 result ttl s, 4 events maxlen,
--       5 penalize ('1' counted | '0' not counted | 'infra' not counted, counted as a failure),
--       6 delay_ms (backoff: not before Redis TIME + delay_ms; '0' = at once),
--       7 kind (the failure's kind for the event, '' = none),
--       then 4-tuples: id, attempt ('' = whatever holds it), worker ('' = any), error
-- Returns one verdict per tuple: 'queued', 'expired', 'dead' or 'stale'; 'cancelled' or
-- 'preempted' when an abort of the attempt was pending (see includes/requeue.lua).
-- Invariant: a requeued request returns to its original position (score = submit time),
-- after its delay if any (delayed zset, moved back by promote.lua); after max_attempts
-- penalized attempts it fails with the last error and is dead-lettered; past its deadline it
-- expires instead; a stale attempt cannot requeue a newer one; an abort still pending for
-- the attempt (a cancel, a preemption) is carried out instead of a plain requeue.
-- include: clock, requeue
local p, max_attempts, ttl, maxlen, penalize = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local delay_ms, kind = tonumber(ARGV[6]), ARGV[7]
local now = now_ms()
local out = {}
for i = 8, #ARGV, 4 do
  out[#out + 1] = requeue_one(p, ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], penalize,
    max_attempts, ttl, maxlen, now, delay_ms, kind)
end
return out
