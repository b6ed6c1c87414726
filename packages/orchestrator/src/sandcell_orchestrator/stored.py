"""Decoding what another worker stored: rows and answers a newer version may have written.

Operators run several workers on one Redis and one S3 and upgrade them one at a
time, so a row in the registry or an object in the store may come from a newer
worker with fields this one does not know: they are dropped, at any depth
(a stored copy of a wire message included: the protocol's messages refuse
unknown fields on the wire, where a peer announced its version first, but a
stored one had no such exchange). Everything else stays as strict as before:
wrong types, unknown enum values and missing fields without a default fail. A
field a newer version adds to a stored row therefore needs a default, so that
an older worker's rows decode on the newer one (pinned by
``tests/orchestrator/test_stored_rows.py``).

``StoredDecoder(T).decode`` takes the direct path (one typed decode) and only on
a validation failure looks for unknown fields to drop and decodes again.
Failures are msgspec's own (``msgspec.DecodeError`` and its ``ValidationError``).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec
import msgspec.inspect as mi

__all__ = ["StoredDecoder", "drop_unknown_fields"]

T = TypeVar("T")

_RECORD_TYPES = (mi.StructType, mi.DataclassType, mi.TypedDictType)
_ITEM_TYPES = (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)


class StoredDecoder(Generic[T]):
    """Decodes stored JSON into ``T``, ignoring fields this version does not know."""

    def __init__(self, type_: type[T]) -> None:
        self._decoder: msgspec.json.Decoder[T] = msgspec.json.Decoder(type_)
        self._info = mi.type_info(type_)

    def decode(self, data: bytes | str) -> T:
        try:
            return self._decoder.decode(data)
        except msgspec.ValidationError as first:
            tree = msgspec.json.decode(data)
            pruned = drop_unknown_fields(tree, self._info)
            if pruned == tree:
                raise first from None  # not an unknown field: the row is bad as it is
            return self._decoder.decode(msgspec.json.encode(pruned))


def drop_unknown_fields(value: Any, type_info: mi.Type) -> Any:
    """``value`` (decoded JSON) without the object keys ``type_info`` has no field for."""
    info = type_info.type if isinstance(type_info, mi.Metadata) else type_info
    if isinstance(info, _RECORD_TYPES) and isinstance(value, dict):
        fields = {field.encode_name: field.type for field in info.fields}
        tag_field = getattr(info, "tag_field", None)
        return {
            key: drop_unknown_fields(item, fields[key]) if key in fields else item
            for key, item in value.items()
            if key in fields or key == tag_field
        }
    if isinstance(info, _ITEM_TYPES) and isinstance(value, list):
        return [drop_unknown_fields(item, info.item_type) for item in value]
    if isinstance(info, mi.TupleType) and isinstance(value, list):
        typed = [drop_unknown_fields(v, t) for v, t in zip(value, info.item_types, strict=False)]
        return typed + value[len(info.item_types) :]
    if isinstance(info, mi.DictType) and isinstance(value, dict):
        return {key: drop_unknown_fields(item, info.value_type) for key, item in value.items()}
    if isinstance(info, mi.UnionType) and isinstance(value, dict):
        chosen = _member_for(value, info)
        return value if chosen is None else drop_unknown_fields(value, chosen)
    return value


def _member_for(value: dict[str, Any], union: mi.UnionType) -> mi.Type | None:
    """The union's record member an object decodes as: the one its tag names, or the
    only record member (msgspec allows no other union of objects)."""
    members = [member.type if isinstance(member, mi.Metadata) else member for member in union.types]
    records = [member for member in members if isinstance(member, _RECORD_TYPES)]
    for member in records:
        tag_field = getattr(member, "tag_field", None)
        if tag_field is not None and value.get(tag_field) == getattr(member, "tag", None):
            return member
    if len(records) == 1 and getattr(records[0], "tag_field", None) is None:
        return records[0]
    return None
