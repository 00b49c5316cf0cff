"""Attention-backward throughput on the paper grid (anchors.md), every mode in one process.

    python benchmarks/bench_bwd.py                      # 24 rows: hdim 64/128 x full/causal x 512..16k
    python benchmarks/bench_bwd.py --hdim 128 --causal  # a subset
    python benchmarks/bench_bwd.py --plot out.png       # also draw the table
    python benchmarks/bench_bwd.py --gqa                # GQA/MQA rows (bench.GQA_SHAPES) instead

Modes (dash.bench.available_modes): DASH's kernels alone — non-deterministic (auto and fa3
order), deterministic per kernel schedule (fa3, interleaved, descending, shift) and auto; the
path users call — flash_attn_func + torch.autograd.grad, deterministic (auto) and not; torch
cuDNN and flash SDPA backward; upstream FA3 and FA4 (deterministic and not, through their own
forward) when importable; opt-in (named with --modes): DASH non-deterministic per schedule
(dash_nondet_interleaved, _descending, _shift). Prints TFLOP/s and the ratio to torch cuDNN (measured in the same
run), the paired ratios the targets are stated in, the model's ranking of the schedules
against the measured one, and writes benchmarks/results/<date>-<gpu>-<tag>.json (-2, -3, ...
added when a run of the same day has that name: a subset run never replaces the full grid).
Without an sm_90 GPU and DASH's kernels it says so in one line and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dash import bench  # noqa: E402
from dash._bench import refuse_without_gpu  # noqa: E402
from dash.cli import OneLineErrorParser, head_dim, nonnegative_int, positive_int  # noqa: E402


def plot(payload: dict, modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharey=True)
    for ax, (hd, causal) in zip(axes.flat, [(64, False), (64, True), (128, False), (128, True)]):
        sel = [r for r in rows if r["shape"]["head_dim"] == hd and r["shape"]["causal"] == causal]
        xs = [str(r["shape"]["seqlen"]) for r in sel]
        width = 0.8 / max(len(modes), 1)
        for i, m in enumerate(modes):
            ys = [r["tflops"].get(m, 0.0) for r in sel]
            ax.bar([j + i * width for j in range(len(xs))], ys, width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(xs))], xs)
        ax.set_title(f"hdim {hd}, {'causal' if causal else 'full'}")
        ax.set_xlabel("seqlen (16k tokens)")
        ax.set_ylabel("backward TFLOP/s")
    axes.flat[0].legend(fontsize=8)
    env = payload["environment"]
    fig.suptitle(f"{env['device']} - commit {str(env['commit'])[:10]} - {env['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    # Sizes checked while parsing (one-line errors): --seqlen 0 used to divide by zero in Shape.paper.
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdim", type=head_dim, nargs="*", default=[64, 128])
    p.add_argument("--causal", action="store_true", help="only causal rows")
    p.add_argument("--full", action="store_true", help="only full-mask rows")
    p.add_argument("--seqlen", type=positive_int, nargs="*", default=list(bench.PAPER_SEQLENS))
    p.add_argument("--modes", nargs="*", default=None, help="modes to run (default: all available but the opt-in ones)")
    p.add_argument("--iters", type=positive_int, default=12, help="timed rounds (default 12)")
    p.add_argument("--burst", type=positive_int, default=3,
                   help="back-to-back calls per mode per round (default 3); 1 = one synced call per sample, "
                        "which adds the host's issue latency to every call")
    p.add_argument("--warmup", type=nonnegative_int, default=5)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--gqa", action="store_true", help="the GQA/MQA rows (dash.bench.GQA_SHAPES), not the paper grid")
    p.add_argument("--tag", default=None, help="results file tag (default bwd, or bwd-gqa with --gqa)")
    p.add_argument("--plot", type=Path, default=None, help="write the table as a PNG chart")
    args = p.parse_args(argv)
    status = refuse_without_gpu("bench_bwd.py")
    if status:
        return status

    masks = [True] if args.causal else [False] if args.full else [False, True]
    if args.gqa:
        shapes = list(bench.GQA_SHAPES)
    else:
        shapes = [bench.Shape.paper(s, hd, c) for hd in args.hdim for c in masks for s in args.seqlen]
    tag = args.tag or ("bwd-gqa" if args.gqa else "bwd")
    modes = args.modes or bench.default_modes()
    import torch

    print(f"{torch.cuda.get_device_name(0)}; median of {args.iters} rounds of {args.burst} back-to-back calls per mode "
          f"after {args.warmup} warm-ups, bf16")
    print(bench.format_header(modes))
    rows = bench.run_rows(shapes, modes, warmup=args.warmup, iters=args.iters, burst=args.burst)
    payload = bench.results_payload(rows, modes, {"iters": args.iters, "burst": args.burst, "warmup": args.warmup,
                                                  "argv": sys.argv[1:]})
    print("\nGeometric means over rows (ratio to torch_cudnn, same run):")
    for m, s in payload["summary"].items():
        print(f"  {m:>20}: geomean {s['geomean_vs_torch_cudnn']:.3f}, worst {s['min_vs_torch_cudnn']:.3f} "
              f"({s['rows']} rows)")
    ratios = bench.paired_ratios(rows)
    payload["ratios"] = ratios
    for name, r in ratios.items():
        print(f"  {name}: geomean {r['geomean']:.3f}, worst {r['worst']:.3f} ({r['rows']} rows)")
    ranking = bench.model_ranking_agreement(rows)
    payload["model_ranking"] = ranking
    if ranking["rows"]:
        print(f"  model vs measured, portable schedules: auto's pick is the measured best on {ranking['best_agrees']} of "
              f"{ranking['rows']} rows, the measured best is among the model's first rank (exact ties) on "
              f"{ranking['best_in_model_top']}; auto within 1 % / 3 % of the measured best on "
              f"{ranking['auto_within_1pct']} / {ranking['auto_within_3pct']} rows "
              f"(worst auto / best {ranking['worst_auto_vs_best']:.3f})")
    for row in rows:
        for m, err in row.errors.items():
            print(f"  error {row.shape.label()} {m}: {err}")
        for m, ok in row.bitwise.items():
            if not ok:
                print(f"  NOT BITWISE REPEATABLE: {row.shape.label()} {m}")
    path = bench.write_results(payload, args.out_dir, tag)
    print(f"\nwrote {path}")
    if args.plot:
        plot(payload, modes, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
