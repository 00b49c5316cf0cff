"""A CPU model of the forward kernel's online softmax, block by block, as the kernel runs it.

    python tools/fwd_softmax_model.py [--hdim 64] [--causal] [--seqlen-q 1000] [--seqlen-k 1063]
                                      [--scores random|sink|rising|offsets|jump] [--rule lazy]

The kernel (csrc/kernels/fwd_main_kernel.h) walks a Q tile's KV blocks from the last to the first
and keeps, per row, the max it subtracts before the exponentials. Three rules, picked per (head
dim, mask) by dash/config.py's FwdTileConfig:

* ``exact``: the running max, raised to every block's row max (FA3's online softmax);
* ``conditional`` (``rescale_max_growth_log2``): raised only where a block's row max exceeds it by
  more than 2**growth (exp2 units), so P reaches up to 2**growth;
* ``lazy`` (``lazy_max_sum_log2`` on top of ``conditional``): an unmasked middle block takes its
  exponentials under the max so far, without its row max. Each thread of the warpgroup sums its
  P per row (the WGMMA accumulator layout: lane t of a quad holds columns 2t, 2t+1 of every 8);
  where one partial sum passes 2**bound, or where a row of the warpgroup meets its first visible
  key in the block, the warpgroup (a vote) computes S again and raises the max by the
  conditional rule, and also where a row's sum passed the bound. Masked blocks (the causal
  diagonal, the key tail) keep the conditional rule.

The model does this in float32 with P rounded to the input dtype before P V, as the kernel does,
and reports O, the LSE, the largest P, and the blocks that took the lazy rule's slow path, per
(Q tile, warpgroup). ``tests/test_fwd_softmax_model.py`` checks every table row under each rule
against the float64 reference by FA3's bound, and the rule's properties.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dash import config as dash_config  # noqa: E402

RULES = ("exact", "conditional", "lazy")
LOG2E = 1.4426950408889634


@dataclass
class SoftmaxRun:
    out: torch.Tensor  # (seqlen_q, head_dim) float32
    lse: torch.Tensor  # (seqlen_q,) float32, natural log, -inf for rows without a visible key
    max_p: float  # largest P the rule computed (after a slow path: the P kept)
    slow_blocks: dict = field(default_factory=dict)  # (Q tile, warpgroup) -> [blocks on the slow path]


def visible_end(row: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Keys [0, visible_end) are visible to query ``row`` (bottom-right aligned causal mask)."""
    return min(seqlen_k, row + seqlen_k - seqlen_q + 1) if causal else seqlen_k


