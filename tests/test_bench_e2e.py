"""benchmarks/bench_e2e.py on the CPU: its pure parts (model/case table, arguments, the bitwise
comparison, the results file, the table and chart), the training loop and a case's record with
stand-in attention functions, and its clear failure on a machine without a CUDA GPU. The GPU
run itself is `python benchmarks/bench_e2e.py` on an H200 (see the script's docstring)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_e2e.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


be = _load()


# ---------------------------------------------------------------------------------------
# Models and cases
# ---------------------------------------------------------------------------------------
def test_model_table_has_the_published_shapes():
    llama, qwen = be.MODELS["llama3-8b"], be.MODELS["qwen2.5-7b"]
    assert (llama.hidden, llama.heads, llama.kv_heads, llama.head_dim, llama.mlp) == (4096, 32, 8, 128, 14336)
    assert (qwen.hidden, qwen.heads, qwen.kv_heads, qwen.head_dim, qwen.mlp) == (3584, 28, 4, 128, 18944)
    assert not llama.qkv_bias and qwen.qkv_bias
    for s in be.MODELS.values():
        assert s.heads * s.head_dim == s.hidden and s.heads % s.kv_heads == 0
    # 32 LLaMA3-8B blocks hold 6.98e9 of its 8.03e9 parameters (the rest: embedding + LM head).
    assert llama.linear_params_per_layer() == 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert 6.9e9 < 32 * llama.params_per_layer() < 7.0e9


def test_default_cases():
    args = be.parse_args([])
    cases = be.build_cases(args.models, args.seqlens, args.full_seqlens, args.tokens, args.layers)
    assert [(c.model, c.seqlen, c.causal, c.batch) for c in cases] == [
        ("llama3-8b", 4096, True, 4), ("llama3-8b", 8192, True, 2), ("llama3-8b", 4096, False, 4),
        ("qwen2.5-7b", 4096, True, 4), ("qwen2.5-7b", 8192, True, 2), ("qwen2.5-7b", 4096, False, 4)]
    assert all(c.tokens == 16384 and c.layers == 2 for c in cases)
    assert cases[0].label() == "llama3-8b causal s4096 b4 L2"


def test_case_flops():
    causal = be.Case("llama3-8b", 4096, True, 4, 2)
    full = be.Case("llama3-8b", 4096, False, 4, 2)
    assert full.attention_flops() == 2 * causal.attention_flops()
    assert full.attention_flops() == 3.5 * 4 * 4 * 32 * 4096 * 4096 * 128 * 2
    linear = 6 * 16384 * be.MODELS["llama3-8b"].linear_params_per_layer() * 2
    assert causal.step_flops() == linear + causal.attention_flops()


def test_build_cases_rejects_unknown_models_and_keeps_one_sequence():
    with pytest.raises(ValueError, match="model 'gpt' is unknown; choose from llama3-8b, qwen2.5-7b"):
        be.build_cases(["gpt"], [4096], [], 16384, 2)
    (case,) = be.build_cases(["llama3-8b"], [32768], [], 16384, 1)
    assert case.batch == 1 and case.tokens == 32768


# ---------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------
def test_parse_defaults():
    a = be.parse_args([])
    assert (a.steps, a.warmup, a.layers, a.tokens, a.seed) == (10, 3, 2, 16384, 0)
    assert a.seqlens == [4096, 8192] and a.full_seqlens == [4096]
    assert a.models == list(be.MODELS) and a.backends is None
    assert a.out == be.DEFAULT_OUT and not a.no_plot


def test_parse_lists_accept_spaces_and_commas():
    a = be.parse_args(["--backends", "dash_det,torch_cudnn", "dash_nondet", "dash_det", "--models", "qwen2.5-7b",
                       "--seqlens", "8192", "8192", "--full-seqlens", "--steps", "5", "--warmup", "0", "--no-plot"])
    assert a.backends == ["dash_det", "torch_cudnn", "dash_nondet"]
    assert a.models == ["qwen2.5-7b"] and a.seqlens == [8192] and a.full_seqlens == []
    assert (a.steps, a.warmup, a.no_plot) == (5, 0, True)


@pytest.mark.parametrize("argv,message", [
    (["--backends", "flash"], "argument --backends: 'flash' is unknown; choose from dash_det, dash_nondet"),
    (["--models", "llama2"], "argument --models: 'llama2' is unknown; choose from llama3-8b, qwen2.5-7b"),
    (["--steps", "0"], "argument --steps: 0 is not a positive integer"),
    (["--warmup", "-1"], "argument --warmup: -1 is not a non-negative integer"),
    (["--layers", "two"], "argument --layers: two is not a positive integer"),
    (["--seqlens", "0"], "argument --seqlens: 0 is not a positive integer"),
    (["--lr", "nan"], "argument --lr: 'nan' is not a positive number"),
    (["--seqlens", "--full-seqlens"], "--seqlens and --full-seqlens are both empty"),
    (["--backends", ","], "argument --backends: give at least one backend"),
])
def test_parse_errors_name_the_argument_and_value(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        be.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_out(tmp_path, capsys):
    assert be.parse_args(["--out", str(tmp_path / "x.json")]).out == tmp_path / "x.json"
    assert be.parse_args(["--out", str(tmp_path)]).out == tmp_path
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        be.parse_args(["--out", str(tmp_path / "file")])
    assert "exists and is not a folder" in capsys.readouterr().err
    (tmp_path / "d.json").mkdir()
    with pytest.raises(SystemExit):
        be.parse_args(["--out", str(tmp_path / "d.json")])
    assert "is a folder" in capsys.readouterr().err


def test_choose_backends():
    avail = {b: None for b in be.BACKENDS}
    avail.update(fa3_nondet="not importable (x)", fa3_det="not importable (x)")
    chosen, skipped = be.choose_backends(None, avail)
    assert chosen == [b for b in be.BACKENDS if not b.startswith("fa3")]
    assert skipped == {"fa3_nondet": "not importable (x)", "fa3_det": "not importable (x)"}
    assert be.choose_backends(["torch_cudnn", "dash_det"], avail) == (["torch_cudnn", "dash_det"], {})
    with pytest.raises(ValueError, match=r"backend fa3_det cannot run here: not importable \(x\)"):
        be.choose_backends(["dash_det", "fa3_det"], avail)


# ---------------------------------------------------------------------------------------
# Bitwise comparison
# ---------------------------------------------------------------------------------------
def _record(losses, params):
    return {"loss_bits": be.float32_bits(losses), "param_digests": {n: be.tensor_digest(t) for n, t in params.items()}}


def test_compare_identical_runs():
    p = {"w": torch.randn(3, 4).bfloat16(), "b": torch.zeros(4)}
    assert be.compare_runs(_record([1.5, 1.25], p), _record([1.5, 1.25], {k: v.clone() for k, v in p.items()})) == []


def test_compare_finds_one_ulp_loss_and_parameter_differences():
    w = torch.randn(8, 8).bfloat16()
    w2 = w.clone()
    w2.view(torch.int16)[3, 3] += 1  # one bf16 ulp in one element
    a = _record([2.0, 1.0, 0.5], {"a.w": w, "b.w": w})
    b = _record([2.0, 1.0, float(torch.tensor(0.5).nextafter(torch.tensor(1.0)))], {"a.w": w, "b.w": w2})
    diffs = be.compare_runs(a, b)
    assert len(diffs) == 2
    assert diffs[0] == "losses differ at 1 of 3 steps, first at step 2 (0.5 [3f000000] vs 0.50000006 [3f000001])"
    assert diffs[1] == "1 of 2 parameters differ bitwise (b.w)"


def test_compare_is_bitwise_not_numeric():
    # -0.0 == 0.0 numerically (torch.equal agrees), but not bitwise; NaN != NaN numerically,
    # but the same NaN bits are the same result.
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert be.tensor_digest(torch.tensor([0.0])) != be.tensor_digest(torch.tensor([-0.0]))
    assert be.compare_runs(_record([0.0], {}), _record([-0.0], {}))
    nan = float("nan")
    assert be.compare_runs(_record([nan], {"x": torch.tensor([nan])}), _record([nan], {"x": torch.tensor([nan])})) == []


def test_compare_reports_structure_differences():
    assert be.compare_runs({"loss_bits": ["00000000"]}, {"loss_bits": []}) == ["the runs have 1 and 0 losses"]
    diffs = be.compare_runs({"loss_bits": ["1"], "param_digests": {"a": "x"}},
                            {"loss_bits": ["1"], "param_digests": {"b": "x"}})
    assert diffs == ["the runs have different parameters (a, b)"]
    assert be.compare_runs({}, {}) == ["nothing was recorded to compare"]
    many = be.compare_runs({"loss_bits": ["1"], "param_digests": {f"p{i}": "x" for i in range(9)}},
                           {"loss_bits": ["1"], "param_digests": {f"p{i}": "y" for i in range(9)}})
    assert many == ["9 of 9 parameters differ bitwise (p0, p1, p2, p3, p4, ...)"]


def test_tensor_digest_covers_dtype_shape_and_non_contiguous_tensors():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert be.tensor_digest(t) != be.tensor_digest(t.reshape(4, 3))
    assert be.tensor_digest(t) != be.tensor_digest(t.to(torch.int32).view(torch.float32))  # same shape, bits differ
    assert be.tensor_digest(t.t()) == be.tensor_digest(t.t().contiguous())
    assert be.float32_bits([1.0, -2.0]) == ["3f800000", "c0000000"]
    assert be._bits_to_float("3f800000") == 1.0


# ---------------------------------------------------------------------------------------
# Results: file name, content, table, chart, exit status
# ---------------------------------------------------------------------------------------
def test_results_path(tmp_path):
    p = be.results_path(tmp_path, "NVIDIA H200", "2026-12-01T10:00:00+00:00")
    assert p == tmp_path / "2026-12-01-NVIDIA-H200-e2e.json"
    p.write_text("{}")
    again = be.results_path(tmp_path, "NVIDIA H200", "2026-12-01T11:00:00+00:00")
    assert again.name == "2026-12-01-NVIDIA-H200-e2e-2.json"  # an earlier run's file is kept
    assert be.results_path(tmp_path, "a/b (c)", "2026-12-01").name == "2026-12-01-a-b-c-e2e.json"
    assert be.results_path(tmp_path / "mine.json", "NVIDIA H200", "2026-12-01") == tmp_path / "mine.json"


def _fake_case(label, ms, det=None):
    backends = {b: {"ms_median": v, "tokens_per_s": 16384 / (v * 1e-3), "gqa": "native"} for b, v in ms.items()}
    return {"label": label, "backends": backends, "determinism": det or {}}


def _fake_payload(args=None, det=None, error=None):
    args = args or be.parse_args(["--no-plot"])
    backends = ["dash_det", "dash_nondet", "torch_cudnn", "torch_flash"]
    cases = [_fake_case("llama3-8b causal s4096 b4 L2", dict(dash_det=110.0, dash_nondet=100.0, torch_cudnn=105.0,
                                                             torch_flash=120.0),
                        {"dash_det": det or {"identical": True, "differences": []}}),
             _fake_case("llama3-8b causal s8192 b2 L2", dict(dash_det=121.0, dash_nondet=110.0, torch_cudnn=121.0,
                                                             torch_flash=132.0))]
    cases[0]["backends"]["torch_cudnn"]["gqa"] = "enable_gqa"
    if error:
        cases[1]["backends"]["dash_nondet"] = {"error": error, "gqa": "native"}
    env = {"device": "NVIDIA H200", "date": "2026-12-01T10:00:00+00:00", "commit": "abc", "checkout_head": "def"}
    return be.assemble(cases, backends, args, env, {"fa3_det": "not importable"}, ["--no-plot"], 12.5)


def test_assemble_ratios_and_summary():
    payload = _fake_payload()
    c0 = payload["cases"][0]["backends"]
    assert c0["dash_nondet"]["speed_vs_dash_nondet"] == 1.0
    assert c0["dash_det"]["speed_vs_dash_nondet"] == pytest.approx(100 / 110)
    assert c0["dash_det"]["speed_vs_torch_cudnn"] == pytest.approx(105 / 110)
    s = payload["summary"]["dash_det"]
    assert s["geomean_speed_vs_torch_cudnn"] == pytest.approx(((105 / 110) * (121 / 121)) ** 0.5)
    assert s["min_speed_vs_torch_cudnn"] == pytest.approx(105 / 110) and s["cases"] == 2
    assert payload["determinism_ok"] and payload["kind"] == "e2e"
    assert payload["config"]["steps"] == 10 and payload["config"]["model_shapes"]["llama3-8b"]["mlp"] == 14336
    assert payload["meta"]["skipped_backends"] == {"fa3_det": "not importable"}
    assert be.exit_status(payload) == (0, "")


def test_format_table():
    text = be.format_table(_fake_payload(error="RuntimeError: boom"))
    lines = text.splitlines()
    assert lines[0].startswith("Step time, median (ms)")
    row = next(line for line in lines if line.startswith("llama3-8b causal s4096 b4 L2"))
    assert "110.0 149k" in row and "100.0 164k" in row
    assert "Speed relative to dash_nondet" in text and "Speed relative to torch_cudnn" in text
    assert "0.955" in text  # dash_det vs cudnn in case 0: 105 / 110
    assert "error" in next(line for line in lines if line.startswith("llama3-8b causal s8192"))
    assert "GQA in torch SDPA: torch_cudnn: enable_gqa" in text
    assert "dash_det: identical" in text
    assert "llama3-8b causal s8192 b2 L2 dash_nondet: RuntimeError: boom" in text


def test_dash_determinism_failure_exits_3_with_a_banner():
    diff = "losses differ at 2 of 13 steps, first at step 4"
    payload = _fake_payload(det={"identical": False, "differences": [diff]})
    assert not payload["determinism_ok"]
    status, message = be.exit_status(payload)
    assert status == 3
    assert "DETERMINISM FAILURE" in message and "llama3-8b causal s4096 b4 L2 dash_det: losses differ" in message
    assert message.startswith("!" * 100)


def test_dash_error_exits_1():
    status, message = be.exit_status(_fake_payload(error="RuntimeError: boom"))
    assert status == 1 and "llama3-8b causal s8192 b2 L2 dash_nondet: RuntimeError: boom" in message


def test_write_results_round_trips(tmp_path):
    payload = _fake_payload()
    path = be.write_results(payload, be.results_path(tmp_path / "sub", "NVIDIA H200", payload["environment"]["date"]))
    assert path.name == "2026-12-01-NVIDIA-H200-e2e.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(payload))


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = be.plot(_fake_payload(error="x"), tmp_path / "chart.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# ---------------------------------------------------------------------------------------
# The model, the training loop and one case's record, on the CPU with stand-in attention
# ---------------------------------------------------------------------------------------
TINY = be.ModelShape("tiny", hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96, qkv_bias=True, rope_theta=1e4,
                     norm_eps=1e-6)


def reference_attention(q, k, v, causal, scale):
    """FA3 semantics on (batch, seqlen, heads, head_dim): GQA by head groups."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=causal, scale=scale)
    return out.transpose(1, 2)


