// The ops whose work divides over tensor- or context-parallel ranks
// (op_impls.h): linears, the embedding and the cross-entropy under tensor
// parallelism (docs/runtime.md, "Tensor parallelism"), flash attention
// under context parallelism ("Context parallelism"). With tp = cp = 1 each
// is the whole op.
#include <array>
#include <cmath>
#include <utility>

#include "op_impls.h"

namespace memplan::runtime::exec {

namespace {

const planner::Arch& A(OpContext& c) { return c.model().arch; }

// y = x W; a tied head stores the embedding E = W^T [vocab, hidden]: y = x E^T.
bool Transposed(const ParamState& w) { return w.tied_head || w.spec->kind == planner::ParamKind::kEmbedding; }

// From the tensors: q [b, heads, s, dqk], k [b, kv_heads, s, dqk], v [b,
// kv_heads, s, dv] (MLA: dqk = nope + rope, dv its own); scale 1/sqrt(dqk).
kernels::AttentionShape FlashShapeOf(OpContext& c) {
  const auto& q = c.InSpec(0).shape;
  const auto& k = c.InSpec(1).shape;
  const auto& v = c.InSpec(2).shape;
  kernels::AttentionShape sh{q[0], q[1], k[1], q[2], q[3], v[3], 1.f / std::sqrt(static_cast<float>(q[3])), true};
  sh.o_token_major = true;
  return sh;
}

}  // namespace

// --- Tensor parallelism --------------------------------------------------------------

// Vocabulary-parallel under tensor parallelism: each rank's tokens outside
// its rows are negative (Executor::LoadInput), its lookup adds zeros for
// them, and the ranks' outputs are summed (with sequence parallelism:
// reduce-scattered over the tokens).
void EmbeddingFwd(OpContext& c) {
  const ParamState& w = c.Param(0);
  const int64_t n = Elements(c.InSpec(0).shape), d = A(c).hidden;
  const bool scatter = RowsCols(c.OutSpec(0)).rows < n;
  Buffer out = scatter ? c.TpBuffer(0) : c.Out(0);
  c.k().EmbeddingFwd(c.In(0).as<int32_t>(), w.weight.as<float>(), n, d, out.as<float>());
  if (scatter) {
    c.TpReduceScatter(out, n / c.tp_size() * d, c.Out(0));
  } else if (c.tp_size() > 1) {
    c.TpAllReduce(out, n * d);
  }
}
void EmbeddingBwd(OpContext& c) {
  const ParamState& w = c.Param(0);
  const int64_t n = Elements(c.InSpec(0).shape), d = A(c).hidden;
  Buffer dy = c.DOut(0);
  if (RowsCols(c.OutSpec(0)).rows < n) {
    c.TpAllGather(dy, n / c.tp_size() * d, c.TpBuffer(0));
    dy = c.TpBuffer(0);
  }
  c.k().EmbeddingBwd(c.In(0).as<int32_t>(), dy.as<float>(), n, d, w.grad.as<float>());
}

// A linear under tensor parallelism (docs/runtime.md, "Tensor
// parallelism"), from its shapes: column-parallel (a tp_split weight that
// reads the whole input width: local output columns; its input gradient
// summed over the group), row-parallel (a tp_split weight that reads this
// rank's columns: its output summed over the group). With sequence
// parallelism a linear whose input has fewer rows (tokens) than its output
// gathers the input first and reduce-scatters its input gradient (a
// replicated weight's identical one: this rank's rows of it); a
// row-parallel one whose output has fewer rows reduce-scatters the output
// and gathers its gradient.
namespace {

struct TpLinear {
  bool column = false, row = false, gather = false, scatter = false;
};
TpLinear TpLinearOf(OpContext& c, const ParamState& w, const Dims2& x, const Dims2& y) {
  TpLinear t;
  if (c.tp_size() == 1) return t;
  const int64_t in_full = Transposed(w) ? w.shape[1] : w.shape[0];
  t.row = w.spec->tp_split && x.cols != in_full;
  t.column = w.spec->tp_split && !t.row;
  t.gather = x.rows < y.rows;
  t.scatter = t.row && y.rows < x.rows;
  return t;
}

}  // namespace

void LinearFwd(OpContext& c) {
  const ParamState& w = c.Param(0);
  Dims2 x = RowsCols(c.InSpec(0));
  Dims2 y = RowsCols(c.OutSpec(0));
  const TpLinear tp = TpLinearOf(c, w, x, y);
  Buffer in = c.In(0);
  if (tp.gather) {
    c.TpAllGather(in, x.rows * x.cols, c.TpBuffer(0));
    in = c.TpBuffer(0);
  }
  const int64_t rows = tp.gather ? y.rows : x.rows;
  Buffer out = tp.scatter ? c.TpBuffer(1) : c.Out(0);
  c.k().Gemm(false, Transposed(w), rows, y.cols, x.cols, 1.f, in.as<float>(), w.weight.as<float>(), 0.f,
             out.as<float>(), nullptr);
  if (tp.scatter) {
    c.TpReduceScatter(out, y.rows * y.cols, c.Out(0));
  } else if (tp.row) {
    c.TpAllReduce(out, y.rows * y.cols);
  }
}
void LinearBwd(OpContext& c) {
  const ParamState& w = c.Param(0);
  Dims2 x = RowsCols(c.InSpec(0));
  Dims2 y = RowsCols(c.OutSpec(0));
  const TpLinear tp = TpLinearOf(c, w, x, y);
  Buffer dy = c.DOut(0);
  Buffer xv = c.In(0);
  if (tp.gather) {
    c.TpAllGather(xv, x.rows * x.cols, c.TpBuffer(0));
    xv = c.TpBuffer(0);
  }
  if (tp.scatter) {
    c.TpAllGather(dy, y.rows * y.cols, c.TpBuffer(0));
    dy = c.TpBuffer(0);
  }
  const int64_t rows = tp.gather ? y.rows : x.rows;
  // dx = dy W^T; dW += x^T dy (a tied head: dE += dy^T x).
  const bool tied = Transposed(w);
  Buffer dx = tp.gather ? c.TpBuffer(1) : c.InputGrad(0);
  c.k().Gemm(false, !tied, rows, x.cols, y.cols, 1.f, dy.as<float>(), w.weight.as<float>(), 0.f, dx.as<float>(),
             nullptr);
  if (tied) {
    c.k().Gemm(true, false, y.cols, x.cols, rows, 1.f, dy.as<float>(), xv.as<float>(), 1.f, w.grad.as<float>(),
               nullptr);
  } else {
    c.k().Gemm(true, false, x.cols, y.cols, rows, 1.f, xv.as<float>(), dy.as<float>(), 1.f, w.grad.as<float>(),
               nullptr);
  }
  if (tp.gather && tp.column) {
    c.TpReduceScatter(dx, x.rows * x.cols, c.InputGrad(0));
  } else if (tp.gather) {
    c.k().Copy(c.InputGrad(0).ptr, dx.ptr + c.tp_rank() * x.rows * x.cols * 4, x.rows * x.cols * 4);
  } else if (tp.column) {
    c.TpAllReduce(dx, x.rows * x.cols);
  }
  c.FinishInputGrad(0);
}

// Vocabulary-parallel under tensor parallelism (Megatron's): each rank's
// max, sum and target logit over its columns (targets outside them are
// negative, Executor::LoadInput), combined over the group on the host in
// rank order (the same bits on every rank), then each rank's probabilities.
void VocabParallelCrossEntropyFwd(OpContext& c, const Dims2& d) {
  Buffer stats = c.TpBuffer(2);
  c.k().CrossEntropyPartialStats(c.In(0).as<float>(), c.In(1).as<int32_t>(), d.rows, d.cols, stats.as<float>());
  const std::vector<float> all = c.TpGather(stats, 3 * d.rows);
  const int64_t t = c.tp_size();
  std::vector<float> ms(static_cast<size_t>(2 * d.rows)), loss(static_cast<size_t>(d.rows));
  for (int64_t i = 0; i < d.rows; ++i) {
    float m = all[static_cast<size_t>(3 * i)], target = 0.f;
    for (int64_t k = 1; k < t; ++k) m = std::max(m, all[static_cast<size_t>(k * 3 * d.rows + 3 * i)]);
    float sum = 0.f;
    for (int64_t k = 0; k < t; ++k) {
      const float* st = all.data() + k * 3 * d.rows + 3 * i;
      sum += st[1] * std::exp(st[0] - m);
      target += st[2];
    }
    ms[static_cast<size_t>(2 * i)] = m;
    ms[static_cast<size_t>(2 * i + 1)] = sum;
    loss[static_cast<size_t>(i)] = std::log(sum) - (target - m);
  }
  c.FromHost(stats.ptr, ms.data(), 2 * d.rows * 4);
  c.FromHost(c.Out(1).ptr, loss.data(), d.rows * 4);
  c.k().CrossEntropyPartialProbs(c.In(0).as<float>(), stats.as<float>(), d.rows, d.cols, c.Out(0).as<float>());
}

// --- Context parallelism -------------------------------------------------------------

namespace {

// A tensor of `groups` runs of s positions (local) or S (the whole
// sequence), each position `w` floats: this rank's two chunks (c = s / 2
// positions each; kernels::CpPosition) between the two layouts, by device
// copies.
void CpCopy(OpContext& c, int64_t groups, int64_t s, int64_t w, const float* from, float* to, bool to_whole,
            int64_t rank) {
  const int64_t half = s / 2, whole = s * c.cp_size();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t part = 0; part < 2; ++part) {
      const int64_t local = (g * s + part * half) * w;
      const int64_t global = (g * whole + kernels::CpPosition(part * half, s, c.cp_size(), rank)) * w;
      c.k().Copy(to_whole ? to + global : to + local, to_whole ? from + local : from + global, half * w * 4);
    }
  }
}

