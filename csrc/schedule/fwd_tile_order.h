// The forward's persistent tile order (FwdTileOrder) and its L2 section rule. Plain C++ for
// host and device, like schedule.h, so that tests/test_kernel_schedule_matches_model.py can
// compile it on the host and compare it with tools/fwd_tile_order_model.py.
#pragma once

#include <stdint.h>

#include "schedule/schedule.h"  // DASH_HOST_DEVICE

namespace dash {

// The order in which the persistent CTAs claim Q tiles (CTA c starts with item c, then
// claims the next unclaimed item from a global counter). Work item t is the Q tile
// (bh, m): bh = batch * heads + head. Items are grouped in sections of `section_heads`
// consecutive (b, h) pairs whose K and V fit in L2 together, so that the CTAs running at
// one time share K/V reads instead of each streaming its own from HBM. Inside a section
// Q tiles go by descending m (under a causal mask the longest tiles first, so that the
// short ones fill the tail) with the heads innermost (GQA siblings share K/V). Claiming
// instead of a static stride matters under a causal mask: with a stride of gridDim.x, a CTA
// keeps landing on tiles of similar length (all long or all short) and the grid waits for
// the unlucky ones (hdim 128 causal 16k ran at 0.71x cuDNN that way).
struct FwdTileOrder {
  int num_m_blocks = 0;
  int num_bh = 0;
  int section_heads = 1;
  int num_tiles = 0;

  struct Tile {
    int bh, m;
  };

  DASH_HOST_DEVICE Tile tile(int t) const {
    int const per_section = section_heads * num_m_blocks;
    int const s = t / per_section;
    int const r = t - s * per_section;
    int const first_bh = s * section_heads;
    int const heads_here = num_bh - first_bh < section_heads ? num_bh - first_bh : section_heads;
    int const m_rank = r / heads_here;
    return {first_bh + (r - m_rank * heads_here), num_m_blocks - 1 - m_rank};
  }

  // Varlen: the end of the run of dead items that `tile` (item t = tile(t)) starts, i.e. the
  // first item after it that may be live. The tile must be dead: it lies past the end of its
  // sequence b (= tile.bh / num_heads), which has `seq_m_blocks` Q tiles. The grid is sized for
  // the longest sequence, so a short sequence's section opens with (num_m_blocks -
  // seq_m_blocks) * heads dead items (descending m, heads innermost); a CTA that meets one skips
  // them all at once instead of claiming them one by one. Only where the section holds heads of
  // sequence b alone: a section spanning several sequences interleaves their items, so the run
  // there is the tile alone (t + 1). Reads the decoded tile, not t, and needs section_heads to
  // be a power of two (fwd_section_heads): with t's division and modulo redone here the
  // producer's 24 registers spilled 12 B.
  DASH_HOST_DEVICE int dead_run_end(Tile tile, int b, int num_heads, int seq_m_blocks) const {
    int const first_bh = tile.bh & ~(section_heads - 1);
    int const heads_here = num_bh - first_bh < section_heads ? num_bh - first_bh : section_heads;
    int const first_item = first_bh * num_m_blocks;  // the sections before are full
    int const m_rank = num_m_blocks - 1 - tile.m;
    int const t = first_item + m_rank * heads_here + (tile.bh - first_bh);
    bool const one_sequence = first_bh >= b * num_heads && first_bh + heads_here <= (b + 1) * num_heads;
    int const end = one_sequence ? first_item + (num_m_blocks - seq_m_blocks) * heads_here : t + 1;
    return end > t + 1 ? end : t + 1;
  }
};

// Heads per L2 section (FwdTileOrder): the largest power of two whose K and V (shared by
// GQA siblings) take at most `l2_budget_bytes` (FwdTileConfig.l2_section_mib in dash/config.py,
// per head dim and mask: small sections keep the K/V read at once resident in L2, large ones
// balance a causal grid's tail; tools/fwd_tile_order_model.py).
DASH_HOST_DEVICE int fwd_section_heads(int64_t l2_budget_bytes, int seqlen_k, int head_dim, int elem_bytes,
                                       int heads_per_kv_head, int num_bh) {
  int64_t const kv_bytes_per_q_head =
      (2 * int64_t(seqlen_k) * head_dim * elem_bytes + heads_per_kv_head - 1) / heads_per_kv_head;
  int w = 1;
  while (2 * w <= num_bh && 2 * w * kv_bytes_per_q_head <= l2_budget_bytes) { w *= 2; }
  return w;
}

}  // namespace dash
