#include <doctest/doctest.h>

#include <cmath>
#include <map>

#include "memplan/common/workspace.h"
#include "memplan/planner/accounting.h"
#include "memplan/planner/import.h"
#include "memplan/planner/templates.h"
#include "json_test_util.h"
#include "test_util.h"

using namespace memplan;
using namespace memplan::planner;
using memplan::test::MustLoad;
using memplan::test::MustParse;
using memplan::test::ReadJson;

namespace {

Json Dense(int64_t dp, int zero, const char* param_dtype = "bf16") {
  return {{"schema", "memplan.model/1"},
          {"name", "dense"},
          {"arch", {{"layers", 4}, {"hidden", 512}, {"heads", 8}, {"ffn_hidden", 2048}, {"vocab", 4096}}},
          {"train", {{"seq_len", 128}, {"micro_batch", 1}, {"microbatches", 4}, {"param_dtype", param_dtype}}},
          {"parallel", {{"dp", dp}, {"zero", zero}}},
          {"hardware", {{"preset", "h100"}}}};
}

struct Accounted {
  Model model;
  std::vector<LayerGraph> layers;
  PipelineLayout layout;
  StaticBreakdown rank(int64_t r) const { return AccountRank(model, layers, layout, r); }
};

Accounted Account(const Model& m) {
  Accounted a{m, *ExpandModel(m), MakePipelineLayout(m)};
  return a;
}

// The kernels' buffers every rank holds (the cuBLAS workspace and the
// kernel scratch, common/workspace.h), which the published per-parameter
// formulas leave out.
constexpr int64_t kKernelBuffers = memplan::workspace::GemmBytes() + memplan::workspace::KernelScratchBytes();

// Model states: the bytes the published formulas count.
int64_t States(const StaticBreakdown& s) { return s.total - kKernelBuffers; }

}  // namespace

TEST_CASE("Megatron: 18 bytes per parameter with bf16 params, fp32 grads and Adam") {
  auto a = Account(MustParse(Dense(1, 0)));
  StaticBreakdown s = a.rank(0);
  CHECK(s.buffers == kKernelBuffers);
  CHECK(s.buffer_detail.at("gemm_workspace") == 32 * 1024 * 1024);
  CHECK(s.buffer_detail.at("kernel_scratch") == 16 * 1024 + 256);
  CHECK(States(s) == 18 * s.params);
  CHECK(s.weights == 2 * s.params);
  CHECK(s.grads == 4 * s.params);
  CHECK(s.optimizer == 12 * s.params);
}

TEST_CASE("Megatron distributed optimizer: 6 + 12/d bytes per parameter") {
  for (int64_t d : {2, 4, 8, 16, 64}) {
    CAPTURE(d);
    auto a = Account(MustParse(Dense(d, 1)));
    StaticBreakdown s = a.rank(0);
    CHECK(States(s) * d == (6 * d + 12) * s.params);
  }
}

TEST_CASE("fp32 params: 16 vs 8 + 8/d") {
  auto plain = Account(MustParse(Dense(1, 0, "fp32"))).rank(0);
  CHECK(States(plain) == 16 * plain.params);
  auto zero = Account(MustParse(Dense(8, 1, "fp32"))).rank(0);
  CHECK(States(zero) * 8 == (8 * 8 + 8) * zero.params);
}

TEST_CASE("16-bit gradients: Megatron's fp16 row, 20 vs 4 + 16/d") {
  Json j = Dense(1, 0, "fp16");
  j["train"]["grad_dtype"] = "fp16";
  auto plain = Account(MustParse(j)).rank(0);
  CHECK(States(plain) == 20 * plain.params);
  j["parallel"]["dp"] = 8;
  j["parallel"]["zero"] = 1;
  auto zero = Account(MustParse(j)).rank(0);
  CHECK(States(zero) * 8 == (4 * 8 + 16) * zero.params);
}

