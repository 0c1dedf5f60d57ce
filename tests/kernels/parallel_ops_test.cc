// The kernel contracts tensor and context parallelism rely on
// (docs/runtime.md, "Tensor parallelism", "Context parallelism"): a rank's
// part of a tensor computed alone, combined, equals the whole computed at
// once. CPU references; ops_cuda_test.cc holds the CUDA kernels to them.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "memplan/kernels/ops.h"
#include "ref_test_util.h"

namespace memplan::test::kernels {
namespace {

TEST_CASE("Vocabulary-parallel cross-entropy: the ranks' stats combined give the whole softmax and loss") {
  auto ops = mk::MakeRefOps();
  const int64_t tokens = 5, vocab = 12;
  for (int64_t tp : {2, 3, 4}) {
    CAPTURE(tp);
    const VecF logits = Rand(tokens * vocab, 11, -4.f, 4.f);
    std::vector<int32_t> targets{0, 11, 5, 6, 3};
    VecF probs(static_cast<size_t>(tokens * vocab)), loss(static_cast<size_t>(tokens));
    ops->CrossEntropyFwd(logits.data(), targets.data(), tokens, vocab, probs.data(), loss.data());
    const int64_t part = vocab / tp;
    std::vector<VecF> stats(static_cast<size_t>(tp), VecF(static_cast<size_t>(3 * tokens)));
    std::vector<VecF> local(static_cast<size_t>(tp), VecF(static_cast<size_t>(tokens * part)));
    for (int64_t r = 0; r < tp; ++r) {
      std::vector<int32_t> mine(targets.size());
      for (size_t i = 0; i < targets.size(); ++i) {
        mine[i] = targets[i] >= r * part && targets[i] < (r + 1) * part ? static_cast<int32_t>(targets[i] - r * part) : -1;
      }
      for (int64_t t = 0; t < tokens; ++t) {
        std::copy_n(logits.begin() + t * vocab + r * part, part, local[static_cast<size_t>(r)].begin() + t * part);
      }
      ops->CrossEntropyPartialStats(local[static_cast<size_t>(r)].data(), mine.data(), tokens, part,
                                    stats[static_cast<size_t>(r)].data());
    }
    int checked = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      float m = -INFINITY, target = 0.f;
      for (const auto& st : stats) m = std::max(m, st[static_cast<size_t>(3 * t)]);
      float sum = 0.f;
      for (const auto& st : stats) {
        sum += st[static_cast<size_t>(3 * t + 1)] * std::exp(st[static_cast<size_t>(3 * t)] - m);
        target += st[static_cast<size_t>(3 * t + 2)];
      }
      CHECK(std::log(sum) - (target - m) == doctest::Approx(loss[static_cast<size_t>(t)]).epsilon(1e-6));
      ++checked;
      for (int64_t r = 0; r < tp; ++r) {
        VecF ms{m, sum}, p(static_cast<size_t>(part));
        ops->CrossEntropyPartialProbs(local[static_cast<size_t>(r)].data() + t * part, ms.data(), 1, part, p.data());
        for (int64_t v = 0; v < part; ++v) {
          CHECK(p[static_cast<size_t>(v)] ==
                doctest::Approx(probs[static_cast<size_t>(t * vocab + r * part + v)]).epsilon(1e-6));
          ++checked;
        }
      }
    }
    CHECK(checked == tokens * (1 + vocab));
  }
}

TEST_CASE("Negative ids are another rank's: the embedding adds zeros, its backward and the loss's skip them") {
  auto ops = mk::MakeRefOps();
  const int64_t d = 3;
  const VecF table = Rand(4 * d, 3);
  std::vector<int32_t> ids{2, -1, 0, -1};
  VecF y(ids.size() * d, 7.f);
  ops->EmbeddingFwd(ids.data(), table.data(), 4, d, y.data());
  for (int64_t c = 0; c < d; ++c) {
    CHECK(y[static_cast<size_t>(c)] == table[static_cast<size_t>(2 * d + c)]);
    CHECK(y[static_cast<size_t>(d + c)] == 0.f);
    CHECK(y[static_cast<size_t>(3 * d + c)] == 0.f);
  }
  VecF dtable(table.size(), 0.f), dy(y.size(), 1.f);
  ops->EmbeddingBwd(ids.data(), dy.data(), 4, d, dtable.data());
  CHECK(dtable[0] == 1.f);
  CHECK(dtable[static_cast<size_t>(d)] == 0.f);  // row 1: no token here
  CHECK(dtable[static_cast<size_t>(2 * d)] == 1.f);
  VecF probs{0.25f, 0.75f}, dl(2);
  std::vector<int32_t> none{-1};
  ops->CrossEntropyBwd(probs.data(), none.data(), 1, 2, 2.f, dl.data());
  CHECK(dl[0] == 0.5f);
  CHECK(dl[1] == 1.5f);
}

TEST_CASE("Dropout's first index: a slice draws the whole tensor's masks") {
  auto ops = mk::MakeRefOps();
  const int64_t n = 1000;
  const VecF x = Rand(n, 5);
  VecF y(static_cast<size_t>(n));
  std::vector<uint8_t> mask(static_cast<size_t>(n));
  ops->DropoutFwd(x.data(), n, 0.3f, 9, 77, y.data(), mask.data());
  VecF ys(300);
  std::vector<uint8_t> ms(300);
  ops->DropoutFwd(x.data() + 600, 300, 0.3f, 9, 77, ys.data(), ms.data(), 600);
  int differ = 0;
  for (int64_t i = 0; i < 300; ++i) differ += ms[static_cast<size_t>(i)] != mask[static_cast<size_t>(600 + i)];
  CHECK(differ == 0);
  ops->DropoutFwd(x.data() + 600, 300, 0.3f, 9, 77, ys.data(), ms.data(), 0);
  differ = 0;
  for (int64_t i = 0; i < 300; ++i) differ += ms[static_cast<size_t>(i)] != mask[static_cast<size_t>(600 + i)];
  CHECK(differ > 0);  // without it, the slice would draw the tensor's first masks
}

TEST_CASE("Context-parallel RoPE: each rank's two chunks rotated at their whole-sequence positions") {
  auto ops = mk::MakeRefOps();
  const int64_t cp = 2, seq = 16, b = 2, heads = 2, kv = 1, hd = 4, width = (heads + 2 * kv) * hd;
  CHECK(mk::CpPosition(0, 8, 2, 0) == 0);
  CHECK(mk::CpPosition(4, 8, 2, 0) == 12);  // rank 0 holds chunks 0 and 3
  CHECK(mk::CpPosition(5, 8, 2, 1) == 9);   // rank 1 holds chunks 1 and 2
  const VecF qkv = Rand(b * seq * width, 21);
  mk::SplitShape whole{b, seq, heads, kv, hd, true};
  VecF q(static_cast<size_t>(b * heads * seq * hd)), k(static_cast<size_t>(b * kv * seq * hd)), v(k.size());
  ops->SplitHeadsFwd(qkv.data(), whole, q.data(), k.data(), v.data());
  int checked = 0;
  for (int64_t r = 0; r < cp; ++r) {
    const int64_t s = seq / cp;
    VecF mine(static_cast<size_t>(b * s * width));
    for (int64_t bb = 0; bb < b; ++bb) {
      for (int64_t p = 0; p < s; ++p) {
        const int64_t g = mk::CpPosition(p, s, cp, r);
        std::copy_n(qkv.begin() + (bb * seq + g) * width, width, mine.begin() + (bb * s + p) * width);
      }
    }
    mk::SplitShape part{b, s, heads, kv, hd, true};
    part.cp = cp;
    part.cp_rank = r;
    VecF ql(static_cast<size_t>(b * heads * s * hd)), kl(static_cast<size_t>(b * kv * s * hd)), vl(kl.size());
    ops->SplitHeadsFwd(mine.data(), part, ql.data(), kl.data(), vl.data());
    for (int64_t bb = 0; bb < b; ++bb) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t p = 0; p < s; ++p) {
          const int64_t g = mk::CpPosition(p, s, cp, r);
          for (int64_t i = 0; i < hd; ++i) {
            CHECK(ql[static_cast<size_t>(((bb * heads + h) * s + p) * hd + i)] ==
                  q[static_cast<size_t>(((bb * heads + h) * seq + g) * hd + i)]);
            ++checked;
          }
        }
      }
    }
  }
  CHECK(checked == b * heads * seq * hd);
}

