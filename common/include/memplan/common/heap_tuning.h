// How a memplan process asks the C library's allocator to keep the memory
// it frees (docs/design.md, "Process memory").
//
// A large plan allocates and frees the same few hundred MiB many times
// (per rank: profiles, bounds, the emitted program). glibc's defaults give
// every block over 128 KiB its own mmap and return the heap's top to the
// kernel on free, so each reuse faults its pages in again; under a
// virtual machine's paravirtualised page faults that was half of a
// 3,072-GPU plan's time (225,000 minor faults for 368 MiB resident).
#pragma once

#include <cstdint>
#include <utility>

namespace memplan {

// Blocks up to 32 MiB (glibc's largest threshold) come from the heap, freed
// memory stays in the process, and the heap grows 256 MiB of address space
// at a time (untouched pages cost nothing). Resident memory never exceeds
// the process's peak; it is just not handed back before exit. The heap's
// first GiB is advised for transparent huge pages (madvise), which take a
// large plan's page faults from ~120,000 to ~6,000 and its CPU time down
// by a third to a half; MEMPLAN_HUGE_PAGES=0 opts out. Call once, first
// thing in main, before any thread starts. A no-op where the C library is
// not glibc; no huge-page advice under a sanitizer.
void KeepFreedHeapMemory();

// The heap range KeepFreedHeapMemory advised for huge pages, [first,
// second); {0, 0} where it did not (not glibc, a sanitizer, opted out, the
// advice refused).
std::pair<uintptr_t, uintptr_t> HugePageHeapRange();

}  // namespace memplan
