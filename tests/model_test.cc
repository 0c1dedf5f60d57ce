#include <doctest/doctest.h>

#include <functional>

#include "memplan/planner/model.h"
#include "memplan/planner/templates.h"
#include "json_test_util.h"
#include "test_util.h"

using namespace memplan;
using namespace memplan::planner;
using memplan::test::BaseModel;
using memplan::test::MustParse;

namespace {

struct BadCase {
  const char* rule;
  std::function<void(Json&)> mutate;
  const char* pointer;   // expected JSON pointer in the message
  const char* expected;  // expected fragment of the message
};

const BadCase kBadCases[] = {
    {"unknown schema version", [](Json& j) { j["schema"] = "memplan.model/2"; }, "/schema", "unknown schema version"},
    {"missing name", [](Json& j) { j.erase("name"); }, "/", "missing required key \"name\""},
    {"unknown top-level key", [](Json& j) { j["extra"] = 1; }, "/extra", "unknown key"},
    {"unknown arch key", [](Json& j) { j["arch"]["hiden"] = 4; }, "/arch/hiden", "unknown key"},
    {"unknown parallel key", [](Json& j) { j["parallel"]["zero3"] = true; }, "/parallel/zero3", "unknown key"},
    {"non-positive hidden", [](Json& j) { j["arch"]["hidden"] = 0; }, "/arch/hidden", "expected an integer in [1,"},
    {"negative layers", [](Json& j) { j["arch"]["layers"] = -3; }, "/arch/layers", "expected an integer"},
    {"10^15 layers", [](Json& j) { j["arch"]["layers"] = 1e15; }, "/arch/layers", "[1, 10000]"},
    {"10001 layers", [](Json& j) { j["arch"]["layers"] = 10001; }, "/arch/layers", "[1, 10000]"},
    {"layers x microbatches", [](Json& j) { j["arch"]["layers"] = 10000; j["train"]["microbatches"] = 21; }, "/train/microbatches",
     "210000 layer-microbatches; the planner's limit is 200000"},
    {"wrong type", [](Json& j) { j["arch"]["hidden"] = "big"; }, "/arch/hidden", "got \"big\""},
    {"fractional integer", [](Json& j) { j["train"]["seq_len"] = 12.5; }, "/train/seq_len", "expected an integer"},
    {"non-positive device memory", [](Json& j) { j["hardware"]["device_memory"] = "0GiB"; },
     "/hardware/device_memory", "expected a size"},
    {"negative budget", [](Json& j) { j["budget"] = "-5GiB"; }, "/budget", "expected a size"},
    {"bad bandwidth", [](Json& j) { j["hardware"]["hbm_bw"] = "4.8TB"; }, "/hardware/hbm_bw", "bandwidth"},
    {"bad flops", [](Json& j) { j["hardware"]["bf16_flops"] = "lots"; }, "/hardware/bf16_flops", "FLOP rate"},
    {"unknown preset", [](Json& j) { j["hardware"]["preset"] = "v100"; }, "/hardware/preset", "a100|h100|h800|h200|b200|host"},
    {"unknown enum", [](Json& j) { j["arch"]["norm"] = "batchnorm"; }, "/arch/norm", "layernorm|rmsnorm"},
    {"pp*vp > layers", [](Json& j) { j["parallel"]["pp"] = 4; j["parallel"]["vp"] = 4; }, "/parallel/vp",
     "exceeds arch.layers"},
    {"pp > layers", [](Json& j) { j["parallel"]["pp"] = 16; j["train"]["microbatches"] = 16; }, "/parallel/pp",
     "exceeds arch.layers"},
    {"vp > 1 with pp = 1", [](Json& j) { j["parallel"]["pp"] = 1; j["parallel"]["vp"] = 2; }, "/parallel/vp",
     "needs pp > 1"},
    {"microbatches not a multiple of pp", [](Json& j) { j["parallel"]["vp"] = 2; j["train"]["microbatches"] = 9; },
     "/train/microbatches", "multiple of pp"},
    {"microbatches < pp", [](Json& j) { j["parallel"]["pp"] = 4; j["train"]["microbatches"] = 3; },
     "/train/microbatches", "at least pp"},
    {"heads not divisible by tp", [](Json& j) { j["parallel"]["tp"] = 3; }, "/parallel/tp", "arch.heads"},
    {"kv_heads not divisible by tp", [](Json& j) { j["arch"]["kv_heads"] = 2; j["parallel"]["tp"] = 4; },
     "/parallel/tp", "arch.kv_heads"},
    {"kv_heads not dividing heads", [](Json& j) { j["arch"]["kv_heads"] = 3; }, "/arch/kv_heads", "divisor of heads"},
    {"hidden not divisible by heads", [](Json& j) { j["arch"]["hidden"] = 250; }, "/arch/hidden",
     "not divisible by heads"},
    {"experts not divisible by ep",
     [](Json& j) {
       j["arch"]["moe"] = {{"experts", 6}, {"top_k", 2}, {"expert_ffn_hidden", 64}};
       j["parallel"]["ep"] = 4;
       j["parallel"]["dp"] = 4;
     },
     "/parallel/ep", "arch.moe.experts"},
    {"tp*dp*cp not a multiple of ep",
     [](Json& j) {
       j["arch"]["moe"] = {{"experts", 8}, {"top_k", 2}, {"expert_ffn_hidden", 64}};
       j["parallel"]["ep"] = 8;
       j["parallel"]["dp"] = 2;  // tp 2 x dp 2 = 4 ranks for 8 expert ranks
     },
     "/parallel/ep", "multiple of ep"},
    {"top_k > experts",
     [](Json& j) { j["arch"]["moe"] = {{"experts", 4}, {"top_k", 8}, {"expert_ffn_hidden", 64}}; },
     "/arch/moe/top_k", "[1, 4]"},
    {"unknown moe key",
     [](Json& j) { j["arch"]["moe"] = {{"experts", 4}, {"top_k", 2}, {"expert_ffn_hidden", 64}, {"aux", 1}}; },
     "/arch/moe/aux", "unknown key"},
    {"seq_len not divisible by cp", [](Json& j) { j["parallel"]["cp"] = 3; j["parallel"]["dp"] = 1; },
     "/parallel/cp", "not divisible by cp"},
    {"seq_len not divisible by 2 cp", [](Json& j) { j["train"]["seq_len"] = 6; j["parallel"]["cp"] = 2; j["parallel"]["dp"] = 1; },
     "/parallel/cp", "not divisible by 2*cp (4)"},
    {"sp tokens not divisible by tp",
     [](Json& j) { j["train"]["seq_len"] = 3; j["train"]["micro_batch"] = 1; j["parallel"]["sp"] = true; },
     "/parallel/sp", "not divisible"},
    {"grad offload without pipeline zero2", [](Json& j) { j["parallel"]["grad_offload"] = "host"; },
     "/parallel/grad_offload", "pipeline_zero2"},
    {"pp_layout length", [](Json& j) { j["parallel"]["pp_layout"] = {8}; }, "/parallel/pp_layout",
     "expected 2 entries"},
    {"pp_layout sum", [](Json& j) { j["parallel"]["pp_layout"] = {3, 4}; }, "/parallel/pp_layout", "sum to 7"},
    {"pp_layout below vp",
     [](Json& j) { j["parallel"]["vp"] = 2; j["parallel"]["pp_layout"] = {1, 7}; }, "/parallel/pp_layout/0",
     "[2, 10000]"},
    {"dense model without ffn_hidden", [](Json& j) { j["arch"].erase("ffn_hidden"); }, "/arch", "ffn_hidden"},
    {"linear attention offset",
     [](Json& j) {
       j["arch"]["linear_attention"] = {{"kind", "kda"}, {"full_attention_every", 4}, {"full_attention_offset", 4},
                                        {"head_dim", 32}};
     },
     "/arch/linear_attention/full_attention_offset", "[0, 3]"},
    {"unknown policy", [](Json& j) { j["policies"] = {{{"match", "*"}, {"policy", "compress"}}}; },
     "/policies/0/policy", "expected one of keep"},
    {"illegal composition",
     [](Json& j) { j["policies"] = {{{"match", "*"}, {"policy", {"offload_host", "fp8"}}}}; }, "/policies/0/policy",
     "[fp8, offload_host|offload_remote]"},
    {"empty glob", [](Json& j) { j["policies"] = {{{"match", ""}, {"policy", "keep"}}}; }, "/policies/0/match",
     "non-empty glob"},
    {"cost without a cost", [](Json& j) { j["costs"] = {{{"match", "*"}}}; }, "/costs/0", "at least one of"},
    {"negative cost", [](Json& j) { j["costs"] = {{{"match", "*"}, {"fp8_s", -1}}}; }, "/costs/0/fp8_s",
     "expected a number"},
    {"unknown option", [](Json& j) { j["options"] = {{"turbo", true}}; }, "/options/turbo", "unknown key"},
    {"graph layer beyond model",
     [](Json& j) {
       j["graph"] = {{"layers", {{{"index", 9}, {"kind", "x"}, {"params", Json::array()},
                                  {"tensors", Json::array()}, {"ops", Json::array()}}}}};
     },
     "/graph/layers/0/index", "below arch.layers"},
    {"graph op reads an unknown tensor",
     [](Json& j) {
       j["graph"] = {{"layers",
                      {{{"index", 0}, {"kind", "x"}, {"params", Json::array()}, {"tensors", Json::array()},
                        {"ops", {{{"name", "a"}, {"kind", "add"}, {"module", "m"}, {"inputs", {"nope"}},
                                  {"outputs", Json::array()}, {"flops", 0}, {"bytes_read", 0},
                                  {"bytes_written", 0}}}}}}}};
     },
     "/graph/layers/0/ops/0/inputs/0", "unknown tensor"},
    {"graph tensor bytes disagree with shape",
     [](Json& j) {
       j["graph"] = {{"layers",
                      {{{"index", 0}, {"kind", "x"}, {"params", Json::array()},
                        {"tensors", {{{"name", "t"}, {"shape", {4, 4}}, {"dtype", "bf16"}, {"bytes", 31},
                                      {"saved", true}}}},
                        {"ops", Json::array()}}}}};
     },
     "/graph/layers/0/tensors/0/bytes", "expected 32"},
    {"graph cycle",
     [](Json& j) {
       Json t = {{"shape", {2}}, {"dtype", "fp32"}, {"bytes", 8}, {"saved", false}};
       Json a = t, b = t;
       a["name"] = "a";
       b["name"] = "b";
       Json op1 = {{"name", "f"}, {"kind", "x"}, {"module", "m"}, {"inputs", {"a"}}, {"outputs", {"b"}},
                   {"flops", 0}, {"bytes_read", 0}, {"bytes_written", 0}};
       Json op2 = op1;
       op2["name"] = "g";
       op2["inputs"] = {"b"};
       op2["outputs"] = {"a"};
       j["graph"] = {{"layers", {{{"index", 0}, {"kind", "x"}, {"params", Json::array()},
                                  {"tensors", {a, b}}, {"ops", {op1, op2}}}}}};
     },
     "/graph/layers/0/ops", "cycle"},
};

}  // namespace

