// HiSparse's hot-buffer resolve for XLA:CPU, an XLA FFI custom call
// (kernels_pallas/cpu_kernels.py builds and registers it; hisparse_jax/sparse/resolver.py
// calls it through `cpu_kernels.resolve` on CPU).
//
// HisparseResolve: for each row (sequence) of one layer, every selected logical block to a
// device block: resident (its own device copy), a hot-buffer hit (the slot holding it) or
// a miss (loaded from the host pool into a slot: empty slots first, then the least
// recently used among those this step does not hit); the new hot-buffer state; the
// loads; the counts. Value for value what `resolver._resolve_row` computes (the jnp
// reference; tests/kernels_pallas/test_cpu_resolve.py holds them equal on random states,
// repeated blocks and empty rows), in one pass over a row's k selected blocks and its
// slots instead of XLA:CPU's chain of [k, k] and [k, slots] compares, a sort of the
// slots, cumsums and scatters.
//
// Operands (B rows, K selected, S slots, M logical blocks): sel [B, K] (logical ids;
// entries not `valid` are ignored), valid [B, K] (int32 0/1), slot_block [B, S] (-1 =
// empty), slot_last_used [B, S], evicted_at [B, M], resident_ids [B, M] (0 = not
// resident), slot_device_ids [B, S], host_ids [B, M], step [] (int32). Results: table
// [B, K], load_host [B, K], load_device [B, K], slot_block, slot_last_used, evicted_at
// (new), counts [B, 5] (resident hits, hot hits, misses, evictions, thrash).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_tasks.h"

namespace ffi = xla::ffi;

namespace {

using hisparse_cpu::RunTasks;

constexpr int32_t kLast = std::numeric_limits<int32_t>::max();  // used by this step
constexpr int32_t kNever = -(1 << 30);  // resolver.NEVER

struct Row {
  const int32_t *sel, *valid, *slot_block, *last_used, *evicted_at, *resident, *slot_device,
      *host;
  int32_t *table, *load_host, *load_device, *new_slot_block, *new_last_used, *new_evicted_at,
      *counts;
};

void ResolveRow(const Row& r, int64_t K, int64_t S, int64_t M, int32_t step,
                int64_t num_device_blocks, int64_t thrash_window) {
  auto safe = [&](int64_t i) -> int64_t {
    const int64_t b = r.valid[i] ? r.sel[i] : 0;
    return std::clamp<int64_t>(b, 0, M - 1);
  };
  // The first slot holding each logical block (lower slot first, as argmax picks).
  std::vector<int32_t> slot_of(M, -1);
  for (int64_t s = S - 1; s >= 0; --s) {
    const int32_t b = r.slot_block[s];
    if (b >= 0 && b < M) slot_of[b] = static_cast<int32_t>(s);
  }
  // First occurrence of each selected block.
  std::vector<int32_t> first_at(M, -1);
  std::vector<int32_t> first_of(K, 0);
  std::vector<uint8_t> first(K, 0), resident(K, 0), hot(K, 0), miss(K, 0);
  std::vector<int32_t> slot(K, static_cast<int32_t>(S));
  std::vector<uint8_t> used(S, 0);
  for (int64_t i = 0; i < K; ++i) {
    if (!r.valid[i]) continue;
    const int32_t b = r.sel[i];
    if (b < 0 || b >= M) {  // out of range: never equal to a slot's block; own "first"
      first[i] = 1;
      first_of[i] = static_cast<int32_t>(i);
      continue;
    }
    if (first_at[b] >= 0) {
      first_of[i] = first_at[b];
      continue;
    }
    first_at[b] = static_cast<int32_t>(i);
    first_of[i] = static_cast<int32_t>(i);
    first[i] = 1;
  }
  int32_t n_res = 0, n_hot = 0, n_miss = 0, n_evict = 0, n_thrash = 0;
  for (int64_t i = 0; i < K; ++i) {
    if (!first[i]) continue;
    if (r.resident[safe(i)] != 0) {
      resident[i] = 1;
      ++n_res;
      continue;
    }
    const int32_t b = r.sel[i];
    const int32_t s = (b >= 0 && b < M) ? slot_of[b] : -1;
    if (s >= 0) {
      hot[i] = 1;
      slot[i] = s;
      used[s] = 1;
      ++n_hot;
    } else {
      miss[i] = 1;
    }
  }
  // Victims: the slots no hit uses, empty ones first, then by last use (stable: lower
  // slot first on equal keys); the j-th miss takes the j-th.
  std::vector<int32_t> order(S);
  std::iota(order.begin(), order.end(), 0);
  std::vector<int32_t> key(S);
  for (int64_t s = 0; s < S; ++s) {
    key[s] = used[s] ? kLast : (r.slot_block[s] < 0 ? kNever : r.last_used[s]);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return key[a] < key[b]; });
  std::memcpy(r.new_slot_block, r.slot_block, S * sizeof(int32_t));
  std::memcpy(r.new_last_used, r.last_used, S * sizeof(int32_t));
  std::memcpy(r.new_evicted_at, r.evicted_at, M * sizeof(int32_t));
  std::vector<int32_t> device(K, 0);
  int64_t rank = 0;
  for (int64_t i = 0; i < K; ++i) {
    const int64_t c = safe(i);
    r.load_host[i] = 0;
    r.load_device[i] = static_cast<int32_t>(num_device_blocks);
    if (resident[i]) {
      device[i] = r.resident[c];
    } else if (hot[i]) {
      device[i] = r.slot_device[slot[i]];
    } else if (miss[i]) {
      const int32_t s = order[std::min<int64_t>(rank++, S - 1)];
      slot[i] = s;
      device[i] = r.slot_device[s];
      const int32_t old = r.slot_block[s];
      if (old >= 0) {
        ++n_evict;
        if (old < M) r.new_evicted_at[old] = step;
      }
      if (static_cast<int64_t>(step) - r.evicted_at[c] <= thrash_window) ++n_thrash;
      r.new_slot_block[s] = r.sel[i];
      r.load_host[i] = r.host[c];
      r.load_device[i] = device[i];
      ++n_miss;
    }
    if (slot[i] < S) r.new_last_used[slot[i]] = step;
  }
  for (int64_t i = 0; i < K; ++i) r.table[i] = r.valid[i] ? device[first_of[i]] : 0;
  r.counts[0] = n_res;
  r.counts[1] = n_hot;
  r.counts[2] = n_miss;
  r.counts[3] = n_evict;
  r.counts[4] = n_thrash;
}

