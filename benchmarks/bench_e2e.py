"""End-to-end training steps with DASH and other attention backends, each timed in the same run.

    python benchmarks/bench_e2e.py                          # defaults (estimated 2-3 minutes on one H200)
    python benchmarks/bench_e2e.py --models llama3-8b --seqlens 8192 --full-seqlens --steps 20
    python benchmarks/bench_e2e.py --backends dash_det dash_nondet torch_cudnn --no-plot

What is measured: a stack of ``--layers`` transformer blocks (RMSNorm -> attention: q/k/v
projections, RoPE, the attention call, output projection -> RMSNorm -> SwiGLU MLP, both with
residuals) in plain PyTorch, bf16 weights, trained with AdamW for ``--warmup`` + ``--steps``
steps (forward + backward + optimizer step, timed with CUDA events; median over the timed
steps). Shapes (MODELS): LLaMA3-8B-like (hidden 4096, 32 q / 8 kv heads, head_dim 128, MLP
14336) and Qwen2.5-7B-like (hidden 3584, 28 q / 4 kv heads, head_dim 128, MLP 18944, q/k/v
bias). Cases: each model causal at each ``--seqlens`` and full-mask (non-causal) at each
``--full-seqlens``, with ``batch = --tokens // seqlen`` sequences per step. There is no
embedding or LM head (their cost does not depend on the attention): the input is random hidden
states and the loss is the mean squared error against a random target, so the numbers are the
blocks' share of a step, which is where the attention backends differ.

Backends (BACKENDS): DASH deterministic and not (``flash_attn_func(..., deterministic=...)``);
torch SDPA forced to the cuDNN and to the flash backend (``torch.nn.attention.sdpa_kernel``);
torch's flash SDPA with ``torch.use_deterministic_algorithms(True)`` (FlashAttention-2's
deterministic backward); upstream FA3 (``flash_attn_interface``) and FA4
(``flash_attn.cute``), deterministic and not, when importable. SDPA gets the grouped kv heads
through ``enable_gqa=True`` where the backend accepts it, else through ``repeat_interleave``
(checked per case; the table and the JSON say which); the others take GQA natively.

Determinism: every deterministic backend trains twice from the same seed; the two runs' losses
(float32 bits, every step) and parameters (SHA-256 of each tensor's bytes) are compared. For
``dash_det`` a difference fails the run (exit status 3, after the results are written).

Output: a table (step ms, tokens/s, speed relative to DASH non-deterministic and to torch
cuDNN: > 1 means faster), benchmarks/results/<date>-<gpu>-e2e.json with the device, torch,
CUDA and cuDNN versions, the commit, the config and every number (per-step times, losses,
digests, errors), and a bar chart PNG beside it when matplotlib is installed (``--no-plot``).
Exit status: 0; 1 when the machine cannot run it (no CUDA GPU, no DASH kernels) or a DASH
backend failed; 2 for bad arguments; 3 when two dash_det runs differ.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the checkout's dash/, as benchmarks/bench_bwd.py uses

from dash._bench import results_path as unique_results_path  # noqa: E402  (bench_bwd.py's file names too)
from dash.cli import int_at_least  # noqa: E402  (the argparse types of `python -m dash`)
from dash.digest import combined_digest, float32_bits, tensor_digest  # noqa: E402, F401  (float32_bits: for tests)

DEFAULT_OUT = ROOT / "benchmarks" / "results"
TAG = "e2e"


# ---------------------------------------------------------------------------------------
# Configuration: model shapes, cases, backends
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """One transformer block's shape (the published configs' numbers)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    qkv_bias: bool
    rope_theta: float
    norm_eps: float

    def linear_params_per_layer(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return q + kv + o + bias + 3 * self.hidden * self.mlp

    def params_per_layer(self) -> int:
        return self.linear_params_per_layer() + 2 * self.hidden  # + the two RMSNorm weights


MODELS: dict[str, ModelShape] = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama3-8b": ModelShape("llama3-8b", hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, qkv_bias=False,
                            rope_theta=500000.0, norm_eps=1e-5),
    # Qwen/Qwen2.5-7B config.json (q/k/v projections have a bias)
    "qwen2.5-7b": ModelShape("qwen2.5-7b", hidden=3584, heads=28, kv_heads=4, head_dim=128, mlp=18944, qkv_bias=True,
                             rope_theta=1000000.0, norm_eps=1e-6),
}


@dataclass(frozen=True)
class Case:
    """One measured configuration: a model's blocks at one sequence length and mask."""

    model: str
    seqlen: int
    causal: bool
    batch: int
    layers: int

    @property
    def shape(self) -> ModelShape:
        return MODELS[self.model]

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    def label(self) -> str:
        return f"{self.model} {'causal' if self.causal else 'full'} s{self.seqlen} b{self.batch} L{self.layers}"

    def attention_flops(self) -> float:
        """Attention matmul FLOPs of one training step (FA3's count: forward 4*b*h*s*s*d,
        backward 2.5x the forward, halved for a causal mask), all layers."""
        s = self.shape
        fwd = 4.0 * self.batch * s.heads * self.seqlen * self.seqlen * s.head_dim / (2.0 if self.causal else 1.0)
        return 3.5 * fwd * self.layers

    def step_flops(self) -> float:
        """Model FLOPs of one step: 6 * tokens * linear parameters + the attention's."""
        return 6.0 * self.tokens * self.shape.linear_params_per_layer() * self.layers + self.attention_flops()


