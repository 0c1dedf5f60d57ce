// `memplan search`: the fastest parallel layout of a model that fits a
// budget on N GPUs (docs/planner.md, "Search").
//
// EnumerateLayouts() lists every combination of the search space whose
// grid has N GPUs (tp x pp x cp x dp = N) and whose microbatches make the
// global batch (micro_batch x microbatches x dp = G), in a fixed order.
// EvaluateLayout() rejects a layout the model file would refuse (its
// JSON pointer is the reason), then one whose static memory alone exceeds
// the budget, then plans it: the planner refuses a layout whose any-plan
// lower bound exceeds the budget, and a plan that still does not fit is
// rejected. Both bounds are below every plan's peak, so pruning never
// drops a layout that could fit. SummarizeSearch() ranks what fits by
// predicted step time (ties: the layout's key), and finds the Pareto front
// of peak memory against step time.
//
// Layouts are independent: callers spread EvaluateLayout over threads or
// processes (`mpirun -np P memplan search`) and gather the candidates in
// enumeration order; the result does not depend on how.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

inline constexpr std::string_view kSearchSchema = "memplan.search/1";

// One parallel layout of the model: what `search` varies.
struct Layout {
  int64_t tp = 1, pp = 1, vp = 1, cp = 1, ep = 1, dp = 1;
  int64_t micro_batch = 1, microbatches = 1;
  int zero = 0;
  bool sp = false, pipeline_zero2 = false, grad_offload_host = false;
  // Layers the first and the last pipeline rank give up to the inner ones
  // (they also hold the embedding and the head; Megatron-LM's
  // --decoder-first/last-pipeline-num-layers): 0 is the default layout.
  int64_t lighter_ends = 0;
  // "tp=1 pp=4 vp=2 cp=1 ep=8 dp=16 mb=1x64 zero=1 sp=0 pz2=1 offload=host ends=0":
  // unique per layout; ties in step time are broken by it.
  std::string Key() const;
};

// The values each dimension may take; dp and microbatches follow from the
// others. An empty list means the default (SearchSpaceDefaults).
struct SearchSpace {
  std::vector<int64_t> tp, pp, vp, cp, ep, dp, micro_batch;
  std::vector<int64_t> zero, sp, pipeline_zero2, grad_offload;  // 0/1 (grad_offload: 1 = host)
  std::vector<int64_t> lighter_ends;
  // sp not given: sequence parallelism follows tp (on exactly when tp > 1,
  // as every Megatron recipe with tp > 1 runs it); set by SearchSpaceDefaults.
  bool sp_follows_tp = false;
};

// The default pipeline layout (DefaultPipelineLayout) with `k` more layers
// moved from the first and the last rank each to the inner ranks (those
// with the fewest first); nullopt when pp < 3 or an end would hold fewer
// than vp layers.
std::optional<std::vector<int64_t>> LighterEndsLayout(int64_t layers, int64_t pp, int64_t vp, int64_t k);

// "key=v1,v2,..." for one dimension; keys are the fields of SearchSpace
// (booleans as 0/1, grad_offload as none/host). Errors: kBadInput naming
// the key or value.
Expected<bool> ParseSpaceArgument(const std::string& arg, SearchSpace* space);

struct SearchOptions {
  int64_t gpus = 0;
  std::optional<int64_t> budget;        // bytes; default: the model's
  std::optional<int64_t> global_batch;  // sequences; default: the model's
  SearchSpace space;
  int top = 10;
  // Plan every layout instead of stopping at the step bound (below).
  bool exhaustive = false;
};

// The space actually searched: defaults filled from the model and N.
SearchSpace SearchSpaceDefaults(const Model& base, const SearchOptions& options);
// The budget and global batch the search uses.
int64_t SearchBudget(const Model& base, const SearchOptions& options);
int64_t SearchGlobalBatch(const Model& base, const SearchOptions& options);

// Every layout of the space on options.gpus GPUs making the global batch,
// in a fixed order. Errors: kBadInput when the model cannot be searched
// (explicit per-device graphs) or gpus < 1.
Expected<std::vector<Layout>> EnumerateLayouts(const Model& base, const SearchOptions& options);

// kStepBound: not planned, because its base step (a lower bound of its
// step: BaseStepSeconds) exceeds the steps of `top` layouts already found
// to fit, so it cannot enter the table. kPending: prepared, not yet planned.
enum class Verdict { kFits, kInvalid, kStaticOverBudget, kAnyPlanOverBudget, kDoesNotFit, kStepBound, kError, kPending };
std::string_view VerdictName(Verdict v);

