// kernels_bench: how fast memplan's kernels move bytes and do arithmetic,
// every figure from one run of one program (no Google Benchmark: the GPU
// machines lack it).
//
// GPU part (built with CUDA and a device visible). Each op runs on one stream;
// after warm-up launches, every repetition is timed with its own pair of
// cudaEvents and the median is reported. Memory-bound ops count logical bytes
// (each input read once, each output written once) and report them over time
// as GB/s (1e9 B/s) and as a percentage of a device-to-device cudaMemcpyAsync
// of 1 GiB measured in the same run (bytes read + bytes written). GEMM reports
// TFLOP/s (2mnk over time). Inputs are random (never zeros), outputs are
// poisoned with 0xFF bytes before the first launch, and every GPU result is
// spot-checked against the CPU reference on a few rows after timing, so a
// kernel that skips work cannot post a number.
//
// CPU part (always). The reference ops (MakeRefOps) at smaller sizes, timed
// with std::chrono, as a percentage of a std::memcpy of 256 MiB.
//
// Usage: kernels_bench [--json FILE] [--markdown FILE] [--reps N]
//                      [--cpu-reps N] [--cpu-only] [--gpu-only] [--quick]
// Exit status: 0 ok, 1 bad arguments or a CUDA error, 2 a spot check failed.
// The JSON layout and the reproduce commands are in docs/kernels.md.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "memplan/kernels/fp8.h"
#include "memplan/kernels/ops.h"

#if defined(MEMPLAN_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "memplan/kernels/fp8_cuda.h"
#include "memplan/kernels/ops_cuda.h"
#endif

namespace mk = memplan::kernels;

namespace {

// ---------------------------------------------------------------------------
// Results and their output.

struct Result {
  std::string backend;  // "cuda" or "cpu"
  std::string op;       // "copy", "fp8_quantize_fp32", "add", "gemm_fp32", ...
  std::string shape;    // human-readable problem size, e.g. "32768x4096"
  int64_t bytes = 0;    // logical bytes moved per call; 0 for compute-bound ops
  double flops = 0;     // floating-point operations per call; 0 for memory-bound ops
  double time_us = 0;   // median over reps
  int reps = 0;
  std::string check;    // "ok (max err ...)", "ref" (the reference itself), "MISMATCH: ..."
  bool check_failed = false;

