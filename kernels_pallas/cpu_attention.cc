// Paged attention for XLA:CPU as XLA FFI custom calls (kernels_pallas/cpu_kernels.py builds
// and registers them; xla_attention calls them where they are built).
//
// HisparsePagedDecodeF32, the decode rows. The contract of `paged_attention` with per-row
// key ranges: one query per row, over the
// keys [starts[b], kv_lens[b]) of the row's block table. Each row is one task:
// its blocks are read straight from the pages (no gathered copy), each block once for all
// its KV heads, the query heads of a KV head share every key and value load (GQA), and an
// online softmax runs block by block.
// head_dim 32 / 64 / 128 (DecodeRowHeads): the scores of 16 keys at a time (each key row
// loaded once per query head, the 16 dot products summed by one butterfly of shuffles),
// p.v with up to 16 vector accumulators in registers (the query heads of a KV head in
// passes of 256 / head_dim), each block's values prefetched while its keys are scored;
// one task per row, or per row and KV head when there are no more rows than threads
// (measured: 8 rows x 600 tokens x 30 layers of SmolLM2, K/V in cache: 3.5x the scalar
// loop below; from DRAM it is bound by the reads). Other head_dims: the loop below.
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
#include "cpu_tasks.h"

namespace ffi = xla::ffi;

namespace {

using hisparse_cpu::RunTasks;

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

// The decode rows' fast path (head_dim 32, 64 or 128; defined below with the vector
// helpers): KV heads [h_lo, h_hi) of row b.
void DecodeRowHeads(int64_t b, int64_t h_lo, int64_t h_hi, const float* q, const float* k,
                    const float* v, const int32_t* tables, const int32_t* kv_lens,
                    const int32_t* starts, float* out, int64_t num_kv_heads, int64_t group,
                    int64_t head_dim, int64_t block_size, int64_t width, int64_t num_blocks,
                    float scale, float soft_cap);

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
  if (head_dim == 32 || head_dim == 64 || head_dim == 128) {
    // One task per row (a block's KV heads one after the other: the block is read front to
    // back); with no more rows than threads, one task per row and KV head.
    const int64_t split = batch <= pool.num_threads() ? num_kv_heads : 1;
    RunTasks(pool, batch * split, [=](int64_t i) {
      const int64_t h_lo = split == 1 ? 0 : i % split;
      const int64_t h_hi = split == 1 ? num_kv_heads : h_lo + 1;
      DecodeRowHeads(i / split, h_lo, h_hi, qp, kp, vp, tp, lp, sp, op, num_kv_heads, group,
                     head_dim, block_size, width, num_blocks, scale, soft_cap);
    });    return ffi::Error::Success();
  }
  RunTasks(pool, batch, [=](int64_t row) {
    OneRow(row, qp, kp, vp, tp, lp, sp, op, num_kv_heads, group, head_dim, block_size, width,
           num_blocks, scale, soft_cap);
  });
  return ffi::Error::Success();
}

// --- Prefill: the rows of a ragged batch with more than one query -----------------------

typedef float Keys16 __attribute__((vector_size(64)));  // 16 keys' scores (any ISA)
typedef int32_t Ints16 __attribute__((vector_size(64)));

// ExpNonPositive on 16 lanes at once (the same arithmetic).
inline Keys16 ExpNonPositive16(Keys16 x) {
  const Keys16 lowest = Keys16{} - 87.0f;
  const Keys16 clamped = x < lowest ? lowest : x;
  const Keys16 y = clamped * 1.44269504088896341f + 0.5f;
  Keys16 n = __builtin_convertvector(__builtin_convertvector(y, Ints16), Keys16);  // trunc
  n = n > y ? n - 1.0f : n;  // floor
  Keys16 f = clamped - n * 0.693359375f;
  f = f + n * 2.12194440e-4f;
  Keys16 e = f * 1.9875691500e-4f + 1.3981999507e-3f;
  e = e * f + 8.3334519073e-3f;
  e = e * f + 4.1665795894e-2f;
  e = e * f + 1.6666665459e-1f;
  e = e * f + 5.0000001201e-1f;
  e = e * f * f + f + 1.0f;
  const Ints16 bits = (__builtin_convertvector(n, Ints16) + 127) << 23;
  Keys16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < lowest ? Keys16{} : e * scale;
}

