// The two small kernels around the main backward kernel.
//
// bwd_preprocess_kernel  (grid: Q tiles x heads x batch): D = rowsum(dO * O) in fp32,
//   LSE in log2 units (padded rows +inf so their P is 0; fully masked rows 0 so their P is
//   0 rather than NaN), zeroes this tile's dQ semaphores (and the block of tile (0, 0, 0) the
//   counters), and with a single dQ chain its dQaccum chunk. It is the only initialiser of
//   the workspace, so it must precede the main kernel on the same stream.
//
// bwd_convert_dq_kernel  (same grid): dQ = scale * dQaccum, cast to the output dtype. The
//   dQaccum chunk is in the main kernel's fragment order; the same TiledMmadQ partition
//   maps it back to (row, col), or to (col, row) where the main kernel computes dQ^T.
//   Deterministic runs sum the tile's chains in index order: chain c holds the adds with turns c, c + kdQChains, ... (its first add stored, so
//   a chain no column added to is never read: the tile has n_end(m) contributions).
//   With convert_under_main it runs while the main kernel does (bwd_launch.h): deterministic
//   CTAs wait for their tile's semaphores to count every add (each released after its add
//   landed), the others for the whole main grid (griddepcontrol.wait).
//
// bwd_varlen_live_columns_kernel  (varlen only; one CTA, between the two above and the main
//   kernel): lists the padded grid's columns that lie inside their sequence's keys, in claim
//   order, and their count; the main kernel's producer claims through the list, so the
//   columns past a short sequence's keys cost nothing.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernels/acc_store.h"
#include "kernels/bwd_traits.h"

