#include "memplan/planner/solver.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <optional>

#include "memplan/common/check.h"
#include "memplan/common/parallel.h"
#include "memplan/common/units.h"
#include "solver_internal.h"

namespace memplan::planner {

namespace internal {

namespace {
int64_t MovedBytes(const SavedTensor& t, Storage s) { return IsFp8(s) ? t.fp8_bytes : t.bytes; }

}  // namespace

void QueueFree(const PlanningProblem& p, int32_t rank, int32_t index, Storage s, int32_t target,
               std::vector<Interval>* out) {
  const Instance& in = p.instances[static_cast<size_t>(rank)][static_cast<size_t>(index)];
  const SavedTensor& t = p.tensors[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)];
  const Hardware& hw = p.model->hardware;
  int64_t done = in.prod;
  if (IsOffload(s)) {
    done = CopyDoneStep(p.timelines[static_cast<size_t>(rank)], in, MovedBytes(t, s),
                        IsRemote(s) ? hw.pp_link_bw : (hw.d2h_bw * p.offload_bw_share));
  }
  IntervalsOf(p, rank, index, s, target, done, out);
}

const std::vector<std::array<double, kStorageCount>>& CostTable(const PlanningProblem& p, int32_t rank) {
  return p.tensor_cost_s[static_cast<size_t>(rank)];
}

bool Decidable(const SavedTensor& t, Storage current) { return !t.annotated && !IsRemote(current); }

}  // namespace internal

using internal::CostTable;
using internal::Decidable;
using internal::Exact;
using internal::kLocalOptions;
using internal::QueueFree;

namespace {

constexpr int kMaxMovesPerTensor = 4;
// The heuristic's exchange pass runs on ranks with at most this many
// instances (the tiny and test models; a DeepSeek-V3 rank has ~2 700, where
// it made kimi-k2's plan 8x slower for 5 % less summed cost, and a K3-scale
// rank ~17 000).
constexpr size_t kExchangeInstances = 512;

// Max over steps with range add, O(log n) per update; ArgMax is the leftmost.
// Bottom-up (no recursion): mx_[i] = max(children) + add_[i].
class MaxTree {
 public:
  explicit MaxTree(const std::vector<int64_t>& base) {
    size_t cap = 1;
    while (cap < base.size()) cap <<= 1;
    cap_ = cap;
    mx_.assign(2 * cap, std::numeric_limits<int64_t>::min() / 4);
    add_.assign(2 * cap, 0);
    for (size_t i = 0; i < base.size(); ++i) mx_[cap + i] = base[i];
    for (size_t i = cap - 1; i >= 1; --i) mx_[i] = std::max(mx_[2 * i], mx_[2 * i + 1]);
  }
  void Add(int64_t first, int64_t last, int64_t v) {
    size_t l = static_cast<size_t>(first) + cap_, r = static_cast<size_t>(last) + cap_ + 1;
    size_t l0 = l, r0 = r - 1;
    for (; l < r; l >>= 1, r >>= 1) {
      if (l & 1) Apply(l++, v);
      if (r & 1) Apply(--r, v);
    }
    Pull(l0);
    Pull(r0);
  }
  int64_t Max() const { return mx_[1]; }
  // The value at one step.
  int64_t At(int64_t step) const {
    size_t i = static_cast<size_t>(step) + cap_;
    int64_t v = mx_[i];
    for (i >>= 1; i >= 1; i >>= 1) v += add_[i];
    return v;
  }
  // Max over steps [first, last], without changing the tree.
  int64_t RangeMax(int64_t first, int64_t last) const {
    return Query(1, 0, cap_, static_cast<size_t>(first), static_cast<size_t>(last) + 1);
  }
  int64_t ArgMax() const {
    size_t node = 1;
    int64_t target = mx_[1];
    while (node < cap_) {
      target -= add_[node];
      node = mx_[2 * node] == target ? 2 * node : 2 * node + 1;
    }
    return static_cast<int64_t>(node - cap_);
  }

