"""Check deterministic ``schedule="auto"`` against stored measurements, without a GPU.

Each results file of ``benchmarks/bench_bwd.py`` holds, per row, the measured time of every
portable schedule (``dash_{fa3,interleaved,descending}_det``). This recomputes what the
current model (``dash.schedules.auto.choose_kernel_schedule``, on the file's SM count) picks
for each row and how far the pick is from the measured fastest, so a change to the model or
its candidates can be checked against every run on record before it reaches a GPU.

    python tools/model_agreement.py                       # every stored backward results file
    python tools/model_agreement.py benchmarks/results/2026-11-30-NVIDIA-H200-bwd-fa4-a2b9bbc.json --rows

Measurements are of the kernels of the commit each file names (``environment.commit``);
files from before a kernel change that moved the schedules' relative speed say little about
today's model choice (``--since`` keeps files by date, e.g. ``2026-11-30T17:30``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dash import bench  # noqa: E402


def agreement_for_file(path: Path, sms: int | None = None) -> dict | None:
    """``bench.model_ranking_agreement`` of a stored results file (None: no schedule columns)."""
    payload = json.loads(path.read_text())
    if not all(isinstance(r, dict) and isinstance(r.get("shape"), dict) for r in payload.get("rows", [None])):
        return None  # not a bench_bwd.py results file (e.g. tools/bwd_kernel_breakdown.py's)
    env = payload.get("environment", {})
    rows = bench.rows_from_results(payload)
    res = bench.model_ranking_agreement(rows, sms or int(env.get("sm_count") or 132))
    if not res["rows"]:
        return None
    res["file"] = str(path)
    res["commit"] = env.get("commit")
    res["date"] = env.get("date")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="results files (default: benchmarks/results/*bwd*.json)")
    ap.add_argument("--sms", type=int, default=None, help="grid size to plan for (default: each file's SM count)")
    ap.add_argument("--since", default=None, help="only files whose run date is at or after this ISO time")
    ap.add_argument("--rows", action="store_true", help="print every row")
    args = ap.parse_args(argv)
    files = args.files or sorted((ROOT / "benchmarks" / "results").glob("*bwd*.json"))
    total = {"rows": 0, "best_agrees": 0, "best_in_model_top": 0, "auto_within_1pct": 0, "auto_within_3pct": 0}
    worst = 1.0
    for f in files:
        res = agreement_for_file(f, args.sms)
        if res is None or (args.since and (res["date"] or "") < args.since):
            continue
        for k in total:
            total[k] += res[k]
        worst = min(worst, res["worst_auto_vs_best"])
        print(f"{f.name} (kernels {str(res['commit'])[:7]}, {str(res['date'])[:16]}): {res['rows']} rows, "
              f"pick = measured best {res['best_agrees']}, measured best in the model's first rank "
              f"{res['best_in_model_top']}, within 1 % {res['auto_within_1pct']}, "
              f"within 3 % {res['auto_within_3pct']}, worst pick / best {res['worst_auto_vs_best']:.3f}")
        if args.rows:
            for r in res["per_row"]:
                best = min(r["measured_ms"].values())
                rel = " ".join(f"{k}={best / v:.3f}" for k, v in r["measured_ms"].items())
                print(f"    {r['shape']:<32} best {r['measured_best']:<11} pick {r['model_pick']:<11} "
                      f"{r['pick_vs_best']:.3f}   {rel}   model's first rank: {'/'.join(r['model_top'])}")
    if not total["rows"]:
        print("no results file with the portable schedules' columns")
        return 1
    print(f"all: {total['rows']} rows, pick = measured best {total['best_agrees']}, measured best in the model's "
          f"first rank {total['best_in_model_top']}, within 1 % "
          f"{total['auto_within_1pct']}, within 3 % {total['auto_within_3pct']}, worst pick / best {worst:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
