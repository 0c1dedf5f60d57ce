// `memplan import megatron` (import.h, docs/import.md).
#include "memplan/planner/import.h"

namespace memplan::planner {

Expected<OrderedJson> ImportMegatron(const std::string&, const std::string& file, const ImportOptions&) {
  return Error{ErrorCode::kBadInput, file + ": not yet"};
}

}  // namespace memplan::planner
