// HiSparse's "union" block selection for XLA:CPU, an XLA FFI custom call
// (kernels_pallas/cpu_kernels.py builds and registers it; hisparse_jax/sparse/indexer.py
// calls it through `cpu_kernels.union_select` on CPU).
//
// HisparseUnionSelectF32: scores [B, H, NB] (each head's upper bound of q . k per block),
// kv_lens [B] -> logical_ids [B, K] (ascending, padded with -1), num_selected [B],
// selected kv_lens [B]. The same selection as the jnp path,
// `select_blocks(union_priority(scores, kv_lens, blocks), kv_lens, blocks)`, value for
// value (tests/kernels_pallas/test_cpu_select.py holds them equal, ties included):
//
//   n valid blocks (ceil(kv_len / block_size)); forced: the sink blocks and the local
//   blocks (the newest included) of the valid ones; every head ranks the valid blocks by
//   its score (higher first, ties to the lower block) and lists its first K; a block's
//   level is K - its best rank in any head (0: listed by none, or forced); the free budget
//   (K - forced) goes to the levels above the budget-th largest level, then to the blocks
//   at that level by their highest score in any head; what is left stays unfilled by
//   listed blocks and takes the lowest-numbered valid blocks (lax.top_k's tie order).
//
// HisparseUnionSelectBounds{F32,BF16,U16}: the same selection from the query and the key
// bounds where they lie: q [B, Hq, D], the bounds array [R, 2, Hkv, D] (0 = min, 1 = max;
// float32, or bfloat16 as the engine stores them by default), the bounds row of each
// logical block [B, NB] and kv_lens [B]. Each query head's score of a valid block is
// indexer.block_scores' upper bound sum_d min(q_d, 0) min_d + max(q_d, 0) max_d (float32,
// summed in vector lanes), computed here in place: the jnp path first gathers every row's bounds
// into a [B, NB, 2, Hkv, D] copy (32 MB a layer at 8 x 4,096 blocks), then multiplies.
// Blocks past a row's kv_len are not read.
//
// HisparseUnionSelectBoundsI8: int8 bounds (block_key_bounds.QuantizedBounds) as two
// buffers, the values int8 [R, 2, Hkv, D] and their scales float32 [R, 2, Hkv, 1] (bound =
// value * scale); the score factors as scale_min * (q- . values_min) + scale_max * (q+ .
// values_max) (float32 sums of the int8 values converted once a row: no scaled copy).
//
// Why C++: XLA:CPU runs the jnp form as a top-k per head, a scatter-min into [B, NB], a
// second top-k and the final top-k and sort, each a pass over [B, (H,) NB] in small ops:
// ~7 ms a layer at 8 x 4,096 blocks x 8 heads, K = 128 (the same selection here: one
// task per row, partial sorts of at most NB entries, < 1 ms).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_tasks.h"

namespace ffi = xla::ffi;

