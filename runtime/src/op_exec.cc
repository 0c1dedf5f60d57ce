// Running one op of a layer: forward, backward, the re-materialization of
// recomputed values, and a layer's inputs (executor_impl.h).
#include "executor_impl.h"
#include "op_impls.h"

namespace memplan::runtime::exec {

// The executor's side of an op's OpContext (op_impls.h): values through
// `value` (the step's buffers, or a recompute chain's), gradients, gradient
// temporaries and workspaces through the activation manager's block
// buffers, parameters through OpSpec::params.
class ExecOpContext final : public OpContext {
 public:
  ExecOpContext(Executor& e, Rank& r, size_t bi, int32_t pos, int32_t mb, const std::function<Buffer(int32_t)>* value)
      : e_(e), r_(r), bi_(bi), pos_(pos), mb_(mb), value_(value),
        blk_(e.p_.timelines[static_cast<size_t>(r.index)].blocks[bi]),
        g_(e.G(blk_.layer)),
        lb_(e.LB(blk_.layer)),
        op_(g_.ops[g_.TopologicalOrder()[static_cast<size_t>(pos)]]) {}

  const OpSpec& op() const override { return op_; }
  const LayerGraph& graph() const override { return g_; }
  const planner::Model& model() const override { return e_.model_; }
  kernels::Ops& k() override { return *r_.ops; }
  int64_t layer() const override { return blk_.layer; }
  int32_t microbatch() const override { return e_.GlobalMicrobatch(mb_); }
  bool forward_pass() const override { return blk_.forward; }
  uint64_t seed() const override { return e_.options_.seed; }

  // A forward (value_ set: the pass, a rebuild or a recompute) writes its
  // outputs; a backward only reads values (each read logged, CheckReads).
  Buffer Value(int32_t t) override {
    const bool output = value_ != nullptr && std::find(op_.outputs.begin(), op_.outputs.end(),
                                                       g_.tensors[static_cast<size_t>(t)].name) != op_.outputs.end();
    if (value_ == nullptr) reads_.insert(t);
    return Stage(Raw(t), g_.tensors[static_cast<size_t>(t)].dtype, output);
  }
  Buffer ReadDeclaredBy(const planner::OpSpec& other, int32_t t) override {
    const std::vector<int32_t> declared = planner::BackwardReads(g_, other);
    if (std::find(declared.begin(), declared.end(), t) == declared.end()) {
      ThrowError(ErrorCode::kCheckFailed, Describe() + " reads " + g_.tensors[static_cast<size_t>(t)].name +
                                              " for op " + other.name + ", whose registry entry does not declare it");
    }
    return Stage(Raw(t), g_.tensors[static_cast<size_t>(t)].dtype, false);
  }

  // "op layer1.moe.dispatch (dispatch), layer 1 forward, microbatch 0".
  std::string Describe() const {
    return "op " + op_.name + " (" + op_.kind + "), layer " + std::to_string(blk_.layer) +
           (value_ != nullptr ? " forward" : " backward") + (value_ != nullptr && !blk_.forward ? " (rebuild)" : "") +
           ", microbatch " + std::to_string(mb_);
  }

  // The plan's buffers against what the op's kernels state they need
  // (op_sizes.cc): every output before a forward writes it, the workspace
  // before a backward. A mismatch is the planner's (or a kernel's) bug,
  // named before any kernel writes out of bounds.
  void CheckSizes() {
    const KernelNeeds needs = StateNeeds(*this);
    if (value_ != nullptr) {
      for (size_t i = 0; i < op_.outputs.size() && i < needs.outputs.size(); ++i) {
        const std::vector<int64_t>& allowed = needs.outputs[i];
        if (allowed.empty()) continue;
        const int32_t t = Index(op_.outputs[i]);
        const planner::TensorSpec& spec = g_.tensors[static_cast<size_t>(t)];
        const int64_t width = planner::DTypeBytes(spec.dtype);
        const int64_t planned = Raw(t).bytes;
        if (std::find(allowed.begin(), allowed.end(), planned / width) != allowed.end() && planned % width == 0) continue;
        ThrowError(ErrorCode::kCheckFailed,
                   Describe() + ": the plan gives its output " + spec.name + " " + std::to_string(planned) +
                       " bytes; its kernel writes " + std::to_string(allowed.front()) + " elements of " +
                       std::to_string(width) + " bytes (" + std::to_string(allowed.front() * width) + " bytes)");
      }
      return;
    }
    bool planned_workspace = false;
    for (const BlockBuffer& b : lb_.backward) planned_workspace |= b.role == BlockBuffer::Role::kWorkspace && b.op == pos_;
    if (needs.workspace < 0) {
      if (planned_workspace) {
        ThrowError(ErrorCode::kCheckFailed, Describe() + ": the plan gives it a workspace its kernels do not use");
      }
      return;
    }
    const int64_t planned = Workspace().bytes;  // names the op when the plan has none (ActivationManager::BlockBuffer)
    if (planned != needs.workspace) {
      ThrowError(ErrorCode::kCheckFailed, Describe() + ": the plan gives its workspace " + std::to_string(planned) +
                                              " bytes; its kernel uses " + std::to_string(needs.workspace));
    }
  }

