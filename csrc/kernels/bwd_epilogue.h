// The backward's epilogue collective: what leaves the CTA. dQ partials, staged in shared
// memory by the MMA warpgroups at every step, are reduce-added into the fp32 dQaccum by two
// writer warps of the producer warpgroup (in the schedule's order when deterministic); dK
// and dV, kept in the MMA warpgroups' registers for a column's life, are stored (or, under
// GQA, reduce-added in query-head order) when the column ends. The mainloop
// (bwd_main_kernel.h) hands dQ partials over through the named barriers below.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/acc_store.h"
#include "kernels/bwd_traits.h"
#include "kernels/ptx.h"
#include "kernels/work_ring.h"
#include "schedule/schedule.h"

namespace dash {

using namespace cute;

template <class Traits, class Schedule>
struct BwdEpilogue {
  using Element = typename Traits::Element;
  using Params = typename Traits::template MainParams<Schedule>;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int NumMmaThreads = Traits::NumMmaThreads;
  static constexpr int NumMmaWarpGroups = Traits::NumMmaWarpGroups;
  static constexpr bool kVarlen = Traits::kVarlen;

  // ---------------------------------------------------------------------------------------
  // Varlen (kernels/varlen.h): every role (producer, MMA warpgroups, dQ writers) reads the
  // place of its column's sequence and walks the column by the schedule with that sequence's
  // lengths. Turns and visits then come from the same formulas on a smaller geometry, so each
  // Q tile (b, h, m) receives exactly the columns [0, n_end(m)) of its own sequence, in the
  // schedule's order; the padded columns past the sequence's keys visit nothing. Every wait
  // still points to a column of the same head that precedes the waiting one in the (padded)
  // item order, so schedule.h's deadlock argument holds unchanged.
  // ---------------------------------------------------------------------------------------
  static __device__ __forceinline__ SeqPlace seq_of(Params const& params, ColumnCoord const& col) {
    if constexpr (kVarlen) {
      return load_seq_place_within(params.cu_seqlens_q, params.cu_seqlens_k, col.b, params.schedule.geo.seqlen_q,
                                   params.schedule.geo.seqlen_k);
    } else {
      return SeqPlace{};
    }
  }
  // The schedule that walks a column: the problem's (a reference into the parameters) or,
  // varlen, the same with the column's sequence lengths.
  static __device__ __forceinline__ decltype(auto) column_schedule(Params const& params, SeqPlace const& seq) {
    if constexpr (kVarlen) {
      auto sched = params.schedule;
      sched.geo = with_lengths(sched.geo, seq);
      return sched;
    } else {
      return (params.schedule);
    }
  }
  // Q tiles a column visits (`sched`: its column_schedule); varlen: none past its keys.
  template <class ColumnSchedule>
  static __device__ __forceinline__ int column_steps(ColumnSchedule const& sched, ColumnCoord const& col) {
    if constexpr (kVarlen) {
      return col.n * kBlockN < sched.geo.seqlen_k ? sched.num_steps(col) : 0;
    } else {
      return sched.num_steps(col);
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
  // the hand-off took longer than a step: hdim 128, 64x128 tiles). With two staging
  // buffers (kStagesdQ == 2) each writer owns one: step g's partial goes to buffer g % 2,
  // which the writer of step g - 2 freed, so a writer waiting for its tile's turn stalls
  // the MMA warpgroups only once it is a whole step late (with one buffer, any wait did:
  // step g + 1's store needed step g's slice read, i.e. step g's turn acquired).
  //
  // Deterministic protocol for the contribution of column n to Q tile m (once both MMA
  // warpgroups' partials are in the staging slices). With t = turn(m, n), the contribution
  // goes to chain c = t % kdQChains of the tile (its own fp32 copy and semaphore) as its
  // r = t / kdQChains-th add (config.py: dq_chains); the convert kernel sums the chains in
  // index order:
  //   1. lane 0 spins (ld.acquire.gpu) until sem[c][m] == r, then a proxy fence so
  //      that our async-proxy reduce-add is ordered after the acquire;
  //   2. reduce-add every warpgroup's slice (cp.reduce.async.bulk, one bulk group per
  //      slice), or, with several chains, for r == 0 store it (cp.async.bulk): their
  //      dQaccum is not zeroed;
  //   3. wait_group.read 1, release slice 0 to warpgroup 0; wait_group.read 0, release
  //      slice 1: each slice may be reused once its own copy has read it;
  //   4. wait_group 0 (no .read): the adds have been *performed in global memory*;
  //      proxy fence, then red.release.gpu sem[c][m] += 1.
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
    // Lane 0 records in trace mode (never with varlen, whose launch refuses a trace: compiled
    // out there, it leaves the writer the registers the sequence's lengths take).
    bool const tracer = !kVarlen && params.trace != nullptr && lane == 0;

    // The staging buffers start empty. Step g waits on "empty" of parity (g + kStagesdQ) & 1
    // (the writer of step g - kStagesdQ), so the first kStagesdQ steps wait on arrivals
    // made here: parity 1 for step 0 with one buffer, both parities with two.
    if (writer >= 2 - Traits::kStagesdQ) {
      CUTLASS_PRAGMA_UNROLL
      for (int w = 0; w < NumMmaWarpGroups; ++w) { ptx::named_arrive(dq_empty_barrier(w, writer), kBarThreads); }
    }
    int g0 = 0;  // the CTA's steps before the current column
    for_each_scheduled_column(params.schedule, ss.work, [&](ColumnCoord const& col) {
      SeqPlace const seq = seq_of(params, col);
      auto&& csched = column_schedule(params, seq);
      int const num_steps = column_steps(csched, col);
      // Q tile (b, h, m) is tile number bh * M + m of dQaccum and of the semaphores, or varlen
      // h * (tiles per head) + (the sequence's first tile) + m (kernels/varlen.h; the tiles per
      // head read from the parameters' constant bank). 32-bit indices, not pointers, keep this
      // warp within its 24 registers (launch checks the range).
      int const bh = col.b * params.num_heads + col.h;
      int const varlen_tile0 =
          kVarlen ? col.h * params.dq_tiles_per_head + varlen_first_tile(seq.row_q, col.b, kBlockM) : 0;
      for (int step = (g0 + writer) & 1; step < num_steps; step += 2) {  // steps with g % 2 == writer
        int const m = csched.m_block(col, step);
        int const tile = kVarlen ? varlen_tile0 + m : bh * num_m_blocks + m;
        // Trace mode: the record is claimed and filled as the step goes, so that no timestamp
        // stays live in a register.
        int const rec = tracer ? begin_record(params, bh, col.n, m, step) : -1;
        // Both warpgroups' partials in smem, then the tile's turn, then the reduce-adds. (In
        // this order a trace tells the wait for the MMA apart from the wait for the turn.)
        CUTLASS_PRAGMA_UNROLL
        for (int w = 0; w < NumMmaWarpGroups; ++w) { ptx::named_sync(dq_full_barrier(w, writer), kBarThreads); }
        if (rec >= 0) { params.trace[rec].t_ready = ptx::globaltimer_ns(); }
        int slot = tile;     // the dQaccum tile and semaphore this step adds into
        bool store = false;  // the first add of a chain stores (kdQChains > 1: nothing zeroed it)
        if (params.deterministic && lane == 0) {
          int const turn = csched.turn(col, m);
          if (rec >= 0) { params.trace[rec].turn = turn; }
          int const rank = turn / Traits::kdQChains;  // position in the chain of turn % kdQChains
          slot = (turn % Traits::kdQChains) * params.dq_chain_tiles + tile;
          // With one chain the preprocess zeroes dQaccum and every contribution adds: a bulk
          // store as the first add measured 2-3 % slower there (full masks, docs/kernel-notes.md).
          store = Traits::kdQChains > 1 && rank == 0;
          while (ptx::ld_acquire_gpu(params.dq_semaphore + slot) != rank) {}
          ptx::fence_proxy_async_global();
        }
        if (rec >= 0) { params.trace[rec].t_acquired = ptx::globaltimer_ns(); }
        if (lane == 0) {
          float* const dst = params.dq_accum + int64_t(slot) * (kBlockM * kHeadDim);
          CUTLASS_PRAGMA_UNROLL
          for (int w = 0; w < NumMmaWarpGroups; ++w) {
            float const* const src = ss.smem_dq + dq_slice_offset(g0 + step, w);
            if (store) {
              ptx::bulk_store(dst + w * kSliceFloats, src, kSliceFloats * sizeof(float));
            } else {
              ptx::bulk_reduce_add_f32(dst + w * kSliceFloats, src, kSliceFloats * sizeof(float));
            }
            ptx::bulk_commit_group();  // one group per slice, so that each is freed once read
          }
        }
        // Warpgroup 0's slice is freed as soon as its own copy has read it, before warpgroup
        // 1's (FA3's order), so warpgroup 0 stores its next partial while slice 1 is still
        // being read. Deterministic hdim 128 +1-5 %, non-deterministic unchanged (kernel
        // notes, tenth pass).
        static_assert(NumMmaWarpGroups == 2, "the staged release below names the two slices");
        if (lane == 0) { ptx::bulk_wait_group_read<1>(); }
        __syncwarp();
        ptx::named_arrive(dq_empty_barrier(0, writer), kBarThreads);
        if (lane == 0) { ptx::bulk_wait_group_read<0>(); }
        __syncwarp();
        ptx::named_arrive(dq_empty_barrier(1, writer), kBarThreads);
        if (lane == 0) {
          if (params.deterministic) {
            ptx::bulk_wait_group<0>();
            ptx::fence_proxy_async_global();
            ptx::red_release_gpu_add(params.dq_semaphore + slot, 1);
          }
          if (rec >= 0) { params.trace[rec].t_done = ptx::globaltimer_ns(); }
        }
      }
      g0 += num_steps;
    });
    if (lane == 0) { ptx::bulk_wait_group<0>(); }
  }

  // Where warpgroup w's slice of step g's staging buffer starts in smem_dq (floats).
  static __device__ __forceinline__ int dq_slice_offset(int g, int w) {
    int const buffer = Traits::kStagesdQ == 2 ? (g & 1) : 0;
    return (buffer * NumMmaWarpGroups + w) * Traits::kdQSliceFloats;
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

  // Without GQA: dK, dV of the column as Element rows. With GQA the G query heads of a KV
  // group sum their dK, dV in fp32 (each query head j = h mod G contributes once per column):
  //
  // Unordered (non-deterministic groups of more than the config's kNondetdKVChainsMaxGroup
  // heads): every head adds into one zeroed accumulator (red.global.add.v2.f32), which the
  // caller casts afterwards.
  //
  // Ordered (deterministic, and smaller non-deterministic groups, where the chains beat the
  // zero-fill and casts: bwd_params.h dkv_ordered_for): heads 0 ... G - 2 accumulate in
  // C = dkv_chains independent chains (fp32 copies of the group's dK / dV, config.py
  // dkv_chains), head j as add r = j / C of chain c = j % C; the last head, G - 1, waits for
  // every chain to be complete, adds the chains to its own dK / dV in index order and writes
  // the Element outputs: no cast afterwards and no zeroed accumulator (the first add of a
  // chain stores). The sum is the same for every grid and schedule: ((head G - 1 + chain 0) +
  // chain 1) + ..., each chain summed in head order.
  // Per chain, the same protocol as the dQ tiles:
  //   1. r > 0: thread 0 spins (ld.acquire.gpu) until sem[column][c] == r; the barrier then
  //      orders every MMA thread's adds after that acquire (r == 0 stores and waits for nothing);
  //   2. every thread stores or adds its fragment (generic proxy);
  //   3. barrier (all writes of the CTA issued before it), thread 0: fence.acq_rel.gpu
  //      (cumulative over the writes the barrier made visible to it) + red.release.gpu += 1,
  //      so the next acquirer of the chain observes every write of ours: they have landed.
  // The last head acquires each chain's final count (the number of heads j < G - 1 with
  // j mod C == c) the same way before it reads the chains.
  // Waits point to the same column of a lower query head, which every schedule claims or
  // runs earlier (schedule.h), so they cannot deadlock. That holds for the non-deterministic
  // claim orders too: they differ from the deterministic ones only in which column a column
  // rank is (longest first), and the heads of a group keep their order within every rank
  // (head_slots, claim_rank in dash/schedules/orders.py; the kernel's own non-deterministic
  // orders: tests/test_kernel_schedule_matches_model.py).
  // `seq`: the column's sequence (varlen; rows offset by its first key row, clipped at its
  // length). The fragments are consumed (the last head adds the chains into them).
  template <class Frag>
  static __device__ __forceinline__ void store_dkv(Params const& params, ColumnCoord col, SeqPlace const& seq,
                                                   Frag& tdKrdK, Frag& tdVrdV, int mma_tidx) {
    // The fragments' (key, dim) coordinates, derived from an opaque thread index: hoisted out
    // of the persistent loop, the dK/dV writes' addresses held registers through the mainloop
    // and it spilled. Except in the hdim-64 `shift` kernel, which spilled with the recomputation
    // and not without it. (ptxas -v of every variant, kernel notes, thirty-fifth pass;
    // tools/check_kernels.py keeps watch.)
    constexpr bool kOpaqueCoords = !(kHeadDim == 64 && !Schedule::kClaimed);
    int const coord_tidx = kOpaqueCoords ? ptx::opaque(mma_tidx) : mma_tidx;
    Tensor const tdKVcdKV = typename Traits::TiledMmadKV{}.get_thread_slice(coord_tidx).partition_C(
        make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    int const seqlen_k = kVarlen ? seq.seqlen_k : params.schedule.geo.seqlen_k;
    int const row0 = col.n * kBlockN;
    // The first key row of the column's batch entry: b * batch stride, or varlen the
    // sequence's first row (batch strides unused).
    auto batch_offset = [&](BSHDStrides const& st) {
      return kVarlen ? int64_t(seq.row_k) * st.row : int64_t(col.b) * st.batch;
    };
    // Without GQA the outputs take the fragments (dK times the softmax scale) as they are.
    int out_head = col.h;
    float dk_scale = params.softmax_scale;
    if (params.dk_accum != nullptr) {
      int const group = params.heads_per_kv_head;
      int const h_kv = col.h / group;
      BSHDStrides const& st = params.dkv_accum_strides;
      int64_t const offset = batch_offset(st) + int64_t(h_kv) * st.head;
      float* const dk_sum = params.dk_accum + offset;
      float* const dv_sum = params.dv_accum + offset;
      if (!params.dkv_ordered) {
        write_acc_rows_f32(tdKrdK, tdKVcdKV, params.softmax_scale, dk_sum, st.row, row0, seqlen_k, /*store=*/false);
        write_acc_rows_f32(tdVrdV, tdKVcdKV, 1.0f, dv_sum, st.row, row0, seqlen_k, /*store=*/false);
        return;
      }
      int const chains = params.dkv_chains;
      int const j = col.h - h_kv * group;
      int* const sem =
          params.dkv_semaphore +
          ((int64_t(col.b) * params.num_heads_k + h_kv) * params.schedule.geo.num_n_blocks() + col.n) * chains;
      if (j < group - 1) {
        int const c = j % chains, rank = j / chains;
        if (rank > 0) {
          if (mma_tidx == 0) {
            while (ptx::ld_acquire_gpu(sem + c) != rank) {}
          }
          __syncwarp();  // reconverge before the aligned bar.sync
          ptx::named_sync(uint32_t(BwdBarrier::kdKVOrder), NumMmaThreads);
        }
        int64_t const chain_offset = c * params.dkv_chain_stride;
        write_acc_rows_f32(tdKrdK, tdKVcdKV, params.softmax_scale, dk_sum + chain_offset, st.row, row0, seqlen_k,
                           /*store=*/rank == 0);
        write_acc_rows_f32(tdVrdV, tdKVcdKV, 1.0f, dv_sum + chain_offset, st.row, row0, seqlen_k,
                           /*store=*/rank == 0);
        ptx::named_sync(uint32_t(BwdBarrier::kdKVOrder), NumMmaThreads);
        if (mma_tidx == 0) {
          ptx::fence_acq_rel_gpu();
          ptx::red_release_gpu_add(sem + c, 1);
        }
        return;
      }
      // The group's last head: every chain complete, then the total into the fragments.
      if (mma_tidx == 0) {
        for (int c = 0; c < chains; ++c) {
          int const adds = (group - 1 - c + chains - 1) / chains;  // heads j < G - 1 with j % C == c
          while (ptx::ld_acquire_gpu(sem + c) != adds) {}
        }
      }
      __syncwarp();  // reconverge before the aligned bar.sync
      ptx::named_sync(uint32_t(BwdBarrier::kdKVOrder), NumMmaThreads);
      add_acc_copies_f32(tdKrdK, tdKVcdKV, params.softmax_scale, dk_sum, st.row, params.dkv_chain_stride, chains, row0,
                         seqlen_k);
      add_acc_copies_f32(tdVrdV, tdKVcdKV, 1.0f, dv_sum, st.row, params.dkv_chain_stride, chains, row0, seqlen_k);
      out_head = h_kv;
      dk_scale = 1.0f;  // the fragments hold the scaled sums (x * 1.0f is exact)
    }
    Element* dk = params.dk + batch_offset(params.dk_strides) + int64_t(out_head) * params.dk_strides.head;
    Element* dv = params.dv + batch_offset(params.dv_strides) + int64_t(out_head) * params.dv_strides.head;
    store_acc_rows_16B(tdKrdK, tdKVcdKV, dk_scale, dk, params.dk_strides.row, row0, seqlen_k);
    store_acc_rows_16B(tdVrdV, tdKVcdKV, 1.0f, dv, params.dv_strides.row, row0, seqlen_k);
  }
};

}  // namespace dash
