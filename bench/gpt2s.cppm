// The GPT of examples/gpt at GPT-2-small shape, for the GPU benchmark: 12 blocks, 768 wide, 12
// heads, T = 1024, GPT-2's vocabulary padded to 50304 (a multiple of 64, as nanoGPT does).
export module gpt2s;
import remat.language;

export namespace gpt2s {
inline constexpr int vocab = 50304, block_size = 1024;
inline constexpr int n_layer = 12, n_head = 12, n_embd = 768;

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
}  // namespace gpt2s