 private:
  void Apply(size_t i, int64_t v) {
    mx_[i] += v;
    if (i < cap_) add_[i] += v;
  }
  void Pull(size_t i) {
    for (i >>= 1; i >= 1; i >>= 1) mx_[i] = std::max(mx_[2 * i], mx_[2 * i + 1]) + add_[i];
  }
  // Node `node` covers leaves [nl, nr); the query is [l, r).
  int64_t Query(size_t node, size_t nl, size_t nr, size_t l, size_t r) const {
    if (r <= nl || nr <= l) return std::numeric_limits<int64_t>::min() / 4;
    if (l <= nl && nr <= r) return mx_[node];
    size_t mid = (nl + nr) / 2;
    return std::max(Query(2 * node, nl, mid, l, r), Query(2 * node + 1, mid, nr, l, r)) + add_[node];
  }
  size_t cap_ = 1;
  std::vector<int64_t> mx_, add_;
};

// The per-step activation profile of every rank under queue-free copies.
class ProfileTrees {
 public:
  ProfileTrees(const PlanningProblem& p, const Assignment& a) : p_(p) {
    std::vector<std::vector<Interval>> own(p.tensors.size());
    ParallelFor(own.size(), [&](size_t r) {
      for (size_t i = 0; i < p.instances[r].size(); ++i) {
        const Instance& in = p.instances[r][i];
        QueueFree(p, static_cast<int32_t>(r), static_cast<int32_t>(i), a.storage[r][static_cast<size_t>(in.tensor)],
                  a.target[r][static_cast<size_t>(in.tensor)], &own[r]);
      }
    });
    std::vector<Interval> ivs;
    for (const auto& v : own) ivs.insert(ivs.end(), v.begin(), v.end());
    auto base = planner::Profiles(p, ivs);
    for (auto& b : base) trees_.emplace_back(b);
    scratch_.resize(trees_.size());
  }

  MaxTree& tree(int32_t r) { return trees_[static_cast<size_t>(r)]; }

  // Moves every instance of tensor t of `rank` from one storage to another:
  // the difference of the two profiles, as maximal runs of one value.
  void Change(int32_t rank, int32_t t, Storage from, int32_t from_target, Storage to, int32_t to_target) {
    for (const Piece& piece : Delta(rank, t, from, from_target, to, to_target)) {
      trees_[static_cast<size_t>(piece.rank)].Add(piece.first, piece.last, piece.bytes);
    }
  }

  // Whether every rank's profile stays at most `limit` after Change(...),
  // without changing anything. Valid while every profile is already at most
  // `limit` (then only steps that gain bytes can cross it).
  bool StaysWithin(int32_t rank, int32_t t, Storage from, int32_t from_target, Storage to, int32_t to_target,
                   int64_t limit) {
    for (const Piece& piece : Delta(rank, t, from, from_target, to, to_target)) {
      if (piece.bytes <= 0) continue;
      if (trees_[static_cast<size_t>(piece.rank)].RangeMax(piece.first, piece.last) + piece.bytes > limit) return false;
    }
    return true;
  }

