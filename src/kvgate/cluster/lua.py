"""The Lua scripts the Redis store runs: each one atomic on the server, one round trip.

Key layout (both keys share the hash tag `{kvgate}`, so they live in one slot and a
script may touch both, as Redis Cluster requires of a script's keys):

- `kvgate:{kvgate}:members`: a sorted set, member id -> the instant (milliseconds of the
  store's own clock, `TIME`) after which that member is dead unless it beats again;
- `kvgate:{kvgate}:views`: a hash, member id -> that member's latest view (bytes).

`SYNC` is the whole of a replica's sync tick: it prunes the members whose heartbeat has
expired (and their views, in the same step, so no reader can ever see the view of a member
it no longer counts), beats for the caller, stores its view, and returns the store's time
and every live view. Deadlines come from the server's clock, so the replicas' own clocks
never have to agree. Both keys expire with the last beat: when every replica is gone, the
store forgets the cluster by itself.
"""

from __future__ import annotations

MEMBERS_KEY = "kvgate:{kvgate}:members"
VIEWS_KEY = "kvgate:{kvgate}:views"

#: KEYS: members, views. ARGV: member id, view, heartbeat ttl (ms).
#: Returns {seconds, microseconds, {id1, view1, id2, view2, ...}}.
SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(dead))
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return {t[1], t[2], redis.call('HGETALL', KEYS[2])}
"""

#: KEYS: members, views. ARGV: member id. A replica that stops leaves at once.
LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('HDEL', KEYS[2], ARGV[1])
"""
