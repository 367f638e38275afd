"""Device packing plans: which fractional (SHARE) amounts should share one device.

Fractional requests fragment GPUs when the amounts put on one device do not add up to it: a
device holding 0.81 keeps a 0.19 sliver that only rare small requests fill. Which amounts
belong together depends on the request mix, and that is a bin-packing question with a known
(learned) item-size distribution. Its fractional optimum is the LP relaxation of bin packing,
the cutting-stock LP of Gilmore and Gomory ("A linear programming approach to the
cutting-stock problem", Operations Research 9, 1961): minimise Σ_j x_j over packing patterns j
(multisets of amounts that fit one device) subject to Σ_j A_ij x_j ≥ d_i for each amount i,
solved by column generation (patterns priced by an unbounded knapsack over the LP's duals).
An online packer that follows the optimal fractional packing of the item-size distribution is
asymptotically optimal for that distribution (Rhee and Talagrand, "On-line bin packing of
items of random sizes", SIAM J. Comput. 22, 1993; Csirik et al., "On the sum-of-squares
algorithm for bin packing", J. ACM 53, 2006, §1, discuss such distribution-based packers).

Here the plan is used without per-device state, so that a scheduler that rebuilds its view of
the cluster each pass gets the same choices: a device with `used` units taken is *on plan* for
an amount `a` when `used` is the sum of a sub-multiset of some pattern in the LP's support that
still has `a` left in it. The fgd-plus policy (`cluster.py`) puts a SHARE request on such a
device first, then on an idle one, then anywhere else it fits.

Units: `capacity` and amounts are integers in the caller's device units (openb: milli-GPU,
1000 a GPU; the scheduler: fGPU quanta of one device). Pure: numpy and scipy's HiGHS LP.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_STEPS = 1024  # knapsack resolution: a capacity of more steps is priced in coarser steps
MAX_SUBSETS = 1 << 16  # sub-multisets enumerated per plan (the on-plan table), at most
MAX_ROUNDS = 200  # column-generation rounds, at most


@dataclass(frozen=True)
class PackingPlan:
    """The support of an optimal fractional packing of `amounts` into devices of `capacity`.

    `patterns`: ((amount, count), ...) per pattern in the LP's support, with `frequency` the
    LP's x (devices of that pattern per the demand given, fractional). `bins`: the LP optimum
    (a lower bound on the devices the demand needs). `table`: (capacity + 1, len(amounts))
    bool, table[used, i] = a device with `used` taken is on plan for amounts[i]."""

    capacity: int
    amounts: tuple[int, ...]
    patterns: tuple[tuple[tuple[int, int], ...], ...]
    frequency: tuple[float, ...]
    bins: float
    table: np.ndarray

    def on_plan(self, used: np.ndarray, amount: int) -> np.ndarray:
        """(K,) bool for (K,) ints `used`: devices with that much taken are on plan for
        `amount` (False for an amount the plan does not know, and for used outside 0..capacity)."""
        used = np.asarray(used, dtype=np.int64)
        try:
            column = self.amounts.index(amount)
        except ValueError:
            return np.zeros(used.shape, dtype=bool)
        inside = (used >= 0) & (used <= self.capacity)
        # np.where, not np.clip: the same rows read (those outside are masked), at a third of the cost
        on_plan: np.ndarray = inside & self.table[np.where(inside, used, 0), column]
        return on_plan


def plan_ranks(
    capacity: np.ndarray,
    used: np.ndarray,
    amount: int,
    plan_for: Callable[[int], PackingPlan | None],
    eligible: np.ndarray | None = None,
) -> np.ndarray:
    """fgd-plus's order among devices for a request of `amount` units, one int per device
    (arrays of any one shape: `capacity` and `used` in units, `eligible` bool, default all):
    0 in use and on the plan for `amount`, 1 idle, 2 otherwise or not eligible; every eligible
    device of a size whose plan is None (nothing to plan: no preference) ranks 0. `plan_for`
    (capacity → plan, e.g. `cluster.Workload.packing_plan`) is asked only for sizes with an
    eligible device in use (idle ones alone rank alike), smallest size first. The index and the
    allocator both rank by this, so a node is chosen for the device the allocator then takes.
    Called once or twice per placement on a handful of devices: a few whole-array operations."""
    idle = used == 0
    busy = used > 0
    if eligible is None:
        rank = np.where(idle, 1, 2)
    else:
        rank = np.where(eligible & idle, 1, 2)
        busy &= eligible
    sizes = capacity[busy].tolist()
    if not sizes:
        return rank
    distinct = sorted(set(sizes))  # np.unique's order, without its cost on a few values
    for size in distinct:
        plan = plan_for(int(size))
        mine = capacity == size
        if plan is None:
            rank[mine if eligible is None else mine & eligible] = 0
        else:
            mine &= busy
            taken = used[mine]
            rank[mine] = np.where(plan.on_plan(taken, amount), 0, rank[mine])
    return rank


def solver_load() -> None:
    """Import the LP solver `solve_packing_plan` uses (scipy.optimize: about 385 modules, 0.5-1.3 s
    of CPU the first time in a process), so that a long-lived process pays it when it starts and
    not in the first scheduler pass that meets a device in use (issue 35.2: 45 % of a
    1,000-session pass's samples on 1,000 nodes). The manager worker calls it as it starts
    (console/celery.py); other processes import the solver when they first solve."""
    import scipy.optimize  # noqa: F401


def solve_packing_plan(capacity: int, demand: Mapping[int, float], start: PackingPlan | None = None) -> PackingPlan | None:
    """The packing plan for `demand` ({amount: count or weight}, amounts in device units) on
    devices of `capacity` units. Amounts ≤ 0 or > `capacity` and zero weights are left out;
    None when nothing is left or the LP solver fails (callers then pack without a plan).
    `start`: an earlier plan for this capacity, whose patterns seed the columns (a demand that
    has moved a little then needs a round or two instead of a dozen).

    Column generation: start from one single-amount pattern per amount, solve the restricted LP
    (scipy.optimize.linprog, HiGHS), price a new pattern by an unbounded knapsack over the
    duals, stop when no pattern has reduced cost below 0 (or after MAX_ROUNDS). Knapsack
    weights are in steps of the amounts' gcd, rounded up to at most MAX_STEPS steps a device
    (rounding up keeps every pattern within `capacity`). Deterministic for equal input."""
    from scipy.optimize import linprog

    items = sorted((int(a), float(w)) for a, w in demand.items() if 0 < int(a) <= capacity and w > 0)
    if not items:
        return None
    amounts = tuple(a for a, _ in items)
    need = np.array([w for _, w in items])
    step = math.gcd(*amounts)
    step = max(step, -(-capacity // MAX_STEPS))
    weights = [-(-a // step) for a in amounts]
    room = capacity // step
    patterns = [np.eye(len(amounts), dtype=np.int64)[i] * max(1, room // weights[i]) for i in range(len(amounts))]
    if start is not None and start.capacity == capacity:
        position = {a: i for i, a in enumerate(amounts)}
        for pattern in start.patterns:
            if all(a in position for a, _ in pattern):
                column = np.zeros(len(amounts), dtype=np.int64)
                for a, n in pattern:
                    column[position[a]] = n
                if not any((column == p).all() for p in patterns):
                    patterns.append(column)
    result: Any = None  # scipy's OptimizeResult of the last round (MAX_ROUNDS ≥ 1)
    for _ in range(MAX_ROUNDS):
        matrix = np.array(patterns, dtype=np.float64).T
        result = linprog(np.ones(len(patterns)), A_ub=-matrix, b_ub=-need, bounds=(0, None), method="highs")
        if result.status != 0:
            return None
        duals = -np.asarray(result.ineqlin.marginals)
        value, counts = _knapsack(weights, duals, room)
        if value <= 1.0 + 1e-9 or any((counts == p).all() for p in patterns):
            break
        patterns.append(counts)
    support = [j for j in range(len(patterns)) if result.x[j] > 1e-9]
    chosen = tuple(tuple((amounts[i], int(patterns[j][i])) for i in np.nonzero(patterns[j])[0]) for j in support)
    return PackingPlan(
        capacity=capacity,
        amounts=amounts,
        patterns=chosen,
        frequency=tuple(float(result.x[j]) for j in support),
        bins=float(result.fun),
        table=_on_plan_table(capacity, amounts, chosen),
    )


def _knapsack(weights: list[int], values: np.ndarray, room: int) -> tuple[float, np.ndarray]:
    """Unbounded knapsack: max Σ values_i k_i with Σ weights_i k_i ≤ room. (best value, k)."""
    best = np.zeros(room + 1)
    pick = np.full(room + 1, -1, dtype=np.int64)
    w = np.asarray(weights, dtype=np.int64)
    for r in range(1, room + 1):
        best[r] = best[r - 1]
        fits = np.nonzero(w <= r)[0]
        if len(fits):
            gains = best[r - w[fits]] + values[fits]
            i = int(np.argmax(gains))
            if gains[i] > best[r] + 1e-12:
                best[r], pick[r] = gains[i], fits[i]
    counts = np.zeros(len(weights), dtype=np.int64)
    r = room
    while r > 0:
        if pick[r] < 0:
            r -= 1
            continue
        counts[pick[r]] += 1
        r -= weights[pick[r]]
    return float(best[room]), counts


def _on_plan_table(capacity: int, amounts: tuple[int, ...], patterns: Iterable[tuple[tuple[int, int], ...]]) -> np.ndarray:
    """table[used, i]: some pattern, filled up (`_filled`), has a sub-multiset summing to
    `used` with amounts[i] left over."""
    table = np.zeros((capacity + 1, len(amounts)), dtype=bool)
    column = {a: i for i, a in enumerate(amounts)}
    budget = MAX_SUBSETS
    for pattern in (_filled(capacity, amounts, p) for p in patterns):
        sizes = [a for a, _ in pattern]
        for taken in itertools.product(*(range(n + 1) for _, n in pattern)):
            budget -= 1
            if budget < 0:
                return table
            used = sum(a * k for a, k in zip(sizes, taken))
            for (a, n), k in zip(pattern, taken):
                if k < n:
                    table[used, column[a]] = True
    return table


def _filled(capacity: int, amounts: tuple[int, ...], pattern: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """`pattern` with its room filled, largest amount first: the LP covers demand with ≥, so
    a pattern's spare room may take any amount; the filled pattern keeps those on plan too
    (a 0.05 request on a device planned for 0.47 + 0.47)."""
    counts = dict(pattern)
    room = capacity - sum(a * n for a, n in pattern)
    for a in sorted(amounts, reverse=True):
        if a <= room:
            counts[a] = counts.get(a, 0) + room // a
            room -= (room // a) * a
    return tuple(sorted(counts.items()))
