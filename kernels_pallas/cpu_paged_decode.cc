// Paged decode attention for XLA:CPU, an XLA FFI custom call (kernels_pallas/cpu_kernels.py
// builds and registers it; xla_attention's decode rows call it where it is built).
//
// The contract of `paged_attention` with per-row key ranges: one query per row, over the
// keys [starts[b], kv_lens[b]) of the row's block table. Each row is one task:
// its blocks are read straight from the pages (no gathered copy), each block once for all
// its KV heads, the query heads of a KV head share every key and value load (GQA), and an
// online softmax runs block by block.
// Keys outside the range are never read, so whatever unused slots hold (NaN or inf of an
// earlier owner) contributes nothing. Tasks go to XLA's intra-op thread pool; the calling
// thread takes tasks too and waits only for tasks, never for a pool thread, so a busy pool
// cannot deadlock it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// exp(x) for x <= 0 in plain arithmetic, so `omp simd` loops vectorize it (glibc's expf
// is scalar without -ffast-math, which would also break the -inf / NaN handling here).
// Cephes' expf: x = n ln2 + f, |f| <= ln2 / 2, a degree-6 polynomial for e^f, 2^n from the
// exponent bits; within 2 ulp of expf; x below -87 gives 0 (expf: at most 1.6e-38).
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float f = clamped - n * 0.693359375f;
  f = f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * f + 1.3981999507e-3f;
  y = y * f + 8.3334519073e-3f;
  y = y * f + 4.1665795894e-2f;
  y = y * f + 1.6666665459e-1f;
  y = y * f + 5.0000001201e-1f;
  y = y * f * f + f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : y * scale;
}

// One row: every KV head of each block in turn, so a block is read once, front to back.
void OneRow(int64_t b, const float* q, const float* k, const float* v, const int32_t* tables,
            const int32_t* kv_lens, const int32_t* starts, float* out, int64_t num_kv_heads,
            int64_t group, int64_t head_dim, int64_t block_size, int64_t width,
            int64_t num_blocks, float scale, float soft_cap) {
  const int64_t num_q_heads = num_kv_heads * group;
  const int64_t end = kv_lens[b];
  const int64_t start = std::max<int64_t>(starts[b], 0);
  const int64_t dim = head_dim;
  std::vector<float> qs(num_q_heads * dim), acc(num_q_heads * dim, 0.0f);
  std::vector<float> m(num_q_heads, -std::numeric_limits<float>::infinity());
  std::vector<float> l(num_q_heads, 0.0f), block_max(num_q_heads);
  std::vector<float> s(static_cast<size_t>(block_size) * num_q_heads);  // [qh][t]
  const float* qb = q + b * num_q_heads * dim;
  for (int64_t i = 0; i < num_q_heads * dim; ++i) qs[i] = qb[i] * scale;
  const int64_t token_stride = num_kv_heads * dim;
  const int64_t block_stride = block_size * token_stride;
  for (int64_t j = start / block_size; j < width && j * block_size < end; ++j) {
    const int64_t block = tables[b * width + j];
    if (block < 0 || block >= num_blocks) continue;  // (a table the caller padded badly)
    const int64_t lo = std::max<int64_t>(start - j * block_size, 0);
    const int64_t hi = std::min<int64_t>(end - j * block_size, block_size);
    if (lo >= hi) continue;
    const float* kb = k + block * block_stride;
    const float* vb = v + block * block_stride;
    std::fill(block_max.begin(), block_max.end(), -std::numeric_limits<float>::infinity());
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const float* key = kb + t * token_stride + h * dim;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t qh = h * group + g;
          const float* qv = qs.data() + qh * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qv[d] * key[d];
          if (soft_cap > 0.0f) dot = soft_cap * std::tanh(dot / soft_cap);
          s[qh * block_size + t] = dot;
          block_max[qh] = std::max(block_max[qh], dot);
        }
      }
    }
    for (int64_t qh = 0; qh < num_q_heads; ++qh) {
      const float m_next = std::max(m[qh], block_max[qh]);
      const float alpha = std::exp(m[qh] - m_next);  // 0 on the first block (m = -inf)
      m[qh] = m_next;
      float* a = acc.data() + qh * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] *= alpha;
      float* p = s.data() + qh * block_size;  // scores -> probabilities, in place
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = lo; t < hi; ++t) {
        p[t] = ExpNonPositive(p[t] - m_next);
        sum += p[t];
      }
      l[qh] = l[qh] * alpha + sum;
    }
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const float* value = vb + t * token_stride + h * dim;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t qh = h * group + g;
          const float p = s[qh * block_size + t];
          float* a = acc.data() + qh * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * value[d];
        }
      }
    }
  }
  float* o = out + b * num_q_heads * dim;
  for (int64_t qh = 0; qh < num_q_heads; ++qh) {
    const float inv = l[qh] > 0.0f ? 1.0f / l[qh] : 0.0f;
    for (int64_t d = 0; d < dim; ++d) o[qh * dim + d] = acc[qh * dim + d] * inv;
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> starts, ffi::ResultBuffer<ffi::F32> out,
                           float scale, float soft_cap) {
  const auto qd = q.dimensions();        // [B, Hq, D]
  const auto kd = k_pages.dimensions();  // [N, bs, H, D]
  const auto td = block_tables.dimensions();  // [B, W]
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode: bad ranks");
  }
  const int64_t batch = qd[0], num_q_heads = qd[1], head_dim = qd[2];
  const int64_t num_blocks = kd[0], block_size = kd[1], num_kv_heads = kd[2];
  const int64_t width = td[1];
  if (kd[3] != head_dim || num_q_heads % num_kv_heads != 0) {
    return ffi::Error::InvalidArgument("paged_decode: head sizes do not match");
  }
  const int64_t group = num_q_heads / num_kv_heads;
  const float* qp = q.typed_data();
  const float* kp = k_pages.typed_data();
  const float* vp = v_pages.typed_data();
  const int32_t* tp = block_tables.typed_data();
  const int32_t* lp = kv_lens.typed_data();
  const int32_t* sp = starts.typed_data();
  float* op = out->typed_data();
  const int64_t num_tasks = batch;
  auto shared = std::make_shared<Shared>();
  auto work = [=]() {
    for (;;) {
      const int64_t task = shared->next.fetch_add(1);
      if (task >= num_tasks) return;
      OneRow(task, qp, kp, vp, tp, lp, sp, op, num_kv_heads, group, head_dim, block_size,
             width, num_blocks, scale, soft_cap);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work]() { work(); });
  work();
  while (shared->done.load(std::memory_order_acquire) < num_tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparsePagedDecodeF32, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap"));
