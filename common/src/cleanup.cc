// cleanup.h: registered paths removed from a signal handler. Everything the
// handler touches is a fixed-size array of atomics and characters, and the
// tree removal uses system calls only (openat, getdents64, unlinkat), so it
// is async-signal-safe.
#include "memplan/common/cleanup.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>

namespace memplan {
namespace {

constexpr int kSlots = 16;
constexpr size_t kPathMax = 4096;
constexpr int kMaxDepth = 16;
constexpr int kSignals[] = {SIGTERM, SIGINT, SIGHUP};

// 0: free; 1: being written or dropped; 2: holds a path.
std::atomic<int> g_state[kSlots];
char g_paths[kSlots][kPathMax];
std::atomic<pid_t> g_child{0};
std::atomic<int> g_forwarded{0};
std::once_flag g_installed;

struct Dirent64 {
  uint64_t ino;
  int64_t off;
  unsigned short reclen;
  unsigned char type;
  char name[1];
};

bool Dots(const char* n) { return n[0] == '.' && (n[1] == '\0' || (n[1] == '.' && n[2] == '\0')); }

// `name` under `dir`: unlinked, or emptied and removed, to kMaxDepth.
void RemoveTreeAt(int dir, const char* name, int depth) {
  if (::unlinkat(dir, name, 0) == 0 || errno == ENOENT) return;
  if (depth >= kMaxDepth) return;
  const int fd = ::openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
  alignas(8) char buf[4096];
  // Entries are removed while listed: list again from the start until
  // only "." and ".." are left (a bounded number of times: another process
  // may still be writing there).
  for (int pass = 0; pass < 256; ++pass) {
    if (::lseek(fd, 0, SEEK_SET) < 0) break;
    const long n = ::syscall(SYS_getdents64, fd, buf, sizeof buf);
    if (n <= 0) break;
    bool any = false;
    for (long at = 0; at < n;) {
      const auto* d = reinterpret_cast<const Dirent64*>(buf + at);
      at += d->reclen;
      if (Dots(d->name)) continue;
      any = true;
      RemoveTreeAt(fd, d->name, depth + 1);
    }
    if (!any) break;
  }
  ::close(fd);
  (void)::unlinkat(dir, name, AT_REMOVEDIR);
}

void OnSignal(int sig) {
  const int saved = errno;
  if (const pid_t child = g_child.load(); child > 0) {
    g_forwarded.store(sig);
    // The child leads its own process group (memplan profile): the whole
    // group gets it, so a shell's children end with the shell.
    if (::kill(-child, sig) != 0) (void)::kill(child, sig);
    errno = saved;
    return;
  }
  RemoveCleanupPaths();
  EndBySignal(sig);
}

void Install() {
  std::call_once(g_installed, [] {
    for (int sig : kSignals) {
      struct sigaction old {};
      if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
      struct sigaction sa {};
      sa.sa_handler = OnSignal;
      sigemptyset(&sa.sa_mask);
      for (int s : kSignals) sigaddset(&sa.sa_mask, s);
      sa.sa_flags = SA_RESTART;
      (void)::sigaction(sig, &sa, nullptr);
    }
  });
}

}  // namespace

int AddCleanupPath(const std::string& path) {
  std::error_code ec;
  const std::string absolute = std::filesystem::absolute(path, ec).string();
  const std::string& p = ec ? path : absolute;
  if (p.empty() || p.size() >= kPathMax) return -1;
  Install();
  for (int i = 0; i < kSlots; ++i) {
    int expected = 0;
    if (!g_state[i].compare_exchange_strong(expected, 1)) continue;
    std::memcpy(g_paths[i], p.c_str(), p.size() + 1);
    g_state[i].store(2);
    return i;
  }
  return -1;
}

void DropCleanupPath(int slot) {
  if (slot < 0 || slot >= kSlots) return;
  g_state[slot].store(0);
}

void RemoveCleanupPaths() {
  for (int i = 0; i < kSlots; ++i) {
    int expected = 2;
    if (!g_state[i].compare_exchange_strong(expected, 1)) continue;
    RemoveTreeAt(AT_FDCWD, g_paths[i], 0);
    g_state[i].store(0);
  }
}

void ForwardSignalsTo(pid_t child) {
  if (child > 0) {
    Install();
    g_forwarded.store(0);
  }
  g_child.store(child);
}

int ForwardedSignal() { return g_forwarded.load(); }

void EndBySignal(int sig) {
  struct sigaction sa {};
  sa.sa_handler = SIG_DFL;
  sigemptyset(&sa.sa_mask);
  (void)::sigaction(sig, &sa, nullptr);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  (void)::sigprocmask(SIG_UNBLOCK, &set, nullptr);
  (void)::raise(sig);
  ::_exit(128 + sig);
}

}  // namespace memplan
