// The Hopper attention-forward kernel: persistent, warp-specialised.
//
//   warpgroup 0, warp 0 : producer. Claims the CTA's next Q tile (FwdTileOrder) and hands
//                         it to the MMA warpgroups through a two-slot ring in smem; TMA
//                         loads of the Q tile and of K and V blocks into mbarrier pipelines.
//   warpgroups 1..W     : MMA. Each owns 64 query rows of the Q tile and keeps their O
//                         rows, running max and running sum in registers: S = Q K^T
//                         (WGMMA from smem), online softmax in fp32, O += P V (P straight
//                         from registers). Where the table says so (hdim 128) the softmax
//                         raises the max it subtracts only when it grows by more than 2^8,
//                         and a warp rescales its O rows only on blocks where one of its
//                         rows raised it (online_softmax, kConditionalRescale). With a
//                         lazy block max (kLazyMax) a middle block's exponentials are taken
//                         under the max so far, without the block's row max; the warpgroup
//                         computes S again and raises the max only when a row's partial sum
//                         passes a bound or meets its first key (lazy_softmax, lazy_raise_max).
//
// Two overlaps keep the tensor cores busy while softmax runs on the FMA/MUFU units:
//   * inside a warpgroup, S of block j+1 is issued together with O += P_j V_j, and the
//     softmax of block j+1 runs while O += P_j V_j is still in flight (at hdim 128; at
//     hdim 64, three warpgroups of 160 registers, ptxas waits for the P V GEMM before the
//     first exponential in every loop form tried: docs/kernel-notes.md, sixth pass);
//   * across warpgroups (ping-pong), the warpgroups take turns issuing their GEMMs, so one
//     warpgroup's softmax runs under the other's GEMMs instead of all of them competing
//     for the tensor cores at the same moment.
// KV blocks are visited from the last to the first: under a causal mask the partially
// masked diagonal blocks come first, before the running max has settled.
// Full masks may run in clusters of two CTAs (FwdTraits::kClusterM, FwdTileConfig.kv_multicast):
// the CTAs of a cluster compute adjacent Q tiles of one head, walk the same KV blocks in
// lockstep, and each producer loads half of every K and V block into both CTAs' shared memory
// (TMA multicast), so L2 serves each block once per pair of tiles. A stage is then refilled only
// when the MMA warps of both CTAs have released it (release_kv).
// Varlen (FwdTraits::kVarlen, FA3's flash_attn_varlen_func): the sequences lie packed along the
// rows of q, k, v and out. The grid of Q tiles is sized for the longest sequence; the producer
// reads each claimed tile's sequence from cu_seqlens, skips tiles past its end and hands the
// rest to the MMA warpgroups with their sequence's place (FwdSeqTile). Loads start at the
// sequence's first row; rows beyond it (the next sequence's, or TMA's zero fill past the
// tensor) are masked as keys and never stored as queries.
// Q tiles go through kStagesQ shared-memory buffers (FwdTileConfig.q_stages): with two, the
// next tile's Q is loaded while the current tile runs (hdim 64 full; at hdim 128 two buffers
// measured slower, kernel notes, seventeenth pass).
#pragma once

#include <cute/tensor.hpp>

#include "kernels/acc_store.h"
#include "kernels/fwd_traits.h"
#include "kernels/mma_utils.h"
#include "kernels/persistent_shell.h"
#include "kernels/ptx.h"

namespace dash {

using namespace cute;

template <class Traits>
struct FwdMainKernel {
  using Element = typename Traits::Element;
  using Params = typename Traits::MainParams;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int NumMmaThreads = Traits::NumMmaThreads;
  static constexpr int NumMmaWarpGroups = Traits::NumMmaWarpGroups;
  static constexpr bool Is_causal = Traits::Is_causal;
  static constexpr bool kVarlen = Traits::kVarlen;
  using KVState = PipelineState<Traits::kStages>;
  using QState = PipelineState<Traits::kStagesQ>;
  static constexpr int kClusterM = Traits::kClusterM;
  // A K/V stage is written by the TMA of every CTA of the cluster (each its slice, multicast),
  // so it is free only when the MMA threads of every CTA are done with it: its empty barrier
  // counts this CTA's MMA threads and one arrival per MMA warp of each peer.
  static constexpr uint32_t kKVEmptyArrivals = Traits::NumMmaThreads + (kClusterM - 1) * Traits::NumMmaThreads / 32;

  // ---------------------------------------------------------------------------------------
  // Shell hooks (kernels/persistent_shell.h).
  // ---------------------------------------------------------------------------------------
  static constexpr int kClusterSize = kClusterM;
  static constexpr int kProducerRegisters = Traits::kProducerRegisters;
  static constexpr int kMmaRegisters = Traits::kMmaRegisters;

  static __device__ __forceinline__ void init_shared(Params const& params, SharedStorage& ss) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    if constexpr (Traits::kTmaStoreOut) { cute::prefetch_tma_descriptor(params.tma_o.get_tma_descriptor()); }
    // Full barriers: one producer arrival (+ TMA bytes). Empty barriers: every MMA thread.
    for (int s = 0; s < Traits::kStagesQ; ++s) {
      ptx::mbar_init(&ss.bar_q_full[s], 1);
      ptx::mbar_init(&ss.bar_q_empty[s], Traits::NumMmaThreads);
    }
    for (int s = 0; s < Traits::kStages; ++s) {
      ptx::mbar_init(&ss.bar_k_full[s], 1);
      ptx::mbar_init(&ss.bar_k_empty[s], kKVEmptyArrivals);
      ptx::mbar_init(&ss.bar_v_full[s], 1);
      ptx::mbar_init(&ss.bar_v_empty[s], kKVEmptyArrivals);
    }
    ss.work.init(Traits::NumMmaThreads);
  }

