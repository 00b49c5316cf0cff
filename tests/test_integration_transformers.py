"""DASH as a Hugging Face transformers attention implementation (dash.integrations.transformers).

CPU tests (everywhere transformers is installed; skipped, with the reason, where it is not):
registration, model construction, the argument translation -- checked by replacing
``dash.api.flash_attn_func`` with a differentiable reference that has FA3's semantics
(bottom-right causal, GQA) and comparing a tiny Llama's forward/backward with
``attn_implementation="sdpa"`` -- and every error path.

GPU tests (``gpu`` marker, skipped without an sm_90 GPU; on a machine that runs GPU tests a
missing transformers fails them, as tests/conftest.py's policy wants): a tiny Llama built in
code trains for a few AdamW steps with DASH in a subprocess (so that CUBLAS_WORKSPACE_CONFIG is
set before cuBLAS starts and ``torch.use_deterministic_algorithms`` does not leak into other
tests); two runs are bit-identical, a second process gives the same bits, and the losses and
first-step gradients (all parameters together, and each attention projection on its own) are
close to an SDPA run. This file is also the subprocess' script (``__main__``).
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import math
import os
import re
import subprocess
import sys
import time
import types
import unittest.mock
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
try:
    import transformers
except ImportError:
    transformers = None

#: Why the tests that need transformers cannot run here (None when they can). Not a
#: module-level skip: that would also skip the GPU tests on a machine with an sm_90 GPU, which
#: must fail instead (tests/conftest.py); CPU tests skip (see _skip_cpu_tests_without_transformers).
TRANSFORMERS_MISSING = (
    "transformers is not installed (pip install 'transformers>=4.51')" if transformers is None
    else f"transformers {transformers.__version__} is older than 4.51 (no AttentionInterface)"
    if getattr(transformers, "AttentionInterface", None) is None else None
)

import torch.nn.functional as F  # noqa: E402

import dash  # noqa: E402
from dash import api as dash_api  # noqa: E402
from dash import reference  # noqa: E402
from dash.config import KERNEL_SCHEDULES  # noqa: E402
from dash import validation  # noqa: E402
from dash.validation import SCHEDULE_NAMES, validate_inputs, validate_varlen_inputs  # noqa: E402

if TRANSFORMERS_MISSING is None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import dash.integrations.transformers as dt

    MASK_INTERFACE = dt._interfaces()[1]
else:
    AutoModelForCausalLM = LlamaConfig = dt = MASK_INTERFACE = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dash.__file__)))


def skip_unless(has_feature: Callable[[], bool], reason: str) -> pytest.MarkDecorator:
    """skipif for a feature of the installed transformers; ``has_feature`` is called only when
    transformers is there (otherwise the reason is TRANSFORMERS_MISSING)."""
    if TRANSFORMERS_MISSING is not None:
        return pytest.mark.skip(reason=TRANSFORMERS_MISSING)
    return pytest.mark.skipif(not has_feature(), reason=reason)


needs_mask_interface = skip_unless(lambda: MASK_INTERFACE is not None, "transformers < 4.53 has no mask interface")


def missing_transformers_outcome(missing: str | None, gpu_test: bool) -> None:
    """Without transformers: a CPU test skips, with the reason; a GPU test fails, with the
    reason. A GPU test only gets here on a machine that runs GPU tests (tests/conftest.py skips
    them everywhere else), where passing by skipping would prove nothing."""
    if missing is None:
        return
    if gpu_test:
        pytest.fail(f"the GPU tests of the transformers integration cannot run on this sm_90 machine: {missing}",
                    pytrace=False)
    pytest.skip(missing)


@pytest.fixture(autouse=True)
def _skip_cpu_tests_without_transformers(request):
    # GPU tests are decided by gpu_runs (module-scoped, so set up before this fixture).
    if "gpu" not in request.keywords:
        missing_transformers_outcome(TRANSFORMERS_MISSING, gpu_test=False)


# ---------------------------------------------------------------------------------------
# A differentiable stand-in for dash.api.flash_attn_func (CPU, any dtype)
# ---------------------------------------------------------------------------------------
class ReferenceFlashAttn:
    """FA3 semantics in plain PyTorch: q (B, Sq, H, D), k/v (B, Sk, Hk, D), bottom-right
    causal, GQA by head groups. Computes in float32, returns q's dtype, records each call.
    ``validate=True`` first runs DASH's own input validation (everything but the device
    checks), so the tensors the integration passes are ones DASH accepts; float32 tests of
    the math turn it off (DASH itself takes bf16/fp16 only)."""

    def __init__(self, validate: bool = True):
        self.validate = validate
        self.calls: list[dict] = []

    def __call__(self, q, k, v, softmax_scale=None, causal=False, deterministic=None, schedule="auto", **kwargs):
        if self.validate:
            validate_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal, schedule=schedule,
                            deterministic=deterministic, check_device=False)
        self.calls.append(dict(q_shape=tuple(q.shape), k_shape=tuple(k.shape), v_shape=tuple(v.shape),
                               q_stride=tuple(q.stride()), q_is_view=q._base is not None, dtype=q.dtype,
                               softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                               schedule=schedule, kwargs=kwargs))
        return reference_attention(q, k, v, softmax_scale, causal)


def reference_attention(q, k, v, softmax_scale=None, causal=False):
    _, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(heads // heads_k, dim=2)
    vv = v.repeat_interleave(heads // heads_k, dim=2)
    mask = None
    if causal:
        mask = torch.arange(seqlen_k)[None, :] <= torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), kk.float().transpose(1, 2),
                                         vv.float().transpose(1, 2), attn_mask=mask, scale=scale)
    return out.transpose(1, 2).to(q.dtype).contiguous()


@pytest.fixture
def fake_dash(monkeypatch):
    fake = ReferenceFlashAttn()
    monkeypatch.setattr(dash_api, "flash_attn_func", fake)
    return fake


class ReferenceFlashAttnVarlen:
    """FA3's flash_attn_varlen_func in plain PyTorch: q (total_q, H, D), k/v (total_k, Hk, D),
    sequences at the int32 offsets, each attended on its own by reference_attention. With
    ``validate=True`` first runs DASH's varlen validation (all but the device checks); records
    each call, offsets as lists."""

    def __init__(self, validate: bool = True):
        self.validate = validate
        self.calls: list[dict] = []

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                 causal=False, deterministic=None, schedule="auto", **kwargs):
        if self.validate:
            def no_device_check(q, k, v, **options):
                validate_inputs(q, k, v, check_device=False, **options)

            with unittest.mock.patch.object(validation, "validate_for_launch", no_device_check):
                validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       softmax_scale=softmax_scale, causal=causal, window_size=(-1, -1), softcap=0.0,
                                       sm_margin=0, schedule=schedule, deterministic=deterministic)
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        self.calls.append(dict(q_shape=tuple(q.shape), k_shape=tuple(k.shape), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dtype=q.dtype,
                               softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                               schedule=schedule, kwargs=kwargs))
        pieces = [reference_attention(q[None, a:b], k[None, c:d], v[None, c:d], softmax_scale, causal)[0]
                  if b > a and d > c else q.new_zeros(b - a, *q.shape[1:]) * q[a:b]
                  for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
        return torch.cat(pieces)


@pytest.fixture
def fake_dash_varlen(monkeypatch):
    fake = ReferenceFlashAttnVarlen()
    monkeypatch.setattr(dash_api, "flash_attn_varlen_func", fake)
    return fake


@pytest.fixture(autouse=True)
def _restore_default_registration():
    yield
    if dt is not None:
        dt.register()  # tests that re-register "dash" with other settings must not leak them


# ---------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------
def tiny_llama_config(heads=4, kv_heads=4, head_dim=64, layers=2, hidden=128, vocab=101, **extra):
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=256, **extra)


def build(config, attn_implementation, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation)
    return model.to(dtype)


def model_pair(config, dtype=torch.float32):
    """The same weights with attn_implementation 'dash' and 'sdpa'."""
    dash_model = build(config, "dash", dtype)
    sdpa_model = build(config, "sdpa", dtype)
    sdpa_model.load_state_dict(dash_model.state_dict())
    return dash_model, sdpa_model


def token_batch(config, batch=2, seqlen=24, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seqlen), generator=gen)


def forward_backward(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def assert_close_models(a, b, rtol, atol, label):
    logits_a, loss_a, grads_a = a
    logits_b, loss_b, grads_b = b
    torch.testing.assert_close(logits_a.float(), logits_b.float(), rtol=rtol, atol=atol, msg=f"{label}: logits")
    torch.testing.assert_close(loss_a.float(), loss_b.float(), rtol=rtol, atol=atol, msg=f"{label}: loss")
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        ga, gb = grads_a[name].float(), grads_b[name].float()
        scale = gb.abs().max().item() or 1.0  # tolerances relative to the gradient's magnitude
        assert (ga - gb).abs().max().item() <= (atol + rtol) * scale, f"{label}: grad of {name}"


def stub_module(is_causal=True, output_attentions=False):
    return types.SimpleNamespace(is_causal=is_causal, config=types.SimpleNamespace(output_attentions=output_attentions))


def bhsd(batch=1, heads=2, seqlen=8, head_dim=64, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, seqlen, head_dim, generator=gen).to(dtype)


# ---------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------
def test_import_registers_dash():
    attention_interface, mask_interface = dt._interfaces()
    assert "dash" in attention_interface()
    assert attention_interface()["dash"].dash_settings == dt.Settings("dash", None, "auto")
    if mask_interface is not None:
        assert "dash" in mask_interface()
    assert dt.registered_names()["dash"] == dt.Settings("dash", None, "auto")


def test_register_is_idempotent():
    attention_interface, mask_interface = dt._interfaces()
    first = attention_interface()["dash"]
    assert dt.register() == "dash"
    assert dt.register() == "dash"
    assert attention_interface()["dash"] is first
    if mask_interface is not None:
        assert mask_interface()["dash"] is dt._registered["dash"][2]
    # Other settings replace the registration; the last call wins.
    dt.register(deterministic=True, schedule="fa3")
    assert attention_interface()["dash"].dash_settings == dt.Settings("dash", True, "fa3")
    dt.register()
    assert attention_interface()["dash"].dash_settings == dt.Settings("dash", None, "auto")


def test_register_under_another_name_with_settings(fake_dash):
    assert dt.register("dash_det", deterministic=True) == "dash_det"
    assert dt.register("dash_det", deterministic=True) == "dash_det"
    config = tiny_llama_config()
    model = build(config, "dash_det", torch.bfloat16)
    model(token_batch(config), use_cache=False)
    assert fake_dash.calls and all(c["deterministic"] is True and c["schedule"] == "auto" for c in fake_dash.calls)


@pytest.mark.parametrize("name", ["", "sdpa", "my_flash", "kernels-community/flash", "paged|dash", "dash det",
                                  "eager", "FLEX", 3, None])
def test_register_rejects_names_transformers_reserves(name):
    with pytest.raises(ValueError, match="name="):
        dt.register(name)


def test_register_rejects_bad_settings():
    with pytest.raises(TypeError, match="deterministic"):
        dt.register(deterministic="yes")
    with pytest.raises(ValueError, match="schedule='nope' is unknown"):
        dt.register(schedule="nope")
    unimplemented = [s for s in SCHEDULE_NAMES if s != "auto" and s not in KERNEL_SCHEDULES]
    if unimplemented:
        with pytest.raises(NotImplementedError, match=f"schedule='{unimplemented[0]}'"):
            dt.register(schedule=unimplemented[0])


def test_old_transformers_error_names_the_minimum_version():
    old = types.SimpleNamespace(__version__="4.50.3")
    with pytest.raises(ImportError, match=r"transformers 4\.50\.3 has no AttentionInterface.*>= 4\.51"):
        dt._interfaces(old)


def test_importing_dash_does_not_import_transformers():
    code = "import sys, dash, dash.integrations; assert 'transformers' not in sys.modules, 'imported transformers'"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_without_transformers_cpu_tests_skip_and_gpu_tests_fail(tmp_path):
    """tests/conftest.py's policy: on a machine that runs GPU tests (simulated here), a missing
    transformers fails this file's GPU tests with the reason; its CPU tests skip. (The file
    used to skip as a whole, GPU tests included.)"""
    (tmp_path / "hide_transformers.py").write_text(
        "import sys\n"
        "sys.modules['transformers'] = None  # import transformers -> ImportError\n"
        "def pytest_sessionstart(session):\n"
        "    for p in session.config.pluginmanager.get_plugins():  # tests/conftest.py: an sm_90 machine\n"
        "        if hasattr(p, 'sm90_state') and hasattr(p, '_GPU_STATE'):\n"
        "            p._GPU_STATE = ('run', None)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    here = os.path.abspath(__file__)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "hide_transformers", "-p", "no:cacheprovider", here,
           "-k", "gpu_training or harness_on_cpu"]
    p = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(here)), env=env, capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert re.search(rf"\b1 skipped, .*\b{2 * len(GPU_CONFIGS)} errors\b", out), out
    assert "SKIPPED [1] " in out and "transformers is not installed" in out
    assert out.count("the GPU tests of the transformers integration cannot run on this sm_90 machine: transformers "
                     "is not installed") >= 8, out


# ---------------------------------------------------------------------------------------
# Construction and switching
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_from_config_builds_with_dash(heads, kv_heads):
    model = build(tiny_llama_config(heads=heads, kv_heads=kv_heads), "dash")
    assert model.config._attn_implementation == "dash"


@skip_unless(lambda: hasattr(transformers.PreTrainedModel, "set_attn_implementation"),
             "this transformers has no PreTrainedModel.set_attn_implementation")
def test_set_attn_implementation_switches_a_model_to_dash(fake_dash):
    fake_dash.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    model = build(config, "sdpa")
    ids = token_batch(config)
    before = model(ids, use_cache=False).logits
    assert not fake_dash.calls
    model.set_attn_implementation("dash")
    assert model.config._attn_implementation == "dash"
    after = model(ids, use_cache=False).logits
    assert len(fake_dash.calls) == config.num_hidden_layers
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Argument translation: DASH (reference stand-in) vs SDPA on a tiny Llama
# ---------------------------------------------------------------------------------------
CONFIGS = {
    "mha-hd64": dict(heads=4, kv_heads=4, head_dim=64),
    "gqa-8x2-hd64": dict(heads=8, kv_heads=2, head_dim=64),
    "mqa-4x1-hd128": dict(heads=4, kv_heads=1, head_dim=128),
}


@pytest.mark.parametrize("label", list(CONFIGS))
def test_forward_backward_match_sdpa_float32(label, fake_dash):
    fake_dash.validate = False  # float32: DASH would reject the dtype; this test is about the math
    config = tiny_llama_config(**CONFIGS[label])
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config)
    a = forward_backward(dash_model, ids)
    b = forward_backward(sdpa_model, ids)
    assert_close_models(a, b, rtol=1e-4, atol=1e-5, label=label)
    assert len(fake_dash.calls) == config.num_hidden_layers
    heads, kv_heads, head_dim = (CONFIGS[label][k] for k in ("heads", "kv_heads", "head_dim"))
    for call in fake_dash.calls:
        assert call["q_shape"] == (2, 24, heads, head_dim)
        assert call["k_shape"] == call["v_shape"] == (2, 24, kv_heads, head_dim)  # GQA heads go in unrepeated
        assert call["causal"] is True
        assert call["softmax_scale"] == pytest.approx(head_dim**-0.5)
        assert call["deterministic"] is None and call["schedule"] == "auto"


@pytest.mark.parametrize("label", list(CONFIGS))
def test_bf16_inputs_pass_dash_validation_without_copies(label, fake_dash):
    config = tiny_llama_config(**CONFIGS[label])
    dash_model, sdpa_model = model_pair(config, torch.bfloat16)
    ids = token_batch(config)
    a = forward_backward(dash_model, ids)
    b = forward_backward(sdpa_model, ids)
    assert_close_models(a, b, rtol=3e-2, atol=3e-2, label=label)
    heads, head_dim = CONFIGS[label]["heads"], CONFIGS[label]["head_dim"]
    seqlen = 24
    for call in fake_dash.calls:
        assert call["dtype"] == torch.bfloat16
        # q is a (B, S, H, D) view of transformers' (B, H, S, D) tensor (whose memory may be
        # either order): no copy was made
        assert call["q_is_view"]
        assert call["q_stride"] in [(heads * seqlen * head_dim, heads * head_dim, head_dim, 1),
                                    (heads * seqlen * head_dim, head_dim, seqlen * head_dim, 1)]


def test_custom_scaling_is_passed_as_softmax_scale(fake_dash):
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    out, weights = dt.attention_forward(stub_module(), q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (1, 8, 2, 64)
    assert fake_dash.calls[-1]["softmax_scale"] == 0.3
    torch.testing.assert_close(out, reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.3,
                                                        True))


def test_reference_stand_in_has_fa3_semantics():
    """The stand-in agrees with dash.reference (bottom-right causal, GQA groups)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, 64, generator=gen)
    k = torch.randn(2, 9, 2, 64, generator=gen)
    v = torch.randn(2, 9, 2, 64, generator=gen)
    for causal in (False, True):
        expected, _ = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float64)
        torch.testing.assert_close(reference_attention(q, k, v, None, causal).double(), expected, rtol=1e-5, atol=1e-6)