// Every rank's chunks of a [groups, s, w] tensor gathered into the whole
// sequence's [groups, S, w] at `whole` (on the host, then one copy).
void CpGatherWhole(OpContext& c, const Buffer& mine, int64_t groups, int64_t s, int64_t w, float* whole) {
  const int64_t n = groups * s * w, cp = c.cp_size(), half = s / 2, full = s * cp;
  const std::vector<float> all = c.CpGather(mine, n);
  std::vector<float> host(static_cast<size_t>(n * cp));
  for (int64_t r = 0; r < cp; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t part = 0; part < 2; ++part) {
        const float* src = all.data() + r * n + (g * s + part * half) * w;
        const int64_t at = (g * full + kernels::CpPosition(part * half, s, cp, r)) * w;
        std::copy(src, src + half * w, host.begin() + at);
      }
    }
  }
  c.FromHost(whole, host.data(), n * cp * 4);
}

// Flash attention over the whole sequence in the plan's cp_comm buffer
// (planner::CpCommBytes, in its order): q, k, v, o, lse, then dO, dq, dk,
// dv; the backward's workspace is the op's (planned for the whole sequence).
struct CpAttention {
  kernels::AttentionShape local, whole;
  float *q, *k, *v, *o, *lse, *d_o, *dq, *dk, *dv;
};
CpAttention CarveCpAttention(OpContext& c) {
  CpAttention a;
  a.local = FlashShapeOf(c);
  a.whole = a.local;
  a.whole.s = a.local.s * c.cp_size();
  const auto& w = a.whole;
  const Buffer buf = c.CpBuffer();
  float* at = buf.as<float>();
  auto take = [&](int64_t n) {
    float* p = at;
    at += n;
    return p;
  };
  const int64_t nq = w.b * w.heads * w.s * w.dqk, nk = w.b * w.kv_heads * w.s * w.dqk;
  const int64_t nv = w.b * w.kv_heads * w.s * w.dv, no = w.b * w.s * w.heads * w.dv;
  a.q = take(nq);
  a.k = take(nk);
  a.v = take(nv);
  a.o = take(no);
  a.lse = take(w.b * w.heads * w.s);
  a.d_o = take(no);
  a.dq = take(nq);
  a.dk = take(nk);
  a.dv = take(nv);
  MEMPLAN_CHECK(reinterpret_cast<std::byte*>(at) <= buf.ptr + buf.bytes, "the plan's cp_comm buffer is too small");
  return a;
}

