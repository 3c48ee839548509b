"""Where the peer copies go: each host's files on ``copies`` other hosts.

A job of ``hosts`` hosts (consecutive blocks of ``ranks_per_host`` ranks) keeps ``K = copies``
copies of every host's files on K other hosts' fast tiers. The rule, the same on every rank (a
pure function of ``hosts``, ``copies`` and ``hosts_per_domain``; nothing is exchanged):

1. **Order the hosts so that neighbours are in different failure domains.** With
   ``hosts_per_domain = D`` (hosts per rack or switch; 1 when not given: each host is its own
   domain), host ``h`` is in domain ``h // D`` and the order takes one host of each domain in
   turn: position ``p`` holds host ``(p % N) * D + p // N``, ``N = hosts // D`` domains. Any
   ``N`` consecutive positions (cyclically) lie in ``N`` different domains.
2. **Cut the order into groups of K + 1 consecutive positions**; when ``hosts`` is not a multiple
   of K + 1, the last groups take one position more each (so every host is in a group).
3. **Within a group of ``g`` hosts, copy ``j`` (``j = 1..K``) of the host at group position
   ``q`` goes to group position ``(q + j) % g``.** A group of exactly K + 1 hosts is a clique
   (each holds every other's files, as NVRx's clique replication); in a larger group each host
   holds its K predecessors' files. Round ``j`` of a save is then a permutation of the hosts:
   every host sends one stream and receives one.

Why groups: the files of host ``h`` are lost only when ``h`` and its K holders are all lost, and
the fewer distinct such sets there are, the less likely a random loss of K + 1 hosts covers one
(``hosts / (K + 1)`` sets with cliques against ``hosts`` with one ring over all hosts).

Failure domains: when there are at least K + 1 domains, no two copies of a file (nor the file
itself) share a domain: step 1 makes consecutive positions differ, and no group is larger than
the number of domains (see ``groups``). With fewer domains than K + 1 the copies are spread
over the domains as evenly as the order allows.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class PeerPlacement:
    """The peer copies' placement for ``hosts`` hosts, ``copies`` copies of each host's files,
    and failure domains of ``hosts_per_domain`` hosts (see the module docstring). Raises
    ``ValueError`` naming the fix for what cannot be placed."""

    hosts: int
    copies: int
    hosts_per_domain: int = 1

    def __post_init__(self) -> None:
        H, K, D = self.hosts, self.copies, self.hosts_per_domain
        for name, value in (("hosts", H), ("copies", K), ("hosts_per_domain", D)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"peer copies: {name} must be a whole number >= 1, got {value!r}")
        if H < 2:
            raise ValueError("peer copies need two hosts or more (the job runs on one): drop peer_copies, or "
                             "fix ranks_per_host")
        if K >= H:
            raise ValueError(f"peer_copies={K} needs more than {K} hosts, but the job has {H}: each copy goes to "
                             f"another host; use peer_copies <= {H - 1}")
        if H % D:
            raise ValueError(f"hosts_per_domain={D} does not divide the {H} hosts into whole failure domains: "
                             "pass the hosts per rack or switch (every domain the same size), or leave it out")

    @property
    def domains(self) -> int:
        """The number of failure domains."""
        return self.hosts // self.hosts_per_domain

    def domain_of(self, host: int) -> int:
        """The failure domain of ``host``."""
        return host // self.hosts_per_domain

    @functools.cached_property
    def order(self) -> tuple[int, ...]:
        """Step 1: the hosts, by position (neighbours in different domains)."""
        n, d = self.domains, self.hosts_per_domain
        return tuple((p % n) * d + p // n for p in range(self.hosts))

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Steps 2 and 3: the groups of hosts, each in its order of positions."""
        # No group is larger than the number of domains N when N >= K + 1, so its members lie in
        # different domains: with D = 1 every host is a domain; with D >= 2 and N = K + 1 + m,
        # the remainder r = H mod (K + 1) = m*D mod (K + 1) <= m*D spreads over G >= D groups,
        # at most ceil(r / G) <= m more per group (checked for every H <= 400, D, K <= 4).
        return _cut(self.order, self.copies + 1)

    @functools.cached_property
    def _holders(self) -> tuple[tuple[int, ...], ...]:
        out: list[tuple[int, ...]] = [()] * self.hosts
        for group in self.groups:
            g = len(group)
            for q, host in enumerate(group):
                out[host] = tuple(group[(q + j) % g] for j in range(1, self.copies + 1))
        return tuple(out)

    def holders(self, host: int) -> tuple[int, ...]:
        """The K hosts that keep ``host``'s files, copy ``j`` (round ``j``) at index ``j - 1``."""
        return self._holders[host]

    def sources(self, host: int) -> tuple[int, ...]:
        """The hosts whose files ``host`` keeps: in round ``j`` it receives from ``sources[j - 1]``."""
        return tuple(self.source_in_round(host, j) for j in range(1, self.copies + 1))

    @functools.cached_property
    def _sources(self) -> tuple[dict[int, int], ...]:
        rounds: list[dict[int, int]] = [{} for _ in range(self.copies)]
        for h in range(self.hosts):
            for j, to in enumerate(self.holders(h)):
                rounds[j][to] = h
        return tuple(rounds)

    def source_in_round(self, host: int, round_: int) -> int:
        """The host that sends its files to ``host`` in round ``round_`` (1..K)."""
        return self._sources[round_ - 1][host]

    def keeps(self, host: int) -> tuple[int, ...]:
        """Every host whose files ``host`` holds after a save: itself, then its sources."""
        return (host, *self.sources(host))

    def lost_files_of(self, lost: set[int] | frozenset[int]) -> list[int]:
        """The hosts whose files no surviving host holds when the hosts in ``lost`` are lost."""
        return [h for h in range(self.hosts) if h in lost and all(k in lost for k in self.holders(h))]


