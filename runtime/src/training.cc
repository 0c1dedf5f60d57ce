// The executor's training state: ranks and their memory, parameters and
// their initial values, the batch, tied embeddings, the optimizer step
// (executor_impl.h).
#include "executor_impl.h"

namespace memplan::runtime::exec {

Expected<std::monostate> Executor::MakeRanks() {
  FindTpPartials();
  const int32_t pp = static_cast<int32_t>(p_.tensors.size());
  for (int32_t r = 0; r < pp; ++r) {
    if (!Local(r)) continue;  // another process's
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    const auto& rb = eval_.ranks[static_cast<size_t>(r)];
    int64_t act = rb.peak - p_.statics[static_cast<size_t>(r)].total;
    std::string name = "pp" + std::to_string(r);
    // Arenas (host, and cuda by default) hold exactly the plan's bytes: an
    // allocation the plan did not predict fails the run instead of hiding
    // in slack. A CUDA pool reserves in granules beyond its used bytes,
    // hence its headroom.
    const bool exact = options_.backend == BackendKind::kHost || !options_.cuda_pool;
    const int64_t statics = p_.statics[static_cast<size_t>(r)].total;
    auto dev = options_.eager ? backend_->MakeEagerDevice(name, 4 * std::max<int64_t>(act, 1) + 64 * kMiB)
                              : backend_->MakeDevice(name, exact ? std::max<int64_t>(act, 1) : 2 * act + 64 * kMiB,
                                                     kActivationAlignment);
    if (!dev.ok()) return dev.error();
    rank->dev = std::move(*dev);
    // Eager: red zones and canaries on every activation buffer (the
    // witness, docs/runtime.md "What each measurement sees").
    if (options_.eager) rank->dev->EnableWitness();
    // Each static buffer is padded to the alignment: the plan's buffers and
    // up to six per parameter (weight, gradient, m, v, master, partition).
    int64_t static_buffers = static_cast<int64_t>(p_.statics[static_cast<size_t>(r)].buffer_detail.size()) + 1;
    for (int64_t l : p_.layout.LayersOfRank(r)) static_buffers += 6 * static_cast<int64_t>(G(l).params.size());
    const int64_t padded = statics + kStaticAlignment * static_buffers;
    auto stat = backend_->MakeDevice(name + ".static", exact ? padded : padded + 64 * kMiB, kStaticAlignment);
    if (!stat.ok()) return stat.error();
    rank->stat = std::move(*stat);
    // Host memory for host offloads: at most every payload at once.
    int64_t host_bytes = kMiB;
    for (const Interval& iv : eval_.intervals) {
      if (iv.owner_rank == r && iv.rank == r && iv.part == IntervalPart::kMovedOut) host_bytes += iv.bytes + 256;
    }
    auto host = backend_->MakeHostArena(name + ".host", host_bytes);
    if (!host.ok()) return host.error();
    rank->host = std::move(*host);
    if (PipelineZero2() && model_.parallel.grad_offload_host) {
      // The gradient partitions in host memory: the plan's ranks[].host,
      // and the arena's alignment per partition.
      int64_t parts = 0;
      for (int64_t l : p_.layout.LayersOfRank(r)) parts += static_cast<int64_t>(G(l).params.size());
      auto grads = backend_->MakeHostArena(name + ".grads", p_.statics[static_cast<size_t>(r)].host + 256 * parts + 256);
      if (!grads.ok()) return grads.error();
      rank->grad_host = std::move(*grads);
    }
    // The plan's static buffers first (static.buffer_detail: the kernels'
    // "gemm_workspace" and "kernel_scratch", Muon's "muon_ns_scratch", ...),
    // then the parameters (InitParams).
    for (const auto& [what, bytes] : p_.statics[static_cast<size_t>(r)].buffer_detail) {
      auto b = rank->stat->Allocate(bytes);
      if (!b.ok()) return b.error();
      rank->static_buffers[what] = *b;
      rank->static_bytes += bytes;
    }
    rank->ops_memory.gemm_workspace = rank->static_buffers.at("gemm_workspace");
    rank->ops_memory.scratch = rank->static_buffers.at("kernel_scratch");
    rank->ops = backend_->MakeOps(*rank->dev, rank->ops_memory);
    rank->produced_at.resize(static_cast<size_t>(p_.timelines[static_cast<size_t>(r)].steps));
    for (size_t i = 0; i < p_.instances[static_cast<size_t>(r)].size(); ++i) {
      rank->produced_at[static_cast<size_t>(p_.instances[static_cast<size_t>(r)][i].prod)].push_back(
          static_cast<int32_t>(i));
    }
    ranks_.push_back(std::move(rank));
  }
  MakeManager();
  for (auto& r : ranks_) {
    steps_total_ += p_.timelines[static_cast<size_t>(r->index)].steps;
    InitParams(*r);
    if (r->static_bytes != p_.statics[static_cast<size_t>(r->index)].total) {
      return Error{ErrorCode::kRuntime, "pp rank " + std::to_string(r->index) + ": static memory is " +
                                            std::to_string(r->static_bytes) + " bytes, the plan's " +
                                            std::to_string(p_.statics[static_cast<size_t>(r->index)].total)};
    }
  }
  return std::monostate{};
}

void Executor::InitParams(Rank& r) {
  std::vector<int64_t> layers = p_.layout.LayersOfRank(r.index);
  // bf16 parameters (accounting.md §5): the weight in bf16, an fp32 master
  // the optimizer updates, fp32 gradients and optimizer state.
  const bool bf16 = model_.train.param_dtype == planner::DType::kBF16;
  std::vector<std::vector<float>> initial;  // bf16: each parameter's initial values, for its weight
  auto alloc = [&](int64_t bytes) {
    auto b = r.stat->Allocate(bytes);
    if (!b.ok()) ThrowError(b.error().code, b.error().message);
    r.static_bytes += bytes;
    return *b;
  };
  for (int64_t l : layers) {
    for (const auto& spec : G(l).params) {
      int64_t n = planner::LocalParamElements(model_, spec);
      if (n == 0) continue;
      ParamState ps;
      ps.spec = &spec;
      ps.elements = n;
      ps.shape = spec.shape;
      ps.tied_head = spec.kind == planner::ParamKind::kHead && model_.arch.tied_embeddings;
      ps.expert = spec.kind == planner::ParamKind::kExpert;
      if (ps.tied_head) ps.shape = {spec.shape[1], spec.shape[0]};
      int64_t bytes = n * 4;
      // ZeRO-1: the optimizer's state, and a bf16 parameter's fp32 master,
      // for this replica's shard alone.
      const int64_t state = Zero1() ? Shard(ps) * 4 : bytes;
      ps.unit = 3 * l + (spec.kind == planner::ParamKind::kEmbedding ? 0 : spec.kind == planner::ParamKind::kHead ? 2 : 1);
      if (!bf16 && Zero3()) {
        ps.shard = alloc(Shard(ps) * 4);
      } else if (!bf16) {
        ps.weight = alloc(bytes);
      }
      if (!GradPartitions()) {
        ps.grad = alloc(n * planner::DTypeBytes(model_.train.grad_dtype));
      } else if (r.grad_host) {
        auto h = r.grad_host->Allocate(Shard(ps) * 4);
        if (!h.ok()) ThrowError(h.error().code, h.error().message);
        ps.part = *h;
      } else {
        ps.part = alloc(Shard(ps) * 4);
      }
      int64_t opt = planner::OptimizerBytesPerParam(model_, spec);
      ps.muon = planner::UsesMuon(model_, spec);
      MEMPLAN_CHECK(opt == (bf16 ? 4 : 0) + (ps.muon ? 4 : 8),
                    "AdamW keeps m and v, Muon a momentum, and 16-bit parameters an fp32 master");
      if (bf16) ps.master = alloc(state);
      ps.m = alloc(state);
      if (!ps.muon) ps.v = alloc(state);
      // Initial values (docs/runtime.md): norms gamma 1, beta 0; every
      // matrix U(-a, a) with a = 1/sqrt(fan_in), fan_in its input width
      // (the embedding and a tied head: hidden).
      // Tensor parallelism: the full tensor's values, then this rank's slice.
      const int64_t n_local = n;
      if (TpSplit(ps)) n *= model_.parallel.tp;
      std::vector<float> w(static_cast<size_t>(n), 0.f);
      const std::string& name = spec.name;
      const bool is_bias = name.ends_with(".bias");
      const uint64_t id = Fnv1a(name);
      if (name.ends_with("dt_bias")) {
        // KDA's decay bias as Mamba's: softplus^-1(dt), dt log-uniform in
        // [1e-3, 0.1] (docs/runtime.md).
        for (int64_t i = 0; i < n; ++i) {
          const double u = kernels::Uniform01(options_.seed, id, static_cast<uint64_t>(i));
          const double dt = std::exp(std::log(1e-3) + u * (std::log(0.1) - std::log(1e-3)));
          w[static_cast<size_t>(i)] = static_cast<float>(dt + std::log(-std::expm1(-dt)));
        }
      } else if (name.ends_with("_conv.weight")) {
        // A depthwise convolution's taps, U(-a, a) with a = 1/sqrt(taps) (its fan-in).
        const float a = 1.f / std::sqrt(static_cast<float>(spec.shape[0]));
        for (int64_t i = 0; i < n; ++i) {
          w[static_cast<size_t>(i)] = (2.f * kernels::Uniform01(options_.seed, id, static_cast<uint64_t>(i)) - 1.f) * a;
        }
      } else if (spec.kind == planner::ParamKind::kNorm) {
        // Block AttnRes's pseudo-queries start at zero: uniform weights over
        // the blocks (the paper's initialisation).
        std::fill(w.begin(), w.end(), is_bias || name.ends_with(".query") ? 0.f : 1.f);
      } else {
        int64_t fan_in = spec.shape.size() >= 3 ? spec.shape[1] : spec.shape[0];
        if (spec.kind == planner::ParamKind::kEmbedding || ps.tied_head) fan_in = model_.arch.hidden;
        float a = 1.f / std::sqrt(static_cast<float>(fan_in));
        // A tied head starts as the embedding it shares.
        const uint64_t head_id = ps.tied_head ? Fnv1a(G(0).params.front().name) : id;
        // Counter-based: any split over threads gives the same values, and
        // an EP rank's experts the values they have in the whole tensor.
        const uint64_t base = static_cast<uint64_t>(ps.expert ? EpRank() * n : 0);
        auto fill = [&](int64_t lo, int64_t hi) {
          for (int64_t i = lo; i < hi; ++i) {
            w[static_cast<size_t>(i)] =
                (2.f * kernels::Uniform01(options_.seed, head_id, base + static_cast<uint64_t>(i)) - 1.f) * a;
          }
        };
        int64_t threads = n < (int64_t{1} << 20) ? 1 : std::max<int64_t>(1, std::thread::hardware_concurrency());
        std::vector<std::thread> pool;
        for (int64_t t = 1; t < threads; ++t) pool.emplace_back(fill, n * t / threads, n * (t + 1) / threads);
        fill(0, n / threads);
        for (auto& th : pool) th.join();
      }
      if (options_.init_hook) options_.init_hook(ps.tied_head ? G(0).params.front().name : name, &w);
      if (TpSplit(ps)) w = TpSlice(ps, w);
      n = n_local;
      std::vector<float> zero(static_cast<size_t>(n), 0.f);
      if (!bf16 && Zero3()) {
        backend_->FromHost(*r.stat, ps.shard.ptr, zero.data(), Shard(ps) * 4);
        backend_->FromHost(*r.stat, ps.shard.ptr, w.data() + RangeStart(ps), Owned(ps) * 4);
      } else if (!bf16) {
        backend_->FromHost(*r.stat, ps.weight.ptr, w.data(), bytes);
      } else {
        // The master holds this replica's shard (ZeRO-1) or all of it.
        const int64_t from = Zero1() ? RangeStart(ps) : 0, count = Zero1() ? Owned(ps) : n;
        backend_->FromHost(*r.stat, ps.master.ptr, zero.data(), state);
        backend_->FromHost(*r.stat, ps.master.ptr, w.data() + from, count * 4);
      }
      if (GradPartitions()) {
        backend_->FromHost(*r.stat, ps.part.ptr, zero.data(), Shard(ps) * 4);
      } else {
        backend_->FromHost(*r.stat, ps.grad.ptr, zero.data(), bytes);
      }
      backend_->FromHost(*r.stat, ps.m.ptr, zero.data(), state);
      if (!ps.muon) backend_->FromHost(*r.stat, ps.v.ptr, zero.data(), state);
      r.param_index[name] = r.params.size();
      r.params.push_back(std::move(ps));
      if (bf16) initial.push_back(std::move(w));
    }
  }
  if (!bf16) return;
  // The bf16 weights last, in one block (2-byte weights one after the other
  // would leave gaps at the arena's 4-byte alignment): each the rounding to
  // nearest even of its master.
  // ZeRO-3: each replica's range only.
  int64_t total = 0;
  for (const auto& ps : r.params) total += (Zero3() ? Shard(ps) : ps.elements) * 2;
  Buffer block = alloc(total);
  int64_t at = 0;
  for (size_t i = 0; i < r.params.size(); ++i) {
    ParamState& ps = r.params[i];
    const int64_t from = Zero3() ? RangeStart(ps) : 0, count = Zero3() ? Shard(ps) : ps.elements;
    Buffer& into = Zero3() ? ps.shard : ps.weight;
    into = Buffer{block.ptr + at, block.offset + at, count * 2};
    std::vector<uint16_t> w16(static_cast<size_t>(count), 0);
    for (int64_t k = 0; k < count && from + k < ps.elements; ++k) {
      w16[static_cast<size_t>(k)] = kernels::FloatToBf16(initial[i][static_cast<size_t>(from + k)]);
    }
    backend_->FromHost(*r.stat, into.ptr, w16.data(), into.bytes);
    at += into.bytes;
  }
}


void Executor::SyncTied() {
  // A tied head on another rank holds a copy of the embedding: the two
  // gradients are summed into both (Megatron's embedding all-reduce).
  if (!model_.arch.tied_embeddings) return;
  const int32_t emb_rank = static_cast<int32_t>(p_.layout.rank_of_layer.front());
  const int32_t head_rank = static_cast<int32_t>(p_.layout.rank_of_layer.back());
  if (emb_rank == head_rank) return;  // the head reads the embedding itself
  ParamState* emb = nullptr;
  ParamState* head = nullptr;
  Rank* er = nullptr;
  Rank* hr = nullptr;
  for (auto& r : ranks_) {
    for (auto& ps : r->params) {
      if (ps.spec->kind == planner::ParamKind::kEmbedding && !emb) std::tie(emb, er) = std::pair{&ps, r.get()};
      if (ps.tied_head) std::tie(head, hr) = std::pair{&ps, r.get()};
    }
  }
  // The gradient, or under pipeline ZeRO-2 this replica's reduced range
  // (the embedding and the head have the same shape: the same range).
  auto count = [&](const ParamState& ps) { return GradPartitions() ? Owned(ps) : ps.elements; };
  auto at = [&](const ParamState& ps) { return OwnGrad(ps, GradPartitions() ? RangeStart(ps) : 0); };
  auto grad_of = [&](Rank& r, ParamState& ps) {
    std::vector<std::byte> g(static_cast<size_t>(count(ps) * 4));
    backend_->ToHost(*r.stat, g.data(), at(ps), count(ps) * 4);
    return g;
  };
  // The embedding's gradient and the head's; across processes each side
  // sends its own and receives the other (a + b == b + a: both sides get
  // the same bits).
  if (!emb && !head) return;  // a rank in between
  std::vector<std::byte> a, b;
  if (emb) a = grad_of(*er, *emb);
  if (head) b = grad_of(*hr, *head);
  if (emb && !head) {
    Post(emb_rank, head_rank, Msg::kTiedGrad, 0, a);
    b = Take(head_rank, emb_rank, Msg::kTiedGrad, 0);
  } else if (head && !emb) {
    Post(head_rank, emb_rank, Msg::kTiedGrad, 0, b);
    a = Take(emb_rank, head_rank, Msg::kTiedGrad, 0);
  }
  MEMPLAN_CHECK(a.size() == b.size(), "the tied embedding's two gradients differ in size");
  const size_t n = a.size() / 4;
  std::vector<float> sum(n), fa(n), fb(n);
  std::memcpy(fa.data(), a.data(), a.size());
  std::memcpy(fb.data(), b.data(), b.size());
  for (size_t i = 0; i < n; ++i) sum[i] = fa[i] + fb[i];
  if (emb) backend_->FromHost(*er->stat, at(*emb), sum.data(), count(*emb) * 4);
  if (head) backend_->FromHost(*hr->stat, at(*head), sum.data(), count(*head) * 4);
}

double Executor::SquaredNorm(Rank& r, const float* x, int64_t n) {
  // The result lands in the kernel scratch's last granule (common/workspace.h),
  // in the plan like the rest of it.
  const Buffer& scratch = r.ops_memory.scratch;
  std::byte* result = scratch.ptr + (scratch.bytes - workspace::kScratchResultBytes);
  r.ops->SquaredNorm(x, n, reinterpret_cast<double*>(result));
  double v = 0;
  backend_->ToHost(*r.dev, &v, result, 8);  // in order with the ops' stream
  return v;
}

void Executor::Optimize(double* grad_norm) {
  // Per rank, then over ranks in rank order: the same sum whether the
  // ranks share a process or not. Data-parallel replicas add their shard
  // (ZeRO-1), or the first replica of the parameter's group the whole
  // reduced gradient (routed experts: one per EP rank).
  std::vector<double> partial;
  for (auto& r : ranks_) {
    double sum = 0;
    for (auto& ps : r->params) {
      if (ps.tied_head) continue;  // counted once, with the embedding
      // Every tensor-parallel rank holds it whole (routed experts: their group's first, below).
      if (tp_rank_ != 0 && !TpSplit(ps) && !ps.expert) continue;
      if (Zero1()) {
        sum += SquaredNorm(*r, OwnGrad(ps, RangeStart(ps)), Owned(ps));
      } else if (GroupOf(ps).rank == 0) {
        sum += SquaredNorm(*r, OwnGrad(ps, 0), ps.elements);
      }
    }
    partial.push_back(sum);
  }
  if (options_.comm) partial = GatherDoubles(partial.front());
  double sum = 0;
  for (double v : partial) sum += v;
  *grad_norm = std::sqrt(sum);
  kernels::AdamConfig cfg;
  for (auto& r : ranks_) {
    for (auto& ps : r->params) {
      if (ps.muon && Zero1()) continue;  // below, every matrix together
      if (ps.muon) {
        MuonStep(*r, ps, cfg);
      } else if (Zero1()) {
        // This replica's shard: of the fp32 weight in place, or of the
        // bf16 parameter's shard-sized master.
        const int64_t from = RangeStart(ps);
        float* master = !ps.master.empty() ? ps.master.as<float>()
                        : Zero3()          ? ps.shard.as<float>()
                                           : ps.weight.as<float>() + from;
        r->ops->AdamStep(master, OwnGrad(ps, from), ps.m.as<float>(), ps.v.as<float>(), Owned(ps), cfg, step_ + 1);
        if (!ps.master.empty()) {
          r->ops->RoundToBf16(master, Owned(ps), Zero3() ? ps.shard.as<uint16_t>() : ps.weight.as<uint16_t>() + from);
        }
        continue;
      } else {
        r->ops->AdamStep(ps.Master(), OwnGrad(ps, 0), ps.m.as<float>(), ps.v.as<float>(), ps.elements, cfg, step_ + 1);
      }
      if (!ps.master.empty()) r->ops->RoundToBf16(ps.master.as<float>(), ps.elements, ps.weight.as<uint16_t>());
    }
    if (Zero1() && model_.train.optimizer == planner::Optimizer::kMuon) {
      MuonStepsSharded(*r, cfg);
      for (auto& ps : r->params) {
        if (!ps.muon || ps.master.empty()) continue;
        r->ops->RoundToBf16(ps.master.as<float>(), Owned(ps),
                            Zero3() ? ps.shard.as<uint16_t>() : ps.weight.as<uint16_t>() + RangeStart(ps));
      }
    }
    backend_->Finish(*r->dev);
  }
  GatherWeights();
}

std::vector<ParamState*> Executor::ChunkParams(Rank& r, int32_t chunk) {
  std::vector<ParamState*> out;
  for (int64_t layer : p_.layout.chunks[static_cast<size_t>(r.index)][static_cast<size_t>(chunk)]) {
    for (const auto& spec : G(layer).params) {
      auto it = r.param_index.find(spec.name);
      if (it != r.param_index.end()) out.push_back(&r.params[it->second]);
    }
  }
  return out;
}

void Executor::BindGrads(Rank& r, const std::vector<ParamState*>& params, const Buffer& buffer, int64_t start,
                         int64_t end, const char* too_small) {
  int64_t at = start;
  for (ParamState* ps : params) {
    const int64_t bytes = ps->elements * 4;
    MEMPLAN_CHECK(at + bytes <= end, too_small);
    ps->grad = Buffer{buffer.ptr + at, buffer.offset + at, bytes};
    r.ops->Zero(ps->grad.ptr, bytes);
    at += bytes;
  }
}

void Executor::BeginGradPass(Rank& r, int32_t chunk) {
  const Buffer& buffer = r.static_buffers.at("grad_double_buffer");
  const int64_t half = buffer.bytes / 2;
  const int64_t start = half * (r.grad_passes++ % 2);
  BindGrads(r, ChunkParams(r, chunk), buffer, start, start + half, "a chunk's gradients exceed the plan's double buffer");
}

void Executor::EndGradPass(Rank& r, int32_t chunk) {
  FlushGrads(r, ChunkParams(r, chunk));
  ++r.events["grad_passes_reduced"];
}

void Executor::BindToBucket(Rank& r, int64_t layer) {
  const Buffer& bucket = r.static_buffers.at("reduce_bucket");
  std::vector<ParamState*> params;
  int64_t bytes = 0;
  for (const auto& spec : G(layer).params) {
    auto it = r.param_index.find(spec.name);
    if (it == r.param_index.end() || !r.params[it->second].grad.empty()) continue;  // bound at an earlier step
    params.push_back(&r.params[it->second]);
    bytes += params.back()->elements * 4;
  }
  if (params.empty()) return;
  MEMPLAN_CHECK(bytes <= bucket.bytes, "a layer's gradients exceed the plan's reduce bucket");
  int64_t at = bucket_.empty() ? 0 : bucket_.back()->grad.ptr + bucket_.back()->grad.bytes - bucket.ptr;
  if (at + bytes > bucket.bytes) {
    FlushGrads(r, std::exchange(bucket_, {}));
    at = 0;
  }
  BindGrads(r, params, bucket, at, bucket.bytes, "a layer's gradients exceed the plan's reduce bucket");
  bucket_.insert(bucket_.end(), params.begin(), params.end());
}

void Executor::FlushGrads(Rank& r, const std::vector<ParamState*>& params) {
  backend_->Finish(*r.dev);
  for (ParamState* ps : params) {
    ReduceTpPartial(r, *ps);
    // Reduced across the replicas, then added into this replica's partition.
    const int64_t owned = Owned(*ps);
    std::vector<float> mine = ReduceScatterRange(r, *ps, ps->grad.ptr), part(static_cast<size_t>(owned));
    backend_->ToHost(*r.stat, part.data(), ps->part.ptr, owned * 4);
    for (int64_t i = 0; i < owned; ++i) part[static_cast<size_t>(i)] += mine[static_cast<size_t>(i)];
    backend_->FromHost(*r.stat, ps->part.ptr, part.data(), owned * 4);
    ps->grad = Buffer{};
  }
  if (Zero2Bucket() && !params.empty()) ++r.events["bucket_flushes"];
}

std::vector<float> Executor::ReduceScatterRange(Rank& r, const ParamState& ps, const std::byte* grad) {
  const DpGroup& group = GroupOf(ps);
  const int64_t k = Shard(ps);
  std::vector<float> g(static_cast<size_t>(k * group.size), 0.f);
  backend_->ToHost(*r.stat, g.data(), grad, ps.elements * 4);
  if (group.size == 1) return g;
  std::vector<float> mine(static_cast<size_t>(k));
  group.comm->ReduceScatterSum(g.data(), mine.data(), k);
  return mine;
}

std::vector<std::byte> Executor::GatherRanges(Rank& r, const ParamState& ps, const void* mine, int64_t width) {
  const DpGroup& group = GroupOf(ps);
  const int64_t k = Shard(ps);
  std::vector<std::byte> ours(static_cast<size_t>(k * width)), all(static_cast<size_t>(k * width * group.size));
  backend_->ToHost(*r.stat, ours.data(), mine, Owned(ps) * width);
  if (group.size == 1) return ours;
  group.comm->AllGatherBlocks(ours.data(), all.data(), k * width);
  return all;
}

void Executor::ReduceGradients() {
  if (GradPartitions()) return;  // (pipeline) ZeRO-2, ZeRO-3: reduced pass by pass (FlushGrads)
  Rank& r = *ranks_.front();
  for (auto& ps : r.params) ReduceTpPartial(r, ps);
  // Routed experts under tensor parallelism are reduced over tp * dp / ep
  // replicas even with dp 1.
  if (Replicas() == 1 && expert_group_.size == 1) return;
  for (auto& ps : r.params) {
    const int64_t n = ps.elements;
    if (DeviceCommunicator* nccl = GroupOf(ps).device) {
      // On the device, in place: the whole sum, or (ZeRO-1) each replica's range.
      if (Zero1()) {
        nccl->ReduceRanges(ps.grad.as<float>(), n, OpsStream(r));
      } else {
        nccl->AllReduceSum(ps.grad.as<float>(), n, OpsStream(r));
      }
      continue;
    }
    if (Zero1()) {
      std::vector<float> mine = ReduceScatterRange(r, ps, ps.grad.ptr);
      backend_->FromHost(*r.stat, ps.grad.as<float>() + RangeStart(ps), mine.data(), Owned(ps) * 4);
      continue;
    }
    if (GroupOf(ps).size == 1) continue;  // routed experts with ep == dp: no replica holds them twice
    // Staged through the host, as the pipeline's messages are.
    std::vector<float> g(static_cast<size_t>(n));
    backend_->ToHost(*r.stat, g.data(), ps.grad.ptr, n * 4);
    GroupOf(ps).comm->AllReduceSum(g.data(), n);
    backend_->FromHost(*r.stat, ps.grad.ptr, g.data(), n * 4);
  }
  SynchronizeNccl(r);
  ++r.events["dp_reductions"];
}

void Executor::GatherWeights() {
  if (!Zero1() || Zero3()) return;  // ZeRO-3 gathers each unit before its ops
  Rank& r = *ranks_.front();
  for (auto& ps : r.params) {
    const int64_t n = ps.elements;
    const int64_t width = ps.master.empty() ? 4 : 2;  // the weight's bytes per element
    if (DeviceCommunicator* nccl = GroupOf(ps).device) {
      nccl->GatherRanges(ps.weight.ptr, n, width, OpsStream(r));
      continue;
    }
    std::vector<std::byte> all = GatherRanges(r, ps, ps.weight.ptr + RangeStart(ps) * width, width);
    backend_->FromHost(*r.stat, ps.weight.ptr, all.data(), n * width);
  }
  SynchronizeNccl(r);
  ++r.events["dp_weight_gathers"];
}

void Executor::MakeBatch() {
  // Tokens U{0..vocab-1} per (microbatch, position); targets are the next
  // token of each sequence (the last position wraps to the first).
  // Each step its own microbatches (GlobalMicrobatch counts the steps).
  tokens_.clear();
  targets_.clear();
  const int64_t mbs = model_.train.microbatches, b = model_.train.micro_batch, sl = model_.train.seq_len;
  const int64_t n = b * sl;
  for (int64_t m = 0; m < mbs; ++m) {
    std::vector<int32_t> tok(static_cast<size_t>(n)), tgt(tok.size());
    const uint64_t g = static_cast<uint64_t>(GlobalMicrobatch(static_cast<int32_t>(m)));
    for (int64_t i = 0; i < n; ++i) {
      float u = kernels::Uniform01(options_.seed, Fnv1a("tokens") + g, static_cast<uint64_t>(i));
      tok[static_cast<size_t>(i)] = std::min<int32_t>(static_cast<int32_t>(model_.arch.vocab - 1),
                                                      static_cast<int32_t>(u * static_cast<float>(model_.arch.vocab)));
    }
    for (int64_t bb = 0; bb < b; ++bb) {
      for (int64_t i = 0; i < sl; ++i) {
        tgt[static_cast<size_t>(bb * sl + i)] = tok[static_cast<size_t>(bb * sl + (i + 1) % sl)];
      }
    }
    tokens_.push_back(std::move(tok));
    targets_.push_back(std::move(tgt));
  }
}


}  // namespace memplan::runtime::exec
