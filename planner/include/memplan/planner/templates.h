// Architecture templates: expand a Model into per-layer graphs (stage 2).
//
// One function per building block (attention variants, MLP, MoE, KDA,
// Block AttnRes, embedding, head + loss) appends its ops, tensors and
// parameters to a layer. The saved-tensor inventory of each template, with
// its byte formula, is documented in docs/templates.md; the `gpt` template
// reproduces Korthikanti et al. 2022 exactly: s*b*h*(34 + 5*a*s/h) bytes per
// layer with 16-bit activations and 1-byte dropout masks, and the paper's TP
// and TP+SP forms.
//
// Layer 0 also holds the embedding (module `embed`); the last layer also
// holds the final norm, output head (`head`) and loss (`loss`).
#pragma once

#include <cstdint>
#include <vector>

#include "memplan/planner/graph.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

// Expands global layer `layer` from the templates (ignores model.graph).
// Throws ErrorException on sizes that overflow.
LayerGraph ExpandTemplateLayer(const Model& model, int64_t layer);

// Every layer of the model: the explicit graph where the model file gives
// one for that index, the template otherwise.
Expected<std::vector<LayerGraph>> ExpandModel(const Model& model);

// Block AttnRes: the number of block representations layer `layer` attends
// over (b_0, every completed block, the running one); `layer` = layers is
// the head's, the most of any.
int64_t AttnResSourceCount(int64_t layer, int64_t block_layers);

}  // namespace memplan::planner
