#include "memplan/common/output.h"

#include "memplan/common/cleanup.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

namespace memplan {

namespace fs = std::filesystem;

namespace {

Error RuntimeError(const std::string& path, const std::string& what) {
  return Error{ErrorCode::kRuntime, path + ": " + what};
}

std::string Errno(int err) { return std::strerror(err); }

// A short name no other writer in this or another process picks, beside
// `target` (a long target name must not make the temporary's too long).
std::string TemporaryBeside(const std::string& target) {
  static std::atomic<int> counter{0};
  fs::path p(target);
  std::string name = ".memplan." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1)) + ".tmp";
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

// How an output reaches its bytes.
struct Target {
  enum class How { kFile, kStream, kFd };
  How how = How::kFile;
  std::string path;  // kFile: the resolved path; kStream: the path as given
  int fd = -1;       // kFd
  bool exists = false;
  bool directory = false;
};

// "/dev/stdout", "/dev/fd/3", "/proc/self/fd/1": a descriptor this process
// already has, written directly (its open flags, O_APPEND included, stay
// the shell's); following those links would name a pipe or a socket that
// cannot be opened, or reopen a file with other flags.
std::optional<int> DescriptorOf(const std::string& path) {
  if (path == "/dev/stdout") return 1;
  if (path == "/dev/stderr") return 2;
  for (const char* prefix : {"/dev/fd/", "/proc/self/fd/"}) {
    std::string_view p(path);
    if (!p.starts_with(prefix)) continue;
    std::string digits(p.substr(std::strlen(prefix)));
    if (digits.empty() || digits.size() > 6 || digits.find_first_not_of("0123456789") != std::string::npos) {
      return std::nullopt;
    }
    return std::stoi(digits);
  }
  return std::nullopt;
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

// Where `path` writes to; `want_directory` for StageDirectory.
Expected<Target> Classify(std::string path, bool want_directory) {
  if (path.empty()) return RuntimeError("<empty path>", "cannot write: empty path");
  const std::string given = path;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  Target t;
  if (auto fd = DescriptorOf(path); fd && !want_directory) {
    if (::fcntl(*fd, F_GETFL) < 0) return RuntimeError(given, "cannot write: descriptor " + std::to_string(*fd) + " is not open");
    t.how = Target::How::kFd;
    t.fd = *fd;
    t.path = path;
    return t;
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
    if (want_directory) return RuntimeError(given, "cannot write: not a directory");
    if (!S_ISCHR(st.st_mode) && !S_ISFIFO(st.st_mode)) {
      return RuntimeError(given, "cannot write: not a regular file, character device or FIFO");
    }
    if (::access(path.c_str(), W_OK) != 0) return RuntimeError(given, "cannot write: " + Errno(errno));
    t.how = Target::How::kStream;
    t.path = path;
    return t;
  }
  auto resolved = ResolveOutputPath(path);
  if (!resolved) return resolved.error();
  t.path = *resolved;
  if (::stat(t.path.c_str(), &st) == 0) {
    t.exists = true;
    t.directory = S_ISDIR(st.st_mode);
  }
  if (t.directory && !want_directory) return RuntimeError(given, "cannot write: is a directory");
  if (t.exists && !t.directory && want_directory) return RuntimeError(given, "cannot write: not a directory");
  if (auto ok = CheckParent(t.path); !ok) return ok.error();
  return t;
}

// A directory a previous dump wrote: only directories and *.npy files, in
// a one-step dump's folders (DIR/initial/*.npy) or a multi-step dump's
// (DIR/step2/updated/*.npy).
bool LooksLikeDump(const std::string& dir) {
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it.depth() > 2) return false;
    if (it->is_directory(ec)) continue;
    if (!it->is_regular_file(ec) || it->path().extension() != ".npy") return false;
  }
  return !ec;
}

// The same file or directory, whether it exists yet or not.
std::string Identity(const Target& t) {
  if (t.how == Target::How::kFd) return "fd:" + std::to_string(t.fd);
  std::error_code ec;
  fs::path p = fs::weakly_canonical(t.path, ec);
  return ec ? t.path : p.string();
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
  auto t = Classify(path, false);
  if (!t) return t.error();
  return true;
}

Expected<bool> OutputFiles::CheckAll(const std::vector<std::string>& files, const std::vector<std::string>& directories) {
  struct Checked {
    const std::string* given;
    Expected<Target> target;
  };
  std::vector<Checked> checked;
  for (const auto& f : files) checked.push_back({&f, Classify(f, false)});
  for (const auto& d : directories) checked.push_back({&d, Classify(d, true)});
  std::map<std::string, const std::string*> seen;
  for (const auto& c : checked) {
    std::error_code ec;
    std::string identity = c.target ? Identity(*c.target) : fs::weakly_canonical(*c.given, ec).string();
    if (ec) identity = *c.given;
    if (auto [it, fresh] = seen.emplace(identity, c.given); !fresh) {
      return Error{ErrorCode::kBadInput, *c.given + ": given twice as an output (also as " + *it->second + ")"};
    }
  }
  for (const auto& c : checked) {
    if (!c.target) return c.target.error();
  }
  return true;
}

OutputFiles::~OutputFiles() { Discard(); }

void OutputFiles::Discard() {
  std::error_code ec;
  for (const Entry& e : entries_) {
    if (!e.committed && !e.temporary.empty()) fs::remove_all(e.temporary, ec);
    DropCleanupPath(e.cleanup_slot);
  }
  entries_.clear();
}

