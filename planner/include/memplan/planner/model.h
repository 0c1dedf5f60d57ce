// The model IR: a validated, defaults-filled `memplan.model/1` document.
//
// Stage 1 of the planner (docs/design.md, "Data flow"): ParseModel() turns the JSON
// of a model file into a `Model`, rejecting bad input with one-line errors
// that name the file and the RFC 6901 pointer ("m.json: /arch/hidden:
// expected an integer in [1, 1048576], got -4"). Unknown keys are errors.
// NormalizedModelJson() writes the model back with every default filled in;
// its sha256 is the model digest that ties plans to measurements.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"
#include "memplan/planner/graph.h"

namespace memplan::planner {

inline constexpr std::string_view kModelSchema = "memplan.model/1";

// Stated maxima: anything larger is refused by a range check rather than
// allowed to allocate or loop for hours. Layers and microbatches are also
// bounded together: the planner meets every model within these limits in
// seconds and at most about 1 GiB (docs/design.md, "Input limits and
// hostile input"; measured by tests/hostile_surfaces_test.sh).
inline constexpr int64_t kMaxLayers = 10'000;
// Layers x microbatches: at most kMaxLayerMicrobatches in a model file; the
// planner simulates a periodic window of them (period.h) in the memory of
// a few, and every microbatch only up to kMaxSimulatedLayerMicrobatches
// (BuildProblem refuses more: where the pipeline has no window, or with
// --full-simulation, and in `memplan run`).
inline constexpr int64_t kMaxLayerMicrobatches = 200'000;
inline constexpr int64_t kMaxSimulatedLayerMicrobatches = 50'000;
inline constexpr int64_t kMaxHidden = 1 << 20;
inline constexpr int64_t kMaxHeads = 1 << 16;
inline constexpr int64_t kMaxVocab = 1 << 24;
inline constexpr int64_t kMaxExperts = 1 << 20;
inline constexpr int64_t kMaxSeqLen = 1 << 24;
inline constexpr int64_t kMaxMicroBatch = 1 << 16;
inline constexpr int64_t kMaxMicrobatches = kMaxLayerMicrobatches;
inline constexpr int64_t kMaxParallel = 1 << 20;

enum class FfnAct { kGelu, kSwiglu };
enum class Norm { kLayerNorm, kRmsNorm };
enum class Attention { kStandard, kFlash };
enum class Optimizer { kAdam, kMuon };
enum class Router { kSoftmax, kSigmoid };

struct MlaConfig {
  int64_t q_lora_rank = 0;  // 0: queries are not compressed
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
};

struct MoeConfig {
  int64_t experts = 0;
  int64_t top_k = 0;
  int64_t expert_ffn_hidden = 0;
  int64_t shared_experts = 0;
  int64_t shared_ffn_hidden = 0;  // defaults to expert_ffn_hidden
  int64_t first_dense_layers = 0;
  // Further layers with a dense FFN, ascending (Qwen-MoE's mlp_only_layers
  // and sparse steps, DeepSeek's moe_layer_freq): docs/formats.md.
  std::vector<int64_t> dense_layers;
  std::optional<int64_t> latent_dim;  // experts run at `hidden` when unset
  // Token dropping: each EP rank keeps at most capacity_factor x its mean
  // share of routed rows. Unset: dropless (Megatron's and DeepSeek's
  // default), and the routed buffers are sized for `imbalance`, the
  // largest expert's load over the mean (docs/accounting.md section 8b).
  std::optional<double> capacity_factor;
  double imbalance = kDefaultMoeImbalance;
  Router router = Router::kSoftmax;
  // DeepSeek-V3 / Kimi K2 routing (docs/runtime.md, "MoE routing"): the
  // gates times this factor, and a per-expert bias added to the scores for
  // the selection only (aux-loss-free balancing; the gates stay unbiased).
  double routed_scaling = 1.0;
  bool selection_bias = false;
  // After each optimizer step the bias moves by this rate towards balance:
  // b_i += rate * sign(mean load - load_i) (DeepSeek-V3's gamma, Megatron's
  // --moe-router-bias-update-rate; default 1e-3).
  double bias_update_rate = 1e-3;
  // The load-balancing loss (Megatron's --moe-router-load-balancing-type
  // and --moe-aux-loss-coeff): no tensor changes size; written to launch
  // the same job. Unset: the framework's default.
  std::optional<std::string> load_balancing;
  std::optional<double> aux_loss_coeff;

