"""Data-parallel training of a tiny Llama with DASH, for bitwise run-to-run comparison.

    torchrun --standalone --nproc_per_node=2 tools/train_multigpu.py --mode ddp   --out DIR
    torchrun --standalone --nproc_per_node=2 tools/train_multigpu.py --mode fsdp2 --out DIR
    torchrun --standalone --nproc_per_node=2 tools/train_multigpu.py --mode ddp --attn sdpa \
        --torch-deterministic off --out DIR

Builds a tiny Llama from a transformers ``LlamaConfig`` in code (no downloads; GQA: 8 query
heads, 2 kv heads, head_dim 64), with ``attn_implementation="dash"`` registered by
``dash.integrations.transformers`` with ``deterministic=True`` (or transformers' "sdpa" /
"eager" for comparison), wraps it in DDP or FSDP2 (``fully_shard`` per decoder layer and on the
root), and trains ``--steps`` AdamW steps on seeded random tokens, each rank its own shard of
every global batch. Rank 0 writes DIR/rank0.json: every rank's loss at every step (float and
float32 bits), a SHA-256 of every parameter after the last step (the full parameters, gathered
from the shards for FSDP2) and of all of them together, whether the ranks' parameters agree,
the settings below as they were in effect, and the versions. tools/multigpu_determinism.py runs
this twice per mode and compares the files.

What determinism needs, and where each is set (see DETERMINISM_ENV and ``configure_torch``):

* the same seeds: the weights are initialised from ``--seed`` on every rank (FSDP2 shards the
  weights each rank made, it does not broadcast them), and each step's global batch is drawn
  from a generator seeded with (seed, step) before the rank takes its shard;
* ``torch.use_deterministic_algorithms(True)``: every op with a non-deterministic CUDA kernel
  uses a deterministic one or raises (DASH's backward follows it too, and is registered with
  ``deterministic=True`` anyway); cuDNN in deterministic mode without autotuning;
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS GEMMs repeat bitwise only with a fixed workspace
  configuration (PyTorch raises without it under deterministic algorithms);
* NCCL: it documents no determinism guarantee, but a reduction's order is fixed by the
  algorithm, the protocol, the channels and the ring/tree built from the topology. NCCL picks
  algorithm and protocol per message size from its tuning model (NVIDIA/nccl#754), so both are
  pinned: ``NCCL_ALGO=Ring``, ``NCCL_PROTO=Simple``. NVLink SHARP (NVLS) reduces inside the
  NVSwitch and is "not deterministic between different calls" (NVIDIA/nccl#1497), so it is
  off (``NCCL_NVLS_ENABLE=0``; the GPU machines require that anyway), as is CollNet
  (in-network reduction). With the same GPUs, the same number of ranks and the same message
  sizes, runs then reduce in the same order. (With 2 ranks each element is a single a + b,
  which is commutative: 2 GPUs cannot show NCCL order effects; 4 or 8 can.)
* fixed message sizes: DDP's gradient buckets have a fixed capacity (``--bucket-cap-mb``); the
  buckets are rebuilt once after the first backward in the order the gradients became ready,
  which the autograd engine makes the same in every run. FSDP2 reduce-scatters one flat
  buffer per ``fully_shard`` unit, whose size the model fixes.

``--device cpu`` (gloo, float32, no DASH) exists to test the plumbing on machines without GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the checkout's dash/ when run from it

from dash.digest import combined_digest, float32_bits, tensor_digest  # noqa: E402

#: Environment for reproducible runs, set (unless already set) before anything starts CUDA,
#: cuBLAS or NCCL. The module docstring says why each is needed.
DETERMINISM_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_COLLNET_ENABLE": "0",
    # NVLink multicast stays off on the shared GPU machines (it can take a host's GPUs out of
    # service), also in PyTorch's symmetric memory and NVSHMEM.
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: Recorded in the results as they were in effect (set by us or by the caller).
RECORDED_ENV = tuple(DETERMINISM_ENV) + ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_TOPO_FILE",
                                         "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "CUDA_VISIBLE_DEVICES")

#: The tiny Llama (GQA 8 query / 2 kv heads, head_dim 64: a shape DASH's kernels take).
MODEL = dict(vocab_size=1024, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, attention_dropout=0.0,
             tie_word_embeddings=False, max_position_embeddings=4096)

MODES = ("ddp", "fsdp2")
ATTNS = ("dash", "sdpa", "eager")


# ---------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------
def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return v


def _nonnegative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_multigpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", required=True, choices=MODES, help="data parallelism: DDP or FSDP2 (fully_shard)")
    p.add_argument("--out", required=True, type=Path, help="folder for rank0.json (made if missing)")
    p.add_argument("--attn", choices=ATTNS, default="dash",
                   help="attention: dash (deterministic=True) or transformers' sdpa / eager (default dash)")
    p.add_argument("--torch-deterministic", choices=("on", "off"), default="on",
                   help="torch.use_deterministic_algorithms(True) or not (default on)")
    p.add_argument("--steps", type=_positive, default=6, help="AdamW steps (default 6)")
    p.add_argument("--seed", type=_nonnegative, default=0, help="seed of the weights and the data (default 0)")
    p.add_argument("--batch", type=_positive, default=4, help="sequences per rank per step (default 4)")
    p.add_argument("--seqlen", type=_positive, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--layers", type=_positive, default=4, help="decoder layers (default 4)")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--bucket-cap-mb", type=_positive_float, default=25.0,
                   help="DDP gradient bucket capacity in MiB, fixed so runs reduce the same messages (default 25)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (NCCL) or cpu (gloo; for testing the plumbing only) (default cuda)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="weights' dtype (default bf16 on cuda, fp32 on cpu; dash needs bf16)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.attn == "dash" and args.device != "cuda":
        parser.error("--attn dash needs --device cuda (DASH's kernels run on Hopper GPUs); "
                     "use --attn sdpa or eager to test the plumbing on the CPU")
    if args.attn == "dash" and args.dtype != "bf16":
        parser.error(f"--attn dash needs --dtype bf16 (DASH takes bf16/fp16 tensors), not {args.dtype}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"argument --out: {args.out} exists and is not a folder")
    return args


def launch_problem(env: Optional[dict] = None) -> Optional[str]:
    """Why this process was not started by torchrun (None when it was)."""
    env = os.environ if env is None else env
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        return (f"{', '.join(missing)} not set: start this script with torchrun, e.g. "
                "torchrun --standalone --nproc_per_node=2 tools/train_multigpu.py --mode ddp --out DIR")
    return None


# ---------------------------------------------------------------------------------------
# Digests and comparison (pure)
# ---------------------------------------------------------------------------------------
#: Settings two runs must share to be comparable.
CONFIG_KEYS = ("mode", "attn", "torch_deterministic", "world_size", "steps", "seed", "batch_per_rank", "seqlen",
               "layers", "dtype", "device")


def compare_results(a: dict, b: dict, max_names: int = 5) -> list[str]:
    """Differences between two rank0.json results, as sentences; empty when bit-identical
    (every rank's loss bits at every step, every parameter's digest)."""
    cfg = [k for k in CONFIG_KEYS if a.get(k) != b.get(k)]
    if cfg:
        return [f"not the same configuration: {', '.join(f'{k}={a.get(k)!r} vs {b.get(k)!r}' for k in cfg)}"]
    diffs = []
    la, lb = a.get("loss_bits") or [], b.get("loss_bits") or []
    if len(la) != len(lb) or any(len(x) != len(y) for x, y in zip(la, lb)):
        diffs.append("the runs recorded different numbers of ranks or steps")
    else:
        for rank, (x, y) in enumerate(zip(la, lb)):
            steps = [i for i, (u, v) in enumerate(zip(x, y)) if u != v]
            if steps:
                i = steps[0]
                diffs.append(f"rank {rank}: losses differ at {len(steps)} of {len(x)} steps, first at step {i} "
                             f"({a['losses'][rank][i]:.9g} vs {b['losses'][rank][i]:.9g})")
    pa, pb = a.get("param_digests") or {}, b.get("param_digests") or {}
    if pa.keys() != pb.keys():
        diffs.append(f"the runs have different parameters ({', '.join(sorted(set(pa) ^ set(pb))[:max_names])})")
    else:
        differing = [n for n in pa if pa[n] != pb[n]]
        if differing:
            shown = ", ".join(differing[:max_names]) + (", ..." if len(differing) > max_names else "")
            diffs.append(f"{len(differing)} of {len(pa)} parameters differ bitwise after the last step ({shown})")
    if not la and not pa:
        diffs.append("nothing was recorded to compare")
    return diffs


def check_result(r: dict) -> list[str]:
    """Problems within one run: ranks whose parameters disagree (replicas must be equal), a
    DASH run in which DASH was not called for every layer and step, non-finite losses."""
    problems = []
    if not r.get("replicas_identical", False):
        problems.append(f"the ranks' parameters differ after training (per rank: {r.get('rank_param_sha256')})")
    if r.get("attn") == "dash":
        want = r["layers"] * r["steps"]
        calls = r.get("dash_calls_per_rank") or []
        if not calls or any(c != want for c in calls):
            problems.append(f"DASH was called {calls} times per rank, expected {want} (layers x steps): "
                            "the model did not use attn_implementation='dash'")
    bad = [(rank, i) for rank, ls in enumerate(r.get("losses") or []) for i, v in enumerate(ls)
           if not (isinstance(v, float) and abs(v) < float("inf"))]
    if bad:
        problems.append(f"non-finite losses at (rank, step) {bad[:5]}")
    return problems


# ---------------------------------------------------------------------------------------
# Training (one process per rank, under torchrun)
# ---------------------------------------------------------------------------------------
def apply_determinism_env(env: Optional[dict] = None) -> dict:
    """Set DETERMINISM_ENV in ``env`` (default os.environ) where not already set; returns the
    values in effect."""
    env = os.environ if env is None else env
    for k, v in DETERMINISM_ENV.items():
        env.setdefault(k, v)
    return {k: env.get(k) for k in RECORDED_ENV}


def configure_torch(deterministic: bool) -> None:
    import torch

    torch.use_deterministic_algorithms(deterministic, warn_only=False)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False  # autotuning may pick other kernels run to run


def tiny_llama(args: argparse.Namespace, attn_impl: str):
    """The model, built from ``args.seed`` on the CPU (so every rank makes the same weights,
    whatever its GPU) in float32, then moved."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(num_hidden_layers=args.layers, **MODEL)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_impl)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return model.to(dtype=dtype)