  struct Piece {
    int32_t rank;
    int64_t first, last, bytes;
  };
  // The profile under `to` minus the profile under `from` of tensor t's
  // instances: runs of constant non-zero difference, per rank, in step order.
  const std::vector<Piece>& Delta(int32_t rank, int32_t t, Storage from, int32_t from_target, Storage to,
                                  int32_t to_target) {
    Scratch& sc = scratch_[static_cast<size_t>(rank)];
    auto& events = sc.events;
    auto& ivs = sc.intervals;
    auto& pieces = sc.pieces;
    events.clear();
    const auto& first = p_.first_instance[static_cast<size_t>(rank)];
    for (int32_t i = first[static_cast<size_t>(t)]; i < first[static_cast<size_t>(t) + 1]; ++i) {
      for (int sign : {-1, 1}) {
        ivs.clear();
        QueueFree(p_, rank, i, sign < 0 ? from : to, sign < 0 ? from_target : to_target, &ivs);
        for (const auto& iv : ivs) {
          events.push_back({iv.rank, iv.first, sign * iv.bytes});
          events.push_back({iv.rank, iv.last + 1, -sign * iv.bytes});
        }
      }
    }
    std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
      return a.rank != b.rank ? a.rank < b.rank : a.step < b.step;
    });
    pieces.clear();
    int64_t run = 0;
    for (size_t k = 0; k < events.size();) {
      const int32_t r = events[k].rank;
      const int64_t step = events[k].step;
      for (; k < events.size() && events[k].rank == r && events[k].step == step; ++k) run += events[k].bytes;
      if (run != 0 && k < events.size() && events[k].rank == r) pieces.push_back({r, step, events[k].step - 1, run});
      if (k == events.size() || events[k].rank != r) run = 0;  // every interval closed on its rank
    }
    return pieces;
  }

  // Bytes tensor t's instances occupy on `on_rank` at `step` under `s`.
  int64_t ResidentAt(int32_t rank, int32_t t, Storage s, int32_t target, int32_t on_rank, int64_t step) {
    auto& ivs = scratch_[static_cast<size_t>(rank)].intervals;
    const auto& first = p_.first_instance[static_cast<size_t>(rank)];
    const auto& insts = p_.instances[static_cast<size_t>(rank)];
    int32_t lo = first[static_cast<size_t>(t)], hi = first[static_cast<size_t>(t) + 1];
    if (on_rank == rank) {
      // A chunk's forwards, and its backwards, run in microbatch order: the
      // instances whose span [prod, b_last] holds `step` are contiguous.
      auto begin = insts.begin() + lo, end = insts.begin() + hi;
      auto from = std::partition_point(begin, end, [&](const Instance& in) { return in.b_last < step; });
      auto to = std::partition_point(from, end, [&](const Instance& in) { return in.prod <= step; });
      lo = static_cast<int32_t>(from - insts.begin());
      hi = static_cast<int32_t>(to - insts.begin());
    }
    int64_t total = 0;
    for (int32_t i = lo; i < hi; ++i) {
      const Instance& in = insts[static_cast<size_t>(i)];
      if (on_rank == rank && (step < in.prod || step > in.b_last)) continue;
      ivs.clear();
      QueueFree(p_, rank, i, s, target, &ivs);
      for (const auto& iv : ivs) {
        if (iv.rank == on_rank && iv.first <= step && step <= iv.last) total += iv.bytes;
      }
    }
    return total;
  }

 private:
  struct Event {
    int32_t rank;
    int64_t step, bytes;
  };
  const PlanningProblem& p_;
  std::vector<MaxTree> trees_;
  // Per rank, so that ranks' local decisions can run in parallel (each
  // touches its own tree and scratch).
  struct Scratch {
    std::vector<Interval> intervals;
    std::vector<Event> events;
    std::vector<Piece> pieces;
  };
  std::vector<Scratch> scratch_;
};

// The heuristic for one rank (docs/planner.md, "Heuristic"): the peak-step
// greedy, clean-up and exchange; on small ranks the same again from the
// start with the excess-area repair, keeping the cheaper plan that fits.
class RankHeuristic {
 public:
  RankHeuristic(const PlanningProblem& p, int32_t rank, int64_t budget, ProfileTrees& prof, Assignment* a)
      : p_(p), rank_(rank), budget_(budget), prof_(prof), a_(a), ts_(p.tensors[static_cast<size_t>(rank)]),
        st_(a->storage[static_cast<size_t>(rank)]), costs_(CostTable(p, rank)), pp_(p.model->parallel.pp),
        tree_(prof.tree(rank)), cap_(HostCapacity(p, rank)), moves_(ts_.size(), 0) {
    for (size_t t = 0; t < ts_.size(); ++t) cap_.Add(ts_[t], HostMoved(t, st_[t]), 1);
  }

  SolveResult Run() {
    const bool small = p_.instances[static_cast<size_t>(rank_)].size() <= kExchangeInstances;
    const std::vector<Storage> initial = st_;
    const std::vector<int> initial_moves = moves_;
    Repair();
    CleanUp();
    Exchange();
    if (small) {
      // The same from the start with the area repair; the cheaper one stays.
      const std::vector<Storage> first = st_;
      const bool first_fits = Fits();
      const double first_cost = Cost();
      RestoreTo(initial);
      moves_ = initial_moves;
      RepairByArea();
      Repair();  // whatever the area repair could not cover
      CleanUp();
      Exchange();
      if (first_fits && (!Fits() || Cost() >= first_cost)) RestoreTo(first);
      // A third start: every tensor offloaded to the host where that costs
      // nothing more than keeping it, then the same repairs. Free offloads
      // lower the forward's peaks, which the greedy, working down from the
      // highest peak, can leave to one costly move.
      const std::vector<Storage> second = st_;
      const bool second_fits = Fits();
      const double second_cost = Cost();
      RestoreTo(initial);
      moves_ = initial_moves;
      for (size_t t = 0; t < ts_.size(); ++t) {
        const Storage cur = st_[t];
        if (!Decidable(ts_[t], cur) || cur != Storage::kKeep || !Legal(ts_[t], Storage::kOffloadHost, pp_)) continue;
        if (CostOf(t, Storage::kOffloadHost) > CostOf(t, cur) || !OffloadFits(t, cur, Storage::kOffloadHost)) continue;
        Change(t, Storage::kOffloadHost);
      }
      RepairByArea();
      Repair();
      Exchange();
      if (second_fits && (!Fits() || Cost() >= second_cost)) RestoreTo(second);
    }
    return {Fits(), Cost()};
  }

