// Host build of csrc/schedule/schedule.h (and the forward's fwd_tile_order.h) for tests/test_kernel_schedule_matches_model.py:
// exposes the kernel's schedule numbers through a C ABI so the Python scheduling model
// (the specification) can be compared with what the kernel computes.
#include "schedule/fwd_tile_order.h"
#include "schedule/schedule.h"

namespace {

dash::TileGeometry make_geometry(int seqlen_q, int seqlen_k, int block_m, int block_n, int causal) {
  dash::TileGeometry geo;
  geo.seqlen_q = seqlen_q;
  geo.seqlen_k = seqlen_k;
  geo.block_m = block_m;
  geo.block_n = block_n;
  geo.causal = causal != 0;
  return geo;
}

// For every item L: columns[3L..3L+2] = (n, h, b), num_steps[L], and for each step s the
// visited tile visit[L*M + s] and its turn turns[L*M + s]. items[x*stride + k] = the k-th
// item of CTA x for static schedules (-1 past the end); claimed schedules leave it alone.
template <class Schedule>
int probe(Schedule const& s, int ctas, int* columns, int* num_steps, int* visit, int* turns, int* items,
          int items_stride) {
  int const M = s.geo.num_m_blocks();
  for (int L = 0; L < s.num_columns(); ++L) {
    dash::ColumnCoord const c = s.column(L);
    columns[3 * L] = c.n;
    columns[3 * L + 1] = c.h;
    columns[3 * L + 2] = c.b;
    num_steps[L] = s.num_steps(c);
    for (int step = 0; step < num_steps[L]; ++step) {
      int const m = s.m_block(c, step);
      visit[L * M + step] = m;
      turns[L * M + step] = s.turn(c, m);
    }
  }
  if (!Schedule::kClaimed) {
    for (int x = 0; x < ctas; ++x) {
      for (int k = 0; k < items_stride; ++k) {
        int const L = s.item(x, k);
        items[x * items_stride + k] = L < s.num_columns() ? L : -1;
      }
    }
  }
  return s.num_columns();
}

}  // namespace

extern "C" {

// kind: dash::BwdScheduleKind. Returns the number of items.
int dash_schedule_probe(int kind, int seqlen_q, int seqlen_k, int block_m, int block_n, int causal, int head_dim,
                        int heads, int heads_k, int batch, int deterministic, int ctas, int* columns, int* num_steps, int* visit,
                        int* turns, int* items, int items_stride) {
  dash::TileGeometry const geo = make_geometry(seqlen_q, seqlen_k, block_m, block_n, causal);
  auto const k = static_cast<dash::BwdScheduleKind>(kind);
  if (k == dash::BwdScheduleKind::kShift) {
    return probe(dash::make_shift_schedule(geo, heads, batch, ctas), ctas, columns, num_steps, visit, turns, items,
                 items_stride);
  }
  return probe(dash::make_claimed_schedule(k, geo, head_dim, heads, heads_k, batch, deterministic != 0), ctas, columns,
               num_steps, visit, turns, items, items_stride);
}

int dash_l2_section_heads(int seqlen_q, int head_dim, int batch_heads, int full_mask_q_tiles) {
  return dash::l2_section_heads(seqlen_q, head_dim, batch_heads, full_mask_q_tiles);
}

// needs_mask(m, n) of the kernel, for the mask test.
int dash_needs_mask(int seqlen_q, int seqlen_k, int block_m, int block_n, int causal, int m, int n) {
  return make_geometry(seqlen_q, seqlen_k, block_m, block_n, causal).needs_mask(m, n) ? 1 : 0;
}

// The forward's claim order: bh[t], m[t] of every work item t; returns the item count.
int dash_fwd_tile_order(int num_m_blocks, int num_bh, int section_heads, int* bh, int* m) {
  dash::FwdTileOrder order;
  order.num_m_blocks = num_m_blocks;
  order.num_bh = num_bh;
  order.section_heads = section_heads;
  order.num_tiles = num_bh * num_m_blocks;
  for (int t = 0; t < order.num_tiles; ++t) {
    dash::FwdTileOrder::Tile const tile = order.tile(t);
    bh[t] = tile.bh;
    m[t] = tile.m;
  }
  return order.num_tiles;
}

// Varlen (FwdTileOrder::sequence_of / sequence_section_heads / tile_in_sequence): the claim
// order of a batch whose sequences have seqlen_k[b] keys, bh[t], m[t] of every item t (num_heads
// * num_m_blocks per sequence); returns the item count.
int dash_fwd_varlen_tile_order(int num_m_blocks, int num_heads, int batch, int section_keys, int const* seqlen_k,
                               int* bh, int* m) {
  dash::FwdTileOrder order;
  order.num_m_blocks = num_m_blocks;
  order.num_bh = num_heads * batch;
  order.num_tiles = order.num_bh * num_m_blocks;
  order.section_keys = section_keys;
  for (int t = 0; t < order.num_tiles; ++t) {
    int const b = order.sequence_of(t, num_heads);
    int const w = order.sequence_section_heads(seqlen_k[b], num_heads);
    dash::FwdTileOrder::Tile const tile = order.tile_in_sequence(t, b, num_heads, w);
    bh[t] = tile.bh;
    m[t] = tile.m;
  }
  return order.num_tiles;
}

// FwdTileOrder::dead_run_end_in_sequence: where the run of dead items that the dead item t (of
// the order above) starts ends, for a sequence of seq_m_blocks Q tiles and seqlen_k keys.
int dash_fwd_dead_run_end(int num_m_blocks, int num_heads, int batch, int section_keys, int t, int seqlen_k,
                          int seq_m_blocks) {
  dash::FwdTileOrder order;
  order.num_m_blocks = num_m_blocks;
  order.num_bh = num_heads * batch;
  order.num_tiles = order.num_bh * num_m_blocks;
  order.section_keys = section_keys;
  int const b = order.sequence_of(t, num_heads);
  int const w = order.sequence_section_heads(seqlen_k, num_heads);
  return order.dead_run_end_in_sequence(order.tile_in_sequence(t, b, num_heads, w), b, num_heads, w, seq_m_blocks);
}

int dash_fwd_section_keys(long long l2_budget_bytes, int head_dim, int elem_bytes, int heads_per_kv_head) {
  return dash::fwd_section_keys(l2_budget_bytes, head_dim, elem_bytes, heads_per_kv_head);
}

int dash_fwd_section_heads(long long l2_budget_bytes, int seqlen_k, int head_dim, int elem_bytes, int heads_per_kv_head,
                           int num_bh) {
  return dash::fwd_section_heads(l2_budget_bytes, seqlen_k, head_dim, elem_bytes, heads_per_kv_head, num_bh);
}

}  // extern "C"
