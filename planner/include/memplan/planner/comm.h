// Communication time of tensor, context, expert and data parallelism
// (docs/planner.md, "Communication").
//
// The planner's op times are rooflines of one device's share of the work;
// this adds what the device waits for its groups: the tensor-parallel
// all-reduces (or, with sequence parallelism, all-gathers and
// reduce-scatters) around column- and row-parallel linears, the expert
// all-to-alls of dispatch and combine, the context-parallel ring of K and V
// (overlapped with attention), and the data-parallel gradient reduction at
// the end of the step. Ring collectives over the group's link: intra-node
// (peer_bw) when the group's span of ranks fits in one node of
// gpus_per_node GPUs, else the per-GPU inter-node link (pp_link_bw). Rank
// order inside a node: tp, then cp, then ep / dp (Megatron's order).
#pragma once

#include <cstdint>
#include <vector>

#include "memplan/planner/graph.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

// The link a parallel group's collectives run over: NCCL's bus bandwidth
// (bytes/s: the link's, times Hardware::Efficiency's nvlink or network),
// the latency of one ring step, and whether it leaves the node.
struct Link {
  double bw = 0;
  double latency_s = 0;
  bool inter_node = false;
};
struct GroupLinks {
  Link tp, cp, ep, dp;
};
GroupLinks LinksOf(const Parallel& par, const Hardware& hw);

// Seconds one device waits for its groups around one op, forward and
// backward. `overlapped`: the time runs beside the op's compute (the op
// takes the longer of the two) rather than after it.
struct OpComm {
  double fwd_s = 0, bwd_s = 0;
  bool overlapped = false;
};
OpComm OpCommunication(const LayerGraph& g, const OpSpec& op, const Parallel& par, const GroupLinks& links);

// Ring collectives: seconds per device for `bytes` (the whole buffer, as
// every member holds it after an all-reduce or all-gather) over n members:
// 2(n - 1) steps for an all-reduce, n - 1 for the others.
double AllReduceSeconds(double bytes, int64_t n, const Link& link);
double AllGatherSeconds(double bytes, int64_t n, const Link& link);  // = reduce-scatter
// All-to-all of `bytes` sent by one device, (n - 1) / n of it leaving.
double AllToAllSeconds(double bytes, int64_t n, const Link& link);

// The data-parallel reduction of one pipeline rank's gradients at the end
// of the step: per parameter its group (dp x cp, routed experts dp x cp /
// ep), reduce-scatter of the gradients (`reduce_s`) and all-gather of the
// updated weights (`gather_s`) with ZeRO-1 or pipeline ZeRO-2, an
// all-reduce without; ZeRO-3's per-microbatch gathers and reduce-scatters.
// Collectives go by buckets (Megatron's ddp_bucket_size). Seconds before
// overlap.
struct DataParallelTime {
  double reduce_s = 0, gather_s = 0;
  double ring_bytes = 0;  // what one device sends (and receives) over its rings
  double total_s() const { return reduce_s + gather_s; }
};
DataParallelTime DataParallelSeconds(const Model& model, const std::vector<LayerGraph>& layers,
                                     const std::vector<int64_t>& rank_layers, const GroupLinks& links);

// The residual stream entering `layer` (its attn_norm.x, templates.cc): what
// crosses a pipeline stage boundary; null in a hand-written graph without it.
const TensorSpec* ResidualStream(const std::vector<LayerGraph>& layers, int64_t layer);

// The pipeline's send (or receive) of one microbatch's activation (or its
// gradient) between neighbouring stages, which are tp x cp x dp ranks
// apart: inside a node while that stride is under gpus_per_node.
double PipelineSendSeconds(const Model& model, double bytes);

// The optimizer step of one pipeline rank holding `rank_layers`: the
// parameters it updates (its shard under ZeRO) times
// Efficiency::optimizer_bytes_per_param, memory-bound.
double OptimizerStepSeconds(const Model& model, const std::vector<LayerGraph>& layers,
                            const std::vector<int64_t>& rank_layers);

// Bytes one GPU of a pipeline rank holding `rank_layers` (in `chunks`
// model chunks) moves per step over the inter-node network, both
// directions: expert all-to-alls and the data-parallel reduction where
// their group leaves the node, and the pipeline's activations and
// gradients where the neighbouring stage is on another node. Inter-node
// traffic crosses the GPU's PCIe link to its NIC, which host copies share.
double InterNodeBytes(const Model& model, const std::vector<LayerGraph>& layers, const std::vector<int64_t>& rank_layers,
                      int64_t chunks, const GroupLinks& links);

}  // namespace memplan::planner