namespace dash {

struct PrepostParams {
  void const* out;
  void const* dout;
  BSHDStrides out_strides, dout_strides;
  float const* lse;  // (b, h, seqlen_q), natural log
  int64_t lse_batch_stride, lse_head_stride;
  float* lse_log2;   // (tiles, kBlockM): row bh of stats_bh_stride floats, or varlen (bwd_params.h)
  float* dpsum;
  float* dq_accum;
  int* dq_semaphore;
  int* counters;  // BwdCounter
  void* dq;
  BSHDStrides dq_strides;
  int seqlen_q, seqlen_k, num_heads, num_m_blocks;
  int dq_chains;           // 1, or Traits::kdQChains when deterministic (bwd_params.h)
  int64_t dq_chain_tiles;  // tiles per chain: batch * heads * num_m_blocks (varlen: heads * tiles_per_head)
  int64_t stats_bh_stride;  // varlen: per head (tiles_per_head * kBlockM)
  float softmax_scale;
  // Convert: launched under the main kernel, waiting per tile on dq_semaphore (deterministic;
  // the main kernel's writers count the adds there). False: waits for the main grid.
  bool wait_per_tile;
  // Traits::kVarlen: the sequences' first rows (kernels/varlen.h); seqlen_q / seqlen_k are then
  // the longest sequence's, the grid the padded one, and out, dout, dq and lse ((heads,
  // total_q), lse_head_stride = total_q) are addressed from the sequence's first row.
  int const* cu_seqlens_q;
  int const* cu_seqlens_k;
  // Varlen: where the preprocess NaN-fills the gradients of a sequence longer than the padded
  // grids (load_seq_place_within): dk, dv as Element, or under GQA their fp32 accumulators.
  void* dk;
  void* dv;
  BSHDStrides dk_strides, dv_strides;
  float* dk_accum;
  float* dv_accum;
  BSHDStrides dkv_accum_strides;
  int num_heads_k;
  int tiles_per_head;  // varlen: the workspace's Q tiles per head (kernels/varlen.h)
};

// The first row of batch entry b of a (b, s, h, d) tensor, relative to its head's: b * batch
// stride, or varlen the sequence's first row times the row stride.
template <class Traits>
__device__ __forceinline__ int64_t batch_rows_offset(BSHDStrides const& st, int b, SeqPlace const& seq) {
  return Traits::kVarlen ? int64_t(seq.row_q) * st.row : int64_t(b) * st.batch;
}

// Workspace tile (b, h, 0): row bh of the padded layout, or varlen head h from the sequence's
// first tile (kernels/varlen.h). Tile t's LSE / D rows are t * kBlockM ...
template <class Traits>
__device__ __forceinline__ int64_t workspace_first_tile(PrepostParams const& p, int b, int h, SeqPlace const& seq) {
  if constexpr (Traits::kVarlen) {
    return int64_t(h) * p.tiles_per_head + varlen_first_tile(seq.row_q, b, Traits::kBlockM);
  } else {
    return (int64_t(b) * p.num_heads + h) * p.num_m_blocks;
  }
}

// The lengths (and varlen place) of batch entry b: the problem's, or its sequence's.
template <class Traits>
__device__ __forceinline__ SeqPlace prepost_seq(PrepostParams const& p, int b) {
  if constexpr (Traits::kVarlen) {
    return load_seq_place_within(p.cu_seqlens_q, p.cu_seqlens_k, b, p.seqlen_q, p.seqlen_k);
  } else {
    SeqPlace s;
    s.seqlen_q = p.seqlen_q;
    s.seqlen_k = p.seqlen_k;
    return s;
  }
}

// Varlen: a sequence longer than the padded grids gets no work in the backward
// (load_seq_place_within), so its gradients would stay unwritten: the preprocess's first Q-tile
// block of each (b, h) writes NaN to all of the sequence's rows of head h of dq, and of dk and dv
// (or their GQA accumulators) when h is also a KV head. Nothing later writes those rows.
// `p` is the kernel's __grid_constant__ parameter: a reference to it stays in parameter space.
// (Without that qualifier the reference made every thread of every block copy the 336-byte
// struct to its stack at kernel entry: ~4 GB of local stores per backward of a skewed batch of
// 29 sequences, 1.1 ms of a 3.5 ms backward, kernel notes, twenty-seventh pass.)
template <class Traits>
__device__ __noinline__ void fill_nan_if_longer_than_grid(PrepostParams const& p, int b, int h) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  SeqPlace const s = load_seq_place(p.cu_seqlens_q, p.cu_seqlens_k, b);
  if (s.seqlen_q <= p.seqlen_q && s.seqlen_k <= p.seqlen_k) { return; }
  float const nan = __int_as_float(0x7fffffff);
  auto fill = [&](auto* base, BSHDStrides const& st, int first_row, int rows) {
    using T = std::remove_pointer_t<decltype(base)>;
    T* head = base + int64_t(first_row) * st.row + int64_t(h) * st.head;
    for (int64_t i = threadIdx.x; i < int64_t(rows) * kHeadDim; i += blockDim.x) {
      head[(i / kHeadDim) * st.row + i % kHeadDim] = T(nan);
    }
  };
  fill(static_cast<Element*>(p.dq), p.dq_strides, s.row_q, s.seqlen_q);
  if (h < p.num_heads_k) {
    if (p.dk_accum != nullptr) {
      fill(p.dk_accum, p.dkv_accum_strides, s.row_k, s.seqlen_k);
      fill(p.dv_accum, p.dkv_accum_strides, s.row_k, s.seqlen_k);
    } else {
      fill(static_cast<Element*>(p.dk), p.dk_strides, s.row_k, s.seqlen_k);
      fill(static_cast<Element*>(p.dv), p.dv_strides, s.row_k, s.seqlen_k);
    }
  }
}