namespace {

using hisparse_cpu::RunTasks;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Row b's selection: see the file comment.
void SelectRow(const float* s, int64_t H, int64_t NB, int64_t K, int32_t kv_len,
               int64_t block_size, int64_t sink, int64_t local, int32_t* ids,
               int32_t* num_selected, int32_t* sel_len) {
  const int64_t n_raw = (static_cast<int64_t>(kv_len) + block_size - 1) / block_size;
  const int64_t n = std::clamp<int64_t>(n_raw, 0, NB);  // valid blocks: [0, n)
  const int64_t k = std::min(K, NB);
  auto forced = [&](int64_t i) { return i < n && (i < sink || i >= n_raw - local); };
  int64_t num_forced = 0;
  for (int64_t i = 0; i < n; ++i) num_forced += forced(i);

  // Each head's first k valid blocks: best[i] = the best rank of block i in any head.
  std::vector<int32_t> best(NB, static_cast<int32_t>(k));
  std::vector<float> highest(NB, -kInf);
  std::vector<int32_t> order;
  order.reserve(n);
  for (int64_t h = 0; h < H; ++h) {
    const float* sh = s + h * NB;
    order.clear();
    for (int64_t i = 0; i < n; ++i) {
      highest[i] = std::max(highest[i], sh[i]);
      if (sh[i] > -kInf) order.push_back(static_cast<int32_t>(i));
    }
    const int64_t listed = std::min<int64_t>(k, order.size());
    std::partial_sort(order.begin(), order.begin() + listed, order.end(),
                      [sh](int32_t a, int32_t b) { return sh[a] > sh[b] || (sh[a] == sh[b] && a < b); });
    for (int64_t r = 0; r < listed; ++r) {
      best[order[r]] = std::min(best[order[r]], static_cast<int32_t>(r));
    }
  }
  // The boundary level: the budget-th largest level (clipped to [1, k]-th as lax.top_k's
  // k values are; levels of unlisted blocks are 0).
  std::vector<int32_t> levels;
  levels.reserve(std::min<int64_t>(n, H * k));
  for (int64_t i = 0; i < n; ++i) {
    if (!forced(i) && best[i] < k) levels.push_back(static_cast<int32_t>(k - best[i]));
  }
  const int64_t budget = k - num_forced;
  const int64_t at = std::clamp<int64_t>(budget - 1, 0, k - 1);
  int32_t boundary = 0;
  if (at < static_cast<int64_t>(levels.size())) {
    std::nth_element(levels.begin(), levels.begin() + at, levels.end(), std::greater<int32_t>());
    boundary = levels[at];
  }
  // Priorities, then the k best (higher first, ties to the lower block).
  std::vector<float> priority(NB, -kInf);
  for (int64_t i = 0; i < n; ++i) {
    if (forced(i)) {
      priority[i] = kInf;
      continue;
    }
    const int32_t level = best[i] < k ? static_cast<int32_t>(k - best[i]) : 0;
    if (level > boundary) {
      priority[i] = kInf;
    } else if (level == boundary && level > 0) {
      priority[i] = highest[i];
    }
  }
  std::vector<int32_t> all(NB);
  std::iota(all.begin(), all.end(), 0);
  const float* p = priority.data();
  std::partial_sort(all.begin(), all.begin() + k, all.end(),
                    [p](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  int64_t count = 0;
  for (int64_t r = 0; r < k; ++r) {
    if (all[r] < n) ids[count++] = all[r];
  }
  std::sort(ids, ids + count);
  for (int64_t r = count; r < K; ++r) ids[r] = -1;
  *num_selected = static_cast<int32_t>(count);
  const int64_t last_tokens = kv_len - (n_raw - 1) * block_size;
  *sel_len = count > 0 ? static_cast<int32_t>((count - 1) * block_size + last_tokens) : 0;
}

constexpr int64_t kPrefetch = 4;  // blocks ahead

typedef float v16 __attribute__((vector_size(64)));

inline v16 Load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// The lanes' sum as a tree of vector adds (16 -> 8 -> 4 -> 1); the halves are taken with
// memcpy (what compilers turn into lane extracts) to build with any GCC or Clang.
inline float Sum(v16 a) {
  v8 lo8, hi8;
  std::memcpy(&lo8, &a, sizeof(v8));
  std::memcpy(&hi8, reinterpret_cast<const char*>(&a) + sizeof(v8), sizeof(v8));
  const v8 b = lo8 + hi8;
  v4 lo4, hi4;
  std::memcpy(&lo4, &b, sizeof(v4));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&b) + sizeof(v4), sizeof(v4));
  const v4 c = lo4 + hi4;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// Blocks [j0, j1) of row b: scores[h, j] for every query head h. qn, qp: min(q, 0) and
// max(q, 0) of the row's heads [Hq, D]. T: float32 bounds, bfloat16 bits, or int8 values
// with `scales` [R, 2, Hkv] (else null): a row's int8 values are converted to float32 once
// (into `buf`, unscaled) and each side's sum is scaled, scale_min * (q- . values_min) +
// scale_max * (q+ . values_max), the bounds' factored form (no scaled copy of the row).
template <typename T>
void ScoreBlocks(const float* qn, const float* qp, const T* bounds, const float* scales,
                 const int32_t* rows, int64_t R, int64_t Hq, int64_t Hkv, int64_t D,
                 int64_t NB, int64_t j0, int64_t j1, float* scores) {
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  const int64_t group = Hq / Hkv;
  const int64_t width = 2 * Hkv * D;
  std::vector<float> buf(width);
  std::vector<uint32_t> bits(width);
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t r = std::clamp<int64_t>(rows[j], 0, R - 1);
    if (j + kPrefetch < j1) {  // rows are scattered (block tables): fetch ahead
      const int64_t next_row = std::clamp<int64_t>(rows[j + kPrefetch], 0, R - 1);
      const char* next = reinterpret_cast<const char*>(bounds + next_row * width);
      for (int64_t c = 0; c < static_cast<int64_t>(width * sizeof(T)); c += 64) {
        __builtin_prefetch(next + c);
      }
      if constexpr (kInt8) __builtin_prefetch(scales + next_row * 2 * Hkv);
    }
    const float* b;
    if constexpr (std::is_same_v<T, float>) {
      b = bounds + r * width;
    } else if constexpr (kInt8) {
      const int8_t* bj = bounds + r * width;
      for (int64_t x = 0; x < width; ++x) buf[x] = static_cast<float>(bj[x]);
      b = buf.data();
    } else {
      const T* bj = bounds + r * width;  // bfloat16 bits: the high half of a float32's
      for (int64_t x = 0; x < width; ++x) bits[x] = static_cast<uint32_t>(bj[x]) << 16;
      std::memcpy(buf.data(), bits.data(), width * sizeof(float));
      b = buf.data();
    }
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / group;
      const float* mn = b + g * D;  // [Hkv, D] minima, then [Hkv, D] maxima
      const float* mx = b + (Hkv + g) * D;
      const float* qnh = qn + h * D;
      const float* qph = qp + h * D;
      int64_t d = 0;
      if constexpr (kInt8) {  // the sides apart: each has its own scale
        float lo = 0.0f, hi = 0.0f;
        if (D >= 16) {
          v16 a{}, c{};
          for (; d + 16 <= D; d += 16) {
            a += Load(qnh + d) * Load(mn + d);
            c += Load(qph + d) * Load(mx + d);
          }
          lo = Sum(a);
          hi = Sum(c);
        }
        for (; d < D; ++d) {
          lo += qnh[d] * mn[d];
          hi += qph[d] * mx[d];
        }
        const float* sc = scales + r * 2 * Hkv;  // [2, Hkv]: minima's, then maxima's
        scores[h * NB + j] = sc[g] * lo + sc[Hkv + g] * hi;
      } else {
        float acc = 0.0f;
        if (D >= 16) {
          v16 a{};
          for (; d + 16 <= D; d += 16) {
            a += Load(qnh + d) * Load(mn + d) + Load(qph + d) * Load(mx + d);
          }
          acc = Sum(a);
        }
        for (; d < D; ++d) acc += qnh[d] * mn[d] + qph[d] * mx[d];
        scores[h * NB + j] = acc;
      }
    }
  }
}