@pytest.fixture
def tiny_model(monkeypatch):
    monkeypatch.setitem(be.MODELS, "tiny", TINY)
    return be.Case("tiny", 32, True, 2, 2)


def test_sdpa_gqa_by_repeat_interleave_matches_enable_gqa():
    from torch.nn.attention import SDPBackend

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 24, 8, 16, generator=gen)
    k = torch.randn(2, 24, 2, 16, generator=gen)
    v = torch.randn(2, 24, 2, 16, generator=gen)
    for causal in (False, True):
        a = be._sdpa_fn(SDPBackend.MATH, "enable_gqa")(q, k, v, causal, 0.25)
        b = be._sdpa_fn(SDPBackend.MATH, "repeat_interleave")(q, k, v, causal, 0.25)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, reference_attention(q, k, v, causal, 0.25))
        assert a.shape == q.shape


def test_train_run_on_cpu_is_repeatable_and_learns(tiny_model):
    calls = []

    def attn(q, k, v, causal, scale):
        calls.append((tuple(q.shape), tuple(k.shape), q.dtype, causal, scale))
        return reference_attention(q, k, v, causal, scale)

    batches = be.make_batches(tiny_model, 2, seed=0, device="cpu")
    a = be.train_run(tiny_model, attn, batches, steps=4, warmup=2, seed=0, lr=1e-2, digests=True, device="cpu")
    b = be.train_run(tiny_model, attn, batches, steps=4, warmup=2, seed=0, lr=1e-2, digests=True, device="cpu")
    assert len(a.ms) == 4 and len(a.losses) == len(a.loss_bits) == 6
    assert calls[0] == ((2, 32, 4, 16), (2, 32, 2, 16), torch.bfloat16, True, 0.25)
    assert len(calls) == 2 * 6 * 2  # runs x steps x layers
    assert be.compare_runs(be.asdict(a), be.asdict(b)) == []
    assert a.losses[-1] < a.losses[0]  # 2 batches cycled: the blocks fit them
    names = set(a.param_digests)
    assert {"layers.0.attn.q_proj.bias", "layers.1.mlp.down_proj.weight", "norm.weight"} <= names
    assert not any("cos" in n or "sin" in n for n in names)  # RoPE tables are buffers, not parameters


