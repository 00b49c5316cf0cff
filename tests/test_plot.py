"""``python -m dash plot``: reading benchmark results files and drawing their charts (CPU only)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dash
from dash import plot

#: Folder holding the dash package under test (site-packages when installed); subprocesses
#: import the same dash through PYTHONPATH.
ROOT = Path(os.path.dirname(os.path.dirname(os.path.abspath(dash.__file__))))
#: A committed results file of the paper grid (24 rows: hdim 64/128 x full/causal x 512..16k),
#: in this checkout (not in the installed package).
COMMITTED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "2026-11-29-NVIDIA-H200-bwd-1d20044.json"
MODES = ["dash_nondet", "dash_fa3_det", "torch_cudnn", "torch_flash"]

needs_matplotlib = pytest.mark.skipif(plot.matplotlib_problem() is not None, reason="matplotlib is not installed")


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    from dash.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _assert_one_line_error(err: str, *expected: str) -> None:
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, f"expected one line on stderr, got:\n{err}"
    assert err.startswith("python -m dash plot: error: "), err
    for text in expected:
        assert text in err, (text, err)


def _synthetic() -> dict:
    """A future results file: more modes, more columns, a kind, a row without 'tflops', a failed mode."""
    payload = json.loads(COMMITTED.read_text())
    payload["kind"] = "fwd+bwd"
    payload["environment"]["device"] = "NVIDIA H100 80GB HBM3"
    for i, row in enumerate(payload["rows"]):
        base = row["ms"]["dash_fa3_det"]
        row["ms"].update(dash_descending_det=base * 0.9, fa3_nondet=base * 1.1, fa4_nondet=base * 1.2)
        row["tflops"] = {m: row["bwd_flops"] / (ms * 1e-3) / 1e12 for m, ms in row["ms"].items()}
        row["l2_hit_rate"] = 0.5  # an unknown column
        row["shape"]["window"] = [-1, 0] if row["shape"]["causal"] else [-1, -1]
        if i == 0:
            del row["tflops"]  # TFLOP/s computed from ms and bwd_flops
        if i == 1:
            row["errors"]["fa4_nondet"] = "RuntimeError: not supported"
            del row["ms"]["fa4_nondet"], row["tflops"]["fa4_nondet"]
    return payload


def _write(tmp_path: Path, payload, name: str = "results.json") -> Path:
    path = tmp_path / name
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return path


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------
def test_read_committed_results():
    res = plot.load_results(str(COMMITTED))
    assert res.kind == "bwd" and res.device == "NVIDIA H200"
    assert res.commit.startswith("1d20044") and res.date.startswith("2026-11-29")
    assert list(res.modes) == MODES and len(res.rows) == 24
    titles = plot._panel_titles(res)
    assert [titles[k] for k in res.panels()] == ["hdim 64, full", "hdim 64, causal", "hdim 128, full",
                                                 "hdim 128, causal"]
    assert sorted({r.seqlen for r in res.rows}) == [512, 1024, 2048, 4096, 8192, 16384]


def test_ratios_are_the_runs_own_summary():
    """The ratio chart's numbers are the same-run ratios bench.summary wrote into the file."""
    payload = json.loads(COMMITTED.read_text())
    res = plot.parse_results(payload, "x.json")
    for mode, s in payload["summary"].items():
        geo, worst, n = plot.ratio_summary(res, mode, "torch_cudnn")
        assert geo == pytest.approx(s["geomean_vs_torch_cudnn"], rel=1e-9)
        assert worst == pytest.approx(s["min_vs_torch_cudnn"], rel=1e-9) and n == s["rows"]


