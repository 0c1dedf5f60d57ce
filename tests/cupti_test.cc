// The CUPTI source without a GPU: CUPTI's records, built by hand field by
// field, decode into memplan's records, and a sequence of them reconstructs
// the footprint a program with known allocations had. Starting the source
// gives either a working collector (on a GPU) or a one-line error.
#include <doctest/doctest.h>

#include <cstring>
#include <string>

#include "cupti_decode.h"
#include "memplan/traces/cupti_source.h"
#include "memplan/traces/footprint.h"

using namespace memplan::traces;

namespace {

CUpti_ActivityMemory4 Memory(CUpti_ActivityMemoryOperationType op, uint64_t address, uint64_t bytes,
                             uint64_t timestamp, uint64_t pool = 0, uint64_t pool_size = 0) {
  CUpti_ActivityMemory4 r;
  std::memset(&r, 0, sizeof r);
  r.kind = CUPTI_ACTIVITY_KIND_MEMORY2;
  r.memoryOperationType = op;
  r.memoryKind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
  r.address = address;
  r.bytes = bytes;
  r.timestamp = timestamp;
  r.deviceId = 3;
  if (pool) {
    r.memoryPoolConfig.memoryPoolType = CUPTI_ACTIVITY_MEMORY_POOL_TYPE_LOCAL;
    r.memoryPoolConfig.address = pool;
    r.memoryPoolConfig.pool.size = pool_size;
  }
  return r;
}

constexpr auto kAlloc = CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION;
constexpr auto kFree = CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE;

}  // namespace

TEST_CASE("CUPTI memory and pool records decode field by field") {
  MemoryRecord a = cupti::FromActivity(Memory(kAlloc, 0x7000, 4096, 100));
  CHECK(a.op == MemoryOp::kAllocation);
  CHECK(a.address == 0x7000);
  CHECK(a.bytes == 4096);
  CHECK(a.timestamp_ns == 100);
  CHECK(a.device_id == 3);
  CHECK(a.kind == MemoryKind::kDevice);
  CHECK(a.pool_address == 0);
  MemoryRecord f = cupti::FromActivity(Memory(kFree, 0x7000, 4096, 200, 0xAA00, 1 << 21));
  CHECK(f.op == MemoryOp::kRelease);
  CHECK(f.pool_address == 0xAA00);
  CHECK(f.pool_bytes == 1 << 21);
  CUpti_ActivityMemory4 pinned = Memory(kAlloc, 0x9000, 64, 5);
  pinned.memoryKind = CUPTI_ACTIVITY_MEMORY_KIND_PINNED;
  CHECK(cupti::FromActivity(pinned).kind == MemoryKind::kPinned);

  CUpti_ActivityMemoryPool3 p;
  std::memset(&p, 0, sizeof p);
  p.kind = CUPTI_ACTIVITY_KIND_MEMORY_POOL;
  p.memoryPoolOperationType = CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_TRIMMED;
  p.address = 0xAA00;
  p.size = 1 << 20;
  p.timestamp = 300;
  p.deviceId = 3;
  PoolRecord pr = cupti::FromActivity(p);
  CHECK(pr.op == PoolOp::kTrimmed);
  CHECK(pr.size_bytes == 1 << 20);
  CHECK(pr.timestamp_ns == 300);
  p.memoryPoolOperationType = CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_DESTROYED;
  CHECK(cupti::FromActivity(p).op == PoolOp::kDestroyed);
}

