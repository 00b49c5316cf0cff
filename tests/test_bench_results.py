"""Results files of the benchmarks, on the CPU: ``python -m dash bench`` writes one (GPU faked),
a second run never replaces the first, the file names the code that produced it, scripts that
need a GPU refuse in one line, and benchmarks/readme_table.py copes with a row missing a mode."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from dash import _bench, bench
from dash.cli import main as cli_main

#: The checkout under test (benchmarks/ and tools/ live beside dash/ there, not in a wheel).
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
needs_checkout = pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(), reason="not a source checkout")


def _sm90_usable() -> bool:
    return _bench._gpu_ok()[0]


# ---------------------------------------------------------------------------------------
# File names: never overwrite
# ---------------------------------------------------------------------------------------
def test_results_path_adds_a_number_instead_of_replacing(tmp_path):
    first = _bench.results_path(tmp_path, "NVIDIA H200", "2026-12-01T10:00:00+00:00", "bwd")
    assert first == tmp_path / "2026-12-01-NVIDIA-H200-bwd.json"
    first.write_text("{}")
    second = _bench.results_path(tmp_path, "NVIDIA H200", "2026-12-01T11:00:00+00:00", "bwd")
    assert second.name == "2026-12-01-NVIDIA-H200-bwd-2.json"
    second.write_text("{}")
    assert _bench.results_path(tmp_path, "NVIDIA H200", "2026-12-01", "bwd").name == "2026-12-01-NVIDIA-H200-bwd-3.json"
    assert _bench.results_path(tmp_path, "a/b (c)", "2026-12-01", "bwd").name == "2026-12-01-a-b-c-bwd.json"


def test_write_results_keeps_an_earlier_run_of_the_same_day(tmp_path):
    """A subset run the same day used to overwrite the full grid's file."""
    env = {"device": "NVIDIA H200", "date": "2026-12-01T10:00:00+00:00"}
    full = bench.write_results({"environment": env, "rows": ["full grid"]}, tmp_path / "out", "bwd")
    subset = bench.write_results({"environment": env, "rows": ["subset"]}, tmp_path / "out", "bwd")
    assert full.name == "2026-12-01-NVIDIA-H200-bwd.json" and subset.name == "2026-12-01-NVIDIA-H200-bwd-2.json"
    assert json.loads(full.read_text())["rows"] == ["full grid"]
    assert json.loads(subset.read_text())["rows"] == ["subset"]


# ---------------------------------------------------------------------------------------
# The code behind a results file
# ---------------------------------------------------------------------------------------
def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_code_identity_says_dirty_and_digests_the_code(tmp_path):
    repo = tmp_path / "repo"
    (repo / "dash" / "sub").mkdir(parents=True)
    (repo / "benchmarks").mkdir()
    (repo / "dash" / "a.py").write_text("A = 1\n")
    (repo / "dash" / "sub" / "b.py").write_text("B = 1\n")
    (repo / "benchmarks" / "bench.py").write_text("C = 1\n")
    (repo / "README.md").write_text("readme\n")
    outside = _bench.code_identity(repo)
    assert outside["checkout_describe"] is None  # not a git work tree yet
    assert len(outside["code_sha256"]) == 16 and "(3 files)" in outside["code_sha256_of"]

    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "init")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    clean = _bench.code_identity(repo)
    assert clean["checkout_describe"] == head
    assert clean["code_sha256"] == outside["code_sha256"]  # the bytes, not the git state

    (repo / "README.md").write_text("edited\n")  # not code: dirty, same digest
    readme = _bench.code_identity(repo)
    assert readme["checkout_describe"] == f"{head}-dirty" and readme["code_sha256"] == clean["code_sha256"]
    _git(repo, "checkout", "README.md")

    (repo / "dash" / "sub" / "b.py").write_text("B = 2\n")
    edited = _bench.code_identity(repo)
    assert edited["checkout_describe"] == f"{head}-dirty" and edited["code_sha256"] != clean["code_sha256"]
    _git(repo, "checkout", "dash")

    (repo / "benchmarks" / "new.py").write_text("D = 1\n")  # untracked: describe cannot see it, the digest does
    untracked = _bench.code_identity(repo)
    assert untracked["checkout_describe"] == head and untracked["code_sha256"] != clean["code_sha256"]

    # A folder inside someone else's work tree is not "the checkout".
    assert _bench.code_identity(repo / "dash")["checkout_describe"] is None


