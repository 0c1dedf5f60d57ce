// Running one op of a layer: forward, backward, the re-materialization of
// recomputed values, and a layer's inputs (executor_impl.h).
#include "executor_impl.h"

namespace memplan::runtime::exec {

// --- Ops --------------------------------------------------------------------------------

struct Dims2 {
  int64_t rows = 1, cols = 1;
};
Dims2 RowsCols(const TensorSpec& t) {
  Dims2 d;
  d.cols = t.shape.empty() ? 1 : t.shape.back();
  d.rows = d.cols == 0 ? 0 : Elements(t.shape) / d.cols;
  return d;
}

void Executor::Forward(Rank& r, size_t bi, int32_t pos, const std::function<Buffer(int32_t)>& value, int32_t mb) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const OpSpec& op = g.ops[g.TopologicalOrder()[static_cast<size_t>(pos)]];
  kernels::Ops& k = *r.ops;
  auto idx = [&](const std::string& name) {
    const TensorSpec* t = g.FindTensor(name);
    return static_cast<int32_t>(t - g.tensors.data());
  };
  auto in = [&](size_t i) { return value(idx(op.inputs[i])); };
  auto out = [&](size_t i) { return value(idx(op.outputs[i])); };
  auto spec = [&](const std::string& name) -> const TensorSpec& { return *g.FindTensor(name); };
  const auto& a = model_.arch;
  const std::string& kind = op.kind;
  if (kind == "embedding") {
    const ParamState& w = Param(r, op);
    k.EmbeddingFwd(in(0).as<int32_t>(), w.weight.as<float>(), Elements(spec(op.inputs[0]).shape), a.hidden,
                   out(0).as<float>());
  } else if (kind == "dropout") {
    const TensorSpec& x = spec(op.inputs[0]);
    uint64_t offset = Fnv1a(op.outputs[1]) ^ (static_cast<uint64_t>(mb) << 48);
    k.DropoutFwd(in(0).as<float>(), Elements(x.shape), kDropoutP, options_.seed, offset, out(0).as<float>(),
                 out(1).as<uint8_t>());
  } else if (kind == "identity" || kind == "copy") {
    k.Copy(out(0).ptr, in(0).ptr, spec(op.outputs[0]).bytes);
  } else if (kind == "layernorm" || kind == "rmsnorm") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    const ParamState& gamma = Param(r, op);
    if (kind == "layernorm") {
      const ParamState& beta = Param(r, op, "bias");
      k.LayerNormFwd(in(0).as<float>(), gamma.weight.as<float>(), beta.weight.as<float>(), d.rows, d.cols,
                     kLayerNormEps, out(0).as<float>());
    } else {
      k.RmsNormFwd(in(0).as<float>(), gamma.weight.as<float>(), d.rows, d.cols, kRmsNormEps, out(0).as<float>());
    }
  } else if (kind == "linear") {
    const ParamState& w = Param(r, op);
    Dims2 x = RowsCols(spec(op.inputs[0]));
    Dims2 y = RowsCols(spec(op.outputs[0]));
    // A tied head reads the embedding matrix E [vocab, hidden]: logits = x E^T.
    bool tied = w.tied_head || w.spec->kind == planner::ParamKind::kEmbedding;
    k.Gemm(false, tied, x.rows, y.cols, x.cols, 1.f, in(0).as<float>(), w.weight.as<float>(), 0.f,
           out(0).as<float>(), nullptr);
  } else if (kind == "split_rope") {
    kernels::SplitShape sh{model_.train.micro_batch, model_.train.seq_len, a.heads, a.kv_heads, a.head_dim,
                           a.norm == planner::Norm::kRmsNorm};
    k.SplitHeadsFwd(in(0).as<float>(), sh, out(0).as<float>(), out(1).as<float>(), out(2).as<float>());
  } else if (kind == "batched_gemm") {
    int64_t b = model_.train.micro_batch, s = model_.train.seq_len, hq = a.heads, hkv = a.kv_heads,
            dh = a.head_dim, grp = hq / hkv;
    if (op.name.ends_with(".scores")) {
      float scale = 1.f / std::sqrt(static_cast<float>(dh));
      k.GemmStridedBatched(false, true, grp * s, s, dh, scale, in(0).as<float>(), dh, grp * s * dh,
                           in(1).as<float>(), dh, s * dh, 0.f, out(0).as<float>(), s, grp * s * s, b * hkv, nullptr);
    } else {  // pv: probs [b, hq, s, s] x v [b, hkv, s, dh] -> [b*s, hq*dh]
      for (int64_t bb = 0; bb < b; ++bb) {
        for (int64_t gq = 0; gq < hkv; ++gq) {
          const float* pr = in(0).as<float>() + (bb * hq + gq * grp) * s * s;
          const float* v = in(1).as<float>() + (bb * hkv + gq) * s * dh;
          float* o = out(0).as<float>() + bb * s * hq * dh + gq * grp * dh;
          k.GemmStridedBatched(false, false, s, dh, s, 1.f, pr, s, s * s, v, dh, 0, 0.f, o, hq * dh, dh, grp, nullptr);
        }
      }
    }
  } else if (kind == "softmax") {
    const TensorSpec& x = spec(op.inputs[0]);
    Dims2 d = RowsCols(x);
    bool attention = x.shape.size() == 4;
    k.SoftmaxFwd(in(0).as<float>(), d.rows, d.cols, 1.f, attention ? model_.train.seq_len : 0, out(0).as<float>());
  } else if (kind == "sigmoid") {
    k.SigmoidFwd(in(0).as<float>(), Elements(spec(op.inputs[0]).shape), out(0).as<float>());
  } else if (kind == "add") {
    k.Add(in(0).as<float>(), in(1).as<float>(), Elements(spec(op.outputs[0]).shape), out(0).as<float>());
  } else if (kind == "gelu") {
    k.GeluFwd(in(0).as<float>(), Elements(spec(op.inputs[0]).shape), out(0).as<float>());
  } else if (kind == "swiglu") {
    Dims2 y = RowsCols(spec(op.outputs[0]));
    k.SwigluFwd(in(0).as<float>(), y.rows, y.cols, out(0).as<float>());
  } else if (kind == "cross_entropy") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    k.CrossEntropyFwd(in(0).as<float>(), in(1).as<int32_t>(), d.rows, d.cols, out(0).as<float>(), out(1).as<float>());
    if (blk.forward) {
      std::vector<float> losses(static_cast<size_t>(d.rows));
      backend_->ToHost(*r.dev, losses.data(), out(1).ptr, d.rows * 4);
      for (float l : losses) loss_sum_ += l;
    }
  } else if (kind == "flash_attention") {
    kernels::AttentionShape sh{model_.train.micro_batch, a.heads, a.kv_heads, model_.train.seq_len, a.head_dim,
                               a.head_dim, 1.f / std::sqrt(static_cast<float>(a.head_dim)), true};
    sh.o_token_major = true;
    k.FlashAttentionFwd(sh, in(0).as<float>(), in(1).as<float>(), in(2).as<float>(), out(0).as<float>(),
                        out(1).as<float>());
  } else if (kind == "topk") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    k.TopKFwd(in(0).as<float>(), d.rows, d.cols, a.moe->top_k, kRouterRenormalize, out(0).as<int32_t>(),
              out(1).as<float>());
  } else if (kind == "dispatch") {
    const TensorSpec& x = spec(op.inputs[0]);
    Dims2 d = RowsCols(x);
    int64_t topk = a.moe->top_k;
    auto& offsets = r.routing[{blk.layer, mb}];
    offsets.assign(static_cast<size_t>(a.moe->experts + 1), 0);
    k.DispatchPlan(in(1).as<int32_t>(), d.rows, topk, a.moe->experts, out(1).as<int32_t>(), offsets.data());
    Buffer xs = out(0);
    k.DispatchFwd(in(0).as<float>(), out(1).as<int32_t>(), d.rows, topk, d.cols, xs.as<float>());
    int64_t used = d.rows * topk * d.cols * 4;
    if (spec(op.outputs[0]).bytes > used) k.Zero(xs.ptr + used, spec(op.outputs[0]).bytes - used);
  } else if (kind == "grouped_gemm") {
    const ParamState& w = Param(r, op);
    const auto& offsets = r.routing.at({blk.layer, mb});
    int64_t kin = w.shape[1], nout = w.shape[2];
    k.GroupedGemm(offsets.data(), a.moe->experts, kin, nout, in(0).as<float>(), w.weight.as<float>(),
                  out(0).as<float>(), nullptr);
  } else if (kind == "attn_res") {
    // Block AttnRes over sources [n, T, h]: h = sum_i softmax_i(w . RMSNorm(v_i)) v_i.
    Dims2 x = RowsCols(spec(op.outputs[0]));
    int64_t n = Elements(spec(op.inputs[0]).shape) / (x.rows * x.cols);
    auto [w, gamma] = AttnResParams(r, op);
    k.AttnResFwd(in(0).as<float>(), w->weight.as<float>(), gamma->weight.as<float>(), n, x.rows, x.cols, kRmsNormEps,
                 out(0).as<float>(), out(1).as<float>());
  } else if (kind == "attn_res_accumulate") {
    // next = [this layer's blocks, except a running partial block] + [partial + out].
    const TensorSpec& src = spec(op.inputs[0]);
    const TensorSpec& o = spec(op.inputs[1]);
    int64_t keep = src.bytes - (AttnResHasPartial(blk.layer) ? o.bytes : 0);
    Buffer next = out(0);
    k.Copy(next.ptr, in(0).ptr, keep);
    if (AttnResHasPartial(blk.layer)) {
      k.Add(reinterpret_cast<const float*>(in(0).ptr + keep), in(1).as<float>(), Elements(o.shape),
            reinterpret_cast<float*>(next.ptr + keep));
    } else {
      k.Copy(next.ptr + keep, in(1).ptr, o.bytes);
    }
  } else if (kind == "combine") {
    Dims2 o = RowsCols(spec(op.outputs[0]));
    k.CombineFwd(in(0).as<float>(), in(2).as<int32_t>(), in(1).as<float>(), o.rows, a.moe->top_k, o.cols,
                 out(0).as<float>());
  } else {
    MEMPLAN_CHECK(false, ("op kind " + kind + " is not executable").c_str());
  }
}