def test_run_case_on_cpu(tiny_model):
    """A case's record: timings, ratios inputs, per-backend GQA handling, the determinism check
    (a stand-in that drifts by one call counts as different) and a failing backend's error."""
    args = argparse.Namespace(steps=2, warmup=1, seed=0, lr=1e-3)
    counter = {"n": 0}

    def drifting(q, k, v, causal, scale):  # a different result on every call
        counter["n"] += 1
        return reference_attention(q, k, v, causal, scale) * (1 + counter["n"] * 2**-7)

    def make(b, gqa):
        if b == "fa3_det":
            return drifting
        if b == "fa4_nondet":
            def broken(*a):
                raise RuntimeError("no kernel for this shape\nmore lines")
            return broken
        if b == "torch_flash":
            from torch.nn.attention import SDPBackend

            return be._sdpa_fn(SDPBackend.MATH, gqa)
        return reference_attention

    log = []
    rec = be.run_case(tiny_model, ["dash_det", "dash_nondet", "torch_flash", "fa3_det", "fa4_nondet"], args,
                      log.append, device="cpu", make_attention=make,
                      probe_gqa=lambda b, c: ("repeat_interleave", None))
    runs = rec["backends"]
    assert rec["tokens"] == 64 and rec["label"] == "tiny causal s32 b2 L2"
    assert runs["dash_det"]["gqa"] == "native" and runs["torch_flash"]["gqa"] == "repeat_interleave"
    assert len(runs["dash_det"]["ms_steps"]) == 2 and runs["dash_det"]["tokens_per_s"] > 0
    assert rec["determinism"]["dash_det"]["identical"]
    assert not rec["determinism"]["fa3_det"]["identical"]
    assert "dash_nondet" not in rec["determinism"]  # non-deterministic backends run once
    assert runs["fa4_nondet"]["error"] == "RuntimeError: no kernel for this shape"
    # The same weights and data: the backends' losses agree (torch_flash stand-in = reference).
    assert runs["torch_flash"]["loss_max_rel_diff_vs_reference"] < 1e-2
    assert runs["dash_nondet"]["loss_max_rel_diff_vs_reference"] == 0.0
    assert any("bitwise: DIFFERENT" in line for line in log)
    payload = be.assemble([rec], ["dash_det", "dash_nondet", "torch_flash", "fa3_det", "fa4_nondet"],
                          be.parse_args([]), {"device": "cpu", "date": "2026-12-01"}, {}, [], 1.0)
    assert payload["determinism_ok"]  # fa3_det differing is reported, not fatal
    assert be.exit_status(payload)[0] == 0
    assert "fa3_det: DIFFERENT: " in be.format_table(payload)


