#include "memplan/planner/model.h"

#include "model_internal.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "memplan/common/schema.h"
#include "memplan/common/units.h"
#include "memplan/planner/target.h"

namespace memplan::planner {

bool Arch::IsMoeLayer(int64_t layer) const {
  return moe.has_value() && layer >= moe->first_dense_layers &&
         !std::binary_search(moe->dense_layers.begin(), moe->dense_layers.end(), layer);
}

bool Arch::IsLinearAttentionLayer(int64_t layer) const {
  if (!linear_attention) return false;
  return layer % linear_attention->full_attention_every != linear_attention->full_attention_offset;
}

std::string_view PolicyName(Policy p) {
  switch (p) {
    case Policy::kKeep: return "keep";
    case Policy::kRecompute: return "recompute";
    case Policy::kFp8: return "fp8";
    case Policy::kOffloadHost: return "offload_host";
    case Policy::kOffloadRemote: return "offload_remote";
  }
  return "?";
}

bool StorageKinds::Allows(Policy p) const {
  switch (p) {
    case Policy::kKeep: return true;
    case Policy::kRecompute: return recompute;
    case Policy::kFp8: return fp8;
    case Policy::kOffloadHost: return offload_host;
    case Policy::kOffloadRemote: return offload_remote;
  }
  return false;
}

namespace {

constexpr Policy kAllPolicies[] = {Policy::kKeep, Policy::kRecompute, Policy::kFp8, Policy::kOffloadHost,
                                   Policy::kOffloadRemote};

bool* KindFlag(StorageKinds& k, Policy p) {
  switch (p) {
    case Policy::kRecompute: return &k.recompute;
    case Policy::kFp8: return &k.fp8;
    case Policy::kOffloadHost: return &k.offload_host;
    case Policy::kOffloadRemote: return &k.offload_remote;
    case Policy::kKeep: break;
  }
  return nullptr;
}

// The policy a name spells (PolicyName's inverse): one list for --storage,
// the model's `storage` and its policy annotations.
std::optional<Policy> PolicyFromName(std::string_view name) {
  for (Policy p : kAllPolicies) {
    if (name == PolicyName(p)) return p;
  }
  return std::nullopt;
}

}  // namespace

Expected<StorageKinds> ParseStorageKinds(std::string_view list) {
  StorageKinds k{false, false, false, false};
  if (list.size() > 200) return Error{ErrorCode::kBadInput, "--storage: expected a short list of storage kinds"};
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string_view word = list.substr(start, comma - start);
    const std::optional<Policy> p = PolicyFromName(word);
    if (p) {
      if (bool* flag = KindFlag(k, *p)) *flag = true;
    } else {
      return Error{ErrorCode::kBadInput, "--storage: expected a comma-separated list of keep, recompute, fp8, "
                                         "offload_host, offload_remote, got \"" + std::string(word.substr(0, 40)) + "\""};
    }
    start = comma + 1;
  }
  return k;
}

std::vector<std::string> StorageKindNames(const StorageKinds& kinds) {
  std::vector<std::string> out;
  for (Policy p : kAllPolicies) {
    if (kinds.Allows(p)) out.emplace_back(PolicyName(p));
  }
  return out;
}

std::string StorageKindsText(const StorageKinds& kinds) {
  std::string out;
  for (const auto& name : StorageKindNames(kinds)) out += (out.empty() ? "" : ",") + name;
  return out;
}

std::vector<int64_t> DefaultPipelineLayout(int64_t layers, int64_t pp, int64_t vp) {
  int64_t per = (layers + pp - 1) / pp;
  std::vector<int64_t> out(static_cast<size_t>(pp), per);
  int64_t deficit = per * pp - layers;
  // The first and last ranks also hold the embedding and the head: they give
  // up layers first, alternately, down to vp; then the inner ranks do, round
  // robin. Validation guarantees layers >= pp * vp, so this terminates.
  std::vector<size_t> outer{0};
  if (pp > 1) outer.push_back(static_cast<size_t>(pp - 1));
  for (bool took = true; deficit > 0 && took;) {
    took = false;
    for (size_t r : outer) {
      if (deficit > 0 && out[r] > vp) {
        --out[r];
        --deficit;
        took = true;
      }
    }
  }
  for (bool took = true; deficit > 0 && took;) {
    took = false;
    for (size_t r = 1; r + 1 < out.size() && deficit > 0; ++r) {
      if (out[r] > vp) {
        --out[r];
        --deficit;
        took = true;
      }
    }
  }
  return out;
}

