#include "memplan/traces/cupti_source.h"

#ifdef MEMPLAN_HAVE_CUPTI

#include <cupti.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include "cupti_decode.h"

namespace memplan::traces {
namespace {

// CUPTI's buffer callbacks are plain functions: they reach the one active
// source's state through this global, guarded by its mutex.
struct State {
  std::mutex mu;
  int64_t buffer_bytes = 0;
  std::vector<MemoryRecord> memory;
  std::vector<PoolRecord> pools;
  std::vector<GpuActivity> activities;
  std::unordered_map<uint32_t, uint64_t> external;  // correlation id -> ScopedGpuOp id
  std::atomic<int64_t> dropped{0};
  std::atomic<int64_t> host_bytes{0};
};
std::atomic<State*> g_state{nullptr};

constexpr size_t kAlign = 8;  // CUPTI requires 8-byte aligned buffers

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  State* s = g_state.load();
  const size_t bytes = s ? static_cast<size_t>(s->buffer_bytes) : size_t{1} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kAlign, bytes));
  *size = *buffer ? bytes : 0;
  *max_records = 0;  // as many as fit
  if (s && *buffer) s->host_bytes += static_cast<int64_t>(bytes);
}

void Decode(State& s, uint8_t* buffer, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(s.mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_MEMORY2:
        s.memory.push_back(cupti::FromActivity(*reinterpret_cast<CUpti_ActivityMemory4*>(record)));
        break;
      case CUPTI_ACTIVITY_KIND_MEMORY_POOL:
        s.pools.push_back(cupti::FromActivity(*reinterpret_cast<CUpti_ActivityMemoryPool3*>(record)));
        break;
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL:
        s.activities.push_back(cupti::FromActivity(*reinterpret_cast<CUpti_ActivityKernel10*>(record)));
        break;
      case CUPTI_ACTIVITY_KIND_MEMCPY:
        s.activities.push_back(cupti::FromActivity(*reinterpret_cast<CUpti_ActivityMemcpy6*>(record)));
        break;
      case CUPTI_ACTIVITY_KIND_MEMSET:
        s.activities.push_back(cupti::FromActivity(*reinterpret_cast<CUpti_ActivityMemset4*>(record)));
        break;
      case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
        cupti::ExternalLink link = cupti::FromActivity(*reinterpret_cast<CUpti_ActivityExternalCorrelation*>(record));
        if (link.external_id != 0) s.external[link.correlation] = link.external_id;
        break;
      }
      default:
        break;
    }
  }
}

void CUPTIAPI BufferCompleted(CUcontext context, uint32_t stream_id, uint8_t* buffer, size_t, size_t valid) {
  if (State* s = g_state.load()) {
    Decode(*s, buffer, valid);
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(context, stream_id, &dropped) == CUPTI_SUCCESS) {
      s->dropped += static_cast<int64_t>(dropped);
    }
  }
  std::free(buffer);
}

std::string ResultString(CUptiResult r) {
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  return text ? text : "unknown CUPTI error";
}

const CUpti_ActivityKind kMemoryKinds[] = {CUPTI_ACTIVITY_KIND_MEMORY2, CUPTI_ACTIVITY_KIND_MEMORY_POOL};
// EXTERNAL_CORRELATION records are only written beside driver API records,
// so DRIVER is enabled too (its records themselves are not decoded), as
// kineto and nvFuser's CUPTI profiler do.
const CUpti_ActivityKind kTimelineKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                             CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
                                             CUPTI_ACTIVITY_KIND_DRIVER};

void DisableAll() {
  for (auto k : kMemoryKinds) cuptiActivityDisable(k);
  for (auto k : kTimelineKinds) cuptiActivityDisable(k);
}

}  // namespace

bool CuptiBuilt() { return true; }

Expected<std::unique_ptr<CuptiSource>> CuptiSource::Start(const CuptiOptions& options) {
  auto state = std::make_unique<State>();
  state->buffer_bytes = std::max<int64_t>(options.buffer_bytes, 64 << 10);
  State* expected = nullptr;
  if (!g_state.compare_exchange_strong(expected, state.get())) {
    return Error{ErrorCode::kRuntime, "CUPTI: another memplan profiler is already collecting in this process"};
  }
  auto fail = [&](const std::string& what, CUptiResult r) -> Error {
    DisableAll();
    g_state.store(nullptr);
    return Error{ErrorCode::kRuntime, "CUPTI: " + what + ": " + ResultString(r)};
  };
  // Keep CUPTI's device-side buffers out of the device footprint.
  uint8_t pinned = 1;
  size_t attr_size = sizeof(pinned);
  cuptiActivitySetAttribute(CUPTI_ACTIVITY_ATTR_MEM_ALLOCATION_TYPE_HOST_PINNED, &attr_size, &pinned);
  if (CUptiResult r = cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted); r != CUPTI_SUCCESS) {
    return fail("cannot register activity buffers (is another profiler attached?)", r);
  }
  for (auto k : kMemoryKinds) {
    if (CUptiResult r = cuptiActivityEnable(k); r != CUPTI_SUCCESS) return fail("cannot enable memory records", r);
  }
  if (options.gpu_timeline) {
    for (auto k : kTimelineKinds) {
      if (CUptiResult r = cuptiActivityEnable(k); r != CUPTI_SUCCESS) return fail("cannot enable GPU timeline", r);
    }
  }
  state.release();  // owned through g_state until the source dies
  return std::unique_ptr<CuptiSource>(new CuptiSource());
}

