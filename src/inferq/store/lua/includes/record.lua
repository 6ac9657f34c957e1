-- record: a request's record is two keys, its hash (req:<id>) and its payload
-- (payload:<id>, the prompt or messages as JSON). The payload lives apart so the hash
-- keeps only short fields and stays a compact listpack (a value over Redis's
-- hash-max-listpack-value, 64 bytes by default, turns the whole hash into a hashtable
-- of ~50 bytes more per field). Both keys share one lifetime: these functions change it.
-- include: keys

local function record_expire(p, id, ttl_s)
  redis.call('EXPIRE', k_req(p, id), ttl_s)
  redis.call('EXPIRE', k_payload(p, id), ttl_s)
end

local function record_persist(p, id)
  redis.call('PERSIST', k_req(p, id))
  redis.call('PERSIST', k_payload(p, id))
end
