// Splitting a kernel's work among threads: XLA's own intra-op thread pool (the FFI's ThreadPool), not a
// team of our own.
//
// The calling thread and up to threads - 1 helper tasks on the pool claim items (panels, attention units)
// a chunk at a time from a shared counter; the call returns once every item is done. The caller never
// waits for a helper to start: a helper that starts late finds the items claimed and returns, so a call
// costs at worst what the calling thread alone takes. The OpenMP team the kernels used before joined every
// member at the region's end: a decode step paid a sleeping worker's wake-up in each of its ~90 calls, and
// the workers competed with XLA's own threads for the cores (benchmarks/NOTES.md, Dec 5).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace jaxllm_team {

class Team {
 public:
  static constexpr int kSpinsBeforeYield = 2000;  // pause instructions: tens of microseconds

  using Schedule = std::function<void(std::function<void()>)>;

  Team() = default;  // the calling thread alone
  // XLA's intra-op pool, sized to the cores (the caller is usually not one of its threads, but a helper
  // beyond the cores would only share one). Without one (XLA run without intra-op threads): the caller alone.
  explicit Team(xla::ffi::ThreadPool& pool)
      : Team(static_cast<int>(pool.num_threads()), [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); }) {}
  Team(int max_threads, Schedule schedule) : max_threads_(std::max(1, max_threads)), schedule_(std::move(schedule)) {}

  int max_threads() const { return max_threads_; }

  // body(i) for every i in [0, items), on up to `threads` threads, `chunk` items a claim.
  template <typename Body>
  void ForEach(int threads, int64_t items, int64_t chunk, const Body& body) const {
    chunk = std::max<int64_t>(1, chunk);
    threads = static_cast<int>(std::min<int64_t>({threads, max_threads_, (items + chunk - 1) / chunk}));
    if (threads <= 1) {
      for (int64_t i = 0; i < items; ++i) body(i);
      return;
    }
    struct Counters {
      std::atomic<int64_t> next{0}, done{0};
    };
    // shared with the helpers, which may run after this call returns (finding nothing left to claim): they
    // keep the counters alive, and touch `body`'s captures only for items they claimed
    auto counters = std::make_shared<Counters>();
    auto work = [counters, items, chunk, body] {
      for (int64_t i; (i = counters->next.fetch_add(chunk, std::memory_order_relaxed)) < items;) {
        const int64_t end = std::min(items, i + chunk);
        for (int64_t j = i; j < end; ++j) body(j);
        counters->done.fetch_add(end - i, std::memory_order_release);
      }
    };
    for (int h = 1; h < threads; ++h) schedule_(work);
    work();
    // items a helper is still on: spin briefly, then yield the core (an oversubscribed machine may have
    // descheduled the helper, perhaps to run it on this very core)
    for (int spins = 0; counters->done.load(std::memory_order_acquire) < items;) {
      if (spins < kSpinsBeforeYield) {
        ++spins;  // counted only up to the threshold: a long wait must not overflow it
        jaxllm_simd::Pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  int max_threads_ = 1;
  Schedule schedule_;
};

}  // namespace jaxllm_team
