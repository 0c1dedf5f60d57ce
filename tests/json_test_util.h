// JSON helpers shared by the test suites: source-tree paths, reading a file
// that must parse, and JSON Schema validation (valijson, when available).
#pragma once

#include <stdexcept>
#include <string>

#include "memplan/common/json_util.h"

#ifdef MEMPLAN_HAVE_VALIJSON
#include <valijson/adapters/nlohmann_json_adapter.hpp>
#include <valijson/schema.hpp>
#include <valijson/schema_parser.hpp>
#include <valijson/validation_results.hpp>
#include <valijson/validator.hpp>
#endif

namespace memplan::test {

inline std::string SourcePath(const std::string& relative) {
  return std::string(MEMPLAN_SOURCE_ROOT) + "/" + relative;
}

inline Json ReadJson(const std::string& relative) {
  auto j = ReadJsonFile(SourcePath(relative));
  if (!j) throw std::runtime_error(j.error().message);
  return *j;
}

#ifdef MEMPLAN_HAVE_VALIJSON
// Returns "" when `doc` validates against the schema, else its first errors.
inline std::string SchemaErrors(const std::string& schema_file, const Json& doc) {
  Json schema_json = ReadJson(schema_file);
  valijson::Schema schema;
  valijson::SchemaParser parser;
  valijson::adapters::NlohmannJsonAdapter schema_adapter(schema_json);
  parser.populateSchema(schema_adapter, schema);
  valijson::Validator validator;
  valijson::ValidationResults results;
  valijson::adapters::NlohmannJsonAdapter doc_adapter(doc);
  if (validator.validate(schema, doc_adapter, &results)) return "";
  valijson::ValidationResults::Error e;
  std::string out;
  for (int n = 0; n < 3 && results.popError(e); ++n) {
    std::string ctx;
    for (const auto& c : e.context) ctx += c;
    out += ctx + ": " + e.description + "; ";
  }
  return out;
}
#endif

}  // namespace memplan::test
