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

}  // namespace memplan::runtime::exec