// Blocks one scoring task reads (a row of 4,096 blocks splits into 8 tasks: a lone
// request's row uses the whole pool).
constexpr int64_t kBlocksPerTask = 512;

// The selection from bounds `bp` [R, 2, Hkv, D] (bd: their dimensions) and, for int8
// values, their scales [R, 2, Hkv, 1] (else null): scores in place, then SelectRow.
template <typename T>
ffi::Error SelectFromBounds(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q,
                            ffi::Span<const int64_t> bd, const T* bp, const float* scales,
                            ffi::Buffer<ffi::S32>& rows, ffi::Buffer<ffi::S32>& kv_lens,
                            ffi::ResultBuffer<ffi::S32>& ids,
                            ffi::ResultBuffer<ffi::S32>& num_selected,
                            ffi::ResultBuffer<ffi::S32>& sel_lens, int64_t block_size,
                            int64_t sink_blocks, int64_t local_blocks) {
  const auto qd = q.dimensions();  // [B, Hq, D]
  const auto rd = rows.dimensions();  // [B, NB]
  const auto id = ids->dimensions();  // [B, K]
  if (qd.size() != 3 || bd.size() != 4 || rd.size() != 2 || id.size() != 2 ||
      kv_lens.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("union_select_bounds: bad ranks");
  }
  const int64_t B = qd[0], Hq = qd[1], D = qd[2], R = bd[0], Hkv = bd[2], NB = rd[1];
  const int64_t K = id[1];
  if (bd[1] != 2 || bd[3] != D || R < 1 || Hkv < 1 || Hq % Hkv != 0 || rd[0] != B ||
      kv_lens.dimensions()[0] != B || id[0] != B || K > NB || K < 1 || block_size < 1 ||
      num_selected->dimensions()[0] != B || sel_lens->dimensions()[0] != B) {
    return ffi::Error::InvalidArgument("union_select_bounds: shapes do not match");
  }
  const float* qp = q.typed_data();
  const int32_t* rp = rows.typed_data();
  const int32_t* lp = kv_lens.typed_data();
  auto valid = [=](int64_t b) {
    return std::clamp<int64_t>((static_cast<int64_t>(lp[b]) + block_size - 1) / block_size,
                               0, NB);
  };
  std::vector<float> scores(B * Hq * NB), split(2 * B * Hq * D);
  float* sp = scores.data();
  float* qn = split.data();  // min(q, 0), then max(q, 0)
  float* qx = split.data() + B * Hq * D;
  for (int64_t x = 0; x < B * Hq * D; ++x) {
    qn[x] = std::min(qp[x], 0.0f);
    qx[x] = std::max(qp[x], 0.0f);
  }
  const int64_t chunks = (NB + kBlocksPerTask - 1) / kBlocksPerTask;
  RunTasks(pool, B * chunks, [=](int64_t i) {
    const int64_t b = i / chunks, j0 = (i % chunks) * kBlocksPerTask;
    const int64_t j1 = std::min(valid(b), j0 + kBlocksPerTask);
    if (j0 < j1) {
      ScoreBlocks(qn + b * Hq * D, qx + b * Hq * D, bp, scales, rp + b * NB, R, Hq, Hkv, D,
                  NB, j0, j1, sp + b * Hq * NB);
    }
  });
  int32_t* ip = ids->typed_data();
  int32_t* np = num_selected->typed_data();
  int32_t* kp = sel_lens->typed_data();
  RunTasks(pool, B, [=](int64_t b) {
    SelectRow(sp + b * Hq * NB, Hq, NB, K, lp[b], block_size, sink_blocks, local_blocks,
              ip + b * K, np + b, kp + b);
  });
  return ffi::Error::Success();
}

