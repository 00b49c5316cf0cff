"""Split a kernel's ncu source-level stall samples by how often each instruction executed.

In a persistent kernel an instruction's execution count says which loop it belongs to: in
DASH's backward, once per step and MMA warp (steps x 8), once per column and MMA warp
(columns x 8), once per step for the one-warp roles (producer, dQ writers). Grouping the SASS
by that count shows what each level of the loop nest costs, e.g. that a column's epilogue and
bookkeeping hold as many stall samples as a whole step (docs/kernel-notes.md, tenth pass).

Input: the SASS source page of one profiled launch as CSV, e.g.

    ncu --profile-from-start off --clock-control none --set full -k regex:bwd_main -c 1 -o rep \
        python tools/ncu_target.py dash bwd 8192 causal 64
    ncu --import rep.ncu-rep --page source --print-source sass --csv > source.csv   (gzip is fine)

    python tools/ncu_source_split.py source.csv[.gz] [--steps N --columns C --mma-warps 8] [--top 8]

With --steps / --columns the groups whose count is steps x mma-warps, columns x mma-warps,
steps (one warp) or columns (one warp) are named so. Needs no GPU.
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dash.cli import OneLineErrorParser, positive_int  # noqa: E402  (no torch import)

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
SOURCE = "Source"


@dataclass
class Group:
    """The instructions that executed ``count`` times (summed over the launch's warps)."""
    count: int
    instructions: int = 0
    samples: int = 0
    reasons: collections.Counter = field(default_factory=collections.Counter)
    opcodes: collections.Counter = field(default_factory=collections.Counter)


def _int(s: str) -> int:
    s = (s or "").replace(",", "").strip()
    return int(float(s)) if s and s not in ("-", "n/a") else 0


def opcode(sass: str) -> str:
    """The mnemonic of a SASS line without its predicate and modifiers: '@!P0 BRA 0x..' -> 'BRA'."""
    toks = sass.split()
    if not toks:
        return ""
    op = toks[1] if toks[0].startswith("@") and len(toks) > 1 else toks[0]
    return op.split(".")[0]


def read_rows(path: Path) -> list[dict[str, str]]:
    """The per-instruction rows of an ncu source-page CSV (a kernel-name line may precede the header)."""
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"') or line.startswith("Address")), None)
    if start is None:
        raise ValueError(f"{path}: no header row starting with Address: not an ncu source-page CSV")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    missing = [c for c in (SAMPLES, EXECUTED, SOURCE) if rows and c not in rows[0]]
    if not rows or missing:
        raise ValueError(f"{path}: {'no instruction rows' if not rows else 'missing columns ' + ', '.join(missing)}")
    return rows


def split(rows: list[dict[str, str]]) -> tuple[list[Group], int]:
    """Groups by execution count, most samples first, and the launch's total samples."""
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    groups: dict[int, Group] = {}
    total = 0
    for r in rows:
        n = _int(r[EXECUTED])
        g = groups.setdefault(n, Group(n))
        s = _int(r[SAMPLES])
        g.instructions += 1
        g.samples += s
        total += s
        g.opcodes[opcode(r[SOURCE])] += s
        for c in reasons:
            g.reasons[c.removeprefix("stall_")] += _int(r[c])
    return sorted(groups.values(), key=lambda g: -g.samples), total


def names(steps: int | None, columns: int | None, mma_warps: int) -> dict[int, str]:
    out: dict[int, str] = {}
    if columns:
        out[columns] = "per column, one warp"
        out[columns * mma_warps] = "per column, each MMA warp"
    if steps:
        out[steps] = "per step, one warp"
        out[steps * mma_warps] = "per step, each MMA warp"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(prog="ncu_source_split.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path, help="ncu source page as CSV (plain or gzip)")
    ap.add_argument("--steps", type=positive_int, default=None, help="the launch's steps (Q tiles visited, all columns)")
    ap.add_argument("--columns", type=positive_int, default=None, help="the launch's columns (work items)")
    ap.add_argument("--mma-warps", type=positive_int, default=8, help="MMA warps per CTA (default 8)")
    ap.add_argument("--top", type=positive_int, default=8, help="groups to print (default 8)")
    args = ap.parse_args(argv)
    try:
        groups, total = split(read_rows(args.csv))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        print(f"ncu_source_split: {e}", file=sys.stderr)
        return 2
    label = names(args.steps, args.columns, args.mma_warps)
    print(f"{args.csv.name}: {sum(g.instructions for g in groups)} instructions, {total} stall samples")
    print(f"{'executed':>12} {'instr':>6} {'samples':>8} {'share':>7}  top reasons | top opcodes (samples)")
    for g in groups[:args.top]:
        share = g.samples / total if total else 0.0
        rs = ", ".join(f"{k} {v}" for k, v in g.reasons.most_common(3) if v)
        ops = ", ".join(f"{k} {v}" for k, v in g.opcodes.most_common(4) if v)
        tag = f"  [{label[g.count]}]" if g.count in label else ""
        print(f"{g.count:>12} {g.instructions:>6} {g.samples:>8} {100 * share:6.2f}%  {rs} | {ops}{tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
