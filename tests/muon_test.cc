// Muon in `memplan run` (docs/runtime.md, "Optimizer"): the plan's
// Newton-Schulz scratch is allocated and measured exactly; the updated
// weights (--dump DIR/updated) equal an independent double-precision Muon
// on the dumped gradients for every matrix, and AdamW for the rest; the step
// does not depend on where saved tensors were kept.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "executor_test_util.h"

namespace {

using memplan::Json;
using namespace memplan::test::exec;
namespace fs = std::filesystem;

// The first Muon step of one [rows, cols] matrix from zero momentum, in
// double: U = (1 + mu) G, X = U / ||U||_F, five quintic Newton-Schulz
// iterations on the wide orientation; returns X.
std::vector<double> NewtonSchulz(const float* g, int64_t rows, int64_t cols) {
  const bool wide = rows <= cols;
  const int64_t r = wide ? rows : cols, c = wide ? cols : rows;  // work on X [r, c], r <= c
  std::vector<double> x(static_cast<size_t>(r * c));
  double sq = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const double u = 1.95 * static_cast<double>(g[i * cols + j]);
      x[static_cast<size_t>(wide ? i * c + j : j * c + i)] = u;
      sq += u * u;
    }
  }
  const double inv = 1.0 / (std::sqrt(sq) + 1e-7);
  for (double& v : x) v *= inv;
  const double a = 3.4445, b = -4.7750, cc = 2.0315;
  std::vector<double> A(static_cast<size_t>(r * r)), B(A.size()), t(x.size());
  for (int s = 0; s < 5; ++s) {
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < r; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < c; ++k) acc += x[static_cast<size_t>(i * c + k)] * x[static_cast<size_t>(j * c + k)];
        A[static_cast<size_t>(i * r + j)] = acc;
      }
    }
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < r; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < r; ++k) acc += A[static_cast<size_t>(i * r + k)] * A[static_cast<size_t>(k * r + j)];
        B[static_cast<size_t>(i * r + j)] = b * A[static_cast<size_t>(i * r + j)] + cc * acc;
      }
    }
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < c; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < r; ++k) acc += B[static_cast<size_t>(i * r + k)] * x[static_cast<size_t>(k * c + j)];
        t[static_cast<size_t>(i * c + j)] = acc;
      }
    }
    for (size_t i = 0; i < x.size(); ++i) x[i] = a * x[i] + t[i];
  }
  if (wide) return x;
  std::vector<double> back(x.size());  // X was the transpose: [cols, rows] -> [rows, cols]
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) back[static_cast<size_t>(i * cols + j)] = x[static_cast<size_t>(j * c + i)];
  }
  return back;
}

Json MuonModel(const char* file) {
  Json m = LoadJson(file);
  m["train"]["optimizer"] = "muon";
  return m;
}

}  // namespace

TEST_CASE("Muon: the Newton-Schulz scratch is planned and allocated as planned (feasibility)") {
  for (const char* file : {"examples/models/tiny-llama.json", "examples/models/tiny-deepseek.json"}) {
    CAPTURE(file);
    Json plan = PlanOf(MuonModel(file));
    RunResult r = MustRun(plan);
    const auto& ranks = plan["ranks"];
    REQUIRE(r.measured.ranks.size() == ranks.size());
    for (size_t i = 0; i < ranks.size(); ++i) {
      CHECK(ranks[i]["static"]["buffer_detail"].contains("muon_ns_scratch"));
      CHECK(r.measured.ranks[i].static_bytes == ranks[i]["static"]["total"].get<int64_t>());
      CHECK(r.measured.ranks[i].peak == ranks[i]["peak"].get<int64_t>());
      CHECK(r.measured.ranks[i].allocated_peak == ranks[i]["lower_bound"].get<int64_t>());
    }
    CHECK(std::isfinite(r.measured.loss));
  }
}

TEST_CASE("Muon: updated matrices equal a double-precision Muon of the dumped gradients; the rest AdamW") {
  for (const char* file : {"examples/models/tiny-llama.json", "examples/models/tiny-deepseek.json"}) {
    CAPTURE(file);
    Json plan = PlanOf(MuonModel(file));
    fs::path dir = UniqueTempDir("memplan_muon_test");
    fs::remove_all(dir);
    RunOptions o;
    o.dump_dir = dir.string();
    MustRun(plan, o);
    int matrices = 0, adamw = 0;
    for (const auto& e : fs::directory_iterator(dir / "updated")) {
      const std::string name = e.path().filename().string();
      CAPTURE(name);
      std::vector<int64_t> shape;
      auto w0 = NpyFloats(dir / "weights" / name, &shape);
      auto g = NpyFloats(dir / "grads" / name);
      auto w1 = NpyFloats(e.path());
      REQUIRE(w0.size() == w1.size());
      const bool embedding_or_head = name.find(".embed.") != std::string::npos || name.find(".head.") != std::string::npos;
      if (shape.size() >= 2 && !embedding_or_head) {
        const int64_t rows = shape[shape.size() - 2], cols = shape.back(), n = rows * cols;
        const double adj = 1e-3 * 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
        for (int64_t m = 0; m < static_cast<int64_t>(w0.size()) / n; ++m) {
          auto x = NewtonSchulz(g.data() + m * n, rows, cols);
          double worst = 0;
          for (int64_t i = 0; i < n; ++i) {
            const double want = static_cast<double>(w0[static_cast<size_t>(m * n + i)]) - adj * x[static_cast<size_t>(i)];
            worst = std::max(worst, std::fabs(want - static_cast<double>(w1[static_cast<size_t>(m * n + i)])));
          }
          CHECK(worst < 2e-6);  // the update is ~3e-3 per element; fp32 weights round at ~1e-8
          ++matrices;
        }
      } else {
        // AdamW, first step, no decay: w - lr g / (|g| + eps).
        double worst = 0;
        for (size_t i = 0; i < w0.size(); ++i) {
          const double gi = g[i];
          const double want = w0[i] - 1e-3 * gi / (std::fabs(gi) + 1e-8);
          worst = std::max(worst, std::fabs(want - w1[i]));
        }
        CHECK(worst < 1e-6);
        ++adamw;
      }
    }
    MESSAGE(std::string(file) << ": " << matrices << " Muon matrices and " << adamw << " AdamW parameters checked");
    CHECK(matrices >= 8);
    CHECK(adamw >= 3);
    fs::remove_all(dir);
  }
}

TEST_CASE("Muon: the step does not depend on where saved tensors were kept") {
  Json model = MuonModel("examples/models/tiny-llama.json");
  std::vector<std::vector<float>> first;
  int compared = 0;
  for (const char* mix : {"keep", "recompute", "offload_host"}) {
    CAPTURE(mix);
    fs::path dir = UniqueTempDir(std::string("memplan_muon_mix_") + mix);
    fs::remove_all(dir);
    RunOptions o;
    o.dump_dir = dir.string();
    Json plan = PlanOf(WithPolicy(model, mix));
    CHECK((std::string(mix) == "keep") == (NotKept(plan) == 0));
    MustRun(plan, o);
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir / "updated")) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    std::vector<std::vector<float>> now;
    for (const auto& n : names) now.push_back(NpyFloats(dir / "updated" / n));
    if (first.empty()) {
      first = now;
    } else {
      REQUIRE(now.size() == first.size());
      for (size_t i = 0; i < now.size(); ++i) {
        CHECK(now[i] == first[i]);
        ++compared;
      }
    }
    fs::remove_all(dir);
  }
  CHECK(compared > 20);
}
