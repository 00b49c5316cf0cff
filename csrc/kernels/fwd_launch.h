// Host launch of one forward: checks, TMA descriptors, the tile order, and the persistent
// main kernel on the caller's stream. Instantiated once per (head dim, element type)
// translation unit. Every check runs before the launch and throws std::invalid_argument
// naming what was asked and what is supported (the build defines NDEBUG: no asserts).
#pragma once

#include <algorithm>
#include <climits>
#include <mutex>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "kernels/bwd_launch.h"  // checked_tma_strides, ensure_max_dynamic_smem, check_cuda
#include "kernels/fwd_main_kernel.h"

namespace dash {

// Clusters of `ctas` x 1 x 1 CTAs.
inline cudaLaunchAttribute cluster_dim_attribute(int ctas) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(ctas);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

// The most clusters of `kernel` (at `smem_bytes`, cluster dims `cluster_ctas` x 1 x 1) that
// can be resident at once on the current device; queried once per device. 0 where the query
// fails (a device or partition without clusters): the caller then runs one CTA per tile.
template <auto kKernel>
int max_active_clusters(int smem_bytes, int cluster_ctas, int block_threads) {
  constexpr int kMaxDevices = 64;
  static std::once_flag flags[kMaxDevices];
  static int counts[kMaxDevices];
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  auto query = [&] {
    cudaLaunchAttribute const attr = cluster_dim_attribute(cluster_ctas);
    cudaLaunchConfig_t const cfg =
        one_attribute_launch_config(&attr, dim3(unsigned(cluster_ctas), 1, 1), block_threads, smem_bytes, nullptr);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kKernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it so that the next check_cuda does not see it
      n = 0;
    }
    return n;
  };
  if (device >= kMaxDevices) { return query(); }
  std::call_once(flags[device], [&] { counts[device] = query(); });
  return counts[device];
}

template <class Traits>
typename Traits::MainParams make_fwd_main_params(FwdParams const& p, BSHDStrides q_st, BSHDStrides k_st,
                                                 BSHDStrides v_st, BSHDStrides o_st, int num_m_blocks, int num_bh) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kClusterM = Traits::kClusterM;
  auto make_gmem = [](void const* ptr, int seqlen, int heads, int batch, BSHDStrides s) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), make_shape(seqlen, Int<kHeadDim>{}, heads, batch),
                       make_stride(s.row, _1{}, s.head, s.batch));
  };
  // Varlen: the packed tensors as one batch of total_q / total_k rows.
  constexpr bool kVarlen = Traits::kVarlen;
  int const rows_q = kVarlen ? p.total_q : p.seqlen_q, rows_k = kVarlen ? p.total_k : p.seqlen_k;
  int const batch = kVarlen ? 1 : p.batch;
  typename Traits::MainParams mp;
  mp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, make_gmem(p.q, rows_q, p.num_heads, batch, q_st),
                           take<0, 2>(typename Traits::SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
  mp.tma_k = make_tma_copy(typename Traits::TmaKVOp{}, make_gmem(p.k, rows_k, p.num_heads_k, batch, k_st),
                           take<0, 2>(typename Traits::SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           Int<kClusterM>{});
  mp.tma_v = make_tma_copy(typename Traits::TmaKVOp{}, make_gmem(p.v, rows_k, p.num_heads_k, batch, v_st),
                           take<0, 2>(typename Traits::SmemLayoutV{}), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           Int<kClusterM>{});
  mp.shape_q = typename Traits::ShapeBSHD{rows_q, kHeadDim, p.num_heads, batch};
  mp.shape_k = typename Traits::ShapeBSHD{rows_k, kHeadDim, p.num_heads_k, batch};
  mp.out = static_cast<Element*>(p.out);
  mp.out_strides = p.out_strides;
  mp.lse = p.lse;
  mp.softmax_scale_log2 = float(double(p.softmax_scale) * M_LOG2E);
  mp.geo.seqlen_q = p.seqlen_q;
  mp.geo.seqlen_k = p.seqlen_k;
  mp.geo.causal = Traits::Is_causal;
  mp.num_heads = p.num_heads;
  mp.heads_per_kv_head = p.num_heads / p.num_heads_k;
  // A cluster's work item is a pair of adjacent Q tiles (FwdTraits): the order runs over pairs.
  mp.order.num_m_blocks = num_m_blocks / kClusterM;
  mp.order.num_bh = num_bh;
  mp.order.section_heads =  // varlen: unused (each sequence's own, from section_keys)
      fwd_section_heads(Traits::kL2SectionBytes, p.seqlen_k, kHeadDim, int(sizeof(Element)), mp.heads_per_kv_head,
                        num_bh);
  mp.order.num_tiles = num_bh * mp.order.num_m_blocks;
  mp.order.section_keys = fwd_section_keys(Traits::kL2SectionBytes, kHeadDim, int(sizeof(Element)), mp.heads_per_kv_head);
  mp.tile_counter = p.tile_counter;
  mp.cu_seqlens_q = p.cu_seqlens_q;
  mp.cu_seqlens_k = p.cu_seqlens_k;
  mp.lse_head_stride = p.total_q;
  if constexpr (Traits::kTmaStoreOut) {
    mp.tma_o = make_tma_copy(SM90_TMA_STORE{},
                             make_tensor(make_gmem_ptr(static_cast<Element*>(p.out)),
                                         make_shape(rows_q, Int<kHeadDim>{}, p.num_heads, batch),
                                         make_stride(o_st.row, _1{}, o_st.head, o_st.batch)),
                             typename Traits::SmemLayoutOSlab{}, Shape<_64, Int<kHeadDim>>{}, _1{});
  }
  return mp;
}

// The persistent one-CTA-per-tile launch of Traits' kernel (at most one CTA per Q tile).
template <class Traits>
void launch_fwd_persistent(FwdParams const& p, BSHDStrides q_st, BSHDStrides k_st, BSHDStrides v_st, BSHDStrides o_st,
                           int num_m_blocks, int64_t num_bh, int64_t num_tiles, cudaStream_t stream) {
  auto const mp = make_fwd_main_params<Traits>(p, q_st, k_st, v_st, o_st, num_m_blocks, int(num_bh));
  constexpr auto kernel = &fwd_main_kernel<Traits>;
  constexpr int smem_bytes = Traits::kSmemBytes;
  ensure_max_dynamic_smem<kernel>(smem_bytes);
  int const num_ctas = num_tiles < p.num_ctas_max ? int(num_tiles) : p.num_ctas_max;
  check_cuda(cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream), "cudaMemsetAsync(tile_counter)");
  kernel<<<num_ctas, Traits::NumThreads, smem_bytes, stream>>>(mp);
  check_cuda(cudaGetLastError(), "launch of fwd_main_kernel");
}

