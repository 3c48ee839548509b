"""Every message solosave sends: trainer -> worker, worker -> trainer, and rank -> rank.

One low module (it imports only :mod:`solosave._src.formats.dcp`) that every other module imports, so a
reader finds each message's fields and meaning in one place. Messages are frozen dataclasses
(sent once per save or per set-up) or ``NamedTuple`` s (sent through collectives, where their
pickled size counts); every tag is an enum.

Trainer <-> worker, over the pipe (see ``worker/host.py``)::

    WorkerSetup                      once, first message: the channel and per-checkpointer settings
    SaveJob ...                      one per save; ``None`` stops the worker
    WorkerMessage(READY | OUTCOME(JobOutcome) | DURABLE(DurableOutcome) | FATAL(text))

Rank <-> rank, over the channel (``coordination/channel.py``), in the order the engine sends them:

    collective path:  gather PlanRequest -> scatter PlanDecision -> gather WriteReport
                      -> broadcast FinishNotice
    reuse path:       all_reduce of one int64 status word (:func:`encode_status`); on failure
                      all_gather of each rank's error (``str | None``), on drift with "raise"
                      all_gather of each rank's drifts (``list[str]``)
    durable copy:     (two tiers, on the durable channel) all_reduce of one int64 status word;
                      on failure all_gather of each rank's error (``str | None``)
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import operator
from array import array
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from solosave._src.coordination.status import (
    SaveIdentity as SaveIdentity,  # re-exported: the status word is a message too
)
from solosave._src.coordination.status import Status as Status
from solosave._src.coordination.status import decode_status as decode_status
from solosave._src.coordination.status import encode_status as encode_status
from solosave._src.coordination.status import save_identity as save_identity
from solosave._src.formats.dcp import ItemKey

# ---------------------------------------------------------------------------------------------
# Tags
# ---------------------------------------------------------------------------------------------


class Mode(str, enum.Enum):
    """How a save coordinates; chosen by the trainer from state every rank shares."""

    COLLECTIVE = "collective"  #: gather plans, scatter decisions, gather results, broadcast
    REUSE = "reuse"            #: write the prepared layout, one 8-byte all_reduce


class SaveKind(str, enum.Enum):
    """What a finished save did (``SaveResult.mode``; compares equal to its string)."""

    COLLECTIVE = "collective"
    CREATE = "create"              #: collective, and the metadata became the prepared metadata
    REUSE = "reuse"
    FALLBACK = "reuse+fallback"    #: a reuse save whose layout drifted, saved collectively


class ErrorKind(str, enum.Enum):
    FAILED = "failed"            #: a rank could not write (or publish); nothing published
    DRIFT = "drift"              #: the layout drifted and ``on_layout_drift="raise"``
    CHANNEL = "channel"          #: a collective failed (peer died, timeout): engine broken
    OUT_OF_STEP = "out_of_step"  #: ranks ran different saves: engine broken
    INTERNAL = "internal"        #: a bug in solosave (reported with its traceback): engine broken


class Verdict(str, enum.Enum):
    """The coordinator's decision on the collective path."""

    OK = "ok"
    ERROR = "error"
    OUT_OF_STEP = "out_of_step"


class WorkerEvent(str, enum.Enum):
    READY = "ready"
    OUTCOME = "outcome"
    DURABLE = "durable"  #: a durable copy ended (two tiers); sent from the worker's copier thread
    FATAL = "fatal"


class ItemKind(enum.IntEnum):
    TENSOR = 0
    BYTES = 1


# ---------------------------------------------------------------------------------------------
# Items
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ItemSpec:
    """The structure of one item of a rank's state (no values).

    ``nbytes`` is the raw tensor size (numel x element size) for tensors and ``0`` for BYTES
    items, whose serialized size depends on the value. ``owner`` is False when this rank holds
    a DTensor replica that another replica writes. ``exclusive``: no other rank may write this
    item (a DTensor shard this rank owns, a ShardedTensor shard), so every plan puts it on this
    rank; a plain tensor may be written by any of its holders.
    """

    fqn: str
    kind: ItemKind
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None
    global_size: tuple[int, ...] | None = None
    dtype: str | None = None
    nbytes: int = 0
    owner: bool = True
    exclusive: bool = False

    @property
    def key(self) -> ItemKey:
        return (self.fqn, self.offsets)


@dataclass(frozen=True, slots=True)
class PlacedItem:
    """Where a prepared metadata puts one item: file, offset and length."""

    key: ItemKey
    relative_path: str
    offset: int
    length: int


#: A write result row: item key, file name relative to the checkpoint, offset and length.
WriteResult = tuple[ItemKey, str, int, int]


