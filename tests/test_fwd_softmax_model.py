"""CPU tests of the forward's softmax rules (tools/fwd_softmax_model.py): every table row under
each rule against the float64 reference by FA3's bound, and the lazy block max's properties
(P within its bound, when the slow path is taken, rows that meet their first key late)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import fwd_softmax_model as M  # noqa: E402

from dash import config as C  # noqa: E402
from dash import reference  # noqa: E402

# Pairs where causal rows meet their first key after the first block a Q tile visits, among them
# an unmasked block (seqlen_k - seqlen_q = 63 at hdim 64, 127 at hdim 128); rows without keys.
SEQLENS = [(640, 640), (500, 563), (500, 627), (563, 500)]
PATTERNS = ["random", "sink", "rising", "offsets", "jump"]
ROWS = [(c.head_dim, c.causal) for c in C.FWD_TILE_CONFIGS]


def _reference(q, k, v, scale, causal):
    args = (q[None, :, None], k[None, :, None], v[None, :, None], scale)
    hi_out, hi_lse = reference.attention_forward(*args, causal=causal, compute_dtype=torch.float64)
    lo_out, lo_lse = reference.attention_forward(*args, causal=causal, compute_dtype=q.dtype)
    return hi_out[0, :, 0], hi_lse[0, 0], lo_out[0, :, 0], lo_lse[0, 0]


@pytest.mark.parametrize("row", ROWS, ids=[f"d{d}-{'causal' if c else 'full'}" for d, c in ROWS])
@pytest.mark.parametrize("rule", M.RULES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_rule_meets_the_reference(pattern, rule, row):
    cfg = C.fwd_tile_config(*row)
    for i, (sq, sk) in enumerate(SEQLENS):
        dtype = torch.float16 if i % 2 else torch.bfloat16
        q, k, v, scale = M.make_scores(pattern, sq, sk, cfg.head_dim, dtype, seed=i)
        run = M.run_config(cfg, q, k, v, scale, rule)
        hi_out, hi_lse, lo_out, lo_lse = _reference(q, k, v, scale, cfg.causal)
        label = f"{pattern} {rule} {row} {(sq, sk)} {dtype}"
        assert torch.equal(torch.isneginf(run.lse), torch.isneginf(hi_lse)), f"{label}: rows without keys differ"
        reference.assert_within_bound(run.out, hi_out, lo_out, f"{label} out")
        reference.assert_within_bound(run.lse, hi_lse, lo_lse, f"{label} lse")
        if rule == "exact":
            bound = 1.0
        elif rule == "lazy":  # the row's own bound when it sets one, else the model's default 12
            bound = 2.0 ** (12 if cfg.lazy_max_sum_log2 is None else cfg.lazy_max_sum_log2)
        else:  # conditional: P stays under 2**rescale_max_growth_log2 (the model's default 8)
            bound = 2.0 ** (8 if cfg.rescale_max_growth_log2 is None else cfg.rescale_max_growth_log2)
        assert run.max_p <= bound, f"{label}: P {run.max_p} above the rule's bound {bound}"


def _first_key_blocks(cfg, sq, sk):
    """(Q tile, warpgroup) -> the block where the warpgroup's first row meets its first key, when
    that block is not the first one the tile visits and holds no masked key of the tile."""
    out = {}
    for m in range(-(-sq // cfg.block_m)):
        tile_first = M.visible_end(m * cfg.block_m, sq, sk, cfg.causal)
        n_end = min(-(-sk // cfg.block_n), -(-max(M.visible_end(m * cfg.block_m + cfg.block_m - 1, sq, sk, cfg.causal), 0) // cfg.block_n))
        for wg in range(cfg.block_m // 64):
            end = M.visible_end(m * cfg.block_m + 64 * wg, sq, sk, cfg.causal)
            n = (end - 1) // cfg.block_n
            if end > 0 and n < n_end - 1 and end % cfg.block_n == 0 and tile_first >= (n + 1) * cfg.block_n:
                out[m, wg] = n
    return out


@pytest.mark.parametrize("row", ROWS, ids=[f"d{d}-{'causal' if c else 'full'}" for d, c in ROWS])
def test_lazy_slow_path_only_where_needed(row):
    """Random scores take the slow path only on the unmasked blocks where a warpgroup's first row
    meets its first key; a sink (keys 0-3, the last block visited) at most once more per (Q tile,
    warpgroup); scores that rise on every block on every unmasked middle block."""
    cfg = C.fwd_tile_config(*row)
    for sq, sk in SEQLENS:
        forced = _first_key_blocks(cfg, sq, sk) if cfg.causal else {}
        q, k, v, scale = M.make_scores("random", sq, sk, cfg.head_dim, seed=1)
        run = M.run_config(cfg, q, k, v, scale, "lazy")
        assert {key: ns for key, ns in run.slow_blocks.items()} == {key: [n] for key, n in forced.items()}, (sq, sk)
        q, k, v, scale = M.make_scores("sink", sq, sk, cfg.head_dim, seed=2)
        run = M.run_config(cfg, q, k, v, scale, "lazy")
        for key, ns in run.slow_blocks.items():
            extra = [n for n in ns if forced.get(key) != n]
            assert extra in ([], [0]), f"{(sq, sk)} {key}: slow path on blocks {ns}"
        assert any(0 in ns for ns in run.slow_blocks.values()), f"{(sq, sk)}: the sink never took the slow path"
    q, k, v, scale = M.make_scores("rising", 640, 640, cfg.head_dim, seed=3)
    run = M.run_config(cfg, q, k, v, scale, "lazy")
    if not cfg.causal:  # every middle block of every (Q tile, warpgroup) outgrows
        n_blocks = -(-640 // cfg.block_n)
        pairs = {(m, wg) for m in range(-(-640 // cfg.block_m)) for wg in range(cfg.block_m // 64)
                 if m * cfg.block_m + 64 * wg < 640}  # warpgroups with rows of the sequence
        assert run.slow_blocks == {key: list(range(n_blocks - 2, -1, -1)) for key in pairs}
    else:
        assert sum(map(len, run.slow_blocks.values())) >= len(run.slow_blocks) > 0, "rising scores never outgrew"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_first_key_rows_subtracting_zero_would_fail(head_dim):
    """The slow path forced where a warpgroup's first row meets its first key in an unmasked block
    (first_keys in the kernel) is what keeps such rows right: without it they subtract 0 (no max
    yet), and fp16 P of a row at -60 units is 0 (the row comes out empty), +inf at +90."""
    cfg = C.fwd_tile_config(head_dim, True)
    sq, sk = (500, 563) if head_dim == 64 else (500, 627)
    assert _first_key_blocks(cfg, sq, sk), "the pair must put a first key in an unmasked block"
    q, k, v, scale = M.make_scores("offsets", sq, sk, head_dim, torch.float16, seed=5)
    q[:, 0] = -15.0  # every row at -60 natural units (k[:, 0] is 4)
    scores = (q.float() @ k.float().T) * (scale * M.LOG2E)
    hi_out, hi_lse, lo_out, lo_lse = _reference(q, k, v, scale, True)
    kw = dict(causal=True, rule="lazy", block_m=cfg.block_m, block_n=cfg.block_n, p_dtype=torch.float16)
    good = M.run_rule(scores, v, **kw)
    reference.assert_within_bound(good.out, hi_out, lo_out, "lazy out")
    reference.assert_within_bound(good.lse, hi_lse, lo_lse, "lazy lse")
    broken = M.run_rule(scores, v, first_keys_slow=False, **kw)
    # fp16 P of exp(-60) is 0: the rows whose first keys came in an unmasked block get O = 0.
    wrong = (broken.out - hi_out.float()).abs().amax(dim=1) > 0.1
    assert wrong.any(), "the rule without first_keys should have lost rows"