def test_generate_matches_sdpa(fake_dash):
    """Prefill and single-token decode steps with a KV cache (seqlen_q < seqlen_k: bottom-right causal)."""
    fake_dash.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    dash_model, sdpa_model = model_pair(config)
    dash_model.eval()
    sdpa_model.eval()
    prompt = token_batch(config, batch=1, seqlen=7)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(dash_model.generate(prompt, **kwargs), sdpa_model.generate(prompt, **kwargs))
    assert any(c["q_shape"][1] == 1 and c["k_shape"][1] > 1 for c in fake_dash.calls)


def test_inference_mode_matches_sdpa(fake_dash):
    """Under torch.inference_mode() every tensor the model makes (position_ids, masks) is an
    inference tensor, which has no version counter: reading it raised in every forward."""
    fake_dash.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    dash_model, sdpa_model = model_pair(config)
    dash_model.eval()
    sdpa_model.eval()
    ids = token_batch(config, seqlen=16)
    causal_4d = torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 1, 16, 16)
    for kwargs in ({}, {"position_ids": torch.arange(16).expand(2, 16)}, {"attention_mask": torch.ones_like(ids)},
                   {"attention_mask": causal_4d}):
        with torch.inference_mode():
            kwargs = {k: v.clone() for k, v in kwargs.items()}  # made inside, as a pipeline makes them
            assert all(v.is_inference() for v in kwargs.values())
            a = dash_model(ids, use_cache=False, **kwargs).logits
            b = sdpa_model(ids, use_cache=False, **kwargs).logits
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"inference_mode, {list(kwargs)}")
    prompt = token_batch(config, batch=1, seqlen=7)
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        assert torch.equal(dash_model.generate(prompt, **gen), sdpa_model.generate(prompt, **gen))


