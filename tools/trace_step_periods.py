"""Where a backward's time goes step by step, from the kernel's trace records.

    python tools/trace_step_periods.py --seqlen 16384 --hdim 64 --causal --schedule descending fa3 --nondeterministic

For every CTA the steps are ordered by ``t_ready`` (both MMA warpgroups' dQ partials in shared
memory), and each step's period is the time since the CTA's previous step was ready. Periods
are split by kind: a step inside a column, the first step of a column (the period includes the
previous column's dK/dV store and the wait for the new K/V), and a step that needs the mask
(diagonal tiles under a causal mask, ragged tails) other than a column's first. Under orders
that start a column at its diagonal (fa3, interleaved) the first step is the masked one, so
their "first of column" includes the mask's cost and "masked" is empty. Per kind: count, mean and share of the
summed periods; beside it the mean period over the launch's time deciles (a step that is
slower early on points at contention in the first wave). ``%globaltimer`` ticks in 256 ns
steps on the H200, so read means, not single periods.
"""

import argparse
import json
import sys

import numpy as np
import torch

from dash._bench import refuse_without_gpu
from dash.cli import OneLineErrorParser, head_dim, kernel_schedule, positive_int


def periods(rec: dict, bm: int, bn: int, causal: bool, seqlen_q: int, seqlen_k: int) -> dict:
    # By CTA, then time; the step index breaks ties of the 256 ns timer inside a column.
    order = np.lexsort((rec["step"], rec["t_ready"], rec["cta"]))
    cta, t = rec["cta"][order], rec["t_ready"][order]
    n, m, b, h = rec["n"][order], rec["m"][order], rec["b"][order], rec["h"][order]
    same_cta = cta[1:] == cta[:-1]
    dt = np.diff(t)[same_cta]
    new_col = ((n[1:] != n[:-1]) | (b[1:] != b[:-1]) | (h[1:] != h[:-1]))[same_cta]
    mm, nn = m[1:][same_cta], n[1:][same_cta]
    # A step needs the mask when its tile holds a key past the causal diagonal or past seqlen_k.
    last_key = (nn + 1) * bn - 1
    first_query = mm * bm
    masked = last_key >= seqlen_k
    if causal:
        masked |= last_key > first_query + seqlen_k - seqlen_q
    kinds = {"in column": ~new_col & ~masked, "first of column": new_col, "masked (not first)": masked & ~new_col}
    total = dt.sum()
    out = {"steps": int(len(t)), "mean_period_us": float(dt.mean()), "makespan_us": float(t.max() - t.min())}
    for name, sel in kinds.items():
        out[name] = {"count": int(sel.sum()), "mean_us": float(dt[sel].mean()) if sel.any() else None,
                     "share": float(dt[sel].sum() / total)}
    tt = t[1:][same_cta]
    edges = np.quantile(tt, np.linspace(0, 1, 11))
    dec = np.clip(np.searchsorted(edges, tt, side="right") - 1, 0, 9)
    by_decile = [dt[(dec == i) & kinds["in column"]] for i in range(10)]
    out["in_column_mean_by_decile_us"] = [float(x.mean()) if len(x) else None for x in by_decile]
    return out


def main() -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=positive_int, default=16384)
    p.add_argument("--hdim", type=head_dim, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--schedule", type=kernel_schedule, nargs="+", default=["auto"])
    p.add_argument("--nondeterministic", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    status = refuse_without_gpu("trace_step_periods.py")
    if status:
        return status
    from dash import bench
    from dash.api import attention_backward
    from dash.trace import trace_backward

    shape = bench.Shape.paper(a.seqlen, a.hdim, a.causal)
    s = bench.make_input_sets(shape, 1, torch.device("cuda"))[0]
    args = (s["dout"], s["q"], s["k"], s["v"], s["out"], s["lse"])
    results = {}
    det = not a.nondeterministic
    for sched in a.schedule:
        for _ in range(3):  # warm-up: clocks, caches, the schedule's model cache
            attention_backward(*args, softmax_scale=s["scale"], causal=a.causal, deterministic=det, schedule=sched)
        *_, tr = trace_backward(*args, softmax_scale=s["scale"], causal=a.causal, deterministic=det, schedule=sched)
        prob = tr.problem  # the traced problem: its tiles, mask and lengths, as the kernel saw them
        r = periods(tr.records, *prob.tile_shape, prob.causal, prob.seqlen_q, prob.seqlen_k)
        r["schedule"] = tr.schedule
        results[sched] = r
        print(f"\n== {shape.label()} {'det' if det else 'non-det'} schedule {sched} -> {tr.schedule}: "
              f"{r['steps']} steps, makespan {r['makespan_us']:.0f} us, mean period {r['mean_period_us']:.3f} us")
        for kind in ("in column", "first of column", "masked (not first)"):
            k = r[kind]
            mean = f"{k['mean_us']:7.3f} us" if k["mean_us"] is not None else "      - us"
            print(f"   {kind:20s} {k['count']:8d}  mean {mean}  share {100 * k['share']:5.1f} %")
        print("   in-column mean by time decile (us): "
              + " ".join(f"{x:.3f}" if x is not None else "-" for x in r["in_column_mean_by_decile_us"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(shape=shape.label(), deterministic=not a.nondeterministic, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
