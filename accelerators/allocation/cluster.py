"""An incremental, vectorised index of a cluster's free resources, and the node-choice policies.

The index keeps, per node, the free CPU and memory, the GPU model, and per device slot the
free and total GPU amount, all as integers in base units the caller picks (openb: milli-cores,
MiB and milli-GPU; the scheduler: CPU cores, bytes and fGPU quanta). A placement changes one
node's row (`commit`); nothing is recomputed for the rest of the cluster. Scores are floats;
amounts never are.

Policies (`POLICIES`; one scorer each, `POLICY_SCORERS`, which `ClusterIndex.scores` calls),
each choosing a node and, for a single-device request, the device slot:

* `binpack` / `spread`: least / most GPU left free on the node after the placement
  (HAMi's node policies); ties go to the first node.
* `best-fit`: least weighted remaining resources after the placement (CPU, memory and GPU
  each as a fraction of the node's total), the device with the least free amount that holds
  the request (the best-fit baseline of Weng et al., ATC'23, §6.1).
* `fgd`: Fragmentation Gradient Descent (Weng et al., "Beware of Fragmentation: Scheduling
  GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC'23, §4): the node
  and device whose expected fragmentation F_n(M) = Σ_m p_m F_n(m) grows least, with p the
  distribution of request shapes seen so far (`Workload`). F_n(m) is all of the node's free GPU
  when m cannot fit the node (CPU, memory, model, device count), else the free GPU on devices
  whose free amount is below m's per-device demand.
* `fgd-plus` (this project's): FGD's delta (per request, p normalised, in device units) plus
  two terms FGD lacks. (1) Stranding: the seen GPU requests bring r_cpu CPU and r_mem memory per
  unit of GPU; a node's free GPU beyond what its free CPU / r_cpu (or memory / r_mem) can serve
  is stranded, and the policy adds STRAND_WEIGHT × the GPU a placement newly strands. FGD sees
  this only where a seen shape stops fitting; the aggregate view steers CPU-heavy and GPU-less
  requests to nodes with CPU to spare per free GPU (openb's T4 nodes: 52 cores a GPU, G2: 12).
  (2) Best fit: FIT_WEIGHT × the node's GPU left after the placement (fraction of its GPU, in
  device units), which packs requests onto used nodes where FGD is indifferent (its delta is 0
  on many nodes for whole-GPU and GPU-less requests), keeping idle nodes whole for multi-GPU
  requests. (3) Model pressure: where requests name GPU models (`gpu_spec`), each model's
  share of the seen GPU demand tied to it over its share of the cluster's GPU; a request that
  names no model pays SCARCITY_WEIGHT × that pressure × what it takes (GPU, plus its CPU in GPU
  at r_cpu), so it leaves the models others need (openb gpuspec: T4) to them. (4) Packing
  plan, for requests one device can hold (SHARE; SPAN up to a device): the workload's
  cutting-stock plan (packing.py) says which amounts fill a device together; candidates rank
  0 on a device in use that the plan has room for, 1 on an idle device, 2 elsewhere, and that
  rank (after model pressure, in PRESSURE_STEP steps) comes before the score. Ties go to the
  better best fit, then the first node. On openb (default trace, seeds 42–51) it leaves 3.82 %
  of the GPU unallocated at 100 % arrival, FGD as published 4.77 % (benchmarks/openb.py).

Speed (benchmarks/placement_speed.py): nodes in equal states are scored once (`state`); a
state's F_n(m) row is computed once and its F · p kept current by one column per observation;
an after-state row is kept by (shape, state, device amount); fgd-plus scores only the best
plan class of a SHARE request. These change no choice (tests/test_packing_plan.py compares
them with a fresh index, exactly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .packing import PackingPlan, plan_ranks, solve_packing_plan

NONE, SHARE, WHOLE, SPAN = 0, 1, 2, 3
KIND_NAMES = {NONE: "none", SHARE: "share", WHOLE: "whole", SPAN: "span"}
POLICIES = ("binpack", "spread", "best-fit", "fgd", "fgd-plus")
FRAGMENTATION_AWARE = ("fgd", "fgd-plus")
FIT_WEIGHT = 0.2  # fgd-plus: best-fit's weight, per device's amount
STRAND_WEIGHT = 2.0  # fgd-plus: weight of GPU newly stranded by CPU or memory
PLUS_FIT_WEIGHTS = (0.0, 0.0, 1.0)  # fgd-plus: best-fit's CPU, memory, GPU weights
SCARCITY_WEIGHT = 1.0  # fgd-plus: weight of model pressure for requests that name no model
REPLAN_GROWTH = 2.0  # fgd-plus: solve the packing plan again when the SHARE requests seen grow by this
AFTER_ROWS = 1 << 16  # fgd / fgd-plus: after-state rows kept, at most
CATCH_UP = 16  # fgd / fgd-plus: kept F·p take up to this many observations a column at a time
SMALL_BATCH = 16  # rows up to which a fragmentation pass does not look for duplicate states
PRESSURE_STEP = 0.1  # fgd-plus: model pressures closer than this rank alike for SHARE requests


# What a policy's scorer returns (POLICY_SCORERS): (candidate rows, device slots, sort keys for
# np.lexsort, most significant last), each key a (K,) array.
Scored = tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]


@dataclass(frozen=True)
class Shape:
    """A request's shape in the index's units (hashable: the workload counts shapes).

    `kind`: NONE (CPU and memory only), SHARE (`amount` on one device), WHOLE (`count` idle
    devices) or SPAN (`amount` in total over one node's devices). `models`: the GPU models
    allowed (empty: any). Binpack/spread count `memory` (bytes) plus `device_fraction` of
    the node's device size as taken of its device memory (openb: neither, the GPU amount).
    `per_device`: a per-device request, checked on CPU and memory here and on its devices by
    the exact allocator."""

    kind: int
    cpu: int = 0
    mem: int = 0
    count: int = 0
    amount: int = 0
    models: frozenset[str] = frozenset()
    memory: int = 0
    device_fraction: float = 0.0
    per_device: bool = False

    @property
    def gpu_amount(self) -> int:
        """Total GPU this shape takes, in device units (WHOLE counts each device's full amount
        only where devices are uniform, as in openb: `amount` per device)."""
        if self.kind == WHOLE:
            return self.count * self.amount
        if self.kind in (SHARE, SPAN):
            return self.amount
        return 0


def shape_key(shape: Shape) -> str:
    """A shape as text for storage ("kind:cpu:mem:count:amount:memory:fraction:per_device");
    models are not kept (the scheduler's shapes name none)."""
    return ":".join(
        str(v)
        for v in (
            KIND_NAMES[shape.kind],
            shape.cpu,
            shape.mem,
            shape.count,
            shape.amount,
            shape.memory,
            repr(shape.device_fraction),
            int(shape.per_device),
        )
    )


def shape_from_key(key: str) -> Shape | None:
    """The inverse of `shape_key`; None for text it did not write."""
    parts = key.split(":")
    kinds = {v: k for k, v in KIND_NAMES.items()}
    if len(parts) != 8 or parts[0] not in kinds:
        return None
    try:
        return Shape(
            kinds[parts[0]],
            cpu=int(parts[1]),
            mem=int(parts[2]),
            count=int(parts[3]),
            amount=int(parts[4]),
            memory=int(parts[5]),
            device_fraction=float(parts[6]),
            per_device=bool(int(parts[7])),
        )
    except ValueError:
        return None


@dataclass
class WorkloadArrays:
    """A workload's request shapes as the fragmentation scorer reads them (`Workload.arrays`).
    T shapes, J classes of shapes that fit alike ((kind, whole-device count, fGPU amount in
    milli-GPU)), M GPU models. Per shape (T,): `cpu` (cores), `mem` (bytes), `gpu` (its GPU
    amount), `named` (1.0 if it names models), `cls` (its class), `p` (how often it was seen),
    `cpu_with_gpu` / `mem_with_gpu` (its CPU and memory where it asks for a GPU, else 0); `mask`
    (T × M: the models it may use) and `mask_by_model` (M × T, contiguous). Per class (J,):
    `classes` ((kind, count, amount) tuples), `kinds`, `counts`, `amounts`, and `onehot` (T × J);
    the classes of each kind by index (`share_classes`, `whole_classes`, `none_classes`,
    `span_classes`) with their amounts or counts (`share_amounts`, `whole_counts`,
    `span_amounts`). Of the whole: `total` (shapes seen), `named_any`, `cpu_per_gpu` and
    `mem_per_gpu` (what GPU requests bring per unit of GPU, weighted by `p`), `model_demand`
    (M: the share of the GPU demand tied to each model). `p`, `total` and the ratios change as
    shapes are seen again; the rest only with new shapes."""

    cpu: np.ndarray
    mem: np.ndarray
    mask: np.ndarray
    mask_by_model: np.ndarray
    cls: np.ndarray
    classes: list[Any]
    onehot: np.ndarray
    kinds: np.ndarray
    counts: np.ndarray
    amounts: np.ndarray
    share_classes: np.ndarray
    share_amounts: np.ndarray
    whole_classes: np.ndarray
    whole_counts: np.ndarray
    none_classes: np.ndarray
    span_classes: np.ndarray
    span_amounts: np.ndarray
    gpu: np.ndarray
    named: np.ndarray
    named_any: bool
    cpu_with_gpu: np.ndarray
    mem_with_gpu: np.ndarray
    p: np.ndarray
    total: float
    cpu_per_gpu: float = 0.0
    mem_per_gpu: float = 0.0
    model_demand: np.ndarray | None = None


class Workload:
    """The distribution p of request shapes seen so far, kept as counts. Fragmentation-aware
    policies weigh F_n(m) by it (Weng et al. use the trace's pod types; here only what has
    arrived, so a live scheduler can keep it)."""

    def __init__(self, counts: dict[Shape, int] | None = None):
        self.shapes: list[Shape] = []
        self.position: dict[Shape, int] = {}
        self._counts = np.zeros(16, dtype=np.float64)
        self._cache: tuple[tuple[Any, ...], WorkloadArrays] | None = None  # (key, arrays) of the last `arrays` call
        self._shares: dict[int, int] = {}  # SHARE requests seen, by amount
        self._plans: dict[int, tuple[int, PackingPlan | None]] = {}  # by device capacity: (seen then, plan)
        # by device capacity: (`_shares_seen` then, the plan `packing_plan` gave): asked again before
        # another SHARE or SPAN request is seen, it gives the same (a few calls a placement)
        self._plan_given: dict[int, tuple[int, PackingPlan | None]] = {}
        self._shares_seen = 0  # observations that changed `_shares`
        # Every observation as (shape position, n), so a kept F·p can catch up (`_FragCache`).
        self.log_position = np.zeros(64, dtype=np.int64)
        self.log_n = np.zeros(64, dtype=np.float64)
        self.observations = 0
        self.observed = 0  # requests seen (Σ counts)
        for shape, n in (counts or {}).items():
            self.observe(shape, n)

    def observe(self, shape: Shape, n: int = 1) -> None:
        pos = self.position.get(shape)
        if pos is None:
            pos = self.position[shape] = len(self.shapes)
            self.shapes.append(shape)
            if pos >= len(self._counts):
                self._counts = np.concatenate([self._counts, np.zeros(len(self._counts), dtype=np.float64)])
        self._counts[pos] += n
        self.observed += n
        if self.observations == len(self.log_n):
            self.log_position = np.concatenate([self.log_position, np.zeros_like(self.log_position)])
            self.log_n = np.concatenate([self.log_n, np.zeros_like(self.log_n)])
        self.log_position[self.observations], self.log_n[self.observations] = pos, n
        self.observations += 1
        if shape.kind in (SHARE, SPAN) and shape.amount > 0:  # SPAN: the scheduler's fGPU requests
            self._shares[shape.amount] = self._shares.get(shape.amount, 0) + n
            self._shares_seen += 1

    def packing_plan(self, capacity: int) -> PackingPlan | None:
        """The packing plan (`packing.solve_packing_plan`) of the SHARE and SPAN amounts seen so
        far on devices of `capacity` units (amounts above it are left out), or None (none seen,
        or the LP failed). Solved again only when those requests have grown by REPLAN_GROWTH
        since the last solve, or an amount appears that the plan lacks: a few solves over a run,
        each tens of ms. Its answer depends on the SHARE and SPAN requests seen and the plans
        solved before only: asked again before another is seen, the last answer is given."""
        given = self._plan_given.get(capacity)
        if given is not None and given[0] == self._shares_seen:
            return given[1]
        plan = self._packing_plan(capacity)
        if plan is None or not self._packing_plan_kept(capacity):
            self._plan_given.pop(capacity, None)  # (solved again at each ask: not kept)
        else:
            self._plan_given[capacity] = (self._shares_seen, plan)
        return plan

    def _packing_plan(self, capacity: int) -> PackingPlan | None:
        seen = sum(self._shares.values())
        if not seen:
            return None
        solved, plan = self._plans.get(capacity, (0, None))
        if self._packing_plan_kept(capacity):
            return plan
        plan = solve_packing_plan(capacity, self._shares, start=plan)
        self._plans[capacity] = (seen, plan)
        return plan

    def _packing_plan_kept(self, capacity: int) -> bool:
        """Whether `_packing_plan(capacity)` gives the plan solved last without solving again."""
        seen = sum(self._shares.values())
        solved, plan = self._plans.get(capacity, (0, None))
        known = set(plan.amounts) if plan is not None else set()
        return bool(solved and seen < REPLAN_GROWTH * solved and all(a in known or a > capacity for a in self._shares))

    def counts(self) -> dict[Shape, int]:
        return {s: int(c) for s, c in zip(self.shapes, self._counts[: len(self.shapes)])}

    def arrays(self, models: dict[str, int]) -> WorkloadArrays:
        """Per-shape arrays for the scorer: cpu, mem, model mask (T × models), class index
        per shape, and the classes' (kind, count, amount) with their probability matrix."""
        key = (len(self.shapes), len(models))
        if self._cache is not None and self._cache[0] == key:
            cached = self._cache[1]
            p = self._counts[: len(self.shapes)]
            cached.total = float(self.observed)
            cached.p = p
            self._ratios(cached, p)
            return cached
        t = len(self.shapes)
        cpu = np.array([s.cpu for s in self.shapes], dtype=np.int64)
        mem = np.array([s.mem for s in self.shapes], dtype=np.int64)
        mask = np.ones((t, max(len(models), 1)), dtype=bool)
        for i, s in enumerate(self.shapes):
            if s.models:
                mask[i, :] = False
                for name in s.models:
                    if name in models:
                        mask[i, models[name]] = True
        classes: dict[tuple[int, int, int], int] = {}
        cls = np.zeros(t, dtype=np.int64)
        for i, s in enumerate(self.shapes):
            k = (s.kind, s.count if s.kind == WHOLE else 0, s.amount if s.kind != WHOLE else 0)
            cls[i] = classes.setdefault(k, len(classes))
        onehot = np.zeros((t, len(classes)), dtype=np.float64)
        onehot[np.arange(t), cls] = 1.0
        p = self._counts[: len(self.shapes)]
        kinds = np.array([c[0] for c in classes], dtype=np.int64)
        counts = np.array([c[1] for c in classes], dtype=np.int64)
        amounts = np.array([c[2] for c in classes], dtype=np.int64)
        gpu = np.array([s.gpu_amount for s in self.shapes], dtype=np.float64)
        named = np.array([bool(s.models) for s in self.shapes], dtype=np.float64)
        share, whole, span = (np.nonzero(kinds == k)[0] for k in (SHARE, WHOLE, SPAN))
        cached = WorkloadArrays(
            cpu=cpu,
            mem=mem,
            mask=mask,
            mask_by_model=np.ascontiguousarray(mask.T),
            cls=cls,
            classes=list(classes),
            onehot=onehot,
            kinds=kinds,
            counts=counts,
            amounts=amounts,
            share_classes=share,
            share_amounts=amounts[share],
            whole_classes=whole,
            whole_counts=counts[whole],
            none_classes=np.nonzero(kinds == NONE)[0],
            span_classes=span,
            span_amounts=amounts[span],
            gpu=gpu,
            named=named,
            named_any=bool(named.any()),
            cpu_with_gpu=cpu * (gpu > 0),
            mem_with_gpu=mem * (gpu > 0),
            p=p,
            total=p.sum(),
        )
        self._ratios(cached, p)
        self._cache = (key, cached)
        return cached

    @staticmethod
    def _ratios(cached: WorkloadArrays, p: np.ndarray) -> None:
        """CPU and memory that GPU requests bring per unit of GPU, weighted by p."""
        gpu = cached.gpu
        demand = float(p @ gpu)  # integer counts × integer amounts: exact in any order
        cached.cpu_per_gpu = float(p @ cached.cpu_with_gpu) / demand if demand else 0.0
        cached.mem_per_gpu = float(p @ cached.mem_with_gpu) / demand if demand else 0.0
        # Share of the GPU demand tied to each model (requests naming models, spread evenly).
        mask = cached.mask
        named = cached.named
        if cached.named_any:
            per_model = (p * gpu * named)[:, None] * mask / np.maximum(mask.sum(axis=1), 1)[:, None]
            cached.model_demand = per_model.sum(axis=0) / demand if demand else np.zeros(mask.shape[1])
        else:
            cached.model_demand = np.zeros(mask.shape[1])


def _unique_rows(*columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique row positions, inverse) over equal tuples of int columns."""
    stacked = np.stack(columns, axis=1)
    if (
        stacked.min(initial=0) >= 0
        and stacked.shape[1] == 3
        and stacked[:, 0].max(initial=0) < 64
        and stacked[:, 1].max(initial=0) < (1 << 28)
        and stacked[:, 2].max(initial=0) < (1 << 30)
    ):
        key = (stacked[:, 0] << 58) | (stacked[:, 1] << 30) | stacked[:, 2]
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(stacked, axis=0, return_index=True, return_inverse=True)
    return np.asarray(first), np.asarray(inverse).reshape(-1)


def expected_fragmentation(
    cpu: np.ndarray, mem: np.ndarray, model: np.ndarray, free: np.ndarray, cap: np.ndarray, arrays: WorkloadArrays
) -> np.ndarray:
    """Σ_m p_m F_n(m) for K node states (Weng et al. ATC'23, Eq. 2–4), unnormalised (p as counts).

    `cpu`, `mem`, `model`: (K,) ints; `free`, `cap`: (K, G) ints (cap 0 = no device in that
    slot). Uses F_n(m) = gsum_n − fits(n, m) · A_n(m), where gsum is the node's free GPU and A
    the part of it m could use (devices with at least m's per-device demand free; idle
    devices for whole-device shapes), so the shape axis collapses to a few demand classes, and
    the CPU/memory/model test is done once per distinct (model, CPU, memory) among the K states.
    Returns (K,) floats."""
    k = free.shape[0]
    if k == 0 or arrays.total == 0:
        return np.zeros(k)
    gsum, fitting, inverse, usable = _fragmentation_parts(cpu, mem, model, free, cap, arrays)
    weights = fitting.astype(np.float64) @ (arrays.onehot * arrays.p[:, None])  # (U, J): seen mass per class fitting
    if inverse is not None:
        weights = weights[inverse]
    return np.asarray(gsum * arrays.total - (usable * weights).sum(axis=1))


def fragmentation_by_shape(
    cpu: np.ndarray, mem: np.ndarray, model: np.ndarray, free: np.ndarray, cap: np.ndarray, arrays: WorkloadArrays
) -> np.ndarray:
    """F_n(m) per state and seen shape, (K, T) floats: `expected_fragmentation` before the
    weighting by p (so that one is this @ p)."""
    if free.shape[0] == 0 or not len(arrays.cpu):
        return np.zeros((free.shape[0], len(arrays.cpu)))
    gsum, fitting, inverse, usable = _fragmentation_parts(cpu, mem, model, free, cap, arrays)
    if inverse is not None:
        fitting = fitting[inverse]
    return np.asarray(gsum[:, None] - fitting * usable[:, arrays.cls])


def _fragmentation_parts(
    cpu: np.ndarray, mem: np.ndarray, model: np.ndarray, free: np.ndarray, cap: np.ndarray, arrays: WorkloadArrays
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """(gsum (K,), fits (U, T) over the distinct (model, CPU, memory), inverse (K,) into U or
    None when each row is its own (few rows), usable (K, J) free GPU each demand class could use)."""
    k = free.shape[0]
    gsum = free.sum(axis=1)
    if k <= SMALL_BATCH:  # a few rows: finding their duplicates costs more than it saves
        inverse = None
    else:
        first, inverse = _unique_rows(model, cpu, mem)
        cpu, mem, model = cpu[first], mem[first], model[first]
    cm = (arrays.cpu[None, :] <= cpu[:, None]) & (arrays.mem[None, :] <= mem[:, None])
    cm &= arrays.mask_by_model[model]
    usable = np.zeros((k, len(arrays.classes)), dtype=np.int64)
    share = arrays.share_classes
    if len(share):  # amounts are > 0, so a missing device (free 0) never holds one
        usable[:, share] = (free[:, :, None] * (free[:, :, None] >= arrays.share_amounts[None, None, :])).sum(axis=1)
    whole = arrays.whole_classes
    if len(whole):
        idle = (cap > 0) & (free == cap)
        fits = idle.sum(axis=1)[:, None] >= arrays.whole_counts[None, :]
        usable[:, whole] = np.where(fits, np.where(idle, free, 0).sum(axis=1)[:, None], 0)
    usable[:, arrays.none_classes] = gsum[:, None]
    span = arrays.span_classes
    if len(span):
        usable[:, span] = np.where(gsum[:, None] >= arrays.span_amounts[None, :], gsum[:, None], 0)
    return gsum, cm, inverse, usable


def _lex_best(keys: tuple[np.ndarray, ...]) -> np.ndarray:
    """Positions of the lexicographically least entries of `keys` (np.lexsort order: most
    significant key last), in position order."""
    best = np.arange(len(keys[0]))
    for key in reversed(keys):  # most significant first; each pass keeps the ties
        values = key[best]
        best = best[values == values.min()]
        if len(best) == 1:
            break
    return best


class _FragCache:
    """F_n(m) rows (floats, one column per seen shape) kept for one workload: a node state's
    F_n(m) never changes, only p does and new shapes add columns. `table` by state id;
    `after` by (shape, before state id, device amount taken from), the state a placement
    would leave (`after_ids` hands out rows). `cols`/`after_cols`: shapes each row holds.

    F and the counts p are integers, so F · p is exact in floats: the before states' dots
    are kept (`before_dots`) and moved along with each observation by one column."""

    def __init__(self, workload: Workload, exact_in_float32: bool = False):
        self.workload = workload
        self.table = np.zeros((64, 16), order="F")  # by column: `before_dots` reads a column a call
        self.cols = np.zeros(64, dtype=np.int64)
        self.dot = np.zeros(64)  # table row · p for the tracked states, as of `synced` observations
        self.is_tracked = np.zeros(64, dtype=bool)
        self.tracked = np.zeros(0, dtype=np.int64)
        self.synced = 0
        self.prune_at = 256  # tracked states at which those no node holds are dropped
        # F is a node's free GPU at most (integers): float32 holds it exactly below 2**24 units.
        self.after = np.zeros((64, 16), dtype=np.float32 if exact_in_float32 else np.float64)
        self.after_cols = np.zeros(64, dtype=np.int64)
        self.after_rows: dict[Shape, dict[int, int]] = {}  # SHARE shapes: key → row
        self.after_dir: dict[Shape, np.ndarray] = {}  # other shapes: row by before state id (-1: none)
        self.after_used = 0
        self.states = 0  # state ids the index has handed out (`reserve`)

    def reserve(self, states: int, t: int) -> None:
        """Room for `states` state ids and `t` shapes in both tables."""
        self.states = states
        self.table, self.cols = self._grown(self.table, self.cols, states, t)
        self.after, self.after_cols = self._grown(self.after, self.after_cols, len(self.after_cols), t)
        if len(self.dot) < len(self.cols):
            extra = len(self.cols) - len(self.dot)
            self.dot = np.concatenate([self.dot, np.zeros(extra)])
            self.is_tracked = np.concatenate([self.is_tracked, np.zeros(extra, dtype=bool)])

    def before_dots(self, ids: np.ndarray, p: np.ndarray, t: int, live: np.ndarray) -> np.ndarray:
        """table[ids] · p for state `ids` (rows current for `t` shapes). The tracked
        states' dots first take the observations since the last call (a column each; a whole
        row past CATCH_UP of them); states not tracked get a row's dot and are tracked from
        then on. `live`: the states nodes hold now; states no node holds stop being tracked
        when they outnumber the rest."""
        workload, now = self.workload, self.workload.observations
        tracked = self.tracked
        if now > self.synced and len(tracked):
            if now - self.synced <= CATCH_UP:
                for k in range(self.synced, now):
                    self.dot[tracked] += self.table[tracked, workload.log_position[k]] * workload.log_n[k]
            else:
                self.dot[tracked] = self.table[tracked, :t] @ p[:t]
        self.synced = now
        new = ids[~self.is_tracked[ids]]
        if len(new) > 1:  # `ids` may repeat (SHARE: one state, several device amounts)
            new = np.unique(new)
        if len(new):
            self.dot[new] = self.table[new, :t] @ p[:t]
            self.is_tracked[new] = True
            self.tracked = tracked = np.concatenate([tracked, new])
        if len(tracked) > self.prune_at:
            keep = np.zeros(len(self.is_tracked), dtype=bool)
            keep[live] = True
            self.is_tracked &= keep
            self.tracked = np.nonzero(self.is_tracked)[0]
            self.prune_at = 2 * len(self.tracked) + 256
        return np.asarray(self.dot[ids])

    @staticmethod
    def _grown(table: np.ndarray, cols: np.ndarray, rows: int, t: int, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`table` (and `cols`) with room for `rows` rows and `t` columns, doubled as needed, at
        most `limit` rows (when given and not less than `rows`)."""
        if rows <= table.shape[0] and t <= table.shape[1]:
            return table, cols
        height = max(table.shape[0], 2 * rows)
        if limit is not None:
            height = max(min(height, limit), rows, table.shape[0])
        grown = np.zeros(
            (height, max(table.shape[1], 2 * t)),
            dtype=table.dtype,
            order="F" if table.flags.f_contiguous and not table.flags.c_contiguous else "C",
        )
        grown[: table.shape[0], : table.shape[1]] = table
        return grown, np.concatenate([cols, np.zeros(grown.shape[0] - len(cols), dtype=np.int64)])

    def after_ids(self, shape: Shape, keys: np.ndarray) -> np.ndarray:
        """Rows of `after` for `keys` of `shape`, new ones handed out: a SHARE shape's keys are
        state id << 22 | the device's free amount, any other's are state ids. Past AFTER_ROWS
        rows all are dropped (most belong to states no node holds any more) and refilled."""
        if self.after_used + len(keys) > AFTER_ROWS:
            self.after_rows.clear()
            self.after_dir.clear()
            self.after_cols[:] = 0
            self.after_used = 0
        if shape.kind == SHARE:
            known = self.after_rows.setdefault(shape, {})
            ids = []
            for k in keys.tolist():
                i = known.get(k)
                if i is None:
                    i = known[k] = self.after_used
                    self.after_used += 1
                ids.append(i)
            rows = np.array(ids, dtype=np.int64)
        else:
            states = keys
            directory = self.after_dir.get(shape)
            if directory is None or len(directory) < self.states:
                grown = np.full(max(64, 2 * self.states), -1, dtype=np.int64)
                if directory is not None:
                    grown[: len(directory)] = directory
                directory = self.after_dir[shape] = grown
            rows = directory[states]
            missing = rows < 0
            if missing.any():
                rows[missing] = self.after_used + np.arange(int(missing.sum()))
                self.after_used += int(missing.sum())
                directory[states[missing]] = rows[missing]
        if self.after_used > len(self.after_cols):
            self.after, self.after_cols = self._grown(self.after, self.after_cols, self.after_used, 1, AFTER_ROWS)
        return rows

    def store(self, ids: np.ndarray, rows: np.ndarray, t: int) -> None:
        """F rows of before states `ids` (room for `t` shapes: `reserve`)."""
        self.table[ids, :t] = rows
        self.cols[ids] = t
        self.is_tracked[ids] = False  # its dot is taken afresh (a stale copy in `tracked` is harmless)

    def store_after(self, ids: np.ndarray, rows: np.ndarray, t: int) -> None:
        """F rows of after states `ids` (room for `t` shapes: `reserve`)."""
        self.after[ids, :t] = rows
        self.after_cols[ids] = t


class ClusterIndex:
    """Per-node free resources as numpy arrays, updated one node at a time.

    Rows follow `names` (the caller's node order; ties between equal scores go to the lower
    row). Device slots per node are columns 0..G-1; cap 0 marks a missing device.
    """

    def __init__(
        self,
        *,
        names: Sequence[str],
        cpu_total: npt.ArrayLike,
        mem_total: npt.ArrayLike,
        models: Sequence[str],
        cap: npt.ArrayLike,
        cpu_free: npt.ArrayLike | None = None,
        mem_free: npt.ArrayLike | None = None,
        free: npt.ArrayLike | None = None,
        memory_total: npt.ArrayLike | None = None,
        memory_free: npt.ArrayLike | None = None,
        device_memory: npt.ArrayLike | None = None,
    ) -> None:
        self.names = list(names)
        self.row = {name: i for i, name in enumerate(self.names)}
        self.cpu_total = np.asarray(cpu_total, dtype=np.int64)
        self.mem_total = np.asarray(mem_total, dtype=np.int64)
        self.cpu_free = np.array(self.cpu_total if cpu_free is None else cpu_free, dtype=np.int64)
        self.mem_free = np.array(self.mem_total if mem_free is None else mem_free, dtype=np.int64)
        self.model_ids: dict[str, int] = {}
        self.model = np.array([self.model_ids.setdefault(m, len(self.model_ids)) for m in models], dtype=np.int64)
        self.cap = (
            np.asarray(cap, dtype=np.int64).reshape(len(self.names), -1) if len(self.names) else np.zeros((0, 1), dtype=np.int64)
        )
        self.free = np.array(self.cap if free is None else free, dtype=np.int64).reshape(self.cap.shape)
        self.gpu_total = self.cap.sum(axis=1)
        self.unit = self.cap.max(axis=1, initial=0)  # one device's amount (the node's largest)
        # Device memory (binpack/spread's measure, as `core._remaining_gpu`); openb: the GPU amount.
        self.memory_total = np.asarray(self.gpu_total if memory_total is None else memory_total, dtype=np.int64)
        self.memory_free = np.array(self.free.sum(axis=1) if memory_free is None else memory_free, dtype=np.int64)
        self.device_memory = np.asarray(
            self.cap.max(axis=1, initial=0) if device_memory is None else device_memory, dtype=np.int64
        )
        # Equivalence classes: nodes in the same state (model, CPU, memory, device amounts as a
        # multiset) share an id, so a policy scores one representative per class.
        self._state_ids: dict[tuple[Any, ...], int] = {}
        self._by_state: _FragCache | None = None  # F_n(m) rows kept for the last workload scored
        self._model_share: np.ndarray | None = None  # each GPU model's share of the cluster's GPU
        self._scratch = np.zeros(64, dtype=np.int64)  # by state id, for `_classes`
        self.state = np.array([self._state_id(r) for r in range(len(self.names))], dtype=np.int64)
        # Twins: nodes alike in every figure a scorer reads (`_twin_id`) score alike, so `choose`
        # scores the first of each (the lowest row, which wins their tie) and no other.
        self._twin_ids: dict[tuple[Any, ...], int] = {}
        self.twin = np.array([self._twin_id(r) for r in range(len(self.names))], dtype=np.int64)
        # Per-node figures the filters read, kept with each update: free GPU in all, the most on
        # one device, idle devices, and which device slots hold a free amount not seen earlier
        # on the node (one candidate per distinct amount).
        self.gsum = np.zeros(len(self.names), dtype=np.int64)
        self.gmax = np.zeros(len(self.names), dtype=np.int64)
        self.idle = np.zeros(len(self.names), dtype=np.int64)
        self.distinct = np.zeros(self.cap.shape, dtype=bool)
        self._derive(slice(None))

    def _derive(self, rows: np.ndarray | slice) -> None:
        free, cap = self.free[rows], self.cap[rows]
        present = cap > 0
        self.gsum[rows] = free.sum(axis=1)
        self.gmax[rows] = np.where(present, free, -1).max(axis=1, initial=-1)
        self.idle[rows] = (present & (free == cap)).sum(axis=1)
        seen = np.zeros(free.shape, dtype=bool)
        for j in range(1, free.shape[1]):
            seen[:, j] = (free[:, :j] == free[:, j : j + 1]).any(axis=1)
        self.distinct[rows] = present & ~seen

    def _derive_row(self, row: int) -> None:
        """`_derive` for one node, in plain Python (a node has a handful of devices)."""
        free, cap = self.free[row].tolist(), self.cap[row].tolist()
        present = [c > 0 for c in cap]
        self.gsum[row] = sum(free)
        self.gmax[row] = max((f for f, p in zip(free, present) if p), default=-1)
        self.idle[row] = sum(1 for f, c, p in zip(free, cap, present) if p and f == c)
        self.distinct[row] = [p and f not in free[:j] for j, (f, p) in enumerate(zip(free, present))]

    def _state_id(self, row: int) -> int:
        pairs = tuple(sorted(zip(self.free[row].tolist(), self.cap[row].tolist())))
        key = (int(self.model[row]), int(self.cpu_free[row]), int(self.mem_free[row]), pairs)
        return self._state_ids.setdefault(key, len(self._state_ids))

    def _twin_id(self, row: int) -> int:
        """The id of `row`'s figures as the scorers read them: its CPU, memory, GPU memory and
        model, and its devices' capacities and free amounts in slot order (gpu_total, unit and
        the derived gsum, gmax, idle, distinct and state follow from these)."""
        key = (
            int(self.model[row]),
            int(self.cpu_total[row]),
            int(self.mem_total[row]),
            int(self.cpu_free[row]),
            int(self.mem_free[row]),
            int(self.memory_total[row]),
            int(self.memory_free[row]),
            int(self.device_memory[row]),
            tuple(self.cap[row].tolist()),
            tuple(self.free[row].tolist()),
        )
        return self._twin_ids.setdefault(key, len(self._twin_ids))

    def __len__(self) -> int:
        return len(self.names)

    def copy(self) -> ClusterIndex:
        other = object.__new__(ClusterIndex)
        other.__dict__.update(self.__dict__)
        other._state_ids = dict(self._state_ids)
        other._twin_ids = dict(self._twin_ids)
        other._by_state = None
        other._scratch = self._scratch.copy()
        for name in ("cpu_free", "mem_free", "free", "memory_free", "state", "twin", "gsum", "gmax", "idle", "distinct"):
            setattr(other, name, getattr(self, name).copy())
        return other

    # ---- updates -------------------------------------------------------------------------
    def commit(self, row: int, *, cpu: int, mem: int, takes: dict[int, int], memory: int = 0) -> None:
        """Take `cpu`, `mem` and `takes` ({device slot: amount}) from node `row`; `memory`
        (binpack/spread's device memory) defaults to the GPU amount taken. Never goes negative:
        raises ValueError (a caller bug: it committed a placement that does not fit)."""
        self.cpu_free[row] -= cpu
        self.mem_free[row] -= mem
        for slot, amount in takes.items():
            self.free[row, slot] -= amount
        self.memory_free[row] -= memory or sum(takes.values())
        self.state[row] = self._state_id(row)
        self.twin[row] = self._twin_id(row)
        self._derive_row(row)
        if self.cpu_free[row] < 0 or self.mem_free[row] < 0 or (self.free[row] < 0).any():
            raise ValueError(f"over-commit on node {self.names[row]}")

    def set_row(self, row: int, *, cpu_free: int, mem_free: int, free: Sequence[int], memory_free: int) -> None:
        """Replace a node's free figures (the scheduler, after the exact allocator's plan)."""
        self.cpu_free[row], self.mem_free[row], self.memory_free[row] = cpu_free, mem_free, memory_free
        self.free[row, :] = 0
        self.free[row, : len(free)] = free
        self.state[row] = self._state_id(row)
        self.twin[row] = self._twin_id(row)
        self._derive_row(row)

    # ---- queries -------------------------------------------------------------------------
    def model_arrays(self) -> dict[str, int]:
        return self.model_ids

    def feasible(self, shape: Shape) -> np.ndarray:
        """(N,) bool: nodes with the CPU, memory, model and device amounts `shape` needs now."""
        ok = (self.cpu_free >= shape.cpu) & (self.mem_free >= shape.mem)
        if shape.models:
            allowed = [self.model_ids[m] for m in shape.models if m in self.model_ids]
            ok &= np.isin(self.model, allowed)
        if shape.kind == SHARE:
            ok &= self.gmax >= shape.amount
        elif shape.kind == WHOLE:
            ok &= self.idle >= shape.count
        elif shape.kind == SPAN:
            ok &= self.gsum >= shape.amount
        return ok

    def candidates(self, shape: Shape, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where `shape` could go among `rows`: (cand_rows, slots). SHARE: one candidate per
        distinct free amount on a node that holds it (which device of equal free amount is
        immaterial to the scores), `slots` its device slot; otherwise one per node, slot -1."""
        if shape.kind == SHARE:
            r, c = np.nonzero((self.free[rows] >= shape.amount) & self.distinct[rows])
            return rows[r], c
        return rows, np.full(len(rows), -1)

    def after_states(self, shape: Shape, cand: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """(K, G) free amounts after placing `shape` on each candidate: SHARE on its slot, WHOLE
        on the first idle devices, SPAN filling the most-free devices first."""
        free = self.free[cand]
        after = free.copy()
        if shape.kind == SHARE:
            after[np.arange(len(cand)), slots] -= shape.amount
        elif shape.kind == WHOLE:
            cap = self.cap[cand]
            idle = (free == cap) & (cap > 0)
            after[idle & (np.cumsum(idle, axis=1) <= shape.count)] = 0
        elif shape.kind == SPAN:
            order = np.argsort(-free, axis=1, kind="stable")
            sorted_free = np.take_along_axis(free, order, axis=1)
            before = np.cumsum(sorted_free, axis=1) - sorted_free
            take = np.clip(shape.amount - before, 0, sorted_free)
            np.put_along_axis(after, order, sorted_free - take, axis=1)
        return np.asarray(after)

    def _gpu_after(self, shape: Shape, cand: np.ndarray) -> np.ndarray:
        """Free GPU left on each candidate's node (whole devices counted at the node's largest)."""
        if shape.kind == WHOLE:
            return np.asarray(self.gsum[cand] - shape.count * self.unit[cand])
        return np.asarray(self.gsum[cand] - (shape.amount if shape.kind in (SHARE, SPAN) else 0))

    def frag(
        self,
        rows: np.ndarray,
        arrays: WorkloadArrays,
        *,
        cpu: np.ndarray | None = None,
        mem: np.ndarray | None = None,
        free: np.ndarray | None = None,
    ) -> np.ndarray:
        cpu = self.cpu_free[rows] if cpu is None else cpu
        mem = self.mem_free[rows] if mem is None else mem
        free = self.free[rows] if free is None else free
        return expected_fragmentation(cpu, mem, self.model[rows], free, self.cap[rows], arrays)

    def fragmentation_rate(self, workload: Workload) -> float:
        """Cluster fragmentation rate in percent: Σ_n F_n(M) / Σ_n free GPU × 100 (Weng et al.
        ATC'23, Eq. 6), p = the workload's shapes seen so far."""
        arrays = workload.arrays(self.model_ids)
        free_total = float(self.free.sum())
        if free_total == 0 or arrays.total == 0:
            return 0.0
        frag = self.frag(np.arange(len(self)), arrays).sum() / arrays.total
        return float(100.0 * frag / free_total)

    def scores(self, shape: Shape, policy: str, workload: Workload | None = None, *, best_only: bool = False) -> Scored:
        """Score every (feasible node, device) candidate for `shape` under `policy`, lower is
        better: the policy's scorer (POLICY_SCORERS) on the feasible candidates. Returns (rows,
        slots, keys) where keys is a tuple of (K,) arrays for np.lexsort, most significant
        last. `best_only`: candidates that cannot be the best may be left out (`choose`: of
        twin nodes, `_twin_id`, only the lowest row, which wins their tie; fgd-plus scores a
        SHARE request's best plan class only). Raises ValueError for an
        unknown policy, and for a fragmentation-aware one without `workload`."""
        rows = np.nonzero(self.feasible(shape))[0]
        if best_only and len(rows) > 1:  # the first of each twin class: the others cannot be best
            rows = rows[np.sort(np.unique(self.twin[rows], return_index=True)[1])]
        cand, slots = self.candidates(shape, rows)
        scorer = POLICY_SCORERS.get(policy)
        if scorer is None:
            raise ValueError(f"unknown placement policy {policy!r} (known: {', '.join(POLICIES)})")
        return scorer(self, shape, cand, slots, workload, best_only=best_only)

    def _frag_delta(
        self, shape: Shape, cand: np.ndarray, slots: np.ndarray, arrays: WorkloadArrays, workload: Workload
    ) -> np.ndarray:
        """FGD's gradient per candidate: F(after) − F(before), computed once per equivalence
        class of (node state, device amount taken from). F_n(m) rows are kept (`_FragCache`)
        for before states by state id and for after states by (shape, state, amount), so only
        classes not met before, or rows missing shapes seen since, are computed; p weighs
        them afresh each call."""
        state = self.state[cand]
        t = len(arrays.cpu)
        cache = self._frag_cache(workload, t)
        if shape.kind == SHARE:  # classes: (state, free amount of the device taken from)
            ukeys, first, inverse = np.unique(state * (1 << 22) + self.free[cand, slots], return_index=True, return_inverse=True)
            before_ids = ukeys >> 22
        else:  # classes: states (one representative each: equal states score alike)
            first, inverse = self._classes(state)
            ukeys = before_ids = state[first]
        after_ids = cache.after_ids(shape, ukeys)
        stale_before = np.nonzero(cache.cols[before_ids] < t)[0]
        if len(stale_before) > 1:  # equal states in one call: compute each once
            before_new, at = np.unique(before_ids[stale_before], return_index=True)
            before_rows = cand[first[stale_before[at]]]
        elif len(stale_before):
            before_new, before_rows = before_ids[stale_before], cand[first[stale_before]]
        else:
            before_new = before_rows = stale_before
        stale_after = np.nonzero(cache.after_cols[after_ids] < t)[0]
        if len(before_rows) or len(stale_after):  # both kinds of rows in one pass
            after_rows = cand[first[stale_after]]
            rows = np.concatenate([before_rows, after_rows])
            parts = fragmentation_by_shape(
                np.concatenate([self.cpu_free[before_rows], self.cpu_free[after_rows] - shape.cpu]),
                np.concatenate([self.mem_free[before_rows], self.mem_free[after_rows] - shape.mem]),
                self.model[rows],
                np.concatenate([self.free[before_rows], self.after_states(shape, after_rows, slots[first[stale_after]])]),
                self.cap[rows],
                arrays,
            )
            cache.store(before_new, parts[: len(before_rows)], t)
            cache.store_after(after_ids[stale_after], parts[len(before_rows) :], t)
        p = arrays.p
        delta = cache.after[after_ids, :t] @ p - cache.before_dots(before_ids, p, t, self.state)
        return np.asarray(delta[inverse.reshape(-1)])

    def _classes(self, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first, inverse) for a (K,) array of state ids: one position per distinct state and
        each position's class, as np.unique gives, in O(K) through a scratch array by state id
        (which position stands for a class is immaterial: equal states score alike)."""
        if len(self._scratch) < len(self._state_ids):
            self._scratch = np.zeros(2 * len(self._state_ids), dtype=np.int64)
        positions = np.arange(len(state))
        self._scratch[state] = positions
        first = np.nonzero(self._scratch[state] == positions)[0]
        self._scratch[state[first]] = np.arange(len(first))
        return first, self._scratch[state]

    def _frag_cache(self, workload: Workload, t: int) -> _FragCache:
        """The F_n(m) rows kept for `workload` (another workload starts afresh), with room for
        every state id and `t` shapes."""
        if self._by_state is None or self._by_state.workload is not workload:
            self._by_state = _FragCache(workload, exact_in_float32=int(self.gpu_total.max(initial=0)) < (1 << 24))
        self._by_state.reserve(len(self._state_ids), t)
        return self._by_state

    def _plan_rank(self, shape: Shape, cand: np.ndarray, slots: np.ndarray, workload: Workload) -> np.ndarray:
        """(K,) ints: `packing.plan_ranks` (0 on plan, 1 idle, 2 elsewhere) of the candidate's
        device for `shape.amount` under the workload's packing plans. SHARE: the device is the
        candidate's slot. SPAN (the scheduler's fGPU requests): the node's best device that
        holds the amount alone (where the allocator puts it: `core.allocate_shares`), 2 where
        none does."""
        if shape.kind == SHARE:
            cap, free = self.cap[cand, slots], self.free[cand, slots]
            holds = None
        else:
            cap, free = self.cap[cand], self.free[cand]
            holds = (cap > 0) & (free >= shape.amount)
        rank = plan_ranks(cap, cap - free, shape.amount, workload.packing_plan, holds)
        return rank if shape.kind == SHARE else rank.min(axis=1, initial=2)

    def _pressure(self, arrays: WorkloadArrays) -> np.ndarray:
        """Per GPU model: the share of the seen GPU demand that only some models may serve
        (`Shape.models`, spread evenly over the models allowed), over the model's share of the
        cluster's GPU. 0 where no request names models."""
        demand = arrays.model_demand
        if demand is None or not demand.any():
            return np.zeros(len(self.model_ids))
        share = self._model_share
        if share is None:  # the cluster's GPU by model never changes
            capacity = np.bincount(self.model, weights=self.gpu_total, minlength=len(self.model_ids))
            share = self._model_share = capacity / max(capacity.sum(), 1)
        return np.where(share > 0, demand[: len(share)] / np.maximum(share, 1e-12), 0.0)

    def _stranded(
        self,
        rows: np.ndarray,
        arrays: WorkloadArrays,
        cpu: np.ndarray | None = None,
        mem: np.ndarray | None = None,
        gpu: np.ndarray | None = None,
    ) -> np.ndarray:
        """Free GPU on each row's node that its free CPU or memory cannot serve at the seen
        workload's CPU and memory per unit of GPU: max(0, gpu − cpu / r_cpu, gpu − mem / r_mem)."""
        cpu = self.cpu_free[rows] if cpu is None else cpu
        mem = self.mem_free[rows] if mem is None else mem
        gpu = self.gsum[rows] if gpu is None else gpu
        by_cpu = gpu - cpu / arrays.cpu_per_gpu if arrays.cpu_per_gpu > 0 else 0
        by_mem = gpu - mem / arrays.mem_per_gpu if arrays.mem_per_gpu > 0 else 0
        return np.asarray(np.maximum(0.0, np.maximum(by_cpu, by_mem)))

    def _best_fit(
        self, shape: Shape, rows: np.ndarray, gpu_after: np.ndarray, weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
    ) -> np.ndarray:
        """Σ weight × (left after the placement / node total) over CPU, memory and GPU (terms
        of weight 0 are not computed)."""
        fit = np.zeros(len(rows))
        if weights[0]:
            fit = fit + weights[0] * ((self.cpu_free[rows] - shape.cpu) / np.maximum(self.cpu_total[rows], 1))
        if weights[1]:
            fit = fit + weights[1] * ((self.mem_free[rows] - shape.mem) / np.maximum(self.mem_total[rows], 1))
        if weights[2]:
            fit = fit + weights[2] * (gpu_after / np.maximum(self.gpu_total[rows], 1))
        return fit

    def choose(self, shape: Shape, policy: str, workload: Workload | None = None) -> tuple[int, int] | None:
        """The best (row, device slot or -1) for `shape`, or None when no node fits now."""
        cand, slots, keys = self.scores(shape, policy, workload, best_only=True)
        if len(cand) == 0:
            return None
        best = int(_lex_best(keys)[0])
        return int(cand[best]), int(slots[best])

    def ranking(self, shape: Shape, policy: str, workload: Workload | None = None) -> list[int]:
        """Feasible rows, best first (each node at the rank of its best candidate)."""
        cand, _, keys = self.scores(shape, policy, workload)
        order = cand[np.lexsort(keys)]
        _, first = np.unique(order, return_index=True)
        return [int(r) for r in order[np.sort(first)]]

    def place(self, shape: Shape, policy: str, workload: Workload | None = None) -> tuple[int, dict[int, int]] | None:
        """Choose and commit: the row and {device slot: amount} taken, or None (nothing changed)."""
        chosen = self.choose(shape, policy, workload)
        if chosen is None:
            return None
        row, slot = chosen
        takes = self.takes(row, shape, slot)
        self.commit(row, cpu=shape.cpu, mem=shape.mem, takes=takes)
        return row, takes

    def takes(self, row: int, shape: Shape, slot: int) -> dict[int, int]:
        """{device slot: amount} `shape` takes on `row` (SHARE on `slot`)."""
        if shape.kind == SHARE:
            return {slot: shape.amount}
        if shape.kind == WHOLE:
            idle = np.nonzero((self.free[row] == self.cap[row]) & (self.cap[row] > 0))[0][: shape.count]
            return {int(s): int(self.free[row, s]) for s in idle}
        if shape.kind == SPAN:
            after = self.after_states(shape, np.array([row]), np.array([-1]))
            diff = self.free[row] - after[0]
            return {int(s): int(diff[s]) for s in np.nonzero(diff)[0]}
        return {}


# --- the policies: one scorer each (ClusterIndex.scores) -----------------------------------------
# A scorer takes the index, the shape, its feasible candidates (node rows and device slots, as
# `ClusterIndex.candidates` gives them), the workload seen so far (fragmentation-aware policies
# only) and `best_only` (see `ClusterIndex.scores`); it answers (rows, slots, keys) for
# np.lexsort, lower is better, most significant key last.


def _remaining_memory(index: ClusterIndex, shape: Shape, cand: np.ndarray) -> np.ndarray:
    """The candidates' node GPU memory left after `shape`, as a fraction of their total."""
    taken = (
        shape.memory + shape.device_fraction * index.device_memory[cand]
        if shape.memory or shape.device_fraction
        else shape.gpu_amount
    )
    total = np.where(index.memory_total[cand] > 0, index.memory_total[cand], 1)
    return np.asarray((index.memory_free[cand] - taken) / total)


def score_binpack(
    index: ClusterIndex,
    shape: Shape,
    cand: np.ndarray,
    slots: np.ndarray,
    workload: Workload | None = None,
    *,
    best_only: bool = False,
) -> Scored:
    """binpack (HAMi's node policy): the node with the least GPU left free after the request (its
    GPU memory, as a fraction of the node's), the first node on a tie; within the node, for a
    SHARE request, the device with the least free amount that holds it (the allocator's
    `evenly`)."""
    remaining = _remaining_memory(index, shape, cand)
    if shape.kind == SHARE:
        return cand, slots, (index.free[cand, slots], cand, remaining)
    return cand, slots, (cand, remaining)


def score_spread(
    index: ClusterIndex,
    shape: Shape,
    cand: np.ndarray,
    slots: np.ndarray,
    workload: Workload | None = None,
    *,
    best_only: bool = False,
) -> Scored:
    """spread (HAMi's node policy): binpack's order reversed: the node with the most GPU left
    free after the request, the first node on a tie; within the node, for a SHARE request, the
    device with the most free amount."""
    remaining = _remaining_memory(index, shape, cand)
    if shape.kind == SHARE:
        return cand, slots, (-index.free[cand, slots], cand, -remaining)
    return cand, slots, (cand, -remaining)


def score_best_fit(
    index: ClusterIndex,
    shape: Shape,
    cand: np.ndarray,
    slots: np.ndarray,
    workload: Workload | None = None,
    *,
    best_only: bool = False,
) -> Scored:
    """best-fit: the node the request fills best (`ClusterIndex._best_fit`: CPU, memory and GPU
    left, weighted); within the node, for a SHARE request, the device with the least free
    amount that holds it."""
    fit = index._best_fit(shape, cand, index._gpu_after(shape, cand))
    if shape.kind == SHARE:
        return cand, slots, (index.free[cand, slots], cand, fit)
    return cand, slots, (cand, fit)


def _needs_workload(policy: str, workload: Workload | None) -> Workload:
    if workload is None:
        raise ValueError(f"policy {policy!r} needs the workload seen so far")
    return workload


def score_fgd(
    index: ClusterIndex,
    shape: Shape,
    cand: np.ndarray,
    slots: np.ndarray,
    workload: Workload | None = None,
    *,
    best_only: bool = False,
) -> Scored:
    """fgd (Weng et al. ATC'23, "Fragmentation Gradient Descent"): the candidate whose
    fragmentation grows least, weighed by the workload seen so far. Raises ValueError without
    `workload`."""
    workload = _needs_workload("fgd", workload)
    if not len(cand):  # fits nowhere now
        return cand, slots, (cand,)
    arrays = workload.arrays(index.model_ids)
    return cand, slots, (cand, index._frag_delta(shape, cand, slots, arrays, workload))


def score_fgd_plus(
    index: ClusterIndex,
    shape: Shape,
    cand: np.ndarray,
    slots: np.ndarray,
    workload: Workload | None = None,
    *,
    best_only: bool = False,
) -> Scored:
    """fgd-plus (ours, on fgd): for SHARE and SPAN requests first the packing plan's rank and
    the model's scarcity pressure, then fgd's fragmentation growth plus best-fit, stranded CPU
    and memory and (with SCARCITY_WEIGHT) scarcity terms. Raises ValueError without `workload`."""
    workload = _needs_workload("fgd-plus", workload)
    if not len(cand):  # fits nowhere now
        return cand, slots, (cand,)
    arrays = workload.arrays(index.model_ids)
    pressured = not shape.models and arrays.named_any  # else no model pressure: all 0
    pressure = index._pressure(arrays)[index.model[cand]] if pressured else np.zeros(len(cand))
    leading: tuple[np.ndarray, ...] = ()
    if shape.kind in (SHARE, SPAN):
        leading = (index._plan_rank(shape, cand, slots, workload), np.round(pressure / PRESSURE_STEP))
        if best_only:  # the rest cannot win: score only the best (plan rank, pressure) class
            keep = _lex_best(leading)
            cand, slots, pressure = cand[keep], slots[keep], pressure[keep]
            leading = tuple(key[keep] for key in leading)
    delta = index._frag_delta(shape, cand, slots, arrays, workload)
    gpu_after = index._gpu_after(shape, cand)
    fit = index._best_fit(shape, cand, gpu_after, PLUS_FIT_WEIGHTS)
    stranded = index._stranded(
        cand, arrays, index.cpu_free[cand] - shape.cpu, index.mem_free[cand] - shape.mem, gpu_after
    ) - index._stranded(cand, arrays)
    score = delta / arrays.total + FIT_WEIGHT * fit * np.maximum(index.unit[cand], 1) + STRAND_WEIGHT * stranded
    if SCARCITY_WEIGHT and pressured:
        score = score + SCARCITY_WEIGHT * pressure * (
            shape.gpu_amount + (shape.cpu / arrays.cpu_per_gpu if arrays.cpu_per_gpu > 0 else 0)
        )
    return cand, slots, (cand, fit, score, *leading)


POLICY_SCORERS = {
    "binpack": score_binpack,
    "spread": score_spread,
    "best-fit": score_best_fit,
    "fgd": score_fgd,
    "fgd-plus": score_fgd_plus,
}
