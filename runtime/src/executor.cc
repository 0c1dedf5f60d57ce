#include "executor_impl.h"

#include "memplan/common/table.h"

namespace memplan::runtime {

std::string_view BackendName(BackendKind kind) { return kind == BackendKind::kCuda ? "cuda" : "host"; }

namespace exec {

bool Executor::Runnable(const Rank& r) const {
  const auto& tl = p_.timelines[static_cast<size_t>(r.index)];
  if (r.next_step >= tl.steps) return false;
  size_t bi = r.block;
  if (bi + 1 < tl.blocks.size() && tl.blocks[bi + 1].first <= r.next_step) ++bi;
  const Block& blk = tl.blocks[bi];
  if (blk.first != r.next_step || blk.prev_in_pass) return true;
  int32_t chunk = p_.schedules[static_cast<size_t>(r.index)][static_cast<size_t>(tl.step_pass[static_cast<size_t>(blk.first)])].chunk;
  int64_t stage = chunk * model_.parallel.pp + r.index;
  int64_t stages = model_.parallel.pp * model_.parallel.vp;
  if (blk.forward && stage == 0) return true;
  if (!blk.forward && stage == stages - 1) return true;
  const int64_t sender = blk.forward ? stage - 1 : stage + 1;
  return Arrived(RankOfStage(sender), r.index, blk.forward ? Msg::kActivation : Msg::kGradient,
                 StageMsgId(stage, blk.microbatch));
}

void Executor::Step(Rank& r) {
  const auto& tl = p_.timelines[static_cast<size_t>(r.index)];
  const int64_t s = r.next_step;
  if (r.block + 1 < tl.blocks.size() && tl.blocks[r.block + 1].first <= s) ++r.block;
  const size_t bi = r.block;
  const Block& blk = tl.blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const LayerBuffers& lb = LB(blk.layer);
  const int32_t local = static_cast<int32_t>(s - blk.first);
  const int32_t n = lb.ops;
  const int32_t pos = blk.forward ? local : n - 1 - local;
  const double t_start = NowUs();
  const OpSpec& op = g.ops[g.TopologicalOrder()[static_cast<size_t>(pos)]];
  const std::string span_name = op.name + (blk.forward ? ".fwd" : ".bwd") + "@mb" + std::to_string(blk.microbatch);
  // Every kernel and copy this step launches carries the step's id in CUPTI's
  // records (the GPU timeline names them by it).
  const bool gpu_trace = cupti_ && options_.trace;
  if (gpu_trace) gpu_ops_.push_back({r.index, span_name});
  ProfiledOp gpu_op(gpu_trace ? cupti_.get() : nullptr, gpu_ops_.size());
  ReceiveRemoteFetches(r, s);
  acts_->BeginStep(r.index);
  ReturnRemotePayloads(r, s);
  MEMPLAN_CHECK(acts_->step(r.index) == s, "memory program out of step");
  BeginCross(r);

  int32_t chunk = p_.schedules[static_cast<size_t>(r.index)][static_cast<size_t>(tl.step_pass[static_cast<size_t>(s)])].chunk;
  int64_t stage = chunk * model_.parallel.pp + r.index;
  const int64_t stages = model_.parallel.pp * model_.parallel.vp;
  if (local == 0) {
    // The neighbour stage's hand-over (it may carry nothing), taken once
    // per pass: the activation in forward, its gradient in backward.
    std::vector<std::byte> inbox;
    const int64_t sender = blk.forward ? stage - 1 : stage + 1;
    const bool received = !blk.prev_in_pass && sender >= 0 && sender < stages;
    if (received) {
      inbox = Take(RankOfStage(sender), r.index, blk.forward ? Msg::kActivation : Msg::kGradient,
                   StageMsgId(stage, blk.microbatch));
    }
    if (blk.forward) {
      // Inputs: the batch, or the previous stage's activation.
      for (size_t t = 0; t < g.tensors.size(); ++t) {
        const TensorSpec& spec = g.tensors[t];
        if (lb.prod[t] >= 0 || lb.share_layer[t] >= 0) continue;  // produced here, or read in place
        bool imported = lb.import_from[t] >= 0 ? !blk.prev_in_pass : !spec.producer.empty();
        if (spec.producer.empty() || imported) {
          LoadInput(r, bi, static_cast<int32_t>(t), Value(r, bi, static_cast<int32_t>(t)), &inbox);
        } else if (spec.saved && lb.import_from[t] >= 0 &&
                   G(blk.layer - 1).tensors[static_cast<size_t>(lb.import_from[t])].saved) {
          // Both layers save the value: this layer keeps its own copy.
          Buffer src = FwdFull(r, blk.layer - 1, lb.import_from[t], blk.microbatch);
          r.ops->Copy(Value(r, bi, static_cast<int32_t>(t)).ptr, src.ptr, spec.bytes);
        }
      }
    } else {
      if (!blk.prev_in_pass && PipelineZero2()) BeginGradPass(r, chunk);
      if (Zero2Bucket()) BindToBucket(r, blk.layer);
      r.rebuilt.erase(bi);  // a new step's backward of this block
      RestoreLayer(r, bi);
      ReceiveSharedGrads(r, bi);
      if (received) {
        // The gradient of this chunk's output, from the next stage.
        for (size_t t = 0; t < g.tensors.size(); ++t) {
          if (lb.prod[t] < 0 || lb.export_to[t] < 0) continue;
          MEMPLAN_CHECK(static_cast<int64_t>(inbox.size()) == g.tensors[t].bytes, "received gradient has the wrong size");
          backend_->FromHost(*r.dev, Grad(r, bi, static_cast<int32_t>(t)).ptr, inbox.data(), g.tensors[t].bytes);
        }
      }
    }
  }
  if (blk.forward) {
    Forward(r, bi, pos, [&](int32_t t) { return Value(r, bi, t); }, blk.microbatch);
  } else {
    // Values a backward op needs that are not saved are re-made first.
    // (Value() finds rebuilt buffers; an op with several rebuilt outputs runs once.)
    // Producers re-run in topological order (a rebuilt value may feed another).
    std::set<int32_t> rerun;
    if (acts_->eager()) {
      // Eager: what this op reads by the registry that is neither saved nor
      // already re-made in this block, and what those values' producers
      // read in turn.
      std::vector<int32_t> need = planner::BackwardReads(g, op);
      std::set<int32_t>& made = r.rebuilt[bi];
      while (!need.empty()) {
        const int32_t t = need.back();
        need.pop_back();
        const size_t ts = static_cast<size_t>(t);
        if (g.tensors[ts].saved || lb.prod[ts] < 0 || lb.share_layer[ts] >= 0 || made.contains(t)) continue;
        rerun.insert(lb.prod[ts]);
        const OpSpec& producer = g.ops[g.TopologicalOrder()[static_cast<size_t>(lb.prod[ts])]];
        for (const auto& out : producer.outputs) made.insert(static_cast<int32_t>(g.FindTensor(out) - g.tensors.data()));
        for (const auto& in : producer.inputs) need.push_back(static_cast<int32_t>(g.FindTensor(in) - g.tensors.data()));
      }
    } else {
      for (const auto& b : acts_->allocations(r.index)) {
        if (b.interval >= 0 || b.block != static_cast<int32_t>(bi)) continue;
        const BlockBuffer& bb = lb.backward[static_cast<size_t>(b.buffer)];
        if (bb.role == BlockBuffer::Role::kRebuilt) rerun.insert(bb.op);
      }
    }
    for (int32_t op_pos : rerun) {
      Forward(r, bi, op_pos, [&](int32_t t) { return Value(r, bi, t); }, blk.microbatch);
      ++r.events["rebuilds"];
    }
    Backward(r, bi, pos);
  }
  if (blk.forward) {
    for (int32_t i : r.produced_at[static_cast<size_t>(s)]) {
      acts_->Save(r.index, i);
      SendRemotePayload(r, i);
      SendBlockCaches(r, i);
    }
  }
  // The end of a pass on this rank: hand the boundary tensor (if any: with
  // shared blocks nothing is handed over) to the neighbour stage.
  const int64_t neighbour = blk.forward ? stage + 1 : stage - 1;
  if (local == n - 1 && !blk.next_in_pass && neighbour >= 0 && neighbour < stages) {
    std::vector<std::byte> msg;
    for (size_t t = 0; t < g.tensors.size(); ++t) {
      bool send = blk.forward ? (lb.prod[t] >= 0 && lb.export_to[t] >= 0) : (lb.prod[t] < 0 && lb.import_from[t] >= 0);
      if (!send) continue;
      Buffer src = blk.forward ? Value(r, bi, static_cast<int32_t>(t)) : Grad(r, bi, static_cast<int32_t>(t));
      msg.resize(static_cast<size_t>(g.tensors[t].bytes));
      backend_->ToHost(*r.dev, msg.data(), src.ptr, g.tensors[t].bytes);
    }
    Post(r.index, RankOfStage(neighbour), blk.forward ? Msg::kActivation : Msg::kGradient,
         StageMsgId(neighbour, blk.microbatch), std::move(msg));
  }
  if (!blk.forward && local == n - 1 && !blk.next_in_pass) {  // the chunk's backward pass ends
    if (PipelineZero2()) EndGradPass(r, chunk);
    if (Zero2Bucket()) FlushGrads(r, std::exchange(bucket_, {}));
  }
  // Routing offsets live on the host until the layer's backward is over.
  if (!blk.forward && local == n - 1) r.routing.erase({blk.layer, blk.microbatch});
  EndCross(r);
  acts_->EndStep(r.index);
  TakeCopies(r);
  Span(r, span_name, "kernel", t_start);
  RetireCopies(r, false);
  double now = NowUs();
  r.timeline.push_back({now, r.static_bytes + r.dev->allocated_bytes()});
  if (options_.trace) {
    traces::MemoryCounter c;
    c.pp_rank = r.index;
    c.ts_us = now;
    c.allocated_bytes = r.static_bytes + r.dev->allocated_bytes();
    c.reserved_bytes = r.static_bytes + r.dev->high_water();
    c.predicted_bytes = p_.statics[static_cast<size_t>(r.index)].total + profiles_[static_cast<size_t>(r.index)][static_cast<size_t>(s)];
    trace_.AddCounter(c);
  }
  ++r.next_step;
  ++steps_done_;
}

void Executor::RetireCopies(Rank& r, bool all) {
  auto& cs = r.copies;
  size_t k = 0;
  for (; k < cs.size(); ++k) {
    if (!all && !cs[k].event.done()) break;
    if (all) cs[k].event.Wait();
    double& q = r.queue_end_us[static_cast<int>(cs[k].stream)];
    traces::TraceSpan s;
    s.pp_rank = r.index;
    s.stream = cs[k].stream;
    s.name = cs[k].name;
    s.cat = "memcpy";
    s.ts_us = std::max(cs[k].issue_us, q);
    s.dur_us = std::max(0.0, NowUs() - s.ts_us);
    q = s.ts_us + s.dur_us;
    trace_.AddSpan(std::move(s));
  }
  cs.erase(cs.begin(), cs.begin() + static_cast<std::ptrdiff_t>(k));
}


Rank* Executor::NextRank() {
  // One process per rank: its own steps in order, waiting for what they
  // receive.
  if (options_.comm) return ranks_.front().get();
  // The runnable rank whose next step starts first in the plan's pipeline
  // timeline (ties: the earlier end, then the lower rank).
  Rank* pick = nullptr;
  double best_start = 0, best_end = 0;
  for (auto& r : ranks_) {
    if (!Runnable(*r)) continue;
    const auto& tl = p_.timelines[static_cast<size_t>(r->index)];
    double st = tl.start_s[static_cast<size_t>(r->next_step)], en = tl.end_s[static_cast<size_t>(r->next_step)];
    if (!pick || st < best_start || (st == best_start && en < best_end)) {
      pick = r.get();
      best_start = st;
      best_end = en;
    }
  }
  MEMPLAN_CHECK(pick != nullptr, "pipeline deadlock: no rank can run");
  return pick;
}

Expected<std::monostate> Executor::Validate() {
  try {
    return Setup();
  } catch (const Json::exception& e) {
    return BadInput(options_.plan_file + ": not a memplan plan (" + e.what() + ")");
  } catch (const ErrorException& e) {
    return e.error();
  }
}

Expected<std::monostate> Executor::AgreeAcrossRanks(const Expected<std::monostate>& local) {
  Communicator& comm = *options_.comm;
  if (auto agreed = Agree(comm, local); !agreed.ok()) return agreed.error();
  // The same plan everywhere (its model and every decision), and one
  // process per rank of its grid.
  const std::string digest = plan_json_.value("digest", std::string());
  std::vector<std::string> digests = comm.AllGather(digest);
  std::vector<std::string> executed = comm.AllGather(planner::ExecutionDigest(digest, assign_));
  for (size_t r = 1; r < digests.size(); ++r) {
    if (digests[r] != digests[0]) {
      return BadInput(options_.plan_file + ": rank " + std::to_string(r) + " runs a different plan (" + digests[r] + ") from rank 0's (" +
                      digests[0] + "): every process must run the same PLAN.json");
    }
    if (executed[r] != executed[0]) {
      return BadInput(options_.plan_file + ": rank " + std::to_string(r) +
                      " runs a plan of the same model with other storage decisions than rank 0's (decisions " +
                      executed[r].substr(0, 12) + " vs " + executed[0].substr(0, 12) +
                      "): every process must run the same PLAN.json");
    }
  }
  const auto& par = model_.parallel;
  const int64_t grid = par.Processes();
  if (comm.size() != grid) {
    return BadInput(options_.plan_file + ": launched as " + std::to_string(comm.size()) +
                    " processes, the plan's grid has " + std::to_string(grid) + " ranks (pp " + std::to_string(par.pp) +
                    " x dp " + std::to_string(par.dp) + (par.tp > 1 ? " x tp " + std::to_string(par.tp) : std::string()) +
                    (par.cp > 1 ? " x cp " + std::to_string(par.cp) : std::string()) +
                    (par.ep > 1 ? ", ep " + std::to_string(par.ep) + " inside dp" : std::string()) +
                    "): run mpirun -np " + std::to_string(grid));
  }
  return CheckTags();
}

Expected<RunResult> Executor::Run() {
  if (!options_.comm) return RunHere();
  // A plan or a backend that fails on some rank fails every rank at once.
  Expected<std::monostate> local = Validate();
  if (local.ok()) local = MakeBackend();
  if (auto s = AgreeAcrossRanks(local); !s.ok()) {
    if (options_.agreed_error != nullptr) *options_.agreed_error = true;
    return s.error();
  }
  // World ranks in Megatron's order (tp-cp-ep-dp-pp), tensor-parallel
  // fastest: ((pp rank * dp + data-parallel rank) * cp + context-parallel
  // rank) * tp + tensor-parallel rank (docs/runtime.md, "Process grid").
  const int64_t tp = model_.parallel.tp, cp = model_.parallel.cp;
  const int64_t world = options_.comm->rank();
  tp_rank_ = world % tp;
  cp_rank_ = world / tp % cp;
  dp_rank_ = world / (tp * cp) % model_.parallel.dp;
  pp_rank_ = static_cast<int32_t>(world / (tp * cp * model_.parallel.dp));
  tp_comm_ = options_.comm->Split(static_cast<int>(world / tp), static_cast<int>(tp_rank_));
  cp_comm_ = options_.comm->Split(static_cast<int>((pp_rank_ * model_.parallel.dp + dp_rank_) * tp + tp_rank_),
                                  static_cast<int>(cp_rank_));
  // Gradients are reduced over the dp x cp ranks (context-parallel ranks
  // hold the same parameters and see other tokens).
  dp_comm_ = options_.comm->Split(static_cast<int>(pp_rank_ * tp + tp_rank_), static_cast<int>(DenseRank()));
  // Expert parallelism: EP groups are runs of ep consecutive replicas; the
  // replicas at the same place in each hold the same experts.
  const int64_t ep = model_.parallel.ep;
  // With tensor parallelism the experts are not split over tp (Megatron's
  // expert tensor-parallel size 1): the expert grid is the tp x dp ranks of
  // the pipeline rank in rank order (ExpertGridIndex), EP fastest, and the
  // expert data-parallel group tp * dp / ep.
  const int64_t grid_index = ExpertGridIndex();
  std::unique_ptr<Communicator> grid = options_.comm->Split(pp_rank_, static_cast<int>(grid_index));
  ep_comm_ = grid->Split(static_cast<int>(grid_index / ep), static_cast<int>(grid_index % ep));
  edp_comm_ = grid->Split(static_cast<int>(grid_index % ep), static_cast<int>(grid_index / ep));
  dense_group_ = {Replicas(), DenseRank(), dp_comm_.get()};
  expert_group_ = {tp * Replicas() / ep, grid_index / ep, edp_comm_.get()};
  // cuda: the data-parallel gradients and ZeRO-1's weights move between
  // GPUs by NCCL (docs/runtime.md, "NCCL"); a rank whose NCCL cannot start
  // ends the job (every rank makes the same calls).
  if (cuda_ != nullptr && (Replicas() > 1 || tp > 1)) {
    for (auto [group, nccl] : {std::pair{&dense_group_, &dense_nccl_}, std::pair{&expert_group_, &expert_nccl_}}) {
      if (group->size == 1 || (group == &expert_group_ && !model_.arch.moe)) continue;  // no routed experts
      auto made = cuda_->make_nccl(*group->comm);
      if (!made.ok()) FailAlone(made.error());
      *nccl = std::move(*made);
      group->device = nccl->get();
    }
  }
  // cuda: the tensor- and context-parallel collectives on the device
  // buffers too (one GPU per rank, as for data parallelism: NCCL refuses two
  // ranks of one communicator on one device).
  if (cuda_ != nullptr) {
    for (auto [group, nccl] : {std::pair{tp_comm_.get(), &tp_nccl_}, std::pair{cp_comm_.get(), &cp_nccl_}}) {
      if (group->size() == 1) continue;
      auto made = cuda_->make_nccl(*group);
      if (!made.ok()) FailAlone(made.error());
      *nccl = std::move(*made);
    }
  }
  // From here a rank that fails fails alone: it says why and ends them all.
  try {
    auto result = RunHere();
    if (!result.ok()) FailAlone(result.error());
    return result;
  } catch (const ErrorException& e) {
    FailAlone(e.error());
  }
}

void Executor::FailAlone(const Error& e) {
  std::fprintf(stderr, "memplan: rank %d: %s\n", options_.comm->rank(), OneLine(e.message).c_str());
  std::fflush(stderr);
  options_.comm->Abort(static_cast<int>(e.code));
  std::_Exit(static_cast<int>(e.code));  // Abort does not return
}

Expected<std::monostate> Executor::MakeBackend() {
  if (options_.backend == BackendKind::kCuda) {
    auto plugin = LoadCudaPlugin();
    if (!plugin) return plugin.error();
    cuda_ = *plugin;
    backend_ = cuda_->make_backend(!options_.cuda_pool);
    if (!backend_) return Error{ErrorCode::kRuntime, "--backend cuda: no CUDA device is visible"};
  } else {
    backend_ = MakeHostBackend(options_.copy_jitter_us);
  }
  return std::monostate{};
}

Expected<RunResult> Executor::RunHere() {
  if (!options_.comm) {
    if (auto s = Validate(); !s.ok()) return s.error();
    if (auto b = MakeBackend(); !b.ok()) return b.error();
  }
  const CudaPlugin* cuda = cuda_;
  if (cuda && options_.cupti) {
    // Before any allocation: the context's bytes, and CUPTI sees the arenas
    // made. A profiler that cannot start is a warning, never a failed run.
    context_bytes_ = backend_->DeviceBytesInUse();
    traces::CuptiOptions co;
    co.gpu_timeline = options_.trace;
    if (auto s = cuda->start_profiler(co); s.ok()) {
      cupti_ = std::move(*s);
    } else {
      warnings_.push_back(s.error().message + "; measured without CUPTI (memplan check fails this run: rerun, or pass --no-cupti)");
    }
  }
  try {
    if (auto s = MakeRanks(); !s.ok()) return s.error();
    for (auto& r : ranks_) backend_->Finish(*r->stat);
    const int64_t steps = options_.eager_record_only ? 1 : std::max<int64_t>(1, options_.steps);
    double grad_norm = 0, step_s = 0;
    for (step_ = 0; step_ < steps;) {
      if (auto s = RunStep(&grad_norm, &step_s); !s.ok()) return s.error();
      if (options_.eager_record_only) return RunResult{};  // eager's record pass: its log is all it gives
      RecordStep(grad_norm, step_s);
      if (options_.progress && steps > 1) {
        const auto& s = step_records_.back();
        options_.progress("run: step " + std::to_string(s.step) + "/" + std::to_string(steps) + " done: loss " +
                          FormatFixed(s.loss, 6) + ", " + FormatFixed(1000 * s.step_s, 1) + " ms");
      }
      if (step_ + 1 < steps) {
        BeginNextStep();
      } else {
        break;
      }
    }
    return Finish();
  } catch (const ErrorException& e) {
    return e.error();
  }
}

// One optimizer step: the batch, every rank's forwards and backwards, the
// gradients' reduction, the optimizer (docs/runtime.md, "Several steps").
Expected<std::monostate> Executor::RunStep(double* grad_norm, double* step_s) {
  MakeBatch();
  if (!options_.dump_dir.empty()) {
    if (auto d = Dump(DumpWhat::kWeights); !d.ok()) return d.error();
  }
  if (options_.comm) options_.comm->Barrier();  // every rank's clock starts together
  const auto start = std::chrono::steady_clock::now();
  if (step_ == 0) {
    t0_ = start;
    if (cupti_) cupti_epoch_ns_ = cupti_->NowNs();
  }
  int64_t next_report = 0;
  // Several steps: a line per step (RunHere) rather than per tenth of one.
  const bool op_progress = options_.progress && options_.steps <= 1;
  while (steps_done_ < steps_total_) {
    Step(*NextRank());
    if (op_progress && (steps_done_ >= next_report || steps_done_ == steps_total_)) {
      options_.progress("run: " + std::to_string(steps_done_) + "/" + std::to_string(steps_total_) + " ops (" +
                        std::to_string(100 * steps_done_ / steps_total_) + "%)");
      next_report = steps_done_ + std::max<int64_t>(1, steps_total_ / 10);
    }
  }
  acts_->FinishEager();
  if (options_.eager_record_only) return std::monostate{};
  for (auto& r : ranks_) {
    r->dev->Synchronize();
    backend_->Finish(*r->dev);
    RetireCopies(*r, true);
    MEMPLAN_CHECK(r->dev->allocated_bytes() == 0, "activation memory left allocated after the step");
  }
  if (Zero3()) {
    for (auto& r : ranks_) ReleaseUnits(*r);  // the last unit's gradients reduce-scattered
  }
  compute_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  SyncTied();
  ReduceGradients();
  if (!options_.dump_dir.empty()) {
    if (auto d = Dump(DumpWhat::kGrads); !d.ok()) return d.error();
  }
  Optimize(grad_norm);
  UpdateRouterBias();
  if (!options_.dump_dir.empty()) {
    if (auto d = Dump(DumpWhat::kUpdated); !d.ok()) return d.error();
  }
  *step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return std::monostate{};
}


}  // namespace exec

Expected<RunResult> RunPlan(const Json& plan, const RunOptions& options) {
  if (!options.eager || options.eager_last_access != nullptr || options.eager_record_only) {
    exec::Executor e(plan, options);
    return e.Run();
  }
  // Eager execution (docs/runtime.md, "Eager execution"): a record pass
  // logs when each buffer is last used, then the measured pass frees each
  // at the end of that step.
  EagerAccessLog log;
  {
    RunOptions record = options;
    record.eager_record_only = true;
    record.trace = false;
    record.dump_dir.clear();
    record.cupti = false;
    record.progress = nullptr;
    exec::Executor e(plan, record);
    auto r = e.Run();
    if (!r.ok()) return r.error();
    log = e.access_log();
  }
  RunOptions measured = options;
  measured.eager_last_access = &log;
  exec::Executor e(plan, measured);
  return e.Run();
}

Expected<std::monostate> ValidatePlan(const Json& plan, const std::string& plan_file) {
  RunOptions options;
  options.plan_file = plan_file;
  exec::Executor e(plan, options);
  return e.Validate();
}

}  // namespace memplan::runtime
