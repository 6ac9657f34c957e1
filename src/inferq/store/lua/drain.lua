-- drain: ask a live worker to drain (`inferq drain`, the scaler).
-- KEYS[1] worker:<w>   KEYS[2] drain:<w>
-- ARGV: 1 prefix, 2 worker id, 3 drain flag ttl ms
-- Returns 1 when the worker is live (the flag is set), 0 when no live worker has this id.
-- Invariant: a drain takes effect for routing at once, not a heartbeat later: its heartbeat
-- hash says `draining` from this call on (heartbeat.lua keeps it so while drain:<w> exists,
-- whatever a beat sent before the worker saw the flag says), and the worker is marked in
-- wchanged, so the next snapshot of every dispatcher, cached fleets included, offers it
-- nothing; assign.lua refuses it too, in the same script as the claim.
-- include: clock, changed
local p, w, ttl_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], '1', 'PX', ttl_ms)
if redis.call('HGET', KEYS[1], 'state') ~= 'draining' then
  redis.call('HSET', KEYS[1], 'state', 'draining')
  worker_changed(p, w)
end
return 1
