"""The scale simulation: what grows with the world size, measured in one process.

We cannot run thousands of ranks here, so this module builds, for W simulated ranks, exactly
the objects each rank would send on a save and runs the coordinator's real code on them.

**Structure** (``llama_like``): a Llama-7B-like model of 200 fp32 tensors (embedding
[32000, 4096]; 22 layers of q/k/v/o [4096, 4096], gate/up [11008, 4096], down [4096, 11008] and
two norms [4096]; final norm), every tensor sharded on dim 0 over W ranks as a 1-D FSDP
``DTensor`` with ``Shard(0)`` is (ceil-sized chunks; trailing ranks may hold empty chunks),
``workers`` files per rank. The state of rank r is ``{"model": {name: shard}}``.

**What is measured** (wall time in this process, ``time.perf_counter``; sizes with ``pickle``):

* stock DCP (torch's own code): each rank's ``SavePlan`` from
  ``DefaultSavePlanner.set_up_planner`` + ``create_local_plan`` +
  ``FileSystemWriter.prepare_local_plan`` (the shards are stand-ins implementing the
  ``__create_write_items__`` protocol with the items a ``DTensor`` creates), pickled as
  ``gather_object`` pickles it; the coordinator: unpickling W plans, ``create_global_plan``
  (dedup, global plan, ``_validate_global_plan``) + ``prepare_global_plan``, pickling the W
  scattered plans, unpickling W write-result lists (``WriteResult`` with ``_StorageInfo``),
  ``FileSystemWriter.finish`` (builds ``storage_data``, pickles and writes ``.metadata`` with
  fsync), and pickling the ``Metadata`` that ``_DistWrapper.all_reduce`` broadcasts to every rank.
* solosave, collective path (solosave's own functions, ``solosave._src.engine.collective``; no stand-ins):
  each rank's gather payload (``plan_request`` of a real ``SaveJob`` of a create save: columnar
  specs, staged positions only when not every held item is staged, flatten mapping), pickled as
  the channel pickles it; the coordinator's unpickling, ``decide`` (lock-step check and
  ``_global_plan.global_plan``: merge, chunk tiling, writer assignment, DCP's
  ``state_dict_metadata``), pickling the scattered ``PlanDecision`` s, unpickling the
  ``WriteReport`` s (``bucket_items`` layout, as ``write_assigned`` makes it), ``finish`` with the
  coordinator's real ``RankIO`` (``finish`` calls no collective): results
  cover the plan, ``Metadata``, ``MetadataTemplate``, the prepared file, the load index written
  (fsync), atomic ``.metadata`` write with fsync; and pickling the ``FinishNotice`` broadcast, which carries the metadata now
  prepared to every rank (the coordinator total includes pickling it, as DCP's includes pickling
  its ``Metadata`` broadcast). For comparison the planning payload is also built in the wire form
  solosave used before the typed protocol (a plain 6-tuple, rebuilt in this module): the
  simulation fails if the new payload is larger (``plan_bytes_*_old_form``; likewise, reported
  only, ``scatter_bytes_old_form`` and ``result_bytes_*_old_form``).
* solosave, reuse path (``measure_startup``), from the prepared file the create save wrote
  (``finish`` with a ``prepared_path``: the sectioned format of ``solosave._src.prepared.sections``): per
  sampled rank (0, W/2, W-1) the start-up a rank runs - ``load_prepared_metadata`` (header),
  ``check_compatible``, the first ``plan_reuse`` (its own section, the structure, the directory
  buckets of items other ranks write) - timed and with the bytes it read, and the pickled size of
  the prepared metadata its trainer sends its worker; the coordinator's template read at start-up
  (``t_template_once``) or adoption of the create save's template (``t_template_after_create``);
  per save ``render`` + ``commit_checkpoint`` (atomic write, fsync) and, apart, the load index
  write that the coordinator runs beside its data writes, and per rank per save
  ``plan_reuse`` + ``check_layout`` (the layout guard) on that rank's write results.
* loading (``measure_load``): per sampled rank, what ``solosave.load`` runs before DCP's
  planner: open the load index, check it against ``.metadata``, and build the ``Metadata`` of
  the shards this rank saved (``LoadIndex.metadata_for``), timed with the bytes read; for
  comparison ``pickle.loads`` of the whole ``.metadata`` (what every loading rank of stock DCP
  does) and solosave's allowlisted ``safe_loads`` (``use_index=False``).

**What is modelled, not measured**: the network (no bytes move; gathered bytes are reported, not
timed), the reuse path's one 1-element ``all_reduce`` (``REDUCE_MODEL_S`` per tree level,
``ceil(log2 W)`` levels), and the record lengths in the files (tensor bytes + a fixed
``torch.save`` overhead measured once). Every rank's payload is built and pickled for real.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import shutil
import statistics
import tempfile
import time
import uuid
from array import array
from collections import defaultdict
from collections.abc import Callable
from typing import Any

Json = dict[str, Any]

#: Modelled latency of one tree level of a 1-element all_reduce (50 us: a fast network hop).
REDUCE_MODEL_S = 50e-6


# ---------------------------------------------------------------------------------------------
# The structure
# ---------------------------------------------------------------------------------------------

def llama_like(layers: int = 22, hidden: int = 4096, ffn: int = 11008, vocab: int = 32000
               ) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of a Llama-7B-like model: ``2 + 9 * layers`` tensors (200 for 22)."""
    out = [("embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (hidden, hidden)),
                (p + "self_attn.k_proj.weight", (hidden, hidden)),
                (p + "self_attn.v_proj.weight", (hidden, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, hidden)),
                (p + "mlp.gate_proj.weight", (ffn, hidden)),
                (p + "mlp.up_proj.weight", (ffn, hidden)),
                (p + "mlp.down_proj.weight", (hidden, ffn)),
                (p + "input_layernorm.weight", (hidden,)),
                (p + "post_attention_layernorm.weight", (hidden,))]
    out.append(("norm.weight", (hidden,)))
    return out


def shard_dim0(shape: tuple[int, ...], world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offsets and sizes of rank ``rank``'s ``Shard(0)`` chunk (DTensor's ceil rule)."""
    chunk = -(-shape[0] // world)
    start = min(rank * chunk, shape[0])
    size = max(0, min(chunk, shape[0] - start))
    return (start,) + (0,) * (len(shape) - 1), (size,) + tuple(shape[1:])


_RECORD_OVERHEAD: int | None = None


def record_overhead() -> int:
    """Bytes a ``torch.save`` record adds to a tensor's data (measured once, small tensor)."""
    global _RECORD_OVERHEAD  # a memo of a constant of this torch build, not state
    if _RECORD_OVERHEAD is None:
        import io

        import torch

        buf = io.BytesIO()
        torch.save(torch.zeros(1024, dtype=torch.float32), buf)
        _RECORD_OVERHEAD = len(buf.getvalue()) - 4096
    return _RECORD_OVERHEAD


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# solosave
# ---------------------------------------------------------------------------------------------

def solosave_rank_specs(structure: list[tuple[str, tuple[int, ...]]], world: int, rank: int) -> list:
    """Rank ``rank``'s items (``ItemSpec``), sorted by fqn as ``_plan.plan_local`` sorts them."""
    from solosave._src.coordination.protocol import ItemKind, ItemSpec

    specs = []
    for name, shape in structure:
        off, sz = shard_dim0(shape, world, rank)
        specs.append(ItemSpec("model." + name, ItemKind.TENSOR, off, sz, shape, "float32",
                              4 * math.prod(sz), True))
    specs.sort(key=lambda s: s.fqn)
    return specs


def solosave_job(specs: list, directory: str, seq: int = 1, reuse: bool = False) -> Any:
    """The ``SaveJob`` a rank's session builds for a create save of ``specs`` (``reuse``: for a
    reuse save, which takes the collective path when its layout drifted): every item held and
    staged (tensors at made-up buffer offsets; no buffer: nothing is written here)."""
    from solosave._src.coordination.protocol import Mode, SaveJob, StagedItem, StagedSave

    planner_data = {s.fqn: ("model", s.fqn[len("model."):]) for s in specs}
    return SaveJob(seq=seq, directory=directory, mode=Mode.REUSE if reuse else Mode.COLLECTIVE,
                   staged=StagedSave(None, 0, tuple(StagedItem(s) for s in specs)),
                   held=tuple(specs), planner_data=planner_data, creates_prepared=not reuse)


def _dumps(obj: Any) -> bytes:
    """Pickled as ``solosave._src.coordination.channel`` pickles every collective payload."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def solosave_plan_payload(job: Any) -> bytes:
    """One rank's planning gather payload: ``_collective.plan_request`` (no pre-written
    results, no drifts), pickled as the channel pickles it."""
    from solosave._src.engine.collective import plan_request

    return _dumps(plan_request(job, None, []))


def old_plan_payload(job: Any) -> bytes:
    """The same rank's planning payload in the wire form solosave used before the typed protocol,
    rebuilt here for comparison (not imported): the 6-tuple ``(("cols", fqns, kinds, dtype_table,
    dtype_index, nbytes, ndims, numbers), staged positions, planner_data, prewritten, drifts,
    identity)``, whose staged positions were always an ``array("q")`` of every staged item and
    whose identity was an int."""
    from solosave._src.coordination.packing import pack_specs

    packed = pack_specs(list(job.held))
    old = (("cols",) + tuple(packed), array("q", range(len(job.held))), job.planner_data, None, [], 123456789)
    return _dumps(old)


def solosave_results(specs: list, rank: int, workers: int) -> list:
    """The write results ``FileWriter`` reports for ``specs`` (the items assigned to ``rank``):
    ``bucket_items`` decides files and order, as ``_collective.write_assigned`` does; lengths are
    modelled (see module docstring)."""
    from solosave._src.formats.dcp import file_name
    from solosave._src.plan.layout import bucket_items

    over = record_overhead()
    results = []
    for n, bucket in enumerate(bucket_items(specs, workers)):
        off = 0
        for s in bucket:
            length = s.nbytes + over
            results.append((s.key, file_name(rank, n), off, length))
            off += length
    return results


def coordinator_io(workers: int, prepared_path: str | None = None) -> tuple[Any, Any]:
    """The coordinator's engine settings and its real ``RankIO`` (rank 0), what ``finish`` and
    ``write_assigned`` take (neither calls a collective)."""
    from solosave._src.coordination.protocol import EngineSettings
    from solosave._src.engine.rank_io import RankIO
    from solosave._src.write.writer import FileWriter

    return EngineSettings(files_per_rank=workers, prepared_path=prepared_path), RankIO(0, FileWriter(fsync=True))


def simulate_solosave(structure: list, world: int, workers: int, directory: str) -> Json:
    """The collective path's coordinator work and the reuse path's, at world size ``world``."""
    from solosave._src.coordination.packing import written_columns
    from solosave._src.coordination.protocol import Verdict, WriteReport
    from solosave._src.engine.collective import decide, finish
    from solosave._src.plan.chunks import validate_chunks

    out: Json = {"world": world}
    ckpt = os.path.join(directory, f"solosave_w{world}")
    os.makedirs(ckpt, exist_ok=True)
    t0 = time.perf_counter()
    plan_payloads, old_sizes = [], []
    coord_job = None
    for r in range(world):
        job = solosave_job(solosave_rank_specs(structure, world, r), ckpt)
        plan_payloads.append(solosave_plan_payload(job))
        if r == 0:
            coord_job = job
    out["build_rank_payloads_s"] = time.perf_counter() - t0
    for r in range(world):  # the old wire form, for comparison only (not timed)
        old_sizes.append(len(old_plan_payload(solosave_job(solosave_rank_specs(structure, world, r), ckpt))))
    out["plan_bytes_per_rank"] = statistics.median(map(len, plan_payloads))
    out["plan_bytes_gathered"] = sum(map(len, plan_payloads))
    out["plan_bytes_per_rank_old_form"] = statistics.median(old_sizes)
    out["plan_bytes_gathered_old_form"] = sum(old_sizes)
    if out["plan_bytes_gathered"] > out["plan_bytes_gathered_old_form"]:
        raise RuntimeError(f"the planning payload grew at W={world}: {out['plan_bytes_gathered']} bytes "
                           f"gathered, {out['plan_bytes_gathered_old_form']} in the old form")

    prepared_path = os.path.join(directory, f"prepared_w{world}.metadata")
    settings, io = coordinator_io(workers, prepared_path)
    requests, out["t_unpickle_plans"] = _timed(lambda: [pickle.loads(b) for b in plan_payloads])
    plan_payloads = None  # free it (a large object)
    (decisions, plan), out["t_global_plan"] = _timed(lambda: decide(coord_job, requests, 0))
    if decisions[0].verdict is not Verdict.OK:
        raise RuntimeError(f"solosave global plan failed at W={world}: {decisions[0]}")
    requests = None  # free it (a large object)
    sdm = plan.state_dict_metadata
    _, out["t_validate_chunks_only"] = _timed(lambda: [
        validate_chunks(f, tuple(m.size), [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks])
        for f, m in sdm.items() if hasattr(m, "chunks")])
    scattered, out["t_scatter_pickle"] = _timed(lambda: [_dumps(d) for d in decisions])
    out["scatter_bytes"] = sum(map(len, scattered))
    # The old wire form of a decision: ("ok", writes, skip_write, validated, drifts).
    out["scatter_bytes_old_form"] = sum(len(_dumps(("ok", w, d.skip_write, False, dict(d.drifts))))
                                        for d, w in zip(decisions, plan.writes))
    scattered = None  # free it (a large object)

    # Every rank writes the items the coordinator assigned to it: positions in its held list
    # (empty trailing chunks have the same key on several ranks: like replicated items, one of
    # them writes).
    sample_ranks = sorted({0, world // 2, world - 1})
    samples: dict[int, tuple[list, list]] = {}
    result_payloads, old_results = [], []
    for r in range(world):
        held = solosave_rank_specs(structure, world, r)
        specs = [held[i] for i in plan.writes[r]]
        results = solosave_results(specs, r, workers)
        result_payloads.append(_dumps(WriteReport(written_columns([s.key for s in held], results), None)))
        old_results.append(len(_dumps((results, None))))
        if r in sample_ranks:
            samples[r] = (held, results)
    decisions = None  # free it (a large object)
    out["result_bytes_per_rank"] = statistics.median(map(len, result_payloads))
    out["result_bytes_gathered"] = sum(map(len, result_payloads))
    out["result_bytes_per_rank_old_form"] = statistics.median(old_results)
    out["result_bytes_gathered_old_form"] = sum(old_results)
    reports, out["t_unpickle_results"] = _timed(lambda: [pickle.loads(b) for b in result_payloads])
    result_payloads = None  # free it (a large object)
    # The create save (creates_prepared, a prepared file): ``finish`` checks the results cover the
    # plan, builds the Metadata and its template, writes the sectioned prepared file from them,
    # publishes ``.metadata`` (fsync) and returns the notice that carries a reference to the
    # prepared file to every rank (each reads its own section, as at start-up: measure_startup).
    finished, out["t_finish_publish"] = _timed(
        lambda: finish(coord_job, plan, reports, settings, io, defaultdict(float)))
    notice, made = finished.notice, finished.made
    if notice.failures or not notice.published or notice.prepared is None:
        raise RuntimeError(f"solosave finish failed at W={world}: {notice.failures}")
    if made is None:
        raise RuntimeError(f"the create save kept no template at W={world}")
    # The broadcast of that notice: pickled once by the coordinator, unpickled by every rank.
    bcast, out["t_broadcast_pickle"] = _timed(lambda: _dumps(notice))
    out["broadcast_bytes"] = len(bcast)
    writes = plan.writes
    reports = plan = sdm = notice = finished = None  # free it (a large object)
    _, out["t_broadcast_unpickle"] = _timed(lambda: pickle.loads(bcast))
    bcast = None  # free it (a large object)
    io.close()
    io = None  # free it (a large object)
    gc.collect()
    out["coordinator_total_s"] = (out["t_unpickle_plans"] + out["t_global_plan"] + out["t_scatter_pickle"]
                                  + out["t_unpickle_results"] + out["t_finish_publish"]
                                  + out["t_broadcast_pickle"])
    out["create_save_s"] = out["coordinator_total_s"]
    md_path = os.path.join(ckpt, ".metadata")
    out["metadata_bytes"] = os.path.getsize(md_path)
    out["prepared_file_bytes"] = os.path.getsize(prepared_path)
    measure_load(out, ckpt, md_path, samples, structure, world)
    measure_startup(out, world, workers, prepared_path, made, samples)
    measure_fallback(out, structure, world, workers, ckpt, prepared_path, writes)  # refreshes the prepared file
    shutil.rmtree(ckpt, ignore_errors=True)
    gc.collect()
    return out


def measure_fallback(out: Json, structure: list, world: int, workers: int, ckpt: str, prepared_path: str,
                     writes: list[list[int]]) -> None:
    """The drift fallback: a reuse save whose layout drifted on some rank (every rank already
    wrote its prepared layout) takes the collective path. Every rank's planning payload carries
    what it wrote (``plan_request`` with pre-written results: the layout the create save gave
    it) and, on one rank, why it drifted; the coordinator's work is timed as for the create save
    (unpickling, ``decide``, unpickling the reports of the kept files, ``finish``, which
    refreshes the prepared file). ``fallback_save_s`` is its total."""
    from solosave._src.coordination.packing import written_columns
    from solosave._src.coordination.protocol import Verdict
    from solosave._src.engine.collective import decide, finish, plan_request, write_assigned

    payloads, reports, coord_job = [], [], None
    for r in range(world):
        held = solosave_rank_specs(structure, world, r)
        job = solosave_job(held, ckpt, seq=2, reuse=True)
        kept = solosave_results([held[i] for i in writes[r]], r, workers)
        payloads.append(_dumps(plan_request(job, kept, ["model.norm.weight: drifted"] if r == world - 1 else [])))
        if r == 0:
            coord_job = job
    settings, io = coordinator_io(workers, prepared_path)
    requests, t_plans = _timed(lambda: [pickle.loads(b) for b in payloads])
    payloads = None  # free it (a large object)
    (decisions, plan), t_decide = _timed(lambda: decide(coord_job, requests, 0))
    if decisions[0].verdict is not Verdict.OK or not plan.skip_write:
        raise RuntimeError(f"the drift fallback did not keep the written files at W={world}: {decisions[0]}")
    requests = None  # free it (a large object)
    for r in range(world):  # every rank keeps its files (skip_write): its report is what it wrote
        held = solosave_rank_specs(structure, world, r)
        kept = solosave_results([held[i] for i in writes[r]], r, workers)
        job = solosave_job(held, ckpt, seq=2, reuse=True)
        kept_columns = written_columns([s.key for s in held], kept)
        reports.append(_dumps(write_assigned(job, decisions[r], kept_columns, workers, io, defaultdict(float))))
    decisions = None  # free it (a large object)
    got, t_reports = _timed(lambda: [pickle.loads(b) for b in reports])
    reports = None  # free it (a large object)
    finished, t_finish = _timed(lambda: finish(coord_job, plan, got, settings, io, defaultdict(float)))
    notice = finished.notice
    if notice.failures or not notice.published or notice.prepared is None:
        raise RuntimeError(f"the drift fallback failed at W={world}: {notice.failures}")
    io.close()
    out["fallback_t_unpickle_plans"], out["fallback_t_global_plan"] = t_plans, t_decide
    out["fallback_t_unpickle_results"], out["fallback_t_finish_publish"] = t_reports, t_finish
    out["fallback_save_s"] = t_plans + t_decide + t_reports + t_finish


def measure_load(out: Json, ckpt: str, md_path: str, samples: dict, structure: list, world: int) -> None:
    """Loading: what a loading rank runs to learn where its shards are. Through the load index
    (``solosave.load``'s path; per sampled rank, loading the shards it saved: open the index,
    check it against ``.metadata``, build the ``Metadata`` of its keys), and, for comparison, the
    whole ``.metadata`` unpickled (what stock DCP and ``use_index=False`` do)."""
    from solosave._src.formats.dcp import INDEX_FILE
    from solosave._src.formats.safe_pickle import safe_loads
    from solosave._src.index.reader import LoadIndex

    data = open(md_path, "rb").read()  # noqa: SIM115 - read once
    _, out["t_load_unpickle"] = _timed(lambda: pickle.loads(data))
    _, out["t_load_safe_unpickle"] = _timed(lambda: safe_loads(data, what=md_path))
    out["load_full_metadata_s_per_rank"] = out["t_load_safe_unpickle"]
    out["load_full_metadata_bytes_per_rank"] = len(data)
    out["index_bytes"] = os.path.getsize(os.path.join(ckpt, INDEX_FILE))
    times, reads = [], []
    for r in samples:
        wanted = {"model." + name: [shard_dim0(shape, world, r)] for name, shape in structure}
        reps = []
        for _ in range(3):
            t0 = time.perf_counter()
            with LoadIndex.open(ckpt) as idx:
                md = idx.metadata_for(wanted)
            reps.append(time.perf_counter() - t0)
        chunks = sum(len(m.chunks) for m in md.state_dict_metadata.values())
        expected = sum(1 for boxes in wanted.values() if boxes[0][1][0] > 0)  # an empty shard reads nothing
        if len(md.state_dict_metadata) != len(structure) or chunks != expected:
            raise RuntimeError(f"the load index gave rank {r} {chunks} chunks of {len(md.state_dict_metadata)} "
                               f"keys at W={world}; expected {expected} chunks of {len(structure)} keys")
        times.append(statistics.median(reps))
        reads.append(idx.bytes_read)
    out["load_metadata_s_per_rank"] = max(times)
    out["load_read_bytes_per_rank"] = max(reads)


def measure_startup(out: Json, world: int, workers: int, prepared_path: str, made: Any, samples: dict) -> None:
    """Reuse start-up and saves from the prepared file the create save wrote, per sampled rank:
    ``load_prepared_metadata`` + ``check_compatible`` (what ``AsyncCheckpointer`` runs) + the
    first ``plan_reuse`` (reads this rank's section and any directory buckets) + the layout guard,
    and the pickle of what the trainer sends its worker; the coordinator also reads the template
    (or adopts the create save's, in the same job) and publishes per save."""
    from solosave._src.formats.dcp import INDEX_FILE
    from solosave._src.index import writer as index
    from solosave._src.plan.layout import check_layout
    from solosave._src.plan.local_plan import LocalPlan
    from solosave._src.prepared.prepared import load_prepared_metadata
    from solosave._src.storage.registry import storage_for
    from solosave._src.write.publish import commit_checkpoint

    per_rank, reads, sent, plans = [], [], [], []
    for r, (held, results) in samples.items():
        local = LocalPlan(list(held), {}, {})
        written = {k for k, *_ in results}
        t0 = time.perf_counter()
        pm = load_prepared_metadata(prepared_path)
        pm.check_compatible(world, workers)
        reuse, to_stage = pm.plan_reuse(local, r)
        per_rank.append(time.perf_counter() - t0)
        reads.append(pm.bytes_read)
        sent.append(len(_dumps(pm)))
        reps = []
        for _ in range(5):
            t0 = time.perf_counter()
            reuse, to_stage = pm.plan_reuse(local, r)
            drifts = check_layout(reuse.placed(), results)
            reps.append(time.perf_counter() - t0)
        if reuse.drift or drifts or {s.key for s in to_stage} != written:
            raise RuntimeError(f"reuse planning drifted at W={world} rank {r}: "
                               f"{list(reuse.drift)[:3] or drifts[:3] or 'staged items differ'}")
        plans.append(statistics.median(reps))
    out["startup_s_per_rank"] = max(per_rank)
    out["startup_read_bytes_per_rank"] = max(reads)
    out["startup_sampled_ranks"] = sorted(samples)
    out["worker_prepared_bytes"] = max(sent)
    out["t_prepared_index_once"] = max(per_rank)
    out["t_reuse_rank_plan_and_guard"] = max(plans)
    coord = load_prepared_metadata(prepared_path)
    tpl, out["t_template_once"] = _timed(lambda: coord.template)
    out["coordinator_startup_read_bytes"] = coord.bytes_read
    adopted, out["t_template_after_create"] = _timed(
        lambda: load_prepared_metadata(prepared_path).adopt_template(made.save_id, made.template, made.index_body))
    if not adopted:
        raise RuntimeError(f"the create save's template was not adopted at W={world}")
    reuse_dir = prepared_path + ".reuse"
    os.makedirs(reuse_dir, exist_ok=True)
    body = coord.index_body
    out["coordinator_index_read_bytes"] = coord.bytes_read - out["coordinator_startup_read_bytes"]

    # Per reuse save the coordinator writes the load index on a thread while it writes its data
    # (save/reuse: the coordinator's Ahead thread), then, after the all_reduce, publishes .metadata: both timed apart.
    pubs, idx_writes = [], []
    for _ in range(3):
        save_id = str(uuid.uuid4())
        _, t = _timed(lambda s=save_id: storage_for(reuse_dir).commit(os.path.join(reuse_dir, INDEX_FILE), index.render(body, tpl, reuse_dir, s), fsync=True))
        idx_writes.append(t)
        _, t = _timed(lambda s=save_id: commit_checkpoint(storage_for(reuse_dir), reuse_dir, tpl.render_parts(reuse_dir, s), fsync=True))
        pubs.append(t)
    out["reuse_index_write_s"] = statistics.median(idx_writes)
    shutil.rmtree(reuse_dir, ignore_errors=True)
    out["t_reuse_publish"] = out["reuse_publish_s"] = statistics.median(pubs)
    out["reduce_levels"] = math.ceil(math.log2(world)) if world > 1 else 0
    out["t_reuse_reduce_modelled"] = out["reduce_levels"] * REDUCE_MODEL_S
    out["reuse_coordinator_s"] = out["t_reuse_publish"] + out["t_reuse_reduce_modelled"]


# ---------------------------------------------------------------------------------------------
# stock DCP
# ---------------------------------------------------------------------------------------------

class _SimShard:
    """A stand-in for one rank's ``DTensor`` shard: implements the checkpoint protocol method
    ``__create_write_items__`` and returns the ``WriteItem`` a ``Shard(0)`` DTensor creates (see
    ``torch.distributed.checkpoint.planner_helpers._create_write_items_for_dtensor``)."""

    __slots__ = ("offsets", "sizes", "shape")

    def __init__(self, offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> None:
        self.offsets, self.sizes, self.shape = offsets, sizes, shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        import torch
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        offsets, sizes = torch.Size(self.offsets), torch.Size(self.sizes)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                      properties=TensorProperties(dtype=torch.float32),
                                                      size=torch.Size(self.shape)))]


