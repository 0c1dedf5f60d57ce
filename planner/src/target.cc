// The targets (target.h): memplan's own runtime and Megatron-LM. Each
// Megatron rule or buffer names its source; docs/targets.md has the table.
#include "memplan/planner/target.h"

#include <algorithm>
#include <numeric>

#include "memplan/common/units.h"
#include "memplan/planner/framework.h"
#include "memplan/planner/layout.h"
#include "memplan/planner/megatron_args.h"

namespace memplan::planner {
namespace {

class MemplanTarget final : public Target {
 public:
  TargetKind Kind() const override { return TargetKind::kMemplan; }
  std::optional<std::string> Refusal(const Model&) const override { return std::nullopt; }
  bool PerTensorStorage() const override { return true; }
  bool HasRuntimeMechanisms() const override { return true; }
  bool MlaDownProjectionsOnShard() const override { return false; }
  void StaticBuffers(const Model&, int64_t, StaticBreakdown*) const override {}
  std::optional<CachingAllocatorConfig> Allocator(const Model&) const override { return std::nullopt; }
  // memplan's arena is exact; the default budget's reserve (model.h
  // DefaultReserveBytes) already holds back the allocator slack and the
  // spread of the NCCL estimates.
  int64_t DefaultHeadroom(const Model&) const override { return 0; }
};

// NCCL's buffers per connection (accounting.cc RuntimeItems, the same
// formula): Simple at NCCL_BUFFSIZE, LL128 and LL at their defaults.
int64_t CollectiveBytes(const Hardware::Runtime& h) {
  constexpr int64_t kLl128 = 4'915'200, kLl = 524'288;
  return 2 * h.nccl_channels * (h.nccl_buffsize + kLl128 + kLl);
}

class MegatronTarget final : public Target {
 public:
  TargetKind Kind() const override { return TargetKind::kMegatron; }

  std::optional<std::string> Refusal(const Model& model) const override {
    const Arch& a = model.arch;
    const Parallel& p = model.parallel;
    // Mechanisms Megatron-Core's GPT model does not have.
    if (a.linear_attention) return "arch.linear_attention: Megatron's GPT model has no KDA layers";
    if (a.attn_res) return "arch.attn_res: Megatron has no attention residuals (Block AttnRes)";
    if (a.moe && a.moe->latent_dim) {
      return "arch.moe.latent_dim: the experts' latent projection is not modelled under target megatron";
    }
    if (!model.graph.empty()) return "graph: explicit layer graphs are memplan's; Megatron's modules are its templates";
    if (p.zero >= 2 || p.pipeline_zero2 || p.grad_offload_host) {
      return "parallel.zero " + std::to_string(p.zero) +
             ": Megatron's distributed optimizer shards optimizer state (ZeRO-1); its FSDP paths are not modelled "
             "under target megatron";
    }
    if (model.train.grad_dtype != DType::kFP32) {
      return "train.grad_dtype: Megatron accumulates main gradients in fp32 (--accumulate-allreduce-grads-in-fp32 "
             "with bf16); --grad-reduce-in-bf16 is not modelled";
    }
    if (model.train.optimizer == Optimizer::kMuon) {
      return "train.optimizer muon: Megatron's Muon (dist_muon) is not modelled under target megatron";
    }
    if (!model.policies.empty()) {
      return "policies: Megatron stores tensors by module settings, not per tensor; give target.settings or let "
             "the planner choose them";
    }
    if (model.target.settings) {
      for (const auto& m : model.target.settings->recompute_modules) {
        if (std::find(MegatronRecomputeModuleNames().begin(), MegatronRecomputeModuleNames().end(), m) ==
            MegatronRecomputeModuleNames().end()) {
          return "target.settings.recompute_modules: Invalid choices for recompute_modules: " + m;
        }
      }
    }
    return ValidateMegatronArgs(MegatronArgsOf(model, model.target.settings.value_or(FrameworkSettings{})));
  }

  bool PerTensorStorage() const override { return false; }
  bool HasRuntimeMechanisms() const override { return false; }
  // multi_latent_attention.py:524-600 (duplicated mode on the SP-local input).
  bool MlaDownProjectionsOnShard() const override { return true; }

  void StaticBuffers(const Model& model, int64_t rank, StaticBreakdown* st) const override {
    const Parallel& p = model.parallel;
    // memplan's kernels' buffers and communication designs are not
    // Megatron's: its buckets are views of the contiguous gradient buffer
    // (param_and_grad_buffer.py), context parallelism is TE's ring.
    for (const char* name : {"gemm_workspace", "kernel_scratch", "cp_comm", "tp_comm", "reduce_bucket"}) {
      st->buffer_detail.erase(name);
    }
    // Transformer Engine's cuBLAS workspace: 32 MiB + 1 KiB on compute
    // capability 9 and above (TE pytorch/cpp_extensions/gemm.py:37-67), one
    // per cuBLAS stream: the compute stream's, and with MoE's grouped GEMM
    // TE's multi-stream workspaces (4 streams).
    const int64_t workspace = 32 * kMiB + 1024;
    st->buffer_detail["te_cublas_workspace"] = workspace * (model.arch.moe ? 5 : 1);
    // Sequence parallelism: the all-gathered input of a column-parallel
    // linear, [s/cp x b, h] in the activation dtype, from Megatron's global
    // memory buffer (parallel_state.py _set_global_memory_buffer).
    if (p.tp > 1 && p.sp) {
      const int64_t tokens = model.train.seq_len / p.cp * model.train.micro_batch;
      st->buffer_detail["sp_all_gather"] = tokens * model.arch.hidden * DTypeBytes(model.train.act_dtype);
    }
    st->buffers = 0;
    for (const auto& [name, bytes] : st->buffer_detail) st->buffers += bytes;
    st->total = st->weights + st->grads + st->optimizer + st->buffers;

    // Outside the framework: the CUDA context and one NCCL communicator per
    // process group that runs a collective in training (PyTorch creates a
    // group's communicator at its first collective; parallel_state.py lists
    // the groups). Point-to-point groups as RuntimeItems prices them.
    auto& rt = st->runtime_detail;
    const Hardware::Runtime& h = model.hardware.runtime;
    const int64_t collective = CollectiveBytes(h);
    // Gradient norm and overflow checks reduce over the model-parallel
    // group (tensor x pipeline).
    if (p.tp * p.pp > 1 && collective > 0) rt["nccl_mp"] = collective;
    // Tied embeddings: the first and last pipeline ranks all-reduce the
    // embedding's gradient in the embedding group.
    if (model.arch.tied_embeddings && p.pp > 1 && (rank == 0 || rank == p.pp - 1) && collective > 0) {
      rt["nccl_embedding"] = collective;
    }
    st->runtime = 0;
    for (const auto& [name, bytes] : rt) st->runtime += bytes;
  }

