// Building blocks the forward and backward mainloops share: WGMMA issue of one tiled GEMM,
// the accumulator -> register-A reinterpretation, the MUFU exp2 and its FMA-pipe twin, and
// the position of a pipeline (stage index + the parity of its current use).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_conversion.h>

namespace dash {

using namespace cute;

// Position in a kStages-deep mbarrier pipeline: which stage, and the parity of its current
// use (flips each time the stage index wraps). Producer and consumers each keep one and
// advance it once per stage they fill / drain, so both sides agree on (index, phase).
template <int kStages>
struct PipelineState {
  int index = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
};

// True when one WGMMA instruction of TiledMma spans N columns. CuTe's op selectors take the
// widest instruction whose N divides the tile's. Without CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
// they offer only N = 256, 192, 128, 96, 64, 32, 16, 8 (16-bit inputs), so a tile of another
// width (80, 176, ...) silently becomes several narrower instructions per K step (176: eleven
// 16-wide ones; a 128 x 176 forward tile ran 28 % slower so, kernel notes, third and eighth
// passes). Every tiled GEMM of the kernels asserts this; the generated translation units
// define that macro (dash/config.py, render_instantiations) for the 80-row backward tile.
template <class TiledMma, int N>
inline constexpr bool kOneWgmmaWide = decltype(size<1>(typename TiledMma::AtomShape_MNK{}))::value == N;

namespace detail {

// 2^x with the MUFU unit; ex2.approx(-inf) = +0, which is how masked scores vanish.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA and integer pipes instead of MUFU, for softmax exponents x <= 0 (-inf, and
// anything at or below -127, gives +0 as ex2.approx.ftz does): x = j + f with j = round(x)
// through the 1.5 * 2^23 shifter (exact: x - j is representable), 2^f on [-0.5, 0.5] by a degree-3
// polynomial (minimax in relative error with the constant term 1: 1.0e-4, a twentieth of a
// bf16 ulp; P and dS are rounded to bf16/fp16 for their GEMMs), j added to the exponent
// field (unsigned: only the low 9 bits of t's pattern, j mod 512, survive the shift). At
// x = -127 the polynomial is exactly 1 and the sum wraps to +0; in (-127, -126) the result is
// a subnormal below 2^-126 (ex2.approx.ftz: +0), nothing at bf16/fp16 or beside 2^-126. A NaN
// exponent gives +0 here (fmaxf drops it) where MUFU gives NaN; the NaN still reaches the
// gradients through the lanes on MUFU and through dP. 9 instructions instead of one
// MUFU.EX2, which a warp occupies for 8 cycles.
__device__ __forceinline__ float exp2_fma(float x) {
  x = fmaxf(x, -127.f);
  float const shifter = 12582912.f;  // 1.5 * 2^23: x + shifter keeps round(x) in the low mantissa bits
  float const t = x + shifter;
  float const f = x - (t - shifter);
  float const p = fmaf(fmaf(fmaf(0.05500858f, f, 0.24221037f), f, 0.6932829f), f, 1.f);
  return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));  // + j << 23 (mod 2^32)
}

// Exponential i of an unrolled loop (i a compile-time constant there): on the FMA pipe when
// it is the last of each group of Every (Every = 0: always MUFU), so that both pipes work.
template <int Every>
__device__ __forceinline__ float exp2_split(float x, int i) {
  if constexpr (Every > 0) {
    if (i % Every == Every - 1) { return exp2_fma(x); }
  }
  return exp2_approx(x);
}

// Issue the WGMMAs of one tiled GEMM over all K blocks as one commit group.
// A_in_regs: the A operand is a register fragment (RS WGMMA), which must be fenced so
// the compiler does not reuse those registers while the asynchronous WGMMA reads them.
template <bool ZeroInit, bool A_in_regs, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_gemm(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  if constexpr (A_in_regs) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (ZeroInit) { tiled_mma.accumulate_ = GMMA::ScaleOut::Zero; }
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tCrC);
  if constexpr (A_in_regs) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
}

// Reinterpret a WGMMA accumulator layout ((2,2,V),M,N) as the register-A layout
// ((2,2,2),M,(V/2,N)) of the next GEMM, whose K dim is this accumulator's N dim: a k16
// block of A covers two consecutive 8-column groups of the accumulator.
template <class AccLayout>
__device__ __forceinline__ auto acc_layout_as_A_regs(AccLayout acc) {
  auto v = flatten(logical_divide(get<0, 2>(acc), Shape<_2>{}));  // (2, V/2)
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0>(v)), get<1>(acc),
                     make_layout(get<1>(v), get<2>(acc)));
}

// Converts a float fragment to Element with one vectorised converter call.
template <class Element, class Frag>
__device__ __forceinline__ auto convert_fragment(Frag const& in) {
  auto out = make_tensor_like<Element>(in);
  constexpr int N = decltype(size(in))::value;
  cutlass::NumericArrayConverter<Element, float, N> convert;
  *reinterpret_cast<cutlass::Array<Element, N>*>(out.data()) =
      convert(*reinterpret_cast<cutlass::Array<float, N> const*>(in.data()));
  return out;
}

}  // namespace detail
}  // namespace dash
