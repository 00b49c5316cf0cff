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
//
// Deadlock freedom of every schedule below assumes that all CTAs of the grid are resident
// at once (a wait may point to a column another CTA holds). The launch guarantees it: the
// persistent grid is launched cooperatively, which the driver refuses when the CTAs cannot
// all be co-resident (bwd_launch.h).
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

// Tile sizes of a geometry: run-time values (host code, the schedule probe) or compile-time
// constants (the kernels: every division by a tile size becomes a multiply-shift, which
// the dQ writer's 24 registers and every step of every role feel).
struct RuntimeBlocks {
  int block_m = 0, block_n = 0;
};
template <int kBlockM, int kBlockN>
struct StaticBlocks {
  static constexpr int block_m = kBlockM;
  static constexpr int block_n = kBlockN;
};

// Tile ranges of one (batch, head) problem under a full or a causal mask. Causal uses
// FA3's bottom-right alignment: query i sees key j iff j <= i + seqlen_k - seqlen_q.
template <class Blocks>
struct TileGeometryT : Blocks {
  int seqlen_q = 0, seqlen_k = 0;
  bool causal = false;

  DASH_HOST_DEVICE int num_m_blocks() const { return ceil_div_int(seqlen_q, this->block_m); }
  DASH_HOST_DEVICE int num_n_blocks() const { return ceil_div_int(seqlen_k, this->block_n); }

  // Column n contributes to Q tiles [m_begin(n), m_end(n)).
  DASH_HOST_DEVICE int m_begin(int n) const {
    if (!causal) return 0;
    // First query row that sees key n*block_n is n*block_n - (seqlen_k - seqlen_q).
    int const first_row = n * this->block_n + seqlen_q - seqlen_k;
    return min_int(max_int(floor_div_int(first_row, this->block_m), 0), num_m_blocks());
  }
  DASH_HOST_DEVICE int m_end(int /*n*/) const { return num_m_blocks(); }

  // Q tile m receives contributions from columns [0, n_end(m)).
  DASH_HOST_DEVICE int n_end(int m) const {
    if (!causal) return num_n_blocks();
    // Last key seen by the tile's last row is (m+1)*block_m - 1 + seqlen_k - seqlen_q.
    int const keys_seen = (m + 1) * this->block_m + seqlen_k - seqlen_q;
    return min_int(max_int(ceil_div_int(max_int(keys_seen, 0), this->block_n), 0), num_n_blocks());
  }

  // Whether tile (m, n) has any (query, key) pair that must be masked: a key tail
  // beyond seqlen_k, or (causal) keys right of the diagonal for some row of the tile.
  DASH_HOST_DEVICE bool needs_mask(int m, int n) const {
    bool const key_tail = (n + 1) * this->block_n > seqlen_k;
    if (!causal) return key_tail;
    int const last_key = (n + 1) * this->block_n - 1;
    int const first_row_limit = m * this->block_m + seqlen_k - seqlen_q;  // keys <= this are visible to row m*block_m
    return key_tail || last_key > first_row_limit;
  }

  // The same geometry with other (e.g. compile-time) tile sizes.
  template <class OtherBlocks>
  DASH_HOST_DEVICE TileGeometryT<OtherBlocks> with_blocks() const {
    TileGeometryT<OtherBlocks> g;
    g.seqlen_q = seqlen_q;
    g.seqlen_k = seqlen_k;
    g.causal = causal;
    return g;
  }
};

using TileGeometry = TileGeometryT<RuntimeBlocks>;

// Heads per L2 section of the interleaved claim orders. The budget: every column reads all of
// the head's Q and dO tiles (bf16) and reduce-adds into all of its fp32 dQaccum tiles.
//
// Under a full mask (full_mask_q_tiles = M, the Q tiles of every column; 0 under a causal
// mask) the width is also capped at the largest power of two <= kSectionStaggerClaims / M.
// Columns of one head are claimed `section_heads` items apart; on P CTAs that each finish a
// column every M steps, claims come P / M per step, so consecutive columns of a head start
// about section_heads * M / P steps apart. Two steps are enough for a deterministic run's
// column n to reach each dQ tile after column n-1 has added there; a wider section only
// keeps more heads in flight: at hdim 128 full 512 (M = 7) the uncapped 64 heads read 1.75x
// the DRAM bytes of FA3's order on an H100 (ncu, 2026-12-06) and ran 0.82x as fast
// deterministically; capped at 32, 1.03x (0.98x the non-deterministic backward).
// kSectionStaggerClaims = 2 steps * 132 CTAs (the H100/H200 SXM grid) keeps the width a
// function of the shape alone. The width never changes the bits: it reorders claims, not
// turns.
constexpr int kSectionStaggerClaims = 2 * 132;