def build_cases(models: Sequence[str], seqlens: Sequence[int], full_seqlens: Sequence[int], tokens: int,
                layers: int) -> list[Case]:
    """Causal cases at ``seqlens`` and full-mask cases at ``full_seqlens``, per model, with
    ``tokens // seqlen`` sequences per step (at least one)."""
    cases = []
    for m in models:
        if m not in MODELS:
            raise ValueError(f"model {m!r} is unknown; choose from {', '.join(MODELS)}")
        for causal, lens in ((True, seqlens), (False, full_seqlens)):
            for s in lens:
                cases.append(Case(m, s, causal, max(1, tokens // s), layers))
    return cases


#: Every backend this script knows, in table order.
BACKENDS: tuple[str, ...] = ("dash_det", "dash_nondet", "torch_cudnn", "torch_flash", "torch_flash_det",
                             "fa3_nondet", "fa3_det", "fa4_nondet", "fa4_det")
#: Backends whose backward is meant to be bitwise reproducible: each is trained twice.
DETERMINISTIC_BACKENDS = frozenset({"dash_det", "torch_flash_det", "fa3_det", "fa4_det"})
#: A difference between two runs of these fails the benchmark.
MUST_BE_BITWISE = frozenset({"dash_det"})
#: The anchors the ratio columns are relative to.
ANCHORS = ("dash_nondet", "torch_cudnn")
BACKEND_NOTES = {
    "dash_det": "DASH flash_attn_func(deterministic=True)",
    "dash_nondet": "DASH flash_attn_func(deterministic=False)",
    "torch_cudnn": "torch SDPA, sdpa_kernel(CUDNN_ATTENTION)",
    "torch_flash": "torch SDPA, sdpa_kernel(FLASH_ATTENTION)",
    "torch_flash_det": "torch SDPA flash under torch.use_deterministic_algorithms(True) (FA2 deterministic bwd)",
    "fa3_nondet": "upstream FA3 flash_attn_interface.flash_attn_func(deterministic=False)",
    "fa3_det": "upstream FA3 flash_attn_interface.flash_attn_func(deterministic=True)",
    "fa4_nondet": "FA4 flash_attn.cute flash_attn_func(deterministic=False)",
    "fa4_det": "FA4 flash_attn.cute flash_attn_func(deterministic=True)",
}


# ---------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------
def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _split_names(values: Optional[Sequence[str]]) -> Optional[list[str]]:
    """``["a,b", "c"]`` -> ``["a", "b", "c"]`` (both spellings work), duplicates dropped."""
    if values is None:
        return None
    out: list[str] = []
    for v in values:
        for name in v.split(","):
            name = name.strip()
            if name and name not in out:
                out.append(name)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_e2e.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int_at_least(1), default=10, help="timed steps per run (default 10)")
    p.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed steps first (default 3)")
    p.add_argument("--layers", type=int_at_least(1), default=2, help="transformer blocks (default 2)")
    p.add_argument("--seqlens", type=int_at_least(1), nargs="*", default=[4096, 8192],
                   help="causal cases' sequence lengths (default 4096 8192; none: no causal case)")
    p.add_argument("--full-seqlens", type=int_at_least(1), nargs="*", default=[4096],
                   help="full-mask (non-causal) cases' sequence lengths (default 4096; none: no full case)")
    p.add_argument("--tokens", type=int_at_least(1), default=16384,
                   help="tokens per step; batch = tokens // seqlen (default 16384)")
    p.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                   help=f"model shapes (default all): {', '.join(MODELS)}")
    p.add_argument("--backends", nargs="+", default=None, metavar="BACKEND",
                   help=f"attention backends (default: every one importable here): {', '.join(BACKENDS)}")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the weights and the data (default 0)")
    p.add_argument("--lr", type=_positive_float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="results folder (default benchmarks/results), or a file name ending in .json")
    p.add_argument("--no-plot", action="store_true", help="do not draw the bar chart PNG")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the arguments; bad values exit 2 with a message naming the argument."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.models = _split_names(args.models) or list(MODELS)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"argument --models: {unknown[0]!r} is unknown; choose from {', '.join(MODELS)}")
    args.backends = _split_names(args.backends)
    if args.backends is not None:
        unknown = [b for b in args.backends if b not in BACKENDS]
        if unknown:
            parser.error(f"argument --backends: {unknown[0]!r} is unknown; choose from {', '.join(BACKENDS)}")
        if not args.backends:
            parser.error("argument --backends: give at least one backend")
    args.seqlens = list(dict.fromkeys(args.seqlens))
    args.full_seqlens = list(dict.fromkeys(args.full_seqlens))
    if not args.seqlens and not args.full_seqlens:
        parser.error("arguments --seqlens and --full-seqlens are both empty: nothing to measure")
    if str(args.out).endswith(".json") and args.out.is_dir():
        parser.error(f"argument --out: {args.out} is a folder; give a folder or a new .json file name")
    if not str(args.out).endswith(".json") and args.out.exists() and not args.out.is_dir():
        parser.error(f"argument --out: {args.out} exists and is not a folder (a file name must end in .json)")
    return args


def config_of(args: argparse.Namespace) -> dict:
    """The run's settings as recorded in the results file."""
    return {
        "steps": args.steps, "warmup": args.warmup, "layers": args.layers, "tokens_per_step": args.tokens,
        "seqlens_causal": args.seqlens, "seqlens_full": args.full_seqlens, "models": args.models,
        "backends_requested": args.backends, "seed": args.seed, "lr": args.lr, "dtype": "bfloat16",
        "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1, fused=True), bf16 weights and states",
        "loss": "MSE of the last block's RMSNorm output against a random target (no embedding / LM head)",
        "rope": True, "timing": "CUDA events around zero_grad+forward+backward+optimizer.step; median of timed steps",
        "model_shapes": {m: asdict(MODELS[m]) for m in args.models},
    }


# ---------------------------------------------------------------------------------------
# Bitwise comparison of two runs (pure: works on the recorded bits and digests)
# ---------------------------------------------------------------------------------------
def compare_runs(a: dict, b: dict, max_names: int = 5) -> list[str]:
    """Differences between two runs' records, as sentences; empty when bit-identical.

    Each record has ``loss_bits`` (one hex string of the float32 loss per step) and
    ``param_digests`` (parameter name -> SHA-256 hex of its bytes)."""
    diffs: list[str] = []
    la, lb = list(a.get("loss_bits") or []), list(b.get("loss_bits") or [])
    if len(la) != len(lb):
        diffs.append(f"the runs have {len(la)} and {len(lb)} losses")
    else:
        steps = [i for i, (x, y) in enumerate(zip(la, lb)) if x != y]
        if steps:
            i = steps[0]
            diffs.append(f"losses differ at {len(steps)} of {len(la)} steps, first at step {i} "
                         f"({_bits_to_float(la[i]):.9g} [{la[i]}] vs {_bits_to_float(lb[i]):.9g} [{lb[i]}])")
    pa, pb = dict(a.get("param_digests") or {}), dict(b.get("param_digests") or {})
    if pa.keys() != pb.keys():
        only = sorted(set(pa) ^ set(pb))
        diffs.append(f"the runs have different parameters ({', '.join(only[:max_names])})")
    else:
        differing = [n for n in pa if pa[n] != pb[n]]
        if differing:
            shown = ", ".join(differing[:max_names]) + (", ..." if len(differing) > max_names else "")
            diffs.append(f"{len(differing)} of {len(pa)} parameters differ bitwise ({shown})")
    if not la and not pa:
        diffs.append("nothing was recorded to compare")
    return diffs


def _bits_to_float(bits: str) -> float:
    import struct

    return struct.unpack("<f", int(bits, 16).to_bytes(4, "little"))[0]


# ---------------------------------------------------------------------------------------
# Results: ratios, table, file, chart (pure)
# ---------------------------------------------------------------------------------------
def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def add_ratios(cases: list[dict]) -> None:
    """Per case and backend, the speed relative to each anchor (anchor ms / backend ms, > 1 is
    faster), in place, for the anchors measured in that case."""
    for c in cases:
        runs = c["backends"]
        for r in runs.values():
            for anchor in ANCHORS:
                base = runs.get(anchor, {}).get("ms_median")
                if base and r.get("ms_median"):
                    r[f"speed_vs_{anchor}"] = base / r["ms_median"]


def summarize(cases: list[dict], backends: Sequence[str]) -> dict:
    """Geometric means over cases of each backend's speed relative to each anchor."""
    out: dict[str, dict] = {}
    for b in backends:
        entry = {}
        for anchor in ANCHORS:
            vals = [c["backends"][b][f"speed_vs_{anchor}"] for c in cases
                    if f"speed_vs_{anchor}" in c["backends"].get(b, {})]
            if vals:
                entry[f"geomean_speed_vs_{anchor}"] = geomean(vals)
                entry[f"min_speed_vs_{anchor}"] = min(vals)
                entry["cases"] = len(vals)
        if entry:
            out[b] = entry
    return out


def format_table(payload: dict) -> str:
    """The printed summary: per case, each backend's step ms and tokens/s, then the speed
    ratios to DASH non-deterministic and to torch cuDNN, then the determinism checks."""
    backends = payload["backends"]
    cases = payload["cases"]
    w0 = max([len("case")] + [len(c["label"]) for c in cases]) + 2
    colw = max(14, max(len(b) for b in backends) + 2)
    lines = []

    def table(title: str, cell: Callable[[dict], str]) -> None:
        lines.append(title)
        lines.append("case".ljust(w0) + "".join(b.rjust(colw) for b in backends))
        for c in cases:
            cells = []
            for b in backends:
                r = c["backends"].get(b)
                if r is None:
                    cells.append("-".rjust(colw))
                elif r.get("error"):
                    cells.append("error".rjust(colw))
                else:
                    cells.append(cell(r).rjust(colw))
            lines.append(c["label"].ljust(w0) + "".join(cells))
        lines.append("")

    table("Step time, median (ms); tokens/s in thousands:",
          lambda r: f"{r['ms_median']:.1f} {r['tokens_per_s'] / 1e3:.0f}k")
    for anchor in ANCHORS:
        if any(f"speed_vs_{anchor}" in r for c in cases for r in c["backends"].values()):
            table(f"Speed relative to {anchor} (its ms / this ms; > 1 is faster):",
                  lambda r, a=anchor: f"{r[f'speed_vs_{a}']:.3f}" if f"speed_vs_{a}" in r else "-")
    summary = payload.get("summary") or {}
    if summary:
        lines.append("Geometric mean over cases:")
        for b, s in summary.items():
            parts = [f"{s[k]:.3f} vs {k.split('_vs_')[1]}" for k in s if k.startswith("geomean_speed_vs_")]
            lines.append(f"  {b:>16}: " + ", ".join(parts) + f" ({s['cases']} case{'s' if s['cases'] != 1 else ''})")
        lines.append("")
    gqa = sorted({(b, r["gqa"]) for c in cases for b, r in c["backends"].items() if r.get("gqa")})
    sdpa_gqa = [f"{b}: {g}" for b, g in gqa if b.startswith("torch_")]
    if sdpa_gqa:
        lines.append("GQA in torch SDPA: " + "; ".join(sdpa_gqa) + " (other backends take the kv heads as they are)")
    lines.append("Bitwise determinism (two runs from the same seed: every step's loss and every parameter):")
    any_check = False
    for c in cases:
        for b, d in c.get("determinism", {}).items():
            any_check = True
            verdict = "identical" if d["identical"] else "DIFFERENT: " + "; ".join(d["differences"])
            lines.append(f"  {c['label']:<{w0}} {b:>16}: {verdict}")
    if not any_check:
        lines.append("  (no deterministic backend ran twice)")
    errors = [(c["label"], b, r["error"]) for c in cases for b, r in c["backends"].items() if r.get("error")]
    if errors:
        lines.append("Errors:")
        lines += [f"  {label} {b}: {e}" for label, b, e in errors]
    return "\n".join(lines)


def results_path(out: Path, device: str, date: str, tag: str = TAG) -> Path:
    """Where the results go: ``out`` itself when it names a .json file, else
    ``out/<date>-<device>-<tag>.json``, with -2, -3, ... added rather than replacing a file."""
    if str(out).endswith(".json"):
        return out
    return unique_results_path(out, device, date, tag)


def write_results(payload: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, allow_nan=True) + "\n")
    return path


