-- changed: which workers' routing view changed, so a dispatcher re-reads only those
-- (store/snapshot.py's FleetCache) instead of every heartbeat on every step.
-- include: clock
-- Invariant: wchanged scores a worker by the Redis ms of the last change a snapshot reads:
-- a routing field of its heartbeat (ROUTING_FIELDS = store/snapshot.py's WORKER_FIELDS
-- but the id; a test checks they agree), its first beat, a change of its load:<w>, its
-- removal. remove_worker.lua trims entries older than CHANGES_KEEP_MS, so the set holds
-- the live workers and those removed within that time; a dispatcher that has not read
-- the changes for half that long reads the whole fleet instead.

local CHANGES_KEEP_MS = 60000
local ROUTING_FIELDS = {'model', 'params_b', 'state', 'slots', 'kv_cache_mib', 'kv_measured_free_mib'}

-- `now`: the caller's Redis ms if it has it (saves a TIME call), else read here.
local function worker_changed(p, w, now)
  redis.call('ZADD', p .. 'wchanged', now or now_ms(), w)
end

-- True when writing the field/value list `fields` to heartbeat hash `key` changes a
-- routing field (or the hash is new).
local function routing_changes(key, fields)
  local old = redis.call('HMGET', key, unpack(ROUTING_FIELDS))
  local at = {}
  for i, f in ipairs(ROUTING_FIELDS) do at[f] = i end
  for i = 1, #fields - 1, 2 do
    local j = at[fields[i]]
    if j and old[j] ~= fields[i + 1] then return true end
  end
  return false
end
