// memplan: the command line. Parses argv into a Command (cli.cc) and runs
// it (commands.cc); both are libraries so that tests and fuzzers reach them.
#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.h"
#include "memplan/common/heap_tuning.h"
#include "memplan/runtime/comm.h"

int main(int argc, char** argv) {
  memplan::KeepFreedHeapMemory();
  // A reader that goes away (`memplan plan ... -o /dev/stdout | head`) is a
  // failed write (exit 5, outputs rolled back), not a killed process.
  std::signal(SIGPIPE, SIG_IGN);
  std::vector<std::string> args(argv + 1, argv + argc);
  auto command = memplan::cli::ParseCommandLine(args);
  if (!command) {
    // Under mpirun every process parses the same arguments: rank 0 says it.
    if (memplan::runtime::LaunchRank() <= 0) {
      std::fprintf(stderr, "memplan: %s\n", memplan::OneLine(command.error().message).c_str());
    }
    return static_cast<int>(command.error().code);
  }
  return memplan::cli::RunCommand(*command);
}
