// Host-only probe of the kernel dispatch (csrc/{fwd,bwd}_dispatch.cpp, compiled beside this
// file against a generated dispatch.h): stand-ins for the per-unit entry points record which
// (pass, head dim, element type) the dispatch picked. Loaded by tests/test_dispatch.py.
#include <stdexcept>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "kernels/bwd_params.h"
#include "kernels/fwd_params.h"

namespace cutlass {
struct bfloat16_t {};
struct half_t {};
}  // namespace cutlass

namespace dash {

int g_last_unit = 0;

template <int kHeadDim, class Element>
constexpr int unit_code(int pass) {
  return pass * 1000 + kHeadDim * 10 + (std::is_same<Element, cutlass::bfloat16_t>::value ? 1 : 2);
}

template <int kHeadDim, class Element>
void run_bwd_hdim(BwdParams const&, cudaStream_t) {
  g_last_unit = unit_code<kHeadDim, Element>(2);
}

template <int kHeadDim, class Element>
void run_fwd_hdim(FwdParams const&, cudaStream_t) {
  g_last_unit = unit_code<kHeadDim, Element>(1);
}

template void run_bwd_hdim<64, cutlass::bfloat16_t>(BwdParams const&, cudaStream_t);
template void run_bwd_hdim<64, cutlass::half_t>(BwdParams const&, cudaStream_t);
template void run_bwd_hdim<128, cutlass::bfloat16_t>(BwdParams const&, cudaStream_t);
template void run_bwd_hdim<128, cutlass::half_t>(BwdParams const&, cudaStream_t);
template void run_fwd_hdim<64, cutlass::bfloat16_t>(FwdParams const&, cudaStream_t);
template void run_fwd_hdim<64, cutlass::half_t>(FwdParams const&, cudaStream_t);
template void run_fwd_hdim<128, cutlass::bfloat16_t>(FwdParams const&, cudaStream_t);
template void run_fwd_hdim<128, cutlass::half_t>(FwdParams const&, cudaStream_t);

void run_bwd(BwdParams const& params, cudaStream_t stream);
void run_fwd(FwdParams const& params, cudaStream_t stream);
bool bwd_is_built(int head_dim, DType dtype);

}  // namespace dash

// pass 1 = forward, 2 = backward; dtype 0 = bf16, 1 = fp16. Returns the unit the dispatch ran
// (pass*1000 + head_dim*10 + 1 for bf16 / 2 for fp16), or -1 when it refused (not built).
extern "C" int probe_dispatch(int pass, int head_dim, int dtype) {
  dash::g_last_unit = 0;
  dash::DType const t = dtype == 0 ? dash::DType::kBFloat16 : dash::DType::kFloat16;
  try {
    if (pass == 1) {
      dash::FwdParams p;
      p.head_dim = head_dim;
      p.dtype = t;
      dash::run_fwd(p, nullptr);
    } else {
      dash::BwdParams p;
      p.head_dim = head_dim;
      p.dtype = t;
      dash::run_bwd(p, nullptr);
    }
  } catch (std::invalid_argument const&) {
    return -1;
  }
  return dash::g_last_unit;
}

extern "C" int probe_is_built(int head_dim, int dtype) {
  return dash::bwd_is_built(head_dim, dtype == 0 ? dash::DType::kBFloat16 : dash::DType::kFloat16) ? 1 : 0;
}

namespace dash {
int bwd_block_n(BwdParams const& p);
int64_t bwd_trace_steps(BwdParams const& p);
}  // namespace dash

// The host sizing functions' tile shape for a head dim and mask: kBlockN (what the GQA dK/dV
// semaphores are sized with), or -1 when the head dim has no tile config.
extern "C" int probe_block_n(int head_dim, int causal) {
  dash::BwdParams p;
  p.head_dim = head_dim;
  p.causal = causal != 0;
  try {
    return dash::bwd_block_n(p);
  } catch (std::invalid_argument const&) {
    return -1;
  }
}

// Steps of the backward's trace (every (column, Q tile) pair the mask keeps), batch = heads = 1.
extern "C" long long probe_trace_steps(int head_dim, int causal, int seqlen_q, int seqlen_k) {
  dash::BwdParams p;
  p.head_dim = head_dim;
  p.causal = causal != 0;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.batch = 1;
  p.num_heads = 1;
  try {
    return dash::bwd_trace_steps(p);
  } catch (std::invalid_argument const&) {
    return -1;
  }
}
