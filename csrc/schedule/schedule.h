// Schedules of the persistent backward: which CTA runs which column, in which order a
// column visits its Q tiles, and each contribution's turn in the dQ accumulation order.
//
// This header is the C++ twin of dash/schedules (the Python scheduling model is the
// specification). It is plain C++ usable on host and device, with no CUDA or CuTe
// dependency, so that tests/test_kernel_schedule_matches_model.py can compile it with a
// host compiler and compare every number against the model.
//
// Vocabulary (per batch b and query head h):
//   column n   = KV tile n (kBlockN keys), n in [0, N)
//   Q tile m   = kBlockM query rows, m in [0, M)
//   turn(m, n) = how many contributions to dQ tile m must have landed before column n's
//                contribution is added (equality wait on the tile's semaphore).
#pragma once

#if defined(__CUDACC__)
#define DASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DASH_HOST_DEVICE inline
#endif

namespace dash {

DASH_HOST_DEVICE int ceil_div_int(int a, int b) { return (a + b - 1) / b; }
DASH_HOST_DEVICE int min_int(int a, int b) { return a < b ? a : b; }
DASH_HOST_DEVICE int max_int(int a, int b) { return a > b ? a : b; }
// Floor division for a possibly negative numerator and a positive divisor.
DASH_HOST_DEVICE int floor_div_int(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Tile ranges of one (batch, head) problem under a full or a causal mask. Causal uses
// FA3's bottom-right alignment: query i sees key j iff j <= i + seqlen_k - seqlen_q.
struct TileGeometry {
  int seqlen_q = 0, seqlen_k = 0;
  int block_m = 0, block_n = 0;
  bool causal = false;

  DASH_HOST_DEVICE int num_m_blocks() const { return ceil_div_int(seqlen_q, block_m); }
  DASH_HOST_DEVICE int num_n_blocks() const { return ceil_div_int(seqlen_k, block_n); }

  // Column n contributes to Q tiles [m_begin(n), m_end(n)).
  DASH_HOST_DEVICE int m_begin(int n) const {
    if (!causal) return 0;
    // First query row that sees key n*block_n is n*block_n - (seqlen_k - seqlen_q).
    int const first_row = n * block_n + seqlen_q - seqlen_k;
    return min_int(max_int(floor_div_int(first_row, block_m), 0), num_m_blocks());
  }
  DASH_HOST_DEVICE int m_end(int /*n*/) const { return num_m_blocks(); }

  // Q tile m receives contributions from columns [0, n_end(m)).
  DASH_HOST_DEVICE int n_end(int m) const {
    if (!causal) return num_n_blocks();
    // Last key seen by the tile's last row is (m+1)*block_m - 1 + seqlen_k - seqlen_q.
    int const keys_seen = (m + 1) * block_m + seqlen_k - seqlen_q;
    return min_int(max_int(ceil_div_int(max_int(keys_seen, 0), block_n), 0), num_n_blocks());
  }

  // Whether tile (m, n) has any (query, key) pair that must be masked: a key tail
  // beyond seqlen_k, or (causal) keys right of the diagonal for some row of the tile.
  DASH_HOST_DEVICE bool needs_mask(int m, int n) const {
    bool const key_tail = (n + 1) * block_n > seqlen_k;
    if (!causal) return key_tail;
    int const last_key = (n + 1) * block_n - 1;
    int const first_row_limit = m * block_m + seqlen_k - seqlen_q;  // keys <= this are visible to row m*block_m
    return key_tail || last_key > first_row_limit;
  }
};

struct ColumnCoord {
  int n = 0, h = 0, b = 0;
};

// A schedule is a policy type the kernel is templated on. It provides:
//   TileGeometry geo;                        the tile ranges it schedules
//   int num_columns() const;                 work items (columns) in the problem
//   static constexpr bool kClaimed;          true: after its first item (its CTA index) a CTA
//                                            claims the next item id from a global counter;
//                                            false: CTA x runs item(x, 0), item(x, 1), ...
//   int item(int cta, int k) const;          (static schedules) the k-th item of CTA cta
//   ColumnCoord column(int item) const;      which column an item is
//   int num_steps(ColumnCoord) const;        Q tiles the column visits
//   int m_block(ColumnCoord, int step) const the step-th Q tile it visits
//   int turn(ColumnCoord, int m) const;      its turn in dQ tile m's accumulation order
// The mainloop only ever calls these; the Python model (dash.schedules) is the spec.

// FA3's schedule on a persistent grid.
//
// Work items are columns with linear id L = k + N*(h + H*b), claimed in increasing L:
// CTA x starts with item x, then each CTA claims the next unclaimed item (an atomic
// counter) whenever its producer is ready for more work. That greedy claiming is what
// the hardware block dispatcher does for FA3's one-CTA-per-column grid; a static
// round-robin instead correlates column lengths with CTAs (e.g. N = 128, 132 CTAs) and
// unbalances causal problems. Item L is column n = k (ascending), or n = N-1-k when
// shortest_first (FA3's "SPT" order for causal deterministic, which matches its
// descending dQ turns). Each column visits its Q tiles in ascending order.
//
// Turns: full mask, turn(m, n) = n (ascending column order). Causal,
// turn(m, n) = n_end(m) - 1 - n (descending). The accumulation order depends on (m, n)
// only, not on which CTA runs a column, so the bits are independent of the grid size.
// Every wait points to a column with a smaller L; items are claimed in increasing L, so
// the smallest unfinished item is held by a running CTA and never waits: deadlock-free for
// any number of CTAs.
struct Fa3Schedule {
  static constexpr bool kClaimed = true;
  TileGeometry geo;
  int num_heads = 0, num_batch = 0;
  bool shortest_first = false;
  bool descending_turns = false;  // causal: turn = n_end(m) - 1 - n

  DASH_HOST_DEVICE int num_columns() const { return geo.num_n_blocks() * num_heads * num_batch; }
  DASH_HOST_DEVICE int item(int cta, int /*k*/) const { return cta; }  // claimed: only the first is static
  DASH_HOST_DEVICE ColumnCoord column(int L) const {
    int const N = geo.num_n_blocks();
    int const k_in_head = L % N;
    int const hb = L / N;
    ColumnCoord c;
    c.n = shortest_first ? N - 1 - k_in_head : k_in_head;
    c.h = hb % num_heads;
    c.b = hb / num_heads;
    return c;
  }
  DASH_HOST_DEVICE int num_steps(ColumnCoord c) const { return max_int(geo.m_end(c.n) - geo.m_begin(c.n), 0); }
  DASH_HOST_DEVICE int m_block(ColumnCoord c, int step) const { return geo.m_begin(c.n) + step; }
  DASH_HOST_DEVICE int turn(ColumnCoord c, int m) const {
    return descending_turns ? geo.n_end(m) - 1 - c.n : c.n;
  }
};

// FA3's deterministic order for a problem: shortest-first columns and descending turns
// under a causal mask, ascending otherwise. Non-deterministic runs use the same
// assignment without shortest-first (longest columns first balances the tail better).
DASH_HOST_DEVICE Fa3Schedule make_fa3_schedule(TileGeometry geo, int num_heads, int num_batch, bool deterministic) {
  Fa3Schedule s;
  s.geo = geo;
  s.num_heads = num_heads;
  s.num_batch = num_batch;
  s.shortest_first = geo.causal && deterministic;
  s.descending_turns = geo.causal;
  return s;
}

}  // namespace dash