template <ffi::DataType DT>
ffi::Error UnionSelectBoundsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                 ffi::Buffer<DT> bounds, ffi::Buffer<ffi::S32> rows,
                                 ffi::Buffer<ffi::S32> kv_lens, ffi::ResultBuffer<ffi::S32> ids,
                                 ffi::ResultBuffer<ffi::S32> num_selected,
                                 ffi::ResultBuffer<ffi::S32> sel_lens, int64_t block_size,
                                 int64_t sink_blocks, int64_t local_blocks) {
  return SelectFromBounds(pool, q, bounds.dimensions(), bounds.typed_data(),
                          static_cast<const float*>(nullptr), rows, kv_lens, ids,
                          num_selected, sel_lens, block_size, sink_blocks, local_blocks);
}

// int8 bounds: values [R, 2, Hkv, D] and float32 scales [R, 2, Hkv, 1].
ffi::Error UnionSelectBoundsI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                   ffi::Buffer<ffi::S8> values, ffi::Buffer<ffi::F32> scales,
                                   ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> kv_lens,
                                   ffi::ResultBuffer<ffi::S32> ids,
                                   ffi::ResultBuffer<ffi::S32> num_selected,
                                   ffi::ResultBuffer<ffi::S32> sel_lens, int64_t block_size,
                                   int64_t sink_blocks, int64_t local_blocks) {
  const auto vd = values.dimensions();
  const auto cd = scales.dimensions();
  if (vd.size() != 4 || cd.size() != 4 || cd[0] != vd[0] || cd[1] != vd[1] ||
      cd[2] != vd[2] || cd[3] != 1) {
    return ffi::Error::InvalidArgument(
        "union_select_bounds: int8 values [R, 2, Hkv, D] need scales [R, 2, Hkv, 1]");
  }
  return SelectFromBounds(pool, q, vd, values.typed_data(), scales.typed_data(), rows,
                          kv_lens, ids, num_selected, sel_lens, block_size, sink_blocks,
                          local_blocks);
}

