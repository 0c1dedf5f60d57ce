// KDA's reference kernels (kernels/src/kda_ref.h, Ops::KdaFwd/KdaBwd) and the
// sigmoid output gate: the chunked forward against a plain recurrent
// implementation written here from the formula (ops.h), independence of the
// chunk size, every backward against central differences in double, and the
// float Ops against the double math.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <vector>

#include "kda_ref.h"
#include "memplan/common/workspace.h"
#include "ref_test_util.h"

namespace {

using namespace memplan::test::kernels;
namespace mr = memplan::kernels::ref;
using memplan::kernels::KdaShape;

struct Inputs {
  VecD q, k, v, g, beta, a_log, dt_bias;
};

Inputs MakeInputs(const KdaShape& sh, uint64_t seed) {
  const int64_t rows = sh.batch * sh.seq;
  Inputs in;
  in.q = ToD(Rand(rows * sh.heads * sh.dk, seed + 1));
  in.k = ToD(Rand(rows * sh.heads * sh.dk, seed + 2));
  in.v = ToD(Rand(rows * sh.heads * sh.dv, seed + 3));
  in.g = ToD(Rand(rows * sh.heads * sh.dk, seed + 4, -2.f, 2.f));
  in.beta = ToD(Rand(rows * sh.heads, seed + 5, -2.f, 2.f));
  in.a_log = ToD(Rand(sh.heads, seed + 6, -1.f, 0.5f));
  in.dt_bias = ToD(Rand(sh.heads * sh.dk, seed + 7, -3.f, 1.f));
  return in;
}

// The recurrence as ops.h states it, token by token over the whole
// sequence, with explicit matrices: S <- (I - b k k^T) Diag(a) S + b k v^T.
VecD Recurrent(const Inputs& in, const KdaShape& sh) {
  VecD o(static_cast<size_t>(sh.batch * sh.seq * sh.heads * sh.dv));
  const int64_t dk = sh.dk, dv = sh.dv;
  for (int64_t b = 0; b < sh.batch; ++b) {
    for (int64_t h = 0; h < sh.heads; ++h) {
      VecD S(static_cast<size_t>(dk * dv), 0.0);
      for (int64_t s = 0; s < sh.seq; ++s) {
        const int64_t r = b * sh.seq + s;
        VecD q(dk), k(dk), a(dk);
        double nq = 0, nk = 0;
        for (int64_t i = 0; i < dk; ++i) {
          nq += in.q[(r * sh.heads + h) * dk + i] * in.q[(r * sh.heads + h) * dk + i];
          nk += in.k[(r * sh.heads + h) * dk + i] * in.k[(r * sh.heads + h) * dk + i];
        }
        nq = std::sqrt(nq + 1e-6);
        nk = std::sqrt(nk + 1e-6);
        for (int64_t i = 0; i < dk; ++i) {
          q[i] = in.q[(r * sh.heads + h) * dk + i] / nq / std::sqrt(double(dk));
          k[i] = in.k[(r * sh.heads + h) * dk + i] / nk;
          const double x = in.g[(r * sh.heads + h) * dk + i] + in.dt_bias[h * dk + i];
          a[i] = std::exp(-std::exp(in.a_log[h]) * std::log1p(std::exp(x)));
        }
        const double beta = 1 / (1 + std::exp(-in.beta[r * sh.heads + h]));
        // M = I - beta k k^T; S = M Diag(a) S + beta k v^T.
        VecD next(S.size(), 0.0);
        for (int64_t i = 0; i < dk; ++i) {
          for (int64_t j = 0; j < dv; ++j) {
            double acc = 0;
            for (int64_t p = 0; p < dk; ++p) acc += ((i == p ? 1.0 : 0.0) - beta * k[i] * k[p]) * a[p] * S[p * dv + j];
            next[i * dv + j] = acc + beta * k[i] * in.v[(r * sh.heads + h) * dv + j];
          }
        }
        S = next;
        for (int64_t j = 0; j < dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < dk; ++i) acc += q[i] * S[i * dv + j];
          o[(r * sh.heads + h) * dv + j] = acc;
        }
      }
    }
  }
  return o;
}