def test_environment_records_the_code(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, major=9, minor=0))
    env = bench.environment()
    assert env["device"] == "NVIDIA H200"
    assert {"commit", "checkout_head", "checkout_describe", "code_sha256", "code_sha256_of"} <= set(env)
    assert env["code_sha256"] == _bench.code_identity()["code_sha256"]
    assert env["round_orders"] == "williams"  # which timer ordering produced the file
    assert "anchors" in env  # FA3 / FA4 identities when they were imported ({} here)


def test_round_coverage_counts_what_a_run_got():
    """A run shorter than a cycle of round_orders is recorded as such (ordered neighbour pairs
    and round openers seen); whole cycles see every pair."""
    short = bench.round_coverage(14, 12)
    assert short["whole_cycles"] == 0 and short["modes_opening_a_round"] == 12
    assert short["neighbour_pairs_seen"] < short["neighbour_pairs"] == 14 * 13
    for n, rounds in ((14, 14), (15, 30), (7, 28)):
        full = bench.round_coverage(n, rounds)
        assert full["neighbour_pairs_seen"] == full["neighbour_pairs"] == n * (n - 1), (n, rounds)
        assert full["modes_opening_a_round"] == n and full["whole_cycles"] == rounds // full["orders_per_cycle"]


def test_warmup_builds_every_input_sets_state_before_timing(monkeypatch):
    """A mode's per-set state (a user-path forward graph) is built in an untimed pass over all
    sets, so that no timed burst pays for it even with fewer warm-ups than sets."""
    built_when = {}
    timing = []
    _fake_cuda_timing(monkeypatch, on_record=lambda: timing.append(True))

    def fn(s):
        if "graph" not in s:
            s["graph"] = True
            built_when[s["i"]] = len(timing)

    sets = [{"i": i} for i in range(3)]
    bench.cuda_time_ms_interleaved({"user": fn}, sets, warmup=0, iters=4, burst=3)
    assert built_when == {0: 0, 1: 0, 2: 0}


# ---------------------------------------------------------------------------------------
# python -m dash bench writes a results file
# ---------------------------------------------------------------------------------------
def _fake_gpu(monkeypatch) -> list:
    """An sm_90 GPU as far as ``python -m dash bench`` can tell, and timings from a stand-in."""
    monkeypatch.setattr(_bench, "_gpu_ok", lambda: (True, ""))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, major=9, minor=0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    modes = ["dash_nondet", "dash_auto_det", "dash_fa3_det", "torch_cudnn"]
    monkeypatch.setattr(bench, "available_modes", lambda: {m: None for m in modes})
    calls = []

    def run_rows(shapes, modes, **kw):
        calls.append((shapes, modes, kw))
        ms = {"dash_nondet": 1.0, "dash_auto_det": 1.1, "dash_fa3_det": 1.2, "torch_cudnn": 1.3}
        return [bench.Row(shapes[0], ms, {"dash_auto_det": True, "dash_fa3_det": True})]

    monkeypatch.setattr(bench, "run_rows", run_rows)
    return calls


