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

// v[idx] for a lane-dependent idx in [0, 4) without indexing registers at run time
// (which would move the array to local memory).
__device__ __forceinline__ uint32_t select4(uint32_t const (&v)[4], int idx) {
  uint32_t r = v[0];
  r = idx == 1 ? v[1] : r;
  r = idx == 2 ? v[2] : r;
  r = idx == 3 ? v[3] : r;
  return r;
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
  int const quad_base = (threadIdx.x % 32) & ~3;
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
      // After the transpose, lane c holds group 4*block + c: element k of it (columns
      // 2k, 2k+1) comes from quad lane k.
      uint32_t recv[4];
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < 4; ++s) {
        // Lane c sends its pair of group (c + s) % 4 to lane (c + s) % 4 and receives from
        // lane (c - s) % 4 that lane's pair of group c.
        uint32_t const send = detail::select4(pairs, (lane_in_quad + s) & 3);
        recv[s] = __shfl_sync(0xffffffff, send, quad_base + ((lane_in_quad - s) & 3));
      }
      uint32_t seg[4];
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 4; ++k) { seg[k] = detail::select4(recv, (lane_in_quad - k) & 3); }
      if (row < row_limit) {
        int const col = col0 + 8 * (4 * block + lane_in_quad);
        *reinterpret_cast<uint4*>(base + int64_t(row) * row_stride + col) = make_uint4(seg[0], seg[1], seg[2], seg[3]);
      }
    }
  }
}

// base[(row_offset + row) * row_stride + col] += scale * acc(i) in fp32, for rows below
// row_limit: one 8-byte atomic add (red.global.add.v2.f32) per adjacent column pair. Each
// element receives one add per call, so the result depends only on the order of the calls.
template <class Frag, class Coords>
__device__ __forceinline__ void red_add_acc_rows_f32(Frag const& acc, Coords const& coords, float scale, float* base,
                                                     int64_t row_stride, int row_offset, int row_limit) {
  using namespace cute;
  check_one_atom_per_warpgroup<Coords>();
  constexpr int kValues = decltype(size(acc))::value;
  static_assert(kValues % 2 == 0);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kValues; i += 2) {
    int const row = row_offset + get<0>(coords(i));
    if (row < row_limit) {
      ptx::red_add_v2_f32(base + int64_t(row) * row_stride + get<1>(coords(i)), acc(i) * scale, acc(i + 1) * scale);
    }
  }
}

}  // namespace dash
