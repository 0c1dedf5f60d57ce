// Writing a command's outputs all or nothing.
//
// A command that fails leaves none of its outputs (docs/design.md, "Input
// limits and hostile input"). OutputFiles stages every file first and
// commits them together at the end:
//  - a regular file (or a path that does not exist yet) is written to a
//    temporary file beside it and renamed into place at Commit(), so a
//    reader never sees half a file and a failure leaves the old one intact;
//    an existing file keeps its permission bits;
//  - a symbolic link is followed (up to 40 links, like the kernel): the
//    link stays, its target is written as above;
//  - a character device or FIFO (`/dev/null`, a named pipe) is written
//    straight through at Commit(), before any rename (appending, so a
//    shell's `>>` keeps its meaning), and a short or failed write
//    (`/dev/full`), or a FIFO nobody reads, fails the whole commit; nothing
//    is ever renamed over a device;
//  - `/dev/stdout`, `/dev/stderr`, `/dev/fd/N` and `/proc/self/fd/N` are
//    this process's descriptors, written directly (a pipe or a socket
//    behind them works; their links are not followed);
//  - a directory, socket path or block device is refused at Stage().
// Commit() keeps the previous version of every file aside until all the
// renames succeeded, so a failing commit leaves every output as it was;
// streams, written first, cannot be taken back. Staged temporaries are
// removed when the object dies without Commit(), and when a signal ends
// the process before it (common/cleanup.h). The same file staged
// twice (`-o x --trace x`) is refused (kBadInput). Other errors are
// kRuntime ("PATH: what went wrong").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/status.h"

namespace memplan {

class OutputFiles {
 public:
  OutputFiles() = default;
  OutputFiles(const OutputFiles&) = delete;
  OutputFiles& operator=(const OutputFiles&) = delete;
  ~OutputFiles();

  // Checks that `path` can be written (its directory exists, it is not a
  // directory) without writing anything: commands call it for every output
  // before doing their work, so a bad path fails in milliseconds.
  static Expected<bool> CheckWritable(const std::string& path);
  // CheckWritable for every file, StageDirectory's checks for every
  // directory (except the replace rule), and no two naming one file
  // (kBadInput, the same refusal Stage makes; reported before any other).
  static Expected<bool> CheckAll(const std::vector<std::string>& files,
                                 const std::vector<std::string>& directories = {});

  // Stages `content` for `path`. On error nothing is left for this path.
  Expected<bool> Stage(const std::string& path, std::string_view content);

  // Stages a directory: returns a fresh temporary directory beside `dir`
  // for the caller to fill; at Commit() it replaces `dir`. An existing
  // `dir` is replaced only when it holds nothing but what a dump writes
  // (sub-directories of *.npy files), so a mistyped path never deletes
  // somebody's files.
  Expected<std::string> StageDirectory(const std::string& dir);

  // Writes the devices, then renames every staged file into place.
  Expected<bool> Commit();

 private:
  struct Entry {
    std::string given;      // the path as the caller gave it (messages)
    std::string target;     // the resolved path that ends up holding the bytes
    std::string identity;   // two entries with one identity are one file
    std::string temporary;  // staged file or directory; empty for a stream
    std::string backup;     // Commit: the previous version, kept until all succeeded
    std::string content;    // streams only: written at Commit()
    int fd = -1;            // streams that are this process's descriptors
    int cleanup_slot = -1;  // the temporary, removed if a signal ends the process (cleanup.h)
    bool directory = false;
    bool committed = false;
  };
  Expected<bool> Add(const std::string& given, Entry entry);
  void Discard();
  std::vector<Entry> entries_;
};

// One file, written as OutputFiles writes it (staged, then committed).
Expected<bool> WriteFileAtomic(const std::string& path, std::string_view content);

// Follows symbolic links from `path` to the path that finally names a
// file, or that does not exist yet (a dangling link's target). Errors on a
// loop or more than 40 links.
Expected<std::string> ResolveOutputPath(const std::string& path);

}  // namespace memplan
