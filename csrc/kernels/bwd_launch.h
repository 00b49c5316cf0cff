// Host launch of one backward: preprocess -> persistent main kernel -> dQ convert, all on
// the caller's stream. Instantiated once per (head dim, element type) translation unit.
//
// Every check of the problem runs before the first launch, and none is an assert (the build
// defines NDEBUG): a problem the kernels cannot run raises std::invalid_argument naming what
// was asked and what is supported. One check only the launch itself can make: whether the
// cooperative main kernel's grid fits on the SMs other work leaves free (MPS, green contexts);
// when it does not, the preprocess has already been queued (harmless: its outputs are
// workspace) and std::runtime_error suggests a larger sm_margin.
#pragma once

#include <climits>
#include <mutex>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "kernels/bwd_main_kernel.h"
#include "kernels/bwd_prepost_kernels.h"

namespace dash {

// Shared by the forward and backward launch code (fwd_launch.h includes this header).
inline void check_cuda(cudaError_t err, char const* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("DASH: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

// The TMA descriptors need 16-byte aligned base addresses and strides, and strides below
// 2^40 bytes (cuTensorMapEncodeTiled's limits; CuTe reports a refused descriptor only by an
// assert, which -DNDEBUG removes, so a bad one must never reach it). A stride of a dim of
// extent 1 is never multiplied by a non-zero index, so it is replaced by the contiguous one
// (which is aligned) instead of being rejected.
inline BSHDStrides checked_tma_strides(char const* name, void const* ptr, BSHDStrides s, int seqlen, int heads,
                                       int batch, int head_dim, int elem_bytes,
                                       char const* who = "DASH backward") {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
    throw std::invalid_argument(std::string(who) + ": " + name + " is not 16-byte aligned (TMA needs it)");
  }
  BSHDStrides out = s;
  struct Dim { char const* what; int extent; int64_t* stride; int64_t contiguous; };
  Dim const dims[3] = {{"seqlen", seqlen, &out.row, int64_t(heads) * head_dim},
                       {"heads", heads, &out.head, int64_t(head_dim)},
                       {"batch", batch, &out.batch, int64_t(seqlen) * heads * head_dim}};
  for (Dim const& d : dims) {
    if (d.extent == 1) {
      *d.stride = d.contiguous;
    } else if ((*d.stride * elem_bytes) % 16 != 0) {
      throw std::invalid_argument(std::string(who) + ": " + name + " has stride " + std::to_string(*d.stride) +
                                  " in its " + d.what + " dim, not a multiple of 16 bytes (TMA needs it)");
    } else if (*d.stride < 0 || *d.stride * elem_bytes >= (int64_t(1) << 40)) {
      throw std::invalid_argument(std::string(who) + ": " + name + " has stride " + std::to_string(*d.stride) +
                                  " in its " + d.what + " dim; TMA needs 0 <= stride < 2^40 bytes");
    }
  }
  return out;
}

// The cudaLaunchKernelEx configuration of a 1-D block with one launch attribute (cooperative,
// cluster dimension, programmatic stream serialisation). `attr` must outlive the returned
// configuration, which points at it.
inline cudaLaunchConfig_t one_attribute_launch_config(cudaLaunchAttribute const* attr, dim3 grid, int block_threads,
                                                      int smem_bytes, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(block_threads), 1, 1);
  cfg.dynamicSmemBytes = size_t(smem_bytes);
  cfg.stream = stream;
  cfg.attrs = const_cast<cudaLaunchAttribute*>(attr);
  cfg.numAttrs = 1;
  return cfg;
}

// cudaFuncSetAttribute once per kernel and device: it is host work every call would pay.
// The once-flags are per kernel function: the function is a template argument. Keyed by the
// function's type instead (a `Kernel kernel` parameter), two kernels of one signature, e.g.
// bwd_main_kernel with and without kLseEarly, shared one flag, and the second one launched
// without its shared-memory attribute (the cooperative launch then reported the grid as not
// fitting).
template <auto kKernel>
void ensure_max_dynamic_smem(int smem_bytes) {
  constexpr int kMaxDevices = 64;
  static std::once_flag flags[kMaxDevices];
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  auto set = [&] {
    check_cuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
               "cudaFuncSetAttribute(max dynamic shared memory)");
  };
  if (device < kMaxDevices) {
    std::call_once(flags[device], set);
  } else {
    set();
  }
}

