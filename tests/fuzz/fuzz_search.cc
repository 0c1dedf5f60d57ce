// Fuzz target: SEARCH.json (memplan.search/1) and the candidates `search`
// processes exchange under mpirun (rank 0 decodes every other process's
// verdicts with CandidateFromJson): a schema verdict and, per layout, a
// candidate or an error, never a crash; a decoded candidate encodes back to
// what decodes to itself.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "memplan/common/schema.h"
#include "memplan/planner/search.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memplan;
  auto doc = fuzz::Parse(data, size);
  if (!doc) return 0;
  if (auto valid = ValidateSchema(*doc, SchemaKind::kSearch, fuzz::kFile); !valid) fuzz::CheckError(valid.error());
  const Json* list = doc->is_array() ? &*doc : doc->is_object() && doc->contains("layouts") ? &(*doc)["layouts"] : nullptr;
  if (list == nullptr || !list->is_array()) return 0;
  for (const Json& e : *list) {
    auto cand = planner::CandidateFromJson(e.is_object() && e.contains("c") ? e["c"] : e);
    if (!cand) continue;
    const Json again = planner::CandidateToJson(*cand);
    auto back = planner::CandidateFromJson(again);
    if (!back || planner::CandidateToJson(*back) != again) {
      fuzz::Broken("a decoded candidate does not survive its own encoding", again.dump().substr(0, 200));
    }
  }
  return 0;
}
