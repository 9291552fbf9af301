// Must not compile: every_n_layers(0) checkpoints no block at a period of zero.
export module compile_fail_every_n_layers_zero;
import remat;
inline constexpr remat::Policy bad = remat::every_n_layers(0);
