// `memplan import megatron` (import.h, docs/import.md): a Megatron-LM
// argument list (pretrain_gpt.py's) to a memplan.model/1 document, with
// Megatron's defaults where an argument is absent (megatron/training/
// arguments.py) and its vocabulary padding.
#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "memplan/planner/framework.h"
#include "memplan/planner/megatron_args.h"
#include "memplan/planner/import.h"
#include "memplan/planner/model.h"

namespace memplan::planner {
namespace {

// Arguments that change no byte the planner counts: data, checkpoints,
// logging, learning-rate schedule and optimizer hyperparameters, kernel
// choices with the same saved tensors, initialisation. Each with its
// argparse arity in Megatron (megatron/training/arguments.py): flags
// (store_true/store_false) take no value, lists one or more.
const std::set<std::string, std::less<>>& IgnoredFlags() {
  static const std::set<std::string, std::less<>> s = {
      "--use-mcore-models", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
      "--no-bias-dropout-fusion", "--no-rope-fusion",
      "--overlap-grad-reduce", "--overlap-param-gather", "--moe-grouped-gemm", "--moe-permute-fusion",
      "--use-checkpoint-args", "--no-load-optim", "--no-load-rng", "--finetune", "--log-throughput",
      "--log-timers-to-tensorboard", "--manual-gc", "--use-distributed-optimizer-overlap",
      "--no-gradient-accumulation-fusion", "--cross-entropy-loss-fusion", "--tp-comm-overlap",
      "--no-create-attention-mask-in-dataloader", "--mock-data", "--eod-mask-loss", "--apply-layernorm-1p",
      "--use-flash-attn"};
  return s;
}

const std::set<std::string, std::less<>>& IgnoredValued() {
  static const std::set<std::string, std::less<>> s = {
      "--train-iters", "--train-samples", "--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters",
      "--lr-warmup-iters", "--lr-warmup-fraction", "--lr-decay-samples", "--lr-warmup-samples", "--weight-decay",
      "--clip-grad", "--adam-beta1", "--adam-beta2", "--adam-eps", "--init-method-std", "--seed", "--split",
      "--save", "--load", "--save-interval", "--eval-interval", "--eval-iters", "--log-interval",
      "--tensorboard-dir", "--wandb-project", "--wandb-exp-name", "--tokenizer-type", "--tokenizer-model",
      "--vocab-file", "--merge-file", "--distributed-backend", "--transformer-impl",
      "--rotary-percent", "--rotary-scaling-factor", "--moe-z-loss-coeff", "--moe-router-num-groups", "--moe-router-group-topk",
      "--moe-router-dtype", "--mscale", "--mscale-all-dim", "--exit-duration-in-mins", "--mtp-loss-scaling-factor",
      "--manual-gc-interval", "--ckpt-format", "--dist-ckpt-strictness", "--num-workers", "--dataloader-type",
      "--ddp-bucket-size"};
  return s;
}

// nargs '+' (or '*' for the data paths): every token up to the next flag.
const std::set<std::string, std::less<>>& IgnoredLists() {
  static const std::set<std::string, std::less<>> s = {"--data-path", "--train-data-path", "--valid-data-path",
                                                       "--test-data-path", "--cp-comm-type"};
  return s;
}

// Flags (no value) the importer reads.
const std::set<std::string, std::less<>>& Flags() {
  static const std::set<std::string, std::less<>> s = {
      "--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights", "--sequence-parallel",
      "--use-distributed-optimizer", "--bf16", "--fp16", "--multi-latent-attention",
      "--accumulate-allreduce-grads-in-fp32", "--fine-grained-activation-offloading", "--moe-router-enable-expert-bias",
      "--disable-bias-linear", "--add-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--use-rope-scaling"};
  return s;
}

// Arguments with one value the importer reads.
const std::set<std::string, std::less<>>& Valued() {
  static const std::set<std::string, std::less<>> s = {
      "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
      "--kv-channels", "--seq-length", "--max-position-embeddings", "--position-embedding-type",
      "--normalization", "--attention-dropout", "--hidden-dropout", "--attention-backend", "--vocab-size",
      "--make-vocab-size-divisible-by", "--micro-batch-size", "--global-batch-size", "--tensor-model-parallel-size",
      "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
      "--num-virtual-stages-per-pipeline-rank", "--context-parallel-size", "--expert-model-parallel-size",
      "--expert-tensor-parallel-size", "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
      "--optimizer", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
      "--moe-shared-expert-intermediate-size", "--moe-layer-freq", "--moe-router-score-function",
      "--moe-expert-capacity-factor", "--moe-token-dispatcher-type", "--q-lora-rank", "--kv-lora-rank",
      "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--recompute-granularity", "--recompute-method",
      "--recompute-num-layers", "--mtp-num-layers", "--recompute-modules", "--offload-modules",
      "--moe-router-topk-scaling-factor", "--moe-router-bias-update-rate", "--pipeline-model-parallel-layout",
      "--rotary-base", "--rope-scaling-factor", "--norm-epsilon", "--layernorm-epsilon",
      "--moe-router-load-balancing-type", "--moe-aux-loss-coeff"};
  return s;
}

// Valued arguments that take one or more values (nargs '+').
const std::set<std::string, std::less<>>& Lists() {
  static const std::set<std::string, std::less<>> s = {"--recompute-modules", "--offload-modules",
                                                       "--moe-router-load-balancing-type", "--moe-aux-loss-coeff"};
  return s;
}

// Arguments Megatron has that change memory and that this importer does
// not translate yet: refused by name (docs/import.md).
const std::set<std::string, std::less<>>& NotYet() {
  static const std::set<std::string, std::less<>> s = {
      "--cpu-offloading",
      "--cpu-offloading-num-layers", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
      "--fp8-format", "--fp8", "--account-for-embedding-in-pipeline-split",
      "--account-for-loss-in-pipeline-split"};
  return s;
}

std::vector<std::string> Tokens(const std::string& text) {
  std::string joined;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.pop_back();
    if (!line.empty() && line.back() == '\\') line.pop_back();
    joined += line + " ";
  }
  std::vector<std::string> out;
  std::istringstream words(joined);
  std::string w;
  while (words >> w) {
    if (w.size() >= 2 && (w.front() == '"' || w.front() == '\'') && w.back() == w.front()) w = w.substr(1, w.size() - 2);
    out.push_back(w);
  }
  return out;
}

class Args {
 public:
  Args(const std::string& text, std::string file) : file_(std::move(file)) {
    const std::vector<std::string> t = Tokens(text);
    // A launch line: the arguments follow the script (torchrun's own
    // arguments come before it).
    size_t start = 0;
    for (size_t i = 0; i < t.size(); ++i) {
      if (t[i].size() > 3 && t[i].compare(t[i].size() - 3, 3, ".py") == 0) start = i + 1;
    }
    // As Megatron's argparse parser (allow_abbrev=False, parse_args):
    // a flag takes no value, a list one or more, any other argument
    // exactly one; a token no argument takes is an error; the last of a
    // repeated argument wins.
    for (size_t i = start; i < t.size(); ++i) {
      std::string name = t[i], value;
      if (name.rfind("--", 0) != 0) {
        ThrowError(ErrorCode::kBadInput, file_ + ": unrecognized arguments: " + name.substr(0, 60) +
                                             " (not a value of the argument before it; Megatron's parser exits here)");
      }
      bool inline_value = false;
      if (const size_t eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name.resize(eq);
        inline_value = true;
      }
      if (NotYet().count(name)) {
        Fail(name, "changes memory and is not imported yet; plan without it and add the policy by hand "
                   "(docs/import.md)");
      }
      if (Flags().count(name) || IgnoredFlags().count(name)) {
        if (inline_value) Fail(name, "ignored explicit argument '" + value.substr(0, 40) + "' (a flag takes no value)");
        if (Flags().count(name)) flags_.insert(name);
        continue;
      }
      const bool valued = Valued().count(name) > 0;
      const bool list = Lists().count(name) > 0 || IgnoredLists().count(name) > 0;
      if (!valued && !IgnoredValued().count(name) && !IgnoredLists().count(name)) {
        Fail(name, "not understood: an argument that may change memory is never dropped silently "
                   "(docs/import.md lists the arguments read and those known to change nothing)");
      }
      if (!inline_value) {
        // One value, or with a list every token up to the next argument.
        while (i + 1 < t.size() && t[i + 1].rfind("--", 0) != 0) {
          value += (value.empty() ? "" : " ") + t[++i];
          if (!list) break;
        }
      }
      if (value.empty() && name != "--data-path") Fail(name, "expected " + std::string(list ? "at least one value" : "one value"));
      if (valued) values_[name] = value;
    }
  }

