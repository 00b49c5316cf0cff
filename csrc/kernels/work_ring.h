// The two-slot ring in shared memory through which a persistent kernel's producer hands the
// CTA's next work item to the threads that consume it (forward and backward alike). The
// producer decides (claims from a global counter, or steps a static list) and every consumer
// reads the same sequence, so all roles process the same items in the same order.
#pragma once

#include <cstdint>

#include "kernels/ptx.h"

namespace dash {

template <class Payload>
struct WorkRingT {
  uint64_t full[2];
  uint64_t empty[2];
  Payload item[2];

  // One elected thread, before the CTA-wide barrier that follows barrier initialisation.
  __device__ __forceinline__ void init(uint32_t num_consumers) {
    for (int s = 0; s < 2; ++s) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], num_consumers);
    }
  }

  // Producer: the CTA's k-th item (the mbarrier arrive releases the st.shared).
  __device__ __forceinline__ void publish(int k, Payload const& value) {
    int const slot = k & 1;
    ptx::mbar_wait(&empty[slot], ((k >> 1) & 1) ^ 1);
    item[slot] = value;
    ptx::mbar_arrive(&full[slot]);
  }

  // Consumer: the CTA's k-th item; every consumer thread calls it once per k.
  __device__ __forceinline__ Payload receive(int k) {
    int const slot = k & 1;
    ptx::mbar_wait(&full[slot], (k >> 1) & 1);
    Payload const value = item[slot];
    ptx::mbar_arrive(&empty[slot]);
    return value;
  }
};

using WorkRing = WorkRingT<int>;  // the forward's: a Q tile's index

// Runs body(col) for every column of this CTA, in order: claimed schedules read them from the
// producer's ring (item and coordinates: the producer divides the item into its column once,
// for all consumer threads), static ones step through their fixed list (no ring, no state
// beyond the item itself). Every consumer role of the backward walks its columns this way.
template <class Schedule, class Column, class Body>
__device__ __forceinline__ void for_each_scheduled_column(Schedule const& sched, WorkRingT<Column>& ring, Body&& body) {
  if constexpr (Schedule::kClaimed) {
    for (int k = 0;; ++k) {
      Column const c = ring.receive(k);  // item >= num_columns: the CTA is done
      if (c.item >= sched.num_columns()) { break; }
      body(c.col());
    }
  } else {
    for (int item = sched.item(blockIdx.x, 0); item < sched.num_columns(); item = sched.next_item(item)) {
      body(sched.column(item));
    }
  }
}

}  // namespace dash