def thread_partials(p: torch.Tensor) -> torch.Tensor:
    """Per row, the four partial sums of a quad: lane t holds columns c with (c % 8) // 2 == t."""
    rows, cols = p.shape
    return p.reshape(rows, cols // 8, 4, 2).sum(dim=(1, 3))  # (rows, 4)


def run_rule(scores: torch.Tensor, v: torch.Tensor, *, causal: bool, rule: str, block_m: int, block_n: int,
             growth_log2: float = 8.0, lazy_bound_log2: int = 12, p_dtype=torch.bfloat16,
             first_keys_slow: bool = True) -> SoftmaxRun:
    """``scores``: (seqlen_q, seqlen_k) float32, already multiplied by the softmax scale and log2(e)
    (exp2 units, what the kernel's FFMA computes); ``v``: (seqlen_k, d). ``first_keys_slow=False``
    models the lazy rule without its forced slow path where a row meets its first key (a row
    without a max then subtracts 0 from its first scores): the bug the tests show it would be."""
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is not supported ({', '.join(RULES)})")
    seqlen_q, seqlen_k = scores.shape
    d = v.shape[1]
    n_blocks = -(-seqlen_k // block_n)
    pad_k = n_blocks * block_n - seqlen_k
    m_blocks = -(-seqlen_q // block_m)
    pad_q = m_blocks * block_m - seqlen_q
    s = torch.nn.functional.pad(scores.float(), (0, pad_k, 0, pad_q), value=0.0)
    vv = torch.nn.functional.pad(v.float(), (0, 0, 0, pad_k))
    rows = torch.arange(m_blocks * block_m)
    keys = torch.arange(n_blocks * block_n)
    ends = torch.tensor([visible_end(int(r), seqlen_q, seqlen_k, causal) for r in rows])
    visible = keys[None, :] < ends[:, None]
    s = s.masked_fill(~visible, -math.inf)
    bound = float(2 ** lazy_bound_log2)

    out = torch.zeros(m_blocks * block_m, d)
    lse = torch.full((m_blocks * block_m,), -math.inf)
    max_p = 0.0
    slow_blocks: dict = {}
    for m in range(m_blocks):
        r0 = m * block_m
        n_end = min(n_blocks, -(-max(int(ends[r0 + block_m - 1]), 0) // block_n)) if causal else n_blocks
        for wg in range(block_m // 64):
            rs = slice(r0 + 64 * wg, r0 + 64 * wg + 64)
            row_max = torch.full((64,), -math.inf)
            row_sum = torch.zeros(64)
            o = torch.zeros(64, d)
            first_end = int(ends[r0 + 64 * wg])  # the warpgroup's first row: the fewest keys
            first_key_block = (first_end - 1) // block_n if first_end > 0 else -1
            for step, n in enumerate(range(n_end - 1, -1, -1)):
                sb = s[rs, n * block_n:(n + 1) * block_n]
                vb = vv[n * block_n:(n + 1) * block_n]
                # The block needs a mask when a row of the tile (not just this warpgroup) has a
                # key of it masked: the kernel decides per tile.
                tile_needs_mask = bool((~visible[r0:r0 + block_m, n * block_n:(n + 1) * block_n]).any())
                block_max = sb.max(dim=1).values
                if step == 0 or rule == "exact":
                    new_max = torch.maximum(row_max, block_max)
                    raise_ = new_max > row_max
                    target = new_max
                    p = None
                elif rule == "conditional" or tile_needs_mask:
                    raise_ = (block_max - row_max) > growth_log2  # NaN (both -inf) -> False
                    target = block_max
                    p = None
                else:  # lazy, unmasked middle block
                    sub = torch.where(row_max == -math.inf, torch.zeros(()), row_max)
                    p_lazy = torch.exp2(sb - sub[:, None])
                    partial = thread_partials(p_lazy)
                    over_thread = ~(partial <= bound)  # NaN counts as over
                    first_keys = first_keys_slow and causal and n >= first_key_block
                    if bool(over_thread.any()) or first_keys:
                        slow_blocks.setdefault((m, wg), []).append(n)
                        over = over_thread.any(dim=1)
                        raise_ = ((block_max - row_max) > growth_log2) | (over & (block_max > row_max))
                        target = block_max
                        p = None
                    else:
                        raise_ = torch.zeros(64, dtype=torch.bool)
                        target = row_max
                        p = p_lazy
                if p is None:
                    rescale = torch.where(raise_, torch.exp2(row_max - target), torch.ones(()))
                    row_max = torch.where(raise_, target, row_max)
                    sub = torch.where(row_max == -math.inf, torch.zeros(()), row_max)
                    p = torch.exp2(sb - sub[:, None])
                    row_sum = row_sum * rescale
                    o = o * rescale[:, None]
                max_p = max(max_p, float(p.max()))
                row_sum = row_sum + thread_partials(p).sum(dim=1)
                o = o + p.to(p_dtype).float() @ vb.to(p_dtype).float()
            empty = row_sum == 0
            sub = torch.where(row_max == -math.inf, torch.zeros(()), row_max)
            out[rs] = torch.where(empty[:, None], torch.zeros(()), o / torch.where(empty, torch.ones(()), row_sum)[:, None])
            lse[rs] = torch.where(empty, torch.full((), -math.inf), (sub + torch.log2(row_sum)) / LOG2E)
    return SoftmaxRun(out[:seqlen_q], lse[:seqlen_q], max_p, slow_blocks)


def make_scores(pattern: str, seqlen_q: int, seqlen_k: int, d: int, dtype=torch.bfloat16, seed: int = 0):
    """q, k, v of one head (rows, d) in ``dtype`` and the softmax scale, for a score pattern:
    random (scale 1/sqrt(d)); sink (keys 0-3 score 12 natural units above the rest in every row);
    rising (every row's scores grow toward key 0 by more than 2**8 exp2 units per 128 keys);
    offsets (each row's scores sit at -60 .. +90 natural units: a row that meets its first key late
    must not subtract 0); jump (keys 0-3 score 100 units above the rest in half the rows: +inf
    under the max so far)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seqlen_q, d, generator=g)
    k = torch.randn(seqlen_k, d, generator=g)
    v = torch.randn(seqlen_k, d, generator=g)
    if pattern == "random":
        return q.to(dtype), k.to(dtype), v.to(dtype), d ** -0.5
    q, k = q * 0.15, k * 0.15
    k[:, 0] = 4.0
    k[:, 1] = 0.0
    q[:, 0] = 0.0
    if pattern == "sink":
        k[:4, 1] = 12.0
        q[:, 1] = 1.0
    elif pattern == "jump":
        k[:4, 1] = 100.0
        q[:, 1] = (torch.rand(seqlen_q, generator=g) < 0.5).float()
    elif pattern == "offsets":
        offsets = torch.tensor([-60.0, -20.0, 0.0, 40.0, 90.0])
        q[:, 0] = offsets[torch.randint(0, 5, (seqlen_q,), generator=g)] / 4.0
    elif pattern == "rising":
        k[:, 1] = (seqlen_k - torch.arange(seqlen_k).float()) / 128
        q[:, 1] = 8.0  # 8 natural units = 11.5 exp2 units per 128 keys
    else:
        raise ValueError(f"pattern={pattern!r} is not supported (random, sink, rising, offsets, jump)")
    return q.to(dtype), k.to(dtype), v.to(dtype), 1.0


def table_rule(cfg) -> str:
    if cfg.lazy_max_sum_log2 is not None:
        return "lazy"
    return "exact" if cfg.rescale_max_growth_log2 is None else "conditional"


def run_config(cfg, q, k, v, scale, rule: str | None = None, p_dtype=None) -> SoftmaxRun:
    """The model of table row ``cfg`` (FwdTileConfig) on one head, under its own rule or ``rule``."""
    scores = (q.float() @ k.float().T) * (scale * LOG2E)
    return run_rule(scores, v, causal=cfg.causal, rule=rule or table_rule(cfg), block_m=cfg.block_m,
                    block_n=cfg.block_n, growth_log2=cfg.rescale_max_growth_log2 or 8.0,
                    lazy_bound_log2=cfg.lazy_max_sum_log2 if cfg.lazy_max_sum_log2 is not None else 12,
                    p_dtype=p_dtype or q.dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen-q", type=int, default=1000)
    ap.add_argument("--seqlen-k", type=int, default=1063)
    ap.add_argument("--scores", default="sink", choices=("random", "sink", "rising", "offsets", "jump"))
    ap.add_argument("--rule", choices=RULES, default=None, help="default: the table row's")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = ap.parse_args(argv)
    from dash import reference

    cfg = dash_config.fwd_tile_config(args.hdim, args.causal)
    dtype = getattr(torch, args.dtype)
    q, k, v, scale = make_scores(args.scores, args.seqlen_q, args.seqlen_k, args.hdim, dtype)
    run = run_config(cfg, q, k, v, scale, args.rule)
    hi_out, hi_lse = reference.attention_forward(q[None, :, None], k[None, :, None], v[None, :, None], scale,
                                                 causal=args.causal, compute_dtype=torch.float64)
    hi_out, hi_lse = hi_out[0, :, 0], hi_lse[0, 0]
    finite = torch.isfinite(hi_lse)
    print(f"rule {args.rule or table_rule(cfg)}  scores {args.scores}  O error {float((run.out - hi_out).abs().max()):.2e}  "
          f"LSE error {float((run.lse[finite] - hi_lse[finite]).abs().max()):.2e}  max P {run.max_p:.4g}  "
          f"slow blocks {sum(map(len, run.slow_blocks.values()))} in {len(run.slow_blocks)} (Q tile, warpgroup) pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
