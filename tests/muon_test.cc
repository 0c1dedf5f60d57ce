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

constexpr double kMu = 0.95;  // Muon's momentum (docs/runtime.md, "Optimizer")

// Muon's orthogonalized update of one [rows, cols] matrix, in double, from
// its Nesterov input U (the first step from zero momentum: U = (1 + mu) G):
// X = U / ||U||_F, five quintic Newton-Schulz iterations on the wide
// orientation; returns X.
std::vector<double> NewtonSchulz(const std::vector<double>& in, int64_t rows, int64_t cols) {
  const bool wide = rows <= cols;
  const int64_t r = wide ? rows : cols, c = wide ? cols : rows;  // work on X [r, c], r <= c
  std::vector<double> x(static_cast<size_t>(r * c));
  double sq = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const double u = in[static_cast<size_t>(i * cols + j)];
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
          std::vector<double> u(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) u[static_cast<size_t>(i)] = (1 + kMu) * g[static_cast<size_t>(m * n + i)];
          auto x = NewtonSchulz(u, rows, cols);
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

// memplan run --steps 2 (docs/runtime.md, "Several steps"): the second
// step's update is the closed form of both steps' dumped gradients g1, g2.
// Muon: momentum m1 = g1, m2 = mu m1 + g2, Nesterov U = g2 + mu m2; AdamW:
// m2 = b1 (1 - b1) g1 + (1 - b1) g2, v2 = b2 (1 - b2) g1^2 + (1 - b2) g2^2,
// bias corrections 1 - b^2. A step that forgot its state (the first step's
// formula on g2) is far from the result: the check tells them apart.
TEST_CASE("two steps: Muon's momentum and AdamW's betas against their closed forms at step 2") {
  Json plan = PlanOf(MuonModel("examples/models/tiny-llama.json"));
  fs::path dir = UniqueTempDir("memplan_muon_two_steps");
  fs::remove_all(dir);
  RunOptions o;
  o.dump_dir = dir.string();
  o.steps = 2;
  RunResult run = MustRun(plan, o);
  REQUIRE(run.measured.steps.size() == 2);
  const fs::path s1 = dir / "step1", s2 = dir / "step2";
  // Fresh microbatches: step 2's first is not step 1's.
  CHECK(NpyFloats(s1 / "batch" / "tokens_mb0.npy") != NpyFloats(s2 / "batch" / "tokens_mb4.npy"));
  int matrices = 0, adamw = 0, params = 0, forgetful_far = 0;
  const double b1 = 0.9, b2 = 0.95, lr = 1e-3;
  for (const auto& e : fs::directory_iterator(s2 / "updated")) {
    const std::string name = e.path().filename().string();
    CAPTURE(name);
    std::vector<int64_t> shape;
    const auto w1 = NpyFloats(s1 / "updated" / name, &shape);
    CHECK(NpyFloats(s2 / "weights" / name) == w1);  // step 2 starts where step 1 ended
    const auto g1 = NpyFloats(s1 / "grads" / name), g2 = NpyFloats(s2 / "grads" / name), w2 = NpyFloats(e.path());
    REQUIRE(g1.size() == w2.size());
    CHECK(g1 != g2);  // fresh microbatches
    const bool embedding_or_head = name.find(".embed.") != std::string::npos || name.find(".head.") != std::string::npos;
    double worst = 0, forgetful = 0;
    if (shape.size() >= 2 && !embedding_or_head) {
      const int64_t rows = shape[shape.size() - 2], cols = shape.back(), n = rows * cols;
      const double adj = lr * 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
      for (int64_t m = 0; m < static_cast<int64_t>(w2.size()) / n; ++m) {
        std::vector<double> u(static_cast<size_t>(n)), u_first(u.size());
        for (int64_t i = 0; i < n; ++i) {
          const size_t k = static_cast<size_t>(m * n + i);
          u[static_cast<size_t>(i)] = (1 + kMu) * g2[k] + kMu * kMu * g1[k];
          u_first[static_cast<size_t>(i)] = (1 + kMu) * g2[k];
        }
        const auto x = NewtonSchulz(u, rows, cols), x_first = NewtonSchulz(u_first, rows, cols);
        for (int64_t i = 0; i < n; ++i) {
          const size_t k = static_cast<size_t>(m * n + i);
          worst = std::max(worst, std::fabs(w1[k] - adj * x[static_cast<size_t>(i)] - w2[k]));
          forgetful = std::max(forgetful, std::fabs(w1[k] - adj * x_first[static_cast<size_t>(i)] - w2[k]));
        }
        ++matrices;
      }
      CHECK(worst < 2e-6);
    } else {
      for (size_t i = 0; i < w2.size(); ++i) {
        const double m2 = b1 * (1 - b1) * g1[i] + (1 - b1) * g2[i];
        const double v2 = b2 * (1 - b2) * g1[i] * g1[i] + (1 - b2) * g2[i] * g2[i];
        const double want = w1[i] - lr * (m2 / (1 - b1 * b1)) / (std::sqrt(v2 / (1 - b2 * b2)) + 1e-8);
        worst = std::max(worst, std::fabs(want - w2[i]));
        const double first = w1[i] - lr * g2[i] / (std::fabs(double(g2[i])) + 1e-8);
        forgetful = std::max(forgetful, std::fabs(first - w2[i]));
      }
      CHECK(worst < 1e-6);
      ++adamw;
    }
    if (forgetful > 1e-5) ++forgetful_far;
    ++params;
  }
  MESSAGE(matrices << " Muon matrices and " << adamw << " AdamW parameters checked at step 2");
  CHECK(matrices >= 8);
  CHECK(adamw >= 3);
  CHECK(forgetful_far == params);  // every parameter
  fs::remove_all(dir);
}
