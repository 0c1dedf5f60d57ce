// What each op's kernels need, stated from the op's own arguments (its
// inputs' shapes, its parameters' shapes, the model's settings), never from
// the template's output shapes or common/workspace.h: the plan's sizes are a
// prediction the executor checks against these before every forward and
// backward (docs/runtime.md, "What each measurement sees").
#include <cmath>

#include "op_impls.h"

namespace memplan::runtime::exec {

namespace {

using planner::OpKind;

int64_t N(const planner::TensorSpec& t) { return Elements(t.shape); }

// y = x W, or x E^T for an embedding-shaped (tied) weight: the weight's
// output width, this rank's share of it when tensor parallelism splits it
// by columns (the input reads the whole width).
int64_t LinearWidth(OpContext& c, const ParamState& w, int64_t x_cols) {
  const bool transposed = w.tied_head || w.spec->kind == planner::ParamKind::kEmbedding;
  const int64_t in = transposed ? w.shape[1] : w.shape[0];
  const int64_t out = transposed ? w.shape[0] : w.shape[1];
  const bool column = c.tp_size() > 1 && w.spec->tp_split && x_cols == in;
  return column ? out / c.tp_size() : out;
}

}  // namespace

KernelNeeds StateNeeds(OpContext& c) {
  KernelNeeds n;
  const planner::Arch& a = c.model().arch;
  const planner::Train& train = c.model().train;
  const int64_t tp = c.tp_size(), cp = c.cp_size();
  const bool sp = c.model().parallel.sp && tp > 1;
  auto in = [&](size_t i) { return N(c.InSpec(i)); };
  auto one = [&](int64_t e) { n.outputs.push_back({e}); };
  switch (c.op().op) {
    case OpKind::kEmbedding: {
      // Vocabulary-parallel: every token's row, reduce-scattered over the
      // tokens under sequence parallelism.
      const int64_t tokens = in(0);
      one((sp ? tokens / tp : tokens) * a.hidden);
      break;
    }
    case OpKind::kLayerNorm:
    case OpKind::kRmsNorm:
    case OpKind::kGelu:
    case OpKind::kSigmoid:
    case OpKind::kSoftmax:
    case OpKind::kIdentity:
    case OpKind::kCopy:
    case OpKind::kAdd:
    case OpKind::kShortConv:
      one(in(0));
      break;
    case OpKind::kGatedRmsNorm:
      one(in(0));
      n.workspace = 2 * in(0) * 4;  // the normalized values and their gradient, fp32
      break;
    case OpKind::kDropout:
      one(in(0));
      one(in(0));  // the mask, a byte per element
      break;
    case OpKind::kSwiglu:
      one(in(0) / 2);
      break;
    case OpKind::kLinear: {
      const ParamState& w = c.Param(0);
      const Dims2 x = RowsCols(c.InSpec(0));
      const int64_t width = LinearWidth(c, w, x.cols);
      // Sequence parallelism: a linear gathers the tokens before it or
      // reduce-scatters them after it; which one is the layer's choice.
      if (sp) {
        n.outputs.push_back({x.rows * width, x.rows * tp * width, x.rows / tp * width});
      } else {
        one(x.rows * width);
      }
      break;
    }
    case OpKind::kGroupedGemm: {
      const ParamState& w = c.Param(0);  // [experts, in, out]
      one(RowsCols(c.InSpec(0)).rows * w.shape[2]);
      break;
    }
    case OpKind::kBatchedGemm: {
      const int64_t b = train.micro_batch, s = train.seq_len / cp, skv = train.seq_len;
      const int64_t hq = a.heads / tp, dh = a.head_dim;
      one(c.op().name.ends_with(".scores") ? b * hq * s * skv : b * s * hq * dh);
      break;
    }
    case OpKind::kSplitRope: {
      const int64_t bs = train.micro_batch * train.seq_len / cp;
      one(bs * a.heads / tp * a.head_dim);
      one(bs * a.kv_heads / tp * a.head_dim);
      one(bs * a.kv_heads / tp * a.head_dim);
      break;
    }
    case OpKind::kMlaSplit: {
      const auto& m = *a.mla;
      const int64_t bsh = train.micro_batch * train.seq_len / cp * (a.heads / tp);
      one(bsh * (m.qk_nope_head_dim + m.qk_rope_head_dim));
      one(bsh * (m.qk_nope_head_dim + m.qk_rope_head_dim));
      one(bsh * m.v_head_dim);
      break;
    }
    case OpKind::kFlashAttention: {
      // q [b, heads, s, dqk], v [b, kv_heads, s, dv]: o [b, s, heads, dv],
      // the log-sum-exp [b, heads, s]; the backward's D = rowsum(dO * O)
      // over the whole sequence (context parallelism gathers it), fp32.
      const auto& q = c.InSpec(0).shape;
      const auto& v = c.InSpec(2).shape;
      one(q[0] * q[1] * q[2] * v[3]);
      one(q[0] * q[1] * q[2]);
      n.workspace = q[0] * q[1] * q[2] * cp * 4;
      break;
    }
    case OpKind::kTopK: {
      const int64_t rows = RowsCols(c.InSpec(0)).rows;
      one(rows * a.moe->top_k);
      one(rows * a.moe->top_k);
      break;
    }
    case OpKind::kDispatch: {
      // Every token's top_k rows, held at this rank's capacity under the
      // routing assumption (Moe::RoutedRowsFactor: the EP skew or the
      // capacity factor), and the routing map.
      const Dims2 x = RowsCols(c.InSpec(0));
      const auto& moe = *a.moe;
      const auto rows = static_cast<int64_t>(
          std::ceil(static_cast<double>(x.rows * moe.top_k) * moe.RoutedRowsFactor(c.model().parallel.ep)));
      one(rows * x.cols);
      one(x.rows * moe.top_k);
      break;
    }
    case OpKind::kCombine:
      one(RowsCols(c.InSpec(1)).rows * RowsCols(c.InSpec(0)).cols);  // tokens x width
      break;
    case OpKind::kCrossEntropy: {
      const Dims2 logits = RowsCols(c.InSpec(0));
      one(logits.rows * logits.cols);  // probabilities
      one(logits.rows);                // per-token losses
      break;
    }
    case OpKind::kKdaChunked: {
      // q [T, heads*dk], v [T, heads*dv], beta [T, heads]; the states
      // [batch, heads, chunks, dk, dv]; the backward's per-chunk states and
      // one da_log partial per sequence and head.
      const auto& la = *a.linear_attention;
      const int64_t batch = train.micro_batch;
      const Dims2 q = RowsCols(c.InSpec(0));
      const int64_t heads = RowsCols(c.InSpec(4)).cols;
      const int64_t dk = q.cols / heads, dv = RowsCols(c.InSpec(2)).cols / heads;
      const int64_t seq = q.rows / batch, chunks = (seq + la.chunk - 1) / la.chunk;
      one(q.rows * heads * dv);
      one(batch * heads * chunks * dk * dv);
      n.workspace = (batch * heads * la.chunk * dk * dv + batch * heads) * 4;
      break;
    }
    case OpKind::kAttnRes: {
      // The blocks [T, h] each (or one input holding them back to back):
      // the mix [T, h] and each token's weights; the backward's partial
      // sums, one fp32 row of h per group of tokens, at most 256 groups.
      const int64_t tokens = train.micro_batch * train.seq_len / cp / (sp ? tp : 1);
      const size_t inputs = c.op().inputs.size();
      const int64_t blocks = inputs > 1 ? static_cast<int64_t>(inputs) : in(0) / (tokens * a.hidden);
      one(tokens * a.hidden);
      one(tokens * blocks);  // the weights
      n.workspace = std::min<int64_t>(tokens, 256) * a.hidden * 4;
      break;
    }
    case OpKind::kAttnResAccumulate:
      // The blocks passed on, joined by the output: a new block, or added
      // to the running partial one.
      n.outputs.push_back({in(0) + in(1), in(0)});
      break;
    default:
      break;
  }
  return n;
}

}  // namespace memplan::runtime::exec