@dataclass(frozen=True, slots=True)
class StagedItem:
    """One staged item as the worker sees it: the spec plus where its bytes are."""

    spec: ItemSpec
    #: Offset in the staging buffer (tensors) or ``-1`` (BYTES items).
    offset: int = -1
    #: Serialized payload of a BYTES item; ``None`` for tensors.
    payload: bytes | None = None


@dataclass(frozen=True, slots=True)
class StagedSave:
    """What ``save()`` hands to the background: the staged items and their buffer.

    ``buffer`` names the staging buffer (``"shm:<name>"`` or ``"file:<path>"``, see
    ``staging/buffer.py``) or is ``None`` when nothing is a tensor. No CUDA object ever travels here.
    """

    buffer: str | None
    buffer_size: int
    items: tuple[StagedItem, ...]


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """A rank's local plan of a reuse save, made from the prepared metadata alone."""

    #: This rank's files in the prepared metadata, each with its items in offset order.
    layout: tuple[tuple[str, tuple[PlacedItem, ...]], ...]
    #: Why this rank cannot write that layout (found while planning); empty: it can.
    drift: tuple[str, ...] = ()

    def placed(self) -> list[PlacedItem]:
        return [p for _, items in self.layout for p in items]


# ---------------------------------------------------------------------------------------------
# Trainer <-> worker
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChannelSpec:
    """How a worker process forms the channel: the store address, its prefix, rank, size."""

    host: str
    port: int
    prefix: str
    rank: int
    world_size: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Per-checkpointer settings of the background; sent once, with the worker's set-up."""

    files_per_rank: int = 1
    #: ``"fallback"`` or ``"raise"`` (see ``CheckpointerOptions.on_layout_drift``).
    on_layout_drift: str = "fallback"
    #: The prepared file to create or refresh (coordinator); ``None``: in memory only.
    prepared_path: str | None = None
    #: Keyword arguments of the fsspec filesystem of URL destinations (``CheckpointerOptions``).
    storage_options: dict | None = None
    #: Two tiers: the root that every published save is copied under (``CheckpointerOptions``).
    durable_root: str | None = None
    #: Peer copies: the ranks per host (0: no peer copy; ``CheckpointerOptions.peer_copies``).
    peer_ranks_per_host: int = 0
    #: Peer copies: copies of each host's files on other hosts (``CheckpointerOptions.peer_copies``).
    peer_copies: int = 1
    #: Peer copies: hosts per failure domain (``CheckpointerOptions.hosts_per_domain``; 1: none).
    peer_hosts_per_domain: int = 1
    #: Two tiers: every save copied, in order (``CheckpointerOptions.durable_every_save``);
    #: ``False``: copies that fall behind are coalesced, the latest wins.
    durable_every_save: bool = False
    #: Two tiers: tries after a failed durable copy (``CheckpointerOptions.durable_retries``).
    durable_retries: int = 0


@dataclass(frozen=True)
class WorkerSetup:
    """The first message to a worker process."""

    channel: ChannelSpec
    settings: EngineSettings
    writer: Any = None  # a solosave.FileWriter or None (the default writer)
    #: The trainer's pid: the worker exits as soon as that process is gone.
    trainer_pid: int = 0


@dataclass(frozen=True)
class SaveJob:
    """Everything the background needs for one save (picklable; sent to the worker)."""

    seq: int
    directory: str
    mode: Mode
    staged: StagedSave
    #: Every item this rank holds (for the global plan on the collective path).
    held: tuple[ItemSpec, ...] = ()
    planner_data: dict = field(default_factory=dict)
    #: REUSE: the local plan from the prepared metadata.
    reuse: ReusePlan | None = None
    #: COLLECTIVE: the finished metadata becomes the prepared metadata (create mode, or
    #: ``assume_constant_structure``); every rank receives it.
    creates_prepared: bool = False
    #: REUSE: the prepared metadata, sent once per token; later jobs send only the token.
    prepared_token: int = 0
    prepared: Any = None  # a PreparedMetadata (sent when the token changes)
    #: Set when ``save()`` raised on this rank after the save was numbered: the job takes part
    #: in the protocol as a failure with this message, so every rank learns it at once.
    abort: str | None = None
    submitted_at: float = 0.0
    #: Two tiers: where this save is copied once it is published (``<durable_root>/<name>``).
    durable: str | None = None
    #: ``save(..., overwrite=True)``: the durable copy may replace a published one too.
    overwrite: bool = False
    #: The ``save_id`` its ``.metadata`` records: the same on every rank without a message (derived
    #: from the checkpointer's run and the save's number), so that every rank can name the
    #: checkpoint it published. Empty: the publishing coordinator draws one.
    save_id: str = ""

    @property
    def identity(self) -> SaveIdentity:
        return save_identity(self.seq, None if self.abort is not None else self.directory)

    def kind(self, fell_back: bool = False) -> SaveKind:
        """What this save is (``fell_back``: a reuse save that the collective path took over)."""
        if self.mode is Mode.REUSE:
            return SaveKind.FALLBACK if fell_back else SaveKind.REUSE
        return SaveKind.CREATE if self.creates_prepared else SaveKind.COLLECTIVE


