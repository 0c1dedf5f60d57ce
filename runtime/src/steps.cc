// Several optimizer steps in one run (docs/runtime.md, "Several steps"):
// the activation manager made again per step, each step's record, and the
// MoE selection bias's update after each step (executor_impl.h).
#include <algorithm>
#include <cstring>

#include "executor_impl.h"

namespace memplan::runtime::exec {

void Executor::MakeManager() {
  std::vector<RankMemory> mem(p_.tensors.size());  // another process's rank: none here
  for (auto& r : ranks_) mem[static_cast<size_t>(r->index)] = {r->dev.get(), r->host.get()};
  MemoryMode mode;
  mode.eager = options_.eager;
  mode.last_access = options_.eager_last_access;
  acts_.reset();
  acts_ = std::make_unique<ActivationManager>(p_, assign_, eval_.intervals, std::move(mem), *backend_, mode);
}

void Executor::BeginNextStep() {
  ++step_;
  MakeManager();
  steps_done_ = 0;
  loss_sum_ = 0;
  for (auto& r : ranks_) {
    r->block = 0;
    r->next_step = 0;
    r->grad_passes = 0;
    r->routing.clear();
    r->expert_load.clear();
    r->events.clear();
    r->dev->ResetAllocatedPeak();
    // The gradients the optimizer consumed, zeroed for the next step's sums.
    for (auto& ps : r->params) {
      if (!ps.grad.empty()) r->ops->Zero(ps.grad.ptr, ps.grad.bytes);
      if (!ps.part.empty() && !r->grad_host) r->ops->Zero(ps.part.ptr, ps.part.bytes);
      if (!ps.part.empty() && r->grad_host) std::memset(ps.part.ptr, 0, static_cast<size_t>(ps.part.bytes));
    }
    backend_->Finish(*r->dev);
  }
}

std::vector<float>& Executor::RouterBias(Rank& r, int64_t layer) {
  auto [it, fresh] = r.router_bias.try_emplace(layer);
  if (fresh) {
    it->second.assign(static_cast<size_t>(model_.arch.moe->experts), 0.f);
    if (options_.init_hook) options_.init_hook("layer" + std::to_string(layer) + ".moe.router.bias", &it->second);
  }
  return it->second;
}

// DeepSeek-V3's aux-loss-free balancing (docs/runtime.md, "MoE routing"):
// b_i += rate * sign(mean load - load_i), the load of the whole step's
// batch, the mean over experts.
void Executor::UpdateRouterBias() {
  if (!model_.arch.moe || !model_.arch.moe->selection_bias) return;
  const planner::MoeConfig& moe = *model_.arch.moe;
  const size_t experts = static_cast<size_t>(moe.experts);
  for (auto& r : ranks_) {
    for (int64_t layer : p_.layout.LayersOfRank(r->index)) {
      if (!model_.arch.IsMoeLayer(layer)) continue;
      std::vector<float> load(experts, 0.f);
      for (int32_t mb = 0; mb < model_.train.microbatches; ++mb) {
        auto it = r->expert_load.find({layer, mb});
        if (it == r->expert_load.end()) continue;
        for (size_t e = 0; e < experts; ++e) load[e] += it->second[e];
      }
      if (dp_comm_ && Replicas() > 1) dp_comm_->AllReduceSum(load.data(), static_cast<int64_t>(experts));
      // Sequence parallelism: each tensor-parallel rank routed its own tokens.
      if (tp_comm_ && model_.parallel.tp > 1) tp_comm_->AllReduceSum(load.data(), static_cast<int64_t>(experts));
      double total = 0;
      for (float v : load) total += v;
      const double mean = total / static_cast<double>(experts);
      std::vector<float>& bias = RouterBias(*r, layer);
      const float step = static_cast<float>(moe.bias_update_rate);
      for (size_t e = 0; e < experts; ++e) {
        const double diff = mean - static_cast<double>(load[e]);
        if (diff > 0) bias[e] += step;
        if (diff < 0) bias[e] -= step;
      }
    }
    r->expert_load.clear();
  }
}

void Executor::RecordStep(double grad_norm, double step_s) {
  traces::MeasuredStep s;
  s.step = step_ + 1;
  // One process per rank: the loss is summed on the last stage alone (the
  // others add zeros), so the sum in rank order is the single process's
  // bits; the time is the slowest rank's.
  double loss_sum = loss_sum_;
  if (options_.comm) {
    loss_sum = 0;
    for (double v : GatherDoubles(loss_sum_)) loss_sum += v;
    for (double v : GatherDoubles(step_s)) step_s = std::max(step_s, v);
  }
  s.loss = loss_sum / GlobalTokens();
  s.grad_norm = grad_norm;
  s.step_s = step_s;
  for (auto& r : ranks_) {
    traces::MeasuredStepRank sr;
    SetGridPlace(sr, *r);
    sr.allocated_peak = r->static_bytes + r->dev->allocated_peak();
    sr.peak = r->static_bytes + r->dev->high_water();
    r->run_allocated_peak = std::max(r->run_allocated_peak, sr.allocated_peak);
    r->run_high_water = std::max(r->run_high_water, sr.peak);
    for (const auto& e : acts_->allocation_events(r->index)) {
      if (e.bytes <= 0) continue;
      ++sr.allocations;
      sr.allocated_bytes += e.bytes;
    }
    s.ranks.push_back(sr);
  }
  step_records_.push_back(std::move(s));
}

}  // namespace memplan::runtime::exec
