// Dispatch from runtime (head dim, dtype) to the translation units this build compiled.
// Which ones exist is decided by setup.py (DASH_HDIMS / DASH_DTYPES): dash/config.py writes
// the units and the list they come from (generated/dispatch.h), so the two cannot disagree.
#include "bwd_api.h"

#include <stdexcept>
#include <string>

#include "generated/dispatch.h"
#include "generated/tile_config.h"
#include "kernels/varlen.h"

namespace cutlass {
struct bfloat16_t;
struct half_t;
}  // namespace cutlass

namespace dash {

template <int kHeadDim, class Element>
void run_bwd_hdim(BwdParams const& params, cudaStream_t stream);

template <class Cfg>
BwdWorkspaceSizes bwd_workspace_sizes_for(BwdParams const& p) {
  constexpr int kHeadDim = Cfg::kHeadDim;
  size_t const m_blocks = size_t((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM);
  size_t const bh = size_t(p.batch) * p.num_heads;
  // Q tiles of the workspace: (batch, heads, the longest sequence's tiles), or varlen per head
  // the sequences' tiles one after another (kernels/varlen.h).
  size_t const tiles = p.cu_seqlens_q != nullptr
                           ? size_t(p.num_heads) * size_t(varlen_tiles_per_head(p.total_q, p.batch, Cfg::kBlockM))
                           : bh * m_blocks;
  BwdWorkspaceSizes w;
  w.lse_log2_floats = tiles * Cfg::kBlockM;
  w.dpsum_floats = w.lse_log2_floats;
  // Deterministic runs accumulate each dQ tile in kdQChains chains (config.py, dq_chains).
  size_t const chains = p.deterministic ? Cfg::kdQChains : 1;
  w.dq_accum_floats = chains * tiles * Cfg::kBlockM * kHeadDim;
  w.semaphore_ints = chains * tiles;
  if (p.cu_seqlens_q != nullptr) {  // the varlen grid's live columns (kernels/bwd_prepost_kernels.h)
    size_t const n_blocks = size_t((p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN);
    w.live_column_ints = bh * n_blocks + 1;
  }
  return w;
}

template <class Cfg>
int64_t bwd_trace_steps_for(BwdParams const& p) {
  TileGeometry geo;
  geo.seqlen_q = p.seqlen_q;
  geo.seqlen_k = p.seqlen_k;
  geo.block_m = Cfg::kBlockM;
  geo.block_n = Cfg::kBlockN;
  geo.causal = Cfg::Is_causal;
  int64_t steps = 0;
  for (int n = 0; n < geo.num_n_blocks(); ++n) { steps += max_int(geo.m_end(n) - geo.m_begin(n), 0); }
  return steps * p.num_heads * p.batch;
}

namespace {

char const* dtype_name(DType t) { return t == DType::kBFloat16 ? "bfloat16" : "float16"; }

bool hdim_built(int d) {
#define DASH_HDIM_CASE(D, T, E) \
  if (d == D) return true;
  DASH_FOR_EACH_BUILT_UNIT(DASH_HDIM_CASE)
#undef DASH_HDIM_CASE
  return false;
}

bool dtype_built(DType t) {
#define DASH_DTYPE_CASE(D, T, E) \
  if (t == DType::E) return true;
  DASH_FOR_EACH_BUILT_UNIT(DASH_DTYPE_CASE)
#undef DASH_DTYPE_CASE
  return false;
}

[[noreturn]] void not_built(BwdParams const& p) {
  throw std::invalid_argument(not_built_message("backward", p.head_dim, p.dtype));
}

// f(BwdTileConfig<head_dim, causal>{}) for p's head dim and mask, over every head dim of the
// config table (DASH_FOR_EACH_HEAD_DIM), so that a head dim added there needs no case here.
template <class F>
auto with_tile_config(BwdParams const& p, F&& f) {
#define DASH_HDIM_CONFIG(D) \
  if (p.head_dim == D) return p.causal ? f(BwdTileConfig<D, true>{}) : f(BwdTileConfig<D, false>{});
  DASH_FOR_EACH_HEAD_DIM(DASH_HDIM_CONFIG)
#undef DASH_HDIM_CONFIG
  not_built(p);
}

}  // namespace

std::string not_built_message(char const* pass, int head_dim, DType dtype) {
  return std::string("DASH ") + pass + ": head_dim=" + std::to_string(head_dim) + " with dtype " + dtype_name(dtype) +
         " is not built; built head dims: " + bwd_built_head_dims() + "; built dtypes: " + bwd_built_dtypes() +
         " (set DASH_HDIMS / DASH_DTYPES when building to add)";
}

bool bwd_is_built(int head_dim, DType dtype) {
#define DASH_UNIT_CASE(D, T, E) \
  if (head_dim == D && dtype == DType::E) return true;
  DASH_FOR_EACH_BUILT_UNIT(DASH_UNIT_CASE)
#undef DASH_UNIT_CASE
  return false;
}

std::string bwd_built_head_dims() {
  std::string s;
  for (int d : kSupportedHeadDims) {
    if (hdim_built(d)) { s += (s.empty() ? "" : ", ") + std::to_string(d); }
  }
  return s.empty() ? "none" : s;
}

std::string bwd_built_dtypes() {
  std::string s;
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    if (dtype_built(t)) { s += (s.empty() ? "" : ", ") + std::string(dtype_name(t)); }
  }
  return s.empty() ? "none" : s;
}

BwdWorkspaceSizes bwd_workspace_sizes(BwdParams const& p) {
  return with_tile_config(p, [&](auto cfg) { return bwd_workspace_sizes_for<decltype(cfg)>(p); });
}

namespace {
size_t round_up_16B(size_t words) { return (words + 3) / 4 * 4; }  // 4-byte words
}  // namespace

size_t bwd_workspace_bytes(BwdParams const& p) {
  BwdWorkspaceSizes const ws = bwd_workspace_sizes(p);
  return 4 * (round_up_16B(ws.lse_log2_floats) + round_up_16B(ws.dpsum_floats) + round_up_16B(ws.dq_accum_floats) +
              round_up_16B(ws.semaphore_ints) + round_up_16B(ws.counter_ints) + round_up_16B(ws.live_column_ints));
}

void bwd_set_workspace(BwdParams& p, void* workspace) {
  BwdWorkspaceSizes const ws = bwd_workspace_sizes(p);
  float* base = static_cast<float*>(workspace);
  p.lse_log2 = base;
  base += round_up_16B(ws.lse_log2_floats);
  p.dpsum = base;
  base += round_up_16B(ws.dpsum_floats);
  p.dq_accum = base;
  base += round_up_16B(ws.dq_accum_floats);
  p.dq_semaphore = reinterpret_cast<int*>(base);
  base += round_up_16B(ws.semaphore_ints);
  p.counters = reinterpret_cast<int*>(base);
  base += round_up_16B(ws.counter_ints);
  p.live_columns = ws.live_column_ints > 0 ? reinterpret_cast<int*>(base) : nullptr;
}

int bwd_block_n(BwdParams const& p) {
  return with_tile_config(p, [](auto cfg) { return int(decltype(cfg)::kBlockN); });
}

bool bwd_dkv_ordered(BwdParams const& p) {
  return with_tile_config(p, [&](auto cfg) { return dkv_ordered_for(decltype(cfg)::kNondetdKVChainsMaxGroup, p); });
}

int bwd_dkv_chains(BwdParams const& p) {
  return with_tile_config(p, [&](auto cfg) {
    using Cfg = decltype(cfg);
    return dkv_chains_for(Cfg::kdKVChains, Cfg::kNondetdKVChainsMaxGroup, p);
  });
}

int64_t bwd_trace_steps(BwdParams const& p) {
  return with_tile_config(p, [&](auto cfg) { return bwd_trace_steps_for<decltype(cfg)>(p); });
}

void run_bwd(BwdParams const& p, cudaStream_t stream) {
#define DASH_RUN_CASE(D, T, E) \
  if (p.head_dim == D && p.dtype == DType::E) return run_bwd_hdim<D, T>(p, stream);
  DASH_FOR_EACH_BUILT_UNIT(DASH_RUN_CASE)
#undef DASH_RUN_CASE
  not_built(p);
}

}  // namespace dash
