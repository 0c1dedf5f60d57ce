// The executor reading its plan: Setup rebuilds the planning problem and the
// plan's storage decisions, Check verifies them, and tensors bind to buffers
// (executor_impl.h).
#include "executor_impl.h"
#include "memplan/planner/runtime_limits.h"
#include "op_impls.h"

namespace memplan::runtime::exec {

// --- Setup ----------------------------------------------------------------------

Expected<std::monostate> Executor::Setup() {
  const std::string& file = options_.plan_file;
  auto model = planner::ReadPlanModel(plan_json_, file);
  if (!model.ok()) return model.error();
  model_ = std::move(*model);
  // A plan for another runtime (docs/targets.md) is launched with that
  // framework and measured with `memplan profile`, not executed here.
  if (model_.target.kind != planner::TargetKind::kMemplan) {
    return Error{ErrorCode::kBadInput,
                 file + ": /model/target: a plan for " + std::string(planner::TargetName(model_.target.kind)) +
                     "; memplan's runtime executes plans for target memplan (launch the job with `memplan export " +
                     std::string(planner::TargetName(model_.target.kind)) +
                     "`'s arguments and measure it with `memplan profile -- CMD`, then `memplan check`)"};
  }
  // Everything that keeps this plan from executing, said at once (one line,
  // each reason with its JSON path or op).
  std::vector<std::string> why;
  const auto& par = model_.parallel;
  // The layouts the runtime does not execute yet: `plan` warns of the same
  // rule (planner/runtime_limits.h).
  for (const std::string& gap : planner::RuntimeLayoutGaps(model_)) why.push_back("/model" + gap);
  // Data, expert and tensor parallelism run one process per rank: their
  // reductions and exchanges are real.
  struct Dim {
    const char* name;
    int64_t size;
    const char* what;
  };
  for (auto [name, v, what] : {Dim{"dp", par.dp, "data"}, Dim{"ep", par.ep, "expert"}, Dim{"tp", par.tp, "tensor"},
                               Dim{"cp", par.cp, "context"}}) {
    if (v > 1 && !options_.comm) {
      why.push_back("/model/parallel/" + std::string(name) + " is " + std::to_string(v) + ": " + what +
                    "-parallel ranks run one process per rank (mpirun -np " +
                    std::to_string(par.Processes()) + " memplan run ...)");
    }
  }
  if (model_.arch.position_embeddings > 0) {
    why.push_back("/model/arch/position_embeddings: learned positions are planned (their table, gradient and "
                  "optimizer state) but not executed yet");
  }
  if (model_.arch.mtp_layers > 0) {
    why.push_back("/model/arch/mtp_layers: multi-token prediction is planned but not executed yet");
  }
  // Activations and weights in fp32 or bf16 (bf16: on the host backend, the
  // kernels computing in fp32 on each op's widened operands); gradients and
  // optimizer state in fp32.
  const auto& tr = model_.train;
  std::string dtypes;
  for (auto [name, d] : {std::pair<const char*, planner::DType>{"act_dtype", tr.act_dtype},
                         {"param_dtype", tr.param_dtype}}) {
    if (d != planner::DType::kFP32 && d != planner::DType::kBF16) {
      dtypes += (dtypes.empty() ? "/model/train/" : ", ") + std::string(name) + " " + std::string(planner::DTypeName(d));
    }
  }
  if (!dtypes.empty()) why.push_back(dtypes + ": activations and weights execute in fp32 or bf16");
  if (tr.grad_dtype != planner::DType::kFP32) {
    why.push_back("/model/train/grad_dtype " + std::string(planner::DTypeName(tr.grad_dtype)) +
                  ": gradients execute in fp32 (the main gradients the optimizer reads)");
  }
  const bool bf16 = tr.act_dtype == planner::DType::kBF16 || tr.param_dtype == planner::DType::kBF16;
  if (bf16 && options_.backend == BackendKind::kCuda) {
    why.push_back("/model/train: bf16 executes on the host backend only (the CUDA kernels read and write fp32; "
                  "--backend host)");
  }
  const auto& a = model_.arch;
  if (a.mla && a.attention != planner::Attention::kFlash) {
    why.push_back("/model/arch/mla: MLA executes with flash attention (arch.attention \"flash\")");
  }
  if (a.attn_res &&
      planner::AttnResSourceCount(a.layers, a.attn_res->block_layers) > workspace::kMaxAttnResSources) {
    why.push_back("/model/arch/attn_res/block_layers: the head attends over " +
                  std::to_string(planner::AttnResSourceCount(a.layers, a.attn_res->block_layers)) +
                  " blocks; the AttnRes kernels take at most " + std::to_string(workspace::kMaxAttnResSources));
  }
  if (!model_.graph.empty()) {
    return BadInput(file + ": /model/graph: explicit layer graphs are not executable");
  }

  auto layers = planner::ExpandModel(model_);
  if (!layers.ok()) return layers.error();
  // The op registry says what executes (planner/op_registry.h), the runtime's
  // half of it how (op_impls.h): the first op of each kind that does not.
  std::set<std::string> kinds;
  for (const auto& g : *layers) {
    for (const auto& op : g.ops) {
      const planner::OpDef& def = planner::GetOpDef(op.op);
      if ((def.executable && GetOpImpl(op.op).forward != nullptr) || !kinds.insert(op.kind).second) continue;
      why.push_back(op.name + ": \"" + op.kind + "\" ops are not executable yet (" +
                    std::string(def.why_not.empty() ? "no runtime implementation" : def.why_not) + ")");
    }
  }
  if (!why.empty()) {
    std::string all;
    for (const auto& w : why) all += (all.empty() ? "" : "; ") + w;
    return BadInput(file + ": " + all);
  }
  try {
    p_ = planner::BuildProblem(model_, std::move(*layers));
  } catch (const ErrorException& e) {
    return e.error();
  }
  auto assigned = planner::ReadPlanAssignment(plan_json_, file, p_);
  if (!assigned.ok()) return assigned.error();
  assign_ = std::move(*assigned);
  eval_ = planner::Evaluate(p_, assign_, false);
  profiles_ = planner::Profiles(p_, eval_.intervals);
  SetupRemote();
  return Check();
}

Expected<std::monostate> Executor::Check() {
  const Json& ranks = plan_json_["ranks"];
  if (ranks.size() != eval_.ranks.size()) {
    return BadInput(options_.plan_file + ": /ranks has " + std::to_string(ranks.size()) + " entries, the model " +
                    std::to_string(eval_.ranks.size()) + " pipeline ranks");
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    const Json& rk = ranks[r];
    if (!rk.is_object() || !rk.contains("peak") || !rk["peak"].is_number_integer() || !rk.contains("lower_bound") ||
        !rk["lower_bound"].is_number_integer()) {
      return BadInput(options_.plan_file + ": /ranks/" + std::to_string(r) + ": expected integer peak and lower_bound");
    }
    int64_t peak = rk["peak"].get<int64_t>(), lb = rk["lower_bound"].get<int64_t>();
    // Eager execution measures the step against the plan; it does not
    // depend on the plan's numbers agreeing with this planner's.
    if (!options_.eager && (peak != eval_.ranks[r].peak || lb != eval_.ranks[r].lower_bound)) {
      return BadInput(options_.plan_file + ": /ranks/" + std::to_string(r) + ": peak " + std::to_string(peak) +
                      " / lower_bound " + std::to_string(lb) + " differ from this planner's " +
                      std::to_string(eval_.ranks[r].peak) + " / " + std::to_string(eval_.ranks[r].lower_bound) +
                      " (re-plan the model with this memplan)");
    }
  }
  // Layer -> rank-local saved index.
  tensor_base_.assign(p_.layers.size(), {});
  saved_index_.assign(p_.layers.size(), {});
  for (size_t l = 0; l < p_.layers.size(); ++l) {
    saved_index_[l].assign(p_.layers[l].tensors.size(), -1);
    int32_t k = 0;
    for (size_t t = 0; t < p_.layers[l].tensors.size(); ++t) {
      if (p_.layers[l].tensors[t].saved) saved_index_[l][t] = k++;
    }
  }
  for (size_t r = 0; r < p_.tensors.size(); ++r) {
    for (size_t t = 0; t < p_.tensors[r].size(); ++t) {
      const SavedTensor& st = p_.tensors[r][t];
      auto& base = tensor_base_[static_cast<size_t>(st.layer)];
      if (base.empty()) base.push_back(static_cast<int32_t>(t));
    }
  }
  // One tensor crosses each pipeline-stage boundary each way (the mailbox
  // carries one per stage, microbatch and direction).
  for (size_t l = 0; l < p_.layers.size(); ++l) {
    const LayerBuffers& lb = LB(static_cast<int64_t>(l));
    auto count = [](const std::vector<int32_t>& v) { return std::count_if(v.begin(), v.end(), [](int32_t x) { return x >= 0; }); };
    if (count(lb.export_to) > 1 || count(lb.import_from) > 1) {
      return BadInput(options_.plan_file + ": layer " + std::to_string(l) +
                      " hands more than one tensor to its neighbour layer; the runtime's stage mailbox carries one");
    }
  }
  SetupShared();
  // FP8 payloads are values then fp32 scales: the scales must be aligned.
  for (size_t r = 0; r < p_.tensors.size(); ++r) {
    for (size_t t = 0; t < p_.tensors[r].size(); ++t) {
      if (!planner::IsFp8(assign_.storage[r][t])) continue;
      const TensorSpec& spec = G(p_.tensors[r][t].layer).tensors[static_cast<size_t>(p_.tensors[r][t].graph_index)];
      if (Elements(spec.shape) % 4 != 0) {
        return BadInput(options_.plan_file + ": " + spec.name + " is stored in FP8 but its element count is not a multiple of 4 (unaligned scales)");
      }
    }
  }
  return std::monostate{};
}

int32_t Executor::SavedIndex(int64_t layer, int32_t tensor) const {
  return saved_index_[static_cast<size_t>(layer)][static_cast<size_t>(tensor)];
}

int32_t Executor::InstIndex(int64_t layer, int32_t tensor, int32_t mb) const {
  int32_t k = SavedIndex(layer, tensor);
  MEMPLAN_CHECK(k >= 0, "not a saved tensor");
  int32_t t = tensor_base_[static_cast<size_t>(layer)].front() + k;
  return t * static_cast<int32_t>(model_.train.microbatches) + mb;
}


Buffer Executor::Value(Rank& r, size_t bi, int32_t t) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const LayerBuffers& lb = LB(blk.layer);
  const TensorSpec& spec = g.tensors[static_cast<size_t>(t)];
  if (lb.share_layer[static_cast<size_t>(t)] >= 0) return SharedValue(r, bi, t);
  if (!blk.forward) {
    if (spec.saved) return BwdFull(r, blk.layer, t, blk.microbatch);
    return BlockBuf(r, bi, BlockBuffer::Role::kRebuilt, t);
  }
  if (spec.saved) return FwdFull(r, blk.layer, t, blk.microbatch);
  if (lb.prod[static_cast<size_t>(t)] >= 0) {
    int32_t exp = lb.export_to[static_cast<size_t>(t)];
    if (exp >= 0 && blk.next_in_pass && G(blk.layer + 1).tensors[static_cast<size_t>(exp)].saved) {
      return FwdFull(r, blk.layer + 1, exp, blk.microbatch);
    }
    return BlockBuf(r, bi, BlockBuffer::Role::kValue, t);
  }
  int32_t src = lb.import_from[static_cast<size_t>(t)];
  if (src >= 0 && blk.prev_in_pass) {
    if (G(blk.layer - 1).tensors[static_cast<size_t>(src)].saved) {
      return FwdFull(r, blk.layer - 1, src, blk.microbatch);
    }
    return BlockBuf(r, bi - 1, BlockBuffer::Role::kValue, src);
  }
  return BlockBuf(r, bi, BlockBuffer::Role::kValue, t);
}

