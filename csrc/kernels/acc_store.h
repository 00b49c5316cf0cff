// Store a WGMMA accumulator fragment to global memory as 16-byte row segments.
//
// In a 64xN WGMMA accumulator, lane l of a warp holds, for every 8-column group j, the two
// adjacent columns 8j + 2(l%4) + {0,1} of rows r and r+8. Stored directly that is one
// 4-byte store per pair, half-filled sectors and N/2 store instructions per row pair. A
// 4x4 transpose among the four lanes of a quad (shuffles) gives each lane all eight
// columns of one group instead: one 16-byte store per group, full sectors, 4x fewer
// instructions. Used by the dK/dV epilogue and the dQ convert kernel.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "kernels/ptx.h"

namespace dash {

namespace detail {

template <class Element>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  cutlass::Array<float, 2> in;
  in[0] = a;
  in[1] = b;
  cutlass::Array<Element, 2> out = convert(in);
  return *reinterpret_cast<uint32_t const*>(&out);
}

}  // namespace detail

// The layout both helpers below assume: `coords` is a WGMMA accumulator partition
// ((2, 2, V), MMA_M, MMA_N) with a single atom per warpgroup along M and N, so a thread
// holds exactly two rows (r and r + 8) and, per 8-column group, two adjacent columns.
template <class Coords>
__device__ __forceinline__ constexpr void check_one_atom_per_warpgroup() {
  using namespace cute;
  static_assert(rank_v<Coords> == 3, "expects a WGMMA accumulator partition ((2,2,V), MMA_M, MMA_N)");
  static_assert(size<1>(Coords{}) == 1 && size<2>(Coords{}) == 1,
                "one WGMMA atom per warpgroup: each thread holds rows r and r+8 only");
}

// acc(i): this thread's accumulator values in the WGMMA order i = col_pair + 2*row_half +
// 4*col_group. coords(i): their (row, col) in the tile. Stores scale * value as Element
// at base[(row_offset + row) * row_stride + col] for rows with row_offset + row < row_limit.
template <class Element, class Frag, class Coords>
__device__ __forceinline__ void store_acc_rows_16B(Frag const& acc, Coords const& coords, float scale, Element* base,
                                                   int64_t row_stride, int row_offset, int row_limit) {
  using namespace cute;
  check_one_atom_per_warpgroup<Coords>();
  constexpr int kValues = decltype(size(acc))::value;
  constexpr int kGroups = kValues / 4;  // 8-column groups per row
  static_assert(kValues % 16 == 0, "needs a multiple of 4 column groups");
  int const lane_in_quad = threadIdx.x % 4;
  bool const upper_pair = (lane_in_quad & 2) != 0;
  bool const odd_lane = (lane_in_quad & 1) != 0;
  int const row0 = row_offset + get<0>(coords(0));
  int const col0 = get<1>(coords(0)) - 2 * lane_in_quad;  // column of group 0 for this quad
  CUTLASS_PRAGMA_UNROLL
  for (int row_half = 0; row_half < 2; ++row_half) {
    int const row = row0 + 8 * row_half;
    CUTLASS_PRAGMA_UNROLL
    for (int block = 0; block < kGroups / 4; ++block) {
      // pairs[b]: my two columns of group 4*block + b.
      uint32_t pairs[4];
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < 4; ++b) {
        int const i = 4 * (4 * block + b) + 2 * row_half;
        pairs[b] = detail::pack2<Element>(acc(i) * scale, acc(i + 1) * scale);
      }
      // A 4x4 transpose among the quad's lanes (M[lane][group] -> lane c holds M[k][c] as its
      // element k: columns 2k, 2k+1 of group 4*block + c), in two exchange stages with fixed
      // partners (lane ^ 2, then lane ^ 1), so that every select tests one of two predicates
      // computed once instead of a lane-dependent index (a dynamic-index select costs three
      // compares and three selects per word; the dK/dV epilogue ran 985 instructions per
      // column, kernel notes, tenth pass).
      uint32_t seg[4] = {pairs[0], pairs[1], pairs[2], pairs[3]};
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 2; ++j) {  // lanes c < 2 keep groups {0,1}, lanes c >= 2 groups {2,3}
        uint32_t const got = __shfl_xor_sync(0xffffffff, upper_pair ? seg[j] : seg[j + 2], 2);
        seg[j] = upper_pair ? got : seg[j];
        seg[j + 2] = upper_pair ? seg[j + 2] : got;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 2; ++i) {  // then swap within each pair of lanes
        uint32_t const got = __shfl_xor_sync(0xffffffff, odd_lane ? seg[2 * i] : seg[2 * i + 1], 1);
        seg[2 * i] = odd_lane ? got : seg[2 * i];
        seg[2 * i + 1] = odd_lane ? seg[2 * i + 1] : got;
      }
      if (row < row_limit) {
        int const col = col0 + 8 * (4 * block + lane_in_quad);
        *reinterpret_cast<uint4*>(base + int64_t(row) * row_stride + col) = make_uint4(seg[0], seg[1], seg[2], seg[3]);
      }
    }
  }
}