  double GbPerS() const { return time_us > 0 ? static_cast<double>(bytes) / time_us / 1e3 : 0; }
  double FlopPerS() const { return time_us > 0 ? flops / time_us * 1e6 : 0; }
};

struct Machine {
  // GPU: whether it ran, and why not otherwise.
  bool gpu_ran = false;
  std::string gpu_note;
  std::string gpu_name;
  int sm_count = 0;
  int64_t gpu_mem_bytes = 0;
  double gpu_mem_peak_gb_per_s = 0;  // memory clock x bus width x 2 (DDR); a lead, not a measurement
  int cuda_runtime_version = 0;
  int cuda_driver_version = 0;
  double gpu_copy_gb_per_s = 0;
  // CPU.
  std::string cpu_model;
  double cpu_copy_gb_per_s = 0;
};

double CopyBandwidth(const Machine& m, const std::string& backend) {
  return backend == "cuda" ? m.gpu_copy_gb_per_s : m.cpu_copy_gb_per_s;
}

// Percentage of the same backend's copy bandwidth; negative when it does not
// apply (compute-bound ops, or no copy measured).
double PctOfCopy(const Machine& m, const Result& r) {
  const double copy = CopyBandwidth(m, r.backend);
  if (r.bytes == 0 || copy <= 0) return -1.0;
  return 100.0 * r.GbPerS() / copy;
}

std::string Fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

// Speed goals (docs/kernels.md): the FP8 kernels against the GPU's own
// device-to-device copy. A missed goal is said in the check column; it does
// not fail the bench (run-to-run noise on a shared machine is a few %).
void ApplyGoals(const Machine& m, std::vector<Result>& results) {
  const std::pair<const char*, double> goals[] = {
      {"fp8_quantize_fp32", 85.0}, {"fp8_quantize_bf16", 80.0}, {"fp8_dequantize", 85.0}};
  for (Result& r : results) {
    if (r.backend != "cuda") continue;
    for (const auto& [op, goal] : goals) {
      if (r.op != op) continue;
      const double pct = PctOfCopy(m, r);
      if (pct < 0) continue;
      r.check += (pct >= goal ? "; goal >= " : "; MISSED goal >= ") + Fmt("%.0f %% of copy", goal);
    }
  }
}

std::string FlopRate(double flop_per_s) {
  if (flop_per_s <= 0) return "-";
  if (flop_per_s >= 1e12) return Fmt("%.1f TFLOP/s", flop_per_s / 1e12);
  return Fmt("%.2f GFLOP/s", flop_per_s / 1e9);
}

std::vector<std::vector<std::string>> TableRows(const Machine& m, const std::vector<Result>& results) {
  std::vector<std::vector<std::string>> rows;
  rows.push_back({"backend", "op", "shape", "median ms", "GB/s", "% of copy", "compute", "check"});
  for (const Result& r : results) {
    const double pct = PctOfCopy(m, r);
    rows.push_back({r.backend, r.op, r.shape, Fmt("%.3f", r.time_us / 1e3),
                    r.bytes > 0 ? Fmt(r.GbPerS() < 10 ? "%.2f" : "%.1f", r.GbPerS()) : "-", pct >= 0 ? Fmt("%.1f", pct) : "-",
                    FlopRate(r.FlopPerS()), r.check});
  }
  return rows;
}

void PrintTable(const Machine& m, const std::vector<Result>& results) {
  const auto rows = TableRows(m, results);
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    std::string line;
    for (size_t c = 0; c < rows[i].size(); ++c) {
      // Text columns left-aligned, numbers right-aligned.
      const bool left = c < 3 || c == rows[i].size() - 1;
      const std::string pad(width[c] - rows[i][c].size(), ' ');
      line += left ? rows[i][c] + pad : pad + rows[i][c];
      if (c + 1 < rows[i].size()) line += "  ";
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::printf("%s\n", line.c_str());
  }
}

std::string MarkdownTable(const Machine& m, const std::vector<Result>& results) {
  std::ostringstream out;
  const auto rows = TableRows(m, results);
  for (size_t i = 0; i < rows.size(); ++i) {
    out << '|';
    for (const auto& cell : rows[i]) out << ' ' << cell << " |";
    out << '\n';
    if (i == 0) {
      out << '|';
      for (size_t c = 0; c < rows[i].size(); ++c) out << ((c < 3 || c + 1 == rows[i].size()) ? "---|" : "--:|");
      out << '\n';
    }
  }
  return out.str();
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  return Fmt("%.6g", v);
}

std::string Json(const Machine& m, const std::vector<Result>& results) {
  std::ostringstream j;
  j << "{\n  \"tool\": \"kernels_bench\",\n  \"format\": 1,\n";
  j << "  \"gpu\": {\"ran\": " << (m.gpu_ran ? "true" : "false") << ", \"note\": " << JsonString(m.gpu_note)
    << ", \"name\": " << JsonString(m.gpu_name) << ", \"sm_count\": " << m.sm_count
    << ", \"memory_bytes\": " << m.gpu_mem_bytes
    << ", \"memory_peak_gb_per_s\": " << JsonNumber(m.gpu_mem_peak_gb_per_s)
    << ", \"cuda_runtime_version\": " << m.cuda_runtime_version
    << ", \"cuda_driver_version\": " << m.cuda_driver_version
    << ", \"copy_gb_per_s\": " << JsonNumber(m.gpu_copy_gb_per_s) << "},\n";
  j << "  \"cpu\": {\"model\": " << JsonString(m.cpu_model)
    << ", \"copy_gb_per_s\": " << JsonNumber(m.cpu_copy_gb_per_s) << "},\n";
  j << "  \"results\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const double pct = PctOfCopy(m, r);
    j << (i ? ",\n" : "\n") << "    {\"backend\": " << JsonString(r.backend) << ", \"op\": " << JsonString(r.op)
      << ", \"shape\": " << JsonString(r.shape) << ", \"bytes\": " << r.bytes
      << ", \"flops\": " << JsonNumber(r.flops) << ", \"time_us\": " << JsonNumber(r.time_us)
      << ", \"reps\": " << r.reps << ", \"gb_per_s\": " << (r.bytes > 0 ? JsonNumber(r.GbPerS()) : "null")
      << ", \"pct_of_copy\": " << (pct >= 0 ? JsonNumber(pct) : "null")
      << ", \"tflop_per_s\": " << (r.flops > 0 ? JsonNumber(r.FlopPerS() / 1e12) : "null")
      << ", \"check\": " << JsonString(r.check) << ", \"check_ok\": " << (r.check_failed ? "false" : "true")
      << "}";
  }
  j << "\n  ]\n}\n";
  return j.str();
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  return static_cast<bool>(f);
}

std::string CpuModel() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown";
}

// ---------------------------------------------------------------------------
// Inputs and checks shared by both parts.

// Deterministic random floats in [lo, hi): the benches never run on zeros,
// which can hide unwritten outputs and run faster than real data.
void FillUniform(float* x, int64_t n, uint64_t seed, float lo = -2.f, float hi = 2.f) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n; ++i) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    x[i] = lo + (hi - lo) * static_cast<float>(s >> 40) * 0x1p-24f;
  }
}

// fp32 -> bf16 bits, round to nearest even (finite inputs).
uint16_t FloatToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  if (n == 0) return 0;
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Options {
  std::string json_path;
  std::string markdown_path;
  int gpu_reps = 20;
  int cpu_reps = 5;
  bool cpu = true;
  bool gpu = true;
  bool quick = false;
};

// Problem sizes. GPU: 32768 x 4096 (128 Mi elements, 512 MiB fp32 per
// tensor, far beyond any L2), 1 GiB copy, 8192^3 GEMM. CPU: 4096 x 4096,
// 256 MiB copy, 512^3 GEMM. --quick divides each by 4 (GEMM by 2).
struct Sizes {
  int64_t rows, cols, copy_bytes, gemm;
};

