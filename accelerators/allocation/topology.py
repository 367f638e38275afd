"""Device topology: the links between a node's devices, and topology-aware device choice.

Pure Python (no Django). Devices are named by their agent-side ids (`Device.device_id`, the
GPU UUID on real nodes); a `Link` joins two of them.

Link kinds, in the vocabulary of `nvidia-smi topo -m` (best first):

| kind        | meaning                                                            | score      |
|-------------|--------------------------------------------------------------------|------------|
| `NVLINK`    | NVLink, `count` lanes ("NV4" in nvidia-smi)                       | 100 × count|
| `METAXLINK` | MetaX's MetaXLink, `count` lanes                                   | 100 × count|
| `PIX`       | at most one PCIe switch between them                               | 50         |
| `PXB`       | several PCIe switches, no host bridge                              | 40         |
| `PHB`       | through a PCIe host bridge (the CPU's root complex)                | 30         |
| `NODE`      | across host bridges within one NUMA node                           | 20         |
| `SYS`       | across NUMA nodes: PCIe plus the SMP interconnect (QPI/UPI)        | 10         |

The scores are those of NVIDIA's k8s-device-plugin best-effort GPU allocator
(`calculateGPUPairScore` in gpuallocator: cross-CPU 10, same CPU 20, host bridge 30,
multiple switches 40, single switch 50, 100 per NVLink lane), the categories HAMi's
topology-aware policy scores by as well. MetaXLink is scored like NVLink lane for lane.
A pair with no declared link counts as `SYS`, or as `NODE` when a NUMA map puts both
devices on one NUMA node.

Placement rules, as in HAMi's topology-aware policy: a multi-device request takes the set
whose weakest pair is strongest (`best_set`); a one-device request takes the free device
whose best link to the other free devices is weakest (`loneliest`), so that well-linked
pairs stay free for later multi-device work.
"""

from __future__ import annotations

from typing import Any

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import combinations

__all__ = [
    "EXACT_SEARCH_LIMIT",
    "KINDS",
    "KIND_LABELS",
    "LANE_KINDS",
    "METAXLINK",
    "NODE",
    "NVLINK",
    "PHB",
    "PIX",
    "PXB",
    "SELF",
    "SYS",
    "Link",
    "best_set",
    "link_score",
    "loneliest",
    "pair_score",
    "parse_link_kind",
]

NVLINK = "NVLINK"
METAXLINK = "METAXLINK"
PIX = "PIX"
PXB = "PXB"
PHB = "PHB"
NODE = "NODE"
SYS = "SYS"
SELF = "X"  # nvidia-smi topo's diagonal cell: a device and itself (no link)

KINDS = (NVLINK, METAXLINK, PIX, PXB, PHB, NODE, SYS)  # best first
LANE_KINDS = (NVLINK, METAXLINK)  # the kinds that carry a lane count
KIND_LABELS = {
    NVLINK: "NVLink",
    METAXLINK: "MetaXLink",
    PIX: "same PCIe switch (PIX)",
    PXB: "several PCIe switches (PXB)",
    PHB: "PCIe host bridge (PHB)",
    NODE: "same NUMA node (NODE)",
    SYS: "across NUMA nodes (SYS)",
}

_PCIE_SCORES = {PIX: 50, PXB: 40, PHB: 30, NODE: 20, SYS: 10}
_LANE_SCORE = 100
# Older nvidia-smi releases printed SOC for what is now SYS ("PCIe as well as the SMP link
# between CPU sockets").
_ALIASES = {"SOC": SYS, "NVLINK": NVLINK, "METAXLINK": METAXLINK}
_LANES_CELL = re.compile(r"(NV|NVLINK|METAXLINK)(\d+)")

# best_set searches every k-subset exactly while there are at most this many of them
# (C(16, 8) = 12 870, so any choice from 16 candidates is exact); beyond, it grows a set
# greedily from each candidate in turn.
EXACT_SEARCH_LIMIT = 20_000


