// Problem description handed from the torch binding to the kernel launch layer.
// Plain C++: no torch, no CUDA headers, so the binding and the kernels share it cheaply.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dash {

enum class DType : int { kBFloat16 = 0, kFloat16 = 1 };

// Deterministic reduction schedules the kernel implements; each names a policy type in
// schedule/schedule.h (kFa3 -> Fa3Schedule).
enum class BwdSchedule : int { kFa3 = 0 };

// Element strides of a (batch, seqlen, heads, head_dim) tensor whose last dim is contiguous.
struct BSHDStrides {
  int64_t batch = 0, row = 0, head = 0;
};

struct BwdParams {
  DType dtype = DType::kBFloat16;
  int batch = 0, seqlen_q = 0, seqlen_k = 0;
  int num_heads = 0;    // query heads
  int num_heads_k = 0;  // key/value heads; num_heads % num_heads_k == 0
  int head_dim = 0;

  void const* q = nullptr;
  void const* k = nullptr;
  void const* v = nullptr;
  void const* out = nullptr;
  void const* dout = nullptr;
  BSHDStrides q_strides, k_strides, v_strides, out_strides, dout_strides;

  // Outputs. dk/dv have num_heads heads (one per query head); the caller sums groups for GQA.
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  BSHDStrides dq_strides, dk_strides, dv_strides;

  // Forward log-sum-exp, natural log of sum_j exp(scale * s_ij): (batch, heads, seqlen_q),
  // seqlen stride 1.
  float const* lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  float softmax_scale = 0.f;
  bool causal = false;
  bool deterministic = false;
  BwdSchedule schedule = BwdSchedule::kFa3;
  int num_ctas_max = 0;  // SMs the persistent grid may use (device SMs - sm_margin)

  // Workspace, sized by bwd_workspace_sizes() and zero-initialised by the preprocess kernel.
  float* lse_log2 = nullptr;      // (batch, heads, seqlen_q rounded up to kBlockM)
  float* dpsum = nullptr;         // D = rowsum(dO * O), same shape
  float* dq_accum = nullptr;      // (batch, heads, num_m_blocks, kBlockM * head_dim), MMA fragment order
  int* dq_semaphore = nullptr;    // (batch, heads, num_m_blocks)
  int* work_counter = nullptr;    // one int: columns claimed by the persistent CTAs
};

struct BwdWorkspaceSizes {
  size_t lse_log2_floats = 0;
  size_t dpsum_floats = 0;
  size_t dq_accum_floats = 0;
  size_t semaphore_ints = 0;
  size_t counter_ints = 1;
};

}  // namespace dash
