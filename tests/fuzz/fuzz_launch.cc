// Fuzz target: the MPI start-up agreement (tools/cli.h, LaunchMismatch).
// The input is two argument vectors (rank 0's and rank 1's), split at a
// 0xff byte, each split at NUL bytes as fuzz_cli does; what the rest of the
// input holds is also offered as the lines of a third rank running another
// memplan. Properties: two `run` commands agree exactly when their
// LaunchOptions are equal, a mismatch is one line naming the rank, and
// foreign lines are a mismatch, never an exception.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cli.h"
#include "fuzz_util.h"

namespace {

void CheckMismatch(const std::optional<std::string>& why, const char* rank) {
  if (!why) return;
  if (why->find('\n') != std::string::npos) memplan::fuzz::Broken("mismatch is not one line", *why);
  if (why->rfind(rank, 0) != 0) memplan::fuzz::Broken("mismatch does not name the rank", *why);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memplan;
  size_t split = 0;
  while (split < size && data[split] != 0xff) ++split;
  const size_t rest = split < size ? split + 1 : size;
  auto a = cli::ParseCommandLine(fuzz::Arguments(data, split));
  auto b = cli::ParseCommandLine(fuzz::Arguments(data + rest, size - rest));
  if (!a || !b || a->verb != cli::Verb::kRun || b->verb != cli::Verb::kRun) {
    // Foreign lines against a default `run`.
    cli::Command run;
    run.verb = cli::Verb::kRun;
    const std::string foreign(reinterpret_cast<const char*>(data), size);
    auto why = cli::LaunchMismatch({cli::LaunchOptions(run), foreign});
    if (why.has_value() == (foreign == cli::LaunchOptions(run))) fuzz::Broken("foreign lines judged wrongly", foreign);
    CheckMismatch(why, "rank 1");
    return 0;
  }
  const std::string la = cli::LaunchOptions(*a), lb = cli::LaunchOptions(*b);
  auto why = cli::LaunchMismatch({la, la, lb});
  if (why.has_value() != (la != lb)) fuzz::Broken("agreement differs from equality", la + " | " + lb);
  CheckMismatch(why, "rank 2");
  return 0;
}
