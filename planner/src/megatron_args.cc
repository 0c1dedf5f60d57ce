// Megatron-LM's argument rules (megatron_args.h). Every rule names its
// source at NVIDIA/Megatron-LM d98e8a64 (docs/targets.md has the table):
// AR = megatron/training/arguments.py, TC = megatron/core/transformer/
// transformer_config.py, TB = megatron/core/transformer/transformer_block.py,
// PS = megatron/core/parallel_state.py, PLL = megatron/core/transformer/
// pipeline_parallel_layer_layout.py, NMC = megatron/core/
// num_microbatches_calculator.py, MOE = megatron/core/transformer/moe/
// moe_layer.py.
#include "memplan/planner/megatron_args.h"

#include <algorithm>
#include <cctype>

#include "memplan/planner/layout.h"

namespace memplan::planner {
namespace {

std::string S(int64_t v) { return std::to_string(v); }

bool Contains(const std::vector<std::string>& v, std::string_view x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// TC uneven pipeline split (first/last stage counts), TC:2293-2370.
std::optional<std::string> UnevenSplit(const MegatronArgs& a, int64_t vpp) {
  int64_t middle_layers = a.num_layers, middle_stages = a.pp;
  for (auto [given, flag] : {std::pair{a.first_stage_layers, "--decoder-first-pipeline-num-layers"},
                             std::pair{a.last_stage_layers, "--decoder-last-pipeline-num-layers"}}) {
    if (!given) continue;
    if (*given <= 0) return std::string(flag) + ": number of layers at first/last stage must be larger than 0";
    if (*given % vpp != 0) {
      return std::string(flag) + ": number of layers at first/last stage: " + S(*given) +
             " must be divisible by virtual pipeline parallel degree " + S(vpp);
    }
    middle_layers -= *given;
    middle_stages -= 1;
  }
  if (middle_layers < 0 || (middle_layers == 0) != (middle_stages == 0)) {
    return "--decoder-first/last-pipeline-num-layers: Mismatch: " + S(middle_layers) + " middle layers remaining but " +
           S(middle_stages) + " middle PP stages available";
  }
  if (middle_stages > 0 && middle_layers % middle_stages != 0) {
    return "--decoder-first/last-pipeline-num-layers: number of layers at middle stage: " + S(middle_layers) +
           " must be divisible by the middle pipeline model parallel size " + S(middle_stages);
  }
  if (middle_stages > 0 && (middle_layers / middle_stages) % vpp != 0) {
    return "--decoder-first/last-pipeline-num-layers: number of layers on each middle pipeline rank:" +
           S(middle_layers / middle_stages) + " must be divisible by virtual pipeline parallel degree " + S(vpp);
  }
  return std::nullopt;
}

std::optional<std::string> PipelineRules(const MegatronArgs& a) {
  // At most one way to give virtual stages (AR:927-939).
  const int ways = a.layers_per_virtual_stage.has_value() + a.virtual_stages_per_rank.has_value() +
                   !a.pipeline_layout.empty();
  if (ways > 1) {
    return "No more than one of the following arguments can be set at the same time: "
           "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank, "
           "--pipeline-model-parallel-layout";
  }
  const bool uneven = a.first_stage_layers || a.last_stage_layers;
  if (!a.pipeline_layout.empty()) {
    // TC:2242-2259: the layout excludes the other pipeline arguments.
    if (uneven || a.account_for_embedding || a.account_for_loss) {
      return "--pipeline-model-parallel-layout: pipeline_model_parallel_layout cannot be set with other pipeline "
             "layout arguments";
    }
    auto stages = ParsePipelineLayout(a.pipeline_layout);
    if (!stages) return "--pipeline-model-parallel-layout: " + stages.error().message;
    const int64_t n = static_cast<int64_t>(stages->size());
    if (n % a.pp != 0) {  // AR:941-953
      return "--pipeline-model-parallel-layout: The length of pipeline_model_parallel_layout must be divisible by "
             "pipeline_model_parallel_size (" + S(n) + " stages, pp " + S(a.pp) + ")";
    }
    // PLL:86-151: one E first, one L last, every decoder and MTP layer once.
    int64_t t = 0, m = 0, e = 0, l = 0;
    bool seen_m = false;
    for (const auto& s : *stages) {
      if (seen_m && s.decoder_layers > 0) {
        return "--pipeline-model-parallel-layout: decoder layers ('t') after an MTP layer ('m')";
      }
      seen_m = seen_m || s.mtp_layers > 0;
      t += s.decoder_layers, m += s.mtp_layers, e += s.embedding, l += s.loss;
    }
    if (e != 1 || !stages->front().embedding) {
      return "--pipeline-model-parallel-layout: the embedding ('E') must be the first layer, exactly once";
    }
    if (l != 1 || !stages->back().loss) {
      return "--pipeline-model-parallel-layout: the loss ('L') must be the last layer, exactly once";
    }
    if (t != a.num_layers) {
      return "--pipeline-model-parallel-layout: the layout has " + S(t) + " decoder layers ('t'), --num-layers is " +
             S(a.num_layers);
    }
    if (m != a.mtp_layers) {
      return "--pipeline-model-parallel-layout: the layout has " + S(m) + " MTP layers ('m'), --mtp-num-layers is " +
             S(a.mtp_layers);
    }
  } else if (a.layers_per_virtual_stage) {
    // AR:954-975.
    if (uneven) {
      return "--num-layers-per-virtual-pipeline-stage: please use --num-virtual-stages-per-pipeline-rank to specify "
             "virtual pipeline parallel degree when enable uneven pipeline parallelism";
    }
    const int64_t layers = a.num_layers + a.account_for_embedding + a.account_for_loss;
    if (layers % a.pp != 0) {
      return "--num-layers: number of layers of the model must be divisible pipeline model parallel size (" +
             S(layers) + " layers, pp " + S(a.pp) + ")";
    }
    if ((layers / a.pp) % *a.layers_per_virtual_stage != 0) {
      return "--num-layers-per-virtual-pipeline-stage: number of layers per pipeline stage must be divisible number "
             "of layers per virtual pipeline stage (" + S(layers / a.pp) + " per stage, " +
             S(*a.layers_per_virtual_stage) + " per virtual stage)";
    }
  } else if (uneven) {
    if (a.account_for_embedding || a.account_for_loss) {  // TC:2230-2239
      return "--decoder-first/last-pipeline-num-layers: num_layers_in_first_pipeline_stage and "
             "num_layers_in_last_pipeline_stage cannot be set at the same time with "
             "account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split";
    }
    if (auto why = UnevenSplit(a, a.VirtualStages())) return why;
  } else {
    // Even split: AR:985-998 without virtual stages, TB:155-178 with them.
    const int64_t layers = a.num_layers + a.account_for_embedding + a.account_for_loss;
    if (layers % a.pp != 0) {
      return "--num-layers: Number of layers should be divisible by the pipeline-model-parallel size (" + S(layers) +
             " layers, pp " + S(a.pp) + ")";
    }
    if ((layers / a.pp) % a.VirtualStages() != 0) {
      return "--num-virtual-stages-per-pipeline-rank: the " + S(layers / a.pp) +
             " layers per pipeline rank are not divisible by the " + S(a.VirtualStages()) + " virtual stages";
    }
  }
  // The interleaved schedule needs pipeline ranks (AR:1000-1010, PS:827-831).
  if (a.VirtualStages() > 1 && a.pp <= 1) {
    return "--pipeline-model-parallel-size: When interleaved schedule is used, pipeline-model-parallel size should "
           "be greater than 1";
  }
  return std::nullopt;
}

std::optional<std::string> StorageRules(const MegatronArgs& a) {
  const std::string& g = a.recompute_granularity;
  if (!g.empty() && g != "full" && g != "selective") return "--recompute-granularity: expected full or selective";
  if (!a.recompute_method.empty() && a.recompute_method != "uniform" && a.recompute_method != "block") {
    return "--recompute-method: expected uniform or block";
  }
  if (g == "selective" && !a.recompute_method.empty()) {  // AR:1425-1428
    return "--recompute-method: recompute method is not yet supported for selective recomputing granularity";
  }
  if (g == "full" && a.recompute_method.empty()) {  // TC:1901-1932
    return "--recompute-method: Using recompute_granularity: full so recompute_method must be \"block\" or "
           "\"uniform\"";
  }
  if (g == "full" && !a.recompute_num_layers) {
    return "--recompute-num-layers: Using recompute_granularity: full so recompute_num_layers must be between 1 and "
           "num_layers_per_pipeline_rank";
  }
  if (g == "selective" && a.recompute_num_layers) {
    return "--recompute-num-layers: Using recompute_granularity: selective so recompute_num_layers must be None";
  }
  if (g == "selective") {
    for (const auto& m : a.recompute_modules) {  // TC:1943-1962
      const auto& names = MegatronRecomputeModuleNames();
      if (std::find(names.begin(), names.end(), m) == names.end()) {
        return "--recompute-modules: Invalid choices for recompute_modules: " + m;
      }
    }
    if (Contains(a.recompute_modules, "moe_act") && !a.grouped_gemm) {  // TC:1964-1967
      return "--recompute-modules: moe_act in recompute_modules is only supported with moe_grouped_gemm";
    }
    if (Contains(a.recompute_modules, "mla_up_proj") && !a.multi_latent_attention) {  // TC:1969-1973
      return "--recompute-modules: mla_up_proj in recompute_modules is only supported with multi-latent attention";
    }
  }
  if (a.fine_grained_offloading) {  // TC:2126-2194
    if (a.offload_modules.empty()) return "--offload-modules: offload_modules must not be empty";
    for (const auto& m : a.offload_modules) {
      const auto& names = MegatronOffloadModuleNames();
      if (std::find(names.begin(), names.end(), m) == names.end()) {
        return "--offload-modules: Invalid choices for offload_modules: " + m;
      }
    }
    if (Contains(a.offload_modules, "attn_proj") && !Contains(a.offload_modules, "core_attn")) {
      return "--offload-modules: attn_proj cannot be set to offload_modules alone without core_attn";
    }
    if (g == "selective" && Contains(a.recompute_modules, "moe")) {
      for (const char* m : {"moe_act", "expert_fc1"}) {
        if (Contains(a.offload_modules, m)) {
          return std::string("--offload-modules: Cannot offload ") + m +
                 " while recomputing the entire MoE layer (recompute_modules moe)";
        }
      }
    }
  } else if (!a.offload_modules.empty()) {
    return "--offload-modules: takes effect with --fine-grained-activation-offloading, which is absent";
  }
  return std::nullopt;
}

}  // namespace

int64_t MegatronArgs::VirtualStages() const {
  if (virtual_stages_per_rank) return *virtual_stages_per_rank;
  if (layers_per_virtual_stage && pp > 0 && *layers_per_virtual_stage > 0) {
    return (num_layers + account_for_embedding + account_for_loss) / pp / *layers_per_virtual_stage;
  }
  if (!pipeline_layout.empty()) {
    auto stages = ParsePipelineLayout(pipeline_layout);
    if (stages && pp > 0) return std::max<int64_t>(1, static_cast<int64_t>(stages->size()) / pp);
  }
  return 1;
}

int64_t MegatronPaddedVocab(int64_t vocab, int64_t divisible_by, int64_t tp) {
  const int64_t multiple = divisible_by * tp;
  return (vocab + multiple - 1) / multiple * multiple;
}

const std::vector<std::string_view>& MegatronRecomputeModuleNames() {
  // TC:1943-1962 (the GDN, GDP and mHC modules belong to architectures
  // memplan does not model).
  static const std::vector<std::string_view> names = {"core_attn", "moe_act", "layernorm", "mla_up_proj",
                                                      "mlp",       "moe",     "shared_experts"};
  return names;
}

const std::vector<std::string_view>& MegatronOffloadModuleNames() {
  // TC:1328-1342, 2126-2194.
  static const std::vector<std::string_view> names = {"attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                                      "mlp_norm",  "expert_fc1", "moe_act"};
  return names;
}

Expected<std::vector<PipelineStage>> ParsePipelineLayout(std::string_view text) {
  // PLL:283-321: commas are cosmetic; "(X)*N" repeats a group (no
  // nesting), "c*N" one character; '|' separates stages.
  std::string s;
  for (char c : text) {
    if (c != ',') s += c;
  }
  if (s.size() > 20'000) return Error{ErrorCode::kBadInput, "layout longer than 20000 characters"};
  constexpr size_t kLimit = 4'000'000;
  const Error too_long{ErrorCode::kBadInput, "a repetition expands past 4000000 characters"};
  // A repeat count after `at` ("*N"), or nullopt (and `at` unchanged).
  auto count_at = [](const std::string& in, size_t& at) -> std::optional<int64_t> {
    if (at >= in.size() || in[at] != '*') return std::nullopt;
    size_t end = at + 1;
    while (end < in.size() && std::isdigit(static_cast<unsigned char>(in[end]))) ++end;
    if (end == at + 1 || end - at > 7) return std::nullopt;
    const int64_t n = std::stoll(in.substr(at + 1, end - at - 1));
    at = end;
    return n;
  };
  // Groups first, then single characters, as Megatron's two substitutions.
  std::string groups;
  for (size_t i = 0; i < s.size();) {
    const size_t close = s[i] == '(' ? s.find_first_of("()", i + 1) : std::string::npos;
    if (close != std::string::npos && s[close] == ')') {
      size_t at = close + 1;
      if (auto n = count_at(s, at)) {
        for (int64_t k = 0; k < *n; ++k) {
          groups.append(s, i + 1, close - i - 1);
          if (groups.size() > kLimit) return too_long;
        }
        i = at;
        continue;
      }
    }
    groups += s[i++];
  }
  std::string chars;
  for (size_t i = 0; i < groups.size();) {
    const char c = groups[i];
    size_t at = i + 1;
    if (c != '|' && c != '*' && c != '(' && c != ')' && !std::isdigit(static_cast<unsigned char>(c))) {
      if (auto n = count_at(groups, at)) {
        chars.append(static_cast<size_t>(*n), c);
        if (chars.size() > kLimit) return too_long;
        i = at;
        continue;
      }
    }
    chars += c;
    ++i;
  }
  std::vector<PipelineStage> out(1);
  for (char c : chars) {
    PipelineStage& st = out.back();
    switch (c) {
      case '|':
        out.emplace_back();
        break;
      case 'E':
        st.embedding = true;
        break;
      case 'L':
        st.loss = true;
        break;
      case 't':
        ++st.decoder_layers;
        break;
      case 'm':
        ++st.mtp_layers;
        break;
      default:
        return Error{ErrorCode::kBadInput, std::string("Invalid layer character: '") + c +
                                               "' (expected E, L, t, m, '|', '(X)*N' or 'c*N')"};
    }
  }
  return out;
}

std::string PipelineLayoutString(const Model& model) {
  const PipelineLayout l = MakePipelineLayout(model);
  std::string out;
  for (int64_t c = 0; c < l.vp; ++c) {
    for (int64_t r = 0; r < l.pp; ++r) {
      if (!out.empty()) out += "|";
      if (c == 0 && r == 0) out += "E";
      const int64_t n = static_cast<int64_t>(l.chunks[static_cast<size_t>(r)][static_cast<size_t>(c)].size());
      if (n > 1) out += "t*" + S(n);
      if (n == 1) out += "t";
      if (c == l.vp - 1 && r == l.pp - 1) {
        if (model.arch.mtp_layers > 1) out += "m*" + S(model.arch.mtp_layers);
        if (model.arch.mtp_layers == 1) out += "m";
        out += "L";
      }
    }
  }
  return out;
}

MegatronArgs MegatronArgsOf(const Model& model, const FrameworkSettings& settings) {
  const Arch& a = model.arch;
  const Parallel& p = model.parallel;
  MegatronArgs m;
  m.world_size = p.Processes();
  m.num_layers = a.layers;
  m.hidden = a.hidden;
  m.heads = a.heads;
  m.multi_latent_attention = a.mla.has_value();
  m.group_query_attention = !m.multi_latent_attention && a.kv_heads != a.heads;
  m.query_groups = m.group_query_attention ? a.kv_heads : 0;
  m.mtp_layers = a.mtp_layers;
  m.seq_len = model.train.seq_len;
  m.learned_positions = a.position_embeddings > 0;
  m.max_position_embeddings = a.position_embeddings;
  m.micro_batch = model.train.micro_batch;
  m.global_batch = model.train.micro_batch * model.train.microbatches * p.dp;
  m.tp = p.tp;
  m.pp = p.pp;
  m.cp = p.cp;
  m.ep = p.ep;
  m.sequence_parallel = p.sp && p.tp > 1;
  if (a.moe) {
    m.experts = a.moe->experts;
    m.expert_tp = 1;
    m.grouped_gemm = true;
  }
  m.bf16 = model.train.param_dtype == DType::kBF16;
  m.fp16 = model.train.param_dtype == DType::kFP16;
  m.distributed_optimizer = p.zero >= 1;
  // The layout: even counts, first/last stage counts (no virtual stages),
  // or the layout string.
  const std::vector<int64_t>& layout = p.pp_layout;
  const bool even = std::adjacent_find(layout.begin(), layout.end(), std::not_equal_to<>()) == layout.end() &&
                    layout.front() % p.vp == 0;
  if (p.pp > 1 && !even) {
    bool first_last = p.vp == 1 && p.pp > 2;
    for (size_t i = 2; i + 1 < layout.size(); ++i) first_last = first_last && layout[i] == layout[1];
    if (first_last) {
      if (layout.front() != layout[1]) m.first_stage_layers = layout.front();
      if (layout.back() != layout[1]) m.last_stage_layers = layout.back();
    } else {
      m.pipeline_layout = PipelineLayoutString(model);
    }
  } else if (p.vp > 1) {
    m.virtual_stages_per_rank = p.vp;
  }
  m.recompute_granularity = settings.granularity;
  m.recompute_method = settings.method;
  if (settings.granularity == "full") m.recompute_num_layers = settings.num_layers;
  m.recompute_modules = settings.recompute_modules;
  m.offload_modules = settings.offload_modules;
  m.fine_grained_offloading = !settings.offload_modules.empty();
  return m;
}

std::optional<std::string> ValidateMegatronArgs(const MegatronArgs& a) {
  if (a.tp < 1 || a.pp < 1 || a.cp < 1 || a.ep < 1 || a.world_size < 1) return "parallel sizes must be at least 1";
  // AR:425-434: the world divides into tensor x pipeline x context groups.
  if (a.world_size % (a.tp * a.pp * a.cp) != 0) {
    return "world size (" + S(a.world_size) + ") is not divisible by total_model_size (tp " + S(a.tp) + " x pp " +
           S(a.pp) + " x cp " + S(a.cp) + ")";
  }
  if (a.num_layers < 1) return "--num-layers: expected at least 1";
  if (auto why = PipelineRules(a)) return why;
  // TC:1446-1468: heads and query groups against tp.
  if (a.heads % a.tp != 0) {
    return "--num-attention-heads: num_attention_heads (" + S(a.heads) +
           ") must be a multiple of tensor_model_parallel_size (" + S(a.tp) + ")";
  }
  if (a.group_query_attention) {
    if (a.multi_latent_attention) {  // AR:1973-1974
      return "--group-query-attention: Group query attention is mutually exclusive with multi latent attention";
    }
    if (a.query_groups < 1 || (a.query_groups % a.tp != 0 && a.tp % a.query_groups != 0)) {
      return "--num-query-groups: num_query_groups (" + S(a.query_groups) +
             ") must be a multiple or divisor of tensor_model_parallel_size (" + S(a.tp) + ")";
    }
  }
  // AR:1335-1338, 1353-1356.
  if (a.cp > 1 && a.seq_len % (2 * a.cp) != 0) {
    return "--seq-length: seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size > 1 (" +
           S(a.seq_len) + ", cp " + S(a.cp) + ")";
  }
  if (a.learned_positions && a.max_position_embeddings < a.seq_len) {
    return "--max-position-embeddings: max_position_embeddings (" + S(a.max_position_embeddings) +
           ") must be greater than or equal to seq_length (" + S(a.seq_len) + ")";
  }
  // Experts: AR:1656-1658; the expert grid, PS:870-884.
  if (a.ep > 1 && a.experts == 0) return "--expert-model-parallel-size: num_experts must be non None to use expert model parallelism";
  if (a.experts > 0 && a.experts % a.ep != 0) {
    return "--num-experts: Number of experts should be a multiple of expert model parallel_size (" + S(a.experts) +
           " experts, ep " + S(a.ep) + ")";
  }
  if (a.experts > 0) {
    const int64_t etp = a.expert_tp > 0 ? a.expert_tp : a.tp;
    if (a.world_size % (etp * a.ep * a.pp) != 0) {
      return "--expert-model-parallel-size: world_size (" + S(a.world_size) +
             ") is not divisible by expert_tensor_model_pipeline_parallel size (" + S(etp * a.ep * a.pp) + ")";
    }
    // MOE:636-640: MoE under tensor parallelism without sequence
    // parallelism raises in the first training forward.
    if (a.tp > 1 && !a.sequence_parallel) {
      return "--sequence-parallel: During training, performance may degrade if MoE and tensor parallelism are "
             "enabled without also enabling sequence parallelism (MoELayer raises; add --sequence-parallel)";
    }
  }
  // NMC:381-386.
  const int64_t dp = a.DataParallel();
  if (a.micro_batch < 1) return "--micro-batch-size: expected at least 1";
  if (a.global_batch % (a.micro_batch * dp) != 0 || a.global_batch < a.micro_batch * dp) {
    return "--global-batch-size: global batch size (" + S(a.global_batch) +
           ") is not divisible by micro batch size (" + S(a.micro_batch) + ") times data parallel size (" + S(dp) + ")";
  }
  if (a.bf16 && a.fp16) return "--bf16: --bf16 and --fp16 cannot both be given";  // AR:1194-1206
  if (a.overlap_param_gather && !(a.distributed_optimizer && a.overlap_grad_reduce)) {  // AR:1024-1029
    return "--overlap-param-gather: --overlap-param-gather only supported with distributed optimizer and "
           "--overlap-grad-reduce";
  }
  return StorageRules(a);
}

}  // namespace memplan::planner
