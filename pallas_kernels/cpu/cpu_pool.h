// Sharing a custom call's work items over XLA's intra-op thread pool: the CPU kernels'
// common scaffold, and the row tiles, work items and FFI signatures of the layer-product
// kernels. Included by pallas_kernels/ragged_paged_attention/cpu_kernel.cc,
// quantized_matmul.cc and {bf16,f32}_matmul.cc; build.py builds them with this folder on
// the include path and hashes it into the cached libraries' names.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

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

// A layer product y[M, N] = x[M, K] @ w[layer], w [L, K, N] or [K, N]: its sizes and the
// layer's first element in w, from checked operand shapes (live: [M] or [0]; layer: [1]).
struct ProductShape {
  int64_t M, N, K, offset;
};

template <typename XDims, typename WDims, typename YDims>
xla::ffi::Error product_shape(const XDims& xd, const WDims& wd, const YDims& yd,
                              int64_t live_count, int64_t layer_count, const int32_t* layer,
                              ProductShape& out) {
  using xla::ffi::Error;
  if (xd.size() != 2 || (wd.size() != 2 && wd.size() != 3) || yd.size() != 2 ||
      layer_count != 1)
    return Error::InvalidArgument("x [M, K], w [L, K, N] or [K, N], layer [1]");
  out.M = xd[0];
  out.K = xd[1];
  out.N = wd[wd.size() - 1];
  const int64_t layers = wd.size() == 3 ? wd[0] : 1;
  if (wd[wd.size() - 2] != out.K || yd[0] != out.M || yd[1] != out.N)
    return Error::InvalidArgument("inconsistent matmul shapes");
  if (live_count != 0 && live_count != out.M)
    return Error::InvalidArgument("live must have one entry per row of x, or none");
  if (layer[0] < 0 || layer[0] >= layers)
    return Error::InvalidArgument("layer index out of range");
  out.offset = int64_t(layer[0]) * out.K * out.N;
  return Error::Success();
}

// Rows m0 .. m0 + rows - 1 of a product's x: one tile of a layer-product kernel.
struct RowTile {
  int64_t m0;
  int rows;
};

// The tiles over the live rows (live[m] != 0; every row when live is null): each run of
// consecutive live rows split into tiles of at most max_rows and near-equal height (64 rows
// at 14: 13, 13, 13, 13, 12), since a short last tile pays the weight loads of a full one.
inline std::vector<RowTile> live_tiles(const int8_t* live, int64_t M, int max_rows) {
  std::vector<RowTile> tiles;
  for (int64_t m = 0; m < M;) {
    if (live && !live[m]) {
      ++m;
      continue;
    }
    int64_t end = m + 1;
    while (end < M && (!live || live[end])) ++end;
    const int64_t count = (end - m + max_rows - 1) / max_rows;
    for (int64_t t = 0; t < count; ++t) {
      const int rows = int((end - m + (count - t) - 1) / (count - t));
      tiles.push_back({m, rows});
      m += rows;
    }
  }
  return tiles;
}

// Panels per item when `panels` column panels are shared by items of at most `most` panels:
// as many items as the fewest multiple of the pool's threads allows (18 panels at most 4 on
// 2 threads: 6 items of 3, not 4, 4, 4, 4, 2).
inline int64_t balanced_run(xla::ffi::ThreadPool& pool, int64_t panels, int64_t most) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t items = (panels + most - 1) / most;
  items = (items + threads - 1) / threads * threads;
  return std::max<int64_t>(1, (panels + items - 1) / items);
}

// A layer product's work items over the pool: blocks of up to block_tiles of `count` tiles
// (near-equal: 10 tiles at 8 are 5 and 5) by runs of its `panels` column panels. item(t0,
// t1, p0, p1) computes tiles [t0, t1) for panels [p0, p1), and may reuse each panel from
// cache across the block's tiles. One block (a decode step): `one_block_run` panels per item
// (one by default, so that a narrow weight (6 panels) still splits evenly over the threads);
// several: two panels.
template <typename Item>
bool share_tile_panels(xla::ffi::ThreadPool& pool, int64_t count, int64_t panels,
                       int64_t block_tiles, Item item, int64_t one_block_run = 1) {
  if (count == 0 || panels == 0) return true;
  const int64_t blocks = (count + block_tiles - 1) / block_tiles;
  const int64_t per_block = (count + blocks - 1) / blocks;
  const int64_t per_item = blocks == 1 ? one_block_run : 2;
  const int64_t runs = (panels + per_item - 1) / per_item;
  return share_items(pool, blocks * runs, [&](int64_t i) {
    const int64_t block = i / runs, run = i % runs;
    const int64_t t0 = block * per_block, t1 = std::min(count, t0 + per_block);
    item(t0, t1, run * per_item, std::min(panels, (run + 1) * per_item));
  });
}

// The FFI signatures of the layer products: x [M, K], w [L, K, N] or [K, N], layer [1], live
// [M] or [0] -> y [M, N]; the gated form, silu(x @ gate) * (x @ up), takes up (gate's shape)
// after gate. A kernel adds its attributes after them.
inline auto product_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()          // x
      .Arg<ffi::AnyBuffer>()          // w
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .Arg<ffi::Buffer<ffi::S8>>()   // live
      .Ret<ffi::AnyBuffer>();         // y
}

inline auto gated_product_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()          // x
      .Arg<ffi::AnyBuffer>()          // gate
      .Arg<ffi::AnyBuffer>()          // up
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .Arg<ffi::Buffer<ffi::S8>>()   // live
      .Ret<ffi::AnyBuffer>();         // y
}

}  // namespace jllm_cpu
