// The per-layer analysis the liveness builds its timelines from
// (liveness.cc) and the block buffers it derives from it (layer_buffers.cc).
// Private to planner/.
#pragma once

#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "memplan/planner/graph.h"
#include "memplan/planner/liveness.h"

namespace memplan::planner {

// A floating-point dtype: FP8-able, and has a gradient.
inline bool IsFloat(DType d) { return d == DType::kBF16 || d == DType::kFP16 || d == DType::kFP32; }

struct LayerInfo {
  std::vector<double> fwd_s, bwd_s;             // per op, topological order (with communication)
  std::vector<double> fwd_comm_s, bwd_comm_s;   // per op: the part of fwd_s / bwd_s spent waiting on groups
  std::vector<int32_t> saved;                   // graph indices of saved tensors
  std::vector<int64_t> prod_pos;                // per saved tensor
  std::vector<int32_t> prod;                    // per tensor: producer's topo position, -1 when not local
  std::vector<int32_t> last_use;                // per tensor: last local consumer's topo position, -1 when none
  std::vector<int32_t> export_to;               // per tensor: the next layer's tensor it becomes, or -1
  std::vector<int32_t> import_from;             // per tensor: the previous layer's tensor it is, or -1
  std::vector<int32_t> share_layer, share_index;  // per tensor: the earlier layer's saved tensor it is, or -1
  std::vector<uint8_t> shared_out;                // per tensor: later layers read it in place
  std::unordered_map<std::string_view, int32_t> op_pos;      // op name -> topo position
  std::unordered_map<std::string_view, int32_t> tensor_idx;  // tensor name -> index
  double fwd_total = 0, bwd_total = 0;
};

// The block buffers of layer `l` (liveness.h, BlockBuffer), for both passes,
// in allocation order.
LayerBuffers MakeLayerBuffers(const LayerGraph& g, const std::vector<LayerInfo>& info, size_t l);

}  // namespace memplan::planner
