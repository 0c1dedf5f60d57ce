#include "memplan/planner/accounting.h"

#include <algorithm>
#include <functional>
#include <map>
#include <tuple>

#include "memplan/common/units.h"
#include "memplan/common/workspace.h"

namespace memplan::planner {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool IsExpert(const ParamSpec& p) { return p.kind == ParamKind::kExpert; }

}  // namespace

// Size of the group that partitions a parameter's gradient or optimizer
// state: the data-parallel x context-parallel group, or for routed experts
// Megatron's expert data-parallel group tp*dp*cp/(ep*etp) with etp = 1
// (experts are whole on each expert rank; docs/accounting.md, section 4).
int64_t DataParallelGroup(const Model& m, const ParamSpec& p) {
  int64_t dpcp = m.parallel.dp * m.parallel.cp;
  return IsExpert(p) ? m.parallel.tp * dpcp / m.parallel.ep : dpcp;
}

namespace {

// Muon's gather for one chunk. allgather: the whole gathered fp32 buffer of
// the chunk's Muon weights. p2p: only the matrices this DP rank owns
// (matrices assigned to owners in decreasing size, round robin; DP rank 0
// owns the most), double-buffered. Only the sizes matter: the matrices are
// counted per size (an expert layer has thousands of equal ones).
int64_t MuonGatherBytes(const Model& m, const std::vector<LayerGraph>& layers,
                        const std::vector<int64_t>& chunk) {
  int64_t all = 0;
  std::map<int64_t, int64_t, std::greater<>> sizes[2];  // elements -> matrices; 0: dense (dp*cp), 1: experts
  for (int64_t layer : chunk) {
    for (const auto& p : layers[static_cast<size_t>(layer)].params) {
      if (!UsesMuon(m, p)) continue;
      int64_t local = LocalParamElements(m, p);
      if (DataParallelGroup(m, p) <= 1) continue;  // not partitioned: no gather
      all += local;
      int64_t matrices = std::max<int64_t>(1, p.Matrices() / (IsExpert(p) ? m.parallel.ep : 1));
      sizes[IsExpert(p) ? 1 : 0][local / matrices] += matrices;
    }
  }
  if (!m.parallel.muon_gather_p2p) return CheckedMul(all, 4, "muon gather buffer");
  int64_t owned = 0;
  for (int g = 0; g < 2; ++g) {
    const int64_t owners =
        g == 0 ? m.parallel.dp * m.parallel.cp : m.parallel.tp * m.parallel.dp * m.parallel.cp / m.parallel.ep;
    // DP rank 0 owns positions 0, owners, 2 owners, ... of the sizes in
    // decreasing order: of a run of `count` equal sizes starting at `pos`,
    // those with pos <= k owners < pos + count.
    int64_t pos = 0;
    for (const auto& [elements, count] : sizes[g]) {
      const int64_t first = (pos + owners - 1) / owners, end = (pos + count + owners - 1) / owners;
      owned += elements * (end - first);
      pos += count;
    }
  }
  return CheckedMul(2 * owned, 4, "muon gather buffer");
}

}  // namespace

std::pair<int64_t, int64_t> MuonMatrixShape(const ParamSpec& param) {
  const auto& s = param.shape;
  if (s.size() < 2) return {1, s.empty() ? 1 : s.back()};
  return {s[s.size() - 2], s.back()};
}

int64_t MuonNsScratchBytes(int64_t rows, int64_t cols) {
  const int64_t m = std::min(rows, cols);
  const int64_t rc = CheckedMul(rows, cols, "Muon matrix");
  const int64_t mm = CheckedMul(m, m, "Muon matrix");
  // fp32: 4 B x (2 rc + 2 m^2).
  return CheckedMul(CheckedAdd(rc, mm, "Muon scratch"), 8, "Muon scratch");
}

bool UsesMuon(const Model& model, const ParamSpec& param) {
  if (model.train.optimizer != Optimizer::kMuon) return false;
  if (param.kind == ParamKind::kEmbedding || param.kind == ParamKind::kHead) return false;
  // Norm-like parameters (gains, decays, KDA's convolution taps) keep AdamW.
  if (param.kind == ParamKind::kNorm) return false;
  return param.shape.size() >= 2;
}