void Executor::Backward(Rank& r, size_t bi, int32_t pos) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const LayerBuffers& lb = LB(blk.layer);
  const OpSpec& op = g.ops[g.TopologicalOrder()[static_cast<size_t>(pos)]];
  kernels::Ops& k = *r.ops;
  auto idx = [&](const std::string& name) {
    return static_cast<int32_t>(g.FindTensor(name) - g.tensors.data());
  };
  auto spec = [&](const std::string& name) -> const TensorSpec& { return *g.FindTensor(name); };
  auto val = [&](const std::string& name) { return Value(r, bi, idx(name)); };
  auto dout = [&](size_t i) { return Grad(r, bi, idx(op.outputs[i])); };
  // An input gradient: written directly by the first backward that reaches
  // it, else into a temporary (summed by Finish).
  auto first_writer = [&](int32_t t) {
    return lb.last_use[static_cast<size_t>(t)] == pos && lb.export_to[static_cast<size_t>(t)] < 0;
  };
  auto din = [&](size_t i) {
    int32_t t = idx(op.inputs[i]);
    if (first_writer(t) || planner::GradAccumulates(op.op)) return Grad(r, bi, t);
    return BlockBuf(r, bi, BlockBuffer::Role::kGradTemp, t, pos);
  };
  auto finish = [&](size_t i) {
    int32_t t = idx(op.inputs[i]);
    if (first_writer(t)) return;
    Buffer temp = BlockBuf(r, bi, BlockBuffer::Role::kGradTemp, t, pos);
    k.Accumulate(Grad(r, bi, t).as<float>(), temp.as<float>(), Elements(spec(op.inputs[i]).shape));
  };
  // Add-like ops: copy into a fresh gradient, add into a started one.
  auto pass_through = [&](size_t i, const Buffer& dy) {
    int32_t t = idx(op.inputs[i]);
    Buffer dx = Grad(r, bi, t);
    int64_t n = Elements(spec(op.inputs[i]).shape);
    if (first_writer(t)) {
      k.Copy(dx.ptr, dy.ptr, n * 4);
    } else {
      k.Accumulate(dx.as<float>(), dy.as<float>(), n);
    }
  };
  const auto& a = model_.arch;
  const std::string& kind = op.kind;
  if (kind == "embedding") {
    const ParamState& w = Param(r, op);
    k.EmbeddingBwd(val(op.inputs[0]).as<int32_t>(), dout(0).as<float>(), Elements(spec(op.inputs[0]).shape), a.hidden,
                   w.grad.as<float>());
  } else if (kind == "dropout") {
    const TensorSpec& x = spec(op.inputs[0]);
    k.DropoutBwd(dout(0).as<float>(), val(op.outputs[1]).as<uint8_t>(), Elements(x.shape), kDropoutP,
                 din(0).as<float>());
    finish(0);
  } else if (kind == "identity" || kind == "copy") {
    pass_through(0, dout(0));
  } else if (kind == "add") {
    Buffer dy = dout(0);
    pass_through(0, dy);
    pass_through(1, dy);
  } else if (kind == "layernorm" || kind == "rmsnorm") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    const ParamState& gamma = Param(r, op);
    if (kind == "layernorm") {
      const ParamState& beta = Param(r, op, "bias");
      k.LayerNormBwd(val(op.inputs[0]).as<float>(), gamma.weight.as<float>(), dout(0).as<float>(), d.rows, d.cols,
                     kLayerNormEps, din(0).as<float>(), gamma.grad.as<float>(), beta.grad.as<float>());
    } else {
      k.RmsNormBwd(val(op.inputs[0]).as<float>(), gamma.weight.as<float>(), dout(0).as<float>(), d.rows, d.cols,
                   kRmsNormEps, din(0).as<float>(), gamma.grad.as<float>());
    }
    finish(0);
  } else if (kind == "linear") {
    const ParamState& w = Param(r, op);
    Dims2 x = RowsCols(spec(op.inputs[0]));
    Dims2 y = RowsCols(spec(op.outputs[0]));
    Buffer dy = dout(0);
    Buffer xv = val(op.inputs[0]);
    // dx = dy W^T; dW += x^T dy (a tied head stores E = W^T: dE += dy^T x).
    bool tied = w.tied_head || w.spec->kind == planner::ParamKind::kEmbedding;
    k.Gemm(false, !tied, x.rows, x.cols, y.cols, 1.f, dy.as<float>(), w.weight.as<float>(), 0.f,
           din(0).as<float>(), nullptr);
    if (tied) {
      k.Gemm(true, false, y.cols, x.cols, x.rows, 1.f, dy.as<float>(), xv.as<float>(), 1.f, w.grad.as<float>(), nullptr);
    } else {
      k.Gemm(true, false, x.cols, y.cols, x.rows, 1.f, xv.as<float>(), dy.as<float>(), 1.f, w.grad.as<float>(), nullptr);
    }
    finish(0);
  } else if (kind == "split_rope") {
    kernels::SplitShape sh{model_.train.micro_batch, model_.train.seq_len, a.heads, a.kv_heads, a.head_dim,
                           a.norm == planner::Norm::kRmsNorm};
    k.SplitHeadsBwd(dout(0).as<float>(), dout(1).as<float>(), dout(2).as<float>(), sh, din(0).as<float>());
    finish(0);
  } else if (kind == "batched_gemm") {
    int64_t b = model_.train.micro_batch, s = model_.train.seq_len, hq = a.heads, hkv = a.kv_heads,
            dh = a.head_dim, grp = hq / hkv;
    if (op.name.ends_with(".scores")) {
      float scale = 1.f / std::sqrt(static_cast<float>(dh));
      Buffer ds = dout(0), q = val(op.inputs[0]), kk = val(op.inputs[1]);
      Buffer dq = din(0), dk = din(1);
      // dq = scale dS k; dk = scale sum over the group's heads dS^T q.
      k.GemmStridedBatched(false, false, grp * s, dh, s, scale, ds.as<float>(), s, grp * s * s, kk.as<float>(), dh,
                           s * dh, 0.f, dq.as<float>(), dh, grp * s * dh, b * hkv, nullptr);
      k.GemmStridedBatched(true, false, s, dh, grp * s, scale, ds.as<float>(), s, grp * s * s, q.as<float>(), dh,
                           grp * s * dh, 0.f, dk.as<float>(), dh, s * dh, b * hkv, nullptr);
      finish(0);
      finish(1);
    } else {
      Buffer d_o = dout(0), pr = val(op.inputs[0]), v = val(op.inputs[1]);
      Buffer dp = din(0), dv = din(1);
      for (int64_t bb = 0; bb < b; ++bb) {
        for (int64_t gq = 0; gq < hkv; ++gq) {
          const float* dob = d_o.as<float>() + bb * s * hq * dh + gq * grp * dh;
          const float* vb = v.as<float>() + (bb * hkv + gq) * s * dh;
          const float* pb = pr.as<float>() + (bb * hq + gq * grp) * s * s;
          // dP_h = dO_h V^T; dV = sum_h P_h^T dO_h.
          k.GemmStridedBatched(false, true, s, s, dh, 1.f, dob, hq * dh, dh, vb, dh, 0, 0.f,
                               dp.as<float>() + (bb * hq + gq * grp) * s * s, s, s * s, grp, nullptr);
          for (int64_t h = 0; h < grp; ++h) {
            k.GemmStridedBatched(true, false, s, dh, s, 1.f, pb + h * s * s, s, 0, dob + h * dh, hq * dh, 0,
                                 h == 0 ? 0.f : 1.f, dv.as<float>() + (bb * hkv + gq) * s * dh, dh, 0, 1, nullptr);
          }
        }
      }
      finish(0);
      finish(1);
    }
  } else if (kind == "softmax" || kind == "sigmoid") {
    const TensorSpec& y = spec(op.outputs[0]);
    if (kind == "softmax") {
      Dims2 d = RowsCols(y);
      k.SoftmaxBwd(val(op.outputs[0]).as<float>(), dout(0).as<float>(), d.rows, d.cols, 1.f, din(0).as<float>());
    } else {
      k.SigmoidBwd(val(op.outputs[0]).as<float>(), dout(0).as<float>(), Elements(y.shape), din(0).as<float>());
    }
    finish(0);
  } else if (kind == "gelu") {
    k.GeluBwd(val(op.inputs[0]).as<float>(), dout(0).as<float>(), Elements(spec(op.inputs[0]).shape),
              din(0).as<float>());
    finish(0);
  } else if (kind == "swiglu") {
    Dims2 y = RowsCols(spec(op.outputs[0]));
    k.SwigluBwd(val(op.inputs[0]).as<float>(), dout(0).as<float>(), y.rows, y.cols, din(0).as<float>());
    finish(0);
  } else if (kind == "cross_entropy") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    float scale = 1.f / static_cast<float>(d.rows * model_.train.microbatches);
    k.CrossEntropyBwd(val(op.outputs[0]).as<float>(), val(op.inputs[1]).as<int32_t>(), d.rows, d.cols, scale,
                      din(0).as<float>());
    finish(0);
  } else if (kind == "flash_attention") {
    kernels::AttentionShape sh{model_.train.micro_batch, a.heads, a.kv_heads, model_.train.seq_len, a.head_dim,
                               a.head_dim, 1.f / std::sqrt(static_cast<float>(a.head_dim)), true};
    sh.o_token_major = true;
    Buffer ws = BlockBuf(r, bi, BlockBuffer::Role::kWorkspace, -1, pos);
    k.FlashAttentionBwd(sh, val(op.inputs[0]).as<float>(), val(op.inputs[1]).as<float>(), val(op.inputs[2]).as<float>(),
                        val(op.outputs[0]).as<float>(), val(op.outputs[1]).as<float>(), dout(0).as<float>(),
                        din(0).as<float>(), din(1).as<float>(), din(2).as<float>(), ws.ptr);
    finish(0);
    finish(1);
    finish(2);
  } else if (kind == "topk") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    k.TopKBwd(val(op.inputs[0]).as<float>(), val(op.outputs[0]).as<int32_t>(), val(op.outputs[1]).as<float>(),
              dout(1).as<float>(), d.rows, d.cols, a.moe->top_k, kRouterRenormalize, din(0).as<float>());
    finish(0);
  } else if (kind == "dispatch") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    k.DispatchBwd(dout(0).as<float>(), val(op.outputs[1]).as<int32_t>(), d.rows, a.moe->top_k, d.cols,
                  din(0).as<float>());
    finish(0);
  } else if (kind == "grouped_gemm") {
    const ParamState& w = Param(r, op);
    const auto& offsets = r.routing.at({blk.layer, blk.microbatch});
    k.GroupedGemmBwd(offsets.data(), a.moe->experts, w.shape[1], w.shape[2], val(op.inputs[0]).as<float>(),
                     w.weight.as<float>(), dout(0).as<float>(), din(0).as<float>(), w.grad.as<float>(), nullptr);
    finish(0);
    const TensorSpec& y = spec(op.outputs[0]);
    if (!y.saved && model_.options.moe_grad_rewrite && op.name.ends_with("experts_fc2")) {
      // SonicMoE: the router gradient from the activation, not the expert output.
      const OpSpec* comb = nullptr;
      for (const auto& o : g.ops) comb = o.kind == "combine" ? &o : comb;
      int32_t gates = idx(comb->inputs[1]);
      int32_t slot = idx(comb->inputs[2]);
      Dims2 o = RowsCols(spec(comb->outputs[0]));
      Dims2 act = RowsCols(spec(op.inputs[0]));
      // dS = <dA, A> / w: dA is the weighted rows' gradient (dW2 needs it).
      k.RouterGradRewrite(din(0).as<float>(), val(op.inputs[0]).as<float>(), Value(r, bi, slot).as<int32_t>(),
                          Value(r, bi, gates).as<float>(), o.rows, a.moe->top_k, act.cols,
                          Grad(r, bi, gates).as<float>());
    }
  } else if (kind == "attn_res") {
    Dims2 x = RowsCols(spec(op.outputs[0]));
    int64_t n = Elements(spec(op.inputs[0]).shape) / (x.rows * x.cols);
    auto [w, gamma] = AttnResParams(r, op);
    k.AttnResBwd(val(op.inputs[0]).as<float>(), w->weight.as<float>(), gamma->weight.as<float>(), dout(0).as<float>(),
                 n, x.rows, x.cols, kRmsNormEps, din(0).as<float>(), w->grad.as<float>(), gamma->grad.as<float>());
    finish(0);
  } else if (kind == "attn_res_accumulate") {
    // The blocks' gradients pass through; the partial block's reaches both
    // the earlier partial and this layer's output.
    const TensorSpec& src = spec(op.inputs[0]);
    const TensorSpec& o = spec(op.inputs[1]);
    bool partial = AttnResHasPartial(blk.layer);
    int64_t keep = src.bytes - (partial ? o.bytes : 0);
    Buffer dnext = dout(0);
    auto into = [&](size_t i, std::byte* dst_base, const std::byte* src_ptr, int64_t bytes) {
      if (first_writer(idx(op.inputs[i]))) {
        k.Copy(dst_base, src_ptr, bytes);
      } else {
        k.Accumulate(reinterpret_cast<float*>(dst_base), reinterpret_cast<const float*>(src_ptr), bytes / 4);
      }
    };
    Buffer dsrc = Grad(r, bi, idx(op.inputs[0]));
    into(0, dsrc.ptr, dnext.ptr, keep);
    if (partial) into(0, dsrc.ptr + keep, dnext.ptr + keep, o.bytes);
    into(1, Grad(r, bi, idx(op.inputs[1])).ptr, dnext.ptr + keep, o.bytes);
  } else if (kind == "combine") {
    Dims2 o = RowsCols(spec(op.outputs[0]));
    bool native = spec(op.inputs[0]).saved;
    k.CombineBwd(dout(0).as<float>(), val(op.inputs[2]).as<int32_t>(), val(op.inputs[1]).as<float>(),
                 native ? val(op.inputs[0]).as<float>() : nullptr, o.rows, a.moe->top_k, o.cols, din(0).as<float>(),
                 native ? din(1).as<float>() : nullptr);
    finish(0);
    if (native) finish(1);
  } else {
    MEMPLAN_CHECK(false, ("op kind " + kind + " is not executable").c_str());
  }
}

