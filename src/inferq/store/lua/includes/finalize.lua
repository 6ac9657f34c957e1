-- finalize: make a request final: state, result fields, notify the waiting client, expire
-- the record.
-- include: keys, record, events, meter, budget
-- Invariant: a final request is in no queue, lease or deadline index, nor in its
-- caller's set (caller:<gateway>, see reap_callers.lua); a streamed request's stream ends
-- with one ``end`` entry (its final state) and expires with it; its figures are added
-- to the usage roll-up once (meter.lua), read from the hash as just written.
-- Returns the request's usage as meter.lua encodes it: every caller puts it on its final
-- event as the field ``usage`` (the Prometheus usage counters, inferq.metrics.events).

local function finalize(p, id, state, now, ttl_s, maxlen, extra)
  local key = k_req(p, id)
  redis.call('HSET', key, 'state', state, 'finished_ms', now)
  if extra then redis.call('HSET', key, unpack(extra)) end
  redis.call('ZREM', p .. 'deadlines', id)
  redis.call('ZREM', p .. 'leases', id)
  record_expire(p, id, ttl_s)
  redis.call('RPUSH', k_done(p, id), state)
  redis.call('EXPIRE', k_done(p, id), ttl_s)
  local seen = redis.call('HMGET', key, 'stream', 'caller', 'tenant', 'api_key', 'priority',
    'model', 'prompt_tokens_used', 'cached_tokens', 'completion_tokens', 'gpu_ms', 'budgets',
    'served_model')
  if seen[2] then redis.call('SREM', k_caller(p, seen[2]), id) end
  if seen[1] == '1' then
    redis.call('XADD', k_stream(p, id), '*', 'end', state)
    redis.call('EXPIRE', k_stream(p, id), ttl_s)
  end
  stat(p, state)
  local model = seen[6]
  if seen[12] and seen[12] ~= '' then model = seen[12] end
  local u = meter(p, state, now, seen[3], seen[4], seen[5], model, seen[7], seen[8], seen[9],
    seen[10])
  if seen[11] then budget_settle(seen[11], seen[7], seen[9], seen[10]) end
  return u
end