@dataclass(frozen=True, slots=True)
class JobDelta:
    """A :class:`SaveJob` sent as its difference from the previous job on the same pipe (the
    process transport): a save of an unchanged structure reuses the same spec, plan and staged
    item objects (see ``plan/structure.py``), so only its number, directory and the payloads of its
    non-tensor items travel, not every item's spec again."""

    #: The job without its structure (``held``, ``planner_data``, ``reuse``, staged items).
    job: SaveJob
    #: ``(index, payload)`` of the staged items whose payload differs from the previous job's.
    payloads: tuple[tuple[int, bytes], ...]


def compact_job(prev: SaveJob | None, job: SaveJob) -> SaveJob | JobDelta:
    """``job`` as a :class:`JobDelta` against ``prev`` (trainer side) where it has the same
    structure objects, else ``job`` itself."""
    if (prev is None or job.abort is not None or prev.abort is not None or job.held is not prev.held
            or job.planner_data is not prev.planner_data or job.reuse is not prev.reuse
            or job.staged.buffer != prev.staged.buffer or len(job.staged.items) != len(prev.staged.items)):
        return job
    payloads = []
    new, old = job.staged.items, prev.staged.items
    for i in itertools.compress(range(len(new)), map(operator.is_not, new, old)):
        a, b = new[i], old[i]
        if a.spec is not b.spec or a.offset != b.offset or a.payload is None:
            return job
        if a.payload != b.payload:
            payloads.append((i, a.payload))
    bare = dataclasses.replace(job, held=(), planner_data={}, reuse=None,
                               staged=StagedSave(job.staged.buffer, job.staged.buffer_size, ()))
    return JobDelta(bare, tuple(payloads))


def expand_job(prev: SaveJob | None, msg: SaveJob | JobDelta) -> SaveJob:
    """The full job of ``msg`` (worker side), given the previous full job on the pipe."""
    if isinstance(msg, SaveJob):
        return msg
    if prev is None:
        raise RuntimeError("internal: a job delta without a previous job")
    items = list(prev.staged.items)
    for i, payload in msg.payloads:
        items[i] = StagedItem(items[i].spec, items[i].offset, payload)
    return dataclasses.replace(msg.job, held=prev.held, planner_data=prev.planner_data, reuse=prev.reuse,
                               staged=StagedSave(msg.job.staged.buffer, msg.job.staged.buffer_size, tuple(items)))


@dataclass(frozen=True)
class JobOutcome:
    """What the background reports for one save (identical ``ok``/``failures`` on every rank)."""

    seq: int
    ok: bool
    kind: SaveKind
    error_kind: ErrorKind | None = None
    bytes_written: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    collectives: tuple[Any, ...] = ()  # CollectiveCall
    failures: dict[int, str] = field(default_factory=dict)
    drifts: dict[int, list[str]] = field(default_factory=dict)
    #: The complete metadata now prepared (create, fallback); every rank receives it.
    prepared_metadata: Any = None  # a PreparedMetadata (a reference to its file, or in memory)
    #: Whether ``.metadata`` was published (known on every rank, except after a broken channel:
    #: ``None`` when this rank cannot tell).
    published: bool | None = False
    warnings: tuple[str, ...] = ()
    finished_at: float = 0.0
    #: Two tiers: the durable directory this save's copy was queued for (``None``: no copy);
    #: its :class:`DurableOutcome` follows later, with the same ``seq``.
    durable: str | None = None


@dataclass(frozen=True)
class DurableOutcome:
    """How one save's durable copy ended (identical ``ok``/``failures`` on every rank)."""

    seq: int
    ok: bool
    path: str
    #: Per failing rank, what went wrong (empty when ``ok``).
    failures: dict[int, str] = field(default_factory=dict)
    #: Bytes this rank copied (its data files; on the coordinator also the index and .metadata).
    bytes_copied: int = 0
    collectives: tuple[Any, ...] = ()  # CollectiveCall, on the durable channel
    #: ``time.time()`` when the copy started (after the fast publication) and when it ended.
    started_at: float = 0.0
    finished_at: float = 0.0
    #: Peer copies (``peer_copy``): whether every rank's files reached its peer host's fast tier
    #: (``None``: no peer copy), and per failing rank what went wrong.
    peer_ok: bool | None = None
    peer_failures: dict[int, str] = field(default_factory=dict)
    #: Not copied: a newer save's copy replaced it before it started (latest wins); that save's
    #: number.
    superseded_by: int | None = None
    #: How many times the copy was run (more than one: it failed and was tried again).
    attempts: int = 1