template <class Traits>
__global__ void __launch_bounds__(kPreprocessThreads)
    bwd_preprocess_kernel(CUTE_GRID_CONSTANT PrepostParams const p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kVec = 16 / sizeof(Element);             // elements per 16-byte load
  constexpr int kThreadsPerRow = kHeadDim / kVec;        // 8 (d64) or 16 (d128): inside one warp
  constexpr int kRowsPerPass = kPreprocessThreads / kThreadsPerRow;
  static_assert(32 % kThreadsPerRow == 0 && kBlockM % kRowsPerPass == 0);

  int const m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  int const tid = threadIdx.x;
  int64_t const bh = int64_t(b) * p.num_heads + h;
  SeqPlace const seq = prepost_seq<Traits>(p, b);
  int const seqlen_q = seq.seqlen_q;
  if constexpr (Traits::kVarlen) {
    if (m == 0) { fill_nan_if_longer_than_grid<Traits>(p, b, h); }
    if (tid < kNumCounters && m == 0 && h == 0 && b == 0) { p.counters[tid] = 0; }
    // The padded grid's blocks past the sequence's Q tiles have no workspace tile: the next
    // ones belong to the next sequence (kernels/varlen.h).
    if (m * kBlockM >= seqlen_q) { return; }
  }
  // Varlen: the first LSE / D row of this (b, h) (workspace_first_tile); padded: row bh's.
  int64_t const varlen_stats_row0 = Traits::kVarlen ? workspace_first_tile<Traits>(p, b, h, seq) * kBlockM : 0;

  Element const* o = static_cast<Element const*>(p.out) + batch_rows_offset<Traits>(p.out_strides, b, seq) +
                     h * p.out_strides.head;
  Element const* dout = static_cast<Element const*>(p.dout) + batch_rows_offset<Traits>(p.dout_strides, b, seq) +
                        h * p.dout_strides.head;
  int const col = (tid % kThreadsPerRow) * kVec;
  CUTLASS_PRAGMA_UNROLL
  for (int r0 = 0; r0 < kBlockM; r0 += kRowsPerPass) {
    int const row = m * kBlockM + r0 + tid / kThreadsPerRow;
    float acc = 0.f;
    if (row < seqlen_q) {
      cutlass::Array<Element, kVec> ov = *reinterpret_cast<cutlass::Array<Element, kVec> const*>(o + row * p.out_strides.row + col);
      cutlass::Array<Element, kVec> dov = *reinterpret_cast<cutlass::Array<Element, kVec> const*>(dout + row * p.dout_strides.row + col);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kVec; ++i) { acc += float(ov[i]) * float(dov[i]); }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int offset = kThreadsPerRow / 2; offset > 0; offset /= 2) { acc += __shfl_xor_sync(0xffffffff, acc, offset); }
    if (tid % kThreadsPerRow == 0) {  // 0 for padding rows
      p.dpsum[(Traits::kVarlen ? varlen_stats_row0 : bh * p.stats_bh_stride) + row] = acc;
    }
  }

  for (int i = tid; i < kBlockM; i += kPreprocessThreads) {
    int const row = m * kBlockM + i;
    float lse_log2 = INFINITY;  // padding rows (and varlen rows past the sequence): P = exp2(s - inf) = 0
    if (row < seqlen_q) {
      float const lse = p.lse[(Traits::kVarlen ? int64_t(seq.row_q) : int64_t(b) * p.lse_batch_stride) +
                              h * p.lse_head_stride + row];
      lse_log2 = lse == -INFINITY ? 0.f : lse * float(M_LOG2E);
    }
    p.lse_log2[(Traits::kVarlen ? varlen_stats_row0 : bh * p.stats_bh_stride) + row] = lse_log2;
  }

  int64_t const tile = Traits::kVarlen ? workspace_first_tile<Traits>(p, b, h, seq) + m : bh * p.num_m_blocks + m;
  if (p.dq_chains == 1) {  // several (deterministic) chains start with a store instead
    float4* chunk = reinterpret_cast<float4*>(p.dq_accum + tile * (kBlockM * kHeadDim));
    for (int i = tid; i < kBlockM * kHeadDim / 4; i += kPreprocessThreads) { chunk[i] = make_float4(0.f, 0.f, 0.f, 0.f); }
  }
  if (tid < p.dq_chains) { p.dq_semaphore[tid * p.dq_chain_tiles + tile] = 0; }
  if (!Traits::kVarlen && tid < kNumCounters && m == 0 && h == 0 && b == 0) { p.counters[tid] = 0; }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::NumMmaThreads)
    bwd_convert_dq_kernel(CUTE_GRID_CONSTANT PrepostParams const p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kValues = Traits::kdQValuesPerThread;

  int const m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  int const tid = threadIdx.x;  // plays MMA thread `tid` of the main kernel
  int const wg = tid / 128, wg_tidx = tid % 128;
  int64_t const bh = int64_t(b) * p.num_heads + h;
  SeqPlace const seq = prepost_seq<Traits>(p, b);
  // The tile's contributions: the columns [0, n_end(m)) of its sequence (schedule.h); none
  // for a varlen tile past its sequence's rows (no column visits it).
  auto const contributions = [&] {
    TileGeometryT<StaticBlocks<kBlockM, Traits::kBlockN>> geo;
    geo.seqlen_q = Traits::kVarlen ? seq.seqlen_q : p.seqlen_q;
    geo.seqlen_k = Traits::kVarlen ? seq.seqlen_k : p.seqlen_k;
    geo.causal = Traits::Is_causal;
    if constexpr (Traits::kVarlen) {
      if (m * kBlockM >= seq.seqlen_q) { return 0; }
    }
    return geo.n_end(m);
  };

  int64_t const tile = Traits::kVarlen ? workspace_first_tile<Traits>(p, b, h, seq) + m : bh * p.num_m_blocks + m;
  // Chains that received an add: all of them without determinism (one, zeroed by the
  // preprocess), else min(chains, contributions); none for a varlen block past its sequence's
  // Q tiles (it has no workspace tile: the next ones are the next sequence's).
  int chains = p.dq_chains;
  if (chains > 1) { chains = min_int(chains, contributions()); }
  if (Traits::kVarlen && m * kBlockM >= seq.seqlen_q) { chains = 0; }
  if (p.wait_per_tile) {
    // Chain c of the tile receives the turns c, c + dq_chains, ... of its n_end(m)
    // contributions; the writer of each releases the chain's semaphore (red.release.gpu) only
    // after its add has been performed in global memory, so once the acquire below reads the
    // chain's full count every add is visible to this thread, and through the barrier to the
    // CTA. The main grid's CTAs are all resident before this grid launches (they trigger it),
    // so the wait cannot starve them.
    if (tid == 0) {
      int const adds_total = contributions();
      for (int c = 0; c < chains; ++c) {
        int const adds = (adds_total - c + p.dq_chains - 1) / p.dq_chains;
        int const* sem = p.dq_semaphore + c * p.dq_chain_tiles + tile;
        while (ptx::ld_acquire_gpu(sem) < adds) { __nanosleep(256); }
      }
    }
    __syncthreads();
  } else {
    ptx::grid_dependency_wait();  // a no-op unless launched under the main kernel
  }
  Tensor vals = make_tensor<float>(Int<kValues>{});
  clear(vals);
  for (int c = 0; c < chains; ++c) {  // in chain order: the sum's order is fixed
    float4 const* slice = reinterpret_cast<float4 const*>(p.dq_accum + (c * p.dq_chain_tiles + tile) * (kBlockM * kHeadDim) +
                                                          wg * Traits::kdQSliceFloats);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kValues / 4; ++j) {
      float4 const v = slice[j * 128 + wg_tidx];
      vals(4 * j) += v.x;
      vals(4 * j + 1) += v.y;
      vals(4 * j + 2) += v.z;
      vals(4 * j + 3) += v.w;
    }
  }
  typename Traits::TiledMmadQ tiled_mma_dQ;
  Tensor tdQcdQ = tiled_mma_dQ.get_thread_slice(tid).partition_C(make_identity_tensor(typename Traits::TileShapedQAcc{}));
  static_assert(decltype(size(tdQcdQ))::value == kValues);
  Element* dq = static_cast<Element*>(p.dq) + batch_rows_offset<Traits>(p.dq_strides, b, seq) +
                h * p.dq_strides.head;
  int const seqlen_q = seq.seqlen_q;
  if constexpr (!Traits::dQ_transposed) {
    store_acc_rows_16B(vals, tdQcdQ, p.softmax_scale, dq, p.dq_strides.row, m * kBlockM, seqlen_q);
  } else {
    // The accumulator is dQ^T: a thread's values run along the query (output row) axis, so
    // they are transposed through shared memory into (query, head dim) rows and stored 16
    // bytes at a time. The row pitch of kHeadDim + 4 floats keeps it 16-byte aligned and
    // makes the scatter conflict-free (a warp's 32 stores hit 32 banks).
    constexpr int kPitch = kHeadDim + 4;
    __shared__ alignas(16) float tile[kBlockM * kPitch];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kValues; ++i) { tile[get<1>(tdQcdQ(i)) * kPitch + get<0>(tdQcdQ(i))] = vals(i); }
    __syncthreads();
    constexpr int kChunksPerRow = kHeadDim / 8;  // 8 outputs (16 bytes of bf16/fp16) per chunk
    for (int c = tid; c < kBlockM * kChunksPerRow; c += Traits::NumMmaThreads) {
      int const r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      int const row = m * kBlockM + r;
      if (row >= seqlen_q) { continue; }
      float4 const lo = *reinterpret_cast<float4 const*>(tile + r * kPitch + col);
      float4 const hi = *reinterpret_cast<float4 const*>(tile + r * kPitch + col + 4);
      float const s = p.softmax_scale;
      *reinterpret_cast<uint4*>(dq + int64_t(row) * p.dq_strides.row + col) =
          make_uint4(detail::pack2<Element>(lo.x * s, lo.y * s), detail::pack2<Element>(lo.z * s, lo.w * s),
                     detail::pack2<Element>(hi.x * s, hi.y * s), detail::pack2<Element>(hi.z * s, hi.w * s));
    }
  }
  if (p.wait_per_tile) {
    // Work queued after this grid on the stream (dK and dV's readers, the GQA casts) is
    // ordered after the main kernel only through this grid's completion, and per-tile waits
    // do not wait for the main kernel's last dK/dV stores. So the grid's last CTA to finish
    // waits for the main grid to complete before it exits; the others exit at once and free
    // their SM for the remaining tiles.
    __syncthreads();
    if (tid == 0) {
      int const ctas = int(gridDim.x * gridDim.y * gridDim.z);
      if (atomicAdd(p.counters + kConvertDoneCounter, 1) == ctas - 1) { ptx::grid_dependency_wait(); }
    }
  }
}