  [[noreturn]] void Fail(const std::string& name, const std::string& why) const {
    ThrowError(ErrorCode::kBadInput, file_ + ": " + name + ": " + why);
  }
  bool Flag(const std::string& name) const { return flags_.count(name) > 0; }
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string String(const std::string& name, const std::string& fallback) const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  int64_t Int(const std::string& name, int64_t min, int64_t max, std::optional<int64_t> fallback = std::nullopt) const {
    auto it = values_.find(name);
    if (it == values_.end()) {
      if (!fallback) Fail(name, "missing: Megatron requires it and memplan has no default for it");
      return *fallback;
    }
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(it->second, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != it->second.size() || v < min || v > max) {
      Fail(name, "expected an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                     it->second.substr(0, 40));
    }
    return v;
  }
  double Number(const std::string& name, double min, double max, double fallback) const {
    auto it = values_.find(name);
    if (it == values_.end()) return fallback;
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(it->second, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != it->second.size() || !(v >= min && v <= max)) {
      Fail(name, "expected a number in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                     it->second.substr(0, 40));
    }
    return v;
  }
  std::string Choice(const std::string& name, std::initializer_list<const char*> choices, const std::string& fallback) const {
    const std::string v = String(name, fallback);
    std::string all;
    for (const char* c : choices) {
      if (v == c) return v;
      all += (all.empty() ? "" : "|") + std::string(c);
    }
    Fail(name, "expected one of " + all + ", got " + v.substr(0, 40));
  }
  const std::string& file() const { return file_; }

 private:
  std::string file_;
  std::set<std::string> flags_;
  std::map<std::string, std::string> values_;
};

// --moe-layer-freq: an integer N (every N-th layer from layer 0 is MoE) or
// Megatron's pattern "([0]*3+[1]*58)" / "[0,1,1,...]" (1: MoE).
std::vector<bool> MoePattern(const Args& args, int64_t layers) {
  const std::string v = args.String("--moe-layer-freq", "1");
  std::vector<bool> moe;
  if (v.find('[') == std::string::npos) {
    const int64_t n = args.Int("--moe-layer-freq", 1, layers);
    for (int64_t l = 0; l < layers; ++l) moe.push_back(l % n == 0);
    return moe;
  }
  std::string s;
  for (char c : v) {
    if (c != ' ' && c != '(' && c != ')') s += c;
  }
  // Terms joined by '+': "[a,b,...]" or "[a]*n".
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != '[') args.Fail("--moe-layer-freq", "expected a pattern like ([0]*3+[1]*58), got " + v.substr(0, 40));
    const size_t close = s.find(']', i);
    if (close == std::string::npos) args.Fail("--moe-layer-freq", "unclosed '[' in " + v.substr(0, 40));
    std::vector<bool> items;
    std::istringstream list(s.substr(i + 1, close - i - 1));
    std::string item;
    while (std::getline(list, item, ',')) {
      if (item != "0" && item != "1") args.Fail("--moe-layer-freq", "expected 0 or 1 per layer, got " + item.substr(0, 20));
      items.push_back(item == "1");
    }
    i = close + 1;
    int64_t times = 1;
    if (i < s.size() && s[i] == '*') {
      size_t end = i + 1;
      while (end < s.size() && std::isdigit(static_cast<unsigned char>(s[end]))) ++end;
      if (end == i + 1 || end - i > 7) args.Fail("--moe-layer-freq", "expected a repeat count after '*'");
      times = std::stoll(s.substr(i + 1, end - i - 1));
      i = end;
    }
    for (int64_t k = 0; k < times && static_cast<int64_t>(moe.size()) <= layers; ++k) moe.insert(moe.end(), items.begin(), items.end());
    if (i < s.size()) {
      if (s[i] != '+') args.Fail("--moe-layer-freq", "expected '+' between terms in " + v.substr(0, 40));
      ++i;
    }
  }
  if (static_cast<int64_t>(moe.size()) != layers) {
    args.Fail("--moe-layer-freq", "the pattern has " + std::to_string(moe.size()) + " layers, --num-layers is " +
                                      std::to_string(layers));
  }
  return moe;
}

OrderedJson Build(const Args& args, const ImportOptions& o) {
  constexpr int64_t kBig = int64_t{1} << 40;
  const int64_t layers = args.Int("--num-layers", 1, kMaxLayers);
  const int64_t h = args.Int("--hidden-size", 1, kMaxHidden);
  const int64_t heads = args.Int("--num-attention-heads", 1, kMaxHeads);
  const bool swiglu = args.Flag("--swiglu");
  // arguments.py: 4h, or with SwiGLU 2/3 of it rounded down to a multiple of 64.
  const int64_t ffn = args.Int("--ffn-hidden-size", 1, kBig, swiglu ? (4 * h * 2 / 3) / 64 * 64 : 4 * h);
  const int64_t tp = args.Int("--tensor-model-parallel-size", 1, kMaxParallel, 1);
  const int64_t pp = args.Int("--pipeline-model-parallel-size", 1, kMaxParallel, 1);
  const int64_t cp = args.Int("--context-parallel-size", 1, kMaxParallel, 1);
  const int64_t ep = args.Int("--expert-model-parallel-size", 1, kMaxParallel, 1);
  // Megatron's expert tensor parallel size defaults to tp; memplan plans
  // experts whole on each expert rank (1): docs/accounting.md, section 4.
  if (args.Has("--num-experts") && args.Int("--expert-tensor-parallel-size", 1, kMaxParallel, tp) != 1) {
    args.Fail("--expert-tensor-parallel-size", args.Has("--expert-tensor-parallel-size")
                                                   ? "only 1 is planned yet (experts whole on each expert rank)"
                                                   : "absent, so Megatron splits experts over tp (" + std::to_string(tp) +
                                                         "); memplan plans them whole: add --expert-tensor-parallel-size 1");
  }
  const int64_t seq = args.Int("--seq-length", 1, kMaxSeqLen);

  OrderedJson a;
  a["layers"] = layers;
  a["hidden"] = h;
  a["heads"] = heads;
  if (args.Flag("--group-query-attention")) a["kv_heads"] = args.Int("--num-query-groups", 1, heads, 1);
  if (args.Has("--kv-channels")) a["head_dim"] = args.Int("--kv-channels", 1, kMaxHidden);
  a["ffn_act"] = swiglu ? "swiglu" : "gelu";
  a["norm"] = args.Choice("--normalization", {"LayerNorm", "RMSNorm"}, "LayerNorm") == "RMSNorm" ? "rmsnorm" : "layernorm";
  // Megatron's attention: TE's fused or flash kernels unless asked for the
  // unfused one, which saves the score matrix (Korthikanti's "standard").
  const std::string backend = args.Choice("--attention-backend", {"auto", "flash", "fused", "unfused", "local"}, "auto");
  a["attention"] = backend == "unfused" || backend == "local" ? "standard" : "flash";
  // arguments.py: both dropouts default to 0.1.
  a["dropout"] = std::max(args.Number("--attention-dropout", 0, 1, 0.1), args.Number("--hidden-dropout", 0, 1, 0.1)) > 0;
  // Megatron pads the vocabulary (megatron_args.h).
  const int64_t vocab = args.Int("--vocab-size", 1, kMaxVocab);
  a["vocab"] = MegatronPaddedVocab(vocab, args.Int("--make-vocab-size-divisible-by", 1, 1 << 20, 128), tp);
  a["tied_embeddings"] = !args.Flag("--untie-embeddings-and-output-weights");
  const std::string positions =
      args.Choice("--position-embedding-type", {"learned_absolute", "rope", "yarn", "none"}, "learned_absolute");
  if (positions == "learned_absolute") {
    const int64_t n = args.Int("--max-position-embeddings", 1, kMaxSeqLen);
    if (n < seq) args.Fail("--max-position-embeddings", "is below --seq-length (" + std::to_string(seq) + ")");
    a["position_embeddings"] = n;
  }
  // What Megatron needs to build the same model (no byte the planner
  // counts depends on it; model.h): rotary base and Llama 3 scaling, biases
  // (Megatron's default: on every linear), q/k norms, epsilon.
  if (positions != "learned_absolute") {
    if (args.Has("--rotary-base")) a["rope_base"] = args.Int("--rotary-base", 1, int64_t{1} << 40);
    if (args.Flag("--use-rope-scaling")) a["rope_scaling_factor"] = args.Number("--rope-scaling-factor", 1, 1e6, 8.0);
  }
  if (!args.Flag("--disable-bias-linear") || args.Flag("--add-bias-linear")) a["linear_bias"] = true;
  if (args.Flag("--add-qkv-bias")) a["qkv_bias"] = true;
  if (args.Flag("--qk-layernorm")) a["qk_norm"] = true;
  for (const char* eps : {"--layernorm-epsilon", "--norm-epsilon"}) {
    if (args.Has(eps)) a["norm_eps"] = args.Number(eps, 1e-12, 1, 1e-5);
  }
  if (args.Flag("--multi-latent-attention")) {
    a["mla"] = {{"q_lora_rank", args.Int("--q-lora-rank", 0, kMaxHidden, 0)},
                {"kv_lora_rank", args.Int("--kv-lora-rank", 1, kMaxHidden, 512)},
                {"qk_nope_head_dim", args.Int("--qk-head-dim", 1, kMaxHidden, 128)},
                {"qk_rope_head_dim", args.Int("--qk-pos-emb-head-dim", 1, kMaxHidden, 64)},
                {"v_head_dim", args.Int("--v-head-dim", 1, kMaxHidden, 128)}};
  }
  bool has_dense = true;
  if (args.Has("--num-experts")) {
    const std::vector<bool> sparse = MoePattern(args, layers);
    OrderedJson moe;
    moe["experts"] = args.Int("--num-experts", 1, kMaxExperts);
    moe["top_k"] = args.Int("--moe-router-topk", 1, kMaxExperts, 2);
    moe["expert_ffn_hidden"] = args.Int("--moe-ffn-hidden-size", 1, kBig, ffn);
    if (args.Has("--moe-shared-expert-intermediate-size")) {
      moe["shared_experts"] = 1;  // Megatron's shared experts are one MLP of this size
      moe["shared_ffn_hidden"] = args.Int("--moe-shared-expert-intermediate-size", 1, kBig);
    }
    int64_t first = 0;
    while (first < layers && !sparse[static_cast<size_t>(first)]) ++first;
    std::vector<int64_t> dense;
    for (int64_t l = first; l < layers; ++l) {
      if (!sparse[static_cast<size_t>(l)]) dense.push_back(l);
    }
    if (first == layers) args.Fail("--moe-layer-freq", "no layer is MoE");
    if (first > 0) moe["first_dense_layers"] = first;
    if (!dense.empty()) moe["dense_layers"] = dense;
    has_dense = first > 0 || !dense.empty();
    // Unset is Megatron's dropless default; the skew is memplan's default.
    if (args.Has("--moe-expert-capacity-factor")) {
      moe["capacity_factor"] = args.Number("--moe-expert-capacity-factor", 1e-3, 64, 1);
    }
    moe["router"] = args.Choice("--moe-router-score-function", {"softmax", "sigmoid"}, "softmax");
    if (args.Has("--moe-router-topk-scaling-factor")) {
      moe["routed_scaling"] = args.Number("--moe-router-topk-scaling-factor", 1e-3, 1e3, 1);
    }
    if (args.Flag("--moe-router-enable-expert-bias")) moe["selection_bias"] = true;
    if (args.Has("--moe-router-bias-update-rate")) {
      moe["bias_update_rate"] = args.Number("--moe-router-bias-update-rate", 0, 1, 1e-3);
    }
    args.Choice("--moe-token-dispatcher-type", {"alltoall", "flex"}, "alltoall");
    // Lists in Megatron (one value per layer group); memplan keeps one.
    if (args.Has("--moe-router-load-balancing-type")) {
      const std::string v = args.String("--moe-router-load-balancing-type", "");
      const std::string first = v.substr(0, v.find(' '));
      for (const char* k : {"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"}) {
        if (first == k) moe["load_balancing"] = first;
      }
      if (!moe.contains("load_balancing")) {
        args.Fail("--moe-router-load-balancing-type",
                  "expected aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none, got " + first.substr(0, 40));
      }
    }
    if (args.Has("--moe-aux-loss-coeff")) {
      const std::string v = args.String("--moe-aux-loss-coeff", "");
      size_t used = 0;
      double c = -1;
      try {
        c = std::stod(v.substr(0, v.find(' ')), &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || !(c >= 0 && c <= 1e3)) {
        args.Fail("--moe-aux-loss-coeff", "expected a number in [0, 1000], got " + v.substr(0, 40));
      }
      moe["aux_loss_coeff"] = c;
    }
    a["moe"] = moe;
  }
  if (has_dense) a["ffn_hidden"] = ffn;
  if (const int64_t mtp = args.Int("--mtp-num-layers", 0, 16, 0); mtp > 0) a["mtp_layers"] = mtp;
  const int64_t mbs = args.Int("--micro-batch-size", 1, kMaxMicroBatch);
  const int64_t gbs = args.Int("--global-batch-size", 1, kBig);
  if (o.gpus <= 0) ThrowError(ErrorCode::kBadInput, "--gpus: expected the world size (> 0)");

  // Megatron's own view of the arguments, held to its rules
  // (megatron_args.h): what Megatron refuses is refused with its reason.
  MegatronArgs m;
  m.world_size = o.gpus;
  m.num_layers = layers;
  m.hidden = h;
  m.heads = heads;
  m.group_query_attention = args.Flag("--group-query-attention");
  m.query_groups = m.group_query_attention ? args.Int("--num-query-groups", 1, heads, 1) : 0;
  m.multi_latent_attention = args.Flag("--multi-latent-attention");
  m.mtp_layers = args.Int("--mtp-num-layers", 0, 16, 0);
  m.seq_len = seq;
  m.learned_positions = positions == "learned_absolute";
  m.max_position_embeddings = m.learned_positions ? args.Int("--max-position-embeddings", 1, kMaxSeqLen) : 0;
  m.micro_batch = mbs;
  m.global_batch = gbs;
  m.tp = tp, m.pp = pp, m.cp = cp, m.ep = ep;
  m.expert_tp = args.Has("--num-experts") ? 1 : 0;
  // arguments.py: sequence parallelism without tensor parallelism is
  // switched off with a warning.
  m.sequence_parallel = args.Flag("--sequence-parallel") && tp > 1;
  if (args.Has("--num-layers-per-virtual-pipeline-stage")) {
    m.layers_per_virtual_stage = args.Int("--num-layers-per-virtual-pipeline-stage", 1, kMaxLayers);
  }
  if (args.Has("--num-virtual-stages-per-pipeline-rank")) {
    m.virtual_stages_per_rank = args.Int("--num-virtual-stages-per-pipeline-rank", 1, kMaxLayers);
  }
  if (args.Has("--decoder-first-pipeline-num-layers")) {
    m.first_stage_layers = args.Int("--decoder-first-pipeline-num-layers", 0, layers);
  }
  if (args.Has("--decoder-last-pipeline-num-layers")) {
    m.last_stage_layers = args.Int("--decoder-last-pipeline-num-layers", 0, layers);
  }
  m.pipeline_layout = args.String("--pipeline-model-parallel-layout", "");
  m.experts = args.Has("--num-experts") ? args.Int("--num-experts", 0, kMaxExperts) : 0;
  m.grouped_gemm = true;  // memplan plans the experts' grouped GEMM (--moe-grouped-gemm is read as such)
  m.bf16 = args.Flag("--bf16");
  m.fp16 = args.Flag("--fp16");
  m.distributed_optimizer = args.Flag("--use-distributed-optimizer");
  auto words = [](const std::string& v) {
    std::vector<std::string> out;
    std::istringstream in(v);
    for (std::string w; in >> w;) out.push_back(w);
    return out;
  };
  m.recompute_granularity = args.Choice("--recompute-granularity", {"", "full", "selective"}, "");
  m.recompute_method = args.Choice("--recompute-method", {"", "uniform", "block"}, "");
  if (args.Has("--recompute-num-layers")) m.recompute_num_layers = args.Int("--recompute-num-layers", 1, kMaxLayers);
  m.recompute_modules = words(args.String("--recompute-modules", ""));
  if (m.recompute_granularity != "selective" && !m.recompute_modules.empty()) {
    args.Fail("--recompute-modules", "takes effect with --recompute-granularity selective, which is absent");
  }
  m.fine_grained_offloading = args.Flag("--fine-grained-activation-offloading");
  m.offload_modules = words(args.String("--offload-modules", ""));
  if (o.gpus % (tp * pp * cp) != 0) {
    ThrowError(ErrorCode::kBadInput, args.file() + ": --gpus " + std::to_string(o.gpus) +
                                         " is not divisible by the arguments' tp * pp * cp = " +
                                         std::to_string(tp * pp * cp));
  }
  if (auto why = ValidateMegatronArgs(m)) {
    ThrowError(ErrorCode::kBadInput, args.file() + ": Megatron refuses these arguments: " + *why);
  }
  const int64_t dp = o.gpus / (tp * pp * cp);
  const int64_t vp = m.VirtualStages();
  OrderedJson parallel = {{"tp", tp}, {"sp", m.sequence_parallel}, {"pp", pp}, {"vp", vp},
                          {"dp", dp}, {"ep", ep}, {"cp", cp},
                          {"zero", m.distributed_optimizer ? 1 : 0}};
  // The layers per pipeline rank Megatron builds (transformer_block.py,
  // pipeline_parallel_layer_layout.py): first/last stage counts with the
  // rest even, or the layout's stages (virtual stage v of rank r is stage
  // v * pp + r).
  if (!m.pipeline_layout.empty()) {
    auto stages = ParsePipelineLayout(m.pipeline_layout);
    if (!stages) args.Fail("--pipeline-model-parallel-layout", stages.error().message);
    std::vector<int64_t> layout(static_cast<size_t>(pp), 0);
    for (size_t i = 0; i < stages->size(); ++i) layout[i % static_cast<size_t>(pp)] += (*stages)[i].decoder_layers;
    // memplan splits a rank's layers over its chunks as evenly as possible,
    // the first chunks taking the rest (layout.h): the layout's chunks must
    // be that split.
    for (size_t i = 0; i < stages->size(); ++i) {
      const int64_t r = static_cast<int64_t>(i) % pp, c = static_cast<int64_t>(i) / pp, n = layout[static_cast<size_t>(r)];
      if ((*stages)[i].decoder_layers != n / vp + (c < n % vp ? 1 : 0)) {
        args.Fail("--pipeline-model-parallel-layout",
                  "pipeline rank " + std::to_string(r) + "'s virtual stages are not an even split of its " +
                      std::to_string(n) + " layers (memplan splits a rank's layers as evenly as possible over its "
                      "virtual stages, the first taking the rest)");
      }
      if ((*stages)[i].mtp_layers > 0 && i + 1 != stages->size()) {
        args.Fail("--pipeline-model-parallel-layout", "MTP layers ('m') outside the last stage are not planned");
      }
    }
    parallel["pp_layout"] = layout;
  } else if (m.first_stage_layers || m.last_stage_layers) {
    const int64_t first = m.first_stage_layers.value_or(-1), last = m.last_stage_layers.value_or(-1);
    const int64_t middle_ranks = pp - (first >= 0) - (last >= 0);
    const int64_t rest = layers - std::max<int64_t>(first, 0) - std::max<int64_t>(last, 0);
    std::vector<int64_t> layout(static_cast<size_t>(pp), middle_ranks > 0 ? rest / middle_ranks : 0);
    if (first >= 0) layout.front() = first;
    if (last >= 0) layout.back() = last;
    parallel["pp_layout"] = layout;
  }
  // The storage settings: fixed as written where the arguments give any
  // (or with --as-written: none given means every tensor kept), else
  // chosen by the planner (docs/targets.md).
  OrderedJson target = {{"name", "megatron"}};
  if (!m.recompute_granularity.empty() || m.fine_grained_offloading || o.as_written) {
    OrderedJson settings = {{"recompute_granularity", m.recompute_granularity.empty() ? "none" : m.recompute_granularity}};
    if (m.recompute_granularity == "full") {
      settings["recompute_method"] = m.recompute_method;
      settings["recompute_num_layers"] = *m.recompute_num_layers;
    }
    if (m.recompute_granularity == "selective") {
      settings["recompute_modules"] = m.recompute_modules.empty() ? std::vector<std::string>{"core_attn"} : m.recompute_modules;
    }
    if (m.fine_grained_offloading) settings["offload_modules"] = m.offload_modules;
    target["settings"] = settings;
  }
  const std::string precision = args.Flag("--bf16") ? "bf16" : args.Flag("--fp16") ? "fp16" : "fp32";
  const std::string optimizer = args.Choice("--optimizer", {"adam", "muon"}, "adam");
  std::string name = o.name.empty() ? std::filesystem::path(args.file()).stem().string() : o.name;
  OrderedJson model{
      {"schema", kModelSchema},
      {"name", name},
      {"description", "Imported by memplan import megatron from " + std::filesystem::path(args.file()).filename().string() +
                          " for " + std::to_string(o.gpus) + " GPUs."},
      {"arch", a},
      {"train",
       {{"seq_len", seq},
        {"micro_batch", mbs},
        {"microbatches", gbs / (mbs * dp)},
        {"act_dtype", precision},
        {"param_dtype", precision},
        {"grad_dtype", "fp32"},  // main gradients accumulate in fp32 (Megatron's default with bf16)
        {"optimizer", optimizer}}},
      {"parallel", parallel},
      {"hardware", {{"preset", o.hardware}}}};
  model["target"] = target;
  return model;
}

}  // namespace

Expected<OrderedJson> ImportMegatron(const std::string& text, const std::string& file, const ImportOptions& o) {
  return CatchErrors([&]() -> OrderedJson {
    const Args args(text, file);
    OrderedJson model = Build(args, o);
    auto parsed = ParseModel(Json::parse(model.dump()), file + " (imported)");
    if (!parsed) throw ErrorException(parsed.error());
    return model;
  });
}

}  // namespace memplan::planner
