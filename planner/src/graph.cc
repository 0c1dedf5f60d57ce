#include "memplan/planner/graph.h"

#include <algorithm>
#include <boost/graph/adjacency_list.hpp>
#include <boost/graph/topological_sort.hpp>
#include <iterator>
#include <numeric>
#include <set>

#include "memplan/common/units.h"

namespace memplan::planner {

// The largest parameter (elements) or tensor (bytes) an explicit graph may
// declare (docs/design.md, "Input limits and hostile input").
constexpr int64_t kMaxGraphBytes = int64_t{1} << 48;

namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  int64_t bytes;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kBF16, "bf16", 2}, {DType::kFP16, "fp16", 2}, {DType::kFP32, "fp32", 4},
    {DType::kFP8, "fp8", 1},   {DType::kU8, "u8", 1},     {DType::kI32, "i32", 4},
    {DType::kI64, "i64", 8},
};

struct ParamKindInfo {
  ParamKind kind;
  std::string_view name;
};
constexpr ParamKindInfo kParamKinds[] = {
    {ParamKind::kLinear, "linear"},   {ParamKind::kNorm, "norm"},
    {ParamKind::kEmbedding, "embedding"}, {ParamKind::kHead, "head"},
    {ParamKind::kRouter, "router"},   {ParamKind::kExpert, "expert"},
    {ParamKind::kSharedExpert, "shared_expert"},
};

std::vector<int64_t> ReadShape(const Json& value, const JsonLocation& where) {
  ExpectArray(value, where);
  if (value.empty() || value.size() > 8) ThrowAt(where, "expected a shape of 1 to 8 dimensions");
  std::vector<int64_t> shape;
  for (size_t i = 0; i < value.size(); ++i) {
    shape.push_back(ExpectInt(value[i], where.Child(i), 1, int64_t{1} << 40));
  }
  return shape;
}

}  // namespace

int64_t DTypeBytes(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.bytes;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

bool ParseDType(std::string_view name, DType* out) {
  for (const auto& d : kDTypes) {
    if (d.name == name) {
      *out = d.dtype;
      return true;
    }
  }
  return false;
}

std::string_view ParamKindName(ParamKind kind) {
  for (const auto& k : kParamKinds) {
    if (k.kind == kind) return k.name;
  }
  return "?";
}

bool ParseParamKind(std::string_view name, ParamKind* out) {
  for (const auto& k : kParamKinds) {
    if (k.name == name) {
      *out = k.kind;
      return true;
    }
  }
  return false;
}

int64_t TensorLayer(std::string_view name) {
  if (!name.starts_with("layer")) return -1;
  int64_t layer = 0;
  size_t i = 5;
  for (; i < name.size() && i < 15 && name[i] >= '0' && name[i] <= '9'; ++i) layer = layer * 10 + (name[i] - '0');
  return i > 5 && i < name.size() && name[i] == '.' ? layer : -1;
}

int64_t ParamSpec::Elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n = CheckedMul(n, d, "parameter " + name);
  return n;
}

int64_t ParamSpec::Matrices() const {
  if (shape.size() < 2) return 0;
  if (kind == ParamKind::kExpert && shape.size() == 3) return shape[0];
  return 1;
}

namespace {

// The parameter of `g` playing `role` for `op` (op_registry.h, ParamNaming);
// empty when the layer has none.
std::string BindParam(const LayerGraph& g, const OpSpec& op, ParamNaming naming, std::string_view role) {
  const size_t dot = op.name.rfind('.');
  if (dot == std::string::npos) return {};
  std::string prefix = op.name.substr(0, dot);
  std::vector<std::string> candidates;
  if (naming == ParamNaming::kAttnRes) {
    if (!prefix.ends_with(".attn_res")) prefix += ".attn_res";
    candidates.push_back(prefix + "." + std::string(role));
  } else {
    std::string dotted = op.name.substr(dot + 1);
    if (auto u = dotted.find('_'); u != std::string::npos) dotted[u] = '.';
    candidates = {op.name + "." + std::string(role), prefix + "." + std::string(role),
                  prefix + "." + dotted + "." + std::string(role)};
  }
  for (const auto& c : candidates) {
    for (const auto& p : g.params) {
      if (p.name == c) return c;
    }
  }
  return {};
}

}  // namespace