  std::optional<CachingAllocatorConfig> Allocator(const Model& model) const override {
    CachingAllocatorConfig c;
    c.expandable_segments = model.target.expandable_segments;
    if (model.target.max_split_size_mb > 0) c.max_split_size_bytes = model.target.max_split_size_mb * kMiB;
    return c;
  }

  // The NCCL estimates (544-688 MB measured per communicator, nccl#964)
  // and the CUDA context vary by driver and system, and the caching
  // allocator's other streams' pools are not modelled: 2 GiB or 2.5 % of
  // the device, whichever is larger, on GPU presets (docs/targets.md).
  int64_t DefaultHeadroom(const Model& model) const override {
    if (model.hardware.runtime.cuda_context <= 0) return 0;
    return std::max<int64_t>(2 * kGiB, model.hardware.device_memory / 40);
  }
};

}  // namespace

const Target& GetTarget(TargetKind kind) {
  static const MemplanTarget memplan;
  static const MegatronTarget megatron;
  switch (kind) {
    case TargetKind::kMemplan:
      return memplan;
    case TargetKind::kMegatron:
      return megatron;
  }
  return memplan;
}

std::string SettingsFlags(const FrameworkSettings& s) {
  auto join = [](const std::vector<std::string>& v) {
    std::string o;
    for (const auto& x : v) o += (o.empty() ? "" : " ") + x;
    return o;
  };
  std::string line;
  if (s.granularity == "selective") {
    line += "--recompute-granularity selective --recompute-modules " +
            (s.recompute_modules.empty() ? std::string("core_attn") : join(s.recompute_modules));
  }
  if (s.granularity == "full") {
    line += "--recompute-granularity full --recompute-method " + s.method + " --recompute-num-layers " +
            std::to_string(s.num_layers);
  }
  if (!s.offload_modules.empty()) {
    line += std::string(line.empty() ? "" : " ") + "--fine-grained-activation-offloading --offload-modules " +
            join(s.offload_modules);
  }
  return line.empty() ? "none" : line;
}

void ApplyTarget(Model* model, TargetKind kind) {
  if (model->target.kind == kind) return;
  model->target = TargetConfig{};
  model->target.kind = kind;
  if (!GetTarget(kind).HasRuntimeMechanisms()) {
    Options& o = model->options;
    // Megatron weights the expert activation by the gates, so FC2's output
    // is not saved: memplan's gradient rewrite, on where there are experts.
    o.moe_grad_rewrite = model->arch.moe.has_value();
    o.moe_recompute_dispatch = false;
    o.attn_res_single_copy = o.attn_res_checkpoint = o.attn_res_pp_cache = false;
  }
}

std::optional<std::string> MegatronRefusal(const Model& model) {
  return GetTarget(TargetKind::kMegatron).Refusal(model);
}

Expected<std::vector<PolicyAnnotation>> SettingsPolicies(const Model& model, const FrameworkSettings& s) {
  std::vector<PolicyAnnotation> out;
  if (s.granularity == "full") {
    // Full recompute checkpoints whole layers of each virtual chunk
    // (megatron/core/recompute.py: `block`, the first num_layers layers of
    // the chunk; `uniform`, groups of num_layers layers, the group's input
    // kept): a checkpointed layer keeps its input, recomputes the rest.
    // Embedding, final norm, head, loss and MTP are outside the block.
    const PipelineLayout layout = MakePipelineLayout(model);
    for (const auto& rank : layout.chunks) {
      for (const auto& chunk : rank) {
        for (size_t i = 0; i < chunk.size(); ++i) {
          const bool block = s.method == "block";
          if (block && static_cast<int64_t>(i) >= s.num_layers) break;
          const std::string l = "layer" + std::to_string(chunk[i]) + ".";
          const bool group_input = block || static_cast<int64_t>(i) % std::max<int64_t>(1, s.num_layers) == 0;
          for (const char* keep : {"embed.*", "head.*", "head_norm.*", "loss.*", "mtp*"}) {
            out.push_back({l + keep, {Policy::kKeep}});
          }
          if (group_input) out.push_back({l + "attn_norm.x", {Policy::kKeep}});
          out.push_back({l + "*", {Policy::kRecompute}});
        }
      }
    }
  }
  std::vector<std::string> recompute;
  if (s.granularity == "selective") {
    recompute = s.recompute_modules.empty() ? std::vector<std::string>{"core_attn"} : s.recompute_modules;
  }
  auto modules = MegatronPolicies(model.arch.mla.has_value(), recompute, s.offload_modules, true, "target.settings");
  if (!modules) return modules.error();
  out.insert(out.end(), modules->begin(), modules->end());
  return out;
}

}  // namespace memplan::planner