DASH_HOST_DEVICE int l2_section_heads(int seqlen_q, int head_dim, int batch_heads, int full_mask_q_tiles) {
  // 32 MiB of the 50 MiB L2 (H100/H200), leaving room for K/V, LSE/D and other work.
  long long const budget = 32ll << 20;
  long long const per_head = 8ll * seqlen_q * head_dim;  // Q + dO (2 B each) + dQaccum (4 B)
  int const stagger_cap = full_mask_q_tiles > 0 ? max_int(kSectionStaggerClaims / full_mask_q_tiles, 1) : (1 << 30);
  int w = 1;
  while (w < batch_heads && 2ll * w * per_head <= budget && 2 * w <= stagger_cap) { w *= 2; }
  return min_int(w, max_int(batch_heads, 1));
}

// One work item of the persistent grid: column n of head h of batch b. rank = the column's
// position among its head's items (its claim rank); the static shift schedule also keeps
// the column's place in its wave.
struct ColumnCoord {
  int n = 0, h = 0, b = 0;
  int slot = 0;    // shift: position among the head's columns in this wave
  int first = 0;   // shift: the head's columns in earlier waves
  int width = 1;   // shift: the head's columns in this wave
};

// A claimed work item as the producer hands it to the consumer roles: its index (>= the
// number of columns: no more work) and, when it is one, its column (claimed schedules use
// n, h and b only).
struct ScheduledColumn {
  int item = 0;
  int n = 0, h = 0, b = 0;
  DASH_HOST_DEVICE ColumnCoord col() const {
    ColumnCoord c;
    c.n = n;
    c.h = h;
    c.b = b;
    return c;
  }
};

// A schedule is a policy type the kernel is templated on. It provides:
//   TileGeometry geo;                        the tile ranges it schedules
//   int num_columns() const;                 work items (columns) in the problem
//   static constexpr bool kClaimed;          true: after its first item (its CTA index) a CTA
//                                            claims the next item id from a global counter;
//                                            false: CTA x runs item(x, 0), item(x, 1), ...
//   static constexpr bool kPortable;         the accumulation order does not depend on the
//                                            number of CTAs (bits equal on every Hopper part)
//   int item(int cta, int k) const;          (static schedules) the k-th item of CTA cta
//   int next_item(int item) const;           (static schedules) the item after `item` on its CTA
//   ColumnCoord column(int item) const;      which column an item is
//   int num_steps(ColumnCoord) const;        Q tiles the column visits
//   int m_block(ColumnCoord, int step) const the step-th Q tile it visits
//   int turn(ColumnCoord, int m) const;      its turn in dQ tile m's accumulation order
// The mainloop only ever calls these; the Python model (dash.schedules) is the spec.

