// Dispatch from runtime (head dim, dtype) to the forward translation units this build
// compiled (the DASH_BUILD_HDIM<d> / DASH_BUILD_<DTYPE> macros, as for the backward).
#include "fwd_api.h"

#include <stdexcept>
#include <string>

#include "bwd_api.h"  // bwd_is_built / bwd_built_*: the (head dim, dtype) set both passes share

namespace cutlass {
struct bfloat16_t;
struct half_t;
}  // namespace cutlass

namespace dash {

template <int kHeadDim, class Element>
void run_fwd_hdim(FwdParams const& params, cudaStream_t stream);

void run_fwd(FwdParams const& p, cudaStream_t stream) {
  if (!bwd_is_built(p.head_dim, p.dtype)) {
    throw std::invalid_argument("DASH forward: head_dim=" + std::to_string(p.head_dim) + " with dtype " +
                                (p.dtype == DType::kBFloat16 ? "bfloat16" : "float16") +
                                " is not built; built head dims: " + bwd_built_head_dims() +
                                "; built dtypes: " + bwd_built_dtypes() +
                                " (set DASH_HDIMS / DASH_DTYPES when building to add)");
  }
  bool const bf16 = p.dtype == DType::kBFloat16;
  (void)bf16;
  switch (p.head_dim) {
#ifdef DASH_BUILD_HDIM64
    case 64:
#ifdef DASH_BUILD_BF16
      if (bf16) return run_fwd_hdim<64, cutlass::bfloat16_t>(p, stream);
#endif
#ifdef DASH_BUILD_FP16
      if (!bf16) return run_fwd_hdim<64, cutlass::half_t>(p, stream);
#endif
      break;
#endif
#ifdef DASH_BUILD_HDIM128
    case 128:
#ifdef DASH_BUILD_BF16
      if (bf16) return run_fwd_hdim<128, cutlass::bfloat16_t>(p, stream);
#endif
#ifdef DASH_BUILD_FP16
      if (!bf16) return run_fwd_hdim<128, cutlass::half_t>(p, stream);
#endif
      break;
#endif
    default: break;
  }
  throw std::logic_error("DASH forward: head_dim=" + std::to_string(p.head_dim) + " passed the build check but has no "
                         "dispatch case");
}

}  // namespace dash