// Horizontal max and sum of 16 lanes in 4 shuffle steps (no scalar loop).
inline float MaxOf(Keys16 x) {
  Keys16 y = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  x = x > y ? x : y;
  return x[0];
}

inline float SumOf(Keys16 x) {
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}
// The sums of 16 vectors, lane t of the result = the sum of x[t]'s lanes: a butterfly of
// shuffles and adds (45 operations for 16 sums instead of 16 horizontal reductions).
inline Keys16 SumsOf16(const Keys16* x) {
  Keys16 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i) {
    c[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                   25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                   18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                   20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

inline Keys16 LoadKeys16(const float* p) {
  Keys16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// kG query heads of one KV head over keys [lo, hi) of one block (kb / vb: the block's
// first token, this head's columns): scores 16 keys at a time (each key row loaded once per
// head, the 16 dot products summed by SumsOf16), the online softmax per head, then p.v with
// the heads' accumulators in registers (kG * kDim / 16 vectors), each V row loaded once for
// the kG heads. m, l, acc: the heads' running max, sum and output (acc [kG][kDim]).
template <int kDim, int kG>
void DecodeHeadsOverBlock(const float* qs, const float* kb, const float* vb,
                          const float* k_next, int64_t lo, int64_t hi, int64_t token_stride,
                          float soft_cap, float* m, float* l, float* acc, float* s,
                          int64_t s_stride) {
  constexpr int kV = kDim / 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int g = 0; g < kG; ++g) {
    Keys16 qv[kV];
    for (int c = 0; c < kV; ++c) qv[c] = LoadKeys16(qs + g * kDim + 16 * c);
    float* sg = s + g * s_stride;
    for (int64_t t0 = lo; t0 < hi; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, hi - t0);
      Keys16 part[16];
      for (int64_t t = 0; t < 16; ++t) {
        if (t >= n) {
          part[t] = Keys16{};
          continue;
        }
        const float* key = kb + (t0 + t) * token_stride;
        if (g == 0) {  // this token's values, read by p.v below (a strided read: the
          // prefetcher does not run ahead of it)
          for (int c = 0; c < kDim; c += 16) __builtin_prefetch(vb + (t0 + t) * token_stride + c);
        }
        Keys16 x = qv[0] * LoadKeys16(key);
        for (int c = 1; c < kV; ++c) x += qv[c] * LoadKeys16(key + 16 * c);
        part[t] = x;
      }
      Keys16 sc = SumsOf16(part);
      if (soft_cap > 0.0f) {
        for (int t = 0; t < 16; ++t) sc[t] = soft_cap * std::tanh(sc[t] / soft_cap);
      }
      for (int64_t t = n; t < 16; ++t) sc[t] = neg_inf;
      std::memcpy(sg + (t0 - lo), &sc, sizeof(sc));
    }
    // Online softmax over this block's scores (padded with -inf to whole tiles of 16).
    const int64_t tiles = (hi - lo + 15) / 16;
    float block_max = neg_inf;
    for (int64_t i = 0; i < tiles; ++i) block_max = std::max(block_max, MaxOf(LoadKeys16(sg + 16 * i)));
    const float m_next = std::max(m[g], block_max);
    const float alpha = std::exp(m[g] - m_next);  // 0 on the first block (m = -inf)
    m[g] = m_next;
    Keys16 sum = {};
    for (int64_t i = 0; i < tiles; ++i) {
      const Keys16 p = ExpNonPositive16(LoadKeys16(sg + 16 * i) - m_next);
      std::memcpy(sg + 16 * i, &p, sizeof(p));
      sum += p;
    }
    l[g] = l[g] * alpha + SumOf(sum);
    for (int d = 0; d < kDim; ++d) acc[g * kDim + d] *= alpha;
  }
  Keys16 a[kG][kV];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kV; ++c) a[g][c] = LoadKeys16(acc + g * kDim + 16 * c);
  for (int64_t t = lo; t < hi; ++t) {
    const float* value = vb + t * token_stride;
    if (k_next != nullptr) {  // the next block's keys of this head, read next
      for (int c = 0; c < kDim; c += 16) __builtin_prefetch(k_next + t * token_stride + c);
    }
    Keys16 vr[kV];
    for (int c = 0; c < kV; ++c) vr[c] = LoadKeys16(value + 16 * c);
    for (int g = 0; g < kG; ++g) {
      const float p = s[g * s_stride + (t - lo)];
      for (int c = 0; c < kV; ++c) a[g][c] += p * vr[c];
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kV; ++c) std::memcpy(acc + g * kDim + 16 * c, &a[g][c], 64);
}

// At most 16 vector accumulators for p.v: query heads per pass by head_dim.
template <int kDim>
constexpr int kMaxHeads = 256 / kDim;

template <int kDim, int kG>
void DecodeHeadsDispatch(int64_t g, const float* qs, const float* kb, const float* vb,
                         const float* k_next, int64_t lo, int64_t hi, int64_t token_stride,
                         float soft_cap, float* m, float* l, float* acc, float* s,
                         int64_t s_stride) {
  if constexpr (kG >= 1) {
    if (g == kG) {
      DecodeHeadsOverBlock<kDim, kG>(qs, kb, vb, k_next, lo, hi, token_stride, soft_cap, m, l,
                                     acc, s, s_stride);
    } else {
      DecodeHeadsDispatch<kDim, kG - 1>(g, qs, kb, vb, k_next, lo, hi, token_stride, soft_cap,
                                        m, l, acc, s, s_stride);
    }
  }
}

template <int kDim>
void DecodeRowHeadDim(int64_t b, int64_t h_lo, int64_t h_hi, const float* q, const float* k,
                      const float* v, const int32_t* tables, const int32_t* kv_lens,
                      const int32_t* starts, float* out, int64_t num_kv_heads, int64_t group,
                      int64_t block_size, int64_t width, int64_t num_blocks, float scale,
                      float soft_cap) {
  const int64_t num_q_heads = num_kv_heads * group;
  const int64_t end = kv_lens[b];
  const int64_t start = std::max<int64_t>(starts[b], 0);
  const int64_t s_stride = (block_size + 15) / 16 * 16;
  const int64_t heads = (h_hi - h_lo) * group;  // query heads of this task
  std::vector<float> qs(heads * kDim), acc(heads * kDim, 0.0f), s(kMaxHeads<kDim> * s_stride);
  std::vector<float> m(heads, -std::numeric_limits<float>::infinity()), l(heads, 0.0f);
  const float* qb = q + (b * num_q_heads + h_lo * group) * kDim;
  for (int64_t i = 0; i < heads * kDim; ++i) qs[i] = qb[i] * scale;
  const int64_t token_stride = num_kv_heads * kDim;
  const int64_t block_stride = block_size * token_stride;
  for (int64_t j = start / block_size; j < width && j * block_size < end; ++j) {
    const int64_t block = tables[b * width + j];
    if (block < 0 || block >= num_blocks) continue;  // (a table the caller padded badly)
    const int64_t lo = std::max<int64_t>(start - j * block_size, 0);
    const int64_t hi = std::min<int64_t>(end - j * block_size, block_size);
    if (lo >= hi) continue;
    // The next block of the row (its keys are prefetched while this one's values are read).
    const int64_t next = j + 1 < width && (j + 1) * block_size < end ? tables[b * width + j + 1]
                                                                      : -1;
    for (int64_t h = h_lo; h < h_hi; ++h) {
      const float* kb = k + block * block_stride + h * kDim;
      const float* vb = v + block * block_stride + h * kDim;
      const float* k_next = next >= 0 && next < num_blocks
                                ? k + next * block_stride + h * kDim : nullptr;
      for (int64_t g0 = 0; g0 < group; g0 += kMaxHeads<kDim>) {
        const int64_t n = std::min<int64_t>(kMaxHeads<kDim>, group - g0);
        const int64_t r = (h - h_lo) * group + g0;
        DecodeHeadsDispatch<kDim, kMaxHeads<kDim>>(
            n, qs.data() + r * kDim, kb, vb, k_next, lo, hi, token_stride, soft_cap,
            m.data() + r, l.data() + r, acc.data() + r * kDim, s.data(), s_stride);
      }
    }
  }
  float* o = out + (b * num_q_heads + h_lo * group) * kDim;
  for (int64_t r = 0; r < heads; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < kDim; ++d) o[r * kDim + d] = acc[r * kDim + d] * inv;
  }
}