Sizes CpuSizes(const Options& o) {
  return o.quick ? Sizes{1024, 4096, int64_t{64} << 20, 256} : Sizes{4096, 4096, int64_t{256} << 20, 512};
}

std::string Shape2(int64_t a, int64_t b) { return std::to_string(a) + "x" + std::to_string(b); }

constexpr float kDropoutP = 0.1f;
constexpr uint64_t kDropoutSeed = 1234;
constexpr float kLayerNormEps = 1e-5f;
constexpr float kRmsNormEps = 1e-6f;

// Logical bytes per call (inputs read once, outputs written once).
int64_t QuantBytes(mk::Fp8BlockLayout l, int64_t in_bytes_per_elem) {
  return l.ValueBytes() * (in_bytes_per_elem + 1) + l.ScaleBytes();
}
int64_t DequantBytes(mk::Fp8BlockLayout l) { return l.ValueBytes() * (1 + 4) + l.ScaleBytes(); }

// ---------------------------------------------------------------------------
// CPU part: the reference ops.

template <typename F>
double CpuMedianUs(int reps, F&& call) {
  call();  // warm-up: page faults, caches
  std::vector<double> samples;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    const auto t1 = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  return Median(samples);
}

void RunCpu(const Options& o, Machine& m, std::vector<Result>& results) {
  const Sizes sz = CpuSizes(o);
  const int reps = o.cpu_reps;
  const auto add = [&](std::string op, std::string shape, int64_t bytes, double flops, double us) {
    Result r;
    r.backend = "cpu";
    r.op = std::move(op);
    r.shape = std::move(shape);
    r.bytes = bytes;
    r.flops = flops;
    r.time_us = us;
    r.reps = reps;
    r.check = "ref";
    results.push_back(r);
  };

  {  // Copy baseline: std::memcpy, bytes read + written.
    std::vector<char> src(static_cast<size_t>(sz.copy_bytes), 1), dst(static_cast<size_t>(sz.copy_bytes), 0);
    // More repetitions than the ops: the baseline is cheap, and every
    // percentage below divides by it.
    const int copy_reps = std::max(reps, 11);
    const double us = CpuMedianUs(copy_reps, [&] { std::memcpy(dst.data(), src.data(), src.size()); });
    add("copy", std::to_string(sz.copy_bytes >> 20) + " MiB", 2 * sz.copy_bytes, 0, us);
    results.back().reps = copy_reps;
    m.cpu_copy_gb_per_s = results.back().GbPerS();
  }

  const int64_t rows = sz.rows, cols = sz.cols, n = rows * cols;
  std::vector<float> x(static_cast<size_t>(n)), x2(static_cast<size_t>(n)), y(static_cast<size_t>(n));
  FillUniform(x.data(), n, 1);
  FillUniform(x2.data(), n, 2);
  const std::string shape = Shape2(rows, cols);

  {  // FP8 blockwise quantize / dequantize (reference).
    const mk::Fp8BlockLayout layout{rows, cols};
    std::vector<uint16_t> xb(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) xb[static_cast<size_t>(i)] = FloatToBf16Bits(x[static_cast<size_t>(i)]);
    std::vector<uint8_t> values(static_cast<size_t>(n));
    std::vector<float> scales(static_cast<size_t>(rows * layout.BlocksPerRow()));
    add("fp8_quantize_fp32", shape, QuantBytes(layout, 4), 0, CpuMedianUs(reps, [&] {
          mk::QuantizeFp8BlockwiseRef(x.data(), layout, mk::ScaleMode::kAmax, values.data(), scales.data());
        }));
    add("fp8_quantize_bf16", shape, QuantBytes(layout, 2), 0, CpuMedianUs(reps, [&] {
          mk::QuantizeFp8BlockwiseRef(xb.data(), layout, mk::ScaleMode::kAmax, values.data(), scales.data());
        }));
    add("fp8_dequantize", shape, DequantBytes(layout), 0, CpuMedianUs(reps, [&] {
          mk::DequantizeFp8BlockwiseRef(values.data(), scales.data(), layout, y.data());
        }));
  }

  const std::unique_ptr<mk::Ops> ops = mk::MakeRefOps();
  std::vector<float> gamma(static_cast<size_t>(cols)), beta(static_cast<size_t>(cols));
  FillUniform(gamma.data(), cols, 3, 0.5f, 1.5f);
  FillUniform(beta.data(), cols, 4, -0.5f, 0.5f);
  std::vector<uint8_t> mask(static_cast<size_t>(n));
  const int64_t f = cols / 2;

  add("add", shape, 12 * n, 0, CpuMedianUs(reps, [&] { ops->Add(x.data(), x2.data(), n, y.data()); }));
  add("gelu_fwd", shape, 8 * n, 0, CpuMedianUs(reps, [&] { ops->GeluFwd(x.data(), n, y.data()); }));
  add("swiglu_fwd", Shape2(rows, 2 * f) + " -> " + Shape2(rows, f), 12 * rows * f, 0,
      CpuMedianUs(reps, [&] { ops->SwigluFwd(x.data(), rows, f, y.data()); }));
  add("dropout_fwd", shape, 9 * n, 0, CpuMedianUs(reps, [&] {
        ops->DropoutFwd(x.data(), n, kDropoutP, kDropoutSeed, 0, y.data(), mask.data());
      }));
  add("layernorm_fwd", shape, 8 * n + 8 * cols, 0, CpuMedianUs(reps, [&] {
        ops->LayerNormFwd(x.data(), gamma.data(), beta.data(), rows, cols, kLayerNormEps, y.data());
      }));
  add("rmsnorm_fwd", shape, 8 * n + 4 * cols, 0, CpuMedianUs(reps, [&] {
        ops->RmsNormFwd(x.data(), gamma.data(), rows, cols, kRmsNormEps, y.data());
      }));

  {  // GEMM, fp32, no transposes, beta = 0.
    const int64_t g = sz.gemm;
    std::vector<float> a(static_cast<size_t>(g * g)), b(static_cast<size_t>(g * g)), c(static_cast<size_t>(g * g));
    FillUniform(a.data(), g * g, 5, -1.f, 1.f);
    FillUniform(b.data(), g * g, 6, -1.f, 1.f);
    std::vector<std::byte> ws(static_cast<size_t>(std::max<int64_t>(mk::GemmWorkspaceBytes(), 1)));
    const int gemm_reps = std::min(reps, 3);
    const double us = CpuMedianUs(gemm_reps, [&] {
      ops->Gemm(false, false, g, g, g, 1.f, a.data(), b.data(), 0.f, c.data(), ws.data());
    });
    add("gemm_fp32", std::to_string(g) + "^3", 0, 2.0 * static_cast<double>(g) * g * g, us);
    results.back().reps = gemm_reps;
  }
}