  // After a backward: the tensors it read against the registry's
  // BackwardReads, both ways (what the planner keeps resident for it).
  void CheckReads() {
    const std::vector<int32_t> declared = planner::BackwardReads(g_, op_);
    for (int32_t t : declared) {
      if (!reads_.contains(t)) {
        ThrowError(ErrorCode::kCheckFailed, Describe() + ": the op registry declares that its backward reads " +
                                                g_.tensors[static_cast<size_t>(t)].name +
                                                ", which it never read (the plan keeps it resident for nothing)");
      }
    }
    for (int32_t t : reads_) {
      if (std::find(declared.begin(), declared.end(), t) == declared.end()) {
        ThrowError(ErrorCode::kCheckFailed, Describe() + ": its backward read " +
                                                g_.tensors[static_cast<size_t>(t)].name +
                                                ", which the op registry does not declare (the plan need not keep it)");
      }
    }
  }
  Buffer Grad(int32_t t) override { return Stage(e_.Grad(r_, bi_, t), g_.tensors[static_cast<size_t>(t)].dtype, true); }
  bool FirstWriter(size_t i) override { return FirstWriterOf(Index(op_.inputs[i])); }
  Buffer InputGrad(size_t i) override {
    const int32_t t = Index(op_.inputs[i]);
    if (FirstWriterOf(t) || planner::GradAccumulates(op_.op)) return Grad(t);
    // Written back at Flush as a GPU kernel writes it (the sum below reads
    // the working copy), so that the witness sees the temporary used.
    return Stage(e_.BlockBuf(r_, bi_, BlockBuffer::Role::kGradTemp, t, pos_), g_.tensors[static_cast<size_t>(t)].dtype,
                 true);
  }
  void FinishInputGrad(size_t i) override {
    const int32_t t = Index(op_.inputs[i]);
    if (FirstWriterOf(t)) return;
    Buffer temp = Stage(e_.BlockBuf(r_, bi_, BlockBuffer::Role::kGradTemp, t, pos_),
                        g_.tensors[static_cast<size_t>(t)].dtype, false);
    r_.ops->Accumulate(Grad(t).as<float>(), temp.as<float>(), Elements(InSpec(i).shape));
  }
  Buffer Workspace() override { return e_.BlockBuf(r_, bi_, BlockBuffer::Role::kWorkspace, -1, pos_); }
  const ParamState& Param(size_t role) override {
    const ParamState& ps = e_.ParamOf(r_, op_, role);
    if (ps.master.empty()) return ps;  // stored in fp32
    auto [it, fresh] = params_.try_emplace(role, ps);
    if (fresh) it->second.weight = Stage(ps.weight, planner::DType::kBF16, false);
    return it->second;
  }

