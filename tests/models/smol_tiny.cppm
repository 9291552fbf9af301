// examples/smollm2's architecture (LlamaForCausalLM: tied LM head, RMSNorm eps 1e-5, grouped-query
// attention, SwiGLU) at small widths and with the config fields SmolLM2 leaves at their defaults:
// 3 query heads sharing 1 key / value head, each of head_dim 16 (not hidden_size / heads = 8),
// biases on q, k, v, o (attention_bias) and on the MLP (mlp_bias), RoPE of base 100000 scaled as
// rope_type "llama3" (factor 8, original context 64, low 1, high 8: frequencies of head 16 kept,
// blended and divided), 3 blocks, an MLP of 20, a vocabulary of 41, 6 positions.
export module smol_tiny;
import remat.language;
import smollm2;

export namespace smol_tiny {
inline constexpr smollm2::Config config{.vocab_size = 41,
                                        .context = 6,
                                        .num_hidden_layers = 3,
                                        .num_attention_heads = 3,
                                        .num_key_value_heads = 1,
                                        .hidden_size = 24,
                                        .intermediate_size = 20,
                                        .head_dim = 16,
                                        .attention_bias = true,
                                        .mlp_bias = true,
                                        .rope_scaling = remat::rope_llama3(8, 1, 8, 64)};
inline constexpr remat::Model model = remat::checked([] { return smollm2::architecture(config); });
inline constexpr remat::Policy policy = remat::none;
// Its trainer (train-smol-tiny), for tests/transformers_models.py: token files it is given.
inline constexpr remat::TrainerDefaults trainer{.batch = 2, .max_steps = 1, .eval_samples = 0, .transformers = "llama"};
}  // namespace smol_tiny
