// RunTasks: fn(i) for every task index on XLA's intra-op thread pool and the calling
// thread; shared by the C++ CPU kernels (cpu_attention.cc, cpu_matmul.cc).
#ifndef HISPARSE_JAX_KERNELS_PALLAS_CPU_TASKS_H_
#define HISPARSE_JAX_KERNELS_PALLAS_CPU_TASKS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace hisparse_cpu {

struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// fn(i) for every i in [0, num_tasks), on XLA's intra-op pool and the calling thread. The
// caller takes tasks too and waits only for tasks to finish, never for a pool thread to
// start, so a busy pool cannot deadlock it; a pool thread that starts late finds no task
// left and returns (it holds the shared state, not the caller's frame).
template <typename F>
void RunTasks(xla::ffi::ThreadPool& pool, int64_t num_tasks, F fn) {
  if (num_tasks <= 0) return;
  auto shared = std::make_shared<Shared>();
  auto task = std::make_shared<F>(std::move(fn));
  auto work = [shared, task, num_tasks]() {
    for (;;) {
      const int64_t i = shared->next.fetch_add(1);
      if (i >= num_tasks) return;
      (*task)(i);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work]() { work(); });
  work();
  while (shared->done.load(std::memory_order_acquire) < num_tasks) std::this_thread::yield();
}

}  // namespace hisparse_cpu

#endif  // HISPARSE_JAX_KERNELS_PALLAS_CPU_TASKS_H_
