"""One side of an A/B timing of two kernel builds: times DASH's forward op (or backward op) on a
list of paper-grid rows beside torch's cuDNN SDPA in the same process (GPU time, host ahead:
``dash.bench.cuda_time_ms_interleaved``) and prints one JSON line per row, tagged with --label.

A build is whatever ``dash`` PYTHONPATH resolves to. Run the two builds in alternating
processes, at least twice each, and compare their cuDNN-normalised times, e.g.:

    for r in 1 2; do for b in base:$PWD variant:/tmp/variant; do
      PYTHONPATH=${b#*:} python tools/ab_time.py --label ${b%%:*} --op fwd; done; done

The cuDNN column is the clock reference: it moved by up to 2 % between processes in earlier
A/Bs (docs/kernel-notes.md, fourth pass), more than some changes under test.

``--sustained SECONDS`` times under sustained load instead: DASH and cuDNN each run back to back
for SECONDS per round (two rounds, order swapped), so the GPU sits at its power cap as in a
training step, while ``nvidia-smi`` samples the SM clock and power (``bwd_kernel_breakdown``'s
sampler); each line then also carries each side's median clock and power. Bursts of a few calls
behind a sleep do not reach the cap, and there a variant that issues fewer instructions can lose
to one that draws more power (docs/kernel-notes.md, nineteenth pass).
"""

from __future__ import annotations

import json
import sys

import torch

from dash._bench import refuse_without_gpu
from dash.cli import OneLineErrorParser, nonnegative_float


def main() -> int:
    ap = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="build", help="name of this build in the output")
    ap.add_argument("--op", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--hdim", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--mask", choices=("full", "causal", "both"), default="both")
    ap.add_argument("--deterministic", action="store_true", help="bwd: deterministic mode (schedule auto)")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--scores", choices=("random", "rising", "sink"), default="random",
                    help="rising: every row's scores grow by more than 2**8 (exp2 units) per 128 keys toward "
                         "key 0, the forward's last block, so its online softmax raises its max on every block "
                         "(the worst case of FwdTileConfig.rescale_max_growth_log2); sink: keys 0-3 score 12 "
                         "natural units above the rest in every row (an attention sink, met in the last block "
                         "the forward visits: FwdTileConfig.lazy_max_sum_log2's typical outgrown block)")
    ap.add_argument("--sustained", type=nonnegative_float, default=0.0,
                    help="seconds of back-to-back calls per side and round under sustained load (0: bursts)")
    args = ap.parse_args()
    status = refuse_without_gpu("ab_time.py")
    if status:
        return status
    sampler = None
    if args.sustained > 0:
        from bwd_kernel_breakdown import ClockSampler  # tools/, beside this script; dash is imported already

        sampler = ClockSampler()
    try:
        return _time_rows(args, sampler)
    finally:
        if sampler is not None:
            sampler.stop()


