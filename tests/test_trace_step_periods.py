"""tools/trace_step_periods.py's split of a trace into step periods (no GPU needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")  # the tools import torch (and dash) at module level

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("trace_step_periods", ROOT / "tools" / "trace_step_periods.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _records(rows):
    """rows: (cta, b, h, n, m, t_ready) -> the dict decode_records returns (fields used here;
    ``step`` numbers each CTA's rows in the order given)."""
    a = np.array(rows, dtype=np.float64)
    step = np.zeros(len(rows), dtype=np.int64)
    for cta in set(a[:, 0].astype(int)):
        idx = np.flatnonzero(a[:, 0] == cta)
        step[idx] = np.arange(len(idx))
    return {"cta": a[:, 0].astype(np.int64), "b": a[:, 1].astype(np.int64), "h": a[:, 2].astype(np.int64),
            "n": a[:, 3].astype(np.int64), "m": a[:, 4].astype(np.int64), "t_ready": a[:, 5], "step": step}


def test_periods_split_column_switches_masked_steps_and_ctas():
    # Causal, 128 x 128 tiles, seqlen 512: column n covers Q tiles n..3, the diagonal m == n
    # needs the mask. CTA 0 runs column 0 (descending: m = 3, 2, 1, 0) then column 3 (m = 3);
    # CTA 1 runs column 1 (m = 3, 2, 1). Steps inside a column take 2 us, a column's first
    # step 5 us; the masked diagonal steps 3 us. Records arrive out of order.
    rows = [
        (0, 0, 0, 0, 3, 10.0), (0, 0, 0, 0, 2, 12.0), (0, 0, 0, 0, 1, 14.0), (0, 0, 0, 0, 0, 17.0),
        (0, 0, 0, 3, 3, 22.0),
        (1, 0, 0, 1, 3, 11.0), (1, 0, 0, 1, 2, 13.0), (1, 0, 0, 1, 1, 16.0),
    ]
    rec = _records(rows)
    order = np.array([4, 0, 7, 2, 5, 1, 6, 3])
    rec = {k: v[order] for k, v in rec.items()}
    out = _tool().periods(rec, 128, 128, True, 512, 512)
    assert out["steps"] == 8
    # CTA 0: 2, 2, 3 (masked m=0), 5 (column 3's first, also masked: counted as first);
    # CTA 1: 2, 3 (masked m=1). The first step of a CTA has no period.
    assert out["in column"]["count"] == 3 and out["in column"]["mean_us"] == pytest.approx(2.0)
    assert out["first of column"]["count"] == 1 and out["first of column"]["mean_us"] == pytest.approx(5.0)
    assert out["masked (not first)"]["count"] == 2 and out["masked (not first)"]["mean_us"] == pytest.approx(3.0)
    total = 2 + 2 + 3 + 5 + 2 + 3
    assert out["first of column"]["share"] == pytest.approx(5 / total)
    assert out["mean_period_us"] == pytest.approx(total / 6)
    assert out["makespan_us"] == pytest.approx(12.0)
    # Six periods in ten time bins: the in-column ones (2 us) land in some bins, the rest are empty.
    deciles = out["in_column_mean_by_decile_us"]
    filled = [x for x in deciles if x is not None]
    assert len(deciles) == 10 and filled and all(x == pytest.approx(2.0) for x in filled)


def test_periods_causal_with_more_keys_than_queries_aligns_bottom_right():
    # seqlen_q 256, seqlen_k 512 (bottom-right): query q sees keys <= q + 256. Column 2 (keys
    # 256..383) needs the mask against Q tile 0 (its last key 383 > 0 + 256); column 1 (keys
    # 128..255) does not (255 <= 0 + 256). With the offset's sign flipped (q - 256) column 1
    # would read as masked too.
    rows = [(0, 0, 0, 2, 1, 0.0), (0, 0, 0, 2, 0, 3.0), (0, 0, 0, 1, 1, 9.0), (0, 0, 0, 1, 0, 11.0)]
    out = _tool().periods(_records(rows), 128, 128, True, 256, 512)
    assert out["masked (not first)"]["count"] == 1 and out["masked (not first)"]["mean_us"] == pytest.approx(3.0)
    assert out["first of column"]["count"] == 1 and out["first of column"]["mean_us"] == pytest.approx(6.0)
    assert out["in column"]["count"] == 1 and out["in column"]["mean_us"] == pytest.approx(2.0)


def test_periods_a_new_head_or_batch_starts_a_column():
    # The same column index n in another head, then another batch: both are column switches.
    rows = [(0, 0, 0, 0, 0, 0.0), (0, 0, 0, 0, 1, 2.0), (0, 0, 1, 0, 0, 7.0), (0, 1, 1, 0, 0, 12.0)]
    out = _tool().periods(_records(rows), 128, 128, False, 256, 256)
    assert out["first of column"]["count"] == 2 and out["first of column"]["mean_us"] == pytest.approx(5.0)
    assert out["in column"]["count"] == 1


def test_periods_full_mask_marks_only_ragged_tails():
    # Full mask, seqlen_k 200 with 128-key tiles: column 1 holds keys 128..255, past seqlen_k.
    rows = [(0, 0, 0, 0, 0, 0.0), (0, 0, 0, 0, 1, 2.0), (0, 0, 0, 1, 0, 7.0), (0, 0, 0, 1, 1, 10.0)]
    out = _tool().periods(_records(rows), 128, 128, False, 200, 200)
    assert out["in column"]["count"] == 1
    assert out["first of column"]["count"] == 1
    assert out["masked (not first)"]["count"] == 1 and out["masked (not first)"]["mean_us"] == pytest.approx(3.0)


def test_breakdown_short_names():
    tool = importlib.util.spec_from_file_location("bwd_kernel_breakdown", ROOT / "tools" / "bwd_kernel_breakdown.py")
    mod = importlib.util.module_from_spec(tool)
    tool.loader.exec_module(mod)
    assert mod.short_name("void dash::bwd_main_kernel<dash::BwdTraits<64, true>>(Params)") == "dash::bwd_main_kernel"
    # FA3's kernels all share cutlass::device_kernel; the kernel class inside tells them apart.
    names = {mod.short_name(f"void cutlass::device_kernel<flash::enable_sm90_or_later<flash::{k}<cute::tuple<int>>>>(T1::Params)")
             for k in ("FlashAttnBwdPreprocess", "FlashAttnBwdSm90", "FlashAttnBwdPostprocessConvertdQ")}
    assert names == {"cutlass::device_kernel[FlashAttnBwdPreprocess]", "cutlass::device_kernel[FlashAttnBwdSm90]",
                     "cutlass::device_kernel[FlashAttnBwdPostprocessConvertdQ]"}