template <int kHeadDim, bool Is_causal, class Element>
void run_fwd_impl(FwdParams const& p, cudaStream_t stream) {
  using Traits = FwdTraits<kHeadDim, Is_causal, Element>;
  constexpr int kBlockM = Traits::kBlockM;
  bool const varlen = p.cu_seqlens_q != nullptr;

  if (p.batch < 1 || p.seqlen_q < 1 || p.seqlen_k < 1 || p.num_heads < 1) {
    throw std::invalid_argument("DASH forward: empty problem (batch=" + std::to_string(p.batch) + ", " +
                                (varlen ? "max_seqlen_q=" : "seqlen_q=") + std::to_string(p.seqlen_q) + ", " +
                                (varlen ? "max_seqlen_k=" : "seqlen_k=") + std::to_string(p.seqlen_k) +
                                ", heads=" + std::to_string(p.num_heads) + ")");
  }
  if (p.num_heads_k < 1 || p.num_heads % p.num_heads_k != 0) {
    throw std::invalid_argument("DASH forward: heads=" + std::to_string(p.num_heads) +
                                " is not a multiple of heads_k=" + std::to_string(p.num_heads_k));
  }
  if (p.num_ctas_max < 1) {
    throw std::invalid_argument("DASH forward: no SM left for the persistent grid (num_ctas_max=" +
                                std::to_string(p.num_ctas_max) + "); lower sm_margin");
  }
  if (p.out == nullptr || p.lse == nullptr || p.tile_counter == nullptr) {
    throw std::invalid_argument("DASH forward: out, lse and tile_counter are required");
  }
  if (varlen && (p.cu_seqlens_k == nullptr || p.total_q < 1 || p.total_k < 1)) {
    throw std::invalid_argument("DASH forward: a varlen problem needs cu_seqlens_q, cu_seqlens_k and at least one "
                                "row of q and of k (total_q=" + std::to_string(p.total_q) + ", total_k=" +
                                std::to_string(p.total_k) + ")");
  }
  int const num_m_blocks = ceil_div_int(p.seqlen_q, kBlockM);
  int64_t const num_bh = int64_t(p.batch) * p.num_heads;
  int64_t const num_tiles = num_bh * num_m_blocks;
  if (num_tiles > INT_MAX / 2) {
    throw std::invalid_argument("DASH forward: " + std::to_string(num_tiles) +
                                " Q tiles (batch x heads x ceil(seqlen_q / " + std::to_string(kBlockM) +
                                ")) exceed the supported " + std::to_string(INT_MAX / 2));
  }
  int const eb = int(sizeof(Element));
  // Varlen tensors are one batch of total_q / total_k rows.
  int const rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  int const batch = varlen ? 1 : p.batch;
  auto checked = [&](char const* name, void const* ptr, BSHDStrides strides, int seqlen, int heads) {
    return checked_tma_strides(name, ptr, strides, seqlen, heads, batch, kHeadDim, eb, "DASH forward");
  };
  BSHDStrides const q_st = checked("q", p.q, p.q_strides, rows_q, p.num_heads);
  BSHDStrides const k_st = checked("k", p.k, p.k_strides, rows_k, p.num_heads_k);
  BSHDStrides const v_st = checked("v", p.v, p.v_strides, rows_k, p.num_heads_k);
  // the epilogue stores 16-byte row segments, or 64-row slabs by TMA (kTmaStoreOut)
  BSHDStrides const o_st = checked("out", p.out, p.out_strides, rows_q, p.num_heads);

  if (varlen) {
    launch_fwd_persistent<FwdTraits<kHeadDim, Is_causal, Element, 1, true>>(p, q_st, k_st, v_st, o_st, num_m_blocks,
                                                                            num_bh, num_tiles, stream);
    return;
  }

  // Clusters of two with K/V multicast (FwdTileConfig.kv_multicast) when the Q tiles pair up
  // and two SMs are allowed; otherwise one CTA per tile. Both give the same bits: a Q tile's
  // result depends only on its own KV walk.
  if constexpr (Traits::Config::kKVMulticast) {
    using ClusterTraits = FwdTraits<kHeadDim, Is_causal, Element, 2>;
    constexpr auto kernel = &fwd_main_kernel<ClusterTraits>;
    constexpr int smem_bytes = ClusterTraits::kSmemBytes;
    if (num_m_blocks % 2 == 0 && p.num_ctas_max >= 2) {
      ensure_max_dynamic_smem<kernel>(smem_bytes);
      int const resident = max_active_clusters<kernel>(smem_bytes, 2, ClusterTraits::NumThreads);
      int64_t clusters = std::min<int64_t>({num_tiles / 2, int64_t(p.num_ctas_max / 2), int64_t(resident)});
      if (clusters >= 1) {
        auto const mp = make_fwd_main_params<ClusterTraits>(p, q_st, k_st, v_st, o_st, num_m_blocks, int(num_bh));
        cudaLaunchAttribute const attr = cluster_dim_attribute(2);
        cudaLaunchConfig_t const cfg = one_attribute_launch_config(&attr, dim3(unsigned(2 * clusters), 1, 1),
                                                                   ClusterTraits::NumThreads, smem_bytes, stream);
        // A cluster launch the device refuses for its resources (e.g. SMs held by other work
        // under MPS) is not an error of the call: the one-CTA kernel below computes the same bits.
        cudaError_t const launched = cudaLaunchKernelEx(&cfg, kernel, mp);
        if (launched == cudaSuccess) { return; }
        if (launched != cudaErrorLaunchOutOfResources && launched != cudaErrorInvalidClusterSize) {
          check_cuda(launched, "launch of fwd_main_kernel (clusters of 2)");
        }
        (void)cudaGetLastError();
      }
    }
  }
  launch_fwd_persistent<Traits>(p, q_st, k_st, v_st, o_st, num_m_blocks, num_bh, num_tiles, stream);
}

template <int kHeadDim, class Element>
void run_fwd_hdim(FwdParams const& p, cudaStream_t stream) {
  if (p.causal) {
    run_fwd_impl<kHeadDim, true, Element>(p, stream);
  } else {
    run_fwd_impl<kHeadDim, false, Element>(p, stream);
  }
}

}  // namespace dash