def test_inference_tensors_are_checked_on_every_call():
    """Inference tensors can be modified in place inside inference mode without any version
    to show it, so their verdicts are never cached: a changed tensor is judged again."""
    with torch.inference_mode():
        mask_2d = torch.ones(2, 8, dtype=torch.long)
        mask_4d = _causal_4d(8, 8)
        position_ids = torch.arange(8)[None].clone()
        assert dt._mask_decides_causal("dash", mask_2d, True, 8, 8) is True
        assert dt._mask_decides_causal("dash", mask_4d, True, 8, 8) is True
        dt._check_position_ids("dash", position_ids, 8)
        mask_2d[1, 0] = 0
        mask_4d[0, 0, 3, 1] = False
        position_ids[0, 4] = 0
        with pytest.raises(NotImplementedError, match="padding mask"):
            dt._mask_decides_causal("dash", mask_2d, True, 8, 8)
        with pytest.raises(NotImplementedError, match="custom attention mask"):
            dt._mask_decides_causal("dash", mask_4d, True, 8, 8)
        with pytest.raises(NotImplementedError, match="packed sequences"):
            dt._check_position_ids("dash", position_ids, 8)


def test_verdict_cache_is_consistent_across_threads():
    """nn.DataParallel runs replicas in threads that share the verdict cache: a reader must
    never get another thread's verdict for its tensor (the cache used to store the tensor, key
    and verdict in three assignments, and a thread switch between them mixed two entries)."""
    import threading

    cache = dt._LastVerdict()
    wrong: list[tuple[str, str]] = []
    deadline = time.time() + 1.0

    def worker(t, verdict):
        while time.time() < deadline and not wrong:
            cache.put(t, "key", verdict)  # same key and tensor version: only the entry tells them apart
            got = cache.get(t, "key")
            if got is not None and got != verdict:
                wrong.append((verdict, got))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=worker, args=(torch.zeros(1), v)) for v in ("A", "B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, f"a thread got another thread's verdict: {wrong[:3]}"


@needs_mask_interface
def test_mask_function_rejects_a_mask_shorter_than_the_keys():
    """transformers pads a 2D mask shorter than the keys with zeros, i.e. the keys it does not
    cover are padding (a StaticCache's unfilled slots). A causal mask meets the static-cache
    check; a bidirectional one used to pass, and DASH attended to the unfilled slots."""
    from transformers import masking_utils as mu

    if not hasattr(mu, "bidirectional_mask_function"):
        pytest.skip(f"transformers {transformers.__version__} has no bidirectional_mask_function")
    bidirectional, causal = mu.bidirectional_mask_function, mu.causal_mask_function
    ones = torch.ones(1, 6, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match=r"does not support a padding mask: attention_mask \(shape \(1, 6\)\) "
                                                  r"covers 6 key positions but the keys span positions 0\.\.9"):
        _mask_fn(batch_size=1, q_length=6, kv_length=10, attention_mask=ones, mask_function=bidirectional)
    with pytest.raises(NotImplementedError, match=r"KV cache longer than the tokens it holds"):
        _mask_fn(batch_size=1, q_length=6, kv_length=10, attention_mask=ones, mask_function=causal)
    # A decode step whose mask misses its own key: padding, whatever the mask kind.
    for fn in (bidirectional, causal):
        with pytest.raises(NotImplementedError, match="covers 6 key positions but the keys span positions 0..6"):
            _mask_fn(batch_size=1, q_length=1, kv_length=7, q_offset=6, attention_mask=ones, mask_function=fn)
    # Masks covering the keys, or longer (only the keys' columns are read), are fine.
    for mask in (torch.ones(1, 10), torch.ones(1, 12, dtype=torch.long)):
        assert _mask_fn(batch_size=1, q_length=6, kv_length=10, attention_mask=mask,
                        mask_function=bidirectional) is None
    assert _mask_fn(batch_size=1, q_length=1, kv_length=7, q_offset=6, attention_mask=torch.ones(1, 7),
                    mask_function=causal) is None


needs_is_causal_kwarg = skip_unless(
    lambda: "is_causal" in getattr(getattr(transformers.utils.generic, "TransformersKwargs", None), "__annotations__",
                                   {}),
    "this transformers has no is_causal forward kwarg")


@needs_is_causal_kwarg
def test_is_causal_false_runs_bidirectional(fake_dash):
    fake_dash.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config)
    a = dash_model(ids, use_cache=False, is_causal=False).logits
    b = sdpa_model(ids, use_cache=False, is_causal=False).logits
    assert fake_dash.calls and all(c["causal"] is False for c in fake_dash.calls)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@needs_is_causal_kwarg
def test_bidirectional_forward_with_a_static_cache_raises(fake_dash):
    """A StaticCache longer than its tokens with is_causal=False: SDPA masks the unfilled slots
    (transformers counts the keys the 2D mask does not cover as padding); DASH used to attend to
    them and returned other logits without a word."""
    from transformers import StaticCache

    fake_dash.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config, batch=1, seqlen=7)
    kwargs = dict(attention_mask=torch.ones_like(ids), use_cache=True, is_causal=False)
    # transformers 5.x renamed past_key_values to cache (the old name warns)
    cache_kw = "cache" if "cache" in inspect.signature(type(dash_model).forward).parameters else "past_key_values"
    with torch.no_grad():
        sdpa_model(ids, **{cache_kw: StaticCache(config=sdpa_model.config, max_cache_len=16)}, **kwargs)
        message = (r"does not support a padding mask: attention_mask \(shape \(1, 7\)\) covers 7 key positions but "
                   r"the keys span positions 0\.\.15")
        with pytest.raises(NotImplementedError, match=message):
            dash_model(ids, **{cache_kw: StaticCache(config=dash_model.config, max_cache_len=16)}, **kwargs)
    assert not fake_dash.calls


def _breaks_in_integration(explanation):
    here = os.path.join("integrations", "transformers.py")
    return [r for r in explanation.break_reasons if any(f.filename.endswith(here) for f in r.user_stack)]


def test_torch_compile_traces_the_attention_function(fake_dash):
    """TorchDynamo traces the attention function without a graph break (the mask function,
    which inspects transformers' mask closures, runs eagerly: it is not in the trace). With
    transformers < 4.53 the model hands a 4D mask to every layer, whose check does break."""
    fake_dash.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    model = build(config, "dash")
    ids = token_batch(config)
    run = lambda x: model(x, use_cache=False).logits  # noqa: E731
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(run)(ids)
        if MASK_INTERFACE is not None:
            assert not _breaks_in_integration(explanation), _breaks_in_integration(explanation)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(run, backend="eager")(ids), run(ids))
    finally:
        torch._dynamo.reset()


@needs_mask_interface
def test_torch_compile_fullgraph_per_decoder_layer(monkeypatch):
    """fullgraph=True cannot trace a whole model: the mask function, which reads transformers'
    mask closures, is torch.compiler.disable'd. Each decoder layer compiles with fullgraph=True
    (what docs/transformers.md recommends), forward and backward."""
    def stand_in(q, k, v, softmax_scale=None, causal=False, **kwargs):  # records nothing: no guards on state
        return reference_attention(q, k, v, softmax_scale, causal)

    monkeypatch.setattr(dash_api, "flash_attn_func", stand_in)
    config = tiny_llama_config(heads=8, kv_heads=2)
    model = build(config, "dash")
    ids = token_batch(config)
    expected = model(ids, use_cache=False).logits.detach()
    torch._dynamo.reset()
    try:
        whole = torch.compile(lambda x: model(x, use_cache=False).logits, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match="disable"):
            whole(ids)
        torch._dynamo.reset()
        for layer in model.model.layers:
            layer.compile(backend="eager", fullgraph=True)
        for position_ids in (None, torch.arange(24).expand(2, 24)):
            logits = model(ids, position_ids=position_ids, use_cache=False).logits
            torch.testing.assert_close(logits, expected)
        logits.sum().backward()
        assert all(p.grad is not None for p in model.model.layers[0].self_attn.parameters())
    finally:
        torch._dynamo.reset()


def traced_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                            causal=False, **kwargs):
    """A stand-in for flash_attn_varlen_func that TorchDynamo traces (no host reads): one
    block-diagonal masked attention over all rows (sequences of equal q / k lengths)."""
    rows = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_seqlens_q, rows, right=True) - 1
    visible = seq[:, None] == seq[None, :]
    if causal:
        visible = visible & (rows[None, :] <= rows[:, None])
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    vv = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), kk.float().transpose(0, 1),
                                         vv.float().transpose(0, 1), attn_mask=visible, scale=softmax_scale)
    return out.transpose(0, 1).to(q.dtype)


@needs_mask_interface
def test_torch_compile_fullgraph_per_decoder_layer_packed(monkeypatch):
    """A packed batch's description is made by the (eager) mask function and handed to the
    layers: decoder layers compiled with fullgraph=True trace the varlen route, forward and
    backward, and agree with the eager model."""
    monkeypatch.setattr(dash_api, "flash_attn_varlen_func", traced_varlen_attention)
    config = tiny_llama_config(heads=8, kv_heads=2)
    model = build(config, "dash")
    ids = token_batch(config, batch=2, seqlen=12)
    position_ids = _packed_position_ids([[5, 7], [3, 3, 6]])
    expected = model(ids, position_ids=position_ids, use_cache=False).logits.detach()
    torch._dynamo.reset()
    try:
        for layer in model.model.layers:
            layer.compile(backend="eager", fullgraph=True)
        logits = model(ids, position_ids=position_ids, use_cache=False).logits
        torch.testing.assert_close(logits, expected)
        logits.sum().backward()
        assert all(p.grad is not None for p in model.model.layers[0].self_attn.parameters())
    finally:
        torch._dynamo.reset()


def test_torch_compile_still_rejects_packed_position_ids(fake_dash):
    """Compiled, the position_ids check is an asynchronous assert (no graph break); on CPU it
    raises at once, on CUDA as a device-side assert."""
    fake_dash.validate = False
    q, k, v = bhsd(seqlen=8), bhsd(seqlen=8, seed=1), bhsd(seqlen=8, seed=2)
    module = torch.nn.Module()
    module.is_causal = True
    step = lambda q, k, v, pos: dt.attention_forward(module, q, k, v, None, position_ids=pos)[0]  # noqa: E731
    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        compiled(q, k, v, torch.arange(8)[None])
        with pytest.raises(RuntimeError, match=r"does not support packed sequences \(varlen\)"):
            compiled(q, k, v, torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))
    finally:
        torch._dynamo.reset()


