// The op registry: one entry per op kind, read by the planner (what a
// backward reads, which backwards add into their input gradients, which
// parameters an op binds) and by the runtime (whether it executes the kind,
// and its forward/backward, runtime/src/op_impls.cc, indexed by the same
// OpKind). The way XLA's opcode table and PyTorch's native_functions.yaml
// keep an op's meaning in one place instead of string tests spread over
// the planner and the executor.
//
// Adding an op (docs/design.md, "Adding an op"): an OpKind, one OpDef row
// in op_registry.cc, the template that emits it, its kernels, and its
// forward/backward in runtime/src/op_impls.cc (an executable kind without
// them fails the runtime's registry test).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace memplan::planner {

enum class OpKind : uint8_t {
  kUnknown = 0,  // a kind no entry names (explicit graphs may use any kind)
  kLinear,
  kGroupedGemm,
  kBatchedGemm,
  kEmbedding,
  kLayerNorm,
  kRmsNorm,
  kGatedRmsNorm,
  kGelu,
  kSwiglu,
  kSoftmax,
  kSigmoid,
  kDropout,
  kAdd,
  kIdentity,
  kCopy,
  kSplitRope,
  kMlaSplit,
  kFlashAttention,
  kTopK,
  kDispatch,
  kCombine,
  kCrossEntropy,
  kKdaChunked,
  kShortConv,
  kAttnRes,
  kAttnResSoftmax,
  kAttnResMix,
  kAttnResAccumulate,
  kCount,
};

// One tensor of an op by position: inputs[index] or outputs[index].
struct OpSlot {
  static constexpr uint8_t kAll = 255;  // every input (or output)
  bool output = false;
  uint8_t index = 0;
  // Read only when the tensor is saved: combine's native router gradient
  // <dO, Y> reads the expert output Y, the gradient rewrite does not.
  bool only_if_saved = false;
};

// How an op's parameters are named from the op's own name (the binding
// templates use, graph.cc BindParams):
//   kByName   "layer1.attn.qkv" -> "layer1.attn.qkv.<role>", else
//             "layer1.attn.<role>" (norms: "layer1.attn_norm.norm" ->
//             "layer1.attn_norm.weight"), else "layer1.moe.experts.fc1.<role>"
//             for "layer1.moe.experts_fc1";
//   kAttnRes  "layer3.attn_res.mix" -> "layer3.attn_res.<role>";
//             "layer3.head.final_mix" -> "layer3.head.attn_res.<role>".
enum class ParamNaming : uint8_t { kByName, kAttnRes };

struct OpDef {
  OpKind kind = OpKind::kUnknown;
  std::string_view name;  // the kind as model files and expand spell it
  // The tensors a backward reads besides its outputs' gradients: they must
  // be resident when it runs (saved, or rebuilt).
  std::vector<OpSlot> backward_reads;
  // The backward adds into its input gradients without a temporary (add,
  // identity, copy, attn_res, attn_res_accumulate); the others overwrite
  // theirs.
  bool grad_accumulates = false;
  // Parameter roles, in the order OpSpec::params lists them.
  std::vector<std::string_view> params;
  ParamNaming naming = ParamNaming::kByName;
  // The runtime executes the kind; otherwise `why_not` says what is missing.
  bool executable = false;
  std::string_view why_not;
};

// The entry of `kind` (kUnknown's entry: reads nothing, not executable).
const OpDef& GetOpDef(OpKind kind);
// The kind named `name`; kUnknown when no entry has that name.
OpKind OpKindFromName(std::string_view name);
// Every entry, kUnknown excluded, in OpKind order.
const std::vector<OpDef>& AllOpDefs();

}  // namespace memplan::planner