CuptiSource::~CuptiSource() {
  DisableAll();
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  // CUPTI's worker thread may still be inside a buffer callback holding
  // the state: it is left allocated (a few vectors, once per process)
  // rather than freed under it. Later buffers are freed unread.
  State* s = g_state.exchange(nullptr);
  if (s != nullptr) {
    std::lock_guard<std::mutex> lock(s->mu);
    s->memory.clear();
    s->pools.clear();
    s->activities.clear();
    s->external.clear();
  }
}

void CuptiSource::Flush() { cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED); }

void CuptiSource::Drain(std::vector<MemoryRecord>& memory, std::vector<PoolRecord>& pools) {
  State& s = *g_state.load();
  std::lock_guard<std::mutex> lock(s.mu);
  memory.insert(memory.end(), s.memory.begin(), s.memory.end());
  pools.insert(pools.end(), s.pools.begin(), s.pools.end());
  s.memory.clear();
  s.pools.clear();
}

std::vector<GpuActivity> CuptiSource::DrainActivities() {
  State& s = *g_state.load();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<GpuActivity> out;
  out.swap(s.activities);
  // Correlation ids are unique: a matched entry is done with. Entries of
  // API calls that launched nothing stay until the source dies.
  for (auto& a : out) {
    if (auto it = s.external.find(a.correlation_id); it != s.external.end()) {
      a.external_id = it->second;
      s.external.erase(it);
    }
  }
  return out;
}

int64_t CuptiSource::TimestampNs() {
  uint64_t t = 0;
  return cuptiGetTimestamp(&t) == CUPTI_SUCCESS ? static_cast<int64_t>(t) : 0;
}

int64_t CuptiSource::StreamId(void* cuda_stream) {
  uint32_t id = 0;
  if (cuptiGetStreamIdEx(nullptr, static_cast<CUstream>(cuda_stream), 0, &id) != CUPTI_SUCCESS) return -1;
  return id;
}

ScopedGpuOp::ScopedGpuOp(bool active, uint64_t id) {
  if (active && id != 0 && g_state.load() != nullptr) {
    pushed_ = cuptiActivityPushExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, id) == CUPTI_SUCCESS;
  }
}

void CuptiSource::PushOp(uint64_t id) {
  pushed_.push_back(id != 0 &&
                    cuptiActivityPushExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, id) == CUPTI_SUCCESS);
}

void CuptiSource::PopOp() {
  if (pushed_.empty()) return;
  bool pushed = pushed_.back();
  pushed_.pop_back();
  uint64_t last = 0;
  if (pushed) cuptiActivityPopExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, &last);
}

ScopedGpuOp::~ScopedGpuOp() {
  if (!pushed_) return;
  uint64_t last = 0;
  cuptiActivityPopExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, &last);
}

int64_t CuptiSource::dropped_records() const { return g_state.load()->dropped.load(); }
int64_t CuptiSource::buffer_host_bytes() const { return g_state.load()->host_bytes.load(); }

}  // namespace memplan::traces

#else  // !MEMPLAN_HAVE_CUPTI

namespace memplan::traces {

bool CuptiBuilt() { return false; }

Expected<std::unique_ptr<CuptiSource>> CuptiSource::Start(const CuptiOptions&) {
  return Error{ErrorCode::kRuntime, "CUPTI: this memplan was built without CUPTI (-Dcupti=enabled needs the CUDA toolkit)"};
}
CuptiSource::~CuptiSource() = default;
void CuptiSource::Flush() {}
void CuptiSource::Drain(std::vector<MemoryRecord>&, std::vector<PoolRecord>&) {}
std::vector<GpuActivity> CuptiSource::DrainActivities() { return {}; }
int64_t CuptiSource::dropped_records() const { return 0; }
int64_t CuptiSource::buffer_host_bytes() const { return 0; }
int64_t CuptiSource::TimestampNs() { return 0; }
int64_t CuptiSource::StreamId(void*) { return -1; }
void CuptiSource::PushOp(uint64_t) { (void)pushed_; }
void CuptiSource::PopOp() {}
ScopedGpuOp::ScopedGpuOp(bool, uint64_t) {}
ScopedGpuOp::~ScopedGpuOp() { (void)pushed_; }

}  // namespace memplan::traces

#endif
