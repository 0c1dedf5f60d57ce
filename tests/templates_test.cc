#include <doctest/doctest.h>

#include <regex>
#include <set>
#include <tuple>

#include "memplan/planner/templates.h"
#include "test_util.h"

using namespace memplan;
using namespace memplan::planner;
using memplan::test::MustParse;

namespace {

Json GptModel(int64_t s, int64_t b, int64_t h, int64_t a, int64_t t, bool sp) {
  Json j = {{"schema", "memplan.model/1"},
            {"name", "gpt"},
            {"arch",
             {{"layers", 4},
              {"hidden", h},
              {"heads", a},
              {"ffn_hidden", 4 * h},
              {"vocab", 1024},
              {"ffn_act", "gelu"},
              {"norm", "layernorm"},
              {"attention", "standard"},
              {"dropout", true}}},
            {"train", {{"seq_len", s}, {"micro_batch", b}, {"microbatches", 1}}},
            {"parallel", {{"tp", t}, {"sp", sp}}},
            {"hardware", {{"preset", "h100"}}}};
  return j;
}

// A layer in the middle of the model: no embedding, no head.
int64_t MiddleLayerSaved(const Json& j) { return ExpandTemplateLayer(MustParse(j), 1).SavedBytes(); }

struct Shape {
  int64_t s, b, h, a;
};
const Shape kShapes[] = {{2048, 1, 12288, 96}, {512, 4, 1024, 16}, {128, 2, 256, 8}, {4096, 1, 8192, 64},
                         {64, 8, 640, 10}};

}  // namespace

TEST_CASE("gpt template reproduces Korthikanti et al. 2022: sbh(34 + 5as/h)") {
  for (const auto& x : kShapes) {
    CAPTURE(x.s);
    CAPTURE(x.h);
    int64_t sbh = x.s * x.b * x.h;
    int64_t expected = 34 * sbh + 5 * x.a * x.s * x.s * x.b;  // = sbh(34 + 5as/h)
    CHECK(MiddleLayerSaved(GptModel(x.s, x.b, x.h, x.a, 1, false)) == expected);
  }
}

TEST_CASE("gpt template, per-module split of the paper") {
  const Shape x{512, 2, 1024, 16};
  LayerGraph g = ExpandTemplateLayer(MustParse(GptModel(x.s, x.b, x.h, x.a, 1, false)), 2);
  int64_t sbh = x.s * x.b * x.h;
  CHECK(g.SavedBytes("attn") == 11 * sbh + 5 * x.a * x.s * x.s * x.b);
  CHECK(g.SavedBytes("mlp") == 19 * sbh);
  CHECK(g.SavedBytes("attn_norm") + g.SavedBytes("ffn_norm") == 4 * sbh);
}

TEST_CASE("gpt template with tensor parallelism: sbh(10 + 24/t + 5as/(ht))") {
  for (const auto& x : kShapes) {
    for (int64_t t : {2, 4, 8}) {
      if (x.a % t) continue;
      CAPTURE(t);
      int64_t sbh = x.s * x.b * x.h;
      int64_t expected = 10 * sbh + 24 * sbh / t + 5 * x.a * x.s * x.s * x.b / t;
      CHECK(MiddleLayerSaved(GptModel(x.s, x.b, x.h, x.a, t, false)) == expected);
    }
  }
}

TEST_CASE("gpt template with TP and sequence parallelism: sbh(34/t + 5as/(ht))") {
  for (const auto& x : kShapes) {
    for (int64_t t : {2, 4, 8}) {
      if (x.a % t || (x.s * x.b) % t) continue;
      CAPTURE(t);
      int64_t sbh = x.s * x.b * x.h;
      int64_t expected = 34 * sbh / t + 5 * x.a * x.s * x.s * x.b / t;
      CHECK(MiddleLayerSaved(GptModel(x.s, x.b, x.h, x.a, t, true)) == expected);
    }
  }
}

