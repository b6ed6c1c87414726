"""What a checkpoint restore accepts at the tar level.

tarfile only parses header blocks; these rules sit on top of it. The extractor
(``extractor.py``) walks the archive with ``StrictTarInfo.next_member`` and
checks every name with ``workspace_relpath``; the exporter (``export.py``)
writes nothing they would refuse.
"""

from __future__ import annotations

import re
import struct
import tarfile
from collections.abc import Callable

from sandcell_protocol import ProtocolError, validate_workspace_path
from sandcell_protocol.routes import CHECKPOINT_WORKSPACE_PREFIX

from ..errors import ArchiveRejectedError

MAX_META_BYTES = 32 << 20
PERMISSION_BITS = 0o777
"""Mode bits that survive a checkpoint: never setuid, setgid or sticky."""


def symlink_target_inside(relpath: str, target: str) -> bool:
    """Whether a symlink at workspace path ``relpath`` provably points inside.

    Stricter than lexical normalisation: ``..`` may only lead the target, and no
    further than the link's depth. ``a/..`` is refused because the kernel
    resolves ``a`` first, and if ``a`` is itself a symlink, ``..`` leaves from
    wherever ``a`` leads; with this rule every link resolves inside by induction.
    """
    if not target or target.startswith("/") or "\x00" in target:
        return False
    if len(target.encode("utf-8", "surrogateescape")) > 4096:
        return False
    depth = relpath.count("/")
    climbing = True
    for part in target.split("/"):
        if part in ("", "."):
            continue
        if part != "..":
            climbing = False
        elif not climbing:
            return False
        else:
            depth -= 1
            if depth < 0:
                return False
    return True


__all__ = [
    "ReadExact",
    "StrictTarInfo",
    "member_mtime_ns",
    "parse_pax_records",
    "shown",
    "workspace_relpath",
]

_PAX_MAX_BYTES = 16 << 10
# A header block's bytes with its 8-byte checksum field skipped (counted as spaces).
_CHECKSUM_UNSIGNED = struct.Struct("148B8x356B")
_CHECKSUM_SIGNED = struct.Struct("148b8x356b")
_PAX_KEYS = frozenset({"path", "linkpath", "mtime", "size"})
_MTIME_RE = re.compile(r"(-?)([0-9]{1,11})(?:\.([0-9]{1,9}))?")
_MAX_MTIME_S = 10**11
_ALLOWED_TYPES = frozenset(
    {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.XHDTYPE}
)
_REFUSED_TYPES = {
    tarfile.LNKTYPE: "hard links are not allowed",
    tarfile.CHRTYPE: "character devices are not allowed",
    tarfile.BLKTYPE: "block devices are not allowed",
    tarfile.FIFOTYPE: "FIFOs are not allowed",
    tarfile.XGLTYPE: "global PAX headers are not allowed",
    tarfile.GNUTYPE_SPARSE: "sparse members are not allowed",
}


ReadExact = Callable[[int], bytes]
"""``read(n)`` of the decompressed tar stream: ``n`` bytes, fewer only where it ends."""


class StrictTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses, at parse time, everything a checkpoint never holds.

    tarfile parses each header block (``frombuf``); ``next_member`` walks the
    stream instead of tarfile's stream reader, so that the extractor can copy
    member data straight from the decompressor. On top of tarfile's header
    parser: member types are checked from the header before any data is read;
    a bad or missing header past the first fails instead of quietly ending the
    archive; PAX headers (per-member only, at most 16 KiB, known keys only) are
    parsed by ``parse_pax_records`` in linear time instead of tarfile's
    backtracking regexes (CVE-2024-6232 is not fixed in 3.11.7).
    """

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> StrictTarInfo:
        if len(buf) == tarfile.BLOCKSIZE and not buf.strip(b"\0"):
            # The end-of-archive marker: tarfile raises its EOF error. Only a
            # PAX header's member can get here (next_member stops before).
            return super().frombuf(buf, encoding, errors)
        try:
            info = super().frombuf(buf, encoding, errors)
        except tarfile.HeaderError as exc:
            raise ArchiveRejectedError(f"tar: {exc} (corrupt or truncated archive)") from None
        except UnicodeError:
            raise ArchiveRejectedError("tar: a member name is not UTF-8") from None
        if info.type in _REFUSED_TYPES:
            raise ArchiveRejectedError(f"tar: {_REFUSED_TYPES[info.type]} ({shown(info.name)})")
        if info.type not in _ALLOWED_TYPES:
            raise ArchiveRejectedError(f"tar: unsupported member type {info.type!r}")
        if info.size < 0 or (info.type in (tarfile.DIRTYPE, tarfile.SYMTYPE) and info.size):
            raise ArchiveRejectedError(f"tar: bad size in header of {shown(info.name)}")
        if info.type == tarfile.XHDTYPE and info.size > _PAX_MAX_BYTES:
            raise ArchiveRejectedError("tar: PAX header too large")
        if info.isdir():
            # What tarfile's member processing does after frombuf: a ustar
            # prefix joined to an empty name leaves a trailing slash.
            info.name = info.name.rstrip("/")
        return info

    @classmethod
    def next_member(cls, read: ReadExact) -> StrictTarInfo | None:
        """The next member's header (and PAX header), or None at the end-of-archive marker.

        Reads headers only: the caller then reads ``size`` bytes of data and
        the padding to the next 512-byte block.
        """
        buf = read(tarfile.BLOCKSIZE)
        if len(buf) == tarfile.BLOCKSIZE and not buf.strip(b"\0"):
            return None
        if len(buf) == tarfile.BLOCKSIZE and buf[156:157] == tarfile.XHDTYPE:
            pax_size = _pax_header_size(buf)
        else:
            return cls.frombuf(buf, "utf-8", "strict")
        padded = _padded(pax_size)
        pax = read(padded)
        if len(pax) != padded:
            raise ArchiveRejectedError("tar: truncated PAX header")
        records = parse_pax_records(pax[:pax_size])
        try:
            member = cls.frombuf(read(tarfile.BLOCKSIZE), "utf-8", "strict")
        except tarfile.HeaderError:
            raise ArchiveRejectedError("tar: PAX header not followed by a member") from None
        if member.type == tarfile.XHDTYPE:
            raise ArchiveRejectedError("tar: two PAX headers in a row")
        if "path" in records:
            member.name = records["path"].rstrip("/") if member.isdir() else records["path"]
        if "linkpath" in records:
            member.linkname = records["linkpath"]
        if "size" in records:
            size = records["size"]
            if not member.isreg() or not (size.isascii() and size.isdigit() and len(size) < 20):
                raise ArchiveRejectedError("tar: bad PAX size")
            member.size = int(size)
        member.pax_headers = records
        return member


def parse_pax_records(buf: bytes) -> dict[str, str]:
    """Parse ``"<len> <key>=<value>\\n"`` records strictly; any deviation is refused."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(buf):
        space = buf.find(b" ", pos, pos + 8)
        digits = buf[pos:space] if space > pos else b""
        if not digits.isdigit() or digits.startswith(b"0"):
            raise ArchiveRejectedError("tar: malformed PAX record length")
        end = pos + int(digits)
        if end > len(buf) or buf[end - 1 : end] != b"\n":
            raise ArchiveRejectedError("tar: PAX record overruns its header")
        key, eq, value = buf[space + 1 : end - 1].partition(b"=")
        try:
            key_text, value_text = key.decode("ascii"), value.decode("utf-8")
        except UnicodeError:
            raise ArchiveRejectedError("tar: PAX record is not UTF-8") from None
        if not eq or key_text not in _PAX_KEYS or key_text in records:
            raise ArchiveRejectedError(f"tar: unexpected PAX record {key_text!r}")
        records[key_text] = value_text
        pos = end
    return records


