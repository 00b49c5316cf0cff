"""Explicit DAGs, the critical path, and the DASH paper's Lemma 1 as an executable check.

A DAG has node weights (durations) and weighted edges (a delay between the end of ``u`` and
the start of ``v``). Definitions used throughout:

* ``est(v)`` — earliest start: the longest path from any source to ``v``, excluding ``v``;
* ``depth(u) = est(u) + w(u)`` — the *arrival depth* of ``u``: when its result is available;
* ``L`` — the critical path length, ``max depth``;
* ``lst(v) = L - tail(v)`` — latest start of ``v`` that does not lengthen the critical path,
  where ``tail(v)`` is the longest path from ``v`` (including ``w(v)``) to any sink.

**Lemma 1.** Adding a zero-weight edge ``u -> v`` (``v`` not reaching ``u``) keeps the
critical path length iff ``depth(u) <= lst(v)``; it keeps *every* start time iff
``depth(u) <= est(v)``. On a schedule without slack (every node critical, as in a lock-step
run) ``lst = est``, which is the paper's statement "iff depth(u) <= depth(v)". For the
attention backward: a reduction order on a Q tile adds edges between consecutive turns; it is
free exactly when each contribution's turn comes after the contributions that arrive earlier.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Dag:
    """Node weights ``weights`` (V,) and edges ``(u, v, delay)``."""

    weights: list[float]
    edges: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return len(self.weights)

    def with_edge(self, u: int, v: int, delay: float = 0.0) -> "Dag":
        """A copy with the edge ``u -> v`` added."""
        return Dag(list(self.weights), self.edges + [(u, v, delay)])

    def _adj(self) -> tuple[list[list[tuple[int, float]]], list[list[tuple[int, float]]]]:
        out: list[list[tuple[int, float]]] = [[] for _ in self.weights]
        inc: list[list[tuple[int, float]]] = [[] for _ in self.weights]
        for u, v, d in self.edges:
            out[u].append((v, d))
            inc[v].append((u, d))
        return out, inc

    def topological_order(self) -> list[int]:
        """Kahn's order; raises ``ValueError`` on a cycle (a deadlock)."""
        out, inc = self._adj()
        indeg = [len(x) for x in inc]
        ready = [v for v in range(self.num_nodes) if indeg[v] == 0]
        order = []
        while ready:
            u = ready.pop()
            order.append(u)
            for v, _ in out[u]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        if len(order) != self.num_nodes:
            raise ValueError("the graph has a cycle")
        return order

    def earliest_start(self) -> np.ndarray:
        """``est`` of every node, shape (V,)."""
        _, inc = self._adj()
        est = [0.0] * self.num_nodes
        for v in self.topological_order():
            for u, d in inc[v]:
                est[v] = max(est[v], est[u] + self.weights[u] + d)
        return np.asarray(est, dtype=np.float64)

    def depth(self) -> np.ndarray:
        """Arrival depth ``est + w`` of every node, shape (V,)."""
        return self.earliest_start() + np.asarray(self.weights, dtype=np.float64)

    def critical_path_length(self) -> float:
        """``L``: the longest path (0 for an empty graph)."""
        return float(self.depth().max(initial=0.0))

    def latest_start(self) -> np.ndarray:
        """``lst`` of every node, shape (V,)."""
        out, _ = self._adj()
        tail = [0.0] * self.num_nodes
        for u in reversed(self.topological_order()):
            t = 0.0
            for v, d in out[u]:
                t = max(t, d + tail[v])
            tail[u] = self.weights[u] + t
        return self.critical_path_length() - np.asarray(tail, dtype=np.float64)

    def reaches(self, src: int, dst: int) -> bool:
        """Whether a path leads from ``src`` to ``dst`` (a node reaches itself)."""
        out, _ = self._adj()
        seen, stack = {src}, [src]
        while stack:
            u = stack.pop()
            if u == dst:
                return True
            for v, _ in out[u]:
                if v not in seen:
                    seen.add(v)
                    stack.append(v)
        return False

    def critical_path(self) -> list[int]:
        """Nodes of one longest path, first to last."""
        _, inc = self._adj()
        est = self.earliest_start()
        dep = est + np.asarray(self.weights)
        if self.num_nodes == 0:
            return []
        v = int(np.argmax(dep))
        tol = 1e-9 * max(1.0, float(dep.max()))
        path = [v]
        while est[v] > tol:
            nxt = [u for u, d in inc[v] if abs(dep[u] + d - est[v]) <= tol]
            if not nxt:
                break
            v = nxt[0]
            path.append(v)
        return path[::-1]