TEST_CASE("llama-style template: flash attention saves no s x s tensor") {
  int64_t s = 1024, b = 2, h = 512, a = 8, g = 2, f = 1536;
  Json j = {{"schema", "memplan.model/1"},
            {"name", "llama"},
            {"arch", {{"layers", 3}, {"hidden", h}, {"heads", a}, {"kv_heads", g}, {"ffn_hidden", f}, {"vocab", 1000}}},
            {"train", {{"seq_len", s}, {"micro_batch", b}, {"microbatches", 1}}},
            {"hardware", {{"preset", "h100"}}}};
  Model m = MustParse(j);
  CHECK(m.arch.attention == Attention::kFlash);
  CHECK(m.arch.norm == Norm::kRmsNorm);
  CHECK(m.arch.ffn_act == FfnAct::kSwiglu);
  LayerGraph layer = ExpandTemplateLayer(m, 1);
  int64_t d = h / a;
  int64_t sbh = s * b * h;
  int64_t expected = 2 * sbh              // attn_norm.x
                     + 2 * sbh            // attn.qkv_in
                     + 2 * sbh            // attn.q
                     + 2 * 2 * s * b * g * d  // attn.k, attn.v (GQA)
                     + 2 * sbh            // attn.out
                     + 4 * s * b * a      // attn.lse (fp32)
                     + 2 * sbh            // ffn_norm.x
                     + 2 * sbh            // mlp.fc1_in
                     + 2 * s * b * 2 * f  // mlp.fc1_out (gate and up)
                     + 2 * s * b * f;     // mlp.fc2_in
  CHECK(layer.SavedBytes() == expected);
  for (const auto& t : layer.tensors) {
    if (t.saved) CHECK((t.shape.size() < 4 || t.shape[3] != s));  // nothing s x s
  }
}

TEST_CASE("MoE techniques remove exactly the tensors they claim") {
  Model m = memplan::test::MustLoad("examples/models/tiny-moe.json");
  REQUIRE(m.arch.moe);
  int64_t layer = m.arch.moe->first_dense_layers;  // first MoE layer
  CHECK(m.options.moe_grad_rewrite);
  CHECK(m.options.moe_recompute_dispatch);
  LayerGraph both = ExpandTemplateLayer(m, layer);
  CHECK_FALSE(both.FindTensor("layer" + std::to_string(layer) + ".moe.fc2_out")->saved);
  CHECK_FALSE(both.FindTensor("layer" + std::to_string(layer) + ".moe.fc1_in")->saved);

  Model native = m;
  native.options.moe_grad_rewrite = false;
  native.options.moe_recompute_dispatch = false;
  LayerGraph plain = ExpandTemplateLayer(native, layer);
  const auto* y = plain.FindTensor("layer" + std::to_string(layer) + ".moe.fc2_out");
  const auto* x = plain.FindTensor("layer" + std::to_string(layer) + ".moe.fc1_in");
  REQUIRE(y);
  REQUIRE(x);
  CHECK(y->saved);
  CHECK(x->saved);
  CHECK(plain.SavedBytes() - both.SavedBytes() == x->bytes + y->bytes);
  // Routed tokens per EP rank: s*b*top_k*capacity_factor.
  int64_t routed = m.train.seq_len * m.train.micro_batch * m.arch.moe->top_k;
  CHECK(y->shape[0] == routed);
  // The dense first layer has no moe module.
  CHECK(ExpandTemplateLayer(m, 0).SavedBytes("moe") == 0);
  CHECK(ExpandTemplateLayer(m, 0).SavedBytes("mlp") > 0);
}

TEST_CASE("MoE with a latent projection and capacity factor") {
  Json j = {{"schema", "memplan.model/1"},
            {"name", "latent"},
            {"arch",
             {{"layers", 2}, {"hidden", 256}, {"heads", 4}, {"vocab", 100},
              {"moe", {{"experts", 8}, {"top_k", 2}, {"expert_ffn_hidden", 64}, {"latent_dim", 128},
                       {"capacity_factor", 1.25}, {"shared_experts", 2}}}}},
            {"train", {{"seq_len", 64}, {"micro_batch", 1}, {"microbatches", 1}}},
            {"hardware", {{"preset", "host"}}}};
  LayerGraph g = ExpandTemplateLayer(MustParse(j), 0);
  const auto* fc1_out = g.FindTensor("layer0.moe.fc1_out");
  REQUIRE(fc1_out);
  CHECK(fc1_out->shape == std::vector<int64_t>{160, 128});  // 64*2*1.25 tokens, swiglu 2*64
  CHECK(g.FindTensor("layer0.moe.latent")->saved);
  CHECK(g.FindTensor("layer0.moe.combine_out")->saved);
  CHECK(g.FindTensor("layer0.moe.shared_fc2_in")->shape == std::vector<int64_t>{64, 128});
  bool has_up = false;
  for (const auto& p : g.params) has_up |= p.name == "layer0.moe.latent_up.weight";
  CHECK(has_up);
}

