// Helpers shared by the planner test suites.
#pragma once

#include <string>

#include "memplan/common/json_util.h"
#include "memplan/planner/model.h"
#include "json_test_util.h"

namespace memplan::test {

inline planner::Model MustLoad(const std::string& relative) {
  auto m = planner::LoadModel(SourcePath(relative));
  if (!m) throw std::runtime_error(m.error().message);
  return *m;
}

inline planner::Model MustParse(const Json& j) {
  auto m = planner::ParseModel(j, "test.json");
  if (!m) throw std::runtime_error(m.error().message);
  return *m;
}

// A small valid gpt-style model to mutate.
inline Json BaseModel() {
  return Json::parse(R"({
    "schema": "memplan.model/1",
    "name": "base",
    "arch": {"layers": 8, "hidden": 256, "heads": 8, "ffn_hidden": 1024, "vocab": 1000,
             "ffn_act": "gelu", "norm": "layernorm", "attention": "standard", "dropout": true},
    "train": {"seq_len": 128, "micro_batch": 2, "microbatches": 8},
    "parallel": {"tp": 2, "pp": 2},
    "hardware": {"preset": "h100"}
  })");
}

}  // namespace memplan::test