TEST_CASE("every validation rule rejects with file, pointer and expectation") {
  for (const auto& c : kBadCases) {
    CAPTURE(c.rule);
    Json j = BaseModel();
    c.mutate(j);
    auto m = ParseModel(j, "bad.json");
    REQUIRE_FALSE(m.ok());
    const std::string& msg = m.error().message;
    CAPTURE(msg);
    CHECK(m.error().code == ErrorCode::kBadInput);
    CHECK(msg.rfind(std::string("bad.json: ") + c.pointer + ":", 0) == 0);
    CHECK(msg.find(c.expected) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }
}

TEST_CASE("the base model parses, with defaults filled") {
  Model m = MustParse(BaseModel());
  CHECK(m.arch.kv_heads == 8);
  CHECK(m.arch.head_dim == 32);
  CHECK(m.parallel.vp == 1);
  CHECK(m.parallel.pp_layout == std::vector<int64_t>{4, 4});
  CHECK(m.train.act_dtype == DType::kBF16);
  CHECK(m.train.grad_dtype == DType::kFP32);
  CHECK(m.hardware.device_memory == 81559LL * 1024 * 1024);
  CHECK(m.budget == m.hardware.device_memory - DefaultReserveBytes(m.hardware));
  CHECK_FALSE(m.options.moe_grad_rewrite);  // no MoE: techniques are off
  CHECK(m.options.pp_balance);
}

TEST_CASE("size strings and overrides") {
  Json j = BaseModel();
  j["hardware"] = {{"preset", "h200"}, {"device_memory", "141GB"}, {"hbm_bw", "4.8TB/s"},
                   {"bf16_flops", "989TFLOP/s"}, {"pp_link_bw", 25e9}};
  j["budget"] = "120GiB";
  Model m = MustParse(j);
  CHECK(m.hardware.device_memory == 141'000'000'000LL);
  CHECK(m.hardware.hbm_bw == doctest::Approx(4.8e12));
  CHECK(m.hardware.pp_link_bw == doctest::Approx(25e9));
  CHECK(m.budget == 120LL << 30);
}

TEST_CASE("normalization is idempotent and the digest is stable") {
  Model m = MustParse(BaseModel());
  Json n1 = NormalizedModelJson(m);
  Model again = MustParse(n1);
  CHECK(NormalizedModelJson(again) == n1);
  CHECK(ModelDigest(again) == ModelDigest(m));
  CHECK(ModelDigest(m).rfind("sha256:", 0) == 0);
  CHECK(ModelDigest(m).size() == 7 + 64);
  Json j = BaseModel();
  j["train"]["micro_batch"] = 4;
  CHECK(ModelDigest(MustParse(j)) != ModelDigest(m));
}

TEST_CASE("default pipeline layout: first and last ranks take fewer") {
  CHECK(DefaultPipelineLayout(8, 2, 1) == std::vector<int64_t>{4, 4});
  CHECK(DefaultPipelineLayout(10, 4, 1) == std::vector<int64_t>{2, 3, 3, 2});
  CHECK(DefaultPipelineLayout(61, 16, 1) == std::vector<int64_t>{2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3});
  CHECK(DefaultPipelineLayout(93, 16, 2) == std::vector<int64_t>{4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5});
  // Outer ranks never drop below vp; inner ranks give up the rest.
  CHECK(DefaultPipelineLayout(5, 4, 1) == std::vector<int64_t>{1, 1, 2, 1});
  CHECK(DefaultPipelineLayout(8, 4, 2) == std::vector<int64_t>{2, 2, 2, 2});
  for (int64_t layers = 1; layers <= 64; ++layers) {
    for (int64_t pp = 1; pp <= layers && pp <= 8; ++pp) {
      for (int64_t vp = 1; pp * vp <= layers && vp <= 3; ++vp) {
        auto l = DefaultPipelineLayout(layers, pp, vp);
        int64_t sum = 0;
        for (int64_t n : l) {
          CHECK(n >= vp);
          sum += n;
        }
        CHECK(sum == layers);
      }
    }
  }
}

TEST_CASE("policies and costs parse in order") {
  Json j = BaseModel();
  j["policies"] = {{{"match", "*.mlp.*"}, {"policy", "recompute"}},
                   {{"match", "layer0.*"}, {"policy", {"fp8", "offload_remote"}}}};
  j["costs"] = {{{"match", "*"}, {"recompute_s", 0.001}}};
  Model m = MustParse(j);
  REQUIRE(m.policies.size() == 2);
  CHECK(m.policies[1].policy == std::vector<Policy>{Policy::kFp8, Policy::kOffloadRemote});
  REQUIRE(m.costs.size() == 1);
  CHECK(*m.costs[0].recompute_s == doctest::Approx(0.001));
  CHECK_FALSE(m.costs[0].fp8_s.has_value());
}

TEST_CASE("every bundled example parses") {
  for (const char* name : {"tiny-gpt", "tiny-llama", "tiny-deepseek", "tiny-attnres", "llama2-7b-shape", "tiny-moe", "gpt3-175b", "llama3-70b", "deepseek-v3", "kimi-k2",
                           "kimi-k3-like"}) {
    CAPTURE(name);
    auto m = LoadModel(memplan::test::SourcePath(std::string("examples/models/") + name + ".json"));
    if (!m) FAIL(m.error().message);
    CHECK(m->name.size() > 0);
  }
}

TEST_CASE("a missing file and invalid JSON are one-line errors") {
  auto missing = LoadModel("/nonexistent/model.json");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().message.rfind("/nonexistent/model.json: cannot open", 0) == 0);
  auto bad = LoadModel(memplan::test::SourcePath("tests/data/bad/syntax.json"));
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().message.find("invalid JSON") != std::string::npos);
  CHECK(bad.error().message.find('\n') == std::string::npos);
}

TEST_CASE("with MLA, hidden need not divide by heads; without it the error says what to give") {
  Json k3 = memplan::test::ReadJson("examples/models/kimi-k3-like.json");
  k3["arch"]["heads"] = 96;
  k3["arch"]["hidden"] = 7168;  // 7168 / 96 is not an integer
  k3["arch"].erase("head_dim");
  auto m = ParseModel(k3, "k3.json");
  REQUIRE(m.ok());
  CHECK(m->arch.head_dim == m->arch.mla->qk_nope_head_dim + m->arch.mla->qk_rope_head_dim);
  Json plain = memplan::test::ReadJson("examples/models/tiny-gpt.json");
  plain["arch"]["hidden"] = 65;
  plain["arch"].erase("head_dim");
  auto bad = ParseModel(plain, "gpt.json");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().message.find("gpt.json: /arch/hidden") != std::string::npos);
  CHECK(bad.error().message.find("give arch.head_dim") != std::string::npos);
}