void DecodeRowHeads(int64_t b, int64_t h_lo, int64_t h_hi, const float* q, const float* k,
                    const float* v, const int32_t* tables, const int32_t* kv_lens,
                    const int32_t* starts, float* out, int64_t num_kv_heads, int64_t group,
                    int64_t head_dim, int64_t block_size, int64_t width, int64_t num_blocks,
                    float scale, float soft_cap) {
  switch (head_dim) {
    case 32:
      DecodeRowHeadDim<32>(b, h_lo, h_hi, q, k, v, tables, kv_lens, starts, out, num_kv_heads,
                           group, block_size, width, num_blocks, scale, soft_cap);
      break;
    case 64:
      DecodeRowHeadDim<64>(b, h_lo, h_hi, q, k, v, tables, kv_lens, starts, out, num_kv_heads,
                           group, block_size, width, num_blocks, scale, soft_cap);
      break;
    default:
      DecodeRowHeadDim<128>(b, h_lo, h_hi, q, k, v, tables, kv_lens, starts, out,
                            num_kv_heads, group, block_size, width, num_blocks, scale,
                            soft_cap);
  }
}

constexpr int64_t kKeyTile = 16;
constexpr int64_t kQueryTile = 32;  // queries of one task (x the GQA group in rows)

struct PrefillTask {
  int64_t row, first_query, num_queries, kv_head;
};

