// The runtime half of the op registry (planner/op_registry.h): for every
// executable OpKind, its forward and its backward, written against an
// OpContext that hides where values, gradients and parameters live
// (op_exec.cc binds it to the executor's buffers). docs/runtime.md states
// the math of each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "executor_impl.h"

namespace memplan::runtime::exec {

class OpContext {
 public:
  virtual ~OpContext() = default;

  virtual const planner::OpSpec& op() const = 0;
  virtual const planner::LayerGraph& graph() const = 0;
  virtual const planner::Model& model() const = 0;
  virtual kernels::Ops& k() = 0;
  virtual int64_t layer() const = 0;
  virtual int32_t microbatch() const = 0;  // in the global batch (data-parallel replicas run their own)
  // True in the forward pass; false when a backward rebuilds a value.
  virtual bool forward_pass() const = 0;
  virtual uint64_t seed() const = 0;

  // A tensor's value (forward: produced or read; backward: saved or rebuilt).
  virtual Buffer Value(int32_t tensor) = 0;
  // Backward: a tensor's gradient buffer.
  virtual Buffer Grad(int32_t tensor) = 0;
  // Backward: whether this op writes input i's gradient first (no later
  // reader, no next layer), so it may overwrite rather than add.
  virtual bool FirstWriter(size_t i) = 0;
  // Backward: where input i's gradient goes: its buffer when this op writes
  // it first or the kind accumulates, else a temporary FinishInputGrad adds.
  virtual Buffer InputGrad(size_t i) = 0;
  virtual void FinishInputGrad(size_t i) = 0;
  // Backward: the op's planned workspace (OpSpec::workspace_bytes).
  virtual Buffer Workspace() = 0;
  // Backward: a value another op of the layer declares as its backward
  // read (BackwardReads of `other`), read for that op's sake (the router
  // gradient rewrite reads the combine's gates and slots).
  virtual Buffer ReadDeclaredBy(const planner::OpSpec& other, int32_t tensor) = 0;
  // The parameter bound to role `role` (OpSpec::params).
  virtual const ParamState& Param(size_t role) = 0;
  // This layer and microbatch's routing (dispatch writes it, the grouped
  // GEMMs and the combine read it).
  virtual exec::Routing& Routing() = 0;
  // Expert parallelism (experts.cc): the size of this rank's EP group (1:
  // every routed expert is here) and its place in it; the all-to-all of
  // the group (out[d] to rank d; returns what each rank sent this one, in
  // rank order); routed rows dropped past this rank's capacity.
  virtual int ep_size() const = 0;
  virtual int ep_rank() const = 0;
  virtual std::vector<std::vector<std::byte>> ExchangeExperts(std::vector<std::vector<std::byte>> out) = 0;
  virtual void NoteDropped(int64_t rows) = 0;
  // The routing one MoE layer saw in one forward: its most-loaded expert's
  // rows over the mean per expert, and (EP) this rank's rows over its share.
  virtual void NoteRouting(double expert_load, double rank_load) = 0;
  // arch.moe.selection_bias: this layer's per-expert bias (experts floats,
  // host memory, zeros unless a test's init hook sets them), added to the
  // scores for the top-k selection only.
  virtual std::vector<float>& RouterBias() = 0;
  // The experts this layer's top-k chose for this microbatch's tokens
  // (tokens x top_k): the load the bias update reads after the step. A
  // recomputed forward notes the same selection again.
  virtual void NoteSelected(const std::vector<int32_t>& experts_of_tokens) = 0;
  // Tensor parallelism (docs/runtime.md, "Tensor parallelism"): the
  // group's size and this rank's place in it; its collectives on float
  // buffers, staged through the host: every rank's n floats (on the host,
  // in rank order), their sum in place, every rank's n floats into `whole`
  // (n * tp), and this rank's n of the sum of every rank's `whole`. The
  // plan's tp_comm buffer (planner::TpCommBytes): slot 0 and 1 [tokens,
  // hidden] fp32 each (sequence parallelism), slot 2 3 * tokens fp32.
  virtual int tp_size() const = 0;
  virtual int tp_rank() const = 0;
  virtual std::vector<float> TpGather(const Buffer& mine, int64_t n) = 0;
  virtual void TpAllReduce(const Buffer& data, int64_t n) = 0;
  virtual void TpAllGather(const Buffer& mine, int64_t n, const Buffer& whole) = 0;
  virtual void TpReduceScatter(const Buffer& whole, int64_t n, const Buffer& mine) = 0;
  virtual Buffer TpBuffer(int slot) = 0;
  // Context parallelism (docs/runtime.md, "Context parallelism"): the
  // group's size and this rank's place; every rank's n floats (on the host,
  // rank order), their sum in place; the plan's cp_comm buffer
  // (planner::CpCommBytes).
  virtual int cp_size() const = 0;
  virtual int cp_rank() const = 0;
  virtual std::vector<float> CpGather(const Buffer& mine, int64_t n) = 0;
  virtual void CpAllReduce(const Buffer& data, int64_t n) = 0;
  virtual Buffer CpBuffer() = 0;
  // Device <-> host, in order with the ops (the exchange's staging).
  virtual void ToHost(void* dst, const void* src, int64_t bytes) = 0;
  virtual void FromHost(void* dst, const void* src, int64_t bytes) = 0;
  // Forward pass: per-token losses on the device, summed into the step loss.
  virtual void AddLosses(const Buffer& losses, int64_t tokens) = 0;

