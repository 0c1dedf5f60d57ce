// The layer-graph IR (stage 2 of the planner).
//
// Glossary:
//   op      one computation of a layer (a GEMM, a norm, an activation): kind,
//           FLOPs, bytes read and written, optional workspace bytes.
//   tensor  a value one op produces and others consume. Shapes and bytes are
//           per device, after TP/SP/CP/EP sharding. `saved` marks tensors
//           kept for the backward pass: the planner's decision variables.
//   param   a weight of the layer, with its global (unsharded) shape and the
//           kind that decides how TP/EP shard it and which optimizer owns it.
//
// One `LayerGraph` holds one global layer. Names follow
// `layer<i>.<module>.<tensor>`. A layer's input tensor (produced by the
// previous layer) has its producer named but lives in this layer's list when
// this layer saves it. The dataflow (op -> op through tensors) is a
// Boost.Graph adjacency list; Finalize() derives producers and consumers from
// the ops and checks that names are unique and the graph is acyclic.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/planner/op_registry.h"

namespace memplan::planner {

enum class DType { kBF16, kFP16, kFP32, kFP8, kU8, kI32, kI64 };

int64_t DTypeBytes(DType dtype);
std::string_view DTypeName(DType dtype);
// "bf16", "fp32", ... ; false when unknown.
bool ParseDType(std::string_view name, DType* out);

// The layer a tensor's name places it in ("layer12.attn_res.partial" -> 12);
// -1 for a name without the layer<i>. prefix.
int64_t TensorLayer(std::string_view name);

enum class ParamKind { kLinear, kNorm, kEmbedding, kHead, kRouter, kExpert, kSharedExpert };
std::string_view ParamKindName(ParamKind kind);
bool ParseParamKind(std::string_view name, ParamKind* out);

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;  // global shape; experts: [experts, rows, cols]
  ParamKind kind = ParamKind::kLinear;
  bool tp_split = false;  // sharded over tensor-parallel ranks
  // A replica of another stage's parameter (the word embedding the last
  // stage keeps for multi-token prediction): memory on its rank, not in
  // the model's parameter totals.
  bool copy = false;

  int64_t Elements() const;  // product of shape
  // Number of 2-D matrices (Muon's unit): experts count one per expert.
  int64_t Matrices() const;
};

struct TensorSpec {
  std::string name;
  std::string module;
  std::vector<int64_t> shape;  // per device
  DType dtype = DType::kBF16;
  int64_t bytes = 0;  // product(shape) * DTypeBytes(dtype)
  bool saved = false;
  std::string producer;  // op name; empty for model inputs
  std::vector<std::string> consumers;
  std::string sharding = "replicated";  // replicated | tp | sp | tp_seq
};

struct OpSpec {
  std::string name;
  std::string kind;  // linear, grouped_gemm, layernorm, rmsnorm, gelu, ... (op_registry.h)
  OpKind op = OpKind::kUnknown;  // `kind` in the registry (set by Finalize)
  std::string module;
  // The parameters the op reads, in its kind's role order (OpDef::params):
  // given by the file, else bound by Finalize from the op's name. A role
  // with no parameter of the layer leaves the list short (a tied head binds
  // the embedding of another layer; the runtime resolves it).
  std::vector<std::string> params;
  std::vector<std::string> inputs;   // tensor names
  std::vector<std::string> outputs;  // tensor names
  double flops = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t workspace_bytes = 0;
};

class LayerGraph {
 public:
  int64_t index = 0;
  std::string kind;  // dense, moe, kda, ... (informational)
  std::vector<ParamSpec> params;
  std::vector<TensorSpec> tensors;
  std::vector<OpSpec> ops;

  // Resolves each op's kind in the registry and binds its parameters
  // (OpSpec::params), derives tensor producers/consumers from the ops (a
  // producer recorded on a tensor that no local op writes is kept: it names
  // the previous layer's op), builds the dataflow graph and verifies it: unique names, every op
  // input/output declared, one producer per tensor, bytes equal to
  // shape x dtype, no cycles. Throws ErrorException(kBadInput) naming
  // `where` (the layer's JSON location) on failure.
  void Finalize(const JsonLocation& where);

  // Ops in a dependency-respecting order (Boost topological sort), stable
  // for equal inputs. Valid after Finalize().
  const std::vector<size_t>& TopologicalOrder() const { return topo_order_; }

  int64_t SavedBytes() const;
  int64_t SavedBytes(std::string_view module) const;
  const TensorSpec* FindTensor(std::string_view name) const;

  OrderedJson ToJson() const;
  // Parses one element of the model file's `graph.layers`.
  static LayerGraph FromJson(const Json& value, const JsonLocation& where);

 private:
  std::vector<size_t> topo_order_;
};

}  // namespace memplan::planner
