-- dead_requeue: give a dead-lettered request a fresh set of attempts and a fresh deadline.
-- ARGV: 1 prefix, 2 id, 3 events maxlen
-- Returns 1 if requeued, 0 if the id is not in the dead letter.
-- Invariant: attempt numbers only grow (attempt_base marks where the new budget starts), so
-- fencing still rejects results of attempts made before the dead letter.
-- include: clock, keys, record, events, requeue
local p, id = ARGV[1], ARGV[2]
if redis.call('ZREM', p .. 'dead', id) == 0 then return 0 end
local key = k_req(p, id)
local r = redis.call('HMGET', key, 'priority', 'model', 'tenant', 'submitted_ms', 'timeout_s', 'attempts')
if not r[1] then return 0 end
local now = now_ms()
local deadline = now + math.floor(tonumber(r[5]) * 1000)
redis.call('HSET', key, 'attempt_base', r[6], 'deadline_ms', deadline, 'error', '', 'finished_ms', '')
record_persist(p, id)
redis.call('DEL', k_done(p, id))
redis.call('ZADD', p .. 'deadlines', deadline, id)
enqueue_again(p, id, {r[1], r[2], r[3], r[4]}, 0, now)
emit(p, ARGV[3], 'retry', 'id', id, 'reason', 'requeued from dead letter')
return 1