  // bf16 storage (host backend, docs/runtime.md "bf16"): the op computes on
  // fp32 working copies of its bf16 operands, widened exactly when first
  // asked for and rounded back to nearest even when the op is done (Flush):
  // the CPU's analogue of a GPU kernel loading bf16 into fp32 registers. The
  // copies are the kernel's own working memory, not device memory.
  void Flush() {
    for (auto& [ptr, s] : staged_) {
      if (s.write_back) r_.ops->RoundToBf16(s.f32.data(), static_cast<int64_t>(s.f32.size()), s.stored.as<uint16_t>());
    }
    staged_.clear();
  }
  exec::Routing& Routing() override { return r_.routing[{blk_.layer, mb_}]; }
  int ep_size() const override { return static_cast<int>(e_.model_.parallel.ep); }
  int ep_rank() const override { return static_cast<int>(e_.EpRank()); }
  std::vector<std::vector<std::byte>> ExchangeExperts(std::vector<std::vector<std::byte>> out) override {
    return e_.ExchangeExperts(std::move(out));
  }
  void NoteDropped(int64_t rows) override { r_.dropped_rows += rows; }
  std::vector<float>& RouterBias() override { return e_.RouterBias(r_, blk_.layer); }
  void NoteSelected(const std::vector<int32_t>& experts_of_tokens) override {
    std::vector<float>& load = r_.expert_load[{blk_.layer, mb_}];
    load.assign(static_cast<size_t>(e_.model_.arch.moe->experts), 0.f);  // a recompute's selection replaces
    for (int32_t e : experts_of_tokens) load[static_cast<size_t>(e)] += 1.f;
  }
  void NoteRouting(double expert_load, double rank_load) override {
    r_.routing_seen = true;
    r_.max_expert_load = std::max(r_.max_expert_load, expert_load);
    r_.max_rank_load = std::max(r_.max_rank_load, rank_load);
  }
  int tp_size() const override { return static_cast<int>(e_.model_.parallel.tp); }
  int tp_rank() const override { return static_cast<int>(e_.tp_rank_); }
  std::vector<float> TpGather(const Buffer& mine, int64_t n) override { return e_.TpGather(r_, mine.as<float>(), n); }
  void TpAllReduce(const Buffer& data, int64_t n) override { e_.TpAllReduce(r_, data.as<float>(), n); }
  void TpAllGather(const Buffer& mine, int64_t n, const Buffer& whole) override {
    MEMPLAN_CHECK(n * e_.model_.parallel.tp * 4 <= whole.bytes, "a tensor-parallel gather outgrew its buffer");
    e_.TpAllGather(r_, mine.as<float>(), n, whole.as<float>());
  }
  void TpReduceScatter(const Buffer& whole, int64_t n, const Buffer& mine) override {
    MEMPLAN_CHECK(n * 4 <= mine.bytes, "a tensor-parallel reduce-scatter outgrew its output");
    e_.TpReduceScatter(r_, whole.as<float>(), n, mine.as<float>());  // sums in place on cuda: `whole` is scratch
  }
  Buffer TpBuffer(int slot) override {
    const Buffer& all = r_.static_buffers.at("tp_comm");
    const auto& train = e_.model_.train;
    const int64_t tokens = train.seq_len / e_.model_.parallel.cp * train.micro_batch;
    const int64_t stats = 3 * tokens * 4, slot_bytes = tokens * e_.model_.arch.hidden * 4;
    const int64_t at = slot == 2 ? 0 : stats + slot * slot_bytes;
    const int64_t bytes = slot == 2 ? stats : slot_bytes;
    MEMPLAN_CHECK(at + bytes <= all.bytes, "the plan's tp_comm buffer has no such slot");
    return Buffer{all.ptr + at, all.offset + at, bytes};
  }
  int cp_size() const override { return static_cast<int>(e_.model_.parallel.cp); }
  int cp_rank() const override { return static_cast<int>(e_.cp_rank_); }
  std::vector<float> CpGather(const Buffer& mine, int64_t n) override { return e_.CpGather(r_, mine.as<float>(), n); }
  void CpAllReduce(const Buffer& data, int64_t n) override { e_.CpAllReduce(r_, data.as<float>(), n); }
  Buffer CpBuffer() override { return r_.static_buffers.at("cp_comm"); }
  void ToHost(void* dst, const void* src, int64_t bytes) override { e_.backend_->ToHost(*r_.dev, dst, src, bytes); }
  void FromHost(void* dst, const void* src, int64_t bytes) override {
    e_.backend_->FromHost(*r_.dev, dst, src, bytes);
  }
  void AddLosses(const Buffer& losses, int64_t tokens) override {
    std::vector<float> host(static_cast<size_t>(tokens));
    e_.backend_->ToHost(*r_.dev, host.data(), losses.ptr, tokens * 4);
    // Every tensor-parallel rank computes the same losses: counted once.
    if (e_.tp_rank_ != 0) return;
    for (float l : host) e_.loss_sum_ += l;
  }

