-- lease: take, renew or release a named lease held by one replica (the acting scaler's
-- scaler:lease, the metrics exporter's metrics:lease).
-- KEYS[1] the lease key
-- ARGV: 1 replica id, 2 ttl_ms ('0' releases the lease when this replica holds it)
-- Returns 1 when this replica holds the lease after the call (taken or renewed) or
-- released it; 0 when another replica holds it.
-- Invariant: at most one replica holds the lease; only the holder renews or releases
-- it (compare-and-set on the id), and a holder that stops renewing loses it after ttl.
local holder = redis.call('GET', KEYS[1])
local ttl = tonumber(ARGV[2])
if ttl == 0 then
  if holder == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
  return 0
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ttl)
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ttl) then return 1 end
return 0
