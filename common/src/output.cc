#include "memplan/common/output.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace memplan {

namespace fs = std::filesystem;

namespace {

Error RuntimeError(const std::string& path, const std::string& what) {
  return Error{ErrorCode::kRuntime, path + ": " + what};
}

std::string Errno(int err) { return std::strerror(err); }

// A name no other writer in this or another process picks.
std::string TemporaryBeside(const std::string& target) {
  static std::atomic<int> counter{0};
  fs::path p(target);
  std::string name = "." + p.filename().string() + ".tmp." + std::to_string(::getpid()) + "." +
                     std::to_string(counter.fetch_add(1));
  return (p.parent_path() / name).string();
}

// Writes all of `content` to `fd`; false with errno set on a short write.
bool WriteAll(int fd, std::string_view content) {
  const char* at = content.data();
  size_t left = content.size();
  while (left > 0) {
    ssize_t n = ::write(fd, at, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (n == 0) {
      errno = EIO;
      return false;
    }
    at += n;
    left -= static_cast<size_t>(n);
  }
  return true;
}

// What sits at a resolved path.
enum class Kind { kMissing, kRegular, kDirectory, kStream, kOther };

Kind KindOf(const std::string& path, struct stat* st) {
  if (::stat(path.c_str(), st) != 0) return Kind::kMissing;
  if (S_ISREG(st->st_mode)) return Kind::kRegular;
  if (S_ISDIR(st->st_mode)) return Kind::kDirectory;
  if (S_ISCHR(st->st_mode) || S_ISFIFO(st->st_mode)) return Kind::kStream;
  return Kind::kOther;
}

Expected<bool> CheckParent(const std::string& target) {
  fs::path parent = fs::path(target).parent_path();
  if (parent.empty()) parent = ".";
  struct stat st {};
  if (::stat(parent.c_str(), &st) != 0) return RuntimeError(target, "cannot write: " + Errno(errno));
  if (!S_ISDIR(st.st_mode)) return RuntimeError(target, "cannot write: " + parent.string() + " is not a directory");
  if (::access(parent.c_str(), W_OK | X_OK) != 0) return RuntimeError(target, "cannot write: " + Errno(errno));
  return true;
}

// A directory a previous dump wrote: only directories and *.npy files.
bool LooksLikeDump(const std::string& dir) {
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it.depth() > 1) return false;
    if (it->is_directory(ec)) continue;
    if (!it->is_regular_file(ec) || it->path().extension() != ".npy") return false;
  }
  return !ec;
}

}  // namespace