// This rank's queries at their places in the whole sequence (zeros
// elsewhere: rows whose output is discarded and whose gradient is zero),
// every rank's keys and values.
void CpWholeInputs(OpContext& c, CpAttention& a) {
  const auto& l = a.local;
  c.k().Zero(a.q, a.whole.b * a.whole.heads * a.whole.s * a.whole.dqk * 4);
  CpCopy(c, l.b * l.heads, l.s, l.dqk, c.In(0).as<float>(), a.q, true, c.cp_rank());
  CpGatherWhole(c, c.In(1), l.b * l.kv_heads, l.s, l.dqk, a.k);
  CpGatherWhole(c, c.In(2), l.b * l.kv_heads, l.s, l.dv, a.v);
}

// Context parallelism: this rank's queries attend to every rank's keys, as
// the causal attention over the whole sequence restricted to this rank's
// rows (docs/runtime.md, "Context parallelism").
void CpFlashAttentionFwd(OpContext& c) {
  CpAttention a = CarveCpAttention(c);
  const auto& l = a.local;
  CpWholeInputs(c, a);
  c.k().FlashAttentionFwd(a.whole, a.q, a.k, a.v, a.o, a.lse);
  CpCopy(c, l.b, l.s, l.heads * l.dv, a.o, c.Out(0).as<float>(), false, c.cp_rank());
  CpCopy(c, l.b * l.heads, l.s, 1, a.lse, c.Out(1).as<float>(), false, c.cp_rank());
}