@dataclass(frozen=True)
class Link:
    """A link between devices `a` and `b` (device ids; the order does not matter).

    `kind`: one of KINDS; `count`: lanes for NVLINK / METAXLINK (≥ 1), 1 for the others.
    Raises ValueError for an unknown kind, a count below 1, a count other than 1 on a PCIe
    kind, or a link from a device to itself.
    """

    a: str
    b: str
    kind: str
    count: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown link kind {self.kind!r} (expected one of {', '.join(KINDS)})")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"link count must be a whole number ≥ 1, got {self.count!r}")
        if self.kind not in LANE_KINDS and self.count != 1:
            raise ValueError(f"a {self.kind} link has no lanes (count {self.count}); only {' and '.join(LANE_KINDS)} do")
        if self.a == self.b:
            raise ValueError(f"a link joins two devices, not {self.a!r} with itself")

    @property
    def score(self) -> int:
        return link_score(self.kind, self.count)

    def as_dict(self) -> dict[str, Any]:
        """`{"a": device_id, "b": device_id, "kind": "NVLINK", "count": 4}` (PluginInventory.links)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Link:
        """The inverse of `as_dict`; `count` defaults to 1. Raises ValueError (KeyError for a
        missing a, b or kind is reported as ValueError too)."""
        try:
            return cls(a=str(data["a"]), b=str(data["b"]), kind=str(data["kind"]), count=data.get("count", 1))
        except KeyError as exc:
            raise ValueError(f"a link needs {exc.args[0]!r}") from None


def link_score(kind: str, count: int = 1) -> int:
    """How good a link is, higher better: NVLINK / METAXLINK 100 per lane, PIX 50, PXB 40,
    PHB 30, NODE 20, SYS 10 (NVIDIA k8s-device-plugin's pair scores, see the module text).
    Raises ValueError for an unknown kind or a lane count below 1."""
    if kind in LANE_KINDS:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"an {kind} link has at least 1 lane, got {count!r}")
        return _LANE_SCORE * count
    try:
        return _PCIE_SCORES[kind]
    except KeyError:
        raise ValueError(f"unknown link kind {kind!r} (expected one of {', '.join(KINDS)})") from None


def parse_link_kind(text: str) -> tuple[str, int]:
    """A link kind as written by `nvidia-smi topo -m` or in the mock inventory's `links` table
    → (kind, lane count). Case and surrounding spaces are ignored.

    "NV4" → ("NVLINK", 4); "NVLINK" → ("NVLINK", 1); "METAXLINK" → ("METAXLINK", 1);
    "PIX", "PXB", "PHB", "NODE", "SYS" → (kind, 1); "SOC" (older nvidia-smi) → ("SYS", 1);
    "X" (the matrix diagonal) → ("X", 0), which callers skip. Raises ValueError otherwise.
    """
    if not isinstance(text, str):
        raise ValueError(f"a link kind is text, got {text!r}")
    cell = text.strip().upper()
    if cell == SELF:
        return SELF, 0
    if cell in _PCIE_SCORES:
        return cell, 1
    if cell in _ALIASES:
        return _ALIASES[cell], 1
    match = _LANES_CELL.fullmatch(cell)
    if match and int(match.group(2)) >= 1:
        kind = METAXLINK if match.group(1) == METAXLINK else NVLINK
        return kind, int(match.group(2))
    raise ValueError(f"unknown link kind {text!r} (expected NVLINK, METAXLINK, NV<lanes>, PIX, PXB, PHB, NODE or SYS)")


def pair_score(a: str, b: str, links: Iterable[Link], *, numa: Mapping[str, int | None] | None = None) -> int:
    """The score (`link_score`) of the best link between devices `a` and `b`; without one,
    NODE's score when `numa` (device id → NUMA node, None unknown) puts both on one NUMA
    node, else SYS's. Raises ValueError when `a == b`."""
    if a == b:
        raise ValueError(f"a pair needs two devices, got {a!r} twice")
    return _Scores(links, numa).pair(a, b)


def best_set(
    candidates: Sequence[str],
    k: int,
    links: Iterable[Link],
    *,
    numa: Mapping[str, int | None] | None = None,
) -> tuple[str, ...]:
    """The k devices among `candidates` that are best linked to each other: the k-subset
    whose weakest pair scores highest (`pair_score`), then whose pair scores sum highest;
    ties go to the subset that comes first in candidate order. Returned in candidate order.

    Exact (every subset) while C(len(candidates), k) ≤ EXACT_SEARCH_LIMIT, which covers any
    k from 16 candidates; beyond, greedy: a set is grown from each candidate in turn by adding
    the candidate that keeps (weakest pair, sum) highest, and the best grown set wins.
    k == 1 gives the first candidate (a one-device request should use `loneliest`).
    Raises ValueError for k < 1, k > len(candidates), or a candidate named twice.
    """
    order = _check_candidates(candidates)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a whole number ≥ 1, got {k!r}")
    if k > len(order):
        raise ValueError(f"cannot choose {k} devices from {len(order)} candidates")
    if k == 1:
        return (order[0],)
    if k == len(order):
        return tuple(order)
    scores = _Scores(links, numa)
    matrix = [[scores.pair(a, b) if a != b else 0 for b in order] for a in order]
    if math.comb(len(order), k) <= EXACT_SEARCH_LIMIT:
        chosen = _exact_set(matrix, k)
    else:
        chosen = _greedy_set(matrix, k)
    return tuple(order[i] for i in chosen)


def loneliest(
    candidates: Sequence[str],
    free: Sequence[str],
    links: Iterable[Link],
    *,
    numa: Mapping[str, int | None] | None = None,
) -> str:
    """For a one-device request: the candidate whose best link to the other free devices is
    weakest, so that well-linked free devices stay together for later multi-device requests
    (HAMi's rule for single-GPU requests). `free`: the node's devices free for such requests
    (a candidate need not be among them; each candidate is skipped in its own comparison).
    A candidate with no other free device scores 0, the loneliest possible. Ties go to the
    first in candidate order. Raises ValueError for no candidates or a candidate named twice.
    """
    order = _check_candidates(candidates)
    if not order:
        raise ValueError("no candidates to choose from")
    scores = _Scores(links, numa)
    others = list(dict.fromkeys(free))
    best_choice, best_value = order[0], None
    for candidate in order:
        value = max((scores.pair(candidate, other) for other in others if other != candidate), default=0)
        if best_value is None or value < best_value:
            best_choice, best_value = candidate, value
    return best_choice


# --- internals -----------------------------------------------------------------------------


class _Scores:
    """Pair scores of one set of links, looked up in a dict (best link per pair wins)."""

    def __init__(self, links: Iterable[Link], numa: Mapping[str, int | None] | None) -> None:
        self.table: dict[frozenset[str], int] = {}
        for link in links:
            key = frozenset((link.a, link.b))
            self.table[key] = max(self.table.get(key, 0), link.score)
        self.numa = numa or {}

    def pair(self, a: str, b: str) -> int:
        score = self.table.get(frozenset((a, b)))
        if score is not None:
            return score
        node_a, node_b = self.numa.get(a), self.numa.get(b)
        if node_a is not None and node_a == node_b:
            return _PCIE_SCORES[NODE]
        return _PCIE_SCORES[SYS]


def _check_candidates(candidates: Sequence[str]) -> list[str]:
    order = list(candidates)
    if len(set(order)) != len(order):
        repeated = sorted({c for c in order if order.count(c) > 1})
        raise ValueError(f"candidates named more than once: {', '.join(repeated)}")
    return order


def _set_key(subset: Sequence[int], matrix: list[list[int]]) -> tuple[int, int]:
    """(weakest pair score, sum of pair scores) of candidate positions `subset`."""
    weakest, total = None, 0
    for i, a in enumerate(subset):
        row = matrix[a]
        for b in subset[i + 1 :]:
            score = row[b]
            total += score
            if weakest is None or score < weakest:
                weakest = score
    return weakest or 0, total


def _exact_set(matrix: list[list[int]], k: int) -> tuple[int, ...]:
    best_key: tuple[Any, ...] | None = None
    best: tuple[int, ...] = ()
    for subset in combinations(range(len(matrix)), k):  # lexicographic: candidate order
        key = _set_key(subset, matrix)
        if best_key is None or key > best_key:  # strictly better: earlier subsets win ties
            best_key, best = key, subset
    return best


def _greedy_set(matrix: list[list[int]], k: int) -> tuple[int, ...]:
    n = len(matrix)
    best_key: tuple[Any, ...] | None = None
    best: tuple[int, ...] = ()
    for seed in range(n):
        chosen = [seed]
        # For each candidate not chosen: its weakest pair and its sum with the chosen set.
        weakest = {i: matrix[seed][i] for i in range(n) if i != seed}
        total = dict(weakest)
        while len(chosen) < k:
            # Highest (weakest pair, sum) with the chosen set; earliest candidate on ties.
            pick = max(weakest, key=lambda i: (weakest[i], total[i], -i))
            chosen.append(pick)
            del weakest[pick], total[pick]
            row = matrix[pick]
            for i in weakest:
                weakest[i] = min(weakest[i], row[i])
                total[i] += row[i]
        subset = tuple(sorted(chosen))
        key = (*_set_key(subset, matrix), tuple(-i for i in subset))
        if best_key is None or key > best_key:
            best_key, best = key, subset
    return best
