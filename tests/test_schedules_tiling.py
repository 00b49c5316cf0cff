"""Tiling: FA3's tile ranges, contributors, tile classes, varlen, the config table."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dash.config import bwd_tile_config
from dash.schedules.tiling import (TILE_EMPTY, TILE_FULL, TILE_PARTIAL, Problem, causal_n_max,
                                   paper_problem, tile_problem)


def _visible(sq: int, sk: int, wl: int, wr: int) -> np.ndarray:
    """(sq, sk) bool: query i sees key j (bottom-right aligned window)."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    d = j - i - (sk - sq)
    ok = np.ones((sq, sk), dtype=bool)
    if wr >= 0:
        ok &= d <= wr
    if wl >= 0:
        ok &= d >= -wl
    return ok


def test_block_sizes_come_from_the_config_table():
    for hd in (64, 128):
        for causal in (False, True):
            cfg = bwd_tile_config(hd, causal)
            p = Problem(1, 1, 1024, 1024, head_dim=hd, causal=causal)
            assert p.tile_shape == (cfg.block_m, cfg.block_n)
    # Local masks use the causal tiles, as FA3 does.
    cfg = bwd_tile_config(128, True)
    assert Problem(1, 1, 64, 64, head_dim=128, window=(32, 32)).tile_shape == (cfg.block_m, cfg.block_n)
    assert Problem(1, 1, 64, 64, head_dim=128, block_m=80).tile_shape == (80, bwd_tile_config(128, False).block_n)
    with pytest.raises(NotImplementedError, match="head_dim=96"):
        Problem(1, 1, 64, 64, head_dim=96)
    assert Problem(1, 1, 64, 64, head_dim=96, block_m=64, block_n=96).tile_shape == (64, 96)


def test_paper_convention():
    p = paper_problem(4096, 128)
    assert (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k) == (4, 16, 4096, 4096)
    assert paper_problem(32768, 64).batch == 1
    assert paper_problem(16384, 64).heads_q == 32


def test_problem_rejects_bad_input():
    with pytest.raises(ValueError, match="heads_kv"):
        Problem(1, 4, 8, 8, heads_kv=3)
    with pytest.raises(ValueError, match="seqlens_q"):
        Problem(2, 1, 8, 8, seqlens_q=(1, 2, 3))
    with pytest.raises(ValueError, match="causal"):
        Problem(1, 1, 8, 8, causal=True, window=(-1, 4))


def test_mask_kinds():
    assert Problem(1, 1, 8, 8).mask == "full"
    assert Problem(1, 1, 8, 8, causal=True).mask == "causal"
    assert Problem(1, 1, 8, 8, window=(-1, 0)).mask == "causal"
    assert Problem(1, 1, 8, 8, window=(4, 0)).mask == "local"
    assert Problem(1, 1, 8, 8, causal=True, window=(4, -1)).mask == "local"


shapes = st.tuples(
    st.integers(0, 600), st.integers(0, 600),  # sq, sk
    st.sampled_from([64, 128]), st.sampled_from([64, 96, 128, 192]),  # block m, n
    st.sampled_from(["full", "causal", "local"]), st.integers(-1, 300), st.integers(-1, 300),
)


def _problem(sq, sk, bm, bn, mask, wl, wr):
    if mask == "full":
        return Problem(1, 1, sq, sk, block_m=bm, block_n=bn)
    if mask == "causal":
        return Problem(1, 1, sq, sk, block_m=bm, block_n=bn, causal=True)
    return Problem(1, 1, sq, sk, block_m=bm, block_n=bn, window=(wl, wr))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_ranges_cover_every_visible_pair_and_contributors_match(shape):
    """FA3's ranges contain every tile with a visible pair; rows and columns describe the same set."""
    p = _problem(*shape)
    t = tile_problem(p)
    sq, sk = p.seqlen_q, p.seqlen_k
    bm, bn = t.block_m, t.block_n
    vis = _visible(sq, sk, p.window_left, p.window_right)
    contrib = t.contributes()[0]
    for m in range(t.mmax):
        for n in range(t.nmax):
            any_vis = vis[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn].any()
            if any_vis:
                assert contrib[m, n], (m, n)
            elif p.mask != "local":
                assert not contrib[m, n], (m, n)  # full and causal ranges are exact
            cls = t.tile_class[0, m, n]
            block = vis[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn]
            want = TILE_EMPTY if not block.any() else (TILE_FULL if block.all() else TILE_PARTIAL)
            assert cls == want, (m, n)
    # The row view (contributors of each tile) and the column view agree.
    for m in range(t.mmax):
        cols = np.flatnonzero(contrib[m])
        assert list(cols) == list(range(t.row_lo[0, m], t.row_hi[0, m]))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 900), st.integers(1, 900), st.sampled_from([64, 128]), st.sampled_from([64, 128, 192]))
def test_causal_closed_forms_agree(sq, sk, bm, bn):
    """m_min(n) (with floor-then-clamp) and n_max(m) describe the same causal contributors."""
    t = tile_problem(Problem(1, 1, sq, sk, causal=True, block_m=bm, block_n=bn))
    n = np.arange(t.nmax)
    assert np.array_equal(t.col_lo[0], np.maximum(0, (n * bn + sq - sk) // bm))
    # C truncation after clamping gives the same value.
    c_trunc = np.array([max(0, int((v * bn + sq - sk) / bm)) for v in n])
    assert np.array_equal(t.col_lo[0], c_trunc)
    assert np.all(t.col_hi[0] == t.mmax)
    m = np.arange(t.mmax)
    assert np.array_equal(t.row_hi[0], causal_n_max(m, sq, sk, bm, bn))
    assert np.all(t.row_lo[0] == 0)
    # Causal never produces an empty column.
    assert np.all(t.col_hi[0] > t.col_lo[0])


def test_causal_sq_greater_than_sk_has_tiles_without_contributors():
    t = tile_problem(Problem(1, 1, 512, 128, causal=True, block_m=128, block_n=128))
    # Rows 0..383 see no key: tiles 0, 1, 2 have no contributors.
    assert list(t.row_hi[0] - t.row_lo[0]) == [0, 0, 0, 1]


def test_sliding_window_can_leave_columns_empty():
    # Right window far to the left of the keys: the last columns see no query.
    t = tile_problem(Problem(1, 1, 128, 512, window=(0, 0), block_m=128, block_n=128))
    lens = t.col_len[0]
    assert lens[-1] == 1 and lens[0] == 0


def test_varlen_pads_to_the_longest_sequence():
    p = Problem(3, 2, 0, 0, seqlens_q=(300, 0, 129), seqlens_k=(100, 257, 0), block_m=128, block_n=128)
    t = tile_problem(p)
    assert list(t.num_m) == [3, 0, 2] and list(t.num_n) == [1, 3, 0]
    assert (t.mmax, t.nmax) == (3, 3)
    assert np.all(t.col_len[0, 1:] == 0)  # padding columns of sequence 0
    assert np.all(t.col_len[1] == 0)  # sequence 1 has no queries: its columns exist but are empty
    assert t.total_steps == 2 * 3