// The keys' and values' gradients from every rank's queries are summed
// over the group; each rank keeps its chunks'.
void CpFlashAttentionBwd(OpContext& c) {
  CpAttention a = CarveCpAttention(c);
  const auto& l = a.local;
  const auto& w = a.whole;
  CpWholeInputs(c, a);
  const int64_t no = w.b * w.s * w.heads * w.dv;
  c.k().Zero(a.o, no * 4);
  c.k().Zero(a.d_o, no * 4);
  c.k().Zero(a.lse, w.b * w.heads * w.s * 4);
  CpCopy(c, l.b, l.s, l.heads * l.dv, c.Out(0).as<float>(), a.o, true, c.cp_rank());
  CpCopy(c, l.b, l.s, l.heads * l.dv, c.DOut(0).as<float>(), a.d_o, true, c.cp_rank());
  CpCopy(c, l.b * l.heads, l.s, 1, c.Out(1).as<float>(), a.lse, true, c.cp_rank());
  MEMPLAN_CHECK(c.Workspace().bytes >= workspace::FlashAttentionBwdBytes(w.b, w.heads, w.s),
                "flash attention's workspace is not planned for the whole sequence");
  c.k().FlashAttentionBwd(w, a.q, a.k, a.v, a.o, a.lse, a.d_o, a.dq, a.dk, a.dv, c.Workspace().ptr);
  CpCopy(c, l.b * l.heads, l.s, l.dqk, a.dq, c.InputGrad(0).as<float>(), false, c.cp_rank());
  CpKeepMine(c, a.dk, l.b * l.kv_heads, l.s, l.dqk, c.InputGrad(1));
  CpKeepMine(c, a.dv, l.b * l.kv_heads, l.s, l.dv, c.InputGrad(2));
  for (size_t i = 0; i < 3; ++i) c.FinishInputGrad(i);
}

}  // namespace

float* CpWholeSlot(OpContext& c, int64_t groups, int64_t s, int64_t w, int slot) {
  const int64_t n = groups * s * c.cp_size() * w;
  const Buffer buf = c.CpBuffer();
  MEMPLAN_CHECK((slot + 1) * n * 4 <= buf.bytes, "the plan's cp_comm buffer is too small");
  return buf.as<float>() + slot * n;
}

