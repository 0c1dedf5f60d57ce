// `memplan import` (planner/import.h, docs/import.md): a model file from a
// Hugging Face config.json or a Megatron-LM argument list, on stdout or
// written whole with -o.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "command_util.h"
#include "memplan/planner/assumptions.h"
#include "memplan/planner/import.h"
#include "memplan/planner/model.h"

namespace memplan::cli {

int RunImport(const Command& c) {
  if (auto ok = CheckOutputs({c.output}, c.input); !ok) return Fail(ok.error());
  planner::ImportOptions o;
  o.gpus = c.gpus;
  o.global_batch = c.global_batch;
  o.seq_len = c.seq;
  o.micro_batch = c.micro_batch;
  o.tp = c.tp;
  o.pp = c.pp;
  o.vp = c.vp;
  o.ep = c.ep;
  o.cp = c.cp;
  o.sp = c.sp;
  o.zero = c.zero;
  o.optimizer = c.optimizer;
  o.hardware = c.hardware;
  o.no_mtp = c.no_mtp;
  o.as_written = c.as_written;
  o.name = c.name;
  Expected<OrderedJson> model = Error{ErrorCode::kBadInput, ""};
  if (c.import_kind == "hf") {
    auto config = ReadJsonFile(c.input);
    if (!config) return Fail(config.error());
    model = planner::ImportHuggingFace(*config, c.input, o);
  } else {
    std::ifstream in(c.input, std::ios::binary);
    if (!in) return Fail({ErrorCode::kBadInput, c.input + ": cannot read the argument list"});
    std::ostringstream text;
    text << in.rdbuf();
    if (text.str().size() > (1u << 20)) return Fail({ErrorCode::kBadInput, c.input + ": over 1 MiB, not an argument list"});
    model = planner::ImportMegatron(text.str(), c.input, o);
  }
  if (!model) return Fail(model.error());
  if (!c.quiet) {
    // What the import chose that the config or arguments did not say.
    if (auto parsed = planner::ParseModel(Json::parse(model->dump()), c.output.empty() ? c.input : c.output)) {
      planner::AssumptionsContext context;
      context.verb = planner::AssumptionsFor::kImport;
      std::fputs(planner::RenderAssumptions(*parsed, context).c_str(), stderr);
    }
  }
  if (c.output.empty()) {
    std::fputs((model->dump(2) + "\n").c_str(), stdout);
    return 0;
  }
  OutputFiles out;
  if (auto st = StageJson(out, c.output, *model, 2); !st) return Fail(st.error());
  if (auto st = out.Commit(); !st) return Fail(st.error());
  return 0;
}

}  // namespace memplan::cli
