-- assign: claim a batch of queued requests for one worker (compare-and-set per request).
-- KEYS[1] worker:<w> (heartbeat)   KEYS[2] load:<w>   KEYS[3] inflight:<w>   KEYS[4] drain:<w>
-- ARGV: 1 prefix, 2 worker id, 3 batch id, 4 lease_ms, 5 events maxlen, 6 prefix-log maxlen,
--       then quadruples: request id, its queue key (the tenant's sub-queue), need_mib,
--       the prompt tokens the prefix index forecast cached on the worker (0: none)
-- Returns a flat list {id1, attempt1, id2, attempt2, ...} of the requests claimed.
-- Invariant: a request leaves its queue (its tenant's sub-queue, with the tenant index and
-- the depth counter, includes/queue.lua) exactly once per attempt (ZREM is the CAS, so two dispatchers
-- never assign the same request); every assigned request is in the leases and
-- inflight:<w> and its need is counted in load:<w>; nothing is assigned to a worker that is
-- not live and ready, or that was asked to drain (before its next beat says so).
-- Isolation (poison requests): a request marked `suspect` (it was on a worker that crashed)
-- is claimed only alone, by a worker with nothing reserved, and while it holds the worker
-- (load:<w> field `isolated` = its id) nothing else is assigned there; so one request that
-- crashes its worker cannot take others with it again.
-- A claim marks the worker in wchanged (its load changed, includes/changed.lua), and
-- brings its gpu_acc up to now before slots grows; each claimed request keeps that value
-- as its gpu_mark (its share of the worker's busy time starts there: includes/gpu.lua).
-- Prefix index (issue 22): the claimed requests' prefix chains go to the prefix log in one
-- entry (worker, chains), in claim order, so every dispatcher replica's index learns the
-- same placements in the same order; a claim and its log entry are one atomic step.
-- A call resent with the same batch id (redis-py resends a call whose reply timed out or
-- was lost; batch ids are never reused) claims nothing more and returns what the first
-- run claimed and still holds, so the dispatcher sends the batch its job; answering []
-- left them assigned with no job until the worker's orphan check, a lease later.
-- include: clock, keys, queue, counts, events, changed, gpu
local p, w, batch, lease_ms, maxlen = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local log_maxlen = ARGV[6]
local again = {}
for i = 7, #ARGV, 4 do
  local r = redis.call('HMGET', k_req(p, ARGV[i]), 'state', 'worker', 'batch', 'attempts')
  if r[1] == 'assigned' and r[2] == w and r[3] == batch then
    again[#again + 1] = ARGV[i]
    again[#again + 1] = tonumber(r[4])
  end
end
if #again > 0 then return again end
if redis.call('HGET', KEYS[1], 'state') ~= 'ready' or redis.call('EXISTS', KEYS[4]) == 1
    or redis.call('HEXISTS', KEYS[2], 'isolated') == 1 then
  return {}
end
local now = now_ms()
local claimed, ids, chains = {}, {}, {}
local acc = nil  -- gpu_acc at now, read at the first claim
for i = 7, #ARGV, 4 do
  local id, qkey, need, cached = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local key = k_req(p, id)
  local r = redis.call('HMGET', key, 'state', 'deadline_ms', 'priority', 'tenant', 'suspect', 'model',
    'prefix')
  local alone = r[5] == '1'
  if alone and (#ids > 0 or (tonumber(redis.call('HGET', KEYS[2], 'slots')) or 0) > 0) then
    break  -- a suspect runs alone: not beside this batch or the worker's running requests
  end
  -- The sub-queue named must be the record's own (a stale or foreign key claims nothing).
  if r[1] == 'queued' and tonumber(r[2]) > now and qkey == k_tqueue(p, r[3], r[6], r[4])
      and redis.call('ZREM', qkey, id) == 1 then
    subqueue_removed(p, r[3], r[6], r[4])
    if not acc then
      local g = redis.call('HMGET', KEYS[2], 'slots', 'gpu_acc', 'gpu_t')
      acc = gpu_acc_at(g[2], g[3], g[1], now)
    end
    local attempt = redis.call('HINCRBY', key, 'attempts', 1)
    redis.call('HSET', key, 'state', 'assigned', 'worker', w, 'batch', batch,
      'dispatched_ms', now, 'need_mib', need, 'cached_fc', cached, 'gpu_mark', gpu_fmt(acc))
    if r[7] then chains[#chains + 1] = r[7] end
    redis.call('ZADD', p .. 'leases', now + lease_ms, id)
    redis.call('SADD', KEYS[3], id)
    redis.call('HINCRBY', KEYS[2], 'slots', 1)
    redis.call('HINCRBYFLOAT', KEYS[2], 'mib', need)
    count_queued(p, r[3], r[4], -1, false, nil, true)
    claimed[#claimed + 1] = id
    claimed[#claimed + 1] = attempt
    ids[#ids + 1] = id
    if alone then
      redis.call('HSET', KEYS[2], 'isolated', id)
      break
    end
  end
end
if #ids > 0 then
  redis.call('HSET', KEYS[2], 'gpu_acc', gpu_fmt(acc), 'gpu_t', now)
  worker_changed(p, w, now)
  stat(p, 'dispatched', #ids)
  emit(p, maxlen, 'dispatch', 'worker', w, 'batch', batch, 'n', #ids, 'ids', table.concat(ids, ','))
  if #chains > 0 then
    redis.call('XADD', k_prefixlog(p), 'MAXLEN', '~', log_maxlen, '*', 'w', w,
      'c', table.concat(chains, ' '))
  end
end
return claimed
