// Private to the templates (templates.cc, templates_attn_res.cc): the
// builder that appends a layer's ops, tensors and parameters, the
// per-device dimensions, and the sublayers one file builds and the other
// uses (docs/templates.md).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/check.h"
#include "memplan/common/units.h"
#include "memplan/planner/graph.h"
#include "memplan/planner/program.h"
#include "memplan/planner/model.h"

namespace memplan::planner::templates_internal {

using Shape = std::vector<int64_t>;

inline int64_t Product(const Shape& shape, std::string_view what) {
  int64_t n = 1;
  for (int64_t d : shape) n = CheckedMul(n, d, what);
  return n;
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Appends ops, tensors and params of one layer, naming them
// layer<i>.<module>.<name>. Byte counts come from shape x dtype, so no
// template states a byte formula twice.
class Builder {
 public:
  Builder(const Model& model, int64_t layer, LayerGraph* graph)
      : model_(model), layer_(layer), g_(graph) {
    g_->index = layer;
    prefix_ = "layer" + std::to_string(layer) + ".";
  }

  std::string Name(std::string_view module, std::string_view name) const {
    return prefix_ + std::string(module) + "." + std::string(name);
  }

  // Declares a tensor and returns its full name.
  std::string Tensor(std::string_view module, std::string_view name, Shape shape, DType dtype,
                     bool saved, std::string_view sharding) {
    TensorSpec t;
    t.name = Name(module, name);
    t.module = std::string(module);
    t.bytes = CheckedMul(Product(shape, t.name), DTypeBytes(dtype), t.name);
    t.shape = std::move(shape);
    t.dtype = dtype;
    t.saved = saved;
    t.sharding = std::string(sharding);
    g_->tensors.push_back(std::move(t));
    return g_->tensors.back().name;
  }

  std::string Act(std::string_view module, std::string_view name, Shape shape, bool saved,
                  std::string_view sharding) {
    return Tensor(module, name, std::move(shape), model_.train.act_dtype, saved, sharding);
  }

  // Declares another (earlier) layer's saved tensor `name`, produced by
  // `producer` there, which this layer reads in place (Block AttnRes with a
  // single copy): it keeps its owner's name, so liveness links the two.
  std::string Shared(const std::string& name, std::string producer, Shape shape, std::string_view sharding) {
    for (const auto& t : g_->tensors) {
      if (t.name == name) return name;  // declared once, read by several ops
    }
    TensorSpec t;
    t.name = name;
    t.module = "attn_res";
    t.bytes = CheckedMul(Product(shape, t.name), DTypeBytes(model_.train.act_dtype), t.name);
    t.shape = std::move(shape);
    t.dtype = model_.train.act_dtype;
    t.producer = std::move(producer);
    t.sharding = std::string(sharding);
    g_->tensors.push_back(std::move(t));
    return g_->tensors.back().name;
  }

  void SetProducer(const std::string& tensor, std::string producer) {
    for (auto& t : g_->tensors) {
      if (t.name == tensor) t.producer = std::move(producer);
    }
  }

  void MarkSaved(const std::string& tensor, bool saved) {
    for (auto& t : g_->tensors) {
      if (t.name == tensor) t.saved = saved;
    }
  }

  int64_t BytesOf(const std::string& tensor) const {
    for (const auto& t : g_->tensors) {
      if (t.name == tensor) return t.bytes;
    }
    MEMPLAN_CHECK(false, "template references an undeclared tensor");
  }

  // `weight_bytes`: parameter bytes the op reads (GEMM weights).
  void Op(std::string_view module, std::string_view name, std::string_view kind,
          std::vector<std::string> inputs, std::vector<std::string> outputs, double flops,
          int64_t weight_bytes = 0) {
    OpSpec op;
    op.name = Name(module, name);
    op.kind = std::string(kind);
    op.module = std::string(module);
    op.bytes_read = weight_bytes;
    for (const auto& in : inputs) op.bytes_read += BytesOf(in);
    for (const auto& out : outputs) op.bytes_written += BytesOf(out);
    op.inputs = std::move(inputs);
    op.outputs = std::move(outputs);
    op.flops = flops;
    g_->ops.push_back(std::move(op));
  }

  // Workspace of the op declared last (its backward's scratch, from
  // common/workspace.h, the formulas the kernels use).
  void SetWorkspace(int64_t bytes) {
    const testing::PlannerMutation& m = testing::ActivePlannerMutation();  // tests only
    if (!m.workspace_kind.empty() && g_->ops.back().kind == m.workspace_kind) {
      bytes = static_cast<int64_t>(static_cast<double>(bytes) * m.workspace_factor);
    }
    g_->ops.back().workspace_bytes = bytes;
  }

  // Parameters of the op declared last, in its kind's role order
  // (op_registry.h), where its name does not give them.
  void SetParams(std::string_view module, std::vector<std::string_view> names) {
    auto& params = g_->ops.back().params;
    params.clear();
    for (auto n : names) params.push_back(Name(module, n));
  }

  // Declares a parameter; returns its per-device bytes (for op bytes_read).
  int64_t Param(std::string_view module, std::string_view name, Shape shape, ParamKind kind,
                bool tp_split) {
    ParamSpec p;
    p.name = Name(module, name);
    p.shape = std::move(shape);
    p.kind = kind;
    p.tp_split = tp_split;
    int64_t elements = p.Elements();
    if (tp_split) elements = CeilDiv(elements, model_.parallel.tp);
    if (kind == ParamKind::kExpert) elements = CeilDiv(elements, model_.parallel.ep);
    g_->params.push_back(std::move(p));
    return CheckedMul(elements, DTypeBytes(model_.train.param_dtype), "parameter bytes");
  }

  // Names what follows `prefix`<module>.<name> (multi-token prediction's
  // depths inside the last layer's graph).
  void SetPrefix(std::string prefix) { prefix_ = std::move(prefix); }
  // The op declared last reads these parameters (full names, declared in
  // this graph): a weight another module owns.
  void SetParamNames(std::vector<std::string> names) { g_->ops.back().params = std::move(names); }
  // The parameter declared last replicates another stage's (ParamSpec::copy).
  void MarkCopy() { g_->params.back().copy = true; }

  const Model& model() const { return model_; }
  int64_t layer() const { return layer_; }

 private:
  const Model& model_;
  int64_t layer_;
  LayerGraph* g_;
  std::string prefix_;
};

// Per-device dimensions shared by the templates.
struct Dims {
  int64_t s = 0;    // local sequence (seq_len / cp)
  int64_t skv = 0;  // keys attended by a local query (seq_len)
  int64_t b = 0;
  int64_t h = 0;
  int64_t t = 1;
  int64_t tokens = 0;    // s*b: tokens in TP regions
  int64_t tokens_r = 0;  // tokens in norm/dropout/residual regions (/t with SP)
  const char* shard_r = "replicated";  // sharding of the *_r regions
};

inline Dims MakeDims(const Model& m) {
  Dims d;
  d.s = m.train.seq_len / m.parallel.cp;
  d.skv = m.train.seq_len;
  d.b = m.train.micro_batch;
  d.h = m.arch.hidden;
  d.t = m.parallel.tp;
  d.tokens = CheckedMul(d.s, d.b, "tokens per microbatch");
  d.tokens_r = m.parallel.sp ? d.tokens / d.t : d.tokens;
  d.shard_r = m.parallel.sp ? "sp" : "replicated";
  return d;
}

inline double Gemm(int64_t m, int64_t k, int64_t n) {
  return 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n);
}

// templates.cc: a layer's attention sublayer (or KDA) on its input `x`
// (attn_norm.x), and its FFN sublayer (MLP or MoE) on `h2` (ffn_norm.x);
// each returns its output. With a standard residual between them:
// AddAttentionAndFfn, which returns the residual stream between them (h2)
// and the FFN's output, whose residual add the caller names.
std::string AddAttention(Builder& B, const Dims& d, const std::string& x, bool kda);
std::string AddFfn(Builder& B, const Dims& d, const std::string& h2, bool moe);
struct BlockParts {
  std::string h2, ffn_out, ffn_module;
};
BlockParts AddAttentionAndFfn(Builder& B, const Dims& d, const std::string& x, bool kda, bool moe);

// templates_attn_res.cc: Block AttnRes (docs/templates.md, "Block AttnRes").
int64_t AttnResSources(int64_t layer, int64_t block_layers);
std::string AddAttnResMix(Builder& B, const Dims& d, const std::string& module, const std::vector<std::string>& sources,
                          int64_t n, const std::string& norm_module);
std::vector<std::string> SingleCopySources(Builder& B, const Dims& d, int64_t layer, int64_t self);
std::string LayerInputProducer(int64_t layer, const Model& model);
std::string AddLayerOutput(Builder& B, const Dims& d, int64_t layer, const std::string& x, bool kda, bool moe);
std::string AddSublayerAttnRes(Builder& B, const Dims& d, int64_t layer, const std::string& x, bool kda, bool moe);

}  // namespace memplan::planner::templates_internal
