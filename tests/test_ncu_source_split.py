"""tools/ncu_source_split.py on synthetic ncu source-page CSVs (no GPU)."""

from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "benchmarks" / "results" / "ncu" / "2026-12-01-NVIDIA-H200-ncu-source-dash-bwd-hd64-causal-8k-c31ca8d.csv.gz"


def _tool():
    spec = importlib.util.spec_from_file_location("ncu_source_split", ROOT / "tools" / "ncu_source_split.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_barrier","stall_wait","stall_barrier (Not Issued)"')
ROWS = [  # address, sass, samples, executed, barrier, wait
    ("0x10", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", 50, 80, 10, 40),
    ("0x20", "@!P0 BRA 0x40", 30, 80, 30, 0),
    ("0x30", "SEL R1, R2, R3, !P0", 15, 8, 0, 15),
    ("0x40", "STG.E.128 desc[UR6][R4.64], R8", 5, 8, 5, 0),
    ("0x50", "EXIT", 0, 1, 0, 0),
]


def _csv(rows=ROWS, kernel_line=True) -> str:
    lines = ['"Kernel Name","void k()"'] if kernel_line else []
    lines.append(HEADER)
    lines += [f'"{a}","{s}","{n}","{e:,}","{b}","{w}","0"' for a, s, n, e, b, w in rows]
    return "\n".join(lines) + "\n"


def test_groups_by_execution_count(tmp_path):
    p = tmp_path / "src.csv"
    p.write_text(_csv())
    groups, total = _tool().split(_tool().read_rows(p))
    assert total == 100
    assert [(g.count, g.instructions, g.samples) for g in groups] == [(80, 2, 80), (8, 2, 20), (1, 1, 0)]
    assert groups[0].reasons["wait"] == 40 and groups[0].reasons["barrier"] == 40
    assert "barrier (Not Issued)" not in groups[0].reasons
    assert groups[0].opcodes == {"HGMMA": 50, "BRA": 30}  # predicate and modifiers stripped
    assert groups[1].opcodes["SEL"] == 15 and groups[1].opcodes["STG"] == 5


def test_gzip_and_no_kernel_line_read_the_same(tmp_path):
    plain, gz = tmp_path / "a.csv", tmp_path / "b.csv.gz"
    plain.write_text(_csv(kernel_line=False))
    gz.write_bytes(gzip.compress(_csv().encode()))
    t = _tool()
    assert t.split(t.read_rows(plain))[1] == t.split(t.read_rows(gz))[1] == 100


def test_cli_labels_loop_levels(tmp_path, capsys):
    p = tmp_path / "src.csv"
    p.write_text(_csv())
    assert _tool().main([str(p), "--steps", "10", "--columns", "1", "--mma-warps", "8"]) == 0
    out = capsys.readouterr().out
    assert "5 instructions, 100 stall samples" in out
    assert "[per step, each MMA warp]" in out and "[per column, each MMA warp]" in out
    assert "[per column, one warp]" in out  # the EXIT row ran once


def test_not_an_ncu_csv_is_an_error(tmp_path, capsys):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    assert _tool().main([str(p)]) == 2
    assert "not an ncu source-page CSV" in capsys.readouterr().err
    q = tmp_path / "y.csv"
    q.write_text('"Address","Source"\n"0x0","NOP"\n')
    assert _tool().main([str(q)]) == 2
    assert "missing columns" in capsys.readouterr().err


@pytest.mark.parametrize("arg", ["--steps", "--columns", "--mma-warps", "--top"])
def test_counts_must_be_positive(tmp_path, arg):
    p = tmp_path / "src.csv"
    p.write_text(_csv())
    with pytest.raises(SystemExit) as e:
        _tool().main([str(p), arg, "0"])
    assert e.value.code == 2


def test_stored_profile_per_column_share():
    """The kernel-notes figure (tenth pass): 985 instructions per column and MMA warp, 2.7 %."""
    groups, total = _tool().split(_tool().read_rows(STORED))
    per_column = next(g for g in groups if g.count == 4096 * 8)
    per_step = next(g for g in groups if g.count == 133120 * 8)
    assert per_column.instructions == 985 and per_step.instructions == 601
    assert per_column.samples / total == pytest.approx(0.0272, abs=5e-4)
