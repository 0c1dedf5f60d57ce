#include "memplan/common/heap_tuning.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if __has_include(<malloc.h>)
#include <malloc.h>
#endif
#if __has_include(<sys/mman.h>)
#include <sys/mman.h>
#include <unistd.h>
#endif

// Sanitizers replace malloc: a 1 GiB block there is 128 MiB of shadow
// written twice, and mallopt means nothing.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MEMPLAN_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(memory_sanitizer) || __has_feature(thread_sanitizer)
#define MEMPLAN_SANITIZED 1
#endif
#endif

namespace memplan {

namespace {
std::pair<uintptr_t, uintptr_t> huge_range{0, 0};
}  // namespace

std::pair<uintptr_t, uintptr_t> HugePageHeapRange() { return huge_range; }

void KeepFreedHeapMemory() {
#if defined(__GLIBC__) && defined(M_MMAP_THRESHOLD) && defined(M_TOP_PAD)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  // Above the huge-page reserve below, so that freeing it keeps it.
  mallopt(M_TRIM_THRESHOLD, 0x7fffffff);
  mallopt(M_TOP_PAD, 256 << 20);
#if defined(MADV_HUGEPAGE) && !defined(MEMPLAN_SANITIZED) && __GLIBC_PREREQ(2, 33)
  // The heap's next GiB of address space, advised for transparent huge
  // pages: one allocation just larger than the heap's free top, made while
  // the top pad is 1 GiB, grows the heap by that much address space (its
  // pages untouched); it is freed at once and the new range advised. The
  // kernel then backs what the process later touches there with 2 MiB
  // pages. (Not one 1 GiB block: under MALLOC_PERTURB_, which Meson sets
  // for tests, glibc would fill it on malloc and on free.) Where THP is
  // off, or the advice fails, nothing changes. MEMPLAN_HUGE_PAGES=0 leaves
  // the heap on 4 KiB pages.
  const char* want = std::getenv("MEMPLAN_HUGE_PAGES");
  if (want != nullptr && std::strcmp(want, "0") == 0) return;
  constexpr size_t kReserve = size_t{1} << 30;
  const size_t request = mallinfo2().keepcost + 4096;
  if (request >= (size_t{32} << 20)) return;  // would be its own mmap
  mallopt(M_TOP_PAD, static_cast<int>(kReserve));
  void* block = std::malloc(request);
  const uintptr_t at = reinterpret_cast<uintptr_t>(block);
  const uintptr_t top = reinterpret_cast<uintptr_t>(sbrk(0));
  std::free(block);
  mallopt(M_TOP_PAD, 256 << 20);
  // Page-aligned (the kernel backs the 2 MiB-aligned stretches inside).
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (at + page - 1) & ~(page - 1);
  const uintptr_t end = top & ~(page - 1);
  if (at != 0 && end > begin && end - begin <= 2 * kReserve) {
    if (madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0) huge_range = {begin, end};
  }
#endif
#endif
}

}  // namespace memplan
