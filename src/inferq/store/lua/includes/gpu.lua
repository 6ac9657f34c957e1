-- gpu: a worker's busy time shared among the requests it holds (the GPU-seconds that
-- meter.lua adds to the usage roll-ups).
-- load:<w> keeps, beside slots and mib, gpu_acc: the integral over Redis time of 1/slots
-- while slots > 0, in ms, brought up to date (gpu_t, Redis ms) at every change of slots
-- (assign.lua claims, release.lua gives back). A request's share is gpu_acc when it is
-- released minus gpu_acc when it was claimed (its gpu_mark).
-- Invariant: at each instant the worker's time is split equally among the requests holding
-- a slot on it, so the shares of all the requests a worker held (metered or not: an attempt
-- that failed is not metered) sum to the time it held at least one, its busy time.

-- gpu_acc brought up to `now` from the stored fields (strings or nil; absent: 0, no time).
local function gpu_acc_at(acc, t, slots, now)
  acc = tonumber(acc) or 0
  local since, n = tonumber(t), tonumber(slots) or 0
  if since and n > 0 and now > since then acc = acc + (now - since) / n end
  return acc
end

-- gpu_acc as stored: ms with 3 decimals (a worker's lifetime of ms keeps its precision).
local function gpu_fmt(acc)
  return string.format('%.3f', acc)
end
