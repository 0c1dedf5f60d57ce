// Fuzz target: a Megatron-LM argument list as `memplan import megatron`
// reads it (8 GPUs): a model the planner reads, or one line naming the
// file (Megatron's parser refuses what memplan refuses).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "memplan/planner/import.h"
#include "memplan/planner/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memplan;
  const std::string text(reinterpret_cast<const char*>(data), size);
  planner::ImportOptions o;
  o.gpus = 8;
  auto model = planner::ImportMegatron(text, fuzz::kFile, o);
  if (!model) {
    const std::string& m = model.error().message;
    if (m.rfind(std::string(fuzz::kFile) + " (imported): /", 0) == 0) return 0;
    fuzz::CheckError(model.error());
    return 0;
  }
  auto parsed = planner::ParseModel(Json::parse(model->dump()), fuzz::kFile);
  if (!parsed) fuzz::Broken("an imported model the planner refuses", parsed.error().message);
  return 0;
}