  static constexpr double kDefaultMoeImbalance = 1.2;
  // Routed rows an EP rank holds, over its mean share (s*b*top_k): the
  // capacity when tokens are dropped, else min(imbalance, ep), since a rank
  // whose every expert carries at most imbalance x the mean receives at most
  // imbalance x its share, and never more than every rank's rows (ep x).
  double RoutedRowsFactor(int64_t ep) const {
    if (capacity_factor) return *capacity_factor;
    return std::min(imbalance, static_cast<double>(ep));
  }
};

struct AttnResConfig {
  int64_t block_layers = 0;
  // true ("mix": "sublayer", the paper's): a mix before each sublayer
  // (attention, FFN), each with its own pseudo-query and key norm, blocks
  // summing the sublayers' outputs; false ("layer"): one mix per layer,
  // blocks summing the layers' outputs (docs/templates.md, Block AttnRes).
  bool per_sublayer = true;
};

struct LinearAttentionConfig {
  std::string kind = "kda";
  int64_t full_attention_every = 0;
  int64_t full_attention_offset = 0;
  int64_t head_dim = 0;
  int64_t chunk = 64;
  // Taps of the short causal convolutions (with SiLU) on q, k and v; 0: none
  // (the simplified layer). 4 is the reference code's conv_size.
  int64_t conv_size = 4;
};

struct Arch {
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t ffn_hidden = 0;  // 0 when every layer is MoE
  FfnAct ffn_act = FfnAct::kSwiglu;
  Norm norm = Norm::kRmsNorm;
  Attention attention = Attention::kFlash;
  bool dropout = false;
  int64_t vocab = 0;
  bool tied_embeddings = false;
  // Learned absolute positions (GPT-2): a table of this many rows on the
  // embedding's rank; 0 for rotary models (docs/formats.md).
  int64_t position_embeddings = 0;
  // Multi-token prediction depths (DeepSeek-V3): after the last layer, on
  // the last pipeline stage (docs/accounting.md section 2b).
  int64_t mtp_layers = 0;
  // What the framework needs to build the same model and no byte the
  // planner counts depends on (docs/formats.md): rotary base and Llama 3's
  // frequency scaling, q/k norms, linear and qkv biases, the norms'
  // epsilon. Unset: the framework's default (Megatron's: base 10000, no
  // scaling, no q/k norm, epsilon 1e-5; memplan's templates have no biases).
  std::optional<double> rope_base;
  std::optional<double> rope_scaling_factor;
  bool qk_norm = false;
  bool linear_bias = false;
  bool qkv_bias = false;
  std::optional<double> norm_eps;
  std::optional<MlaConfig> mla;
  std::optional<MoeConfig> moe;
  std::optional<AttnResConfig> attn_res;
  std::optional<LinearAttentionConfig> linear_attention;

