// Problem description handed from the torch binding to the kernel launch layer.
// Plain C++: no torch, no CUDA headers, so the binding and the kernels share it cheaply.
#pragma once

#include <cstddef>
#include <cstdint>

#include "schedule/schedule.h"  // BwdScheduleKind (plain C++)

namespace dash {

enum class DType : int { kBFloat16 = 0, kFloat16 = 1 };

// One (column, Q tile) step as the dQ writer saw it, in trace mode. Times are %globaltimer
// nanoseconds (a coarse clock: 32 ns to 1 us steps, by GPU): t_wait when the writer turned
// to the step, t_ready when both MMA warpgroups' dQ partials were in shared memory,
// t_acquired when the tile's turn had come (= t_ready without determinism), t_done when the
// reduce-add had landed and the tile was released (deterministic) or the staging slice was
// free (otherwise).
// turn is -1 without determinism; bh = b * heads + h. Fields not reached stay -1.
// 64 bytes; Python reads a record as 8 int32 then 4 int64.
struct BwdTraceRecord {
  int32_t cta, bh, n, m, step, turn, reserved0, reserved1;
  int64_t t_wait, t_ready, t_acquired, t_done;
};
static_assert(sizeof(BwdTraceRecord) == 64, "dash.trace reads 64-byte records");

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

  // Outputs, shaped like q, k, v. Under GQA (num_heads > num_heads_k) the query heads of a
  // KV group sum their dK/dV in fp32 (bwd_epilogue.h, store_dkv):
  //  - ordered (deterministic, or a group of at most the config's kNondetdKVChainsMaxGroup
  //    heads, dkv_ordered_for): dk_accum/dv_accum hold bwd_dkv_chains() chains of k's shape,
  //    one after the other (dkv_chain_stride floats apart, any contents), and the kernel writes
  //    dk/dv; dkv_semaphore: (batch, heads_k, num_n_blocks, chains) ints, zeroed by the caller
  //    (unused otherwise);
  //  - otherwise: every head reduce-adds into dk_accum/dv_accum (shaped like k,
  //    zero-initialised by the caller), which the caller casts into dk/dv afterwards (dk/dv
  //    unused by the kernel).
  // dkv_accum_strides are those of one chain.
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  BSHDStrides dq_strides, dk_strides, dv_strides;
  float* dk_accum = nullptr;
  float* dv_accum = nullptr;
  BSHDStrides dkv_accum_strides;
  int64_t dkv_chain_stride = 0;
  int* dkv_semaphore = nullptr;

  // Forward log-sum-exp, natural log of sum_j exp(scale * s_ij): (batch, heads, seqlen_q),
  // seqlen stride 1.
  float const* lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  float softmax_scale = 0.f;
  bool causal = false;
  bool deterministic = false;
  BwdScheduleKind schedule = BwdScheduleKind::kFa3;
  int num_ctas_max = 0;  // SMs the persistent grid may use (device SMs - sm_margin)
  // The dQ convert kernel is launched while the main kernel runs (programmatic dependent
  // launch) and takes SMs as the main kernel's CTAs finish: deterministic runs convert each
  // dQ tile once its semaphores show every add landed, others wait for the main kernel to
  // complete. Off when sm_margin leaves SMs to other work: waiting convert CTAs would sit on them.
  bool convert_under_main = false;

  // Trace mode (null = off): one record per (column, Q tile) step, trace_capacity of them
  // (bwd_trace_steps()); the kernel numbers them with the workspace's trace counter.
  BwdTraceRecord* trace = nullptr;
  int64_t trace_capacity = 0;

  // Workspace, sized by bwd_workspace_sizes() and initialised by the preprocess kernel (dQaccum
  // is zeroed when it has one chain; with several, the first add of each chain stores). Its Q
  // tiles are (batch, heads, num_m_blocks), or varlen (heads, tiles per head) with each
  // sequence's tiles from its first (kernels/varlen.h): set cu_seqlens_q and total_q before
  // sizing it. The LSE / D rows of tile t are t * kBlockM ...
  float* lse_log2 = nullptr;      // (tiles, kBlockM)
  float* dpsum = nullptr;         // D = rowsum(dO * O), same shape
  // dQ chains: 1, or the config's kdQChains when deterministic (chain c of tile t at c * tiles + t).
  float* dq_accum = nullptr;      // (chains, tiles, kBlockM * head_dim), MMA fragment order
  int* dq_semaphore = nullptr;    // (chains, tiles)
  int* counters = nullptr;        // kNumCounters ints, zeroed by the preprocess kernel

  // Variable-length batch (FwdParams' layout), when cu_seqlens_q is set: q, dout, out and dq
  // hold total_q rows, k, v, dk, dv (and the GQA accumulators) total_k, their batch strides
  // unused; lse is (heads, total_q) (lse_head_stride = total_q). `batch` counts the sequences,
  // seqlen_q / seqlen_k are the longest ones (the grids are sized by them, the workspace by
  // total_q). Claimed schedules only, no trace.
  int const* cu_seqlens_q = nullptr;
  int const* cu_seqlens_k = nullptr;
  int total_q = 0, total_k = 0;
  // Varlen workspace: the live columns (those inside their sequence's keys), in claim order,
  // then their count (bwd_varlen_live_columns_kernel; num_columns + 1 ints).
  int* live_columns = nullptr;
};

// GQA: whether the group's dK/dV sum runs in ordered chains (store_dkv): always when
// deterministic; without determinism for groups of at most `nondet_max_group` query heads (the
// config's kNondetdKVChainsMaxGroup: there the chains beat adds into a zeroed accumulator plus
// the casts after the kernel; larger groups queue on them). False without GQA.
inline bool dkv_ordered_for(int nondet_max_group, BwdParams const& p) {
  int const group = p.num_heads_k > 0 ? p.num_heads / p.num_heads_k : 1;
  return group >= 2 && (p.deterministic || group <= nondet_max_group);
}

// GQA dK/dV accumulation chains of an ordered run (store_dkv): the config's `max_chains`, at
// most one per query head of a group but its last (G - 1); 1 without GQA or ordering.
inline int dkv_chains_for(int max_chains, int nondet_max_group, BwdParams const& p) {
  if (!dkv_ordered_for(nondet_max_group, p)) { return 1; }
  int const group = p.num_heads / p.num_heads_k;
  return max_chains < group - 1 ? max_chains : group - 1;
}

// Counters of the workspace: columns claimed by the persistent CTAs, trace records written,
// dQ convert CTAs done (convert_under_main).
enum BwdCounter : int { kWorkCounter = 0, kTraceCounter = 1, kConvertDoneCounter = 2, kNumCounters = 3 };

struct BwdWorkspaceSizes {
  size_t lse_log2_floats = 0;
  size_t dpsum_floats = 0;
  size_t dq_accum_floats = 0;
  size_t semaphore_ints = 0;
  size_t counter_ints = kNumCounters;
  size_t live_column_ints = 0;  // varlen: the padded grid's columns + 1
};

}  // namespace dash