int64_t LocalParamElements(const Model& model, const ParamSpec& param) {
  if (param.kind == ParamKind::kHead && model.arch.tied_embeddings && model.parallel.pp == 1) return 0;
  int64_t n = param.Elements();
  if (param.tp_split) n = CeilDiv(n, model.parallel.tp);
  if (IsExpert(param)) n = CeilDiv(n, model.parallel.ep);
  return n;
}

int64_t OptimizerBytesPerParam(const Model& model, const ParamSpec& param) {
  int64_t master = model.train.param_dtype == DType::kFP32 ? 0 : 4;
  // 16-bit main grads: the optimizer keeps an fp32 copy to step from
  // (Megatron's fp16 mode: 20 B/param, 4 + 16/d with ZeRO-1).
  int64_t grad_copy = model.train.grad_dtype == DType::kFP32 ? 0 : 4;
  int64_t states = UsesMuon(model, param) ? 4 : 8;  // Muon: momentum; Adam: m, v
  return master + grad_copy + states;
}

ModelTotals CountParameters(const Model& model, const std::vector<LayerGraph>& layers) {
  ModelTotals t;
  const Arch& a = model.arch;
  for (const auto& g : layers) {
    for (const auto& p : g.params) {
      if ((p.kind == ParamKind::kHead && a.tied_embeddings) || p.copy) continue;
      int64_t n = p.Elements();
      t.params = CheckedAdd(t.params, n, "parameter count");
      if (IsExpert(p) && a.moe) {
        n = n / a.moe->experts * a.moe->top_k;
      }
      t.params_active += n;
    }
  }
  return t;
}