namespace {

DType ReadDType(ObjectReader& r, std::string_view key, std::initializer_list<std::string_view> choices,
                std::string_view fallback) {
  DType d = DType::kBF16;
  ParseDType(r.Enum(key, choices, fallback), &d);
  return d;
}

std::vector<Policy> ReadPolicy(const Json& value, const JsonLocation& where) {
  auto one = [&](const Json& v, const JsonLocation& w) {
    if (auto p = PolicyFromName(v.is_string() ? v.get<std::string>() : "")) return *p;
    ThrowAt(w, "expected one of keep|recompute|fp8|offload_host|offload_remote, got " + Brief(v));
  };
  std::vector<Policy> out;
  if (value.is_array()) {
    if (value.empty()) ThrowAt(where, "expected a non-empty list of policies");
    for (size_t i = 0; i < value.size(); ++i) out.push_back(one(value[i], where.Child(i)));
  } else {
    out.push_back(one(value, where));
  }
  // Legal compositions: keep | recompute | fp8 | [fp8,] offload_host|offload_remote.
  auto offload = [](Policy p) { return p == Policy::kOffloadHost || p == Policy::kOffloadRemote; };
  bool legal = (out.size() == 1) ||
               (out.size() == 2 && out[0] == Policy::kFp8 && offload(out[1]));
  if (!legal) {
    ThrowAt(where,
            "expected keep, recompute, fp8, offload_host, offload_remote or "
            "[fp8, offload_host|offload_remote], got " + Brief(value));
  }
  return out;
}

std::string ReadGlob(ObjectReader& r) {
  std::string s = r.String("match");
  if (s.empty()) ThrowAt(r.At("match"), "expected a non-empty glob over tensor names");
  return s;
}

void ParseArch(ObjectReader& r, Model& m) {
  Arch& a = m.arch;
  a.layers = r.Int("layers", 1, kMaxLayers);
  a.hidden = r.Int("hidden", 1, kMaxHidden);
  a.heads = r.Int("heads", 1, kMaxHeads);
  a.kv_heads = r.Int("kv_heads", 1, kMaxHeads, a.heads);
  if (a.kv_heads > a.heads || a.heads % a.kv_heads != 0) {
    ThrowAt(r.At("kv_heads"), "expected a divisor of heads (" + std::to_string(a.heads) + "), got " +
                                  std::to_string(a.kv_heads));
  }
  const std::optional<int64_t> head_dim = r.OptInt("head_dim", 1, kMaxHidden);
  a.ffn_hidden = r.Int("ffn_hidden", 1, kMaxHidden * 64, 0);
  a.ffn_act = r.Enum("ffn_act", {"gelu", "swiglu"}, "swiglu") == "gelu" ? FfnAct::kGelu : FfnAct::kSwiglu;
  a.norm = r.Enum("norm", {"layernorm", "rmsnorm"}, "rmsnorm") == "layernorm" ? Norm::kLayerNorm : Norm::kRmsNorm;
  a.attention = r.Enum("attention", {"standard", "flash"}, "flash") == "standard" ? Attention::kStandard
                                                                                   : Attention::kFlash;
  a.dropout = r.Bool("dropout", false);
  a.vocab = r.Int("vocab", 1, kMaxVocab);
  a.tied_embeddings = r.Bool("tied_embeddings", false);
  a.position_embeddings = r.Int("position_embeddings", 0, kMaxSeqLen, 0);
  a.mtp_layers = r.Int("mtp_layers", 0, 16, 0);
  if (r.Has("rope_base")) a.rope_base = r.Number("rope_base", 1, 1e12, 10000);
  if (r.Has("rope_scaling_factor")) a.rope_scaling_factor = r.Number("rope_scaling_factor", 1, 1e6, 1);
  a.qk_norm = r.Bool("qk_norm", false);
  a.linear_bias = r.Bool("linear_bias", false);
  a.qkv_bias = r.Bool("qkv_bias", false);
  if (r.Has("norm_eps")) a.norm_eps = r.Number("norm_eps", 1e-12, 1, 1e-5);

  if (const Json* v = r.Get("mla")) {
    ObjectReader o(*v, r.At("mla"));
    MlaConfig c;
    c.q_lora_rank = o.OptIntNullable("q_lora_rank", 0, kMaxHidden).value_or(0);  // null: no compression
    c.kv_lora_rank = o.Int("kv_lora_rank", 1, kMaxHidden);
    c.qk_nope_head_dim = o.Int("qk_nope_head_dim", 1, kMaxHidden);
    c.qk_rope_head_dim = o.Int("qk_rope_head_dim", 1, kMaxHidden);
    c.v_head_dim = o.Int("v_head_dim", 1, kMaxHidden);
    o.Finish();
    a.mla = c;
  }
  // The standard attention's head width: given, else hidden / heads. MLA
  // states its own head sizes, so with MLA hidden need not divide by heads
  // (head_dim, which no MLA template reads, is then qk_nope + qk_rope).
  if (head_dim) {
    a.head_dim = *head_dim;
  } else if (a.hidden % a.heads == 0) {
    a.head_dim = a.hidden / a.heads;
  } else if (a.mla) {
    a.head_dim = a.mla->qk_nope_head_dim + a.mla->qk_rope_head_dim;
  } else {
    ThrowAt(r.At("hidden"), "hidden (" + std::to_string(a.hidden) + ") is not divisible by heads (" +
                                std::to_string(a.heads) + "); give arch.head_dim explicitly");
  }
  if (const Json* v = r.Get("moe")) {
    ObjectReader o(*v, r.At("moe"));
    MoeConfig c;
    c.experts = o.Int("experts", 1, kMaxExperts);
    c.top_k = o.Int("top_k", 1, c.experts);
    c.expert_ffn_hidden = o.Int("expert_ffn_hidden", 1, kMaxHidden * 64);
    c.shared_experts = o.Int("shared_experts", 0, 1024, 0);
    c.shared_ffn_hidden = o.Int("shared_ffn_hidden", 1, kMaxHidden * 64, c.expert_ffn_hidden);
    c.first_dense_layers = o.Int("first_dense_layers", 0, a.layers, 0);
    if (const Json* d = o.Get("dense_layers")) {
      const JsonLocation at = o.At("dense_layers");
      if (!d->is_array() || d->size() > static_cast<size_t>(a.layers)) {
        ThrowAt(at, "expected an array of at most arch.layers (" + std::to_string(a.layers) + ") layer indices");
      }
      for (size_t i = 0; i < d->size(); ++i) {
        const Json& v = (*d)[i];
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= a.layers ||
            (!c.dense_layers.empty() && v.get<int64_t>() <= c.dense_layers.back())) {
          ThrowAt(at.Child(std::to_string(i)), "expected ascending layer indices in [0, " +
                                                   std::to_string(a.layers - 1) + "], got " + v.dump());
        }
        c.dense_layers.push_back(v.get<int64_t>());
      }
    }
    c.latent_dim = o.OptIntNullable("latent_dim", 1, kMaxHidden);
    if (o.Get("capacity_factor")) c.capacity_factor = o.Number("capacity_factor", 1e-3, 64, 1.0);
    c.imbalance = o.Number("imbalance", 1.0, 1 << 20, MoeConfig::kDefaultMoeImbalance);
    c.routed_scaling = o.Number("routed_scaling", 1e-3, 1e3, 1.0);
    c.selection_bias = o.Bool("selection_bias", false);
    c.bias_update_rate = o.Number("bias_update_rate", 0, 1, 1e-3);
    c.router = o.Enum("router", {"softmax", "sigmoid"}, "softmax") == "sigmoid" ? Router::kSigmoid
                                                                                : Router::kSoftmax;
    if (o.Has("load_balancing")) {
      c.load_balancing = o.Enum("load_balancing", {"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"});
    }
    if (o.Has("aux_loss_coeff")) c.aux_loss_coeff = o.Number("aux_loss_coeff", 0, 1e3, 0);
    o.Finish();
    a.moe = c;
  }
  if (const Json* v = r.Get("attn_res")) {
    ObjectReader o(*v, r.At("attn_res"));
    a.attn_res = AttnResConfig{o.Int("block_layers", 1, kMaxLayers), o.Enum("mix", {"sublayer", "layer"}, "sublayer") == "sublayer"};
    o.Finish();
  }
  if (const Json* v = r.Get("linear_attention")) {
    ObjectReader o(*v, r.At("linear_attention"));
    LinearAttentionConfig c;
    c.kind = o.Enum("kind", {"kda"});
    c.full_attention_every = o.Int("full_attention_every", 1, kMaxLayers);
    c.full_attention_offset = o.Int("full_attention_offset", 0, c.full_attention_every - 1, 0);
    c.head_dim = o.Int("head_dim", 1, kMaxHidden);
    c.chunk = o.Int("chunk", 1, 1 << 16, 64);
    c.conv_size = o.Int("conv_size", 0, 64, 4);
    o.Finish();
    a.linear_attention = c;
  }
  r.Finish();
  if (a.mtp_layers > 0 && (a.attn_res || a.position_embeddings > 0)) {
    ThrowAt(r.At("mtp_layers"), std::string("multi-token prediction with ") +
                                    (a.attn_res ? "Block AttnRes" : "learned positions") + " is not planned");
  }
  bool has_dense = !a.moe || a.moe->first_dense_layers > 0 || !a.moe->dense_layers.empty();
  if (has_dense && a.ffn_hidden == 0) {
    ThrowAt(r.where(), "missing required key \"ffn_hidden\" (the model has dense FFN layers)");
  }
}

