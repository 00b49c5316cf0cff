// Problem description handed from the torch binding to the forward's launch layer.
// Plain C++ (no torch, no CuTe), like bwd_params.h.
#pragma once

#include <cstdint>

#include "kernels/bwd_params.h"  // DType, BSHDStrides

namespace dash {

struct FwdParams {
  DType dtype = DType::kBFloat16;
  int batch = 0, seqlen_q = 0, seqlen_k = 0;
  int num_heads = 0;    // query heads
  int num_heads_k = 0;  // key/value heads; num_heads % num_heads_k == 0 (GQA/MQA)
  int head_dim = 0;

  void const* q = nullptr;
  void const* k = nullptr;
  void const* v = nullptr;
  BSHDStrides q_strides, k_strides, v_strides;

  // Outputs. out: shaped like q (any 16-byte aligned row stride). lse: (batch, heads,
  // seqlen_q) float32, contiguous: natural log of sum_j exp(scale * s_ij), -inf for a row
  // that sees no key (causal with seqlen_q > seqlen_k); out is 0 there. Every element of
  // both is written.
  void* out = nullptr;
  BSHDStrides out_strides;
  float* lse = nullptr;

  float softmax_scale = 0.f;
  bool causal = false;  // bottom-right aligned: key j visible to query i iff j <= i + seqlen_k - seqlen_q
  int num_ctas_max = 0;  // SMs the persistent grid may use (device SMs - sm_margin)

  // Workspace: one int, any contents (run_fwd zeroes it on the stream before the launch).
  int* tile_counter = nullptr;

  // Variable-length batch (FA3's flash_attn_varlen_func), when cu_seqlens_q is set. The
  // sequences are packed along the rows: q and out hold total_q rows, k and v total_k (their
  // batch strides are unused), and sequence b's queries are rows [cu_seqlens_q[b],
  // cu_seqlens_q[b + 1]) and its keys rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) (int32 on the
  // device, batch + 1 non-decreasing entries each). `batch` counts the sequences; seqlen_q and
  // seqlen_k are the longest sequence's lengths (FA3's max_seqlen_q / max_seqlen_k): seqlen_q
  // sizes the grid of Q tiles, seqlen_k the L2 sections. The causal mask is aligned to the
  // bottom-right corner of each sequence. lse is (heads, total_q). Rows of a sequence longer
  // than seqlen_q lie outside the grid: the kernel writes NaN to them (out and lse), so that
  // a wrong max_seqlen_q shows instead of leaving rows unwritten.
  int const* cu_seqlens_q = nullptr;
  int const* cu_seqlens_k = nullptr;
  int total_q = 0, total_k = 0;
};

}  // namespace dash
