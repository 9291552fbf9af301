// examples/gpt2's architecture (GPT2LMHeadModel: tied LM head, gelu_new, LayerNorm eps) at small
// widths unlike the example's: 3 heads of 8 features, an MLP of 40 (n_inner, not 4 x 24), 2 blocks,
// a vocabulary of 37, and the example's 1024 positions (attention by rows, a head at a time).
export module gpt2_tiny;
import remat.language;
import gpt2;

export namespace gpt2_tiny {
inline constexpr gpt2::Config config{
    .vocab_size = 37, .n_positions = 1024, .n_layer = 2, .n_head = 3, .n_embd = 24, .n_inner = 40};
inline constexpr remat::Model model = remat::checked([] { return gpt2::architecture(config); });
inline constexpr remat::Policy policy = remat::none;
// Its trainer (train-gpt2-tiny), for tests/transformers_models.py: token files it is given.
inline constexpr remat::TrainerDefaults trainer{.batch = 2, .max_steps = 1, .eval_samples = 0, .transformers = "gpt2"};
}  // namespace gpt2_tiny
