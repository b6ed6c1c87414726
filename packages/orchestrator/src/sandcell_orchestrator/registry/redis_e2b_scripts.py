"""The Lua scripts of the E2B table in Redis (``redis_e2b``): one atomic step each.

Each names, above it, what its KEYS and ARGV carry; the key layout they keep is in
``redis_e2b``'s docstring. A row's write and its index entries change in one script,
so no reader sees a row without its entries or entries without their row (but for
what an older orchestrator, which knows fewer keys, wrote: the readers put that
right).
"""

from __future__ import annotations

from .redis_db import legacy_move_lua

__all__ = [
    "ADD_E2B_LUA",
    "INDEX_E2B_LUA",
    "PAGE_E2B_BY_START_LUA",
    "PRUNE_E2B_IDS_LUA",
    "REMOVE_E2B_LUA",
    "UPDATE_E2B_LUA",
]

# KEYS[1] row hash, KEYS[2] every sandbox's zset, KEYS[3] the namespace's ids zset,
# KEYS[4] its zset by start time, KEYS[5] the running sandboxes' ends zset, KEYS[6] the
# namespace's running zset
# ARGV[1] row JSON, ARGV[2] started_at_s, ARGV[3] sandbox id, ARGV[4] namespace,
# ARGV[5] the row's revision, ARGV[6] its end_at_s if it is running, else ''
# Returns 1 if added, 0 if the id is taken.
ADD_E2B_LUA = """
if redis.call('exists', KEYS[1]) == 1 then
    return 0
end
redis.call('hset', KEYS[1], 'rev', ARGV[5], 'ns', ARGV[4], 'row', ARGV[1])
redis.call('zadd', KEYS[2], ARGV[2], ARGV[3])
redis.call('zadd', KEYS[3], 0, ARGV[3])
redis.call('zadd', KEYS[4], ARGV[2], ARGV[3])
if ARGV[6] ~= '' then
    redis.call('zadd', KEYS[5], ARGV[6], ARGV[3])
    redis.call('zadd', KEYS[6], ARGV[2], ARGV[3])
end
return 1
"""

# KEYS[1] row hash, KEYS[2] the running sandboxes' ends zset, KEYS[3] the namespace's
# running zset
# ARGV[1] the revision expected, ARGV[2] the new revision, ARGV[3] row JSON, ARGV[4] namespace,
# ARGV[5] sandbox id, ARGV[6] the new row's end_at_s if it is running, else '', ARGV[7] its
# started_at_s
# Returns 1 if replaced, 0 if the stored row is another revision, another namespace's or gone.
UPDATE_E2B_LUA = """
if redis.call('hget', KEYS[1], 'rev') == ARGV[1]
        and redis.call('hget', KEYS[1], 'ns') == ARGV[4] then
    redis.call('hset', KEYS[1], 'rev', ARGV[2], 'row', ARGV[3])
    if ARGV[6] ~= '' then
        redis.call('zadd', KEYS[2], ARGV[6], ARGV[5])
        redis.call('zadd', KEYS[3], ARGV[7], ARGV[5])
    else
        redis.call('zrem', KEYS[2], ARGV[5])
        redis.call('zrem', KEYS[3], ARGV[5])
    end
    return 1
end
return 0
"""

# KEYS[1] row hash, KEYS[2] every sandbox's zset, KEYS[3] the namespace's ids zset,
# KEYS[4] its legacy zset, KEYS[5] the id's killed mark, KEYS[6] its zset by start time,
# KEYS[7] the running sandboxes' ends zset, KEYS[8] the namespace's running zset
# ARGV[1] sandbox id, ARGV[2] namespace (the row's: the namespace zsets are its),
# ARGV[3] the mark's TTL in seconds
# Returns 1 if removed, 0 if there was no such row of that namespace. The mark is set
# either way, in the script: no worker sees the row gone without it.
REMOVE_E2B_LUA = """
redis.call('set', KEYS[5], '1', 'EX', ARGV[3])
redis.call('zrem', KEYS[2], ARGV[1])
redis.call('zrem', KEYS[3], ARGV[1])
redis.call('zrem', KEYS[4], ARGV[1])
redis.call('zrem', KEYS[6], ARGV[1])
redis.call('zrem', KEYS[7], ARGV[1])
redis.call('zrem', KEYS[8], ARGV[1])
if redis.call('hget', KEYS[1], 'ns') == ARGV[2] then
    redis.call('del', KEYS[1])
    return 1
end
return 0
"""