 private:
  struct Candidate {
    double score;
    int64_t benefit;
    int32_t tensor;
    Storage to;
  };

  bool Fits() const { return tree_.Max() <= budget_; }
  double Cost() const { return SeparableCost(p_, rank_, *a_); }
  double CostOf(size_t t, Storage s) const { return costs_[t][static_cast<size_t>(s)]; }

  int64_t HostMoved(size_t t, Storage s) const {
    if (s != Storage::kOffloadHost && s != Storage::kFp8OffloadHost) return 0;
    return s == Storage::kFp8OffloadHost ? ts_[t].fp8_bytes : ts_[t].bytes;
  }
  // Host offload must hide behind compute: within the layer's and chunk's
  // copy capacity once the tensor's current share is released.
  bool OffloadFits(size_t t, Storage from, Storage to) {
    int64_t moved = HostMoved(t, to);
    if (moved == 0) return true;
    cap_.Add(ts_[t], HostMoved(t, from), -1);
    bool ok = cap_.Fits(ts_[t], moved);
    cap_.Add(ts_[t], HostMoved(t, from), 1);
    return ok;
  }
  void Change(size_t t, Storage to) {
    ++moves_[t];
    if (logging_) log_.emplace_back(t, st_[t]);
    cap_.Add(ts_[t], HostMoved(t, st_[t]), -1);
    cap_.Add(ts_[t], HostMoved(t, to), 1);
    prof_.Change(rank_, static_cast<int32_t>(t), st_[t], -1, to, -1);
    st_[t] = to;
  }
  void RestoreTo(const std::vector<Storage>& storage) {
    for (size_t t = 0; t < ts_.size(); ++t) {
      if (st_[t] != storage[t]) Change(t, storage[t]);
    }
  }
  // The legal storages of tensor t cheaper than its current one, cheapest first.
  std::vector<Storage> Cheaper(size_t t) const {
    std::vector<Storage> out;
    for (Storage o : kLocalOptions) {
      if (o != st_[t] && Legal(ts_[t], o, pp_) && CostOf(t, o) < CostOf(t, st_[t])) out.push_back(o);
    }
    std::stable_sort(out.begin(), out.end(), [&](Storage x, Storage y) { return CostOf(t, x) < CostOf(t, y); });
    return out;
  }
  // The decided (not kept, not annotated) tensors, most expensive first.
  std::vector<int32_t> DecidedByCost() const {
    std::vector<int32_t> decided;
    for (size_t t = 0; t < ts_.size(); ++t) {
      if (Decidable(ts_[t], st_[t]) && st_[t] != Storage::kKeep) decided.push_back(static_cast<int32_t>(t));
    }
    std::stable_sort(decided.begin(), decided.end(), [&](int32_t x, int32_t y) {
      return CostOf(static_cast<size_t>(x), st_[static_cast<size_t>(x)]) >
             CostOf(static_cast<size_t>(y), st_[static_cast<size_t>(y)]);
    });
    return decided;
  }