def _sustained_ms(fns, inputs, seconds: float, sampler, rounds: int = 2) -> dict[str, dict]:
    """Per side: time per call over windows of ``seconds`` of back-to-back calls (the host far
    ahead of the GPU, a sync every 64 calls), and the median SM clock and power in them."""
    from dash.bench import back_to_back

    per: dict[str, list[dict]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            fn = fns[name]
            t0, t1, n = back_to_back(lambda: fn(inputs), seconds)
            per[name].append({"ms": (t1 - t0) / n * 1e3, **sampler.window(t0 + 0.2, t1)})
    out = {}
    for name, runs in per.items():
        mhz = [x["sm_mhz"] for x in runs if "sm_mhz" in x]
        watts = [x["watts"] for x in runs if "watts" in x]
        out[name] = {"ms": sum(x["ms"] for x in runs) / len(runs),
                     "sm_mhz": sum(mhz) / len(mhz) if mhz else None,
                     "watts": sum(watts) / len(watts) if watts else None}
    return out


def _time_rows(args, sampler) -> int:
    import dash
    from dash import ops
    from dash.bench import Shape, cuda_time_ms_interleaved, make_input_sets
    from dash.digest import tensor_digest

    masks = {"full": [False], "causal": [True], "both": [False, True]}[args.mask]
    for d in args.hdim:
        for causal in masks:
            for s in args.seqlen:
                # Seeded per row: both builds see the same inputs, so their outputs compare bit for bit.
                inputs = make_input_sets(Shape.paper(s, d, causal), 1, torch.device("cuda"))[0]
                q, k, v = inputs["q"], inputs["k"], inputs["v"]
                if args.scores == "rising":
                    _make_scores_rise(inputs, causal)
                elif args.scores == "sink":
                    _make_sink(inputs, causal)
                digest = tensor_digest(inputs["out"])[:16] + "/" + tensor_digest(inputs["lse"])[:16]
                det = bool(args.deterministic)
                inputs.update(causal=causal, det=det, qkv_t=tuple(t.transpose(1, 2) for t in (q, k, v)),
                              schedule=ops.resolve_schedule("auto", q, k, causal, det, 0))
                fns = {"dash": _dash_fwd if args.op == "fwd" else _dash_bwd,
                       "cudnn": _cudnn_fwd if args.op == "fwd" else _cudnn_fwd_bwd}
                if args.op == "bwd":  # deterministic mode: the same bits in A and B?
                    digest += "|" + "/".join(tensor_digest(g)[:12] for g in _dash_bwd(inputs))
                errors: dict[str, str] = {}
                ms = cuda_time_ms_interleaved(fns, [inputs], warmup=5, iters=args.iters, errors=errors)
                if errors or "dash" not in ms or "cudnn" not in ms:
                    print(f"ab_time: hdim {d} causal {causal} seqlen {s}: skipped, {errors}", file=sys.stderr, flush=True)
                    continue
                clock = {}
                if sampler is not None:  # these replace the burst timing above, which is kept beside them
                    clock = {"burst_dash_ms": ms["dash"], "burst_cudnn_ms": ms["cudnn"]}
                    sus = _sustained_ms(fns, inputs, args.sustained, sampler)
                    ms = {name: x["ms"] for name, x in sus.items()}
                    clock.update({f"{name}_{key}": x[key] for name, x in sus.items() for key in ("sm_mhz", "watts")})
                    clock["sustained_s"] = args.sustained
                print(json.dumps({"label": args.label, "scores": args.scores, "op": args.op, "hdim": d,
                                  "causal": causal, "seqlen": s,
                                  "dash_ms": ms["dash"], "cudnn_ms": ms["cudnn"],
                                  "dash_over_cudnn_time": ms["dash"] / ms["cudnn"], "digest": digest,
                                  "deterministic": bool(args.deterministic), **clock,
                                  "dash_version": getattr(dash, "__file__", "?")}), flush=True)
    return 0


def _make_scores_rise(s, causal):
    """Scores that rise by about 7 natural units (10 in exp2 units) per 128 keys toward key 0, in
    every row: q's first coordinate 8, k's (seqlen - j) / 128 * 7 * 8 * sqrt(d) / 64. out and lse
    are recomputed from the new inputs."""
    from dash import ops

    q, k = s["q"], s["k"]
    seqlen, d = k.shape[1], k.shape[-1]
    q[..., 0] = 8.0
    ramp = (seqlen - torch.arange(seqlen, device=k.device, dtype=torch.float32)) / 128 * 7.0 * 8.0 * d**0.5 / 64
    k[..., 0] = ramp[None, :, None].to(k.dtype)
    s["out"], s["lse"] = ops.forward_impl(q, k, s["v"], s["scale"], causal)


def _make_sink(s, causal):
    """Keys 0-3 score about 12 natural units above the others in every row (q's first coordinate
    1, k's 12 * sqrt(d) for those keys); out and lse are recomputed from the new inputs."""
    from dash import ops

    q, k = s["q"], s["k"]
    q[..., 0] = 1.0
    k[:, :4, :, 0] = 12.0 * k.shape[-1] ** 0.5
    s["out"], s["lse"] = ops.forward_impl(q, k, s["v"], s["scale"], causal)


def _dash_fwd(s):
    from dash import ops

    return ops.forward_impl(s["q"], s["k"], s["v"], s["scale"], s["causal"])


def _dash_bwd(s):
    return torch.ops.dash.bwd(s["dout"], s["q"], s["k"], s["v"], s["out"], s["lse"], s["scale"], s["causal"], s["det"],
                              s["schedule"], 0)


def _sdpa_cudnn(qt, kt, vt, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


def _cudnn_fwd(s):
    return _sdpa_cudnn(*s["qkv_t"], s["causal"])


def _cudnn_fwd_bwd(s):
    qs, ks, vs = (t.detach().requires_grad_() for t in s["qkv_t"])
    o = _sdpa_cudnn(qs, ks, vs, s["causal"])
    return torch.autograd.grad(o, (qs, ks, vs), torch.ones_like(o))


if __name__ == "__main__":
    sys.exit(main())
