// The Hopper attention-backward main kernel: persistent, warp-specialised.
//
//   warpgroup 0, warp 0 : producer. TMA loads of K, V (once per column), Q + LSE and
//                         dO + D (per Q tile) into multi-stage mbarrier pipelines.
//   warpgroup 0, warps 1-2: dQ writers (alternating steps). Reduce-add each dQ partial from
//                         smem into the fp32 dQaccum with cp.reduce.async.bulk, in the
//                         schedule's order when deterministic (BwdEpilogue::dq_writer,
//                         kernels/bwd_epilogue.h).
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

#include "kernels/bwd_epilogue.h"
#include "kernels/bwd_traits.h"
#include "kernels/mma_utils.h"
#include "kernels/persistent_shell.h"
#include "kernels/ptx.h"

namespace dash {

using namespace cute;

// kLseEarly: load a step's LSE into registers before its S^T GEMM is issued, instead of
// reading it from shared memory in the exponential loop after the S^T wait. Measured on the
// H200 (docs/kernel-notes.md, sixteenth to eighteenth passes) it ran 0.6-1.9 % faster without
// determinism, and with determinism 1.6-4.6 % slower behind one dQ staging buffer but faster
// behind two; the config table says per mode where it runs (BwdTileConfig.lse_early_nondet,
// lse_early_det).
template <class Traits, class Schedule, bool kLseEarly = false>
struct BwdMainKernel {
  static_assert(!kLseEarly || Traits::kBlockM == 64, "the LSE registers spill with this tile");
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
  using Epilogue = BwdEpilogue<Traits, Schedule>;  // dQ writers, dK/dV store (bwd_epilogue.h)

  // ---------------------------------------------------------------------------------------
  // Shell hooks (kernels/persistent_shell.h): one-time setup and the producer warpgroup's
  // other warps.
  // ---------------------------------------------------------------------------------------
  static constexpr int kClusterSize = 1;
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
    if (warp == 1 || warp == 2) { Epilogue::dq_writer(params, ss, warp - 1); }
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
    // Varlen: the claims run over the live columns only (those inside their sequence's keys),
    // in claim order. A batch of short sequences beside a long one pads the grid with columns
    // past the short ones' keys, each of which cost a claim and a pass through the work ring
    // (one sequence of 8k beside 60 of 64-512 tokens: 94 % of the columns). The live ones keep
    // their order, so a wait still points to an item claimed earlier (schedule.h).
    int num_live = 0;
    if constexpr (Traits::kVarlen) { num_live = params.live_columns[num_columns]; }
    auto live_item = [&](int claim) {
      return claim < num_live ? params.live_columns[claim] : num_columns;  // num_columns: no more work
    };
    int item;
    if constexpr (Traits::kVarlen) {
      item = live_item(int(blockIdx.x));
    } else {
      item = sched.item(blockIdx.x, 0);
    }
    for (int k = 0;; ++k) {
      if (item >= num_columns) {
        if constexpr (Schedule::kClaimed) { ss.work.publish(k, ScheduledColumn{item}); }
        break;
      }
      ColumnCoord const col = sched.column(item);
      if constexpr (Schedule::kClaimed) {
        ss.work.publish(k, ScheduledColumn{item, col.n, col.h, col.b});
      }

      SeqPlace const seq = Epilogue::seq_of(params, col);
      auto&& csched = Epilogue::column_schedule(params, seq);
      int const num_steps = Epilogue::column_steps(csched, col);
      if (num_steps > 0) {
        load_column(params, ss, col, seq, csched, num_steps, stage, kv_phase, tQsQ, tdOsdO, tKsK, tVsV, mQ_all,
                    mdO_all, mK_all, mV_all, tma_q, tma_do, tma_k, tma_v);
      }
      if constexpr (Schedule::kClaimed) {
        // Items are claimed in increasing order (the deadlock-freedom argument in
        // schedule.h); the first gridDim.x items are the CTAs' first columns.
        if constexpr (Traits::kVarlen) {
          item = live_item(int(gridDim.x) + atomicAdd(params.counters + kWorkCounter, 1));
        } else {
          item = int(gridDim.x) + atomicAdd(params.counters + kWorkCounter, 1);
        }
      } else {
        item = sched.item(blockIdx.x, k + 1);
      }
    }
  }