  // Greedy repair: while the peak exceeds the budget, move the tensors that
  // remove bytes at the peak step at the least added seconds per byte.
  void Repair() {
    for (int iter = 0; iter < 100000 && !Fits(); ++iter) {
      int64_t step = tree_.ArgMax();
      int64_t excess = tree_.Max() - budget_;
      std::vector<Candidate> cands;
      for (size_t t = 0; t < ts_.size(); ++t) {
        Storage cur = st_[t];
        if (!Decidable(ts_[t], cur)) continue;
        int64_t now = prof_.ResidentAt(rank_, static_cast<int32_t>(t), cur, -1, rank_, step);
        if (now == 0) continue;
        Candidate best{std::numeric_limits<double>::infinity(), 0, static_cast<int32_t>(t), cur};
        for (Storage o : kLocalOptions) {
          // Any move that lowers the peak step qualifies (at a backward peak,
          // fp8's dequantize or recompute's chain can cost more than keep);
          // a cap on moves per tensor rules out oscillation.
          if (o == cur || !Legal(ts_[t], o, pp_) || moves_[t] >= kMaxMovesPerTensor) continue;
          if (!OffloadFits(t, cur, o)) continue;
          int64_t benefit = now - prof_.ResidentAt(rank_, static_cast<int32_t>(t), o, -1, rank_, step);
          if (benefit <= 0) continue;
          double score = (CostOf(t, o) - CostOf(t, cur)) / static_cast<double>(benefit);
          if (score < best.score || (score == best.score && benefit > best.benefit)) best = {score, benefit, best.tensor, o};
        }
        if (best.to != cur) cands.push_back(best);
      }
      if (cands.empty()) break;
      std::stable_sort(cands.begin(), cands.end(), [](const Candidate& x, const Candidate& y) {
        if (x.score != y.score) return x.score < y.score;
        return x.benefit > y.benefit;
      });
      int64_t covered = 0;
      bool applied = false;
      for (const auto& c : cands) {
        size_t t = static_cast<size_t>(c.tensor);
        if (!OffloadFits(t, st_[t], c.to)) continue;  // an earlier candidate took the capacity
        Change(t, c.to);
        applied = true;
        covered += c.benefit;
        if (covered >= excess) break;
      }
      if (!applied) break;
    }
  }

  // Greedy repair by the excess area (small ranks): while some step exceeds
  // the budget, apply the move with the least added seconds per byte-step of
  // excess it removes, over every step (a move that lowers several peaks
  // counts for each), net of the excess it creates elsewhere.
  void RepairByArea() {
    const int64_t steps = p_.timelines[static_cast<size_t>(rank_)].steps;
    std::vector<int64_t> level(static_cast<size_t>(steps));
    for (int iter = 0; iter < 100000 && !Fits(); ++iter) {
      for (int64_t s = 0; s < steps; ++s) level[static_cast<size_t>(s)] = tree_.At(s);
      Candidate best{std::numeric_limits<double>::infinity(), 0, -1, Storage::kKeep};
      for (size_t t = 0; t < ts_.size(); ++t) {
        Storage cur = st_[t];
        if (!Decidable(ts_[t], cur)) continue;
        for (Storage o : kLocalOptions) {
          if (o == cur || !Legal(ts_[t], o, pp_) || moves_[t] >= kMaxMovesPerTensor) continue;
          if (!OffloadFits(t, cur, o)) continue;
          int64_t net = 0;
          for (const auto& piece : prof_.Delta(rank_, static_cast<int32_t>(t), cur, -1, o, -1)) {
            for (int64_t s = piece.first; s <= piece.last; ++s) {
              const int64_t before = std::max<int64_t>(0, level[static_cast<size_t>(s)] - budget_);
              const int64_t after = std::max<int64_t>(0, level[static_cast<size_t>(s)] + piece.bytes - budget_);
              net += before - after;
            }
          }
          if (net <= 0) continue;
          double score = (CostOf(t, o) - CostOf(t, cur)) / static_cast<double>(net);
          if (score < best.score || (score == best.score && net > best.benefit)) {
            best = {score, net, static_cast<int32_t>(t), o};
          }
        }
      }
      if (best.tensor < 0) break;
      Change(static_cast<size_t>(best.tensor), best.to);
    }
  }

  // Drop what is no longer needed: most expensive decisions first, each to
  // the cheapest storage that still fits.
  void CleanUp() {
    if (!Fits()) return;
    for (int32_t t : DecidedByCost()) {
      const size_t ti = static_cast<size_t>(t);
      Storage cur = st_[ti];
      // A cheaper storage keeps more bytes between forward and backward; skip
      // it without trying when even one instance's extra bytes exceed the
      // headroom left under the budget.
      int64_t headroom = budget_ - tree_.Max();
      for (Storage o : Cheaper(ti)) {
        if (StoredBytes(ts_[ti], o) - StoredBytes(ts_[ti], cur) > headroom || !OffloadFits(ti, cur, o)) continue;
        if (!prof_.StaysWithin(rank_, t, cur, -1, o, -1, budget_)) continue;
        Change(ti, o);
        break;
      }
    }
  }

