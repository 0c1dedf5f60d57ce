// Intervals of saved instances under a storage assignment (liveness.h):
// each storage's device footprint over the timeline, the copy queues of
// offloads (first in, first out), per-step profiles, the any-plan profile,
// host-offload capacity and the per-instance added time. The timeline they
// read is BuildProblem's (liveness.cc).
#include "memplan/planner/liveness.h"
#include "memplan/planner/program.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "memplan/common/check.h"

namespace memplan::planner {

namespace {

int64_t MovedBytes(const SavedTensor& t, Storage s) { return IsFp8(s) ? t.fp8_bytes : t.bytes; }

void Emit(std::vector<Interval>* out, IntervalPart part, int32_t rank, int64_t first, int64_t last, int64_t bytes,
          int32_t owner, int32_t inst) {
  if (first > last || bytes <= 0) return;
  Interval iv;
  iv.part = part;
  iv.rank = rank;
  iv.first = first;
  iv.last = last;
  iv.bytes = bytes;
  iv.owner_rank = owner;
  iv.instance = inst;
  out->push_back(iv);
}

// Intervals of one instance given when its copy-out completes and when its
// prefetch arrives (both only for offloads).
void EmitInstance(const PlanningProblem& p, int32_t rank, int32_t index, Storage s, int32_t target, double done_s,
                  double arrive_s, std::vector<Interval>* out) {
  using P = IntervalPart;
  const Instance& in = p.instances[static_cast<size_t>(rank)][static_cast<size_t>(index)];
  const SavedTensor& t = p.tensors[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)];
  const RankTimeline& tl = p.timelines[static_cast<size_t>(rank)];
  switch (s) {
    case Storage::kKeep:
      Emit(out, P::kFull, rank, in.prod, in.b_last, t.bytes, rank, index);
      return;
    case Storage::kRecompute:
      Emit(out, P::kFull, rank, in.prod, in.f_last, t.bytes, rank, index);
      Emit(out, P::kRestored, rank, in.b_first, in.b_last, t.bytes, rank, index);
      Emit(out, P::kExtra, rank, in.b_first, in.b_first, t.recompute_extra_bytes, rank, index);
      return;
    case Storage::kFp8:
      Emit(out, P::kFull, rank, in.prod, in.f_last, t.bytes, rank, index);
      Emit(out, P::kCompact, rank, in.prod, in.b_first, t.fp8_bytes, rank, index);
      Emit(out, P::kRestored, rank, in.b_first, in.b_last, t.bytes, rank, index);
      return;
    default:
      break;
  }
  bool fp8 = IsFp8(s);
  int64_t moved = MovedBytes(t, s);
  // The device copy goes once the copy-out is over and, without FP8, once
  // the forward consumers have read it.
  int64_t done = std::max(in.prod, StepAt(tl, done_s));
  if (!fp8) done = std::max(done, in.f_last);
  if (fp8) Emit(out, P::kFull, rank, in.prod, in.f_last, t.bytes, rank, index);
  if (done >= in.pf_start) {
    // The copy-out does not finish before the prefetch would start: the
    // instance stays resident (the verifier flags it).
    Emit(out, fp8 ? P::kCompact : P::kFull, rank, in.prod, fp8 ? in.b_first : in.b_last, moved, rank, index);
    (*out)[out->size() - 1].transfer_late = true;
  } else {
    Emit(out, P::kMovedOut, rank, in.prod, done, moved, rank, index);
    Emit(out, P::kFetched, rank, in.pf_start, fp8 ? in.b_first : in.b_last, moved, rank, index);
    if (IsRemote(s) && target >= 0) {
      const RankTimeline& tt = p.timelines[static_cast<size_t>(target)];
      Emit(out, P::kLanded, target, StepAt(tt, done_s), StepAt(tt, arrive_s), moved, rank, index);
    }
  }
  if (fp8) Emit(out, P::kRestored, rank, in.b_first, in.b_last, t.bytes, rank, index);
}

}  // namespace

void IntervalsOf(const PlanningProblem& p, int32_t rank, int32_t index, Storage s, int32_t target, int64_t out_done,
                 std::vector<Interval>* out) {
  const Instance& in = p.instances[static_cast<size_t>(rank)][static_cast<size_t>(index)];
  const RankTimeline& tl = p.timelines[static_cast<size_t>(rank)];
  double done_s = tl.end_s[static_cast<size_t>(std::min(out_done, tl.steps - 1))];
  const SavedTensor& t = p.tensors[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)];
  const Hardware& hw = p.model->hardware;
  double bw = IsRemote(s) ? hw.pp_link_bw : (hw.h2d_bw * p.offload_bw_share);
  double arrive_s = in.pf_start_s + static_cast<double>(MovedBytes(t, s)) / bw;
  EmitInstance(p, rank, index, s, target, done_s, arrive_s, out);
}

namespace {
// testing::PerturbLiveness (program.h): off unless a test sets it.
struct Perturbation {
  std::string tensor;
  IntervalPart part = IntervalPart::kFull;
  int64_t steps = 0;
};
Perturbation& TestPerturbation() {
  static Perturbation p;
  return p;
}
}  // namespace

