// Work items of a native CPU kernel spread over XLA's intra-op thread pool (included by the kernels' sources).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace pagefleet {

// Calls run(i) once for every i < n: on the calling thread and on up to pool.num_threads() - 1 helpers from XLA's
// intra-op pool, each taking the next item until none is left (so hand the items out biggest first: the threads
// then finish together). `run` is moved into state the helpers share, which outlives this call: a helper may start
// after the call has returned (the pool's threads may all be busy, for instance running a kernel for other
// devices), finds no item left and touches no buffer. So the caller never waits for a helper that has not started,
// only for helpers inside an item.
template <class Run>
void run_items(xla::ffi::ThreadPool& pool, size_t n, Run run) {
  struct State {
    Run run;
    size_t n;
    std::atomic<size_t> next{0};
    std::atomic<int> active{0};  // threads that may still be inside an item
    State(Run r, size_t count) : run(std::move(r)), n(count) {}
  };
  auto state = std::make_shared<State>(std::move(run), n);
  auto work = [](State& st) {
    st.active.fetch_add(1);
    for (size_t i; (i = st.next.fetch_add(1)) < st.n;) st.run(i);
    st.active.fetch_sub(1);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, static_cast<int64_t>(n) - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state, work] { work(*state); });
  work(*state);
  while (state->active.load() > 0) std::this_thread::yield();
}

}  // namespace pagefleet
