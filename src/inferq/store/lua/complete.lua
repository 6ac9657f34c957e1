-- complete: record final results from a worker, fenced by attempt number.
-- ARGV: 1 prefix, 2 worker id, 3 result ttl s, 4 events maxlen, 5 the model the worker
--       serves ('' = unknown: read from its heartbeat, one HGET a call),
--       then 12-tuples: id, attempt, status ('succeeded'|'failed'|'expired'|'cancelled'),
--       output, prompt_tokens, completion_tokens, first_token_ms ('' if unknown), error,
--       finish_reason ('stop'|'length'|... as the model server said; '' if unknown),
--       rejection (the model server's message when it refused the request as invalid,
--       the caller's error; '' otherwise, and then no field is written),
--       cached_tokens (prompt tokens the model server reused from its cache; 0 unknown),
--       tool_calls (the model's tool calls as JSON text; '' when none, and then no field
--       is written)
-- Writes gpu_ms (the request's share of its worker's busy time from its claim to now,
-- includes/gpu.lua: the GPU time metered, see includes/meter.lua), service_ms (Redis ms
-- from this attempt's start to now, for reference), cached_tokens and served_model (the
-- model the usage is metered under: the worker's, not the route, which may be a size
-- requirement) beside the result.
-- Events: finish/fail/expire with class, tenant, queue_ms, e2e_ms, ttft_ms (finish time
-- when the model server reports no first token), output and prompt tokens, so
-- metrics and reports need not read the request hashes; and usage (includes/meter.lua).
-- Returns one verdict per tuple: 'ok' or 'stale' (not the attempt that holds the request:
-- ignored, so a late result from a re-dispatched attempt never overwrites the real one).
-- Invariant: exactly one final result per request; a final request holds no lease or
-- reservation; the waiting client is told once.
-- include: clock, keys, events, release, finalize, gpu
local p, w, ttl, maxlen, served = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local now = now_ms()
local out = {}
if served == '' then served = redis.call('HGET', k_worker(p, w), 'model') or '' end
for i = 6, #ARGV, 12 do
  local id, attempt, status = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local key = k_req(p, id)
  local r = redis.call('HMGET', key, 'state', 'attempts', 'worker', 'need_mib', 'priority',
    'submitted_ms', 'dispatched_ms', 'tenant', 'started_ms', 'gpu_mark')
  if (r[1] ~= 'assigned' and r[1] ~= 'running') or r[2] ~= attempt or r[3] ~= w then
    stat(p, 'stale_results')
    out[#out + 1] = 'stale'
  else
    local acc = release(p, id, w, r[4], now)
    local service = math.max(0, now - (tonumber(r[9]) or now))
    -- its share (includes/gpu.lua); claimed before GPU sharing (no mark), or its load:<w>
    -- rebuilt by quarantine.lua meanwhile (the integral restarted below the mark): its
    -- service time, the rule before
    local gpu, mark = service, tonumber(r[10])
    if acc and mark and acc >= mark then gpu = math.floor(acc - mark + 0.5) end
    local fields = {
      'output', ARGV[i + 3], 'prompt_tokens_used', ARGV[i + 4],
      'completion_tokens', ARGV[i + 5], 'first_token_ms', ARGV[i + 6], 'error', ARGV[i + 7],
      'finish_reason', ARGV[i + 8], 'cached_tokens', ARGV[i + 10],
      'service_ms', service, 'gpu_ms', gpu, 'served_model', served}
    if ARGV[i + 9] ~= '' then
      fields[#fields + 1] = 'rejection'
      fields[#fields + 1] = ARGV[i + 9]
    end
    if ARGV[i + 11] ~= '' then
      fields[#fields + 1] = 'tool_calls'
      fields[#fields + 1] = ARGV[i + 11]
    end
    local u = finalize(p, id, status, now, ttl, maxlen, fields)
    local etype = 'finish'
    if status == 'failed' then etype = 'fail' elseif status == 'expired' then etype = 'expire'
    elseif status == 'cancelled' then etype = 'cancel' end
    local submitted = tonumber(r[6])
    local why = {}
    if status == 'failed' then why = {'error', ARGV[i + 7]} end
    emit(p, maxlen, etype, 'id', id, 'worker', w, 'attempt', attempt, 'class', r[5],
      'tenant', r[8], 'queue_ms', tonumber(r[7]) - submitted, 'e2e_ms', now - submitted,
      'ttft_ms', (tonumber(ARGV[i + 6]) or now) - submitted, 'tokens', ARGV[i + 5],
      'ptokens', ARGV[i + 4], 'usage', u, unpack(why))
    out[#out + 1] = 'ok'
  end
end
return out