const float* CpWhole(OpContext& c, const Buffer& mine, int64_t groups, int64_t s, int64_t w, int slot) {
  float* whole = CpWholeSlot(c, groups, s, w, slot);
  CpGatherWhole(c, mine, groups, s, w, whole);
  return whole;
}

void CpKeepMine(OpContext& c, float* whole, int64_t groups, int64_t s, int64_t w, const Buffer& mine) {
  c.CpAllReduce(Buffer{reinterpret_cast<std::byte*>(whole), -1, 0}, groups * s * c.cp_size() * w);
  CpCopy(c, groups, s, w, whole, mine.as<float>(), false, c.cp_rank());
}

// KDA's short convolution and chunked delta rule under context
// parallelism, in the same gathered form: every rank's inputs gathered into
// the whole sequence, the op run over it, this rank's rows kept; in
// backward the output gradient of this rank's rows only, and the inputs'
// gradients summed over the group (the parameters' are summed with the
// dp x cp reduction).
void CpShortConvFwd(OpContext& c, const ParamState& w, int64_t batch, int64_t seq, int64_t channels) {
  float* x = c.CpBuffer().as<float>();
  float* y = x + batch * seq * c.cp_size() * channels;
  CpGatherWhole(c, c.In(0), batch, seq, channels, x);
  c.k().ShortConvFwd(x, w.weight.as<float>(), batch, seq * c.cp_size(), channels, w.shape[0], y);
  CpCopy(c, batch, seq, channels, y, c.Out(0).as<float>(), false, c.cp_rank());
}
void CpShortConvBwd(OpContext& c, const ParamState& w, int64_t batch, int64_t seq, int64_t channels) {
  const int64_t n = batch * seq * c.cp_size() * channels;
  float* x = c.CpBuffer().as<float>();
  float* dy = x + n;
  float* dx = dy + n;
  MEMPLAN_CHECK((3 * n) * 4 <= c.CpBuffer().bytes, "the plan's cp_comm buffer is too small");
  CpGatherWhole(c, c.In(0), batch, seq, channels, x);
  c.k().Zero(dy, n * 4);
  CpCopy(c, batch, seq, channels, c.DOut(0).as<float>(), dy, true, c.cp_rank());
  c.k().ShortConvBwd(x, w.weight.as<float>(), dy, batch, seq * c.cp_size(), channels, w.shape[0], dx,
                     w.grad.as<float>());
  CpKeepMine(c, dx, batch, seq, channels, c.InputGrad(0));
  c.FinishInputGrad(0);
}

namespace {

// The whole sequence's KDA tensors in cp_comm (planner::CpCommBytes):
// q, k, v, g [T, heads * dk], beta [T, heads], o, the per-chunk states, and
// in backward dO and the five inputs' gradients.
struct CpKda {
  kernels::KdaShape whole;
  float* in[5];
  float *o, *states, *d_o;
  float* grad[5];
};
// Each input's width per token: q, k, v, g [heads * d], beta [heads].
std::array<int64_t, 5> KdaWidths(const kernels::KdaShape& sh) {
  return {sh.heads * sh.dk, sh.heads * sh.dk, sh.heads * sh.dv, sh.heads * sh.dk, sh.heads};
}
CpKda CarveCpKda(OpContext& c, const kernels::KdaShape& local) {
  CpKda a;
  a.whole = local;
  a.whole.seq = local.seq * c.cp_size();
  const auto& w = a.whole;
  const Buffer buf = c.CpBuffer();
  float* at = buf.as<float>();
  const int64_t t = w.batch * w.seq;
  const auto width = KdaWidths(w);
  for (int i = 0; i < 5; ++i) a.in[i] = std::exchange(at, at + t * width[static_cast<size_t>(i)]);
  a.o = std::exchange(at, at + t * w.heads * w.dv);
  a.states = std::exchange(at, at + w.batch * w.heads * w.Chunks() * w.dk * w.dv);
  a.d_o = std::exchange(at, at + t * w.heads * w.dv);
  for (int i = 0; i < 5; ++i) a.grad[i] = std::exchange(at, at + t * width[static_cast<size_t>(i)]);
  MEMPLAN_CHECK(reinterpret_cast<std::byte*>(at) <= buf.ptr + buf.bytes, "the plan's cp_comm buffer is too small");
  return a;
}

void CpKdaInputs(OpContext& c, CpKda& a, const kernels::KdaShape& l) {
  const auto width = KdaWidths(l);
  for (size_t i = 0; i < 5; ++i) CpGatherWhole(c, c.In(i), l.batch, l.seq, width[i], a.in[i]);
}

}  // namespace

