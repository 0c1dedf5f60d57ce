// Messages between pipeline ranks (executor_impl.h): one process keeps them
// in a mailbox outside the pools, as a network link would hold them;
// one process per rank hands them to the communicator (runtime/comm.h),
// tagged kind + kMsgKinds * id.
#include "executor_impl.h"

namespace memplan::runtime::exec {

void Executor::Post(int32_t from, int32_t to, Msg kind, int64_t id, std::vector<std::byte> bytes) {
  if (options_.comm && !Local(to)) {
    options_.comm->Send(World(to), static_cast<int>(kind) + kMsgKinds * static_cast<int>(id), std::move(bytes));
    return;
  }
  mailbox_[{from, to, kind, id}].push_back(std::move(bytes));
}

bool Executor::Arrived(int32_t from, int32_t to, Msg kind, int64_t id) const {
  auto it = mailbox_.find({from, to, kind, id});
  return it != mailbox_.end() && !it->second.empty();
}

std::vector<std::byte> Executor::Take(int32_t from, int32_t to, Msg kind, int64_t id) {
  if (options_.comm && !Local(from)) {
    return options_.comm->Recv(World(from), static_cast<int>(kind) + kMsgKinds * static_cast<int>(id));
  }
  auto it = mailbox_.find({from, to, kind, id});
  MEMPLAN_CHECK(it != mailbox_.end() && !it->second.empty(), "a message between pipeline ranks did not arrive");
  std::vector<std::byte> bytes = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) mailbox_.erase(it);
  return bytes;
}

void Executor::SetupRemote() {
  const size_t pp = p_.tensors.size();
  remote_returns_.assign(pp, {});
  remote_fetches_.assign(pp, {});
  remote_target_.assign(pp, {});
  if (!options_.comm) return;  // one process: the activation manager's wire
  std::map<std::pair<int32_t, int32_t>, int64_t> fetch_step;  // (owner, instance) -> its fetch's first step
  for (const Interval& iv : eval_.intervals) {
    if (iv.part == IntervalPart::kFetched && iv.rank == iv.owner_rank) fetch_step[{iv.owner_rank, iv.instance}] = iv.first;
  }
  for (const Interval& iv : eval_.intervals) {
    if (iv.part != IntervalPart::kLanded) continue;
    const int32_t owner = iv.owner_rank, target = iv.rank;
    auto f = fetch_step.find({owner, iv.instance});
    MEMPLAN_CHECK(f != fetch_step.end(), "a remote payload is never fetched");
    // The target returns the payload at its last step that starts after
    // the owner's copy-out ended and strictly before the owner's fetch
    // starts: every wait then points forward in the plan's timeline (two
    // ranks fetching from each other at the same instant would otherwise
    // wait for each other), so none closes a cycle.
    const auto& otl = p_.timelines[static_cast<size_t>(owner)];
    const int64_t prod = p_.instances[static_cast<size_t>(owner)][static_cast<size_t>(iv.instance)].prod;
    const double saved_s = otl.end_s[static_cast<size_t>(prod)];
    const double fetch_s = otl.start_s[static_cast<size_t>(f->second)];
    const auto& tl = p_.timelines[static_cast<size_t>(target)];
    int64_t at = -1;
    for (int64_t s = iv.first; s <= iv.last; ++s) {
      const double t = tl.start_s[static_cast<size_t>(s)];
      if (t >= saved_s && t < fetch_s) at = s;
    }
    if (at < 0) {
      ThrowError(ErrorCode::kBadInput,
                 options_.plan_file + ": " + p_.tensors[static_cast<size_t>(owner)][static_cast<size_t>(
                                                 p_.instances[static_cast<size_t>(owner)][static_cast<size_t>(iv.instance)].tensor)].name +
                     ": pp rank " + std::to_string(target) +
                     " has no step between the remote copy-out and the fetch to carry the payload between processes");
    }
    remote_returns_[static_cast<size_t>(target)][at].push_back({owner, iv.instance});
    remote_fetches_[static_cast<size_t>(owner)][f->second].push_back({target, iv.instance});
    remote_target_[static_cast<size_t>(owner)][iv.instance] = target;
  }
}

