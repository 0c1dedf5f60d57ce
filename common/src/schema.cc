#include "memplan/common/schema.h"

#include <valijson/adapters/nlohmann_json_adapter.hpp>
#include <valijson/schema.hpp>
#include <valijson/schema_parser.hpp>
#include <valijson/validation_results.hpp>
#include <valijson/validator.hpp>

#include <memory>
#include <string_view>

#include "memplan/common/check.h"

namespace memplan {

namespace schema_text {
extern const std::string_view k_model;
extern const std::string_view k_plan;
extern const std::string_view k_measured;
extern const std::string_view k_hardware;
extern const std::string_view k_search;
}  // namespace schema_text

namespace {

// Parsed once per process (function-local statics are thread-safe).
const valijson::Schema& Compiled(SchemaKind kind) {
  auto compile = [](std::string_view text) {
    auto schema = std::make_unique<valijson::Schema>();
    Json doc = Json::parse(text);
    valijson::SchemaParser parser;
    valijson::adapters::NlohmannJsonAdapter adapter(doc);
    parser.populateSchema(adapter, *schema);
    return schema;
  };
  static const auto model = compile(schema_text::k_model);
  static const auto plan = compile(schema_text::k_plan);
  static const auto measured = compile(schema_text::k_measured);
  static const auto hardware = compile(schema_text::k_hardware);
  static const auto search = compile(schema_text::k_search);
  switch (kind) {
    case SchemaKind::kModel: return *model;
    case SchemaKind::kPlan: return *plan;
    case SchemaKind::kMeasured: return *measured;
    case SchemaKind::kHardware: return *hardware;
    case SchemaKind::kSearch: return *search;
  }
  MEMPLAN_CHECK(false, "unknown schema kind");
  return *model;
}

// valijson's context ["<root>", "[ranks]", "[0]"] as a JSON pointer.
std::string ToPointer(const std::vector<std::string>& context) {
  std::string pointer;
  for (const std::string& c : context) {
    if (c.size() >= 2 && c.front() == '[' && c.back() == ']') pointer = PointerAppend(pointer, c.substr(1, c.size() - 2));
  }
  return pointer.empty() ? "/" : pointer;
}

}  // namespace

Expected<bool> ValidateSchema(const Json& doc, SchemaKind kind, const std::string& file) {
  valijson::Validator validator;
  valijson::ValidationResults results;
  valijson::adapters::NlohmannJsonAdapter adapter(doc);
  if (validator.validate(Compiled(kind), adapter, &results)) return true;
  // valijson reports enclosing violations ("failed to match the schema of
  // items") before the one that caused them: the deepest is the useful one.
  valijson::ValidationResults::Error e, deepest;
  while (results.popError(e)) {
    if (e.context.size() > deepest.context.size()) deepest = e;
  }
  std::string what = deepest.description;
  while (!what.empty() && (what.back() == '.' || what.back() == '\n')) what.pop_back();
  const std::string pointer = ToPointer(deepest.context);
  if (pointer != "/") {
    const Json::json_pointer at(pointer);
    if (doc.contains(at) && !doc.at(at).is_structured()) what += ", got " + Brief(doc.at(at));
  }
  const char* name = kind == SchemaKind::kPlan       ? "memplan.plan/1"
                     : kind == SchemaKind::kMeasured ? "memplan.measured/1"
                     : kind == SchemaKind::kHardware ? "memplan.hardware/1"
                     : kind == SchemaKind::kSearch   ? "memplan.search/1"
                                                     : "memplan.model/1";
  return Error{ErrorCode::kBadInput, OneLine(file + ": " + pointer + ": " + what) + " (schema " + name + ")"};
}

}  // namespace memplan
