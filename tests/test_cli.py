"""``python -m dash info | bench | simulate`` run as subprocesses, and the ``dash.config`` table.

The CLI tests run the real entry point (``sys.executable -m dash ...`` with ``PYTHONPATH`` set to
the repository root). Expectations about the GPU line and ``bench`` follow what this process
sees: on a machine without an sm_90 GPU, ``info`` reports none and ``bench`` falls back to the
scheduling model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dash
from dash import config as C
from dash.schedules.orders import SCHEDULE_NAMES

#: Folder holding the dash package under test (the repository root when run with PYTHONPATH set to
#: it); every subprocess gets it as PYTHONPATH, so it runs the same dash as this process.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dash.__file__)))


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT)


def _dash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dash", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _sm90_usable() -> bool:
    """What ``bench`` itself checks: an sm_90 GPU and loadable kernels."""
    if not _cuda_visible():
        return False
    import torch

    from dash._ext import kernels_available

    return torch.cuda.get_device_capability(0) == (9, 0) and kernels_available()


# ---------------------------------------------------------------------------------------
# The package parses on this interpreter (setup.py: python_requires >= 3.10)
# ---------------------------------------------------------------------------------------
def test_every_dash_module_compiles_on_this_python():
    bad = []
    for path in sorted(Path(dash.__file__).parent.rglob("*.py")):
        try:
            compile(path.read_text(), str(path), "exec")
        except SyntaxError as e:
            bad.append(f"{path.relative_to(ROOT)}:{e.lineno}: {e.msg}")
    assert not bad, f"SyntaxError on Python {sys.version.split()[0]}: " + "; ".join(bad)


# ---------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------
def test_info_text():
    from dash._ext import kernels_status, manifest

    p = _dash("info")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == f"DASH {dash.__version__}"
    kernels = [ln for ln in lines if re.match(r"^\s+kernels\s+: ", ln)]
    assert len(kernels) == 1
    info = manifest()
    if info.get("kernels_built"):
        assert re.search(r": built for \S+, head dims \[[\d, ]+\], dtypes ", kernels[0]), kernels[0]
        loaded = [ln for ln in lines if re.match(r"^\s+loaded\s+: ", ln)]
        assert len(loaded) == 1
        ok, why_not = kernels_status()
        assert loaded[0].split(": ", 1)[1] == ("yes" if ok else f"NO ({why_not})")
    else:
        m = re.search(r": NOT built: (.+)$", kernels[0])
        assert m and m.group(1).strip() not in ("", "None"), kernels[0]
    gpu = [ln for ln in lines if re.match(r"^\s+GPU\s+: ", ln)]
    assert len(gpu) == 1
    if not _cuda_visible():
        m = re.search(r": none \((.+)\)$", gpu[0])
        assert m and m.group(1).strip(), gpu[0]
    else:
        assert "compute capability" in gpu[0]


def test_info_json():
    from dash._ext import kernels_available, manifest

    p = _dash("info", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)  # stdout is JSON and nothing else
    assert {"version", "build", "kernels_loaded", "gpu"} <= set(data)
    assert data["version"] == dash.__version__
    assert data["build"] == json.loads(json.dumps(manifest()))
    assert isinstance(data["kernels_loaded"], bool)
    assert data["kernels_loaded"] == bool(manifest().get("kernels_built") and kernels_available())
    assert isinstance(data["gpu"]["present"], bool)
    if not _cuda_visible():
        assert data["gpu"]["present"] is False
        assert isinstance(data["gpu"]["reason"], str) and data["gpu"]["reason"]
    else:
        assert data["gpu"]["present"] is True
        assert re.fullmatch(r"\d+\.\d+", data["gpu"]["compute_capability"])


def test_info_without_build_manifest():
    """An install without setup.py's manifest reports "NOT built" with the reason, in both forms."""
    code = (
        "import io, json, contextlib\n"
        "from pathlib import Path\n"
        "import dash._ext as e\n"
        "e._MANIFEST_PATH = Path('/nonexistent/dash_manifest.json')\n"
        "e._MANIFEST = e._read_manifest()\n"
        "from dash.cli import main\n"
        "out = {}\n"
        "for argv in (['info'], ['info', '--json']):\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        rc = main(argv)\n"
        "    out[' '.join(argv)] = [rc, buf.getvalue()]\n"
        "print(json.dumps(out))\n"
    )
    p = _python(code)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    rc, text = res["info"]
    assert rc == 0
    # Run from the checkout, the reason names the checkout and the fix (the build command).
    assert re.search(r"kernels\s+: NOT built: .*(no build manifest|holds no kernels).*pip install", text), text
    rc, js = res["info --json"]
    data = json.loads(js)
    assert rc == 0 and data["build"]["kernels_built"] is False and data["kernels_loaded"] is False
    assert re.search(r"no build manifest|holds no kernels", data["build"]["reason_not_built"])