def test_read_tolerates_extra_modes_columns_and_kind():
    payload = _synthetic()
    res = plot.parse_results(payload, "future.json")
    assert res.kind == "fwd+bwd"
    assert list(res.modes) == MODES + ["dash_descending_det", "fa3_nondet", "fa4_nondet"]
    assert len(res.panels()) == 4  # the window field makes no extra panels
    row0 = payload["rows"][0]
    assert res.rows[0].tflops["fa3_nondet"] == pytest.approx(row0["bwd_flops"] / (row0["ms"]["fa3_nondet"] * 1e-3)
                                                             / 1e12)
    assert "fa4_nondet" not in res.rows[1].tflops and "fa4_nondet" in res.rows[2].tflops


def test_panels_split_on_any_other_shape_field():
    payload = json.loads(COMMITTED.read_text())
    extra = copy.deepcopy(payload["rows"][:6])
    for row in extra:
        row["shape"]["dtype"] = "float16"
    payload["rows"] += extra
    res = plot.parse_results(payload, "x.json")
    titles = [plot._panel_titles(res)[k] for k in res.panels()]
    assert len(titles) == 5 and "hdim 64, full, dtype bfloat16" in titles and "hdim 64, full, dtype float16" in titles
    assert "hdim 128, causal" in titles  # only panels that need it name the field


# ---------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------
def _plot_png(path, out, capsys) -> str:
    """``python -m dash plot PATH --out OUT``: succeeds silently on stderr and writes a PNG;
    returns what it printed."""
    rc, stdout, err = _main(["plot", str(path), "--out", str(out)], capsys)
    assert rc == 0 and err == ""
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return stdout


@needs_matplotlib
def test_plot_committed_results(tmp_path, capsys):
    from matplotlib.image import imread

    out = tmp_path / "chart.png"
    stdout = _plot_png(COMMITTED, out, capsys)
    assert stdout == f"wrote {out} (4 panels, 4 modes, ratios to torch_cudnn)\n"
    assert out.stat().st_size > 50_000
    res = plot.load_results(str(COMMITTED))
    w, h = plot.draw(res, MODES, "torch_cudnn").get_size_inches() * plot.DPI
    img = imread(out)
    assert img.shape[:2] == (round(h), round(w))
    assert img.shape[1] > 1500 and img.shape[0] > 700  # 4 panels wide, TFLOP/s over ratio
    assert img[..., :3].std() > 0.05  # not a blank canvas


@needs_matplotlib
def test_chart_is_readable():
    """Axes with units, log2 seqlen axis, one legend entry per mode, DASH solid and anchors dashed."""
    res = plot.load_results(str(COMMITTED))
    fig = plot.draw(res, MODES, "torch_cudnn")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 8
    tput, ratio = axes[:4], axes[4:]
    assert tput[0].get_ylabel() == "backward TFLOP/s"
    assert "ratio to torch_cudnn" in ratio[0].get_ylabel() and "same run" in ratio[0].get_ylabel()
    for ax in axes:
        assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
        assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "1k", "2k", "4k", "8k", "16k"]
    assert "16k tokens" in ratio[0].get_xlabel()
    styles = {line.get_label().split(":")[0].split(" ")[0]: line.get_linestyle() for line in tput[0].get_lines()}
    assert styles == {"dash_nondet": "-", "dash_fa3_det": "-", "torch_cudnn": "--", "torch_flash": "--"}
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(labels) == 4 and labels[0].startswith("dash_nondet: 1.21x torch_cudnn (geomean of 24 rows")
    title = fig._suptitle.get_text()
    assert "NVIDIA H200" in title and "1d2004425d" in title and "2026-11-29" in title
    ys = [y for y in ratio[0].get_lines()[0].get_ydata()]
    assert ys == [1.0, 1.0]  # the anchor's line


