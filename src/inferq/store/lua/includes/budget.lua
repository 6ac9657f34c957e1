-- budget: spending limits per tenant or API key, held at intake (submit.lua) and settled
-- when the request is final (finalize). P budget:<name>:<period> is a hash: ``held`` (what
-- the non-final requests admitted in that period may still cost: their estimate) and
-- ``spent`` (what the final ones cost); units are tokens or US dollars, as configured.
-- A period is a UTC day (d<epoch day>) or a calendar month (mYYYYMM), on Redis TIME.
-- Invariant: held + spent never exceeds the limit after an admission (the check and the
-- hold are one script), so a burst admits at most what fits; a request's hold is given
-- back exactly once, when it is made final (its spend is its metered figures).

-- (year, month) of an epoch day (H. Hinnant's civil_from_days).
local function civil_of(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

-- The epoch day of the first of month m of year y (days_from_civil).
local function first_of(y, m)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100)
    + math.floor((153 * mp + 2) / 5)
  return era * 146097 + doe - 719468
end

-- The period id of 'day' | 'month' at now_ms, and when it ends (ms).
local function budget_period(period, now)
  local day = math.floor(now / 86400000)
  if period == 'day' then return 'd' .. day, (day + 1) * 86400000 end
  local y, m = civil_of(day)
  local ny, nm = y, m + 1
  if nm > 12 then ny, nm = y + 1, 1 end
  return string.format('m%04d%02d', y, m), first_of(ny, nm) * 86400000
end

-- Settle a final request's holds: entries 'key,est,prompt rate,completion rate,gpu ms rate'.
local function budget_settle(holds, pt, ct, gpu_ms)
  for entry in string.gmatch(holds, '%S+') do
    local key, est, pr, cr, gr = string.match(entry, '^([^,]+),([^,]+),([^,]+),([^,]+),([^,]+)$')
    if key then
      local cost = (tonumber(pt) or 0) * tonumber(pr) + (tonumber(ct) or 0) * tonumber(cr)
        + (tonumber(gpu_ms) or 0) * tonumber(gr)
      redis.call('HINCRBYFLOAT', key, 'held', '-' .. est)
      if cost > 0 then redis.call('HINCRBYFLOAT', key, 'spent', tostring(cost)) end
    end
  end
end
