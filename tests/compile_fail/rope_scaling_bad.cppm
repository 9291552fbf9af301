// Must not compile: llama3 RoPE scaling with a factor below 1 (a config typo).
export module compile_fail_rope_scaling_bad;
import remat;
inline constexpr remat::Layer rope = remat::rope(4, 4, remat::rope_theta(500000), remat::rope_llama3(0.5, 1, 4, 8192));
