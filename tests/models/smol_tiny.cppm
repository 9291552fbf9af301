// examples/smollm2's architecture (LlamaForCausalLM: tied LM head, RMSNorm eps 1e-5, RoPE base
// 100000, grouped-query attention, SwiGLU) at small widths unlike the example's: 3 query heads of
// 8 features sharing 1 key / value head, 3 blocks, an MLP of 20, a vocabulary of 41, 6 positions.
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
                                        .intermediate_size = 20};
inline constexpr remat::Model model = remat::checked([] { return smollm2::architecture(config); });
inline constexpr remat::Policy policy = remat::none;
// Its trainer (train-smol-tiny), for tests/transformers_models.py: token files it is given.
inline constexpr remat::TrainerDefaults trainer{.batch = 2, .max_steps = 1, .eval_samples = 0, .transformers = "llama"};
}  // namespace smol_tiny