# ---------------------------------------------------------------------------------------
# bench (CPU-only fallback: the scheduling model)
# ---------------------------------------------------------------------------------------
def _model_table(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    header = [i for i, ln in enumerate(lines) if ln.startswith("schedule ") and "makespan" in ln]
    assert len(header) == 1, stdout
    rows = {}
    for ln in lines[header[0] + 1:]:
        if ln.strip():
            rows[ln.split()[0]] = ln.split()
    return rows


def test_bench_without_gpu_runs_the_model():
    if _sm90_usable():
        pytest.skip("an sm_90 GPU with DASH's kernels is present: bench times the real kernels")
    p = _dash("bench")
    assert p.returncode == 0, p.stderr
    assert "No usable sm_90 GPU here" in p.stdout
    assert "running the scheduling model" in p.stdout
    # The defaults (seqlen 4096, hdim 128, causal, 16k tokens, hidden 2048) reach the model.
    model_line = [ln for ln in p.stdout.splitlines() if ln.startswith("DASH scheduling model:")]
    assert len(model_line) == 1
    assert "batch 4 x heads 16" in model_line[0] and "seqlen q 4096" in model_line[0]
    assert "hdim 128" in model_line[0] and "causal" in model_line[0]
    assert any(ln.startswith("fa3 ") for ln in p.stdout.splitlines())
    rows = _model_table(p.stdout)
    assert list(rows) == list(SCHEDULE_NAMES)
    for name, cols in rows.items():
        assert float(cols[1]) > 0 and cols[5] == "yes", (name, cols)


def test_bench_without_gpu_forwards_the_shape():
    if _sm90_usable():
        pytest.skip("an sm_90 GPU with DASH's kernels is present")
    p = _dash("bench", "--seqlen", "2048", "--hdim", "64", "--no-causal")
    assert p.returncode == 0, p.stderr
    model_line = [ln for ln in p.stdout.splitlines() if ln.startswith("DASH scheduling model:")][0]
    assert "batch 8 x heads 32" in model_line and "seqlen q 2048" in model_line and "hdim 64" in model_line
    assert "causal" not in model_line
    assert set(_model_table(p.stdout)) == set(SCHEDULE_NAMES)


# ---------------------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------------------
def test_simulate_json_all_schedules():
    p = _dash("simulate", "--seqlen", "1024", "--hdim", "64", "--schedule", "all", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)  # the whole of stdout is one JSON document
    sch = data["schedules"]
    assert list(sch) == list(SCHEDULE_NAMES) and len(sch) >= 5
    for name, rec in sch.items():
        assert rec["deadlock_free"] is True, name
        assert rec["makespan"] >= rec["lower_bound"] - 1e-9 > 0, name
    assert "seqlen q 1024" in data["problem"] and "hdim 64" in data["problem"]
    assert data["ctas"] == 132


def test_simulate_does_not_import_torch():
    code = (
        "import io, json, sys, contextlib\n"
        "from dash.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    rc = main(['simulate', '--seqlen', '512', '--hdim', '128', '--causal', '--json'])\n"
        "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, 'n': len(json.loads(buf.getvalue())['schedules'])}))\n"
    )
    p = _python(code)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"rc": 0, "torch": False, "n": len(SCHEDULE_NAMES)}


@pytest.mark.parametrize("hdim", ["80", "256"])
def test_simulate_bad_hdim(hdim):
    p = _dash("simulate", "--seqlen", "1024", "--hdim", hdim)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    assert f"head_dim={hdim}" in p.stderr and "not supported" in p.stderr and "64, 128" in p.stderr
    assert p.stdout == ""


def test_simulate_unknown_schedule():
    p = _dash("simulate", "--seqlen", "1024", "--hdim", "64", "--schedule", "bogus")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and "'bogus'" in p.stderr
    for name in SCHEDULE_NAMES:
        assert name in p.stderr


def test_no_command_is_a_usage_error():
    p = _dash()
    assert p.returncode == 2
    assert "usage:" in p.stderr and "info" in p.stderr and "simulate" in p.stderr
    _assert_one_line(p.stderr)


