// The Hopper attention-backward main kernel: persistent, warp-specialised.
//
//   warpgroup 0, warp 0 : producer. TMA loads of K, V (once per column), Q + LSE and
//                         dO + D (per Q tile) into multi-stage mbarrier pipelines.
//   warpgroup 0, warps 1-2: dQ writers (alternating steps). Reduce-add each dQ partial from
//                         smem into the fp32 dQaccum with cp.reduce.async.bulk, in the
//                         schedule's order when deterministic (see dq_writer below).
//   warpgroups 1..2     : MMA. Each owns 64 keys of the column; keeps dK, dV in registers
//                         for the column's life; computes S^T, dP^T, P^T, dS^T, dV, dK, dQ.
//
// Which column comes next, the order of Q tiles inside a column and each contribution's
// turn come from the Schedule (schedule/schedule.h). The producer decides the CTA's next
// column (here: claims the next item from a global counter) and hands it to the MMA
// warpgroups and the dQ writer through a two-slot ring in shared memory, so all roles
// process the same columns in the same order.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "kernels/acc_store.h"
#include "kernels/bwd_traits.h"
#include "kernels/mma_utils.h"
#include "kernels/persistent_shell.h"
#include "kernels/ptx.h"

namespace dash {

using namespace cute;

template <class Traits, class Schedule>
struct BwdMainKernel {
  using Element = typename Traits::Element;
  using Params = typename Traits::template MainParams<Schedule>;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int NumMmaThreads = Traits::NumMmaThreads;
  static constexpr int NumMmaWarpGroups = Traits::NumMmaWarpGroups;
  static constexpr int kStages = Traits::kStagesQ;

  using StageState = PipelineState<kStages>;  // Q and dO stages advance together

  // Runs body(item) for every column of this CTA, in order: claimed schedules read them
  // from the producer's ring, static ones step through their fixed list (no ring, no state
  // beyond the item itself).
  template <class Body>
  static __device__ __forceinline__ void for_each_column(Params const& params, SharedStorage& ss, Body&& body) {
    auto const& sched = params.schedule;
    if constexpr (Schedule::kClaimed) {
      for (int k = 0;; ++k) {
        int const item = ss.work.receive(k);  // >= num_columns: the CTA is done
        if (item >= sched.num_columns()) { break; }
        body(item);
      }
    } else {
      for (int item = sched.item(blockIdx.x, 0); item < sched.num_columns(); item = sched.next_item(item)) {
        body(item);
      }
    }
  }

  // ---------------------------------------------------------------------------------------
  // Shell hooks (kernels/persistent_shell.h): one-time setup and the producer warpgroup's
  // other warps.
  // ---------------------------------------------------------------------------------------
  static constexpr int kProducerRegisters = Traits::kProducerRegisters;
  static constexpr int kMmaRegisters = Traits::kMmaRegisters;

  static __device__ __forceinline__ void init_shared(Params const& params, SharedStorage& ss) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    // Full barriers: one producer arrival (+ TMA bytes). Empty barriers: every MMA thread.
    ptx::mbar_init(&ss.bar_k_full, 1);
    ptx::mbar_init(&ss.bar_v_full, 1);
    ptx::mbar_init(&ss.bar_k_empty, Traits::NumMmaThreads);
    ptx::mbar_init(&ss.bar_v_empty, Traits::NumMmaThreads);
    // Work ring: the producer publishes; every MMA thread and both dQ writer warps consume.
    ss.work.init(Traits::NumMmaThreads + 2 * 32);
    for (int s = 0; s < Traits::kStagesQ; ++s) {
      ptx::mbar_init(&ss.bar_q_full[s], 1);
      ptx::mbar_init(&ss.bar_q_empty[s], Traits::NumMmaThreads);
      ptx::mbar_init(&ss.bar_do_full[s], 1);
      ptx::mbar_init(&ss.bar_do_empty[s], Traits::NumMmaThreads);
    }
  }

