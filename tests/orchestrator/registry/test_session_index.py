"""The registry's session index (whose a session is), run against every backend."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sandcell_orchestrator.registry import SessionOwner, SessionRegistry

NewSessionId = Callable[[], str]


def owner(session_id: str, namespace: str = "tenant-a", hint: str = "h") -> SessionOwner:
    return SessionOwner(session_id=session_id, namespace=namespace, user_id="u", hint=hint)


async def test_indexed_sessions_are_found_per_namespace(
    registry: SessionRegistry, new_session_id: NewSessionId
) -> None:
    """A session is listed for its namespace only, by id; unknown ids answer None."""
    ns_a, ns_b = f"a-{new_session_id()[-8:]}", f"b:{new_session_id()[-8:]} x"
    ids = sorted(new_session_id() for _ in range(3))
    for sid in ids[:2]:
        await registry.index_session(owner(sid, ns_a))
    await registry.index_session(owner(ids[2], ns_b))
    assert [o.session_id for o in await registry.sessions_of(ns_a)] == ids[:2]
    assert await registry.sessions_of(ns_b) == [owner(ids[2], ns_b)]
    assert await registry.session_owner(ids[0]) == owner(ids[0], ns_a)
    assert await registry.session_owner(new_session_id()) is None
    assert await registry.sessions_of("nobody") == []


async def test_reindexing_moves_and_unindexing_forgets(
    registry: SessionRegistry, new_session_id: NewSessionId
) -> None:
    """The latest entry wins (also across namespaces); unindex is idempotent."""
    sid, ns_a, ns_b = new_session_id(), f"a{new_session_id()[-6:]}", f"b{new_session_id()[-6:]}"
    await registry.index_session(owner(sid, ns_a, hint="one"))
    await registry.index_session(owner(sid, ns_b, hint="two"))
    assert await registry.sessions_of(ns_a) == []
    assert await registry.sessions_of(ns_b) == [owner(sid, ns_b, hint="two")]
    await registry.unindex_session(sid)
    await registry.unindex_session(sid)
    assert await registry.session_owner(sid) is None
    assert await registry.sessions_of(ns_b) == []


async def test_index_takes_only_session_ids(registry: SessionRegistry) -> None:
    """Anything but rt_… is refused before it reaches a key."""
    with pytest.raises(ValueError, match="session_id"):
        await registry.session_owner("../x")
    with pytest.raises(ValueError, match="session_id"):
        SessionOwner(session_id="x", namespace="n", user_id="u", hint="h")


async def test_sessions_of_pages_by_after_and_limit(
    registry: SessionRegistry, new_session_id: NewSessionId
) -> None:
    """A page is the first ``limit`` ids strictly above ``after``, by id, of the namespace
    only: pages chained by their last id give every session once; a short page is the
    last; ``after`` need not be an indexed id."""
    ns_a, ns_b = f"a-{new_session_id()[-8:]}", f"b-{new_session_id()[-8:]}"
    ids = sorted(new_session_id() for _ in range(7))
    for sid in ids:
        await registry.index_session(owner(sid, ns_a))
    for _ in range(5):  # the other tenant's, interleaved with ns_a's by id
        await registry.index_session(owner(new_session_id(), ns_b))

    assert [o.session_id for o in await registry.sessions_of(ns_a, limit=3)] == ids[:3]
    assert [o.session_id for o in await registry.sessions_of(ns_a, after=ids[2])] == ids[3:]
    page = await registry.sessions_of(ns_a, after=ids[2], limit=2)
    assert [o.session_id for o in page] == ids[3:5]
    assert page[0] == owner(ids[3], ns_a)
    for limit in (1, 2, 3, 7, 8):
        seen: list[str] = []
        after: str | None = None
        while True:
            chunk = [
                o.session_id for o in await registry.sessions_of(ns_a, after=after, limit=limit)
            ]
            assert len(chunk) <= limit
            seen += chunk
            if len(chunk) < limit:
                break
            after = chunk[-1]
        assert seen == ids, limit
    assert await registry.sessions_of(ns_a, after=ids[-1], limit=5) == []
    assert await registry.sessions_of(ns_a, limit=0) == []
    # A prefix of ids[3]: below it, above ids[2] (unless they share 63 hex digits).
    assert [o.session_id for o in await registry.sessions_of(ns_a, after=ids[3][:-1])] == ids[3:]
    with pytest.raises(ValueError, match="limit"):
        await registry.sessions_of(ns_a, limit=-1)
