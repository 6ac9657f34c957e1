-- wake: tell a blocked dispatcher there is work (a submission, a requeue) or room (a
-- released slot). The list holds at most one token: many wake-ups cost one step.

local function wake(p)
  redis.call('LPUSH', p .. 'wake', '1')
  redis.call('LTRIM', p .. 'wake', 0, 0)
end
