#include "memplan/traces/timeline_compare.h"

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <map>
#include <tuple>

namespace memplan::traces {

namespace {

using Key = std::tuple<std::string, std::string, int64_t>;  // name, part, bytes

struct Life {
  int64_t first = 0, last = 0;
  Key key;
  bool copy_timed = false;
};

// Pairs each measured allocation with the free of the same buffer; a
// buffer never freed lives to the last step.
std::vector<Life> MeasuredLives(const std::vector<StepAllocation>& events, int64_t steps) {
  std::map<std::pair<std::string, std::string>, std::deque<std::pair<int64_t, int64_t>>> open;
  std::vector<Life> out;
  for (const auto& e : events) {
    auto& q = open[{e.name, e.part}];
    if (e.bytes >= 0) {
      q.push_back({e.step, e.bytes});
      continue;
    }
    if (q.empty()) continue;  // a free without its allocation (ParseMeasured refuses most)
    auto [first, bytes] = q.front();
    q.pop_front();
    out.push_back({first, e.step, {e.name, e.part, bytes}, e.part == "staging"});
  }
  for (auto& [id, q] : open) {
    for (auto [first, bytes] : q) out.push_back({first, steps - 1, {id.first, id.second, bytes}, id.second == "staging"});
  }
  return out;
}

std::vector<int64_t> LiveBytes(const std::vector<Life>& lives, int64_t steps) {
  std::vector<int64_t> d(static_cast<size_t>(steps) + 1, 0);
  for (const Life& l : lives) {
    const int64_t f = std::clamp<int64_t>(l.first, 0, steps), e = std::clamp<int64_t>(l.last + 1, 0, steps);
    d[static_cast<size_t>(f)] += std::get<2>(l.key);
    d[static_cast<size_t>(e)] -= std::get<2>(l.key);
  }
  int64_t run = 0;
  for (auto& x : d) x = (run += x);
  d.pop_back();
  return d;
}

}  // namespace

TimelineComparison CompareTimelines(const std::vector<PredictedLife>& predicted,
                                    const std::vector<StepAllocation>& measured, int64_t steps,
                                    const std::function<std::string(int64_t)>& describe) {
  TimelineComparison c;
  c.steps = steps;
  std::vector<Life> pred;
  for (const auto& p : predicted) pred.push_back({p.first, p.last, {p.name, p.part, p.bytes}, p.copy_timed});
  std::vector<Life> meas = MeasuredLives(measured, steps);
  c.buffers = static_cast<int64_t>(meas.size());
  auto peak = [&](const std::vector<Life>& v) {
    auto b = LiveBytes(v, steps);
    return b.empty() ? 0 : *std::max_element(b.begin(), b.end());
  };
  c.predicted_peak = peak(pred);
  c.measured_peak = peak(meas);

  // Timing-independent lives: +1 predicted / -1 measured per key at each
  // start, undone after each end; a step diverges while any count is off.
  std::vector<std::vector<std::pair<Key, int>>> at(static_cast<size_t>(steps) + 1);
  auto add = [&](const std::vector<Life>& v, int sign) {
    for (const Life& l : v) {
      if (l.copy_timed) continue;
      at[static_cast<size_t>(std::clamp<int64_t>(l.first, 0, steps))].push_back({l.key, sign});
      at[static_cast<size_t>(std::clamp<int64_t>(l.last + 1, 0, steps))].push_back({l.key, -sign});
    }
  };
  add(pred, +1);
  add(meas, -1);
  std::map<Key, int> off;
  auto bytes_of = [&](const std::vector<Life>& v, int64_t s) {
    int64_t b = 0;
    for (const Life& l : v) b += !l.copy_timed && l.first <= s && s <= l.last ? std::get<2>(l.key) : 0;
    return b;
  };
  for (int64_t s = 0; s < steps; ++s) {
    for (const auto& [key, d] : at[static_cast<size_t>(s)]) {
      int& n = off[key];
      n += d;
      if (n == 0) off.erase(key);
    }
    if (off.empty()) continue;
    ++c.divergent_steps;
    if (c.first_step) continue;
    c.first_step = s;
    c.predicted_bytes = bytes_of(pred, s);
    c.measured_bytes = bytes_of(meas, s);
    for (const auto& [key, n] : off) {
      LiveBuffer b{std::get<0>(key), std::get<1>(key), std::get<2>(key)};
      for (int k = 0; k < std::abs(n); ++k) (n > 0 ? c.only_predicted : c.only_measured).push_back(b);
    }
  }

  // Copy-timed lives, matched by buffer in order.
  std::map<Key, std::deque<const Life*>> timed;
  for (const Life& l : meas) {
    if (l.copy_timed) timed[l.key].push_back(&l);
  }
  for (const Life& p : pred) {
    if (!p.copy_timed) continue;
    auto it = timed.find(p.key);
    if (it == timed.end() || it->second.empty()) {
      c.only_predicted.push_back({std::get<0>(p.key), std::get<1>(p.key), std::get<2>(p.key)});
      c.first_step = c.first_step ? std::min(*c.first_step, p.first) : p.first;
      continue;
    }
    const Life* m = it->second.front();
    it->second.pop_front();
    if (m->last != p.last || m->first != p.first) {
      c.moved.push_back({std::get<0>(p.key), std::get<1>(p.key), std::get<2>(p.key), p.last, m->last});
      c.moved_bytes += std::get<2>(p.key);
    }
  }
  for (const auto& [key, q] : timed) {
    for (const Life* m : q) {
      c.only_measured.push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key)});
      c.first_step = c.first_step ? std::min(*c.first_step, m->first) : m->first;
    }
  }

  const bool lives_equal = !c.first_step;
  const bool peak_explained = std::llabs(c.measured_peak - c.predicted_peak) <= c.moved_bytes;
  c.pass = lives_equal && peak_explained;
  if (c.pass) {
    c.verdict = "pass";
  } else if (!lives_equal) {
    auto list = [](const std::vector<LiveBuffer>& v) {
      std::string s;
      for (size_t k = 0; k < v.size() && k < 4; ++k) {
        s += (k ? ", " : "") + v[k].name + " [" + v[k].part + "] " + std::to_string(v[k].bytes) + " B";
      }
      if (v.size() > 4) s += " and " + std::to_string(v.size() - 4) + " more";
      return s.empty() ? std::string("nothing") : s;
    };
    c.verdict = "FAIL: first divergence at step " + std::to_string(*c.first_step) + " (" + describe(*c.first_step) +
                "): predicted " + std::to_string(c.predicted_bytes) + " B live, measured " +
                std::to_string(c.measured_bytes) + " B; only in the plan: " + list(c.only_predicted) +
                "; only measured: " + list(c.only_measured) + " (" + std::to_string(c.divergent_steps) +
                " divergent steps)";
  } else {
    c.verdict = "FAIL: allocated peak " + std::to_string(c.measured_peak) + " B against the plan's " +
                std::to_string(c.predicted_peak) + " B, more than the " + std::to_string(c.moved_bytes) +
                " B of moved copies explain";
  }
  return c;
}

}  // namespace memplan::traces