TEST_CASE("MoE routed rows: capacity, or the assumed skew bounded by ep") {
  // docs/accounting.md section 8b: F = capacity_factor when tokens are
  // dropped, else min(imbalance, ep); rows per EP rank s*b*top_k*F.
  Json j = {{"schema", "memplan.model/1"},
            {"name", "skew"},
            {"arch",
             {{"layers", 2}, {"hidden", 256}, {"heads", 4}, {"vocab", 100},
              {"moe", {{"experts", 8}, {"top_k", 2}, {"expert_ffn_hidden", 64}}}}},
            {"train", {{"seq_len", 64}, {"micro_batch", 1}, {"microbatches", 4}}},
            {"parallel", {{"dp", 8}, {"ep", 4}}},
            {"hardware", {{"preset", "host"}}}};
  auto rows = [](const Json& model) {
    return ExpandTemplateLayer(MustParse(model), 0).FindTensor("layer0.moe.fc1_in")->shape[0];
  };
  int checked = 0;
  // Default: dropless at 1.2 -> ceil(128 * 1.2) = 154 rows.
  CHECK(MustParse(j).arch.moe->imbalance == doctest::Approx(1.2));
  CHECK_FALSE(MustParse(j).arch.moe->capacity_factor.has_value());
  CHECK(rows(j) == 154);
  ++checked;
  for (auto [imbalance, ep, want] : std::vector<std::tuple<double, int, int64_t>>{
           {1.0, 4, 128}, {3.0, 4, 384}, {16.0, 4, 512}, {16.0, 1, 128}, {1.5, 2, 192}}) {
    Json k = j;
    k["arch"]["moe"]["imbalance"] = imbalance;
    k["parallel"]["ep"] = ep;
    CAPTURE(imbalance);
    CAPTURE(ep);
    CHECK(rows(k) == want);  // never past ep x the share: a rank cannot receive more than every rank's rows
    ++checked;
  }
  // Token dropping: the capacity sizes the buffers whatever the skew.
  Json c = j;
  c["arch"]["moe"]["capacity_factor"] = 2.0;
  c["arch"]["moe"]["imbalance"] = 8.0;
  CHECK(rows(c) == 256);
  ++checked;
  // The normalized model says which: imbalance always, capacity_factor when dropping.
  CHECK(NormalizedModelJson(MustParse(j))["arch"]["moe"].contains("imbalance"));
  CHECK_FALSE(NormalizedModelJson(MustParse(j))["arch"]["moe"].contains("capacity_factor"));
  CHECK(NormalizedModelJson(MustParse(c))["arch"]["moe"]["capacity_factor"] == 2.0);
  // Below 1 is refused with the path.
  Json bad = j;
  bad["arch"]["moe"]["imbalance"] = 0.5;
  auto parsed = ParseModel(bad, "skew.json");
  REQUIRE_FALSE(parsed.ok());
  CHECK(parsed.error().message.find("/arch/moe/imbalance") != std::string::npos);
  CHECK(checked == 7);
}

TEST_CASE("Block AttnRes with single copy and checkpointing saves what a standard layer saves") {
  Model ar = memplan::test::MustLoad("examples/models/tiny-moe.json");
  REQUIRE(ar.arch.attn_res);
  Model standard = ar;
  standard.arch.attn_res.reset();
  for (int64_t i = 1; i + 1 < ar.arch.layers; ++i) {
    CAPTURE(i);
    CHECK(ExpandTemplateLayer(ar, i).SavedBytes() == ExpandTemplateLayer(standard, i).SavedBytes());
  }
  // Without the optimizations it costs more, and more in later blocks.
  Model naive = ar;
  naive.options.attn_res_checkpoint = false;
  naive.options.attn_res_single_copy = false;
  CHECK(ExpandTemplateLayer(naive, 1).SavedBytes() > ExpandTemplateLayer(ar, 1).SavedBytes());
  // Layer 1 attends over 2 sources (embedding, partial block), layer 3 over 3.
  CHECK(ExpandTemplateLayer(naive, 3).SavedBytes("attn_res") > ExpandTemplateLayer(naive, 1).SavedBytes("attn_res"));
}