TEST_CASE("ZeRO-3 / FSDP: every model state sharded, gathered units and one unit's gradients live") {
  // Rajbhandari et al. 2020 (ZeRO), Figure 1: P_os+g+p holds (2 + 2 + K) psi
  // / N_d; with fp32 main gradients (memplan's and Megatron's default) that
  // is (2 + 4 + 12) / d = 18 / d bytes per parameter, no bucket. FSDP
  // (PyTorch FSDP2, TorchTitan: a unit per transformer block, the
  // embedding and the output head) gathers the unit computing and
  // `fsdp_prefetch` ahead; one unit's unsharded fp32 gradients wait for
  // their reduce-scatter.
  int checked = 0;
  for (int64_t d : {2, 4, 8, 64}) {
    CAPTURE(d);
    auto s = Account(MustParse(Dense(d, 3))).rank(0);
    CHECK((s.weights + s.grads + s.optimizer) * d == 18 * s.params);
    CHECK(s.buffer_detail.count("reduce_bucket") == 0);
    ++checked;
  }
  CHECK(checked == 4);
  // Dense(): h 512, ffn 2048 (SwiGLU), 8 heads, vocab 4096, 4 layers. A
  // block: 4 h^2 + 3 h ffn + 2 h = 4,195,328; the last adds the final norm
  // (512); the embedding and the head units V h = 2,097,152 each.
  const int64_t block = 4 * 512 * 512 + 3 * 512 * 2048 + 2 * 512, last = block + 512;
  auto s = Account(MustParse(Dense(8, 3))).rank(0);
  CHECK(s.buffer_detail.at("fsdp_params") == 2 * (last + block));  // bf16, the two largest units
  CHECK(s.buffer_detail.at("fsdp_grads") == 4 * last);              // fp32, the largest unit
  Json deeper = Dense(8, 3);
  deeper["parallel"]["fsdp_prefetch"] = 2;
  CHECK(Account(MustParse(deeper)).rank(0).buffer_detail.at("fsdp_params") == 2 * (last + 2 * block));
  Json kept = Dense(8, 3);
  kept["parallel"]["fsdp_reshard_after_forward"] = false;  // every unit stays gathered
  auto k = Account(MustParse(kept)).rank(0);
  CHECK(k.buffer_detail.at("fsdp_params") == 2 * k.params);
  CHECK(k.params == 3 * block + last + 2 * 4096 * 512);
  // The FSDP settings belong to zero 3 only.
  Json wrong = Dense(8, 1);
  wrong["parallel"]["fsdp_prefetch"] = 2;
  auto refused = ParseModel(wrong, "z.json");
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().message.find("/parallel/fsdp_prefetch: applies to zero 3 only") != std::string::npos);
}

TEST_CASE("ZeRO-2 without data parallelism adds no reduce bucket") {
  auto s = Account(MustParse(Dense(1, 2))).rank(0);
  CHECK(s.buffer_detail.count("reduce_bucket") == 0);
  CHECK(States(s) == 18 * s.params);
}

TEST_CASE("ZeRO-2 partitions gradients and adds a reduce bucket") {
  auto s = Account(MustParse(Dense(8, 2))).rank(0);
  CHECK(s.grads * 8 == 4 * s.params);
  REQUIRE(s.buffer_detail.count("reduce_bucket"));
  CHECK(s.buffer_detail.at("reduce_bucket") == 4 * std::min<int64_t>(s.params, 40'000'000));
}

TEST_CASE("tensor parallelism shards linear weights, replicates norms") {
  Json j = Dense(1, 0);
  auto one = Account(MustParse(j));
  j["parallel"]["tp"] = 4;
  auto four = Account(MustParse(j));
  int64_t norms = 0;
  for (const auto& g : one.layers) {
    for (const auto& p : g.params) norms += p.kind == ParamKind::kNorm ? p.Elements() : 0;
  }
  CHECK(four.rank(0).params == (one.rank(0).params - norms) / 4 + norms);
}

TEST_CASE("EP divides routed experts; shared experts and router are replicated") {
  Json j = {{"schema", "memplan.model/1"},
            {"name", "moe"},
            {"arch", {{"layers", 2}, {"hidden", 256}, {"heads", 4}, {"vocab", 512},
                      {"moe", {{"experts", 16}, {"top_k", 2}, {"expert_ffn_hidden", 128}, {"shared_experts", 1}}}}},
            {"train", {{"seq_len", 64}, {"micro_batch", 1}, {"microbatches", 1}}},
            {"parallel", {{"dp", 8}, {"ep", 4}, {"zero", 1}}},
            {"hardware", {{"preset", "host"}}}};
  Model m = MustParse(j);
  auto a = Account(m);
  int64_t expert = 0, other = 0;
  for (const auto& g : a.layers) {
    for (const auto& p : g.params) (p.kind == ParamKind::kExpert ? expert : other) += p.Elements();
  }
  StaticBreakdown s = a.rank(0);
  CHECK(expert > 0);
  CHECK(other > 0);
  CHECK(s.params == expert / 4 + other);
  // ZeRO-1: dense optimizer state over dp*cp = 8, experts over dp*cp/ep = 2.
  CHECK(s.optimizer == 12 * other / 8 + 12 * (expert / 4) / 2);
}

