#include "memplan/planner/templates.h"


#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "memplan/common/check.h"
#include "memplan/common/units.h"
#include "memplan/common/workspace.h"
#include "memplan/planner/program.h"
#include "memplan/planner/target.h"
#include "template_builder.h"

namespace memplan::planner {
namespace templates_internal {

// Norm over the residual stream: saves its input (`x`, given) and its output
// (the next GEMM's input). rstd/mean are recomputed from the input in
// backward (one reduction), as Korthikanti et al. assume.
std::string AddNorm(Builder& B, const Dims& d, std::string_view module, const std::string& x,
                    const std::string& out_module, std::string_view out_name, bool out_saved) {
  const Arch& a = B.model().arch;
  bool layernorm = a.norm == Norm::kLayerNorm;
  int64_t wbytes = B.Param(module, "weight", {d.h}, ParamKind::kNorm, false);
  if (layernorm) wbytes += B.Param(module, "bias", {d.h}, ParamKind::kNorm, false);
  std::string y = B.Act(out_module, out_name, {d.tokens_r, d.h}, out_saved, d.shard_r);
  B.Op(module, "norm", layernorm ? "layernorm" : "rmsnorm", {x}, {y},
       (layernorm ? 8.0 : 4.0) * static_cast<double>(d.tokens_r * d.h), wbytes);
  return y;
}

// Dropout on the residual stream: a 1-byte mask is saved.
std::string AddResidualDropout(Builder& B, const Dims& d, std::string_view module,
                               const std::string& x) {
  std::string mask = B.Tensor(module, "dropout_mask", {d.tokens_r, d.h}, DType::kU8, true, d.shard_r);
  std::string y = B.Act(module, "dropout_out", {d.tokens_r, d.h}, false, d.shard_r);
  B.Op(module, "dropout", "dropout", {x}, {y, mask}, 2.0 * static_cast<double>(d.tokens_r * d.h));
  return y;
}

// Core attention from saved q, k, v; returns the context (projection input).
// standard: scores -> softmax (saved) [-> dropout: mask + output saved] -> PV.
// flash: only the output and the log-sum-exp are saved.
std::string AddAttentionCore(Builder& B, const Dims& d, std::string_view module,
                             const std::string& q, const std::string& k, const std::string& v,
                             int64_t heads_local, int64_t qk_dim, int64_t v_dim) {
  const Arch& a = B.model().arch;
  Shape prob_shape{d.b, heads_local, d.s, d.skv};
  double score_flops = Gemm(d.b * heads_local * d.s, qk_dim, d.skv);
  double pv_flops = Gemm(d.b * heads_local * d.s, d.skv, v_dim);
  if (a.attention == Attention::kFlash) {
    std::string out = B.Act(module, "out", {d.tokens, heads_local * v_dim}, true, "tp");
    std::string lse = B.Tensor(module, "lse", {d.b, heads_local, d.s}, DType::kFP32, true, "tp");
    B.Op(module, "flash", "flash_attention", {q, k, v}, {out, lse}, score_flops + pv_flops);
    // Under context parallelism the runtime's backward runs over the whole
    // sequence (docs/runtime.md, "Context parallelism"): its workspace too.
    B.SetWorkspace(workspace::FlashAttentionBwdBytes(d.b, heads_local, d.skv));
    return out;
  }
  std::string scores = B.Act(module, "scores", prob_shape, false, "tp");
  B.Op(module, "scores", "batched_gemm", {q, k}, {scores}, score_flops);
  std::string probs = B.Act(module, "softmax_out", prob_shape, true, "tp");
  B.Op(module, "softmax", "softmax", {scores}, {probs},
       5.0 * static_cast<double>(Product(prob_shape, "scores")));
  // Its backward's score gradients are the block buffers of d(scores) and
  // d(softmax_out): no workspace beyond them.
  if (a.dropout) {
    std::string mask = B.Tensor(module, "attn_dropout_mask", prob_shape, DType::kU8, true, "tp");
    std::string dropped = B.Act(module, "probs", prob_shape, true, "tp");
    B.Op(module, "attn_dropout", "dropout", {probs}, {dropped, mask},
         2.0 * static_cast<double>(Product(prob_shape, "probs")));
    probs = dropped;
  }
  std::string ctx = B.Act(module, "proj_in", {d.tokens, heads_local * v_dim}, true, "tp");
  B.Op(module, "pv", "batched_gemm", {probs, v}, {ctx}, pv_flops);
  return ctx;
}

// Output projection back to the residual stream (+ dropout).
std::string AddOutputProjection(Builder& B, const Dims& d, std::string_view module,
                                const std::string& ctx, int64_t in_full) {
  int64_t in_local = in_full / d.t;
  int64_t w = B.Param(module, "proj.weight", {in_full, d.h}, ParamKind::kLinear, true);
  std::string out = B.Act(module, "proj_out", {d.tokens_r, d.h}, false, d.shard_r);
  B.Op(module, "proj", "linear", {ctx}, {out}, Gemm(d.tokens, in_local, d.h), w);
  if (B.model().arch.dropout) out = AddResidualDropout(B, d, module, out);
  return out;
}

// gpt / llama attention (MHA or GQA). `x_in` is the normed input.
std::string AddStandardAttention(Builder& B, const Dims& d, const std::string& x_in) {
  const Arch& a = B.model().arch;
  int64_t hq = a.heads / d.t;
  int64_t hkv = a.kv_heads / d.t;
  int64_t qkv_full = (a.heads + 2 * a.kv_heads) * a.head_dim;
  int64_t w = B.Param("attn", "qkv.weight", {d.h, qkv_full}, ParamKind::kLinear, true);
  std::string qkv = B.Act("attn", "qkv", {d.tokens, qkv_full / d.t}, false, "tp");
  B.Op("attn", "qkv", "linear", {x_in}, {qkv}, Gemm(d.tokens, d.h, qkv_full / d.t), w);
  std::string q = B.Act("attn", "q", {d.b, hq, d.s, a.head_dim}, true, "tp");
  std::string k = B.Act("attn", "k", {d.b, hkv, d.s, a.head_dim}, true, "tp");
  std::string v = B.Act("attn", "v", {d.b, hkv, d.s, a.head_dim}, true, "tp");
  // Split (and RoPE for llama-style models) is elementwise on q and k.
  B.Op("attn", "split", "split_rope", {qkv}, {q, k, v},
       4.0 * static_cast<double>(d.tokens * (a.heads + a.kv_heads) * a.head_dim / d.t));
  std::string ctx = AddAttentionCore(B, d, "attn", q, k, v, hq, a.head_dim, a.head_dim);
  return AddOutputProjection(B, d, "attn", ctx, a.heads * a.head_dim);
}

// Multi-head latent attention (DeepSeek-V2/V3). Down-projections are not
// tensor-parallel; up-projections and the output projection are.
std::string AddMlaAttention(Builder& B, const Dims& d, const std::string& x_in) {
  const Arch& a = B.model().arch;
  const MlaConfig& m = *a.mla;
  int64_t hq = a.heads / d.t;
  int64_t qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
  std::string q_src = x_in;
  int64_t q_in = d.h;
  // Where the target runs the down-projections on the sequence-parallel
  // shard, their outputs are saved there (target.h, docs/targets.md);
  // memplan's runtime computes them on every token.
  const bool local = GetTarget(B.model().target.kind).MlaDownProjectionsOnShard();
  const int64_t down_rows = local ? d.tokens_r : d.tokens;
  const std::string down_shard = local ? d.shard_r : "replicated";
  if (m.q_lora_rank > 0) {
    int64_t w = B.Param("attn", "q_a.weight", {d.h, m.q_lora_rank}, ParamKind::kLinear, false);
    std::string qa = B.Act("attn", "q_a", {down_rows, m.q_lora_rank}, true, down_shard);
    B.Op("attn", "q_a", "linear", {x_in}, {qa}, Gemm(d.tokens, d.h, m.q_lora_rank), w);
    int64_t nw = B.Param("attn", "q_a_norm.weight", {m.q_lora_rank}, ParamKind::kNorm, false);
    q_src = B.Act("attn", "q_b_in", {down_rows, m.q_lora_rank}, true, down_shard);
    B.Op("attn", "q_a_norm", "rmsnorm", {qa}, {q_src}, 4.0 * static_cast<double>(d.tokens * m.q_lora_rank), nw);
    q_in = m.q_lora_rank;
  }
  int64_t wq = B.Param("attn", m.q_lora_rank > 0 ? "q_b.weight" : "q.weight", {q_in, a.heads * qk},
                       ParamKind::kLinear, true);
  std::string q_lin = B.Act("attn", "q_lin", {d.tokens, hq * qk}, false, "tp");
  B.Op("attn", m.q_lora_rank > 0 ? "q_b" : "q", "linear", {q_src}, {q_lin}, Gemm(d.tokens, q_in, hq * qk), wq);

  // The kv down-projection in two parts (one matrix in DeepSeek's code,
  // kv_a_proj_with_mqa, split by columns here): the latent c_kv, normed and
  // up-projected per head, and the decoupled RoPE key k_pe shared by heads.
  int64_t wkva = B.Param("attn", "kv_a.weight", {d.h, m.kv_lora_rank}, ParamKind::kLinear, false);
  std::string kva = B.Act("attn", "kv_a", {down_rows, m.kv_lora_rank}, true, down_shard);
  B.Op("attn", "kv_a", "linear", {x_in}, {kva}, Gemm(d.tokens, d.h, m.kv_lora_rank), wkva);
  int64_t wkpe = B.Param("attn", "k_pe.weight", {d.h, m.qk_rope_head_dim}, ParamKind::kLinear, false);
  std::string k_pe = B.Act("attn", "k_pe", {d.tokens, m.qk_rope_head_dim}, false, "replicated");
  B.Op("attn", "k_pe", "linear", {x_in}, {k_pe}, Gemm(d.tokens, d.h, m.qk_rope_head_dim), wkpe);
  int64_t nw = B.Param("attn", "kv_norm.weight", {m.kv_lora_rank}, ParamKind::kNorm, false);
  std::string kvb_in = B.Act("attn", "kv_b_in", {down_rows, m.kv_lora_rank}, true, down_shard);
  B.Op("attn", "kv_norm", "rmsnorm", {kva}, {kvb_in}, 4.0 * static_cast<double>(d.tokens * m.kv_lora_rank), nw);
  int64_t kvb_full = a.heads * (m.qk_nope_head_dim + m.v_head_dim);
  int64_t wkvb = B.Param("attn", "kv_b.weight", {m.kv_lora_rank, kvb_full}, ParamKind::kLinear, true);
  std::string kv = B.Act("attn", "kv", {d.tokens, kvb_full / d.t}, false, "tp");
  B.Op("attn", "kv_b", "linear", {kvb_in}, {kv}, Gemm(d.tokens, m.kv_lora_rank, kvb_full / d.t), wkvb);
  std::string q = B.Act("attn", "q", {d.b, hq, d.s, qk}, true, "tp");
  std::string k = B.Act("attn", "k", {d.b, hq, d.s, qk}, true, "tp");
  std::string v = B.Act("attn", "v", {d.b, hq, d.s, m.v_head_dim}, true, "tp");
  // Heads out of q_lin and kv, RoPE on q's and k_pe's rope parts, k_pe
  // broadcast to every head's key.
  B.Op("attn", "split", "mla_split", {q_lin, kv, k_pe}, {q, k, v},
       4.0 * static_cast<double>(d.tokens * hq * (qk + m.qk_rope_head_dim)));
  std::string ctx = AddAttentionCore(B, d, "attn", q, k, v, hq, qk, m.v_head_dim);
  return AddOutputProjection(B, d, "attn", ctx, a.heads * m.v_head_dim);
}

// KDA's low-rank projections x A B (A [h, r] replicated, B [r, width] split
// over TP): two linears "<name>_a", "<name>_b" through "<name>_mid"; saves
// "<name>" as `dtype` (the decay gate is fp32), which the next op reads.
std::string AddLowRank(Builder& B, const Dims& d, const std::string& name, const std::string& x_in, int64_t rank,
                       int64_t width, int64_t width_full, DType dtype) {
  int64_t wa = B.Param("kda", name + "_a.weight", {d.h, rank}, ParamKind::kLinear, false);
  int64_t wb = B.Param("kda", name + "_b.weight", {rank, width_full}, ParamKind::kLinear, true);
  std::string mid = B.Act("kda", name + "_mid", {d.tokens, rank}, false, "replicated");
  B.Op("kda", name + "_a", "linear", {x_in}, {mid}, Gemm(d.tokens, d.h, rank), wa);
  B.SetParams("kda", {name + "_a.weight"});
  std::string out = B.Tensor("kda", name, {d.tokens, width}, dtype, true, "tp");
  B.Op("kda", name + "_b", "linear", {mid}, {out}, Gemm(d.tokens, rank, width), wb);
  B.SetParams("kda", {name + "_b.weight"});
  return out;
}

// Kimi Delta Attention as the reference layer runs it (docs/templates.md):
// q, k, v projections, each through a short causal depthwise convolution
// with SiLU (arch.linear_attention.conv_size taps; 0: none), the chunked
// gated delta rule (decay softplus(g + dt_bias)), the sigmoid-gated norm and
// the output projection. Saves the convolutions' inputs (their backward
// re-makes the SiLU's input), q, k, v, the per-channel decay gates and beta
// (fp32), the per-chunk states (fp32), the output before the gated norm, the
// output gate and the projection input.
std::string AddKda(Builder& B, const Dims& d, const std::string& x_in) {
  const Arch& a = B.model().arch;
  const LinearAttentionConfig& la = *a.linear_attention;
  int64_t heads = a.heads / d.t;
  int64_t dk = la.head_dim;
  int64_t width_full = a.heads * dk;
  int64_t width = heads * dk;
  std::string qkv[3];
  const char* names[3] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    const std::string n = names[i];
    int64_t w = B.Param("kda", n + ".weight", {d.h, width_full}, ParamKind::kLinear, true);
    qkv[i] = B.Act("kda", n, {d.tokens, width}, true, "tp");
    if (la.conv_size == 0) {
      B.Op("kda", n + "_proj", "linear", {x_in}, {qkv[i]}, Gemm(d.tokens, d.h, width), w);
      B.SetParams("kda", {n + ".weight"});
      continue;
    }
    std::string conv_in = B.Act("kda", n + "_conv_in", {d.tokens, width}, true, "tp");
    B.Op("kda", n + "_proj", "linear", {x_in}, {conv_in}, Gemm(d.tokens, d.h, width), w);
    B.SetParams("kda", {n + ".weight"});
    int64_t wc = B.Param("kda", n + "_conv.weight", {la.conv_size, width_full}, ParamKind::kNorm, true);
    // Taps' multiply-adds plus SiLU.
    B.Op("kda", n + "_conv", "short_conv", {conv_in}, {qkv[i]},
         static_cast<double>(2 * la.conv_size + 4) * static_cast<double>(d.tokens * width), wc);
    B.SetParams("kda", {n + "_conv.weight"});
  }
  const std::string &q = qkv[0], &k = qkv[1], &v = qkv[2];
  // Decay gate: a low-rank projection, two GEMMs (hidden -> head_dim ->
  // heads*head_dim) through a transient (rebuilt for g_b's weight gradient).
  std::string g = AddLowRank(B, d, "g", x_in, dk, width, width_full, DType::kFP32);
  int64_t wb = B.Param("kda", "beta.weight", {d.h, a.heads}, ParamKind::kLinear, true);
  std::string beta = B.Tensor("kda", "beta", {d.tokens, heads}, DType::kFP32, true, "tp");
  B.Op("kda", "beta_proj", "linear", {x_in}, {beta}, Gemm(d.tokens, d.h, heads), wb);
  B.SetParams("kda", {"beta.weight"});
  int64_t chunks = CeilDiv(d.s, la.chunk);
  std::string states = B.Tensor("kda", "states", {d.b, heads, chunks, dk, dk}, DType::kFP32, true, "tp");
  std::string o = B.Act("kda", "o", {d.tokens, width}, true, "tp");
  // Chunked delta rule: intra-chunk attention plus state updates.
  double delta_flops = 4.0 * static_cast<double>(d.tokens) * static_cast<double>(heads) *
                       static_cast<double>(dk) * static_cast<double>(dk + la.chunk);
  int64_t wa = B.Param("kda", "a_log", {a.heads}, ParamKind::kNorm, true);
  int64_t wdt = B.Param("kda", "dt_bias", {width_full}, ParamKind::kNorm, true);
  B.Op("kda", "delta_rule", "kda_chunked", {q, k, v, g, beta}, {o, states}, delta_flops, wa + wdt);
  B.SetParams("kda", {"a_log", "dt_bias"});
  B.SetWorkspace(workspace::KdaBwdBytes(d.b, heads, la.chunk, dk, dk));
  std::string gate = AddLowRank(B, d, "o_gate", x_in, dk, width, width_full, B.model().train.act_dtype);
  int64_t wn = B.Param("kda", "o_norm.weight", {dk}, ParamKind::kNorm, false);
  std::string proj_in = B.Act("kda", "proj_in", {d.tokens, width}, true, "tp");
  B.Op("kda", "gated_norm", "gated_rmsnorm", {o, gate}, {proj_in}, 6.0 * static_cast<double>(d.tokens * width), wn);
  B.SetParams("kda", {"o_norm.weight"});
  B.SetWorkspace(workspace::GatedRmsNormBwdBytes(d.tokens * heads, dk));
  return AddOutputProjection(B, d, "kda", proj_in, width_full);
}

// A tensor-parallel FFN of width `f`: fc1 -> gelu|swiglu -> fc2. Saves the
// activation input (fc1_out) and fc2's input. `prefix` names the copy: ""
// for the dense MLP, "shared_" for shared experts (params "shared.fc1...").
std::string AddTpFfn(Builder& B, const Dims& d, std::string_view module, const std::string& prefix,
                     const std::string& x_in, int64_t f, ParamKind kind) {
  bool glu = B.model().arch.ffn_act == FfnAct::kSwiglu;
  std::string param_prefix = prefix.empty() ? "" : prefix.substr(0, prefix.size() - 1) + ".";
  int64_t fc1_full = glu ? 2 * f : f;
  int64_t w1 = B.Param(module, param_prefix + "fc1.weight", {d.h, fc1_full}, kind, true);
  std::string h1 = B.Act(module, prefix + "fc1_out", {d.tokens, fc1_full / d.t}, true, "tp");
  B.Op(module, prefix + "fc1", "linear", {x_in}, {h1}, Gemm(d.tokens, d.h, fc1_full / d.t), w1);
  std::string act = B.Act(module, prefix + "fc2_in", {d.tokens, f / d.t}, true, "tp");
  B.Op(module, prefix + "act", glu ? "swiglu" : "gelu", {h1}, {act}, 8.0 * static_cast<double>(d.tokens * f / d.t));
  int64_t w2 = B.Param(module, param_prefix + "fc2.weight", {f, d.h}, kind, true);
  std::string out = B.Act(module, prefix + "fc2_out", {d.tokens_r, d.h}, false, d.shard_r);
  B.Op(module, prefix + "fc2", "linear", {act}, {out}, Gemm(d.tokens, f / d.t, d.h), w2);
  return out;
}

// Dense MLP (+ dropout). `x_in` is the normed input.
std::string AddMlp(Builder& B, const Dims& d, const std::string& x_in) {
  std::string out = AddTpFfn(B, d, "mlp", "", x_in, B.model().arch.ffn_hidden, ParamKind::kLinear);
  if (B.model().arch.dropout) out = AddResidualDropout(B, d, "mlp", out);
  return out;
}

// MoE FFN: router + top-k, optional latent projection, dispatch, expert
// grouped GEMMs, combine, shared experts. `x_in` (moe.x) is saved: it feeds
// the router, the shared experts and the dispatch.
std::string AddMoe(Builder& B, const Dims& d, const std::string& x_in) {
  const Model& model = B.model();
  const Arch& a = model.arch;
  const MoeConfig& m = *a.moe;
  bool glu = a.ffn_act == FfnAct::kSwiglu;
  int64_t wr = B.Param("moe", "router.weight", {d.h, m.experts}, ParamKind::kRouter, false);
  std::string logits = B.Tensor("moe", "logits", {d.tokens_r, m.experts}, DType::kFP32, false, d.shard_r);
  B.Op("moe", "router", "linear", {x_in}, {logits}, Gemm(d.tokens_r, d.h, m.experts), wr);
  std::string probs = B.Tensor("moe", "probs", {d.tokens_r, m.experts}, DType::kFP32, true, d.shard_r);
  B.Op("moe", "router_act", m.router == Router::kSoftmax ? "softmax" : "sigmoid", {logits}, {probs},
       5.0 * static_cast<double>(d.tokens_r * m.experts));
  std::string idx = B.Tensor("moe", "topk_idx", {d.tokens_r, m.top_k}, DType::kI32, true, d.shard_r);
  std::string gates = B.Tensor("moe", "topk_weights", {d.tokens_r, m.top_k}, DType::kFP32, true, d.shard_r);
  B.Op("moe", "topk", "topk", {probs}, {idx, gates}, static_cast<double>(d.tokens_r * m.experts));

  int64_t width = m.latent_dim.value_or(d.h);
  std::string dispatch_in = x_in;
  if (m.latent_dim) {
    int64_t w = B.Param("moe", "latent_down.weight", {d.h, width}, ParamKind::kLinear, false);
    // Saved only to re-run the dispatch in backward; latent_down's own
    // gradients need moe.x, not its output.
    dispatch_in = B.Act("moe", "latent", {d.tokens_r, width}, model.options.moe_recompute_dispatch, d.shard_r);
    B.Op("moe", "latent_down", "linear", {x_in}, {dispatch_in}, Gemm(d.tokens_r, d.h, width), w);
  }
  // Each EP rank receives tokens*top_k rows on average; its buffers hold
  // the capacity, or the worst rank's share under the assumed skew.
  int64_t routed = static_cast<int64_t>(std::ceil(static_cast<double>(CheckedMul(d.tokens_r, m.top_k, "routed tokens")) *
                                                  m.RoutedRowsFactor(model.parallel.ep) *
                                                  testing::ActivePlannerMutation().routed_capacity));
  // With dispatch recompute, only the dispatch input is saved; the grouped
  // GEMM input is rebuilt in backward by re-running the dispatch.
  std::string fc1_in = B.Act("moe", "fc1_in", {routed, width}, !model.options.moe_recompute_dispatch, "ep");
  // The routing map (which (token, slot) each sorted row holds; saved, the
  // combine and the backward of both read it).
  std::string slot_of = B.Tensor("moe", "slot_of", {d.tokens_r * m.top_k}, DType::kI32, true, d.shard_r);
  B.Op("moe", "dispatch", "dispatch", {dispatch_in, idx}, {fc1_in, slot_of}, 0);
  int64_t fe = m.expert_ffn_hidden;
  int64_t fc1_width = glu ? 2 * fe : fe;
  int64_t w1 = B.Param("moe", "experts.fc1.weight", {m.experts, width, fc1_width}, ParamKind::kExpert, false);
  std::string h1 = B.Act("moe", "fc1_out", {routed, fc1_width}, true, "ep");
  B.Op("moe", "experts_fc1", "grouped_gemm", {fc1_in}, {h1}, Gemm(routed, width, fc1_width), w1);
  std::string act = B.Act("moe", "fc2_in", {routed, fe}, true, "ep");
  B.Op("moe", "experts_act", glu ? "swiglu" : "gelu", {h1}, {act}, 8.0 * static_cast<double>(routed * fe));
  int64_t w2 = B.Param("moe", "experts.fc2.weight", {m.experts, fe, width}, ParamKind::kExpert, false);
  // Natively dS = <dO, Y> needs the expert output Y; the rewrite computes
  // dS = <dO W2^T, A> from the saved activation A instead.
  std::string y = B.Act("moe", "fc2_out", {routed, width}, !model.options.moe_grad_rewrite, "ep");
  B.Op("moe", "experts_fc2", "grouped_gemm", {act}, {y}, Gemm(routed, fe, width), w2);
  std::string combined = B.Act("moe", "combine_out", {d.tokens_r, width}, m.latent_dim.has_value(), d.shard_r);
  B.Op("moe", "combine", "combine", {y, gates, slot_of}, {combined}, 2.0 * static_cast<double>(routed * width));
  std::string routed_out = combined;
  if (m.latent_dim) {
    int64_t w = B.Param("moe", "latent_up.weight", {width, d.h}, ParamKind::kLinear, false);
    routed_out = B.Act("moe", "routed_out", {d.tokens_r, d.h}, false, d.shard_r);
    B.Op("moe", "latent_up", "linear", {combined}, {routed_out}, Gemm(d.tokens_r, width, d.h), w);
  }
  if (m.shared_experts == 0) {
    return a.dropout ? AddResidualDropout(B, d, "moe", routed_out) : routed_out;
  }
  std::string s_out = AddTpFfn(B, d, "moe", "shared_", x_in, m.shared_experts * m.shared_ffn_hidden,
                               ParamKind::kSharedExpert);
  std::string out = B.Act("moe", "ffn_out", {d.tokens_r, d.h}, false, d.shard_r);
  B.Op("moe", "add_shared", "add", {routed_out, s_out}, {out}, static_cast<double>(d.tokens_r * d.h));
  return a.dropout ? AddResidualDropout(B, d, "moe", out) : out;
}

// A transformer block's attention sublayer (or KDA) on its input `x`
// (attn_norm.x): the norm, then the attention; returns its output.
std::string AddAttention(Builder& B, const Dims& d, const std::string& x, bool kda) {
  const Arch& a = B.model().arch;
  std::string normed = AddNorm(B, d, "attn_norm", x, kda ? "kda" : "attn", kda ? "in" : "qkv_in", true);
  return kda ? AddKda(B, d, normed) : a.mla ? AddMlaAttention(B, d, normed) : AddStandardAttention(B, d, normed);
}

// Its FFN sublayer (MLP or MoE) on `h2` (ffn_norm.x); returns its output.
std::string AddFfn(Builder& B, const Dims& d, const std::string& h2, bool moe) {
  std::string ffn_in = AddNorm(B, d, "ffn_norm", h2, moe ? "moe" : "mlp", moe ? "x" : "fc1_in", true);
  return moe ? AddMoe(B, d, ffn_in) : AddMlp(B, d, ffn_in);
}

// A transformer block's attention (or KDA) and FFN (MLP or MoE) on the
// layer input `x` (attn_norm.x) with a standard residual between them: the
// residual stream there (h2, ffn_norm.x) and the FFN's output, whose
// residual add the caller names.
BlockParts AddAttentionAndFfn(Builder& B, const Dims& d, const std::string& x, bool kda, bool moe) {
  const std::string attn_out = AddAttention(B, d, x, kda);
  BlockParts out;
  out.h2 = B.Act("ffn_norm", "x", {d.tokens_r, d.h}, true, d.shard_r);
  B.Op(kda ? "kda" : "attn", "residual", "add", {x, attn_out}, {out.h2}, static_cast<double>(d.tokens_r * d.h));
  out.ffn_module = moe ? "moe" : "mlp";
  out.ffn_out = AddFfn(B, d, out.h2, moe);
  return out;
}

// Multi-token prediction (DeepSeek-V3, section 2.2, as Megatron-LM runs it:
// docs/accounting.md section 2), after the main loss in the last layer's
// graph: depth k normalises the previous depth's hidden state `h_prev` (the
// main model's, before its final norm, at k = 0) and the embedding of the
// token k + 1 ahead, projects the two (eh_proj, as two h x h linears and an
// add), runs one transformer block of the last layer's kind and a
// cross-entropy through the shared output head with its own norm. With
// pp > 1 the last stage keeps its own word embedding for the lookups, a
// copy unless the head is tied (then the head's copy serves both).
void AddMtp(Builder& B, const Dims& d, std::string h_prev) {
  const Model& model = B.model();
  const Arch& a = model.arch;
  const int64_t last = a.layers - 1;
  const std::string base = "layer" + std::to_string(last) + ".";
  const int64_t pbytes = DTypeBytes(model.train.param_dtype);
  std::vector<std::string> table;  // the lookups' weight where it is in this graph
  if (model.parallel.pp > 1 && !a.tied_embeddings) {
    B.SetPrefix(base + "mtp.");
    B.Param("embed", "weight", {a.vocab, d.h}, ParamKind::kEmbedding, true);
    B.MarkCopy();
    table = {base + "mtp.embed.weight"};
  } else if (model.parallel.pp > 1 || last == 0) {
    table = {a.tied_embeddings && model.parallel.pp > 1 ? base + "head.weight" : "layer0.embed.weight"};
  }
  const bool moe = a.IsMoeLayer(last), kda = a.IsLinearAttentionLayer(last);
  const int64_t vocab_local = CeilDiv(a.vocab, d.t);
  for (int64_t k = 0; k < a.mtp_layers; ++k) {
    B.SetPrefix(base + "mtp" + std::to_string(k) + ".");
    std::string tokens = B.Tensor("embed", "tokens", {d.tokens}, DType::kI32, true, "replicated");
    // Saved: the embedding norm's input.
    std::string emb = B.Act("embed", "out", {d.tokens_r, d.h}, true, d.shard_r);
    B.Op("embed", "lookup", "embedding", {tokens}, {emb}, 0, CheckedMul(d.tokens, d.h * pbytes, "embedding rows"));
    if (!table.empty()) B.SetParamNames(table);
    std::string e_in = AddNorm(B, d, "enorm", emb, "proj", "e_in", true);
    std::string h_in = AddNorm(B, d, "hnorm", h_prev, "proj", "h_in", true);
    int64_t we = B.Param("proj", "e.weight", {d.h, d.h}, ParamKind::kLinear, false);
    std::string e_out = B.Act("proj", "e_out", {d.tokens_r, d.h}, false, d.shard_r);
    B.Op("proj", "e", "linear", {e_in}, {e_out}, Gemm(d.tokens_r, d.h, d.h), we);
    int64_t wh = B.Param("proj", "h.weight", {d.h, d.h}, ParamKind::kLinear, false);
    std::string h_out = B.Act("proj", "h_out", {d.tokens_r, d.h}, false, d.shard_r);
    B.Op("proj", "h", "linear", {h_in}, {h_out}, Gemm(d.tokens_r, d.h, d.h), wh);
    std::string x = B.Act("attn_norm", "x", {d.tokens_r, d.h}, true, d.shard_r);
    B.Op("proj", "add", "add", {e_out, h_out}, {x}, static_cast<double>(d.tokens_r * d.h));
    // The block, as a main layer of the last layer's kind.
    const BlockParts block = AddAttentionAndFfn(B, d, x, kda, moe);
    std::string out = B.Act("head", "norm_x", {d.tokens_r, d.h}, true, d.shard_r);
    B.Op(block.ffn_module, "residual", "add", {block.h2, block.ffn_out}, {out}, static_cast<double>(d.tokens_r * d.h));
    // Its loss through the shared output head.
    std::string head_in = AddNorm(B, d, "head_norm", out, "head", "in", true);
    std::string logits = B.Act("head", "logits", {d.tokens, vocab_local}, false, "tp");
    B.Op("head", "proj", "linear", {head_in}, {logits}, Gemm(d.tokens, d.h, vocab_local),
         CheckedMul(vocab_local, d.h * pbytes, "head bytes"));
    B.SetParamNames({base + "head.weight"});
    std::string probs = B.Tensor("loss", "probs", {d.tokens, vocab_local}, DType::kFP32, true, "tp");
    std::string targets = B.Tensor("loss", "targets", {d.tokens}, DType::kI32, true, "replicated");
    std::string loss = B.Tensor("loss", "value", {d.tokens}, DType::kFP32, false, "replicated");
    B.Op("loss", "cross_entropy", "cross_entropy", {logits, targets}, {probs, loss},
         5.0 * static_cast<double>(d.tokens * vocab_local));
    h_prev = out;
  }
  B.SetPrefix(base);
}

}  // namespace templates_internal

