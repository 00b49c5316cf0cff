"""``python -m dash simulate``, tested through ``dash.schedules.cli`` (no torch needed)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

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



def test_dq_chains_shorten_the_descending_causal_order(capsys):
    """``--dq-chains 2`` models the kernel's deterministic causal mode (each dQ tile accumulates
    in two chains): descending's turn chain halves and its makespan drops below one chain's."""
    argv = ["--seqlen", "8192", "--hdim", "128", "--causal", "--schedule", "descending", "--c", "2.048",
            "--r", "1.152", "--latency", "1.152", "--json"]
    rc1, out1, _ = _run(argv, capsys)
    rc2, out2, _ = _run(argv + ["--dq-chains", "2"], capsys)
    one, two = json.loads(out1), json.loads(out2)
    assert rc1 == rc2 == 0 and one["dq_chains"] == 1 and two["dq_chains"] == 2
    m1, m2 = one["schedules"]["descending"]["makespan"], two["schedules"]["descending"]["makespan"]
    assert two["schedules"]["descending"]["deadlock_free"] is True
    assert m2 < 0.97 * m1, (m1, m2)
    with pytest.raises(SystemExit):
        _run(argv + ["--dq-chains", "0"], capsys)

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


# ---------------------------------------------------------------------------------------
# Input checks: at parse time (argparse's SystemExit(2)) or before the model runs (rc 2)
# ---------------------------------------------------------------------------------------
def _parse_error(argv, capsys) -> str:
    parser = argparse.ArgumentParser(prog="python -m dash simulate")
    cli.add_simulate_arguments(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_sizes_are_checked_while_parsing(capsys):
    assert "argument --seqlen: 0 is not a positive integer" in _parse_error(["--seqlen", "0", "--hdim", "64"], capsys)
    err = _parse_error(["--seqlen", "64", "--hdim", "64", "--varlen-q", "1,x"], capsys)
    assert "argument --varlen-q: 1,x is not a comma-separated list of lengths >= 0" in err
    err = _parse_error(["--seqlen", "64", "--hdim", "64", "--latency", "inf"], capsys)
    assert "argument --latency: inf is not a finite number >= 0" in err


def test_unsupported_hdim_runs_with_explicit_tiles(capsys):
    """The head dim is only checked against the kernel's table when the model needs its tiles."""
    rc, out, err = _run(["--seqlen", "1024", "--hdim", "96", "--block-m", "64", "--block-n", "128",
                         "--schedule", "fa3", "--json"], capsys)
    assert rc == 0 and err == ""
    assert "hdim 96" in json.loads(out)["problem"]
    rc, out, err = _run(["--seqlen", "1024", "--hdim", "96", "--block-m", "64"], capsys)
    assert rc == 2 and out == "" and "argument --hdim: head_dim=96" in err and "--block-n" in err


@pytest.mark.parametrize("argv", [
    ["--seqlen", "64", "--hdim", "64", "--varlen-q", "0,0"],  # every sequence empty: lower bound 0
    ["--seqlen", "64", "--hdim", "64", "--c", "0", "--r", "0"],  # zero costs: lower bound 0
])
def test_zero_lower_bound_is_not_a_division_by_zero(argv, capsys):
    rc, out, err = _run(argv + ["--schedule", "fa3,shift"], capsys)
    assert rc == 0 and err == ""
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[2:]}
    assert set(rows) == {"fa3", "shift"} and all(r[1] == "0.0" and r[2] == "1.000" for r in rows.values())


def test_gantt_with_nothing_to_draw_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "g.png"
    rc, out, err = _run(["--seqlen", "4096", "--hdim", "64", "--batch", "1", "--heads", "1", "--ctas", "3",
                         "--schedule", "portable", "--gantt", str(path)], capsys)
    assert rc == 1 and "Traceback" not in err and err.count("\n") == 1
    assert f"--gantt {path} not written: no schedule was simulated deadlock-free" in err
    assert not path.exists()


def test_gantt_write_failure_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import errno

    from dash.schedules import gantt

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gantt, "plot_gantt", full_disk)
    path = tmp_path / "g.png"
    rc, out, err = _run(["--seqlen", "1024", "--hdim", "64", "--schedule", "fa3", "--gantt", str(path)], capsys)
    assert rc == 1 and err.count("\n") == 1
    assert f"--gantt {path} not written: {os.strerror(errno.ENOSPC)}" in err


def test_gantt_leaves_the_global_matplotlib_backend_alone(tmp_path):
    """plot_gantt draws on an Agg canvas without pyplot: a notebook's backend is not switched."""
    pytest.importorskip("matplotlib")
    import dash

    path = str(tmp_path / "g.png")
    code = (
        "import sys, matplotlib\n"
        "matplotlib.use('svg')\n"
        "from dash.cli import main\n"
        f"rc = main(['simulate', '--seqlen', '1024', '--hdim', '64', '--schedule', 'fa3', '--gantt', {path!r}])\n"
        "print(rc, matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(dash.__file__)))
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=root),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "0 svg False"
    assert (tmp_path / "g.png").stat().st_size > 10_000


def test_kernel_flag_models_the_kernel_and_prints_autos_pick(capsys):
    """--kernel: the kernel's calibrated costs, dQ chains and pipeline depth for the head dim and
    mask, and the schedule deterministic auto picks (the same as choose_kernel_schedule)."""
    from dash.schedules.auto import choose_kernel_schedule, kernel_costs, kernel_dq_chains, kernel_pipeline_depth

    rc, out, err = _run(["--seqlen", "2048", "--hdim", "128", "--causal", "--kernel", "--schedule", "fa3,descending",
                         "--json"], capsys)
    assert rc == 0 and err == ""
    data = json.loads(out)
    assert data["costs"] == kernel_costs(128, True).as_dict()
    assert data["dq_chains"] == kernel_dq_chains(128, True) and data["pipeline_depth"] == kernel_pipeline_depth(128, True)
    assert data["auto"] == choose_kernel_schedule(8, 16, 16, 2048, 2048, 128, True, 132)
    # What auto ranks by: the claimed schedules replayed with claims in simulated time.
    replayed = data["replayed_makespan"]
    assert set(replayed) == {"fa3", "descending"} and all(v > 0 for v in replayed.values())
    rc, out, _ = _run(["--seqlen", "512", "--hdim", "128", "--kernel", "--schedule", "fa3,interleaved,shift"], capsys)
    line = [ln for ln in out.splitlines() if ln.startswith("makespan with the claims replayed in simulated time")]
    assert rc == 0 and len(line) == 1 and "fa3" in line[0] and "interleaved" in line[0] and "shift" not in line[0]
    rc, out, _ = _run(["--seqlen", "512", "--hdim", "128", "--causal", "--kernel"], capsys)
    assert rc == 0 and f"deterministic auto picks {choose_kernel_schedule(32, 16, 16, 512, 512, 128, True, 132)} " in out
    rc, _, err = _run(["--seqlen", "512", "--hdim", "128", "--kernel", "--costs", os.devnull], capsys)
    assert rc == 2 and "argument --kernel: uses the kernel's calibrated costs; leave out --costs" in err