Expected<std::string> ResolveOutputPath(const std::string& path) {
  if (path.empty()) return RuntimeError("<empty path>", "cannot write: empty path");
  std::string at = path;
  for (int links = 0; links <= 40; ++links) {
    struct stat st {};
    if (::lstat(at.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return at;
    std::string target(static_cast<size_t>(st.st_size > 0 ? st.st_size : 4096) + 1, '\0');
    ssize_t n = ::readlink(at.c_str(), target.data(), target.size());
    if (n < 0) return RuntimeError(path, "cannot follow link: " + Errno(errno));
    target.resize(static_cast<size_t>(n));
    fs::path next(target);
    at = next.is_absolute() ? next.string() : (fs::path(at).parent_path() / next).string();
  }
  return RuntimeError(path, "cannot write: too many levels of symbolic links");
}

Expected<bool> OutputFiles::CheckWritable(const std::string& path) {
  auto target = ResolveOutputPath(path);
  if (!target) return target.error();
  struct stat st {};
  switch (KindOf(*target, &st)) {
    case Kind::kDirectory:
      return RuntimeError(path, "cannot write: is a directory");
    case Kind::kOther:
      return RuntimeError(path, "cannot write: not a regular file, character device or FIFO");
    case Kind::kStream:
      if (::access(target->c_str(), W_OK) != 0) return RuntimeError(path, "cannot write: " + Errno(errno));
      return true;
    case Kind::kRegular:
    case Kind::kMissing:
      break;
  }
  return CheckParent(*target);
}

OutputFiles::~OutputFiles() { Discard(); }

void OutputFiles::Discard() {
  std::error_code ec;
  for (const Entry& e : entries_) {
    if (!e.committed && !e.temporary.empty()) fs::remove_all(e.temporary, ec);
  }
  entries_.clear();
}

Expected<bool> OutputFiles::Stage(const std::string& path, std::string_view content) {
  auto target = ResolveOutputPath(path);
  if (!target) return target.error();
  struct stat st {};
  Kind kind = KindOf(*target, &st);
  if (kind == Kind::kDirectory) return RuntimeError(path, "cannot write: is a directory");
  if (kind == Kind::kOther) return RuntimeError(path, "cannot write: not a regular file, character device or FIFO");
  if (kind == Kind::kStream) {
    entries_.push_back(Entry{*target, "", std::string(content), false, false});
    return true;
  }
  if (auto ok = CheckParent(*target); !ok) return ok.error();
  std::string tmp = TemporaryBeside(*target);
  // An existing file keeps its mode; a new one gets 0666 less the umask.
  mode_t mode = kind == Kind::kRegular ? (st.st_mode & 07777) : 0666;
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) return RuntimeError(path, "cannot write: " + Errno(errno));
  if (kind == Kind::kRegular) (void)::fchmod(fd, mode);
  bool ok = WriteAll(fd, content);
  int err = errno;
  if (::close(fd) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    return RuntimeError(path, "write failed: " + Errno(err));
  }
  entries_.push_back(Entry{*target, tmp, "", false, false});
  return true;
}

Expected<std::string> OutputFiles::StageDirectory(const std::string& dir) {
  auto target = ResolveOutputPath(dir);
  if (!target) return target.error();
  struct stat st {};
  Kind kind = KindOf(*target, &st);
  if (kind == Kind::kDirectory && !LooksLikeDump(*target)) {
    return RuntimeError(dir, "refusing to replace a directory that holds other files than a dump's .npy files");
  }
  if (kind != Kind::kDirectory && kind != Kind::kMissing) return RuntimeError(dir, "cannot write: not a directory");
  // The parent of a directory target: strip a trailing slash first.
  std::string trimmed = *target;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  if (auto ok = CheckParent(trimmed); !ok) return ok.error();
  std::string tmp = TemporaryBeside(trimmed);
  if (::mkdir(tmp.c_str(), 0777) != 0) return RuntimeError(dir, "cannot create: " + Errno(errno));
  entries_.push_back(Entry{trimmed, tmp, "", true, false});
  return tmp;
}

Expected<bool> OutputFiles::Commit() {
  // Devices first: they are the writes that can still fail (a full disk
  // behind /dev/full, a closed pipe). Once they are written, the renames
  // below only move names inside directories already checked.
  for (Entry& e : entries_) {
    if (!e.temporary.empty()) continue;
    int fd = ::open(e.target.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) {
      Error err = RuntimeError(e.target, "cannot write: " + Errno(errno));
      Discard();
      return err;
    }
    bool ok = WriteAll(fd, e.content);
    int werr = errno;
    ::close(fd);
    if (!ok) {
      Error err = RuntimeError(e.target, "write failed: " + Errno(werr));
      Discard();
      return err;
    }
    e.committed = true;
  }
  for (Entry& e : entries_) {
    if (e.temporary.empty()) continue;
    std::error_code ec;
    std::string old;
    if (e.directory && fs::is_directory(e.target, ec)) {
      old = TemporaryBeside(e.target);
      if (::rename(e.target.c_str(), old.c_str()) != 0) {
        Error err = RuntimeError(e.target, "cannot replace: " + Errno(errno));
        Discard();
        return err;
      }
    }
    if (::rename(e.temporary.c_str(), e.target.c_str()) != 0) {
      Error err = RuntimeError(e.target, "cannot rename into place: " + Errno(errno));
      if (!old.empty()) (void)::rename(old.c_str(), e.target.c_str());
      Discard();
      return err;
    }
    e.committed = true;
    if (!old.empty()) fs::remove_all(old, ec);
  }
  entries_.clear();
  return true;
}

Expected<bool> WriteFileAtomic(const std::string& path, std::string_view content) {
  OutputFiles out;
  if (auto st = out.Stage(path, content); !st) return st.error();
  return out.Commit();
}

}  // namespace memplan
