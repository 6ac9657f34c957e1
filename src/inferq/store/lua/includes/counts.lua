-- counts: the queued counters (backpressure and tenant backlog): class and class+tenant,
-- and the VTC state that follows a tenant's backlog in a class.
-- include: clock
-- Invariant: c:<class> and t:<class>:<tenant> equal the queued requests they name;
-- fair:live:<class> holds exactly the tenants with a queued request in the class, each
-- scored by its virtual time (= fair:vtc:<class>); every fair:vtc entry has a
-- fair:seen entry (last time the tenant was backlogged or served); fair:new:<class> holds
-- only backlogged newcomers not yet dispatched, each scored by its finish tag.

-- A tenant becomes backlogged in a class: VTC's counter lift (Sheng et al., OSDI'24):
-- its virtual time rises to the lowest of the tenants already backlogged, so idle time
-- banks no credit; a tenant served more than them keeps its own (higher) counter.
-- Virtual time = counter / tenant weight, so the lift needs no weights.
-- A newcomer (no virtual time in the class: never seen, or folded) also starts no lower
-- than the last finish tag of the newcomers still waiting for their first dispatch, and
-- leaves its own, start + `size` (its request's VTC charge at max_tokens; 0 unknown), in
-- fair:new:<class>: a crowd of one-off tenants advances as one tenant would, instead of
-- all of them tying at the floor ahead of every established tenant (issue 24; the same
-- rule as inferq.policy.fairness.lift_tenants, at weight 1: the scripts know no weights).
local function vtc_activate(p, class, tenant, size)
  local seen = redis.call('ZSCORE', p .. 'fair:vtc:' .. class, tenant)
  local own = tonumber(seen or '0')
  local low = redis.call('ZRANGE', p .. 'fair:live:' .. class, 0, 0, 'WITHSCORES')
  if low[2] and tonumber(low[2]) > own then own = tonumber(low[2]) end
  if not seen then
    local new = p .. 'fair:new:' .. class
    local last = redis.call('ZRANGE', new, -1, -1, 'WITHSCORES')
    if last[2] and tonumber(last[2]) > own then own = tonumber(last[2]) end
    redis.call('ZADD', new, own + (tonumber(size) or 0), tenant)
  end
  redis.call('ZADD', p .. 'fair:vtc:' .. class, own, tenant)
  redis.call('ZADD', p .. 'fair:live:' .. class, own, tenant)
  redis.call('ZADD', p .. 'fair:seen:' .. class, now_ms(), tenant)
end

-- Give back `tokens` of a tenant's VTC charge (a preempted request keeps only what it
-- used): never below zero, never to a tenant already folded. `tokens` is virtual time
-- (tokens / the tenant's weight, which the caller passes: abort.lua, requeue_preempted.lua).
local function vtc_refund(p, class, tenant, tokens)
  if not tokens or tokens <= 0 then return end
  local vtc = p .. 'fair:vtc:' .. class
  local v = redis.call('ZSCORE', vtc, tenant)
  if not v then return end
  local left = math.max(0, tonumber(v) - tokens)
  redis.call('ZADD', vtc, left, tenant)
  redis.call('ZADD', p .. 'fair:live:' .. class, 'XX', left, tenant)
end

-- A preempted attempt is charged only what it used: its dispatch charged `charged` tokens
-- (prompt + weight x its expected output), it used prompt + weight x `generated`; the rest
-- goes back, in virtual time (divided by the tenant's weight `tw`). One rule for every
-- path a preemption ends by (requeue_preempted.lua, and includes/requeue.lua when the
-- worker died or went silent before carrying the abort out). Missing figures count 0
-- (weight, generated) or 1 (tw).
local function vtc_keep_used(p, class, tenant, prompt, charged, weight, tw, generated)
  local used = (tonumber(prompt) or 0) + (tonumber(weight) or 0) * (tonumber(generated) or 0)
  local refund = ((tonumber(charged) or 0) - used) / (tonumber(tw) or 1)
  vtc_refund(p, class, tenant, refund)
end

-- A waiting newcomer leaves the backlog undispatched (cancelled, expired, quarantined):
-- the newcomers stacked behind it move up by its size, never below the lowest backlogged
-- virtual time, as if it had never come -- a crowd that queues and cancels must not push
-- an honest newcomer back for free (inferq.policy.fairness.newcomer_left, the same rule).
-- At most NEWCOMER_REPACK newcomers are moved per departure (the script stays short).
local NEWCOMER_REPACK = 512
local function newcomer_left(p, class, tenant)
  local new, vtc = p .. 'fair:new:' .. class, p .. 'fair:vtc:' .. class
  local tag = redis.call('ZSCORE', new, tenant)
  if not tag then return end
  redis.call('ZREM', new, tenant)
  local size = tonumber(tag) - tonumber(redis.call('ZSCORE', vtc, tenant) or tag)
  if size <= 0 then return end
  local live = p .. 'fair:live:' .. class
  local low = redis.call('ZRANGE', live, 0, 0, 'WITHSCORES')
  local floor = tonumber(low[2] or '0')
  local behind = redis.call('ZRANGEBYSCORE', new, '(' .. tag, '+inf', 'WITHSCORES',
    'LIMIT', 0, NEWCOMER_REPACK)
  for i = 1, #behind, 2 do
    local other, other_tag = behind[i], tonumber(behind[i + 1])
    local v = tonumber(redis.call('ZSCORE', vtc, other) or '0')
    local moved = v - math.max(v - size, floor)
    if moved > 0 then
      redis.call('ZADD', vtc, v - moved, other)
      redis.call('ZADD', live, 'XX', v - moved, other)
      redis.call('ZADD', new, other_tag - moved, other)
    end
  end
end

-- requeued: the request was queued before (a preemption, a retry): its tenant is no new
-- arrival (its request was running, not idle), so it keeps its own counter, unlifted,
-- unless that counter was folded meanwhile (then it is lifted as any returning tenant).
-- size: the queued request's VTC charge at max_tokens (a newcomer's finish tag; nil: 0).
-- dispatched: the request leaves its queue for a worker (assign.lua): a newcomer that
-- leaves so was served, and those behind it stay where they are.
local function count_queued(p, class, tenant, delta, requeued, size, dispatched)
  redis.call('HINCRBY', p .. 'counts', 'c:' .. class, delta)
  local left = redis.call('HINCRBY', p .. 'counts', 't:' .. class .. ':' .. tenant, delta)
  if left <= 0 then
    redis.call('HDEL', p .. 'counts', 't:' .. class .. ':' .. tenant)
    redis.call('ZREM', p .. 'fair:live:' .. class, tenant)
    if dispatched then
      redis.call('ZREM', p .. 'fair:new:' .. class, tenant)
    else
      newcomer_left(p, class, tenant)
    end
    redis.call('ZADD', p .. 'fair:seen:' .. class, now_ms(), tenant)
  elseif left == delta then
    local own = requeued and redis.call('ZSCORE', p .. 'fair:vtc:' .. class, tenant)
    if own then
      redis.call('ZADD', p .. 'fair:live:' .. class, own, tenant)
      redis.call('ZADD', p .. 'fair:seen:' .. class, now_ms(), tenant)
    else
      vtc_activate(p, class, tenant, size)
    end
  end
end