def test_autocast_float32_inputs_are_cast(fake_dash):
    """Under torch.autocast, float32 q/k/v (e.g. after a float32 RoPE) go to DASH in the
    autocast dtype, as SDPA would compute them."""
    q, k, v = (bhsd(dtype=torch.float32, seed=s) for s in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = dt.attention_forward(stub_module(), q, k, v, None)
    assert fake_dash.calls[-1]["dtype"] == torch.bfloat16 and out.dtype == torch.bfloat16
    config = tiny_llama_config(heads=8, kv_heads=2)
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = dash_model(ids, use_cache=False).logits
        b = sdpa_model(ids, use_cache=False).logits
    torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


def test_all_ones_padding_mask_is_accepted(fake_dash):
    fake_dash.validate = False
    config = tiny_llama_config()
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config)
    ones = torch.ones_like(ids)
    torch.testing.assert_close(dash_model(ids, attention_mask=ones, use_cache=False).logits,
                               sdpa_model(ids, use_cache=False).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["bool-causal", "float-causal", "bool-full"])
def test_exact_4d_masks_are_accepted(kind, fake_dash):
    """A 4D mask that is exactly causal or exactly all-visible decides causality, as in SDPA."""
    fake_dash.validate = False
    config = tiny_llama_config()
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config, seqlen=16)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    mask = {"bool-causal": causal, "bool-full": torch.ones(16, 16, dtype=torch.bool),
            "float-causal": torch.zeros(16, 16).masked_fill(~causal, torch.finfo(torch.float32).min)}[kind]
    mask = mask.expand(2, 1, 16, 16)
    a = dash_model(ids, attention_mask=mask, use_cache=False).logits
    b = sdpa_model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert all(c["causal"] is (kind != "bool-full") for c in fake_dash.calls)


# ---------------------------------------------------------------------------------------
# Packed and padded batches: flash_attn_varlen_func on the kept tokens
# ---------------------------------------------------------------------------------------
def _offsets_of(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _packed_position_ids(rows_of_lengths):
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows_of_lengths])


def _padding_mask(batch, seqlen, kept, sides):
    mask = torch.zeros(batch, seqlen, dtype=torch.long)
    for b, (n, side) in enumerate(zip(kept, sides)):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, seqlen - n:] = 1
    return mask


