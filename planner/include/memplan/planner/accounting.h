// Static memory accounting per pipeline rank (stage 3): parameters, weights,
// gradients, optimizer state, communication/optimizer buffers and host
// bytes, following the accounting rules of docs/accounting.md (each rule
// there with its source).
//
// All byte counts are per device. `grads` holds main gradients only; reduce
// buckets, double buffers and gather buffers are `buffers`, at their maximum.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "memplan/planner/graph.h"
#include "memplan/planner/layout.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

struct ModelTotals {
  int64_t params = 0;         // every parameter once (tied embeddings once)
  int64_t params_active = 0;  // touched per token: routed experts count top_k of E
};

struct StaticBreakdown {
  int64_t params = 0;  // parameters held by this device
  int64_t weights = 0;
  int64_t grads = 0;
  int64_t optimizer = 0;
  int64_t buffers = 0;
  int64_t total = 0;  // weights + grads + optimizer + buffers
  int64_t host = 0;   // host bytes this device's training state needs
  std::map<std::string, int64_t> buffer_detail;  // reduce_bucket, grad_double_buffer, muon_gather
  // Device bytes outside the training framework (not in `total`, which is
  // what the runtime allocates and CUPTI measures): RuntimeItems.
  int64_t runtime = 0;
  std::map<std::string, int64_t> runtime_detail;
};

// Memory outside the framework on every GPU process of the layout
// (docs/accounting.md, "Memory outside the framework"): the CUDA context
// and one NCCL communicator per process group the layout needs. The same
// on every pipeline rank (a middle rank's two pipeline neighbours).
std::map<std::string, int64_t> RuntimeItems(const Model& model);

// Tensor parallelism's communication buffer (static `tp_comm`, tp > 1;
// docs/accounting.md): vocabulary-parallel cross-entropy's per-token
// statistics, and with sequence parallelism one linear's gathered input
// and partial output ([tokens, hidden] fp32 each), as Megatron's global
// memory buffer holds them.
int64_t TpCommBytes(const Model& model);

// Context parallelism's attention buffer (static `cp_comm`, cp > 1 with
// softmax attention layers; docs/accounting.md): the runtime attends with
// every rank's keys and values all-gathered, its queries placed in the
// whole sequence (docs/runtime.md, "Context parallelism"): the whole
// sequence's q, k, v, output and their gradients and the log-sum-exp,
// fp32; for KDA layers the same of
// KDA's inputs, output, states and gradients (the larger of the two).
int64_t CpCommBytes(const Model& model);

// Parameters a device holds for `param`: TP shards tp_split weights, EP
// divides routed experts. Returns 0 for a tied output head when pp == 1
// (the embedding's storage is shared).
int64_t LocalParamElements(const Model& model, const ParamSpec& param);

// The group that reduces and partitions a parameter's gradient and
// optimizer state: data x context parallel, for routed experts dp x cp / ep.
int64_t DataParallelGroup(const Model& model, const ParamSpec& param);

// Bytes of optimizer state per parameter (before ZeRO-1 partitioning):
// Adam: fp32 master (unless params are fp32) + m + v; Muon: master +
// momentum for 2-D weights other than embedding and head, Adam for the rest.
int64_t OptimizerBytesPerParam(const Model& model, const ParamSpec& param);
bool UsesMuon(const Model& model, const ParamSpec& param);
// One Muon matrix of `param` (experts: one expert's [rows, cols]; else the
// last two dimensions), unsharded: Newton-Schulz runs on the whole matrix.
std::pair<int64_t, int64_t> MuonMatrixShape(const ParamSpec& param);
// Newton-Schulz scratch for a [rows, cols] matrix, fp32: the iterate X and
// the product T (rows x cols each) and A = X X^T and B (m x m each, m =
// min(rows, cols)) (docs/accounting.md §6b).
int64_t MuonNsScratchBytes(int64_t rows, int64_t cols);

ModelTotals CountParameters(const Model& model, const std::vector<LayerGraph>& layers);

StaticBreakdown AccountRank(const Model& model, const std::vector<LayerGraph>& layers,
                            const PipelineLayout& layout, int64_t rank);

}  // namespace memplan::planner