// ---------------------------------------------------------------------------
// GPU part.

#if defined(MEMPLAN_HAVE_CUDA)

Sizes GpuSizes(const Options& o) {
  return o.quick ? Sizes{8192, 4096, int64_t{256} << 20, 4096} : Sizes{32768, 4096, int64_t{1} << 30, 8192};
}

// Largest |got - want| / (1 + |want|) over a slice; NaN (a poisoned,
// unwritten output) counts as infinite.
double MaxErr(const float* got, const float* want, int64_t n) {
  double err = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]) / (1.0 + std::fabs(want[i]));
    if (!(e <= err)) err = std::isnan(e) ? INFINITY : e;
  }
  return err;
}

// Throws with file:line and the runtime's error string; main turns it into
// exit status 1.
#define MEMPLAN_BENCH_CUDA_CHECK(expr)                                                          \
  do {                                                                                          \
    const cudaError_t memplan_err_ = (expr);                                                    \
    if (memplan_err_ != cudaSuccess) {                                                          \
      throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " + \
                               #expr + ": " + cudaGetErrorString(memplan_err_));                \
    }                                                                                           \
  } while (0)

// Owns one device allocation.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(int64_t size_bytes) : size_bytes_(size_bytes) {
    if (size_bytes > 0) MEMPLAN_BENCH_CUDA_CHECK(cudaMalloc(&ptr_, static_cast<size_t>(size_bytes)));
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* As() const {
    return static_cast<T*>(ptr_);
  }
  int64_t size_bytes() const { return size_bytes_; }

 private:
  void* ptr_ = nullptr;
  int64_t size_bytes_ = 0;
};

// Copies `count` elements starting at element `offset` of a device array.
template <typename T>
std::vector<T> Download(const T* d, int64_t offset, int64_t count) {
  std::vector<T> h(static_cast<size_t>(count));
  MEMPLAN_BENCH_CUDA_CHECK(
      cudaMemcpy(h.data(), d + offset, static_cast<size_t>(count) * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Fills a device array from a host generator: one 16 MiB chunk uploaded,
// then replicated on the device (doubling copies), so a 512 MiB input costs
// one small host fill.
template <typename T>
void Upload(T* d, int64_t n, const std::vector<T>& chunk) {
  const int64_t first = std::min<int64_t>(n, static_cast<int64_t>(chunk.size()));
  MEMPLAN_BENCH_CUDA_CHECK(
      cudaMemcpy(d, chunk.data(), static_cast<size_t>(first) * sizeof(T), cudaMemcpyHostToDevice));
  for (int64_t done = first; done < n;) {
    const int64_t step = std::min(done, n - done);
    MEMPLAN_BENCH_CUDA_CHECK(
        cudaMemcpy(d + done, d, static_cast<size_t>(step) * sizeof(T), cudaMemcpyDeviceToDevice));
    done += step;
  }
  // Device-to-device cudaMemcpy on the legacy stream returns before the copy
  // ends, and the bench's non-blocking stream does not wait for it.
  MEMPLAN_BENCH_CUDA_CHECK(cudaDeviceSynchronize());
}

void UploadUniform(float* d, int64_t n, uint64_t seed, float lo = -2.f, float hi = 2.f) {
  std::vector<float> chunk(static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 22)));
  FillUniform(chunk.data(), static_cast<int64_t>(chunk.size()), seed, lo, hi);
  Upload(d, n, chunk);
}

class GpuTimer {
 public:
  explicit GpuTimer(cudaStream_t stream, int reps) : stream_(stream), reps_(reps) {
    MEMPLAN_BENCH_CUDA_CHECK(cudaEventCreate(&start_));
    MEMPLAN_BENCH_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~GpuTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;

  // Median time of one call in microseconds, after `warmup` untimed calls.
  // Each repetition is bracketed by its own events and synchronized, so
  // launch gaps between repetitions never count.
  double MedianUs(const std::function<void()>& launch, int warmup = 3) {
    for (int i = 0; i < warmup; ++i) launch();
    MEMPLAN_BENCH_CUDA_CHECK(cudaGetLastError());
    MEMPLAN_BENCH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<double> samples;
    for (int i = 0; i < reps_; ++i) {
      MEMPLAN_BENCH_CUDA_CHECK(cudaEventRecord(start_, stream_));
      launch();
      MEMPLAN_BENCH_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      MEMPLAN_BENCH_CUDA_CHECK(cudaEventSynchronize(stop_));
      MEMPLAN_BENCH_CUDA_CHECK(cudaGetLastError());
      float ms = 0;
      MEMPLAN_BENCH_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      samples.push_back(1e3 * static_cast<double>(ms));
    }
    return Median(samples);
  }
  int reps() const { return reps_; }

 private:
  cudaStream_t stream_;
  int reps_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Turns a status from the fp8 launchers into an exception.
void CheckLaunch(int status, const char* what) {
  if (status != 0) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(static_cast<cudaError_t>(status)));
  }
}

void SetCheck(Result& r, double err, double tol) {
  if (err <= tol) {
    r.check = "ok" + Fmt(" (err %.1e)", err);
  } else {
    r.check = "MISMATCH" + Fmt(" (err %.1e)", err);
    r.check_failed = true;
  }
}

void SetExact(Result& r, bool equal, const std::string& what) {
  r.check = equal ? "ok (bit-exact)" : "MISMATCH (" + what + ")";
  r.check_failed = !equal;
}

// Tolerance of the spot checks of the fp32 ops against the reference:
// reduction order and libm differ, the math does not.
constexpr double kOpTol = 1e-4;

void RunGpu(const Options& o, Machine& m, std::vector<Result>& results) {
  if (!mk::CudaDeviceAvailable()) {
    m.gpu_note = "no CUDA device visible";
    return;
  }
  int dev = 0;
  MEMPLAN_BENCH_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  MEMPLAN_BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  int mem_clock_khz = 0;
  MEMPLAN_BENCH_CUDA_CHECK(cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, dev));
  m.gpu_name = prop.name;
  m.sm_count = prop.multiProcessorCount;
  m.gpu_mem_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  m.gpu_mem_peak_gb_per_s = 2.0 * mem_clock_khz * 1e3 * (prop.memoryBusWidth / 8.0) / 1e9;
  MEMPLAN_BENCH_CUDA_CHECK(cudaRuntimeGetVersion(&m.cuda_runtime_version));
  MEMPLAN_BENCH_CUDA_CHECK(cudaDriverGetVersion(&m.cuda_driver_version));

  cudaStream_t stream = nullptr;
  MEMPLAN_BENCH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::unique_ptr<void, void (*)(void*)> stream_guard(
      stream, [](void* s) { cudaStreamDestroy(static_cast<cudaStream_t>(s)); });
  GpuTimer timer(stream, o.gpu_reps);
  const Sizes sz = GpuSizes(o);
  const auto add = [&](std::string op, std::string shape, int64_t bytes, double flops, double us) -> Result& {
    Result r;
    r.backend = "cuda";
    r.op = std::move(op);
    r.shape = std::move(shape);
    r.bytes = bytes;
    r.flops = flops;
    r.time_us = us;
    r.reps = timer.reps();
    results.push_back(r);
    return results.back();
  };
  const auto poison = [&](void* p, int64_t bytes) {
    MEMPLAN_BENCH_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, static_cast<size_t>(bytes), stream));
  };

  {  // Copy baseline: cudaMemcpyAsync D2D, bytes read + written.
    DeviceBuffer src(sz.copy_bytes), dst(sz.copy_bytes);
    UploadUniform(src.As<float>(), sz.copy_bytes / 4, 11);
    poison(dst.As<void>(), sz.copy_bytes);
    const double us = timer.MedianUs([&] {
      MEMPLAN_BENCH_CUDA_CHECK(cudaMemcpyAsync(dst.As<void>(), src.As<void>(), static_cast<size_t>(sz.copy_bytes),
                                               cudaMemcpyDeviceToDevice, stream));
    });
    Result& r = add("copy", std::to_string(sz.copy_bytes >> 20) + " MiB", 2 * sz.copy_bytes, 0, us);
    const int64_t tail = 1 << 20;
    const auto a = Download(src.As<char>(), sz.copy_bytes - tail, tail);
    const auto b = Download(dst.As<char>(), sz.copy_bytes - tail, tail);
    SetExact(r, a == b, "copied tail differs");
    m.gpu_copy_gb_per_s = r.GbPerS();
  }

  const int64_t rows = sz.rows, cols = sz.cols, n = rows * cols;
  const std::string shape = Shape2(rows, cols);
  DeviceBuffer x(4 * n), x2(4 * n), y(4 * n);
  UploadUniform(x.As<float>(), n, 1);
  UploadUniform(x2.As<float>(), n, 2);
  // Rows spot-checked for the row-wise ops: the first and the last.
  const int64_t check_rows[] = {0, rows - 1};

  {  // FP8 blockwise quantize (fp32 and bf16 in) and dequantize.
    const mk::Fp8BlockLayout layout{rows, cols};
    const int64_t bpr = layout.BlocksPerRow();
    const mk::Fp8BlockLayout row_layout{1, cols};
    DeviceBuffer xb(2 * n), values(layout.ValueBytes()), scales(layout.ScaleBytes());
    {
      std::vector<uint16_t> chunk(static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 22)));
      std::vector<float> f(chunk.size());
      FillUniform(f.data(), static_cast<int64_t>(f.size()), 7);
      for (size_t i = 0; i < f.size(); ++i) chunk[i] = FloatToBf16Bits(f[i]);
      Upload(xb.As<uint16_t>(), n, chunk);
    }
    std::vector<uint8_t> want_v(static_cast<size_t>(cols));
    std::vector<float> want_s(static_cast<size_t>(bpr));
    const auto check_quant = [&](Result& r, auto* input) {
      bool equal = true;
      for (const int64_t row : check_rows) {
        const auto in = Download(input, row * cols, cols);
        mk::QuantizeFp8BlockwiseRef(in.data(), row_layout, mk::ScaleMode::kAmax, want_v.data(), want_s.data());
        equal = equal && Download(values.As<uint8_t>(), row * cols, cols) == want_v &&
                Download(scales.As<float>(), row * bpr, bpr) == want_s;
      }
      SetExact(r, equal, "values or scales differ from the reference");
    };

    poison(values.As<void>(), values.size_bytes());
    poison(scales.As<void>(), scales.size_bytes());
    double us = timer.MedianUs([&] {
      CheckLaunch(mk::QuantizeFp8BlockwiseCuda(x.As<float>(), layout, mk::ScaleMode::kAmax, values.As<uint8_t>(),
                                               scales.As<float>(), stream),
                  "QuantizeFp8BlockwiseCuda(fp32)");
    });
    check_quant(add("fp8_quantize_fp32", shape, QuantBytes(layout, 4), 0, us), x.As<float>());

    poison(values.As<void>(), values.size_bytes());
    poison(scales.As<void>(), scales.size_bytes());
    us = timer.MedianUs([&] {
      CheckLaunch(mk::QuantizeFp8BlockwiseCuda(xb.As<uint16_t>(), layout, mk::ScaleMode::kAmax,
                                               values.As<uint8_t>(), scales.As<float>(), stream),
                  "QuantizeFp8BlockwiseCuda(bf16)");
    });
    check_quant(add("fp8_quantize_bf16", shape, QuantBytes(layout, 2), 0, us), xb.As<uint16_t>());

    // Dequantize what the bf16 quantizer just wrote.
    poison(y.As<void>(), y.size_bytes());
    us = timer.MedianUs([&] {
      CheckLaunch(mk::DequantizeFp8BlockwiseCuda(values.As<uint8_t>(), scales.As<float>(), layout, y.As<float>(),
                                                 stream),
                  "DequantizeFp8BlockwiseCuda");
    });
    Result& r = add("fp8_dequantize", shape, DequantBytes(layout), 0, us);
    bool equal = true;
    std::vector<float> want(static_cast<size_t>(cols));
    for (const int64_t row : check_rows) {
      const auto v = Download(values.As<uint8_t>(), row * cols, cols);
      const auto s = Download(scales.As<float>(), row * bpr, bpr);
      mk::DequantizeFp8BlockwiseRef(v.data(), s.data(), row_layout, want.data());
      const auto got = Download(y.As<float>(), row * cols, cols);
      equal = equal && std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0;
    }
    SetExact(r, equal, "output differs from the reference");
  }

  const std::unique_ptr<mk::Ops> ops = mk::MakeCudaOps(stream);
  if (!ops) throw std::runtime_error("MakeCudaOps returned null in a CUDA build");
  const std::unique_ptr<mk::Ops> ref = mk::MakeRefOps();
  DeviceBuffer gamma(4 * cols), beta(4 * cols), mask(n);
  UploadUniform(gamma.As<float>(), cols, 3, 0.5f, 1.5f);
  UploadUniform(beta.As<float>(), cols, 4, -0.5f, 0.5f);
  const auto h_gamma = Download(gamma.As<float>(), 0, cols);
  const auto h_beta = Download(beta.As<float>(), 0, cols);
  const int64_t f = cols / 2;
  const int64_t slice = 4096;  // elements spot-checked at each end of the flat ops
  const int64_t slice_at[] = {0, n - slice};

  {
    poison(y.As<void>(), y.size_bytes());
    const double us = timer.MedianUs([&] { ops->Add(x.As<float>(), x2.As<float>(), n, y.As<float>()); });
    Result& r = add("add", shape, 12 * n, 0, us);
    double err = 0;
    std::vector<float> want(static_cast<size_t>(slice));
    for (const int64_t at : slice_at) {
      const auto a = Download(x.As<float>(), at, slice), b = Download(x2.As<float>(), at, slice);
      ref->Add(a.data(), b.data(), slice, want.data());
      err = std::max(err, MaxErr(Download(y.As<float>(), at, slice).data(), want.data(), slice));
    }
    SetCheck(r, err, kOpTol);
  }
  {
    poison(y.As<void>(), y.size_bytes());
    const double us = timer.MedianUs([&] { ops->GeluFwd(x.As<float>(), n, y.As<float>()); });
    Result& r = add("gelu_fwd", shape, 8 * n, 0, us);
    double err = 0;
    std::vector<float> want(static_cast<size_t>(slice));
    for (const int64_t at : slice_at) {
      const auto a = Download(x.As<float>(), at, slice);
      ref->GeluFwd(a.data(), slice, want.data());
      err = std::max(err, MaxErr(Download(y.As<float>(), at, slice).data(), want.data(), slice));
    }
    SetCheck(r, err, kOpTol);
  }
  {
    poison(y.As<void>(), y.size_bytes());
    const double us = timer.MedianUs([&] { ops->SwigluFwd(x.As<float>(), rows, f, y.As<float>()); });
    Result& r = add("swiglu_fwd", Shape2(rows, 2 * f) + " -> " + Shape2(rows, f), 12 * rows * f, 0, us);
    double err = 0;
    std::vector<float> want(static_cast<size_t>(f));
    for (const int64_t row : check_rows) {
      const auto in = Download(x.As<float>(), row * 2 * f, 2 * f);
      ref->SwigluFwd(in.data(), 1, f, want.data());
      err = std::max(err, MaxErr(Download(y.As<float>(), row * f, f).data(), want.data(), f));
    }
    SetCheck(r, err, kOpTol);
  }
  {
    poison(y.As<void>(), y.size_bytes());
    poison(mask.As<void>(), mask.size_bytes());
    const double us = timer.MedianUs([&] {
      ops->DropoutFwd(x.As<float>(), n, kDropoutP, kDropoutSeed, 0, y.As<float>(), mask.As<uint8_t>());
    });
    Result& r = add("dropout_fwd", shape, 9 * n, 0, us);
    double err = 0;
    bool mask_equal = true;
    std::vector<float> want(static_cast<size_t>(slice));
    std::vector<uint8_t> want_mask(static_cast<size_t>(slice));
    for (const int64_t at : slice_at) {
      // Element i of a draw keyed (seed, offset) is element 0 of (seed,
      // offset + i): ops.h's Uniform01 hashes offset + index.
      const auto a = Download(x.As<float>(), at, slice);
      ref->DropoutFwd(a.data(), slice, kDropoutP, kDropoutSeed, static_cast<uint64_t>(at), want.data(),
                      want_mask.data());
      err = std::max(err, MaxErr(Download(y.As<float>(), at, slice).data(), want.data(), slice));
      mask_equal = mask_equal && Download(mask.As<uint8_t>(), at, slice) == want_mask;
    }
    SetCheck(r, mask_equal ? err : INFINITY, kOpTol);
    if (!mask_equal) r.check = "MISMATCH (mask)";
  }
  {
    poison(y.As<void>(), y.size_bytes());
    const double us = timer.MedianUs([&] {
      ops->LayerNormFwd(x.As<float>(), gamma.As<float>(), beta.As<float>(), rows, cols, kLayerNormEps,
                        y.As<float>());
    });
    Result& r = add("layernorm_fwd", shape, 8 * n + 8 * cols, 0, us);
    double err = 0;
    std::vector<float> want(static_cast<size_t>(cols));
    for (const int64_t row : check_rows) {
      const auto in = Download(x.As<float>(), row * cols, cols);
      ref->LayerNormFwd(in.data(), h_gamma.data(), h_beta.data(), 1, cols, kLayerNormEps, want.data());
      err = std::max(err, MaxErr(Download(y.As<float>(), row * cols, cols).data(), want.data(), cols));
    }
    SetCheck(r, err, kOpTol);
  }
  {
    poison(y.As<void>(), y.size_bytes());
    const double us = timer.MedianUs([&] {
      ops->RmsNormFwd(x.As<float>(), gamma.As<float>(), rows, cols, kRmsNormEps, y.As<float>());
    });
    Result& r = add("rmsnorm_fwd", shape, 8 * n + 4 * cols, 0, us);
    double err = 0;
    std::vector<float> want(static_cast<size_t>(cols));
    for (const int64_t row : check_rows) {
      const auto in = Download(x.As<float>(), row * cols, cols);
      ref->RmsNormFwd(in.data(), h_gamma.data(), 1, cols, kRmsNormEps, want.data());
      err = std::max(err, MaxErr(Download(y.As<float>(), row * cols, cols).data(), want.data(), cols));
    }
    SetCheck(r, err, kOpTol);
  }

  {  // GEMM: fp32 in and out through Ops::Gemm (cuBLAS), beta = 0.
    const int64_t g = sz.gemm;
    DeviceBuffer a(4 * g * g), b(4 * g * g), c(4 * g * g), ws(std::max<int64_t>(mk::GemmWorkspaceBytes(), 256));
    UploadUniform(a.As<float>(), g * g, 5, -1.f, 1.f);
    UploadUniform(b.As<float>(), g * g, 6, -1.f, 1.f);
    poison(c.As<void>(), c.size_bytes());
    const double us = timer.MedianUs([&] {
      ops->Gemm(false, false, g, g, g, 1.f, a.As<float>(), b.As<float>(), 0.f, c.As<float>(), ws.As<void>());
    });
    Result& r = add("gemm_fp32", std::to_string(g) + "^3", 0, 2.0 * static_cast<double>(g) * g * g, us);
    // A few entries against float64 dot products, scaled by sum |a_k b_k|:
    // fp32 lands near 1e-7, TF32 (if cuBLAS chose it) near 5e-4.
    double err = 0;
    const int64_t probes[][2] = {{0, 0}, {g - 1, g - 1}, {g / 3, 2 * g / 3}, {g - 1, 0}, {7, g - 5}};
    for (const auto& p : probes) {
      const auto arow = Download(a.As<float>(), p[0] * g, g);
      std::vector<float> bcol(static_cast<size_t>(g));
      MEMPLAN_BENCH_CUDA_CHECK(cudaMemcpy2D(bcol.data(), sizeof(float), b.As<float>() + p[1], 4 * g, sizeof(float),
                                            static_cast<size_t>(g), cudaMemcpyDeviceToHost));
      double dot = 0, mag = 0;
      for (int64_t k = 0; k < g; ++k) {
        dot += static_cast<double>(arow[static_cast<size_t>(k)]) * bcol[static_cast<size_t>(k)];
        mag += std::fabs(static_cast<double>(arow[static_cast<size_t>(k)]) * bcol[static_cast<size_t>(k)]);
      }
      const double got = Download(c.As<float>(), p[0] * g + p[1], 1)[0];
      const double e = std::fabs(got - dot) / mag;
      err = std::isnan(e) ? INFINITY : std::max(err, e);
    }
    SetCheck(r, err, 5e-3);
  }
  MEMPLAN_BENCH_CUDA_CHECK(cudaStreamSynchronize(stream));
  m.gpu_ran = true;
}

