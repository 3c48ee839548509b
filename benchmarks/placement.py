"""The peer-copy placement model (``python -m benchmarks --only placement``): no processes, exact counts.

For a job of ``H`` hosts keeping ``K`` peer copies of each host's files, a restore needs nothing
from the durable tier exactly when no host lost its files together with all K hosts holding
them. The model gives, for F hosts lost at random (every F-subset alike), the probability of
that, computed exactly (no sampling), for four placements:

``solosave``     :class:`solosave._src.tiers.placement.PeerPlacement` (groups of K + 1 hosts, the
                 last ones larger; failure domains interleaved), as the library places copies
``clique``       NVRx's clique replication (groups of exactly K + 1 consecutive hosts, each holding
                 all the others'; needs H divisible by K + 1, with ``replication_jump`` = the hosts
                 per domain when domains are given)
``pairs``        DCP 2.13's ``_ReplicationStager`` (rank r with r + W/2; K = 1 only, H even)
``ring``         one ring over all hosts: host h's copies on h+1..h+K (what a naive K-neighbour
                 scheme does)

Every placement here is a set of groups in which the host at position q keeps copies of
positions q+1..q+K (cyclically): a group's files are lost exactly when K + 1 cyclically
consecutive positions of it are lost. So the number of F-subsets that lose nothing is the
coefficient of x^F of the product, over groups, of the polynomial whose m-th coefficient counts
the m-subsets of that group (a cycle of g positions) with no K + 1 consecutive positions; each
is counted by a dynamic programme over the positions, the product truncated at x^F.

With failure domains (``D`` hosts per rack or switch) the model also draws F whole domains lost
at random and counts, over every F-subset of domains, those that lose nothing (exact, by
enumeration, where there are at most 200,000 subsets; else 200,000 draws with a fixed seed, and
the table says so). ``solosave`` places copies in other domains; ``solosave, domains ignored``
is the same rule without ``hosts_per_domain``.

Transfer time per save: every placement here moves K copies of each host's bytes, one stream in
and one out per host per round (K rounds), so at a per-host bandwidth B (full duplex) and S bytes
per host the peer stage takes K x S / B, the same for all four; with domains, all K copies cross
the domain's uplink, which the table reports as the bytes per domain uplink per save.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Sequence
from typing import Any

from solosave._src.tiers.placement import PeerPlacement

Json = dict[str, Any]
HOSTS = (64, 256, 1024, 4096)
COPIES = (1, 2, 3)
LOSSES = (1, 2, 3, 4)
PER_DOMAIN = 16  # hosts per rack, for the "with domains" rows
ENUMERATE_UP_TO = 200_000
DRAWS = 200_000


@functools.cache
def safe_subsets(g: int, copies: int, most: int) -> tuple[int, ...]:
    """``out[m]`` (m = 0..most): the m-subsets of a cycle of ``g`` positions with no ``copies + 1``
    cyclically consecutive positions (a group whose position q keeps q+1..q+K loses nothing)."""
    run_limit = copies
    if g <= run_limit:  # a group smaller than K + 1 (never placed): nothing can be lost
        return tuple(math.comb(g, m) for m in range(most + 1))
    # state after each position: (ones, current run, first run, a zero seen) -> count
    states: dict[tuple[int, int, int, bool], int] = {(0, 0, 0, True): 1, (1, 1, 1, False): 1}
    for _ in range(1, g):
        nxt: dict[tuple[int, int, int, bool], int] = {}
        for (ones, run, first, closed), n in states.items():
            key0 = (ones, 0, first, True)
            nxt[key0] = nxt.get(key0, 0) + n
            if ones + 1 > most:
                continue
            if closed:
                if run + 1 <= run_limit:
                    key1 = (ones + 1, run + 1, first, True)
                    nxt[key1] = nxt.get(key1, 0) + n
            elif first + 1 <= run_limit:
                key1 = (ones + 1, first + 1, first + 1, False)
                nxt[key1] = nxt.get(key1, 0) + n
        states = nxt
    out = [0] * (most + 1)
    for (ones, run, first, closed), n in states.items():
        if closed and run + first <= run_limit:  # the run across the end and the start
            out[ones] += n
    return tuple(out)


def _product(polys: Sequence[tuple[int, ...]], most: int) -> list[int]:
    out = [1] + [0] * most
    for p in polys:
        out = [sum(out[i] * p[m - i] for i in range(m + 1)) for m in range(most + 1)]
    return out


def groups_of(kind: str, hosts: int, copies: int, per_domain: int = 1) -> list[tuple[int, ...]] | None:
    """The groups (hosts in position order) of a placement; ``None`` where it cannot place."""
    if copies >= hosts:
        return None
    if kind == "solosave":
        return [tuple(g) for g in PeerPlacement(hosts, copies, per_domain).groups]
    if kind == "clique":
        size = copies + 1
        if hosts % size:
            return None
        if per_domain == 1:
            return [tuple(range(i, i + size)) for i in range(0, hosts, size)]
        jump = per_domain  # NVRx: members replication_jump apart
        if hosts % (jump * size):
            return None
        out = []
        for block in range(0, hosts, jump * size):
            out += [tuple(block + j + i * jump for i in range(size)) for j in range(jump)]
        return out
    if kind == "pairs":
        if copies != 1 or hosts % 2:
            return None
        return [(h, h + hosts // 2) for h in range(hosts // 2)]
    if kind == "ring":
        return [tuple(range(hosts))]
    raise ValueError(kind)


def p_no_durable_read(groups: Sequence[tuple[int, ...]], copies: int, lost: int) -> float:
    """Exact: the probability that ``lost`` hosts drawn at random leave every file on a survivor."""
    hosts = sum(len(g) for g in groups)
    sizes: dict[int, int] = {}
    for g in groups:
        sizes[len(g)] = sizes.get(len(g), 0) + 1
    polys = [safe_subsets(s, copies, lost) for s, n in sorted(sizes.items()) for _ in range(n)]
    return _product(polys, lost)[lost] / math.comb(hosts, lost)


def _fatal_domain_sets(groups: Sequence[tuple[int, ...]], copies: int, per_domain: int) -> set[frozenset[int]]:
    out = set()
    for g in groups:
        n = len(g)
        for q in range(n):
            out.add(frozenset(g[(q + j) % n] // per_domain for j in range(copies + 1)))
    return out


def p_no_durable_read_domains(groups: Sequence[tuple[int, ...]], copies: int, per_domain: int,
                              lost: int) -> tuple[float, str]:
    """The probability that ``lost`` whole domains drawn at random leave every file on a
    survivor, and how it was computed ("exact" or "N draws")."""
    domains = sum(len(g) for g in groups) // per_domain
    fatal = _fatal_domain_sets(groups, copies, per_domain)
    smallest = min(len(s) for s in fatal)
    if lost < smallest:
        return 1.0, "exact"
    total = math.comb(domains, lost)
    if total <= ENUMERATE_UP_TO:
        bad = sum(1 for c in itertools.combinations(range(domains), lost) if _covers(set(c), fatal))
        return 1 - bad / total, "exact"
    rng = random.Random(1234)
    bad = sum(1 for _ in range(DRAWS) if _covers(set(rng.sample(range(domains), lost)), fatal))
    return 1 - bad / DRAWS, f"{DRAWS} draws"


def _covers(lost: set[int], fatal: set[frozenset[int]]) -> bool:
    return any(s <= lost for s in fatal)


def run_placement_model(progress: Any = None) -> Json:
    """Every row of the model (see the module docstring)."""
    rows: list[Json] = []
    for hosts in HOSTS:
        for copies in COPIES:
            for kind in ("solosave", "clique", "pairs", "ring"):
                groups = groups_of(kind, hosts, copies)
                if groups is None:
                    why = (f"{hosts} hosts not a multiple of K + 1 = {copies + 1}" if kind == "clique"
                           else "pairs only (K = 1)")
                    rows.append({"hosts": hosts, "copies": copies, "placement": kind, "domains": None,
                                 "cannot_place": why})
                    continue
                rows.append({"hosts": hosts, "copies": copies, "placement": kind, "domains": None,
                             "host_losses": {f: p_no_durable_read(groups, copies, f) for f in LOSSES}})
            for kind, per in (("solosave", PER_DOMAIN), ("solosave, domains ignored", 1), ("clique", PER_DOMAIN)):
                groups = groups_of(kind.split(",")[0], hosts, copies, per)
                if groups is None:
                    continue
                rack = {}
                for f in LOSSES:
                    p, how = p_no_durable_read_domains(groups, copies, PER_DOMAIN, f)
                    rack[f] = (p, how)
                rows.append({"hosts": hosts, "copies": copies, "placement": kind, "domains": PER_DOMAIN,
                             "host_losses": {f: p_no_durable_read(groups, copies, f) for f in LOSSES},
                             "domain_losses": {f: rack[f][0] for f in LOSSES},
                             "domain_method": sorted({how for _, how in rack.values()})})
        if progress is not None:
            progress.step(f"placement model: {hosts} hosts")
    return {"hosts_per_domain": PER_DOMAIN, "rows": rows}


def markdown(model: Json) -> str:
    """The model's table."""
    lines = ["| hosts | K | placement | domains | P(no durable read), F = 1 / 2 / 3 / 4 hosts lost | "
             "F = 1 / 2 / 3 / 4 domains lost |", "|---:|---:|---|---|---|---|"]
    for r in model["rows"]:
        if "cannot_place" in r:
            lines.append(f"| {r['hosts']} | {r['copies']} | {r['placement']} | - | cannot place: "
                         f"{r['cannot_place']} | - |")
            continue
        hosts_p = " / ".join(_fmt(r["host_losses"][f]) for f in LOSSES)
        dom = ("-" if r["domains"] is None else " / ".join(_fmt(r["domain_losses"][f]) for f in LOSSES)
               + ("" if r["domain_method"] == ["exact"] else f" ({', '.join(r['domain_method'])})"))
        lines.append(f"| {r['hosts']} | {r['copies']} | {r['placement']} | "
                     f"{'-' if r['domains'] is None else str(r['domains']) + ' hosts each'} | {hosts_p} | {dom} |")
    return "\n".join(lines)


def print_placement(model: Json) -> None:
    print("\npeer-copy placement: probability that a restore reads nothing from the durable tier")
    print(markdown(model))


def plot_placement(model: Json, plots: Any) -> list:
    """No plot: the table is the result."""
    return []


def _fmt(p: float) -> str:
    if p == 1.0:
        return "1"
    if p > 0.999:
        return f"1 - {1 - p:.1e}"
    return f"{p:.4f}"