  // `seq`, `csched`: the column's sequence (varlen) and the schedule that walks it
  // (Epilogue::column_schedule).
  template <class ColumnSchedule, class TQs, class TdOs, class TKs, class TVs, class MQ, class MdO, class MK,
            class MV, class TmaQ, class TmadO, class TmaK, class TmaV>
  static __device__ __forceinline__ void load_column(Params const& params, SharedStorage& ss, ColumnCoord col,
                                                     SeqPlace const& seq, ColumnSchedule const& csched,
                                                     int num_steps, StageState& stage, uint32_t& kv_phase,
                                                     TQs& tQsQ, TdOs& tdOsdO, TKs& tKsK, TVs& tVsV, MQ const& mQ_all,
                                                     MdO const& mdO_all, MK const& mK_all, MV const& mV_all,
                                                     TmaQ const& tma_q, TmadO const& tma_do, TmaK const& tma_k,
                                                     TmaV const& tma_v) {
    int const h_kv = col.h / params.heads_per_kv_head;
    // The rows of the column's batch entry: varlen, its sequence's, from its first row of the
    // packed tensors (a tile's rows past the sequence are the next one's, or TMA's zero fill:
    // their P is 0, masked keys or an LSE of +inf, see the preprocess).
    auto rows = [&](auto const& m_all, int head, int first_row) {
      if constexpr (Traits::kVarlen) {
        return domain_offset(make_coord(first_row, _0{}), m_all(_, _, head, _0{}));
      } else {
        return m_all(_, _, head, col.b);
      }
    };
    Tensor gQ = local_tile(rows(mQ_all, col.h, seq.row_q), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gdO =
        local_tile(rows(mdO_all, col.h, seq.row_q), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gK =
        local_tile(rows(mK_all, h_kv, seq.row_k), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(col.n, _0{}));
    Tensor gV =
        local_tile(rows(mV_all, h_kv, seq.row_k), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(col.n, _0{}));
    Tensor tQgQ = tma_q.partition_S(gQ);      // (TMA, 1, 1, m)
    Tensor tdOgdO = tma_do.partition_S(gdO);  // (TMA, 1, 1, m)
    Tensor tKgK = tma_k.partition_S(gK);
    Tensor tVgV = tma_v.partition_S(gV);
    // The column's LSE / D rows: row (b, h) of the padded workspace, or varlen head h's rows
    // from its sequence's first tile (kernels/varlen.h).
    int64_t const stats_offset =
        Traits::kVarlen
            ? int64_t(col.h) * params.stats_bh_stride + int64_t(varlen_first_tile(seq.row_q, col.b, kBlockM)) * kBlockM
            : (int64_t(col.b) * params.num_heads + col.h) * params.stats_bh_stride;
    float const* lse_bh = params.lse_log2 + stats_offset;
    float const* dpsum_bh = params.dpsum + stats_offset;

    for (int step = 0; step < num_steps; ++step) {
      int const m = csched.m_block(col, step);
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
  // MMA warpgroups. mma_tidx in [0, NumMmaThreads).
  // ---------------------------------------------------------------------------------------
  static __device__ void mma(Params const& params, SharedStorage& ss, int mma_tidx) {
    auto const& sched = params.schedule;
    // The warpgroup index is warp-uniform, but the compiler cannot see that in mma_tidx / 128;
    // through a shuffle from lane 0 it keeps the warpgroup's WGMMA descriptors in uniform
    // registers instead of moving them there (R2UR) before every HGMMA (ncu, hdim 64: 32 R2UR
    // per warp and step). Measured (kernel notes, seventh pass): claimed schedules hdim 64
    // +1.5-3 %, hdim 128 +0-2.5 %; the shift kernel lost 4-6 % at hdim 64 full, so it keeps
    // the plain division.
    int const wg = Schedule::kClaimed ? __shfl_sync(0xffffffff, mma_tidx / 128, 0) : mma_tidx / 128;
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
    // dQ = dS K, or dQ^T = K^T dS^T (Traits::dQ_transposed: the operands swap sides, over
    // the same shared-memory bytes).
    Tensor tdQrdS = [&] {
      if constexpr (Traits::dQ_transposed) { return wg_mma_dQ.partition_fragment_B(sdS); }
      else { return wg_mma_dQ.partition_fragment_A(sdS); }
    }();
    Tensor tdQrKt = [&] {
      if constexpr (Traits::dQ_transposed) { return wg_mma_dQ.partition_fragment_A(sKt); }
      else { return wg_mma_dQ.partition_fragment_B(sKt); }
    }();

    // Coordinates (key row, query col) of this thread's S^T accumulator values.
    Tensor tScS = thr_mma_SdP.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));

    auto smem_tiled_copy_dS = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, tiled_mma_SdP);
    auto smem_thr_copy_dS = smem_tiled_copy_dS.get_thread_slice(mma_tidx);
    Tensor tdSsdS = smem_thr_copy_dS.partition_D(as_position_independent_swizzle_tensor(sdSt));  // (.., stage)

    StageState stage;
    int ds_stage = 0;
    int g = 0;  // this CTA's steps so far: their parity picks the dQ writer (Epilogue::dq_writer)
    uint32_t kv_phase = 0;
    auto const& problem_geo = sched.geo;
    int const seqlen_q = problem_geo.seqlen_q, seqlen_k = problem_geo.seqlen_k;

    for_each_scheduled_column(params.schedule, ss.work, [&](ColumnCoord const& col) {
      SeqPlace const seq = Epilogue::seq_of(params, col);
      auto&& csched = Epilogue::column_schedule(params, seq);
      // The column's geometry and lengths: the problem's (taken outside the column loop; taken
      // per column, ptxas scheduled the padded kernels' step loops differently) or, varlen, its
      // sequence's.
      auto const& geo = Traits::kVarlen ? csched.geo : problem_geo;
      int const num_steps = Epilogue::column_steps(csched, col);

      Tensor tdKrdK = partition_fragment_C(tiled_mma_dKV, Shape<Int<kBlockN>, Int<kHeadDim>>{});
      Tensor tdVrdV = partition_fragment_C(tiled_mma_dKV, Shape<Int<kBlockN>, Int<kHeadDim>>{});
      clear(tdKrdK);
      clear(tdVrdV);

      for (int step = 0; step < num_steps; ++step) {
        int const m = csched.m_block(col, step);
        float const* sLSE = ss.smem_lse + stage.index * kBlockM;
        float const* sdPsum = ss.smem_dpsum + stage.index * kBlockM;

        // S^T = K Q_m^T and dP^T = V dO_m^T, both in flight at once.
        Tensor tSrS = partition_fragment_C(tiled_mma_SdP, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Tensor tdPrdP = partition_fragment_C(tiled_mma_SdP, Shape<Int<kBlockN>, Int<kBlockM>>{});
        ptx::mbar_wait(&ss.bar_q_full[stage.index], stage.phase);
        // kLseEarly: the shared-memory latency of these loads (hundreds of cycles while both
        // warpgroups' GEMMs read shared memory) then runs under the S^T and dP^T GEMMs
        // instead of after the S^T wait, where the exponentials' first FFMAs waited on it
        // (ncu, sixteenth pass). They cannot move above the wait: mbar_wait is an asm
        // statement with a memory clobber.
        constexpr int kSValues = decltype(size(tSrS))::value;
        float lse_of[kLseEarly ? kSValues : 1];
        if constexpr (kLseEarly) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < kSValues; ++i) { lse_of[i] = sLSE[get<1>(tScS(i))]; }
        }
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
            int const sk = Traits::kVarlen ? seq.seqlen_k : seqlen_k, sq = Traits::kVarlen ? seq.seqlen_q : seqlen_q;
            bool const masked = key >= sk || (Traits::Is_causal && key > query + sk - sq);
            if (masked) { tSrS(i) = -INFINITY; }
          }
        }
        // P^T = exp2(S^T * scale * log2(e) - LSE_log2[query]), every kExp2FmaEvery-th on the FMA pipe.
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          tSrS(i) = detail::exp2_split<Traits::kExp2FmaEvery>(
              fmaf(tSrS(i), params.softmax_scale_log2, -(kLseEarly ? lse_of[i] : sLSE[get<1>(tScS(i))])), i);
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

        Tensor tdQrdQ = partition_fragment_C(tiled_mma_dQ, typename Traits::TileShapedQAcc{});
        if constexpr (Traits::dQ_transposed) {
          detail::wgmma_gemm<true, false>(tiled_mma_dQ, tdQrKt, tdQrdS(_, _, _, ds_stage), tdQrdQ);
        } else {
          detail::wgmma_gemm<true, false>(tiled_mma_dQ, tdQrdS(_, _, _, ds_stage), tdQrKt, tdQrdQ);
        }
        warpgroup_wait<1>();  // dV GEMM done: dO_m no longer read
        ptx::mbar_arrive(&ss.bar_do_empty[stage.index]);

        // dK += dS^T Q_m.
        Tensor tdKrdS = make_tensor(rdS.data(), detail::acc_layout_as_A_regs(tdPrdP.layout()));
        detail::wgmma_gemm<false, true>(tiled_mma_dKV, tdKrdS, tdKrQt(_, _, _, stage.index), tdKrdK);
        warpgroup_wait<1>();  // dQ GEMM done
        if (step == num_steps - 1) { ptx::mbar_arrive(&ss.bar_k_empty); }  // last read of this column's K

        // dQ partial -> this warpgroup's slice of staging buffer g % kStagesdQ, for the dQ
        // writer of this step's parity. The buffer is free once the writer of step
        // g - kStagesdQ has read it: with two buffers the MMA can run a whole step ahead of
        // a writer that waits for its tile's turn, instead of stalling here.
        ptx::named_sync(Epilogue::dq_empty_barrier(wg, (g + Traits::kStagesdQ) & 1), 128 + 32);
        float4* sdQ_slice = reinterpret_cast<float4*>(ss.smem_dq + Epilogue::dq_slice_offset(g, wg));
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < Traits::kdQValuesPerThread / 4; ++j) {
          sdQ_slice[j * 128 + wg_tidx] =
              make_float4(tdQrdQ(4 * j), tdQrdQ(4 * j + 1), tdQrdQ(4 * j + 2), tdQrdQ(4 * j + 3));
        }
        ptx::fence_proxy_async_smem();  // the bulk reduce reads the slice through the async proxy
        ptx::named_arrive(Epilogue::dq_full_barrier(wg, g & 1), 128 + 32);
        ++g;

        warpgroup_wait<0>();  // dK GEMM done: Q_m no longer read
        ptx::mbar_arrive(&ss.bar_q_empty[stage.index]);
        stage.advance();
        ds_stage ^= 1;
      }

      // Epilogue: dK (scaled; dS omitted the softmax scale) and dV straight from registers.
      // Rows past seqlen_k are not stored. A column with no Q tiles stores zeros.
      Epilogue::store_dkv(params, col, seq, tdKrdK, tdVrdV, mma_tidx);
    });
  }
};

template <class Traits, class Schedule, bool kLseEarly>
__global__ void __launch_bounds__(Traits::NumThreads, 1)
    bwd_main_kernel(CUTE_GRID_CONSTANT typename Traits::template MainParams<Schedule> const params) {
  // Every CTA is resident from the start (cooperative launch), so the dQ convert grid queued
  // behind this one may launch now: its CTAs take SMs only as this grid's CTAs exit, and
  // never hold one this grid needs (bwd_launch.h, convert_under_main).
  ptx::launch_dependents();
  PersistentShell<BwdMainKernel<Traits, Schedule, kLseEarly>>::run(params);
}

}  // namespace dash