  // Warps 1 and 2 of the producer warpgroup are the dQ writers; warp 3 idles.
  static __device__ __forceinline__ void producer_warpgroup_warp(Params const& params, SharedStorage& ss, int warp) {
    if (warp == 1 || warp == 2) { dq_writer(params, ss, warp - 1); }
  }

  // ---------------------------------------------------------------------------------------
  // Producer: one elected lane of warp 0.
  // ---------------------------------------------------------------------------------------
  static __device__ void producer(Params const& params, SharedStorage& ss) {
    auto const& sched = params.schedule;

    Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.smem_do), typename Traits::SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(ss.smem_k), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.smem_v), typename Traits::SmemLayoutV{});

    Tensor mQ_all = params.tma_q.get_tma_tensor(params.shape_q);
    Tensor mdO_all = params.tma_do.get_tma_tensor(params.shape_q);
    Tensor mK_all = params.tma_k.get_tma_tensor(params.shape_k);
    Tensor mV_all = params.tma_v.get_tma_tensor(params.shape_k);
    auto tma_q = params.tma_q.get_slice(_0{});
    auto tma_do = params.tma_do.get_slice(_0{});
    auto tma_k = params.tma_k.get_slice(_0{});
    auto tma_v = params.tma_v.get_slice(_0{});
    Tensor tQsQ = tma_q.partition_D(sQ);      // (TMA, 1, 1, stage)
    Tensor tdOsdO = tma_do.partition_D(sdO);  // (TMA, 1, 1, stage)
    Tensor tKsK = tma_k.partition_D(sK);      // (TMA, 1, 1)
    Tensor tVsV = tma_v.partition_D(sV);

    StageState stage;
    uint32_t kv_phase = 0;
    int const num_columns = sched.num_columns();
    int item = sched.item(blockIdx.x, 0);
    for (int k = 0;; ++k) {
      if constexpr (Schedule::kClaimed) {
        ss.work.publish(k, item);
      }
      if (item >= num_columns) { break; }

      ColumnCoord const col = sched.column(item);
      int const num_steps = sched.num_steps(col);
      if (num_steps > 0) {
        load_column(params, ss, col, num_steps, stage, kv_phase, tQsQ, tdOsdO, tKsK, tVsV, mQ_all, mdO_all, mK_all,
                    mV_all, tma_q, tma_do, tma_k, tma_v);
      }
      if constexpr (Schedule::kClaimed) {
        // Items are claimed in increasing order (the deadlock-freedom argument in
        // schedule.h); the first gridDim.x items are the CTAs' first columns.
        item = int(gridDim.x) + atomicAdd(params.counters + kWorkCounter, 1);
      } else {
        item = sched.item(blockIdx.x, k + 1);
      }
    }
  }

  template <class TQs, class TdOs, class TKs, class TVs, class MQ, class MdO, class MK, class MV, class TmaQ,
            class TmadO, class TmaK, class TmaV>
  static __device__ __forceinline__ void load_column(Params const& params, SharedStorage& ss, ColumnCoord col,
                                                     int num_steps, StageState& stage, uint32_t& kv_phase,
                                                     TQs& tQsQ, TdOs& tdOsdO, TKs& tKsK, TVs& tVsV, MQ const& mQ_all,
                                                     MdO const& mdO_all, MK const& mK_all, MV const& mV_all,
                                                     TmaQ const& tma_q, TmadO const& tma_do, TmaK const& tma_k,
                                                     TmaV const& tma_v) {
    auto const& sched = params.schedule;
    int const h_kv = col.h / params.heads_per_kv_head;
    Tensor gQ = local_tile(mQ_all(_, _, col.h, col.b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gdO = local_tile(mdO_all(_, _, col.h, col.b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gK = local_tile(mK_all(_, _, h_kv, col.b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(col.n, _0{}));
    Tensor gV = local_tile(mV_all(_, _, h_kv, col.b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(col.n, _0{}));
    Tensor tQgQ = tma_q.partition_S(gQ);      // (TMA, 1, 1, m)
    Tensor tdOgdO = tma_do.partition_S(gdO);  // (TMA, 1, 1, m)
    Tensor tKgK = tma_k.partition_S(gK);
    Tensor tVgV = tma_v.partition_S(gV);
    int64_t const stats_offset = (int64_t(col.b) * params.num_heads + col.h) * params.stats_bh_stride;
    float const* lse_bh = params.lse_log2 + stats_offset;
    float const* dpsum_bh = params.dpsum + stats_offset;

    for (int step = 0; step < num_steps; ++step) {
      int const m = sched.m_block(col, step);
      // Q_m and its LSE share one full barrier; so do dO_m and its D.
      ptx::mbar_wait(&ss.bar_q_empty[stage.index], stage.phase ^ 1);
      ptx::mbar_arrive_expect_tx(&ss.bar_q_full[stage.index], Traits::kBytesQ + Traits::kBytesRowStats);
      copy(params.tma_q.with(ss.bar_q_full[stage.index], 0, TMA::CacheHintSm90::EVICT_LAST), tQgQ(_, _, _, m),
           tQsQ(_, _, _, stage.index));
      ptx::bulk_copy_g2s(ss.smem_lse + stage.index * kBlockM, lse_bh + m * kBlockM, Traits::kBytesRowStats,
                         &ss.bar_q_full[stage.index]);
      if (step == 0) {
        // V, then K, are overwritten once every MMA thread finished its last read of the
        // previous column's (bar_v_empty after the last dP GEMM, bar_k_empty after the
        // last dQ GEMM); the first Q tile above is already in flight meanwhile.
        ptx::mbar_wait(&ss.bar_v_empty, kv_phase ^ 1);
        ptx::mbar_arrive_expect_tx(&ss.bar_v_full, Traits::kBytesKV);
        copy(params.tma_v.with(ss.bar_v_full, 0), tVgV, tVsV);
        ptx::mbar_wait(&ss.bar_k_empty, kv_phase ^ 1);
        ptx::mbar_arrive_expect_tx(&ss.bar_k_full, Traits::kBytesKV);
        copy(params.tma_k.with(ss.bar_k_full, 0), tKgK, tKsK);
        kv_phase ^= 1;
      }
      ptx::mbar_wait(&ss.bar_do_empty[stage.index], stage.phase ^ 1);
      ptx::mbar_arrive_expect_tx(&ss.bar_do_full[stage.index], Traits::kBytesQ + Traits::kBytesRowStats);
      copy(params.tma_do.with(ss.bar_do_full[stage.index], 0, TMA::CacheHintSm90::EVICT_LAST), tdOgdO(_, _, _, m),
           tdOsdO(_, _, _, stage.index));
      ptx::bulk_copy_g2s(ss.smem_dpsum + stage.index * kBlockM, dpsum_bh + m * kBlockM, Traits::kBytesRowStats,
                         &ss.bar_do_full[stage.index]);
      stage.advance();
    }
  }

  // ---------------------------------------------------------------------------------------
  // dQ writers: warps 1 and 2 (all 32 lanes take part in the named barriers, lane 0 issues).
  //
  // The CTA's steps (numbered g = 0, 1, ... across its columns) alternate between the two
  // writer warps: writer (g % 2) reduces step g. Each MMA warpgroup's staging slice is
  // handed over through a pair of named barriers per parity (kdQFull/kdQEmpty of (w, g % 2)),
  // so each barrier phase has exactly one writer warp. Two writers keep two reduce-adds in
  // flight: one writer waits for its add to land in global memory and releases the tile
  // while the other already takes the next partial, so the deterministic hand-off no longer
  // serialises the dQ path (with one writer the kernel ran at the writer's pace whenever
  // the hand-off took longer than a step: hdim 128, 64x128 tiles).
  //
  // Deterministic protocol for the contribution of column n to Q tile m (once both MMA
  // warpgroups' partials are in the staging slices):
  //   1. lane 0 spins (ld.acquire.gpu) until sem[m] == turn(m, n), then a proxy fence so
  //      that our async-proxy reduce-add is ordered after the acquire;
  //   2. reduce-add every warpgroup's slice (cp.reduce.async.bulk, one group);
  //   3. wait_group.read 0: smem slices may be reused -> release them to the MMA warps;
  //   4. wait_group 0 (no .read): the adds have been *performed in global memory*;
  //      proxy fence, then red.release.gpu sem[m] += 1.
  // Step 4 is what makes the wait real: releasing after .read alone (FA3's protocol) lets
  // the next column's add overtake ours. A writer never holds a tile while it waits for
  // another (it releases before its next step), so waits chain exactly as the schedule's
  // turns say and the schedule's deadlock argument holds unchanged.
  // ---------------------------------------------------------------------------------------
  static __device__ void dq_writer(Params const& params, SharedStorage& ss, int writer) {
    auto const& sched = params.schedule;
    int const lane = threadIdx.x % 32;
    int const num_m_blocks = sched.geo.num_m_blocks();
    constexpr int kSliceFloats = Traits::kdQSliceFloats;
    constexpr uint32_t kBarThreads = 128 + 32;
    bool const tracer = params.trace != nullptr && lane == 0;  // lane 0 records in trace mode

    // The staging slices start empty: the MMA's step 0 waits on parity 1's "empty".
    if (writer == 1) {
      CUTLASS_PRAGMA_UNROLL
      for (int w = 0; w < NumMmaWarpGroups; ++w) { ptx::named_arrive(dq_empty_barrier(w, 1), kBarThreads); }
    }
    int g0 = 0;  // the CTA's steps before the current column
    for_each_column(params, ss, [&](int item) {
      ColumnCoord const col = sched.column(item);
      int const num_steps = sched.num_steps(col);
      // Q tile (b, h, m) is tile number bh * M + m of dQaccum and of the semaphores. 32-bit
      // indices, not pointers, keep this warp within its 24 registers (launch checks the range).
      int const bh = col.b * params.num_heads + col.h;
      for (int step = (g0 + writer) & 1; step < num_steps; step += 2) {  // steps with g % 2 == writer
        int const m = sched.m_block(col, step);
        int const tile = bh * num_m_blocks + m;
        // Trace mode: the record is claimed and filled as the step goes, so that no timestamp
        // stays live in a register.
        int const rec = tracer ? begin_record(params, bh, col.n, m, step) : -1;
        // Both warpgroups' partials in smem, then the tile's turn, then the reduce-adds. (In
        // this order a trace tells the wait for the MMA apart from the wait for the turn.)
        CUTLASS_PRAGMA_UNROLL
        for (int w = 0; w < NumMmaWarpGroups; ++w) { ptx::named_sync(dq_full_barrier(w, writer), kBarThreads); }
        if (rec >= 0) { params.trace[rec].t_ready = ptx::globaltimer_ns(); }
        if (params.deterministic && lane == 0) {
          int const turn = sched.turn(col, m);
          if (rec >= 0) { params.trace[rec].turn = turn; }
          while (ptx::ld_acquire_gpu(params.dq_semaphore + tile) != turn) {}
          ptx::fence_proxy_async_global();
        }
        if (rec >= 0) { params.trace[rec].t_acquired = ptx::globaltimer_ns(); }
        if (lane == 0) {
          CUTLASS_PRAGMA_UNROLL
          for (int w = 0; w < NumMmaWarpGroups; ++w) {
            ptx::bulk_reduce_add_f32(params.dq_accum + int64_t(tile) * (kBlockM * kHeadDim) + w * kSliceFloats,
                                     ss.smem_dq + w * kSliceFloats, kSliceFloats * sizeof(float));
          }
          ptx::bulk_commit_group();
          ptx::bulk_wait_group_read<0>();
        }
        __syncwarp();
        CUTLASS_PRAGMA_UNROLL
        for (int w = 0; w < NumMmaWarpGroups; ++w) { ptx::named_arrive(dq_empty_barrier(w, writer), kBarThreads); }
        if (lane == 0) {
          if (params.deterministic) {
            ptx::bulk_wait_group<0>();
            ptx::fence_proxy_async_global();
            ptx::red_release_gpu_add(params.dq_semaphore + tile, 1);
          }
          if (rec >= 0) { params.trace[rec].t_done = ptx::globaltimer_ns(); }
        }
      }
      g0 += num_steps;
    });
    if (lane == 0) { ptx::bulk_wait_group<0>(); }
  }

  // Named barriers of warpgroup w's dQ staging slice for steps of parity p (see dq_writer).
  static __device__ __forceinline__ uint32_t dq_empty_barrier(int w, int p) {
    return uint32_t(BwdBarrier::kdQEmpty0) + 2 * w + p;
  }
  static __device__ __forceinline__ uint32_t dq_full_barrier(int w, int p) {
    return uint32_t(BwdBarrier::kdQFull0) + 2 * w + p;
  }

  // Claims the next trace record and fills what is known when the writer turns to a step;
  // returns its index (-1: none).
  static __device__ __forceinline__ int begin_record(Params const& params, int bh, int n, int m, int step) {
    int const idx = atomicAdd(params.counters + kTraceCounter, 1);
    if (idx >= params.trace_capacity) { return -1; }  // cannot happen: the host sized it by the schedule
    // Read after the atomic's round trip, so that measured waits are turn waits only.
    int64_t const t_wait = ptx::globaltimer_ns();
    BwdTraceRecord& r = params.trace[idx];
    r.cta = blockIdx.x;
    r.bh = bh;
    r.n = n;
    r.m = m;
    r.step = step;
    r.t_wait = t_wait;
    return idx;
  }

  // ---------------------------------------------------------------------------------------
  // MMA warpgroups. mma_tidx in [0, NumMmaThreads).
  // ---------------------------------------------------------------------------------------
  static __device__ void mma(Params const& params, SharedStorage& ss, int mma_tidx) {
    auto const& sched = params.schedule;
    auto const& geo = sched.geo;
    int const wg = mma_tidx / 128;
    int const wg_tidx = mma_tidx % 128;

    Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.smem_do), typename Traits::SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(ss.smem_k), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.smem_v), typename Traits::SmemLayoutV{});
    Tensor sQt = make_tensor(make_smem_ptr(ss.smem_q), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(ss.smem_do), typename Traits::SmemLayoutdOt{});
    Tensor sKt = make_tensor(make_smem_ptr(ss.smem_k), typename Traits::SmemLayoutKt{});
    Tensor sdS = make_tensor(make_smem_ptr(ss.smem_ds), typename Traits::SmemLayoutdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(ss.smem_ds), typename Traits::SmemLayoutdSt{});

    typename Traits::TiledMmaSdP tiled_mma_SdP;
    typename Traits::TiledMmadKV tiled_mma_dKV;
    typename Traits::TiledMmadQ tiled_mma_dQ;
    // Operand descriptors are per warpgroup (slice by the warpgroup's first thread);
    // accumulators are per thread.
    auto wg_mma_SdP = tiled_mma_SdP.get_slice(wg * 128);
    auto wg_mma_dKV = tiled_mma_dKV.get_slice(wg * 128);
    auto wg_mma_dQ = tiled_mma_dQ.get_slice(wg * 128);
    auto thr_mma_SdP = tiled_mma_SdP.get_thread_slice(mma_tidx);
    auto thr_mma_dKV = tiled_mma_dKV.get_thread_slice(mma_tidx);
    auto thr_mma_dQ = tiled_mma_dQ.get_thread_slice(mma_tidx);

    Tensor tSrK = wg_mma_SdP.partition_fragment_A(sK);     // S^T = K Q^T
    Tensor tSrQ = wg_mma_SdP.partition_fragment_B(sQ);     // (.., stage)
    Tensor tdPrV = wg_mma_SdP.partition_fragment_A(sV);    // dP^T = V dO^T
    Tensor tdPrdO = wg_mma_SdP.partition_fragment_B(sdO);  // (.., stage)
    Tensor tdVrdOt = wg_mma_dKV.partition_fragment_B(sdOt);  // dV += P^T dO
    Tensor tdKrQt = wg_mma_dKV.partition_fragment_B(sQt);    // dK += dS^T Q
    Tensor tdQrdS = wg_mma_dQ.partition_fragment_A(sdS);     // dQ = dS K
    Tensor tdQrKt = wg_mma_dQ.partition_fragment_B(sKt);

    // Coordinates (key row, query col) of this thread's S^T accumulator values.
    Tensor tScS = thr_mma_SdP.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    Tensor tdKVcdKV = thr_mma_dKV.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

    auto smem_tiled_copy_dS = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, tiled_mma_SdP);
    auto smem_thr_copy_dS = smem_tiled_copy_dS.get_thread_slice(mma_tidx);
    Tensor tdSsdS = smem_thr_copy_dS.partition_D(as_position_independent_swizzle_tensor(sdSt));  // (.., stage)

    float4* sdQ_slice = reinterpret_cast<float4*>(ss.smem_dq + wg * Traits::kdQSliceFloats);

    StageState stage;
    int ds_stage = 0;
    int g = 0;  // this CTA's steps so far: their parity picks the dQ writer (dq_writer)
    uint32_t kv_phase = 0;
    int const seqlen_q = geo.seqlen_q, seqlen_k = geo.seqlen_k;

    for_each_column(params, ss, [&](int item) {
      ColumnCoord const col = sched.column(item);
      int const num_steps = sched.num_steps(col);

      Tensor tdKrdK = partition_fragment_C(tiled_mma_dKV, Shape<Int<kBlockN>, Int<kHeadDim>>{});
      Tensor tdVrdV = partition_fragment_C(tiled_mma_dKV, Shape<Int<kBlockN>, Int<kHeadDim>>{});
      clear(tdKrdK);
      clear(tdVrdV);

      for (int step = 0; step < num_steps; ++step) {
        int const m = sched.m_block(col, step);
        float const* sLSE = ss.smem_lse + stage.index * kBlockM;
        float const* sdPsum = ss.smem_dpsum + stage.index * kBlockM;

        // S^T = K Q_m^T and dP^T = V dO_m^T, both in flight at once.
        Tensor tSrS = partition_fragment_C(tiled_mma_SdP, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Tensor tdPrdP = partition_fragment_C(tiled_mma_SdP, Shape<Int<kBlockN>, Int<kBlockM>>{});
        ptx::mbar_wait(&ss.bar_q_full[stage.index], stage.phase);
        if (step == 0) { ptx::mbar_wait(&ss.bar_k_full, kv_phase); }
        detail::wgmma_gemm<true, false>(tiled_mma_SdP, tSrK, tSrQ(_, _, _, stage.index), tSrS);
        ptx::mbar_wait(&ss.bar_do_full[stage.index], stage.phase);
        if (step == 0) {
          ptx::mbar_wait(&ss.bar_v_full, kv_phase);
          kv_phase ^= 1;
        }
        detail::wgmma_gemm<true, false>(tiled_mma_SdP, tdPrV, tdPrdO(_, _, _, stage.index), tdPrdP);

        warpgroup_wait<1>();  // S^T ready
        if (geo.needs_mask(m, col.n)) {
          int const key0 = col.n * kBlockN, query0 = m * kBlockM;
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            int const key = key0 + get<0>(tScS(i));
            int const query = query0 + get<1>(tScS(i));
            bool const masked = key >= seqlen_k || (Traits::Is_causal && key > query + seqlen_k - seqlen_q);
            if (masked) { tSrS(i) = -INFINITY; }
          }
        }
        // P^T = exp2(S^T * scale * log2(e) - LSE_log2[query]).
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          tSrS(i) = detail::exp2_approx(fmaf(tSrS(i), params.softmax_scale_log2, -sLSE[get<1>(tScS(i))]));
        }
        warpgroup_wait<0>();  // dP^T ready
        if (step == num_steps - 1) { ptx::mbar_arrive(&ss.bar_v_empty); }  // last read of this column's V
        // dS^T = P^T * (dP^T - D[query]).
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tdPrdP); ++i) {
          tdPrdP(i) = tSrS(i) * (tdPrdP(i) - sdPsum[get<1>(tScS(i))]);
        }

        Tensor rP = detail::convert_fragment<Element>(tSrS);
        Tensor rdS = detail::convert_fragment<Element>(tdPrdP);

        // dS -> smem (A operand of the dQ GEMM, which needs rows from both warpgroups).
        // Writing buffer ds_stage is safe without a barrier: it was last read by the dQ
        // GEMM two tiles ago, which every warpgroup completed before the kdSReady
        // barrier of the previous tile.
        cute::copy(smem_tiled_copy_dS, smem_thr_copy_dS.retile_S(rdS), tdSsdS(_, _, _, ds_stage));

        // dV += P^T dO_m, P^T straight from registers.
        Tensor tdVrP = make_tensor(rP.data(), detail::acc_layout_as_A_regs(tSrS.layout()));
        detail::wgmma_gemm<false, true>(tiled_mma_dKV, tdVrP, tdVrdOt(_, _, _, stage.index), tdVrdV);

        // stmatrix writes are generic-proxy; WGMMA reads through the async proxy.
        ptx::fence_proxy_async_smem();
        ptx::named_sync(uint32_t(BwdBarrier::kdSReady), NumMmaThreads);

        Tensor tdQrdQ = partition_fragment_C(tiled_mma_dQ, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        detail::wgmma_gemm<true, false>(tiled_mma_dQ, tdQrdS(_, _, _, ds_stage), tdQrKt, tdQrdQ);
        warpgroup_wait<1>();  // dV GEMM done: dO_m no longer read
        ptx::mbar_arrive(&ss.bar_do_empty[stage.index]);

        // dK += dS^T Q_m.
        Tensor tdKrdS = make_tensor(rdS.data(), detail::acc_layout_as_A_regs(tdPrdP.layout()));
        detail::wgmma_gemm<false, true>(tiled_mma_dKV, tdKrdS, tdKrQt(_, _, _, stage.index), tdKrdK);
        warpgroup_wait<1>();  // dQ GEMM done
        if (step == num_steps - 1) { ptx::mbar_arrive(&ss.bar_k_empty); }  // last read of this column's K

        // dQ partial -> this warpgroup's staging slice, for the dQ writer of this step's
        // parity (the slice is free once the writer of the previous step has read it).
        ptx::named_sync(dq_empty_barrier(wg, (g + 1) & 1), 128 + 32);
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < Traits::kdQValuesPerThread / 4; ++j) {
          sdQ_slice[j * 128 + wg_tidx] =
              make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3));
        }
        ptx::fence_proxy_async_smem();  // the bulk reduce reads the slice through the async proxy
        ptx::named_arrive(dq_full_barrier(wg, g & 1), 128 + 32);
        ++g;

        warpgroup_wait<0>();  // dK GEMM done: Q_m no longer read
        ptx::mbar_arrive(&ss.bar_q_empty[stage.index]);
        stage.advance();
        ds_stage ^= 1;
      }

      // Epilogue: dK (scaled; dS omitted the softmax scale) and dV straight from registers.
      // Rows past seqlen_k are not stored. A column with no Q tiles stores zeros.
      store_dkv(params, col, tdKrdK, tdVrdV, tdKVcdKV, mma_tidx);
    });
  }

  // Without GQA: dK, dV of the column as Element rows. With GQA: the query heads of a KV
  // group reduce-add their fp32 dK, dV into the group's accumulators; deterministic runs add
  // in ascending query-head order, the same protocol as the dQ tiles:
  //   1. thread 0 spins (ld.acquire.gpu) until sem[b, h_kv, n] == h % group; the barrier
  //      then orders every MMA thread's adds after that acquire;
  //   2. every thread adds its fragment (red.global.add.v2.f32: generic-proxy atomics);
  //   3. barrier (all adds of the CTA issued before it), thread 0: fence.acq_rel.gpu
  //      (cumulative over the adds the barrier made visible to it) + red.release.gpu += 1,
  //      so the next head's acquire observes every add of ours: they have landed.
  // Waits point to the same column of a lower query head, which every schedule claims or
  // runs earlier (schedule.h), so they cannot deadlock.
  template <class Frag, class Coord>
  static __device__ __forceinline__ void store_dkv(Params const& params, ColumnCoord col, Frag const& tdKrdK,
                                                   Frag const& tdVrdV, Coord const& tdKVcdKV, int mma_tidx) {
    int const seqlen_k = params.schedule.geo.seqlen_k;
    int const row0 = col.n * kBlockN;
    if (params.dk_accum == nullptr) {
      Element* dk = params.dk + int64_t(col.b) * params.dk_strides.batch + int64_t(col.h) * params.dk_strides.head;
      Element* dv = params.dv + int64_t(col.b) * params.dv_strides.batch + int64_t(col.h) * params.dv_strides.head;
      store_acc_rows_16B(tdKrdK, tdKVcdKV, params.softmax_scale, dk, params.dk_strides.row, row0, seqlen_k);
      store_acc_rows_16B(tdVrdV, tdKVcdKV, 1.0f, dv, params.dv_strides.row, row0, seqlen_k);
      return;
    }
    int const h_kv = col.h / params.heads_per_kv_head;
    BSHDStrides const& st = params.dkv_accum_strides;
    int64_t const offset = int64_t(col.b) * st.batch + int64_t(h_kv) * st.head;
    int* sem = params.dkv_semaphore +
               (int64_t(col.b) * params.num_heads_k + h_kv) * params.schedule.geo.num_n_blocks() + col.n;
    if (params.deterministic) {
      if (mma_tidx == 0) {
        int const turn = col.h - h_kv * params.heads_per_kv_head;
        while (ptx::ld_acquire_gpu(sem) != turn) {}
      }
      __syncwarp();  // reconverge before the aligned bar.sync
      ptx::named_sync(uint32_t(BwdBarrier::kdKVOrder), NumMmaThreads);
    }
    red_add_acc_rows_f32(tdKrdK, tdKVcdKV, params.softmax_scale, params.dk_accum + offset, st.row, row0, seqlen_k);
    red_add_acc_rows_f32(tdVrdV, tdKVcdKV, 1.0f, params.dv_accum + offset, st.row, row0, seqlen_k);
    if (params.deterministic) {
      ptx::named_sync(uint32_t(BwdBarrier::kdKVOrder), NumMmaThreads);
      if (mma_tidx == 0) {
        ptx::fence_acq_rel_gpu();
        ptx::red_release_gpu_add(sem, 1);
      }
    }
  }
};

template <class Traits, class Schedule>
__global__ void __launch_bounds__(Traits::NumThreads, 1)
    bwd_main_kernel(CUTE_GRID_CONSTANT typename Traits::template MainParams<Schedule> const params) {
  PersistentShell<BwdMainKernel<Traits, Schedule>>::run(params);
}

}  // namespace dash
