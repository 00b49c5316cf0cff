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
  // Varlen: a section's K/V budget in keys of one query head (fwd_section_keys), from which each
  // sequence's section width follows (sequence_section_heads).
  int section_keys = 0;

  struct Tile {
    int bh, m;
  };

  DASH_HOST_DEVICE Tile tile(int t) const { return tile_in_sections(t, 0, num_bh, section_heads); }

  // Item r of a run of `count` (b, h) pairs from `first_bh` on, in sections of `width` of them:
  // descending m inside a section, the pairs innermost (the last section may be narrower).
  DASH_HOST_DEVICE Tile tile_in_sections(int r, int first_bh, int count, int width) const {
    int const per_section = width * num_m_blocks;
    int const s = r / per_section;
    int const rr = r - s * per_section;
    int const first = s * width;
    int const here = count - first < width ? count - first : width;
    int const m_rank = rr / here;
    return {first_bh + first + (rr - m_rank * here), num_m_blocks - 1 - m_rank};
  }

  // Varlen: sequence b owns items [b, b + 1) * num_heads * num_m_blocks (the grid is sized for
  // the longest sequence), its heads in L2 sections of `seq_section_heads` heads, a power of two
  // chosen for its own length (sequence_section_heads), so that a short sequence takes all its
  // heads in one section (the largest power of two of them: with 12 heads, sections of 8 and 4).
  // Inside a section Q tiles go by descending m with the heads innermost, as in tile(). Sections
  // never span sequences, and a short sequence's dead items (past its last Q tile) open each of
  // its sections as one run (dead_run_end_in_sequence). Sections sized for
  // the longest sequence (tile() over all (b, h)) gave a skewed batch 224 runs of ~120 dead items
  // at hdim 128, which the CTAs claiming at once walked item by item before the first skip
  // landed: the mix took 1.13x the time of its parts (kernel notes, thirty-first and
  // thirty-second passes; tools/varlen_claim_model.py).
  DASH_HOST_DEVICE int sequence_of(int t, int num_heads) const { return t / (num_heads * num_m_blocks); }

  // The section width of a sequence with `seqlen_k` keys: the largest power of two w <= num_heads
  // with w * seqlen_k <= section_keys (fwd_section_heads' rule counted in keys, equal to it where
  // a GQA group's share of a key's bytes is whole; 32-bit, no product that can overflow, few
  // registers for the producer warp that evaluates it per claim).
  DASH_HOST_DEVICE int sequence_section_heads(int seqlen_k, int num_heads) const {
    int w = 1;
    int limit = section_keys >> 1;  // 2w * seqlen_k <= section_keys  <=>  seqlen_k <= section_keys / 2w
    while (2 * w <= num_heads && seqlen_k <= limit) {
      w *= 2;
      limit >>= 1;
    }
    return w;
  }

  DASH_HOST_DEVICE Tile tile_in_sequence(int t, int b, int num_heads, int seq_section_heads) const {
    return tile_in_sections(t - b * num_heads * num_m_blocks, b * num_heads, num_heads, seq_section_heads);
  }

  // The end of the run of dead items that the dead `tile` of sequence b (tile_in_sequence) opens:
  // its section's first (num_m_blocks - seq_m_blocks) * heads items, all past the sequence's end.
  DASH_HOST_DEVICE int dead_run_end_in_sequence(Tile tile, int b, int num_heads, int seq_section_heads,
                                                int seq_m_blocks) const {
    int const first_h = (tile.bh - b * num_heads) & ~(seq_section_heads - 1);  // a power of two
    int const heads_here = num_heads - first_h < seq_section_heads ? num_heads - first_h : seq_section_heads;
    return (b * num_heads + first_h) * num_m_blocks + (num_m_blocks - seq_m_blocks) * heads_here;
  }
};

// FwdTileOrder::section_keys: how many keys of one query head's K and V (shared by its GQA
// group) fit the L2 section budget, at most INT_MAX.
DASH_HOST_DEVICE int fwd_section_keys(int64_t l2_budget_bytes, int head_dim, int elem_bytes, int heads_per_kv_head) {
  int64_t const keys = l2_budget_bytes * heads_per_kv_head / (2 * int64_t(head_dim) * elem_bytes);
  return keys > 2147483647 ? 2147483647 : int(keys);
}

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
