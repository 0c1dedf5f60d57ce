#include "memplan/planner/op_registry.h"

#include "memplan/common/check.h"

namespace memplan::planner {
namespace {

OpSlot In(uint8_t i) { return {false, i, false}; }
OpSlot Out(uint8_t i) { return {true, i, false}; }
OpSlot InIfSaved(uint8_t i) { return {false, i, true}; }
OpSlot AllIn() { return {false, OpSlot::kAll, false}; }

std::vector<OpDef> MakeTable() {
  using K = OpKind;
  constexpr bool kRuns = true;
  constexpr std::string_view kDecomposedAttnResWhy =
      "no kernels for the decomposed Block AttnRes (options.attn_res_checkpoint off)";
  std::vector<OpDef> t = {
      {K::kUnknown, "", {}, false, {}, ParamNaming::kByName, false, "no op registry entry has this kind"},
      {K::kLinear, "linear", {In(0)}, false, {"weight"}, ParamNaming::kByName, kRuns, ""},
      {K::kGroupedGemm, "grouped_gemm", {In(0)}, false, {"weight"}, ParamNaming::kByName, kRuns, ""},
      {K::kBatchedGemm, "batched_gemm", {In(0), In(1)}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kEmbedding, "embedding", {In(0)}, false, {"weight"}, ParamNaming::kByName, kRuns, ""},
      {K::kLayerNorm, "layernorm", {In(0)}, false, {"weight", "bias"}, ParamNaming::kByName, kRuns, ""},
      {K::kRmsNorm, "rmsnorm", {In(0)}, false, {"weight"}, ParamNaming::kByName, kRuns, ""},
      // KDA's output norm: RMSNorm(o) * sigmoid(gate), per head.
      {K::kGatedRmsNorm, "gated_rmsnorm", {In(0), In(1)}, false, {"weight"}, ParamNaming::kByName, kRuns, ""},
      {K::kGelu, "gelu", {In(0)}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kSwiglu, "swiglu", {In(0)}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kSoftmax, "softmax", {Out(0)}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kSigmoid, "sigmoid", {Out(0)}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kDropout, "dropout", {Out(1)}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kAdd, "add", {}, true, {}, ParamNaming::kByName, kRuns, ""},
      {K::kIdentity, "identity", {}, true, {}, ParamNaming::kByName, kRuns, ""},
      {K::kCopy, "copy", {}, true, {}, ParamNaming::kByName, kRuns, ""},
      {K::kSplitRope, "split_rope", {}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kMlaSplit, "mla_split", {}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kFlashAttention, "flash_attention", {In(0), In(1), In(2), Out(0), Out(1)}, false, {},
       ParamNaming::kByName, kRuns, ""},
      {K::kTopK, "topk", {In(0), Out(0), Out(1)}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kDispatch, "dispatch", {Out(1)}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kCombine, "combine", {InIfSaved(0), In(1), In(2)}, false, {}, ParamNaming::kByName, kRuns, ""},
      {K::kCrossEntropy, "cross_entropy", {Out(0), In(1)}, false, {}, ParamNaming::kByName, kRuns, ""},
      // q, k, v, g, beta and the per-chunk states (its second output).
      {K::kKdaChunked, "kda_chunked", {AllIn(), Out(1)}, false, {"a_log", "dt_bias"}, ParamNaming::kByName, kRuns,
       ""},
      // KDA's causal depthwise convolution on q, k or v, then SiLU; the
      // backward re-makes the SiLU's input from the saved input.
      {K::kShortConv, "short_conv", {In(0)}, false, {"weight"}, ParamNaming::kByName, kRuns, ""},
      // Its inputs are the blocks (one tensor of them all, or each block read
      // in place); the backward recomputes the weights from them.
      {K::kAttnRes, "attn_res", {AllIn()}, true, {"query", "norm.weight"}, ParamNaming::kAttnRes, kRuns, ""},
      {K::kAttnResSoftmax, "attn_res_softmax", {In(0), Out(0)}, false, {"query"}, ParamNaming::kAttnRes, false,
       kDecomposedAttnResWhy},
      {K::kAttnResMix, "attn_res_mix", {AllIn()}, false, {}, ParamNaming::kAttnRes, false,
       kDecomposedAttnResWhy},
      {K::kAttnResAccumulate, "attn_res_accumulate", {}, true, {}, ParamNaming::kByName, kRuns, ""},
  };
  for (size_t i = 0; i < t.size(); ++i) {
    MEMPLAN_CHECK(static_cast<size_t>(t[i].kind) == i, "op registry rows must follow OpKind order");
  }
  MEMPLAN_CHECK(t.size() == static_cast<size_t>(OpKind::kCount), "every OpKind needs a registry row");
  return t;
}

const std::vector<OpDef>& Table() {
  static const std::vector<OpDef> table = MakeTable();
  return table;
}

}  // namespace

const OpDef& GetOpDef(OpKind kind) {
  const auto& t = Table();
  const size_t i = static_cast<size_t>(kind);
  return i < t.size() ? t[i] : t.front();
}

OpKind OpKindFromName(std::string_view name) {
  for (const auto& d : Table()) {
    if (d.kind != OpKind::kUnknown && d.name == name) return d.kind;
  }
  return OpKind::kUnknown;
}

const std::vector<OpDef>& AllOpDefs() {
  static const std::vector<OpDef> defs(Table().begin() + 1, Table().end());
  return defs;
}

}  // namespace memplan::planner