// Re-materializes a recomputed instance at its layer's backward: the
// producer chain runs again from saved tensors, its intermediates in the
// instance's extra buffer (planner: recompute_extra_bytes).
void Executor::Recompute(Rank& r, size_t bi, int32_t inst_index) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const LayerBuffers& lb = LB(blk.layer);
  const Instance& in = p_.instances[static_cast<size_t>(r.index)][static_cast<size_t>(inst_index)];
  const SavedTensor& st = p_.tensors[static_cast<size_t>(r.index)][static_cast<size_t>(in.tensor)];
  Buffer scratch = acts_->Scratch(r.index, inst_index);
  Buffer restored = acts_->Backward(r.index, inst_index);
  int64_t extra_used = 0;
  std::unordered_map<int32_t, Buffer> local;  // chain intermediates
  std::function<void(int32_t, Buffer)> make = [&](int32_t t, Buffer dst) {
    int32_t pos = lb.prod[static_cast<size_t>(t)];
    const OpSpec& op = g.ops[g.TopologicalOrder()[static_cast<size_t>(pos)]];
    std::vector<Buffer> ins;
    for (const auto& name : op.inputs) {
      int32_t u = static_cast<int32_t>(g.FindTensor(name) - g.tensors.data());
      if (g.tensors[static_cast<size_t>(u)].saved) continue;
      Buffer b{scratch.ptr + extra_used, -1, g.tensors[static_cast<size_t>(u)].bytes};
      extra_used += b.bytes;
      MEMPLAN_CHECK(extra_used <= scratch.bytes, "recompute chain outgrew its buffer");
      make(u, b);
      local[u] = b;
    }
    auto value = [&](int32_t u) -> Buffer {
      if (u == t) return dst;
      auto it = local.find(u);
      if (it != local.end()) return it->second;
      return BwdFull(r, blk.layer, u, blk.microbatch);
    };
    Forward(r, bi, pos, value, blk.microbatch);
  };
  make(st.graph_index, restored);
  ++r.events["recomputes"];
}

