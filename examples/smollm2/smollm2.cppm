// SmolLM2-135M, exactly Transformers' LlamaForCausalLM with its config: a token embedding
// ("embed_tokens", no position table), 30 pre-RMSNorm blocks (bias-free q/k/v projections, RoPE
// of base 100000 on q and k, grouped-query causal attention of 9 query heads sharing 3 key / value
// heads of 64 features, an output projection, a SwiGLU MLP of 1536), a final RMSNorm (eps 1e-5)
// and the LM head, whose weight is the token table (tie_word_embeddings): 134,515,008 parameters.
//
// `architecture(config)` writes the model for any Llama config of this form; the tests build the
// same function at small widths (tests/models/smol_tiny.cppm) and check it against Transformers.
export module smollm2;
import remat.language;

export namespace smollm2 {
// The shape fields of a Llama config.json (head_dim 0: hidden_size / num_attention_heads;
// hidden_act silu; T: the context the kernels are generated for, at most max_position_embeddings).
struct Config {
  int vocab_size, context, num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size, intermediate_size;
  int head_dim = 0;
  double rms_norm_eps = 1e-5, rope_theta = 100000;
  bool attention_bias = false, mlp_bias = false;  // on q, k, v and o; on gate, up and down
  remat::Layer::RopeScaling rope_scaling{};       // rope_type "llama3": remat::rope_llama3(...)
};
inline constexpr Config smollm2_135m{.vocab_size = 49152,
                                     .context = 1024,
                                     .num_hidden_layers = 30,
                                     .num_attention_heads = 9,
                                     .num_key_value_heads = 3,
                                     .hidden_size = 576,
                                     .intermediate_size = 1536};

// Blocks are checkpointed (full) unless --checkpoint-policy says otherwise; run selectively they
// keep q/k/v after RoPE, the gate and up projections and their inputs, and rebuild the attention
// core, SwiGLU and both RMSNorm outputs (from the saved row statistics).
inline constexpr remat::Policy blocks_policy =
    remat::full | remat::selective_set(remat::recompute_modules(remat::core_attn, remat::activation, remat::norm));

constexpr remat::Model architecture(const Config &c) {
  const int C = c.hidden_size, H = c.num_attention_heads, KV = c.num_key_value_heads, I = c.intermediate_size;
  const int D = c.head_dim ? c.head_dim : C / H;
  const auto linear = [](int in, int out, bool bias) {
    return bias ? remat::linear(in, out) : remat::linear(in, out, remat::no_bias);
  };
  const remat::Epsilon eps = remat::epsilon(c.rms_norm_eps);
  const remat::Block block = remat::chain(
      remat::residual(remat::rms_norm(eps), linear(C, (H + 2 * KV) * D, c.attention_bias),
                      remat::rope(H, KV, remat::rope_theta(c.rope_theta), c.rope_scaling),
                      remat::causal_self_attention(H, KV), linear(H * D, C, c.attention_bias)),
      remat::residual(remat::rms_norm(eps), linear(C, 2 * I, c.mlp_bias), remat::swiglu(), linear(I, C, c.mlp_bias)));
  return remat::make_model(remat::tokens(c.vocab_size, c.context),
                           remat::name("embed_tokens", remat::token_embedding(c.vocab_size, C)),
                           remat::repeat(c.num_hidden_layers, block, blocks_policy), remat::rms_norm(eps),
                           remat::linear(C, c.vocab_size, remat::no_bias, remat::tied_to("embed_tokens")),
                           remat::softmax_cross_entropy(c.vocab_size));
}

inline constexpr remat::Model model = remat::checked([] { return architecture(smollm2_135m); });

// The policy `make train-smollm2` uses unless --checkpoint-policy says otherwise.
inline constexpr remat::Policy policy = remat::full;
// Its trainer (train-smollm2): the BPE token files of `make train-smollm2`, one sequence of 1024
// tokens a step, a short run that shows the loss falling on two cores.
inline constexpr remat::TrainerDefaults trainer{.data_dir = "build/data/fortunes-bpe",
                                                .batch = 1,
                                                .max_steps = 20,
                                                .learning_rate = 1e-3,
                                                .warmup_steps = 4,
                                                .eval_samples = 4,
                                                .eval_steps = 0,
                                                .sample_length = 0,
                                                .transformers = "llama"};
}  // namespace smollm2
