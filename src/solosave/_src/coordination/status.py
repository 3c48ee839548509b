"""The reuse status word: one int64 that every rank contributes to one ``all_reduce(BAND)``.

It carries the rank's status (failed / drifted / ok) and the identity of the save it is running,
so the one 8-byte collective of a reuse save both agrees on the outcome and detects ranks that
are out of step. Pure functions; re-exported by ``coordination/protocol.py``. The set-up word of an
``AsyncCheckpointer`` (:func:`encode_setup`) lives here too: one more word of the same kind.
"""

from __future__ import annotations

import enum
import hashlib
from typing import NamedTuple


class Status(enum.IntEnum):
    """A rank's reuse status; the agreed status is the minimum over ranks."""

    FAILED = 0
    DRIFT = 1
    OK = 2


# One int64, reduced with bitwise AND: bits 0-1 the status as a thermometer code (so AND is
# MIN), bits 2-31 the save's identity (15 bits of its sequence number, 15 bits of a hash of its
# directory), bits 32-61 their complement. If every rank ran the same save, the AND gives back
# the identity and its exact complement; if two ranks differ in an identity bit, that bit is 0
# in both halves, which every rank sees (the reduced value is the same everywhere). A rank whose
# save() raised does not know for sure which directory the others save to: it sends 1s in both
# halves of the directory part (a wildcard that AND leaves to the other ranks).

_STATUS_CODE = {Status.FAILED: 0b00, Status.DRIFT: 0b01, Status.OK: 0b11}
_CODE_STATUS = {v: k for k, v in _STATUS_CODE.items()}
_HALF = 15
_HALF_MASK = (1 << _HALF) - 1
_ID_BITS = 2 * _HALF
_ID_MASK = (1 << _ID_BITS) - 1


class SaveIdentity(NamedTuple):
    """Which save a rank is running: its sequence number's low bits and its directory's hash
    (``None``: any directory, see above)."""

    seq_bits: int
    dir_bits: int | None



def same_save(identities: list[SaveIdentity]) -> bool:
    """Every rank runs the same save (the planning gather's check; the status word makes the
    same check through the AND): one sequence number, one directory apart from wildcards."""
    return len({i.seq_bits for i in identities}) == 1 and len({i.dir_bits for i in identities} - {None}) <= 1


def save_identity(seq: int, directory: str | None) -> SaveIdentity:
    """The identity of one save, equal on every rank that runs it."""
    if directory is None:
        return SaveIdentity(seq & _HALF_MASK, None)
    digest = hashlib.blake2b(directory.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return SaveIdentity(seq & _HALF_MASK, int.from_bytes(digest, "little") & _HALF_MASK)


def encode_status(status: Status, ident: SaveIdentity) -> int:
    return encode_flags(_STATUS_CODE[status], ident)


def decode_status(word: int, ident: SaveIdentity) -> Status | None:
    """The agreed status, or ``None`` if the ranks were not all running save ``ident``."""
    code = decode_flags(word, ident)
    return None if code is None else _CODE_STATUS.get(code)


def encode_flags(flags: int, ident: SaveIdentity) -> int:
    """The same word with two independent flags (bits 0-1) instead of a status: after the AND,
    each flag holds on every rank or is 0 (two tiers: which copy every rank finds complete)."""
    seq_part = ident.seq_bits | ((~ident.seq_bits & _HALF_MASK) << _ID_BITS)
    if ident.dir_bits is None:
        dir_part = (_HALF_MASK << _HALF) | (_HALF_MASK << (_ID_BITS + _HALF))
    else:
        dir_part = (ident.dir_bits << _HALF) | ((~ident.dir_bits & _HALF_MASK) << (_ID_BITS + _HALF))
    return (flags & 0b11) | (seq_part << 2) | (dir_part << 2)


def decode_flags(word: int, ident: SaveIdentity) -> int | None:
    """The agreed flags, or ``None`` if the ranks did not all contribute a word of ``ident``."""
    code = word & 0b11
    ids = (word >> 2) & _ID_MASK
    comp = (word >> (2 + _ID_BITS)) & _ID_MASK
    seq, seq_c = ids & _HALF_MASK, comp & _HALF_MASK
    d, d_c = ids >> _HALF, comp >> _HALF
    if seq != ident.seq_bits or seq_c != (~ident.seq_bits & _HALF_MASK):
        return None
    if ident.dir_bits is not None:
        ok = d == ident.dir_bits and d_c == (~ident.dir_bits & _HALF_MASK)
    else:  # a wildcard: every rank a wildcard, or the others agree among themselves
        ok = (d == d_c == _HALF_MASK) or (d_c == (~d & _HALF_MASK))
    return code if ok else None


class SetupAgreement(NamedTuple):
    """What the set-up word of every rank's ``AsyncCheckpointer`` settled (the same everywhere):
    whether every rank set up, whether every rank or none has a durable tier, and whether every
    rank has the same peer copies' layout (the last two are meaningful when ``ok``)."""

    ok: bool
    same_durable: bool
    same_peers: bool


# bit 0 set up here; bit 1 durable_root here, bit 2 none (after the AND, both 0: some ranks only);
# bits 8-23 a 16-bit digest of the peer copies' layout (0: none), bits 24-39 its complement: equal
# on every rank exactly when the AND gives back the value and its complement (two layouts with the
# same digest pass: about one chance in 65,536, and the copier's transfers then fail, bounded).
def encode_setup(ok: bool, durable: bool, peers: str | None) -> int:
    code = 0 if peers is None else int.from_bytes(hashlib.sha256(peers.encode()).digest()[:2], "little") or 1
    return int(ok) | (0b010 if durable else 0b100) | code << 8 | (~code & 0xFFFF) << 24


def decode_setup(word: int) -> SetupAgreement:
    return SetupAgreement(bool(word & 1), bool(word & 0b110), (word >> 8) & 0xFFFF == ~(word >> 24) & 0xFFFF)
