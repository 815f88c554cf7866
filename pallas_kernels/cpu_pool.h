// Sharing a custom call's work items over XLA's intra-op thread pool: the CPU kernels'
// common scaffold. Included by pallas_kernels/ragged_paged_attention/cpu_kernel.cc and
// jllm/quantization/cpu_matmul.cc; ragged_paged_attention/cpu.py builds both with this
// folder on the include path and hashes it into the cached libraries' names.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jllm_cpu {

// Runs item(i) for i in [0, total) on the calling thread and up to pool.num_threads() - 1
// pool tasks, and returns once every item has run; false if one threw. The caller waits
// only for items that some thread has claimed, so a task the pool starts late finds nothing
// to do and never touches `item`'s captures, which may be gone by then.
template <typename Item>
bool share_items(xla::ffi::ThreadPool& pool, int64_t total, Item item) {
  struct Progress {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto progress = std::make_shared<Progress>();
  auto work = [progress, item, total]() {
    for (;;) {
      const int64_t i = progress->next.fetch_add(1);
      if (i >= total) return;
      try {
        item(i);
      } catch (...) {
        progress->failed.store(true);
      }
      if (progress->done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(progress->mu);
        progress->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work]() { work(); });
  work();
  std::unique_lock<std::mutex> lock(progress->mu);
  progress->cv.wait(lock, [&] { return progress->done.load() >= total; });
  return !progress->failed.load();
}

}  // namespace jllm_cpu