def plot(payload: dict, path: Path) -> Path:
    """Bar chart: tokens/s per case and backend, and speed relative to torch cuDNN."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cases, backends = payload["cases"], payload["backends"]
    fig = Figure(figsize=(max(9.0, 1.1 * len(cases) * max(1, len(backends)) * 0.35 + 3), 8.0), layout="constrained")
    FigureCanvasAgg(fig)  # Agg without pyplot: no display needed, a notebook's backend is left alone
    ax_tok, ax_ratio = fig.subplots(2, 1, sharex=True)
    width = 0.8 / max(1, len(backends))
    xs = range(len(cases))
    for i, b in enumerate(backends):
        tok = [(c["backends"].get(b) or {}).get("tokens_per_s", 0.0) / 1e3 for c in cases]
        ratio = [(c["backends"].get(b) or {}).get("speed_vs_torch_cudnn", 0.0) for c in cases]
        offs = [x + (i - (len(backends) - 1) / 2) * width for x in xs]
        ax_tok.bar(offs, tok, width, label=b)
        ax_ratio.bar(offs, ratio, width, label=b)
    ax_tok.set_ylabel("tokens/s (thousands)")
    ax_tok.set_title("Training step throughput (forward + backward + AdamW)")
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_ratio.set_ylabel("speed vs torch cuDNN SDPA")
    ax_ratio.set_xticks(list(xs), [c["label"].replace(" ", "\n", 2) for c in cases], fontsize=8)
    ax_tok.legend(fontsize=8, ncols=min(len(backends), 5))
    env = payload.get("environment", {})
    fig.suptitle(f"{env.get('device', '?')} - commit {str(env.get('checkout_head') or env.get('commit'))[:10]} - "
                 f"{str(env.get('date', ''))[:10]} - {payload['config']['layers']} layers, bf16")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------
def gpu_problem() -> Optional[str]:
    """Why this machine cannot run the benchmark (None when it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return (f"no CUDA GPU: torch {torch.__version__} reports torch.cuda.is_available() == False "
                f"(CUDA build: {torch.version.cuda or 'none, a CPU-only torch'}). This benchmark trains on an "
                "NVIDIA Hopper GPU (sm_90, e.g. H100/H200); run it there")
    return None


def dash_problem() -> tuple[Optional[str], bool]:
    """(why DASH's backends cannot run here or None, whether that must stop the run even when
    the backends were not named). On a Hopper GPU, unusable kernels stop the run: a DASH
    benchmark that quietly measured everything but DASH would prove nothing. On another GPU
    the default backend list just leaves DASH out."""
    import torch

    cc = torch.cuda.get_device_capability(0)
    if cc != (9, 0):
        return (f"GPU 0 ({torch.cuda.get_device_name(0)}) has compute capability {cc[0]}.{cc[1]}; DASH's kernels "
                "need 9.0 (Hopper); leave out the dash_* backends (--backends) to measure the others"), False
    try:
        from dash._ext import kernels_status
    except ImportError as e:
        return f"dash is not importable ({e})", True
    ok, why = kernels_status()
    return (None, False) if ok else (f"DASH's kernels are not usable: {why}", True)


def _import_fa3():
    """Upstream FA3's module (``flash_attn_interface``, from flash-attention's hopper/ or the
    flash_attn_3 package), or raise ImportError naming what was tried."""
    import importlib

    tried = []
    for name in ("flash_attn_interface", "flash_attn_3.flash_attn_interface"):
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # ImportError, or a broken build's OSError
            tried.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if mod.__name__.split(".")[0] == "dash":  # dash.install_as_flash_attn_3() maps these names to DASH
            tried.append(f"{name}: is DASH's FA3 alias (dash.install_as_flash_attn_3), not upstream FA3")
            continue
        if callable(getattr(mod, "flash_attn_func", None)):
            return mod
        tried.append(f"{name}: has no flash_attn_func")
    raise ImportError("; ".join(tried))


def _import_fa4():
    import importlib

    tried = []
    for name in ("flash_attn.cute.interface", "flash_attn.cute"):
        try:
            mod = importlib.import_module(name)
        except Exception as e:
            tried.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if callable(getattr(mod, "flash_attn_func", None)):
            return mod
        tried.append(f"{name}: has no flash_attn_func")
    raise ImportError("; ".join(tried))


def backend_availability(dash_why: Optional[str]) -> dict[str, Optional[str]]:
    """Backend -> None when it can run here, else why not."""
    out: dict[str, Optional[str]] = {}
    for b in ("dash_det", "dash_nondet"):
        out[b] = dash_why
    for b in ("torch_cudnn", "torch_flash", "torch_flash_det"):
        try:
            from torch.nn.attention import sdpa_kernel  # noqa: F401  (torch >= 2.3)

            out[b] = None
        except ImportError as e:
            out[b] = f"this torch has no torch.nn.attention.sdpa_kernel ({e})"
    for prefix, importer in (("fa3", _import_fa3), ("fa4", _import_fa4)):
        try:
            importer()
            why = None
        except ImportError as e:
            why = f"not importable ({e})"
        out[f"{prefix}_nondet"] = out[f"{prefix}_det"] = why
    return out


def choose_backends(requested: Optional[list[str]], available: dict[str, Optional[str]]) -> tuple[list[str], dict]:
    """(backends to run, {skipped backend: why}). Explicitly requested backends that cannot run
    are an error (ValueError naming each and why); by default they are skipped and reported."""
    if requested is not None:
        missing = {b: available[b] for b in requested if available.get(b)}
        if missing:
            raise ValueError("; ".join(f"backend {b} cannot run here: {why}" for b, why in missing.items()))
        return list(requested), {}
    chosen = [b for b in BACKENDS if not available.get(b)]
    return chosen, {b: available[b] for b in BACKENDS if available.get(b)}


# ---------------------------------------------------------------------------------------
# The model (plain torch; built on the GPU)
# ---------------------------------------------------------------------------------------
def _model_classes():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float, **kw):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim, **kw))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    class Attention(nn.Module):
        """q/k/v projections (as in the HF models), RoPE, the backend's attention, out projection."""

        def __init__(self, s: ModelShape, attn: Callable, causal: bool, **kw):
            super().__init__()
            self.s, self.attn, self.causal = s, attn, causal
            self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=s.qkv_bias, **kw)
            self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias, **kw)
            self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias, **kw)
            self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False, **kw)

        def forward(self, x, cos, sin):
            b, n, _ = x.shape
            s = self.s
            q = self.q_proj(x).view(b, n, s.heads, s.head_dim)  # (batch, seqlen, heads, head_dim)
            k = self.k_proj(x).view(b, n, s.kv_heads, s.head_dim)
            v = self.v_proj(x).view(b, n, s.kv_heads, s.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            out = self.attn(q, k, v, self.causal, s.head_dim ** -0.5)
            return self.o_proj(out.reshape(b, n, s.heads * s.head_dim))

    class MLP(nn.Module):
        def __init__(self, s: ModelShape, **kw):
            super().__init__()
            self.gate_proj = nn.Linear(s.hidden, s.mlp, bias=False, **kw)
            self.up_proj = nn.Linear(s.hidden, s.mlp, bias=False, **kw)
            self.down_proj = nn.Linear(s.mlp, s.hidden, bias=False, **kw)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self, s: ModelShape, attn: Callable, causal: bool, **kw):
            super().__init__()
            self.input_norm = RMSNorm(s.hidden, s.norm_eps, **kw)
            self.attn = Attention(s, attn, causal, **kw)
            self.post_attn_norm = RMSNorm(s.hidden, s.norm_eps, **kw)
            self.mlp = MLP(s, **kw)

        def forward(self, x, cos, sin):
            x = x + self.attn(self.input_norm(x), cos, sin)
            return x + self.mlp(self.post_attn_norm(x))

    class Blocks(nn.Module):
        def __init__(self, s: ModelShape, layers: int, seqlen: int, attn: Callable, causal: bool, **kw):
            super().__init__()
            self.layers = nn.ModuleList(Block(s, attn, causal, **kw) for _ in range(layers))
            self.norm = RMSNorm(s.hidden, s.norm_eps, **kw)
            inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=kw["device"],
                                                             dtype=torch.float32) / s.head_dim))
            angles = torch.outer(torch.arange(seqlen, device=kw["device"], dtype=torch.float32), inv_freq)
            emb = torch.cat((angles, angles), dim=-1)[None, :, None, :]  # (1, seqlen, 1, head_dim)
            self.register_buffer("cos", emb.cos().to(kw["dtype"]), persistent=False)
            self.register_buffer("sin", emb.sin().to(kw["dtype"]), persistent=False)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x, self.cos, self.sin)
            return self.norm(x)

    return Blocks


