// `memplan import hf` (import.h, docs/import.md): a Hugging Face
// config.json to a memplan.model/1 document.
#include <utility>
#include <vector>
#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "memplan/common/table.h"
#include "memplan/planner/import.h"
#include "memplan/planner/model.h"

namespace memplan::planner {
namespace {

enum class Family { kDense, kMixtral, kQwenMoe, kDeepSeek, kGpt2 };

// model_type -> family. Architectures whose memory memplan's templates
// describe (docs/import.md); anything else is refused by name.
const std::map<std::string, Family, std::less<>>& Families() {
  static const std::map<std::string, Family, std::less<>> f = {
      {"llama", Family::kDense},      {"mistral", Family::kDense},       {"qwen2", Family::kDense},
      {"qwen3", Family::kDense},      {"mixtral", Family::kMixtral},     {"qwen2_moe", Family::kQwenMoe},
      {"qwen3_moe", Family::kQwenMoe}, {"deepseek_v2", Family::kDeepSeek}, {"deepseek_v3", Family::kDeepSeek},
      {"kimi_k2", Family::kDeepSeek}, {"gpt2", Family::kGpt2}};
  return f;
}

// Fields read and deliberately left out of the model, each for a stated
// reason (docs/import.md, "Fields that do not change memory"): metadata,
// inference-only settings, numerics, routing rules that move no bytes,
// and biases and per-head norms (under 0.02 % of the parameters).
const std::set<std::string, std::less<>>& NoMemoryEffect() {
  static const std::set<std::string, std::less<>> s = {
      // metadata and the checkpoint's own storage
      "architectures", "model_type", "_name_or_path", "transformers_version", "auto_map", "torch_dtype",
      "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id", "tokenizer_class",
      "task_specific_params", "return_dict", "use_return_dict", "output_attentions", "output_hidden_states",
      "torchscript", "is_encoder_decoder", "chunk_size_feed_forward",
      // inference only
      "use_cache", "ep_size", "pretraining_tp",
      // numerics and initialisation
      "initializer_range", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "rope_scaling",
      "attn_logit_softcapping", "scale_attn_weights", "reorder_and_upcast_attn",
      "scale_attn_by_inverse_layer_idx",
      // the position range of rotary models (no parameters; the run's length is --seq)
      "max_position_embeddings",
      // the span of sliding-window attention (flash attention's saved bytes do not depend on it)
      "sliding_window", "use_sliding_window", "max_window_layers",
      // routing rules and losses (no tensor changes size)
      "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "router_jitter_noise",
      "norm_topk_prob", "routed_scaling_factor", "topk_method", "n_group", "topk_group",
      // biases and per-head q/k norms: under 0.02 % of any listed model's parameters
      "attention_bias", "mlp_bias", "qkv_bias", "use_qk_norm",
      // GPT-2's sequence-summary head (classification only)
      "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
      "summary_first_dropout"};
  return s;
}

// The fields each family reads into the model (besides NoMemoryEffect).
std::set<std::string, std::less<>> Reads(Family f) {
  std::set<std::string, std::less<>> common = {"vocab_size", "tie_word_embeddings"};
  auto add = [&](std::initializer_list<const char*> keys) { common.insert(keys.begin(), keys.end()); };
  if (f == Family::kGpt2) {
    add({"n_layer", "n_embd", "n_head", "n_inner", "n_positions", "n_ctx", "activation_function", "resid_pdrop",
         "embd_pdrop", "attn_pdrop"});
    return common;
  }
  add({"num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
       "intermediate_size", "hidden_act", "attention_dropout", "hidden_dropout"});
  if (f == Family::kMixtral) add({"num_local_experts", "num_experts_per_tok"});
  if (f == Family::kQwenMoe) {
    add({"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
         "decoder_sparse_step", "mlp_only_layers"});
  }
  if (f == Family::kDeepSeek) {
    add({"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
         "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
         "moe_layer_freq", "scoring_func", "num_nextn_predict_layers"});
  }
  return common;
}

double Probability(ObjectReader& r, std::string_view key) {
  const Json* v = r.GetNullable(key);
  if (!v) return 0;
  if (!v->is_number() || v->get<double>() < 0 || v->get<double>() >= 1) {
    ThrowAt(r.At(key), "expected a dropout probability in [0, 1), got " + Brief(*v));
  }
  return v->get<double>();
}

int64_t Divide(int64_t n, int64_t d, const std::string& what) {
  if (d <= 0 || n % d != 0) {
    ThrowError(ErrorCode::kBadInput, what + ": " + std::to_string(n) + " is not divisible by " + std::to_string(d));
  }
  return n / d;
}

// The fields the framework needs to build the same model, though no byte
// the planner counts depends on them (model.h, docs/import.md): the rotary
// base and Llama 3's scaling, the norms' epsilon, q/k norms (Qwen3),
// biases (Qwen2's QKV bias), the MoE load-balancing loss.
void ReadFrameworkFields(const Json& config, const JsonLocation& top, Family family, const std::string& type, Json& a) {
  auto number = [&](const char* key, double lo, double hi) -> std::optional<double> {
    if (!config.contains(key) || config[key].is_null()) return std::nullopt;
    const Json& v = config[key];
    if (!v.is_number() || !(v.get<double>() >= lo && v.get<double>() <= hi)) {
      ThrowAt(top.Child(key), "expected a number in [" + FormatFixed(lo, 12) + ", " + FormatFixed(hi, 0) + "], got " + Brief(v));
    }
    return v.get<double>();
  };
  auto flag = [&](const char* key) {
    if (!config.contains(key) || config[key].is_null()) return false;
    if (!config[key].is_boolean()) ThrowAt(top.Child(key), "expected true or false, got " + Brief(config[key]));
    return config[key].get<bool>();
  };
  if (family != Family::kGpt2) {
    if (auto b = number("rope_theta", 1, 1e12)) a["rope_base"] = *b;
    // Llama 3's frequency scaling (rope_type "llama3"); other kinds (YaRN)
    // are not carried: docs/import.md.
    if (config.contains("rope_scaling") && config["rope_scaling"].is_object()) {
      const Json& rs = config["rope_scaling"];
      const std::string kind = rs.contains("rope_type") && rs["rope_type"].is_string() ? rs["rope_type"].get<std::string>()
                               : rs.contains("type") && rs["type"].is_string()        ? rs["type"].get<std::string>()
                                                                                      : "";
      if (kind == "llama3" && rs.contains("factor") && rs["factor"].is_number() && rs["factor"].get<double>() >= 1) {
        a["rope_scaling_factor"] = rs["factor"].get<double>();
      }
    }
  }
  for (const char* key : {"rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"}) {
    if (auto e = number(key, 1e-12, 1)) a["norm_eps"] = *e;
  }
  if (type == "qwen3" || type == "qwen3_moe" || flag("use_qk_norm")) a["qk_norm"] = true;
  if (type == "qwen2" || type == "qwen2_moe" || flag("attention_bias") || flag("qkv_bias")) a["qkv_bias"] = true;
  if (flag("mlp_bias")) a["linear_bias"] = true;
  if (a.contains("moe")) {
    if (auto c = number("router_aux_loss_coef", 0, 1e3)) {
      a["moe"]["load_balancing"] = "aux_loss";
      a["moe"]["aux_loss_coeff"] = *c;
    }
    if (auto c = number("aux_loss_alpha", 0, 1e3)) {
      a["moe"]["load_balancing"] = flag("seq_aux") ? "seq_aux_loss" : "aux_loss";
      a["moe"]["aux_loss_coeff"] = *c;
    }
  }
}

Json ArchOf(const Json& config, const std::string& file, Family family, const std::string& type,
          const ImportOptions& o) {
  const JsonLocation top{file, ""};
  // Every field is read, or known to leave memory alone, or refused.
  const auto reads = Reads(family);
  for (const auto& [key, value] : config.items()) {
    if (reads.count(key) || NoMemoryEffect().count(key)) continue;
    ThrowAt(top.Child(key), "not understood for model_type \"" + type +
                                "\": a field that may change memory is never dropped silently "
                                "(docs/import.md lists the fields read and those known to change nothing)");
  }
  ObjectReader r(config, top);
  for (const auto& key : NoMemoryEffect()) r.GetNullable(key);
  constexpr int64_t kBig = int64_t{1} << 40;
  Json a;
  a["norm"] = family == Family::kGpt2 ? "layernorm" : "rmsnorm";
  a["attention"] = "flash";
  a["vocab"] = r.Int("vocab_size", 1, kMaxVocab);
  // Hugging Face's default: GPT-2 ties its head to the embedding, the
  // other families' configs say false.
  a["tied_embeddings"] = r.Bool("tie_word_embeddings", family == Family::kGpt2);
  if (family == Family::kGpt2) {
    const int64_t h = r.Int("n_embd", 1, kMaxHidden);
    a["layers"] = r.Int("n_layer", 1, kMaxLayers);
    a["hidden"] = h;
    a["heads"] = r.Int("n_head", 1, kMaxHeads);
    a["ffn_hidden"] = r.OptIntNullable("n_inner", 1, kBig).value_or(4 * h);
    const std::string act = r.Enum("activation_function", {"gelu_new", "gelu", "gelu_pytorch_tanh"}, "gelu_new");
    (void)act;
    a["ffn_act"] = "gelu";
    const int64_t positions = r.Int("n_positions", 1, kMaxSeqLen, 1024);
    r.GetNullable("n_ctx");
    if (o.seq_len > positions) {
      ThrowAt(r.At("n_positions"), "--seq " + std::to_string(o.seq_len) + " exceeds the model's " +
                                       std::to_string(positions) + " learned positions");
    }
    a["position_embeddings"] = positions;
    const double p = std::max({Probability(r, "resid_pdrop"), Probability(r, "embd_pdrop"), Probability(r, "attn_pdrop")});
    a["dropout"] = p > 0;
    return a;
  }
  const int64_t h = r.Int("hidden_size", 1, kMaxHidden);
  const int64_t heads = r.Int("num_attention_heads", 1, kMaxHeads);
  a["layers"] = r.Int("num_hidden_layers", 1, kMaxLayers);
  a["hidden"] = h;
  a["heads"] = heads;
  a["kv_heads"] = r.Int("num_key_value_heads", 1, kMaxHeads, heads);
  if (const auto hd = r.OptIntNullable("head_dim", 1, kMaxHidden)) a["head_dim"] = *hd;
  a["ffn_act"] = "swiglu";
  const std::string act = r.Enum("hidden_act", {"silu", "swish"}, "silu");
  (void)act;  // gated SiLU: the SwiGLU MLP of every family here
  a["dropout"] = std::max(Probability(r, "attention_dropout"), Probability(r, "hidden_dropout")) > 0;
  const int64_t layers = a["layers"];
  const std::optional<int64_t> ffn = r.OptInt("intermediate_size", 1, kBig);
  if (family == Family::kDense) {
    if (!ffn) ThrowAt(r.At("intermediate_size"), "missing: the MLP's size");
    a["ffn_hidden"] = *ffn;
    return a;
  }
  Json moe;
  if (family == Family::kMixtral) {
    if (!ffn) ThrowAt(r.At("intermediate_size"), "missing: each expert's FFN size");
    moe["experts"] = r.Int("num_local_experts", 1, kMaxExperts);
    moe["top_k"] = r.Int("num_experts_per_tok", 1, kMaxExperts);
    moe["expert_ffn_hidden"] = *ffn;
    moe["router"] = "softmax";
    a["moe"] = moe;
    return a;
  }
  std::vector<int64_t> dense;  // beyond the first `first` layers
  int64_t first = 0;
  if (family == Family::kQwenMoe) {
    moe["experts"] = r.Int("num_experts", 1, kMaxExperts);
    moe["top_k"] = r.Int("num_experts_per_tok", 1, kMaxExperts);
    moe["expert_ffn_hidden"] = r.Int("moe_intermediate_size", 1, kBig);
    const int64_t shared = r.Int("shared_expert_intermediate_size", 0, kBig, 0);
    if (shared > 0) {
      moe["shared_experts"] = 1;  // one shared expert of that size (its sigmoid gate: one row, left out)
      moe["shared_ffn_hidden"] = shared;
    }
    moe["router"] = "softmax";
    // Transformers' rule: layer l is sparse unless listed in
    // mlp_only_layers, and only every decoder_sparse_step-th ((l + 1) % step == 0).
    const int64_t step = r.Int("decoder_sparse_step", 1, kMaxLayers, 1);
    std::set<int64_t> only;
    if (const Json* v = r.GetNullable("mlp_only_layers")) {
      if (!v->is_array()) ThrowAt(r.At("mlp_only_layers"), "expected an array of layer indices");
      for (size_t i = 0; i < v->size(); ++i) {
        const Json& x = (*v)[i];
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= layers) {
          ThrowAt(r.At("mlp_only_layers").Child(i), "expected a layer index in [0, " + std::to_string(layers - 1) +
                                                        "], got " + Brief(x));
        }
        only.insert(x.get<int64_t>());
      }
    }
    for (int64_t l = 0; l < layers; ++l) {
      if (only.count(l) || (l + 1) % step != 0) dense.push_back(l);
    }
  } else {  // DeepSeek-V2/V3, Kimi K2
    Json mla;
    mla["q_lora_rank"] = r.OptIntNullable("q_lora_rank", 1, kMaxHidden).value_or(0);  // null: V2-Lite's uncompressed queries
    mla["kv_lora_rank"] = r.Int("kv_lora_rank", 1, kMaxHidden);
    mla["qk_nope_head_dim"] = r.Int("qk_nope_head_dim", 1, kMaxHidden);
    mla["qk_rope_head_dim"] = r.Int("qk_rope_head_dim", 1, kMaxHidden);
    mla["v_head_dim"] = r.Int("v_head_dim", 1, kMaxHidden);
    a["mla"] = mla;
    a["kv_heads"] = heads;  // MLA: every head has its own keys and values
    moe["experts"] = r.Int("n_routed_experts", 1, kMaxExperts);
    moe["top_k"] = r.Int("num_experts_per_tok", 1, kMaxExperts);
    moe["expert_ffn_hidden"] = r.Int("moe_intermediate_size", 1, kBig);
    moe["shared_experts"] = r.Int("n_shared_experts", 0, 1024, 0);
    // DeepSeek's scoring function: softmax (V2) or sigmoid (V3, K2).
    moe["router"] = r.Enum("scoring_func", {"softmax", "sigmoid"}, type == "deepseek_v2" ? "softmax" : "sigmoid");
    // Routing that changes the computation, not the bytes (executed by the
    // runtime): the gates' scale, and DeepSeek-V3's aux-loss-free bias
    // (topk_method "noaux_tc": the bias enters the selection only).
    if (const auto it = config.find("routed_scaling_factor"); it != config.end() && it->is_number() &&
                                                              it->get<double>() != 1.0) {
      moe["routed_scaling"] = it->get<double>();
    }
    if (const auto it = config.find("topk_method"); it != config.end() && *it == "noaux_tc") moe["selection_bias"] = true;
    // Transformers' rule: layer l is sparse when l >= first_k_dense_replace
    // and l % moe_layer_freq == 0.
    first = r.Int("first_k_dense_replace", 0, layers, 0);
    const int64_t freq = r.Int("moe_layer_freq", 1, kMaxLayers, 1);
    for (int64_t l = first; l < layers; ++l) {
      if (l % freq != 0) dense.push_back(l);
    }
    // Multi-token prediction depths, planned on the last stage
    // (docs/accounting.md section 2b); --no-mtp plans the model without.
    const int64_t mtp = r.Int("num_nextn_predict_layers", 0, 16, 0);
    if (mtp > 0 && !o.no_mtp) a["mtp_layers"] = mtp;
  }
  if (first > 0) moe["first_dense_layers"] = first;
  if (!dense.empty()) moe["dense_layers"] = dense;
  if (first > 0 || !dense.empty()) {
    if (!ffn) ThrowAt(r.At("intermediate_size"), "missing: the dense layers' MLP size");
    a["ffn_hidden"] = *ffn;
  }
  if (static_cast<int64_t>(dense.size()) + first == layers) {
    ThrowAt(top, "no layer is sparse: plan it as a dense model");
  }
  a["moe"] = moe;
  ReadFrameworkFields(config, top, family, type, a);
  return a;
}

// An error the imported model raised at an /arch field the config gave,
// said at the config's own key (the user edits config.json, not the
// generated model): "/arch/kv_heads" -> "/num_key_value_heads".
Error ToConfigKeys(Error e, const Json& config, const std::string& file) {
  static const std::pair<const char*, std::vector<const char*>> kKeys[] = {
      {"/arch/kv_heads", {"num_key_value_heads"}},
      {"/arch/heads", {"num_attention_heads", "n_head"}},
      {"/arch/hidden", {"hidden_size", "n_embd"}},
      {"/arch/layers", {"num_hidden_layers", "n_layer"}},
      {"/arch/vocab", {"vocab_size"}},
      {"/arch/head_dim", {"head_dim"}},
      {"/arch/ffn_hidden", {"intermediate_size", "n_inner"}},
      {"/arch/moe/experts", {"num_local_experts", "n_routed_experts", "num_experts"}},
      {"/arch/moe/top_k", {"num_experts_per_tok", "moe_topk"}},
  };
  const std::string prefix = file + " (imported): ";
  if (e.message.rfind(prefix, 0) != 0) return e;
  for (const auto& [generated, keys] : kKeys) {
    const std::string at = prefix + generated;
    if (e.message.rfind(at, 0) != 0 || (e.message.size() > at.size() && e.message[at.size()] != ':')) continue;
    for (const char* key : keys) {
      if (!config.contains(key)) continue;
      e.message = file + ": /" + key + " (the imported model's " + generated + ")" + e.message.substr(at.size());
      return e;
    }
  }
  return e;
}

}  // namespace