// Varlen: the main kernel's live columns. Work item L (claim order) is live when its column
// starts inside its sequence's keys (load_seq_place_within: none for a sequence longer than the
// grid); live items keep their order, so the producer's claims through the list still run in
// increasing L and every wait of the deterministic schedules points to an earlier claim.
// A column inside the keys but without a query that sees it stays live: it writes its zero
// dK / dV. The others wrote nothing (their rows belong to the next sequence) and, under GQA,
// took their group's dK / dV turns with nothing to add, for every query head alike.
constexpr int kLiveColumnsThreads = 1024;
// Items per thread and chunk: 8 keeps the sequence lookups of one thread in flight together and
// a skewed batch's 47k items to 6 chunks (one item per thread took 46 chunks and 47 us at hdim
// 128, 94 us at hdim 64: a pass through two block barriers and dependent loads per chunk).
constexpr int kLiveColumnsPerThread = 8;

template <class Traits, class MainParams>
__global__ void __launch_bounds__(kLiveColumnsThreads) bwd_varlen_live_columns_kernel(CUTE_GRID_CONSTANT MainParams const p) {
  constexpr int kWarps = kLiveColumnsThreads / 32;
  constexpr int kChunk = kLiveColumnsThreads * kLiveColumnsPerThread;
  static_assert(kWarps == 32, "the warp totals are scanned by one warp, a lane each");
  __shared__ int warp_prefix[kWarps];
  __shared__ int chunk_live;
  int* const live_columns = const_cast<int*>(p.live_columns);
  int const num_columns = p.schedule.num_columns();
  int const lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  int listed = 0;  // live items before this chunk
  for (int chunk = 0; chunk < num_columns; chunk += kChunk) {
    // This thread's items are chunk + threadIdx.x * 8 + [0, 8): consecutive, so that the
    // thread-order prefix below keeps the list in item (claim) order.
    int const first = chunk + int(threadIdx.x) * kLiveColumnsPerThread;
    unsigned live = 0;  // bit i: item first + i is live
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kLiveColumnsPerThread; ++i) {
      int const item = first + i;
      if (item < num_columns) {
        ColumnCoord const col = p.schedule.column(item);
        SeqPlace const seq = load_seq_place_within(p.cu_seqlens_q, p.cu_seqlens_k, col.b, p.schedule.geo.seqlen_q,
                                                   p.schedule.geo.seqlen_k);
        live |= unsigned(col.n * Traits::kBlockN < seq.seqlen_k) << i;
      }
    }
    // Exclusive prefix of the live counts over the block's threads: within the warp by
    // shuffles, across warps through one warp's scan of the warp totals.
    int const count = __popc(live);
    int inclusive = count;
    CUTLASS_PRAGMA_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      int const up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) { inclusive += up; }
    }
    if (lane == 31) { warp_prefix[warp] = inclusive; }  // the warp's total, for now
    __syncthreads();
    if (warp == 0) {  // each lane reads and rewrites its own slot only
      int const total = warp_prefix[lane];
      int scan = total;
      CUTLASS_PRAGMA_UNROLL
      for (int d = 1; d < 32; d *= 2) {
        int const up = __shfl_up_sync(0xffffffffu, scan, d);
        if (lane >= d) { scan += up; }
      }
      warp_prefix[lane] = scan - total;  // live items of the warps before
      if (lane == 31) { chunk_live = scan; }
    }
    __syncthreads();
    int slot = listed + warp_prefix[warp] + inclusive - count;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kLiveColumnsPerThread; ++i) {
      if (live >> i & 1u) { live_columns[slot++] = first + i; }
    }
    listed += chunk_live;
    __syncthreads();  // warp_prefix and chunk_live are rewritten by the next chunk
  }
  if (threadIdx.x == 0) { live_columns[num_columns] = listed; }
}

}  // namespace dash