def dcp_rank_payloads(structure: list, world: int, rank: int, writer: Any) -> tuple[bytes, bytes]:
    """One rank's pickled ``SavePlan`` and pickled write-result list, built by DCP's code."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    sd = {"model": {name: _SimShard(*shard_dim0(shape, world, rank), shape) for name, shape in structure}}
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, None, rank == 0)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    over = record_overhead()
    results, off = [], 0
    for item in plan.items:
        td = item.tensor_data
        length = 4 * math.prod(td.chunk.sizes) + over
        results.append(WriteResult(index=MetadataIndex(item.index.fqn, item.index.offset),
                                   size_in_bytes=length,
                                   storage_data=_StorageInfo(f"__{rank}_0.distcp", off, length)))
        off += length
    return pickle.dumps(plan), pickle.dumps(results)


def simulate_dcp(structure: list, world: int, directory: str) -> Json:
    """Stock DCP's coordinator work at world size ``world`` (torch's own functions)."""
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    out: Json = {"world": world}
    ckpt = os.path.join(directory, f"dcp_w{world}")
    os.makedirs(ckpt, exist_ok=True)
    writer = FileSystemWriter(ckpt)
    writer.set_up_storage_writer(True)
    t0 = time.perf_counter()
    plan_payloads, result_payloads = [], []
    for r in range(world):
        p, res = dcp_rank_payloads(structure, world, r, writer)
        plan_payloads.append(p)
        result_payloads.append(res)
    out["build_rank_payloads_s"] = time.perf_counter() - t0
    out["plan_bytes_per_rank"] = statistics.median(map(len, plan_payloads))
    out["plan_bytes_gathered"] = sum(map(len, plan_payloads))
    out["result_bytes_per_rank"] = statistics.median(map(len, result_payloads))
    out["result_bytes_gathered"] = sum(map(len, result_payloads))

    plans, out["t_unpickle_plans"] = _timed(lambda: [pickle.loads(b) for b in plan_payloads])
    plan_payloads = None  # free it (a large object)
    planner = DefaultSavePlanner()
    planner.set_up_planner({}, None, True)

    def global_plan() -> tuple:
        gp, md = planner.create_global_plan(plans)
        return writer.prepare_global_plan(gp), md

    (global_plans, metadata), out["t_global_plan"] = _timed(global_plan)
    plans = None  # free it (a large object)
    scattered, out["t_scatter_pickle"] = _timed(lambda: [pickle.dumps(p) for p in global_plans])
    out["scatter_bytes"] = sum(map(len, scattered))
    scattered = global_plans = None  # free it (a large object)
    results, out["t_unpickle_results"] = _timed(lambda: [pickle.loads(b) for b in result_payloads])
    result_payloads = None  # free it (a large object)
    _, out["t_finish_publish"] = _timed(lambda: writer.finish(metadata, results))
    results = None  # free it (a large object)
    bcast, out["t_broadcast_pickle"] = _timed(lambda: pickle.dumps(metadata))
    out["broadcast_bytes"] = len(bcast)
    bcast = metadata = None  # free it (a large object)
    gc.collect()
    out["coordinator_total_s"] = (out["t_unpickle_plans"] + out["t_global_plan"] + out["t_scatter_pickle"]
                                  + out["t_unpickle_results"] + out["t_finish_publish"]
                                  + out["t_broadcast_pickle"])
    data = open(os.path.join(ckpt, ".metadata"), "rb").read()  # noqa: SIM115
    out["metadata_bytes"] = len(data)
    _, out["t_load_unpickle"] = _timed(lambda: pickle.loads(data))
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def world_sizes(max_w: int, min_w: int = 2) -> list[int]:
    out, w = [], min_w
    while w <= max_w:
        out.append(w)
        w *= 2
    return out


def run_scale(cfg: Json, progress: Any) -> Json:
    """``cfg``: ``max_w``, ``dcp_max_w``, ``workers``, ``layers``, ``scratch`` (a directory)."""
    structure = llama_like(cfg["layers"])
    report: Json = {"config": {**cfg, "tensors": len(structure),
                               "reduce_model_s_per_level": REDUCE_MODEL_S,
                               "record_overhead_bytes": record_overhead()},
                    "solosave": [], "dcp": []}
    scratch = tempfile.mkdtemp(prefix="solosave-scale-", dir=cfg.get("scratch"))
    try:
        for w in cfg.get("world_sizes") or world_sizes(cfg["max_w"]):
            progress.step(f"scale W={w} solosave")
            try:
                report["solosave"].append(simulate_solosave(structure, w, cfg["workers"], scratch))
            except (RuntimeError, MemoryError, OSError) as e:
                report.setdefault("errors", []).append(f"solosave W={w}: {type(e).__name__}: {e}")
                progress.note(report["errors"][-1])
                break
            if w <= cfg["dcp_max_w"]:
                progress.step(f"scale W={w} stock DCP")
                try:
                    report["dcp"].append(simulate_dcp(structure, w, scratch))
                except (RuntimeError, MemoryError, OSError, ValueError) as e:
                    report.setdefault("errors", []).append(f"DCP W={w}: {type(e).__name__}: {e}")
                    progress.note(report["errors"][-1])
            gc.collect()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report


def scale_steps(cfg: Json) -> int:
    ws = cfg.get("world_sizes") or world_sizes(cfg["max_w"])
    return len(ws) + sum(1 for w in ws if w <= cfg["dcp_max_w"])


#: The figures of issue #15, per world size (``python -m benchmarks --json``).
SUMMARY_FIELDS = ("startup_read_bytes_per_rank", "startup_s_per_rank", "create_save_s", "fallback_save_s",
                  "reuse_publish_s",
                  "load_metadata_s_per_rank", "load_read_bytes_per_rank", "load_full_metadata_s_per_rank",
                  "index_bytes", "reuse_index_write_s", "worker_prepared_bytes",
                  "coordinator_startup_read_bytes", "t_template_once", "t_finish_publish", "metadata_bytes",
                  "prepared_file_bytes", "startup_sampled_ranks")


def scale_summary(report: Json) -> list[Json]:
    """One row per simulated world size: the fields of ``SUMMARY_FIELDS`` (and stock DCP's
    coordinator total where it was simulated)."""
    dcp = {r["world"]: r for r in report.get("dcp", [])}
    rows = []
    for s in report.get("solosave", []):
        row = {"world_size": s["world"], **{k: s[k] for k in SUMMARY_FIELDS if k in s}}
        if s["world"] in dcp:
            row["dcp_create_save_s"] = dcp[s["world"]]["coordinator_total_s"]
            row["dcp_load_metadata_s_per_rank"] = dcp[s["world"]]["t_load_unpickle"]
        rows.append(row)
    return rows


__all__ = ["llama_like", "run_scale", "scale_summary", "shard_dim0", "simulate_dcp", "simulate_solosave", "world_sizes"]
