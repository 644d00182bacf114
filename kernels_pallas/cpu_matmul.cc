// Matmul over packed weights for XLA:CPU, an XLA FFI custom call (kernels_pallas/cpu_kernels.py
// builds and registers it; kernels_pallas/packed.py packs the weights and calls it).
//
// HisparsePackedMatmulF32: y [M, N] = x [M, K] @ W [K, N] with W packed as [N / T, K, T]:
// column tile t holds W[:, t*T : (t+1)*T] row after row, so one tile is one contiguous
// stretch of memory (a K x T panel). Why: a decode step multiplies a few rows by every
// weight matrix, so its time is the time to stream the weights from DRAM; a row-major
// [K, N] matrix read one column tile at a time jumps N floats between rows (a new page
// every row; ~8 GB/s here), the packed panel streams (~20 GB/s per core, the memory's
// bandwidth). Each panel is read once for all rows: rows go in register blocks of 8 (then
// 4, 2, 1) with 8 x T/16 vector accumulators, the panel staying in L1/L2 between blocks.
//
// Every output is sum_k x[m, k] * W[k, n] accumulated in k order with fused multiply-adds,
// whatever M, the tile or the thread: the same value for a row whether it is computed in a
// batch of 1 or of 2,048. Tasks (a column tile and a range of row blocks) go to XLA's
// intra-op thread pool; the caller takes tasks too (RunTasks, as cpu_attention.cc).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"
#include "cpu_tasks.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));

inline v16 Load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

using hisparse_cpu::RunTasks;

// Rows [m0, m0 + MB) of x against one panel (K x 16 NV, contiguous): y[m, n0 : n0 + cols].
template <int MB, int NV>
void Block(const float* x, const float* panel, float* y, int64_t K, int64_t N, int64_t m0,
           int64_t n0, int64_t cols) {
  v16 acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = v16{};
  const float* xr = x + m0 * K;
  const float* w = panel;
  for (int64_t k = 0; k < K; ++k, w += 16 * NV) {
    v16 wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = Load(w + 16 * j);
    for (int m = 0; m < MB; ++m) {
      const float xv = xr[m * K + k];
      for (int j = 0; j < NV; ++j) acc[m][j] += xv * wv[j];
    }
  }
  for (int m = 0; m < MB; ++m) {
    float* yr = y + (m0 + m) * N + n0;
    if (cols == 16 * NV) {
      for (int j = 0; j < NV; ++j) Store(yr + 16 * j, acc[m][j]);
    } else {  // the last tile of an N that is not a multiple of T
      float tmp[16 * NV];
      for (int j = 0; j < NV; ++j) Store(tmp + 16 * j, acc[m][j]);
      std::memcpy(yr, tmp, cols * sizeof(float));
    }
  }
}

// Rows [m_lo, m_hi) against one panel, in register blocks of 8, then 4, 2, 1 rows.
template <int NV>
void Rows(const float* x, const float* panel, float* y, int64_t K, int64_t N, int64_t m_lo,
          int64_t m_hi, int64_t n0, int64_t cols) {
  int64_t m = m_lo;
  for (; m + 8 <= m_hi; m += 8) Block<8, NV>(x, panel, y, K, N, m, n0, cols);
  if (m + 4 <= m_hi) Block<4, NV>(x, panel, y, K, N, m, n0, cols), m += 4;
  if (m + 2 <= m_hi) Block<2, NV>(x, panel, y, K, N, m, n0, cols), m += 2;
  if (m < m_hi) Block<1, NV>(x, panel, y, K, N, m, n0, cols);
}

// Rows of one task: a panel's rows in chunks of kRowsPerTask (a chunk reuses the panel
// from cache; chunks spread a long prefill over the pool when there are few panels).
constexpr int64_t kRowsPerTask = 256;

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();  // [M, K]
  const auto wd = w.dimensions();  // [N / T, K, T]
  const auto yd = y->dimensions();  // [M, N]
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("packed_matmul: bad ranks");
  }
  const int64_t M = xd[0], K = xd[1], tiles = wd[0], T = wd[2], N = yd[1];
  if (wd[1] != K || yd[0] != M || N > tiles * T || N <= (tiles - 1) * T) {
    return ffi::Error::InvalidArgument("packed_matmul: shapes do not match");
  }
  if (T != 16 && T != 32 && T != 48 && T != 64) {
    return ffi::Error::InvalidArgument("packed_matmul: tile width must be 16, 32, 48 or 64");
  }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t row_chunks = std::max<int64_t>((M + kRowsPerTask - 1) / kRowsPerTask, 1);
  RunTasks(pool, tiles * row_chunks, [=](int64_t i) {
    const int64_t t = i / row_chunks, c = i % row_chunks;
    const int64_t m_lo = c * kRowsPerTask, m_hi = std::min<int64_t>(M, m_lo + kRowsPerTask);
    const int64_t n0 = t * T, cols = std::min<int64_t>(T, N - n0);
    const float* panel = wp + t * K * T;
    switch (T) {
      case 16: Rows<1>(xp, panel, yp, K, N, m_lo, m_hi, n0, cols); break;
      case 32: Rows<2>(xp, panel, yp, K, N, m_lo, m_hi, n0, cols); break;
      case 48: Rows<3>(xp, panel, yp, K, N, m_lo, m_hi, n0, cols); break;
      default: Rows<4>(xp, panel, yp, K, N, m_lo, m_hi, n0, cols); break;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparsePackedMatmulF32, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
