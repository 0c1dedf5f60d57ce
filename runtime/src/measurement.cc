// What a run reports: --dump, MEASURED.json (allocator, CUPTI) and
// TRACE.json (executor_impl.h).
#include "executor_impl.h"

#include "memplan/common/table.h"

namespace memplan::runtime::exec {

// --steps N > 1: DIR/step<k>/, each step's weights before it, batch,
// gradients and weights after it.
std::string Executor::DumpDir() const {
  if (options_.steps <= 1) return options_.dump_dir;
  return (std::filesystem::path(options_.dump_dir) / ("step" + std::to_string(step_ + 1))).string();
}

Expected<std::monostate> Executor::Dump(DumpWhat what) {
  namespace fs = std::filesystem;
  fs::path dir(DumpDir());
  const bool grads = what == DumpWhat::kGrads;
  const char* sub = what == DumpWhat::kWeights ? "weights" : grads ? "grads" : "updated";
  std::error_code ec;
  fs::create_directories(dir / sub, ec);
  if (ec) return Error{ErrorCode::kRuntime, options_.dump_dir + ": " + ec.message()};
  for (auto& r : ranks_) {
    for (auto& ps : r->params) {
      // bf16 parameters: the fp32 master (the forward reads its bf16 rounding).
      const Buffer& from = grads ? ps.grad : !ps.master.empty() ? ps.master : Zero3() ? ps.shard : ps.weight;
      const int64_t n = ps.elements;
      std::vector<float> v(static_cast<size_t>(n));
      if (Zero1() && (grads || !ps.master.empty() || Zero3())) {
        // ZeRO-1: the reduced gradient and the master are ranges, gathered
        // for the dump (every replica takes part; replica 0 writes).
        std::vector<std::byte> all = GatherRanges(*r, ps, grads ? OwnGrad(ps, RangeStart(ps)) : from.as<float>(), 4);
        std::memcpy(v.data(), all.data(), static_cast<size_t>(n * 4));
      } else {
        backend_->ToHost(*r->stat, v.data(), grads ? OwnGrad(ps, 0) : from.as<float>(), n * 4);
      }
      if (ps.expert && model_.parallel.ep > 1) {
        // Every EP rank's experts, in order: the whole tensor.
        std::vector<float> whole(static_cast<size_t>(n * model_.parallel.ep));
        ep_comm_->AllGatherBlocks(v.data(), whole.data(), n * 4);
        v = std::move(whole);
      }
      if (TpSplit(ps)) v = TpWhole(ps, v);  // every tensor-parallel rank's slice: the whole tensor
      if (DenseRank() != 0 || tp_rank_ != 0) continue;  // the replicas hold the same step
      auto st = WriteNpy((dir / sub / (ps.spec->name + ".npy")).string(), v.data(), ps.shape);
      if (!st.ok()) return st.error();
    }
  }
  if (what != DumpWhat::kGrads && model_.arch.moe && model_.arch.moe->selection_bias && dp_rank_ == 0 &&
      tp_rank_ == 0 && cp_rank_ == 0) {
    // arch.moe.selection_bias: each MoE layer's routing bias, state that is
    // not a parameter (no gradient): before and after the step's update.
    for (auto& r : ranks_) {
      for (int64_t layer : p_.layout.LayersOfRank(r->index)) {
        if (!model_.arch.IsMoeLayer(layer)) continue;
        const std::vector<float>& bias = RouterBias(*r, layer);
        const std::string name = "layer" + std::to_string(layer) + ".moe.router.bias.npy";
        auto st = WriteNpy((dir / sub / name).string(), bias.data(), {static_cast<int64_t>(bias.size())});
        if (!st.ok()) return st.error();
      }
    }
  }
  if (what == DumpWhat::kWeights) {
    // Each replica its microbatches, named by their index in the global batch.
    fs::create_directories(dir / "batch", ec);
    if (ec) return Error{ErrorCode::kRuntime, options_.dump_dir + ": " + ec.message()};
    std::vector<int64_t> shape{model_.train.micro_batch, model_.train.seq_len};
    for (size_t m = 0; m < tokens_.size() && Local(0) && tp_rank_ == 0 && cp_rank_ == 0; ++m) {
      const std::string g = std::to_string(GlobalMicrobatch(static_cast<int32_t>(m)));
      auto a = WriteNpy((dir / "batch" / ("tokens_mb" + g + ".npy")).string(), tokens_[m].data(), shape);
      if (!a.ok()) return a.error();
      auto b = WriteNpy((dir / "batch" / ("targets_mb" + g + ".npy")).string(), targets_[m].data(), shape);
      if (!b.ok()) return b.error();
    }
  }
  return std::monostate{};
}

Expected<RunResult> Executor::Finish() {
  RunResult out;
  const traces::MeasuredStep& last = step_records_.back();  // agreed across processes (RecordStep)
  traces::Measured& m = out.measured;
  m.backend = std::string(BackendName(options_.backend));
  // Arenas follow the planner's placement; a pool is the driver's.
  m.allocator = options_.eager ? "eager" : options_.backend == BackendKind::kCuda && options_.cuda_pool ? "pool" : "arena";
  m.device = backend_->device_name();
  m.plan_digest = plan_json_.value("digest", std::string());
  m.step_s = last.step_s;
  m.compute_s = compute_s_;
  m.loss = last.loss;
  m.grad_norm = last.grad_norm;
  if (options_.steps > 1) m.steps = step_records_;
  for (auto& r : ranks_) {
    traces::MeasuredRank mr;
    SetGridPlace(mr, *r);
    mr.ep_rank = EpRank();
    mr.static_bytes = r->static_bytes;
    // The largest step's (RecordStep): one step's when there is one.
    mr.allocated_peak = r->run_allocated_peak;
    mr.peak = r->run_high_water;
    if (options_.backend == BackendKind::kCuda && m.allocator != "arena") {
      // Both pools' own marks: the driver rounds the statics' pool too.
      mr.pool = traces::PoolMarks{r->stat->high_water() + r->dev->high_water(),
                                  r->stat->used_high_water() + r->dev->used_high_water()};
    }
    mr.timeline = std::move(r->timeline);
    for (const auto& e : acts_->allocation_events(r->index)) {
      mr.allocation_timeline.push_back({e.step, e.bytes, e.name, e.part, e.touched});
    }
    mr.events = r->events;
    if (r->routing_seen) {
      mr.moe_routing = traces::MoeRoutingSeen{r->max_expert_load, r->max_rank_load,
                                              model_.arch.moe->RoutedRowsFactor(model_.parallel.ep), r->dropped_rows};
    }
    for (const auto& [k, v] : acts_->events(r->index)) mr.events[k] += v;
    m.ranks.push_back(std::move(mr));
  }
  if (options_.backend == BackendKind::kCuda) {
    m.cupti_status = !options_.cupti ? "off" : cupti_ ? "collected" : "unavailable";
  }
  if (cupti_) {
    CuptiMeasureInput in;
    in.context_bytes = context_bytes_;
    in.epoch_ns = cupti_epoch_ns_;
    for (auto& r : ranks_) {
      traces::OwnerRegions regions;
      regions.owner = r->index;
      r->dev->AddRegions(regions);
      r->stat->AddRegions(regions);
      in.regions.push_back(std::move(regions));
    }
    in.used_at_end = backend_->DeviceBytesInUse();
    cupti_->Flush();
    if (int64_t dropped = cupti_->dropped_records(); dropped > 0) {
      // A partial record set would fail the check for the wrong reason.
      warnings_.push_back("CUPTI dropped " + std::to_string(dropped) + " records; no CUPTI bytes reported");
      m.cupti_status = "unavailable";
    } else {
      AttachCupti(*cupti_, in, m);
      if (options_.trace) {
        traces::GpuTimelineInput gt{{}, std::move(gpu_ops_), cupti_epoch_ns_};
        for (auto& r : ranks_) {
          for (Device* d : {r->dev.get(), r->stat.get()}) {
            for (const auto& [name, stream] : backend_->Streams(*d)) {
              gt.lanes.push_back({cupti_->StreamIdOf(stream), r->index,
                                  (d == r->stat.get() ? "static " : "") + name});
            }
          }
        }
        traces::GpuTimelineCounts drawn = AddCuptiTrace(cupti_->DrainActivities(), gt, m, trace_);
        if (drawn.unowned > 0) {
          warnings_.push_back("TRACE.json: " + std::to_string(drawn.unowned) +
                              " GPU activities ran on streams no rank owns");
        }
      }
    }
  }
  if (options_.trace) {
    for (auto& r : ranks_) trace_.AddRank(r->index);
    out.trace = trace_.ToJson();
  }
  for (auto& r : ranks_) {
    if (!r->routing_seen) continue;
    const planner::MoeConfig& moe = *model_.arch.moe;
    const double planned = moe.RoutedRowsFactor(model_.parallel.ep);
    const std::string where = "EP rank " + std::to_string(EpRank()) + " of pp rank " + std::to_string(r->index);
    const std::string assumed = moe.capacity_factor ? "/model/arch/moe/capacity_factor " + FormatFixed(planned, 2)
                                                    : "/model/arch/moe/imbalance " + FormatFixed(moe.imbalance, 2);
    if (r->dropped_rows > 0) {
      warnings_.push_back(where + " dropped " + std::to_string(r->dropped_rows) +
                          " routed rows past its planned rows (" + assumed + "): their expert outputs are zero");
    }
    if (!moe.capacity_factor && model_.parallel.ep > 1 && r->max_expert_load > moe.imbalance) {
      warnings_.push_back(where + ": routing skew seen " + FormatFixed(r->max_expert_load, 2) +
                          "x the mean expert load exceeds the plan's " + assumed);
    }
  }
  out.warnings = warnings_;
  if (options_.comm) GatherRanks(out);
  return out;
}

void Executor::GatherRanks(RunResult& out) {
  traces::Measured& m = out.measured;
  // (The loss and the step time were agreed by RecordStep.)
  for (double v : GatherDoubles(m.compute_s)) m.compute_s = std::max(m.compute_s, v);
  std::vector<std::string> all = options_.comm->AllGather(traces::MeasuredToJson(m).dump());
  std::vector<std::string> traces;
  if (options_.trace) traces = options_.comm->AllGather(out.trace.dump());
  std::vector<std::string> warnings = options_.comm->AllGather(Json(out.warnings).dump());
  if (options_.comm->rank() != 0) return;
  m.ranks.clear();
  m.process.reset();  // one process's CUPTI view; each rank has its own
  for (auto& s : m.steps) s.ranks.clear();
  out.warnings.clear();
  for (size_t k = 0; k < all.size(); ++k) {
    auto theirs = traces::ParseMeasured(Json::parse(all[k]), "rank " + std::to_string(k));
    MEMPLAN_CHECK(theirs.ok(), "a rank sent a malformed measurement");
    for (auto& mr : theirs->ranks) m.ranks.push_back(std::move(mr));
    MEMPLAN_CHECK(theirs->steps.size() == m.steps.size(), "ranks ran different numbers of steps");
    for (size_t i = 0; i < m.steps.size(); ++i) {
      for (auto& sr : theirs->steps[i].ranks) m.steps[i].ranks.push_back(sr);
    }
    for (const auto& w : Json::parse(warnings[k])) out.warnings.push_back("rank " + std::to_string(k) + ": " + w.get<std::string>());
  }
  if (options_.trace) {
    // One document: every rank's metadata first, then the events by time
    // (each process's clock starts at the barrier before the step).
    OrderedJson merged = OrderedJson::parse(traces.front());
    OrderedJson meta = OrderedJson::array(), events = OrderedJson::array();
    for (const std::string& t : traces) {
      OrderedJson doc = OrderedJson::parse(t);
      for (auto& e : doc["traceEvents"]) (e.value("ph", "") == "M" ? meta : events).push_back(std::move(e));
    }
    std::stable_sort(events.begin(), events.end(), [](const OrderedJson& a, const OrderedJson& b) {
      return a.value("ts", 0.0) < b.value("ts", 0.0);
    });
    for (auto& e : events) meta.push_back(std::move(e));
    merged["traceEvents"] = std::move(meta);
    out.trace = std::move(merged);
  }
}


}  // namespace memplan::runtime::exec
