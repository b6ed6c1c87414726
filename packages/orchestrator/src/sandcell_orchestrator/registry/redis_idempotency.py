"""Idempotency keys in Redis (``IdempotencyStore`` of ``RedisRegistry``).

<prefix>idem:<key>     hash    token, fingerprint, done, status, body of a claimed
                               idempotency key (a sha256 hex); PX-expiring
"""

from __future__ import annotations

from functools import cached_property

from redis.commands.core import AsyncScript

from ..errors import RegistryError
from .core import check_ttl
from .idempotency import IdempotencyEntry, validate_idempotency_key
from .redis_db import RedisDatabase, map_redis_errors, text

__all__ = [
    "CLAIM_IDEMPOTENCY_LUA",
    "DROP_IDEMPOTENCY_LUA",
    "FINISH_IDEMPOTENCY_LUA",
    "RENEW_IDEMPOTENCY_LUA",
    "RedisIdempotency",
]

# KEYS[1] idempotency key
# ARGV[1] token, ARGV[2] fingerprint, ARGV[3] ttl in ms
# Returns {} if claimed, else {fingerprint, done, status, body} of the holder.
CLAIM_IDEMPOTENCY_LUA = """
if redis.call('exists', KEYS[1]) == 0 then
    redis.call('hset', KEYS[1], 'token', ARGV[1], 'fingerprint', ARGV[2],
        'done', '0', 'status', '0', 'body', '')
    redis.call('pexpire', KEYS[1], ARGV[3])
    return {}
end
return redis.call('hmget', KEYS[1], 'fingerprint', 'done', 'status', 'body')
"""

# KEYS[1] idempotency key
# ARGV[1] token, ARGV[2] ttl in ms
# Returns 1 if the pending claim was extended, 0 if it is not ours (or answered).
RENEW_IDEMPOTENCY_LUA = """
if redis.call('hget', KEYS[1], 'token') == ARGV[1]
        and redis.call('hget', KEYS[1], 'done') == '0' then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] idempotency key
# ARGV[1] token, ARGV[2] status, ARGV[3] body, ARGV[4] ttl in ms
# Returns 1 if the answer was stored, 0 if the claim is not ours.
FINISH_IDEMPOTENCY_LUA = """
if redis.call('hget', KEYS[1], 'token') == ARGV[1] then
    redis.call('hset', KEYS[1], 'done', '1', 'status', ARGV[2], 'body', ARGV[3])
    return redis.call('pexpire', KEYS[1], ARGV[4])
end
return 0
"""

# KEYS[1] idempotency key
# ARGV[1] token
# Returns 1 if the pending claim was deleted, 0 if it is not ours (or answered).
DROP_IDEMPOTENCY_LUA = """
if redis.call('hget', KEYS[1], 'token') == ARGV[1]
        and redis.call('hget', KEYS[1], 'done') == '0' then
    return redis.call('del', KEYS[1])
end
return 0
"""


class RedisIdempotency(RedisDatabase):
    """``IdempotencyStore`` on ``<prefix>idem:<key>`` hashes."""

    @cached_property
    def _claim_idem(self) -> AsyncScript:
        return self._client.register_script(CLAIM_IDEMPOTENCY_LUA)

    @cached_property
    def _renew_idem(self) -> AsyncScript:
        return self._client.register_script(RENEW_IDEMPOTENCY_LUA)

    @cached_property
    def _finish_idem(self) -> AsyncScript:
        return self._client.register_script(FINISH_IDEMPOTENCY_LUA)

    @cached_property
    def _drop_idem(self) -> AsyncScript:
        return self._client.register_script(DROP_IDEMPOTENCY_LUA)

    def _idem_key(self, key: str) -> str:
        return f"{self._prefix}idem:{validate_idempotency_key(key)}"

    async def claim_idempotency(
        self, key: str, *, fingerprint: str, token: str, ttl_ms: int
    ) -> IdempotencyEntry | None:
        """Claim ``key`` unless someone has (``CLAIM_IDEMPOTENCY_LUA``); else its entry."""
        check_ttl(ttl_ms)
        with map_redis_errors("claim_idempotency"):
            found = await self._claim_idem(
                keys=[self._idem_key(key)], args=[token, fingerprint, ttl_ms]
            )
        if not found:
            return None
        held_fingerprint, done, status, body = found
        if held_fingerprint is None:
            # A hash without our fields was not written by this registry.
            raise RegistryError("idempotency entry is corrupt")
        raw = body if isinstance(body, bytes) else (body or "").encode()
        return IdempotencyEntry(
            fingerprint=text(held_fingerprint),
            done=text(done) == "1",
            status=int(status),
            body=raw,
        )

    async def renew_idempotency(self, key: str, *, token: str, ttl_ms: int) -> bool:
        """Extend ``token``'s pending claim (``RENEW_IDEMPOTENCY_LUA``)."""
        check_ttl(ttl_ms)
        with map_redis_errors("renew_idempotency"):
            result = await self._renew_idem(keys=[self._idem_key(key)], args=[token, ttl_ms])
        return bool(result)

    async def finish_idempotency(
        self, key: str, *, token: str, status: int, body: bytes, ttl_ms: int
    ) -> bool:
        """Store the answer of ``token``'s claim (``FINISH_IDEMPOTENCY_LUA``)."""
        check_ttl(ttl_ms)
        with map_redis_errors("finish_idempotency"):
            result = await self._finish_idem(
                keys=[self._idem_key(key)], args=[token, status, bytes(body), ttl_ms]
            )
        return bool(result)

    async def drop_idempotency(self, key: str, *, token: str) -> bool:
        """Forget ``token``'s pending claim (``DROP_IDEMPOTENCY_LUA``)."""
        with map_redis_errors("drop_idempotency"):
            result = await self._drop_idem(keys=[self._idem_key(key)], args=[token])
        return bool(result)