def forward_backward_masked(model, ids, attention_mask, **kwargs):
    """forward_backward with the loss on the kept tokens only (labels -100 at padding)."""
    model.zero_grad(set_to_none=True)
    labels = ids.masked_fill(attention_mask == 0, -100)
    out = model(input_ids=ids, attention_mask=attention_mask, labels=labels, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


@needs_mask_interface
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("rows_of_lengths", [[[5, 3, 1, 7]], [[4, 12], [9, 2, 5]]], ids=["batch1", "batch2"])
def test_packed_position_ids_match_sdpa(kv_heads, rows_of_lengths, fake_dash, fake_dash_varlen):
    """Sequences packed along rows (position_ids restart, as DataCollatorWithFlattening makes
    them): DASH runs flash_attn_varlen_func per forward with the sequences' offsets; SDPA gets
    transformers' block-diagonal mask. Forward, loss and every gradient agree."""
    fake_dash_varlen.validate = False  # float32 model: the math only
    config = tiny_llama_config(kv_heads=kv_heads)
    dash_model, sdpa_model = model_pair(config)
    seqlen = sum(rows_of_lengths[0])
    ids = token_batch(config, batch=len(rows_of_lengths), seqlen=seqlen)
    position_ids = _packed_position_ids(rows_of_lengths)
    a = forward_backward(dash_model, ids, position_ids=position_ids)
    b = forward_backward(sdpa_model, ids, position_ids=position_ids)
    assert_close_models(a, b, rtol=1e-4, atol=1e-5, label="packed")
    assert not fake_dash.calls
    assert len(fake_dash_varlen.calls) == config.num_hidden_layers
    lengths = [n for row in rows_of_lengths for n in row]
    for call in fake_dash_varlen.calls:
        assert call["cu_seqlens_q"] == call["cu_seqlens_k"] == _offsets_of(lengths)
        assert call["max_seqlen_q"] == call["max_seqlen_k"] == max(lengths)
        assert call["causal"] is True and call["q_shape"] == (len(rows_of_lengths) * seqlen, 4, 64)


@needs_mask_interface
def test_packed_bf16_batch_passes_dash_validation(fake_dash_varlen):
    """What reaches flash_attn_varlen_func for a bf16 model passes DASH's own validation
    (int32 offsets, exact maxima, layouts), and the model's settings reach it."""
    dt.register("dash", deterministic=True, schedule="fa3")
    config = tiny_llama_config(heads=8, kv_heads=2)
    dash_model, sdpa_model = model_pair(config, dtype=torch.bfloat16)
    ids = token_batch(config, batch=1, seqlen=20)
    position_ids = _packed_position_ids([[6, 6, 8]])
    a = forward_backward(dash_model, ids, position_ids=position_ids)
    b = forward_backward(sdpa_model, ids, position_ids=position_ids)
    assert_close_models(a, b, rtol=3e-2, atol=3e-2, label="packed bf16")
    assert len(fake_dash_varlen.calls) == config.num_hidden_layers
    assert all(c["deterministic"] is True and c["schedule"] == "fa3" and c["dtype"] == torch.bfloat16
               for c in fake_dash_varlen.calls)


@needs_mask_interface
def test_packed_batch_with_a_schedule_varlen_lacks_raises(fake_dash_varlen):
    """shift is not built for varlen: DASH's own error, not a silent substitute."""
    dt.register("dash", deterministic=True, schedule="shift")
    config = tiny_llama_config()
    model = build(config, "dash", dtype=torch.bfloat16)
    ids = token_batch(config, batch=1, seqlen=12)
    with pytest.raises(NotImplementedError, match="schedule='shift' is not built for variable-length batches"):
        model(ids, position_ids=_packed_position_ids([[5, 7]]), use_cache=False)


@needs_mask_interface
@pytest.mark.parametrize("sides", [("right", "right", "right"), ("left", "left", "left"), ("right", "left", "right")])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_padded_batch_matches_sdpa(sides, kv_heads, fake_dash, fake_dash_varlen):
    """A 2D padding mask: DASH attends over each row's real tokens with
    flash_attn_varlen_func (padded query rows give zeros, as in transformers' flash paths);
    the logits of real tokens, the loss over them and every gradient agree with SDPA."""
    fake_dash_varlen.validate = False
    config = tiny_llama_config(kv_heads=kv_heads)
    dash_model, sdpa_model = model_pair(config)
    seqlen, kept = 14, [14, 9, 3]
    ids = token_batch(config, batch=3, seqlen=seqlen)
    mask = _padding_mask(3, seqlen, kept, sides)
    a = forward_backward_masked(dash_model, ids, mask)
    b = forward_backward_masked(sdpa_model, ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(a[0][keep], b[0][keep], rtol=1e-4, atol=1e-5)
    assert_close_models((a[0][keep], a[1], a[2]), (b[0][keep], b[1], b[2]), rtol=1e-4, atol=1e-5, label="padded")
    assert not fake_dash.calls and len(fake_dash_varlen.calls) == config.num_hidden_layers
    for call in fake_dash_varlen.calls:
        assert call["cu_seqlens_q"] == call["cu_seqlens_k"] == _offsets_of(kept)
        assert call["max_seqlen_q"] == call["max_seqlen_k"] == 14 and call["q_shape"][0] == sum(kept)


@needs_mask_interface
def test_generate_with_left_padding_matches_sdpa(fake_dash, fake_dash_varlen):
    """Batched generation with left padding: the prefill and every decode step (one query per
    row against the cache) run on the real tokens; greedy outputs equal SDPA's."""
    fake_dash_varlen.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    dash_model, sdpa_model = model_pair(config)
    dash_model.eval()
    sdpa_model.eval()
    prompt = token_batch(config, batch=3, seqlen=9)
    mask = _padding_mask(3, 9, [9, 4, 6], ["left"] * 3)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(dash_model.generate(prompt, **kwargs), sdpa_model.generate(prompt, **kwargs))
    decode = [c for c in fake_dash_varlen.calls if c["q_shape"][0] == 3]
    assert decode and all(c["cu_seqlens_q"] == [0, 1, 2, 3] and c["max_seqlen_q"] == 1 for c in decode)
    assert decode[-1]["cu_seqlens_k"] == _offsets_of([9 + 5, 4 + 5, 6 + 5])


@needs_mask_interface
@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_flattening_collator_matches_sdpa(flash_kwargs, fake_dash, fake_dash_varlen):
    """DataCollatorWithFlattening batches: position_ids only, or with FA's cu_seq_lens /
    max_length keywords (which DASH then takes as given)."""
    from transformers import DataCollatorWithFlattening

    fake_dash_varlen.validate = False
    config = tiny_llama_config(kv_heads=2)
    dash_model, sdpa_model = model_pair(config)
    gen = torch.Generator().manual_seed(3)
    features = [{"input_ids": torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()} for n in (7, 3, 11)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features)
    assert ("cu_seq_lens_q" in batch) is flash_kwargs
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    a = forward_backward(dash_model, batch["input_ids"], **{k: v for k, v in inputs.items() if k != "input_ids"})
    b = forward_backward(sdpa_model, batch["input_ids"], position_ids=batch["position_ids"])
    assert_close_models(a, b, rtol=1e-4, atol=1e-5, label="collator")
    assert len(fake_dash_varlen.calls) == config.num_hidden_layers and not fake_dash.calls
    assert all(c["cu_seqlens_q"] == [0, 7, 10, 21] and c["max_seqlen_q"] == 11 for c in fake_dash_varlen.calls)


def test_varlen_keywords_in_the_attention_function(fake_dash, fake_dash_varlen):
    """FA's keywords: int64 offsets become int32, missing maxima are computed, seq_idx is not
    read; half a description, or one beside a padding mask, is an error."""
    q, k, v = bhsd(seqlen=12), bhsd(seqlen=12, seed=1), bhsd(seqlen=12, seed=2)
    cu = torch.tensor([0, 5, 12])
    out, _ = dt.attention_forward(stub_module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                  seq_idx=torch.tensor([[0] * 5 + [1] * 7]))
    call = fake_dash_varlen.calls[-1]
    assert call["cu_seqlens_q"] == [0, 5, 12] and call["max_seqlen_q"] == call["max_seqlen_k"] == 7
    qr, kr, vr = (t.transpose(1, 2)[0] for t in (q, k, v))
    for a, b in ((0, 5), (5, 12)):
        torch.testing.assert_close(out[0, a:b], reference_attention(qr[None, a:b], kr[None, a:b], vr[None, a:b],
                                                                    None, True)[0])
    dt.attention_forward(stub_module(), q, k, v, None, cu_seq_lens_q=cu.int(), cu_seq_lens_k=cu.int(),
                         max_length_q=torch.tensor(7), max_length_k=7)
    assert fake_dash_varlen.calls[-1]["max_seqlen_q"] == 7
    with pytest.raises(ValueError, match="need both cu_seq_lens_q and cu_seq_lens_k"):
        dt.attention_forward(stub_module(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=7)
    padded = torch.ones(1, 12, dtype=torch.long)
    padded[0, :2] = 0
    with pytest.raises(ValueError, match="both a padding mask and cu_seq_lens_q/k"):
        dt.attention_forward(stub_module(), q, k, v, padded, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    # an all-ones 2D mask describes nothing: the offsets decide
    dt.attention_forward(stub_module(), q, k, v, torch.ones(1, 12), cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert fake_dash_varlen.calls[-1]["cu_seqlens_q"] == [0, 5, 12]
    assert not fake_dash.calls


def test_two_d_padding_mask_given_to_the_attention_function(fake_dash, fake_dash_varlen, monkeypatch):
    """A 2D mask handed to the attention function directly (transformers without a mask
    interface, or a caller): read once per tensor version across the layers sharing it; rows
    with no real token come out as zeros, and a batch with none calls nothing."""
    fake_dash_varlen.validate = False
    real = dt._rows_from_padding_mask
    built = []
    monkeypatch.setattr(dt, "_rows_from_padding_mask", lambda *a: built.append(1) or real(*a))
    q, k, v = bhsd(batch=3, seqlen=8), bhsd(batch=3, seqlen=8, seed=1), bhsd(batch=3, seqlen=8, seed=2)
    mask = _padding_mask(3, 8, [8, 0, 5], ["right", "right", "left"])
    for _ in range(3):
        out, _ = dt.attention_forward(stub_module(), q, k, v, mask)
    assert len(built) == 1
    assert fake_dash_varlen.calls[-1]["cu_seqlens_q"] == [0, 8, 8, 13]
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[2, :3]) == 0
    ref = reference_attention(q[2:3, :, 3:].transpose(1, 2), k[2:3, :, 3:].transpose(1, 2),
                              v[2:3, :, 3:].transpose(1, 2), None, True)
    torch.testing.assert_close(out[2:3, 3:], ref)
    mask[0, :2] = 0  # modified in place: read again
    dt.attention_forward(stub_module(), q, k, v, mask)
    assert len(built) == 2 and fake_dash_varlen.calls[-1]["cu_seqlens_q"] == [0, 6, 6, 11]
    n = len(fake_dash_varlen.calls)
    out, _ = dt.attention_forward(stub_module(), q, k, v, torch.zeros(3, 8))
    assert torch.count_nonzero(out) == 0 and out.shape == (3, 8, 2, 64) and len(fake_dash_varlen.calls) == n
    assert not fake_dash.calls


def test_bidirectional_packed_rows(fake_dash_varlen):
    """Encoders (is_causal=False) attend within each packed sequence in full."""
    q, k, v = bhsd(seqlen=10), bhsd(seqlen=10, seed=1), bhsd(seqlen=10, seed=2)
    rows = dt._rows_from_sequence_ids(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]]))
    out, _ = dt.attention_forward(stub_module(is_causal=False), q, k, v, rows)
    assert fake_dash_varlen.calls[-1]["causal"] is False
    qr, kr, vr = (t.transpose(1, 2) for t in (q, k, v))
    torch.testing.assert_close(out[:, 4:], reference_attention(qr[:, 4:], kr[:, 4:], vr[:, 4:], None, False))


@needs_mask_interface
def test_mask_function_describes_packed_and_padded_batches():
    from transformers import masking_utils as mu

    causal = mu.causal_mask_function
    if hasattr(mu, "packed_sequence_mask_function"):
        seq_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 1]])
        rows = _mask_fn(batch_size=2, q_length=6, kv_length=6,
                        mask_function=mu.and_masks(causal, mu.packed_sequence_mask_function(seq_ids)))
        assert isinstance(rows, dt.VarlenRows) and rows.kind == "packed" and rows.indices_q is None
        assert rows.cu_seqlens_q.tolist() == [0, 3, 5, 6, 8, 12] and rows.cu_seqlens_q.dtype == torch.int32
        assert rows.max_seqlen_q == rows.max_seqlen_k == 4
        # a window covering the longest packed sequence cuts nothing; a shorter one raises
        window = mu.and_masks(mu.sliding_window_causal_mask_function(4), mu.packed_sequence_mask_function(seq_ids))
        assert isinstance(_mask_fn(batch_size=2, q_length=6, kv_length=6, mask_function=window), dt.VarlenRows)
        window = mu.and_masks(mu.sliding_window_causal_mask_function(3), mu.packed_sequence_mask_function(seq_ids))
        with pytest.raises(NotImplementedError, match="sliding_window=3 is shorter than the 4 keys of this forward's "
                                                      "longest packed sequence"):
            _mask_fn(batch_size=2, q_length=6, kv_length=6, mask_function=window)
        # under torch.compile transformers adds the packed-sequence leaf even for one sequence per row
        single = mu.and_masks(causal, mu.packed_sequence_mask_function(torch.zeros(1, 6, dtype=torch.long)))
        assert _mask_fn(batch_size=1, q_length=6, kv_length=6, mask_function=single) is None
    padded = torch.ones(2, 8, dtype=torch.bool)
    padded[0, :3] = False
    rows = _mask_fn(batch_size=2, q_length=8, kv_length=8, attention_mask=padded, mask_function=causal)
    assert rows.kind == "padding" and rows.cu_seqlens_k.tolist() == [0, 5, 13] and rows.max_seqlen_k == 8
    assert rows.indices_k.tolist() == [3, 4, 5, 6, 7] + list(range(8, 16)) and rows.indices_q is rows.indices_k
    # a decode step: one query per row (the newest token) against the kept keys
    rows = _mask_fn(batch_size=2, q_length=1, kv_length=8, q_offset=7, attention_mask=padded, mask_function=causal)
    assert rows.cu_seqlens_q.tolist() == [0, 1, 2] and rows.indices_q.tolist() == [0, 1] and rows.max_seqlen_q == 1
    assert rows.cu_seqlens_k.tolist() == [0, 5, 13]


# ---------------------------------------------------------------------------------------
# Errors: each names the feature and its value, never a fallback
# ---------------------------------------------------------------------------------------
def test_custom_4d_mask_raises(fake_dash):
    config = tiny_llama_config()
    model = build(config, "dash")
    ids = token_batch(config, seqlen=8)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    mask[5, 2] = False
    with pytest.raises(NotImplementedError, match=r"does not support a custom attention mask: the 4D attention_mask"):
        model(ids, attention_mask=mask.expand(2, 1, 8, 8), use_cache=False)


@pytest.mark.parametrize("causal", [True, False])
def test_padded_4d_mask_is_named_a_padding_mask(causal):
    """The 4D masks transformers < 4.53 builds from a padded 2D mask (or users pass)."""
    q, k, v = bhsd(batch=2), bhsd(batch=2, seed=1), bhsd(batch=2, seed=2)
    keep = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    if causal:
        keep &= torch.ones(8, 8, dtype=torch.bool).tril()
    keep[1, ..., :3] = False  # left padding of the second sequence
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    with pytest.raises(NotImplementedError, match=r"does not support a padding mask: the 4D attention_mask"):
        dt.attention_forward(stub_module(is_causal=causal), q, k, v, mask)


