// Fuzz target: the command line's argument parser. The input is split at
// NUL bytes into arguments (argv without the program name); parsing does
// no I/O, so any argument vector must give a Command or a one-line usage
// error.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cli.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<std::string> args = memplan::fuzz::Arguments(data, size);
  auto command = memplan::cli::ParseCommandLine(args);
  if (!command) {
    const auto& e = command.error();
    if (e.code != memplan::ErrorCode::kBadInput) memplan::fuzz::Broken("usage error is not exit 2", e.message);
    memplan::fuzz::CheckError(e, "");
  }
  return 0;
}