StaticBreakdown AccountRank(const Model& model, const std::vector<LayerGraph>& layers,
                            const PipelineLayout& layout, int64_t rank) {
  const Parallel& par = model.parallel;
  const int64_t pbytes = DTypeBytes(model.train.param_dtype);
  const int64_t gbytes = DTypeBytes(model.train.grad_dtype);
  const bool partition_grads = par.zero >= 2 || par.pipeline_zero2;
  const bool partition_optimizer = par.zero >= 1 || par.pipeline_zero2;

  const bool shard_params = par.zero >= 3;

  StaticBreakdown s;
  int64_t grad_partition = 0;  // gradient bytes after partitioning
  int64_t weight_elements = 0;  // after ZeRO-3's sharding
  int64_t largest_chunk_params = 0;
  // ZeRO-3's units, in order (section 4c): each layer's embedding, its
  // block (everything else), its output head; elements unsharded.
  std::vector<int64_t> units;
  for (const auto& chunk : layout.chunks[static_cast<size_t>(rank)]) {
    int64_t chunk_params = 0;
    for (int64_t layer : chunk) {
      int64_t unit[3] = {0, 0, 0};
      for (const auto& p : layers[static_cast<size_t>(layer)].params) {
        int64_t n = LocalParamElements(model, p);
        chunk_params += n;
        int64_t group = DataParallelGroup(model, p);
        weight_elements += shard_params ? CeilDiv(n, group) : n;
        unit[p.kind == ParamKind::kEmbedding ? 0 : p.kind == ParamKind::kHead ? 2 : 1] += n;
        grad_partition += CheckedMul(partition_grads ? CeilDiv(n, group) : n, gbytes, "gradient bytes");
        // Partitions are element ranges (each DP rank steps whole
        // elements): ceil(n / group) elements' state per rank.
        s.optimizer += CheckedMul(partition_optimizer ? CeilDiv(n, group) : n, OptimizerBytesPerParam(model, p),
                                  "optimizer bytes");
      }
      for (int64_t u : unit) {
        if (u > 0) units.push_back(u);
      }
    }
    s.params += chunk_params;
    largest_chunk_params = std::max(largest_chunk_params, chunk_params);
  }
  s.weights = CheckedMul(weight_elements, pbytes, "weight bytes");
  if (shard_params && !units.empty()) {
    // Gathered parameters: with reshard after forward, the unit computing
    // and `fsdp_prefetch` units ahead, bounded by the largest ones whatever
    // the order; without, every unit of the rank (between a microbatch's
    // forward and its backward the pipeline holds them all). Unsharded
    // gradients of one unit before its reduce-scatter.
    std::sort(units.begin(), units.end(), std::greater<>());
    int64_t gathered = 0;
    const size_t live = par.fsdp_reshard_after_forward ? static_cast<size_t>(1 + par.fsdp_prefetch) : units.size();
    for (size_t i = 0; i < std::min(live, units.size()); ++i) gathered += units[i];
    s.buffer_detail["fsdp_params"] = CheckedMul(gathered, pbytes, "FSDP parameter buffers");
    s.buffer_detail["fsdp_grads"] = CheckedMul(units.front(), gbytes, "FSDP gradient buffer");
  }

  if (par.pipeline_zero2) {
    // Reduced gradients land in a GPU double buffer sized for the largest
    // model chunk, then accumulate into the partitions (host or device).
    s.buffer_detail["grad_double_buffer"] = CheckedMul(2 * largest_chunk_params, gbytes, "double buffer");
    if (par.grad_offload_host) {
      s.host += grad_partition;
    } else {
      s.grads = grad_partition;
    }
  } else if (par.zero >= 3) {
    s.grads = grad_partition;  // reduce-scattered unit by unit: no bucket (fsdp_grads)
  } else if (par.zero >= 2) {
    s.grads = grad_partition;
    // Megatron DDP's bucket: max(40M, 1M * dp) parameters, capped by the
    // rank. Without data parallelism there is nothing to reduce-scatter.
    if (par.dp * par.cp > 1) {
      int64_t bucket = std::min(s.params, std::max<int64_t>(40'000'000, 1'000'000 * par.dp * par.cp));
      s.buffer_detail["reduce_bucket"] = CheckedMul(bucket, gbytes, "reduce bucket");
    }
  } else {
    s.grads = grad_partition;
  }

  if (model.train.optimizer == Optimizer::kMuon && partition_optimizer) {
    int64_t gather = 0;
    for (const auto& chunk : layout.chunks[static_cast<size_t>(rank)]) {
      gather = std::max(gather, MuonGatherBytes(model, layers, chunk));
    }
    if (gather > 0) s.buffer_detail["muon_gather"] = gather;
  }
  if (model.train.optimizer == Optimizer::kMuon) {
    // Newton-Schulz runs one matrix at a time: scratch for the rank's largest.
    int64_t ns = 0;
    for (const auto& chunk : layout.chunks[static_cast<size_t>(rank)]) {
      for (int64_t layer : chunk) {
        for (const auto& p : layers[static_cast<size_t>(layer)].params) {
          if (!UsesMuon(model, p) || LocalParamElements(model, p) == 0) continue;
          auto [rows, cols] = MuonMatrixShape(p);
          ns = std::max(ns, MuonNsScratchBytes(rows, cols));
        }
      }
    }
    if (ns > 0) s.buffer_detail["muon_ns_scratch"] = ns;
  }
  if (par.tp > 1) s.buffer_detail["tp_comm"] = TpCommBytes(model);
  if (const int64_t cp = CpCommBytes(model); cp > 0) s.buffer_detail["cp_comm"] = cp;
  // What the kernels hold for the run (common/workspace.h): every device
  // byte the runtime uses is in the plan.
  s.buffer_detail["gemm_workspace"] = workspace::GemmBytes();
  s.buffer_detail["kernel_scratch"] = workspace::KernelScratchBytes();
  for (const auto& [name, bytes] : s.buffer_detail) s.buffers += bytes;
  s.total = s.weights + s.grads + s.optimizer + s.buffers;
  s.runtime_detail = RuntimeItems(model);
  for (const auto& [name, bytes] : s.runtime_detail) s.runtime += bytes;
  return s;
}

int64_t TpCommBytes(const Model& model) {
  const Parallel& par = model.parallel;
  if (par.tp <= 1) return 0;
  const int64_t tokens = CheckedMul(model.train.seq_len / par.cp, model.train.micro_batch, "tokens per microbatch");
  // Vocabulary-parallel cross-entropy's per-token statistics (max, sum,
  // target logit), fp32; with sequence parallelism the gathered input and
  // the partial output of one linear, fp32 [tokens, hidden] each.
  int64_t floats = 3 * tokens;
  if (par.sp) floats = CheckedAdd(floats, CheckedMul(2 * tokens, model.arch.hidden, "SP buffers"), "SP buffers");
  return CheckedMul(floats, 4, "tensor-parallel buffers");
}

