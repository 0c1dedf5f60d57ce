#include "memplan/common/heap_tuning.h"

#if __has_include(<malloc.h>)
#include <malloc.h>
#endif

namespace memplan {

void KeepFreedHeapMemory() {
#if defined(__GLIBC__) && defined(M_MMAP_THRESHOLD) && defined(M_TOP_PAD)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 256 << 20);
#endif
}

}  // namespace memplan
