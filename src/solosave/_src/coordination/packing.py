"""Columnar forms of the item lists that ranks send in the collective path.

:func:`pack_specs` turns a rank's held items into :class:`~solosave._src.coordination.protocol.PackedSpecs` (the
planning gather) and :func:`written_columns` turns its write results into
:class:`~solosave._src.coordination.protocol.WrittenColumns` (the results gather): a few arrays per rank instead
of one tuple per item, so that the coordinator unpickles and matches W ranks' items with array
operations (``plan/global_plan``, ``plan/columns``). Pure functions; every rank calls them on its own
items.
"""

from __future__ import annotations

from array import array

from solosave._src.coordination.protocol import ItemKind, ItemSpec, PackedSpecs, WriteResult, WrittenColumns
from solosave._src.formats.dcp import ItemKey


def pack_specs(specs: list[ItemSpec]) -> PackedSpecs:
    """One rank's items in columnar form, for the planning gather: a few Python objects per
    rank instead of one tuple per item, so that the coordinator unpickles and merges W ranks'
    items with array operations (``plan/global_plan.py``). Integer columns use the smallest signed
    typecode that holds their values ("b", "i" or "q")."""
    fqns: list[str] = []
    kinds = bytearray()
    dt_index = bytearray()
    table: dict[str | None, int] = {}
    nbytes, ndims, numbers = array("q"), array("q"), array("q")
    for s in specs:
        o, z, g = s.offsets, s.sizes, s.global_size
        if o is None and z is None and g is None:
            ndims.append(-1)
        elif o is not None and z is not None and g is not None and len(o) == len(z) == len(g):
            ndims.append(len(o))
            numbers.extend(o)
            numbers.extend(z)
            numbers.extend(g)
        else:
            raise ValueError(f"internal: item {s.fqn!r} has offsets, sizes and global size of "
                             "different lengths")
        fqns.append(s.fqn)
        kinds.append(int(s.kind))
        dt_index.append(table.setdefault(s.dtype, len(table)))
        nbytes.append(s.nbytes)
    return PackedSpecs(fqns, bytes(kinds), list(table), bytes(dt_index), narrow(nbytes),
                       narrow(ndims), narrow(numbers))


def narrow(a: array) -> array:
    """``a`` with the smallest signed typecode of 1, 4 or 8 bytes that holds its values."""
    if not a:
        return array("b")
    lo, hi = min(a), max(a)
    for code, bound in (("b", 1 << 7), ("i", 1 << 31)):
        if array(code).itemsize * 8 == bound.bit_length() and -bound <= lo and hi < bound:
            return array(code, a)
    return a


def unpack_specs(packed: PackedSpecs) -> list[ItemSpec]:
    """The :class:`ItemSpec` objects of a :func:`pack_specs` payload (``owner`` and
    ``exclusive`` are not sent)."""
    kind_of = tuple(ItemKind)
    out = []
    pos = 0
    for i, fqn in enumerate(packed.fqns):
        nd = packed.ndims[i]
        if nd < 0:
            o = z = g = None
        else:
            nums = packed.numbers
            o = tuple(nums[pos:pos + nd])
            z = tuple(nums[pos + nd:pos + 2 * nd])
            g = tuple(nums[pos + 2 * nd:pos + 3 * nd])
            pos += 3 * nd
        out.append(ItemSpec(fqn, kind_of[packed.kinds[i]], o, z, g,
                            packed.dtype_table[packed.dtype_index[i]], packed.nbytes[i]))
    return out


def written_columns(held: list[ItemKey], rows: list[WriteResult]) -> WrittenColumns:
    """The :class:`WrittenColumns` of ``rows`` (keyed write results) against ``held`` (the keys
    of the rank's held list, in order). Raises ``ValueError`` for a row whose key is not held."""
    at = {k: i for i, k in enumerate(held)}
    files: dict[str, int] = {}
    positions, file, offset, length = array("q"), array("q"), array("q"), array("q")
    for key, rel, off, n in rows:
        i = at.get(key)
        if i is None:
            raise ValueError(f"internal: wrote item {key!r}, which this rank does not hold")
        positions.append(i)
        file.append(files.setdefault(rel, len(files)))
        offset.append(off)
        length.append(n)
    return WrittenColumns(narrow(positions), list(files), narrow(file), offset, length)