ffi::Error UnionSelectImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scores,
                           ffi::Buffer<ffi::S32> kv_lens, ffi::ResultBuffer<ffi::S32> ids,
                           ffi::ResultBuffer<ffi::S32> num_selected,
                           ffi::ResultBuffer<ffi::S32> sel_lens, int64_t block_size,
                           int64_t sink_blocks, int64_t local_blocks) {
  const auto sd = scores.dimensions();  // [B, H, NB]
  const auto id = ids->dimensions();  // [B, K]
  if (sd.size() != 3 || id.size() != 2 || kv_lens.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("union_select: bad ranks");
  }
  const int64_t B = sd[0], H = sd[1], NB = sd[2], K = id[1];
  if (kv_lens.dimensions()[0] != B || id[0] != B || K > NB || K < 1 || block_size < 1 ||
      num_selected->dimensions()[0] != B || sel_lens->dimensions()[0] != B) {
    return ffi::Error::InvalidArgument("union_select: shapes do not match");
  }
  const float* sp = scores.typed_data();
  const int32_t* lp = kv_lens.typed_data();
  int32_t* ip = ids->typed_data();
  int32_t* np = num_selected->typed_data();
  int32_t* kp = sel_lens->typed_data();
  RunTasks(pool, B, [=](int64_t b) {
    SelectRow(sp + b * H * NB, H, NB, K, lp[b], block_size, sink_blocks, local_blocks,
              ip + b * K, np + b, kp + b);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseUnionSelectF32, UnionSelectImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("sink_blocks")
                                  .Attr<int64_t>("local_blocks"));

#define HISPARSE_UNION_SELECT_BOUNDS(name, DT)                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, UnionSelectBoundsImpl<DT>,         \
                                ffi::Ffi::Bind()                         \
                                    .Ctx<ffi::ThreadPool>()              \
                                    .Arg<ffi::Buffer<ffi::F32>>()        \
                                    .Arg<ffi::Buffer<DT>>()              \
                                    .Arg<ffi::Buffer<ffi::S32>>()        \
                                    .Arg<ffi::Buffer<ffi::S32>>()        \
                                    .Ret<ffi::Buffer<ffi::S32>>()        \
                                    .Ret<ffi::Buffer<ffi::S32>>()        \
                                    .Ret<ffi::Buffer<ffi::S32>>()        \
                                    .Attr<int64_t>("block_size")         \
                                    .Attr<int64_t>("sink_blocks")        \
                                    .Attr<int64_t>("local_blocks"));

HISPARSE_UNION_SELECT_BOUNDS(HisparseUnionSelectBoundsF32, ffi::F32)
HISPARSE_UNION_SELECT_BOUNDS(HisparseUnionSelectBoundsBF16, ffi::BF16)
// bfloat16 bounds as XLA:CPU stores them (their uint16 bits; DESIGN.md): taking the bits
// saves the program a bitcast-convert copy of the whole bounds array per layer.
HISPARSE_UNION_SELECT_BOUNDS(HisparseUnionSelectBoundsU16, ffi::U16)
// int8 bounds (`QuantizedBounds`): values and scales as two buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseUnionSelectBoundsI8, UnionSelectBoundsI8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("sink_blocks")
                                  .Attr<int64_t>("local_blocks"));