namespace testing {
void PerturbLiveness(const std::string& tensor, IntervalPart part, int64_t steps) {
  TestPerturbation() = {tensor, part, steps};
}
void ClearLivenessPerturbation() { TestPerturbation() = {}; }

namespace {
PlannerMutation& Mutation() {
  static PlannerMutation m;
  return m;
}
}  // namespace
void SetPlannerMutation(const PlannerMutation& m) { Mutation() = m; }
void ClearPlannerMutation() { Mutation() = {}; }
const PlannerMutation& ActivePlannerMutation() { return Mutation(); }
}  // namespace testing

void InstanceIntervals(const PlanningProblem& p, const Assignment& a, int32_t rank, std::vector<Interval>* out,
                       TransferStats* stats) {
  const size_t first_out = out->size();
  struct Perturb {  // applied on the way out (tests only)
    const PlanningProblem& p;
    int32_t rank;
    std::vector<Interval>* out;
    size_t from;
    ~Perturb() {
      const Perturbation& t = TestPerturbation();
      if (t.steps == 0) return;
      for (size_t k = from; k < out->size(); ++k) {
        Interval& iv = (*out)[k];
        const Instance& in = p.instances[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(iv.instance)];
        if (iv.part != t.part || p.tensors[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(in.tensor)].name != t.tensor) continue;
        iv.last = std::clamp<int64_t>(iv.last + t.steps, iv.first, p.timelines[static_cast<size_t>(iv.rank)].steps - 1);
      }
    }
  } perturb{p, rank, out, first_out};
  const auto& insts = p.instances[static_cast<size_t>(rank)];
  const auto& ts = p.tensors[static_cast<size_t>(rank)];
  const auto& st = a.storage[static_cast<size_t>(rank)];
  const Hardware& hw = p.model->hardware;
  // Copy queues, first in first out, in the order the copies are issued.
  std::vector<int32_t> offloaded;
  for (size_t i = 0; i < insts.size(); ++i) {
    Storage s = st[static_cast<size_t>(insts[i].tensor)];
    if (IsOffload(s)) {
      offloaded.push_back(static_cast<int32_t>(i));
    } else {
      EmitInstance(p, rank, static_cast<int32_t>(i), s, -1, 0, 0, out);
    }
  }
  std::vector<double> done(insts.size(), 0), arrive(insts.size(), 0);
  auto by = [&](auto field) {
    std::vector<int32_t> order = offloaded;
    std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
      return insts[static_cast<size_t>(x)].*field < insts[static_cast<size_t>(y)].*field;
    });
    return order;
  };
  double q_host = 0, q_link = 0;
  for (int32_t i : by(&Instance::prod_end_s)) {
    const Instance& in = insts[static_cast<size_t>(i)];
    Storage s = st[static_cast<size_t>(in.tensor)];
    bool remote = IsRemote(s);
    double& q = remote ? q_link : q_host;
    double start = std::max(q, in.prod_end_s);
    q = start + static_cast<double>(MovedBytes(ts[static_cast<size_t>(in.tensor)], s)) / (remote ? hw.pp_link_bw : (hw.d2h_bw * p.offload_bw_share));
    done[static_cast<size_t>(i)] = q;
  }
  double q_in = 0, q_link_in = 0;
  for (int32_t i : by(&Instance::pf_start_s)) {
    const Instance& in = insts[static_cast<size_t>(i)];
    const SavedTensor& t = ts[static_cast<size_t>(in.tensor)];
    Storage s = st[static_cast<size_t>(in.tensor)];
    bool remote = IsRemote(s);
    double& q = remote ? q_link_in : q_in;
    double start = std::max(q, in.pf_start_s);
    q = start + static_cast<double>(MovedBytes(t, s)) / (remote ? hw.pp_link_bw : (hw.h2d_bw * p.offload_bw_share));
    arrive[static_cast<size_t>(i)] = q;
    if (stats) {
      stats->exposed_s += static_cast<double>(InstanceWeight(p, rank, i)) *
                          (t.cost_offload_s ? *t.cost_offload_s : std::max(0.0, q - in.need_s));
    }
  }
  for (int32_t i : offloaded) {
    const Instance& in = insts[static_cast<size_t>(i)];
    size_t before = out->size();
    EmitInstance(p, rank, i, st[static_cast<size_t>(in.tensor)], a.target[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)],
                 done[static_cast<size_t>(i)], arrive[static_cast<size_t>(i)], out);
    if (stats) {
      for (size_t k = before; k < out->size(); ++k) {
        stats->late_copies += (*out)[k].transfer_late ? InstanceWeight(p, rank, i) : 0;
      }
    }
  }
}

