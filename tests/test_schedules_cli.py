"""``python -m dash simulate``, tested through ``dash.schedules.cli`` (no torch needed)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from dash.schedules import cli
from dash.schedules.orders import SCHEDULE_NAMES


def _run(argv, capsys):
    parser = argparse.ArgumentParser(prog="python -m dash simulate")
    cli.add_simulate_arguments(parser)
    rc = cli.run_simulate(parser.parse_args(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_full_4k_hdim128_shift_below_fa3(capsys):
    rc, out, err = _run(["--seqlen", "4096", "--hdim", "128", "--schedule", "all", "--json"], capsys)
    assert rc == 0 and err == ""
    data = json.loads(out)  # stdout holds the JSON and nothing else
    sch = data["schedules"]
    assert list(sch) == list(SCHEDULE_NAMES)
    for name, rec in sch.items():
        assert set(rec) == {"makespan", "lower_bound", "idle_fraction", "max_wait", "deadlock_free", "portable"}
        assert rec["deadlock_free"] is True
        assert rec["makespan"] >= rec["lower_bound"] - 1e-9
    assert sch["shift"]["makespan"] < sch["fa3"]["makespan"]
    assert sch["fa3"]["portable"] is True and sch["shift"]["portable"] is False
    assert "batch 4 x heads 16" in data["problem"] and data["ctas"] == 132


def test_table_causal_8k_descending_at_or_below_fa3(capsys):
    rc, out, _ = _run(["--seqlen", "8192", "--hdim", "128", "--causal"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert "batch 2 x heads 16" in lines[0] and "causal" in lines[0]
    assert lines[1].split() == ["schedule", "makespan", "/", "bound", "idle", "%", "worst", "wait", "deadlock-free",
                                "portable"]
    rows = {ln.split()[0]: ln.split() for ln in lines[2:]}
    assert set(rows) == set(SCHEDULE_NAMES)
    assert float(rows["descending"][1]) <= float(rows["fa3"][1])
    assert all(r[5] == "yes" for r in rows.values())


def test_options_shape_the_problem(capsys):
    rc, out, _ = _run(["--seqlen", "1000", "--seqlen-k", "700", "--hdim", "64", "--batch", "2", "--heads", "4",
                       "--heads-kv", "2", "--ctas", "7", "--schedule", "fa3,shift", "--c", "2", "--r", "0.5",
                       "--latency", "0.1", "--pipeline-depth", "0", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and list(data["schedules"]) == ["fa3", "shift"]
    assert data["costs"]["c"] == 2.0 and data["ctas"] == 7
    assert "batch 2 x heads 4/2kv, seqlen q 1000 k 700" in data["problem"]
    rc, out, _ = _run(["--seqlen", "1", "--hdim", "128", "--varlen-q", "100,0,700", "--window", "64", "0",
                       "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and "batch 3" in data["problem"] and "local" in data["problem"]


def test_portable_that_does_not_fit_is_reported(capsys):
    rc, out, _ = _run(["--seqlen", "4096", "--hdim", "64", "--batch", "1", "--heads", "1", "--ctas", "3",
                       "--schedule", "portable", "--json"], capsys)
    rec = json.loads(out)["schedules"]["portable"]
    assert rec["makespan"] is None and "needs at least" in rec["error"]


def test_bad_input_is_a_clear_error(capsys):
    rc, out, err = _run(["--seqlen", "1024", "--hdim", "96"], capsys)
    assert rc == 2 and "head_dim=96" in err and out == ""
    rc, _, err = _run(["--seqlen", "1024", "--hdim", "64", "--schedule", "zigzag"], capsys)
    assert rc == 2 and "zigzag" in err


def test_gantt_png_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "g.png"
    rc, out, _ = _run(["--seqlen", "1024", "--hdim", "64", "--schedule", "fa3,shift", "--gantt", str(path)], capsys)
    assert rc == 0 and "Gantt chart written" in out
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000


def test_gantt_segments_show_fa3_waits_and_none_for_shift():
    from dash.schedules import make_plan, paper_problem, simulate
    from dash.schedules.gantt import cta_segments

    p = paper_problem(2048, 64)
    fa3 = cta_segments(simulate(make_plan(p, "fa3", 132)))
    shift = cta_segments(simulate(make_plan(p, "shift", 132)))
    assert len(fa3["wait"]) > 100 and len(shift["wait"]) == 0