  // Exchange pass, on ranks small enough to afford it: each decision, most
  // expensive first, pinned in turn to each cheaper storage, the others
  // repaired and cleaned up around it; kept when the rank costs less. One
  // move that lowers several peaks at once is what the per-peak greedy misses.
  void Exchange() {
    if (!Fits() || p_.instances[static_cast<size_t>(rank_)].size() > kExchangeInstances) return;
    for (int pass = 0; pass < 2; ++pass) {
      bool improved = false;
      for (int32_t t : DecidedByCost()) {
        const size_t ti = static_cast<size_t>(t);
        for (Storage o : Cheaper(ti)) {
          if (CostOf(ti, o) >= CostOf(ti, st_[ti])) continue;  // an earlier trial won
          if (!OffloadFits(ti, st_[ti], o)) continue;
          const double before = Cost();
          const std::vector<int> saved_moves = moves_;
          log_.clear();
          logging_ = true;
          Change(ti, o);
          moves_[ti] = kMaxMovesPerTensor;  // it stays there in this trial
          const size_t pinned = log_.size();
          const std::vector<int> pinned_moves = moves_;
          Repair();
          CleanUp();
          if (!(Fits() && Cost() < before - 1e-12)) {
            // The peak greedy's repair did not pay: the same pin repaired by
            // the excess area instead (one move that lowers several peaks).
            logging_ = false;
            for (size_t k = log_.size(); k > pinned; --k) Change(log_[k - 1].first, log_[k - 1].second);
            log_.resize(pinned);
            logging_ = true;
            moves_ = pinned_moves;
            RepairByArea();
            Repair();
            CleanUp();
          }
          logging_ = false;
          if (Fits() && Cost() < before - 1e-12) {
            improved = true;
          } else {
            for (auto it = log_.rbegin(); it != log_.rend(); ++it) Change(it->first, it->second);
          }
          moves_ = saved_moves;
        }
      }
      if (!improved) break;
    }
  }

  const PlanningProblem& p_;
  const int32_t rank_;
  const int64_t budget_;
  ProfileTrees& prof_;
  Assignment* a_;
  const std::vector<SavedTensor>& ts_;
  std::vector<Storage>& st_;
  const std::vector<std::array<double, kStorageCount>>& costs_;
  const int64_t pp_;
  MaxTree& tree_;
  OffloadCapacity cap_;
  std::vector<int> moves_;
  // Every change, while a trial of the exchange pass records them.
  std::vector<std::pair<size_t, Storage>> log_;
  bool logging_ = false;
};

SolveResult Heuristic(const PlanningProblem& p, int32_t rank, int64_t budget, ProfileTrees& prof, Assignment* a) {
  return RankHeuristic(p, rank, budget, prof, a).Run();
}

}  // namespace

double SeparableCost(const PlanningProblem& p, int32_t rank, const Assignment& a) {
  const auto& table = CostTable(p, rank);
  double c = 0;
  for (size_t t = 0; t < table.size(); ++t) {
    c += table[t][static_cast<size_t>(a.storage[static_cast<size_t>(rank)][t])];
  }
  return c;
}

struct ProfileCache::Impl {
  Impl(const PlanningProblem& p, const Assignment& a) : trees(std::in_place, p, a) {}
  std::optional<ProfileTrees> trees;
};

ProfileCache::ProfileCache(const PlanningProblem& p, const Assignment& a) : impl_(std::make_unique<Impl>(p, a)) {}
ProfileCache::~ProfileCache() = default;

