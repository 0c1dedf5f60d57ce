// Tensor parallelism (docs/runtime.md, "Tensor parallelism"): how a
// tp_split parameter's full tensor divides over the tensor-parallel ranks,
// the collectives of the tensor-parallel group, and the parameters whose
// gradients each rank only holds a part of; the context-parallel group's
// collectives (executor_impl.h).
#include "executor_impl.h"
#include "op_impls.h"

namespace memplan::runtime::exec {

bool Executor::TpSplit(const ParamState& ps) const { return model_.parallel.tp > 1 && ps.spec->tp_split; }

// The stored tensor as [rows, cols] (its last dimension by the rest). Rows
// divide for the row-parallel projections (attention's and KDA's output
// projection, an FFN's fc2) and the vocabulary's rows (the embedding, and
// a tied head's copy of it); columns otherwise, each segment of the columns
// on its own: [q | k | v] of a fused QKV, [gate | up] of a SwiGLU's fc1, so
// that each rank's columns are whole heads of each part in the order the
// kernels read them.
TpLayout Executor::TpLayoutOf(const ParamState& ps) const {
  TpLayout l;
  l.cols = ps.shape.empty() ? 1 : ps.shape.back();
  l.rows = Elements(ps.shape) / std::max<int64_t>(1, l.cols);
  const std::string& name = ps.spec->name;
  const auto kind = ps.spec->kind;
  l.by_rows = kind == planner::ParamKind::kEmbedding || ps.tied_head || name.ends_with("proj.weight") ||
              name.ends_with("fc2.weight");
  const auto& a = model_.arch;
  if (l.by_rows) {
    l.segments = {l.rows};
  } else if (name.ends_with("attn.qkv.weight")) {
    l.segments = {a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim};
  } else if (name.ends_with("fc1.weight") && a.ffn_act == planner::FfnAct::kSwiglu) {
    l.segments = {l.cols / 2, l.cols / 2};
  } else {
    l.segments = {l.cols};
  }
  return l;
}

namespace {

// Calls f(full index, local index) for every element of rank r's slice.
template <typename F>
void ForEachOfSlice(const TpLayout& l, int64_t t, int64_t r, F f) {
  if (l.by_rows) {
    const int64_t rows = l.rows / t;
    for (int64_t i = 0; i < rows * l.cols; ++i) f(r * rows * l.cols + i, i);
    return;
  }
  int64_t local_cols = 0;
  for (int64_t s : l.segments) local_cols += s / t;
  for (int64_t row = 0; row < l.rows; ++row) {
    int64_t seg_start = 0, local = 0;
    for (int64_t s : l.segments) {
      const int64_t part = s / t;
      for (int64_t c = 0; c < part; ++c) f(row * l.cols + seg_start + r * part + c, row * local_cols + local + c);
      seg_start += s;
      local += part;
    }
  }
}

}  // namespace

std::vector<float> Executor::TpSlice(const ParamState& ps, const std::vector<float>& full) const {
  const TpLayout l = TpLayoutOf(ps);
  std::vector<float> out(static_cast<size_t>(ps.elements));
  ForEachOfSlice(l, model_.parallel.tp, tp_rank_,
                 [&](int64_t f, int64_t i) { out[static_cast<size_t>(i)] = full[static_cast<size_t>(f)]; });
  return out;
}

std::vector<float> Executor::TpWhole(const ParamState& ps, const std::vector<float>& mine) {
  const int64_t t = model_.parallel.tp, n = ps.elements;
  std::vector<float> all(static_cast<size_t>(n * t)), full(static_cast<size_t>(n * t));
  tp_comm_->AllGatherBlocks(mine.data(), all.data(), n * 4);
  const TpLayout l = TpLayoutOf(ps);
  for (int64_t r = 0; r < t; ++r) {
    ForEachOfSlice(l, t, r, [&](int64_t f, int64_t i) {
      full[static_cast<size_t>(f)] = all[static_cast<size_t>(r * n + i)];
    });
  }
  return full;
}

// --- Collectives of a group (tensor- or context-parallel), through the host ---
// Every rank gathers every rank's block and sums them in rank order: the
// same bits on every rank and in every run.

// Every rank's n floats of `comm`'s group on the host, in rank order.
std::vector<float> Executor::GatherOver(Rank& r, Communicator& comm, const char* event, const float* data, int64_t n) {
  std::vector<float> mine(static_cast<size_t>(n)), all(static_cast<size_t>(n * comm.size()));
  backend_->ToHost(*r.dev, mine.data(), data, n * 4);
  comm.AllGatherBlocks(mine.data(), all.data(), n * 4);
  ++r.events[event];
  return all;
}

// Their sum in place: on cuda through NCCL on the ops' stream (NCCL's sums
// are not in rank order; every rank still gets the same bits).
void Executor::SumOver(Rank& r, Communicator& comm, DeviceCommunicator* nccl, const char* event, float* data,
                       int64_t n) {
  if (nccl != nullptr) {
    nccl->AllReduceSum(data, n, OpsStream(r));
    ++r.events[event];
    return;
  }
  std::vector<float> all = GatherOver(r, comm, event, data, n), sum(static_cast<size_t>(n), 0.f);
  for (int k = 0; k < comm.size(); ++k) {
    for (int64_t i = 0; i < n; ++i) sum[static_cast<size_t>(i)] += all[static_cast<size_t>(k * n + i)];
  }
  backend_->FromHost(*r.dev, data, sum.data(), n * 4);
}

std::vector<float> Executor::TpGather(Rank& r, const float* data, int64_t n) {
  return GatherOver(r, *tp_comm_, "tp_collectives", data, n);
}

// On cuda the sums, gathers and reduce-scatters run on the device buffers
// through NCCL, on the ops' stream.
void Executor::TpAllReduce(Rank& r, float* data, int64_t n) {
  SumOver(r, *tp_comm_, tp_nccl_.get(), "tp_collectives", data, n);
}

void Executor::TpAllGather(Rank& r, const float* mine, int64_t n, float* whole) {
  if (tp_nccl_) {
    // Each rank's block at its place, then every block to every rank.
    r.ops->Copy(whole + tp_rank_ * n, mine, n * 4);
    tp_nccl_->GatherRanges(whole, n * model_.parallel.tp, 4, OpsStream(r));
    ++r.events["tp_collectives"];
    return;
  }
  std::vector<float> all = TpGather(r, mine, n);
  backend_->FromHost(*r.dev, whole, all.data(), n * model_.parallel.tp * 4);
}

void Executor::TpReduceScatter(Rank& r, float* whole, int64_t n, float* mine) {
  const int64_t t = model_.parallel.tp;
  if (tp_nccl_) {
    // This rank's block of the sum lands in place in its copy.
    tp_nccl_->ReduceRanges(whole, n * t, OpsStream(r));
    r.ops->Copy(mine, whole + tp_rank_ * n, n * 4);
    ++r.events["tp_collectives"];
    return;
  }
  std::vector<float> all = TpGather(r, whole, n * t), sum(static_cast<size_t>(n), 0.f);
  for (int64_t k = 0; k < t; ++k) {
    const float* block = all.data() + (k * t + tp_rank_) * n;
    for (int64_t i = 0; i < n; ++i) sum[static_cast<size_t>(i)] += block[i];
  }
  backend_->FromHost(*r.dev, mine, sum.data(), n * 4);
}

// --- Partial gradients -------------------------------------------------------

// A parameter every tensor-parallel rank holds whole but that reads values
// which differ between them (a norm on the sequence-parallel tokens, KDA's
// gated norm on this rank's heads, a router on its tokens) gets a part of
// its gradient on each: summed over the group before the data-parallel
// reduction (Megatron's all-reduce of sequence-parallel parameters). A
// linear that gathers its sequence-parallel input computes its gradient
// whole on every rank.
void Executor::FindTpPartials() {
  if (model_.parallel.tp <= 1) return;
  for (int64_t l = 0; l < model_.arch.layers; ++l) {
    const LayerGraph& g = G(l);
    for (const auto& op : g.ops) {
      bool differs = false;
      for (const auto& in : op.inputs) {
        const std::string& s = g.FindTensor(in)->sharding;
        differs = differs || s == "tp" || s == "sp" || s == "tp_seq";
      }
      // A linear with fewer input rows than output rows gathers its input
      // (op_impls_parallel.cc, TpLinearOf).
      if (op.op == planner::OpKind::kLinear &&
          RowsCols(*g.FindTensor(op.inputs[0])).rows < RowsCols(*g.FindTensor(op.outputs[0])).rows) {
        differs = false;
      }
      if (!differs) continue;
      for (const auto& p : op.params) {
        const planner::ParamSpec* spec = nullptr;
        for (const auto& gp : g.params) {
          if (gp.name == p) spec = &gp;
        }
        if (spec != nullptr && !spec->tp_split) tp_partial_.insert(p);
      }
    }
  }
}

void Executor::ReduceTpPartial(Rank& r, ParamState& ps) {
  if (!tp_partial_.contains(ps.spec->name) || ps.grad.empty()) return;
  TpAllReduce(r, ps.grad.as<float>(), ps.elements);
}

// --- Context parallelism's collectives -----------------------------------------

std::vector<float> Executor::CpGather(Rank& r, const float* data, int64_t n) {
  return GatherOver(r, *cp_comm_, "cp_collectives", data, n);
}

void Executor::CpAllReduce(Rank& r, float* data, int64_t n) {
  SumOver(r, *cp_comm_, cp_nccl_.get(), "cp_collectives", data, n);
}

}  // namespace memplan::runtime::exec
