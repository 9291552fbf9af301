// The layer kinds, one line each. A kind is its folder generators/kinds/<name>/:
//   traits.cppm  what the DSL, the planner and the trainer know of it (remat::kinds::<name>, its
//                constructor): a partition of module remat.language
//   algorithm.h  its Halide forward and vector-Jacobian rules (remat::gen)
//   rules.h      how the model compiler builds and schedules it in a block kernel
//                (remat::modelc::KindRules<Op::<name>>)
//   reference.h  its float64 reference for the tests (remat::testing::KindReference<Op::<name>>)
//   checks.h     its layer checks, test cases of test_layers (remat::testing::KindChecks<Op::<name>>)
// From this list come remat::Op (in this order) and n_ops (dsl/core.cppm), the traits table
// (dsl/language.cppm), the model compiler's rules table (generators/modelc.cpp), the tests'
// reference table (tests/test_model_gradients.cpp) and test_layers' checks; CMake
// (cmake/RematKinds.cmake) compiles or includes each folder's files. Adding a kind: its folder, and
// its line here.
REMAT_KIND(linear)
REMAT_KIND(layer_norm)
REMAT_KIND(rms_norm)
REMAT_KIND(gelu)
REMAT_KIND(relu)
REMAT_KIND(relu2)
REMAT_KIND(swiglu)
REMAT_KIND(dropout)
REMAT_KIND(rope)
REMAT_KIND(attention)
REMAT_KIND(embedding)
REMAT_KIND(residual_begin)
REMAT_KIND(residual_end)