VecD Forward(const Inputs& in, const KdaShape& sh, VecD* states = nullptr) {
  VecD o(static_cast<size_t>(sh.batch * sh.seq * sh.heads * sh.dv));
  VecD st(static_cast<size_t>(sh.batch * sh.heads * sh.Chunks() * sh.dk * sh.dv));
  mr::KdaFwd(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), in.a_log.data(), in.dt_bias.data(),
             sh, o.data(), st.data());
  if (states) *states = st;
  return o;
}

}  // namespace

TEST_CASE("KDA: the chunked forward equals the plain recurrence, for any chunk size") {
  KdaShape sh{2, 11, 2, 5, 4, 4};  // 3 chunks, the last short
  const Inputs in = MakeInputs(sh, 300);
  const VecD want = Recurrent(in, sh);
  VecD states;
  const VecD o = Forward(in, sh, &states);
  ExpectClose(o, want, 1e-12, "kda o vs recurrence");
  // The first chunk starts from zero.
  for (int64_t e = 0; e < sh.dk * sh.dv; ++e) CHECK(states[static_cast<size_t>(e)] == 0.0);
  for (int64_t chunk : {1, 3, 11, 64}) {
    CAPTURE(chunk);
    KdaShape other = sh;
    other.chunk = chunk;
    CHECK(Forward(in, other) == o);  // bit for bit: the same token order
  }
}

TEST_CASE("KDA backward: every input, a_log and dt_bias against central differences") {
  const KdaShape shapes[] = {{2, 7, 2, 4, 3, 3}, {1, 20, 2, 6, 6, 8}};
  for (const KdaShape& sh : shapes) {
  CAPTURE(sh.dk);
  Inputs in = MakeInputs(sh, 400);
  const VecD r = ToD(Rand(sh.batch * sh.seq * sh.heads * sh.dv, 410));
  auto loss = [&] { return Dot(r, Forward(in, sh)); };
  VecD states;
  Forward(in, sh, &states);
  VecD dq(in.q.size()), dk(in.k.size()), dv(in.v.size()), dg(in.g.size()), db(in.beta.size());
  const VecD da0 = ToD(Rand(sh.heads, 411));
  VecD da = da0;
  const VecD ddt0 = ToD(Rand(sh.heads * sh.dk, 412));
  VecD ddt = ddt0;
  VecD work(static_cast<size_t>(memplan::workspace::KdaBwdBytes(sh.batch, sh.heads, sh.chunk, sh.dk, sh.dv) / 4));
  mr::KdaBwd(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), in.a_log.data(), in.dt_bias.data(),
             states.data(), r.data(), sh, dq.data(), dk.data(), dv.data(), dg.data(), db.data(), da.data(), ddt.data(),
             work.data());
  for (size_t h = 0; h < da.size(); ++h) da[h] -= da0[h];  // added into
  for (size_t c = 0; c < ddt.size(); ++c) ddt[c] -= ddt0[c];
  ExpectClose(dq, NumGrad(in.q, loss), 1e-6, "kda dq");
  ExpectClose(dk, NumGrad(in.k, loss), 1e-6, "kda dk");
  ExpectClose(dv, NumGrad(in.v, loss), 1e-6, "kda dv");
  ExpectClose(dg, NumGrad(in.g, loss), 1e-6, "kda dg");
  ExpectClose(db, NumGrad(in.beta, loss), 1e-6, "kda dbeta");
  ExpectClose(da, NumGrad(in.a_log, loss), 1e-6, "kda da_log");
  ExpectClose(ddt, NumGrad(in.dt_bias, loss), 1e-6, "kda d_dt_bias");

  // The float Ops (the runtime's) against the double math.
  auto ops = memplan::kernels::MakeRefOps();
  auto F = [](const VecD& v) { return VecF(v.begin(), v.end()); };
  const VecF qf = F(in.q), kf = F(in.k), vf = F(in.v), gf = F(in.g), bf = F(in.beta), af = F(in.a_log), rf = F(r);
  const VecF tf = F(in.dt_bias);
  VecF o(dv.size()), st(states.size());
  ops->KdaFwd(qf.data(), kf.data(), vf.data(), gf.data(), bf.data(), af.data(), tf.data(), sh, o.data(), st.data());
  ExpectClose(o, Forward(in, sh), 1e-4, "kda o (float)");
  VecF dqf(dq.size()), dkf(dk.size()), dvf(dv.size()), dgf(dg.size()), dbf(db.size()), daf(da.size(), 0.f);
  VecF wf(work.size()), dtf(ddt.size(), 0.f);
  ops->KdaBwd(qf.data(), kf.data(), vf.data(), gf.data(), bf.data(), af.data(), tf.data(), st.data(), rf.data(), sh,
              dqf.data(), dkf.data(), dvf.data(), dgf.data(), dbf.data(), daf.data(), dtf.data(), wf.data());
  ExpectClose(dqf, dq, 1e-4, "kda dq (float)");
  ExpectClose(dgf, dg, 1e-4, "kda dg (float)");
  ExpectClose(daf, da, 1e-4, "kda da_log (float)");
  ExpectClose(dtf, ddt, 1e-4, "kda d_dt_bias (float)");
  }
}

