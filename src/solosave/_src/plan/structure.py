"""Step 1, steady state: a save of an unchanged structure is checked, not planned again
(calling thread, every rank, no collective).

A training run saves the same structure again and again: the same keys, dtypes, shapes,
devices and shardings, only new values. :class:`StructureCache` keeps the
:class:`~solosave._src.plan.local_plan.LocalPlan` of the last structure it planned and, per save, walks the
state dict once (the same traversal and keys as ``flatten_state_dict``) and compares a cheap
signature per leaf (type, dtype, shape, layout, device; a DTensor's placements, mesh and local
shape; a checkpointable object's chunks, which its own methods list) with the cached one.
Equal: the cached specs (the same objects, so everything keyed on
them downstream is reused too) with this save's values. Different, or a leaf the signature
cannot vouch for: :func:`~solosave._src.plan.local_plan.plan_local` plans from scratch, with all its checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from solosave._src.coordination.protocol import ItemSpec
from solosave._src.plan.local_plan import (
    LocalPlan,
    _is_dtensor,
    _is_stateful,
    _is_terminal,
    checkpointable_items,
    is_checkpointable,
    local_shard,
    plan_local,
)

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    _DTensor = None  # type: ignore[assignment,misc]

#: Types that are always leaves (checked first: most leaves are tensors; FSDP2's are DTensors).
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, str, bool, bytes, type(None)}
                        | ({_DTensor} if _DTensor is not None else set()))
_PLAIN = (torch.Tensor, dict, list, int, float, str)


def resolve_stateful(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """Top-level ``Stateful`` values replaced by their ``state_dict()``, taken now (DCP's rule)."""
    if not isinstance(state_dict, Mapping):
        return state_dict
    if all(isinstance(v, _PLAIN) or not _is_stateful(v) for v in state_dict.values()):
        return state_dict
    return {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state_dict.items()}


def walk(state_dict: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    """The flattened keys and values, in traversal order (``flatten_state_dict``'s keys; its
    errors, e.g. two entries with one key, are left to the planning that follows a miss)."""
    keys: list[str] = []
    values: list[Any] = []
    stack: list[tuple[str, Any]] = [(str(k), v) for k, v in reversed(list(state_dict.items()))]
    while stack:
        key, value = stack.pop()
        if type(value) in _LEAF_TYPES:
            keys.append(key)
            values.append(value)
        elif isinstance(value, Mapping):
            stack.extend((f"{key}.{k}", v) for k, v in reversed(list(value.items())))
        elif _is_terminal(value):
            keys.append(key)
            values.append(value)
        else:
            stack.extend((f"{key}.{i}", v) for i, v in reversed(list(enumerate(value))))
    return keys, values


#: Marks a checkpointable object in a signature: its chunks are compared separately.
_CHUNKED = object()


def _signature(value: Any) -> Any:
    t = type(value)
    if t is torch.Tensor or t is torch.nn.Parameter:
        return (t, value.dtype, value.shape, value.layout, value.device)
    if t is _DTensor or _is_dtensor(value):
        local = local_shard(value)
        spec = getattr(value, "_spec", None)  # mesh, placements, global shape, stride and dtype
        if spec is not None:  # one object per DTensor: equal by identity save after save
            return (t, spec, local.shape, local.device)
        return (t, value.dtype, value.shape, value.placements, value.device_mesh, local.shape, local.device)
    if is_checkpointable(value):
        return (_CHUNKED, t)  # and its chunks, compared by the cache (it knows the key)
    if isinstance(value, torch.Tensor):
        return None  # a tensor subclass: planned (and refused) every time
    return t


class StructureCache:
    """The last planned structure of one checkpointer's state dicts (see the module docstring).

    Owned by the trainer-side :class:`~solosave._src.save.session.SaveSession`; one save at a time."""

    def __init__(self) -> None:
        self._keys: list[str] | None = None
        self._signature: list[Any] | None = None
        self._plan: LocalPlan | None = None
        #: Positions of the DTensor leaves of the cached structure (their shards are staged).
        self._dtensors: list[int] = []
        #: Position and chunk specs of each checkpointable leaf of the cached structure.
        self._chunked: list[tuple[int, list[ItemSpec]]] = []
        self.hits = 0

    def plan(self, state_dict: Mapping[str, Any]) -> LocalPlan:
        """This save's plan: the cached specs with new values when the structure is unchanged,
        else a new plan (which becomes the cached one)."""
        resolved = resolve_stateful(state_dict)
        if not isinstance(resolved, Mapping) or self._plan is None:
            return self._replan(resolved)
        keys, values = walk(resolved)
        if keys != self._keys:
            return self._replan(resolved)
        signature = [_signature(v) for v in values]
        if None in signature or signature != self._signature:
            return self._replan(resolved)
        cached = self._plan
        # plain tensors as they are (staging copies them without autograd); DTensors' shards
        fresh: dict[Any, Any] = dict(zip(keys, values))
        dtensors = {}
        for i in self._dtensors:
            fresh[keys[i]] = local_shard(values[i])
            dtensors[keys[i]] = values[i]
        if self._chunked and not self._fresh_chunks(keys, values, fresh):
            return self._replan(resolved)
        self.hits += 1
        return LocalPlan(cached.specs, fresh, cached.planner_data, by_key=cached.by_key, dtensors=dtensors)

    def _fresh_chunks(self, keys: list[str], values: list[Any], fresh: dict[Any, Any]) -> bool:
        """Put this save's chunks of the checkpointable leaves into ``fresh`` (by key, in place of
        the objects); ``False`` if some object now lists other chunks than the cached ones."""
        for i, specs in self._chunked:
            items = checkpointable_items(keys[i], values[i])
            if [s for s, _ in items] != specs:
                return False
            del fresh[keys[i]]
            fresh.update((s.key, shard) for s, shard in items)
        return True

    def _replan(self, state_dict: Any) -> LocalPlan:
        self._plan = self._keys = self._signature = None
        plan = plan_local(state_dict)
        keys, values = walk(state_dict)
        signature = [_signature(v) for v in values]
        if None not in signature:
            self._keys, self._signature, self._plan = keys, signature, plan
            self._dtensors = [i for i, v in enumerate(values) if _is_dtensor(v)]
            chunked = [i for i, sig in enumerate(signature) if type(sig) is tuple and sig[0] is _CHUNKED]
            by_fqn: dict[str, list[ItemSpec]] = {keys[i]: [] for i in chunked}
            for spec in plan.specs:
                if spec.fqn in by_fqn:
                    by_fqn[spec.fqn].append(spec)
            self._chunked = [(i, by_fqn[keys[i]]) for i in chunked]
        return plan
