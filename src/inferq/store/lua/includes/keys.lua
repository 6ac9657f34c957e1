-- keys: per-request and per-worker key names, rebuilt from the prefix (ARGV) in a script.
-- They mirror inferq/store/keys.py; tests/unit/test_store_keys.py checks they agree.

local function k_req(p, id) return p .. 'req:' .. id end
local function k_payload(p, id) return p .. 'payload:' .. id end
local function k_done(p, id) return p .. 'done:' .. id end
local function k_stream(p, id) return p .. 'stream:' .. id end
local function k_worker(p, w) return p .. 'worker:' .. w end
local function k_load(p, w) return p .. 'load:' .. w end
local function k_inflight(p, w) return p .. 'inflight:' .. w end
local function k_ctl(p, w) return p .. 'ctl:' .. w end
local function k_caller(p, c) return p .. 'caller:' .. c end
local function k_prefixlog(p) return p .. 'prefixlog' end
-- A tenant's sub-queue of one queue, and the queue's tenant index. The route is
-- length-prefixed (routes and tenants may both hold ':'), so no two (route, tenant)
-- pairs share a sub-queue.
local function k_tqueue(p, class, route, tenant)
  return p .. 'tq:' .. class .. ':' .. string.len(route) .. ':' .. route .. ':' .. tenant
end
local function k_tindex(p, class, route) return p .. 'tix:' .. class .. ':' .. route end