# ---------------------------------------------------------------------------------------
# Attention backends: fn(q, k, v, causal, scale) on (batch, seqlen, heads, head_dim) tensors
# ---------------------------------------------------------------------------------------
def _sdpa_fn(sdp_backend, gqa: str) -> Callable:
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def attn(q, k, v, causal, scale):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, h, s, d) views
        extra = {}
        if kt.shape[1] != qt.shape[1]:
            if gqa == "enable_gqa":
                extra["enable_gqa"] = True
            else:  # repeat_interleave: head j of kv serves q heads j*g .. j*g+g-1, as enable_gqa does
                g = qt.shape[1] // kt.shape[1]
                kt, vt = kt.repeat_interleave(g, dim=1), vt.repeat_interleave(g, dim=1)
        with sdpa_kernel(sdp_backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, **extra)
        return out.transpose(1, 2)

    return attn


def attention_fn(backend: str, gqa: str = "native") -> Callable:
    if backend in ("dash_det", "dash_nondet"):
        from dash import flash_attn_func

        det = backend == "dash_det"
        return lambda q, k, v, causal, scale: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                                               deterministic=det)
    if backend.startswith("torch_"):
        from torch.nn.attention import SDPBackend

        which = SDPBackend.CUDNN_ATTENTION if backend == "torch_cudnn" else SDPBackend.FLASH_ATTENTION
        return _sdpa_fn(which, gqa)
    if backend.startswith(("fa3_", "fa4_")):
        mod = _import_fa3() if backend.startswith("fa3_") else _import_fa4()
        det = backend.endswith("_det")

        def attn(q, k, v, causal, scale):
            out = mod.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, deterministic=det)
            return out[0] if isinstance(out, tuple) else out  # versions differ: out or (out, lse)

        return attn
    raise ValueError(f"backend {backend!r} is unknown; choose from {', '.join(BACKENDS)}")


