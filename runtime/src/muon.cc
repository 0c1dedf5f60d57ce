// Muon (executor_impl.h; docs/runtime.md, "Optimizer"): one step of every
// matrix of a parameter in one process, and across data-parallel replicas
// with ZeRO-1, where each replica holds an element range of the momentum
// and Newton-Schulz needs whole matrices: gathered by all-gather or by
// point-to-point to each matrix's owner (`muon_gather`), in the plan's
// "muon_gather" buffer (accounting.md §6b).
#include "executor_impl.h"

namespace memplan::runtime::exec {

// The matrix at x (the NS scratch's X slot; T, A and B follow it):
//   X <- X / (||X||_F + eps)
//   5 x:  A = X X^T;  B = b A + c A A;  X <- a X + B X
//         (rows > cols: A = X^T X, X <- a X + X B, the same iteration on X^T)
void Executor::Orthogonalize(Rank& r, int64_t rows, int64_t cols) {
  kernels::Ops& k = *r.ops;
  const int64_t n = rows * cols, m = std::min(rows, cols);
  const Buffer& scratch = r.static_buffers.at("muon_ns_scratch");
  MEMPLAN_CHECK(scratch.bytes >= planner::MuonNsScratchBytes(rows, cols), "Muon scratch smaller than the plan's");
  float* x = scratch.as<float>();
  float* t = x + n;
  float* a = t + n;
  float* b = a + m * m;
  const double sq = SquaredNorm(r, x, n);
  k.Axpby(x, nullptr, n, static_cast<float>(1.0 / (std::sqrt(sq) + kMuonNormEps)), 0.f, x);
  for (int s = 0; s < kMuonNsSteps; ++s) {
    if (rows <= cols) {
      k.Gemm(false, true, m, m, cols, 1.f, x, x, 0.f, a, nullptr);
    } else {
      k.Gemm(true, false, m, m, rows, 1.f, x, x, 0.f, a, nullptr);
    }
    k.Gemm(false, false, m, m, m, kMuonNsC, a, a, 0.f, b, nullptr);
    k.Axpby(b, a, m * m, 1.f, kMuonNsB, b);
    if (rows <= cols) {
      k.Gemm(false, false, rows, cols, rows, 1.f, b, x, 0.f, t, nullptr);
    } else {
      k.Gemm(false, false, rows, cols, cols, 1.f, x, b, 0.f, t, nullptr);
    }
    k.Axpby(x, t, n, kMuonNsA, 1.f, x);
  }
}

namespace {

float AdjustedLr(const kernels::AdamConfig& cfg, int64_t rows, int64_t cols) {
  return static_cast<float>(cfg.lr * kMuonRmsScale * std::sqrt(static_cast<double>(std::max(rows, cols))));
}

}  // namespace

// One Muon step of every matrix of `ps` (experts: each expert's):
//   M <- mu M + G;  X <- G + mu M  (Nesterov);  X <- Orthogonalize(X)
//   W <- (1 - lr wd) W - lr 0.2 sqrt(max(rows, cols)) X
// Tensor parallelism: each rank holds a slice of the matrix (TpLayoutOf);
// Newton-Schulz needs it whole, so the ranks' X slices are gathered, every
// rank orthogonalizes the whole matrix and applies its own slice
// (Megatron's "duplicated" mode; the plan's NS scratch holds the whole).
void Executor::MuonStep(Rank& r, ParamState& ps, const kernels::AdamConfig& cfg) {
  kernels::Ops& k = *r.ops;
  auto [rows, cols] = planner::MuonMatrixShape(*ps.spec);
  const int64_t n = rows * cols;
  if (TpSplit(ps)) {
    const int64_t mine = ps.elements;
    MEMPLAN_CHECK(mine * model_.parallel.tp == n, "a tensor-parallel Muon parameter is not one matrix");
    float* x = r.static_buffers.at("muon_ns_scratch").as<float>();
    float* mom = ps.m.as<float>();
    k.Axpby(mom, OwnGrad(ps, 0), mine, kMuonMomentum, 1.f, mom);
    k.Axpby(OwnGrad(ps, 0), mom, mine, 1.f, kMuonMomentum, x);
    std::vector<float> part(static_cast<size_t>(mine));
    backend_->ToHost(*r.dev, part.data(), x, mine * 4);
    std::vector<float> whole = TpWhole(ps, part);
    backend_->FromHost(*r.dev, x, whole.data(), n * 4);
    Orthogonalize(r, rows, cols);
    backend_->ToHost(*r.dev, whole.data(), x, n * 4);
    part = TpSlice(ps, whole);
    backend_->FromHost(*r.dev, x, part.data(), mine * 4);
    k.Axpby(ps.Master(), x, mine, 1.f - cfg.lr * cfg.weight_decay, -AdjustedLr(cfg, rows, cols), ps.Master());
    return;
  }
  MEMPLAN_CHECK(n > 0 && ps.elements % n == 0, "Muon parameter is not a stack of matrices");
  float* x = r.static_buffers.at("muon_ns_scratch").as<float>();
  for (int64_t i = 0; i < ps.elements / n; ++i) {
    float* w = ps.Master() + i * n;
    const float* g = OwnGrad(ps, i * n);
    float* mom = ps.m.as<float>() + i * n;
    k.Axpby(mom, g, n, kMuonMomentum, 1.f, mom);
    k.Axpby(g, mom, n, 1.f, kMuonMomentum, x);
    Orthogonalize(r, rows, cols);
    k.Axpby(w, x, n, 1.f - cfg.lr * cfg.weight_decay, -AdjustedLr(cfg, rows, cols), w);
  }
}

// ZeRO-1 across dp replicas, chunk by chunk (the plan sizes the gather
// buffer for the rank's largest chunk). Each replica holds elements
// [lo, lo + owned) of every parameter (Shard, Owned): it updates its
// momentum range and turns its gradient range into X's (Nesterov) in place,
// then
//   allgather: every replica gathers every Muon parameter of the chunk
//     into the buffer, orthogonalizes every matrix and applies its range;
//   p2p: the chunk's matrices are dealt in decreasing size, round robin,
//     to owners (dense and routed experts apart, as the accounting deals
//     them); each replica sends its part of a matrix to the matrix's owner,
//     which assembles it in the buffer's first half, orthogonalizes it into
//     the second half and sends each replica its part back.
// Either way each replica's weight range gets the same update as in one
// process; GatherWeights then all-gathers the weights. Under tensor
// parallelism a split parameter is one matrix of its slice's elements,
// gathered over the tensor-parallel group for Newton-Schulz (as MuonStep).
void Executor::MuonStepsSharded(Rank& r, const kernels::AdamConfig& cfg) {
  kernels::Ops& k = *r.ops;
  if (std::none_of(r.params.begin(), r.params.end(), [](const ParamState& ps) { return ps.muon; })) return;
  // Only partitioned parameters are gathered: with no replica to gather
  // from (ZeRO-3 at dp 1) the plan has no buffer and needs none.
  auto planned = r.static_buffers.find("muon_gather");
  const Buffer gather = planned != r.static_buffers.end() ? planned->second : Buffer{};
  float* x = r.static_buffers.at("muon_ns_scratch").as<float>();
  const bool p2p = model_.parallel.muon_gather_p2p;
  for (const auto& chunk : p_.layout.chunks[static_cast<size_t>(r.index)]) {
    struct Matrix {
      ParamState* ps;
      int64_t index;  // within the parameter
      int64_t rows, cols;
      int64_t at = 0;  // allgather: offset in the buffer; p2p: in each half
      int owner = 0;  // in the parameter's group (GroupOf)
      int64_t n = 0;  // its elements here (rows * cols, or a tensor-parallel slice's)
    };
    std::vector<Matrix> mats;
    std::vector<ParamState*> params;
    for (int64_t layer : chunk) {
      for (const auto& spec : G(layer).params) {
        auto it = r.param_index.find(spec.name);
        if (it == r.param_index.end() || !r.params[it->second].muon) continue;
        ParamState& ps = r.params[it->second];
        params.push_back(&ps);
        auto [rows, cols] = planner::MuonMatrixShape(*ps.spec);
        const int64_t n = TpSplit(ps) ? ps.elements : rows * cols;
        for (int64_t i = 0; i < ps.elements / n; ++i) {
          mats.push_back({&ps, i, rows, cols});
          mats.back().n = n;
        }
      }
    }
    // Nesterov on this replica's range, X's range in place of the gradient's.
    for (ParamState* ps : params) {
      float* g = OwnGrad(*ps, RangeStart(*ps));
      k.Axpby(ps->m.as<float>(), g, Owned(*ps), kMuonMomentum, 1.f, ps->m.as<float>());
      k.Axpby(g, ps->m.as<float>(), Owned(*ps), 1.f, kMuonMomentum, g);
    }
    backend_->Finish(*r.dev);
    // Newton-Schulz on matrix `mt`'s elements at x: its tensor-parallel
    // slice gathered into the whole matrix first, and cut again after.
    auto orthogonalize = [&](const Matrix& mt) {
      if (!TpSplit(*mt.ps)) return Orthogonalize(r, mt.rows, mt.cols);
      std::vector<float> part(static_cast<size_t>(mt.n));
      backend_->ToHost(*r.dev, part.data(), x, mt.n * 4);
      std::vector<float> whole = TpWhole(*mt.ps, part);
      backend_->FromHost(*r.dev, x, whole.data(), mt.rows * mt.cols * 4);
      Orthogonalize(r, mt.rows, mt.cols);
      backend_->ToHost(*r.dev, whole.data(), x, mt.rows * mt.cols * 4);
      part = TpSlice(*mt.ps, whole);
      backend_->FromHost(*r.dev, x, part.data(), mt.n * 4);
    };
    // The update of matrix `mt` (rows x cols at `u`, device) on this
    // replica's range of its weight.
    auto apply = [&](const Matrix& mt, const float* u) {
      ParamState& ps = *mt.ps;
      const int64_t n = mt.n, lo = RangeStart(ps);
      const int64_t from = std::max(lo, mt.index * n), to = std::min(lo + Owned(ps), (mt.index + 1) * n);
      if (from >= to) return;
      float* w = !ps.master.empty() ? ps.master.as<float>() + (from - lo)
                 : Zero3()          ? ps.shard.as<float>() + (from - lo)
                                    : ps.weight.as<float>() + from;
      k.Axpby(w, u + (from - mt.index * n), to - from, 1.f - cfg.lr * cfg.weight_decay,
              -AdjustedLr(cfg, mt.rows, mt.cols), w);
    };
    // A parameter whose group is this replica alone (routed experts when
    // dp == ep) is not partitioned: its matrices are orthogonalized where
    // they are, with no gather (the accounting gives them no room in the
    // buffer, docs/accounting.md §6b).
    std::erase_if(mats, [&](const Matrix& mt) {
      if (GroupOf(*mt.ps).size > 1) return false;
      const int64_t n = mt.n;
      k.Copy(reinterpret_cast<std::byte*>(x), reinterpret_cast<const std::byte*>(OwnGrad(*mt.ps, mt.index * n)), n * 4);
      orthogonalize(mt);
      apply(mt, x);
      return true;
    });
    std::erase_if(params, [&](const ParamState* ps) { return GroupOf(*ps).size <= 1; });
    if (!p2p) {
      int64_t at = 0;
      std::map<ParamState*, int64_t> where;
      for (ParamState* ps : params) {
        const int64_t n = ps->elements;
        std::vector<std::byte> all = GatherRanges(r, *ps, OwnGrad(*ps, RangeStart(*ps)), 4);
        MEMPLAN_CHECK((at + n) * 4 <= gather.bytes, "Muon's gather exceeds the plan's buffer");
        backend_->FromHost(*r.stat, gather.as<float>() + at, all.data(), n * 4);
        where[ps] = at;
        at += n;
      }
      for (const Matrix& mt : mats) {
        const int64_t n = mt.n;
        k.Copy(reinterpret_cast<std::byte*>(x), reinterpret_cast<const std::byte*>(gather.as<float>() + where[mt.ps] + mt.index * n),
               n * 4);
        orthogonalize(mt);
        apply(mt, x);
      }
      ++r.events["muon_allgathers"];
      continue;
    }
    // p2p: deal the matrices (dense, then routed experts) in decreasing size.
    int64_t owned_elements = 0;
    for (int group = 0; group < 2; ++group) {
      std::vector<Matrix*> order;
      for (Matrix& mt : mats) {
        if ((mt.ps->spec->kind == planner::ParamKind::kExpert) == (group == 1)) order.push_back(&mt);
      }
      std::stable_sort(order.begin(), order.end(),
                       [](const Matrix* a, const Matrix* b) { return a->n > b->n; });
      for (size_t j = 0; j < order.size(); ++j) {
        order[j]->owner = static_cast<int>(j % static_cast<size_t>(GroupOf(*order[j]->ps).size));
      }
    }
    // Whether this replica owns `mt`.
    auto mine = [&](const Matrix& mt) { return mt.owner == GroupOf(*mt.ps).rank; };
    for (Matrix& mt : mats) {
      if (!mine(mt)) continue;
      mt.at = owned_elements;
      owned_elements += mt.n;
    }
    MEMPLAN_CHECK(2 * owned_elements * 4 <= gather.bytes, "Muon's gather exceeds the plan's buffer");
    float* assembled = gather.as<float>();
    float* result = assembled + owned_elements;
    // This replica's part [from, to) of matrix `mt`, in the parameter's elements.
    auto part = [&](const Matrix& mt, int64_t replica) {
      const int64_t n = mt.n, kk = Shard(*mt.ps);
      const int64_t lo = kk * replica, hi = std::min(mt.ps->elements, lo + kk);
      return std::pair<int64_t, int64_t>{std::max(lo, mt.index * n), std::min(hi, (mt.index + 1) * n)};
    };
    // 1. Every part to its matrix's owner (sends never block).
    for (size_t j = 0; j < mats.size(); ++j) {
      const Matrix& mt = mats[j];
      const DpGroup& group = GroupOf(*mt.ps);
      auto [from, to] = part(mt, group.rank);
      std::vector<std::byte> bytes(static_cast<size_t>(std::max<int64_t>(0, to - from) * 4));
      if (from < to) backend_->ToHost(*r.stat, bytes.data(), OwnGrad(*mt.ps, from), (to - from) * 4);
      if (mine(mt)) {
        if (from < to) {
          backend_->FromHost(*r.stat, assembled + mt.at + (from - mt.index * mt.n), bytes.data(),
                             (to - from) * 4);
        }
      } else {
        group.comm->Send(mt.owner, static_cast<int>(j), std::move(bytes));
      }
    }
    // 2. The owner assembles, orthogonalizes and sends each part back.
    for (size_t j = 0; j < mats.size(); ++j) {
      const Matrix& mt = mats[j];
      if (!mine(mt)) continue;
      const DpGroup& group = GroupOf(*mt.ps);
      const int64_t n = mt.n;
      for (int64_t q = 0; q < group.size; ++q) {
        if (q == group.rank) continue;
        auto [from, to] = part(mt, q);
        std::vector<std::byte> bytes = group.comm->Recv(static_cast<int>(q), static_cast<int>(j));
        MEMPLAN_CHECK(static_cast<int64_t>(bytes.size()) == std::max<int64_t>(0, to - from) * 4, "a Muon part has the wrong size");
        if (from < to) backend_->FromHost(*r.stat, assembled + mt.at + (from - mt.index * n), bytes.data(), (to - from) * 4);
      }
      k.Copy(reinterpret_cast<std::byte*>(x), reinterpret_cast<const std::byte*>(assembled + mt.at), n * 4);
      orthogonalize(mt);
      k.Copy(reinterpret_cast<std::byte*>(result + mt.at), reinterpret_cast<const std::byte*>(x), n * 4);
      backend_->Finish(*r.dev);
      for (int64_t q = 0; q < group.size; ++q) {
        if (q == group.rank) continue;
        auto [from, to] = part(mt, q);
        std::vector<std::byte> bytes(static_cast<size_t>(std::max<int64_t>(0, to - from) * 4));
        if (from < to) backend_->ToHost(*r.stat, bytes.data(), result + mt.at + (from - mt.index * n), (to - from) * 4);
        group.comm->Send(static_cast<int>(q), static_cast<int>(mats.size() + j), std::move(bytes));
      }
      apply(mt, result + mt.at);
    }
    // 3. The other matrices' updates, each from its owner.
    for (size_t j = 0; j < mats.size(); ++j) {
      const Matrix& mt = mats[j];
      if (mine(mt)) continue;
      const DpGroup& group = GroupOf(*mt.ps);
      auto [from, to] = part(mt, group.rank);
      std::vector<std::byte> bytes = group.comm->Recv(mt.owner, static_cast<int>(mats.size() + j));
      if (from >= to) continue;
      // Into the X scratch at the part's place in the matrix, then applied.
      const int64_t n = mt.n;
      backend_->FromHost(*r.stat, x + (from - mt.index * n), bytes.data(), (to - from) * 4);
      apply(mt, x);
    }
    ++r.events["muon_p2p_gathers"];
  }
}

}  // namespace memplan::runtime::exec