using namespace templates_internal;

int64_t AttnResSourceCount(int64_t layer, int64_t block_layers) {
  return 1 + layer / block_layers + (layer % block_layers != 0 ? 1 : 0);
}

LayerGraph ExpandTemplateLayer(const Model& model, int64_t layer) {
  MEMPLAN_CHECK(layer >= 0 && layer < model.arch.layers, "layer index out of range");
  const Arch& a = model.arch;
  LayerGraph g;
  Builder B(model, layer, &g);
  Dims d = MakeDims(model);
  bool moe = a.IsMoeLayer(layer);
  bool kda = a.IsLinearAttentionLayer(layer);
  g.kind = std::string(kda ? "kda" : (a.mla ? "mla" : "attn")) + (moe ? "+moe" : "+mlp");
  bool last = layer == a.layers - 1;

  // --- Embedding (layer 0 only) --------------------------------------------
  std::string stream;  // the residual-stream tensor entering the layer
  if (layer == 0) {
    std::string tokens = B.Tensor("embed", "tokens", {d.tokens}, DType::kI32, true, "replicated");
    int64_t w = B.Param("embed", "weight", {a.vocab, d.h}, ParamKind::kEmbedding, true);
    // Learned positions (GPT-2): replicated over tp; their lookup adds into
    // the embedding's output in place and saves nothing for backward.
    if (a.position_embeddings) B.Param("embed", "positions", {a.position_embeddings, d.h}, ParamKind::kEmbedding, false);
    std::string emb = B.Act("embed", "out", {d.tokens_r, d.h}, false, d.shard_r);
    (void)w;  // a lookup reads one row per token, not the table
    B.Op("embed", "lookup", "embedding", {tokens}, {emb}, 0,
         CheckedMul(d.tokens, d.h * DTypeBytes(model.train.param_dtype), "embedding rows"));
    stream = emb;
    if (a.dropout) stream = AddResidualDropout(B, d, "embed", emb);
    // Block AttnRes keeps the (post-dropout) embedding as block b_0, once
    // (without single copy, b_0 travels inside the layers' sources instead).
    if (a.attn_res && model.options.attn_res_single_copy) B.MarkSaved(stream, true);
  }

  // --- Layer input: plain residual stream or Block AttnRes -----------------
  std::string x;
  if (a.attn_res) {
    const Options& o = model.options;
    const bool single = o.attn_res_single_copy;
    int64_t n = AttnResSources(layer, a.attn_res->block_layers);
    // The block representations this layer attends over. With a single copy
    // they are the earlier layers' `attn_res.partial` tensors and b_0, read
    // in place; without it each layer receives one tensor of all of them
    // (and copies it on).
    std::vector<std::string> sources;
    if (single) {
      sources = SingleCopySources(B, d, layer, layer);
    } else {
      sources = {B.Act("attn_res", "sources", {n * d.tokens_r, d.h}, true, d.shard_r)};
      if (layer == 0) {
        B.Op("attn_res", "gather", "copy", {stream}, {sources[0]}, 0);
      } else {
        // Without single copy the blocks travel as one tensor from layer to
        // layer (and across pipeline stages): the previous layer's
        // accumulate writes this layer's sources.
        B.SetProducer(sources[0], "layer" + std::to_string(layer - 1) + ".attn_res.accumulate");
      }
    }
    x = AddAttnResMix(B, d, "attn_res", sources, n, "attn_norm");
  } else if (layer == 0) {
    // The embedding output is the first layer's input: rename by a copy-free
    // alias op so that attn_norm.x carries the layer-input name.
    x = B.Act("attn_norm", "x", {d.tokens_r, d.h}, true, d.shard_r);
    B.Op("embed", "to_layer", "identity", {stream}, {x}, 0);
  } else {
    x = B.Act("attn_norm", "x", {d.tokens_r, d.h}, true, d.shard_r);
    B.SetProducer(x, LayerInputProducer(layer, model));
  }

  // --- Attention (or KDA), then the FFN ------------------------------------
  const std::string out = a.attn_res && a.attn_res->per_sublayer ? AddSublayerAttnRes(B, d, layer, x, kda, moe)
                                                                  : AddLayerOutput(B, d, layer, x, kda, moe);

  // --- Output head and loss (last layer only) --------------------------------
  if (last) {
    std::string head_in = AddNorm(B, d, "head_norm", out, "head", "in", true);
    int64_t vocab_local = CeilDiv(a.vocab, d.t);
    int64_t w = B.Param("head", "weight", {d.h, a.vocab}, ParamKind::kHead, true);
    std::string logits = B.Act("head", "logits", {d.tokens, vocab_local}, false, "tp");
    B.Op("head", "proj", "linear", {head_in}, {logits}, Gemm(d.tokens, d.h, vocab_local), w);
    std::string probs = B.Tensor("loss", "probs", {d.tokens, vocab_local}, DType::kFP32, true, "tp");
    std::string targets = B.Tensor("loss", "targets", {d.tokens}, DType::kI32, true, "replicated");
    // Per-token losses; the step loss is their mean over tokens and microbatches.
    std::string loss = B.Tensor("loss", "value", {d.tokens}, DType::kFP32, false, "replicated");
    B.Op("loss", "cross_entropy", "cross_entropy", {logits, targets}, {probs, loss},
         5.0 * static_cast<double>(d.tokens * vocab_local));
    if (a.mtp_layers > 0) AddMtp(B, d, out);
  }
  g.Finalize(JsonLocation{model.file, "/arch"});
  return g;
}

Expected<std::vector<LayerGraph>> ExpandModel(const Model& model) {
  return CatchErrors([&]() -> std::vector<LayerGraph> {
    std::vector<LayerGraph> layers;
    layers.reserve(static_cast<size_t>(model.arch.layers));
    size_t next_explicit = 0;
    for (int64_t i = 0; i < model.arch.layers; ++i) {
      if (next_explicit < model.graph.size() && model.graph[next_explicit].index == i) {
        layers.push_back(model.graph[next_explicit++]);
      } else {
        layers.push_back(ExpandTemplateLayer(model, i));
      }
    }
    return layers;
  });
}

}  // namespace memplan::planner