class _DeterministicAlgorithms:
    """``torch.use_deterministic_algorithms(True)`` for one run (torch_flash_det), restored
    after. Uninitialized-memory filling is turned off for the run: it is a debugging aid that
    writes every torch.empty and would charge that backend for work the others do not do."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if self.enabled:
            import torch
            import torch.utils.deterministic as tud

            self._saved = (torch.are_deterministic_algorithms_enabled(),
                           torch.is_deterministic_algorithms_warn_only_enabled(), tud.fill_uninitialized_memory)
            torch.use_deterministic_algorithms(True, warn_only=False)
            tud.fill_uninitialized_memory = False
        return self

    def __exit__(self, *exc):
        if self.enabled:
            import torch
            import torch.utils.deterministic as tud

            torch.use_deterministic_algorithms(self._saved[0], warn_only=self._saved[1])
            tud.fill_uninitialized_memory = self._saved[2]
        return False


def choose_sdpa_gqa(backend: str, case: Case, device: str = "cuda") -> tuple[Optional[str], Optional[str]]:
    """How SDPA gets the grouped kv heads for this backend and case: ("enable_gqa" | "repeat_interleave",
    None), or (None, why neither runs). Probed with one sequence, forward and backward."""
    import torch

    s = case.shape
    if s.heads == s.kv_heads:
        return "enable_gqa", None  # nothing to group: the call is the same either way
    first_error = None
    for gqa in ("enable_gqa", "repeat_interleave"):
        fn = attention_fn(backend, gqa)
        try:
            with _DeterministicAlgorithms(backend == "torch_flash_det"):
                gen = torch.Generator(device=device).manual_seed(0)
                q = torch.randn(1, case.seqlen, s.heads, s.head_dim, device=device, dtype=torch.bfloat16,
                                generator=gen, requires_grad=True)
                k = torch.randn(1, case.seqlen, s.kv_heads, s.head_dim, device=device, dtype=torch.bfloat16,
                                generator=gen, requires_grad=True)
                v = torch.randn_like(k, requires_grad=True)
                fn(q, k, v, case.causal, s.head_dim ** -0.5).float().sum().backward()
                if torch.device(device).type == "cuda":
                    torch.cuda.synchronize()
            return gqa, None
        except RuntimeError as e:
            first_error = first_error or f"{gqa}: {str(e).splitlines()[0][:200]}"
    return None, first_error


# ---------------------------------------------------------------------------------------
# One training run
# ---------------------------------------------------------------------------------------
@dataclass
class RunResult:
    ms: list[float] = field(default_factory=list)  # timed steps only
    losses: list[float] = field(default_factory=list)  # every step, warm-ups included
    loss_bits: list[str] = field(default_factory=list)
    param_digests: dict[str, str] = field(default_factory=dict)
    peak_mem_gib: float = 0.0
    wall_s: float = 0.0


def make_batches(case: Case, n: int, seed: int, device: str = "cuda") -> list[tuple]:
    """``n`` (input, target) pairs of random hidden states, the same for every backend."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed + 1)
    shape = (case.batch, case.seqlen, case.shape.hidden)
    return [(torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen),
             torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)) for _ in range(n)]