void CpKdaFwd(OpContext& c, const kernels::KdaShape& l) {
  CpKda a = CarveCpKda(c, l);
  CpKdaInputs(c, a, l);
  c.k().KdaFwd(a.in[0], a.in[1], a.in[2], a.in[3], a.in[4], c.Param(0).weight.as<float>(),
               c.Param(1).weight.as<float>(), a.whole, a.o, a.states);
  CpCopy(c, l.batch, l.seq, l.heads * l.dv, a.o, c.Out(0).as<float>(), false, c.cp_rank());
  // The saved states are this rank's chunks' (whole chunks: seq / 2 is a
  // multiple of the chunk, plan_binding.cc); the backward gathers them.
  CpCopy(c, l.batch * l.heads, l.Chunks(), l.dk * l.dv, a.states, c.Out(1).as<float>(), false, c.cp_rank());
}

void CpKdaBwd(OpContext& c, const kernels::KdaShape& l) {
  const ParamState& a_log = c.Param(0);
  const ParamState& dt_bias = c.Param(1);
  CpKda a = CarveCpKda(c, l);
  CpKdaInputs(c, a, l);
  // The whole sequence's states: every rank's saved chunks.
  CpGatherWhole(c, c.Out(1), l.batch * l.heads, l.Chunks(), l.dk * l.dv, a.states);
  const int64_t t = a.whole.batch * a.whole.seq;
  c.k().Zero(a.d_o, t * l.heads * l.dv * 4);
  CpCopy(c, l.batch, l.seq, l.heads * l.dv, c.DOut(0).as<float>(), a.d_o, true, c.cp_rank());
  c.k().KdaBwd(a.in[0], a.in[1], a.in[2], a.in[3], a.in[4], a_log.weight.as<float>(), dt_bias.weight.as<float>(),
               a.states, a.d_o, a.whole, a.grad[0], a.grad[1], a.grad[2], a.grad[3], a.grad[4], a_log.grad.as<float>(),
               dt_bias.grad.as<float>(), c.Workspace().as<float>());
  const auto width = KdaWidths(l);
  for (size_t i = 0; i < 5; ++i) {
    CpKeepMine(c, a.grad[i], l.batch, l.seq, width[i], c.InputGrad(i));
    c.FinishInputGrad(i);
  }
}

// --- Attention ---------------------------------------------------------------------

void FlashAttentionFwd(OpContext& c) {
  if (c.cp_size() > 1) return CpFlashAttentionFwd(c);
  c.k().FlashAttentionFwd(FlashShapeOf(c), c.In(0).as<float>(), c.In(1).as<float>(), c.In(2).as<float>(),
                          c.Out(0).as<float>(), c.Out(1).as<float>());
}
void FlashAttentionBwd(OpContext& c) {
  if (c.cp_size() > 1) return CpFlashAttentionBwd(c);
  c.k().FlashAttentionBwd(FlashShapeOf(c), c.In(0).as<float>(), c.In(1).as<float>(), c.In(2).as<float>(),
                          c.Out(0).as<float>(), c.Out(1).as<float>(), c.DOut(0).as<float>(),
                          c.InputGrad(0).as<float>(), c.InputGrad(1).as<float>(), c.InputGrad(2).as<float>(),
                          c.Workspace().ptr);
  for (size_t i = 0; i < 3; ++i) c.FinishInputGrad(i);
}

}  // namespace memplan::runtime::exec
