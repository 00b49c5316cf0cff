"""Discrete-event simulation of a plan: makespan, idle time, waits, critical path, deadlocks.

The kernel model, per CTA, for its steps k = 0, 1, ... in work-list order:

* compute of step k (cost ``c`` by tile class: full / partial / empty) starts when compute
  of step k-1 ended and the dQ reduction of step ``k-1-depth`` ended (``depth`` = 1: one dQ
  staging buffer lets compute run one step ahead of the writer; ``depth`` = 0: no overlap);
* the reduction of step k (cost ``r``) starts when compute of step k ended, the CTA's previous
  reduction ended (one dQ writer) and the contribution with the previous turn on the same Q
  tile ended its reduction plus the semaphore hand-off ``latency``;
* after the last step of a column the consumers run the column's epilogue (cost
  ``epilogue + r_kv``); under GQA the query heads ``j = 0 ... G-1`` of a KV group sum their
  dK/dV in ``kv_chains`` = C chains (``kv_links``): head ``j < G-1`` first waits for the same
  column of head ``j - C`` (its chain's previous add), head ``G-1`` for the last add of every
  chain (it sums them); C = 1 is ascending head order. Deadlocks through dK/dV are caught too.

All start times are a max-plus function of the plan, so the simulation is a longest-path
evaluation: CTAs advance lazily and block only on values another CTA has not produced yet.
A deadlock is exactly a state where every unfinished CTA waits on such a value; it does not
depend on the costs (only the plan's orders). Cost: about a microsecond of Python per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dash.schedules.orders import Plan

_UNKNOWN = -1.0


@dataclass(frozen=True)
class Costs:
    """Costs of the model, in any time unit (calibrate with ``dash.schedules.calibrate``).

    ``c``: compute of one (column, Q tile) step whose tile is fully visible;
    ``c_partial`` / ``c_empty``: steps on partially masked (diagonal) / fully masked tiles
    (default ``c``: the kernel runs the same GEMMs); ``r``: one serialized dQ reduce-add;
    ``latency``: semaphore hand-off from one contributor to the next; ``epilogue``: dK/dV
    store per column; ``r_kv``: serialized GQA dK/dV add per column.
    """

    c: float = 1.0
    r: float = 0.3
    latency: float = 0.0
    c_partial: float | None = None
    c_empty: float | None = None
    epilogue: float = 0.0
    r_kv: float = 0.0

    def __post_init__(self) -> None:
        for k, v in self.as_dict().items():
            if v is not None and (not np.isfinite(v) or v < 0):
                raise ValueError(f"cost {k}={v} must be finite and >= 0")

    def class_costs(self) -> np.ndarray:
        """``(3,)`` compute cost of a full, partial and empty tile."""
        cp = self.c if self.c_partial is None else self.c_partial
        ce = self.c if self.c_empty is None else self.c_empty
        return np.array([self.c, cp, ce], dtype=np.float64)

    def as_dict(self) -> dict[str, float | None]:
        return {"c": self.c, "r": self.r, "latency": self.latency, "c_partial": self.c_partial,
                "c_empty": self.c_empty, "epilogue": self.epilogue, "r_kv": self.r_kv}

    def scaled(self, factor: float) -> "Costs":
        """All costs multiplied by ``factor`` (the makespan scales by the same factor)."""
        d = {k: (None if v is None else v * factor) for k, v in self.as_dict().items()}
        return Costs(**d)


@dataclass(frozen=True)
class PathNode:
    """One node of the critical path: ``kind`` is "compute", "reduce" or "epilogue"."""

    kind: str
    cta: int
    b: int
    h: int
    n: int
    m: int  # -1 for an epilogue
    start: float
    end: float


@dataclass(eq=False)
class SimResult:
    """Outcome of ``simulate``. Times are in the unit of the costs.

    Step arrays (S,) follow ``plan.steps()`` order: ``compute_start``/``compute_end``,
    ``reduce_start``/``reduce_end`` (NaN where a deadlock left them unset) and ``turn_wait``
    (time the reduction waited for its turn). ``tile_wait`` (B, H, Mmax): total turn wait per
    Q tile. ``busy`` / ``idle_fraction`` (P,): compute time of each CTA, and the fraction of the
    makespan it did not compute. ``blocked`` (deadlock only): CTA -> what it waits on.
    """

    plan: Plan
    costs: Costs
    depth: int
    deadlock_free: bool
    makespan: float
    lower_bound: float
    lower_bound_work: float
    lower_bound_chain: float
    compute_start: np.ndarray
    compute_end: np.ndarray
    reduce_start: np.ndarray
    reduce_end: np.ndarray
    turn_wait: np.ndarray
    tile_wait: np.ndarray
    busy: np.ndarray
    idle_fraction: np.ndarray
    epilogue_start: np.ndarray
    epilogue_end: np.ndarray
    blocked: dict[int, str] = field(default_factory=dict)
    _path: list[PathNode] | None = field(default=None, repr=False)
    _ops: tuple | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        if not self.deadlock_free:
            return f"SimResult({self.plan.schedule!r}: DEADLOCK, {len(self.blocked)} CTAs blocked)"
        return (f"SimResult({self.plan.schedule!r}: makespan {self.makespan:.4g}, lower bound "
                f"{self.lower_bound:.4g}, mean idle {100 * self.mean_idle:.1f} %, max tile wait {self.max_wait:.4g})")

    @property
    def mean_idle(self) -> float:
        """Mean over CTAs of the idle fraction."""
        return float(self.idle_fraction.mean()) if len(self.idle_fraction) else 0.0

    @property
    def max_wait(self) -> float:
        """Largest total turn wait of one Q tile."""
        return float(self.tile_wait.max(initial=0.0))

    @property
    def total_wait(self) -> float:
        """Sum of all turn waits."""
        return float(np.nansum(self.turn_wait))

    @property
    def cta_last(self) -> np.ndarray:
        """``(P,)`` when each CTA's last step, reduce-add or epilogue ended (as
        ``ClaimReplay.cta_last``; what ``auto.end_with_dq_convert`` reads the tail from)."""
        last = np.zeros(self.plan.ctas)
        for arr in (self.compute_end, self.reduce_end):
            np.maximum.at(last, self.plan.steps()["cta"], np.nan_to_num(arr, nan=0.0))
        np.maximum.at(last, self.plan.col_cta(), np.nan_to_num(self.epilogue_end, nan=0.0))
        return last

    @property
    def efficiency(self) -> float:
        """``lower_bound / makespan`` (1 = optimal)."""
        return self.lower_bound / self.makespan if self.makespan > 0 else 1.0

    @property
    def critical_path(self) -> list[PathNode]:
        """The chain of operations that decides the makespan, first to last."""
        if self._path is None:
            self._path = _critical_path(self)
        return self._path

    def summary(self) -> dict[str, float | bool]:
        """The CLI's JSON record (makespan null on deadlock)."""
        ok = self.deadlock_free
        return {"makespan": float(self.makespan) if ok else None,
                "lower_bound": float(self.lower_bound),
                "idle_fraction": self.mean_idle if ok else None,
                "max_wait": self.max_wait if ok else None,
                "deadlock_free": bool(ok),
                "portable": bool(self.plan.portable)}