void LayerGraph::Finalize(const JsonLocation& where) {
  for (auto& op : ops) {
    op.op = OpKindFromName(op.kind);
    if (!op.params.empty()) continue;
    const OpDef& def = GetOpDef(op.op);
    for (std::string_view role : def.params) {
      std::string name = BindParam(*this, op, def.naming, role);
      if (name.empty()) break;  // later roles are not bound past a missing one
      op.params.push_back(std::move(name));
    }
  }
  std::unordered_map<std::string_view, size_t> tensor_index;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto& t = tensors[i];
    if (!tensor_index.emplace(t.name, i).second) {
      ThrowAt(where.Child("tensors").Child(i), "duplicate tensor name \"" + t.name + "\"");
    }
    int64_t expect = DTypeBytes(t.dtype);
    for (int64_t d : t.shape) {
      if (__builtin_mul_overflow(expect, d, &expect) || expect > kMaxGraphBytes) {
        ThrowAt(where.Child("tensors").Child(i).Child("shape"),
                "tensor \"" + t.name + "\" exceeds " + std::to_string(kMaxGraphBytes) + " bytes (2^48)");
      }
    }
    if (t.bytes != expect) {
      ThrowAt(where.Child("tensors").Child(i).Child("bytes"),
              "expected " + std::to_string(expect) + " (shape x " + std::string(DTypeName(t.dtype)) +
                  "), got " + std::to_string(t.bytes));
    }
    t.consumers.clear();
  }
  std::set<std::string_view> op_names;
  std::vector<int> producer_op(tensors.size(), -1);
  for (size_t o = 0; o < ops.size(); ++o) {
    const auto& op = ops[o];
    if (!op_names.insert(op.name).second) {
      ThrowAt(where.Child("ops").Child(o), "duplicate op name \"" + op.name + "\"");
    }
    for (size_t k = 0; k < op.inputs.size(); ++k) {
      auto it = tensor_index.find(op.inputs[k]);
      if (it == tensor_index.end()) {
        ThrowAt(where.Child("ops").Child(o).Child("inputs").Child(k),
                "unknown tensor \"" + op.inputs[k] + "\"");
      }
      auto& consumers = tensors[it->second].consumers;
      if (std::find(consumers.begin(), consumers.end(), op.name) == consumers.end()) {
        consumers.push_back(op.name);
      }
    }
    for (size_t k = 0; k < op.outputs.size(); ++k) {
      auto it = tensor_index.find(op.outputs[k]);
      if (it == tensor_index.end()) {
        ThrowAt(where.Child("ops").Child(o).Child("outputs").Child(k),
                "unknown tensor \"" + op.outputs[k] + "\"");
      }
      if (producer_op[it->second] >= 0) {
        ThrowAt(where.Child("ops").Child(o).Child("outputs").Child(k),
                "tensor \"" + op.outputs[k] + "\" already produced by \"" +
                    ops[static_cast<size_t>(producer_op[it->second])].name + "\"");
      }
      producer_op[it->second] = static_cast<int>(o);
      tensors[it->second].producer = op.name;
    }
  }

  // Dataflow graph: vertex per op, an edge producer -> consumer per tensor.
  using Graph = boost::adjacency_list<boost::vecS, boost::vecS, boost::directedS>;
  Graph g(ops.size());
  std::unordered_map<std::string_view, size_t> op_index;
  for (size_t o = 0; o < ops.size(); ++o) op_index.emplace(ops[o].name, o);
  for (size_t o = 0; o < ops.size(); ++o) {
    for (const auto& in : ops[o].inputs) {
      int p = producer_op[tensor_index.at(in)];
      if (p >= 0) boost::add_edge(static_cast<size_t>(p), o, g);
    }
  }
  std::vector<size_t> reverse_order;
  try {
    boost::topological_sort(g, std::back_inserter(reverse_order));
  } catch (const boost::not_a_dag&) {
    ThrowAt(where.Child("ops"), "the ops form a cycle; expected an acyclic dataflow");
  }
  topo_order_.assign(reverse_order.rbegin(), reverse_order.rend());
}

int64_t LayerGraph::SavedBytes() const {
  int64_t total = 0;
  for (const auto& t : tensors) {
    if (t.saved) total = CheckedAdd(total, t.bytes, "saved bytes");
  }
  return total;
}

int64_t LayerGraph::SavedBytes(std::string_view module) const {
  int64_t total = 0;
  for (const auto& t : tensors) {
    if (t.saved && t.module == module) total += t.bytes;
  }
  return total;
}