TEST_CASE("Megatron's expert grid: with tp > 1 routed experts shard over tp*dp*cp/ep (expert tensor parallel 1)") {
  // Mixtral 8x7B at tp 2, ep 4, dp 4 with the distributed optimizer: every
  // rank holds 2 whole experts per layer, replicated on the 8/4 = 2 ranks of
  // its expert data-parallel group (megatron/core/parallel_state.py:
  // world / (etp * ep * pp)), so their 12 B/param of Adam state is halved.
  // Dense weights are split by tp and their state by dp. The earlier rule
  // (dp*cp/ep = 1) left expert state unsharded: +31 % static memory.
  Json j = ReadJson("tests/data/hf/mixtral-8x7b.json");
  planner::ImportOptions o;
  o.gpus = 8;
  o.global_batch = 8;
  o.seq_len = 4096;
  o.tp = 2;
  o.sp = true;
  o.ep = 4;
  auto doc = planner::ImportHuggingFace(j, "mixtral.json", o);
  REQUIRE(doc.ok());
  auto a = Account(MustParse(Json::parse(doc->dump())));
  CHECK(a.model.parallel.dp == 4);
  int64_t expert = 0, dense_split = 0, replicated = 0;
  for (const auto& g : a.layers) {
    for (const auto& p : g.params) {
      if (p.kind == ParamKind::kExpert) {
        expert += p.Elements();
      } else {
        (p.tp_split ? dense_split : replicated) += p.Elements();
      }
    }
  }
  const StaticBreakdown s = a.rank(0);
  CHECK(s.params == expert / 4 + dense_split / 2 + replicated);
  CHECK(s.optimizer == 12 * (expert / 4) / 2 + 12 * (dense_split / 2) / 4 + 12 * replicated / 4);
  // What the old rule would have counted, for the record of the gap.
  const int64_t old_rule = 12 * (expert / 4) + 12 * (dense_split / 2) / 4 + 12 * replicated / 4;
  CHECK(static_cast<double>(old_rule) / static_cast<double>(s.optimizer) > 1.5);
}

TEST_CASE("Muon: 8 B/param for 2-D weights, Adam for embedding, head and norms") {
  Json j = Dense(1, 0);
  j["train"]["optimizer"] = "muon";
  auto a = Account(MustParse(j));
  int64_t adam = 0, muon = 0;
  for (const auto& g : a.layers) {
    for (const auto& p : g.params) (UsesMuon(a.model, p) ? muon : adam) += p.Elements();
  }
  CHECK(muon > 0);
  CHECK(a.rank(0).optimizer == 8 * muon + 12 * adam);
}

TEST_CASE("Muon gather buffers: allgather holds the chunk, p2p only owned matrices") {
  Json j = Dense(8, 1);
  j["train"]["optimizer"] = "muon";
  j["parallel"]["muon_gather"] = "allgather";
  auto ag = Account(MustParse(j));
  int64_t muon = 0;
  for (const auto& g : ag.layers) {
    for (const auto& p : g.params) muon += UsesMuon(ag.model, p) ? p.Elements() : 0;
  }
  CHECK(ag.rank(0).buffer_detail.at("muon_gather") == 4 * muon);
  j["parallel"]["muon_gather"] = "p2p";
  auto p2p = Account(MustParse(j));
  int64_t buf = p2p.rank(0).buffer_detail.at("muon_gather");
  // 4 layers x 4 matrices = 16 matrices over 8 owners, in decreasing size:
  // 4 fc1 [512, 2*2048], 4 fc2, 4 qkv [512, 3*512], 4 proj. Rank 0 owns
  // positions 0 and 8: one fc1 and one qkv, double-buffered.
  CHECK(buf < ag.rank(0).buffer_detail.at("muon_gather"));
  CHECK(buf == 2 * 4 * (512 * 4096 + 512 * 1536));
  // Without a distributed optimizer there is nothing to gather.
  j["parallel"]["zero"] = 0;
  CHECK(Account(MustParse(j)).rank(0).buffer_detail.count("muon_gather") == 0);
}