  // The CTA's first work item and the one after `t`. One CTA: claimed (FwdTileOrder). A
  // cluster: a static stride over tile pairs, so that both CTAs of the cluster see the same
  // pairs without talking (all pairs of a full mask are equally long, nothing to balance).
  static __device__ __forceinline__ int first_item() { return int(blockIdx.x) / kClusterM; }
  static __device__ __forceinline__ int next_item(Params const& p, int t) {
    if constexpr (kClusterM == 1) {
      return int(gridDim.x) + atomicAdd(p.tile_counter, 1);
    } else {
      return t + int(gridDim.x) / kClusterM;
    }
  }
  // The Q tile (row block) of item `t` that this CTA computes: the pair's tile of its rank
  // (`rank`: ptx::cluster_ctarank(), read once by the caller; 0 without a cluster).
  static __device__ __forceinline__ int q_tile_of(FwdTileOrder::Tile const& tile, uint32_t rank) {
    return kClusterM * tile.m + int(rank);
  }

  // Varlen: the first work item from `t` on (t is advanced to it) whose Q tile holds a row of
  // its sequence, with the sequence's place. The order's grid is sized for the longest
  // sequence; the tiles past a shorter one's end are dropped here and never reach the MMA
  // warpgroups. Past the last item: item >= num_tiles, nothing else read.
  static __device__ __forceinline__ FwdSeqTile next_seq_tile(Params const& p, int& t) {
    for (;; t = next_item(p, t)) {
      FwdSeqTile s;
      s.item = t;
      if (t >= p.order.num_tiles) { return s; }
      // The item's sequence, then its tile in the sequence's own L2 sections.
      int const b = p.order.sequence_of(t, p.num_heads);
      s.seq = load_seq_place(p.cu_seqlens_q, p.cu_seqlens_k, b);
      int const section_heads = p.order.sequence_section_heads(s.seq.seqlen_k, p.num_heads);
      auto const tile = p.order.tile_in_sequence(t, b, p.num_heads, section_heads);
      s.bh = tile.bh;
      s.m = tile.m;
      if (s.m * kBlockM < s.seq.seqlen_q) { return s; }
      // A dead item: raise the counter past the run of dead items it starts, so that this
      // claim (the loop's next_item) and every other CTA's land after it. Every item between
      // the counter and the run's end lies in (t, end), so all are dead: no live item is
      // skipped. Items t < gridDim.x are the CTAs' first ones, never claimed through the counter.
      int const end = p.order.dead_run_end_in_sequence(tile, b, p.num_heads, section_heads,
                                                       (s.seq.seqlen_q + kBlockM - 1) / kBlockM);
      if (end > t + 1) { atomicMax(p.tile_counter, end - int(gridDim.x)); }
    }
  }

  // The tile geometry (blocks per tile, which need a mask) of a received work item: the
  // problem's (a reference into the parameters) or, varlen, its sequence's.
  template <class Work>
  static __device__ __forceinline__ decltype(auto) geometry_of(Params const& p, Work const& work) {
    if constexpr (kVarlen) {
      return with_lengths(p.geo, work.seq);
    } else {
      return (p.geo);
    }
  }

  // An MMA thread is done reading K/V stage `bar`'s buffer. With a cluster lane 0 of each warp
  // also tells the peers, whose TMA writes their slices of the next block into this CTA's
  // buffer: its warp's lanes passed the wait for the GEMMs that read the stage together
  // (wgmma.wait_group is .sync.aligned), so lane 0's arrival speaks for the warp. `peer` and
  // `lane0` are computed once per thread (reading %cluster_ctarank per release put an S2R
  // ahead of every arrive in the loop).
  static __device__ __forceinline__ void release_kv(uint64_t* bar, uint32_t peer, bool lane0) {
    ptx::mbar_arrive(bar);
    if constexpr (kClusterM > 1) {
      static_assert(kClusterM == 2, "one peer");
      ptx::mbar_arrive_cluster_if(bar, peer, lane0);
    }
  }

  // The forward's producer warpgroup has one working warp.
  static __device__ __forceinline__ void producer_warpgroup_warp(Params const&, SharedStorage&, int) {}

  // ---------------------------------------------------------------------------------------
  // Producer: one elected lane of warp 0.
  // ---------------------------------------------------------------------------------------
  static __device__ void producer(Params const& p, SharedStorage& ss) {
    if constexpr (kClusterM == 1) {
      producer_loads(p, ss, _0{});
    } else {
      // The rank as a compile-time slice: with a run-time one the producer's 24 registers
      // spilled (the slice's smem and coordinate offsets).
      static_assert(kClusterM == 2);
      if (ptx::cluster_ctarank() == 0) {
        producer_loads(p, ss, _0{});
      } else {
        producer_loads(p, ss, _1{});
      }
    }
  }

