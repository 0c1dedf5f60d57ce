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

namespace memplan {

// Blocks up to 32 MiB (glibc's largest threshold) come from the heap, freed
// memory stays in the process, and the heap grows 256 MiB of address space
// at a time (untouched pages cost nothing). Resident memory never exceeds
// the process's peak; it is just not handed back before exit. Call once,
// first thing in main. A no-op where the C library is not glibc.
void KeepFreedHeapMemory();

}  // namespace memplan
