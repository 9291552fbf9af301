// A GPT over byte-level BPE tokens: the character GPT's blocks (examples/gpt) with a vocabulary of
// 4096 tokens from scripts/bpe.py, 4 pre-LayerNorm transformer blocks, 128 wide, T = 64
// tokens. Its trainer reads token files (remat_add_trainer(... DATA tokens)): `make train-gpt-bpe`
// writes them into build/data/fortunes-bpe/ and trains.
export module gpt_bpe;
import remat.language;

export namespace gpt_bpe {
inline constexpr int vocab = 4096;     // scripts/bpe.py --vocab (its default)
inline constexpr int block_size = 64;  // T: tokens of context (about 190 characters of fortunes)
inline constexpr int n_layer = 4, n_head = 4, n_embd = 128;

inline constexpr remat::Block transformer_block =
    remat::chain(remat::residual(remat::layer_norm(), remat::linear(n_embd, 3 * n_embd),
                                 remat::causal_self_attention(n_head), remat::linear(n_embd, n_embd), remat::dropout()),
                 remat::residual(remat::layer_norm(), remat::linear(n_embd, 4 * n_embd), remat::gelu(),
                                 remat::linear(4 * n_embd, n_embd), remat::dropout()));

inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(remat::tokens(vocab, block_size), remat::embedding(vocab, n_embd), remat::dropout(),
                           remat::repeat(n_layer, transformer_block), remat::layer_norm(), remat::linear(n_embd, vocab),
                           remat::softmax_cross_entropy(vocab));
});

inline constexpr remat::Policy policy = remat::selective;
// Its trainer (train-gpt-bpe): the token files of `make train-gpt-bpe` (--data-dir, or
// --train-file / --validation-file), relative to the checkout; a sample of 100 tokens at the end
// (printed as `sample ids: ...`, which scripts/bpe.py decode turns into text).
inline constexpr remat::TrainerDefaults trainer{.data_dir = "build/data/fortunes-bpe",
                                                .batch = 32,
                                                .max_steps = 600,
                                                .learning_rate = 2e-3,
                                                .warmup_steps = 60,
                                                .eval_samples = 256,
                                                .eval_steps = 150,
                                                .sample_length = 100};

}  // namespace gpt_bpe