@needs_matplotlib
def test_plot_synthetic_results_with_more_modes(tmp_path, capsys):
    path = _write(tmp_path, _synthetic())
    out = tmp_path / "all.png"
    rc, stdout, err = _main(["plot", str(path), "--out", str(out)], capsys)
    assert rc == 0 and err == "" and "7 modes" in stdout and out.stat().st_size > 50_000
    res = plot.load_results(str(path))
    fig = plot.draw(res, list(res.modes), "torch_cudnn")
    assert fig.axes[0].get_ylabel() == "forward + backward TFLOP/s"
    styles = {line.get_label().split(":")[0].split(" ")[0]: line.get_linestyle() for line in fig.axes[0].get_lines()}
    assert styles["dash_descending_det"] == "-" and styles["fa3_nondet"] == "--" and styles["fa4_nondet"] == "--"
    # Another anchor and a subset of modes.
    out2 = tmp_path / "fa3.svg"
    rc, stdout, err = _main(["plot", str(path), "--out", str(out2), "--ratio-to", "fa3_nondet",
                             "--modes", "dash_fa3_det,dash_descending_det,fa3_nondet"], capsys)
    assert rc == 0 and err == "" and "3 modes, ratios to fa3_nondet" in stdout
    assert out2.read_text().lstrip().startswith("<?xml")


@needs_matplotlib
def test_without_the_anchor_only_throughput_is_drawn(tmp_path, capsys):
    payload = json.loads(COMMITTED.read_text())
    for row in payload["rows"]:
        for key in ("ms", "tflops"):
            del row[key]["torch_cudnn"]
    path = _write(tmp_path, payload)
    out = tmp_path / "c.png"
    rc, stdout, err = _main(["plot", str(path), "--out", str(out)], capsys)
    assert rc == 0 and err == "" and out.exists()
    assert "has no torch_cudnn mode: no ratio chart (pick an anchor with --ratio-to)" in stdout
    fig = plot.draw(plot.load_results(str(path)), ["dash_nondet"], None)
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 4


@needs_matplotlib
def test_default_out_is_next_to_the_results(tmp_path, capsys):
    first = shutil.copy(COMMITTED, tmp_path / "a.json")
    second = _write(tmp_path, _synthetic(), "b.json")
    rc, stdout, err = _main(["plot", str(first), str(second)], capsys)
    assert rc == 0 and err == ""
    assert (tmp_path / "a-throughput.png").stat().st_size > 50_000
    assert (tmp_path / "b-throughput.png").stat().st_size > 50_000
    assert stdout.count("wrote ") == 2