def test_dash_bench_writes_a_results_file(tmp_path, monkeypatch, capsys):
    calls = _fake_gpu(monkeypatch)
    out = tmp_path / "results"
    assert cli_main(["bench", "--seqlen", "2048", "--out-dir", str(out)]) == 0
    stdout = capsys.readouterr().out
    (path,) = out.iterdir()
    assert path.name.endswith("-NVIDIA-H200-dash-bench.json") and f"wrote {path}" in stdout
    payload = json.loads(path.read_text())
    assert payload["meta"]["kind"] == "bwd" and payload["meta"]["command"] == "python -m dash bench"
    assert payload["meta"]["options"]["seqlen"] == 2048 and payload["meta"]["iters"] == 12
    assert payload["environment"]["device"] == "NVIDIA H200" and payload["environment"]["code_sha256"]
    (row,) = payload["rows"]
    assert row["shape"]["seqlen"] == 2048 and row["shape"]["batch"] == 8
    assert row["ms"]["dash_auto_det"] == 1.1 and row["bitwise_repeatable"]["dash_auto_det"] is True
    assert payload["summary"]["dash_nondet"]["geomean_vs_torch_cudnn"] == pytest.approx(1.3)
    assert calls[0][1] == ["dash_nondet", "dash_auto_det", "dash_fa3_det", "torch_cudnn"]
    # A second run the same day keeps the first file.
    assert cli_main(["bench", "--out-dir", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {path.name, path.name.replace(".json", "-2.json")}
    assert json.loads(path.read_text()) == payload


def test_dash_bench_out_dir_that_is_a_file(tmp_path, monkeypatch, capsys):
    calls = _fake_gpu(monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli_main(["bench", "--out-dir", str(blocker / "results")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --out-dir" in err and f"{blocker} is not a folder" in err
    assert not calls  # refused before any timing


def test_dash_bench_default_folder(monkeypatch):
    if _bench.checkout_root() is not None:
        assert _bench.default_results_dir() == _bench.checkout_root() / "benchmarks" / "results"
    monkeypatch.setattr(_bench, "checkout_root", lambda: None)  # an installed package
    assert _bench.default_results_dir() == Path("dash-bench-results")


def test_dash_bench_model_fallback_writes_nothing(tmp_path, capsys):
    if _sm90_usable():
        pytest.skip("an sm_90 GPU with DASH's kernels is present: bench times the real kernels")
    out = tmp_path / "results"
    assert cli_main(["bench", "--out-dir", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "running the scheduling model" in stdout and "no results file is written" in stdout
    assert not out.exists()


# ---------------------------------------------------------------------------------------
# Scripts that need a GPU refuse in one line
# ---------------------------------------------------------------------------------------
GPU_SCRIPTS = ["benchmarks/bench_bwd.py", "tools/smoke_bwd.py", "tools/smoke_fwd.py", "tools/sanitize_bwd.py",
               "tools/sanitize_fwd.py", "tools/profile_bwd.py", "tools/ab_time.py", "tools/bwd_kernel_breakdown.py",
               "tools/trace_step_periods.py", "tools/fwd_clock_sample.py", "tools/fwd_clock_reasons.py"]


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


@needs_checkout
@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_gpu_scripts_refuse_without_a_gpu(script, tmp_path):
    if _sm90_usable():
        pytest.skip("an sm_90 GPU with DASH's kernels is present: the script would run")
    args = ("--out-dir", str(tmp_path / "out")) if script.endswith("bench_bwd.py") else ()
    p = _run(script, *args, cwd=tmp_path)
    name = Path(script).name
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"{name}: error: needs an sm_90 GPU"), p.stderr
    assert not (tmp_path / "out").exists()


@needs_checkout
@pytest.mark.parametrize("script, args, option", [
    ("benchmarks/bench_bwd.py", ("--seqlen", "0"), "--seqlen"),
    ("benchmarks/bench_bwd.py", ("--seqlen", "512", "0"), "--seqlen"),
    ("benchmarks/bench_bwd.py", ("--hdim", "96"), "--hdim"),
    ("benchmarks/bench_bwd.py", ("--iters", "0"), "--iters"),
    ("tools/profile_bwd.py", ("--seqlen", "0"), "--seqlen"),
    ("tools/bwd_kernel_breakdown.py", ("--hdim", "96"), "--hdim"),
    ("tools/bwd_kernel_breakdown.py", ("--calls", "0"), "--calls"),
    ("tools/bwd_kernel_breakdown.py", ("--clock-seconds", "-1"), "--clock-seconds"),
    ("tools/trace_step_periods.py", ("--seqlen", "0"), "--seqlen"),
    ("tools/fwd_clock_sample.py", ("--hdim", "96"), "--hdim"),
    ("tools/fwd_clock_sample.py", ("--rounds", "0"), "--rounds"),
    ("tools/ab_time.py", ("--sustained", "-1"), "--sustained"),
    ("tools/fwd_clock_reasons.py", ("--hdim", "96"), "--hdim"),
    ("tools/trace_step_periods.py", ("--schedule", "zigzag"), "--schedule"),
])
def test_bad_sizes_are_argument_errors(script, args, option, tmp_path):
    """--seqlen 0 divided by zero in Shape.paper; now argparse refuses it, before the GPU check."""
    p = _run(script, *args, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert f"error: argument {option}" in p.stderr


# ---------------------------------------------------------------------------------------
# benchmarks/readme_table.py: a row missing a mode
# ---------------------------------------------------------------------------------------
def _readme_table():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_checkout
def test_readme_table_with_a_row_missing_modes(tmp_path):
    src = RESULTS / "2026-11-30-NVIDIA-H200-bwd-fa3-fa4-ebf9e4a.json"
    rt = _readme_table()
    full = rt.table(src).splitlines()
    payload = json.loads(src.read_text())
    rows = payload["rows"]
    del rows[0]["tflops"]["fa3_det"], rows[0]["ms"]["fa3_det"]  # FA3 det failed on row 0
    del rows[1]["tflops"]["fa3_det"], rows[1]["tflops"]["fa4_det"]  # no det anchor on row 1
    del rows[2]["tflops"]["torch_cudnn"]  # no anchor for the vs-cuDNN geomean
    del rows[3]["tflops"]["dash_nondet"]
    path = tmp_path / "missing.json"
    path.write_text(json.dumps(payload))
    lines = rt.table(path).splitlines()
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    col = {h: i for i, h in enumerate(header)}
    assert cells[0][col["FA3 det"]] == "–" and cells[0][col["det(auto) / FA3 or FA4 det"]] != "–"
    t0 = rows[0]["tflops"]
    assert float(cells[0][col["det(auto) / FA3 or FA4 det"]]) == pytest.approx(
        t0["dash_auto_det"] / t0["fa4_det"], abs=0.006)  # the faster of those present
    assert cells[1][col["det(auto) / FA3 or FA4 det"]] == "–"
    assert cells[2][col["torch cuDNN"]] == "–" and cells[3][col["det(auto) / non-det"]] == "–"
    assert lines[6:-1] == full[6:-1]  # rows with every mode are as before
    # Geomeans over the rows that have both modes.
    geo = cells[-1]
    vals = [r["tflops"]["fa3_det"] / r["tflops"]["torch_cudnn"] for r in rows
            if "fa3_det" in r["tflops"] and "torch_cudnn" in r["tflops"]]
    assert geo[col["FA3 det"]] == f"{rt.geomean(vals):.2f}×"
    vals = [r["tflops"]["dash_auto_det"] / r["tflops"]["dash_nondet"] for r in rows if "dash_nondet" in r["tflops"]]
    assert geo[col["det(auto) / non-det"]] == f"{rt.geomean(vals):.3f}"


@needs_checkout
def test_readme_table_without_a_mode_anywhere_shows_a_dash(tmp_path):
    payload = json.loads((RESULTS / "2026-11-30-NVIDIA-H200-bwd-fa3-fa4-ebf9e4a.json").read_text())
    for r in payload["rows"]:
        r["tflops"].pop("dash_fa3_det")
    path = tmp_path / "no-fa3-order.json"
    path.write_text(json.dumps(payload))
    last = _readme_table().table(path).splitlines()[-1]
    assert last.split("|")[-3].strip() == "–"  # det(auto) / det(fa3 order): no row has it


def test_modes_not_defined_for_a_shape_are_skipped_not_errors():
    """The shift schedule exists for full masks only: on a causal row the benchmark leaves its
    column empty ("-") instead of running it into DASH's NotImplementedError and printing
    "err" (which it keeps for modes that failed)."""
    from dash.bench import Row, Shape, format_row, mode_applies

    full, causal = Shape.paper(2048, 128, False), Shape.paper(2048, 128, True)
    assert mode_applies("dash_shift_det", full) and not mode_applies("dash_shift_det", causal)
    assert all(mode_applies(m, causal) for m in ("dash_auto_det", "dash_fa3_det", "torch_cudnn"))
    row = Row(causal)
    row.ms = {"torch_cudnn": 1.0, "dash_auto_det": 0.8}
    row.errors = {"fa4_det": "ImportError: no"}
    cells = format_row(row, ["dash_auto_det", "dash_shift_det", "fa4_det", "torch_cudnn"]).split()
    assert cells[-6:] == [cells[-6], "1.25x", "-", "err", cells[-2], "1.00x"], cells


def test_nondeterministic_per_schedule_modes_are_opt_in():
    """The non-deterministic column per schedule exists (for choosing non-deterministic auto's
    rule) but a default run leaves it out, and shift's is undefined under a causal mask."""
    from dash import bench
    from dash.config import KERNEL_SCHEDULES

    names = bench.available_modes()
    assert {f"dash_nondet_{s}" for s in KERNEL_SCHEDULES if s != "fa3"} == set(bench.OPT_IN_MODES) <= set(names)
    default = bench.default_modes()
    assert not set(default) & bench.OPT_IN_MODES
    assert {"dash_nondet", "dash_nondet_fa3", "dash_auto_det", "torch_cudnn"} <= set(default)
    causal = bench.Shape.paper(2048, 64, True)
    assert not bench.mode_applies("dash_nondet_shift", causal) and bench.mode_applies("dash_nondet_descending", causal)


@pytest.mark.parametrize("n", range(1, 14))
def test_round_orders_balance_first_places_and_neighbours(n):
    """Every round order is a permutation; over one cycle every mode opens a round equally often
    and directly follows every other mode equally often (a burst's clock depends on the power
    its predecessor drew; the cyclic rotation kept one predecessor per mode)."""
    from collections import Counter

    orders = bench.round_orders(n)
    assert len(orders) == (2 * n if n % 2 and n > 1 else n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    firsts = Counter(order[0] for order in orders)
    assert set(firsts) == set(range(n)) and len(set(firsts.values())) == 1
    follows = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert len(follows) == n * (n - 1)  # every ordered pair of distinct modes
    assert len(set(follows.values())) <= 1


def _fake_cuda_timing(monkeypatch, on_record=lambda: None) -> None:
    """cuda_time_ms_interleaved's CUDA calls replaced by stand-ins (no GPU): every event pair
    measures 1 ms, ``on_record`` runs at each event record."""

    class Event:
        def __init__(self, **_):
            pass

        def record(self):
            on_record()

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    monkeypatch.setattr(bench.torch.cuda, "Event", Event)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench.torch.cuda, "_sleep", lambda cycles: None)


def test_interleaved_timer_runs_each_mode_once_per_round_in_round_orders(monkeypatch):
    """cuda_time_ms_interleaved's rounds follow round_orders (checked without a GPU: the CUDA
    calls are replaced by stand-ins that record the order of the calls)."""
    calls = []
    _fake_cuda_timing(monkeypatch)
    names = ["a", "b", "c", "d", "e"]
    fns = {name: (lambda s, name=name: calls.append(name)) for name in names}
    warmup, iters, burst = 2, 13, 3  # 13 rounds: past the 10 orders of a cycle, so it wraps around
    ms = bench.cuda_time_ms_interleaved(fns, [{}], warmup, iters, burst=burst)
    assert ms == {name: 1.0 / burst for name in names}
    timed = calls[(1 + warmup) * len(names):]  # each mode once per input set (one), then its warm-ups
    rounds = [timed[i:i + burst * len(names)][::burst] for i in range(0, len(timed), burst * len(names))]
    orders = bench.round_orders(len(names))
    assert rounds == [[names[j] for j in orders[i % len(orders)]] for i in range(iters)]

    # A mode that starts raising is dropped (its samples too); the others keep their places in the
    # later orders.
    calls.clear()
    errors: dict = {}

    def flaky(s, seen=[]):
        seen.append(1)
        if len(seen) > 3 + 2 * burst:  # the set pass, the warm-ups and two rounds' bursts succeed
            raise RuntimeError("out of memory")
        calls.append("c")

    fns["c"] = flaky
    ms = bench.cuda_time_ms_interleaved(fns, [{}], warmup, iters, errors=errors, burst=burst)
    assert set(ms) == set(names) - {"c"} and errors == {"c": "RuntimeError: out of memory"}
    timed = calls[(1 + warmup) * len(names):]
    expected = []
    for i in range(iters):
        expected += [n for n in (names[j] for j in orders[i % len(orders)]) if n != "c" or i < 2]
    assert [timed[i] for i in range(0, len(timed), burst)] == expected


@needs_checkout
@pytest.mark.parametrize("flag, name", [
    ("", "2026-12-06-NVIDIA-H100-80GB-HBM3-bwd-fa3-fa4-eac6de6.json"),
    ("", "2026-12-04-NVIDIA-H200-bwd-user-fa3-fa4-dq2-641ef6f.json"),
    ("--fwd", "2026-12-05-NVIDIA-H200-fwd-fa3-fa4-dd9c262.json"),
    ("--e2e", "2026-12-01-NVIDIA-H200-e2e-c75b47a.json"),
])
def test_readme_tables_are_the_generated_ones(flag, name):
    """Each performance table in README.md is readme_table.py's output for the results file it
    cites, verbatim: a hand-edited or stale table fails here."""
    rt = _readme_table()
    make = {"": rt.table, "--fwd": rt.fwd_table, "--e2e": rt.e2e_table}[flag]
    readme = (ROOT / "README.md").read_text()
    assert name in readme, f"README.md no longer cites {name}: update this test's list"
    assert make(RESULTS / name) in readme, f"README.md's table from {name} differs from readme_table.py {flag}"
