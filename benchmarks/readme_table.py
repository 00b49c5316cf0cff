"""Print README.md's performance table from a results file of benchmarks/bench_bwd.py.

    python benchmarks/readme_table.py benchmarks/results/2026-11-30-NVIDIA-H200-bwd-fa3.json

Cells are backward TFLOP/s (FA3's FLOP convention); the last columns are time ratios from the
same run. Modes missing from the file are left out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

COLUMNS = [  # (mode, header)
    ("dash_nondet", "DASH non-det"),
    ("dash_auto_det", "DASH det (auto)"),
    ("dash_fa3_det", "DASH det (fa3 order)"),
    ("user_dash_auto_det", "DASH det (auto), flash_attn_func + autograd"),
    ("fa3_nondet", "FA3 non-det"),
    ("fa3_det", "FA3 det"),
    ("fa4_nondet", "FA4 non-det"),
    ("fa4_det", "FA4 det"),
    ("torch_cudnn", "torch cuDNN"),
]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def table(path: Path) -> str:
    d = json.loads(path.read_text())
    rows = d["rows"]
    cols = [(m, h) for m, h in COLUMNS if any(m in r["tflops"] for r in rows)]
    det_anchor = [m for m in ("fa3_det", "fa4_det") if any(m in r["tflops"] for r in rows)]
    out = ["| hd | mask | seqlen | " + " | ".join(h for _, h in cols) +
           " | det(auto) / non-det | det(auto) / det(fa3 order) |" +
           (f" det(auto) / {' or '.join(m.split('_')[0].upper() for m in det_anchor)} det |" if det_anchor else ""),
           "|---|---|---|" + "---|" * len(cols) + "---|---|" + ("---|" if det_anchor else "")]
    for r in rows:
        s, t = r["shape"], r["tflops"]
        cells = [f"{t[m]:.0f}" if m in t else "–" for m, _ in cols]
        ratios = [f"{t['dash_auto_det'] / t['dash_nondet']:.2f}", f"{t['dash_auto_det'] / t['dash_fa3_det']:.2f}"]
        if det_anchor:
            best = max(t[m] for m in det_anchor if m in t)
            ratios.append(f"{t['dash_auto_det'] / best:.2f}")
        out.append(f"| {s['head_dim']} | {'causal' if s['causal'] else 'full'} | {s['seqlen']} | " +
                   " | ".join(cells + ratios) + " |")
    means = []
    for m, _ in cols:
        vals = [r["tflops"][m] / r["tflops"]["torch_cudnn"] for r in rows if m in r["tflops"]]
        means.append(f"{geomean(vals):.2f}×" if vals else "–")
    g = lambda a, b: geomean([r["tflops"][a] / r["tflops"][b] for r in rows])  # noqa: E731
    tail = [f"{g('dash_auto_det', 'dash_nondet'):.3f}", f"{g('dash_auto_det', 'dash_fa3_det'):.3f}"]
    if det_anchor:
        tail.append(f"{geomean([r['tflops']['dash_auto_det'] / max(r['tflops'][m] for m in det_anchor) for r in rows]):.3f}")
    out.append("| geomean | | vs cuDNN | " + " | ".join(means + tail) + " |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    print(table(p.parse_args().results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
