"""Join results files of benchmarks/bench_bwd.py that one grid was split into (a device call
runs at most 10 minutes, so a full grid with every anchor may take two runs on one warm
machine) and recompute the summary, the paired ratios and the model's ranking over all rows.

    python tools/merge_bwd_results.py OUT.json short.json long.json

The files must come from one GPU, the same kernel sources, Python code, torch and cuDNN
(``environment``: device, sm_count, commit, build.sources_digest, code_sha256, torch, cudnn,
round_orders), the same timing settings (``meta``: kind, iters, burst, warmup) and the same
modes; otherwise their ratios are not from one run's settings and joining them would hide it,
so the tool refuses. Rows are sorted by head dim, mask (full first) and sequence length, the
paper grid's order; a shape present in two files is refused. The output's ``environment`` is
the first file's, with each file's name, date and argv under ``meta.merged_from``. The model's
ranking (``model_ranking``) is recomputed with the model of the checkout that runs this tool,
as ``tools/model_agreement.py`` does. Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dash import bench  # noqa: E402

# build.sources_digest: two builds of one dirty checkout share ``commit``.
SAME_ENVIRONMENT = ("device", "sm_count", "commit", "build.sources_digest", "code_sha256", "torch", "cudnn",
                    "round_orders")
SAME_META = ("kind", "iters", "burst", "warmup")


def _get(section: dict, dotted: str):
    for part in dotted.split("."):
        section = section.get(part) if isinstance(section, dict) else None
    return section


def merge(payloads: list[dict], names: list[str]) -> dict:
    first = payloads[0]

    def modes_of(p: dict) -> set[str]:
        return {m for r in p["rows"] for m in r["ms"]} | {m for r in p["rows"] for m in r.get("errors", {})}

    if first["meta"].get("kind") != "bwd":
        raise SystemExit(f"{names[0]}: meta.kind is {first['meta'].get('kind')!r}, not 'bwd'")
    for p, name in zip(payloads[1:], names[1:]):
        if modes_of(p) != modes_of(first):
            raise SystemExit(f"{name}: modes {sorted(modes_of(p) ^ modes_of(first))} are in one file only")
        for section, keys in (("environment", SAME_ENVIRONMENT), ("meta", SAME_META)):
            for key in keys:
                mine, theirs = _get(p[section], key), _get(first[section], key)
                if mine != theirs:
                    raise SystemExit(f"{name}: {section}.{key} is {mine!r}, {names[0]} has {theirs!r}: "
                                     "not one run's settings")
    rows: list[bench.Row] = []
    seen: dict[str, str] = {}
    for p, name in zip(payloads, names):
        for row in bench.rows_from_results(p):
            label = row.shape.label()
            if label in seen:
                raise SystemExit(f"{name}: row {label} is also in {seen[label]}")
            seen[label] = name
            rows.append(row)
    rows.sort(key=lambda r: (r.shape.head_dim, r.shape.causal, r.shape.seqlen, r.shape.label()))
    modes = list(dict.fromkeys(m for r in rows for m in r.ms))
    # bench.results_payload's layout, with the first file's environment (this machine has no GPU).
    merged = {
        "meta": {**{k: first["meta"][k] for k in SAME_META if k in first["meta"]},
                 "merged_from": [{"file": Path(n).name, "date": p["environment"].get("date"),
                                  "argv": p["meta"].get("argv")} for p, n in zip(payloads, names)]},
        "environment": first["environment"],
        "summary": bench.summary(rows, modes),
        "rows": bench.rows_payload(rows),
    }
    merged["ratios"] = bench.paired_ratios(rows)
    merged["model_ranking"] = bench.model_ranking_agreement(rows, sms=first["environment"]["sm_count"])
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("inputs", type=Path, nargs="+")
    args = p.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; results files are never replaced")
    payloads = [json.loads(f.read_text()) for f in args.inputs]
    merged = merge(payloads, [str(f) for f in args.inputs])
    args.out.write_text(json.dumps(merged, indent=2) + "\n")
    for name, r in merged["ratios"].items():
        print(f"  {name}: geomean {r['geomean']:.3f}, worst {r['worst']:.3f} ({r['rows']} rows)")
    rk = merged["model_ranking"]
    print(f"  model vs measured: auto's pick is the measured best on {rk['best_agrees']} of {rk['rows']} rows, "
          f"in the model's first rank on {rk['best_in_model_top']}; auto within 1 % / 3 % on "
          f"{rk['auto_within_1pct']} / {rk['auto_within_3pct']} (worst {rk['worst_auto_vs_best']:.3f})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