TEST_CASE("Context-parallel causal softmax: each rank's rows mask at their whole-sequence positions") {
  auto ops = mk::MakeRefOps();
  const int64_t cp = 2, seq = 16, s = seq / cp, heads = 3;
  const VecF x = Rand(heads * seq * seq, 31, -3.f, 3.f);
  VecF whole(x.size());
  ops->SoftmaxFwd(x.data(), heads * seq, seq, 0.5f, seq, whole.data());
  int checked = 0;
  for (int64_t r = 0; r < cp; ++r) {
    VecF mine(static_cast<size_t>(heads * s * seq)), y(mine.size());
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t p = 0; p < s; ++p) {
        std::copy_n(x.begin() + (h * seq + mk::CpPosition(p, s, cp, r)) * seq, seq, mine.begin() + (h * s + p) * seq);
      }
    }
    ops->SoftmaxFwd(mine.data(), heads * s, seq, 0.5f, s, y.data(), cp, r);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t p = 0; p < s; ++p) {
        for (int64_t j = 0; j < seq; ++j) {
          CHECK(y[static_cast<size_t>((h * s + p) * seq + j)] ==
                whole[static_cast<size_t>((h * seq + mk::CpPosition(p, s, cp, r)) * seq + j)]);
          ++checked;
        }
      }
    }
  }
  CHECK(checked == heads * seq * seq);
}

}  // namespace
}  // namespace memplan::test::kernels