class WorkerMessage(NamedTuple):
    event: WorkerEvent
    payload: Any = None  # JobOutcome (OUTCOME), DurableOutcome (DURABLE), pid (READY) or text (FATAL)


class BufferHandoff(NamedTuple):
    """Trainer -> worker, before the first job that names staging buffer ``name``: the buffer's
    file descriptor follows on the pipe itself (``SCM_RIGHTS``), as the buffer has no name in
    the file system (``staging/buffer.py``)."""

    name: str


# ---------------------------------------------------------------------------------------------
# Rank <-> rank (collective path)
# ---------------------------------------------------------------------------------------------

class WrittenColumns(NamedTuple):
    """A rank's fresh write results as columns: row ``i`` is the item at position
    ``positions[i]`` of its held list (the list it sent in :class:`PlanRequest`), written to
    ``files[file[i]]`` at ``offset[i]``, ``length[i]`` bytes. The coordinator knows every held
    item's chunk from the plan, so it matches rows to chunks by position, with no key per row
    (keyed rows, 800k at W=4096, took seconds to unpickle and match)."""

    positions: array
    files: list[str]
    file: array
    offset: array
    length: array


class PackedSpecs(NamedTuple):
    """One rank's items in columnar form (see :func:`pack_specs`)."""

    fqns: list[str]
    kinds: bytes            #: one ``ItemKind`` per item
    dtype_table: list       #: the distinct dtype names (``None`` for BYTES items)
    dtype_index: bytes      #: per item, its dtype's index in ``dtype_table``
    nbytes: array
    ndims: array            #: per item, its number of dimensions; -1 for BYTES items
    numbers: array          #: per tensor item: offsets, sizes, global size (3 * ndims values)


class PlanRequest(NamedTuple):
    """What every rank sends in the planning gather of the collective path."""

    identity: SaveIdentity         #: :func:`save_identity` of the save (lock-step check)
    specs: PackedSpecs             #: every item this rank holds
    staged: array | None           #: positions in ``specs`` of the items it staged; None: all
    planner_data: dict             #: DCP's flatten mapping
    prewritten: WrittenColumns | None  #: reuse fallback: what it already wrote (held positions)
    drifts: list[str]              #: reuse fallback: why its layout drifted
    error: str | None = None       #: this rank cannot take part in this save (and why)


class PlanDecision(NamedTuple):
    """The coordinator's answer to one rank."""

    verdict: Verdict
    writes: list[int] | None = None  #: positions, in its held list, of the items it writes; None: all
    skip_write: bool = False       #: reuse fallback: the pre-written files already fit the plan
    drifts: dict = {}              #: every rank's drifts (reuse fallback), for the warning
    failures: dict = {}            #: ERROR: {rank: what went wrong}
    message: str | None = None     #: OUT_OF_STEP: what happened

    def __reduce__(self) -> tuple:
        # The scatter sends one decision per rank: pickle it as a short tuple (the verdict's
        # value, then the fields up to the last non-default one), not as class + enum objects.
        fields = [self.verdict.value, self.writes, self.skip_write, self.drifts, self.failures, self.message]
        while len(fields) > 2 and not fields[-1]:
            fields.pop()
        return (_pd, tuple(fields))


def _pd(verdict: str, *fields: Any) -> PlanDecision:
    return PlanDecision(Verdict(verdict), *fields)


class WriteReport(NamedTuple):
    """A rank's write results (or its error) for the second gather: what it wrote, or what a
    reuse fallback kept (``skip_write``)."""

    columns: WrittenColumns | None
    error: str | None

    def __reduce__(self) -> tuple:  # a short global instead of the class: gathered from every rank
        return (_wr, (self.columns, self.error))

    @property
    def bytes_written(self) -> int:
        return sum(self.columns.length) if self.columns is not None else 0


def _wr(columns: WrittenColumns | None, error: str | None) -> WriteReport:
    return WriteReport(columns, error)


class FinishNotice(NamedTuple):
    """The coordinator's last word on a collective save (broadcast)."""

    failures: dict[int, str]
    prepared: Any                  #: the PreparedMetadata it made (a file reference, or in memory)
    published: bool
