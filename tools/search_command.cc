// `memplan search`: layouts spread over threads, and under mpirun over
// processes (layout i on process i mod P); rank 0 gathers every verdict in
// enumeration order, so the output is the single-process one.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>

#include "command_util.h"
#include "memplan/common/parallel.h"
#include "memplan/common/schema.h"
#include "memplan/common/table.h"
#include "memplan/common/units.h"
#include "memplan/planner/model.h"
#include "memplan/planner/assumptions.h"
#include "memplan/planner/search.h"
#include "memplan/runtime/comm.h"

namespace memplan::cli {
namespace {

using planner::Candidate;
using planner::Layout;

// Every process's candidates, as (index, candidate) JSON, merged by index.
Expected<std::vector<Candidate>> Gather(runtime::Communicator& comm, size_t total,
                                        const std::vector<std::pair<size_t, Candidate>>& mine) {
  Json list = Json::array();
  for (const auto& [i, cand] : mine) list.push_back({{"i", i}, {"c", planner::CandidateToJson(cand)}});
  const std::vector<std::string> all = comm.AllGather(list.dump());
  std::vector<Candidate> out(total);
  std::vector<char> seen(total, 0);
  for (const auto& text : all) {
    const Json doc = Json::parse(text, nullptr, false);
    if (!doc.is_array()) return Error{ErrorCode::kRuntime, "search: a process sent unreadable results"};
    for (const auto& e : doc) {
      const size_t i = e.value("i", total);
      auto cand = planner::CandidateFromJson(e.value("c", Json::object()));
      if (i >= total || seen[i] || !cand) return Error{ErrorCode::kRuntime, "search: a process sent a bad result"};
      out[i] = *cand;
      seen[i] = 1;
    }
  }
  for (size_t i = 0; i < total; ++i) {
    if (!seen[i]) return Error{ErrorCode::kRuntime, "search: layout " + std::to_string(i) + " was not evaluated"};
  }
  return out;
}

}  // namespace

int RunSearch(const Command& c) {
  if (auto ok = CheckOutputs({c.output, c.best_model}, c.input); !ok) return Fail(ok.error());
  auto model = planner::LoadModel(c.input);
  if (!model) return Fail(Located(model.error(), c.input));
  if (auto ok = ApplyModelOptions(c, &*model); !ok) return Fail(ok.error());
  planner::SearchOptions options;
  options.gpus = c.gpus;
  options.top = c.top;
  options.exhaustive = c.exhaustive;
  if (!c.budget.empty()) {
    auto bytes = ParseBudget(c.budget);
    if (!bytes) return Fail(bytes.error());
    options.budget = *bytes;
  }
  if (c.global_batch > 0) options.global_batch = c.global_batch;
  for (const auto& arg : c.space) {
    if (auto ok = planner::ParseSpaceArgument(arg, &options.space); !ok) return Fail(ok.error());
  }
  if (c.threads > 0) SetThreads(c.threads);
  auto layouts = planner::EnumerateLayouts(*model, options);
  if (!layouts) return Fail(layouts.error());

  std::unique_ptr<runtime::Communicator> comm;
  if (runtime::LaunchedByMpi()) {
    auto made = runtime::MakeMpiCommunicator(3600);
    if (!made) return Fail(made.error());
    comm = std::move(*made);
  }
  const size_t rank = comm ? static_cast<size_t>(comm->rank()) : 0;
  const size_t procs = comm ? static_cast<size_t>(comm->size()) : 1;
  if (comm) {
    // Each process searches its share by index and rank 0 merges them: all
    // must enumerate the same layouts of the same model and rank them alike.
    if (auto why = LaunchMismatch(comm->AllGather(SearchLaunchOptions(c, planner::ModelDigest(*model))))) {
      return FailAgreed(comm.get(), {ErrorCode::kBadInput, "search under mpirun: " + *why});
    }
  }
  std::vector<size_t> mine;
  for (size_t i = rank; i < layouts->size(); i += procs) mine.push_back(i);

  // Progress on stderr (rank 0, its own share): a line every 2 s while the
  // search runs, whether or not a layout finished, with the time left at
  // the rate so far.
  const bool progress = !c.quiet && rank == 0;
  if (progress) {
    // What the search takes for granted, once (rank 0).
    planner::AssumptionsContext context;
    context.verb = planner::AssumptionsFor::kSearch;
    context.budget = options.budget;
    std::fputs((planner::RenderAssumptions(*model, context) + planner::DefaultSpaceNote(*model, options)).c_str(), stderr);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<size_t> done_n{0}, total_n{mine.size()}, fit_n{0};
  auto report = [&](size_t n, size_t total, size_t fit) {
    done_n = n;
    total_n = total;
    fit_n = fit;
  };
  std::mutex ticker_mutex;
  std::condition_variable ticker_cv;
  bool finished = false;
  std::thread ticker;
  if (progress) {
    ticker = std::thread([&] {
      std::unique_lock<std::mutex> lock(ticker_mutex);
      while (!ticker_cv.wait_for(lock, std::chrono::seconds(2), [&] { return finished; })) {
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const size_t n = done_n, total = total_n;
        std::string eta = "estimating the time left";
        if (n > 0 && n < total) {
          eta = "about " + FormatFixed(elapsed / static_cast<double>(n) * static_cast<double>(total - n), 0) +
                " s left at the rate so far";
        }
        std::fprintf(stderr, "memplan: search: %zu/%zu layouts%s, %zu fit, %.0f s, %s\n", n, total,
                     procs > 1 ? " of rank 0's share" : "", fit_n.load(), elapsed, eta.c_str());
      }
    });
  }
  std::vector<Candidate> evaluated = planner::SearchShare(*model, options, *layouts, mine, report);
  if (progress) {
    {
      std::lock_guard<std::mutex> lock(ticker_mutex);
      finished = true;
    }
    ticker_cv.notify_all();
    ticker.join();
  }

  std::vector<Candidate> all;
  if (comm) {
    std::vector<std::pair<size_t, Candidate>> pairs;
    for (size_t k = 0; k < mine.size(); ++k) pairs.emplace_back(mine[k], evaluated[k]);
    auto gathered = Gather(*comm, layouts->size(), pairs);
    if (!gathered) return Fail(gathered.error());
    if (rank != 0) return 0;  // rank 0 reports and writes
    all = std::move(*gathered);
  } else {
    all = std::move(evaluated);
  }

  auto summarized = planner::SummarizeSearch(*model, options, std::move(all));
  if (!summarized) return Fail(summarized.error());
  const planner::SearchResult& result = *summarized;
  OutputFiles out;
  if (!c.output.empty()) {
    const OrderedJson doc = planner::SearchToJson(result);
    if (auto valid = ValidateSchema(Json::parse(doc.dump()), SchemaKind::kSearch, c.output); !valid) {
      return Fail({ErrorCode::kRuntime, "internal error: " + valid.error().message + "; no output written"});
    }
    if (auto st = StageJson(out, c.output, doc, 1); !st) return Fail(st.error());
  }
  if (!c.best_model.empty() && !result.ranked.empty()) {
    const Layout& best = result.candidates[result.ranked.front()].layout;
    Json best_json = planner::ModelJsonWithLayout(*model, best);
    if (options.budget) best_json["budget"] = *options.budget;  // the budget it was searched for
    if (auto st = StageJson(out, c.best_model, best_json, 2); !st) {
      return Fail(st.error());
    }
  }
  if (auto st = out.Commit(); !st) return Fail(st.error());
  if (!c.quiet) std::fputs(planner::RenderSearchTable(result).c_str(), stdout);
  if (result.ranked.empty() && !result.candidates.empty() &&
      std::all_of(result.candidates.begin(), result.candidates.end(),
                  [](const Candidate& k) { return k.verdict == planner::Verdict::kInvalid; })) {
    // No layout is a valid model: say why (the most frequent refusal), not
    // the budget.
    std::map<std::string, size_t> reasons;
    for (const Candidate& k : result.candidates) ++reasons[k.detail.empty() ? k.reason : k.detail];
    auto most = std::max_element(reasons.begin(), reasons.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
    return Fail({ErrorCode::kBadInput, "search: none of " + std::to_string(result.candidates.size()) +
                                           " layouts is a valid model; " + std::to_string(most->second) + " of them: " +
                                           most->first + (reasons.size() > 1 ? " (and " + std::to_string(reasons.size() - 1) +
                                           " other reasons: -o SEARCH.json lists each)" : "")});
  }
  if (result.ranked.empty()) {
    return Fail({ErrorCode::kInfeasible, "search: none of " + std::to_string(result.candidates.size()) +
                                             " layouts fits the budget " + FormatBytes(result.budget) +
                                             (c.best_model.empty() ? "" : "; no best model written")});
  }
  return 0;
}

}  // namespace memplan::cli
