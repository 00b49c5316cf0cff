// Host launch of one backward: preprocess -> persistent main kernel -> dQ convert, all on
// the caller's stream. Instantiated once per (head dim, element type) translation unit.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "kernels/bwd_main_kernel.h"
#include "kernels/bwd_prepost_kernels.h"

namespace dash {

inline void check_cuda(cudaError_t err, char const* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("DASH backward: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

template <class Traits, class Schedule>
void launch_main_kernel(typename Traits::template MainParams<Schedule> const& mp, int num_ctas, cudaStream_t stream) {
  auto kernel = bwd_main_kernel<Traits, Schedule>;
  constexpr int smem_bytes = Traits::kSmemBytes;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
             "cudaFuncSetAttribute(max dynamic shared memory)");

  // Cooperative launch: the driver refuses a grid whose CTAs cannot all be resident at
  // once, so every CTA a deterministic wait may depend on is guaranteed to be running.
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(num_ctas, 1, 1);
  cfg.blockDim = dim3(Traits::NumThreads, 1, 1);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, mp), "launch of bwd_main_kernel");
}

template <int kHeadDim, bool Is_causal, class Element>
void run_bwd_impl(BwdParams const& p, cudaStream_t stream) {
  using Traits = BwdTraits<kHeadDim, Is_causal, Element>;
  // Every check before the first launch: an error never leaves a half-run backward.
  if (p.schedule != BwdSchedule::kFa3) {
    throw std::invalid_argument("DASH backward: schedule " + std::to_string(int(p.schedule)) +
                                " is not implemented by the kernel; implemented: fa3");
  }
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;

  TileGeometry geo;
  geo.seqlen_q = p.seqlen_q;
  geo.seqlen_k = p.seqlen_k;
  geo.block_m = kBlockM;
  geo.block_n = kBlockN;
  geo.causal = Is_causal;
  int const num_m_blocks = geo.num_m_blocks();
  int64_t const stats_bh_stride = int64_t(num_m_blocks) * kBlockM;

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
  pp.work_counter = p.work_counter;
  pp.dq = p.dq;
  pp.dq_strides = p.dq_strides;
  pp.seqlen_q = p.seqlen_q;
  pp.num_heads = p.num_heads;
  pp.num_m_blocks = num_m_blocks;
  pp.stats_bh_stride = stats_bh_stride;
  pp.softmax_scale = p.softmax_scale;

  dim3 const tile_grid(num_m_blocks, p.num_heads, p.batch);
  bwd_preprocess_kernel<Traits><<<tile_grid, kPreprocessThreads, 0, stream>>>(pp);
  check_cuda(cudaGetLastError(), "launch of bwd_preprocess_kernel");

  // ---- main kernel -----------------------------------------------------------------------
  using ShapeBSHD = typename Traits::ShapeBSHD;
  auto make_gmem = [](void const* ptr, int seqlen, int heads, int batch, BSHDStrides s) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_shape(seqlen, kHeadDim, heads, batch),
                       make_stride(s.row, _1{}, s.head, s.batch));
  };
  auto mQ = make_gmem(p.q, p.seqlen_q, p.num_heads, p.batch, p.q_strides);
  auto mdO = make_gmem(p.dout, p.seqlen_q, p.num_heads, p.batch, p.dout_strides);
  auto mK = make_gmem(p.k, p.seqlen_k, p.num_heads_k, p.batch, p.k_strides);
  auto mV = make_gmem(p.v, p.seqlen_k, p.num_heads_k, p.batch, p.v_strides);
  auto const smem_q_one_stage = take<0, 2>(typename Traits::SmemLayoutQ{});
  auto const tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
  auto const tile_kv = Shape<Int<kBlockN>, Int<kHeadDim>>{};

  using Schedule = Fa3Schedule;  // BwdSchedule::kFa3, the only kernel schedule so far (checked above)
  typename Traits::template MainParams<Schedule> mp{
      make_tma_copy(SM90_TMA_LOAD{}, mQ, smem_q_one_stage, tile_q, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mdO, smem_q_one_stage, tile_q, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, typename Traits::SmemLayoutK{}, tile_kv, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mV, typename Traits::SmemLayoutV{}, tile_kv, _1{}),
      ShapeBSHD{p.seqlen_q, kHeadDim, p.num_heads, p.batch},
      ShapeBSHD{p.seqlen_k, kHeadDim, p.num_heads_k, p.batch},
      p.lse_log2,
      p.dpsum,
      stats_bh_stride,
      p.dq_accum,
      p.dq_semaphore,
      p.work_counter,
      static_cast<Element*>(p.dk),
      static_cast<Element*>(p.dv),
      p.dk_strides,
      p.dv_strides,
      p.softmax_scale,
      float(p.softmax_scale * M_LOG2E),
      p.num_heads,
      p.num_heads / p.num_heads_k,
      p.deterministic,
      geo,
      make_fa3_schedule(geo, p.num_heads, p.batch, p.deterministic),
  };

  int const num_columns = geo.num_n_blocks() * p.num_heads * p.batch;
  int const num_ctas = num_columns < p.num_ctas_max ? num_columns : p.num_ctas_max;

  launch_main_kernel<Traits, Schedule>(mp, num_ctas, stream);

  bwd_convert_dq_kernel<Traits><<<tile_grid, Traits::NumMmaThreads, 0, stream>>>(pp);
  check_cuda(cudaGetLastError(), "launch of bwd_convert_dq_kernel");
}

template <int kHeadDim, class Element>
void run_bwd_hdim(BwdParams const& p, cudaStream_t stream) {
  if (p.causal) {
    run_bwd_impl<kHeadDim, true, Element>(p, stream);
  } else {
    run_bwd_impl<kHeadDim, false, Element>(p, stream);
  }
}

}  // namespace dash
