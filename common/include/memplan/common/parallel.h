// Work spread over the machine's cores: the planner's per-rank stages
// (placement, intervals, liveness) are independent across pipeline ranks.
//
// Results never depend on the number of threads: callers write each
// index's result to its own slot and combine them in index order.
#pragma once

#include <cstddef>
#include <functional>

namespace memplan {

// The threads ParallelFor uses: SetThreads' value when set, else
// MEMPLAN_THREADS when it is a positive integer, else the hardware's.
int Threads();
// 0 restores the default.
void SetThreads(int threads);

// Runs fn(i) for every i in [0, n), on up to Threads() threads (the
// calling one included). Rethrows the exception of the lowest index that
// threw, after every started call has returned. Called from inside fn, it
// runs on the calling thread alone (the outer loop already uses the cores).
void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

}  // namespace memplan
