// GPT-2 small (124M), exactly Transformers' GPT2LMHeadModel at its published config: token and
// position embeddings ("wte", "wpe"), 12 pre-LayerNorm blocks (a fused q/k/v projection with bias,
// causal attention of 12 heads, an output projection, an MLP of 4x width with gelu_new, dropout on
// both residual branches and the attention probabilities), a final LayerNorm and the LM head, whose
// weight is the token table (tie_word_embeddings): 124,439,808 parameters.
//
// `architecture(config)` writes the model for any GPT-2 config; the tests build the same function
// at small widths (tests/models/gpt2_tiny.cppm) and check it against Transformers.
export module gpt2;
import remat.language;

export namespace gpt2 {
// The shape fields of a GPT-2 config.json (n_inner 0: 4 n_embd; activation_function gelu_new, or
// gelu with gelu_exact; T is n_positions: the context the kernels are generated for).
struct Config {
  int vocab_size, n_positions, n_layer, n_head, n_embd;
  int n_inner = 0;
  double layer_norm_epsilon = 1e-5;
  bool gelu_exact = false;
};
inline constexpr Config small{.vocab_size = 50257, .n_positions = 1024, .n_layer = 12, .n_head = 12, .n_embd = 768};

// Blocks are checkpointed (full) unless --checkpoint-policy says otherwise; run selectively they
// keep q/k/v, the MLP's first GEMM output and their inputs, and rebuild the attention core, GELU
// and both LayerNorm outputs (from the saved row statistics: a pass over [T, C], against 6 MiB a
// block kept at T 1024).
inline constexpr remat::Policy blocks_policy =
    remat::full | remat::selective_set(remat::recompute_modules(remat::core_attn, remat::activation, remat::norm));

constexpr remat::Model architecture(const Config &c) {
  const int C = c.n_embd, inner = c.n_inner ? c.n_inner : 4 * C;
  const remat::Epsilon eps = remat::epsilon(c.layer_norm_epsilon);
  const remat::Block block =
      remat::chain(remat::residual(remat::layer_norm(eps), remat::linear(C, 3 * C),
                                   remat::causal_self_attention(c.n_head), remat::linear(C, C), remat::dropout()),
                   remat::residual(remat::layer_norm(eps), remat::linear(C, inner),
                                   c.gelu_exact ? remat::gelu(remat::gelu_exact) : remat::gelu(),
                                   remat::linear(inner, C), remat::dropout()));
  return remat::make_model(remat::tokens(c.vocab_size, c.n_positions),
                           remat::name("wte", remat::embedding(c.vocab_size, C)), remat::dropout(),
                           remat::repeat(c.n_layer, block, blocks_policy), remat::layer_norm(eps),
                           remat::linear(C, c.vocab_size, remat::no_bias, remat::tied_to("wte")),
                           remat::softmax_cross_entropy(c.vocab_size));
}

inline constexpr remat::Model model = remat::checked([] { return architecture(small); });

// The policy `make train-gpt2` uses unless --checkpoint-policy says otherwise.
inline constexpr remat::Policy policy = remat::full;
// Its trainer (train-gpt2): the BPE token files of `make train-gpt2` (build/data/fortunes-bpe,
// ids < 4096 of GPT-2's 50257), one sequence of 1024 tokens a step, a short run that shows the
// loss falling on two cores.
inline constexpr remat::TrainerDefaults trainer{.data_dir = "build/data/fortunes-bpe",
                                                .batch = 1,
                                                .max_steps = 30,
                                                .learning_rate = 6e-4,
                                                .warmup_steps = 5,
                                                .eval_samples = 4,
                                                .eval_steps = 0,
                                                .sample_length = 0,
                                                .transformers = "gpt2"};
}  // namespace gpt2