  bool IsMoeLayer(int64_t layer) const;
  // True for linear-attention (KDA) layers of a hybrid model.
  bool IsLinearAttentionLayer(int64_t layer) const;
};

struct Train {
  int64_t seq_len = 0;
  int64_t micro_batch = 0;
  int64_t microbatches = 0;
  DType act_dtype = DType::kBF16;
  DType param_dtype = DType::kBF16;
  DType grad_dtype = DType::kFP32;
  Optimizer optimizer = Optimizer::kAdam;
};

struct Parallel {
  int64_t tp = 1;
  bool sp = false;
  int64_t pp = 1;
  int64_t vp = 1;
  int64_t dp = 1;
  int64_t ep = 1;
  int64_t cp = 1;
  int zero = 0;  // 3: parameters sharded too (FSDP), docs/accounting.md section 4c
  // ZeRO-3 / FSDP: free a unit's gathered parameters after its forward
  // (gathered again for backward), and how many units ahead are gathered.
  bool fsdp_reshard_after_forward = true;
  int64_t fsdp_prefetch = 1;
  bool pipeline_zero2 = false;
  bool grad_offload_host = false;
  bool muon_gather_p2p = true;
  // Layers per pipeline rank (length pp). Always filled after parsing.
  std::vector<int64_t> pp_layout;
  bool pp_layout_given = false;
  // The grid's ranks, one process (GPU) each: EP is carved out of dp
  // (docs/design.md), so it adds none.
  int64_t Processes() const { return pp * dp * tp * cp; }
};

struct Hardware {
  std::string preset;
  int64_t device_memory = 0;  // bytes
  double hbm_bw = 0;          // bytes/s
  double bf16_flops = 0;      // FLOP/s, dense
  double d2h_bw = 0;          // bytes/s, per direction
  double h2d_bw = 0;
  double peer_bw = 0;     // NVLink inside a node, per direction
  double pp_link_bw = 0;  // between pipeline ranks
  int64_t host_memory = 0;  // host bytes available per GPU
  // Fixed cost of one op (kernel launch and the runtime's per-op work),
  // added to its roofline time; 0 in the presets, measured by `memplan
  // calibrate` (docs/planner.md, "Calibration").
  double launch_s = 0;
  // GPUs sharing one node's NVLink (peer_bw); groups spanning more ranks
  // communicate over pp_link_bw, the per-GPU inter-node link
  // (docs/planner.md, "Communication").
  int64_t gpus_per_node = 8;
  // Memory outside the training framework, per GPU process
  // (docs/accounting.md, "Memory outside the framework"): 0 on the host
  // preset, estimates on the GPU presets until calibrated.
  struct Runtime {
    int64_t cuda_context = 0;      // the CUDA context and loaded modules
    int64_t nccl_channels = 0;     // channels of a collective communicator (NCCL_MAX_NCHANNELS)
    int64_t nccl_buffsize = 0;     // NCCL_BUFFSIZE: the Simple protocol's buffer per connection
    int64_t nccl_p2p_channels = 0; // channels per peer of point-to-point traffic (NCCL_NCHANNELS_PER_PEER)
    bool operator==(const Runtime&) const = default;
  } runtime;
  // How far real kernels and collectives fall short of the peaks above
  // (docs/planner.md, "Time model"; kernel_time.h). The defaults are the
  // ideal roofline the host preset and calibrations use; the GPU presets
  // carry published measurements.
  struct Efficiency {
    // GEMMs: the fraction of bf16_flops a large GEMM reaches; the SMs and
    // output tile that quantize its work into waves (0 SMs: none); the
    // reduction depth at which the main loop reaches half speed (0: none).
    double gemm = 1;
    int64_t sms = 0;
    int64_t tile_m = 128, tile_n = 128;
    double gemm_k_half = 0;
    // Flash attention: the fraction of bf16_flops forward and backward
    // reach on the work they do; causal kernels skip the masked half; the
    // backward's FLOPs per forward FLOP.
    double attention_fwd = 1, attention_bwd = 1;
    bool causal = false;
    double attention_bwd_ratio = 2;
    // Memory-bound kernels: the fraction of hbm_bw they reach.
    double memory = 1;
    // NCCL: bus bandwidth as a fraction of the link (peer_bw inside a node,
    // pp_link_bw across nodes) and the latency of one ring step.
    double nvlink = 1, network = 1;
    double nvlink_latency_s = 0, network_latency_s = 0;
    // The optimizer step: bytes it moves per parameter it updates (its
    // shard under ZeRO), at `memory` of hbm_bw; 0: not timed.
    double optimizer_bytes_per_param = 0;
    bool operator==(const Efficiency&) const = default;
  } efficiency;
};

// A hardware description `memplan calibrate` wrote (memplan.hardware/1):
// its `hardware` object, read as a model file's `hardware` is. Errors name
// the file and the JSON pointer.
Expected<Hardware> LoadHardwareFile(const std::string& path);
// The same, for a document already read (fuzz targets, tests).
Expected<Hardware> ParseHardwareFile(const Json& doc, const std::string& path);
// A model file's `hardware` object with every number explicit (launch_s
// only when not 0).
Json HardwareJson(const Hardware& h);
Json EfficiencyJson(const Hardware::Efficiency& e);

enum class Policy { kKeep, kRecompute, kFp8, kOffloadHost, kOffloadRemote };
std::string_view PolicyName(Policy p);

// The storage kinds plan and search may choose for saved tensors
// (--storage, the model's `storage`; docs/formats.md): keep always, each
// other kind allowed or not. A policy annotation naming a kind left out
// falls back to the nearest allowed storage, as an illegal one does.
struct StorageKinds {
  bool recompute = true, fp8 = true, offload_host = true, offload_remote = true;
  bool Allows(Policy p) const;
  bool All() const { return recompute && fp8 && offload_host && offload_remote; }
  bool operator==(const StorageKinds&) const = default;
};
// "keep,fp8" (--storage) into kinds; errors name the word that is not one.
Expected<StorageKinds> ParseStorageKinds(std::string_view list);
// The allowed kinds' names, keep first, in the order of Policy.
std::vector<std::string> StorageKindNames(const StorageKinds& kinds);
// The same as --storage spells it: "keep,recompute,fp8".
std::string StorageKindsText(const StorageKinds& kinds);

struct PolicyAnnotation {
  std::string match;             // fnmatch glob over tensor names
  std::vector<Policy> policy;    // a legal composition
};

struct CostOverride {
  std::string match;
  std::optional<double> recompute_s;
  std::optional<double> fp8_s;
  std::optional<double> offload_s;
};

struct Options {
  bool moe_grad_rewrite = false;
  bool moe_recompute_dispatch = false;
  bool attn_res_single_copy = false;
  bool attn_res_checkpoint = false;
  bool attn_res_pp_cache = false;
  bool pp_balance = false;
};

// The runtime a plan is for (target.h, docs/targets.md).
enum class TargetKind { kMemplan, kMegatron };
std::string_view TargetName(TargetKind kind);
std::optional<TargetKind> TargetFromName(std::string_view name);

// A framework's storage settings, as Megatron-LM spells them
// (megatron/core/transformer/transformer_config.py; docs/targets.md):
// `granularity` "" (none), "selective" (recompute_modules) or "full"
// (method "block": the first num_layers layers of every virtual pipeline
// chunk recompute everything from their input). Offload modules go with
// --fine-grained-activation-offloading.
struct FrameworkSettings {
  std::string granularity;
  std::string method;
  int64_t num_layers = 0;
  std::vector<std::string> recompute_modules;
  std::vector<std::string> offload_modules;
  bool operator==(const FrameworkSettings&) const = default;
  bool empty() const { return granularity.empty() && offload_modules.empty(); }
};

// A model file's `target` (docs/formats.md): which runtime, the caching
// allocator's settings where it has one (PYTORCH_CUDA_ALLOC_CONF), and the
// framework settings when they are given rather than chosen by the planner.
struct TargetConfig {
  TargetKind kind = TargetKind::kMemplan;
  bool expandable_segments = false;
  int64_t max_split_size_mb = 0;  // 0: unlimited (PyTorch's default)
  std::optional<FrameworkSettings> settings;
};

struct Model {
  std::string file;  // where it was read from (for messages; not in the digest)
  std::string name;
  std::string description;
  Arch arch;
  Train train;
  Parallel parallel;
  Hardware hardware;
  int64_t budget = 0;
  bool budget_given = false;
  std::vector<CostOverride> costs;
  std::vector<PolicyAnnotation> policies;
  StorageKinds storage;  // written in the normalized model only when not all
  Options options;
  TargetConfig target;
  // What plan and search keep free under the budget (docs/targets.md,
  // "Headroom"); the target's default unless given.
  int64_t headroom = 0;
  bool headroom_given = false;
  // Explicit layer graphs from the model file's `graph`, by global layer
  // index; they replace the template expansion of those layers.
  std::vector<LayerGraph> graph;
};

// A model file's `target` object, and the settings in it (also PLAN.json's
// `target_settings`).
Json TargetJson(const TargetConfig& target);
Json SettingsJson(const FrameworkSettings& settings);

// Hardware presets: h100, h200, b200, host. Sources are in docs/accounting.md.
Expected<Hardware> HardwarePreset(std::string_view name);

// Bytes held back from device memory when no budget is given: what no line
// item counts (the allocator's slack; also the CUDA context and NCCL where
// hardware.runtime does not count them). docs/accounting.md.
int64_t DefaultReserveBytes(const Hardware& hardware);

// Layers per pipeline rank when `pp_layout` is not given: as even as
// possible; when layers do not divide, the first and last ranks take fewer,
// and no rank gets fewer than vp layers.
std::vector<int64_t> DefaultPipelineLayout(int64_t layers, int64_t pp, int64_t vp);

Expected<Model> ParseModel(const Json& doc, const std::string& file);
Expected<Model> LoadModel(const std::string& path);

// The model with defaults filled (sorted keys). Explicit graphs are included
// as `graph` only when present.
Json NormalizedModelJson(const Model& model);

// "sha256:<hex>" of the compact dump of NormalizedModelJson().
std::string ModelDigest(const Model& model);

}  // namespace memplan::planner
