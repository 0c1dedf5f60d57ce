// Helpers shared by the executor suites (executor_test.cc,
// executor_gradients_test.cc): plans as `memplan plan -o` writes them, runs
// that fail the test case on error.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "json_test_util.h"
#include "memplan/planner/plan.h"
#include "memplan/runtime/executor.h"
#include "memplan/runtime/npy.h"
#include "test_util.h"

namespace memplan::test::exec {

using runtime::RunOptions;
using runtime::RunPlan;
using runtime::RunResult;

inline Json LoadJson(const std::string& relative) {
  auto j = ReadJsonFile(std::string(MEMPLAN_SOURCE_ROOT) + "/" + relative);
  REQUIRE(j.ok());
  return *j;
}

// The plan of `model` as `memplan plan -o` writes it.
inline Json PlanOf(const Json& model) {
  auto m = MustParse(model);
  auto p = planner::BuildPlan(m);
  REQUIRE(p.ok());
  return Json::parse(planner::PlanToJson(*p).dump());
}

inline Json WithPolicy(Json model, const Json& policy, const std::string& match = "*") {
  model["policies"] = Json::array({{{"match", match}, {"policy", policy}}});
  return model;
}

// Saved tensors the plan does not keep: a mix under test must move some,
// or it only repeats the keep case.
inline int NotKept(const Json& plan) {
  int n = 0;
  for (const auto& t : plan.at("tensors")) n += t.at("effective") != Json::array({"keep"});
  return n;
}

inline RunResult MustRun(const Json& plan, RunOptions options = {}) {
  auto r = RunPlan(plan, options);
  if (!r.ok()) FAIL(r.error().message);
  return *r;
}

// A fresh directory per process: test runs may overlap.
// The float32 array of a --dump file, and its shape when `shape` is given.
inline std::vector<float> NpyFloats(const std::filesystem::path& file, std::vector<int64_t>* shape = nullptr) {
  auto npy = memplan::runtime::ReadNpy(file.string());
  REQUIRE_MESSAGE(npy.ok(), file.string());
  std::vector<float> v(npy->bytes.size() / 4);
  std::memcpy(v.data(), npy->bytes.data(), npy->bytes.size());
  if (shape) *shape = npy->shape;
  return v;
}

inline std::filesystem::path UniqueTempDir(const std::string& stem) {
  return std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(::getpid()));
}

inline const char* kModels[] = {"examples/models/tiny-gpt.json", "examples/models/tiny-llama.json",
                                "examples/models/tiny-deepseek.json", "examples/models/tiny-attnres.json",
                                "examples/models/tiny-mla.json"};

}  // namespace memplan::test::exec