def turn_chain_keys(st: dict[str, np.ndarray], plan: Plan, chains: int = 1) -> np.ndarray:
    """Per step, the accumulation chain it adds to: its Q tile, and with ``chains`` > 1 its
    turn modulo ``chains`` (the kernel's ``dq_chains`` of its tile config: turn t is add t // chains of
    chain t % chains, and only adds of one chain wait for each other)."""
    if chains < 1:
        raise ValueError(f"chains={chains} must be >= 1")
    t = plan.tiling
    tile = (st["b"] * t.heads + st["h"]) * t.mmax + st["m"]
    return tile * chains + (st["turn"] % chains if chains > 1 else 0)


def _turn_links(st: dict[str, np.ndarray], plan: Plan, chains: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """For every step, the step with the previous turn in its chain (pred) and the next (succ)."""
    tile = turn_chain_keys(st, plan, chains)
    order = np.lexsort((st["turn"], tile))
    s_tile = tile[order]
    same = np.zeros(len(order), dtype=bool)
    same[1:] = s_tile[1:] == s_tile[:-1]
    pred = np.full(len(order), -1, dtype=np.int64)
    succ = np.full(len(order), -1, dtype=np.int64)
    pred[order[1:][same[1:]]] = order[:-1][same[1:]]
    succ[order[:-1][same[1:]]] = order[1:][same[1:]]
    return pred, succ


def kv_links(plan: Plan, kv_chains: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """GQA dK/dV waits between the columns of a KV group: ``(preds, succ)``.

    ``preds`` (K, C) holds, per column, the columns whose dK/dV writes its own waits for (-1:
    none), ``succ`` (K,) the one column that waits for it (-1: none). With G query heads per KV
    head and C = min(kv_chains, G - 1) chains, head ``j < G-1`` is add ``j // C`` of chain
    ``j % C`` and waits for head ``j - C``; head ``G-1`` waits for the last head of every chain
    and sums the chains (``store_dkv`` of csrc/kernels/bwd_epilogue.h). Every wait points to a
    lower query head of the same column."""
    K = len(plan.cols)
    group = plan.tiling.problem.heads_q // plan.tiling.problem.heads_kv
    C = max(1, min(int(kv_chains), group - 1))
    preds = np.full((K, C), -1, dtype=np.int64)
    succ = np.full(K, -1, dtype=np.int64)
    if group < 2 or K == 0:
        return preds, succ
    cidx = plan.column_index()
    b, h, n = (plan.cols[:, i].astype(np.int64) for i in range(3))
    j = h % group
    mid = (j < group - 1) & (j >= C)
    preds[mid, 0] = cidx[b[mid], h[mid] - C, n[mid]]
    last = j == group - 1
    first_head = h[last] - j[last]
    for c in range(C):
        jc = c + C * ((group - 2 - c) // C)  # the chain's last head
        preds[last, c] = cidx[b[last], first_head + jc, n[last]]
    has = preds >= 0
    succ[preds[has]] = np.nonzero(has)[0]
    return preds, succ


def simulate(plan: Plan, costs: Costs | None = None, depth: int = 1, *,
             c_steps: np.ndarray | None = None, r_steps: np.ndarray | None = None, chains: int = 1,
             kv_chains: int = 1) -> SimResult:
    """Simulate ``plan`` with ``costs`` and a compute/reduce pipeline ``depth`` (0 = no overlap).

    ``chains``: accumulation chains per Q tile (1: every contribution waits for the previous
    turn, the paper's model; the kernel's deterministic mode uses ``dq_chains`` of its tile config).
    ``kv_chains``: GQA dK/dV accumulation chains per KV group (``kv_links``; the kernel's
    deterministic mode uses ``dkv_chains`` of its tile config, at most G - 1).

    ``c_steps`` / ``r_steps`` (S,) override the compute / reduction cost of every step (in
    ``plan.steps()`` order), e.g. to check that a schedule stays deadlock-free and keeps its
    order under arbitrary timing.
    """
    costs = Costs() if costs is None else costs
    if depth < 0:
        raise ValueError(f"depth={depth} must be >= 0")
    t = plan.tiling
    st = plan.steps()
    S, P, K = plan.num_steps, plan.ctas, len(plan.cols)
    c_arr = costs.class_costs()[t.tile_class[st["b"], st["m"], st["n"]]] if c_steps is None \
        else np.asarray(c_steps, dtype=np.float64)
    r_arr = np.full(S, costs.r) if r_steps is None else np.asarray(r_steps, dtype=np.float64)
    if c_arr.shape != (S,) or r_arr.shape != (S,):
        raise ValueError(f"c_steps / r_steps must have shape ({S},)")
    pred, succ = _turn_links(st, plan, chains)
    step_cta = st["cta"]
    succ_cta = np.where(succ >= 0, step_cta[np.maximum(succ, 0)], -1)

    group = t.problem.heads_q // t.problem.heads_kv
    epi_cost = costs.epilogue + costs.r_kv
    with_epi = group > 1 or epi_cost > 0
    lens = np.diff(plan.visit_ptr)
    col_of_step = st["col"]
    if with_epi:
        # ops: each column's steps, then -(col + 1) for its epilogue.
        ops = np.empty(S + K, dtype=np.int64)
        pos_step = np.arange(S) + col_of_step
        pos_epi = plan.visit_ptr[1:] + np.arange(K)
        ops[pos_step] = np.arange(S)
        ops[pos_epi] = -(np.arange(K) + 1)
        op_ptr = plan.step_ptr + plan.cta_ptr
        kvpred, kvsucc = kv_links(plan, kv_chains)
        col_cta = plan.col_cta()
        kvsucc_cta = np.where(kvsucc >= 0, col_cta[np.maximum(kvsucc, 0)], -1)
        kvpred_lists = [[int(v) for v in row if v >= 0] for row in kvpred] if group > 1 else [[]] * K
        raw = _run_general(op_ptr.tolist(), ops.tolist(), plan.step_ptr.tolist(),
                           c_arr.tolist(), r_arr.tolist(), pred.tolist(), succ_cta.tolist(),
                           kvpred_lists, kvsucc_cta.tolist(), K, float(epi_cost),
                           float(costs.latency), int(depth))
    else:
        ops = None
        op_ptr = plan.step_ptr
        raw = _run_fast(op_ptr.tolist(), c_arr.tolist(), r_arr.tolist(), pred.tolist(),
                        succ_cta.tolist(), float(costs.latency), int(depth))
        kvpred = np.full((K, 1), -1, dtype=np.int64)
    cs, ce, rs, re, ks, ke, blocked = raw
    cs, ce, rs, re = (np.asarray(a, dtype=np.float64) for a in (cs, ce, rs, re))
    ks, ke = np.asarray(ks, dtype=np.float64), np.asarray(ke, dtype=np.float64)
    ok = not blocked
    unknown = re < 0
    re[unknown] = np.nan
    rs[unknown] = np.nan
    if with_epi:
        ke[ke < 0] = np.nan
        ks[np.isnan(ke)] = np.nan

    # Turn wait: how long each reduction sat waiting for the previous turn.
    prev_re = np.zeros(S)
    first = np.zeros(S, dtype=bool)
    first[plan.step_ptr[:-1][plan.step_ptr[:-1] < S]] = True
    prev_re[1:] = re[:-1]
    prev_re[first] = 0.0
    ready_own = np.maximum(ce, prev_re)
    turn_wait = np.maximum(0.0, rs - ready_own)
    tile_wait = np.zeros((t.batch, t.heads, t.mmax))
    if S:
        np.add.at(tile_wait, (st["b"], st["h"], st["m"]), np.nan_to_num(turn_wait))

    busy = np.bincount(step_cta, weights=c_arr, minlength=P).astype(np.float64)
    if with_epi:
        busy += np.bincount(plan.col_cta(), minlength=P) * epi_cost
    ends = [np.nanmax(re) if S and ok else 0.0, ce.max() if S else 0.0]
    if with_epi and K:
        ends.append(np.nanmax(ke) if ok else 0.0)
    makespan = float(max(ends)) if ok else float("nan")
    idle = 1.0 - busy / makespan if ok and makespan > 0 else np.zeros(P)

    lb_work, lb_chain = _lower_bounds(plan, st, c_arr, r_arr, costs, depth, lens, epi_cost if with_epi else 0.0,
                                      group, col_of_step, chains, kv_chains)
    res = SimResult(plan, costs, depth, ok, makespan, max(lb_work, lb_chain), lb_work, lb_chain,
                    cs, ce, rs, re, turn_wait, tile_wait, busy, idle, ks, ke, blocked)
    res._ops = (ops, op_ptr, pred, kvpred, c_arr, r_arr, epi_cost if with_epi else None)
    return res


def _lower_bounds(plan: Plan, st: dict, c_arr: np.ndarray, r_arr: np.ndarray, costs: Costs, depth: int,
                  lens: np.ndarray, epi: float, group: int, col_of_step: np.ndarray,
                  chains: int = 1, kv_chains: int = 1) -> tuple[float, float]:
    """Total work / P and the longest chain any schedule must respect."""
    P, K = plan.ctas, len(plan.cols)
    work_c = float(c_arr.sum()) + epi * K
    work_r = float(r_arr.sum())
    work = (work_c + work_r) if depth == 0 else max(work_c, work_r)
    chain = 0.0
    if len(c_arr):
        col_c = np.bincount(col_of_step, weights=c_arr, minlength=K)
        col_r = np.bincount(col_of_step, weights=r_arr, minlength=K)
        last_r = np.zeros(K)
        nz = lens > 0
        last_r[nz] = r_arr[plan.visit_ptr[1:][nz] - 1]
        tail = np.maximum(last_r, epi)
        col_chain = col_c + (col_r - last_r if depth == 0 else 0.0) + tail
        chain = float(col_chain.max())
        t = plan.tiling
        tile = turn_chain_keys(st, plan, chains)  # the adds of one chain are serial
        ntile = t.batch * t.heads * t.mmax * chains
        cnt = np.bincount(tile, minlength=ntile)
        rsum = np.bincount(tile, weights=r_arr, minlength=ntile)
        cmin = np.full(ntile, np.inf)
        np.minimum.at(cmin, tile, c_arr)
        has = cnt > 0
        tile_chain = cmin[has] + rsum[has] + (cnt[has] - 1) * costs.latency
        chain = max(chain, float(tile_chain.max()))
    if group > 1 and K:
        # The longest dK/dV chain of a group, then the last head's epilogue after it.
        adds = -(-(group - 1) // max(1, min(kv_chains, group - 1)))
        chain = max(chain, (adds + 1) * epi + adds * costs.latency)
    return work / P, chain


def _run_fast(op_ptr: list, c: list, r: list, pred: list, succ_cta: list, lat: float, depth: int):
    """Lazy longest-path evaluation; each CTA's ops are its steps (no epilogue ops)."""
    S, P = len(c), len(op_ptr) - 1
    cs = [0.0] * S
    ce = [0.0] * S
    rs = [0.0] * S
    re = [_UNKNOWN] * S
    a_of = list(op_ptr[:-1])  # next step to compute, per CTA
    z_of = list(op_ptr[:-1])  # next step to reduce
    cend = [0.0] * P
    rend = [0.0] * P
    blocked = [-1] * P
    stack = list(range(P - 1, -1, -1))
    while stack:
        x = stack.pop()
        if blocked[x] >= 0 and re[blocked[x]] < 0:
            continue
        blocked[x] = -1
        s0, end = op_ptr[x], op_ptr[x + 1]
        a, z, ce_prev, re_prev = a_of[x], z_of[x], cend[x], rend[x]
        while True:
            lim = z + depth + 1
            if lim > end:
                lim = end
            while a < lim:
                j = a - 1 - depth
                s = ce_prev
                if j >= s0:
                    v = re[j]
                    if v > s:
                        s = v
                cs[a] = s
                ce_prev = s + c[a]
                ce[a] = ce_prev
                a += 1
            if z == a:
                break
            s = ce[z]
            if re_prev > s:
                s = re_prev
            p = pred[z]
            if p >= 0:
                v = re[p]
                if v < 0:
                    blocked[x] = p
                    break
                v += lat
                if v > s:
                    s = v
            rs[z] = s
            re_prev = s + r[z]
            re[z] = re_prev
            y = succ_cta[z]
            if y >= 0 and blocked[y] == z:
                blocked[y] = -1
                stack.append(y)
            z += 1
        a_of[x], z_of[x], cend[x], rend[x] = a, z, ce_prev, re_prev
    stuck = {x: f"reduction of step {z_of[x]} waits for step {blocked[x]}"
             for x in range(P) if z_of[x] < op_ptr[x + 1]}
    return cs, ce, rs, re, [], [], stuck


def _run_general(op_ptr: list, ops: list, step_ptr: list, c: list, r: list, pred: list, succ_cta: list,
                 kvpred: list, kvsucc_cta: list, K: int, epi: float, lat: float, depth: int):
    """As ``_run_fast`` with column epilogues (op < 0: epilogue of column -op-1) in the compute chain."""
    S, P = len(c), len(op_ptr) - 1
    cs = [0.0] * S
    ce = [0.0] * S
    rs = [0.0] * S
    re = [_UNKNOWN] * S
    ks = [0.0] * K
    ke = [_UNKNOWN] * K
    ia_of = list(op_ptr[:-1])  # next compute-chain op
    a_of = list(step_ptr[:-1])  # steps computed so far end here
    z_of = list(step_ptr[:-1])
    cend = [0.0] * P
    rend = [0.0] * P
    b_red = [-1] * P
    b_kv = [-1] * P
    stack = list(range(P - 1, -1, -1))
    while stack:
        x = stack.pop()
        if b_red[x] >= 0 and re[b_red[x]] >= 0:
            b_red[x] = -1
        if b_kv[x] >= 0 and ke[b_kv[x]] >= 0:
            b_kv[x] = -1
        s0, o_end = step_ptr[x], op_ptr[x + 1]
        ia, a, z, ce_prev, re_prev = ia_of[x], a_of[x], z_of[x], cend[x], rend[x]
        while True:
            progressed = False
            if b_kv[x] < 0:
                while ia < o_end:
                    op = ops[ia]
                    if op >= 0:
                        if op > z + depth:
                            break
                        j = op - 1 - depth
                        s = ce_prev
                        if j >= s0:
                            v = re[j]
                            if v > s:
                                s = v
                        cs[op] = s
                        ce_prev = s + c[op]
                        ce[op] = ce_prev
                        a = op + 1
                    else:
                        col = -op - 1
                        s = ce_prev
                        waiting = -1
                        for p in kvpred[col]:
                            v = ke[p]
                            if v < 0:
                                waiting = p
                                break
                            v += lat
                            if v > s:
                                s = v
                        if waiting >= 0:
                            b_kv[x] = waiting
                            break
                        ks[col] = s
                        ce_prev = s + epi
                        ke[col] = ce_prev
                        y = kvsucc_cta[col]
                        if y >= 0 and b_kv[y] == col:
                            b_kv[y] = -1
                            stack.append(y)
                    ia += 1
                    progressed = True
            if b_red[x] < 0:
                while z < a:
                    s = ce[z]
                    if re_prev > s:
                        s = re_prev
                    p = pred[z]
                    if p >= 0:
                        v = re[p]
                        if v < 0:
                            b_red[x] = p
                            break
                        v += lat
                        if v > s:
                            s = v
                    rs[z] = s
                    re_prev = s + r[z]
                    re[z] = re_prev
                    y = succ_cta[z]
                    if y >= 0 and b_red[y] == z:
                        b_red[y] = -1
                        stack.append(y)
                    z += 1
                    progressed = True
                    if a <= z + depth:
                        break  # let the compute chain move
            if not progressed:
                break
        ia_of[x], a_of[x], z_of[x], cend[x], rend[x] = ia, a, z, ce_prev, re_prev
    stuck = {}
    for x in range(P):
        if ia_of[x] < op_ptr[x + 1] or z_of[x] < step_ptr[x + 1]:
            why = []
            if b_red[x] >= 0:
                why.append(f"reduction of step {z_of[x]} waits for step {b_red[x]}")
            if b_kv[x] >= 0:
                why.append(f"epilogue waits for column {b_kv[x]}")
            stuck[x] = "; ".join(why) or "waits on its own pipeline"
    return cs, ce, rs, re, ks, ke, stuck


def _critical_path(res: SimResult) -> list[PathNode]:
    """Walk back from the last-finishing operation along the predecessors that bound it."""
    if not res.deadlock_free or res.plan.num_steps == 0:
        return []
    plan = res.plan
    ops, op_ptr, pred, kvpred, c_arr, r_arr, epi = res._ops
    st = plan.steps()
    lat, D = res.costs.latency, res.depth
    S = plan.num_steps
    step_ptr = plan.step_ptr
    cta_first = np.zeros(S, dtype=bool)
    cta_first[step_ptr[:-1][step_ptr[:-1] < S]] = True
    col_cta = plan.col_cta()
    if ops is not None:
        pos_of_step = np.arange(S) + st["col"]
        pos_epi = plan.visit_ptr[1:] + np.arange(len(plan.cols))
        op_first = np.zeros(len(ops), dtype=bool)
        op_first[op_ptr[:-1][op_ptr[:-1] < len(ops)]] = True
    cs, ce, rs, re = res.compute_start, res.compute_end, res.reduce_start, res.reduce_end
    ks, ke = res.epilogue_start, res.epilogue_end
    eps = 1e-9 * max(1.0, res.makespan)

    def node(kind: str, k: int) -> PathNode:
        if kind == "epilogue":
            b, h, n = (int(v) for v in plan.cols[k])
            return PathNode(kind, int(col_cta[k]), b, h, n, -1, float(ks[k]), float(ke[k]))
        s, e = (cs[k], ce[k]) if kind == "compute" else (rs[k], re[k])
        return PathNode(kind, int(st["cta"][k]), int(st["b"][k]), int(st["h"][k]), int(st["n"][k]),
                        int(st["m"][k]), float(s), float(e))

    # Start from the latest end.
    k_r = int(np.nanargmax(re))
    cur = ("reduce", k_r)
    if ops is not None and len(plan.cols) and np.nanmax(ke) > re[k_r]:
        cur = ("epilogue", int(np.nanargmax(ke)))
    path = []
    while cur is not None:
        kind, k = cur
        path.append(node(kind, k))
        nxt = None
        if kind == "reduce":
            p = pred[k]
            if p >= 0 and abs(re[p] + lat - rs[k]) <= eps and rs[k] > 0:
                nxt = ("reduce", int(p))
            elif abs(ce[k] - rs[k]) <= eps:
                nxt = ("compute", k)
            elif not cta_first[k] and abs(re[k - 1] - rs[k]) <= eps:
                nxt = ("reduce", k - 1)
        elif kind == "compute":
            if cs[k] <= eps:
                nxt = None
            else:
                j = k - 1 - D
                if j >= 0 and st["cta"][j] == st["cta"][k] and abs(re[j] - cs[k]) <= eps:
                    nxt = ("reduce", j)
                elif ops is None:
                    if not cta_first[k]:
                        nxt = ("compute", k - 1)
                else:
                    pos = pos_of_step[k]
                    if not op_first[pos]:
                        prev = ops[pos - 1]
                        nxt = ("compute", int(prev)) if prev >= 0 else ("epilogue", int(-prev - 1))
        else:  # epilogue
            bound = [int(p) for p in kvpred[k] if p >= 0 and abs(ke[p] + lat - ks[k]) <= eps]
            if bound and ks[k] > 0:
                nxt = ("epilogue", bound[0])
            elif ks[k] > eps:
                pos = pos_epi[k]
                if not op_first[pos]:
                    prev = ops[pos - 1]
                    nxt = ("compute", int(prev)) if prev >= 0 else ("epilogue", int(-prev - 1))
        cur = nxt
    path.reverse()
    return path


# --------------------------------------------------------------------------------------------
# Claims in simulated time
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClaimReplay:
    """What ``replay_claims`` returns."""

    makespan: float
    cta_last: np.ndarray  # (ctas,) when each CTA's last step, reduce-add or epilogue ended
    claim_cta: np.ndarray  # (K,) the CTA that ran each row of ``plan.cols`` in the replay
    claim_time: np.ndarray  # (K,) when that CTA claimed it (its previous column's epilogue ended)


def replay_claims(plan: Plan, costs: Costs | None = None, depth: int = 1, *, chains: int = 1,
                  kv_chains: int = 1) -> ClaimReplay:
    """``plan``'s columns claimed the way the kernel claims them: in the plan's claim order
    (``plan.item_sequence()``), each by the CTA that frees first in simulated time.

    ``simulate`` runs the plan's static dispatch, which list-schedules the claims on step
    counts: under a full mask every column has the same length, so CTA ``k`` runs items
    ``k, k + ctas, ...`` as if every CTA finished its column at the same instant, and in every
    wave the columns of a head start together whatever the claim order. In the kernel a CTA
    claims from an atomic counter when its column ends, so once turn waits have spread the
    CTAs' finishing times, the claim order decides how far apart a head's columns start and
    how long they queue on each other's dQ tiles (``interleaved`` claims a column of every
    head of an L2 section before the next column of one; ``fa3`` a head's columns back to
    back). Same rules as ``simulate`` otherwise: step ``k``'s compute starts when step
    ``k - 1``'s ended and the CTA's reduce-add of step ``k - 1 - depth`` ended; a reduce-add
    starts when its compute ended, the CTA's previous reduce-add ended and the previous add
    of its chain (``chains``) ended plus ``latency``; the epilogue (``epilogue + r_kv``) starts
    after the column's last compute and, under GQA, the dK/dV adds it waits for
    (``kv_links``) plus ``latency``; its end is when the CTA claims again. With one CTA this is
    ``simulate``'s makespan exactly.

    Only for claimed plans (``fa3``, ``interleaved``, ``descending``); raises ``ValueError``
    for a static dispatch and ``RuntimeError`` if a wait points to a column claimed later
    (which would hang the kernel; no portable order has one).
    """
    import heapq

    if not plan.claimed:
        raise ValueError(f"schedule {plan.schedule!r} is not claimed column by column; use simulate()")
    if depth < 0:
        raise ValueError(f"depth={depth} must be >= 0")
    costs = Costs() if costs is None else costs
    t = plan.tiling
    st = plan.steps()
    S, P, K = plan.num_steps, plan.ctas, len(plan.cols)
    c = costs.class_costs()[t.tile_class[st["b"], st["m"], st["n"]]].tolist()
    pred = _turn_links(st, plan, chains)[0].tolist()
    vptr = plan.visit_ptr.tolist()
    seq = plan.item_sequence()
    order = plan.column_index()[seq[:, 0], seq[:, 1], seq[:, 2]].tolist() if K else []
    group = t.problem.heads_q // t.problem.heads_kv
    kv_pred = [[int(v) for v in row if v >= 0] for row in kv_links(plan, kv_chains)[0]] if group > 1 else None
    r, lat, epi = float(costs.r), float(costs.latency), float(costs.epilogue + costs.r_kv)

    re = [_UNKNOWN] * S
    epi_end = [_UNKNOWN] * K
    claim_cta = np.full(K, -1, dtype=np.int64)
    claim_time = np.zeros(K)
    history: list[list[float]] = [[] for _ in range(P)]  # reduce-add ends per CTA, in order
    last = [0.0] * P
    # (free time, rank, CTA): among CTAs free at one instant the one freed by the earliest claim
    # claims first, and at the start every CTA claims once before any claims twice (a column
    # with no steps and no epilogue cost would otherwise hand its CTA the next claim too).
    free = [(0.0, x - P, x) for x in range(P)]
    for rank, i in enumerate(order):
        t_free, _, x = heapq.heappop(free)
        claim_cta[i], claim_time[i] = x, t_free
        hist = history[x]
        ce = t_free
        wend = hist[-1] if hist else 0.0
        for s in range(vptr[i], vptr[i + 1]):
            j = len(hist) - 1 - depth
            start = hist[j] if j >= 0 and hist[j] > ce else ce
            ce = start + c[s]
            rs = ce if ce > wend else wend
            p = pred[s]
            if p >= 0:
                v = re[p]
                if v < 0:
                    raise RuntimeError(f"column {tuple(int(a) for a in plan.cols[i])} waits for the add of step {p}, "
                                       "claimed later")
                v += lat
                if v > rs:
                    rs = v
            wend = rs + r
            re[s] = wend
            hist.append(wend)
        es = ce
        if kv_pred is not None:
            for pc in kv_pred[i]:
                v = epi_end[pc]
                if v < 0:
                    raise RuntimeError(f"column {tuple(int(a) for a in plan.cols[i])} waits for the dK/dV add of "
                                       f"column {pc}, claimed later")
                v += lat
                if v > es:
                    es = v
        done = es + epi
        epi_end[i] = done
        last[x] = done if done > wend else wend
        heapq.heappush(free, (done, rank, x))
    return ClaimReplay(float(max(last)) if P else 0.0, np.asarray(last), claim_cta, claim_time)
