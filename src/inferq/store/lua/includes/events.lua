-- events: an entry on the capped events stream, and the lifetime counters.

local function emit(p, maxlen, etype, ...)
  redis.call('XADD', p .. 'events', 'MAXLEN', '~', maxlen, '*', 'type', etype, ...)
end

local function stat(p, field, n)
  redis.call('HINCRBY', p .. 'stats', field, n or 1)
end