def test_run_case_runs_backends_in_the_case_s_round_order(tiny_model):
    """Over the cases, the backends' places rotate (dash.bench.round_orders: case i's order),
    the order is recorded, and the record lists the backends as given whatever order ran."""
    from dash.bench import in_round_order

    args = argparse.Namespace(steps=1, warmup=0, seed=0, lr=1e-3)
    names = ["dash_det", "dash_nondet", "fa3_nondet"]
    for i in range(3):
        ran = []

        def make(b, gqa, ran=ran):
            ran.append(b)
            return reference_attention

        rec = be.run_case(tiny_model, names, args, lambda s: None, device="cpu", make_attention=make, order_index=i)
        assert ran == rec["backend_order"] == in_round_order(names, i)
        assert list(rec["backends"]) == names
    assert be.run_case(tiny_model, names, args, lambda s: None, device="cpu",
                       make_attention=lambda b, g: reference_attention)["backend_order"] == names


def test_run_case_with_the_real_sdpa_backends_on_cpu(tiny_model):
    """torch_flash and torch_flash_det as the script builds them (sdpa_kernel(FLASH_ATTENTION),
    the GQA probe, torch.use_deterministic_algorithms around the run), on CPU: PyTorch's CPU
    flash kernel takes the same calls. The global flags are restored afterwards."""
    import torch.utils.deterministic as tud

    args = argparse.Namespace(steps=2, warmup=1, seed=0, lr=1e-3)
    before = (torch.are_deterministic_algorithms_enabled(), tud.fill_uninitialized_memory)
    rec = be.run_case(tiny_model, ["torch_flash", "torch_flash_det"], args, lambda s: None, device="cpu")
    assert (torch.are_deterministic_algorithms_enabled(), tud.fill_uninitialized_memory) == before
    for b in ("torch_flash", "torch_flash_det"):
        assert "error" not in rec["backends"][b], rec["backends"][b]
        assert rec["backends"][b]["gqa"] in ("enable_gqa", "repeat_interleave")
    assert rec["determinism"]["torch_flash_det"]["identical"]
    assert rec["backends"]["torch_flash_det"]["loss_max_rel_diff_vs_reference"] < 1e-2