@needs_matplotlib
def test_plot_subprocess_without_torch_or_pyplot(tmp_path):
    out = tmp_path / "chart.png"
    code = ("import sys\nfrom dash.cli import main\n"
            f"rc = main(['plot', {str(COMMITTED)!r}, '--out', {str(out)!r}])\n"
            "print(rc, 'torch' in sys.modules, 'matplotlib.pyplot' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "0 False False" and out.exists()


# ---------------------------------------------------------------------------------------
# Errors: one line naming the file / option, exit code 2, checked before drawing
# ---------------------------------------------------------------------------------------
@needs_matplotlib  # the input's errors are reported after --out's check for matplotlib
@pytest.mark.parametrize("content, expected", [
    ("not json at all", "is not a JSON file"),
    ('{"rows": []}', "is not a DASH benchmark results file: no 'rows' list"),
    ('{"meta": {}, "rows": [{"ms": {"a": 1}}]}', "row 0 has no shape with head_dim and seqlen"),
    ('{"rows": [{"shape": {"head_dim": 64, "seqlen": 512}, "ms": {}, "tflops": {}}]}', "has no TFLOP/s or ms numbers"),
    ('{"kind": "gantt", "rows": []}', "is a 'gantt' file, not benchmark results"),
    ('{"traceEvents": [], "displayTimeUnit": "ns"}', "is a profiler trace, not benchmark results"),
    ('[{"ph": "X", "name": "bwd", "ts": 0, "dur": 5}]', "is a profiler trace, not benchmark results"),
    ('{"schedules": {"fa3": {}}, "problem": "x"}', "is scheduling-model output (python -m dash simulate --json)"),
])
def test_files_that_cannot_be_plotted(content, expected, tmp_path, capsys):
    path = _write(tmp_path, content, "in.json")
    out = tmp_path / "x.png"
    rc, stdout, err = _main(["plot", str(path), "--out", str(out)], capsys)
    assert rc == 2 and stdout == ""
    _assert_one_line_error(err, str(path), expected)
    assert not out.exists()


@needs_matplotlib
def test_binary_file_is_not_json(tmp_path, capsys):
    path = tmp_path / "chart.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    rc, _, err = _main(["plot", str(path), "--out", str(tmp_path / "x.png")], capsys)
    assert rc == 2
    _assert_one_line_error(err, f"{path} is not a JSON file")


def test_missing_results_file(tmp_path, capsys):
    path = tmp_path / "nope.json"
    rc, _, err = _main(["plot", str(path)], capsys)
    assert rc == 2
    _assert_one_line_error(err, f"argument RESULTS.json: file {path} does not exist")


@needs_matplotlib
@pytest.mark.parametrize("option, value", [("--modes", "dash_nondet,fa5"), ("--ratio-to", "fa5")])
def test_unknown_mode_lists_the_available_ones(option, value, tmp_path, capsys):
    rc, stdout, err = _main(["plot", str(COMMITTED), option, value, "--out", str(tmp_path / "x.png")], capsys)
    assert rc == 2 and stdout == ""
    _assert_one_line_error(err, f"argument {option}: 'fa5' is not in {COMMITTED}", "available: " + ", ".join(MODES))


@needs_matplotlib
def test_out_into_missing_folder(tmp_path, capsys):
    out = tmp_path / "no" / "chart.png"
    rc, stdout, err = _main(["plot", str(COMMITTED), "--out", str(out)], capsys)
    assert rc == 2 and stdout == ""
    _assert_one_line_error(err, f"argument --out: cannot write {out}: folder {out.parent} does not exist")


@needs_matplotlib
def test_default_out_in_unwritable_folder(tmp_path, capsys, monkeypatch):
    path = shutil.copy(COMMITTED, tmp_path / "a.json")
    real_access = os.access  # as root chmod does not deny writes: make os.access say no instead
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(tmp_path)
                        else real_access(p, mode, **kw))
    rc, stdout, err = _main(["plot", str(path)], capsys)
    assert rc == 2 and stdout == ""
    _assert_one_line_error(err, f"folder {tmp_path} is not writable", "choose another path with --out")
    assert not (tmp_path / "a.png").exists()


@needs_matplotlib
def test_one_out_for_two_files(tmp_path, capsys):
    rc, _, err = _main(["plot", str(COMMITTED), str(COMMITTED), "--out", str(tmp_path / "x.png")], capsys)
    assert rc == 2
    _assert_one_line_error(err, "argument --out: one path for 2 results files")


def test_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, stdout, err = _main(["plot", str(COMMITTED)], capsys)
    assert rc == 2 and stdout == ""
    _assert_one_line_error(err, "plot needs matplotlib, which is not installed: pip install matplotlib "
                                "(or pip install 'dash-attention[plot]')")
    rc, _, err = _main(["plot", str(COMMITTED), "--out", str(tmp_path / "x.png")], capsys)
    assert rc == 2
    _assert_one_line_error(err, "argument --out: needs matplotlib, which is not installed")