void ParseTrain(ObjectReader& r, Model& m) {
  Train& t = m.train;
  t.seq_len = r.Int("seq_len", 1, kMaxSeqLen);
  t.micro_batch = r.Int("micro_batch", 1, kMaxMicroBatch);
  t.microbatches = r.Int("microbatches", 1, kMaxMicrobatches);
  t.act_dtype = ReadDType(r, "act_dtype", {"bf16", "fp16", "fp32"}, "bf16");
  t.param_dtype = ReadDType(r, "param_dtype", {"bf16", "fp16", "fp32"}, "bf16");
  t.grad_dtype = ReadDType(r, "grad_dtype", {"bf16", "fp16", "fp32"}, "fp32");
  t.optimizer = r.Enum("optimizer", {"adam", "muon"}, "adam") == "muon" ? Optimizer::kMuon : Optimizer::kAdam;
  r.Finish();
}

void ParseParallel(const Json* value, const JsonLocation& where, Model& m) {
  Parallel& p = m.parallel;
  Json empty = Json::object();
  ObjectReader r(value ? *value : empty, where);
  p.tp = r.Int("tp", 1, kMaxParallel, 1);
  p.sp = r.Bool("sp", false);
  p.pp = r.Int("pp", 1, kMaxParallel, 1);
  p.vp = r.Int("vp", 1, kMaxParallel, 1);
  p.dp = r.Int("dp", 1, kMaxParallel, 1);
  p.ep = r.Int("ep", 1, kMaxParallel, 1);
  p.cp = r.Int("cp", 1, kMaxParallel, 1);
  p.zero = static_cast<int>(r.Int("zero", 0, 3, 0));
  const bool has_reshard = r.Get("fsdp_reshard_after_forward") != nullptr, has_prefetch = r.Get("fsdp_prefetch") != nullptr;
  p.fsdp_reshard_after_forward = r.Bool("fsdp_reshard_after_forward", true);
  p.fsdp_prefetch = r.Int("fsdp_prefetch", 0, 8, 1);
  p.pipeline_zero2 = r.Bool("pipeline_zero2", false);
  p.grad_offload_host = r.Enum("grad_offload", {"none", "host"}, "none") == "host";
  p.muon_gather_p2p = r.Enum("muon_gather", {"allgather", "p2p"}, "p2p") == "p2p";
  const Json* layout = r.Get("pp_layout");
  r.Finish();

  const Arch& a = m.arch;
  const Train& t = m.train;
  auto at = [&](std::string_view key) { return where.Child(key); };
  if (p.pp * p.vp > a.layers) {
    ThrowAt(at(p.vp > 1 ? "vp" : "pp"), "pp*vp (" + std::to_string(p.pp * p.vp) +
                                            ") exceeds arch.layers (" + std::to_string(a.layers) + ")");
  }
  if (p.vp > 1 && p.pp == 1) ThrowAt(at("vp"), "vp > 1 needs pp > 1 (interleaving is across pipeline ranks)");
  if (t.microbatches < p.pp) {
    ThrowAt(JsonLocation{where.file, "/train/microbatches"},
            "expected at least pp (" + std::to_string(p.pp) + ") microbatches, got " +
                std::to_string(t.microbatches));
  }
  if (p.vp > 1 && t.microbatches % p.pp != 0) {
    ThrowAt(JsonLocation{where.file, "/train/microbatches"},
            "interleaved 1F1B (vp > 1) needs microbatches to be a multiple of pp (" +
                std::to_string(p.pp) + "), got " + std::to_string(t.microbatches));
  }
  if (a.heads % p.tp != 0) {
    ThrowAt(at("tp"), "arch.heads (" + std::to_string(a.heads) + ") is not divisible by tp (" +
                          std::to_string(p.tp) + ")");
  }
  if (a.kv_heads % p.tp != 0) {
    ThrowAt(at("tp"), "arch.kv_heads (" + std::to_string(a.kv_heads) + ") is not divisible by tp (" +
                          std::to_string(p.tp) + ")");
  }
  if (a.moe && a.moe->experts % p.ep != 0) {
    ThrowAt(at("ep"), "arch.moe.experts (" + std::to_string(a.moe->experts) + ") is not divisible by ep (" +
                          std::to_string(p.ep) + ")");
  }
  if ((p.tp * p.dp * p.cp) % p.ep != 0) {
    ThrowAt(at("ep"), "tp*dp*cp (" + std::to_string(p.tp * p.dp * p.cp) +
                          ") must be a multiple of ep: expert ranks are carved out of the tensor, data and context "
                          "parallel grid (Megatron's expert grid with expert tensor parallel size 1)");
  }
  if (t.seq_len % p.cp != 0) {
    ThrowAt(at("cp"), "train.seq_len (" + std::to_string(t.seq_len) + ") is not divisible by cp (" +
                          std::to_string(p.cp) + ")");
  }
  if (p.cp > 1 && t.seq_len % (2 * p.cp) != 0) {
    // Megatron's load-balanced context parallelism: the sequence in 2 cp
    // chunks, rank i holding chunks i and 2 cp - 1 - i (causal work even).
    ThrowAt(at("cp"), "context parallelism splits train.seq_len into 2*cp load-balanced chunks (rank i holds "
                      "chunks i and 2*cp-1-i): " + std::to_string(t.seq_len) + " is not divisible by 2*cp (" +
                          std::to_string(2 * p.cp) + ")");
  }
  if (p.sp && ((t.seq_len / p.cp) * t.micro_batch) % p.tp != 0) {
    ThrowAt(at("sp"), "sequence parallelism splits seq_len/cp*micro_batch tokens over tp; " +
                          std::to_string((t.seq_len / p.cp) * t.micro_batch) + " is not divisible by " +
                          std::to_string(p.tp));
  }
  if (p.grad_offload_host && !p.pipeline_zero2) {
    ThrowAt(at("grad_offload"), "grad_offload \"host\" needs pipeline_zero2: true");
  }
  if (p.zero == 3 && p.pipeline_zero2) {
    ThrowAt(at("pipeline_zero2"), "pipeline ZeRO-2 with zero 3: parameters are already sharded (choose one)");
  }
  if (p.zero != 3 && (has_reshard || has_prefetch)) {
    ThrowAt(at(has_reshard ? "fsdp_reshard_after_forward" : "fsdp_prefetch"), "applies to zero 3 only");
  }
  if (layout) {
    JsonLocation lw = at("pp_layout");
    ExpectArray(*layout, lw);
    if (static_cast<int64_t>(layout->size()) != p.pp) {
      ThrowAt(lw, "expected " + std::to_string(p.pp) + " entries (one per pipeline rank), got " +
                      std::to_string(layout->size()));
    }
    int64_t sum = 0;
    for (size_t i = 0; i < layout->size(); ++i) {
      int64_t n = ExpectInt((*layout)[i], lw.Child(i), p.vp, kMaxLayers);
      p.pp_layout.push_back(n);
      sum += n;
    }
    if (sum != a.layers) {
      ThrowAt(lw, "layers per rank sum to " + std::to_string(sum) + ", expected arch.layers (" +
                      std::to_string(a.layers) + ")");
    }
    p.pp_layout_given = true;
  } else {
    p.pp_layout = DefaultPipelineLayout(a.layers, p.pp, p.vp);
  }
}