def global_batch(step: int, seed: int, world: int, batch: int, seqlen: int, vocab: int):
    """Step ``step``'s tokens for all ranks, (world * batch, seqlen), Zipf-distributed (learnable
    statistics: the loss goes down), from a generator seeded with (seed, step)."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(zipf, world * batch * seqlen, replacement=True, generator=gen).view(world * batch, seqlen)


def _count_dash_calls() -> dict:
    """Count the calls of DASH's ``flash_attn_func`` (what the transformers integration calls),
    to prove that the model ran DASH. The function is replaced wherever a loaded dash module
    holds it (its defining module and the modules re-exporting it), so the count does not
    depend on which of them the integration looks it up in."""
    import dash

    dash.flash_attn_func  # noqa: B018  (imports the defining module)
    real = dash.flash_attn_func
    counter = {"n": 0}

    def counting(*a, **k):
        counter["n"] += 1
        return real(*a, **k)

    patched = []
    for name, mod in list(sys.modules.items()):
        if (name == "dash" or name.startswith("dash.")) and getattr(mod, "flash_attn_func", None) is real:
            setattr(mod, "flash_attn_func", counting)
            patched.append(name)
    counter["patched"] = patched
    return counter


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:  # torch 2.4-2.5
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def train(args: argparse.Namespace) -> Optional[dict]:
    """One rank's training; the results (on rank 0, None elsewhere)."""
    env_in_effect = apply_determinism_env()  # before torch starts CUDA, cuBLAS or NCCL
    import torch
    import torch.distributed as dist

    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise SystemExit(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU")
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; start at most "
                             f"that many processes per node (--nproc_per_node)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    t0 = time.time()
    try:
        configure_torch(args.torch_deterministic == "on")
        counter = None
        if args.attn == "dash":
            import dash
            import dash.integrations.transformers as dt

            ok, why = dash._ext.kernels_status()
            if not ok:
                raise SystemExit(f"DASH's kernels are not usable here: {why}")
            dt.register("dash", deterministic=True)
            counter = _count_dash_calls()
        model = tiny_llama(args, args.attn).to(device).train()
        if args.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            # The bucket capacity is explicit (not left to a default that may change) so that
            # every run all-reduces the same messages; every parameter gets a gradient.
            wrapped = DDP(model, device_ids=[local_rank] if cuda else None, bucket_cap_mb=args.bucket_cap_mb,
                          find_unused_parameters=False)
            inner = wrapped.module
        else:
            from torch.distributed.device_mesh import init_device_mesh

            fully_shard = _fully_shard()
            mesh = init_device_mesh(device.type, (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            wrapped = inner = model
        opt = torch.optim.AdamW(wrapped.parameters(), lr=args.lr, weight_decay=0.01)
        losses = []
        for step in range(args.steps):
            ids = global_batch(step, args.seed, world, args.batch, args.seqlen, MODEL["vocab_size"])
            ids = ids[rank * args.batch:(rank + 1) * args.batch].to(device)
            loss = wrapped(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().float())
        local = torch.stack(losses)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        # Full parameters: a DTensor shard (FSDP2) is gathered on every rank (a collective: all
        # ranks call it, in the same order); DDP's replicas are full already.
        digests = {}
        for name, p in inner.named_parameters():
            t = p.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            digests[name] = tensor_digest(t)
        mine = combined_digest(digests)
        rank_digests: list = [None] * world
        dist.all_gather_object(rank_digests, mine)
        calls: list = [None] * world
        dist.all_gather_object(calls, counter["n"] if counter else 0)
        if rank != 0:
            return None
        loss_values = [g.cpu().tolist() for g in gathered]
        import transformers

        return {
            "mode": args.mode, "attn": args.attn, "torch_deterministic": args.torch_deterministic,
            "world_size": world, "steps": args.steps, "seed": args.seed, "batch_per_rank": args.batch,
            "seqlen": args.seqlen, "layers": args.layers, "dtype": args.dtype, "device": args.device,
            "lr": args.lr, "bucket_cap_mb": args.bucket_cap_mb if args.mode == "ddp" else None,
            "model": dict(MODEL, num_hidden_layers=args.layers),
            "losses": loss_values, "loss_bits": [float32_bits(v) for v in loss_values],
            "param_sha256": mine, "param_digests": digests, "rank_param_sha256": rank_digests,
            "replicas_identical": len(set(rank_digests)) == 1,
            "dash_calls_per_rank": calls if args.attn == "dash" else None,
            "dash_counted_in": counter["patched"] if counter else None,
            "env": env_in_effect,
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                         "transformers": transformers.__version__, "python": platform.python_version(),
                         "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None},
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else ["cpu"],
            "wall_s": time.time() - t0,
        }
    finally:
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    problem = launch_problem()
    if problem:
        print(f"train_multigpu.py: error: {problem}", file=sys.stderr)
        return 2
    result = train(args)
    if result is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "rank0.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        last = ", ".join(f"{ls[-1]:.4f}" for ls in result["losses"])
        print(f"{args.mode}/{args.attn} (torch deterministic {args.torch_deterministic}), "
              f"{result['world_size']} ranks: loss {result['losses'][0][0]:.4f} -> {last} (per rank); "
              f"parameters sha256 {result['param_sha256'][:16]}; wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