int64_t CpCommBytes(const Model& model) {
  const Parallel& par = model.parallel;
  const Arch& a = model.arch;
  bool attention = false, kda = false;
  for (int64_t l = 0; l < a.layers; ++l) {
    attention = attention || !a.IsLinearAttentionLayer(l);
    kda = kda || a.IsLinearAttentionLayer(l);
  }
  if (par.cp <= 1) return 0;
  const int64_t b = model.train.micro_batch, s = model.train.seq_len, hq = a.heads / par.tp;
  int64_t kda_floats = 0;
  if (kda) {
    // KDA in the same form: q, k, v, g, o, dO and four input gradients
    // [b s, heads dk], beta and its gradient [b s, heads], the chunks'
    // states; the short convolution's input, output gradient and input
    // gradient fit in it.
    const int64_t dk = a.linear_attention->head_dim, tokens = CheckedMul(b, s, "context-parallel buffers");
    const int64_t chunks = CeilDiv(s, a.linear_attention->chunk);
    kda_floats = CheckedAdd(CheckedMul(tokens, 10 * hq * dk + 2 * hq, "context-parallel buffers"),
                            CheckedMul(b * hq * chunks, dk * dk, "context-parallel buffers"), "context-parallel buffers");
  }
  if (!attention) return CheckedMul(kda_floats, 4, "context-parallel buffers");
  int64_t hkv = a.kv_heads / par.tp, dqk = a.head_dim, dv = a.head_dim;
  if (a.mla) {
    hkv = hq;
    dqk = a.mla->qk_nope_head_dim + a.mla->qk_rope_head_dim;
    dv = a.mla->v_head_dim;
  }
  // The whole sequence's q, k, v and output, their gradients and the
  // log-sum-exp, fp32 (the backward's workspace is the op's, planned for
  // the whole sequence: templates.cc).
  const int64_t per = CheckedMul(b, s, "context-parallel buffers");
  int64_t floats = CheckedMul(per, hq * dqk + hkv * dqk + hkv * dv + hq * dv, "context-parallel buffers");
  floats = CheckedAdd(CheckedMul(floats, 2, "context-parallel buffers"), per * hq, "context-parallel buffers");
  return CheckedMul(std::max(floats, kda_floats), 4, "context-parallel buffers");
}

std::map<std::string, int64_t> RuntimeItems(const Model& model) {
  const Hardware::Runtime& h = model.hardware.runtime;
  const Parallel& par = model.parallel;
  // NCCL's buffers per connection: Simple (NCCL_BUFFSIZE), LL128 and LL at
  // their fixed defaults (4,915,200 and 524,288 bytes).
  constexpr int64_t kLl128 = 4'915'200, kLl = 524'288;
  // A collective communicator: every channel connects a ring (or tree)
  // neighbour on each side, each connection with its three protocol buffers.
  const int64_t collective = 2 * h.nccl_channels * (h.nccl_buffsize + kLl128 + kLl);
  // Point-to-point: per peer, send and receive over nccl_p2p_channels.
  auto p2p = [&](int64_t peers) { return peers * 2 * h.nccl_p2p_channels * h.nccl_buffsize; };
  std::map<std::string, int64_t> out;
  if (h.cuda_context > 0) out["cuda_context"] = h.cuda_context;
  auto add = [&](const char* name, bool needed, int64_t bytes) {
    if (needed && bytes > 0) out[name] = bytes;
  };
  const int64_t dpcp = par.dp * par.cp;
  add("nccl_dp", dpcp > 1, collective);
  add("nccl_expert_dp", model.arch.moe && par.tp * dpcp / par.ep > 1 && par.tp * dpcp / par.ep != dpcp, collective);
  add("nccl_tp", par.tp > 1, collective);
  add("nccl_cp", par.cp > 1, p2p(2));
  add("nccl_ep", model.arch.moe && par.ep > 1, p2p(par.ep - 1));
  add("nccl_pp", par.pp > 1, p2p(2));
  return out;
}

}  // namespace memplan::planner