# ---------------------------------------------------------------------------------------
# Bad input: one line on stderr naming the argument and the value, exit code 2, no traceback
# ---------------------------------------------------------------------------------------
def _assert_one_line(err: str) -> None:
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, f"expected one line on stderr, got:\n{err}"


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    """``dash.cli.main`` in this process: (exit status, stdout, stderr)."""
    from dash.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _dash_in(cwd: Path, *args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """``python -m dash ARGS`` (or ``python -c CODE``) run from ``cwd``, away from the repository."""
    argv = ["-c", code] if code is not None else ["-m", "dash", *args]
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["simulate", "bench"])
def test_zero_seqlen_is_one_line_subprocess(command, tmp_path):
    """Was a ZeroDivisionError traceback; now argparse's one line, before anything runs."""
    args = [command, "--seqlen", "0"] + (["--hdim", "64"] if command == "simulate" else [])
    p = _dash_in(tmp_path, *args)
    assert p.returncode == 2 and p.stdout == ""
    _assert_one_line(p.stderr)
    assert f"python -m dash {command}: error: argument --seqlen: 0 is not a positive integer" in p.stderr


_SIM = ["simulate", "--seqlen", "1024", "--hdim", "64"]


@pytest.mark.parametrize("argv, option, value", [
    (["simulate", "--seqlen", "0", "--hdim", "64"], "--seqlen", "0"),
    (["simulate", "--seqlen", "-5", "--hdim", "64"], "--seqlen", "-5"),
    (["simulate", "--seqlen", "4k", "--hdim", "64"], "--seqlen", "4k"),
    (_SIM + ["--seqlen-k", "0"], "--seqlen-k", "0"),
    (["simulate", "--seqlen", "1024", "--hdim", "0"], "--hdim", "0"),
    (_SIM + ["--batch", "0"], "--batch", "0"),
    (_SIM + ["--heads", "0"], "--heads", "0"),
    (_SIM + ["--heads-kv", "0"], "--heads-kv", "0"),
    (_SIM + ["--block-m", "0"], "--block-m", "0"),
    (_SIM + ["--block-n", "-64"], "--block-n", "-64"),
    (_SIM + ["--ctas", "0"], "--ctas", "0"),
    (_SIM + ["--pipeline-depth", "-1"], "--pipeline-depth", "-1"),
    (_SIM + ["--gantt-ctas", "0"], "--gantt-ctas", "0"),
    (_SIM + ["--c", "-1"], "--c", "-1"),
    (_SIM + ["--r", "nan"], "--r", "nan"),
    (_SIM + ["--window", "-2", "0"], "--window", "-2"),
    (_SIM + ["--varlen-q", "100,-1"], "--varlen-q", "100,-1"),
    (["bench", "--seqlen", "0"], "--seqlen", "0"),
    (["bench", "--hdim", "0"], "--hdim", "0"),
    (["bench", "--batch", "0"], "--batch", "0"),
    (["bench", "--heads", "-1"], "--heads", "-1"),
    (["bench", "--iters", "0"], "--iters", "0"),
    (["bench", "--warmup", "-1"], "--warmup", "-1"),
    (["bench", "--repeats", "1"], "--repeats", "1"),
])
def test_bad_sizes_are_one_line_usage_errors(argv, option, value, capsys):
    rc, out, err = _main(argv, capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    assert f"error: argument {option}: {value} is not " in err, err


@pytest.mark.parametrize("hdim", ["80", "256"])
def test_bench_unsupported_hdim_says_which_are_supported(hdim, capsys):
    rc, out, err = _main(["bench", "--hdim", hdim], capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    dims = ", ".join(map(str, C.SUPPORTED_HEAD_DIMS))
    assert f"argument --hdim: head_dim={hdim} is not supported" in err and f"supported head dims: {dims}" in err


def test_simulate_combinations_are_one_line_errors(capsys):
    cases = [
        (_SIM + ["--heads", "32", "--heads-kv", "3"], "argument --heads-kv: 3 does not divide the 32 query heads"),
        (_SIM + ["--causal", "--window", "16", "8"], "argument --window: right side 8 with --causal"),
        (_SIM + ["--varlen-q", "10,20", "--varlen-k", "10"], "argument --varlen-k: 1 lengths for the 2 of --varlen-q"),
        (_SIM + ["--schedule", ","], "argument --schedule: ',' names no schedule"),
    ]
    for argv, expected in cases:
        rc, out, err = _main(argv, capsys)
        assert rc == 2 and out == "", argv
        _assert_one_line(err)
        assert expected in err, (argv, err)


def test_unknown_command_lists_the_commands(capsys):
    rc, out, err = _main(["simualte"], capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    assert "'simualte'" in err and all(c in err for c in ("info", "bench", "simulate", "plot"))


def test_help_returns_zero_in_process(capsys):
    rc, out, _ = _main(["simulate", "--help"], capsys)
    assert rc == 0 and "--gantt" in out and "--seqlen" in out


def test_costs_file_errors_name_the_file(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    rc, out, err = _main(_SIM + ["--costs", str(missing)], capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    assert f"argument --costs: file {missing} does not exist" in err
    for text in ("not json", '{"c": 1, "bogus": 2}', '{"c": -1}'):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        rc, out, err = _main(_SIM + ["--costs", str(bad)], capsys)
        assert rc == 2 and out == "", text
        _assert_one_line(err)
        assert f"argument --costs: {bad} is not a costs file" in err, err


# --gantt: the path and matplotlib are checked before the model runs (nothing on stdout).
def test_gantt_into_missing_folder_fails_fast(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "no" / "such" / "g.png"
    rc, out, err = _main(_SIM + ["--gantt", str(path)], capsys)
    assert rc == 2 and out == ""  # no table printed before the error
    _assert_one_line(err)
    assert f"argument --gantt: cannot write {path}: folder {path.parent} does not exist" in err
    assert not path.parent.exists()


def test_gantt_into_unwritable_folder_fails_fast(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    # Tests may run as root, for whom chmod does not deny writes: make os.access say no instead.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(tmp_path)
                        else real_access(p, mode, **kw))
    path = tmp_path / "g.png"
    rc, out, err = _main(_SIM + ["--gantt", str(path)], capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    assert f"argument --gantt: cannot write {path}: folder {tmp_path} is not writable" in err


@pytest.mark.parametrize("name, expected", [
    ("", "it is a folder"),
    ("gantt", "has no file extension; use .png"),
    ("gantt.bmp", "matplotlib cannot write .bmp files"),
])
def test_gantt_path_must_be_an_image_file(name, expected, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / name if name else tmp_path
    rc, out, err = _main(_SIM + ["--gantt", str(path)], capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    assert "argument --gantt: " in err and expected in err and str(path) in err


_NO_MATPLOTLIB = (
    "import sys\n"
    "sys.modules['matplotlib'] = None  # what an install without matplotlib looks like to import\n"
    "from dash.cli import main\n"
    "raise SystemExit(main(sys.argv[1:]))\n"
)


def test_gantt_without_matplotlib_subprocess(tmp_path):
    path = tmp_path / "g.png"
    p = subprocess.run([sys.executable, "-c", _NO_MATPLOTLIB, *_SIM, "--gantt", str(path)], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""  # checked before the simulation runs
    _assert_one_line(p.stderr)
    assert ("argument --gantt: needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'dash-attention[plot]')") in p.stderr
    assert not path.exists()


def test_gantt_without_matplotlib_in_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, out, err = _main(_SIM + ["--gantt", str(tmp_path / "g.png")], capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    assert "argument --gantt: needs matplotlib, which is not installed: pip install matplotlib" in err


def test_simulate_without_gantt_does_not_need_matplotlib(tmp_path):
    p = subprocess.run([sys.executable, "-c", _NO_MATPLOTLIB, *_SIM, "--json"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert list(json.loads(p.stdout)["schedules"]) == list(SCHEDULE_NAMES)


# ---------------------------------------------------------------------------------------
# dash.config
# ---------------------------------------------------------------------------------------
def test_supported_head_dims():
    assert C.SUPPORTED_HEAD_DIMS == (64, 128)
    assert C.SUPPORTED_DTYPES == ("bfloat16", "float16")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", C.SUPPORTED_HEAD_DIMS)
def test_bwd_tile_config_supported(head_dim, causal):
    cfg = C.bwd_tile_config(head_dim, causal)
    assert cfg in C.BWD_TILE_CONFIGS
    assert cfg.head_dim == head_dim and cfg.causal is causal
    assert cfg.block_n == 64 * cfg.mma_warpgroups and cfg.block_m % 16 == 0
    assert cfg.dq_transposed == (cfg.block_m % 64 != 0)
    assert not cfg.dq_transposed or cfg.head_dim == 64 * cfg.mma_warpgroups
    assert cfg.num_threads == 128 * (cfg.mma_warpgroups + 1)
    assert cfg.dq_split_rows == (cfg.block_m == 64 * cfg.mma_warpgroups)
    assert min(cfg.q_stages, cfg.do_stages, cfg.ds_stages) >= 1
    assert C.bwd_tile_config(head_dim, int(causal)) is cfg  # truthy ints select the same entry


@pytest.mark.parametrize("head_dim", [0, 32, 80, 96, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_tile_config_unsupported(head_dim, causal):
    with pytest.raises(NotImplementedError) as e:
        C.bwd_tile_config(head_dim, causal)
    msg = str(e.value)
    assert f"head_dim={head_dim}" in msg and "not supported yet" in msg and "64, 128" in msg


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", C.SUPPORTED_HEAD_DIMS)
def test_fwd_tile_config_supported(head_dim, causal):
    cfg = C.fwd_tile_config(head_dim, causal)
    assert cfg in C.FWD_TILE_CONFIGS
    assert cfg.head_dim == head_dim and cfg.causal is causal
    assert cfg.block_m == 64 * cfg.mma_warpgroups
    assert C.fwd_tile_config(head_dim, int(causal)) is cfg


@pytest.mark.parametrize("head_dim", [0, 32, 96, 256])
def test_fwd_tile_config_unsupported(head_dim):
    with pytest.raises(NotImplementedError) as e:
        C.fwd_tile_config(head_dim, True)
    msg = str(e.value)
    assert f"head_dim={head_dim}" in msg and "forward" in msg and "64, 128" in msg


def test_table_covers_each_supported_pair_once():
    keys = [(c.head_dim, c.causal) for c in C.BWD_TILE_CONFIGS]
    assert len(keys) == len(set(keys))
    assert set(keys) == {(d, c) for d in C.SUPPORTED_HEAD_DIMS for c in (False, True)}


def _expected_smem(cfg: C.BwdTileConfig, elem: int = 2) -> int:
    d, m, n = cfg.head_dim, cfg.block_m, cfg.block_n
    return (2 * n * d * elem  # K and V
            + cfg.q_stages * m * d * elem + cfg.do_stages * m * d * elem  # Q, dO stages
            + cfg.ds_stages * m * n * elem  # dS stages
            + cfg.dq_stages * m * d * 4  # fp32 dQ staging tiles
            + (cfg.q_stages + cfg.do_stages) * m * 4)  # LSE and D rows


@pytest.mark.parametrize("cfg", C.BWD_TILE_CONFIGS, ids=lambda c: f"d{c.head_dim}-{'causal' if c.causal else 'full'}")
def test_shared_memory_under_227kb(cfg):
    assert C.H100_SMEM_LIMIT_BYTES == 227 * 1024
    assert cfg.smem_bytes() == _expected_smem(cfg)
    assert cfg.smem_bytes() < 227 * 1024
    assert cfg.smem_bytes() <= C.H100_SMEM_LIMIT_BYTES - 1024  # room left for the barriers


def test_tile_config_invariants_are_enforced():
    with pytest.raises(ValueError, match="block_n=192 must be 64 \\* mma_warpgroups=2"):
        C.BwdTileConfig(64, False, 128, 192, 2, 2, 2, 2)
    with pytest.raises(ValueError, match="block_m=96"):
        C.BwdTileConfig(64, False, 96, 128, 2, 2, 2, 2)
    with pytest.raises(ValueError, match="head_dim=96"):
        C.BwdTileConfig(96, False, 64, 128, 2, 2, 2, 2)
    with pytest.raises(ValueError, match="dq_stages=3 must be 1 or 2"):
        C.BwdTileConfig(64, False, 128, 128, 2, 2, 2, 2, 3)
    with pytest.raises(ValueError, match="dq_chains=3 must be 1, 2 or 4"):
        C.BwdTileConfig(64, False, 128, 128, 2, 2, 2, 2, 1, 3)
    with pytest.raises(ValueError, match="dkv_chains=0 must be 1 ... 8"):
        C.BwdTileConfig(64, False, 128, 128, 2, 2, 2, 2, dkv_chains=0)
    for every in (1, -4):
        with pytest.raises(ValueError, match=f"exp2_fma_every={every} must be 0"):
            C.BwdTileConfig(64, False, 128, 128, 2, 2, 2, 2, 1, 1, every)
    assert C.BwdTileConfig(64, False, 128, 128, 2, 2, 2, 2, 1, 1, 0).exp2_fma_every == 0
    with pytest.raises(ValueError, match="lse_early_nondet needs block_m=64"):
        C.BwdTileConfig(64, False, 128, 128, 2, 2, 2, 2, lse_early_nondet=True)
    with pytest.raises(ValueError, match="lse_early_det needs block_m=64"):
        C.BwdTileConfig(128, False, 80, 128, 2, 2, 2, 2, lse_early_det=True)


@pytest.mark.parametrize("cfg", C.FWD_TILE_CONFIGS, ids=lambda c: f"d{c.head_dim}-{'causal' if c.causal else 'full'}")
def test_forward_shared_memory_counts_every_q_buffer(cfg):
    d, m, n = cfg.head_dim, cfg.block_m, cfg.block_n
    out_slabs = m * d if cfg.tma_store_out else 0  # the TMA-store epilogue's staging slabs
    assert cfg.smem_bytes() == (cfg.q_stages * m * d + 2 * cfg.kv_stages * n * d + out_slabs) * 2
    assert cfg.smem_bytes() <= C.H100_SMEM_LIMIT_BYTES - 1024  # room left for the barriers


def test_forward_tile_config_invariants_are_enforced():
    with pytest.raises(ValueError, match="q_stages=3 is not supported"):
        C.FwdTileConfig(64, False, 192, 128, 3, 2, 160, True, q_stages=3)
    with pytest.raises(ValueError, match="block_m=128 must be 64 \\* mma_warpgroups=3"):
        C.FwdTileConfig(64, False, 128, 128, 3, 2, 160, True)
    one, two = (C.FwdTileConfig(128, False, 128, 128, 2, 2, 240, True, q_stages=q) for q in (1, 2))
    assert two.smem_bytes() - one.smem_bytes() == 128 * 128 * 2
    tma = C.FwdTileConfig(128, False, 128, 128, 2, 2, 240, True, tma_store_out=True)
    assert tma.smem_bytes() - one.smem_bytes() == 128 * 128 * 2
    with pytest.raises(ValueError, match="kv_multicast .* full masks only"):
        C.FwdTileConfig(128, True, 128, 128, 2, 2, 240, True, kv_multicast=True)
    for growth in (-1.0, 12.5, float("nan")):
        with pytest.raises(ValueError, match="rescale_max_growth_log2=.* is not supported \\(0 to 12\\)"):
            C.FwdTileConfig(128, True, 128, 128, 2, 2, 240, True, rescale_max_growth_log2=growth)
    for bound in (-1, 13, 8.0):
        with pytest.raises(ValueError, match="lazy_max_sum_log2=.* is not supported \\(an int, 0 to 12\\)"):
            C.FwdTileConfig(128, True, 128, 128, 2, 2, 240, True, rescale_max_growth_log2=8.0, lazy_max_sum_log2=bound)
    with pytest.raises(ValueError, match="set both"):
        C.FwdTileConfig(128, True, 128, 128, 2, 2, 240, True, lazy_max_sum_log2=12)
    for mib in (0, -12, 1025):
        with pytest.raises(ValueError, match=f"l2_section_mib={mib} is not supported \\(1 to 1024 MiB\\)"):
            C.FwdTileConfig(128, True, 128, 128, 2, 2, 240, True, l2_section_mib=mib)
    # A thread takes block_n / 2 exponentials per block: the P V wait must follow 1 .. block_n / 2 - 1.
    for after in (0, 64, 16.0):
        with pytest.raises(ValueError, match="pv_wait_after_exp2=.* is not supported \\(an int, 1 to 63"):
            C.FwdTileConfig(64, False, 192, 128, 3, 2, 160, True, pv_wait_after_exp2=after)
    assert C.FwdTileConfig(64, False, 192, 128, 3, 2, 160, True, pv_wait_after_exp2=63).pv_wait_after_exp2 == 63
    with pytest.raises(ValueError, match="not with lazy_max_sum_log2"):
        C.FwdTileConfig(64, True, 192, 128, 3, 2, 160, True, rescale_max_growth_log2=8.0, lazy_max_sum_log2=12,
                        pv_wait_after_exp2=16)

def test_forward_kv_multicast_is_rendered_per_row(monkeypatch):
    import dataclasses

    rows = tuple(dataclasses.replace(c, kv_multicast=(c.head_dim, c.causal) == (128, False)) for c in C.FWD_TILE_CONFIGS)
    monkeypatch.setattr(C, "FWD_TILE_CONFIGS", rows)
    header = C.render_cpp_header()
    block = header.split("struct FwdTileConfig<128, false> {", 1)[1].split("};", 1)[0]
    assert "static constexpr bool kKVMulticast = true;" in block
    assert header.count("kKVMulticast = true") == 1 and header.count("kKVMulticast = false") == len(rows) - 1


def test_check_table_rejects_bad_tables():
    good = list(C.BWD_TILE_CONFIGS)
    C._check_table(good)
    with pytest.raises(ValueError, match="duplicate"):
        C._check_table(good + [good[0]])
    with pytest.raises(ValueError, match="no config for head_dim=128 causal=True"):
        C._check_table([c for c in good if (c.head_dim, c.causal) != (128, True)])
    huge = C.BwdTileConfig(128, True, 128, 128, 2, 4, 4, 2)
    assert huge.smem_bytes() > C.H100_SMEM_LIMIT_BYTES
    with pytest.raises(ValueError, match="shared memory"):
        C._check_table([c for c in good if (c.head_dim, c.causal) != (128, True)] + [huge])


_SPEC = re.compile(r"template <> struct BwdTileConfig<(\d+), (true|false)> \{(.*?)\};", re.S)
_FIELD = re.compile(r"static constexpr (?:int|bool|float|long long) (\w+) = ([\w.]+);")


def _cpp(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def test_render_cpp_header_has_every_config():
    text = C.render_cpp_header()
    assert text.startswith("// Generated from dash/config.py") and "#pragma once" in text
    assert text.count("{") == text.count("}")
    specs = {(int(d), c == "true"): dict(_FIELD.findall(body)) for d, c, body in _SPEC.findall(text)}
    assert len(specs) == len(C.BWD_TILE_CONFIGS)
    for cfg in C.BWD_TILE_CONFIGS:
        f = specs[(cfg.head_dim, cfg.causal)]
        assert f == {
            "kHeadDim": _cpp(cfg.head_dim),
            "Is_causal": _cpp(cfg.causal),
            "kBlockM": _cpp(cfg.block_m),
            "kBlockN": _cpp(cfg.block_n),
            "NumMmaWarpGroups": _cpp(cfg.mma_warpgroups),
            "kStagesQ": _cpp(cfg.q_stages),
            "kStagesdO": _cpp(cfg.do_stages),
            "kStagesdS": _cpp(cfg.ds_stages),
            "kStagesdQ": _cpp(cfg.dq_stages),
            "kdQChains": _cpp(cfg.dq_chains),
            "kdKVChains": _cpp(cfg.dkv_chains),
            "kNondetdKVChainsMaxGroup": _cpp(cfg.nondet_dkv_chains_max_group),
            "kExp2FmaEvery": _cpp(cfg.exp2_fma_every),
            "kLseEarlyNondet": _cpp(cfg.lse_early_nondet),
            "kLseEarlyDet": _cpp(cfg.lse_early_det),
            "dQ_split_rows": _cpp(cfg.dq_split_rows),
            "dQ_transposed": _cpp(cfg.dq_transposed),
        }
    dims = ", ".join(map(str, C.SUPPORTED_HEAD_DIMS))
    assert f"inline constexpr int kSupportedHeadDims[] = {{{dims}}};" in text
    assert f"inline constexpr int kPreprocessThreads = {C.PREPROCESS_THREADS};" in text


_FWD_SPEC = re.compile(r"template <> struct FwdTileConfig<(\d+), (true|false)> \{(.*?)\};", re.S)


def test_render_cpp_header_has_every_forward_config():
    specs = {(int(d), c == "true"): dict(_FIELD.findall(body)) for d, c, body in _FWD_SPEC.findall(C.render_cpp_header())}
    assert len(specs) == len(C.FWD_TILE_CONFIGS)
    for cfg in C.FWD_TILE_CONFIGS:
        assert specs[(cfg.head_dim, cfg.causal)] == {
            "kHeadDim": _cpp(cfg.head_dim),
            "Is_causal": _cpp(cfg.causal),
            "kBlockM": _cpp(cfg.block_m),
            "kBlockN": _cpp(cfg.block_n),
            "NumMmaWarpGroups": _cpp(cfg.mma_warpgroups),
            "kStagesKV": _cpp(cfg.kv_stages),
            "kMmaRegisters": _cpp(cfg.mma_registers),
            "kPingPong": _cpp(cfg.pingpong),
            "kOverlapTileEnd": _cpp(cfg.overlap_tile_end),
            "kStagesQ": _cpp(cfg.q_stages),
            "kWaitVInTurn": _cpp(cfg.v_wait_in_turn),
            "kKVMulticast": _cpp(cfg.kv_multicast),
            "kConditionalRescale": _cpp(cfg.rescale_max_growth_log2 is not None),
            "kRescaleMaxGrowthLog2": f"{float(cfg.rescale_max_growth_log2 or 0.0)!r}f",
            "kLazyMax": _cpp(cfg.lazy_max_sum_log2 is not None),
            "kLazyMaxSumBound": f"{float(2 ** (cfg.lazy_max_sum_log2 or 0))!r}f",
            "kL2SectionBytes": _cpp(cfg.l2_section_mib * 1024 * 1024),
            "kTmaStoreOut": _cpp(cfg.tma_store_out),
            "kRowLimitMask": _cpp(cfg.row_limit_mask),
            "kPvWaitAfterExp2": _cpp(cfg.pv_wait_after_exp2 or 0),
        }


def test_config_module_writes_the_header(tmp_path):
    p = subprocess.run([sys.executable, "-m", "dash.config", "--header", "-"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == C.render_cpp_header()
    out = tmp_path / "gen" / "tile_config.h"
    assert C.write_if_changed(str(out), p.stdout) is True
    assert out.read_text() == p.stdout
    assert C.write_if_changed(str(out), p.stdout) is False
    assert C.write_if_changed(str(out), p.stdout + "// changed\n") is True


# ---------------------------------------------------------------------------------------
# python -m dash trace: bad input is one line and exit 2, as for profile; no GPU is exit 1
# ---------------------------------------------------------------------------------------
_TRACE = ["trace", "--seqlen", "128", "--hdim", "64", "--batch", "1", "--heads", "2"]


@pytest.mark.parametrize("extra, expected", [
    (["--schedule", "bogus"], "argument --schedule: 'bogus' is not a kernel schedule; choose auto, fa3"),
    (["--schedule", "portable"], ("argument --schedule: 'portable' is modelled (python -m dash simulate) but not "
                                  "implemented by the kernel yet")),
    (["--schedule", "symmetric_shift"], "argument --schedule: 'symmetric_shift' is modelled"),
    (["--schedule", "shift", "--causal"], "argument --schedule: 'shift' is for full masks; with --causal use auto"),
    (["--heads-kv", "3"], "argument --heads-kv: 3 does not divide the 2 query heads"),
    (["--sm-margin", "-1"], "argument --sm-margin: -1 is not a non-negative integer"),
], ids=str)
def test_trace_bad_input_is_one_line_before_any_gpu_work(extra, expected, capsys):
    rc, out, err = _main(_TRACE + extra, capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    assert err.startswith("python -m dash trace: error: ") and expected in err, err


def test_trace_bogus_schedule_subprocess():
    p = _dash(*_TRACE, "--schedule", "bogus")
    assert p.returncode == 2 and p.stdout == ""
    _assert_one_line(p.stderr)
    assert "argument --schedule: 'bogus' is not a kernel schedule" in p.stderr


def test_trace_without_gpu_is_one_error_line_on_stderr(capsys):
    if _sm90_usable():
        pytest.skip("an sm_90 GPU with DASH's kernels is present: trace runs")
    rc, out, err = _main(_TRACE, capsys)
    assert rc == 1 and out == ""
    _assert_one_line(err)
    assert err.startswith("python -m dash trace: error: needs an sm_90 GPU with DASH's kernels (")
    assert "python -m dash simulate" in err  # what to do instead


def test_trace_input_check_errors_are_one_line(capsys, monkeypatch):
    """An error of DASH's input checks while the trace runs (here: the device check, on CPU
    tensors standing in for the GPU's) is a usage error's one line, not a traceback."""
    import functools

    from dash import _bench, trace

    monkeypatch.setattr(_bench, "_gpu_ok", lambda: (True, ""))
    monkeypatch.setattr(trace, "_random_inputs", functools.partial(trace._random_inputs, device="cpu"))
    rc, out, err = _main(_TRACE, capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    assert err.startswith("python -m dash trace: error: q is on device cpu; DASH runs on CUDA devices")