// The fragment's part of a sum in fp32 held in global memory, for rows row_offset + row below
// row_limit (one element per value acc(i), at base[(row_offset + row) * row_stride + col]): a
// plain 8-byte store per adjacent column pair (store: the first contribution) or an 8-byte
// atomic add (red.global.add.v2.f32, a generic-proxy atomic). Each element receives one write
// per call, so a sum built by such calls depends only on their order. (One loop for both: as two
// instantiations, their address arithmetic, hoisted out of the backward's persistent loop,
// spilled.)
template <class Frag, class Coords>
__device__ __forceinline__ void write_acc_rows_f32(Frag const& acc, Coords const& coords, float scale, float* base,
                                                   int64_t row_stride, int row_offset, int row_limit, bool store) {
  using namespace cute;
  check_one_atom_per_warpgroup<Coords>();
  constexpr int kValues = decltype(size(acc))::value;
  static_assert(kValues % 2 == 0);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kValues; i += 2) {
    int const row = row_offset + get<0>(coords(i));
    if (row < row_limit) {
      float* const dst = base + int64_t(row) * row_stride + get<1>(coords(i));
      if (store) {
        ptx::st_v2_f32(dst, acc(i) * scale, acc(i + 1) * scale);
      } else {
        ptx::red_add_v2_f32(dst, acc(i) * scale, acc(i + 1) * scale);
      }
    }
  }
}

// acc(i) = ((scale * acc(i) + copy 0) + copy 1) + ... + copy (chains - 1), copy c the fp32 sum
// at base + c * chain_stride + (row_offset + row) * row_stride + col; every rounding explicit
// (__fmul_rn, __fadd_rn: never contracted into an FMA). Rows at or past row_limit read the
// last row below it instead (in bounds, branch-free) and must not be stored by the caller
// (row_limit > row_offset). The loads read through L2 (ld.global.cg): other SMs wrote the
// copies, the caller acquired them.
// Each pass of the loop below loads half of the fragment's pairs of one copy, in a branch of its
// own: the compiler issues a pass's loads together but cannot hoist the next pass's above this
// pass's adds. (Unrolled over both halves, every load of a copy went out at once and held 64
// registers beside both 64-value fragments: the backward's persistent state spilled.)
template <class Frag, class Coords>
__device__ __forceinline__ void add_acc_copies_f32(Frag& acc, Coords const& coords, float scale, float const* base,
                                                   int64_t row_stride, int64_t chain_stride, int chains,
                                                   int row_offset, int row_limit) {
  using namespace cute;
  check_one_atom_per_warpgroup<Coords>();
  constexpr int kValues = decltype(size(acc))::value;
  static_assert(kValues % 4 == 0);
  constexpr int kHalf = kValues / 2;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kValues; ++i) { acc(i) = __fmul_rn(acc(i), scale); }
  auto add_pairs = [&](float const* copy, auto first) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = decltype(first)::value; i < decltype(first)::value + kHalf; i += 2) {
      int const row = min(row_offset + get<0>(coords(i)), row_limit - 1);
      float2 const v = __ldcg(reinterpret_cast<float2 const*>(copy + int64_t(row) * row_stride + get<1>(coords(i))));
      acc(i) = __fadd_rn(acc(i), v.x);
      acc(i + 1) = __fadd_rn(acc(i + 1), v.y);
    }
  };
#pragma unroll 1
  for (int pass = 0; pass < 2 * chains; ++pass) {
    float const* const copy = base + (pass >> 1) * chain_stride;
    if (pass & 1) {
      add_pairs(copy, Int<kHalf>{});
    } else {
      add_pairs(copy, Int<0>{});
    }
  }
}

}  // namespace dash
