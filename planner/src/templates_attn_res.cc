// Block AttnRes's templates (docs/templates.md, "Block AttnRes"): the mix
// over the blocks, the blocks a layer reads (single copy: in place), and a
// layer's output in the per-layer and per-sublayer forms.
#include <string>
#include <vector>

#include "memplan/common/workspace.h"
#include "memplan/planner/templates.h"
#include "template_builder.h"

namespace memplan::planner::templates_internal {

// Block AttnRes's mix over `sources` (n blocks: one input each, or one
// tensor of them all), written to `norm_module`.x, the input of the
// sublayer that norm starts: h = sum_i softmax_i(q . RMSNorm(v_i)) v_i with
// the pseudo-query q and key norm of `module` ("attn_res" before attention,
// "ffn_res" before the FFN in the per-sublayer form). Checkpointed (the
// default), one fused op whose backward re-makes the weights and h from
// the sources: nothing saved. Otherwise the decomposed ops, which save the
// normalized blocks, the weights and h.
std::string AddAttnResMix(Builder& B, const Dims& d, const std::string& module, const std::vector<std::string>& sources,
                          int64_t n, const std::string& norm_module) {
  const bool checkpoint = B.model().options.attn_res_checkpoint;
  const int64_t wq = B.Param(module, "query", {d.h}, ParamKind::kNorm, false) +
                     B.Param(module, "norm.weight", {d.h}, ParamKind::kNorm, false);
  const bool saved = !checkpoint;
  std::string x;
  if (checkpoint) {
    std::string weights = B.Tensor(module, "weights", {d.tokens_r, n}, DType::kFP32, false, d.shard_r);
    x = B.Act(norm_module, "x", {d.tokens_r, d.h}, false, d.shard_r);
    B.Op(module, "mix", "attn_res", sources, {x, weights}, 8.0 * static_cast<double>(n * d.tokens_r * d.h), wq);
    B.SetParams(module, {"query", "norm.weight"});
    B.SetWorkspace(workspace::AttnResBwdBytes(d.tokens_r, d.h));
    return x;
  }
  std::string normed = B.Act(module, "normed", {n * d.tokens_r, d.h}, saved, d.shard_r);
  B.Op(module, "norm", "rmsnorm", sources, {normed}, 4.0 * static_cast<double>(n * d.tokens_r * d.h), wq);
  B.SetParams(module, {"norm.weight"});
  std::string weights = B.Tensor(module, "weights", {d.tokens_r, n}, DType::kFP32, saved, d.shard_r);
  B.Op(module, "softmax", "attn_res_softmax", {normed}, {weights}, 2.0 * static_cast<double>(n * d.tokens_r * d.h));
  B.SetParams(module, {"query"});
  x = B.Act(norm_module, "x", {d.tokens_r, d.h}, saved, d.shard_r);
  std::vector<std::string> mix_in = {weights};
  mix_in.insert(mix_in.end(), sources.begin(), sources.end());
  B.Op(module, "mix", "attn_res_mix", mix_in, {x}, 2.0 * static_cast<double>(n * d.tokens_r * d.h));
  return x;
}

int64_t AttnResSources(int64_t layer, int64_t block_layers) { return AttnResSourceCount(layer, block_layers); }

// Block AttnRes with a single copy: the one tensor holding block
// representation b_0 (the embedding output, after dropout) and the running
// block sum after layer `layer` ("attn_res.partial"; a block's first layer
// writes it with its residual add, the others with attn_res.accumulate).
std::string EmbeddingBlock(const Model& model) {
  return model.arch.dropout ? "layer0.embed.dropout_out" : "layer0.embed.out";
}
std::string EmbeddingBlockProducer(const Model& model) {
  return model.arch.dropout ? "layer0.embed.dropout" : "layer0.embed.lookup";
}
std::string PartialBlock(int64_t layer) { return "layer" + std::to_string(layer) + ".attn_res.partial"; }
std::string PartialBlockProducer(const Model& model, int64_t layer) {
  const std::string prefix = "layer" + std::to_string(layer) + ".";
  // Per sublayer, the FFN's output always joins the running block by an add.
  if (model.arch.attn_res->per_sublayer || layer % model.arch.attn_res->block_layers != 0) {
    return prefix + "attn_res.accumulate";
  }
  return prefix + (model.arch.IsMoeLayer(layer) ? "moe" : "mlp") + ".residual";
}

// The blocks layer `layer` attends over (the head's: layer = layers), by
// name: b_0, every completed block (the partial sum after its last layer),
// and the running partial block. Tensors of other layers are declared
// shared (read in place); `layer`'s own partial (the head's last source) is
// local.
std::vector<std::string> SingleCopySources(Builder& B, const Dims& d, int64_t layer, int64_t self) {
  const Model& m = B.model();
  const int64_t bl = m.arch.attn_res->block_layers;
  std::vector<std::pair<std::string, std::string>> blocks = {{EmbeddingBlock(m), EmbeddingBlockProducer(m)}};
  for (int64_t k = 1; k * bl <= layer; ++k) blocks.emplace_back(PartialBlock(k * bl - 1), PartialBlockProducer(m, k * bl - 1));
  if (layer % bl != 0) blocks.emplace_back(PartialBlock(layer - 1), PartialBlockProducer(m, layer - 1));
  std::vector<std::string> names;
  const std::string own = "layer" + std::to_string(self) + ".";
  for (auto& [name, producer] : blocks) {
    names.push_back(name.starts_with(own) ? name : B.Shared(name, producer, {d.tokens_r, d.h}, d.shard_r));
  }
  return names;
}

std::string LayerInputProducer(int64_t layer, const Model& model) {
  if (layer == 0) return "";
  const Arch& a = model.arch;
  std::string ffn = a.IsMoeLayer(layer - 1) ? "moe" : "mlp";
  if (a.attn_res) return "layer" + std::to_string(layer - 1) + ".attn_res.accumulate";
  return "layer" + std::to_string(layer - 1) + "." + ffn + ".residual";
}

// The head's mix over the final blocks (n of them: one input each, or one
// tensor of them all) with its own query and norm weight: head.norm_x.
std::string AddFinalMix(Builder& B, const Dims& d, const std::vector<std::string>& blocks, int64_t n) {
  const std::string out = B.Act("head", "norm_x", {d.tokens_r, d.h}, true, d.shard_r);
  const std::string weights = B.Tensor("head", "attn_res_weights", {d.tokens_r, n}, DType::kFP32, false, d.shard_r);
  const int64_t wq = B.Param("head", "attn_res.query", {d.h}, ParamKind::kNorm, false) +
                     B.Param("head", "attn_res.norm.weight", {d.h}, ParamKind::kNorm, false);
  B.Op("head", "final_mix", "attn_res", blocks, {out, weights}, 8.0 * static_cast<double>(n * d.tokens_r * d.h), wq);
  B.SetWorkspace(workspace::AttnResBwdBytes(d.tokens_r, d.h));
  return out;
}

// The layer's attention and FFN with a standard residual between them, and
// its output: the residual stream (no AttnRes), or with Block AttnRes in
// its per-layer form ("mix": "layer") the running block plus this layer's
// output. Returns the head's input on the last layer ("" elsewhere).
std::string AddLayerOutput(Builder& B, const Dims& d, int64_t layer, const std::string& x, bool kda, bool moe) {
  const Model& model = B.model();
  const Arch& a = model.arch;
  const bool last = layer == a.layers - 1;
  const BlockParts block = AddAttentionAndFfn(B, d, x, kda, moe);
  const std::string& h2 = block.h2;
  const std::string& ffn_module = block.ffn_module;
  const std::string& ffn_out = block.ffn_out;

  // --- Layer output ----------------------------------------------------------
  const bool single = a.attn_res && model.options.attn_res_single_copy;
  const bool block_start = a.attn_res && layer % a.attn_res->block_layers == 0;
  std::string out = last && !a.attn_res ? B.Act("head", "norm_x", {d.tokens_r, d.h}, true, d.shard_r)
                    : single && block_start
                        // A block's first layer starts the running block sum: the
                        // single copy of the block, written by the residual add.
                        ? B.Act("attn_res", "partial", {d.tokens_r, d.h}, true, d.shard_r)
                        : B.Act(ffn_module, "out", {d.tokens_r, d.h}, false, d.shard_r);
  B.Op(ffn_module, "residual", "add", {h2, ffn_out}, {out}, static_cast<double>(d.tokens_r * d.h));
  if (a.attn_res && !single) {
    // The next layer's sources: this layer's blocks with its output added to
    // the running block sum (a new block starts on a block's first layer).
    int64_t n = AttnResSources(layer, a.attn_res->block_layers);
    int64_t n_next = AttnResSources(layer + 1, a.attn_res->block_layers);
    std::string sources = "layer" + std::to_string(layer) + ".attn_res.sources";
    // (Saved on the last layer: the final mix's backward reads it.)
    std::string next = B.Act("attn_res", "next_sources", {n_next * d.tokens_r, d.h}, last, d.shard_r);
    B.Op("attn_res", "accumulate", "attn_res_accumulate", {sources, out}, {next},
         static_cast<double>(n * d.tokens_r * d.h));
    if (last) out = AddFinalMix(B, d, {next}, n_next);
  } else if (a.attn_res) {
    // The running block sum after this layer: the single copy of the block
    // (complete after the block's last layer), which later layers read in
    // place; the previous layer's partial is read in place too.
    if (!block_start) {
      std::string prev = B.Shared(PartialBlock(layer - 1), PartialBlockProducer(model, layer - 1), {d.tokens_r, d.h},
                                  d.shard_r);
      std::string partial = B.Act("attn_res", "partial", {d.tokens_r, d.h}, true, d.shard_r);
      B.Op("attn_res", "accumulate", "add", {prev, out}, {partial}, static_cast<double>(d.tokens_r * d.h));
    }
    if (last) {
      // The head's mix over every block, the last one this layer's partial.
      const std::vector<std::string> blocks = SingleCopySources(B, d, layer + 1, layer);
      out = AddFinalMix(B, d, blocks, static_cast<int64_t>(blocks.size()));
    }
  }

  return last ? out : std::string();
}

// Block AttnRes as the paper runs it ("mix": "sublayer"): the attention
// reads the mix over the blocks (`x`, made by the caller with attn_res's
// query and norm), its output starts or extends the running block; the FFN
// reads a second mix (ffn_res's query and norm) over the blocks with that
// running block, and its output extends it. A layer saves the two running
// blocks (after its attention, after its FFN) where a standard residual
// layer saves its two sublayer inputs. Returns the head's input on the last
// layer ("" elsewhere).
std::string AddSublayerAttnRes(Builder& B, const Dims& d, int64_t layer, const std::string& x, bool kda, bool moe) {
  const Model& model = B.model();
  const Arch& a = model.arch;
  const bool last = layer == a.layers - 1;
  const bool single = model.options.attn_res_single_copy;
  const int64_t bl = a.attn_res->block_layers;
  const bool block_start = layer % bl == 0;
  const int64_t n = AttnResSources(layer, bl);
  const int64_t n_mid = block_start ? n + 1 : n;  // the attention's output starts a block, or joins the running one
  const std::string attn_out = AddAttention(B, d, x, kda);
  std::vector<std::string> mid;  // the FFN mix's sources
  if (single) {
    // The blocks before this layer and the running block after attention.
    mid = SingleCopySources(B, d, layer, layer);
    std::string running;
    if (block_start) {
      running = attn_out;  // a new block: the attention's output itself
      B.MarkSaved(running, true);
    } else {
      running = B.Act("attn_res", "partial_attn", {d.tokens_r, d.h}, true, d.shard_r);
      B.Op("attn_res", "accumulate_attn", "add", {mid.back(), attn_out}, {running}, static_cast<double>(d.tokens_r * d.h));
      mid.pop_back();
    }
    mid.push_back(running);
  } else {
    const std::string sources = "layer" + std::to_string(layer) + ".attn_res.sources";
    mid = {B.Act("attn_res", "mid_sources", {n_mid * d.tokens_r, d.h}, true, d.shard_r)};
    B.Op("attn_res", "accumulate_attn", "attn_res_accumulate", {sources, attn_out}, {mid[0]},
         static_cast<double>(n * d.tokens_r * d.h));
  }
  const std::string h2 = AddAttnResMix(B, d, "ffn_res", mid, n_mid, "ffn_norm");
  const std::string ffn_out = AddFfn(B, d, h2, moe);
  // The running block after the FFN: later layers' source (single copy:
  // read in place), or the next layer's sources.
  std::vector<std::string> blocks;
  if (single) {
    const std::string partial = B.Act("attn_res", "partial", {d.tokens_r, d.h}, true, d.shard_r);
    B.Op("attn_res", "accumulate", "add", {mid.back(), ffn_out}, {partial}, static_cast<double>(d.tokens_r * d.h));
    if (last) blocks = SingleCopySources(B, d, layer + 1, layer);
  } else {
    // (Saved on the last layer: the final mix's backward reads it.)
    const std::string next = B.Act("attn_res", "next_sources", {n_mid * d.tokens_r, d.h}, last, d.shard_r);
    B.Op("attn_res", "accumulate", "attn_res_accumulate", {mid[0], ffn_out}, {next},
         static_cast<double>(n_mid * d.tokens_r * d.h));
    blocks = {next};
  }
  if (!last) return "";
  // The head's mix over every block, the last one this layer's running block.
  return AddFinalMix(B, d, blocks, single ? static_cast<int64_t>(blocks.size()) : n_mid);
}

}  // namespace memplan::planner::templates_internal