Expected<bool> OutputFiles::Add(const std::string& given, Entry entry) {
  for (const Entry& e : entries_) {
    if (e.identity == entry.identity) {
      if (!entry.temporary.empty()) {
        std::error_code ec;
        fs::remove_all(entry.temporary, ec);
      }
      DropCleanupPath(entry.cleanup_slot);
      return Error{ErrorCode::kBadInput, given + ": given twice as an output (also as " + e.given + ")"};
    }
  }
  entry.given = given;
  entries_.push_back(std::move(entry));
  return true;
}

Expected<bool> OutputFiles::Stage(const std::string& path, std::string_view content) {
  auto t = Classify(path, false);
  if (!t) return t.error();
  Entry e;
  e.target = t->path;
  e.identity = Identity(*t);
  if (t->how != Target::How::kFile) {
    e.fd = t->fd;
    e.content = std::string(content);
    return Add(path, std::move(e));
  }
  // An existing file keeps its mode; a new one gets 0666 less the umask.
  struct stat st {};
  const bool exists = ::stat(t->path.c_str(), &st) == 0;
  mode_t mode = exists ? (st.st_mode & 07777) : 0666;
  std::string tmp = TemporaryBeside(t->path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) return RuntimeError(path, "cannot write: " + Errno(errno));
  e.cleanup_slot = AddCleanupPath(tmp);  // a signal now removes it (cleanup.h)
  if (exists) (void)::fchmod(fd, mode);
  bool ok = WriteAll(fd, content);
  int err = errno;
  if (::close(fd) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    DropCleanupPath(e.cleanup_slot);
    return RuntimeError(path, "write failed: " + Errno(err));
  }
  e.temporary = tmp;
  return Add(path, std::move(e));
}

Expected<std::string> OutputFiles::StageDirectory(const std::string& dir) {
  auto t = Classify(dir, true);
  if (!t) return t.error();
  if (t->how != Target::How::kFile) return RuntimeError(dir, "cannot write: not a directory");
  if (t->directory && !LooksLikeDump(t->path)) {
    return RuntimeError(dir, "refusing to replace a directory that holds other files than a dump's .npy files");
  }
  std::string tmp = TemporaryBeside(t->path);
  if (::mkdir(tmp.c_str(), 0777) != 0) return RuntimeError(dir, "cannot create: " + Errno(errno));
  Entry e;
  e.target = t->path;
  e.identity = Identity(*t);
  e.temporary = tmp;
  e.directory = true;
  e.cleanup_slot = AddCleanupPath(tmp);  // a dump half-written when a signal comes is removed (cleanup.h)
  if (auto ok = Add(dir, std::move(e)); !ok) return ok.error();
  return tmp;
}

Expected<bool> OutputFiles::Commit() {
  // Streams first: they are the writes that can still fail (a full disk
  // behind /dev/full, a pipe nobody reads). Once they are written, the
  // renames below only move names inside directories already checked.
  for (Entry& e : entries_) {
    if (!e.temporary.empty()) continue;
    int fd = e.fd;
    if (fd < 0) {
      // O_NONBLOCK: a FIFO without a reader fails (ENXIO) instead of
      // waiting forever; writes then block as usual.
      fd = ::open(e.target.c_str(), O_WRONLY | O_APPEND | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
      if (fd < 0) {
        Error err = RuntimeError(e.given, errno == ENXIO ? "cannot write: nobody reads this FIFO"
                                                         : "cannot write: " + Errno(errno));
        Discard();
        return err;
      }
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    }
    bool ok = WriteAll(fd, e.content);
    int werr = errno;
    if (e.fd < 0) ::close(fd);
    if (!ok) {
      Error err = RuntimeError(e.given, "write failed: " + Errno(werr));
      Discard();
      return err;
    }
    e.committed = true;
  }
  // Files and directories: the previous version is kept aside (a hard link
  // for a file, the directory itself) until every rename succeeded, so a
  // failure puts everything back as it was.
  std::error_code ec;
  std::vector<Entry*> done;
  auto rollback = [&](Error err) {
    for (auto it = done.rbegin(); it != done.rend(); ++it) {
      Entry& d = **it;
      fs::remove_all(d.target, ec);
      if (!d.backup.empty()) (void)::rename(d.backup.c_str(), d.target.c_str());
    }
    Discard();
    return err;
  };
  for (Entry& e : entries_) {
    if (e.temporary.empty()) continue;
    struct stat st {};
    if (::lstat(e.target.c_str(), &st) == 0) {
      e.backup = TemporaryBeside(e.target);
      int rc = e.directory ? ::rename(e.target.c_str(), e.backup.c_str()) : ::link(e.target.c_str(), e.backup.c_str());
      if (rc != 0) e.backup.clear();  // cannot keep it: this one cannot be put back
    }
    if (::rename(e.temporary.c_str(), e.target.c_str()) != 0) {
      Error err = RuntimeError(e.given, "cannot rename into place: " + Errno(errno));
      if (!e.backup.empty() && e.directory) (void)::rename(e.backup.c_str(), e.target.c_str());
      if (!e.backup.empty() && !e.directory) ::unlink(e.backup.c_str());
      e.backup.clear();
      return rollback(err);
    }
    e.committed = true;
    done.push_back(&e);
  }
  for (Entry* d : done) {
    if (!d->backup.empty()) fs::remove_all(d->backup, ec);
  }
  for (const Entry& e : entries_) DropCleanupPath(e.cleanup_slot);
  entries_.clear();
  return true;
}

Expected<bool> WriteFileAtomic(const std::string& path, std::string_view content) {
  OutputFiles out;
  if (auto st = out.Stage(path, content); !st) return st.error();
  return out.Commit();
}

}  // namespace memplan
