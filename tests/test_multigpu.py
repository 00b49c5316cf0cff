"""Multi-GPU determinism: tools/train_multigpu.py (DDP / FSDP2 training of a tiny Llama with
DASH under torchrun) and tools/multigpu_determinism.py (two runs per configuration, compared).

CPU tests: the argument checks, digests and comparisons, the driver's plan, commands,
environment, exit statuses and summary (with stand-in runs), and -- where transformers is
installed -- the real plumbing: torchrun with 2 CPU processes over gloo, DDP and FSDP2, with
transformers' SDPA instead of DASH.

GPU test (``gpu`` marker; skipped unless at least 2 CUDA GPUs of compute capability 9.0 are
visible): the driver's default run -- DDP and FSDP2 with DASH twice each, which must be
bit-identical, and torch SDPA for contrast, reported either way.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tools" / "multigpu_determinism.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


md = _load("multigpu_determinism", DRIVER)
tm = md.tm  # the driver's train_multigpu


def _two_hopper_gpus() -> str | None:
    """Why the GPU test cannot run here (None when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU (CPU-only machine)"
    n = torch.cuda.device_count()
    if n < 2:
        return f"{n} CUDA GPU visible; the multi-GPU determinism test needs 2"
    caps = [torch.cuda.get_device_capability(i) for i in range(n)]
    if sum(c == (9, 0) for c in caps) < 2:
        return f"compute capabilities {caps}; the test needs 2 GPUs of 9.0 (DASH's kernels are sm_90a)"
    return None


# ---------------------------------------------------------------------------------------
# train_multigpu.py: arguments, launch check, environment
# ---------------------------------------------------------------------------------------
def test_train_args_defaults(tmp_path):
    a = tm.parse_args(["--mode", "fsdp2", "--out", str(tmp_path)])
    assert (a.mode, a.attn, a.torch_deterministic, a.device, a.dtype) == ("fsdp2", "dash", "on", "cuda", "bf16")
    assert (a.steps, a.seed, a.batch, a.seqlen, a.layers, a.bucket_cap_mb) == (6, 0, 4, 512, 4, 25.0)
    assert tm.parse_args(["--mode", "ddp", "--out", str(tmp_path), "--device", "cpu", "--attn", "sdpa"]).dtype == "fp32"


@pytest.mark.parametrize("argv,message", [
    (["--mode", "zero3"], "argument --mode: invalid choice: 'zero3'"),
    (["--mode", "ddp", "--device", "cpu"], "--attn dash needs --device cuda"),
    (["--mode", "ddp", "--dtype", "fp32"], "--attn dash needs --dtype bf16"),
    (["--mode", "ddp", "--steps", "0"], "argument --steps: '0' is not a positive integer"),
    (["--mode", "ddp", "--bucket-cap-mb", "-1"], "argument --bucket-cap-mb: '-1' is not a positive number"),
])
def test_train_args_errors(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tm.parse_args(argv + ["--out", str(tmp_path)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_train_refuses_to_run_without_torchrun(tmp_path):
    assert "start this script with torchrun" in tm.launch_problem({})
    assert tm.launch_problem({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x",
                              "MASTER_PORT": "1"}) is None
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "train_multigpu.py"), "--mode", "ddp", "--out",
                        str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and "RANK, WORLD_SIZE, LOCAL_RANK" in p.stderr and "torchrun" in p.stderr


def test_determinism_env_is_set_only_where_unset():
    env = {"NCCL_ALGO": "Tree"}
    in_effect = tm.apply_determinism_env(env)
    assert env["NCCL_ALGO"] == "Tree"  # the caller's choice is kept (and recorded)
    assert env["NCCL_PROTO"] == "Simple" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert in_effect["NCCL_ALGO"] == "Tree" and in_effect["NCCL_MAX_NCHANNELS"] is None
    assert "NCCL_ALGO" not in os.environ or os.environ["NCCL_ALGO"] != "Tree"


def test_global_batch_is_seeded_and_sharded_by_rank():
    a = tm.global_batch(3, seed=0, world=2, batch=4, seqlen=16, vocab=1024)
    assert a.shape == (8, 16) and int(a.max()) < 1024
    assert torch.equal(a, tm.global_batch(3, seed=0, world=2, batch=4, seqlen=16, vocab=1024))
    assert not torch.equal(a, tm.global_batch(4, seed=0, world=2, batch=4, seqlen=16, vocab=1024))
    assert not torch.equal(a, tm.global_batch(3, seed=1, world=2, batch=4, seqlen=16, vocab=1024))


# ---------------------------------------------------------------------------------------
# Comparison of two runs and checks within one
# ---------------------------------------------------------------------------------------
def _result(losses=((7.0, 6.5), (7.1, 6.4)), params=None, **over):
    params = params if params is not None else {"w": torch.ones(3), "b": torch.zeros(2)}
    digests = {n: tm.tensor_digest(t) for n, t in params.items()}
    r = {"mode": "ddp", "attn": "dash", "torch_deterministic": "on", "world_size": 2, "steps": 2, "seed": 0,
         "batch_per_rank": 4, "seqlen": 512, "layers": 4, "dtype": "bf16", "device": "cuda",
         "losses": [list(x) for x in losses], "loss_bits": [tm.float32_bits(x) for x in losses],
         "param_digests": digests, "param_sha256": tm.combined_digest(digests),
         "rank_param_sha256": [tm.combined_digest(digests)] * 2, "replicas_identical": True,
         "dash_calls_per_rank": [8, 8]}
    r.update(over)
    return r


def test_compare_identical():
    assert tm.compare_results(_result(), _result()) == []


def test_compare_finds_loss_and_parameter_differences():
    w = torch.ones(3)
    w2 = w.clone()
    w2[1] = torch.tensor(1.0).nextafter(torch.tensor(2.0))
    a = _result()
    b = _result(losses=((7.0, 6.5), (7.1, float(torch.tensor(6.4).nextafter(torch.tensor(7.0))))),
                params={"w": w2, "b": torch.zeros(2)})
    assert tm.compare_results(a, b) == [
        "rank 1: losses differ at 1 of 2 steps, first at step 1 (6.4 vs 6.40000057)",
        "1 of 2 parameters differ bitwise after the last step (w)"]


def test_compare_refuses_different_configurations():
    diffs = tm.compare_results(_result(), _result(mode="fsdp2", seed=1))
    assert diffs == ["not the same configuration: mode='ddp' vs 'fsdp2', seed=0 vs 1"]
    assert tm.compare_results(_result(), _result(losses=((7.0,), (7.1,)))) == [
        "the runs recorded different numbers of ranks or steps"]


def test_check_result():
    assert tm.check_result(_result()) == []
    bad = _result(replicas_identical=False, rank_param_sha256=["a", "b"], dash_calls_per_rank=[8, 0],
                  losses=[[7.0, float("nan")], [7.0, 6.0]])
    problems = tm.check_result(bad)
    assert problems[0].startswith("the ranks' parameters differ after training")
    assert "DASH was called [8, 0] times per rank, expected 8 (layers x steps)" in problems[1]
    assert problems[2] == "non-finite losses at (rank, step) [(0, 1)]"
    assert tm.check_result(_result(attn="sdpa", dash_calls_per_rank=None)) == []


# ---------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------
def test_plan():
    pairs = md.plan(["ddp", "fsdp2"], "dash", "both")
    assert [p.label for p in pairs] == [
        "ddp + dash (deterministic=True)", "fsdp2 + dash (deterministic=True)",
        "ddp + torch SDPA, torch defaults (deterministic algorithms off)",
        "ddp + torch SDPA, torch.use_deterministic_algorithms(True)"]
    assert [p.required for p in pairs] == [True, True, False, False]
    assert [r.name for p in pairs for r in p.runs] == [
        "ddp-dash-run1", "ddp-dash-run2", "fsdp2-dash-run1", "fsdp2-dash-run2", "ddp-sdpa-default-run1",
        "ddp-sdpa-default-run2", "ddp-sdpa-torchdet-run1", "ddp-sdpa-torchdet-run2"]
    assert pairs[2].runs[0].torch_deterministic == "off" and pairs[3].runs[0].torch_deterministic == "on"
    assert len(md.plan(["fsdp2"], "dash", "off")) == 1


def test_torchrun_command_and_env(tmp_path):
    args = md.parse_args(["--out", str(tmp_path), "--nproc", "4", "--steps", "3", "--", "--layers", "2"])
    run = md.Run("fsdp2-dash-run1", "fsdp2", "dash", "on")
    cmd = md.torchrun_command(run, args, tmp_path)
    assert cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    assert cmd[5] == str(ROOT / "tools" / "train_multigpu.py")
    assert cmd[6:] == ["--mode", "fsdp2", "--attn", "dash", "--torch-deterministic", "on", "--out",
                       str(tmp_path / "fsdp2-dash-run1"), "--steps", "3", "--seed", "0", "--device", "cuda",
                       "--layers", "2"]
    env = md.run_env({"PYTHONPATH": "/x", "NCCL_PROTO": "LL"})
    assert env["PYTHONPATH"] == f"{ROOT}{os.pathsep}/x"
    assert env["NCCL_PROTO"] == "LL" and env["NCCL_ALGO"] == "Ring" and env["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("argv,message", [
    (["--device", "cpu"], "--attn dash needs --device cuda"),
    (["--device", "cpu", "--attn", "sdpa"], "--sdpa both needs --device cuda"),
    (["--", "--mode", "ddp"], "--mode is set by this driver"),
    (["--", "--seqlen", "x"], "train_multigpu.py rejects the arguments after --: --seqlen x"),
    (["--nproc", "0"], "argument --nproc: '0' is not a positive integer"),
    (["--modes", "zero"], "argument --modes: invalid choice: 'zero'"),
])
def test_driver_argument_errors(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        md.parse_args(["--out", str(tmp_path)] + argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs")
def test_driver_needs_the_gpus_it_asks_for(tmp_path, capsys):
    assert md.main(["--out", str(tmp_path)]) == 2
    assert "--nproc 2 needs 2 CUDA GPUs" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()


def _fake_execute(outcomes):
    """A stand-in for execute(): results per run name from ``outcomes`` (dict or error string)."""
    def execute(run, args, out, env):
        o = outcomes[run.name]
        return (None, o) if isinstance(o, str) else (o, None)
    return execute


def _cpu_args(tmp_path):
    return ["--out", str(tmp_path), "--device", "cpu", "--attn", "sdpa", "--sdpa", "off"]


def test_driver_status_identical(tmp_path, monkeypatch, capsys):
    same = _result(attn="sdpa", dash_calls_per_rank=None, wall_s=1.0)
    runs = {f"{m}-sdpa-run{i}": same for m in ("ddp", "fsdp2") for i in (1, 2)}
    monkeypatch.setattr(md, "execute", _fake_execute(runs))
    assert md.main(_cpu_args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "ddp + sdpa" in out and "[required] bit-identical" in out and "OK: every sdpa run pair" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == 0 and all(p["identical"] for p in summary["pairs"])
    assert set(summary["results"]) == set(runs) and summary["env"]["NCCL_ALGO"]


def test_driver_status_mismatch(tmp_path, monkeypatch, capsys):
    a = _result(attn="sdpa", dash_calls_per_rank=None, wall_s=1.0)
    b = _result(attn="sdpa", dash_calls_per_rank=None, wall_s=1.0, losses=((7.0, 6.5), (7.1, 6.3)))
    monkeypatch.setattr(md, "execute", _fake_execute({"ddp-sdpa-run1": a, "ddp-sdpa-run2": b}))
    assert md.main(_cpu_args(tmp_path) + ["--modes", "ddp"]) == 1
    captured = capsys.readouterr()
    assert "NOT identical: rank 1: losses differ at 1 of 2 steps" in captured.out
    assert "FAILED: 1 sdpa configuration(s) not bit-identical" in captured.err
    assert json.loads((tmp_path / "summary.json").read_text())["pairs"][0]["identical"] is False


def test_driver_status_replicas_disagree(tmp_path, monkeypatch, capsys):
    a = _result(attn="sdpa", dash_calls_per_rank=None, wall_s=1.0, replicas_identical=False)
    monkeypatch.setattr(md, "execute", _fake_execute({"ddp-sdpa-run1": a, "ddp-sdpa-run2": a}))
    assert md.main(_cpu_args(tmp_path) + ["--modes", "ddp"]) == 1
    assert "problem: ddp-sdpa-run1: the ranks' parameters differ" in capsys.readouterr().out


def test_driver_status_failed_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(md, "execute", _fake_execute({"ddp-sdpa-run1": "exit status 1; log x ends:\n  boom"}))
    assert md.main(_cpu_args(tmp_path) + ["--modes", "ddp"]) == 2
    captured = capsys.readouterr()
    assert "RUN FAILED: ddp-sdpa-run1: exit status 1" in captured.out
    assert "could not be run" in captured.err


def test_sdpa_contrast_pairs_never_fail_the_driver(tmp_path, monkeypatch):
    dash = _result(wall_s=1.0)
    s1 = _result(attn="sdpa", torch_deterministic="off", dash_calls_per_rank=None, wall_s=1.0)
    s2 = dict(s1, loss_bits=[["0"], ["1"]])
    monkeypatch.setattr(md, "execute", _fake_execute({"ddp-dash-run1": dash, "ddp-dash-run2": dash,
                                                      "ddp-sdpa-default-run1": s1, "ddp-sdpa-default-run2": s2}))
    monkeypatch.setattr(md, "gpu_problem", lambda n: None)
    assert md.main(["--out", str(tmp_path), "--modes", "ddp", "--sdpa", "default"]) == 0
    pairs = json.loads((tmp_path / "summary.json").read_text())["pairs"]
    assert [p["identical"] for p in pairs] == [True, False]


def test_failed_sdpa_contrast_run_is_reported_but_never_fails_the_driver(tmp_path, monkeypatch, capsys):
    dash = _result(wall_s=1.0)
    monkeypatch.setattr(md, "execute", _fake_execute({"ddp-dash-run1": dash, "ddp-dash-run2": dash,
                                                      "ddp-sdpa-default-run1": "exit status 1; log x ends:\n  boom"}))
    monkeypatch.setattr(md, "gpu_problem", lambda n: None)
    assert md.main(["--out", str(tmp_path), "--modes", "ddp", "--sdpa", "default"]) == 0
    captured = capsys.readouterr()
    assert "[for contrast] RUN FAILED: ddp-sdpa-default-run1: exit status 1" in captured.out
    assert "note: 1 contrast configuration(s) could not be run (they never fail this driver)" in captured.out
    assert "OK: every dash run pair is bit-identical" in captured.out and "FAILED" not in captured.err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == 0 and "boom" in summary["pairs"][1]["error"]


# ---------------------------------------------------------------------------------------
# The real plumbing on CPUs: torchrun, 2 processes, gloo, DDP and FSDP2 (transformers' SDPA)
# ---------------------------------------------------------------------------------------
def _needs_transformers(gpu_test: bool = False) -> None:
    """Without transformers a CPU test skips, with the reason; the GPU test fails, with the
    reason: it only gets here on a machine with 2 sm_90 GPUs, where passing by skipping would
    prove nothing (tests/conftest.py's GPU test policy)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        why = "transformers is not installed (the multi-GPU tools build a transformers Llama)"
        if gpu_test:
            pytest.fail(f"the multi-GPU determinism test cannot run on this machine with 2 sm_90 GPUs: {why}",
                        pytrace=False)
        pytest.skip(why)


def test_missing_transformers_skips_cpu_tests_but_fails_the_gpu_test(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(pytest.skip.Exception, match="transformers is not installed"):
        _needs_transformers()
    with pytest.raises(pytest.fail.Exception, match="cannot run on this machine with 2 sm_90 GPUs: transformers is"):
        _needs_transformers(gpu_test=True)


def test_plumbing_on_cpu_with_gloo(tmp_path):
    _needs_transformers()
    p = subprocess.run([sys.executable, str(DRIVER), "--out", str(tmp_path), "--device", "cpu", "--attn", "sdpa",
                        "--sdpa", "off", "--steps", "2", "--", "--layers", "2", "--seqlen", "64"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [x["label"] for x in summary["pairs"]] == ["ddp + sdpa", "fsdp2 + sdpa"]
    assert all(x["identical"] and not x["problems"] for x in summary["pairs"])
    r = summary["results"]["fsdp2-sdpa-run1"]
    assert r["world_size"] == 2 and len(r["losses"]) == 2 and len(r["losses"][0]) == 2
    assert r["losses"][0] != r["losses"][1]  # each rank trains on its own shard of the batch
    assert r["replicas_identical"] and r["env"]["NCCL_ALGO"] == "Ring"
    assert "model.layers.1.self_attn.q_proj.weight" in r["param_digests"]  # full names: gathered, not sharded
    assert (tmp_path / "ddp-sdpa-run2.log").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fa3_reference(q, k, v, softmax_scale=None, causal=False, **kwargs):
    """A CPU stand-in for dash.flash_attn_func: FA3 semantics, (B, S, H, D), GQA."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("mode", tm.MODES)
def test_train_with_dash_in_process(mode, monkeypatch):
    """train()'s DASH path (registration with deterministic=True, the call count, the wrapping,
    the results) in this process, world size 1 over gloo, with a CPU stand-in for DASH's kernel."""
    _needs_transformers()
    import dash
    import dash.integrations.transformers as dt

    real = dash.flash_attn_func
    seen = []

    def stand_in(q, k, v, softmax_scale=None, causal=False, deterministic=None, schedule="auto", **kw):
        seen.append((tuple(q.shape), tuple(k.shape), causal, deterministic))
        return _fa3_reference(q, k, v, softmax_scale, causal)

    for name, mod in list(sys.modules.items()):  # wherever dash holds it (defined / re-exported)
        if (name == "dash" or name.startswith("dash.")) and getattr(mod, "flash_attn_func", None) is real:
            monkeypatch.setattr(mod, "flash_attn_func", stand_in)
    monkeypatch.setattr(dash._ext, "kernels_status", lambda: (True, None))
    for k, v in tm.DETERMINISM_ENV.items():  # train() sets these; monkeypatch restores them afterwards
        monkeypatch.setenv(k, v)
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(k, v)
    args = tm.parse_args(["--mode", mode, "--out", "unused", "--steps", "2", "--layers", "2", "--seqlen", "32",
                          "--batch", "2"])
    args.device, args.dtype = "cpu", "fp32"  # parse_args refuses dash on the CPU; the stand-in takes it
    try:
        r = tm.train(args)
    finally:
        torch.use_deterministic_algorithms(False)
        dt.register()
    assert r["dash_calls_per_rank"] == [4] and len(seen) == 4  # layers x steps
    assert seen[0] == ((2, 32, 8, 64), (2, 32, 2, 64), True, True)  # GQA heads unrepeated, deterministic=True
    assert tm.check_result(r) == []
    assert r["mode"] == mode and r["world_size"] == 1 and r["losses"][0][1] < r["losses"][0][0]
    assert r["env"]["NCCL_ALGO"] == "Ring" and r["versions"]["nccl"] is None


def test_timeout_ends_the_whole_run(tmp_path):
    _needs_transformers()
    t0 = time.time()
    p = subprocess.run([sys.executable, str(DRIVER), "--out", str(tmp_path), "--device", "cpu", "--attn", "sdpa",
                        "--sdpa", "off", "--modes", "ddp", "--timeout", "3"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "timed out after 3 s" in p.stdout
    assert time.time() - t0 < 120
    # No worker of the ended run is left (they would hold the log file open and keep writing).
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", f"train_multigpu.py.*{tmp_path}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


# ---------------------------------------------------------------------------------------
# GPU: 2 Hopper GPUs
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(_two_hopper_gpus() is not None, reason=f"multi-GPU test skipped: {_two_hopper_gpus()}")
def test_multigpu_training_with_dash_is_bitwise_reproducible(tmp_path):
    _needs_transformers(gpu_test=True)
    p = subprocess.run([sys.executable, str(DRIVER), "--out", str(tmp_path), "--nproc", "2"], capture_output=True,
                       text=True, timeout=900, cwd=ROOT)
    print(p.stdout)
    summary_file = tmp_path / "summary.json"
    assert summary_file.exists(), p.stdout + p.stderr
    summary = json.loads(summary_file.read_text())
    required = [x for x in summary["pairs"] if x["required"]]
    assert [x["label"] for x in required] == ["ddp + dash (deterministic=True)", "fsdp2 + dash (deterministic=True)"]
    for x in required:
        assert x["error"] is None, x["error"]
        assert x["identical"], f"{x['label']}: {x['differences']}"
        assert not x["problems"], x["problems"]
    assert p.returncode == 0, p.stdout + p.stderr
