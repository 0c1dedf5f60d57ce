// ZeRO-3 / FSDP (docs/runtime.md, "ZeRO-3 / FSDP"): each unit's weights
// gathered from the replicas' ranges before its ops, its gradients
// reduce-scattered into the partitions after its backward (executor_impl.h).
#include "executor_impl.h"

namespace memplan::runtime::exec {

void Executor::PrepareParams(Rank& r, const OpSpec& op, bool backward) {
  int64_t unit = -1;
  for (size_t role = 0; role < op.params.size(); ++role) {
    const int64_t u = ParamOf(r, op, role).unit;
    MEMPLAN_CHECK(unit < 0 || u == unit, "an op reads parameters of two ZeRO-3 units");
    unit = u;
  }
  if (unit < 0) return;
  if (!model_.parallel.fsdp_reshard_after_forward) {
    if (!r.kept_units.contains(unit)) GatherUnit(r, unit);
  } else if (r.gathered_unit != unit) {
    GatherUnit(r, unit);
  }
  if (backward && r.grad_unit != unit) {
    FlushUnitGrads(r);
    const Buffer& buffer = r.static_buffers.at("fsdp_grads");
    BindGrads(r, UnitParams(r, unit), buffer, 0, buffer.bytes, "a unit's gradients exceed the plan's fsdp_grads");
    r.grad_unit = unit;
  }
}

std::vector<ParamState*> Executor::UnitParams(Rank& r, int64_t unit) {
  std::vector<ParamState*> out;
  for (auto& ps : r.params) {
    if (ps.unit == unit) out.push_back(&ps);
  }
  return out;
}

void Executor::GatherUnit(Rank& r, int64_t unit) {
  const Buffer& buffer = r.static_buffers.at("fsdp_params");
  const int64_t width = model_.train.param_dtype == planner::DType::kBF16 ? 2 : 4;
  backend_->Finish(*r.dev);  // the released unit's last readers are done
  // Resharding after forward: one unit at a time at the buffer's start;
  // without: each unit after the units before it in the rank's order (the
  // plan's buffer holds them all).
  const bool keep = !model_.parallel.fsdp_reshard_after_forward;
  int64_t at = 0;
  if (keep) {
    for (const auto& ps : r.params) {
      if (ps.unit < unit) at += ps.elements * width;
    }
  }
  for (auto& ps : r.params) {
    if (!keep && ps.unit == r.gathered_unit) ps.weight = Buffer{};
    if (ps.unit != unit) continue;
    const int64_t bytes = ps.elements * width;
    MEMPLAN_CHECK(at + bytes <= buffer.bytes, "a unit's parameters exceed the plan's fsdp_params");
    ps.weight = Buffer{buffer.ptr + at, buffer.offset + at, bytes};
    // Every replica's range, in order: the whole parameter.
    std::vector<std::byte> all = GatherRanges(r, ps, ps.shard.ptr, width);
    backend_->FromHost(*r.stat, ps.weight.ptr, all.data(), bytes);
    at += bytes;
  }
  r.gathered_unit = unit;
  if (keep) r.kept_units.insert(unit);
  ++r.events["fsdp_gathers"];
}

void Executor::FlushUnitGrads(Rank& r) {
  if (r.grad_unit < 0) return;
  FlushGrads(r, UnitParams(r, r.grad_unit));
  r.grad_unit = -1;
  ++r.events["fsdp_grad_reduce_scatters"];
}

void Executor::ReleaseUnits(Rank& r) {
  FlushUnitGrads(r);
  for (auto& ps : r.params) {
    if (ps.unit == r.gathered_unit || r.kept_units.contains(ps.unit)) ps.weight = Buffer{};
  }
  r.gathered_unit = -1;
  r.kept_units.clear();
}

}  // namespace memplan::runtime::exec