Expected<OrderedJson> ImportHuggingFace(const Json& config, const std::string& file, const ImportOptions& o) {
  return CatchErrors([&]() -> OrderedJson {
    const JsonLocation top{file, ""};
    if (!config.is_object()) ThrowAt(top, "expected a Hugging Face config.json object");
    if (!config.contains("model_type") || !config["model_type"].is_string()) {
      ThrowAt(top.Child("model_type"), "expected the architecture's name (a string)");
    }
    const std::string type = config["model_type"].get<std::string>();
    const auto family = Families().find(type);
    if (family == Families().end()) {
      std::string known;
      for (const auto& [name, f] : Families()) known += (known.empty() ? "" : "|") + name;
      ThrowAt(top.Child("model_type"), "\"" + type + "\" is not an architecture memplan can import (" + known + ")");
    }
    if (o.gpus <= 0) ThrowError(ErrorCode::kBadInput, "--gpus: expected the run's GPU count (> 0)");
    if (o.global_batch <= 0) ThrowError(ErrorCode::kBadInput, "--global-batch: expected sequences per step (> 0)");
    if (o.seq_len <= 0) ThrowError(ErrorCode::kBadInput, "--seq: expected the sequence length (> 0)");
    Json arch = ArchOf(config, file, family->second, type, o);

    const int64_t dp = Divide(o.gpus, o.tp * o.pp * o.cp, "--gpus (over tp * pp * cp = " +
                                                             std::to_string(o.tp * o.pp * o.cp) + ")");
    const int64_t microbatches =
        Divide(o.global_batch, dp * o.micro_batch,
               "--global-batch (over dp * micro batch = " + std::to_string(dp) + " * " + std::to_string(o.micro_batch) + ")");
    std::string name = o.name;
    if (name.empty()) {
      name = config.value("_name_or_path", std::string());
      if (name.empty()) name = std::filesystem::path(file).stem().string();
    }
    OrderedJson model = {
        {"schema", kModelSchema},
        {"name", name},
        {"description", "Imported by memplan import hf from " + std::filesystem::path(file).filename().string() +
                            " (model_type " + type + ") for " + std::to_string(o.gpus) + " GPUs, global batch " +
                            std::to_string(o.global_batch) + " x " + std::to_string(o.seq_len) + " tokens."},
        {"arch", OrderedJson::parse(arch.dump())},
        {"train",
         {{"seq_len", o.seq_len},
          {"micro_batch", o.micro_batch},
          {"microbatches", microbatches},
          {"act_dtype", "bf16"},
          {"param_dtype", "bf16"},
          {"grad_dtype", "fp32"},
          {"optimizer", o.optimizer}}},
        {"parallel",
         {{"tp", o.tp}, {"sp", o.sp}, {"pp", o.pp}, {"vp", o.vp}, {"dp", dp}, {"ep", o.ep}, {"cp", o.cp}, {"zero", o.zero}}},
        {"hardware", {{"preset", o.hardware}}}};
    // The document must be one the planner reads; its errors name the
    // imported model's pointer (the layout flags map onto /parallel).
    auto parsed = ParseModel(Json::parse(model.dump()), file + " (imported)");
    if (!parsed) throw ErrorException(ToConfigKeys(parsed.error(), config, file));
    return model;
  });
}

}  // namespace memplan::planner
