"""tools/merge_bwd_results.py: a grid split over two runs, joined, gives the ratios of the whole
grid measured at once; files of other kernels or timer settings are refused (no GPU needed)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "benchmarks" / "results" / "2026-12-06-NVIDIA-H100-80GB-HBM3-bwd-fa3-fa4-d8cc23f.json"


def _tool():
    spec = importlib.util.spec_from_file_location("merge_bwd_results", ROOT / "tools" / "merge_bwd_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _halves() -> tuple[dict, dict, dict]:
    whole = json.loads(GRID.read_text())
    long_rows = [r for r in whole["rows"] if r["shape"]["seqlen"] >= 4096]
    short_rows = [r for r in whole["rows"] if r["shape"]["seqlen"] < 4096]
    a, b = copy.deepcopy(whole), copy.deepcopy(whole)
    a["rows"], b["rows"] = long_rows, short_rows  # out of grid order on purpose
    return whole, a, b


def test_joined_halves_give_the_whole_grids_ratios_and_order():
    whole, a, b = _halves()
    merged = _tool().merge([a, b], ["a.json", "b.json"])
    assert [r["shape"] for r in merged["rows"]] == [r["shape"] for r in whole["rows"]]
    # The ratios are recomputed with today's paired_ratios (which may name more pairs than the
    # file's run did); the file's own pairs must come out the same.
    from dash import bench as bench_now

    assert merged["ratios"].keys() == bench_now.paired_ratios(bench_now.rows_from_results(whole)).keys()
    assert whole["ratios"].keys() <= merged["ratios"].keys()
    for name, r in whole["ratios"].items():
        assert merged["ratios"][name]["geomean"] == pytest.approx(r["geomean"], rel=1e-12)
        assert merged["ratios"][name]["worst"] == pytest.approx(r["worst"], rel=1e-12)
    assert merged["summary"].keys() == whole["summary"].keys()
    for mode, v in whole["summary"].items():
        assert merged["summary"][mode] == pytest.approx(v, rel=1e-12)
    # The ranking is recomputed with today's model, so compare with the whole grid's, recomputed.
    from dash import bench

    ranking = bench.model_ranking_agreement(bench.rows_from_results(whole), sms=whole["environment"]["sm_count"])
    for key in ("rows", "best_agrees", "best_in_model_top", "auto_within_1pct", "auto_within_3pct"):
        assert merged["model_ranking"][key] == ranking[key]
    assert [m["file"] for m in merged["meta"]["merged_from"]] == ["a.json", "b.json"]


@pytest.mark.parametrize("section, key, value", [("environment", "commit", "0" * 40),
                                                 ("environment", "device", "NVIDIA H200"),
                                                 ("environment", "sm_count", 114),
                                                 ("environment", "code_sha256", "ffff"),
                                                 ("environment", "torch", "2.12.0"),
                                                 ("environment", "cudnn", 91000),
                                                 ("environment", "round_orders", "cyclic"),
                                                 ("meta", "iters", 20),
                                                 ("meta", "burst", 1),
                                                 ("meta", "warmup", 0)])
def test_files_of_other_runs_settings_are_refused(section, key, value):
    _, a, b = _halves()
    b[section][key] = value
    with pytest.raises(SystemExit, match=f"{section}.{key}"):
        _tool().merge([a, b], ["a.json", "b.json"])


def test_other_kernel_sources_are_refused_even_under_one_commit():
    """Two builds of one dirty checkout share ``commit``; their sources digests tell them apart."""
    _, a, b = _halves()
    b["environment"]["build"] = dict(b["environment"]["build"], sources_digest="efc9066ff01b6534")
    with pytest.raises(SystemExit, match="build.sources_digest"):
        _tool().merge([a, b], ["a.json", "b.json"])


def test_other_modes_and_other_kinds_are_refused():
    _, a, b = _halves()
    for r in b["rows"]:
        del r["ms"]["fa4_det"]
    with pytest.raises(SystemExit, match=r"modes \['fa4_det'\] are in one file only"):
        _tool().merge([a, b], ["a.json", "b.json"])
    _, a, b = _halves()
    a["meta"]["kind"] = "fwd"
    with pytest.raises(SystemExit, match="not 'bwd'"):
        _tool().merge([a, b], ["a.json", "b.json"])


def test_an_existing_output_is_never_replaced(tmp_path):
    out = tmp_path / "out.json"
    out.write_text("{}")
    with pytest.raises(SystemExit, match="exists"):
        _tool().main([str(out), str(GRID)])
    assert out.read_text() == "{}"


def test_a_row_in_two_files_is_refused():
    _, a, _ = _halves()
    with pytest.raises(SystemExit, match="is also in a.json"):
        _tool().merge([a, copy.deepcopy(a)], ["a.json", "b.json"])