TEST_CASE("kernel, copy and memset records decode for the GPU timeline") {
  CUpti_ActivityKernel10 k;
  std::memset(&k, 0, sizeof k);
  k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
  k.name = "gemm";
  k.start = 1000;
  k.end = 1500;
  k.streamId = 7;
  k.correlationId = 42;
  GpuActivity ka = cupti::FromActivity(k);
  CHECK(ka.kind == GpuActivity::Kind::kKernel);
  CHECK(ka.name == "gemm");
  CHECK(ka.end_ns - ka.start_ns == 500);
  CHECK(ka.stream_id == 7);
  CHECK(ka.correlation_id == 42);
  CUpti_ActivityMemcpy6 c;
  std::memset(&c, 0, sizeof c);
  c.copyKind = CUPTI_ACTIVITY_MEMCPY_KIND_DTOH;
  c.bytes = 1 << 20;
  GpuActivity ca = cupti::FromActivity(c);
  CHECK(ca.name == "memcpy DtoH");
  CHECK(ca.bytes == 1 << 20);
  CUpti_ActivityMemset4 s;
  std::memset(&s, 0, sizeof s);
  s.bytes = 256;
  CHECK(cupti::FromActivity(s).bytes == 256);
}

TEST_CASE("external correlation records tie launches to ScopedGpuOp ids (CUSTOM0 only)") {
  CUpti_ActivityExternalCorrelation e;
  std::memset(&e, 0, sizeof e);
  e.kind = CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION;
  e.externalKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;
  e.externalId = 17;
  e.correlationId = 42;
  cupti::ExternalLink link = cupti::FromActivity(e);
  CHECK(link.correlation == 42);
  CHECK(link.external_id == 17);
  e.externalKind = CUPTI_EXTERNAL_CORRELATION_KIND_OPENACC;  // somebody else's ids
  CHECK(cupti::FromActivity(e).external_id == 0);
  // Without a started source a ScopedGpuOp does nothing (and does not crash).
  ScopedGpuOp op(true, 5);
}

TEST_CASE("decoded records of a known program reconstruct its footprint exactly") {
  // cudaMalloc 1 MiB; a pool of 2 MiB serving 0.5 + 1 MiB; free all.
  VectorRecordSource source;
  const uint64_t pool = 0xB000'0000;
  source.Add(cupti::FromActivity(Memory(kAlloc, 0x1000'0000, 1 << 20, 10)));
  source.Add(cupti::FromActivity(Memory(kAlloc, 0xB000'0000, 1 << 19, 20, pool, 2 << 20)));
  source.Add(cupti::FromActivity(Memory(kAlloc, 0xB008'0000, 1 << 20, 30, pool, 2 << 20)));
  source.Add(cupti::FromActivity(Memory(kFree, 0xB000'0000, 1 << 19, 40, pool, 2 << 20)));
  source.Add(cupti::FromActivity(Memory(kFree, 0xB008'0000, 1 << 20, 50, pool, 2 << 20)));
  source.Add(cupti::FromActivity(Memory(kFree, 0x1000'0000, 1 << 20, 60)));
  Footprint f = ReconstructFootprint(source);
  CHECK(f.allocated_peak == (1 << 20) + (1 << 19) + (1 << 20));
  CHECK(f.reserved_peak == (1 << 20) + (2 << 20));
  CHECK(f.allocated_bytes == 0);
  CHECK(f.warnings.empty());
  CHECK(f.samples.size() == 6);
}

TEST_CASE("starting CUPTI gives a collector on a GPU, or one line saying why not") {
  auto s = CuptiSource::Start();
  if (s.ok()) {
    // A GPU machine: a second source is refused while the first lives.
    auto second = CuptiSource::Start();
    REQUIRE_FALSE(second.ok());
    CHECK(second.error().message.find("already collecting") != std::string::npos);
    (*s)->Flush();
    std::vector<MemoryRecord> memory;
    std::vector<PoolRecord> pools;
    (*s)->Drain(memory, pools);
    CHECK((*s)->dropped_records() == 0);
  } else {
    CHECK(s.error().code == memplan::ErrorCode::kRuntime);
    CHECK(s.error().message.starts_with("CUPTI: "));
    CHECK(s.error().message.find('\n') == std::string::npos);
    MESSAGE("no collector here: " << s.error().message);
  }
}