TEST_CASE("sigmoid output gate: forward and backward") {
  const int64_t n = 37;
  VecD x = ToD(Rand(n, 500)), g = ToD(Rand(n, 501, -3.f, 3.f));
  const VecD r = ToD(Rand(n, 502));
  auto loss = [&] {
    VecD y(static_cast<size_t>(n));
    mr::SigmoidGateFwd(x.data(), g.data(), n, y.data());
    return Dot(r, y);
  };
  VecD dx(static_cast<size_t>(n)), dg(static_cast<size_t>(n));
  mr::SigmoidGateBwd(x.data(), g.data(), r.data(), n, dx.data(), dg.data());
  ExpectClose(dx, NumGrad(x, loss), 1e-6, "gate dx");
  ExpectClose(dg, NumGrad(g, loss), 1e-6, "gate dg");
}

// The short convolution against a causal depthwise conv1d written here from
// its definition (zero left padding of taps - 1, then SiLU), and its
// backward against central differences; sequences shorter than the taps.
TEST_CASE("short convolution: forward against conv1d, backward against central differences") {
  int checked = 0;
  for (const auto& [batch, seq, channels, taps] :
       std::vector<std::array<int64_t, 4>>{{2, 9, 5, 4}, {3, 2, 3, 4}, {1, 6, 4, 1}}) {
    CAPTURE(seq);
    CAPTURE(taps);
    VecD x = ToD(Rand(batch * seq * channels, 600 + seq, -2.f, 2.f));
    VecD w = ToD(Rand(taps * channels, 610 + seq, -1.f, 1.f));
    VecD want(x.size());
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t c = 0; c < channels; ++c) {
        VecD padded(static_cast<size_t>(seq + taps - 1), 0.0);  // F.pad(x, (taps - 1, 0))
        for (int64_t s = 0; s < seq; ++s) padded[static_cast<size_t>(s + taps - 1)] = x[(b * seq + s) * channels + c];
        for (int64_t s = 0; s < seq; ++s) {
          double pre = 0;
          for (int64_t j = 0; j < taps; ++j) pre += w[j * channels + c] * padded[static_cast<size_t>(s + j)];
          want[(b * seq + s) * channels + c] = pre / (1 + std::exp(-pre));
        }
      }
    }
    auto forward = [&] {
      VecD y(x.size());
      mr::ShortConvFwd(x.data(), w.data(), batch, seq, channels, taps, y.data());
      return y;
    };
    ExpectClose(forward(), want, 1e-14, "short conv y");
    const VecD r = ToD(Rand(batch * seq * channels, 620 + seq));
    auto loss = [&] { return Dot(r, forward()); };
    VecD dx(x.size());
    const VecD dw0 = ToD(Rand(taps * channels, 630));
    VecD dw = dw0;
    mr::ShortConvBwd(x.data(), w.data(), r.data(), batch, seq, channels, taps, dx.data(), dw.data());
    for (size_t i = 0; i < dw.size(); ++i) dw[i] -= dw0[i];  // added into
    ExpectClose(dx, NumGrad(x, loss), 1e-7, "short conv dx");
    ExpectClose(dw, NumGrad(w, loss), 1e-7, "short conv dw");
    ++checked;
  }
  CHECK(checked == 3);
}