void ParseHardware(ObjectReader& r, Model& m) {
  m.hardware = ParseHardwareObject(r);
}

void ParseOptions(const Json* value, const JsonLocation& where, Model& m) {
  // Each technique is on by default where the architecture has the feature
  // and the target has the mechanism: Megatron has neither memplan's
  // dispatch recompute nor its AttnRes mechanisms (docs/targets.md).
  const Arch& a = m.arch;
  const bool own = GetTarget(m.target.kind).HasRuntimeMechanisms();
  bool moe = a.moe.has_value();
  bool ar = a.attn_res.has_value();
  Json empty = Json::object();
  ObjectReader r(value ? *value : empty, where);
  Options& o = m.options;
  auto memplan_only = [&](std::string_view key, bool feature) {
    const bool on = r.Bool(key, feature && own) && feature;
    if (on && !own) {
      ThrowAt(r.At(key), "expected false under target " + std::string(TargetName(m.target.kind)) +
                             ": a memplan runtime mechanism the framework does not have");
    }
    return on;
  };
  // The gradient rewrite (FC2's output not saved) is what Megatron does
  // too: it weights the expert activation by the routing probabilities
  // (moe/experts.py weighted_bias_swiglu), so its combine saves no expert
  // output (docs/targets.md, "What Megatron saves").
  o.moe_grad_rewrite = r.Bool("moe_grad_rewrite", moe) && moe;
  o.moe_recompute_dispatch = memplan_only("moe_recompute_dispatch", moe);
  o.attn_res_single_copy = memplan_only("attn_res_single_copy", ar);
  o.attn_res_checkpoint = memplan_only("attn_res_checkpoint", ar);
  o.attn_res_pp_cache = memplan_only("attn_res_pp_cache", ar);
  o.pp_balance = r.Bool("pp_balance", m.parallel.pp > 1) && m.parallel.pp > 1;
  r.Finish();
}