 private:
  // An input gradient is written directly by the first backward that
  // reaches it (its last forward reader, not handed to the next layer).
  // A shared tensor's gradient sums every reader's (zeroed when allocated).
  bool FirstWriterOf(int32_t t) const {
    return lb_.last_use[static_cast<size_t>(t)] == pos_ && lb_.export_to[static_cast<size_t>(t)] < 0 &&
           !e_.IsShared(lb_, t);
  }

  Buffer Raw(int32_t t) { return value_ ? (*value_)(t) : e_.Value(r_, bi_, t); }

  Buffer Stage(Buffer stored, planner::DType dtype, bool write_back) {
    if (dtype != planner::DType::kBF16 || stored.empty()) return stored;
    auto [it, fresh] = staged_.try_emplace(stored.ptr);
    Staged& s = it->second;
    if (fresh) {
      s.stored = stored;
      s.f32.resize(static_cast<size_t>(stored.bytes / 2));
      r_.ops->WidenBf16(stored.as<uint16_t>(), static_cast<int64_t>(s.f32.size()), s.f32.data());
    }
    s.write_back |= write_back;
    return Buffer{reinterpret_cast<std::byte*>(s.f32.data()), -1, static_cast<int64_t>(s.f32.size()) * 4};
  }

  struct Staged {
    Buffer stored;
    std::vector<float> f32;
    bool write_back = false;
  };
  std::unordered_map<std::byte*, Staged> staged_;
  std::set<int32_t> reads_;  // backward: the values it read
  std::map<size_t, ParamState> params_;  // bf16 weights' working copies, by role
  Executor& e_;
  Rank& r_;
  size_t bi_;
  int32_t pos_, mb_;
  const std::function<Buffer(int32_t)>* value_;
  const Block& blk_;
  const LayerGraph& g_;
  const LayerBuffers& lb_;
  const OpSpec& op_;
};

void Executor::Forward(Rank& r, size_t bi, int32_t pos, const std::function<Buffer(int32_t)>& value, int32_t mb) {
  ExecOpContext c(*this, r, bi, pos, mb, &value);
  const OpImpl& impl = GetOpImpl(c.op().op);
  MEMPLAN_CHECK(impl.forward != nullptr, ("op kind " + c.op().kind + " is not executable").c_str());
  if (Zero3()) PrepareParams(r, c.op(), false);
  c.CheckSizes();
  impl.forward(c);
  c.Flush();
  if (acts_->eager()) acts_->AfterOp(r.index, c.Describe());
}

void Executor::Backward(Rank& r, size_t bi, int32_t pos) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  ExecOpContext c(*this, r, bi, pos, blk.microbatch, nullptr);
  const OpImpl& impl = GetOpImpl(c.op().op);
  MEMPLAN_CHECK(impl.backward != nullptr, ("op kind " + c.op().kind + " is not executable").c_str());
  if (Zero3()) PrepareParams(r, c.op(), true);
  c.CheckSizes();
  impl.backward(c);
  c.Flush();
  c.CheckReads();
  if (acts_->eager()) acts_->AfterOp(r.index, c.Describe());
}

// Re-materializes a recomputed instance at its layer's backward: the
// producer chain runs again from saved tensors, its intermediates in the
// instance's extra buffer (planner: recompute_extra_bytes).
void Executor::Recompute(Rank& r, size_t bi, int32_t inst_index) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const LayerBuffers& lb = LB(blk.layer);
  const Instance& in = p_.instances[static_cast<size_t>(r.index)][static_cast<size_t>(inst_index)];
  const SavedTensor& st = p_.tensors[static_cast<size_t>(r.index)][static_cast<size_t>(in.tensor)];
  Buffer scratch = acts_->Scratch(r.index, inst_index);
  Buffer restored = acts_->Backward(r.index, inst_index);
  int64_t extra_used = 0;
  std::unordered_map<int32_t, Buffer> local;  // chain intermediates
  std::function<void(int32_t, Buffer)> make = [&](int32_t t, Buffer dst) {
    int32_t pos = lb.prod[static_cast<size_t>(t)];
    const OpSpec& op = g.ops[g.TopologicalOrder()[static_cast<size_t>(pos)]];
    std::vector<Buffer> ins;
    auto carve = [&](int32_t u) {
      Buffer b{scratch.ptr + extra_used, -1, g.tensors[static_cast<size_t>(u)].bytes};
      extra_used += b.bytes;
      MEMPLAN_CHECK(extra_used <= scratch.bytes, "recompute chain outgrew its buffer");
      return b;
    };
    for (const auto& name : op.inputs) {
      int32_t u = static_cast<int32_t>(g.FindTensor(name) - g.tensors.data());
      if (g.tensors[static_cast<size_t>(u)].saved || lb.share_layer[static_cast<size_t>(u)] >= 0) continue;
      Buffer b = carve(u);
      make(u, b);
      local[u] = b;
    }
    // The op's other outputs that are not saved land in the scratch too.
    for (const auto& name : op.outputs) {
      int32_t u = static_cast<int32_t>(g.FindTensor(name) - g.tensors.data());
      if (u != t && !g.tensors[static_cast<size_t>(u)].saved) local[u] = carve(u);
    }
    auto value = [&](int32_t u) -> Buffer {
      if (u == t) return dst;
      auto it = local.find(u);
      if (it != local.end()) return it->second;
      if (lb.share_layer[static_cast<size_t>(u)] >= 0) return SharedValue(r, bi, u);
      return BwdFull(r, blk.layer, u, blk.microbatch);
    };
    Forward(r, bi, pos, value, blk.microbatch);
  };
  make(st.graph_index, restored);
  ++r.events["recomputes"];
}