struct Candidate {
  Layout layout;
  Verdict verdict = Verdict::kError;
  std::string reason;  // kInvalid: the JSON pointer the model file refused
  std::string detail;  // the refusal or planner message
  // Bytes, largest rank. max_peak is what the target's allocator reserves
  // at the peak (memplan's arena: the placed peak; Megatron: PyTorch's
  // reserved bytes, plan.h RankPlan::reserved).
  int64_t max_static = 0, max_any_plan = 0, max_peak = 0;
  // The smallest margin left by a rank (budget - reserved - runtime), and
  // under a framework target the storage settings its plan chose.
  int64_t min_margin = 0;
  std::string settings;
  double base_bound_s = 0;  // BaseStepSeconds: set once the layout passed the static check
  // The steps its solved decisions implied before placement, one per
  // planning round (host-side rounds re-plan), as far as the search went;
  // solved_step_s: the one that stopped it (kStepBound: could not enter
  // the top), else 0.
  std::vector<double> solved_steps;
  double solved_step_s = 0;
  double step_s = 0, base_step_s = 0, recompute_s = 0, quantize_s = 0, exposed_transfer_s = 0, comm_s = 0,
         dp_exposed_s = 0;
};

// The model with `layout` applied (pp_layout kept only when pp and vp are
// the base's); errors as ParseModel's.
Expected<Model> ModelWithLayout(const Model& base, const Layout& layout);
Json ModelJsonWithLayout(const Model& base, const Layout& layout);

// Never fails: every outcome is a verdict. PrepareLayout checks validity
// and static memory and computes the step bound (kPending when the layout
// needs planning); PlanLayout plans a pending one; EvaluateLayout does both.
Candidate PrepareLayout(const Model& base, const Layout& layout, int64_t budget);
// `place_if` (optional): asked with the solved step before placement;
// false leaves the layout kStepBound with its solved_step_s.
// `defer_host`: a layout whose offloads pass the host's memory is left
// kPending (planned again later, host-side rounds included); returns
// whether it was.
bool PlanLayout(const Model& base, int64_t budget, Candidate* c,
                const std::function<bool(double step_s)>& place_if = nullptr, bool defer_host = false);
Candidate EvaluateLayout(const Model& base, const Layout& layout, int64_t budget);

// The candidates of `share` (indices into `layouts`), in share order: all
// prepared (on threads), then the pending ones planned in order of their
// step bound, skipping (kStepBound) a layout whose bound, or whose solved
// step before placement, exceeds the options.top fastest steps the share
// has found so far (never with options.exhaustive); layouts whose offloads
// pass the host's memory are planned last. That bound is never below the
// one ApplyStepBound computes on the whole search, so a layout skipped here
// is skipped there too, and the result does not depend on threads or
// processes. `progress(done, total, fit)` after each layout (any thread).
std::vector<Candidate> SearchShare(const Model& base, const SearchOptions& options, const std::vector<Layout>& layouts,
                                   const std::vector<size_t>& share,
                                   const std::function<void(size_t, size_t, size_t)>& progress = nullptr);

// The step bound over the whole search, deterministically: with K-th the
// options.top-th best step of every layout that fits, a prepared layout is
// kStepBound when its base bound exceeds it, or when one of its solved
// steps does (not placed); its plan, if a share computed one, is dropped.
// Errors: kRuntime when a layout this keeps was skipped by a share (a
// broken invariant).
Expected<bool> ApplyStepBound(std::vector<Candidate>* candidates, int top);

// Round trip for gathering candidates between processes.
Json CandidateToJson(const Candidate& c);
Expected<Candidate> CandidateFromJson(const Json& j);

struct SearchResult {
  std::string model, digest;
  TargetKind target = TargetKind::kMemplan;
  int64_t headroom = 0;  // given (model.headroom) or the target's default
  // For tokens/s per GPU and MFU in the table (plan.h Throughput): the
  // model's FLOPs per token, sequence length, dense bf16 peak, and what
  // the step model comes from.
  double flops_per_token = 0, bf16_flops = 0;
  int64_t seq_len = 0;
  std::string step_source;
  int64_t gpus = 0, budget = 0, global_batch = 0;
  SearchSpace space;
  std::vector<Candidate> candidates;  // enumeration order
  std::vector<size_t> ranked;         // fitting candidates, fastest first
  std::vector<size_t> pareto;         // planned layouts by peak ascending, each faster than the previous
  // Per verdict other than kFits (and per JSON pointer for kInvalid): count
  // and one example's message.
  std::map<std::string, std::pair<int64_t, std::string>> rejected;
  int top = 10;
  bool exhaustive = false;
};

// Applies the step bound (unless options.exhaustive), ranks, finds the
// Pareto front among the planned layouts and counts the rejections.
Expected<SearchResult> SummarizeSearch(const Model& base, const SearchOptions& options,
                                       std::vector<Candidate> candidates);

// SEARCH.json (memplan.search/1; schemas/search.schema.json).
OrderedJson SearchToJson(const SearchResult& result);
// The top-K table, why the best beats the next, the Pareto front and the
// rejection counts, as `memplan search` prints them.
std::string RenderSearchTable(const SearchResult& result);
// One paragraph, printed once before a search: the values the default space
// tries for each key the command line left to it, and what that leaves out
// (with the --space argument that adds it); "" when every key was given.
std::string DefaultSpaceNote(const Model& base, const SearchOptions& options);
// One line: why ranked[0] beats ranked[1] (the terms of the step that differ).
std::string WhyBestBeatsNext(const SearchResult& result);

}  // namespace memplan::planner
