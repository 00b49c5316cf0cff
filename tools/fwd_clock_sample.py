"""Forward throughput under sustained load, with the SM clock and power drawn meanwhile.

    python tools/fwd_clock_sample.py --seqlen 8192 --hdim 64 128 --mask full --seconds 3 --rounds 2

For each shape, every library's forward (``benchmarks/bench_fwd.py``'s: DASH's
``flash_attn_func``, torch cuDNN, FA3 / FA4 when importable; inputs requiring grad, as a
training step's forward) is called back to back for ``--seconds`` while ``nvidia-smi`` samples
the SM clock and the power draw every 50 ms (``tools/bwd_kernel_breakdown.py``'s sampler).
Libraries take turns, in rounds in ``bench.round_orders``' orders. Per library it prints the time
per call (wall time of the window over the calls in it, the host far ahead of the GPU), the TFLOP/s that
gives, and the medians of clock and power over the window; then the time ratio to DASH at equal
clock (time x MHz), which says how much of a gap is cycles and how much is clock.

Why: under ncu (one launch, no sustained load) DASH's hdim 128 full 8k forward took as many
cycles as FA3's while the benchmark, which runs each library for milliseconds at a time, timed
it 3 % slower (docs/kernel-notes.md, nineteenth pass).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402

from dash import bench  # noqa: E402
from dash._bench import refuse_without_gpu  # noqa: E402
from dash.cli import OneLineErrorParser, head_dim, nonnegative_float, positive_int  # noqa: E402


def main() -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=positive_int, nargs="+", default=[8192])
    p.add_argument("--hdim", type=head_dim, nargs="+", default=[64, 128])
    p.add_argument("--mask", choices=("full", "causal", "both"), default="full")
    p.add_argument("--seconds", type=nonnegative_float, default=3.0, help="per library and round (default 3)")
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--libs", nargs="+", default=["dash", "torch_cudnn", "fa3", "fa4"])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    status = refuse_without_gpu("fwd_clock_sample.py")
    if status:
        return status
    from bench_fwd import _libraries
    from bwd_kernel_breakdown import ClockSampler

    available = _libraries()
    libs = [lib for lib in a.libs if lib in available]
    print(f"libraries: {', '.join(libs)} (not importable: {', '.join(sorted(set(a.libs) - set(libs))) or 'none'})")
    masks = {"full": [False], "causal": [True], "both": [False, True]}[a.mask]
    sampler = ClockSampler()
    results = []
    try:
        for d in a.hdim:
            for causal in masks:
                for s in a.seqlen:
                    shape = bench.Shape.paper(s, d, causal)
                    q, k, v = (torch.randn(shape.batch, s, shape.heads, d, device="cuda", dtype=torch.bfloat16,
                                           requires_grad=True) for _ in range(3))
                    flops = shape.fwd_flops()
                    per_lib: dict[str, list[dict]] = {lib: [] for lib in libs}
                    for lib in libs:  # warm-up (FA4 compiles on first use)
                        for _ in range(3):
                            available[lib](q, k, v, causal, False)
                    torch.cuda.synchronize()
                    for r in range(a.rounds):
                        for lib in bench.in_round_order(libs, r):
                            fn = available[lib]
                            time.sleep(0.3)  # let the previous library's clock state settle a little
                            t0, t1, n = bench.back_to_back(lambda: fn(q, k, v, causal, False), a.seconds)
                            w = sampler.window(t0 + 0.2, t1)
                            per_lib[lib].append({"ms": (t1 - t0) / n * 1e3, "calls": n, **w})
                    label = shape.label()
                    print(f"\n{label}")
                    rows = {}
                    for lib in libs:
                        runs = per_lib[lib]
                        ms = sum(x["ms"] for x in runs) / len(runs)
                        mhz = [x["sm_mhz"] for x in runs if "sm_mhz" in x]
                        watts = [x["watts"] for x in runs if "watts" in x]
                        rows[lib] = {"shape": label, "lib": lib, "ms": ms, "tflops": flops / ms / 1e9,
                                     "sm_mhz": sum(mhz) / len(mhz) if mhz else float("nan"),
                                     "watts": sum(watts) / len(watts) if watts else float("nan"), "rounds": runs}
                    base = rows.get("dash")
                    for lib, row in rows.items():
                        ms, mhz_m, w_m = row["ms"], row["sm_mhz"], row["watts"]
                        ratio = f"{ms / base['ms']:.3f}" if base else "-"
                        cyc = f"{ms * mhz_m / (base['ms'] * base['sm_mhz']):.3f}" if base else "-"
                        print(f"  {lib:12s} {ms:8.3f} ms  {row['tflops']:6.1f} TFLOP/s  SM {mhz_m:6.0f} MHz  "
                              f"{w_m:5.0f} W   time / DASH {ratio}  cycles / DASH {cyc}")
                        results.append(row)
    finally:
        sampler.stop()
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
