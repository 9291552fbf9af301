// Model zoo: the layers of today's LLMs around a GPT-style core. A token embedding without a
// position table; pre-RMSNorm blocks with bias-free projections, RoPE on q and k, grouped-query
// attention (6 query heads of 2 features, not a power of two, sharing 2 key / value heads) and a
// SwiGLU gated MLP (linear(C, 2H) -> swiglu -> linear(H, C)); widths no multiple of 8 (12, 20,
// 28, 14, 18); a second repeat stage of another kind (LayerNorm, squared ReLU as in Primer and
// modded-nanoGPT, dropout after the activation and after the GEMM); an RMSNorm head without
// bias. Both repeat stages carry their own policy: the first's selective kernels keep only the
// outputs named "rotated" and "gate" (so they rebuild the attention, both RMSNorms and the gate /
// up GEMM), "gate" offloaded to host memory between forward and backward (the CPU runs the
// copies), the second is checkpointed every 2 blocks and its selective kernels rebuild the
// LayerNorm output. Epsilons and the RoPE base differ from the kinds' defaults (0.25 and 0.1, base
// 500: large enough that a kernel using a default would miss the float64 reference).
export module zoo_gated;
import remat.language;

export namespace zoo_gated {
inline constexpr int vocab = 11, block_size = 5, width = 12, heads = 6, kv_heads = 2, hidden = 14;
inline constexpr int qkv_width = (heads + 2 * kv_heads) * (width / heads);

inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(
      remat::tokens(vocab, block_size), remat::token_embedding(vocab, width),
      remat::repeat(
          3,
          remat::chain(
              remat::residual(remat::rms_norm(remat::epsilon(0.25)), remat::linear(width, qkv_width, remat::no_bias),
                              remat::name("rotated", remat::rope(heads, kv_heads, remat::rope_theta(500))),
                              remat::causal_self_attention(heads, kv_heads),
                              remat::linear(width, width, remat::no_bias)),
              remat::residual(remat::rms_norm(), remat::linear(width, 2 * hidden, remat::no_bias),
                              remat::name("gate", remat::swiglu()), remat::linear(hidden, width, remat::no_bias))),
          remat::save_and_offload_only_these_names({"rotated"}, {"gate"})),
      remat::repeat(2,
                    remat::residual(remat::layer_norm(remat::epsilon(0.1)), remat::linear(width, 18), remat::relu2(),
                                    remat::dropout(), remat::linear(18, width), remat::dropout()),
                    remat::every_n_layers(2) | remat::recompute_modules(remat::norm)),
      remat::rms_norm(), remat::linear(width, vocab, remat::no_bias), remat::softmax_cross_entropy(vocab));
});
// Its trainer (train-zoo-gated, tests/CMakeLists.txt): none where the model names no policy; one step.
inline constexpr remat::Policy policy = remat::none;
inline constexpr remat::TrainerDefaults trainer{.batch = 8, .max_steps = 1, .eval_samples = 0};
}  // namespace zoo_gated