def test_additive_bias_mask_raises():
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    bias = torch.zeros(1, 1, 8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    bias[..., 7, 0] = -1.0  # a soft bias, not a mask
    with pytest.raises(NotImplementedError, match="custom attention mask"):
        dt.attention_forward(stub_module(), q, k, v, bias)


@pytest.mark.parametrize("training", [True, False])
def test_dropout_raises_in_training(training, fake_dash):
    fake_dash.validate = False
    config = tiny_llama_config(attention_dropout=0.1)
    model = build(config, "dash")
    model.train(training)
    ids = token_batch(config)
    if training:
        with pytest.raises(NotImplementedError, match=r"does not support attention dropout: dropout=0\.1"):
            model(ids, use_cache=False)
    else:
        model(ids, use_cache=False)
        assert len(fake_dash.calls) == config.num_hidden_layers


def test_packed_position_ids_with_a_cache_raise(fake_dash, fake_dash_varlen):
    """transformers describes packing only without a cache; with one, position_ids that
    restart reach the attention layer alone, which cannot tell the sequences apart: an error."""
    config = tiny_llama_config()
    model = build(config, "dash")
    ids = token_batch(config, batch=1, seqlen=12)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with pytest.raises(NotImplementedError, match=r"does not support packed sequences \(varlen\) described only by "
                                                  r"position_ids"):
        model(ids, position_ids=position_ids, use_cache=True)
    assert not fake_dash.calls and not fake_dash_varlen.calls


def test_consecutive_position_ids_with_offset_are_fine(fake_dash):
    fake_dash.validate = False
    config = tiny_llama_config()
    model = build(config, "dash")
    ids = token_batch(config, batch=2, seqlen=12)
    model(ids, position_ids=torch.arange(5, 17).expand(2, 12), use_cache=False)
    assert len(fake_dash.calls) == config.num_hidden_layers


@pytest.mark.parametrize("kwarg,feature", [("s_aux", "attention sinks"), ("sinks", "attention sinks"),
                                           ("position_bias", "additive attention bias"), ("head_mask", "head mask")])
def test_other_unsupported_kwargs_raise(kwarg, feature):
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    with pytest.raises(NotImplementedError, match=feature):
        dt.attention_forward(stub_module(), q, k, v, None, **{kwarg: torch.zeros(2)})


def test_sliding_window_raises_only_when_it_cuts(fake_dash):
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    with pytest.raises(NotImplementedError, match=r"does not support sliding-window attention: sliding_window=4 with"):
        dt.attention_forward(stub_module(), q, k, v, None, sliding_window=4)
    dt.attention_forward(stub_module(), q, k, v, None, sliding_window=8)  # covers every key: plain causal
    assert len(fake_dash.calls) == 1


@skip_unless(lambda: hasattr(transformers, "MistralConfig"), "no MistralConfig")
def test_sliding_window_model(fake_dash):
    fake_dash.validate = False
    config = transformers.MistralConfig(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=8)
    model = build(config, "dash")
    with pytest.raises(NotImplementedError, match=r"sliding-window attention: sliding_window=8"):
        model(token_batch(config, seqlen=12), use_cache=False)
    model(token_batch(config, seqlen=8), use_cache=False)
    assert len(fake_dash.calls) == config.num_hidden_layers


def test_softcap_raises():
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    with pytest.raises(NotImplementedError, match=r"does not support softcapping: softcap=50\.0"):
        dt.attention_forward(stub_module(), q, k, v, None, softcap=50.0)


def test_output_attentions_raises(fake_dash):
    config = tiny_llama_config()
    model = build(config, "dash")
    with pytest.raises(NotImplementedError, match=r"does not support output_attentions=True"):
        model(token_batch(config), output_attentions=True, use_cache=False)
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    with pytest.raises(NotImplementedError, match="output_attentions=True"):
        dt.attention_forward(stub_module(output_attentions=True), q, k, v, None)


def test_unsupported_head_dim_error_comes_from_dash(fake_dash):
    config = tiny_llama_config(heads=4, kv_heads=4, head_dim=32)
    model = build(config, "dash", torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"head_dim=32 is not supported yet"):
        model(token_batch(config), use_cache=False)


def test_float32_without_autocast_error_comes_from_dash(fake_dash):
    config = tiny_llama_config()
    model = build(config, "dash", torch.float32)
    with pytest.raises(ValueError, match=r"q has dtype torch\.float32; supported: torch\.bfloat16, torch\.float16"):
        model(token_batch(config), use_cache=False)


def test_real_flash_attn_func_is_called_and_its_errors_propagate():
    """No stand-in: the real dash.api.flash_attn_func rejects CPU tensors; the error
    reaches the caller unchanged (nothing falls back to another implementation)."""
    config = tiny_llama_config()
    model = build(config, "dash", torch.bfloat16)
    with pytest.raises(ValueError, match=r"q is on device cpu; DASH runs on CUDA devices"):
        model(token_batch(config), use_cache=False)


# ---------------------------------------------------------------------------------------
# The mask function (transformers >= 4.53) and the mask / position checks
# ---------------------------------------------------------------------------------------
def _mask_fn(**kwargs):
    return dt._mask_function("dash", **kwargs)


@needs_mask_interface
def test_mask_function_plain_masks_build_nothing():
    from transformers import masking_utils as mu

    assert _mask_fn(batch_size=2, q_length=8, kv_length=8, mask_function=mu.causal_mask_function) is None
    assert _mask_fn(batch_size=1, q_length=1, kv_length=9, q_offset=8, mask_function=mu.causal_mask_function) is None
    if hasattr(mu, "bidirectional_mask_function"):
        assert _mask_fn(batch_size=2, q_length=8, kv_length=8, mask_function=mu.bidirectional_mask_function) is None
    ones = torch.ones(2, 8, dtype=torch.bool)
    assert _mask_fn(batch_size=2, q_length=8, kv_length=8, attention_mask=ones,
                    mask_function=mu.causal_mask_function) is None
    # transformers 4.53-4.5x pass cache_position instead of q_length/q_offset
    assert _mask_fn(batch_size=1, cache_position=torch.arange(4, 8), kv_length=8,
                    mask_function=mu.causal_mask_function) is None
    # a sliding window that covers every key changes nothing
    window = mu.sliding_window_causal_mask_function(8)
    assert _mask_fn(batch_size=1, q_length=8, kv_length=8, mask_function=window) is None


@needs_mask_interface
def test_mask_function_errors_name_the_feature():
    from transformers import masking_utils as mu

    causal = mu.causal_mask_function
    with pytest.raises(NotImplementedError, match="sliding-window attention: sliding_window=4 is shorter than the 8"):
        _mask_fn(batch_size=1, q_length=8, kv_length=8, mask_function=mu.sliding_window_causal_mask_function(4))
    with pytest.raises(NotImplementedError, match="a custom mask pattern"):
        _mask_fn(batch_size=1, q_length=8, kv_length=8,
                 mask_function=mu.or_masks(causal, lambda b, h, q, kv: kv == 0))
    with pytest.raises(NotImplementedError, match="a custom mask pattern: mask function"):
        _mask_fn(batch_size=1, q_length=8, kv_length=8, mask_function=lambda b, h, q, kv: kv <= q)
    with pytest.raises(NotImplementedError, match=r"KV cache longer than the tokens it holds \(e\.g\. StaticCache\)"):
        _mask_fn(batch_size=1, q_length=4, kv_length=16, q_offset=0, mask_function=causal)
    if hasattr(mu, "packed_sequence_mask_function"):
        packed = mu.and_masks(causal, mu.packed_sequence_mask_function(torch.tensor([[0, 0, 0, 1, 1, 2]])))
        with pytest.raises(NotImplementedError, match="packed sequences with a padding mask or a KV cache"):
            _mask_fn(batch_size=1, q_length=6, kv_length=6, attention_mask=torch.ones(1, 6), mask_function=packed)
    if hasattr(mu, "chunked_causal_mask_function"):
        try:
            chunked = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
        except TypeError:
            chunked = mu.chunked_causal_mask_function(4)
        with pytest.raises(NotImplementedError, match="chunked attention: attention_chunk_size=4"):
            _mask_fn(batch_size=1, q_length=8, kv_length=8, mask_function=chunked)


def _causal_4d(seqlen_q, seqlen_k, dtype=torch.bool, batch=2):
    visible = torch.arange(seqlen_k)[None, :] <= torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    if dtype == torch.bool:
        mask = visible
    else:
        mask = torch.zeros(seqlen_q, seqlen_k, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
    return mask.expand(batch, 1, seqlen_q, seqlen_k).contiguous()


@pytest.mark.parametrize("chunk", [7, 1 << 24])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16])
def test_four_d_mask_kind_in_chunks(chunk, dtype, monkeypatch):
    monkeypatch.setattr(dt, "_MASK_CHECK_CHUNK", chunk)
    for seqlen_q, seqlen_k in [(8, 8), (5, 13), (1, 6)]:
        mask = _causal_4d(seqlen_q, seqlen_k, dtype)
        full, causal = dt._four_d_mask_kind(mask, seqlen_q, seqlen_k)
        assert causal and full == (seqlen_q == 1)
        if seqlen_q < seqlen_k:  # the top-left aligned causal mask is not DASH's
            top_left = torch.arange(seqlen_k)[None, :] <= torch.arange(seqlen_q)[:, None]
            if dtype != torch.bool:
                top_left = torch.zeros(top_left.shape, dtype=dtype).masked_fill(~top_left, torch.finfo(dtype).min)
            assert dt._four_d_mask_kind(top_left[None, None], seqlen_q, seqlen_k) == (False, False)
        visible = torch.ones(1, 1, seqlen_q, seqlen_k, dtype=torch.bool) if dtype == torch.bool else \
            torch.zeros(1, 1, seqlen_q, seqlen_k, dtype=dtype)
        assert dt._four_d_mask_kind(visible, seqlen_q, seqlen_k) == (True, seqlen_q == 1)


def test_four_d_mask_checked_once_per_tensor_version(monkeypatch):
    calls = []
    real = dt._four_d_mask_kind
    monkeypatch.setattr(dt, "_four_d_mask_kind", lambda *a: calls.append(1) or real(*a))
    mask = _causal_4d(8, 8)
    for _ in range(4):  # the layers of one forward share the mask
        assert dt._mask_decides_causal("dash", mask, True, 8, 8) is True
    assert len(calls) == 1
    mask[0, 0, 3, 1] = False  # modified in place: checked again, and now rejected
    with pytest.raises(NotImplementedError, match="custom attention mask"):
        dt._mask_decides_causal("dash", mask, True, 8, 8)
    assert len(calls) == 2


def test_transformers_pre_453_style_masks_are_understood():
    """transformers < 4.53 builds a float (B, 1, Sq, Sk + 1) causal mask for custom
    implementations; the integration slices the key dim as transformers' SDPA path does."""
    mask = torch.cat([_causal_4d(8, 8, torch.float32), torch.full((2, 1, 8, 1), torch.finfo(torch.float32).min)], -1)
    assert dt._mask_decides_causal("dash", mask, True, 8, 8) is True
    with pytest.raises(ValueError, match="does not fit 8 queries and 9 keys"):
        dt._mask_decides_causal("dash", mask[..., :7], True, 8, 9)