// One task: `num_queries` queries of a row from `first_query` on (chunk-relative), the query
// heads of one KV head, over the keys their causal (and sliding-window) ranges need, in
// tiles of 16 keys: scores vectorized over the keys (K transposed per tile, shared by all
// the task's rows, 4 rows per pass), an online softmax per row, p.v over head_dim with each
// V row loaded once for 4 rows. Keys at or past kv_len are never read; keys past a query's
// position get probability 0 (they hold this step's finite K/V: write_kv runs first).
// kDim: head_dim known at compile time (its loops unrolled, accumulators in registers), or
// 0 for any head_dim.
template <int kDim>
void OnePrefillTask(const PrefillTask& task, const float* q, const float* k, const float* v,
                    const int32_t* tables, const int32_t* kv_lens, const int32_t* cu_q_lens,
                    float* out, int64_t num_kv_heads, int64_t group, int64_t dim_arg,
                    int64_t block_size, int64_t width, int64_t num_blocks, float scale,
                    float soft_cap, int64_t window) {
  constexpr int64_t kRows = 4;
  const int64_t dim = kDim > 0 ? kDim : dim_arg;
  const int64_t b = task.row, h = task.kv_head;
  const int64_t num_q_heads = num_kv_heads * group;
  const int64_t kv_len = kv_lens[b];
  const int64_t q_len = cu_q_lens[b + 1] - cu_q_lens[b];
  const int64_t first_pos = kv_len - q_len + task.first_query;  // KV position of query 0
  const int64_t rows = task.num_queries * group;  // row r = query i * group + g
  const int64_t padded_rows = (rows + kRows - 1) / kRows * kRows;
  std::vector<float> qs(padded_rows * dim, 0.0f), acc(padded_rows * dim, 0.0f);
  std::vector<float> m(padded_rows, -std::numeric_limits<float>::infinity());
  std::vector<float> l(padded_rows, 0.0f);
  std::vector<int64_t> pos(padded_rows, -1);  // padding rows: no key is <= -1
  for (int64_t i = 0; i < task.num_queries; ++i) {
    const float* src = q + ((cu_q_lens[b] + task.first_query + i) * num_q_heads + h * group) * dim;
    for (int64_t g = 0; g < group; ++g) {
      pos[i * group + g] = first_pos + i;
      for (int64_t d = 0; d < dim; ++d) qs[(i * group + g) * dim + d] = src[g * dim + d] * scale;
    }
  }
  const int64_t end = std::min(kv_len, first_pos + task.num_queries);  // keys < end
  int64_t start = 0;
  if (window > 0) start = std::max<int64_t>(first_pos - window + 1, 0);
  std::vector<float> kt(dim * kKeyTile);  // K^T of one key tile: [dim][16]
  alignas(64) float p[kRows][kKeyTile];
  const int64_t token_stride = num_kv_heads * dim;
  const int64_t block_stride = block_size * token_stride;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t t0 = start - start % std::min<int64_t>(kKeyTile, block_size);
  while (t0 < end) {
    const int64_t j = t0 / block_size;
    if (j >= width) break;
    // Keys of this tile: up to 16, inside one block and below `end`.
    const int64_t n = std::min<int64_t>({kKeyTile, end - t0, block_size - t0 % block_size});
    const int64_t block = tables[b * width + j];
    if (block < 0 || block >= num_blocks) {
      t0 += n;
      continue;
    }
    const float* kb = k + block * block_stride + (t0 % block_size) * token_stride + h * dim;
    const float* vb = v + block * block_stride + (t0 % block_size) * token_stride + h * dim;
    for (int64_t t = 0; t < kKeyTile; ++t) {
      const float* key = kb + t * token_stride;
      for (int64_t d = 0; d < dim; ++d) kt[d * kKeyTile + t] = t < n ? key[d] : 0.0f;
    }
    // Rows whose queries see none of the tile's keys skip it (the causal diagonal).
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      if (pos[std::min(r0 + kRows, rows) - 1] < t0) continue;  // pos grows with r
      Keys16 sv[kRows] = {};
      const float* q0 = qs.data() + r0 * dim;
      for (int64_t d = 0; d < dim; ++d) {
        Keys16 kv;
        std::memcpy(&kv, kt.data() + d * kKeyTile, sizeof(kv));
        for (int64_t x = 0; x < kRows; ++x) sv[x] += q0[x * dim + d] * kv;
      }
      // Every key of the tile counts for every row of the pass: no mask (most tiles).
      const bool full = n == kKeyTile && t0 >= start && t0 + kKeyTile - 1 <= pos[r0] &&
                        r0 + kRows <= rows && soft_cap <= 0.0f &&
                        (window <= 0 || t0 > pos[r0 + kRows - 1] - window);
      if (kDim > 0 && full) {
        float ar[kRows][kDim > 0 ? kDim : 1];
        for (int64_t x = 0; x < kRows; ++x) {
          const int64_t r = r0 + x;
          const float m_next = std::max(m[r], MaxOf(sv[x]));
          const float alpha = std::exp(m[r] - m_next);
          m[r] = m_next;
          const Keys16 pv = ExpNonPositive16(sv[x] - m_next);
          std::memcpy(p[x], &pv, sizeof(pv));
          l[r] = l[r] * alpha + SumOf(pv);
          const float* a = acc.data() + r * kDim;
          for (int64_t d = 0; d < kDim; ++d) ar[x][d] = a[d] * alpha;
        }
        for (int64_t t = 0; t < kKeyTile; ++t) {
          const float* value = vb + t * token_stride;
          for (int64_t x = 0; x < kRows; ++x) {
            const float pt = p[x][t];
            for (int64_t d = 0; d < kDim; ++d) ar[x][d] += pt * value[d];
          }
        }
        for (int64_t x = 0; x < kRows; ++x) {
          std::memcpy(acc.data() + (r0 + x) * kDim, ar[x], sizeof(float) * kDim);
        }
        continue;
      }
      for (int64_t x = 0; x < kRows; ++x) {
        const int64_t r = r0 + x;
        float sc[kKeyTile];
        std::memcpy(sc, &sv[x], sizeof(sc));
        const int64_t qpos = pos[r];
        float tile_max = neg_inf;
        for (int64_t t = 0; t < kKeyTile; ++t) {
          const int64_t kpos = t0 + t;
          float y = sc[t];
          if (soft_cap > 0.0f) y = soft_cap * std::tanh(y / soft_cap);
          const bool ok = t < n && kpos >= start && kpos <= qpos &&
                          (window <= 0 || kpos > qpos - window);
          sc[t] = ok ? y : neg_inf;
          tile_max = std::max(tile_max, sc[t]);
        }
        if (tile_max == neg_inf) {  // nothing for this row here
          for (int64_t t = 0; t < kKeyTile; ++t) p[x][t] = 0.0f;
          continue;
        }
        const float m_next = std::max(m[r], tile_max);
        const float alpha = std::exp(m[r] - m_next);
        m[r] = m_next;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < kKeyTile; ++t) {
          p[x][t] = ExpNonPositive(sc[t] - m_next);  // masked: exp(-inf) = 0
          sum += p[x][t];
        }
        l[r] = l[r] * alpha + sum;
        float* a = acc.data() + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] *= alpha;
      }
      float* a0 = acc.data() + r0 * dim;
      for (int64_t t = 0; t < n; ++t) {
        const float* value = vb + t * token_stride;
        for (int64_t x = 0; x < kRows; ++x) {
          const float pt = p[x][t];
          if (pt == 0.0f) continue;
          float* a = a0 + x * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += pt * value[d];
        }
      }
    }
    t0 += n;
  }
  for (int64_t i = 0; i < task.num_queries; ++i) {
    float* dst = out + ((cu_q_lens[b] + task.first_query + i) * num_q_heads + h * group) * dim;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int64_t d = 0; d < dim; ++d) dst[g * dim + d] = acc[r * dim + d] * inv;
    }
  }
}