class _StepTimer:
    """CUDA events around each step on a GPU (read once at the end: no sync per step, so host
    overhead shows only where the GPU waits for it); wall clock on the CPU (tests only)."""

    def __init__(self, device: str):
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.spans: list = []

    def start(self):
        import torch

        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start, keep: bool) -> None:
        import torch

        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        if keep:
            self.spans.append((start, end))

    def ms(self) -> list[float]:
        if self.cuda:
            return [s.elapsed_time(e) for s, e in self.spans]
        return [(e - s) * 1e3 for s, e in self.spans]


def train_run(case: Case, attn: Callable, batches: list[tuple], steps: int, warmup: int, seed: int, lr: float,
              digests: bool, deterministic_algorithms: bool = False, device: str = "cuda") -> RunResult:
    """Build the blocks from ``seed`` and train ``warmup + steps`` AdamW steps on ``batches``
    (cycled); the timed steps' ms, every step's loss (and its float32 bits) and, with
    ``digests``, each parameter's SHA-256 at the end."""
    import torch
    import torch.nn.functional as F

    t0 = time.time()
    res = RunResult()
    cuda = torch.device(device).type == "cuda"
    with _DeterministicAlgorithms(deterministic_algorithms):
        torch.manual_seed(seed)  # the same initial weights for every backend
        model = _model_classes()(case.shape, case.layers, case.seqlen, attn, case.causal, device=device,
                                 dtype=torch.bfloat16)
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        except (RuntimeError, TypeError):  # a torch without fused AdamW for this device / dtype
            opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=cuda)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        timer = _StepTimer(device)
        losses = []
        for step in range(warmup + steps):
            x, target = batches[step % len(batches)]
            start = timer.start()
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x).float(), target.float())
            loss.backward()
            opt.step()
            timer.stop(start, keep=step >= warmup)
            losses.append(loss.detach())
        if cuda:
            torch.cuda.synchronize()
        res.ms = timer.ms()
        stacked = torch.stack(losses).float()
        res.losses = stacked.tolist()
        res.loss_bits = [f"{b & 0xFFFFFFFF:08x}" for b in stacked.view(torch.int32).tolist()]
        res.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        if digests:
            res.param_digests = {n: tensor_digest(p) for n, p in model.named_parameters()}
        del model, opt, losses, stacked
    if cuda:
        torch.cuda.empty_cache()
    res.wall_s = time.time() - t0
    return res


