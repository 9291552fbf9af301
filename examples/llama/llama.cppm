// A small Llama-style character model: token embedding (no position table), 6 pre-RMSNorm blocks
// (bias-free q/k/v projection, rotary position embedding, grouped-query causal attention of 4
// query heads sharing 2 key / value heads, SwiGLU MLP), a final RMSNorm and a bias-free LM head.
//
// Sizes are compile-time constants: the generated kernels are specialized to them.
export module llama;
import remat.language;

export namespace llama {
inline constexpr int vocab = 128;      // bytes; non-ASCII bytes are read as '?'
inline constexpr int block_size = 64;  // T: characters of context
inline constexpr int n_layer = 6, n_head = 4, n_kv_head = 2, n_embd = 128;
inline constexpr int head_dim = n_embd / n_head, qkv_width = (n_head + 2 * n_kv_head) * head_dim;
inline constexpr int hidden = 352;  // SwiGLU width: 8/3 n_embd rounded up to a multiple of 32, as Llama's

inline constexpr remat::Block llama_block = remat::chain(
    remat::residual(remat::rms_norm(), remat::linear(n_embd, qkv_width, remat::no_bias), remat::rope(n_head, n_kv_head),
                    remat::causal_self_attention(n_head, n_kv_head), remat::linear(n_embd, n_embd, remat::no_bias)),
    remat::residual(remat::rms_norm(), remat::linear(n_embd, 2 * hidden, remat::no_bias), remat::swiglu(),
                    remat::linear(hidden, n_embd, remat::no_bias)));

inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(remat::tokens(vocab, block_size), remat::token_embedding(vocab, n_embd),
                           remat::repeat(n_layer, llama_block), remat::rms_norm(),
                           remat::linear(n_embd, vocab, remat::no_bias), remat::softmax_cross_entropy(vocab));
});

// The policy `make train-llama` uses unless --checkpoint-policy says otherwise.
inline constexpr remat::Policy policy = remat::selective;
inline constexpr int default_batch = 32;  // sequences of block_size characters
// Its trainer (train-llama): the GPT's corpus and schedule.
inline constexpr remat::TrainerDefaults trainer{.data_dir = "/usr/share/games/fortunes",
                                                .batch = default_batch,
                                                .max_steps = 1500,
                                                .learning_rate = 2e-3,
                                                .warmup_steps = 100,
                                                .eval_samples = 256,
                                                .eval_steps = 250,
                                                .sample_length = 400};

}  // namespace llama
