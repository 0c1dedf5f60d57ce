#include "memplan/common/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <thread>
#include <vector>

namespace memplan {
namespace {

std::atomic<int> g_threads{0};
// Set while a thread runs ParallelFor's work: a nested ParallelFor (a plan
// inside `memplan search`'s loop over layouts) runs on that thread alone.
thread_local bool t_in_parallel = false;

}  // namespace

int Threads() {
  if (int n = g_threads.load(); n > 0) return n;
  if (const char* env = std::getenv("MEMPLAN_THREADS")) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v > 0) return static_cast<int>(std::min<long>(v, 1024));
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

void SetThreads(int threads) { g_threads.store(std::max(0, threads)); }

void ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  const size_t workers = t_in_parallel ? 1 : std::min(n, static_cast<size_t>(Threads()));
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> errors(n);
  auto work = [&] {
    const bool outer = t_in_parallel;
    t_in_parallel = true;
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      try {
        fn(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
    t_in_parallel = outer;
  };
  {
    std::vector<std::jthread> pool;
    pool.reserve(workers > 0 ? workers - 1 : 0);
    for (size_t w = 1; w < workers; ++w) pool.emplace_back(work);
    work();
  }
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace memplan
