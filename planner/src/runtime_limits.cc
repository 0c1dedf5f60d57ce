#include "memplan/planner/runtime_limits.h"

namespace memplan::planner {

std::vector<std::string> RuntimeLayoutGaps(const Model& model) {
  std::vector<std::string> why;
  const auto& par = model.parallel;
  const auto& a = model.arch;
  const auto& tr = model.train;
  if (par.cp > 1 && a.linear_attention) {
    bool kda = false;
    for (int64_t l = 0; l < a.layers; ++l) kda = kda || a.IsLinearAttentionLayer(l);
    const int64_t half = tr.seq_len / (2 * par.cp);
    if (kda && half % a.linear_attention->chunk != 0) {
      why.push_back("/arch/linear_attention/chunk: KDA under cp > 1 needs whole chunks in each of a rank's two "
                    "parts of the sequence (seq_len / (2 cp) = " + std::to_string(half) + " is not a multiple of " +
                    std::to_string(a.linear_attention->chunk) + ")");
    }
  }
  if (par.tp > 1) {
    const std::string tp = std::to_string(par.tp);
    if (a.vocab % par.tp != 0) {
      why.push_back("/arch/vocab (" + std::to_string(a.vocab) + ") is not divisible by tp (" + tp +
                    "): the runtime splits the vocabulary evenly (Megatron pads it: --make-vocab-size-divisible-by)");
    }
    if (a.moe && par.dp == 1 && (par.zero >= 1 || par.pipeline_zero2)) {
      why.push_back("/parallel/zero: routed experts under tp > 1 with dp 1 and a sharded optimizer (the plan "
                    "shards them over tp / ep replicas) are not executed yet");
    }
    if (a.moe && !par.sp) {
      why.push_back("/parallel/sp: MoE under tp > 1 needs sequence parallelism (each tensor-parallel rank "
                    "routes its own tokens, as Megatron requires)");
    }
  }
  if (par.zero >= 3) {
    if (par.pipeline_zero2) why.push_back("/parallel/pipeline_zero2: not executed together with ZeRO-3");
    if (tr.grad_dtype != DType::kFP32) why.push_back("/train/grad_dtype: ZeRO-3 executes fp32 gradients");
  }
  if (a.moe && a.moe->RoutedRowsFactor(par.ep) < 1) {
    why.push_back("/arch/moe/capacity_factor is below 1: the runtime drops routed tokens only past an "
                  "expert rank's capacity, never a rank's own");
  }
  if (par.dp > 1 && par.zero >= 2 && !par.pipeline_zero2 && tr.grad_dtype != DType::kFP32) {
    why.push_back("/train/grad_dtype: ZeRO-2 with dp > 1 executes fp32 gradients (its partitions add fp32 ranges)");
  }
  if (par.pipeline_zero2 && par.pp == 1 && par.vp > 1 && a.tied_embeddings) {
    why.push_back("/parallel/pipeline_zero2: a tied head in another chunk than its embedding on one pipeline "
                  "rank (their gradient is one buffer, bound chunk by chunk)");
  }
  if (par.pipeline_zero2 && tr.grad_dtype != DType::kFP32) {
    why.push_back("/parallel/pipeline_zero2: its double buffer executes fp32 gradients");
  }
  return why;
}

}  // namespace memplan::planner