std::vector<SolveResult> Solve(const PlanningProblem& p, const std::vector<int64_t>& budgets, SolverKind kind,
                               Assignment* a, ProfileCache* cache) {
  const int32_t pp = static_cast<int32_t>(p.tensors.size());
  std::vector<SolveResult> out;
  if (kind == SolverKind::kHeuristic) {
    std::optional<ProfileTrees> own;
    if (!cache) own.emplace(p, *a);  // every rank, incoming remote offloads included
    ProfileTrees& prof = cache ? *cache->impl().trees : *own;
    // Local decisions touch only their own rank's tree: ranks in parallel.
    out.resize(static_cast<size_t>(pp));
    ParallelFor(static_cast<size_t>(pp), [&](size_t r) {
      out[r] = Heuristic(p, static_cast<int32_t>(r), budgets[r], prof, a);
    });
    return out;
  }
  // The heuristic's solution of the same problem starts each MILP.
  Assignment warm = *a;
  std::vector<SolveResult> warm_result;
  {
    ProfileTrees prof(p, warm);
    for (int32_t r = 0; r < pp; ++r) warm_result.push_back(Heuristic(p, r, budgets[static_cast<size_t>(r)], prof, &warm));
  }
  for (int32_t r = 0; r < pp; ++r) {
    // Bytes other ranks offload into this one are fixed for its MILP.
    std::vector<Interval> incoming;
    for (int32_t src = 0; src < pp; ++src) {
      if (src == r) continue;
      for (size_t i = 0; i < p.instances[static_cast<size_t>(src)].size(); ++i) {
        size_t t = static_cast<size_t>(p.instances[static_cast<size_t>(src)][i].tensor);
        if (!IsRemote(a->storage[static_cast<size_t>(src)][t]) || a->target[static_cast<size_t>(src)][t] != r) continue;
        QueueFree(p, src, static_cast<int32_t>(i), a->storage[static_cast<size_t>(src)][t], r, &incoming);
      }
    }
    std::erase_if(incoming, [&](const Interval& iv) { return iv.rank != r; });
    const auto* start = warm_result[static_cast<size_t>(r)].fits ? &warm.storage[static_cast<size_t>(r)] : nullptr;
    out.push_back(Exact(p, r, budgets[static_cast<size_t>(r)], incoming, start, a));
  }
  // The MILP changed the assignment behind the cache's back.
  if (cache) cache->impl().trees.emplace(p, *a);
  return out;
}

