// Every kind's rules for the model compiler, by Op: part of modelc.cpp, included after
// StageKernels. Adding a kind: its unit here (forward, backward, statistics side by side) and its
// entry in `table`, in the order of remat::Op.
#include "kinds/activations.h"
#include "kinds/attention.h"
#include "kinds/dropout.h"
#include "kinds/embedding.h"
#include "kinds/layer_norm.h"
#include "kinds/linear.h"
#include "kinds/residual.h"
#include "kinds/rms_norm.h"
#include "kinds/rope.h"

constexpr std::array<const KindRules *, n_ops> kind_rules = {
    &linear_rules,  &layer_norm_rules, &rms_norm_rules,  &gelu_rules,      &relu_rules,           &swiglu_rules,
    &dropout_rules, &rope_rules,       &attention_rules, &embedding_rules, &residual_begin_rules, &residual_end_rules};
static_assert(
    [] {
      for (int i = 0; i < n_ops; ++i)
        if (kind_rules[i]->op != Op(i)) return false;
      return true;
    }(),
    "remat model compiler: kind_rules is indexed by Op");

const KindRules &rules_of(Op op) { return *kind_rules[std::size_t(op)]; }