# KEYS[1] the namespace's zset by start time, KEYS[2] its ids zset, KEYS[3] every
# sandbox's zset (its scores are the start times), KEYS[4] its legacy zset
# ARGV[1] '1' newest first, else '0'; ARGV[2] the start time of the row the page follows
# ('' from the first), exactly as the row has it (a string: Lua's numbers print
# rounded); ARGV[3] that row's id; ARGV[4] how many ids
# Returns the page's ids, each followed by its score. First the legacy zset is moved
# into the ids zset (``legacy_move_lua``), and the ids of the ids zset the start zset
# lacks are added to it (rows an older orchestrator added); one of those with no start
# time in ``e2b_all`` is a removed row's (a removal by an orchestrator before the ids
# zset, after the move, leaves it) and is taken out of the ids zset, which only this
# script reads: else the zsets would stay unequal in size and every page would read
# the ids zset whole. Then the page: past the row's rank if the row is still there
# (ties on the start time go by id, the zset's own order); past its start time if it
# is gone, the ties at that very time read whole and filtered by id.
PAGE_E2B_BY_START_LUA = (
    legacy_move_lua("redis.call('zrange', KEYS[4], 0, -1)", ids="KEYS[2]", legacy="KEYS[4]")
    + """
local by_start, ids, all = KEYS[1], KEYS[2], KEYS[3]
if redis.call('zcard', by_start) < redis.call('zcard', ids) then
    local known = redis.call('zrange', ids, 0, -1)
    for i = 1, #known do
        if not redis.call('zscore', by_start, known[i]) then
            local started = redis.call('zscore', all, known[i])
            if started then
                redis.call('zadd', by_start, started, known[i])
            else
                redis.call('zrem', ids, known[i])
            end
        end
    end
end
local newest, at, after, count = ARGV[1] == '1', ARGV[2], ARGV[3], tonumber(ARGV[4])
if count <= 0 then
    return {}
end
local range, by_score, beyond = 'zrange', 'zrangebyscore', '+inf'
if newest then
    range, by_score, beyond = 'zrevrange', 'zrevrangebyscore', '-inf'
end
if at == '' then
    return redis.call(range, by_start, 0, count - 1, 'WITHSCORES')
end
local rank
if newest then
    rank = redis.call('zrevrank', by_start, after)
else
    rank = redis.call('zrank', by_start, after)
end
if rank and tonumber(redis.call('zscore', by_start, after)) == tonumber(at) then
    return redis.call(range, by_start, rank + 1, rank + count, 'WITHSCORES')
end
local page = {}
local ties = redis.call(by_score, by_start, at, at)
for i = 1, #ties do
    if #page < 2 * count and ((newest and ties[i] < after) or (not newest and ties[i] > after)) then
        page[#page + 1] = ties[i]
        page[#page + 1] = at
    end
end
if #page < 2 * count then
    local rest = redis.call(
        by_score, by_start, '(' .. at, beyond, 'WITHSCORES', 'LIMIT', 0, count - #page / 2
    )
    for i = 1, #rest do
        page[#page + 1] = rest[i]
    end
end
return page
"""
)

# KEYS[1] the running sandboxes' ends zset; for each row i, KEYS[2i] its hash and
# KEYS[2i + 1] its namespace's running zset
# ARGV[4i-3..4i] (ARGV[1] to ARGV[4] for the first row): row i's id, the revision it
# was read at, and its end_at_s and started_at_s if it is running ('' and '' if not)
# Puts each row in the two zsets (running) or takes it out of them (paused), as its
# state calls for, only if its hash is still at the revision read: a write since set
# the entries itself, and is not undone. Rows an older orchestrator wrote (it knows
# neither zset) are indexed this way: by the full sweep, and where a read finds an
# entry that does not match its row. Returns how many rows were at their revision.
INDEX_E2B_LUA = """
local done = 0
for i = 1, (#KEYS - 1) / 2 do
    local id, seen, ends, started = ARGV[4 * i - 3], ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i]
    if redis.call('hget', KEYS[2 * i], 'rev') == seen then
        if ends ~= '' then
            redis.call('zadd', KEYS[1], ends, id)
            redis.call('zadd', KEYS[2 * i + 1], started, id)
        else
            redis.call('zrem', KEYS[1], id)
            redis.call('zrem', KEYS[2 * i + 1], id)
        end
        done = done + 1
    end
end
return done
"""

# KEYS[1] a zset of ids (a namespace's ids, by id, by start or running; the ends),
# KEYS[2..] row hashes a read found missing
# ARGV[1], ARGV[2]... their sandbox ids (ARGV[i]'s hash is KEYS[i + 1])
# Takes out of the zset each id whose hash is still missing: an older orchestrator's
# removal leaves the id there (it knows only its own zsets). Checked in the script, so
# a row added again meanwhile (rebuilt after a wipe) keeps its id.
PRUNE_E2B_IDS_LUA = """
local pruned = 0
for i = 1, #ARGV do
    if redis.call('exists', KEYS[i + 1]) == 0 then
        pruned = pruned + redis.call('zrem', KEYS[1], ARGV[i])
    end
end
return pruned
"""