ffi::Error ResolveImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> sel,
                       ffi::Buffer<ffi::S32> valid, ffi::Buffer<ffi::S32> slot_block,
                       ffi::Buffer<ffi::S32> last_used, ffi::Buffer<ffi::S32> evicted_at,
                       ffi::Buffer<ffi::S32> resident, ffi::Buffer<ffi::S32> slot_device,
                       ffi::Buffer<ffi::S32> host, ffi::Buffer<ffi::S32> step,
                       ffi::ResultBuffer<ffi::S32> table, ffi::ResultBuffer<ffi::S32> load_host,
                       ffi::ResultBuffer<ffi::S32> load_device,
                       ffi::ResultBuffer<ffi::S32> new_slot_block,
                       ffi::ResultBuffer<ffi::S32> new_last_used,
                       ffi::ResultBuffer<ffi::S32> new_evicted_at,
                       ffi::ResultBuffer<ffi::S32> counts, int64_t num_device_blocks,
                       int64_t thrash_window_steps) {
  const auto sd = sel.dimensions();
  const auto bd = slot_block.dimensions();
  const auto md = evicted_at.dimensions();
  if (sd.size() != 2 || bd.size() != 2 || md.size() != 2 || step.element_count() != 1) {
    return ffi::Error::InvalidArgument("resolve: bad ranks");
  }
  const int64_t B = sd[0], K = sd[1], S = bd[1], M = md[1];
  auto same = [](auto dims, int64_t a, int64_t b) {
    return dims.size() == 2 && dims[0] == a && dims[1] == b;
  };
  if (S < 1 || M < 1 || !same(valid.dimensions(), B, K) || !same(bd, B, S) ||
      !same(last_used.dimensions(), B, S) || !same(md, B, M) ||
      !same(resident.dimensions(), B, M) || !same(slot_device.dimensions(), B, S) ||
      !same(host.dimensions(), B, M) || !same(table->dimensions(), B, K) ||
      !same(load_host->dimensions(), B, K) || !same(load_device->dimensions(), B, K) ||
      !same(new_slot_block->dimensions(), B, S) || !same(new_last_used->dimensions(), B, S) ||
      !same(new_evicted_at->dimensions(), B, M) || !same(counts->dimensions(), B, 5)) {
    return ffi::Error::InvalidArgument("resolve: shapes do not match");
  }
  const int32_t now = step.typed_data()[0];
  const int32_t *sp = sel.typed_data(), *vp = valid.typed_data(),
                *bp = slot_block.typed_data(), *lp = last_used.typed_data(),
                *ep = evicted_at.typed_data(), *rp = resident.typed_data(),
                *dp = slot_device.typed_data(), *hp = host.typed_data();
  int32_t *tp = table->typed_data(), *lh = load_host->typed_data(),
          *ld = load_device->typed_data(), *nb = new_slot_block->typed_data(),
          *nl = new_last_used->typed_data(), *ne = new_evicted_at->typed_data(),
          *cp = counts->typed_data();
  RunTasks(pool, B, [=](int64_t b) {
    const Row row{sp + b * K, vp + b * K, bp + b * S, lp + b * S, ep + b * M, rp + b * M,
                  dp + b * S, hp + b * M, tp + b * K, lh + b * K, ld + b * K, nb + b * S,
                  nl + b * S, ne + b * M, cp + b * 5};
    ResolveRow(row, K, S, M, now, num_device_blocks, thrash_window_steps);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseResolve, ResolveImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sel
                                  .Arg<ffi::Buffer<ffi::S32>>()  // valid
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_block
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_last_used
                                  .Arg<ffi::Buffer<ffi::S32>>()  // evicted_at
                                  .Arg<ffi::Buffer<ffi::S32>>()  // resident_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_device_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()  // host_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()  // step
                                  .Ret<ffi::Buffer<ffi::S32>>()  // table
                                  .Ret<ffi::Buffer<ffi::S32>>()  // load_host
                                  .Ret<ffi::Buffer<ffi::S32>>()  // load_device
                                  .Ret<ffi::Buffer<ffi::S32>>()  // slot_block
                                  .Ret<ffi::Buffer<ffi::S32>>()  // slot_last_used
                                  .Ret<ffi::Buffer<ffi::S32>>()  // evicted_at
                                  .Ret<ffi::Buffer<ffi::S32>>()  // counts
                                  .Attr<int64_t>("num_device_blocks")
                                  .Attr<int64_t>("thrash_window_steps"));