def test_two_d_masks_in_the_attention_function():
    ones = torch.ones(2, 8, dtype=torch.long)
    assert dt._mask_decides_causal("dash", ones, True, 8, 8) is True
    padded = ones.clone()
    padded[1, 0] = 0
    with pytest.raises(NotImplementedError, match="padding mask"):
        dt._mask_decides_causal("dash", padded, True, 8, 8)
    with pytest.raises(NotImplementedError, match="BlockMask|type"):
        dt._mask_decides_causal("dash", object(), True, 8, 8)


def test_position_ids_check():
    dt._check_position_ids("dash", torch.arange(3, 11)[None], 8)
    dt._check_position_ids("dash", torch.tensor([[7]]), 1)  # decode step
    dt._check_position_ids("dash", torch.zeros(3, 2, 8, dtype=torch.long), 8)  # not (batch, seqlen): not read
    with pytest.raises(NotImplementedError, match="packed sequences"):
        dt._check_position_ids("dash", torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), 8)


# ---------------------------------------------------------------------------------------
# GPU: a tiny Llama trains deterministically with DASH (subprocess, see the module docstring)
# ---------------------------------------------------------------------------------------
#: Tiny Llamas built in code (no downloads). "autocast": float32 weights under bf16 autocast;
#: otherwise bf16 weights. Sequence lengths include ragged ones (not multiples of 128).
GPU_CONFIGS = {
    "mha-hd64-bf16": dict(heads=4, kv_heads=4, head_dim=64, seqlen=512, batch=2, autocast=False),
    "gqa-8x2-hd64-bf16": dict(heads=8, kv_heads=2, head_dim=64, seqlen=1024, batch=2, autocast=False),
    "gqa-8x2-hd128-autocast": dict(heads=8, kv_heads=2, head_dim=128, seqlen=768, batch=2, autocast=True),
    "mqa-4x1-hd128-bf16": dict(heads=4, kv_heads=1, head_dim=128, seqlen=333, batch=3, autocast=False),
    # flash_attn_varlen_func: rows of packed sequences (position_ids restart), and a padded
    # batch (right and left padding, loss on the real tokens)
    "packed-gqa-8x2-hd128-bf16": dict(heads=8, kv_heads=2, head_dim=128, seqlen=1024, batch=2, autocast=False,
                                      layout="packed"),
    "padded-mha-hd64-autocast": dict(heads=4, kv_heads=4, head_dim=64, seqlen=640, batch=3, autocast=True,
                                     layout="padded"),
}
GPU_STEPS = 5
GPU_HIDDEN = 256
GPU_LAYERS = 2
GPU_VOCAB = 1000
#: Relative tolerance of DASH's losses against SDPA's. DASH's forward and backward differ from
#: SDPA's in summation order, i.e. by a few bf16 roundings (2**-8 = 3.9e-3) per output and
#: gradient element, which AdamW turns into parameter differences of at most ~lr per step.
#: Over 5 steps that moves a loss of ~6.9 by well under 1e-2 relative.
LOSS_RTOL = 1e-2
#: Relative L2 difference of the first step's full gradient (all parameters) against SDPA's:
#: a few bf16 roundings; a wrong mask, scale or head mapping gives O(1). Too coarse to see a
#: wrong attention backward: the attention projections hold a small share of the gradient's
#: norm, so dq = 0 or dk = 0 moves it by only ~0.01 (hence ATTN_GRAD_RTOL).
GRAD_RTOL = 3e-2
#: The attention projections whose first-step gradients are compared one by one: DASH's dq
#: feeds a layer's q_proj gradient directly, dk its k_proj, dv its v_proj (o_proj checks the
#: forward output).
ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
#: Relative L2 difference of each attention projection's first-step gradient against SDPA's.
#: Measured on the CPU at GPU_CONFIGS' shapes, one step against SDPA: the reference stand-in,
#: and a flash-like one that rounds P and dS to bf16 before their GEMMs (as FA kernels do),
#: give at most 0.009 on any projection. Planted backward bugs give: dq = 0 or dk = 0 1.0
#: (while the whole gradient moves by only 0.007-0.015, within GRAD_RTOL), dq / 2 0.5,
#: dv x 1.1 0.2, dq = 0 in the last 64 query rows only 0.075-0.24 (seqlen 1024-333).
ATTN_GRAD_RTOL = 5e-2
_ATTN_PARAM = re.compile(r"layers\.(\d+)\.self_attn\.(" + "|".join(ATTN_PROJECTIONS) + r")\.weight$")