ffi::Error RaggedPrefillImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                             ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                             ffi::Buffer<ffi::S32> cu_q_lens, ffi::ResultBuffer<ffi::F32> out,
                             float scale, float soft_cap, int64_t window) {
  const auto qd = q.dimensions();        // [T, Hq, D]
  const auto kd = k_pages.dimensions();  // [N, bs, H, D]
  const auto td = block_tables.dimensions();  // [B, W]
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("ragged_prefill: bad ranks");
  }
  const int64_t num_tokens = qd[0], num_q_heads = qd[1], dim = qd[2];
  const int64_t num_blocks = kd[0], block_size = kd[1], num_kv_heads = kd[2];
  const int64_t batch = td[0], width = td[1];
  if (kd[3] != dim || num_q_heads % num_kv_heads != 0) {
    return ffi::Error::InvalidArgument("ragged_prefill: head sizes do not match");
  }
  const int64_t group = num_q_heads / num_kv_heads;
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  float* op = out->typed_data();
  std::fill(op, op + num_tokens * num_q_heads * dim, 0.0f);  // rows it does not compute
  std::vector<PrefillTask> tasks;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b];
    if (q_len < 2 || cu[b + 1] > num_tokens || lens[b] < q_len) continue;
    for (int64_t i = 0; i < q_len; i += kQueryTile) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        tasks.push_back({b, i, std::min<int64_t>(kQueryTile, q_len - i), h});
      }
    }
  }
  // Longest tasks first (the last query tiles of long rows), so the pool ends together.
  std::sort(tasks.begin(), tasks.end(), [&](const PrefillTask& x, const PrefillTask& y) {
    return lens[x.row] - (cu[x.row + 1] - cu[x.row]) + x.first_query >
           lens[y.row] - (cu[y.row + 1] - cu[y.row]) + y.first_query;
  });
  const float* qp = q.typed_data();
  const float* kp = k_pages.typed_data();
  const float* vp = v_pages.typed_data();
  const int32_t* tp = block_tables.typed_data();
  auto task_list = std::make_shared<std::vector<PrefillTask>>(std::move(tasks));
  RunTasks(pool, static_cast<int64_t>(task_list->size()), [=](int64_t i) {
    const PrefillTask& t = (*task_list)[i];
    switch (dim) {
      case 32:
        OnePrefillTask<32>(t, qp, kp, vp, tp, lens, cu, op, num_kv_heads, group, dim,
                           block_size, width, num_blocks, scale, soft_cap, window);
        break;
      case 64:
        OnePrefillTask<64>(t, qp, kp, vp, tp, lens, cu, op, num_kv_heads, group, dim,
                           block_size, width, num_blocks, scale, soft_cap, window);
        break;
      case 128:
        OnePrefillTask<128>(t, qp, kp, vp, tp, lens, cu, op, num_kv_heads, group, dim,
                            block_size, width, num_blocks, scale, soft_cap, window);
        break;
      default:
        OnePrefillTask<0>(t, qp, kp, vp, tp, lens, cu, op, num_kv_heads, group, dim,
                          block_size, width, num_blocks, scale, soft_cap, window);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseRaggedPrefillF32, RaggedPrefillImpl,
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
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window"));

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