TEST_CASE("pipeline ZeRO-2 with host partitions keeps only a double buffer on the GPU") {
  Json j = Dense(4, 1);
  j["parallel"]["pp"] = 2;
  j["parallel"]["pipeline_zero2"] = true;
  j["parallel"]["grad_offload"] = "host";
  auto a = Account(MustParse(j));
  for (int64_t r = 0; r < 2; ++r) {
    StaticBreakdown s = a.rank(r);
    CHECK(s.grads == 0);
    CHECK(s.host == 4 * s.params / 4);
    CHECK(s.buffer_detail.at("grad_double_buffer") == 2 * 4 * s.params);  // vp = 1: one chunk
  }
  j["parallel"]["grad_offload"] = "none";
  StaticBreakdown device = Account(MustParse(j)).rank(0);
  CHECK(device.grads == 4 * device.params / 4);
  CHECK(device.host == 0);
}

TEST_CASE("embedding on the first stage, head on the last, tied copies") {
  Json j = Dense(1, 0);
  j["parallel"]["pp"] = 2;
  j["arch"]["tied_embeddings"] = true;
  auto a = Account(MustParse(j));
  int64_t vh = 4096 * 512;
  // Both stages hold a copy of the tied matrix under pp > 1.
  int64_t r0 = a.rank(0).params, r1 = a.rank(1).params;
  int64_t per_layer = (r0 - vh) / 2;
  CHECK(r1 - vh - 512 == 2 * per_layer);  // + final rmsnorm on the last stage
  auto single = Account(MustParse(Dense(1, 0)));
  Json tied1 = Dense(1, 0);
  tied1["arch"]["tied_embeddings"] = true;
  CHECK(single.rank(0).params - Account(MustParse(tied1)).rank(0).params == vh);
}

TEST_CASE("MTP: one block, a projection and its norms on the last stage; the embedding copied there under pp > 1") {
  // docs/accounting.md section 2 (with its sources): Megatron-LM runs the
  // MTP block on the last pipeline stage, which builds its own word
  // embedding when it is not the first; a tied head already is that copy.
  // DeepSeek-V3 section 2.2: M_k is d x 2d, two RMSNorms, one transformer
  // block; the output head is shared.
  const int64_t h = 512, V = 4096;
  const int64_t block = 4 * h * h + 3 * h * 2048 + 2 * h;  // attention (q, k, v, o), SwiGLU MLP, its two norms
  const int64_t mtp = block + 2 * h * h + 3 * h;          // + eh_proj (two h x h) + enorm, hnorm, head norm
  int checked = 0;
  for (bool tied : {false, true}) {
    for (int64_t pp : {1, 2}) {
      CAPTURE(tied);
      CAPTURE(pp);
      Json j = Dense(1, 0);
      j["arch"]["tied_embeddings"] = tied;
      j["arch"]["heads"] = 8;
      j["parallel"]["pp"] = pp;
      auto without = Account(MustParse(j));
      j["arch"]["mtp_layers"] = 1;
      auto with = Account(MustParse(j));
      const int64_t last = pp - 1;
      // A copy of the embedding on the last stage only when it is not the
      // first and the head is not tied.
      const int64_t copy = pp > 1 && !tied ? V * h : 0;
      CHECK(with.rank(last).params - without.rank(last).params == mtp + copy);
      if (pp > 1) CHECK(with.rank(0).params == without.rank(0).params);
      // The model's totals count the block, never the copy.
      CHECK(CountParameters(with.model, with.layers).params - CountParameters(without.model, without.layers).params == mtp);
      ++checked;
    }
  }
  CHECK(checked == 4);
  // Its activations are the last stage's: one more block and another
  // cross-entropy over the vocabulary.
  Json j = Dense(1, 0);
  j["parallel"]["pp"] = 2;
  j["arch"]["mtp_layers"] = 2;
  const Model m = MustParse(j);
  const LayerGraph last = ExpandTemplateLayer(m, m.arch.layers - 1);
  CHECK(last.FindTensor("layer3.mtp0.loss.probs"));
  CHECK(last.FindTensor("layer3.mtp1.attn_norm.x"));
  CHECK(last.SavedBytes() > ExpandTemplateLayer(MustParse(Dense(1, 0)), 3).SavedBytes() + 2 * 128 * V * 4);
  Json bad = Dense(1, 0);
  bad["arch"]["mtp_layers"] = 1;
  bad["arch"]["attn_res"] = {{"block_layers", 2}};
  auto refused = ParseModel(bad, "mtp.json");
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().message.find("/arch/mtp_layers") != std::string::npos);
}