def _train(spec: dict, impl: str, device: str, keep_grads: bool = False, steps: int | None = None) -> dict:
    """One seeded training run: ``steps`` (default GPU_STEPS) AdamW steps. Returns losses, a
    digest of the final parameters, the parameters themselves and (optionally) the first
    step's gradients by parameter name."""
    steps = GPU_STEPS if steps is None else steps
    config = tiny_llama_config(heads=spec["heads"], kv_heads=spec["kv_heads"], head_dim=spec["head_dim"],
                               layers=GPU_LAYERS, hidden=GPU_HIDDEN, vocab=GPU_VOCAB)
    config.max_position_embeddings = 2048
    weights_dtype = torch.float32 if spec["autocast"] else torch.bfloat16
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
    model = model.to(device=device, dtype=weights_dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    # Fresh Zipf-distributed tokens each step: learnable statistics, so the loss goes down.
    gen = torch.Generator().manual_seed(99)
    zipf = 1.0 / torch.arange(1, GPU_VOCAB + 1, dtype=torch.float64)
    batches = [torch.multinomial(zipf, spec["batch"] * spec["seqlen"], replacement=True, generator=gen)
               .view(spec["batch"], spec["seqlen"]).to(device) for _ in range(steps)]
    layouts = [_batch_layout(spec, gen, device) for _ in range(steps)]
    losses, first_grads = [], None
    for step, ids in enumerate(batches):
        layout = layouts[step]
        labels = ids if "attention_mask" not in layout else ids.masked_fill(layout["attention_mask"] == 0, -100)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=spec["autocast"]):
            loss = model(input_ids=ids, labels=labels, use_cache=False, **layout).loss
        loss.backward()
        if step == 0 and keep_grads:
            first_grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    digest = hashlib.sha256()
    for name, p in params.items():
        digest.update(name.encode())
        digest.update(p.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return dict(losses=losses, digest=digest.hexdigest(), params=params, grads=first_grads)


def layout_unsupported(spec: dict) -> str | None:
    """Why this transformers cannot run a config's batch layout through DASH (None: it can):
    packed and padded batches reach DASH's varlen route through its mask function."""
    if spec.get("layout") and MASK_INTERFACE is None:
        return f"a {spec['layout']} batch needs transformers >= 4.53 (DASH's mask function)"
    return None


def _batch_layout(spec: dict, gen: torch.Generator, device: str) -> dict:
    """The model keywords of one step's batch layout: none (a plain batch), ``position_ids`` of
    3-5 packed sequences per row ("packed"), or an ``attention_mask`` whose first row is full and
    whose others keep a quarter to all of their tokens, padded right and left in turn
    ("padded")."""
    layout, batch, seqlen = spec.get("layout"), spec["batch"], spec["seqlen"]
    if layout is None:
        return {}
    if layout == "packed":
        rows = []
        for _ in range(batch):
            cuts = int(torch.randint(2, 5, (), generator=gen))
            ends = sorted((torch.randperm(seqlen - 1, generator=gen)[:cuts] + 1).tolist()) + [seqlen]
            rows.append(torch.cat([torch.arange(b - a) for a, b in zip([0] + ends[:-1], ends)]))
        return {"position_ids": torch.stack(rows).to(device)}
    assert layout == "padded", layout
    kept = [seqlen] + torch.randint(seqlen // 4, seqlen + 1, (batch - 1,), generator=gen).tolist()
    return {"attention_mask": _padding_mask(batch, seqlen, kept, ["right", "left"] * batch).to(device)}


def _train_all(configs: dict, device: str, with_sdpa: bool) -> dict:
    """Per config: two DASH runs (deterministic=True, all other ops deterministic too) and,
    optionally, one SDPA run. Counts the calls that reach dash.api.flash_attn_func."""
    dt.register("dash", deterministic=True)
    real, real_varlen = dash_api.flash_attn_func, dash_api.flash_attn_varlen_func
    calls = {"n": 0, "varlen": 0}

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    def counting_varlen(*args, **kwargs):
        calls["n"] += 1
        calls["varlen"] += 1
        return real_varlen(*args, **kwargs)

    results = {}
    dash_api.flash_attn_func, dash_api.flash_attn_varlen_func = counting, counting_varlen
    try:
        for label, spec in configs.items():
            t0 = time.time()
            torch.use_deterministic_algorithms(True, warn_only=False)
            calls["n"] = calls["varlen"] = 0
            first = _train(spec, "dash", device, keep_grads=with_sdpa)
            dash_calls, varlen_calls = calls["n"], calls["varlen"]
            second = _train(spec, "dash", device)
            differing = [n for n in first["params"] if not torch.equal(first["params"][n], second["params"][n])]
            entry = dict(losses=[first["losses"], second["losses"]], digests=[first["digest"], second["digest"]],
                         differing_params=differing, dash_calls_per_run=dash_calls,
                         varlen_calls_per_run=varlen_calls, layout=spec.get("layout"))
            if with_sdpa:
                torch.use_deterministic_algorithms(False)
                calls["n"] = 0
                sdpa = _train(spec, "sdpa", device, keep_grads=True)
                entry["sdpa_losses"] = sdpa["losses"]
                entry["sdpa_dash_calls"] = calls["n"]
                entry.update(grad_differences(first["grads"], sdpa["grads"]))
            entry["seconds"] = time.time() - t0
            results[label] = entry
    finally:
        dash_api.flash_attn_func, dash_api.flash_attn_varlen_func = real, real_varlen
        torch.use_deterministic_algorithms(False)
        dt.register()
    return results


def grad_differences(dash_grads: dict, sdpa_grads: dict) -> dict:
    """First-step gradients against SDPA's: ``grad_rel_l2``, the relative L2 difference of all
    parameters' gradients together, and ``attn_grad_rel_l2``, that of each attention
    projection's gradient (by parameter name)."""
    names = list(sdpa_grads)
    assert list(dash_grads) == names, "the two runs have different parameters"

    def flat(grads):
        return torch.cat([grads[n].flatten() for n in names])

    total = ((flat(dash_grads) - flat(sdpa_grads)).norm() / flat(sdpa_grads).norm()).item()
    # A zero reference norm gives inf or nan, which fails the check: SDPA's attention
    # projections always get a gradient, so that would be a broken harness.
    per = {n: ((dash_grads[n] - sdpa_grads[n]).norm() / sdpa_grads[n].norm()).item()
           for n in names if _ATTN_PARAM.search(n)}
    return dict(grad_rel_l2=total, attn_grad_rel_l2=per)


def check_attention_grads(per: dict) -> None:
    """Each attention projection of each layer within ATTN_GRAD_RTOL of SDPA's gradient."""
    found = sorted((int(m[1]), m[2]) for m in map(_ATTN_PARAM.search, per))
    expected = sorted((layer, proj) for layer in range(GPU_LAYERS) for proj in ATTN_PROJECTIONS)
    assert found == expected, f"attention projections compared: {found}; expected {expected}"
    bad = {n: round(r, 4) for n, r in per.items() if not r <= ATTN_GRAD_RTOL}  # "not <=": nan fails too
    assert not bad, (f"first-step gradients of attention projections differ from SDPA's by more than "
                     f"{ATTN_GRAD_RTOL} (rel L2): {bad}")


def check_bitwise_reproducible(a: dict, b: dict) -> None:
    """``a``: one process' entry for a config (two runs); ``b``: another process' entry."""
    assert a["dash_calls_per_run"] == GPU_LAYERS * GPU_STEPS, "DASH was not called for every layer and step"
    expected_varlen = a["dash_calls_per_run"] if a["layout"] else 0  # packed / padded batches run varlen only
    assert a["varlen_calls_per_run"] == expected_varlen, (a["layout"], a["varlen_calls_per_run"])
    (l1, l2), (d1, d2) = a["losses"], a["digests"]
    assert all(math.isfinite(x) for x in l1), l1
    assert l1 == l2, f"losses differ between two runs: {l1} vs {l2}"
    assert not a["differing_params"], f"parameters differ bitwise after {GPU_STEPS} steps: {a['differing_params']}"
    assert d1 == d2
    assert b["losses"][0] == l1, f"another process gave other losses: {b['losses'][0]} vs {l1}"
    assert b["digests"][0] == d1, "another process gave other parameters"


def check_close_to_sdpa(a: dict) -> None:
    dash_losses, sdpa_losses = a["losses"][0], a["sdpa_losses"]
    assert a["sdpa_dash_calls"] == 0, "the SDPA run called DASH"
    for step, (x, y) in enumerate(zip(dash_losses, sdpa_losses)):
        assert abs(x - y) <= LOSS_RTOL * abs(y), f"step {step}: DASH loss {x} vs SDPA {y}"
    assert a["grad_rel_l2"] <= GRAD_RTOL, f"first-step gradient differs from SDPA's by {a['grad_rel_l2']:.3g} (rel L2)"
    check_attention_grads(a["attn_grad_rel_l2"])
    assert dash_losses[-1] < dash_losses[0], f"the loss did not go down: {dash_losses}"


def test_training_harness_on_cpu(fake_dash, fake_dash_varlen):
    """The GPU tests' harness, on CPU with the reference stand-ins and short sequences: checks
    the harness itself (counting, digests, comparisons, batch layouts), not DASH's kernels."""
    fake_dash.validate = fake_dash_varlen.validate = True
    small = {label: dict(GPU_CONFIGS[label], seqlen=64)
             for label in ("gqa-8x2-hd128-autocast", "packed-gqa-8x2-hd128-bf16", "padded-mha-hd64-autocast")
             if layout_unsupported(GPU_CONFIGS[label]) is None}
    a = _train_all(small, "cpu", with_sdpa=True)
    b = _train_all(small, "cpu", with_sdpa=False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert dt.registered_names()["dash"] == dt.Settings("dash", None, "auto")
    assert dash_api.flash_attn_func is fake_dash and dash_api.flash_attn_varlen_func is fake_dash_varlen
    assert all(c["deterministic"] is True for c in fake_dash.calls + fake_dash_varlen.calls)
    if len(small) == 3:
        assert len({tuple(c["cu_seqlens_q"]) for c in fake_dash_varlen.calls}) > 2  # layouts change per step
    for label in small:
        check_bitwise_reproducible(a[label], b[label])
        check_close_to_sdpa(a[label])


class _PlantedBackward(torch.autograd.Function):
    """The reference stand-in's forward, with a backward that has one planted bug (None: none)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, bug):
        ctx.save_for_backward(q, k, v)
        ctx.softmax_scale, ctx.causal, ctx.bug = softmax_scale, causal, bug
        return reference_attention(q, k, v, softmax_scale, causal)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = reference_attention(q, k, v, ctx.softmax_scale, ctx.causal)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        bug = ctx.bug
        dq = torch.zeros_like(dq) if bug == "dq=0" else dq * 0.5 if bug == "dq/2" else dq
        dk = torch.zeros_like(dk) if bug == "dk=0" else dk
        dv = dv * 1.1 if bug == "dv*1.1" else dv
        return dq, dk, dv, None, None, None


@pytest.mark.parametrize("bug,projection", [(None, None), ("dq=0", "q_proj"), ("dk=0", "k_proj"), ("dq/2", "q_proj"),
                                            ("dv*1.1", "v_proj")])
def test_training_harness_catches_a_wrong_backward(bug, projection, monkeypatch):
    """The GPU tests' gradient checks, on CPU with backwards that have planted bugs: the
    whole-gradient check (GRAD_RTOL) misses dq = 0 and dk = 0; the per-projection check
    (ATTN_GRAD_RTOL) catches each bug, and a correct bf16 backward passes it with a margin."""
    def stand_in(q, k, v, softmax_scale=None, causal=False, **kwargs):
        return _PlantedBackward.apply(q, k, v, softmax_scale, causal, bug)

    monkeypatch.setattr(dash_api, "flash_attn_func", stand_in)
    spec = dict(GPU_CONFIGS["gqa-8x2-hd64-bf16"], seqlen=128)
    sdpa = _train(spec, "sdpa", "cpu", keep_grads=True, steps=1)["grads"]
    diffs = grad_differences(_train(spec, "dash", "cpu", keep_grads=True, steps=1)["grads"], sdpa)
    per = diffs["attn_grad_rel_l2"]
    if bug is None:
        check_attention_grads(per)
        assert max(per.values()) < ATTN_GRAD_RTOL / 4, per  # bf16 noise, well under the bound
        return
    if bug != "dv*1.1":
        assert diffs["grad_rel_l2"] <= GRAD_RTOL  # what the whole-gradient check alone let through
    with pytest.raises(AssertionError, match=rf"layers\.\d\.self_attn\.{projection}\.weight"):
        check_attention_grads(per)


def _gpu_main(out_path: str, with_sdpa: bool) -> None:
    """Subprocess entry: CUBLAS_WORKSPACE_CONFIG is set by the parent before cuBLAS starts."""
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    results = _train_all({k: v for k, v in GPU_CONFIGS.items() if layout_unsupported(v) is None}, "cuda", with_sdpa)
    with open(out_path, "w") as f:
        json.dump(dict(results=results, transformers=transformers.__version__, torch=torch.__version__), f)


def _run_gpu_subprocess(tmp_path_factory, with_sdpa: bool) -> dict:
    out = tmp_path_factory.mktemp("hf_train") / "results.json"
    env = dict(os.environ, PYTHONPATH=ROOT, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    cmd = [sys.executable, os.path.abspath(__file__), "--gpu-train", str(out)] + (["--with-sdpa"] if with_sdpa else [])
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        pytest.fail(f"training subprocess failed (rc {p.returncode}):\n{p.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)["results"]


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    """Process A: per config two DASH runs and one SDPA run; process B: the DASH runs again."""
    missing_transformers_outcome(TRANSFORMERS_MISSING, gpu_test=True)
    return _run_gpu_subprocess(tmp_path_factory, True), _run_gpu_subprocess(tmp_path_factory, False)


@pytest.mark.gpu
@pytest.mark.parametrize("label", list(GPU_CONFIGS))
def test_gpu_training_is_bitwise_reproducible(label, gpu_runs):
    if layout_unsupported(GPU_CONFIGS[label]):
        pytest.skip(layout_unsupported(GPU_CONFIGS[label]))
    check_bitwise_reproducible(gpu_runs[0][label], gpu_runs[1][label])


@pytest.mark.gpu
@pytest.mark.parametrize("label", list(GPU_CONFIGS))
def test_gpu_training_close_to_sdpa(label, gpu_runs):
    if layout_unsupported(GPU_CONFIGS[label]):
        pytest.skip(layout_unsupported(GPU_CONFIGS[label]))
    check_close_to_sdpa(gpu_runs[0][label])


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--gpu-train":
        _gpu_main(sys.argv[2], "--with-sdpa" in sys.argv[3:])
    else:
        sys.exit(f"usage: {sys.argv[0]} --gpu-train OUT.json [--with-sdpa]")
