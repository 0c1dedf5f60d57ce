#include "op_impls.h"

#include "experts.h"

#include <array>
#include <cmath>

namespace memplan::runtime::exec {

int32_t OpContext::Index(const std::string& tensor) const {
  const planner::TensorSpec* t = graph().FindTensor(tensor);
  MEMPLAN_CHECK(t != nullptr, "op reads an undeclared tensor");
  return static_cast<int32_t>(t - graph().tensors.data());
}

const planner::TensorSpec& OpContext::Spec(const std::string& tensor) const {
  return graph().tensors[static_cast<size_t>(Index(tensor))];
}

void OpContext::PassThrough(size_t i, const Buffer& dy) {
  Buffer dx = Grad(Index(op().inputs[i]));
  const int64_t n = Elements(InSpec(i).shape);
  if (FirstWriter(i)) {
    k().Copy(dx.ptr, dy.ptr, n * 4);
  } else {
    k().Accumulate(dx.as<float>(), dy.as<float>(), n);
  }
}

namespace {

using planner::OpKind;


const planner::Arch& A(OpContext& c) { return c.model().arch; }

// --- Embedding, copies, elementwise -------------------------------------------------

// Under tensor and context parallelism each rank draws its part of the
// whole tensor's masks: each local row's mask is the whole tensor's row it
// holds (attention's probabilities [b, heads, s, skv]: this rank's heads and
// query positions; the residual stream [tokens, hidden]: its
// sequence-parallel rows of its context-parallel positions), drawn run by
// run of consecutive whole-tensor rows.
void DropoutFwd(OpContext& c) {
  const uint64_t offset = Fnv1a(c.op().outputs[1]) ^ (static_cast<uint64_t>(c.microbatch()) << 48);
  const planner::TensorSpec& x = c.InSpec(0);
  const int64_t n = Elements(x.shape);
  if (c.tp_size() == 1 && c.cp_size() == 1) {
    c.k().DropoutFwd(c.In(0).as<float>(), n, kDropoutP, c.seed(), offset, c.Out(0).as<float>(),
                     c.Out(1).as<uint8_t>());
    return;
  }
  const int64_t tp = c.tp_size(), tr = c.tp_rank(), cp = c.cp_size(), cr = c.cp_rank();
  const int64_t seq = c.model().train.seq_len, s = seq / cp;
  const bool heads = x.sharding == "tp" && x.shape.size() == 4;
  const int64_t cols = x.shape.back(), rows = n / cols;
  auto whole_row = [&](int64_t i) {
    if (heads) {
      const int64_t hl = x.shape[1], p = i % s, h = i / s % hl, bb = i / (s * hl);
      return (bb * hl * tp + tr * hl + h) * seq + kernels::CpPosition(p, s, cp, cr);
    }
    const int64_t local = x.sharding == "sp" ? tr * rows + i : i;  // its context-parallel rank's rows
    return local / s * seq + kernels::CpPosition(local % s, s, cp, cr);
  };
  for (int64_t i = 0; i < rows;) {
    const int64_t g = whole_row(i);
    int64_t len = 1;
    while (i + len < rows && whole_row(i + len) == g + len) ++len;
    c.k().DropoutFwd(c.In(0).as<float>() + i * cols, len * cols, kDropoutP, c.seed(), offset,
                     c.Out(0).as<float>() + i * cols, c.Out(1).as<uint8_t>() + i * cols, g * cols);
    i += len;
  }
}
void DropoutBwd(OpContext& c) {
  c.k().DropoutBwd(c.DOut(0).as<float>(), c.Out(1).as<uint8_t>(), Elements(c.InSpec(0).shape), kDropoutP,
                   c.InputGrad(0).as<float>());
  c.FinishInputGrad(0);
}

void CopyFwd(OpContext& c) {
  Buffer out = c.Out(0);
  c.k().Copy(out.ptr, c.In(0).ptr, out.bytes);
}
void CopyBwd(OpContext& c) { c.PassThrough(0, c.DOut(0)); }

void AddFwd(OpContext& c) {
  c.k().Add(c.In(0).as<float>(), c.In(1).as<float>(), Elements(c.OutSpec(0).shape), c.Out(0).as<float>());
}
void AddBwd(OpContext& c) {
  Buffer dy = c.DOut(0);
  c.PassThrough(0, dy);
  c.PassThrough(1, dy);
}

void GeluFwd(OpContext& c) { c.k().GeluFwd(c.In(0).as<float>(), Elements(c.InSpec(0).shape), c.Out(0).as<float>()); }
void GeluBwd(OpContext& c) {
  c.k().GeluBwd(c.In(0).as<float>(), c.DOut(0).as<float>(), Elements(c.InSpec(0).shape), c.InputGrad(0).as<float>());
  c.FinishInputGrad(0);
}

void SwigluFwd(OpContext& c) {
  Dims2 y = RowsCols(c.OutSpec(0));
  c.k().SwigluFwd(c.In(0).as<float>(), y.rows, y.cols, c.Out(0).as<float>());
}
void SwigluBwd(OpContext& c) {
  Dims2 y = RowsCols(c.OutSpec(0));
  c.k().SwigluBwd(c.In(0).as<float>(), c.DOut(0).as<float>(), y.rows, y.cols, c.InputGrad(0).as<float>());
  c.FinishInputGrad(0);
}

void SoftmaxFwd(OpContext& c) {
  const planner::TensorSpec& x = c.InSpec(0);
  Dims2 d = RowsCols(x);
  // Causal scores [b, heads, s, skv]: under context parallelism this rank's
  // query rows of the whole sequence's keys.
  const bool attention = x.shape.size() == 4;
  c.k().SoftmaxFwd(c.In(0).as<float>(), d.rows, d.cols, 1.f, attention ? x.shape[2] : 0, c.Out(0).as<float>(),
                   c.cp_size(), c.cp_rank());
}
void SoftmaxBwd(OpContext& c) {
  Dims2 d = RowsCols(c.OutSpec(0));
  c.k().SoftmaxBwd(c.Out(0).as<float>(), c.DOut(0).as<float>(), d.rows, d.cols, 1.f, c.InputGrad(0).as<float>());
  c.FinishInputGrad(0);
}

void SigmoidFwd(OpContext& c) {
  c.k().SigmoidFwd(c.In(0).as<float>(), Elements(c.InSpec(0).shape), c.Out(0).as<float>());
}
void SigmoidBwd(OpContext& c) {
  c.k().SigmoidBwd(c.Out(0).as<float>(), c.DOut(0).as<float>(), Elements(c.OutSpec(0).shape),
                   c.InputGrad(0).as<float>());
  c.FinishInputGrad(0);
}

// --- Norms and GEMMs ----------------------------------------------------------------

void LayerNormFwd(OpContext& c) {
  Dims2 d = RowsCols(c.InSpec(0));
  c.k().LayerNormFwd(c.In(0).as<float>(), c.Param(0).weight.as<float>(), c.Param(1).weight.as<float>(), d.rows,
                     d.cols, kLayerNormEps, c.Out(0).as<float>());
}
void LayerNormBwd(OpContext& c) {
  Dims2 d = RowsCols(c.InSpec(0));
  const ParamState& gamma = c.Param(0);
  const ParamState& beta = c.Param(1);
  c.k().LayerNormBwd(c.In(0).as<float>(), gamma.weight.as<float>(), c.DOut(0).as<float>(), d.rows, d.cols,
                     kLayerNormEps, c.InputGrad(0).as<float>(), gamma.grad.as<float>(), beta.grad.as<float>());
  c.FinishInputGrad(0);
}

void RmsNormFwd(OpContext& c) {
  Dims2 d = RowsCols(c.InSpec(0));
  c.k().RmsNormFwd(c.In(0).as<float>(), c.Param(0).weight.as<float>(), d.rows, d.cols, kRmsNormEps,
                   c.Out(0).as<float>());
}
void RmsNormBwd(OpContext& c) {
  Dims2 d = RowsCols(c.InSpec(0));
  const ParamState& gamma = c.Param(0);
  c.k().RmsNormBwd(c.In(0).as<float>(), gamma.weight.as<float>(), c.DOut(0).as<float>(), d.rows, d.cols, kRmsNormEps,
                   c.InputGrad(0).as<float>(), gamma.grad.as<float>());
  c.FinishInputGrad(0);
}


// --- Attention ----------------------------------------------------------------------

// This rank's heads (tp) and positions (cp: its two chunks of each sequence).
kernels::SplitShape SplitShapeOf(OpContext& c) {
  const auto& a = A(c);
  kernels::SplitShape sh{c.model().train.micro_batch, c.model().train.seq_len / c.cp_size(), a.heads / c.tp_size(),
                         a.kv_heads / c.tp_size(), a.head_dim, a.norm == planner::Norm::kRmsNorm};
  sh.cp = c.cp_size();
  sh.cp_rank = c.cp_rank();
  return sh;
}
void SplitRopeFwd(OpContext& c) {
  c.k().SplitHeadsFwd(c.In(0).as<float>(), SplitShapeOf(c), c.Out(0).as<float>(), c.Out(1).as<float>(),
                      c.Out(2).as<float>());
}
void SplitRopeBwd(OpContext& c) {
  c.k().SplitHeadsBwd(c.DOut(0).as<float>(), c.DOut(1).as<float>(), c.DOut(2).as<float>(), SplitShapeOf(c),
                      c.InputGrad(0).as<float>());
  c.FinishInputGrad(0);
}

// Standard attention's two batched GEMMs: scores = scale q k^T per kv group
// ([b, hq, s, skv]), and pv: probs [b, hq, s, skv] x v [b, hkv, skv, dh] ->
// [b*s, hq*dh]. s: this rank's queries per sequence; skv: the keys (the
// whole sequence: under context parallelism every rank's keys and values,
// gathered by CpWhole, docs/runtime.md "Context parallelism").
struct AttnDims {
  int64_t b, s, skv, hq, hkv, dh, grp;
};
AttnDims AttnDimsOf(OpContext& c) {
  const auto& a = A(c);
  const int64_t seq = c.model().train.seq_len;
  return {c.model().train.micro_batch, seq / c.cp_size(), seq, a.heads / c.tp_size(), a.kv_heads / c.tp_size(),
          a.head_dim, a.heads / a.kv_heads};
}
bool IsScores(OpContext& c) { return c.op().name.ends_with(".scores"); }

// The keys (scores) or values (pv) of the whole sequence, [b, hkv, skv, dh].
const float* WholeKeys(OpContext& c, const AttnDims& d) {
  if (c.cp_size() == 1) return c.In(1).as<float>();
  return CpWhole(c, c.In(1), d.b * d.hkv, d.s, d.dh, 0);
}
// Where their gradient goes: the input gradient, or under context
// parallelism a whole-sequence buffer summed over the group (CpKeepMine).
float* WholeKeysGrad(OpContext& c, const AttnDims& d) {
  if (c.cp_size() == 1) return c.InputGrad(1).as<float>();
  return CpWholeSlot(c, d.b * d.hkv, d.s, d.dh, 1);
}
void FinishKeysGrad(OpContext& c, const AttnDims& d, float* whole) {
  if (c.cp_size() > 1) CpKeepMine(c, whole, d.b * d.hkv, d.s, d.dh, c.InputGrad(1));
}

void BatchedGemmFwd(OpContext& c) {
  const AttnDims d = AttnDimsOf(c);
  auto [b, s, skv, hq, hkv, dh, grp] = d;
  const float* kv = WholeKeys(c, d);
  if (IsScores(c)) {
    const float scale = 1.f / std::sqrt(static_cast<float>(dh));
    c.k().GemmStridedBatched(false, true, grp * s, skv, dh, scale, c.In(0).as<float>(), dh, grp * s * dh, kv, dh,
                             skv * dh, 0.f, c.Out(0).as<float>(), skv, grp * s * skv, b * hkv, nullptr);
    return;
  }
  for (int64_t bb = 0; bb < b; ++bb) {
    for (int64_t gq = 0; gq < hkv; ++gq) {
      const float* pr = c.In(0).as<float>() + (bb * hq + gq * grp) * s * skv;
      const float* v = kv + (bb * hkv + gq) * skv * dh;
      float* o = c.Out(0).as<float>() + bb * s * hq * dh + gq * grp * dh;
      c.k().GemmStridedBatched(false, false, s, dh, skv, 1.f, pr, skv, s * skv, v, dh, 0, 0.f, o, hq * dh, dh, grp,
                               nullptr);
    }
  }
}
void BatchedGemmBwd(OpContext& c) {
  const AttnDims d = AttnDimsOf(c);
  auto [b, s, skv, hq, hkv, dh, grp] = d;
  const float* kv = WholeKeys(c, d);
  float* dkv = WholeKeysGrad(c, d);
  if (IsScores(c)) {
    const float scale = 1.f / std::sqrt(static_cast<float>(dh));
    Buffer ds = c.DOut(0), q = c.In(0);
    Buffer dq = c.InputGrad(0);
    // dq = scale dS k; dk = scale sum over the group's heads dS^T q.
    c.k().GemmStridedBatched(false, false, grp * s, dh, skv, scale, ds.as<float>(), skv, grp * s * skv, kv, dh,
                             skv * dh, 0.f, dq.as<float>(), dh, grp * s * dh, b * hkv, nullptr);
    c.k().GemmStridedBatched(true, false, skv, dh, grp * s, scale, ds.as<float>(), skv, grp * s * skv, q.as<float>(),
                             dh, grp * s * dh, 0.f, dkv, dh, skv * dh, b * hkv, nullptr);
  } else {
    Buffer d_o = c.DOut(0), pr = c.In(0);
    Buffer dp = c.InputGrad(0);
    for (int64_t bb = 0; bb < b; ++bb) {
      for (int64_t gq = 0; gq < hkv; ++gq) {
        const float* dob = d_o.as<float>() + bb * s * hq * dh + gq * grp * dh;
        const float* vb = kv + (bb * hkv + gq) * skv * dh;
        const float* pb = pr.as<float>() + (bb * hq + gq * grp) * s * skv;
        // dP_h = dO_h V^T; dV = sum_h P_h^T dO_h.
        c.k().GemmStridedBatched(false, true, s, skv, dh, 1.f, dob, hq * dh, dh, vb, dh, 0, 0.f,
                                 dp.as<float>() + (bb * hq + gq * grp) * s * skv, skv, s * skv, grp, nullptr);
        for (int64_t h = 0; h < grp; ++h) {
          c.k().GemmStridedBatched(true, false, skv, dh, s, 1.f, pb + h * s * skv, skv, 0, dob + h * dh, hq * dh, 0,
                                   h == 0 ? 0.f : 1.f, dkv + (bb * hkv + gq) * skv * dh, dh, 0, 1, nullptr);
        }
      }
    }
  }
  FinishKeysGrad(c, d, dkv);
  c.FinishInputGrad(0);
  c.FinishInputGrad(1);
}

// MLA: q_lin, kv, k_pe -> q, k, v (ops.h MlaShape).
kernels::MlaShape MlaShapeOf(OpContext& c) {
  const auto& a = A(c);
  const auto& m = *a.mla;
  kernels::MlaShape sh{c.model().train.micro_batch, c.model().train.seq_len / c.cp_size(), c.OutSpec(0).shape[1],
                       m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, kernels::MlaShape{}.rope_theta};
  sh.cp = c.cp_size();
  sh.cp_rank = c.cp_rank();
  return sh;
}
void MlaSplitFwd(OpContext& c) {
  c.k().MlaSplitFwd(c.In(0).as<float>(), c.In(1).as<float>(), c.In(2).as<float>(), MlaShapeOf(c),
                    c.Out(0).as<float>(), c.Out(1).as<float>(), c.Out(2).as<float>());
}
void MlaSplitBwd(OpContext& c) {
  c.k().MlaSplitBwd(c.DOut(0).as<float>(), c.DOut(1).as<float>(), c.DOut(2).as<float>(), MlaShapeOf(c),
                    c.InputGrad(0).as<float>(), c.InputGrad(1).as<float>(), c.InputGrad(2).as<float>());
  // k_pe is every head's: this rank's heads give a part of its gradient.
  if (c.tp_size() > 1) c.TpAllReduce(c.InputGrad(2), Elements(c.InSpec(2).shape));
  for (size_t i = 0; i < 3; ++i) c.FinishInputGrad(i);
}
// --- Loss ---------------------------------------------------------------------------

void CrossEntropyFwd(OpContext& c) {
  Dims2 d = RowsCols(c.InSpec(0));
  if (c.tp_size() > 1) {
    VocabParallelCrossEntropyFwd(c, d);
  } else {
    c.k().CrossEntropyFwd(c.In(0).as<float>(), c.In(1).as<int32_t>(), d.rows, d.cols, c.Out(0).as<float>(),
                          c.Out(1).as<float>());
  }
  if (c.forward_pass()) c.AddLosses(c.Out(1), d.rows);
}
void CrossEntropyBwd(OpContext& c) {
  Dims2 d = RowsCols(c.InSpec(0));
  // The mean over the global batch: every data-parallel replica's tokens.
  // Context parallelism: the rows are this rank's part of each sequence.
  const auto& par = c.model().parallel;
  const float scale = 1.f / static_cast<float>(d.rows * c.model().train.microbatches * par.dp * par.cp);
  c.k().CrossEntropyBwd(c.Out(0).as<float>(), c.In(1).as<int32_t>(), d.rows, d.cols, scale,
                        c.InputGrad(0).as<float>());
  c.FinishInputGrad(0);
}

// --- Mixture of experts -------------------------------------------------------------

// DeepSeek-V3's routing (docs/runtime.md, "MoE routing"), on the host:
// the top-k by score + bias (ties to the lower expert), the gates the
// selected unbiased scores, renormalized (summed best first), times
// routed_scaling. Without a bias or a scale the kernel's path, unchanged.
bool HostRouting(OpContext& c) { return A(c).moe->selection_bias || A(c).moe->routed_scaling != 1.0; }

void ScaleOnHost(OpContext& c, Buffer b, int64_t n, float s) {
  std::vector<float> h(static_cast<size_t>(n));
  c.ToHost(h.data(), b.ptr, n * 4);
  for (float& v : h) v *= s;
  c.FromHost(b.ptr, h.data(), n * 4);
}

void TopKFwd(OpContext& c) {
  Dims2 d = RowsCols(c.InSpec(0));
  const auto& moe = *A(c).moe;
  if (!HostRouting(c)) {
    c.k().TopKFwd(c.In(0).as<float>(), d.rows, d.cols, moe.top_k, kRouterRenormalize, c.Out(0).as<int32_t>(),
                  c.Out(1).as<float>());
    return;
  }
  const int64_t k = moe.top_k;
  std::vector<float> p(static_cast<size_t>(d.rows * d.cols));
  c.ToHost(p.data(), c.In(0).ptr, d.rows * d.cols * 4);
  const std::vector<float> zero(static_cast<size_t>(d.cols), 0.f);
  const std::vector<float>& bias = moe.selection_bias ? c.RouterBias() : zero;
  std::vector<int32_t> idx(static_cast<size_t>(d.rows * k));
  std::vector<float> w(static_cast<size_t>(d.rows * k));
  std::vector<int32_t> order(static_cast<size_t>(d.cols));
  for (int64_t t = 0; t < d.rows; ++t) {
    const float* row = p.data() + t * d.cols;
    for (int64_t e = 0; e < d.cols; ++e) order[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      const float sa = row[a] + bias[static_cast<size_t>(a)], sb = row[b] + bias[static_cast<size_t>(b)];
      return sa > sb || (sa == sb && a < b);
    });
    float sum = 0;
    for (int64_t i = 0; i < k; ++i) sum += row[order[static_cast<size_t>(i)]];
    for (int64_t i = 0; i < k; ++i) {
      const int32_t e = order[static_cast<size_t>(i)];
      idx[static_cast<size_t>(t * k + i)] = e;
      const float gate = kRouterRenormalize ? row[e] / sum : row[e];
      w[static_cast<size_t>(t * k + i)] = gate * static_cast<float>(moe.routed_scaling);
    }
  }
  c.FromHost(c.Out(0).ptr, idx.data(), d.rows * k * 4);
  c.FromHost(c.Out(1).ptr, w.data(), d.rows * k * 4);
  if (moe.selection_bias) c.NoteSelected(idx);
}
void TopKBwd(OpContext& c) {
  Dims2 d = RowsCols(c.InSpec(0));
  const auto& moe = *A(c).moe;
  if (moe.routed_scaling != 1.0) {
    // The kernel's backward for the unscaled gates: dL/dw = s dL/dw', w = w'/s.
    const int64_t n = d.rows * moe.top_k;
    ScaleOnHost(c, c.DOut(1), n, static_cast<float>(moe.routed_scaling));
    ScaleOnHost(c, c.Out(1), n, static_cast<float>(1.0 / moe.routed_scaling));
  }
  c.k().TopKBwd(c.In(0).as<float>(), c.Out(0).as<int32_t>(), c.Out(1).as<float>(), c.DOut(1).as<float>(), d.rows,
                d.cols, moe.top_k, kRouterRenormalize, c.InputGrad(0).as<float>());
  c.FinishInputGrad(0);
}

// Expert parallelism (experts.h): the routed rows of the dispatch's output
// and of the combine's input live on the expert side between the two.
bool ExpertParallel(OpContext& c) { return c.ep_size() > 1; }
int64_t LocalExperts(OpContext& c) { return A(c).moe->experts / c.ep_size(); }
// Whether this grouped GEMM's output is the combine's input (the experts'
// last GEMM): under EP its rows go back to the token side.
bool FeedsCombine(OpContext& c) {
  for (const auto& o : c.graph().ops) {
    if (o.op == OpKind::kCombine && o.inputs[0] == c.op().outputs[0]) return true;
  }
  return false;
}

void DispatchFwd(OpContext& c) {
  Dims2 d = RowsCols(c.InSpec(0));
  const auto& moe = *A(c).moe;
  Routing& rt = c.Routing();
  // Under EP the plan's offsets are this rank's rows by global expert; the
  // exchange makes the local experts' (experts.cc).
  auto& offsets = ExpertParallel(c) ? rt.token_offsets : rt.offsets;
  offsets.assign(static_cast<size_t>(moe.experts + 1), 0);
  c.k().DispatchPlan(c.In(1).as<int32_t>(), d.rows, moe.top_k, moe.experts, c.Out(1).as<int32_t>(), offsets.data());
  Buffer xs = c.Out(0);
  c.k().DispatchFwd(c.In(0).as<float>(), c.Out(1).as<int32_t>(), d.rows, moe.top_k, d.cols, xs.as<float>());
  // Rows past the routed ones (capacity the template reserves) are zero.
  const int64_t used = d.rows * moe.top_k * d.cols * 4;
  if (xs.bytes > used) c.k().Zero(xs.ptr + used, xs.bytes - used);
  if (ExpertParallel(c)) {
    DispatchToExperts(c, xs, d.cols);  // notes the routing with the experts' global counts
  } else if (c.forward_pass() && d.rows > 0) {
    int64_t most = 0;
    for (size_t e = 0; e + 1 < offsets.size(); ++e) most = std::max(most, offsets[e + 1] - offsets[e]);
    const double mean = static_cast<double>(d.rows * moe.top_k) / static_cast<double>(moe.experts);
    c.NoteRouting(static_cast<double>(most) / mean, 1.0);
  }
}
void DispatchBwd(OpContext& c) {
  Dims2 d = RowsCols(c.InSpec(0));
  if (ExpertParallel(c)) ToTokens(c, c.DOut(0), d.cols);
  c.k().DispatchBwd(c.DOut(0).as<float>(), c.Out(1).as<int32_t>(), d.rows, A(c).moe->top_k, d.cols,
                    c.InputGrad(0).as<float>());
  c.FinishInputGrad(0);
}

// The expert offsets DispatchFwd wrote for this layer and microbatch.
const std::vector<int64_t>& Offsets(OpContext& c) {
  const auto& offsets = c.Routing().offsets;
  MEMPLAN_CHECK(!offsets.empty(), "grouped GEMM before its layer's dispatch: no expert offsets");
  return offsets;
}

void GroupedGemmFwd(OpContext& c) {
  const ParamState& w = c.Param(0);
  c.k().GroupedGemm(Offsets(c).data(), LocalExperts(c), w.shape[1], w.shape[2], c.In(0).as<float>(),
                    w.weight.as<float>(), c.Out(0).as<float>(), nullptr);
  if (ExpertParallel(c) && FeedsCombine(c)) ToTokens(c, c.Out(0), w.shape[2]);
}
void GroupedGemmBwd(OpContext& c) {
  const ParamState& w = c.Param(0);
  const auto& a = A(c);
  if (ExpertParallel(c) && FeedsCombine(c)) ToExperts(c, c.DOut(0), w.shape[2]);
  c.k().GroupedGemmBwd(Offsets(c).data(), LocalExperts(c), w.shape[1], w.shape[2], c.In(0).as<float>(),
                       w.weight.as<float>(), c.DOut(0).as<float>(), c.InputGrad(0).as<float>(), w.grad.as<float>(),
                       nullptr);
  c.FinishInputGrad(0);
  if (c.OutSpec(0).saved || !c.model().options.moe_grad_rewrite || !c.op().name.ends_with("experts_fc2")) return;
  // SonicMoE: the router gradient from the activation, not the expert
  // output: dS = <dA, A> / w, dA being the weighted rows' gradient.
  const planner::OpSpec* comb = nullptr;
  for (const auto& o : c.graph().ops) comb = o.op == OpKind::kCombine ? &o : comb;
  MEMPLAN_CHECK(comb != nullptr, "the gradient rewrite needs the layer's combine");
  const int32_t gates = c.Index(comb->inputs[1]);
  const int32_t slot = c.Index(comb->inputs[2]);
  Dims2 o = RowsCols(c.Spec(comb->outputs[0]));
  Dims2 act = RowsCols(c.InSpec(0));
  if (ExpertParallel(c)) {
    RouterGradRewriteAcrossRanks(c, c.InputGrad(0), c.In(0), act.cols, c.ReadDeclaredBy(*comb, slot),
                                 c.ReadDeclaredBy(*comb, gates), o.rows, c.Grad(gates));
    return;
  }
  c.k().RouterGradRewrite(c.InputGrad(0).as<float>(), c.In(0).as<float>(), c.ReadDeclaredBy(*comb, slot).as<int32_t>(),
                          c.ReadDeclaredBy(*comb, gates).as<float>(), o.rows, a.moe->top_k, act.cols,
                          c.Grad(gates).as<float>());
}

void CombineFwd(OpContext& c) {
  Dims2 o = RowsCols(c.OutSpec(0));
  c.k().CombineFwd(c.In(0).as<float>(), c.In(2).as<int32_t>(), c.In(1).as<float>(), o.rows, A(c).moe->top_k, o.cols,
                   c.Out(0).as<float>());
}
void CombineBwd(OpContext& c) {
  Dims2 o = RowsCols(c.OutSpec(0));
  const bool native = c.InSpec(0).saved;  // else the gradient rewrite (GroupedGemmBwd) makes the gates' gradient
  c.k().CombineBwd(c.DOut(0).as<float>(), c.In(2).as<int32_t>(), c.In(1).as<float>(),
                   native ? c.In(0).as<float>() : nullptr, o.rows, A(c).moe->top_k, o.cols,
                   c.InputGrad(0).as<float>(), native ? c.InputGrad(1).as<float>() : nullptr);
  c.FinishInputGrad(0);
  if (native) c.FinishInputGrad(1);
}

// --- KDA --------------------------------------------------------------------------

// q [T, heads*dk] (T = batch * seq), v [T, heads*dv], beta [T, heads],
// states [batch, heads, chunks, dk, dv].
kernels::KdaShape KdaShapeOf(OpContext& c) {
  const planner::TensorSpec& q = c.InSpec(0);
  const planner::TensorSpec& beta = c.InSpec(4);
  const planner::TensorSpec& states = c.OutSpec(1);
  kernels::KdaShape sh;
  sh.batch = states.shape[0];
  sh.heads = beta.shape[1];
  sh.seq = q.shape[0] / sh.batch;
  sh.dk = q.shape[1] / sh.heads;
  sh.dv = c.InSpec(2).shape[1] / sh.heads;
  sh.chunk = c.model().arch.linear_attention->chunk;
  return sh;
}
void KdaFwd(OpContext& c) {
  if (c.cp_size() > 1) return CpKdaFwd(c, KdaShapeOf(c));
  c.k().KdaFwd(c.In(0).as<float>(), c.In(1).as<float>(), c.In(2).as<float>(), c.In(3).as<float>(),
               c.In(4).as<float>(), c.Param(0).weight.as<float>(), c.Param(1).weight.as<float>(), KdaShapeOf(c),
               c.Out(0).as<float>(), c.Out(1).as<float>());
}
void KdaBwd(OpContext& c) {
  if (c.cp_size() > 1) return CpKdaBwd(c, KdaShapeOf(c));
  const ParamState& a_log = c.Param(0);
  const ParamState& dt_bias = c.Param(1);
  c.k().KdaBwd(c.In(0).as<float>(), c.In(1).as<float>(), c.In(2).as<float>(), c.In(3).as<float>(),
               c.In(4).as<float>(), a_log.weight.as<float>(), dt_bias.weight.as<float>(), c.Out(1).as<float>(),
               c.DOut(0).as<float>(), KdaShapeOf(c), c.InputGrad(0).as<float>(), c.InputGrad(1).as<float>(),
               c.InputGrad(2).as<float>(), c.InputGrad(3).as<float>(), c.InputGrad(4).as<float>(),
               a_log.grad.as<float>(), dt_bias.grad.as<float>(), c.Workspace().as<float>());
  for (size_t i = 0; i < 5; ++i) c.FinishInputGrad(i);
}

// KDA's short convolution: x, y [batch * seq, channels], the weight
// [taps, channels] (taps = its global first dimension).
void ShortConvFwd(OpContext& c) {
  const Dims2 x = RowsCols(c.InSpec(0));
  const int64_t batch = c.model().train.micro_batch;
  if (c.cp_size() > 1) return CpShortConvFwd(c, c.Param(0), batch, x.rows / batch, x.cols);
  c.k().ShortConvFwd(c.In(0).as<float>(), c.Param(0).weight.as<float>(), batch, x.rows / batch, x.cols,
                     c.Param(0).shape[0], c.Out(0).as<float>());
}
void ShortConvBwd(OpContext& c) {
  const Dims2 x = RowsCols(c.InSpec(0));
  const int64_t batch = c.model().train.micro_batch;
  const ParamState& w = c.Param(0);
  if (c.cp_size() > 1) return CpShortConvBwd(c, w, batch, x.rows / batch, x.cols);
  c.k().ShortConvBwd(c.In(0).as<float>(), w.weight.as<float>(), c.DOut(0).as<float>(), batch, x.rows / batch, x.cols,
                     w.shape[0], c.InputGrad(0).as<float>(), w.grad.as<float>());
  c.FinishInputGrad(0);
}

// KDA's output norm per head (rows of dk): y = RMSNorm(o; w, 1e-5) * sigmoid(gate).
void GatedRmsNormFwd(OpContext& c) {
  const ParamState& w = c.Param(0);
  const int64_t n = Elements(c.InSpec(0).shape);
  c.k().RmsNormFwd(c.In(0).as<float>(), w.weight.as<float>(), n / w.elements, w.elements, kKdaGatedNormEps,
                   c.Out(0).as<float>());
  c.k().SigmoidGateFwd(c.Out(0).as<float>(), c.In(1).as<float>(), n, c.Out(0).as<float>());
}
// The normalized values are re-made into the workspace's first half, their
// gradient goes to its second half, then RMSNorm's backward.
void GatedRmsNormBwd(OpContext& c) {
  const ParamState& w = c.Param(0);
  const int64_t n = Elements(c.InSpec(0).shape);
  float* normed = c.Workspace().as<float>();
  float* dnormed = normed + n;
  c.k().RmsNormFwd(c.In(0).as<float>(), w.weight.as<float>(), n / w.elements, w.elements, kKdaGatedNormEps, normed);
  c.k().SigmoidGateBwd(normed, c.In(1).as<float>(), c.DOut(0).as<float>(), n, dnormed, c.InputGrad(1).as<float>());
  c.k().RmsNormBwd(c.In(0).as<float>(), w.weight.as<float>(), dnormed, n / w.elements, w.elements, kKdaGatedNormEps,
                   c.InputGrad(0).as<float>(), w.grad.as<float>());
  c.FinishInputGrad(0);
  c.FinishInputGrad(1);
}

// --- Block AttnRes ------------------------------------------------------------------

// Block AttnRes: h = sum_i softmax_i(w . RMSNorm(v_i)) v_i over the blocks
// v_i: the op's inputs, each a [T, h] block read in place (single copy), or
// one input holding all n blocks back to back.
struct AttnResBlocks {
  std::vector<const float*> src;
  std::vector<float*> grad;  // backward only
};
AttnResBlocks Blocks(OpContext& c, bool grads) {
  Dims2 x = RowsCols(c.OutSpec(0));
  AttnResBlocks b;
  const size_t inputs = c.op().inputs.size();
  const int64_t n = inputs > 1 ? static_cast<int64_t>(inputs) : Elements(c.InSpec(0).shape) / (x.rows * x.cols);
  for (int64_t i = 0; i < n; ++i) {
    const size_t in = inputs > 1 ? static_cast<size_t>(i) : 0;
    const int64_t at = inputs > 1 ? 0 : i * x.rows * x.cols;
    b.src.push_back(c.In(in).as<float>() + at);
    if (!grads) continue;
    // The backward adds into the blocks' gradients; one nobody wrote yet
    // starts at zero.
    Buffer g = c.InputGrad(in);
    if (at == 0 && c.FirstWriter(in)) c.k().Zero(g.ptr, g.bytes);
    b.grad.push_back(g.as<float>() + at);
  }
  return b;
}
void AttnResFwd(OpContext& c) {
  Dims2 x = RowsCols(c.OutSpec(0));
  AttnResBlocks b = Blocks(c, false);
  c.k().AttnResFwd(b.src.data(), static_cast<int64_t>(b.src.size()), c.Param(0).weight.as<float>(),
                   c.Param(1).weight.as<float>(), x.rows, x.cols, kRmsNormEps, c.Out(0).as<float>(),
                   c.Out(1).as<float>());
}
void AttnResBwd(OpContext& c) {
  Dims2 x = RowsCols(c.OutSpec(0));
  AttnResBlocks b = Blocks(c, true);
  const ParamState& w = c.Param(0);
  const ParamState& gamma = c.Param(1);
  c.k().AttnResBwd(b.src.data(), static_cast<int64_t>(b.src.size()), w.weight.as<float>(), gamma.weight.as<float>(),
                   c.DOut(0).as<float>(), x.rows, x.cols, kRmsNormEps, b.grad.data(), w.grad.as<float>(),
                   gamma.grad.as<float>(), c.Workspace().as<float>());
}

// Whether the sources end with a running partial block, which the output
// joins (next has as many blocks as the sources), or the output starts a
// new block (next has one more).
bool AttnResJoinsPartial(OpContext& c) { return Elements(c.OutSpec(0).shape) == Elements(c.InSpec(0).shape); }
// The sources' fp32 bytes that pass through unchanged: all but a running
// partial block (which the output is added to).
int64_t AttnResKeptBytes(OpContext& c) {
  return 4 * (Elements(c.InSpec(0).shape) - (AttnResJoinsPartial(c) ? Elements(c.InSpec(1).shape) : 0));
}

// next = [this layer's blocks, except a running partial block] + [partial + out].
void AttnResAccumulateFwd(OpContext& c) {
  const planner::TensorSpec& o = c.InSpec(1);
  const bool partial = AttnResJoinsPartial(c);
  const int64_t keep = AttnResKeptBytes(c);
  Buffer next = c.Out(0);
  Buffer in0 = c.In(0);
  c.k().Copy(next.ptr, in0.ptr, keep);
  if (partial) {
    c.k().Add(reinterpret_cast<const float*>(in0.ptr + keep), c.In(1).as<float>(), Elements(o.shape),
              reinterpret_cast<float*>(next.ptr + keep));
  } else {
    c.k().Copy(next.ptr + keep, c.In(1).ptr, 4 * Elements(o.shape));
  }
}
// The blocks' gradients pass through; the partial block's reaches both the
// earlier partial and this layer's output.
void AttnResAccumulateBwd(OpContext& c) {
  const planner::TensorSpec& o = c.InSpec(1);
  const bool partial = AttnResJoinsPartial(c);
  const int64_t keep = AttnResKeptBytes(c);
  Buffer dnext = c.DOut(0);
  auto into = [&](size_t i, std::byte* dst, const std::byte* from, int64_t bytes) {
    if (c.FirstWriter(i)) {
      c.k().Copy(dst, from, bytes);
    } else {
      c.k().Accumulate(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(from), bytes / 4);
    }
  };
  Buffer dsrc = c.Grad(c.Index(c.op().inputs[0]));
  into(0, dsrc.ptr, dnext.ptr, keep);
  if (partial) into(0, dsrc.ptr + keep, dnext.ptr + keep, 4 * Elements(o.shape));
  into(1, c.Grad(c.Index(c.op().inputs[1])).ptr, dnext.ptr + keep, 4 * Elements(o.shape));
}

std::array<OpImpl, static_cast<size_t>(OpKind::kCount)> MakeImpls() {
  std::array<OpImpl, static_cast<size_t>(OpKind::kCount)> t{};
  auto set = [&](OpKind k, OpFn f, OpFn b) { t[static_cast<size_t>(k)] = {f, b}; };
  set(OpKind::kEmbedding, EmbeddingFwd, EmbeddingBwd);
  set(OpKind::kDropout, DropoutFwd, DropoutBwd);
  set(OpKind::kIdentity, CopyFwd, CopyBwd);
  set(OpKind::kCopy, CopyFwd, CopyBwd);
  set(OpKind::kAdd, AddFwd, AddBwd);
  set(OpKind::kGelu, GeluFwd, GeluBwd);
  set(OpKind::kSwiglu, SwigluFwd, SwigluBwd);
  set(OpKind::kSoftmax, SoftmaxFwd, SoftmaxBwd);
  set(OpKind::kSigmoid, SigmoidFwd, SigmoidBwd);
  set(OpKind::kLayerNorm, LayerNormFwd, LayerNormBwd);
  set(OpKind::kRmsNorm, RmsNormFwd, RmsNormBwd);
  set(OpKind::kLinear, LinearFwd, LinearBwd);
  set(OpKind::kSplitRope, SplitRopeFwd, SplitRopeBwd);
  set(OpKind::kMlaSplit, MlaSplitFwd, MlaSplitBwd);
  set(OpKind::kBatchedGemm, BatchedGemmFwd, BatchedGemmBwd);
  set(OpKind::kFlashAttention, FlashAttentionFwd, FlashAttentionBwd);
  set(OpKind::kCrossEntropy, CrossEntropyFwd, CrossEntropyBwd);
  set(OpKind::kTopK, TopKFwd, TopKBwd);
  set(OpKind::kDispatch, DispatchFwd, DispatchBwd);
  set(OpKind::kGroupedGemm, GroupedGemmFwd, GroupedGemmBwd);
  set(OpKind::kCombine, CombineFwd, CombineBwd);
  set(OpKind::kKdaChunked, KdaFwd, KdaBwd);
  set(OpKind::kShortConv, ShortConvFwd, ShortConvBwd);
  set(OpKind::kGatedRmsNorm, GatedRmsNormFwd, GatedRmsNormBwd);
  set(OpKind::kAttnRes, AttnResFwd, AttnResBwd);
  set(OpKind::kAttnResAccumulate, AttnResAccumulateFwd, AttnResAccumulateBwd);
  return t;
}

}  // namespace

const OpImpl& GetOpImpl(planner::OpKind kind) {
  static const auto impls = MakeImpls();
  static const OpImpl none{};
  const size_t i = static_cast<size_t>(kind);
  return i < impls.size() ? impls[i] : none;
}

}  // namespace memplan::runtime::exec