TEST_CASE("uneven pp_layout moves parameters with the layers") {
  Json j = Dense(1, 0);
  j["parallel"]["pp"] = 2;
  j["parallel"]["pp_layout"] = {1, 3};
  auto a = Account(MustParse(j));
  CHECK(a.layout.chunks[0][0] == std::vector<int64_t>{0});
  CHECK(a.layout.chunks[1][0] == std::vector<int64_t>{1, 2, 3});
  CHECK(a.rank(1).params > 2 * a.rank(0).params - 2 * 4096 * 512);
}

TEST_CASE("published parameter totals within 2%") {
  struct Case {
    const char* file;
    double published;
    double tolerance;
  };
  for (const Case& c : {Case{"gpt3-175b", 175e9, 0.02}, Case{"llama3-70b", 70.6e9, 0.02},
                        Case{"deepseek-v3", 671e9, 0.02}, Case{"kimi-k2", 1.04e12, 0.02},
                        Case{"kimi-k3-like", 2.8e12, 0.03}}) {
    CAPTURE(c.file);
    Model m = MustLoad(std::string("examples/models/") + c.file + ".json");
    ModelTotals t = CountParameters(m, *ExpandModel(m));
    double total = static_cast<double>(t.params);
    CAPTURE(total);
    CHECK(std::fabs(total - c.published) / c.published < c.tolerance);
  }
}

TEST_CASE("active parameters: DeepSeek-V3 ~37B, Kimi K2 ~32.6B") {
  for (auto [file, active] : {std::pair{"deepseek-v3", 37e9}, std::pair{"kimi-k2", 32.6e9}}) {
    CAPTURE(file);
    Model m = MustLoad(std::string("examples/models/") + file + ".json");
    double a = static_cast<double>(CountParameters(m, *ExpandModel(m)).params_active);
    CAPTURE(a);
    CHECK(std::fabs(a - active) / active < 0.05);
  }
}

TEST_CASE("Memory outside the framework: the CUDA context and one NCCL communicator per group the layout needs") {
  constexpr int64_t kMiBytes = 1 << 20;
  // A collective communicator: 2 connections x 32 channels x (Simple 4 MiB
  // + LL128 4,915,200 + LL 524,288), 588 MiB: within the 544-688 MB per
  // communicator users measure (NVIDIA/nccl#964).
  const int64_t collective = 2 * 32 * (4 * kMiBytes + 4'915'200 + 524'288);
  CHECK(collective == 616'562'688);
  // deepseek-v3: dp 128 (dense), expert dp 128/64 = 2, ep 64, pp 16, tp 1.
  const auto ds = RuntimeItems(MustLoad("examples/models/deepseek-v3.json"));
  CHECK(ds == std::map<std::string, int64_t>{{"cuda_context", 512 * kMiBytes},
                                             {"nccl_dp", collective},
                                             {"nccl_expert_dp", collective},
                                             {"nccl_ep", 63 * 2 * 2 * 4 * kMiBytes},  // all-to-all: 63 peers
                                             {"nccl_pp", 2 * 2 * 2 * 4 * kMiBytes}});
  // llama3-70b: tp 8, pp 4, dp 16, no experts.
  const auto llama = RuntimeItems(MustLoad("examples/models/llama3-70b.json"));
  CHECK(llama.size() == 4);
  CHECK(llama.count("nccl_tp") == 1);
  CHECK(llama.count("nccl_ep") == 0);
  // The host backend has no CUDA context and no NCCL.
  CHECK(RuntimeItems(MustLoad("examples/models/tiny-gpt.json")).empty());
  // Calibrated or given numbers override the preset's.
  Json j = ReadJson("examples/models/llama3-70b.json");
  j["hardware"]["runtime"] = {{"cuda_context", "1GiB"}, {"nccl_buffsize", "8MiB"}, {"nccl_channels", 16}};
  const auto given = RuntimeItems(MustParse(j));
  CHECK(given.at("cuda_context") == 1024 * kMiBytes);
  CHECK(given.at("nccl_tp") == 2 * 16 * (8 * kMiBytes + 4'915'200 + 524'288));
  // ... and stay in the model's digest, which preset models keep unchanged.
  CHECK(NormalizedModelJson(MustParse(j))["hardware"].contains("runtime"));
  CHECK(!NormalizedModelJson(MustLoad("examples/models/llama3-70b.json"))["hardware"].contains("runtime"));
}
