"""The session index in Redis (``SessionIndex`` of ``RedisRegistry``).

<prefix>owners         hash    id -> SessionOwner JSON (the session index)
<prefix>ns:<sha256>    set     ids indexed for one namespace (hashed: any text)
"""

from __future__ import annotations

import hashlib
import logging

import msgspec

from .core import validate_session_id
from .index import SessionOwner
from .redis_db import RedisDatabase, map_redis_errors, text

__all__ = ["RedisSessionIndex"]

logger = logging.getLogger(__name__)


class RedisSessionIndex(RedisDatabase):
    """``SessionIndex`` on ``<prefix>owners`` and one set per namespace."""

    def _namespace_key(self, namespace: str) -> str:
        return f"{self._prefix}ns:{hashlib.sha256(namespace.encode()).hexdigest()}"

    async def index_session(self, owner: SessionOwner) -> None:
        """``HSET owners`` + ``SADD`` to the namespace's set, in one transaction."""
        previous = await self.session_owner(owner.session_id)
        with map_redis_errors("index_session"):
            async with self._client.pipeline(transaction=True) as pipe:
                if previous is not None and previous.namespace != owner.namespace:
                    pipe.srem(self._namespace_key(previous.namespace), owner.session_id)
                pipe.hset(f"{self._prefix}owners", owner.session_id, owner.to_json())
                pipe.sadd(self._namespace_key(owner.namespace), owner.session_id)
                await pipe.execute()

    async def session_owner(self, session_id: str) -> SessionOwner | None:
        """``HGET owners``; ``None`` if missing or unreadable."""
        validate_session_id(session_id)
        with map_redis_errors("session_owner"):
            raw = await self._client.hget(f"{self._prefix}owners", session_id)
        return None if raw is None else _decode_owner(raw)

    async def sessions_of(self, namespace: str) -> list[SessionOwner]:
        """The namespace's set, then ``HMGET owners`` (entries of another namespace skipped)."""
        with map_redis_errors("sessions_of"):
            members = await self._client.smembers(self._namespace_key(namespace))
            session_ids = sorted(text(member) for member in members)
            if not session_ids:
                return []
            raws = await self._client.hmget(f"{self._prefix}owners", session_ids)
        owners = (None if raw is None else _decode_owner(raw) for raw in raws)
        return [o for o in owners if o is not None and o.namespace == namespace]

    async def unindex_session(self, session_id: str) -> None:
        """``HDEL owners`` and ``SREM`` from its namespace's set."""
        previous = await self.session_owner(session_id)
        with map_redis_errors("unindex_session"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hdel(f"{self._prefix}owners", session_id)
                if previous is not None:
                    pipe.srem(self._namespace_key(previous.namespace), session_id)
                await pipe.execute()


def _decode_owner(raw: bytes | str) -> SessionOwner | None:
    try:
        return SessionOwner.from_json(raw)
    except (msgspec.DecodeError, ValueError):
        logger.warning("a session index entry is unreadable; skipping it")
        return None
