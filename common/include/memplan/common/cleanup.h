// What a process removes, and whom it tells, when a signal ends it.
//
// A command stages its outputs beside their targets (output.h) and renames
// them into place at the end; `memplan profile` keeps a temporary directory
// while its program runs. A signal that ends the process (SIGTERM from
// `timeout` or from mpirun when another rank died, SIGINT, SIGHUP) would
// skip every destructor and leave them behind. The handlers installed here
// remove every registered path, then end the process by the same signal.
// While a child runs under ForwardSignalsTo, the signal goes to the child
// instead, and the caller waits for it, cleans up and ends by the signal.
// A signal whose disposition was SIG_IGN (nohup) stays ignored.
#pragma once

#include <sys/types.h>

#include <string>

namespace memplan {

// Removes `path` (a file, or a directory and everything under it) if the
// process is ended by a signal or calls RemoveCleanupPaths(). Returns a
// slot for DropCleanupPath, or -1 when every slot is taken (the path is
// then only removed by its owner). Relative paths are made absolute.
int AddCleanupPath(const std::string& path);
// The owner committed or removed the path itself: forget it.
void DropCleanupPath(int slot);
// Removes every registered path now (async-signal-safe: also called from
// the handlers, and before an abort that runs no destructor, such as
// MPI_Abort).
void RemoveCleanupPaths();

// Until ForwardSignalsTo(0): a terminating signal is sent on to `child`
// and its process group when it leads one (which then ends, and the
// caller's waitpid returns) instead of ending this process. ForwardedSignal() is the last signal forwarded, or 0.
void ForwardSignalsTo(pid_t child);
int ForwardedSignal();
// Ends this process by `sig` as if it had not been caught (after the
// caller cleaned up): the default disposition, then raise().
[[noreturn]] void EndBySignal(int sig);

}  // namespace memplan