RebalanceResult Rebalance(const PlanningProblem& p, int64_t budget, Assignment* a, ProfileCache* cache) {
  RebalanceResult result;
  const int32_t pp = static_cast<int32_t>(p.tensors.size());
  if (pp < 2) return result;
  std::optional<ProfileTrees> own;
  if (!cache) own.emplace(p, *a);
  ProfileTrees& prof = cache ? *cache->impl().trees : *own;
  auto lower = [&](int32_t r) { return p.statics[static_cast<size_t>(r)].total + prof.tree(r).Max(); };
  const Hardware& hw = p.model->hardware;
  const auto& costs = p.tensor_cost_s;
  std::vector<double> added(static_cast<size_t>(pp), 0);
  for (int32_t r = 0; r < pp; ++r) added[static_cast<size_t>(r)] = SeparableCost(p, r, *a);
  // Link budget: remote bytes per (rank, layer) and microbatch must move
  // within the layer's prefetch window.
  std::vector<std::map<int64_t, double>> link_s(static_cast<size_t>(pp));
  std::vector<std::map<int32_t, double>> link_out_s(static_cast<size_t>(pp));
  std::vector<std::vector<bool>> tried(static_cast<size_t>(pp));
  for (int32_t r = 0; r < pp; ++r) tried[static_cast<size_t>(r)].assign(p.tensors[static_cast<size_t>(r)].size(), false);
  auto remote_of = [](Storage s) { return IsFp8(s) ? Storage::kFp8OffloadRemote : Storage::kOffloadRemote; };
  std::vector<bool> exhausted(static_cast<size_t>(pp), false);
  exhausted[static_cast<size_t>(pp - 1)] = true;  // no later rank
  for (int iter = 0; iter < 1000000; ++iter) {
    // Source: a rank over budget (the highest), else the one whose decisions
    // cost the most time.
    int32_t r = -1;
    for (int32_t k = 0; k < pp; ++k) {
      if (exhausted[static_cast<size_t>(k)]) continue;
      auto key = [&](int32_t x) { return std::make_pair(lower(x) > budget ? lower(x) : 0, added[static_cast<size_t>(x)]); };
      if (r < 0 || key(k) > key(r)) r = k;
    }
    if (r < 0) break;
    bool over = lower(r) > budget;
    if (!over && added[static_cast<size_t>(r)] <= 0) {
      exhausted[static_cast<size_t>(r)] = true;
      continue;
    }
    int32_t target = -1;  // the later rank with the most spare memory
    for (int32_t k = r + 1; k < pp; ++k) {
      if (target < 0 || lower(k) < lower(target)) target = k;
    }
    const auto& ts = p.tensors[static_cast<size_t>(r)];
    auto& st = a->storage[static_cast<size_t>(r)];
    int64_t step = prof.tree(r).ArgMax();
    // Candidate: most seconds saved per byte moved; when the rank is over
    // budget, most bytes removed at its peak step.
    int32_t best = -1;
    double best_score = 0;
    for (size_t t = 0; t < ts.size(); ++t) {
      if (tried[static_cast<size_t>(r)][t] || ts[t].annotated || IsRemote(st[t])) continue;
      Storage to = remote_of(st[t]);
      if (!Legal(ts[t], to, pp)) continue;  // the one storage rule (liveness.h)
      double score = 0;
      if (over) {
        score = static_cast<double>(prof.ResidentAt(r, static_cast<int32_t>(t), st[t], -1, r, step) -
                                    prof.ResidentAt(r, static_cast<int32_t>(t), to, target, r, step));
      } else {
        double saved = costs[static_cast<size_t>(r)][t][static_cast<size_t>(st[t])] -
                       costs[static_cast<size_t>(r)][t][static_cast<size_t>(to)];
        score = saved / static_cast<double>(IsFp8(to) ? ts[t].fp8_bytes : ts[t].bytes);
      }
      if (score > best_score) {
        best_score = score;
        best = static_cast<int32_t>(t);
      }
    }
    if (best < 0) {
      exhausted[static_cast<size_t>(r)] = true;
      continue;
    }
    tried[static_cast<size_t>(r)][static_cast<size_t>(best)] = true;
    const SavedTensor& t = ts[static_cast<size_t>(best)];
    Storage from = st[static_cast<size_t>(best)];
    Storage to = remote_of(from);
    // The target must have room for at least one instance.
    if (lower(target) + (IsFp8(to) ? t.fp8_bytes : t.bytes) > std::max(budget, lower(r))) continue;
    double window = std::numeric_limits<double>::infinity();
    const auto& first = p.first_instance[static_cast<size_t>(r)];
    for (int32_t i = first[static_cast<size_t>(best)]; i < first[static_cast<size_t>(best) + 1]; ++i) {
      const Instance& in = p.instances[static_cast<size_t>(r)][static_cast<size_t>(i)];
      window = std::min(window, in.need_s - in.pf_start_s);
    }
    double seconds = static_cast<double>(IsFp8(to) ? t.fp8_bytes : t.bytes) / hw.pp_link_bw;
    double need = link_s[static_cast<size_t>(r)][t.layer] + seconds;
    // Copy-outs of one forward pass drain within it (as for host offload).
    size_t stage = static_cast<size_t>(t.chunk) * static_cast<size_t>(pp) + static_cast<size_t>(r);
    double out_need = link_out_s[static_cast<size_t>(r)][t.chunk] + seconds;
    if (need > window || out_need > p.stage_fwd_s[stage]) continue;  // the link cannot hide it
    int64_t source_before = lower(r);
    prof.Change(r, best, from, -1, to, target);
    bool ok = lower(target) <= std::max(budget, source_before) && lower(r) <= source_before &&
              (!over || lower(r) < source_before) && lower(target) < source_before;
    if (ok) {
      st[static_cast<size_t>(best)] = to;
      a->target[static_cast<size_t>(r)][static_cast<size_t>(best)] = target;
      link_s[static_cast<size_t>(r)][t.layer] = need;
      link_out_s[static_cast<size_t>(r)][t.chunk] = out_need;
      added[static_cast<size_t>(r)] += costs[static_cast<size_t>(r)][static_cast<size_t>(best)][static_cast<size_t>(to)] -
                                       costs[static_cast<size_t>(r)][static_cast<size_t>(best)][static_cast<size_t>(from)];
      ++result.moved_tensors;
    } else {
      prof.Change(r, best, to, target, from, -1);
    }
  }
  return result;
}

}  // namespace memplan::planner