void ParseGraph(const Json& value, const JsonLocation& where, Model& m) {
  ObjectReader r(value, where);
  const Json& layers = ExpectArray(r.Required("layers"), r.At("layers"));
  r.Finish();
  std::set<int64_t> seen;
  for (size_t i = 0; i < layers.size(); ++i) {
    JsonLocation lw = where.Child("layers").Child(i);
    LayerGraph g = LayerGraph::FromJson(layers[i], lw);
    if (g.index >= m.arch.layers) {
      ThrowAt(lw.Child("index"), "expected a layer index below arch.layers (" + std::to_string(m.arch.layers) +
                                     "), got " + std::to_string(g.index));
    }
    if (!seen.insert(g.index).second) {
      ThrowAt(lw.Child("index"), "layer " + std::to_string(g.index) + " is given twice");
    }
    m.graph.push_back(std::move(g));
  }
  std::sort(m.graph.begin(), m.graph.end(),
            [](const LayerGraph& x, const LayerGraph& y) { return x.index < y.index; });
}

Model ParseModelOrThrow(const Json& doc, const std::string& file) {
  JsonLocation root{file, ""};
  ObjectReader r(doc, root);
  Model m;
  m.file = file;
  {
    const Json& schema = r.Required("schema");
    if (!schema.is_string() || schema.get<std::string>() != kModelSchema) {
      ThrowAt(r.At("schema"), "expected \"" + std::string(kModelSchema) + "\" (unknown schema version), got " +
                                  Brief(schema));
    }
  }
  m.name = r.String("name");
  if (const Json* d = r.Get("description")) m.description = ExpectString(*d, r.At("description"));
  {
    ObjectReader a(r.Required("arch"), r.At("arch"));
    ParseArch(a, m);
  }
  {
    ObjectReader t(r.Required("train"), r.At("train"));
    ParseTrain(t, m);
    // The planner's work grows with layers x microbatches (a periodic
    // window's placement streams every microbatch's buffers; without a
    // window every saved tensor of every microbatch is an instance with its
    // own interval, limited further in BuildProblem): the stated limit is
    // one it meets within seconds and a bounded memory (docs/design.md,
    // "Input limits and hostile input").
    if (m.arch.layers * m.train.microbatches > kMaxLayerMicrobatches) {
      ThrowAt(t.At("microbatches"), std::to_string(m.train.microbatches) + " microbatches of " +
                                        std::to_string(m.arch.layers) + " layers is " +
                                        std::to_string(m.arch.layers * m.train.microbatches) +
                                        " layer-microbatches; the planner's limit is " +
                                        std::to_string(kMaxLayerMicrobatches));
    }
  }
  // Parallel checks read arch and train, so it comes after both.
  ParseParallel(r.Get("parallel"), r.At("parallel"), m);
  {
    ObjectReader h(r.Required("hardware"), r.At("hardware"));
    ParseHardware(h, m);
  }
  if (auto b = r.OptBytes("budget")) {
    m.budget = *b;
    m.budget_given = true;
  } else {
    m.budget = m.hardware.device_memory - DefaultReserveBytes(m.hardware);
  }
  if (const Json* costs = r.Get("costs")) {
    ExpectArray(*costs, r.At("costs"));
    for (size_t i = 0; i < costs->size(); ++i) {
      ObjectReader c((*costs)[i], r.At("costs").Child(i));
      CostOverride o;
      o.match = ReadGlob(c);
      auto seconds = [&](std::string_view key) -> std::optional<double> {
        if (!c.Has(key)) {
          c.Get(key);
          return std::nullopt;
        }
        return c.Number(key, 0, 1e6, 0);
      };
      o.recompute_s = seconds("recompute_s");
      o.fp8_s = seconds("fp8_s");
      o.offload_s = seconds("offload_s");
      c.Finish();
      if (!o.recompute_s && !o.fp8_s && !o.offload_s) {
        ThrowAt(c.where(), "expected at least one of recompute_s, fp8_s, offload_s");
      }
      m.costs.push_back(std::move(o));
    }
  }
  if (const Json* policies = r.Get("policies")) {
    ExpectArray(*policies, r.At("policies"));
    for (size_t i = 0; i < policies->size(); ++i) {
      ObjectReader p((*policies)[i], r.At("policies").Child(i));
      PolicyAnnotation a;
      a.match = ReadGlob(p);
      a.policy = ReadPolicy(p.Required("policy"), p.At("policy"));
      p.Finish();
      m.policies.push_back(std::move(a));
    }
  }
  if (const Json* kinds = r.Get("storage")) {
    // Storage kinds allowed (--storage): names of policies, keep implied.
    ExpectArray(*kinds, r.At("storage"));
    if (kinds->size() > 8) ThrowAt(r.At("storage"), "expected at most the five storage kinds");
    m.storage = StorageKinds{false, false, false, false};
    for (size_t i = 0; i < kinds->size(); ++i) {
      for (Policy p : ReadPolicy((*kinds)[i], r.At("storage").Child(i))) {
        if (bool* flag = KindFlag(m.storage, p)) *flag = true;
      }
    }
  }
  ParseTarget(r.Get("target"), r.At("target"), m);
  if (auto h = r.OptBytes("headroom")) {
    m.headroom = *h;
    m.headroom_given = true;
  }
  ParseOptions(r.Get("options"), r.At("options"), m);
  if (const Json* g = r.Get("graph")) ParseGraph(*g, r.At("graph"), m);
  r.Finish();
  return m;
}

}  // namespace

