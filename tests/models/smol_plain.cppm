// examples/smollm2's architecture with SmolLM2-135M's own kinds of config fields, at small widths:
// no biases, plain RoPE of base 100000 (no rope_scaling), head_dim = hidden_size /
// num_attention_heads (6 heads of 8 sharing 2 key / value heads), tied LM head; 2 blocks, an MLP of
// 32, a vocabulary of 53, 16 positions. For tests/transformers_models.py (train-smol-plain), where
// smol_tiny covers the fields SmolLM2 leaves at their defaults.
export module smol_plain;
import remat.language;
import smollm2;

export namespace smol_plain {
inline constexpr smollm2::Config config{.vocab_size = 53,
                                        .context = 16,
                                        .num_hidden_layers = 2,
                                        .num_attention_heads = 6,
                                        .num_key_value_heads = 2,
                                        .hidden_size = 48,
                                        .intermediate_size = 32};
inline constexpr remat::Model model = remat::checked([] { return smollm2::architecture(config); });
inline constexpr remat::Policy policy = remat::none;
// Its trainer (train-smol-plain): token files it is given.
inline constexpr remat::TrainerDefaults trainer{.batch = 2, .max_steps = 1, .eval_samples = 0, .transformers = "llama"};
}  // namespace smol_plain