def _error_text(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


def run_case(case: Case, backends: list[str], args: argparse.Namespace, log: Callable[[str], None],
             device: str = "cuda", make_attention: Callable[[str, str], Callable] = attention_fn,
             probe_gqa: Optional[Callable[[str, Case], tuple]] = None, order_index: Optional[int] = None) -> dict:
    """Every backend on one case; the case's record for the results file. (``device``,
    ``make_attention`` and ``probe_gqa`` let the CPU tests run this with stand-ins.)

    The backends run one after another (each a whole training run), in the order
    ``dash.bench.round_orders`` gives case ``order_index`` (None: as listed), so that over the
    cases each backend opens and follows every other about equally often instead of always
    holding one place (a run's clock depends on the power drawn before it). The order is
    recorded (``backend_order``)."""
    import torch

    from dash.bench import in_round_order

    cuda = torch.device(device).type == "cuda"
    probe_gqa = probe_gqa or (lambda b, c: choose_sdpa_gqa(b, c, device))

    rec: dict[str, Any] = {"label": case.label(), "case": asdict(case), "tokens": case.tokens,
                           "params": case.shape.params_per_layer() * case.layers + case.shape.hidden,
                           "step_flops": case.step_flops(), "attention_flops": case.attention_flops(),
                           "backends": {b: {} for b in backends}, "determinism": {}}
    order = list(backends) if order_index is None else in_round_order(list(backends), order_index)
    rec["backend_order"] = order
    batches = make_batches(case, min(4, args.warmup + args.steps), args.seed, device)
    for b in order:
        # SDPA's way of taking the grouped kv heads is found per case below; the others take them as they are.
        entry: dict[str, Any] = {"gqa": None if b.startswith("torch_") else "native"}
        rec["backends"][b] = entry
        try:
            if b.startswith("torch_"):
                gqa, why = probe_gqa(b, case)
                if gqa is None:
                    raise RuntimeError(f"no SDPA kernel for this case with enable_gqa or repeat_interleave ({why})")
                entry["gqa"] = gqa
            attn = make_attention(b, entry["gqa"])
            det = b in DETERMINISTIC_BACKENDS
            runs = []
            for _ in range(2 if det else 1):
                runs.append(train_run(case, attn, batches, args.steps, args.warmup, args.seed, args.lr, digests=det,
                                      deterministic_algorithms=(b == "torch_flash_det"), device=device))
            first = runs[0]
            med = statistics.median(first.ms)
            entry.update(ms_median=med, ms_steps=first.ms, tokens_per_s=case.tokens / (med * 1e-3),
                         model_tflops=case.step_flops() / (med * 1e-3) / 1e12, peak_mem_gib=first.peak_mem_gib,
                         losses=first.losses, loss_bits=first.loss_bits, run_wall_s=[r.wall_s for r in runs])
            if det:
                entry["ms_median_second_run"] = statistics.median(runs[1].ms)
                entry["param_digest"] = [combined_digest(r.param_digests) for r in runs]
                diffs = compare_runs(asdict(runs[0]), asdict(runs[1]))
                rec["determinism"][b] = {"identical": not diffs, "differences": diffs,
                                         "losses_second_run": runs[1].losses}
            extra = ""
            if det:
                extra = "  bitwise: " + ("identical" if not rec["determinism"][b]["differences"] else "DIFFERENT")
            log(f"  {b:>16}: {med:8.2f} ms  {entry['tokens_per_s'] / 1e3:8.1f}k tok/s  "
                f"{entry['model_tflops']:6.1f} TFLOP/s  peak {first.peak_mem_gib:5.1f} GiB  gqa={entry['gqa']}"
                f"  loss {first.losses[0]:.4f} -> {first.losses[-1]:.4f}{extra}")
        except Exception as e:  # one backend's failure (unsupported shape, OOM) must not end the others
            entry["error"] = _error_text(e)
            log(f"  {b:>16}: error: {entry['error']}")
            if cuda:
                torch.cuda.empty_cache()
    # Losses of every backend against the first deterministic DASH run, as a sanity check: the
    # same model and data, so they agree to a few bf16 roundings (a wrong mask does not).
    ref = rec["backends"].get("dash_det", {}).get("losses") or next(
        (r["losses"] for r in rec["backends"].values() if r.get("losses")), None)
    if ref:
        for r in rec["backends"].values():
            if r.get("losses"):
                r["loss_max_rel_diff_vs_reference"] = max(abs(x - y) / max(abs(y), 1e-12)
                                                          for x, y in zip(r["losses"], ref))
    del batches
    if cuda:
        torch.cuda.empty_cache()
    return rec


def environment() -> dict:
    import platform

    import torch

    try:
        from dash import bench as dash_bench

        env = dash_bench.environment()
    except Exception as e:  # DASH not importable: still record the machine
        props = torch.cuda.get_device_properties(0)
        env = {"device": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
               "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "commit": None,
               "checkout_head": _git_head(), "dash_environment_error": _error_text(e),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "host": platform.node()}
    env["python"] = platform.python_version()
    for label, importer in (("fa3_module", _import_fa3), ("fa4_module", _import_fa4)):
        try:
            mod = importer()
            env[label] = getattr(mod, "__file__", None)
        except ImportError:
            env[label] = None
    return env


def _git_head() -> Optional[str]:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              timeout=30).stdout.strip() or None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------
def _fail(message: str, status: int = 1) -> int:
    print(f"bench_e2e.py: error: {message}", file=sys.stderr)
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    # cuBLAS picks one workspace per stream; a fixed one is what makes its GEMMs repeatable
    # where several streams are involved (PyTorch's reproducibility notes). ":4096:8" is the
    # size PyTorch already uses on Hopper, so it does not change the timings. Read when the
    # first cuBLAS handle is made, so it is set before anything touches the GPU.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    problem = gpu_problem()
    if problem:
        return _fail(problem)
    import torch

    wants_dash = args.backends is None or any(b.startswith("dash_") for b in args.backends)
    dash_why, fatal = dash_problem() if wants_dash else ("not requested", False)
    if dash_why and wants_dash and (fatal or args.backends is not None):
        return _fail(dash_why + ("" if args.backends is not None else
                                 " (or leave DASH out: --backends torch_cudnn torch_flash ...)"))
    available = backend_availability(dash_why)
    try:
        backends, skipped = choose_backends(args.backends, available)
    except ValueError as e:
        return _fail(str(e))
    if not backends:
        return _fail("no attention backend can run here: " + "; ".join(f"{b}: {w}" for b, w in skipped.items()))
    if args.backends is None and dash_why:
        print(f"warning: DASH's backends are left out: {dash_why}", file=sys.stderr)
    cases = build_cases(args.models, args.seqlens, args.full_seqlens, args.tokens, args.layers)
    env = environment()
    print(f"{env['device']}, torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
          f"{torch.backends.cudnn.version()}); {len(cases)} cases x {len(backends)} backends; {args.layers} layers, "
          f"{args.warmup} warm-up + {args.steps} timed AdamW steps, bf16", flush=True)
    for b, why in skipped.items():
        print(f"  skipped {b}: {why}")
    t0 = time.time()
    records = []
    for i, case in enumerate(cases):
        print(f"{case.label()}  ({case.tokens} tokens/step, "
              f"{(case.shape.params_per_layer() * case.layers) / 1e6:.0f}M parameters)", flush=True)
        records.append(run_case(case, backends, args, lambda s: print(s, flush=True), order_index=i))
    payload = assemble(records, backends, args, env, skipped, sys.argv[1:] if argv is None else list(argv),
                       time.time() - t0)
    path = write_results(payload, results_path(args.out, env["device"], env["date"]))
    print()
    print(format_table(payload))
    print(f"\nwrote {path}")
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("no chart: matplotlib is not installed (pip install matplotlib, or pass --no-plot)")
        else:
            print(f"wrote {plot(payload, path.with_suffix('.png'))}")
    print(f"total {time.time() - t0:.0f} s")
    status, message = exit_status(payload)
    if message:
        print(message, file=sys.stderr)
    return status


