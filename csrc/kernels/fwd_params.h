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
};

}  // namespace dash