  // Loads of the CTA whose K/V slice is KVSlice (its rank in the cluster; 0 without one).
  template <class KVSlice>
  static __device__ __forceinline__ void producer_loads(Params const& p, SharedStorage& ss, KVSlice kv_slice) {
    Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ss.smem_k), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.smem_v), typename Traits::SmemLayoutV{});
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_k);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_k);
    auto tma_q = p.tma_q.get_slice(_0{});
    // With a cluster each CTA loads the slice of K and V of its rank, for every CTA.
    uint16_t constexpr kMcastMask = uint16_t((1u << kClusterM) - 1);
    auto tma_k = p.tma_k.get_slice(kv_slice);
    auto tma_v = p.tma_v.get_slice(kv_slice);
    auto kv_load = [&](auto const& tma, uint64_t& bar) {
      if constexpr (kClusterM == 1) {
        return tma.with(bar, 0, TMA::CacheHintSm90::EVICT_LAST);
      } else {
        return tma.with(bar, kMcastMask, TMA::CacheHintSm90::EVICT_LAST);
      }
    };
    Tensor tQsQ = tma_q.partition_D(sQ);  // (TMA, 1, 1, stage)
    Tensor tKsK = tma_k.partition_D(sK);  // (TMA, 1, 1, stage)
    Tensor tVsV = tma_v.partition_D(sV);

    KVState kv;
    QState qs;
    // One Q tile's loads: its Q, then K and V of blocks n_end - 1 down to 0.
    auto load_tile = [&](auto const& tQgQ, auto const& tKgK, auto const& tVgV, int n_end) {
      // A Q buffer is free once every MMA thread's last S GEMM of the tile it held is done.
      // With one buffer (kStagesQ = 1) that is the tile the MMA warpgroups are still working
      // on, so this load waits for its last S GEMM. With two it is the tile before that one,
      // normally finished by now, so the load goes out when this tile is claimed: up to
      // kStages blocks before the MMA warpgroups reach it (fewer when the tile before had
      // fewer blocks).
      ptx::mbar_wait(&ss.bar_q_empty[qs.index], qs.phase ^ 1);
      ptx::mbar_arrive_expect_tx(&ss.bar_q_full[qs.index], Traits::kBytesQ);
      copy(p.tma_q.with(ss.bar_q_full[qs.index], 0), tQgQ, tQsQ(_, _, _, qs.index));
      qs.advance();
      auto load_kv = [&](int n) {
        // K_n is needed first (S), V_n one step later (O += P V).
        ptx::mbar_wait(&ss.bar_k_empty[kv.index], kv.phase ^ 1);
        ptx::mbar_arrive_expect_tx(&ss.bar_k_full[kv.index], Traits::kBytesKV);
        copy(kv_load(p.tma_k, ss.bar_k_full[kv.index]), tKgK(_, _, _, n), tKsK(_, _, _, kv.index));
        ptx::mbar_wait(&ss.bar_v_empty[kv.index], kv.phase ^ 1);
        ptx::mbar_arrive_expect_tx(&ss.bar_v_full[kv.index], Traits::kBytesKV);
        copy(kv_load(p.tma_v, ss.bar_v_full[kv.index]), tVgV(_, _, _, n), tVsV(_, _, _, kv.index));
        kv.advance();
      };
      if constexpr (kVarlen) {
        // Not unrolled: unrolled, the varlen loop (its rows offset by the sequence's first row)
        // spilled in the producer's registers (24 then; 32 at hdim 64 now, FwdTraits).
#pragma unroll 1
        for (int n = n_end - 1; n >= 0; --n) { load_kv(n); }
      } else {
        for (int n = n_end - 1; n >= 0; --n) { load_kv(n); }
      }
    };
    uint32_t const rank = kClusterM == 1 ? 0u : ptx::cluster_ctarank();
    int t = first_item();
    for (int k = 0;; ++k) {
      if constexpr (kVarlen) {
        FwdSeqTile const s = next_seq_tile(p, t);
        ss.work.publish(k, s);
        if (t >= p.order.num_tiles) { break; }
        int const n_end = geometry_of(p, s).n_end(s.m);  // 0: no row of the tile sees a key
        if (n_end == 0) {
          t = next_item(p, t);
          continue;
        }
        int const h = s.bh % p.num_heads;
        int const h_kv = h / p.heads_per_kv_head;
        // The sequence's rows, from its first one in the packed tensors.
        Tensor gQ = local_tile(domain_offset(make_coord(s.seq.row_q, _0{}), mQ(_, _, h, _0{})),
                               Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(s.m, _0{}));
        Tensor gK = local_tile(domain_offset(make_coord(s.seq.row_k, _0{}), mK(_, _, h_kv, _0{})),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
        Tensor gV = local_tile(domain_offset(make_coord(s.seq.row_k, _0{}), mV(_, _, h_kv, _0{})),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
        load_tile(tma_q.partition_S(gQ), tma_k.partition_S(gK), tma_v.partition_S(gV), n_end);
      } else if constexpr (Traits::kTmaStoreOut) {
        // The tile decoded here, once, for the MMA warpgroups as well.
        if (t >= p.order.num_tiles) {
          ss.work.publish(k, FwdWorkItem{t, 0, 0, 0, 0});
          break;
        }
        auto const tile = p.order.tile(t);
        int const b = tile.bh / p.num_heads, h = tile.bh - b * p.num_heads;
        ss.work.publish(k, FwdWorkItem{t, tile.bh, tile.m, b, h});
        int const m = q_tile_of(tile, rank);
        int const n_end = p.geo.n_end(m);  // 0: no row of the tile sees a key
        if (n_end == 0) {
          t = next_item(p, t);
          continue;
        }
        int const h_kv = h / p.heads_per_kv_head;
        Tensor gQ = local_tile(mQ(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, _0{}));
        Tensor gK = local_tile(mK(_, _, h_kv, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
        Tensor gV = local_tile(mV(_, _, h_kv, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
        load_tile(tma_q.partition_S(gQ), tma_k.partition_S(gK), tma_v.partition_S(gV), n_end);
      } else {
        ss.work.publish(k, t);
        if (t >= p.order.num_tiles) { break; }
        auto const tile = p.order.tile(t);
        int const m = q_tile_of(tile, rank);
        int const n_end = p.geo.n_end(m);  // 0: no row of the tile sees a key
        if (n_end == 0) {
          t = next_item(p, t);
          continue;
        }
        int const b = tile.bh / p.num_heads, h = tile.bh - b * p.num_heads;
        int const h_kv = h / p.heads_per_kv_head;
        Tensor gQ = local_tile(mQ(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, _0{}));
        Tensor gK = local_tile(mK(_, _, h_kv, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
        Tensor gV = local_tile(mV(_, _, h_kv, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
        load_tile(tma_q.partition_S(gQ), tma_k.partition_S(gK), tma_v.partition_S(gV), n_end);
      }
      // The next tile is claimed once this one's last loads are issued, while the MMA
      // warpgroups still have up to kStages blocks of it to go: claiming it when this tile's
      // loads began held each CTA one whole tile ahead, so under a causal mask a CTA could
      // sit on a long tile while others ran dry (the tail: 7-8 % of SM time idle at hdim 128
      // causal 2k-16k by tools/fwd_tile_order_model.py, 8.6 % measured by ncu at 8k; claiming
      // late took the forward +4-8 % there, same bits). With one Q buffer the atomic's latency
      // is hidden (the next Q load waits for this tile's last S GEMM anyway); with two it
      // delays the next Q load, which is still issued while this tile's blocks run.
      t = next_item(p, t);
    }
    // With a cluster the peers' MMA warps arrive on this CTA's K/V empty barriers (release_kv)
    // until they are done with the last blocks: wait until every stage has been released by
    // all of them, so that no arrival is still on its way when this CTA exits. (The loads this
    // CTA multicast into its peers are waited for by the peers' own MMA warps.)
    if constexpr (kClusterM > 1) {
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < Traits::kStages; ++s) {
        ptx::mbar_wait(&ss.bar_k_empty[kv.index], kv.phase ^ 1);
        ptx::mbar_wait(&ss.bar_v_empty[kv.index], kv.phase ^ 1);
        kv.advance();
      }
    }
  }

  // ---------------------------------------------------------------------------------------
  // Ping-pong turns: warpgroup w waits for its turn before issuing GEMMs and then hands the
  // turn to warpgroup w + 1 (round robin). Barrier kTurn0 + w counts warpgroup w's 128
  // waiting threads plus the 128 arrivals of the warpgroup before it; the last warpgroup
  // arrives once up front so that warpgroup 0 goes first. All warpgroups issue the same
  // number of GEMM groups (same tiles, same blocks), so the arrivals always balance.
  // ---------------------------------------------------------------------------------------
  static __device__ __forceinline__ void wait_turn(int wg) {
    if constexpr (Traits::kPingPong) { ptx::named_sync(uint32_t(FwdBarrier::kTurn0) + wg, 256); }
  }
  static __device__ __forceinline__ void pass_turn(int wg) {
    if constexpr (Traits::kPingPong) {
      int const next = wg + 1 == NumMmaWarpGroups ? 0 : wg + 1;
      ptx::named_arrive(uint32_t(FwdBarrier::kTurn0) + next, 256);
    }
  }

  // Value i of a thread's 64xN accumulator fragment lies in row half (i / 2) % 2: the
  // thread holds rows r and r + 8 of its warpgroup's 64, and the other three lanes of its
  // quad hold the rest of those two rows.
  static __device__ __forceinline__ int row_half(int i) { return (i >> 1) & 1; }

  static __device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  }
  static __device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
  }

  // This thread's max of each of its two rows in the block (quad_max gives the row's).
  template <class Frag>
  static __device__ __forceinline__ void thread_row_max(Frag const& s, float (&block_max)[2]) {
    block_max[0] = block_max[1] = -INFINITY;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(s); ++i) { block_max[row_half(i)] = fmaxf(block_max[row_half(i)], s(i)); }
  }

  // S -> P = exp2(S * scale_log2 - max_scaled) in place; `block_sum` gets this thread's partial
  // sums of its two rows (quads are summed once, at the tile's end). WaitPvAfter > 0: the
  // warpgroup's P V GEMM in flight is waited for after the first WaitPvAfter exponentials
  // (Traits::kPvWaitAfterExp2; the partial sum they feed orders the wait behind them).
  template <int WaitPvAfter = 0, class Frag>
  static __device__ __forceinline__ void exp2_rows(Frag& s, float const (&max_scaled)[2], float scale_log2,
                                                   float (&block_sum)[2]) {
    static_assert(WaitPvAfter < decltype(size(s))::value, "the wait must follow one of the block's exponentials");
    block_sum[0] = block_sum[1] = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(s); ++i) {
      s(i) = detail::exp2_approx(fmaf(s(i), scale_log2, -max_scaled[row_half(i)]));
      block_sum[row_half(i)] += s(i);
      if constexpr (WaitPvAfter > 0) {
        if (i == WaitPvAfter - 1) { ptx::wgmma_wait_all_after(block_sum[row_half(i)]); }
      }
    }
  }

  // Online softmax of one block, in place: S -> P = exp2(S * scale_log2 - max_scaled), where
  // `row_max` is the max subtracted from the row (`max_scaled` = row_max * scale_log2); `rescale`
  // gets the factor by which the O rows and sums accumulated so far must be multiplied. Returns
  // whether one of this thread's rows raised its max (only then is a factor other than 1); the
  // caller reads it only under kConditionalRescale, so the exact-max path just returns true.
  //   * kConditionalRescale (dash/config.py, FwdTileConfig.rescale_max_growth_log2 says where it
  //     pays): the max is raised only when the block's row max exceeds it by more than
  //     kRescaleMaxGrowthLog2 in exp2 units, so P stays at most 2^kRescaleMaxGrowthLog2 and most
  //     blocks of a long row raise nothing (the caller then skips the O rescale).
  //   * otherwise: the exact running max (FA3's online softmax).
  // A row whose keys so far are all masked has max -inf: it uses 0 as the subtracted max
  // (P = exp2(-inf) = 0, no NaN).
  template <bool First, int WaitPvAfter = 0, class Frag>
  static __device__ __forceinline__ bool online_softmax(Frag& s, float (&row_max)[2], float (&max_scaled)[2],
                                                        float (&row_sum)[2], float (&rescale)[2], float scale_log2) {
    float block_max[2];
    thread_row_max(s, block_max);
    bool raised = false;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      float const block_row_max = quad_max(block_max[r]);
      if constexpr (First) {
        rescale[r] = 1.f;
        row_max[r] = block_row_max;
      } else if constexpr (Traits::kConditionalRescale) {
        // False when both are -inf (NaN): the row has seen no key yet and stays at -inf. True
        // when only row_max is -inf: the factor exp2(-inf) = 0 meets an O row that is still 0.
        bool const raise = (block_row_max - row_max[r]) * scale_log2 > Traits::kRescaleMaxGrowthLog2;
        rescale[r] = raise ? detail::exp2_approx((row_max[r] - block_row_max) * scale_log2) : 1.f;
        row_max[r] = raise ? block_row_max : row_max[r];
        raised |= raise;
      } else {
        float const new_max = fmaxf(row_max[r], block_row_max);
        rescale[r] = new_max == -INFINITY ? 1.f : detail::exp2_approx((row_max[r] - new_max) * scale_log2);
        row_max[r] = new_max;
        raised = true;
      }
      max_scaled[r] = row_max[r] == -INFINITY ? 0.f : row_max[r] * scale_log2;
    }
    float block_sum[2];
    exp2_rows<WaitPvAfter>(s, max_scaled, scale_log2, block_sum);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      // Each thread keeps a partial sum of its own columns; quads are summed once at the end.
      row_sum[r] = First ? block_sum[r] : row_sum[r] * rescale[r] + block_sum[r];
    }
    return raised;
  }

  // Lazy block max (kLazyMax, FwdTileConfig.lazy_max_sum_log2), the common path of a middle
  // block: S -> P = exp2(S * scale_log2 - max_scaled) under the max subtracted so far, without
  // the block's row max; `block_sum` gets this thread's partial row sums. Returns, the same for
  // the whole warpgroup (bar.red.or on `vote_barrier`), whether it must take the slow path
  // (lazy_raise_max): a thread's partial sum passed kLazyMaxSumBound, or `first_keys` (a row of
  // the warpgroup meets its first visible key in this block). P >= 0, so a partial sum within the
  // bound means no P of the thread above it; a score more than 128 exp2 units above the max gives
  // +inf, which passes it too (as does NaN). A row that has seen no key has max -inf and
  // subtracts 0: harmless while its scores are all masked (P = 0), wrong (under- or overflow) on
  // its first visible keys, hence `first_keys`.
  template <class Frag>
  static __device__ __forceinline__ bool lazy_softmax(Frag& s, float const (&max_scaled)[2], float (&block_sum)[2],
                                                      float scale_log2, bool first_keys, uint32_t vote_barrier) {
    exp2_rows(s, max_scaled, scale_log2, block_sum);
    bool const within = block_sum[0] <= Traits::kLazyMaxSumBound && block_sum[1] <= Traits::kLazyMaxSumBound;
    return ptx::named_sync_or(vote_barrier, 128, !within || first_keys);
  }

  // The lazy block max's slow path: `s` holds S of the block again (masked). A row raises its max
  // to the block's row max where that grew by more than 2^kRescaleMaxGrowthLog2 (the conditional
  // rule; a row meeting its first key grows by +inf), or where the common path's sum (`lazy_sum`)
  // passed the bound with the block's max above the row's (else a row whose scores all rose a
  // little would come here on every block); then P under the new max, as online_softmax does.
  // Returns whether one of this thread's rows raised its max.
  template <class Frag>
  static __device__ __forceinline__ bool lazy_raise_max(Frag& s, float (&row_max)[2], float (&max_scaled)[2],
                                                        float const (&lazy_sum)[2], float (&block_sum)[2],
                                                        float (&rescale)[2], float scale_log2) {
    float block_max[2];
    thread_row_max(s, block_max);
    bool raised = false;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      float const block_row_max = quad_max(block_max[r]);
      // The quad's four partial sums of the row: over the bound where one is (NaN included).
      bool const over = quad_max(lazy_sum[r] <= Traits::kLazyMaxSumBound ? 0.f : 1.f) > 0.f;
      // NaN (false) when both maxima are -inf: the row still sees no key.
      float const growth = (block_row_max - row_max[r]) * scale_log2;
      bool const raise = growth > Traits::kRescaleMaxGrowthLog2 || (over && block_row_max > row_max[r]);
      rescale[r] = raise ? detail::exp2_approx((row_max[r] - block_row_max) * scale_log2) : 1.f;
      row_max[r] = raise ? block_row_max : row_max[r];
      max_scaled[r] = row_max[r] == -INFINITY ? 0.f : row_max[r] * scale_log2;
      raised |= raise;
    }
    exp2_rows(s, max_scaled, scale_log2, block_sum);
    return raised;
  }

  // Masks S of block n of Q tile m: keys past seqlen_k, and (causal) keys after the query's
  // diagonal (bottom-right aligned). `geo`: geometry_of the tile.
  template <class Geo, class Frag, class Coords>
  static __device__ __forceinline__ void apply_mask(Geo const& geo, Frag& s, Coords const& tScS, int m, int n) {
    if constexpr (Traits::kRowLimitMask) {
      // Each of the thread's two rows sees the keys below one limit (min(seqlen_k, the diagonal
      // + 1)), taken relative to the thread's first column: an element then costs one compare
      // against a column offset known at compile time and one select, instead of its own key
      // and query arithmetic (~200 instructions per masked block at hdim 128).
      int const first_key = n * kBlockN + get<1>(tScS(0));
      int limit[2];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        int const query = m * kBlockM + get<0>(tScS(2 * r));  // values 0 and 2: row halves 0 and 1
        int visible_end = geo.seqlen_k;  // keys [0, visible_end) of this row are visible
        if constexpr (Is_causal) { visible_end = min(visible_end, query + geo.seqlen_k - geo.seqlen_q + 1); }
        limit[r] = visible_end - first_key;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(s); ++i) {
        int const col = get<1>(tScS(i)) - get<1>(tScS(0));  // compile-time: the thread's base cancels
        if (col >= limit[row_half(i)]) { s(i) = -INFINITY; }
      }
    } else {
      int const key0 = n * kBlockN, query0 = m * kBlockM;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(s); ++i) {
        int const key = key0 + get<1>(tScS(i));
        int const query = query0 + get<0>(tScS(i));
        bool const masked = key >= geo.seqlen_k || (Is_causal && key > query + geo.seqlen_k - geo.seqlen_q);
        if (masked) { s(i) = -INFINITY; }
      }
    }
  }

  // ---------------------------------------------------------------------------------------
  // MMA warpgroups. mma_tidx in [0, NumMmaThreads).
  // ---------------------------------------------------------------------------------------
  static __device__ void mma(Params const& p, SharedStorage& ss, int mma_tidx) {
    int const wg = mma_tidx / 128;
    uint32_t const rank = kClusterM == 1 ? 0u : ptx::cluster_ctarank();
    uint32_t const peer = rank ^ 1u;  // unused without a cluster
    bool const lane0 = threadIdx.x % 32 == 0;
    Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ss.smem_k), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(ss.smem_v), typename Traits::SmemLayoutVt{});

    typename Traits::TiledMmaQK tiled_mma_qk;
    typename Traits::TiledMmaPV tiled_mma_pv;
    auto wg_mma_qk = tiled_mma_qk.get_slice(wg * 128);
    auto wg_mma_pv = tiled_mma_pv.get_slice(wg * 128);
    auto thr_mma_qk = tiled_mma_qk.get_thread_slice(mma_tidx);
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(mma_tidx);
    Tensor tSrQ = wg_mma_qk.partition_fragment_A(sQ);    // (.., stage)
    Tensor tSrK = wg_mma_qk.partition_fragment_B(sK);    // (.., stage)
    Tensor tOrVt = wg_mma_pv.partition_fragment_B(sVt);  // (.., stage)
    // (row, key) within the tile of this thread's S values; (row, dim) of its O values.
    Tensor tScS = thr_mma_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor tOcO = thr_mma_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));

    // TMA-store tile end (kTmaStoreOut): this thread's part of the output tile in shared memory
    // (stmatrix), its warpgroup's 64-row slab as the store's source, out as its destination.
    auto smem_tiled_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma_pv);
    auto smem_thr_copy_o = smem_tiled_copy_o.get_thread_slice(mma_tidx);
    Tensor tOsO = smem_thr_copy_o.partition_D(make_tensor(make_smem_ptr(ss.smem_o), typename Traits::SmemLayoutO{}));
    Tensor sO_slab = make_tensor(make_smem_ptr(ss.smem_o + wg * Traits::kSlabElemsO), typename Traits::SmemLayoutOSlab{});
    uint32_t const slab_barrier = uint32_t(FwdBarrier::kOutSlab0) + uint32_t(wg);
    uint32_t const vote_barrier = uint32_t(FwdBarrier::kLazyMaxVote0) + uint32_t(wg);  // kLazyMax
    bool const slab_leader = mma_tidx % 128 == 0;  // issues and waits for its warpgroup's TMA stores

    float const scale_log2 = p.softmax_scale_log2;
    if (Traits::kPingPong && wg == NumMmaWarpGroups - 1) {
      ptx::named_arrive(uint32_t(FwdBarrier::kTurn0), 256);  // warpgroup 0 issues first
    }

    KVState kv;
    QState qs;
    for (int k = 0;; ++k) {
      auto const work = ss.work.receive(k);
      int t, m, bh;
      if constexpr (kVarlen) {
        t = work.item;
        m = work.m;
        bh = work.bh;
      } else if constexpr (Traits::kTmaStoreOut) {
        t = work.t;
      } else {
        t = work;
      }
      if (t >= p.order.num_tiles) { break; }  // the CTA is done
      if constexpr (Traits::kTmaStoreOut) {
        m = q_tile_of(FwdTileOrder::Tile{work.bh, work.m_pair}, rank);
        bh = work.bh;
      } else if constexpr (!kVarlen) {
        auto const tile = p.order.tile(t);
        m = q_tile_of(tile, rank);
        bh = tile.bh;
      }
      auto&& geo = geometry_of(p, work);
      // KV blocks [0, n_end) hold a visible key; 0 when no row does (causal, seqlen_q >
      // seqlen_k, or a varlen sequence without keys): the tile's O is then 0 and its LSE -inf.
      int const n_end = geo.n_end(m);
      // Lazy block max, causal: the first KV block in which a row of this warpgroup meets a
      // visible key (its first row's: visible ends grow with the row; -1 if it sees none).
      // Unmasked blocks hold every row's keys, so a row meets its first key in one only if
      // that is the warpgroup's first row and the block ends where its keys end (blocks are
      // walked downwards): that block takes the slow path (first_keys), the masked blocks
      // their own exact step.
      int first_key_block = 0;
      if constexpr (Traits::kLazyMax && Is_causal) {
        int const visible_end = min(geo.seqlen_k, m * kBlockM + wg * 64 + geo.seqlen_k - geo.seqlen_q + 1);
        first_key_block = visible_end > 0 ? (visible_end - 1) / kBlockN : -1;
      }

      Tensor tOrO = partition_fragment_C(tiled_mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      clear(tOrO);
      float row_max[2] = {-INFINITY, -INFINITY}, max_scaled[2] = {0.f, 0.f}, row_sum[2] = {0.f, 0.f};
      float rescale[2];

      // O / rowsum as Element rows, LSE = ln(sum_j exp(scale * s_ij)); from the quads'
      // partial sums, once the tile's last softmax is done.
      float inv_sum[2], lse[2];
      auto finish_row_stats = [&] {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          float const sum = quad_sum(row_sum[r]);
          bool const empty = sum == 0.f;  // the row saw no key (only possible under a causal mask)
          inv_sum[r] = empty ? 0.f : 1.f / sum;
          lse[r] = empty ? -INFINITY : (max_scaled[r] + __log2f(sum)) * 0.693147180559945309f;  // ln 2
        }
      };
      if (n_end > 0) {
        ptx::mbar_wait(&ss.bar_q_full[qs.index], qs.phase);
        auto const tSrQ_tile = tSrQ(_, _, _, qs.index);

        // ---- the first block (n_end - 1): S, softmax; its P V is issued with the next S.
        Tensor tSrS = partition_fragment_C(tiled_mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
        ptx::mbar_wait(&ss.bar_k_full[kv.index], kv.phase);
        wait_turn(wg);
        detail::wgmma_gemm<true, false>(tiled_mma_qk, tSrQ_tile, tSrK(_, _, _, kv.index), tSrS);
        pass_turn(wg);
        warpgroup_wait<0>();
        release_kv(&ss.bar_k_empty[kv.index], peer, lane0);
        if (n_end == 1) { ptx::mbar_arrive(&ss.bar_q_empty[qs.index]); }  // last read of this tile's Q
        if (geo.needs_mask(m, n_end - 1)) { apply_mask(geo, tSrS, tScS, m, n_end - 1); }
        online_softmax<true>(tSrS, row_max, max_scaled, row_sum, rescale, scale_log2);
        Tensor tOrP = detail::convert_fragment<Element>(tSrS);
        Tensor tOrP_A = make_tensor(tOrP.data(), detail::acc_layout_as_A_regs(tSrS.layout()));
        KVState kv_prev = kv;  // the stage of the block whose P V is pending
        kv.advance();

        // ---- middle blocks: issue S_n and O += P_{n+1} V_{n+1}; softmax of S_n under the latter.
        // The blocks that need a mask (keys past seqlen_k, the causal diagonal) come first in
        // this descending walk; they get their own loop, so the loop over the rest holds no
        // mask code. With the mask behind a branch inside the one loop, the softmax started a
        // basic block of its own and ptxas placed the wait for the P V GEMM at its top, before
        // the first exponential: a warpgroup's softmax never overlapped its own P V GEMM (FA3,
        // whose unmasked loop has no mask code, waits after 13-19 exponentials).
        // `masked`: std::true_type / std::false_type picks the variant at compile time, a bool
        // at run time (hdim 64).
        auto middle_step = [&](int n, auto masked) {
          Tensor tSrS = partition_fragment_C(tiled_mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
          // kWaitVInTurn (dash/config.py says where it pays): V is waited for between the two
          // issues, inside the turn, as FA3 does; otherwise before the turn, beside K.
          ptx::mbar_wait(&ss.bar_k_full[kv.index], kv.phase);
          if constexpr (!Traits::kWaitVInTurn) { ptx::mbar_wait(&ss.bar_v_full[kv_prev.index], kv_prev.phase); }
          wait_turn(wg);
          detail::wgmma_gemm<true, false>(tiled_mma_qk, tSrQ_tile, tSrK(_, _, _, kv.index), tSrS);
          if constexpr (Traits::kWaitVInTurn) { ptx::mbar_wait(&ss.bar_v_full[kv_prev.index], kv_prev.phase); }
          detail::wgmma_gemm<false, true>(tiled_mma_pv, tOrP_A, tOrVt(_, _, _, kv_prev.index), tOrO);
          pass_turn(wg);
          warpgroup_wait<1>();  // S_n done
          // K_n and (last block) Q are read again on the lazy max's slow path: released after it.
          auto release_k_and_q = [&] {
            release_kv(&ss.bar_k_empty[kv.index], peer, lane0);
            if (n == 0) { ptx::mbar_arrive(&ss.bar_q_empty[qs.index]); }
          };
          bool raised;
          // The lazy max's common path, and its slow path where the warpgroup votes for it.
          auto lazy_step = [&] {
            float lazy_sum[2];
            bool const first_keys = Is_causal && n >= first_key_block;
            bool const slow = lazy_softmax(tSrS, max_scaled, lazy_sum, scale_log2, first_keys, vote_barrier);
            if (slow) {  // warpgroup-uniform (the vote): S_n again, out of turn, beside the pending P V
              detail::wgmma_gemm<true, false>(tiled_mma_qk, tSrQ_tile, tSrK(_, _, _, kv.index), tSrS);
              warpgroup_wait<0>();
              float block_sum[2];
              raised = lazy_raise_max(tSrS, row_max, max_scaled, lazy_sum, block_sum, rescale, scale_log2);
              CUTLASS_PRAGMA_UNROLL
              for (int r = 0; r < 2; ++r) { row_sum[r] = row_sum[r] * rescale[r] + block_sum[r]; }
            } else {
              raised = false;
              CUTLASS_PRAGMA_UNROLL
              for (int r = 0; r < 2; ++r) { row_sum[r] += lazy_sum[r]; }
            }
            release_k_and_q();
          };
          // Masked blocks (the causal diagonal, the key tail) keep the conditional rule's row max:
          // the rows meeting their first keys are there, and so the lazy slow path never masks.
          auto exact_step = [&] {
            release_k_and_q();
            if (masked) { apply_mask(geo, tSrS, tScS, m, n); }
            raised = online_softmax<false, Traits::kPvWaitAfterExp2>(tSrS, row_max, max_scaled, row_sum, rescale,
                                                                      scale_log2);
          };
          // `masked` is a bool (hdim 64) or a compile-time cute::true_type / false_type (hdim 128).
          if constexpr (!Traits::kLazyMax) {
            exact_step();
          } else if (masked) {
            exact_step();
          } else {
            lazy_step();
          }
          // O += P V done: P's registers and V_{n+1} are free (with kPvWaitAfterExp2 the
          // softmax waited, among its exponentials).
          if constexpr (Traits::kPvWaitAfterExp2 == 0) { warpgroup_wait<0>(); }
          release_kv(&ss.bar_v_empty[kv_prev.index], peer, lane0);
          auto rescale_o = [&] {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(tOrO); ++i) { tOrO(i) *= rescale[row_half(i)]; }
          };
          auto convert_p = [&] {
            Tensor tOrP_next = detail::convert_fragment<Element>(tSrS);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(tOrP); ++i) { tOrP(i) = tOrP_next(i); }
          };
          if constexpr (Traits::kConditionalRescale) {
            // P first: with the conversions ahead of the branch ptxas interleaves them with the
            // exponentials; behind it they ran after the last one (and the loop lost 3-6 %,
            // kernel notes, twenty-third pass). The O rescale only where a row of the warp
            // raised its max (every other factor is exactly 1); the vote keeps the branch
            // warp-uniform.
            convert_p();
            if (__any_sync(0xffffffffu, raised)) { rescale_o(); }
          } else {
            rescale_o();
            convert_p();
          }
          kv_prev = kv;
          kv.advance();
        };
        int n = n_end - 2;
        if constexpr (kHeadDim == 128) {
          for (; n >= 0 && geo.needs_mask(m, n); --n) { middle_step(n, cute::true_type{}); }
          for (; n >= 0; --n) { middle_step(n, cute::false_type{}); }
        } else {
          // hdim 64 (three warpgroups of 160 registers) keeps one loop with the mask behind a
          // run-time branch. ptxas waits for the P V GEMM before the first exponential in every
          // form tried, and the others ran slower on the H200 (kernel notes, sixth pass): the
          // split loop spills 16 bytes under a causal mask; two inlined variants chosen per
          // block lost 6 % at causal 2k and 4 % at full 8k; a full-mask loop with no mask code
          // at all (only the peeled first block can hold a key tail) lost 1.5-4.5 %.
          for (; n >= 0; --n) { middle_step(n, geo.needs_mask(m, n)); }
        }

        // ---- the last block's P V. kOverlapTileEnd (dash/config.py says where it pays): issued
        // out of turn, with the row sums reduced under it. Skipping the turn keeps the turns
        // balanced (every warpgroup of the CTA skips it, once per tile of the same blocks).
        ptx::mbar_wait(&ss.bar_v_full[kv_prev.index], kv_prev.phase);
        if constexpr (!Traits::kOverlapTileEnd) { wait_turn(wg); }
        detail::wgmma_gemm<false, true>(tiled_mma_pv, tOrP_A, tOrVt(_, _, _, kv_prev.index), tOrO);
        if constexpr (Traits::kOverlapTileEnd) {
          finish_row_stats();
        } else {
          pass_turn(wg);
        }
        warpgroup_wait<0>();
        release_kv(&ss.bar_v_empty[kv_prev.index], peer, lane0);
        qs.advance();
      } else if constexpr (Traits::kOverlapTileEnd) {
        finish_row_stats();  // no key at all: O = 0, LSE = -inf
      }
      // Without the overlap the row sums stay after the join: folded into the branches above,
      // ptxas compiled hdim 128's unmasked loop differently (516 instead of 484 instructions)
      // and it ran 2-4 % slower.
      if constexpr (!Traits::kOverlapTileEnd) { finish_row_stats(); }

      // ---- epilogue.
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tOrO); ++i) { tOrO(i) *= inv_sum[row_half(i)]; }
      int b, h;
      if constexpr (Traits::kTmaStoreOut) {
        b = work.b;
        h = work.h;
      } else {
        b = bh / p.num_heads;
        h = bh - b * p.num_heads;
      }
      // The tile's rows in out and lse: (batch, seqlen_q, heads, d) and (batch, heads, seqlen_q),
      // or varlen its sequence's rows of (total_q, heads, d) and (heads, total_q).
      Element* out;
      float* lse_rows;
      if constexpr (kVarlen) {
        out = p.out + int64_t(work.seq.row_q) * p.out_strides.row + int64_t(h) * p.out_strides.head;
        lse_rows = p.lse + int64_t(h) * p.lse_head_stride + work.seq.row_q;
      } else {
        out = p.out + int64_t(b) * p.out_strides.batch + int64_t(h) * p.out_strides.head;
        lse_rows = p.lse + int64_t(bh) * p.geo.seqlen_q;
      }
      int const row0 = m * kBlockM;
      if constexpr (Traits::kTmaStoreOut) {
        // O / rowsum as Element, staged in this warpgroup's slab (stmatrix) and written by one
        // TMA store (rows past seqlen_q are clipped by the TMA unit). From registers, the row
        // stores took a 4x4 transpose per quad (shuffles, selects): ~490 instructions per warp
        // and tile at hdim 128 (kernel notes, twenty-fourth pass).
        Tensor tOrO_out = detail::convert_fragment<Element>(tOrO);
        // The slab is free once the previous tile's store has read it (the leader waits for
        // that, the barrier tells the others); the store may read it once every thread's
        // stmatrix writes are ordered before the async proxy's reads (fence, then the barrier).
        if (slab_leader) { ptx::bulk_wait_group_read<0>(); }
        ptx::named_sync(slab_barrier, 128);
        copy(smem_tiled_copy_o, smem_thr_copy_o.retile_S(tOrO_out), tOsO);
        ptx::fence_proxy_async_smem();
        ptx::named_sync(slab_barrier, 128);
        if (slab_leader) {
          Tensor mO = p.tma_o.get_tma_tensor(p.shape_q);
          Tensor gO = local_tile(mO(_, _, h, b), Shape<_64, Int<kHeadDim>>{}, make_coord(m * NumMmaWarpGroups + wg, _0{}));
          auto tma_o = p.tma_o.get_slice(_0{});
          copy(p.tma_o, tma_o.partition_S(sO_slab), tma_o.partition_D(gO));
          ptx::bulk_commit_group();
        }
      } else {
        store_acc_rows_16B(tOrO, tOcO, 1.0f, out, p.out_strides.row, row0, geo.seqlen_q);
      }
      if (threadIdx.x % 4 == 0) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          int const row = row0 + get<0>(tOcO(2 * r));  // values 0 and 2: row halves 0 and 1
          if (row < geo.seqlen_q) { lse_rows[row] = lse[r]; }
        }
      }
      if constexpr (kVarlen) {
        if (m == p.order.num_m_blocks - 1) { write_nan_past_grid(p, out, lse_rows, work.seq.seqlen_q, mma_tidx); }
      }
    }
    // The last TMA store reads this CTA's shared memory, which ends with the CTA: wait until it
    // is complete before the warpgroup exits.
    if constexpr (Traits::kTmaStoreOut) {
      if (slab_leader) { ptx::bulk_wait_group<0>(); }
    }
  }

  // Varlen: a sequence longer than the grid's seqlen_q (the caller's max_seqlen_q) has rows no
  // Q tile covers. They get NaN in out and lse, written by the MMA threads of the sequence's
  // last Q tile of the grid, so that the mistake shows instead of leaving the rows unwritten.
  static __device__ __noinline__ void write_nan_past_grid(Params const& p, Element* out, float* lse_rows,
                                                          int seqlen_q, int mma_tidx) {
    int const first = p.order.num_m_blocks * kBlockM;
    if (seqlen_q <= first) { return; }
    float const nan = __int_as_float(0x7fffffff);
    for (int64_t i = mma_tidx; i < int64_t(seqlen_q - first) * kHeadDim; i += NumMmaThreads) {
      int const row = first + int(i / kHeadDim), d = int(i % kHeadDim);
      out[int64_t(row) * p.out_strides.row + d] = Element(nan);
      if (d == 0) { lse_rows[row] = nan; }
    }
  }
};

template <class Traits>
__global__ void __launch_bounds__(Traits::NumThreads, 1)
    fwd_main_kernel(CUTE_GRID_CONSTANT typename Traits::MainParams const params) {
  PersistentShell<FwdMainKernel<Traits>>::run(params);
}

}  // namespace dash