std::vector<std::vector<int64_t>> Profiles(const PlanningProblem& p, const std::vector<Interval>& intervals) {
  std::vector<std::vector<int64_t>> prof(p.timelines.size());
  for (size_t r = 0; r < p.timelines.size(); ++r) {
    prof[r].assign(static_cast<size_t>(p.timelines[r].steps) + 1, 0);
  }
  for (const auto& iv : intervals) {
    auto& d = prof[static_cast<size_t>(iv.rank)];
    d[static_cast<size_t>(iv.first)] += iv.bytes;
    d[static_cast<size_t>(iv.last) + 1] -= iv.bytes;
  }
  for (size_t r = 0; r < prof.size(); ++r) {
    auto& d = prof[r];
    int64_t run = 0;
    for (size_t s = 0; s + 1 < d.size(); ++s) {
      run += d[s];
      d[s] = run + p.timelines[r].transient[s];
    }
    d.pop_back();
  }
  return prof;
}

std::vector<std::vector<int64_t>> AnyPlanProfiles(const PlanningProblem& p) {
  std::vector<Interval> ivs;
  for (size_t r = 0; r < p.instances.size(); ++r) {
    for (size_t i = 0; i < p.instances[r].size(); ++i) {
      const Instance& in = p.instances[r][i];
      int64_t bytes = p.tensors[r][static_cast<size_t>(in.tensor)].bytes;
      Emit(&ivs, IntervalPart::kFull, static_cast<int32_t>(r), in.prod, in.f_last, bytes, static_cast<int32_t>(r),
           static_cast<int32_t>(i));
      Emit(&ivs, IntervalPart::kRestored, static_cast<int32_t>(r), in.b_first, in.b_last, bytes,
           static_cast<int32_t>(r), static_cast<int32_t>(i));
    }
  }
  return Profiles(p, ivs);
}

bool OffloadCapacity::Fits(const SavedTensor& t, int64_t moved) const {
  size_t l = static_cast<size_t>(t.layer), c = static_cast<size_t>(t.chunk);
  return layer_in_used[l] + static_cast<double>(moved) <= layer_in_bytes[l] &&
         chunk_out_used[c] + static_cast<double>(moved) <= chunk_out_bytes[c];
}

void OffloadCapacity::Add(const SavedTensor& t, int64_t moved, double sign) {
  layer_in_used[static_cast<size_t>(t.layer)] += sign * static_cast<double>(moved);
  chunk_out_used[static_cast<size_t>(t.chunk)] += sign * static_cast<double>(moved);
}

OffloadCapacity HostCapacity(const PlanningProblem& p, int32_t rank) {
  const Hardware& hw = p.model->hardware;
  const int64_t pp = p.model->parallel.pp;
  OffloadCapacity cap;
  cap.layer_in_bytes.assign(p.layers.size(), 0);
  cap.layer_in_used.assign(p.layers.size(), 0);
  cap.chunk_out_bytes.assign(static_cast<size_t>(p.model->parallel.vp), 0);
  cap.chunk_out_used.assign(static_cast<size_t>(p.model->parallel.vp), 0);
  std::vector<double> window(p.layers.size(), std::numeric_limits<double>::infinity());
  const auto& insts = p.instances[static_cast<size_t>(rank)];
  const auto& ts = p.tensors[static_cast<size_t>(rank)];
  for (const auto& in : insts) {
    size_t l = static_cast<size_t>(ts[static_cast<size_t>(in.tensor)].layer);
    window[l] = std::min(window[l], in.need_s - in.pf_start_s);
  }
  for (size_t l = 0; l < window.size(); ++l) {
    if (std::isfinite(window[l])) cap.layer_in_bytes[l] = std::max(0.0, window[l]) * (hw.h2d_bw * p.offload_bw_share);
  }
  for (int64_t c = 0; c < p.model->parallel.vp; ++c) {
    size_t stage = static_cast<size_t>(c * pp + rank);
    // Copy-outs of one forward pass must drain within that pass: warm-up
    // runs forwards back to back, and a queue that grows there makes later
    // copy-outs miss their windows.
    cap.chunk_out_bytes[static_cast<size_t>(c)] = p.stage_fwd_s[stage] * (hw.d2h_bw * p.offload_bw_share);
  }
  return cap;
}

double InstanceCost(const PlanningProblem& p, int32_t rank, int32_t index, Storage s) {
  const Instance& in = p.instances[static_cast<size_t>(rank)][static_cast<size_t>(index)];
  const SavedTensor& t = p.tensors[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)];
  const Hardware& hw = p.model->hardware;
  double cost = 0;
  if (s == Storage::kRecompute) cost += t.cost_recompute_s ? *t.cost_recompute_s : t.recompute_s;
  if (IsFp8(s)) cost += t.cost_fp8_s ? *t.cost_fp8_s : t.fp8_s;
  if (IsOffload(s)) {
    if (t.cost_offload_s) {
      cost += *t.cost_offload_s;
    } else {
      double bw = IsRemote(s) ? hw.pp_link_bw : (hw.h2d_bw * p.offload_bw_share);
      double window = in.need_s - in.pf_start_s;
      cost += std::max(0.0, static_cast<double>(MovedBytes(t, s)) / bw - window);
    }
  }
  return cost;
}

}  // namespace memplan::planner