def lemma1_predicts_kept(dag: Dag, u: int, v: int) -> bool:
    """Lemma 1's prediction: the zero-weight edge u -> v keeps L iff ``depth(u) <= lst(v)``."""
    return bool(dag.depth()[u] <= dag.latest_start()[v] + 1e-9)


def edge_keeps_critical_path(dag: Dag, u: int, v: int) -> bool:
    """Ground truth: add u -> v with weight 0 and compare the critical path lengths."""
    if dag.reaches(v, u):
        raise ValueError(f"adding {u} -> {v} would close a cycle")
    return abs(dag.with_edge(u, v).critical_path_length() - dag.critical_path_length()) <= 1e-9


def edge_keeps_all_starts(dag: Dag, u: int, v: int) -> bool:
    """Ground truth for the strong form: every earliest start is unchanged."""
    return bool(np.allclose(dag.with_edge(u, v).earliest_start(), dag.earliest_start(), rtol=0, atol=1e-9))


def plan_dag(plan, costs=None, depth: int = 1, *, with_turns: bool = True, chains: int = 1,
             kv_chains: int = 1) -> tuple[Dag, dict]:
    """The simulator's model of ``plan`` as an explicit DAG (for small plans).

    Nodes: ``C[k]`` compute and ``R[k]`` reduction of step k (``plan.steps()`` order), then one
    epilogue node per column. Edges: program order of compute and of reductions on a CTA,
    ``C[k] -> R[k]``, ``R[k-1-depth] -> C[k]``, the epilogue between a column's last step and
    the next column, and — when ``with_turns`` — ``R[prev turn] -> R[k]`` with the hand-off
    latency, plus the GQA dK/dV chains (``kv_chains``, ``simulate.kv_links``). Its critical path
    length equals the simulated makespan.
    Returns the DAG and an index: ``{"C": (S,), "R": (S,), "E": (K,), "turn_edges": [(u, v)]}``.
    """
    from dash.schedules.simulate import Costs, _turn_links, kv_links

    costs = Costs() if costs is None else costs
    t = plan.tiling
    st = plan.steps()
    S, K = plan.num_steps, len(plan.cols)
    c = costs.class_costs()[t.tile_class[st["b"], st["m"], st["n"]]] if S else np.zeros(0)
    group = t.problem.heads_q // t.problem.heads_kv
    epi = costs.epilogue + costs.r_kv
    with_epi = group > 1 or epi > 0
    C = np.arange(S)
    R = S + np.arange(S)
    E = 2 * S + np.arange(K)
    weights = list(c) + [costs.r] * S + [epi] * K
    edges: list[tuple[int, int, float]] = []
    step_ptr = plan.step_ptr
    for x in range(plan.ctas):
        prev_op = None  # last node of the compute chain
        s_first = int(step_ptr[x])
        for ci in range(int(plan.cta_ptr[x]), int(plan.cta_ptr[x + 1])):
            for k in range(int(plan.visit_ptr[ci]), int(plan.visit_ptr[ci + 1])):
                if prev_op is not None:
                    edges.append((prev_op, int(C[k]), 0.0))
                j = k - 1 - depth
                if j >= s_first:
                    edges.append((int(R[j]), int(C[k]), 0.0))
                edges.append((int(C[k]), int(R[k]), 0.0))
                if k > s_first:
                    edges.append((int(R[k - 1]), int(R[k]), 0.0))
                prev_op = int(C[k])
            if with_epi:
                if prev_op is not None:
                    edges.append((prev_op, int(E[ci]), 0.0))
                prev_op = int(E[ci])
    turn_edges = []
    if with_turns and S:
        pred, _ = _turn_links(st, plan, chains)
        for k in np.flatnonzero(pred >= 0):
            edges.append((int(R[pred[k]]), int(R[k]), costs.latency))
            turn_edges.append((int(R[pred[k]]), int(R[k])))
    if with_turns and with_epi and group > 1:
        kvpred, _ = kv_links(plan, kv_chains)
        for ci, p in zip(*np.nonzero(kvpred >= 0)):
            edges.append((int(E[kvpred[ci, p]]), int(E[ci]), costs.latency))
    if not with_epi:
        weights = weights[:2 * S]
        E = np.zeros(0, dtype=np.int64)
    return Dag(weights, edges), {"C": C, "R": R, "E": E, "turn_edges": turn_edges}