Expected<Model> ParseModel(const Json& doc, const std::string& file) {
  return CatchErrors([&] { return ParseModelOrThrow(doc, file); });
}

Expected<Model> LoadModel(const std::string& path) {
  auto doc = ReadJsonFile(path);
  if (!doc) return doc.error();
  return ParseModel(*doc, path);
}

Json NormalizedModelJson(const Model& m) {
  const Arch& a = m.arch;
  Json arch{{"layers", a.layers},
            {"hidden", a.hidden},
            {"heads", a.heads},
            {"kv_heads", a.kv_heads},
            {"head_dim", a.head_dim},
            {"ffn_act", a.ffn_act == FfnAct::kGelu ? "gelu" : "swiglu"},
            {"norm", a.norm == Norm::kLayerNorm ? "layernorm" : "rmsnorm"},
            {"attention", a.attention == Attention::kStandard ? "standard" : "flash"},
            {"dropout", a.dropout},
            {"vocab", a.vocab},
            {"tied_embeddings", a.tied_embeddings}};
  if (a.ffn_hidden) arch["ffn_hidden"] = a.ffn_hidden;
  if (a.position_embeddings) arch["position_embeddings"] = a.position_embeddings;  // absent: digests unchanged
  if (a.mtp_layers) arch["mtp_layers"] = a.mtp_layers;
  // Each written only when set: models without them keep their digests.
  if (a.rope_base) arch["rope_base"] = *a.rope_base;
  if (a.rope_scaling_factor) arch["rope_scaling_factor"] = *a.rope_scaling_factor;
  if (a.qk_norm) arch["qk_norm"] = true;
  if (a.linear_bias) arch["linear_bias"] = true;
  if (a.qkv_bias) arch["qkv_bias"] = true;
  if (a.norm_eps) arch["norm_eps"] = *a.norm_eps;
  if (a.mla) {
    arch["mla"] = {{"q_lora_rank", a.mla->q_lora_rank},
                   {"kv_lora_rank", a.mla->kv_lora_rank},
                   {"qk_nope_head_dim", a.mla->qk_nope_head_dim},
                   {"qk_rope_head_dim", a.mla->qk_rope_head_dim},
                   {"v_head_dim", a.mla->v_head_dim}};
  }
  if (a.moe) {
    const MoeConfig& c = *a.moe;
    arch["moe"] = {{"experts", c.experts},
                   {"top_k", c.top_k},
                   {"expert_ffn_hidden", c.expert_ffn_hidden},
                   {"shared_experts", c.shared_experts},
                   {"shared_ffn_hidden", c.shared_ffn_hidden},
                   {"first_dense_layers", c.first_dense_layers},
                   {"latent_dim", c.latent_dim ? Json(*c.latent_dim) : Json(nullptr)},
                   {"imbalance", c.imbalance},
                   {"router", c.router == Router::kSigmoid ? "sigmoid" : "softmax"}};
    if (!c.dense_layers.empty()) arch["moe"]["dense_layers"] = c.dense_layers;  // absent: digests unchanged
    if (c.capacity_factor) arch["moe"]["capacity_factor"] = *c.capacity_factor;  // absent: dropless
    if (c.routed_scaling != 1.0) arch["moe"]["routed_scaling"] = c.routed_scaling;  // absent: digests unchanged
    if (c.selection_bias) arch["moe"]["selection_bias"] = true;
    if (c.bias_update_rate != 1e-3) arch["moe"]["bias_update_rate"] = c.bias_update_rate;  // absent: digests unchanged
    if (c.load_balancing) arch["moe"]["load_balancing"] = *c.load_balancing;
    if (c.aux_loss_coeff) arch["moe"]["aux_loss_coeff"] = *c.aux_loss_coeff;
  }
  if (a.attn_res) {
    arch["attn_res"] = {{"block_layers", a.attn_res->block_layers},
                        {"mix", a.attn_res->per_sublayer ? "sublayer" : "layer"}};
  }
  if (a.linear_attention) {
    const auto& l = *a.linear_attention;
    arch["linear_attention"] = {{"kind", l.kind},
                                {"full_attention_every", l.full_attention_every},
                                {"full_attention_offset", l.full_attention_offset},
                                {"head_dim", l.head_dim},
                                {"chunk", l.chunk},
                                {"conv_size", l.conv_size}};
  }
  const Train& t = m.train;
  const Parallel& p = m.parallel;
  Json j{{"schema", kModelSchema},
         {"name", m.name},
         {"arch", arch},
         {"train",
          {{"seq_len", t.seq_len},
           {"micro_batch", t.micro_batch},
           {"microbatches", t.microbatches},
           {"act_dtype", DTypeName(t.act_dtype)},
           {"param_dtype", DTypeName(t.param_dtype)},
           {"grad_dtype", DTypeName(t.grad_dtype)},
           {"optimizer", t.optimizer == Optimizer::kMuon ? "muon" : "adam"}}},
         {"parallel",
          {{"tp", p.tp},
           {"sp", p.sp},
           {"pp", p.pp},
           {"vp", p.vp},
           {"dp", p.dp},
           {"ep", p.ep},
           {"cp", p.cp},
           {"zero", p.zero},
           {"pipeline_zero2", p.pipeline_zero2},
           {"grad_offload", p.grad_offload_host ? "host" : "none"},
           {"muon_gather", p.muon_gather_p2p ? "p2p" : "allgather"},
           {"pp_layout", p.pp_layout}}},
         {"hardware", HardwareJson(m.hardware)},
         {"budget", m.budget},
         {"options",
          {{"moe_grad_rewrite", m.options.moe_grad_rewrite},
           {"moe_recompute_dispatch", m.options.moe_recompute_dispatch},
           {"attn_res_single_copy", m.options.attn_res_single_copy},
           {"attn_res_checkpoint", m.options.attn_res_checkpoint},
           {"attn_res_pp_cache", m.options.attn_res_pp_cache},
           {"pp_balance", m.options.pp_balance}}}};
  if (!m.description.empty()) j["description"] = m.description;
  if (m.parallel.zero == 3) {  // absent otherwise: digests unchanged
    j["parallel"]["fsdp_reshard_after_forward"] = m.parallel.fsdp_reshard_after_forward;
    j["parallel"]["fsdp_prefetch"] = m.parallel.fsdp_prefetch;
  }
  // Written for other targets only: memplan's plans keep their digests.
  if (m.target.kind != TargetKind::kMemplan) j["target"] = TargetJson(m.target);
  if (m.headroom_given) j["headroom"] = m.headroom;
  Json costs = Json::array();
  for (const auto& c : m.costs) {
    Json cj{{"match", c.match}};
    if (c.recompute_s) cj["recompute_s"] = *c.recompute_s;
    if (c.fp8_s) cj["fp8_s"] = *c.fp8_s;
    if (c.offload_s) cj["offload_s"] = *c.offload_s;
    costs.push_back(cj);
  }
  j["costs"] = costs;
  Json policies = Json::array();
  for (const auto& a : m.policies) {
    Json names = Json::array();
    for (Policy p : a.policy) names.push_back(PolicyName(p));
    policies.push_back({{"match", a.match}, {"policy", names}});
  }
  j["policies"] = policies;
  if (!m.storage.All()) j["storage"] = StorageKindNames(m.storage);  // absent: every kind (digests unchanged)
  if (!m.graph.empty()) {
    Json layers = Json::array();
    for (const auto& g : m.graph) layers.push_back(Json::parse(g.ToJson().dump()));
    j["graph"] = {{"layers", layers}};
  }
  return j;
}

std::string ModelDigest(const Model& model) {
  return "sha256:" + Sha256Hex(NormalizedModelJson(model).dump());
}

}  // namespace memplan::planner
