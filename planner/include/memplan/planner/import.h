// `memplan import`: a model file from the files users already have
// (docs/import.md). A Hugging Face config.json gives the architecture; the
// layout and the batch come from the command line. A Megatron-LM argument
// list gives both.
//
// Nothing is defaulted silently: a field that changes memory and is not
// understood, an unknown model_type or a missing size is a one-line error
// naming the file and the JSON pointer (or the argument), and the model
// written is one ParseModel accepts (it is parsed before it is returned).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"

namespace memplan::planner {

// The run around the architecture: what a config.json does not say.
struct ImportOptions {
  int64_t gpus = 0;          // every process of the run (tp * cp * dp * pp)
  int64_t global_batch = 0;  // sequences per optimizer step
  int64_t seq_len = 0;
  int64_t micro_batch = 1;
  int64_t tp = 1, pp = 1, vp = 1, ep = 1, cp = 1;
  bool sp = false;
  int zero = 1;              // the distributed optimizer (Megatron's and most users' choice)
  std::string optimizer = "adam";
  std::string hardware = "h100";
  bool no_mtp = false;       // plan without the checkpoint's multi-token-prediction layers
  // Megatron: store every tensor as the arguments say (their recompute and
  // offload modules, everything else kept, as Megatron does) instead of
  // leaving what they do not mention to memplan. `memplan export` writes
  // argument lists meant for this.
  bool as_written = false;
  std::string name;          // empty: from the file
};

// A memplan.model/1 document from a Hugging Face config.json (already
// read; `file` names it in errors). Architectures: docs/import.md.
Expected<OrderedJson> ImportHuggingFace(const Json& config, const std::string& file, const ImportOptions& options);

// A memplan.model/1 document from a Megatron-LM argument list: the text of
// a file of arguments as given to pretrain_gpt.py (whitespace-separated,
// `\` line continuations and `#` comments allowed). `options.gpus` is the
// world size, which Megatron takes from its launcher; the rest of
// `options` is unused (the arguments say it).
Expected<OrderedJson> ImportMegatron(const std::string& text, const std::string& file, const ImportOptions& options);

}  // namespace memplan::planner
