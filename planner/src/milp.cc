// The exact solver: one MILP per rank through COIN-OR CBC (docs/planner.md,
// "What --solver exact optimizes"). Without CBC (the optional Meson feature
// `cbc`) it refuses with the reason.
#if MEMPLAN_HAVE_CBC
#include <coin/Cbc_C_Interface.h>
#endif

#include <algorithm>
#include <limits>
#include <map>
#include <string>

#include "memplan/common/status.h"
#include "solver_internal.h"

namespace memplan::planner {

bool ExactSolverAvailable() {
#if MEMPLAN_HAVE_CBC
  return true;
#else
  return false;
#endif
}

namespace internal {

SolveResult Exact(const PlanningProblem& p, int32_t rank, int64_t budget, const std::vector<Interval>& fixed,
                  const std::vector<Storage>* warm_start, Assignment* a) {
  if (!ExactSolverAvailable()) {
    ThrowError(ErrorCode::kBadInput,
               "--solver exact: this memplan was built without CBC (install coinor-libcbc-dev and configure with "
               "-Dcbc=enabled); the heuristic solver plans without it");
  }
  const auto& ts = p.tensors[static_cast<size_t>(rank)];
  auto& st = a->storage[static_cast<size_t>(rank)];
  const int64_t pp = p.model->parallel.pp;
  const int64_t steps = p.timelines[static_cast<size_t>(rank)].steps;
  const auto& costs = CostTable(p, rank);
  // Fixed part: transients, tensors the solver does not decide, incoming.
  std::vector<Interval> ivs = fixed;
  struct Column {
    int32_t tensor;
    Storage storage;
    std::vector<int64_t> profile;  // bytes per step
  };
  std::vector<Column> cols;
  std::vector<Interval> scratch;
  for (size_t t = 0; t < ts.size(); ++t) {
    const auto& first = p.first_instance[static_cast<size_t>(rank)];
    if (!Decidable(ts[t], st[t])) {
      for (int32_t i = first[t]; i < first[t + 1]; ++i) {
        QueueFree(p, rank, i, st[t], a->target[static_cast<size_t>(rank)][t], &ivs);
      }
      continue;
    }
    for (Storage o : kLocalOptions) {
      if (!Legal(ts[t], o, pp)) continue;
      if (static_cast<int64_t>(cols.size() + 1) * steps > kMaxExactCells) {
        ThrowError(ErrorCode::kBadInput,
                   "--solver exact: pp rank " + std::to_string(rank) + " is too large for the MILP (" +
                       std::to_string(steps) + " steps x more than " + std::to_string(cols.size()) +
                       " columns); use the heuristic solver");
      }
      Column c{static_cast<int32_t>(t), o, std::vector<int64_t>(static_cast<size_t>(steps) + 1, 0)};
      for (int32_t i = first[t]; i < first[t + 1]; ++i) {
        scratch.clear();
        QueueFree(p, rank, i, o, -1, &scratch);
        for (const auto& iv : scratch) {
          if (iv.rank != rank) continue;
          c.profile[static_cast<size_t>(iv.first)] += iv.bytes;
          c.profile[static_cast<size_t>(iv.last) + 1] -= iv.bytes;
        }
      }
      int64_t run = 0;
      for (auto& v : c.profile) v = (run += v);
      cols.push_back(std::move(c));
    }
  }
  std::vector<int64_t> base(static_cast<size_t>(steps) + 1, 0);
  for (const auto& iv : ivs) {
    if (iv.rank != rank) continue;
    base[static_cast<size_t>(iv.first)] += iv.bytes;
    base[static_cast<size_t>(iv.last) + 1] -= iv.bytes;
  }
  {
    int64_t run = 0;
    for (size_t s = 0; s < base.size(); ++s) {
      run += base[s];
      base[s] = run + (s < static_cast<size_t>(steps) ? p.timelines[static_cast<size_t>(rank)].transient[s] : 0);
    }
  }
  if (cols.empty()) {
    int64_t peak = *std::max_element(base.begin(), base.end() - 1);
    return {peak <= budget, SeparableCost(p, rank, *a)};
  }
  // Rows: one per tensor (choose exactly one storage), one per step that
  // can bind (its worst case exceeds the budget).
  std::map<int32_t, int> tensor_row;
  std::vector<double> row_lo, row_hi;
  for (const auto& c : cols) {
    if (!tensor_row.count(c.tensor)) {
      tensor_row[c.tensor] = static_cast<int>(row_lo.size());
      row_lo.push_back(1);
      row_hi.push_back(1);
    }
  }
  std::vector<int64_t> step_rows;
  for (int64_t s = 0; s < steps; ++s) {
    std::map<int32_t, int64_t> worst;
    for (const auto& c : cols) worst[c.tensor] = std::max(worst[c.tensor], c.profile[static_cast<size_t>(s)]);
    int64_t w = base[static_cast<size_t>(s)];
    for (const auto& [t, v] : worst) w += v;
    if (w > budget) step_rows.push_back(s);
  }
  int first_step_row = static_cast<int>(row_lo.size());
  for (int64_t s : step_rows) {
    row_lo.push_back(-std::numeric_limits<double>::max());
    row_hi.push_back(static_cast<double>(budget - base[static_cast<size_t>(s)]));
  }
  // Host-offload capacity rows, as the heuristic enforces: per layer
  // (prefetch) and per chunk (copy-out), net of fixed host offloads.
  OffloadCapacity cap = HostCapacity(p, rank);
  for (size_t t = 0; t < ts.size(); ++t) {
    if (Decidable(ts[t], st[t])) continue;
    if (st[t] == Storage::kOffloadHost) cap.Add(ts[t], ts[t].bytes, 1);
    if (st[t] == Storage::kFp8OffloadHost) cap.Add(ts[t], ts[t].fp8_bytes, 1);
  }
  std::map<int64_t, int> layer_row;
  std::map<int32_t, int> chunk_row;
  for (const auto& c : cols) {
    if (c.storage != Storage::kOffloadHost && c.storage != Storage::kFp8OffloadHost) continue;
    const SavedTensor& t = ts[static_cast<size_t>(c.tensor)];
    if (!layer_row.count(t.layer)) {
      layer_row[t.layer] = static_cast<int>(row_lo.size());
      row_lo.push_back(-std::numeric_limits<double>::max());
      row_hi.push_back(cap.layer_in_bytes[static_cast<size_t>(t.layer)] - cap.layer_in_used[static_cast<size_t>(t.layer)]);
    }
    if (!chunk_row.count(t.chunk)) {
      chunk_row[t.chunk] = static_cast<int>(row_lo.size());
      row_lo.push_back(-std::numeric_limits<double>::max());
      row_hi.push_back(cap.chunk_out_bytes[static_cast<size_t>(t.chunk)] - cap.chunk_out_used[static_cast<size_t>(t.chunk)]);
    }
  }
  std::vector<int> start{0};
  std::vector<int> index;
  std::vector<double> value, lb, ub, obj;
  for (const auto& c : cols) {
    index.push_back(tensor_row[c.tensor]);
    value.push_back(1);
    for (size_t k = 0; k < step_rows.size(); ++k) {
      int64_t v = c.profile[static_cast<size_t>(step_rows[k])];
      if (v == 0) continue;
      index.push_back(first_step_row + static_cast<int>(k));
      value.push_back(static_cast<double>(v));
    }
    if (c.storage == Storage::kOffloadHost || c.storage == Storage::kFp8OffloadHost) {
      const SavedTensor& t = ts[static_cast<size_t>(c.tensor)];
      double moved = static_cast<double>(c.storage == Storage::kFp8OffloadHost ? t.fp8_bytes : t.bytes);
      index.push_back(layer_row[t.layer]);
      value.push_back(moved);
      index.push_back(chunk_row[t.chunk]);
      value.push_back(moved);
    }
    start.push_back(static_cast<int>(index.size()));
    lb.push_back(0);
    ub.push_back(1);
    // In microseconds: CBC's absolute tolerances (cutoff increment,
    // allowable gap) are far above costs of 1e-5 s, where it declared
    // suboptimal solutions optimal.
    obj.push_back(1e6 * costs[static_cast<size_t>(c.tensor)][static_cast<size_t>(c.storage)]);
  }
  bool feasible = false;
#if MEMPLAN_HAVE_CBC
  Cbc_Model* model = Cbc_newModel();
  Cbc_loadProblem(model, static_cast<int>(cols.size()), static_cast<int>(row_lo.size()), start.data(), index.data(),
                  value.data(), lb.data(), ub.data(), obj.data(), row_lo.data(), row_hi.data());
  for (size_t i = 0; i < cols.size(); ++i) Cbc_setInteger(model, static_cast<int>(i));
  if (warm_start) {
    // The heuristic's decisions as the first incumbent: the optimum is then
    // never worse than the heuristic's where its solution is feasible here.
    std::vector<int> idx(cols.size());
    std::vector<double> val(cols.size());
    for (size_t i = 0; i < cols.size(); ++i) {
      idx[i] = static_cast<int>(i);
      val[i] = (*warm_start)[static_cast<size_t>(cols[i].tensor)] == cols[i].storage ? 1.0 : 0.0;
    }
    Cbc_setMIPStartI(model, static_cast<int>(cols.size()), idx.data(), val.data());
  }
  Cbc_setLogLevel(model, 0);
  Cbc_setMaximumSeconds(model, 120);
  Cbc_setParameter(model, "threads", "1");
  // Proven optimal, not CBC's default stop within a relative gap.
  Cbc_setAllowableGap(model, 0);
  Cbc_setAllowableFractionGap(model, 0);
  Cbc_setAllowablePercentageGap(model, 0);
  Cbc_solve(model);
  const double* x = Cbc_getColSolution(model);
  feasible = !Cbc_isProvenInfeasible(model) && x != nullptr && Cbc_getObjValue(model) < 1e29;
  if (feasible) {
    // Verify the rounded solution before using it.
    std::vector<Storage> chosen(ts.size(), Storage::kKeep);
    for (size_t i = 0; i < cols.size(); ++i) {
      if (x[i] > 0.5) chosen[static_cast<size_t>(cols[i].tensor)] = cols[i].storage;
    }
    for (const auto& [t, row] : tensor_row) st[static_cast<size_t>(t)] = chosen[static_cast<size_t>(t)];
  }
  Cbc_deleteModel(model);
#endif
  std::vector<int64_t> prof = base;
  for (const auto& c : cols) {
    if (st[static_cast<size_t>(c.tensor)] != c.storage) continue;
    for (int64_t s = 0; s < steps; ++s) prof[static_cast<size_t>(s)] += c.profile[static_cast<size_t>(s)];
  }
  int64_t peak = *std::max_element(prof.begin(), prof.end() - 1);
  return {feasible && peak <= budget, SeparableCost(p, rank, *a)};
}

}  // namespace internal
}  // namespace memplan::planner