Buffer Executor::Grad(Rank& r, size_t bi, int32_t t) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerBuffers& lb = LB(blk.layer);
  if (IsShared(lb, t)) return SharedGrad(r, bi, t);
  if (lb.prod[static_cast<size_t>(t)] >= 0 && lb.export_to[static_cast<size_t>(t)] >= 0 && blk.prev_in_pass) {
    return BlockBuf(r, bi - 1, BlockBuffer::Role::kGrad, lb.export_to[static_cast<size_t>(t)]);
  }
  return BlockBuf(r, bi, BlockBuffer::Role::kGrad, t);
}

const ParamState& Executor::ParamOf(Rank& r, const OpSpec& op, size_t role) {
  if (role < op.params.size()) {
    auto it = r.param_index.find(op.params[role]);
    if (it != r.param_index.end()) return r.params[it->second];
    // A tied head on the embedding's own rank holds no copy: it reads the embedding.
    const planner::ParamSpec* spec = nullptr;
    for (const auto& p : G(p_.layers.size() - 1).params) spec = p.name == op.params[role] ? &p : spec;
    if (spec != nullptr && spec->kind == planner::ParamKind::kHead && model_.arch.tied_embeddings) {
      auto emb = r.param_index.find(G(0).params.front().name);
      if (emb != r.param_index.end()) return r.params[emb->second];
    }
  }
  ThrowError(ErrorCode::kRuntime, "op " + op.name + " has no parameter for its role " + std::to_string(role) +
                                      " on pp rank " + std::to_string(r.index));
}

}  // namespace memplan::runtime::exec
