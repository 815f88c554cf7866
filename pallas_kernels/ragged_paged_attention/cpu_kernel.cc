// Ragged paged attention for the CPU, as an XLA FFI custom call.
//
// The same contract as the Pallas kernel and the jnp reference in this folder: a flat
// ragged batch of queries q [T, N, H] (request r owns rows query_start[r] ..
// query_start[r] + query_lens[r] - 1, which sit at the last query_lens[r] of its kv_lens[r]
// positions) attends causally over its own pages of one layer of the stacked cache
// [L, B, S, 2K, H] (K of kv head k at head index 2k, V at 2k + 1). Rows no request owns come
// out zero. float32 and bfloat16, q and cache of the same dtype; accumulation in float32.
//
// One work item is one request's block of up to kQueryBlock queries with all its heads, so
// each page of the cache is read once per item, front to back, while the next page is
// prefetched. Items are shared out over XLA's intra-op thread pool.
//
// Built at run time by cpu.py with the host compiler (-O3 -march=native).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Bf16 {
  using Storage = uint16_t;
  static float load(uint16_t x) {
    const uint32_t bits = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static uint16_t store(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return uint16_t((bits >> 16) | 0x40);  // NaN
    bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
    return uint16_t(bits >> 16);
  }
};

struct F32 {
  using Storage = float;
  static float load(float x) { return x; }
  static float store(float f) { return f; }
};

// exp(x) for x <= 0 (Cephes' single-precision polynomial, about 1 ulp); unlike std::exp it
// vectorizes inside a loop.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  x -= fx * 0.693359375f;
  x -= fx * -2.12194440e-4f;
  const float z = x * x;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const int32_t e = (int32_t(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return y * scale;
}

struct Problem {
  const void* q;
  const void* cache;  // this layer's [B, S, 2K, H]
  void* out;
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* query_start;
  const int32_t* query_lens;
  int64_t S, K, G, H, P;
  float scale;
};

constexpr int kQueryBlock = 8;

struct Item {
  int32_t request, first_query, num_queries;
};

// Online softmax over the request's pages for rows j = i * N + n (query i of the block,
// head n = k * G + g). Scratch holds the float32 queries, accumulators and scores.
template <typename D, int kH>
void run_item(const Problem& pb, const Item& it, std::vector<float>& scratch) {
  using St = typename D::Storage;
  const int64_t H = kH > 0 ? kH : pb.H;
  const int64_t S = pb.S, G = pb.G, K = pb.K, K2 = 2 * pb.K, N = K * G;
  const int64_t rows = it.num_queries * N;
  scratch.resize(size_t(rows * (2 * H + S + 2) + H));
  float* qf = scratch.data();  // [rows, H], scaled
  float* acc = qf + rows * H;  // [rows, H]
  float* s = acc + rows * H;   // [rows, S] scores, then probabilities, of one page
  float* m = s + rows * S;     // [rows] running max
  float* l = m + rows;         // [rows] running denominator
  float* kv = l + rows;        // [H] one K or V vector in float32
  std::fill(acc, acc + rows * H, 0.0f);
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.0f);

  const int64_t r = it.request;
  const int64_t q_row0 = int64_t(pb.query_start[r]) + it.first_query;
  // Position of the block's first query; query i sits at pos0 + i and sees keys <= pos0 + i.
  const int64_t pos0 = int64_t(pb.kv_lens[r]) - pb.query_lens[r] + it.first_query;
  const St* q = static_cast<const St*>(pb.q) + q_row0 * N * H;
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t h = 0; h < H; ++h) qf[j * H + h] = D::load(q[j * H + h]) * pb.scale;

  const int64_t kv_end = pos0 + it.num_queries;  // keys [0, kv_end) are read
  const int64_t num_pages = (kv_end + S - 1) / S;
  const int32_t* table = pb.block_tables + r * pb.P;
  const St* cache = static_cast<const St*>(pb.cache);
  const int64_t page_elems = S * K2 * H;
  const int64_t prefetch_bytes = page_elems * int64_t(sizeof(St)) / S;  // per token row

  for (int64_t pi = 0; pi < num_pages; ++pi) {
    const St* page = cache + int64_t(table[pi]) * page_elems;
    const char* next =
        pi + 1 < num_pages
            ? reinterpret_cast<const char*>(cache + int64_t(table[pi + 1]) * page_elems)
            : nullptr;
    const int64_t key0 = pi * S;
    const int64_t nt = std::min(S, kv_end - key0);
    // Scores s[j, t] = q_j . k_t.
    for (int64_t t = 0; t < nt; ++t) {
      if (next)  // the next page, a token row's worth at a time
        for (int64_t b = t * prefetch_bytes; b < (t + 1) * prefetch_bytes; b += 64)
          __builtin_prefetch(next + b);
      for (int64_t k = 0; k < K; ++k) {
        const St* kp = page + (t * K2 + 2 * k) * H;
        for (int64_t h = 0; h < H; ++h) kv[h] = D::load(kp[h]);
        for (int64_t i = 0; i < it.num_queries; ++i) {
          for (int64_t g = 0; g < G; ++g) {
            const int64_t j = i * N + k * G + g;
            const float* qj = qf + j * H;
            float dot = 0.0f;
            for (int64_t h = 0; h < H; ++h) dot += qj[h] * kv[h];
            s[j * S + t] = dot;
          }
        }
      }
    }
    // Fold the page into each row's running softmax; masked keys get probability 0.
    for (int64_t j = 0; j < rows; ++j) {
      float* sj = s + j * S;
      const int64_t visible = std::min(nt, pos0 + j / N - key0 + 1);
      if (visible <= 0) {
        std::fill(sj, sj + nt, 0.0f);
        continue;
      }
      float m_new = m[j];
      for (int64_t t = 0; t < visible; ++t) m_new = std::max(m_new, sj[t]);
      const float alpha = exp_nonpositive(m[j] - m_new);
      float sum = 0.0f;
      for (int64_t t = 0; t < visible; ++t) {
        sj[t] = exp_nonpositive(sj[t] - m_new);
        sum += sj[t];
      }
      std::fill(sj + visible, sj + nt, 0.0f);
      l[j] = l[j] * alpha + sum;
      m[j] = m_new;
      if (alpha != 1.0f) {
        float* aj = acc + j * H;
        for (int64_t h = 0; h < H; ++h) aj[h] *= alpha;
      }
    }
    // acc[j] += sum_t p[j, t] v_t.
    for (int64_t t = 0; t < nt; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const St* vp = page + (t * K2 + 2 * k + 1) * H;
        for (int64_t h = 0; h < H; ++h) kv[h] = D::load(vp[h]);
        for (int64_t i = 0; i < it.num_queries; ++i) {
          for (int64_t g = 0; g < G; ++g) {
            const int64_t j = i * N + k * G + g;
            const float p = s[j * S + t];
            float* aj = acc + j * H;
            for (int64_t h = 0; h < H; ++h) aj[h] += p * kv[h];
          }
        }
      }
    }
  }
  St* out = static_cast<St*>(pb.out) + q_row0 * N * H;
  for (int64_t j = 0; j < rows; ++j) {
    const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
    for (int64_t h = 0; h < H; ++h) out[j * H + h] = D::store(acc[j * H + h] * inv);
  }
}

