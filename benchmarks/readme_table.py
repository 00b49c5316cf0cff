"""Print README.md's performance tables from a results file of benchmarks/bench_bwd.py, with
--fwd of benchmarks/bench_fwd.py, with --e2e of benchmarks/bench_e2e.py.

    python benchmarks/readme_table.py benchmarks/results/2026-11-30-NVIDIA-H200-bwd-fa3.json
    python benchmarks/readme_table.py --fwd benchmarks/results/2026-11-30-NVIDIA-H200-fwd-fa3-efddef7.json
    python benchmarks/readme_table.py --e2e benchmarks/results/2026-12-01-NVIDIA-H200-e2e-c75b47a.json

Cells are backward TFLOP/s (FA3's FLOP convention), or step times in ms for --e2e; the last
columns are speed ratios from the same run (> 1: the first named is faster). Modes missing from the file are left out; a mode missing from a row (it failed on
that shape) shows "–" there and is left out of that column's geomean.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

COLUMNS = [  # (mode, header)
    ("dash_nondet", "DASH non-det (auto)"),
    ("dash_nondet_fa3", "DASH non-det (fa3 order)"),
    ("dash_auto_det", "DASH det (auto)"),
    ("dash_fa3_det", "DASH det (fa3 order)"),
    ("user_dash_auto_det", "DASH det (auto), flash_attn_func + autograd"),
    ("user_dash_nondet", "DASH non-det (auto), flash_attn_func + autograd"),
    ("fa3_nondet", "FA3 non-det"),
    ("fa3_det", "FA3 det"),
    ("fa4_nondet", "FA4 non-det"),
    ("fa4_det", "FA4 det"),
    ("torch_cudnn", "torch cuDNN"),
]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _ratio(t: dict, a: str, b_of: tuple[str, ...]) -> float | None:
    """t[a] / the best of t[b_of] (TFLOP/s, so > 1 when ``a`` is faster), None when the row
    lacks ``a`` or every mode of ``b_of`` (a mode that failed on that shape, an older file)."""
    bs = [t[b] for b in b_of if b in t]
    return t[a] / max(bs) if a in t and bs else None


def _geomean_cell(vals: list[float | None], fmt: str) -> str:
    """Geomean over the rows that have the ratio; "–" when none has it."""
    vals = [v for v in vals if v is not None]
    return format(geomean(vals), fmt) if vals else "–"


def table(path: Path) -> str:
    d = json.loads(path.read_text())
    rows = d["rows"]
    cols = [(m, h) for m, h in COLUMNS if any(m in r["tflops"] for r in rows)]
    det_anchor = tuple(m for m in ("fa3_det", "fa4_det") if any(m in r["tflops"] for r in rows))
    # (numerator, denominators, header): a row missing a mode shows "–" and is left out of that
    # geomean. The user-path pair only where the file has both user-path columns (older files
    # timed det(auto) alone through flash_attn_func).
    user = all(any(m in r["tflops"] for r in rows) for m in ("user_dash_auto_det", "user_dash_nondet"))
    pairs = ([("user_dash_auto_det", ("user_dash_nondet",), "det(auto) / non-det, flash_attn_func")] if user else [])
    pairs += [("dash_auto_det", ("dash_nondet",), "det(auto) / non-det"),
              ("dash_auto_det", ("dash_fa3_det",), "det(auto) / det(fa3 order)")]
    if det_anchor:
        pairs.append(("dash_auto_det", det_anchor,
                      f"det(auto) / {' or '.join(m.split('_')[0].upper() for m in det_anchor)} det"))
    out = ["| hd | mask | seqlen | " + " | ".join([h for _, h in cols] + [h for _, _, h in pairs]) + " |",
           "|---|---|---|" + "---|" * (len(cols) + len(pairs))]
    for r in rows:
        s, t = r["shape"], r["tflops"]
        cells = [f"{t[m]:.0f}" if m in t else "–" for m, _ in cols]
        ratios = [_ratio(t, a, b) for a, b, _ in pairs]
        cells += [f"{x:.2f}" if x is not None else "–" for x in ratios]
        out.append(f"| {s['head_dim']} | {'causal' if s['causal'] else 'full'} | {s['seqlen']} | " +
                   " | ".join(cells) + " |")
    means = [_geomean_cell([_ratio(r["tflops"], m, ("torch_cudnn",)) for r in rows], ".2f") for m, _ in cols]
    means = [m if m == "–" else m + "×" for m in means]
    tail = [_geomean_cell([_ratio(r["tflops"], a, b) for r in rows], ".3f") for a, b, _ in pairs]
    out.append("| geomean | | vs cuDNN | " + " | ".join(means + tail) + " |")
    return "\n".join(out)


FWD_COLUMNS = [  # (mode, header): bench_fwd.py's modes
    ("dash_fwd", "DASH fwd"),
    ("torch_cudnn_fwd", "cuDNN fwd"),
    ("fa3_fwd", "FA3 fwd"),
    ("fa4_fwd", "FA4 fwd"),
    ("dash_det_fwdbwd", "DASH det fwd+bwd"),
    ("dash_nondet_fwdbwd", "DASH non-det fwd+bwd"),
    ("torch_cudnn_fwdbwd", "cuDNN fwd+bwd"),
    ("fa3_det_fwdbwd", "FA3 det fwd+bwd"),
    ("fa4_det_fwdbwd", "FA4 det fwd+bwd"),
]
FWD_RATIOS = [  # (numerator, denominator, header): time ratios, > 1 when DASH is faster
    ("dash_fwd", "torch_cudnn_fwd", "DASH / cuDNN (fwd)"),
    ("dash_fwd", "fa3_fwd", "DASH / FA3 (fwd)"),
    ("dash_det_fwdbwd", "torch_cudnn_fwdbwd", "DASH det / cuDNN (fwd+bwd)"),
    ("dash_det_fwdbwd", "fa3_det_fwdbwd", "DASH det / FA3 det (fwd+bwd)"),
]


def fwd_table(path: Path) -> str:
    rows = json.loads(path.read_text())["rows"]
    present = lambda m: any(m in r["tflops"] for r in rows)  # noqa: E731
    cols = [(m, h) for m, h in FWD_COLUMNS if present(m)]
    ratios = [(a, b, h) for a, b, h in FWD_RATIOS if present(a) and present(b)]
    out = ["| hd | mask | seqlen | " + " | ".join([h for _, h in cols] + [h for _, _, h in ratios]) + " |",
           "|---|---|---|" + "---|" * (len(cols) + len(ratios))]
    for r in rows:
        s, t = r["shape"], r["tflops"]
        cells = [f"{t[m]:.0f}" if m in t else "–" for m, _ in cols]
        cells += [f"{t[a] / t[b]:.2f}" if a in t and b in t else "–" for a, b, _ in ratios]
        out.append(f"| {s['head_dim']} | {'causal' if s['causal'] else 'full'} | {s['seqlen']} | " +
                   " | ".join(cells) + " |")
    means = []
    for a, b, _ in ratios:
        vals = [r["tflops"][a] / r["tflops"][b] for r in rows if a in r["tflops"] and b in r["tflops"]]
        means.append(f"{geomean(vals):.3f} (worst {min(vals):.2f})" if vals else "–")  # no row has both
    out.append("| geomean | | | " + " | ".join(["" for _ in cols] + means) + " |")
    return "\n".join(out)


E2E_COLUMNS = {  # bench_e2e.py's backends: header
    "dash_det": "DASH det", "dash_nondet": "DASH non-det", "fa3_det": "FA3 det", "fa3_nondet": "FA3 non-det",
    "fa4_det": "FA4 det", "fa4_nondet": "FA4 non-det", "torch_cudnn": "torch cuDNN", "torch_flash": "torch flash",
    "torch_flash_det": "torch flash det"}
E2E_RATIOS = [("dash_nondet", "DASH det / non-det"), ("torch_cudnn", "DASH det / cuDNN"),
              ("fa3_det", "DASH det / FA3 det"), ("fa4_det", "DASH det / FA4 det")]


def e2e_table(path: Path) -> str:
    """Median step time (ms) per backend and case, and DASH det's step-speed ratios (the other
    backend's time over DASH det's: > 1 when DASH det is faster), with their geomeans."""
    cases = json.loads(path.read_text())["cases"]
    ms = [{b: e["ms_median"] for b, e in c["backends"].items() if e.get("ms_median")} for c in cases]
    cols = [b for b in E2E_COLUMNS if any(b in m for m in ms)]
    ratios = [(b, h) for b, h in E2E_RATIOS if any(b in m and "dash_det" in m for m in ms)]
    head = [E2E_COLUMNS[b] for b in cols]
    out = ["| case | " + " | ".join(head + [h for _, h in ratios]) + " |", "|---|" + "---|" * (len(cols) + len(ratios))]
    for c, m in zip(cases, ms):
        cells = [f"{m[b]:.1f}" if b in m else "–" for b in cols]
        cells += [f"{m[b] / m['dash_det']:.3f}" if b in m and "dash_det" in m else "–" for b, _ in ratios]
        out.append(f"| {c['label']} | " + " | ".join(cells) + " |")
    means = []
    for b, _ in ratios:
        vals = [m[b] / m["dash_det"] for m in ms if b in m and "dash_det" in m]
        means.append(f"{geomean(vals):.3f} (worst {min(vals):.3f})")
    out.append("| geomean | " + " | ".join(["" for _ in cols] + means) + " |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--fwd", action="store_true", help="a results file of benchmarks/bench_fwd.py")
    kind.add_argument("--e2e", action="store_true", help="a results file of benchmarks/bench_e2e.py")
    args = p.parse_args()
    print(fwd_table(args.results) if args.fwd else e2e_table(args.results) if args.e2e else table(args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