#endif  // MEMPLAN_HAVE_CUDA

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--json FILE] [--markdown FILE] [--reps N] [--cpu-reps N] [--cpu-only] [--gpu-only] "
               "[--quick]\n",
               argv0);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--json" && has_value) {
      o.json_path = argv[++i];
    } else if (arg == "--markdown" && has_value) {
      o.markdown_path = argv[++i];
    } else if (arg == "--reps" && has_value) {
      o.gpu_reps = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--cpu-reps" && has_value) {
      o.cpu_reps = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--cpu-only") {
      o.gpu = false;
    } else if (arg == "--gpu-only") {
      o.cpu = false;
    } else if (arg == "--quick") {
      o.quick = true;
    } else {
      return Usage(argv[0]);
    }
  }

  Machine m;
  m.cpu_model = CpuModel();
  std::vector<Result> results;
  int status = 0;
#if defined(MEMPLAN_HAVE_CUDA)
  if (o.gpu) {
    try {
      RunGpu(o, m, results);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kernels_bench: CUDA error: %s\n", e.what());
      m.gpu_note = std::string("CUDA error: ") + e.what();
      status = 1;
    }
  } else {
    m.gpu_note = "skipped (--cpu-only)";
  }
#else
  m.gpu_note = o.gpu ? "built without CUDA" : "skipped (--cpu-only)";
