// module remat.tensors: the tensor rules. What each block kernel keeps, rebuilds and needs as
// workspace under a Keep, the element type of each tensor under a precision, and every kernel's
// typed signature (its ordered arguments). The model compiler imports this (and the language it
// re-exports), not the planner: editing the planner regenerates no kernels.
// Its parts: tensors/keys.cppm, tensors/rules.cppm, tensors/kernels.cppm.
export module remat.tensors;
export import remat.language;
export import :keys;
export import :rules;
export import :kernels;