def _cut(order: tuple[int, ...], size: int) -> tuple[tuple[int, ...], ...]:
    """``order`` cut into groups of ``size`` consecutive positions; the remainder spread one more
    position per group over the last groups (cycling when there are more left than groups)."""
    count = max(1, len(order) // size)
    sizes = [size] * count
    extra = len(order) - size * count
    for i in range(extra):
        sizes[count - 1 - i % count] += 1
    out, start = [], 0
    for s in sizes:
        out.append(tuple(order[start:start + s]))
        start += s
    return tuple(out)


def owner_of(name: str) -> int | None:
    """The rank whose data file ``name`` is (``__{rank}_{n}.distcp``), else ``None``."""
    m = _DATA_FILE.match(name)
    return int(m.group(1)) if m else None


_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class PeerLayout:
    """The peer copies of a job: its hosts (consecutive blocks of ``ranks_per_host`` ranks) and
    where each host's files go. Rank ``r`` (local rank ``r % L`` of host ``r // L``) exchanges
    with the same local rank of the other hosts."""

    ranks_per_host: int
    placement: PeerPlacement

    @classmethod
    def of(cls, world_size: int, ranks_per_host: int, copies: int = 1, hosts_per_domain: int = 1) -> PeerLayout:
        """The layout of ``world_size`` ranks; ``ValueError`` naming the fix when it cannot be made."""
        if ranks_per_host < 1 or world_size % ranks_per_host:
            raise ValueError(f"ranks_per_host={ranks_per_host} does not split the {world_size} ranks into hosts of "
                             "the same size: pass the ranks per host (LOCAL_WORLD_SIZE)")
        return cls(ranks_per_host, PeerPlacement(world_size // ranks_per_host, copies, hosts_per_domain))

    @property
    def copies(self) -> int:
        return self.placement.copies

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def rank_on(self, host: int, like: int) -> int:
        """The rank of ``host`` with the local rank of ``like``."""
        return host * self.ranks_per_host + like % self.ranks_per_host

    def kept_ranks(self, host: int) -> set[int]:
        """The ranks whose files ``host`` keeps after a save: its own and its sources' ranks."""
        L = self.ranks_per_host
        return {o for h in self.placement.keeps(host) for o in range(h * L, h * L + L)}

    def send_to(self, rank: int, round_: int) -> int:
        """The rank that ``rank`` sends its files to in round ``round_`` (1..K) of a save."""
        return self.rank_on(self.placement.holders(self.host_of(rank))[round_ - 1], rank)

    def recv_from(self, rank: int, round_: int) -> int:
        """The rank whose files ``rank`` receives in round ``round_`` (1..K) of a save."""
        return self.rank_on(self.placement.source_in_round(self.host_of(rank), round_), rank)

    def describe(self) -> dict[str, int]:
        """What the ``.solosave-peers`` sidecar records (:meth:`from_description` reads it back)."""
        p = self.placement
        return {"ranks_per_host": self.ranks_per_host, "hosts": p.hosts, "copies": p.copies,
                "hosts_per_domain": p.hosts_per_domain}

    @classmethod
    def from_description(cls, d: object) -> PeerLayout:
        """The layout a ``.solosave-peers`` sidecar records; ``ValueError`` if it is not one."""
        if not isinstance(d, dict) or set(d) != {"ranks_per_host", "hosts", "copies", "hosts_per_domain"}:
            raise ValueError(f"not a peer layout: {d!r}")
        L = d["ranks_per_host"]
        if not isinstance(L, int) or isinstance(L, bool) or L < 1:
            raise ValueError(f"not a peer layout: {d!r}")
        return cls(L, PeerPlacement(d["hosts"], d["copies"], d["hosts_per_domain"]))


__all__ = ["PeerLayout", "PeerPlacement", "owner_of"]