const TensorSpec* LayerGraph::FindTensor(std::string_view name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

OrderedJson LayerGraph::ToJson() const {
  OrderedJson j;
  j["index"] = index;
  j["kind"] = kind;
  OrderedJson ps = OrderedJson::array();
  for (const auto& p : params) {
    ps.push_back({{"name", p.name},
                  {"shape", p.shape},
                  {"kind", ParamKindName(p.kind)},
                  {"tp_split", p.tp_split}});
    if (p.copy) ps.back()["copy"] = true;
  }
  j["params"] = std::move(ps);
  OrderedJson ts = OrderedJson::array();
  for (const auto& t : tensors) {
    OrderedJson tj{{"name", t.name},     {"module", t.module},
                   {"shape", t.shape},   {"dtype", DTypeName(t.dtype)},
                   {"bytes", t.bytes},   {"saved", t.saved},
                   {"sharding", t.sharding}};
    tj["producer"] = t.producer.empty() ? OrderedJson(nullptr) : OrderedJson(t.producer);
    tj["consumers"] = t.consumers;
    ts.push_back(std::move(tj));
  }
  j["tensors"] = std::move(ts);
  OrderedJson os = OrderedJson::array();
  for (const auto& op : ops) {
    OrderedJson oj{{"name", op.name},       {"kind", op.kind},
                   {"module", op.module},   {"inputs", op.inputs},
                   {"outputs", op.outputs}, {"flops", op.flops},
                   {"bytes_read", op.bytes_read}, {"bytes_written", op.bytes_written}};
    if (op.workspace_bytes) oj["workspace_bytes"] = op.workspace_bytes;
    if (!op.params.empty()) oj["params"] = op.params;
    os.push_back(std::move(oj));
  }
  j["ops"] = std::move(os);
  return j;
}

LayerGraph LayerGraph::FromJson(const Json& value, const JsonLocation& where) {
  ObjectReader r(value, where);
  LayerGraph g;
  g.index = r.Int("index", 0, int64_t{1} << 40);
  g.kind = r.String("kind");
  const Json& params = ExpectArray(r.Required("params"), r.At("params"));
  for (size_t i = 0; i < params.size(); ++i) {
    ObjectReader p(params[i], r.At("params").Child(i));
    ParamSpec spec;
    spec.name = p.String("name");
    spec.shape = ReadShape(p.Required("shape"), p.At("shape"));
    int64_t elements = 1;
    for (int64_t d : spec.shape) {
      // Accounting multiplies elements by up to 16 bytes (weights, fp32
      // gradients, optimizer state) and sums over layers: 2^48 keeps every
      // such total inside 64 bits.
      if (__builtin_mul_overflow(elements, d, &elements) || elements > kMaxGraphBytes) {
        ThrowAt(p.At("shape"), "parameter \"" + spec.name + "\" exceeds " + std::to_string(kMaxGraphBytes) +
                                   " elements (2^48)");
      }
    }
    std::string kind = p.Enum("kind", {"linear", "norm", "embedding", "head", "router", "expert",
                                       "shared_expert"});
    ParseParamKind(kind, &spec.kind);
    spec.tp_split = p.Bool("tp_split", false);
    spec.copy = p.Bool("copy", false);
    p.Finish();
    g.params.push_back(std::move(spec));
  }
  const Json& tensors = ExpectArray(r.Required("tensors"), r.At("tensors"));
  for (size_t i = 0; i < tensors.size(); ++i) {
    ObjectReader t(tensors[i], r.At("tensors").Child(i));
    TensorSpec spec;
    spec.name = t.String("name");
    spec.module = t.Has("module") ? t.String("module") : std::string();
    spec.shape = ReadShape(t.Required("shape"), t.At("shape"));
    std::string dtype = t.Enum("dtype", {"bf16", "fp16", "fp32", "fp8", "u8", "i32", "i64"});
    ParseDType(dtype, &spec.dtype);
    spec.bytes = t.Int("bytes", 0, INT64_MAX);
    spec.saved = [&] {
      auto b = t.OptBool("saved");
      if (!b) ThrowAt(t.where(), "missing required key \"saved\"");
      return *b;
    }();
    if (const Json* p = t.GetNullable("producer")) spec.producer = ExpectString(*p, t.At("producer"));
    if (const Json* c = t.Get("consumers")) ExpectStrings(*c, t.At("consumers"));  // derived again
    spec.sharding = t.Enum("sharding", {"replicated", "tp", "sp", "tp_seq", "ep"}, "replicated");
    t.Finish();
    g.tensors.push_back(std::move(spec));
  }
  const Json& ops = ExpectArray(r.Required("ops"), r.At("ops"));
  for (size_t i = 0; i < ops.size(); ++i) {
    ObjectReader o(ops[i], r.At("ops").Child(i));
    OpSpec op;
    op.name = o.String("name");
    op.kind = o.String("kind");
    op.module = o.String("module");
    op.inputs = ExpectStrings(o.Required("inputs"), o.At("inputs"));
    op.outputs = ExpectStrings(o.Required("outputs"), o.At("outputs"));
    op.flops = o.Number("flops", 0, 1e30, 0);
    op.bytes_read = o.Int("bytes_read", 0, INT64_MAX, 0);
    op.bytes_written = o.Int("bytes_written", 0, INT64_MAX, 0);
    op.workspace_bytes = o.Int("workspace_bytes", 0, INT64_MAX, 0);
    if (o.Get("params")) op.params = ExpectStrings(o.Required("params"), o.At("params"));
    o.Finish();
    g.ops.push_back(std::move(op));
  }
  r.Finish();
  g.Finalize(where);
  return g;
}

}  // namespace memplan::planner