def workspace_relpath(name: str) -> str | None:
    """``workspace/<relpath>`` to ``relpath``, ``workspace`` to None; refuse anything else.

    The relpath must already be normalized: the exporter writes it so, and two
    spellings of one path are how duplicate checks get fooled.
    """
    if name.startswith("/"):
        raise ArchiveRejectedError(f"absolute member name {shown(name)}")
    if ".." in name.split("/"):
        raise ArchiveRejectedError(f"member name {shown(name)} contains '..'")
    if name == CHECKPOINT_WORKSPACE_PREFIX:
        return None
    prefix = CHECKPOINT_WORKSPACE_PREFIX + "/"
    if not name.startswith(prefix):
        raise ArchiveRejectedError(f"member {shown(name)} is outside {prefix}")
    relpath = name[len(prefix) :]
    try:
        normalized = validate_workspace_path(relpath)
    except ProtocolError as exc:
        raise ArchiveRejectedError(f"member {shown(name)}: {exc}") from None
    if normalized != relpath:
        raise ArchiveRejectedError(f"member name {shown(name)} is not normalized")
    return relpath


def member_mtime_ns(member: tarfile.TarInfo) -> int:
    """The member's mtime in ns: the exporter's PAX record if any, else the header's."""
    text = member.pax_headers.get("mtime")
    if text is None:
        seconds = int(member.mtime)
        if abs(seconds) >= _MAX_MTIME_S:
            raise ArchiveRejectedError(f"mtime out of range in {shown(member.name)}")
        return seconds * 1_000_000_000
    match = _MTIME_RE.fullmatch(text)
    if match is None:
        raise ArchiveRejectedError(f"bad mtime {text[:40]!r} in {shown(member.name)}")
    sign, seconds_text, fraction = match.groups()
    value = int(seconds_text) * 1_000_000_000 + int((fraction or "").ljust(9, "0"))
    return -value if sign else value


def shown(name: str) -> str:
    """A member name for an error message: quoted, and short."""
    return repr(name if len(name) <= 120 else name[:120] + "...")


def _pax_header_size(buf: bytes) -> int:
    """The data size a PAX header block announces, its checksum and size checked.

    Not ``frombuf``: it decodes every field of the block (~15 us a member, and
    the exporter writes a PAX header before nearly every member), while only the
    checksum and the size of a PAX header's own block are ever used. tarfile's
    field helpers (``nti``, ``calc_chksums``) are private, so the two fields are
    read here, the checksum the way tarfile computes it.
    """
    checksum = _octal_field(buf[148:156])
    size = _octal_field(buf[124:136])
    unsigned = 256 + sum(_CHECKSUM_UNSIGNED.unpack_from(buf))
    signed = 256 + sum(_CHECKSUM_SIGNED.unpack_from(buf))
    if checksum not in (unsigned, signed):
        raise ArchiveRejectedError("tar: bad checksum (corrupt or truncated archive)")
    if size > _PAX_MAX_BYTES:
        raise ArchiveRejectedError("tar: PAX header too large")
    return size


def _octal_field(field: bytes) -> int:
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not digits or digits.strip(b"01234567"):
        raise ArchiveRejectedError("tar: invalid number in a PAX header block")
    return int(digits, 8)


def _padded(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