def test_deterministic_algorithms_switch_restores_the_flags():
    import torch.utils.deterministic as tud

    before = (torch.are_deterministic_algorithms_enabled(), tud.fill_uninitialized_memory)
    with be._DeterministicAlgorithms(True):
        assert torch.are_deterministic_algorithms_enabled() and not tud.fill_uninitialized_memory
    assert (torch.are_deterministic_algorithms_enabled(), tud.fill_uninitialized_memory) == before
    with pytest.raises(RuntimeError), be._DeterministicAlgorithms(True):
        raise RuntimeError("a failing run")
    assert (torch.are_deterministic_algorithms_enabled(), tud.fill_uninitialized_memory) == before


def test_gqa_probe_failure_is_a_backend_error(tiny_model):
    args = argparse.Namespace(steps=1, warmup=0, seed=0, lr=1e-3)
    rec = be.run_case(tiny_model, ["torch_cudnn"], args, lambda s: None, device="cpu",
                      make_attention=lambda b, g: reference_attention,
                      probe_gqa=lambda b, c: (None, "enable_gqa: No available kernel"))
    assert "no SDPA kernel for this case" in rec["backends"]["torch_cudnn"]["error"]


# ---------------------------------------------------------------------------------------
# The script on a machine without a CUDA GPU
# ---------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_script_fails_clearly_without_a_gpu(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    assert "bench_e2e.py: error: no CUDA GPU" in p.stderr and "Hopper" in p.stderr
    assert "Traceback" not in p.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_script_help_and_usage_errors_run_anywhere(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "--backends" in p.stdout and "--no-plot" in p.stdout
    p = subprocess.run([sys.executable, str(SCRIPT), "--models", "nope"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "argument --models: 'nope' is unknown" in p.stderr
