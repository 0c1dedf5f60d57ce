// The op registry (planner/op_registry.h) and its runtime half
// (runtime/src/op_impls.h): one row per kind, in order, names unique;
// every executable kind implemented; every op the templates emit for the
// bundled examples registered and bound to its parameters.
#include <doctest/doctest.h>

#include <filesystem>
#include <set>
#include <string>

#include "memplan/planner/liveness.h"
#include "memplan/planner/model.h"
#include "memplan/planner/op_registry.h"
#include "memplan/planner/templates.h"
#include "op_impls.h"

using namespace memplan;
using namespace memplan::planner;

TEST_CASE("the registry has one row per kind, named once, found by name") {
  std::set<std::string_view> names;
  int rows = 0;
  for (const OpDef& d : AllOpDefs()) {
    ++rows;
    CHECK(d.kind != OpKind::kUnknown);
    CHECK(&GetOpDef(d.kind) == &GetOpDef(OpKindFromName(d.name)));
    CHECK(names.insert(d.name).second);
    CHECK(d.executable == d.why_not.empty());
  }
  CHECK(rows == static_cast<int>(OpKind::kCount) - 1);
  CHECK(OpKindFromName("no_such_kind") == OpKind::kUnknown);
  CHECK_FALSE(GetOpDef(OpKind::kUnknown).executable);
}

TEST_CASE("every executable kind has a forward and a backward in the runtime; the others none") {
  int executable = 0;
  for (const OpDef& d : AllOpDefs()) {
    CAPTURE(d.name);
    const auto& impl = runtime::exec::GetOpImpl(d.kind);
    CHECK((impl.forward != nullptr) == d.executable);
    CHECK((impl.backward != nullptr) == d.executable);
    executable += d.executable;
  }
  CHECK(executable >= 20);
}

TEST_CASE("what a backward reads follows the registry (combine reads Y only when it is saved)") {
  LayerGraph g;
  auto tensor = [&](const std::string& name, bool saved) {
    TensorSpec t;
    t.name = name;
    t.shape = {4};
    t.dtype = DType::kFP32;
    t.bytes = 16;
    t.saved = saved;
    g.tensors.push_back(t);
  };
  tensor("y", false);
  tensor("gates", true);
  tensor("slot", true);
  tensor("out", false);
  OpSpec op;
  op.name = "moe.combine";
  op.kind = "combine";
  op.inputs = {"y", "gates", "slot"};
  op.outputs = {"out"};
  g.ops.push_back(op);
  g.Finalize(JsonLocation{"t.json", ""});
  CHECK(g.ops[0].op == OpKind::kCombine);
  CHECK(BackwardReads(g, g.ops[0]) == std::vector<int32_t>{1, 2});
  g.tensors[0].saved = true;  // the native router gradient <dO, Y>
  CHECK(BackwardReads(g, g.ops[0]) == std::vector<int32_t>{0, 1, 2});
  CHECK_FALSE(GradAccumulates(OpKind::kCombine));
  CHECK(GradAccumulates(OpKind::kAdd));
}

TEST_CASE("every op of every bundled example is registered and bound to its parameters") {
  namespace fs = std::filesystem;
  int models = 0, ops = 0, bound = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(MEMPLAN_SOURCE_ROOT) / "examples" / "models")) {
    if (entry.path().extension() != ".json") continue;
    CAPTURE(entry.path().string());
    auto model = LoadModel(entry.path().string());
    REQUIRE(model.ok());
    auto layers = ExpandModel(*model);
    REQUIRE(layers.ok());
    ++models;
    for (const auto& g : *layers) {
      std::set<std::string> names;
      for (const auto& p : g.params) names.insert(p.name);
      for (const auto& op : g.ops) {
        CAPTURE(op.name);
        ++ops;
        CHECK(op.op != OpKind::kUnknown);
        const OpDef& d = GetOpDef(op.op);
        // Every role is bound to a parameter of the layer, except a tied
        // head (it reads the embedding) and a head on a model without one.
        const bool tied_head = op.module == "head" && model->arch.tied_embeddings;
        if (!tied_head) CHECK(op.params.size() == d.params.size());
        for (const auto& p : op.params) {
          CHECK(names.count(p) == 1);
          ++bound;
        }
      }
    }
  }
  CHECK(models >= 11);
  MESSAGE(ops << " ops of " << models << " models, " << bound << " parameter bindings checked");
  CHECK(bound > 100);
}