void Executor::SendRemotePayload(Rank& r, int32_t inst) {
  auto& targets = remote_target_[static_cast<size_t>(r.index)];
  auto t = targets.find(inst);
  if (t == targets.end()) return;
  Post(r.index, t->second, Msg::kRemotePut, inst, acts_->TakeWire(r.index, inst));
  ++r.events["remote_puts"];
}

void Executor::ReturnRemotePayloads(Rank& r, int64_t step) {
  auto it = remote_returns_[static_cast<size_t>(r.index)].find(step);
  if (it == remote_returns_[static_cast<size_t>(r.index)].end()) return;
  for (auto [owner, inst] : it->second) {
    // Through this rank's buffer, as the plan places it, and back.
    std::vector<std::byte> payload = Take(owner, r.index, Msg::kRemotePut, inst);
    Buffer landed = acts_->Landed(owner, inst);
    MEMPLAN_CHECK(static_cast<int64_t>(payload.size()) == landed.bytes, "a remote payload has the wrong size");
    backend_->FromHost(*r.dev, landed.ptr, payload.data(), landed.bytes);
    backend_->ToHost(*r.dev, payload.data(), landed.ptr, landed.bytes);
    Post(r.index, owner, Msg::kRemoteReturn, inst, std::move(payload));
    ++r.events["remote_returns"];
  }
}

void Executor::ReceiveRemoteFetches(Rank& r, int64_t step) {
  auto it = remote_fetches_[static_cast<size_t>(r.index)].find(step);
  if (it == remote_fetches_[static_cast<size_t>(r.index)].end()) return;
  for (auto [target, inst] : it->second) acts_->PutWire(r.index, inst, Take(target, r.index, Msg::kRemoteReturn, inst));
}

Expected<std::monostate> Executor::CheckTags() const {
  if (!options_.comm) return std::monostate{};
  int64_t ids = model_.parallel.pp * model_.parallel.vp * model_.train.microbatches;
  for (const auto& inst : p_.instances) ids = std::max<int64_t>(ids, static_cast<int64_t>(inst.size()));
  const int64_t largest = (ids + 1) * kMsgKinds;
  if (largest > options_.comm->max_tag()) {
    return Error{ErrorCode::kBadInput, options_.plan_file + ": the plan needs message tags up to " +
                                           std::to_string(largest) + ", the transport allows " +
                                           std::to_string(options_.comm->max_tag())};
  }
  return std::monostate{};
}

std::vector<double> Executor::GatherDoubles(double mine) {
  if (!options_.comm) return {mine};
  std::string bytes(sizeof mine, '\0');
  std::memcpy(bytes.data(), &mine, sizeof mine);  // exact: the bits travel
  std::vector<double> out;
  for (const std::string& s : options_.comm->AllGather(bytes)) {
    MEMPLAN_CHECK(s.size() == sizeof(double), "a rank sent a malformed number");
    double v = 0;
    std::memcpy(&v, s.data(), sizeof v);
    out.push_back(v);
  }
  return out;
}

std::vector<std::vector<std::byte>> Executor::ExchangeExperts(std::vector<std::vector<std::byte>> out) {
  // Every EP rank of the group calls it at the same op of the same step
  // (one plan, one program): one tag keeps the exchanges in order.
  MEMPLAN_CHECK(ep_comm_ != nullptr && static_cast<int>(out.size()) == ep_comm_->size(),
                "an expert exchange outside an EP group");
  const int me = ep_comm_->rank();
  ++ranks_.front()->events["expert_exchanges"];  // one rank per process
  std::vector<std::vector<std::byte>> in(out.size());
  for (int d = 0; d < ep_comm_->size(); ++d) {
    if (d != me) ep_comm_->Send(d, 0, std::move(out[static_cast<size_t>(d)]));
  }
  in[static_cast<size_t>(me)] = std::move(out[static_cast<size_t>(me)]);
  for (int s = 0; s < ep_comm_->size(); ++s) {
    if (s != me) in[static_cast<size_t>(s)] = ep_comm_->Recv(s, 0);
  }
  return in;
}

}  // namespace memplan::runtime::exec