def assemble(records: list[dict], backends: list[str], args: argparse.Namespace, env: dict, skipped: dict,
             argv: list[str], wall_s: float) -> dict:
    """The results file's content: ratios and summary added to the cases' records."""
    add_ratios(records)
    failures = [c["label"] for c in records for b, d in c["determinism"].items()
                if b in MUST_BE_BITWISE and not d["identical"]]
    return {
        "kind": "e2e",
        "meta": {"argv": argv, "wall_s": wall_s, "backend_notes": {b: BACKEND_NOTES[b] for b in backends},
                 "skipped_backends": skipped},
        "config": config_of(args),
        "environment": env,
        "backends": backends,
        "summary": summarize(records, backends),
        "determinism_ok": not failures,
        "cases": records,
    }


def exit_status(payload: dict) -> tuple[int, str]:
    """(exit status, message for stderr): 3 when two runs of a MUST_BE_BITWISE backend differ
    (a loud banner naming the cases and the differences), 1 when a DASH backend failed, else 0."""
    failures = [(c["label"], b, d["differences"]) for c in payload["cases"] for b, d in c["determinism"].items()
                if b in MUST_BE_BITWISE and not d["identical"]]
    if failures:
        bar = "!" * 100
        lines = [bar, f"DETERMINISM FAILURE: two runs from seed {payload['config']['seed']} are not bit-identical:"]
        lines += [f"  {label} {b}: {'; '.join(diffs)}" for label, b, diffs in failures]
        lines.append(bar)
        return 3, "\n".join(lines)
    dash_errors = [f"bench_e2e.py: error: {c['label']} {b}: {r['error']}" for c in payload["cases"]
                   for b, r in c["backends"].items() if b.startswith("dash_") and r.get("error")]
    if dash_errors:
        return 1, "\n".join(dash_errors)
    return 0, ""


if __name__ == "__main__":
    raise SystemExit(main())
