// PLAN.json read back (replay.h).
#include "memplan/planner/replay.h"

#include <map>
#include <unordered_map>
#include <vector>

#include "memplan/common/schema.h"
#include "memplan/planner/plan.h"

namespace memplan::planner {
namespace {

Error Bad(const std::string& message) { return Error{ErrorCode::kBadInput, message}; }

}  // namespace

Expected<Model> ReadPlanModel(const Json& plan, const std::string& file) {
  if (plan.is_object() && plan.contains("arch") && !plan.contains("model")) {
    return Bad(file + ": this is a model file, not a plan; run `memplan plan " + file + " -o PLAN.json` first");
  }
  if (!plan.is_object() || !plan.contains("model") || !plan.contains("tensors")) {
    return Bad(file + ": not a memplan plan (expected an object with /model and /tensors)");
  }
  if (plan.value("schema", Json()) != Json(std::string(kPlanSchema))) {
    return Bad(file + ": /schema: expected \"" + std::string(kPlanSchema) + "\"");
  }
  if (!plan.contains("digest") || !plan["digest"].is_string()) {
    return Bad(file + ": /digest: expected a string");
  }
  if (!plan["tensors"].is_array()) return Bad(file + ": /tensors: expected an array");
  if (!plan.contains("ranks") || !plan["ranks"].is_array()) {
    return Bad(file + ": /ranks: expected an array");
  }
  // The whole plan against its schema before any field is used: a field
  // a reader rebuilds rather than reads (tensors, schedule) is still
  // refused when malformed.
  if (auto valid = ValidateSchema(plan, SchemaKind::kPlan, file); !valid.ok()) return valid.error();
  auto model = ParseModel(plan["model"], file + " /model");
  if (!model.ok()) return model.error();
  if (plan["digest"].get<std::string>() != ModelDigest(*model)) {
    return Bad(file + ": /digest does not match the embedded model (the plan was edited or is corrupt)");
  }
  return model;
}

Expected<Assignment> ReadPlanAssignment(const Json& plan, const std::string& file, const PlanningProblem& p) {
  // One of the legal compositions per tensor.
  std::unordered_map<std::string, std::pair<Storage, int32_t>> decided;
  const Json& ts = plan["tensors"];
  const std::map<std::vector<std::string>, Storage> kCompositions = {
      {{"keep"}, Storage::kKeep},
      {{"recompute"}, Storage::kRecompute},
      {{"fp8"}, Storage::kFp8},
      {{"offload_host"}, Storage::kOffloadHost},
      {{"offload_remote"}, Storage::kOffloadRemote},
      {{"fp8", "offload_host"}, Storage::kFp8OffloadHost},
      {{"fp8", "offload_remote"}, Storage::kFp8OffloadRemote}};
  for (size_t i = 0; i < ts.size(); ++i) {
    const Json& t = ts[i];
    std::string where = file + ": /tensors/" + std::to_string(i);
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) {
      return Bad(where + ": expected an object with a string \"name\"");
    }
    if (!t.contains("effective") || !t["effective"].is_array()) return Bad(where + "/effective: expected an array");
    std::vector<std::string> names;
    for (const auto& n : t["effective"]) {
      if (!n.is_string()) return Bad(where + "/effective: expected policy names");
      names.push_back(n.get<std::string>());
    }
    auto comp = kCompositions.find(names);
    if (comp == kCompositions.end()) {
      return Bad(where + "/effective: expected keep, recompute, fp8, offload_host, offload_remote or "
                              "[fp8, offload_host|offload_remote]");
    }
    int32_t target = -1;
    if (t.contains("to_pp_rank")) {
      if (!t["to_pp_rank"].is_number_integer()) return Bad(where + "/to_pp_rank: expected an integer");
      target = t["to_pp_rank"].get<int32_t>();
    }
    if (!decided.emplace(t["name"].get<std::string>(), std::pair{comp->second, target}).second) {
      return Bad(where + "/name: " + t["name"].get<std::string>() + " is listed twice");
    }
  }
  Assignment a = Assignment::KeepAll(p);
  const int64_t pp = static_cast<int64_t>(p.tensors.size());
  for (size_t r = 0; r < p.tensors.size(); ++r) {
    for (size_t t = 0; t < p.tensors[r].size(); ++t) {
      auto it = decided.find(p.tensors[r][t].name);
      if (it == decided.end()) {
        return Bad(file + ": /tensors has no entry for " + p.tensors[r][t].name + " (a different planner made it)");
      }
      const SavedTensor& st = p.tensors[r][t];
      auto [storage, target] = it->second;
      if (auto why = StorageRefusal(st, storage, pp, static_cast<int32_t>(r), target)) {
        return Bad(file + ": /tensors: " + *why);
      }
      a.storage[r][t] = storage;
      a.target[r][t] = target;
    }
  }
  return a;
}

}  // namespace memplan::planner

namespace memplan::planner {

std::string ExecutionDigest(const std::string& model_digest, const Assignment& a) {
  std::string text = model_digest;
  for (size_t r = 0; r < a.storage.size(); ++r) {
    text += "\n" + std::to_string(r) + ":";
    for (size_t t = 0; t < a.storage[r].size(); ++t) {
      text += " " + std::to_string(static_cast<int>(a.storage[r][t])) + "/" + std::to_string(a.target[r][t]);
    }
  }
  return Sha256Hex(text);
}

}  // namespace memplan::planner