template <typename D>
void run(const Problem& pb, const Item& it, std::vector<float>& scratch) {
  switch (pb.H) {  // the common head dims get fully unrolled inner loops
    case 64:
      return run_item<D, 64>(pb, it, scratch);
    case 128:
      return run_item<D, 128>(pb, it, scratch);
    default:
      return run_item<D, 0>(pb, it, scratch);
  }
}

// Work shared between the calling thread and pool tasks. The caller waits only for items
// that some thread has claimed, so a task the pool starts late finds nothing to do and
// never blocks the call.
struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                     ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> query_start,
                     ffi::Buffer<ffi::S32> query_lens, ffi::Buffer<ffi::S32> num_seqs,
                     ffi::Result<ffi::AnyBuffer> out, float sm_scale) {
  const auto qd = q.dimensions();
  const auto cd = kv_cache.dimensions();
  if (qd.size() != 3 || cd.size() != 5)
    return ffi::Error::InvalidArgument("q must be [T, N, H] and kv_cache [L, B, S, 2K, H]");
  const auto dtype = q.element_type();
  if (dtype != kv_cache.element_type() ||
      (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("q and kv_cache must both be float32 or bfloat16");
  const int64_t num_layers = cd[0], B = cd[1], S = cd[2], K2 = cd[3], H = cd[4];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= num_layers) return ffi::Error::InvalidArgument("layer out of range");
  Problem pb;
  pb.q = q.untyped_data();
  pb.cache = static_cast<const char*>(kv_cache.untyped_data()) +
             l * B * S * K2 * H * int64_t(ffi::ByteWidth(dtype));
  pb.out = out->untyped_data();
  pb.kv_lens = kv_lens.typed_data();
  pb.block_tables = block_tables.typed_data();
  pb.query_start = query_start.typed_data();
  pb.query_lens = query_lens.typed_data();
  pb.S = S;
  pb.K = K2 / 2;
  pb.G = qd[1] / pb.K;
  pb.H = H;
  pb.P = block_tables.dimensions()[1];
  pb.scale = sm_scale;

  std::memset(out->untyped_data(), 0, out->size_bytes());
  const int64_t R = std::min<int64_t>(num_seqs.typed_data()[0], kv_lens.dimensions()[0]);
  std::vector<Item> items;
  for (int32_t r = 0; r < R; ++r) {
    const int32_t q_len = pb.query_lens[r], kv_len = pb.kv_lens[r];
    const int64_t q0 = pb.query_start[r];
    // The same consistency rules as the reference; a bad row is an error, not a wild read.
    if (q_len < 0 || q_len > kv_len || kv_len > pb.P * S || q0 < 0 || q0 + q_len > qd[0])
      return ffi::Error::InvalidArgument("inconsistent ragged metadata");
    for (int32_t first = 0; first < q_len; first += kQueryBlock)
      items.push_back({r, first, std::min(kQueryBlock, q_len - first)});
  }
  for (const Item& it : items) {
    const int64_t pages = (int64_t(pb.kv_lens[it.request]) + S - 1) / S;
    const int32_t* table = pb.block_tables + int64_t(it.request) * pb.P;
    for (int64_t p = 0; p < pages; ++p)
      if (table[p] < 0 || table[p] >= B)
        return ffi::Error::InvalidArgument("block table entry out of range");
  }

  const int64_t total = int64_t(items.size());
  auto progress = std::make_shared<Progress>();
  const bool bf16 = dtype == ffi::DataType::BF16;
  auto work = [progress, &items, &pb, total, bf16]() {
    thread_local std::vector<float> scratch;
    for (;;) {
      const int64_t i = progress->next.fetch_add(1);
      if (i >= total) return;
      if (bf16)
        run<Bf16>(pb, items[i], scratch);
      else
        run<F32>(pb, items[i], scratch);
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
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JllmRaggedPagedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q [T, N, H]
                                  .Arg<ffi::AnyBuffer>()         // kv_cache [L, B, S, 2K, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [R, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Ret<ffi::AnyBuffer>()         // out [T, N, H]
                                  .Attr<float>("sm_scale"));
