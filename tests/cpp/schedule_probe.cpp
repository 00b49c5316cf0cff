// Host build of csrc/schedule/schedule.h for tests/test_kernel_schedule_matches_model.py:
// exposes the kernel's schedule numbers through a C ABI so the Python scheduling model
// (the specification) can be compared with what the kernel computes.
#include "schedule/schedule.h"

namespace {

dash::TileGeometry make_geometry(int seqlen_q, int seqlen_k, int block_m, int block_n, int causal) {
  dash::TileGeometry geo;
  geo.seqlen_q = seqlen_q;
  geo.seqlen_k = seqlen_k;
  geo.block_m = block_m;
  geo.block_n = block_n;
  geo.causal = causal != 0;
  return geo;
}

}  // namespace

extern "C" {

// columns[3*L + {0,1,2}] = (n, h, b) of item L; for every column n of head (0, 0):
// num_steps[n] and visit[n * M + step] = m; turns[m * N + n] = turn(m, n) for visited (m, n),
// -1 elsewhere. Returns the number of items.
int dash_fa3_probe(int seqlen_q, int seqlen_k, int block_m, int block_n, int causal, int heads, int batch,
                   int deterministic, int* columns, int* num_steps, int* visit, int* turns) {
  dash::TileGeometry const geo = make_geometry(seqlen_q, seqlen_k, block_m, block_n, causal);
  dash::Fa3Schedule const s = dash::make_fa3_schedule(geo, heads, batch, deterministic != 0);
  int const N = geo.num_n_blocks(), M = geo.num_m_blocks();
  for (int L = 0; L < s.num_columns(); ++L) {
    dash::ColumnCoord const c = s.column(L);
    columns[3 * L] = c.n;
    columns[3 * L + 1] = c.h;
    columns[3 * L + 2] = c.b;
  }
  for (int i = 0; i < M * N; ++i) { turns[i] = -1; }
  for (int n = 0; n < N; ++n) {
    dash::ColumnCoord c;
    c.n = n;
    num_steps[n] = s.num_steps(c);
    for (int step = 0; step < num_steps[n]; ++step) {
      int const m = s.m_block(c, step);
      visit[n * M + step] = m;
      turns[m * N + n] = s.turn(c, m);
    }
  }
  return s.num_columns();
}

// needs_mask(m, n) of the kernel, for the mask test.
int dash_needs_mask(int seqlen_q, int seqlen_k, int block_m, int block_n, int causal, int m, int n) {
  return make_geometry(seqlen_q, seqlen_k, block_m, block_n, causal).needs_mask(m, n) ? 1 : 0;
}

}  // extern "C"
