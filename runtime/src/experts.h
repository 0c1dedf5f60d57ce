// Expert parallelism (docs/runtime.md, "Expert parallelism"): routed rows
// move between two layouts of the same capacity-sized tensor.
//   token side  - this rank's routed rows sorted by (global) expert, as the
//                 dispatch writes them; the rows bound for EP rank d (its
//                 experts [d E/ep, (d+1) E/ep)) are one run;
//   expert side - the rows every EP rank sent for this rank's experts, by
//                 local expert, then sending rank, then token, at most the
//                 tensor's capacity (template: s b top_k capacity_factor
//                 rows); rows past it are dropped (their output is zero).
// Each exchange is one all-to-all of the EP group, staged through the host
// as every message is. Every EP rank of a group runs the same program, so
// they meet at the same op (forward, backward and the rebuild of the
// dispatch in backward alike).
#pragma once

#include <cstdint>
#include <vector>

#include "op_impls.h"

namespace memplan::runtime::exec {

// After the dispatch wrote this rank's rows (token side, by the routing's
// token_offsets) into `rows` (fp32, `width` columns): the counts and rows
// exchanged, the expert side in `rows`, and the routing's received, kept
// and offsets (the grouped GEMMs' local experts).
void DispatchToExperts(OpContext& c, Buffer rows, int64_t width);
// A routed tensor's rows from one side to the other, in place.
void ToExperts(OpContext& c, Buffer rows, int64_t width);
void ToTokens(OpContext& c, Buffer rows, int64_t width);
// The gradient rewrite's router gradient (Ops::RouterGradRewrite) when the
// expert rows are on other ranks: each expert rank's <dA, A> per row, sent
// back to the token side, divided by the gate there.
void RouterGradRewriteAcrossRanks(OpContext& c, Buffer da, Buffer act, int64_t width, Buffer slot_of, Buffer gates,
                                  int64_t tokens, Buffer d_gates);

}  // namespace memplan::runtime::exec