template <class Traits, class Schedule, bool kLseEarly>
void launch_main_kernel(typename Traits::template MainParams<Schedule> const& mp, int num_ctas, cudaStream_t stream) {
  constexpr auto kernel = &bwd_main_kernel<Traits, Schedule, kLseEarly>;
  constexpr int smem_bytes = Traits::kSmemBytes;
  ensure_max_dynamic_smem<kernel>(smem_bytes);

  // Cooperative launch: the driver refuses a grid whose CTAs cannot all be resident at
  // once, so every CTA a deterministic wait may depend on is guaranteed to be running.
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cudaLaunchConfig_t const cfg =
      one_attribute_launch_config(&attr, dim3(num_ctas, 1, 1), Traits::NumThreads, smem_bytes, stream);
  cudaError_t const err = cudaLaunchKernelEx(&cfg, kernel, mp);
  if (err == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();  // clear the sticky launch error
    throw std::runtime_error(
        "DASH backward: the persistent grid of " + std::to_string(num_ctas) + " CTAs (one per SM, " +
        std::to_string(smem_bytes / 1024) +
        " KB shared memory each) does not fit on the GPU at once: other work (another process under MPS, a green "
        "context) holds some SMs. Pass a larger sm_margin to leave them free.");
  }
  check_cuda(err, "launch of bwd_main_kernel");
}