// Claimed schedules: `fa3`, `interleaved`, `descending` (their names in dash.schedules).
//
// Work items are numbered L = 0, 1, ... and claimed in increasing L: CTA x starts with
// item x, then each CTA claims the next unclaimed item (an atomic counter) whenever its
// producer is ready for more work -- what the hardware block dispatcher does for FA3's
// one-CTA-per-column grid, without its imbalance of static round-robin.
//
// Item order. Heads hd = b*H + h are cut into L2 sections of `section_heads` consecutive
// heads; inside a section the head varies fastest and the column rank k slowest, so
// consecutive items are the same column of different heads (FA4's launch order). The k-th
// column of a head is n = k, or n = N-1-k when `shortest_first`. section_heads = 1 is
// FA3's order (column fastest). Interleaving matters for the deterministic mode: the
// columns of one head then start a whole section of claims apart instead of all at once,
// so each reaches a dQ tile after its predecessor in the turn order has left it, and the
// staircase of waits of FA3's order (every column of a wave waiting at the same first tile)
// disappears; sections keep the heads in flight within L2.
//
// GQA: within a batch, query head h = kv * G + j (G query heads per KV head) takes slot
// j * heads_kv + kv of the head order: the heads of one KV group, which reduce-add into the
// same dK/dV tiles in the fixed order j, are heads_kv slots apart rather than adjacent (adjacent,
// they finish a column together and queue on that order). Without GQA slot == head.
//
// Visits: ascending from m_begin(n), or descending from M-1 (the paper's descending Q-tile
// iteration). Turns: ascending column order (turn = n), or under a causal mask descending
// (turn = n_end(m) - 1 - n, FA3's order for its shortest-first columns).
//
// Every turn depends on (m, n) only, so the bits are independent of the grid size. Every
// wait points to a column of the same head that precedes the waiting one in the item
// order (ascending turns with n = k, descending turns with n = N-1-k), or (GQA dK/dV) to
// the same column of query head j - 1 of the group, whose slot is heads_kv smaller; items
// are claimed in increasing L, so the smallest unfinished item is held by a running CTA and
// never waits: deadlock-free for any number of CTAs >= 1.
template <class Geometry = TileGeometry>
struct ClaimedSchedule {
  static constexpr bool kClaimed = true;
  static constexpr bool kPortable = true;
  Geometry geo;
  int num_heads = 0, num_batch = 0;
  int heads_per_group = 1;  // query heads per KV head (GQA); 1 without
  int section_heads = 1;
  bool shortest_first = false;
  bool visit_descending = false;
  bool descending_turns = false;

  DASH_HOST_DEVICE int num_columns() const { return geo.num_n_blocks() * num_heads * num_batch; }
  DASH_HOST_DEVICE int item(int cta, int /*k*/) const { return cta; }  // claimed: only the first is static
  DASH_HOST_DEVICE ColumnCoord column(int L) const {
    int const N = geo.num_n_blocks();
    int const batch_heads = num_heads * num_batch;
    int const section = L / (section_heads * N);
    int const in_section = L - section * section_heads * N;
    int const width = min_int(section_heads, batch_heads - section * section_heads);
    int const k = in_section / width;
    int const slot = section * section_heads + (in_section - k * width);
    ColumnCoord c;
    c.n = shortest_first ? N - 1 - k : k;
    c.b = slot / num_heads;
    int const s = slot - c.b * num_heads;  // s = j * heads_kv + kv -> h = kv * G + j
    int const heads_kv = num_heads / heads_per_group;
    int const j = s / heads_kv;
    c.h = (s - j * heads_kv) * heads_per_group + j;
    return c;
  }
  DASH_HOST_DEVICE int num_steps(ColumnCoord c) const { return max_int(geo.m_end(c.n) - geo.m_begin(c.n), 0); }
  DASH_HOST_DEVICE int m_block(ColumnCoord c, int step) const {
    return visit_descending ? geo.m_end(c.n) - 1 - step : geo.m_begin(c.n) + step;
  }
  DASH_HOST_DEVICE int turn(ColumnCoord c, int m) const {
    return descending_turns ? geo.n_end(m) - 1 - c.n : c.n;
  }
};

// The paper's shift schedule (full mask), on static waves planned for the launched grid.
//
// Columns are numbered L = n + N*(b*H + h) and CTA x runs L = x, x + P, x + 2P, ... (P =
// the grid): wave w holds L in [wP, (w+1)P). The `width` columns of one head that share a
// wave have slots a = 0..width-1; slot a visits Q tiles a, a+1, ..., wrapping at M, so at
// any step no two of them touch the same tile (a cyclic Latin square), and each tile's
// turn numbers its contributions in the order a lock-step run delivers them: first the
// `first` columns of the head in earlier waves, then the wave's columns in arrival order
// a = min(m, width-1), ..., 0, width-1, ..., m+1 -- nobody waits in the model.
//
// The turns depend on P: NOT portable (the bits change with the SM count or sm_margin);
// reached only by naming it. Needs width <= M (at most M columns of a head in one wave),
// i.e. min(N, P) <= M, checked by the host. Deadlock-free for any P: every wait points to
// an earlier wave or to an earlier step of the same wave, and each CTA runs its waves in
// order on a co-resident grid.
template <class Geometry = TileGeometry>
struct ShiftSchedule {
  static constexpr bool kClaimed = false;
  static constexpr bool kPortable = false;
  Geometry geo;
  int num_heads = 0, num_batch = 0;
  int num_ctas = 1;  // P: the grid the waves are planned for (must be the launched grid)