  // Conveniences over the above.
  int32_t Index(const std::string& tensor) const;
  const planner::TensorSpec& Spec(const std::string& tensor) const;
  const planner::TensorSpec& InSpec(size_t i) const { return Spec(op().inputs[i]); }
  const planner::TensorSpec& OutSpec(size_t i) const { return Spec(op().outputs[i]); }
  Buffer In(size_t i) { return Value(Index(op().inputs[i])); }
  Buffer Out(size_t i) { return Value(Index(op().outputs[i])); }
  Buffer DOut(size_t i) { return Grad(Index(op().outputs[i])); }
  // Add-like backwards: dy copied into a fresh input gradient, added into a
  // started one.
  void PassThrough(size_t i, const Buffer& dy);
};

// A tensor as a row-major matrix: its last dimension by the rest.
struct Dims2 {
  int64_t rows = 1, cols = 1;
};
inline Dims2 RowsCols(const planner::TensorSpec& t) {
  Dims2 d;
  d.cols = t.shape.empty() ? 1 : t.shape.back();
  d.rows = d.cols == 0 ? 0 : Elements(t.shape) / d.cols;
  return d;
}

// op_impls_parallel.cc: the ops whose work divides over tensor- or
// context-parallel ranks (the whole op with tp = cp = 1).
void LinearFwd(OpContext& c);
void LinearBwd(OpContext& c);
void EmbeddingFwd(OpContext& c);
void EmbeddingBwd(OpContext& c);
void VocabParallelCrossEntropyFwd(OpContext& c, const Dims2& d);
void FlashAttentionFwd(OpContext& c);
void FlashAttentionBwd(OpContext& c);
// KDA's ops under context parallelism (op_impls.cc calls them with cp > 1;
// this rank's shapes).
void CpShortConvFwd(OpContext& c, const ParamState& w, int64_t batch, int64_t seq, int64_t channels);
void CpShortConvBwd(OpContext& c, const ParamState& w, int64_t batch, int64_t seq, int64_t channels);
void CpKdaFwd(OpContext& c, const kernels::KdaShape& local);
// Context parallelism's whole-sequence tensors in the plan's cp_comm buffer
// (a [groups, s, w] tensor per rank, [groups, s * cp, w] whole): slot k of
// them; every rank's `mine` gathered into slot k; and a whole-sequence
// gradient summed over the group with this rank's chunks written to `mine`.
float* CpWholeSlot(OpContext& c, int64_t groups, int64_t s, int64_t w, int slot);
const float* CpWhole(OpContext& c, const Buffer& mine, int64_t groups, int64_t s, int64_t w, int slot);
void CpKeepMine(OpContext& c, float* whole, int64_t groups, int64_t s, int64_t w, const Buffer& mine);
void CpKdaBwd(OpContext& c, const kernels::KdaShape& local);

// What an op's kernels need (op_sizes.cc), stated from the op's own
// arguments: per output, the element counts it may have (usually one;
// empty: not stated), and the backward's workspace bytes (-1: none).
struct KernelNeeds {
  std::vector<std::vector<int64_t>> outputs;
  int64_t workspace = -1;
};
KernelNeeds StateNeeds(OpContext& c);

using OpFn = void (*)(OpContext&);

struct OpImpl {
  OpFn forward = nullptr;
  OpFn backward = nullptr;
};

// The implementation of `kind`; both null when the runtime has none.
const OpImpl& GetOpImpl(planner::OpKind kind);

}  // namespace memplan::runtime::exec
