// Expert parallelism: the all-to-all dispatch and combine (experts.h).
#include "experts.h"

#include <algorithm>
#include <cstring>

#include "memplan/common/check.h"

namespace memplan::runtime::exec {

namespace {

struct Shape {
  int64_t ranks, me, local;  // EP group size, this rank's place, experts per rank
};

Shape ShapeOf(OpContext& c) {
  const int64_t experts = c.model().arch.moe->experts;
  return {c.ep_size(), c.ep_rank(), experts / c.ep_size()};
}

int64_t At(const Shape& s, int64_t rank, int64_t expert) { return rank * s.local + expert; }

// The first token-side row bound for EP rank d, and the row after its last.
std::pair<int64_t, int64_t> TokenRun(const Routing& rt, const Shape& s, int64_t d) {
  return {rt.token_offsets[static_cast<size_t>(d * s.local)], rt.token_offsets[static_cast<size_t>((d + 1) * s.local)]};
}

// Token side -> the rows bound for each rank (its run of `mine`).
std::vector<std::vector<std::byte>> ExpertMessages(const Routing& rt, const Shape& s, const std::vector<float>& mine,
                                                   int64_t width) {
  std::vector<std::vector<std::byte>> out(static_cast<size_t>(s.ranks));
  for (int64_t d = 0; d < s.ranks; ++d) {
    auto [lo, hi] = TokenRun(rt, s, d);
    auto* from = reinterpret_cast<const std::byte*>(mine.data() + lo * width);
    out[static_cast<size_t>(d)].assign(from, from + (hi - lo) * width * 4);
  }
  return out;
}

// Token side -> expert side on host rows: `in[s]` the rows rank s sent (by
// local expert, then token), after a header of `header` bytes; the kept
// rows land by expert, then rank, in a capacity-row image.
std::vector<float> ExpertImage(const Routing& rt, const Shape& s, const std::vector<std::vector<std::byte>>& in,
                               size_t header, int64_t capacity, int64_t width) {
  std::vector<float> side(static_cast<size_t>(capacity * width), 0.f);
  int64_t pos = 0;
  for (int64_t e = 0; e < s.local; ++e) {
    for (int64_t r = 0; r < s.ranks; ++r) {
      int64_t skip = 0;  // rows rank r sent for the experts before e
      for (int64_t f = 0; f < e; ++f) skip += rt.received[static_cast<size_t>(At(s, r, f))];
      const int64_t kept = rt.kept[static_cast<size_t>(At(s, r, e))];
      if (kept > 0) {
        std::memcpy(side.data() + pos * width, in[static_cast<size_t>(r)].data() + header + skip * width * 4,
                    static_cast<size_t>(kept * width * 4));
      }
      pos += kept;
    }
  }
  return side;
}

// Expert side -> token side on host rows: what goes back to each rank
// (its rows for each local expert in order, the dropped ones zero).
std::vector<std::vector<std::byte>> TokenMessages(const Routing& rt, const Shape& s, const std::vector<float>& side,
                                                  int64_t width) {
  std::vector<std::vector<std::byte>> out(static_cast<size_t>(s.ranks));
  for (int64_t r = 0; r < s.ranks; ++r) {
    int64_t rows = 0;
    for (int64_t e = 0; e < s.local; ++e) rows += rt.received[static_cast<size_t>(At(s, r, e))];
    std::vector<std::byte>& msg = out[static_cast<size_t>(r)];
    msg.assign(static_cast<size_t>(rows * width * 4), std::byte{0});
    int64_t at = 0;
    for (int64_t e = 0; e < s.local; ++e) {
      int64_t first = rt.offsets[static_cast<size_t>(e)];  // expert e's rows, rank by rank
      for (int64_t q = 0; q < r; ++q) first += rt.kept[static_cast<size_t>(At(s, q, e))];
      const int64_t kept = rt.kept[static_cast<size_t>(At(s, r, e))];
      if (kept > 0) {
        std::memcpy(msg.data() + at * width * 4, side.data() + first * width, static_cast<size_t>(kept * width * 4));
      }
      at += rt.received[static_cast<size_t>(At(s, r, e))];
    }
  }
  return out;
}

// The token side from what each rank sent back, in EP rank order.
std::vector<float> TokenImage(const Routing& rt, const Shape& s, const std::vector<std::vector<std::byte>>& in,
                              int64_t width) {
  std::vector<float> tokens(static_cast<size_t>(rt.token_offsets.back() * width));
  for (int64_t d = 0; d < s.ranks; ++d) {
    auto [lo, hi] = TokenRun(rt, s, d);
    const auto& msg = in[static_cast<size_t>(d)];
    MEMPLAN_CHECK(static_cast<int64_t>(msg.size()) == (hi - lo) * width * 4, "an EP rank returned the wrong rows");
    if (hi > lo) std::memcpy(tokens.data() + lo * width, msg.data(), msg.size());
  }
  return tokens;
}

std::vector<float> ToHostFloats(OpContext& c, const Buffer& b, int64_t floats) {
  std::vector<float> h(static_cast<size_t>(floats));
  if (floats > 0) c.ToHost(h.data(), b.ptr, floats * 4);
  return h;
}

}  // namespace

void DispatchToExperts(OpContext& c, Buffer rows, int64_t width) {
  Routing& rt = c.Routing();
  const Shape s = ShapeOf(c);
  const int64_t capacity = rows.bytes / (width * 4);
  std::vector<float> mine = ToHostFloats(c, rows, rt.token_offsets.back() * width);
  // To each rank: its experts' row counts, then the rows.
  std::vector<std::vector<std::byte>> out = ExpertMessages(rt, s, mine, width);
  const size_t header = static_cast<size_t>(s.local) * sizeof(int64_t);
  for (int64_t d = 0; d < s.ranks; ++d) {
    std::vector<std::byte>& msg = out[static_cast<size_t>(d)];
    std::vector<int64_t> counts(static_cast<size_t>(s.local));
    for (int64_t e = 0; e < s.local; ++e) {
      counts[static_cast<size_t>(e)] = rt.token_offsets[static_cast<size_t>(d * s.local + e + 1)] -
                                       rt.token_offsets[static_cast<size_t>(d * s.local + e)];
    }
    msg.insert(msg.begin(), reinterpret_cast<const std::byte*>(counts.data()),
               reinterpret_cast<const std::byte*>(counts.data()) + header);
  }
  std::vector<std::vector<std::byte>> in = c.ExchangeExperts(std::move(out));
  rt.received.assign(static_cast<size_t>(s.ranks * s.local), 0);
  for (int64_t r = 0; r < s.ranks; ++r) {
    const auto& msg = in[static_cast<size_t>(r)];
    MEMPLAN_CHECK(msg.size() >= header, "an EP rank sent no row counts");
    std::memcpy(rt.received.data() + r * s.local, msg.data(), header);
    int64_t rows_in = 0;
    for (int64_t e = 0; e < s.local; ++e) rows_in += rt.received[static_cast<size_t>(At(s, r, e))];
    MEMPLAN_CHECK(static_cast<int64_t>(msg.size() - header) == rows_in * width * 4, "an EP rank sent the wrong rows");
  }
  if (c.forward_pass() && rt.token_offsets.back() > 0) {
    // Every rank routes as many rows as this one (equal microbatches): the
    // mean per expert is ep * rows / experts, a rank's share its own rows.
    const int64_t mine_rows = rt.token_offsets.back();
    int64_t most = 0, all = 0;
    for (int64_t e = 0; e < s.local; ++e) {
      int64_t global = 0;
      for (int64_t r = 0; r < s.ranks; ++r) global += rt.received[static_cast<size_t>(At(s, r, e))];
      most = std::max(most, global);
      all += global;
    }
    const double mean = static_cast<double>(s.ranks * mine_rows) / static_cast<double>(s.ranks * s.local);
    c.NoteRouting(static_cast<double>(most) / mean, static_cast<double>(all) / static_cast<double>(mine_rows));
  }
  // Capacity: the first rows in (expert, rank) order are kept.
  rt.kept.assign(rt.received.size(), 0);
  rt.offsets.assign(static_cast<size_t>(s.local + 1), 0);
  int64_t room = capacity, dropped = 0;
  for (int64_t e = 0; e < s.local; ++e) {
    for (int64_t r = 0; r < s.ranks; ++r) {
      const int64_t want = rt.received[static_cast<size_t>(At(s, r, e))];
      const int64_t kept = std::min(want, room);
      rt.kept[static_cast<size_t>(At(s, r, e))] = kept;
      room -= kept;
      dropped += want - kept;
    }
    rt.offsets[static_cast<size_t>(e + 1)] = capacity - room;
  }
  if (dropped > 0 && c.forward_pass()) c.NoteDropped(dropped);
  std::vector<float> side = ExpertImage(rt, s, in, header, capacity, width);
  c.FromHost(rows.ptr, side.data(), capacity * width * 4);
}

void ToExperts(OpContext& c, Buffer rows, int64_t width) {
  Routing& rt = c.Routing();
  const Shape s = ShapeOf(c);
  MEMPLAN_CHECK(!rt.kept.empty(), "an expert exchange before its layer's dispatch");
  std::vector<float> mine = ToHostFloats(c, rows, rt.token_offsets.back() * width);
  std::vector<std::vector<std::byte>> in = c.ExchangeExperts(ExpertMessages(rt, s, mine, width));
  const int64_t capacity = rows.bytes / (width * 4);
  std::vector<float> side = ExpertImage(rt, s, in, 0, capacity, width);
  c.FromHost(rows.ptr, side.data(), capacity * width * 4);
}

void ToTokens(OpContext& c, Buffer rows, int64_t width) {
  Routing& rt = c.Routing();
  const Shape s = ShapeOf(c);
  MEMPLAN_CHECK(!rt.kept.empty(), "an expert exchange before its layer's dispatch");
  std::vector<float> side = ToHostFloats(c, rows, rt.offsets.back() * width);
  std::vector<float> tokens = TokenImage(rt, s, c.ExchangeExperts(TokenMessages(rt, s, side, width)), width);
  if (!tokens.empty()) c.FromHost(rows.ptr, tokens.data(), static_cast<int64_t>(tokens.size()) * 4);
}

void RouterGradRewriteAcrossRanks(OpContext& c, Buffer da, Buffer act, int64_t width, Buffer slot_of, Buffer gates,
                                  int64_t tokens, Buffer d_gates) {
  Routing& rt = c.Routing();
  const Shape s = ShapeOf(c);
  const int64_t rows = rt.offsets.back();
  std::vector<float> a = ToHostFloats(c, da, rows * width), x = ToHostFloats(c, act, rows * width);
  std::vector<float> dots(static_cast<size_t>(rows));
  for (int64_t j = 0; j < rows; ++j) {
    float sum = 0;  // in order, as the kernel's DotN
    for (int64_t k = 0; k < width; ++k) sum += a[static_cast<size_t>(j * width + k)] * x[static_cast<size_t>(j * width + k)];
    dots[static_cast<size_t>(j)] = sum;
  }
  std::vector<float> back = TokenImage(rt, s, c.ExchangeExperts(TokenMessages(rt, s, dots, 1)), 1);
  const int64_t pairs = tokens * c.model().arch.moe->top_k;
  MEMPLAN_CHECK(static_cast<int64_t>(back.size()) == pairs, "the routed rows do not match the tokens");
  std::vector<int32_t> slot(static_cast<size_t>(pairs));
  c.ToHost(slot.data(), slot_of.ptr, pairs * 4);
  std::vector<float> w = ToHostFloats(c, gates, pairs), d(static_cast<size_t>(pairs));
  for (int64_t j = 0; j < pairs; ++j) {
    const size_t at = static_cast<size_t>(slot[static_cast<size_t>(j)]);
    d[at] = w[at] == 0.f ? 0.f : back[static_cast<size_t>(j)] / w[at];
  }
  c.FromHost(d_gates.ptr, d.data(), pairs * 4);
}

}  // namespace memplan::runtime::exec