TEST_CASE("hybrid KDA/MLA layers and their saved inventory") {
  Model m = memplan::test::MustLoad("examples/models/kimi-k3-like.json");
  REQUIRE(m.arch.linear_attention);
  int64_t mla = 0, kda = 0;
  for (int64_t i = 0; i < m.arch.layers; ++i) (m.arch.IsLinearAttentionLayer(i) ? kda : mla)++;
  CHECK(mla == 24);
  CHECK(kda == 69);
  LayerGraph g = ExpandTemplateLayer(m, 1);
  REQUIRE(m.arch.IsLinearAttentionLayer(1));
  const auto* states = g.FindTensor("layer1.kda.states");
  REQUIRE(states);
  int64_t s = m.train.seq_len / m.parallel.cp;
  int64_t heads = m.arch.heads / m.parallel.tp;
  int64_t dk = m.arch.linear_attention->head_dim;
  CHECK(states->bytes == 4 * m.train.micro_batch * heads * ((s + 63) / 64) * dk * dk);
  for (const char* t : {"q_conv_in", "k_conv_in", "v_conv_in", "q", "k", "v", "g", "beta", "o", "o_gate", "proj_in"}) {
    CAPTURE(t);
    REQUIRE(g.FindTensor(std::string("layer1.kda.") + t));
    CHECK(g.FindTensor(std::string("layer1.kda.") + t)->saved);
  }
  LayerGraph full = ExpandTemplateLayer(m, 4);
  CHECK(full.FindTensor("layer4.attn.kv_b_in") != nullptr);  // MLA layer
  CHECK(full.FindTensor("layer4.kda.q") == nullptr);
}

TEST_CASE("tensor names follow layer<i>.<module>.<tensor> and graphs are DAGs") {
  std::regex name(R"(layer(\d+)\.(embed|attn_norm|attn|ffn_norm|mlp|moe|attn_res|ffn_res|kda|head|head_norm|loss)\.[a-z0-9_.]+)");
  for (const char* file : {"tiny-gpt", "tiny-moe", "kimi-k3-like", "deepseek-v3"}) {
    Model m = memplan::test::MustLoad(std::string("examples/models/") + file + ".json");
    for (int64_t i : {int64_t{0}, int64_t{1}, m.arch.layers - 1}) {
      LayerGraph g = ExpandTemplateLayer(m, i);
      CHECK(g.TopologicalOrder().size() == g.ops.size());
      std::set<std::string> produced;
      int local_inputs = 0;
      for (size_t idx : g.TopologicalOrder()) {
        for (const auto& in : g.ops[idx].inputs) {
          const TensorSpec* t = g.FindTensor(in);
          REQUIRE(t);
          // Inputs are produced earlier in topological order or come from outside the layer.
          bool local = false;
          for (const auto& op : g.ops) local |= op.name == t->producer;
          if (local) {
            ++local_inputs;
            CHECK(produced.count(in) == 1);
          }
        }
        for (const auto& out : g.ops[idx].outputs) produced.insert(out);
      }
      if (g.ops.size() > 1) CHECK(local_inputs > 0);
      for (const auto& t : g.tensors) {
        std::smatch mm;
        CAPTURE(t.name);
        REQUIRE(std::regex_match(t.name, mm, name));
        // Another layer's name: an earlier layer's block read in place
        // (Block AttnRes with a single copy), never saved here.
        const int64_t owner = std::stoll(mm[1]);
        CHECK((owner == i || (owner < i && !t.saved && t.module == "attn_res")));
        CHECK(t.bytes > 0);
      }
      for (const auto& op : g.ops) CHECK(op.bytes_read + op.bytes_written > 0);
    }
  }
}

TEST_CASE("embedding on the first layer, head and loss on the last") {
  Model m = memplan::test::MustLoad("examples/models/tiny-gpt.json");
  LayerGraph first = ExpandTemplateLayer(m, 0);
  LayerGraph last = ExpandTemplateLayer(m, m.arch.layers - 1);
  CHECK(first.FindTensor("layer0.embed.tokens") != nullptr);
  CHECK(first.SavedBytes("head") == 0);
  std::string p = "layer" + std::to_string(m.arch.layers - 1);
  REQUIRE(last.FindTensor(p + ".loss.probs"));
  CHECK(last.FindTensor(p + ".loss.probs")->bytes ==
        4 * m.train.seq_len * m.train.micro_batch * m.arch.vocab / m.parallel.tp);
}
