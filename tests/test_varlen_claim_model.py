"""tools/varlen_claim_model.py on the CPU: its three varlen claim orders hold the same live Q
tiles, a dead-run skip never passes a live tile, and the makespans respect the work bound."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import varlen_claim_model as vcm  # noqa: E402
from bench_varlen import HIDDEN, lengths_of  # noqa: E402

from dash.config import fwd_tile_config  # noqa: E402

ORDERS = ("padded", "per_sequence", "live_only")


def _live(items):
    return sorted(x[1] for x in items if x[0] == vcm.LIVE)


@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [lengths_of("skewed"), lengths_of("uniform"), [1, 700, 129, 4096, 64, 2000]])
def test_orders_hold_the_same_live_tiles_and_skips_pass_only_dead_ones(hdim, causal, lengths):
    heads = HIDDEN // hdim
    block_m = fwd_tile_config(hdim, causal).block_m
    live_tiles = sum(heads * -(-n // block_m) for n in lengths)
    orders = {o: vcm.items_of(lengths, heads, hdim, causal, o) for o in ORDERS}
    for o, items in orders.items():
        assert len(_live(items)) == live_tiles, o
        assert _live(items) == _live(orders["padded"]), o
        for t, item in enumerate(items):
            if item[0] == vcm.DEAD:
                end = item[1]
                assert t + 1 <= end <= len(items)
                assert all(items[u][0] == vcm.DEAD for u in range(t, end)), (o, t, end)
    assert not any(x[0] == vcm.DEAD for x in orders["live_only"])
    assert len(orders["per_sequence"]) == len(orders["padded"])


@pytest.mark.parametrize("causal", [False, True])
def test_makespans_respect_the_work_bound_and_dead_items_cost_time(causal):
    lengths, heads = lengths_of("skewed"), HIDDEN // 128
    spans = {}
    for o in ORDERS:
        items = vcm.items_of(lengths, heads, 128, causal, o)
        ideal = sum(x[1] for x in items if x[0] == vcm.LIVE) / 132
        spans[o] = vcm.makespan(items, 132, claim=0.2, read=0.15, lead=2.0)
        assert spans[o] >= ideal
    # Claims that cost nothing make the dead items free: the padded order then loses only its
    # different section widths, not the walk.
    free = {o: vcm.makespan(vcm.items_of(lengths, heads, 128, causal, o), 132, 0.0, 0.0, 2.0) for o in ORDERS}
    assert spans["live_only"] < spans["padded"]
    assert free["padded"] < spans["padded"]
    assert free["per_sequence"] == pytest.approx(free["live_only"], rel=0.02)