// At the first step of a layer's backward: prefetches are waited for, FP8
// payloads dequantized, recomputed instances re-made (in producer order).
void Executor::RestoreLayer(Rank& r, size_t bi) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  std::vector<std::pair<int64_t, int32_t>> recompute;
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    if (!g.tensors[t].saved) continue;
    int32_t i = InstIndex(blk.layer, static_cast<int32_t>(t), blk.microbatch);
    acts_->Restore(r.index, i);
    const Instance& in = p_.instances[static_cast<size_t>(r.index)][static_cast<size_t>(i)];
    if (assign_.storage[static_cast<size_t>(r.index)][static_cast<size_t>(in.tensor)] == Storage::kRecompute) {
      recompute.emplace_back(p_.tensors[static_cast<size_t>(r.index)][static_cast<size_t>(in.tensor)].prod_pos, i);
    }
  }
  std::sort(recompute.begin(), recompute.end());
  for (auto [pos, i] : recompute) Recompute(r, bi, i);
}

// A model input (tokens, targets) or a value received from the previous
// pipeline stage, written into `dst` at its block's first step.
void Executor::LoadInput(Rank& r, size_t bi, int32_t t, Buffer dst) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const TensorSpec& spec = G(blk.layer).tensors[static_cast<size_t>(t)];
  if (spec.producer.empty()) {
    const auto& src = spec.name.ends_with(".targets") ? targets_ : tokens_;
    backend_->FromHost(*r.dev, dst.ptr, src[static_cast<size_t>(blk.microbatch)].data(), spec.bytes);
    return;
  }
  int32_t chunk = p_.schedules[static_cast<size_t>(r.index)]
                      [static_cast<size_t>(p_.timelines[static_cast<size_t>(r.index)].step_pass[static_cast<size_t>(blk.first)])]
                          .chunk;
  int64_t stage = chunk * model_.parallel.pp + r.index;
  auto it = mailbox_.find({stage, blk.microbatch, true});
  MEMPLAN_CHECK(it != mailbox_.end(), "activation not received");
  MEMPLAN_CHECK(static_cast<int64_t>(it->second.size()) == spec.bytes, "received activation has the wrong size");
  backend_->FromHost(*r.dev, dst.ptr, it->second.data(), spec.bytes);
  mailbox_.erase(it);
}


}  // namespace memplan::runtime::exec