#endif
  if (o.cpu) RunCpu(o, m, results);

  if (m.gpu_ran) {
    std::printf("GPU: %s, %d SMs, %.0f GiB, memory peak %.0f GB/s (clock x bus), D2D copy %.0f GB/s\n",
                m.gpu_name.c_str(), m.sm_count, static_cast<double>(m.gpu_mem_bytes) / (1 << 30),
                m.gpu_mem_peak_gb_per_s, m.gpu_copy_gb_per_s);
  } else {
    std::printf("GPU: none measured (%s)\n", m.gpu_note.c_str());
  }
  if (o.cpu) std::printf("CPU: %s, memcpy %.1f GB/s (reference ops)\n", m.cpu_model.c_str(), m.cpu_copy_gb_per_s);
  std::printf("GB/s = 1e9 bytes/s of logical traffic (inputs read once, outputs written once); "
              "%% of copy = of the same backend's copy.\n\n");
  ApplyGoals(m, results);
  PrintTable(m, results);

  for (const Result& r : results) {
    if (r.check_failed && status == 0) status = 2;
  }
  if (!o.json_path.empty() && !WriteFile(o.json_path, Json(m, results))) {
    std::fprintf(stderr, "kernels_bench: cannot write %s\n", o.json_path.c_str());
    status = 1;
  }
  if (!o.markdown_path.empty() && !WriteFile(o.markdown_path, MarkdownTable(m, results))) {
    std::fprintf(stderr, "kernels_bench: cannot write %s\n", o.markdown_path.c_str());
    status = 1;
  }
  return status;
}