def test_plot_without_matplotlib_subprocess(tmp_path):
    code = ("import sys\nsys.modules['matplotlib'] = None\nfrom dash.cli import main\n"
            "raise SystemExit(main(sys.argv[1:]))\n")
    p = subprocess.run([sys.executable, "-c", code, "plot", str(COMMITTED), "--out", str(tmp_path / "x.png")],
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    _assert_one_line_error(p.stderr, "needs matplotlib, which is not installed")


# ---------------------------------------------------------------------------------------
# Forward files (benchmarks/bench_fwd.py): forward and forward + backward drawn apart
# ---------------------------------------------------------------------------------------
#: A committed bench_fwd.py file written before it recorded a kind.
COMMITTED_FWD = COMMITTED.parent / "2026-11-30-NVIDIA-H200-fwd-fa3-fa4-a0464c6.json"


def test_fwd_kind_is_inferred_from_the_modes():
    payload = json.loads(COMMITTED_FWD.read_text())
    assert "kind" not in payload and "kind" not in payload["meta"]
    res = plot.parse_results(payload, "fwd.json")
    assert res.kind == "fwd" and res.parts() == ["fwd", "fwd+bwd"]
    assert res.part_of("dash_fwd_op") == res.part_of("torch_cudnn_fwd") == "fwd"
    assert res.part_of("dash_det_fwdbwd") == res.part_of("torch_cudnn_fwdbwd") == "fwd+bwd"
    assert len(res.panels()) == 8
    for row in res.rows:  # no row mixes the two passes' TFLOP/s
        assert len({res.part_of(m) for m in row.tflops}) == 1
    assert plot.anchors_for(res, "fa3_fwd") == {"fwd": "fa3_fwd", "fwd+bwd": "torch_cudnn_fwdbwd"}
    payload["meta"]["kind"] = "fwd"  # what bench_fwd.py writes now
    assert plot.parse_results(payload, "fwd.json").parts() == ["fwd", "fwd+bwd"]
    assert plot.load_results(str(COMMITTED)).parts() == ["bwd"]  # backward files are one pass


@needs_matplotlib
def test_plot_fwd_results(tmp_path, capsys):
    out = tmp_path / "fwd.png"
    stdout = _plot_png(COMMITTED_FWD, out, capsys)
    assert stdout == f"wrote {out} (8 panels, 14 modes, ratios to torch_cudnn_fwd, torch_cudnn_fwdbwd)\n"
    res = plot.load_results(str(COMMITTED_FWD))
    fig = plot.draw(res, list(res.modes), {p: plot.default_anchor(res, p) for p in res.parts()})
    title = fig._suptitle.get_text()
    assert title.startswith("NVIDIA H200: attention forward and forward + backward, commit a0464c6")
    assert "ratios to torch_cudnn_fwd / torch_cudnn_fwdbwd" in title
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 16  # 4 panels x (TFLOP/s, ratio) x 2 passes
    ylabels = [ax.get_ylabel() for ax in axes if ax.get_ylabel()]
    assert ylabels == ["forward TFLOP/s", "ratio to torch_cudnn_fwd\n(TFLOP/s, same run)",
                       "forward + backward TFLOP/s", "ratio to torch_cudnn_fwdbwd\n(TFLOP/s, same run)"]
    tput = [ax for ax in axes if ax.get_title()]
    assert [ax.get_title() for ax in tput] == [f"{p}: hdim {d}, {m}" for p in ("forward", "forward + backward")
                                               for d in (64, 128) for m in ("full", "causal")]
    for ax in tput:
        names = {line.get_label().split(":")[0].split(" ")[0] for line in ax.get_lines()}
        fwdbwd = {n for n in names if n.endswith("_fwdbwd")}
        assert fwdbwd == (names if ax.get_title().startswith("forward + backward") else set()), ax.get_title()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(lb.startswith("dash_fwd: ") and "x torch_cudnn_fwd (" in lb for lb in labels)
    assert any(lb.startswith("dash_det_fwdbwd: ") and "x torch_cudnn_fwdbwd (" in lb for lb in labels)


@needs_matplotlib
def test_plot_fwd_modes_of_one_pass(tmp_path, capsys):
    out = tmp_path / "fwd.png"
    rc, stdout, err = _main(["plot", str(COMMITTED_FWD), "--out", str(out), "--modes", "dash_fwd,torch_cudnn_fwd"],
                            capsys)
    assert rc == 0 and err == ""
    assert stdout == f"wrote {out} (4 panels, 2 modes, ratios to torch_cudnn_fwd)\n"
    res = plot.load_results(str(COMMITTED_FWD))
    fig = plot.draw(res, ["dash_fwd", "torch_cudnn_fwd"], "torch_cudnn_fwd")
    assert "attention forward, commit" in fig._suptitle.get_text()
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 8