// At the first step of a layer's backward: prefetches are waited for, FP8
// payloads dequantized, recomputed instances re-made (in producer order).
void Executor::RestoreLayer(Rank& r, size_t bi) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  std::vector<std::pair<int64_t, int32_t>> recompute;
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    if (!g.tensors[t].saved) continue;
    int32_t i = InstIndex(blk.layer, static_cast<int32_t>(t), blk.microbatch);
    acts_->Restore(r.index, i);
    const Instance& in = p_.instances[static_cast<size_t>(r.index)][static_cast<size_t>(i)];
    if (assign_.storage[static_cast<size_t>(r.index)][static_cast<size_t>(in.tensor)] == Storage::kRecompute) {
      recompute.emplace_back(p_.tensors[static_cast<size_t>(r.index)][static_cast<size_t>(in.tensor)].prod_pos, i);
    }
  }
  std::sort(recompute.begin(), recompute.end());
  for (auto [pos, i] : recompute) Recompute(r, bi, i);
}

// A model input (tokens, targets) or a value received from the previous
// pipeline stage, written into `dst` at its block's first step.
void Executor::LoadInput(Rank& r, size_t bi, int32_t t, Buffer dst, const std::vector<std::byte>* inbox) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const TensorSpec& spec = G(blk.layer).tensors[static_cast<size_t>(t)];
  if (spec.producer.empty()) {
    const auto& src = spec.name.ends_with(".targets") ? targets_ : tokens_;
    const std::vector<int32_t>& ids = src[static_cast<size_t>(blk.microbatch)];
    if (model_.parallel.tp == 1 && model_.parallel.cp == 1) {
      backend_->FromHost(*r.dev, dst.ptr, ids.data(), spec.bytes);
      return;
    }
    // Context parallelism: this rank's two chunks of each sequence
    // (kernels::CpPosition).
    const int64_t seq = model_.train.seq_len, s = seq / model_.parallel.cp;
    std::vector<int32_t> local(static_cast<size_t>(spec.bytes / 4));
    for (size_t i = 0; i < local.size(); ++i) {
      const int64_t b = static_cast<int64_t>(i) / s, pos = static_cast<int64_t>(i) % s;
      local[i] = ids[static_cast<size_t>(b * seq + kernels::CpPosition(pos, s, model_.parallel.cp, cp_rank_))];
    }
    // Tensor parallelism: this rank's rows of the vocabulary (the
    // embedding's, the head's columns) are [tp rank * V / tp, + V / tp); an
    // id outside them is -1 for the lookup and the loss (op_impls.cc).
    const int64_t part = model_.arch.vocab / model_.parallel.tp, lo = tp_rank_ * part;
    for (int32_t& id : local) id = id >= lo && id < lo + part ? static_cast<int32_t>(id - lo) : -1;
    backend_->FromHost(*r.dev, dst.ptr, local.data(), spec.bytes);
    return;
  }
  MEMPLAN_CHECK(inbox != nullptr && static_cast<int64_t>(inbox->size()) == spec.bytes,
                "received activation has the wrong size");
  backend_->FromHost(*r.dev, dst.ptr, inbox->data(), spec.bytes);
}


}  // namespace memplan::runtime::exec