template <int kHeadDim, bool Is_causal, class Element, bool kVarlen>
void run_bwd_impl(BwdParams const& p, cudaStream_t stream) {
  using Traits = BwdTraits<kHeadDim, Is_causal, Element, kVarlen>;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;

  // The torch binding refuses empty tensors; a direct caller (tools/runner) gets the same
  // one-line error instead of a zero-size grid's launch failure.
  if (p.batch < 1 || p.seqlen_q < 1 || p.seqlen_k < 1 || p.num_heads < 1 || p.num_heads_k < 1) {
    throw std::invalid_argument("DASH backward: empty problem (batch=" + std::to_string(p.batch) + ", " +
                                (kVarlen ? "max_seqlen_q=" : "seqlen_q=") + std::to_string(p.seqlen_q) + ", " +
                                (kVarlen ? "max_seqlen_k=" : "seqlen_k=") + std::to_string(p.seqlen_k) +
                                ", heads=" + std::to_string(p.num_heads) + ", heads_k=" +
                                std::to_string(p.num_heads_k) + ")");
  }

  TileGeometry geo;
  geo.seqlen_q = p.seqlen_q;
  geo.seqlen_k = p.seqlen_k;
  geo.block_m = kBlockM;
  geo.block_n = kBlockN;
  geo.causal = Is_causal;
  int const num_m_blocks = geo.num_m_blocks();
  // The workspace's Q tiles per (batch, head) row, or varlen per head (kernels/varlen.h); the
  // LSE / D rows of a row of tiles follow the same layout.
  int64_t const workspace_tiles_per_row =
      kVarlen ? varlen_tiles_per_head(p.total_q, p.batch, kBlockM) : int64_t(num_m_blocks);
  int64_t const workspace_rows = kVarlen ? int64_t(p.num_heads) : int64_t(p.num_heads) * p.batch;
  int64_t const stats_bh_stride = workspace_tiles_per_row * kBlockM;

  // ---- checks --------------------------------------------------------------------------
  // The pre/post-process grids are (Q tiles, heads, batch); y and z are limited to 65535.
  if (p.num_heads > 65535 || p.batch > 65535) {
    throw std::invalid_argument("DASH backward: batch=" + std::to_string(p.batch) + " and heads=" +
                                std::to_string(p.num_heads) + " must each be at most 65535");
  }
  int64_t const num_columns64 = int64_t(geo.num_n_blocks()) * p.num_heads * p.batch;
  if (num_columns64 > INT_MAX / 2) {
    throw std::invalid_argument("DASH backward: " + std::to_string(num_columns64) +
                                " columns (KV tiles x heads x batch) exceed the supported " +
                                std::to_string(INT_MAX / 2));
  }
  int const num_columns = int(num_columns64);
  // The dQ writers address chain c of dQ tile t as the 32-bit index c * tiles + t.
  int64_t const dq_tiles64 = workspace_tiles_per_row * workspace_rows * Traits::kdQChains;
  if (dq_tiles64 > INT_MAX) {
    throw std::invalid_argument("DASH backward: " + std::to_string(dq_tiles64 / Traits::kdQChains) +
                                (kVarlen ? " workspace Q tiles (tiles per head x heads)" : " Q tiles (Q tiles x heads x batch)") +
                                " exceed the supported " +
                                std::to_string(INT_MAX / Traits::kdQChains));
  }
  if (p.num_ctas_max < 1) {
    throw std::invalid_argument("DASH backward: no SM left for the persistent grid (num_ctas_max=" +
                                std::to_string(p.num_ctas_max) + "); lower sm_margin");
  }
  int const num_ctas = num_columns < p.num_ctas_max ? num_columns : p.num_ctas_max;
  bool const shift = p.schedule == BwdScheduleKind::kShift;
  if (shift && !kVarlen) {  // varlen refuses shift below
    if (Is_causal) {
      throw std::invalid_argument("DASH backward: schedule 'shift' is for full masks; for causal use 'descending', "
                                  "'interleaved', 'fa3' or 'auto'");
    }
    int const lanes = geo.num_n_blocks() < num_ctas ? geo.num_n_blocks() : num_ctas;
    if (lanes > num_m_blocks) {
      throw std::invalid_argument(
          "DASH backward: schedule 'shift' needs at most as many concurrently running columns of a head (" +
          std::to_string(lanes) + ") as Q tiles (" + std::to_string(num_m_blocks) +
          "), i.e. seqlen_q long enough for seqlen_k; use 'auto', 'interleaved' or 'fa3'");
    }
  }
  if (p.num_heads_k < 1 || p.num_heads % p.num_heads_k != 0) {
    throw std::invalid_argument("DASH backward: heads=" + std::to_string(p.num_heads) +
                                " is not a multiple of heads_k=" + std::to_string(p.num_heads_k));
  }
  bool const gqa = p.num_heads != p.num_heads_k;
  if (gqa && (p.dk_accum == nullptr || p.dv_accum == nullptr)) {
    throw std::invalid_argument("DASH backward: GQA needs dk_accum and dv_accum");
  }
  bool const dkv_ordered = dkv_ordered_for(Traits::kNondetdKVChainsMaxGroup, p);
  int const dkv_chains = dkv_chains_for(Traits::kdKVChains, Traits::kNondetdKVChainsMaxGroup, p);
  if (dkv_ordered && (p.dk == nullptr || p.dv == nullptr || p.dkv_semaphore == nullptr ||
                      (dkv_chains > 1 && p.dkv_chain_stride <= 0))) {
    throw std::invalid_argument("DASH backward: GQA in ordered chains writes dk and dv and needs dkv_semaphore and "
                                "dkv_chain_stride (got dk=" +
                                std::string(p.dk ? "set" : "null") + ", dkv_semaphore=" +
                                std::string(p.dkv_semaphore ? "set" : "null") + ", dkv_chain_stride=" +
                                std::to_string(p.dkv_chain_stride) + ")");
  }
  if constexpr (kVarlen) {
    if (p.cu_seqlens_k == nullptr || p.total_q < 1 || p.total_k < 1) {
      throw std::invalid_argument("DASH backward: a varlen problem needs cu_seqlens_q, cu_seqlens_k and at least one "
                                  "row of q and of k (total_q=" + std::to_string(p.total_q) + ", total_k=" +
                                  std::to_string(p.total_k) + ")");
    }
    if (p.live_columns == nullptr) {
      throw std::invalid_argument("DASH backward: a varlen problem needs the workspace's live-column list "
                                  "(bwd_set_workspace)");
    }
    if (shift || p.trace != nullptr) {
      throw std::invalid_argument(std::string("DASH backward: a varlen problem runs the claimed schedules (fa3, "
                                              "interleaved, descending) without trace; got ") +
                                  (shift ? "schedule 'shift'" : "a trace request"));
    }
  }
  int const eb = int(sizeof(Element));
  // Varlen tensors are one batch of total_q / total_k rows.
  int const rows_q = kVarlen ? p.total_q : p.seqlen_q, rows_k = kVarlen ? p.total_k : p.seqlen_k;
  int const tma_batch = kVarlen ? 1 : p.batch;
  BSHDStrides const q_st = checked_tma_strides("q", p.q, p.q_strides, rows_q, p.num_heads, tma_batch, kHeadDim, eb);
  BSHDStrides const do_st =
      checked_tma_strides("dout", p.dout, p.dout_strides, rows_q, p.num_heads, tma_batch, kHeadDim, eb);
  BSHDStrides const k_st = checked_tma_strides("k", p.k, p.k_strides, rows_k, p.num_heads_k, tma_batch, kHeadDim, eb);
  BSHDStrides const v_st = checked_tma_strides("v", p.v, p.v_strides, rows_k, p.num_heads_k, tma_batch, kHeadDim, eb);

  // ---- preprocess ------------------------------------------------------------------------
  PrepostParams pp;
  pp.out = p.out;
  pp.dout = p.dout;
  pp.out_strides = p.out_strides;
  pp.dout_strides = p.dout_strides;
  pp.lse = p.lse;
  pp.lse_batch_stride = p.lse_batch_stride;
  pp.lse_head_stride = p.lse_head_stride;
  pp.lse_log2 = p.lse_log2;
  pp.dpsum = p.dpsum;
  pp.dq_accum = p.dq_accum;
  pp.dq_semaphore = p.dq_semaphore;
  pp.counters = p.counters;
  pp.dq = p.dq;
  pp.dq_strides = p.dq_strides;
  pp.seqlen_q = p.seqlen_q;
  pp.seqlen_k = p.seqlen_k;
  pp.num_heads = p.num_heads;
  pp.num_m_blocks = num_m_blocks;
  pp.tiles_per_head = kVarlen ? int(workspace_tiles_per_row) : 0;
  pp.dq_chains = p.deterministic ? Traits::kdQChains : 1;
  pp.dq_chain_tiles = workspace_tiles_per_row * workspace_rows;
  pp.stats_bh_stride = stats_bh_stride;
  pp.softmax_scale = p.softmax_scale;
  pp.wait_per_tile = false;
  pp.cu_seqlens_q = p.cu_seqlens_q;
  pp.cu_seqlens_k = p.cu_seqlens_k;
  pp.dk = p.dk;
  pp.dv = p.dv;
  pp.dk_strides = p.dk_strides;
  pp.dv_strides = p.dv_strides;
  // Varlen NaN fill: under GQA the accumulator the caller casts, or (ordered) dk / dv, which
  // the group's last query head writes.
  pp.dk_accum = gqa && !dkv_ordered ? p.dk_accum : nullptr;
  pp.dv_accum = gqa && !dkv_ordered ? p.dv_accum : nullptr;
  pp.dkv_accum_strides = p.dkv_accum_strides;
  pp.num_heads_k = p.num_heads_k;

  dim3 const tile_grid(num_m_blocks, p.num_heads, p.batch);
  bwd_preprocess_kernel<Traits><<<tile_grid, kPreprocessThreads, 0, stream>>>(pp);
  check_cuda(cudaGetLastError(), "launch of bwd_preprocess_kernel");

  // ---- main kernel -----------------------------------------------------------------------
  auto make_gmem = [](void const* ptr, int seqlen, int heads, int batch, BSHDStrides s) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), make_shape(seqlen, kHeadDim, heads, batch),
                       make_stride(s.row, _1{}, s.head, s.batch));
  };
  auto const smem_q_one_stage = take<0, 2>(typename Traits::SmemLayoutQ{});
  auto const tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
  auto const tile_kv = Shape<Int<kBlockN>, Int<kHeadDim>>{};
  auto launch = [&](auto schedule) {
    using Schedule = decltype(schedule);
    typename Traits::template MainParams<Schedule> mp;
    mp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, make_gmem(p.q, rows_q, p.num_heads, tma_batch, q_st), smem_q_one_stage,
                             tile_q, _1{});
    mp.tma_do = make_tma_copy(SM90_TMA_LOAD{}, make_gmem(p.dout, rows_q, p.num_heads, tma_batch, do_st),
                              smem_q_one_stage, tile_q, _1{});
    mp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, make_gmem(p.k, rows_k, p.num_heads_k, tma_batch, k_st),
                             typename Traits::SmemLayoutK{}, tile_kv, _1{});
    mp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, make_gmem(p.v, rows_k, p.num_heads_k, tma_batch, v_st),
                             typename Traits::SmemLayoutV{}, tile_kv, _1{});
    mp.shape_q = typename Traits::ShapeBSHD{rows_q, kHeadDim, p.num_heads, tma_batch};
    mp.shape_k = typename Traits::ShapeBSHD{rows_k, kHeadDim, p.num_heads_k, tma_batch};
    mp.lse_log2 = p.lse_log2;
    mp.dpsum = p.dpsum;
    mp.stats_bh_stride = stats_bh_stride;
    mp.dq_accum = p.dq_accum;
    mp.dq_semaphore = p.dq_semaphore;
    mp.dq_chain_tiles = int(pp.dq_chain_tiles);
    mp.counters = p.counters;
    mp.dk = static_cast<Element*>(p.dk);
    mp.dv = static_cast<Element*>(p.dv);
    mp.dk_strides = p.dk_strides;
    mp.dv_strides = p.dv_strides;
    mp.dk_accum = gqa ? p.dk_accum : nullptr;
    mp.dv_accum = gqa ? p.dv_accum : nullptr;
    mp.dkv_accum_strides = p.dkv_accum_strides;
    mp.dkv_chain_stride = p.dkv_chain_stride;
    mp.dkv_ordered = dkv_ordered;
    mp.dkv_chains = dkv_chains;
    mp.dkv_semaphore = p.dkv_semaphore;
    mp.trace = p.trace;
    mp.trace_capacity = p.trace_capacity;
    mp.softmax_scale = p.softmax_scale;
    mp.softmax_scale_log2 = float(p.softmax_scale * M_LOG2E);
    mp.num_heads = p.num_heads;
    mp.num_heads_k = p.num_heads_k;
    mp.heads_per_kv_head = p.num_heads / p.num_heads_k;
    mp.deterministic = p.deterministic;
    mp.schedule = schedule;
    mp.cu_seqlens_q = p.cu_seqlens_q;
    mp.cu_seqlens_k = p.cu_seqlens_k;
    mp.dq_tiles_per_head = int(workspace_tiles_per_row);
    mp.live_columns = p.live_columns;
    if constexpr (kVarlen) {
      // The live columns the producer claims through (bwd_prepost_kernels.h); the preprocess
      // before it has zeroed the claim counter, the main kernel after it reads the list.
      bwd_varlen_live_columns_kernel<Traits><<<1, kLiveColumnsThreads, 0, stream>>>(mp);
      check_cuda(cudaGetLastError(), "launch of bwd_varlen_live_columns_kernel");
    }
    // The config table says per mode whether a launch runs the mainloop that loads the LSE
    // before the S^T GEMM (BwdMainKernel's kLseEarly: lse_early_nondet, lse_early_det); where
    // both modes say the same, the two calls name one instantiation.
    // Varlen runs the other mainloop only (one instantiation).
    if (p.deterministic) {
      launch_main_kernel<Traits, Schedule, !kVarlen && Traits::kLseEarlyDet>(mp, num_ctas, stream);
    } else {
      launch_main_kernel<Traits, Schedule, !kVarlen && Traits::kLseEarlyNondet>(mp, num_ctas, stream);
    }
  };
  // The kernel's geometry carries the tile sizes as compile-time constants.
  auto const kgeo = geo.template with_blocks<StaticBlocks<kBlockM, kBlockN>>();
  if constexpr (!Is_causal && !kVarlen) {
    if (shift) {
      // The waves are planned for the grid actually launched (the bits depend on it).
      launch(make_shift_schedule(kgeo, p.num_heads, p.batch, num_ctas));
    } else {
      launch(make_claimed_schedule(p.schedule, kgeo, kHeadDim, p.num_heads, p.num_heads_k, p.batch, p.deterministic));
    }
  } else {
    launch(make_claimed_schedule(p.schedule, kgeo, kHeadDim, p.num_heads, p.num_heads_k, p.batch, p.deterministic));
  }

  // ---- dQ convert ------------------------------------------------------------------------
  // With convert_under_main, launched behind the main kernel with programmatic stream
  // serialisation: the main kernel's CTAs trigger it as they start, and its CTAs take the SMs
  // the main kernel's tail frees, so the conversion of finished tiles overlaps that tail and
  // the launch latency is hidden. Deterministic runs wait per tile on the dQ semaphores,
  // whose final counts the writers release only after their adds landed; without determinism
  // the writers keep no count, and each CTA waits for the main grid (bwd_prepost_kernels.h).
  if (p.convert_under_main) {
    PrepostParams cp = pp;
    cp.wait_per_tile = p.deterministic;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t const cfg = one_attribute_launch_config(&attr, tile_grid, Traits::NumMmaThreads, 0, stream);
    check_cuda(cudaLaunchKernelEx(&cfg, bwd_convert_dq_kernel<Traits>, cp), "launch of bwd_convert_dq_kernel");
  } else {
    bwd_convert_dq_kernel<Traits><<<tile_grid, Traits::NumMmaThreads, 0, stream>>>(pp);
    check_cuda(cudaGetLastError(), "launch of bwd_convert_dq_kernel");
  }
}

template <int kHeadDim, class Element>
void run_bwd_hdim(BwdParams const& p, cudaStream_t stream) {
  bool const varlen = p.cu_seqlens_q != nullptr;
  if (p.causal) {
    varlen ? run_bwd_impl<kHeadDim, true, Element, true>(p, stream) : run_bwd_impl<kHeadDim, true, Element, false>(p, stream);
  } else {
    varlen ? run_bwd_impl<kHeadDim, false, Element, true>(p, stream)
           : run_bwd_impl<kHeadDim, false, Element, false>(p, stream);
  }
}

}  // namespace dash
