// Buffers in model terms (program.h): the names `check` compares an eager
// measurement by, and the predicted buffers of a rank's memory program.
#include <algorithm>
#include <string>
#include <vector>

#include "memplan/planner/bounds.h"
#include "memplan/planner/program.h"
#include "memplan/planner/replay.h"
#include "memplan/planner/templates.h"

namespace memplan::planner {

namespace {

std::string AtMicrobatch(const std::string& name, int32_t mb) { return name + "@mb" + std::to_string(mb); }

const char* PartName(IntervalPart part) {
  switch (part) {
    case IntervalPart::kFull: return "full";
    case IntervalPart::kCompact: return "fp8";
    case IntervalPart::kMovedOut: return "staging";
    case IntervalPart::kFetched: return "fetched";
    case IntervalPart::kRestored: return "restored";
    case IntervalPart::kExtra: return "recompute";
    case IntervalPart::kLanded: return "landed";
  }
  return "?";
}

}  // namespace

BufferLabel InstancePartLabel(const PlanningProblem& p, int32_t owner_rank, int32_t instance, IntervalPart part) {
  const Instance& in = p.instances[static_cast<size_t>(owner_rank)][static_cast<size_t>(instance)];
  const SavedTensor& st = p.tensors[static_cast<size_t>(owner_rank)][static_cast<size_t>(in.tensor)];
  return {AtMicrobatch(st.name, in.microbatch), PartName(part)};
}

BufferLabel BlockBufferLabel(const PlanningProblem& p, int32_t rank, int64_t block, BlockBuffer::Role role,
                             int32_t tensor, int32_t op) {
  const Block& blk = p.timelines[static_cast<size_t>(rank)].blocks[static_cast<size_t>(block)];
  const LayerGraph& g = p.layers[static_cast<size_t>(blk.layer)];
  auto op_name = [&] { return g.ops[g.TopologicalOrder()[static_cast<size_t>(op)]].name; };
  using R = BlockBuffer::Role;
  if (role == R::kWorkspace) return {AtMicrobatch(op_name(), blk.microbatch), "workspace"};
  const std::string name = AtMicrobatch(g.tensors[static_cast<size_t>(tensor)].name, blk.microbatch);
  switch (role) {
    case R::kValue: return {name, "value"};
    case R::kGrad: return {name, "grad"};
    case R::kRebuilt: return {name, "rebuilt"};
    case R::kGradTemp: return {name, "grad_temp " + op_name()};
    case R::kWorkspace: break;
  }
  return {name, "?"};
}

BufferLabel CrossBufferLabel(const PlanningProblem& p, int32_t rank, int32_t index) {
  const CrossBuffer& c = p.cross[static_cast<size_t>(rank)][static_cast<size_t>(index)];
  BufferLabel l = InstancePartLabel(p, c.owner_rank, c.instance, IntervalPart::kFull);
  using R = CrossBuffer::Role;
  l.part = c.role == R::kSharedGrad ? "shared_grad" : c.role == R::kCache ? "cache"
           : c.role == R::kCacheGrad ? "cache_grad" : "grad_inbox";
  return l;
}

std::vector<PredictedBuffer> PredictedBuffers(const PlanningProblem& p, int32_t rank,
                                              const std::vector<Interval>& intervals) {
  std::vector<size_t> mine;
  for (size_t k = 0; k < intervals.size(); ++k) {
    if (intervals[k].rank == rank) mine.push_back(k);
  }
  std::vector<PredictedBuffer> out;
  ProgramWalker walk(p, rank, intervals, std::move(mine));
  while (walk.Next()) {
    for (const ProgramBuffer& b : walk.allocations()) {
      PredictedBuffer pb;
      pb.first = b.first;
      pb.last = b.last;
      pb.bytes = b.bytes;
      if (b.interval >= 0) {
        const Interval& iv = intervals[static_cast<size_t>(b.interval)];
        pb.label = InstancePartLabel(p, iv.owner_rank, iv.instance, iv.part);
        pb.copy_timed = iv.part == IntervalPart::kMovedOut;
      } else if (b.cross >= 0) {
        pb.label = CrossBufferLabel(p, rank, b.cross);
      } else {
        const Block& blk = p.timelines[static_cast<size_t>(rank)].blocks[static_cast<size_t>(b.block)];
        const LayerBuffers& lb = p.layer_buffers[static_cast<size_t>(blk.layer)];
        const BlockBuffer& bb = (blk.forward ? lb.forward : lb.backward)[static_cast<size_t>(b.buffer)];
        pb.label = BlockBufferLabel(p, rank, b.block, bb.role, bb.tensor, bb.op);
      }
      out.push_back(std::move(pb));
    }
    walk.Frees();
  }
  return out;
}

Expected<std::vector<RankProgram>> ReplayPrograms(const Json& plan, const std::string& file) {
  auto model = ReadPlanModel(plan, file);
  if (!model) return model.error();
  auto layers = ExpandModel(*model);
  if (!layers) return layers.error();
  PlanningProblem p;
  try {
    p = BuildProblem(*model, std::move(*layers));
  } catch (const ErrorException& e) {
    return e.error();
  }
  auto assigned = ReadPlanAssignment(plan, file, p);
  if (!assigned) return assigned.error();
  const Evaluation eval = Evaluate(p, *assigned, false);
  std::vector<RankProgram> out(p.timelines.size());
  for (size_t r = 0; r < out.size(); ++r) {
    out[r].buffers = PredictedBuffers(p, static_cast<int32_t>(r), eval.intervals);
    if (model->arch.moe && model->arch.moe->RoutedRowsFactor(model->parallel.ep) > 1.0) {
      for (const LayerGraph& g : p.layers) {
        for (const TensorSpec& t : g.tensors) {
          if (t.sharding == "ep") out[r].routed_reserve.insert(t.name);
        }
      }
    }
    const RankTimeline& tl = p.timelines[r];
    out[r].steps.reserve(static_cast<size_t>(tl.steps));
    size_t bi = 0;
    for (int64_t s = 0; s < tl.steps; ++s) {
      while (bi + 1 < tl.blocks.size() && tl.blocks[bi + 1].first <= s) ++bi;
      const Block& blk = tl.blocks[bi];
      const LayerGraph& g = p.layers[static_cast<size_t>(blk.layer)];
      const int32_t n = p.layer_buffers[static_cast<size_t>(blk.layer)].ops;
      const int64_t local = s - blk.first;
      const int64_t pos = blk.forward ? local : n - 1 - local;
      const int32_t chunk = p.schedules[r][static_cast<size_t>(tl.step_pass[static_cast<size_t>(s)])].chunk;
      out[r].steps.push_back(g.ops[g.TopologicalOrder()[static_cast<size_t>(pos)]].name +
                             (blk.forward ? ".fwd" : ".bwd") + "@mb" + std::to_string(blk.microbatch) +
                             (p.model->parallel.vp > 1 ? " chunk " + std::to_string(chunk) : std::string()));
    }
  }
  return out;
}

}  // namespace memplan::planner
