// Variable-length batches (FA3's varlen layout), shared by the forward and the backward: the
// sequences lie packed along the rows of q, k, v and of the outputs, sequence b at rows
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k
// and v. The kernels keep the padded grids of the longest sequence (max_seqlen_*) and give each
// work item its sequence's place; the tile geometry of an item is the padded one with the
// sequence's lengths.
#pragma once

#include <stdint.h>

#include "schedule/schedule.h"  // DASH_HOST_DEVICE

namespace dash {

// Where one sequence lies in the packed tensors.
struct SeqPlace {
  int row_q = 0, row_k = 0;        // its first row in q (and out, dout, dq) / in k and v (dk, dv)
  int seqlen_q = 0, seqlen_k = 0;  // its lengths
};

#ifdef __CUDACC__
// Sequence b's place, from the int32 offsets (b + 1 < their length).
__device__ __forceinline__ SeqPlace load_seq_place(int const* cu_seqlens_q, int const* cu_seqlens_k, int b) {
  SeqPlace s;
  s.row_q = cu_seqlens_q[b];
  s.seqlen_q = cu_seqlens_q[b + 1] - s.row_q;
  s.row_k = cu_seqlens_k[b];
  s.seqlen_k = cu_seqlens_k[b + 1] - s.row_k;
  return s;
}

// The backward's view of sequence b: its place, or, when it is longer than the padded grids
// (max_seqlen_q / max_seqlen_k, the caller's promise), no rows at all. Every backward role
// (producer, MMA warpgroups, dQ writers, preprocess, convert) reads it through this one
// function, so they agree: such a sequence gets no column, no contribution and no store (the
// grids, sized by the maxima, do not cover it, and a partial result would be silently wrong),
// and the preprocess NaN-fills its dq, dk and dv instead (bwd_prepost_kernels.h).
__device__ __forceinline__ SeqPlace load_seq_place_within(int const* cu_seqlens_q, int const* cu_seqlens_k, int b,
                                                          int max_seqlen_q, int max_seqlen_k) {
  SeqPlace s = load_seq_place(cu_seqlens_q, cu_seqlens_k, b);
  if (s.seqlen_q > max_seqlen_q || s.seqlen_k > max_seqlen_k) {
    s.seqlen_q = 0;
    s.seqlen_k = 0;
  }
  return s;
}
#endif

// The varlen backward's workspace (LSE in log2 units, D, dQaccum, dQ semaphores): per head, the
// sequences' Q tiles one after another, sequence b's first at (cu_seqlens_q[b] + b * block_m) /
// block_m (FA3's padded offsets), so it grows with the tokens instead of with batch x the
// longest sequence. The tiles of consecutive sequences never overlap: the next first tile is at
// least floor(x / block_m) + floor(seqlen / block_m) + 1 >= first + ceil(seqlen / block_m).
DASH_HOST_DEVICE int varlen_first_tile(int row_q, int b, int block_m) {
  return int((int64_t(row_q) + int64_t(b) * block_m) / block_m);
}
// Workspace tiles per head (a bound on every sequence's first tile + its tiles).
DASH_HOST_DEVICE int64_t varlen_tiles_per_head(int64_t total_q, int batch, int block_m) {
  return (total_q + int64_t(batch) * block_m + block_m - 1) / block_m;
}

// `geo` (the padded problem's tile geometry) with the sequence's lengths.
template <class Geometry>
DASH_HOST_DEVICE Geometry with_lengths(Geometry geo, SeqPlace const& s) {
  geo.seqlen_q = s.seqlen_q;
  geo.seqlen_k = s.seqlen_k;
  return geo;
}

}  // namespace dash
