// Megatron-LM's arguments that decide a job's layout and memory, as values,
// and the rules Megatron holds them to (docs/targets.md, "Megatron's
// argument rules", cites each rule's line in NVIDIA/Megatron-LM at
// d98e8a64: megatron/training/arguments.py validate_args, TransformerConfig
// __post_init__, transformer_block.py, parallel_state.py, the pipeline
// layout parser and the microbatch calculator).
//
// One place for the rules: `import megatron` validates the arguments it
// reads, `export megatron` the arguments it writes, and `plan`/`search`
// under --target megatron the arguments the layout would be launched with
// (MegatronArgsOf). What Megatron refuses, memplan refuses with Megatron's
// reason.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/status.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

struct MegatronArgs {
  int64_t world_size = 1;
  int64_t num_layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  bool group_query_attention = false;
  int64_t query_groups = 0;  // --num-query-groups (with --group-query-attention)
  bool multi_latent_attention = false;
  int64_t mtp_layers = 0;
  int64_t seq_len = 0;
  int64_t max_position_embeddings = 0;  // learned absolute positions only
  bool learned_positions = false;
  int64_t micro_batch = 0;
  int64_t global_batch = 0;

  int64_t tp = 1, pp = 1, cp = 1, ep = 1;
  int64_t expert_tp = 0;  // 0: absent (Megatron sets it to tp)
  bool sequence_parallel = false;
  std::optional<int64_t> layers_per_virtual_stage;    // --num-layers-per-virtual-pipeline-stage
  std::optional<int64_t> virtual_stages_per_rank;     // --num-virtual-stages-per-pipeline-rank
  std::optional<int64_t> first_stage_layers;          // --decoder-first-pipeline-num-layers
  std::optional<int64_t> last_stage_layers;           // --decoder-last-pipeline-num-layers
  std::string pipeline_layout;                        // --pipeline-model-parallel-layout
  bool account_for_embedding = false, account_for_loss = false;

  int64_t experts = 0;  // --num-experts
  bool grouped_gemm = false;

  bool bf16 = false, fp16 = false;
  bool distributed_optimizer = false;
  bool overlap_grad_reduce = false, overlap_param_gather = false;

  std::string recompute_granularity;  // "", "full", "selective"
  std::string recompute_method;       // "", "uniform", "block"
  std::optional<int64_t> recompute_num_layers;
  std::vector<std::string> recompute_modules;  // as given (empty: Megatron's default, core_attn)
  bool fine_grained_offloading = false;
  std::vector<std::string> offload_modules;

  int64_t DataParallel() const { return world_size / (tp * pp * cp); }
  // The virtual pipeline size the arguments give (1 without one).
  int64_t VirtualStages() const;
};

// The first rule of Megatron's the arguments break, in Megatron's words
// with the flags named, or nullopt.
std::optional<std::string> ValidateMegatronArgs(const MegatronArgs& args);

// Megatron's padded vocabulary: rounded up to a multiple of
// make_vocab_size_divisible_by x tp (megatron/core/tokenizers/utils/
// build_tokenizer.py:133-146, megatron/training/vocab_utils.py:9-59).
int64_t MegatronPaddedVocab(int64_t vocab, int64_t divisible_by, int64_t tp);

// Megatron's modules for selective recompute and fine-grained offload
// (transformer_config.py; docs/targets.md).
const std::vector<std::string_view>& MegatronRecomputeModuleNames();
const std::vector<std::string_view>& MegatronOffloadModuleNames();

// --pipeline-model-parallel-layout: the stages' layer counts ("t" per
// decoder layer, "m" per MTP layer), in stage order (virtual stage v of
// pipeline rank r is stage v * pp + r). Refuses what Megatron's parser
// refuses (pipeline_parallel_layer_layout.py), with its reason.
struct PipelineStage {
  int64_t decoder_layers = 0;
  int64_t mtp_layers = 0;
  bool embedding = false, loss = false;
};
Expected<std::vector<PipelineStage>> ParsePipelineLayout(std::string_view text);
// The layout string for memplan's layout of `model` (stage counts from
// MakePipelineLayout; E on the first stage, MTP and L on the last).
std::string PipelineLayoutString(const Model& model);

// The arguments `export megatron` writes for `model` with these storage
// settings: the layout as even counts, first/last stage counts or the
// layout string, whichever Megatron can take.
MegatronArgs MegatronArgsOf(const Model& model, const FrameworkSettings& settings);

}  // namespace memplan::planner
