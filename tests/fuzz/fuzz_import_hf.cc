// Fuzz target: a Hugging Face config.json as `memplan import hf` reads it
// (8 GPUs, global batch 64, sequence 4096): a model the planner reads, or
// one line naming the config (or the imported model) and a JSON pointer.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "memplan/planner/import.h"
#include "memplan/planner/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memplan;
  auto doc = fuzz::Parse(data, size);
  if (!doc) return 0;
  planner::ImportOptions o;
  o.gpus = 8;
  o.global_batch = 64;
  o.seq_len = 4096;
  auto model = planner::ImportHuggingFace(*doc, fuzz::kFile, o);
  if (!model) {
    // Errors of the generated model name it ("fuzz.json (imported): /arch/...")
    // where no config key stands behind the field.
    const std::string& m = model.error().message;
    if (m.rfind(std::string(fuzz::kFile) + " (imported): /", 0) == 0) return 0;
    fuzz::CheckError(model.error());
    return 0;
  }
  // What import writes, the planner reads.
  auto parsed = planner::ParseModel(Json::parse(model->dump()), fuzz::kFile);
  if (!parsed) fuzz::Broken("an imported model the planner refuses", parsed.error().message);
  return 0;
}