  DASH_HOST_DEVICE int num_columns() const { return geo.num_n_blocks() * num_heads * num_batch; }
  DASH_HOST_DEVICE int item(int cta, int k) const { return cta + k * num_ctas; }
  DASH_HOST_DEVICE int next_item(int item) const { return item + num_ctas; }  // item(cta, k) -> item(cta, k + 1)
  DASH_HOST_DEVICE ColumnCoord column(int L) const {
    int const N = geo.num_n_blocks();
    int const hd = L / N;
    int const wave_begin = (L / num_ctas) * num_ctas;
    ColumnCoord c;
    c.n = L - hd * N;
    c.h = hd % num_heads;
    c.b = hd / num_heads;
    c.first = max_int(0, wave_begin - hd * N);
    c.slot = c.n - c.first;
    c.width = min_int(wave_begin + num_ctas, (hd + 1) * N) - max_int(wave_begin, hd * N);
    return c;
  }
  DASH_HOST_DEVICE int num_steps(ColumnCoord /*c*/) const { return geo.num_m_blocks(); }
  DASH_HOST_DEVICE int m_block(ColumnCoord c, int step) const {
    int const M = geo.num_m_blocks();
    int const m = c.slot + step;  // slot < width <= M
    return m >= M ? m - M : m;
  }
  DASH_HOST_DEVICE int turn(ColumnCoord c, int m) const {
    int const last = min_int(m, c.width - 1);
    int const r = last - c.slot;
    return c.first + (r >= 0 ? r : r + c.width);
  }
};

// Schedule names shared with Python: dash.config.KERNEL_SCHEDULES lists them in this order.
enum class BwdScheduleKind : int { kFa3 = 0, kInterleaved = 1, kDescending = 2, kShift = 3 };

// The claimed schedules. A non-deterministic run keeps the schedule's item and visit order
// but takes the longest columns first (balances the tail); its turns are unused.
template <class Geometry>
DASH_HOST_DEVICE ClaimedSchedule<Geometry> make_claimed_schedule(BwdScheduleKind kind, Geometry geo, int head_dim,
                                                                 int num_heads, int num_heads_k, int num_batch,
                                                                 bool deterministic) {
  ClaimedSchedule<Geometry> s;
  s.geo = geo;
  s.num_heads = num_heads;
  s.heads_per_group = num_heads / num_heads_k;
  s.num_batch = num_batch;
  s.section_heads = kind == BwdScheduleKind::kFa3
                        ? 1
                        : l2_section_heads(geo.seqlen_q, head_dim, num_heads * num_batch,
                                           geo.causal ? 0 : geo.num_m_blocks());
  // FA3's causal deterministic order: shortest columns first with descending turns (the
  // order in which its columns reach a tile). Descending visits go longest first with
  // ascending turns: every column starts at the last tile, column n right after n-1.
  bool const fa3_causal = geo.causal && kind != BwdScheduleKind::kDescending;
  s.shortest_first = fa3_causal && deterministic;
  s.descending_turns = fa3_causal;
  s.visit_descending = kind == BwdScheduleKind::kDescending;
  return s;
}

template <class Geometry>
DASH_HOST_DEVICE ShiftSchedule<Geometry> make_shift_schedule(Geometry geo, int num_heads, int num_batch,
                                                             int num_ctas) {
  ShiftSchedule<Geometry> s;
  s.geo = geo;
  s.num_heads = num_heads;
  s.num_batch = num_batch;
  s.num_ctas = num_ctas;
  return s;
}

}  // namespace dash
