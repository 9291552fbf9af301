// Causal self-attention on the host, the CPU kernels' attention (generators/kinds/attention/rules.h
// emits extern stages that call it): FlashAttention-style, by blocks of query rows and chunks of
// key positions, every inner product a sequential GEMM on Halide's threads (remat's fp32 tiles on
// AVX-512, its bf16 dot product on AVX512_BF16, else MKL). Nothing is allocated: a task's blocks
// live on its stack, the gradient's per-head sums in a planned workspace.
//
// Bits: every sum runs in an order fixed by the shapes alone (blocks, chunks and the GEMMs'
// own), so a call repeated on the same inputs (a recompute) gives the same bits, on any thread.
#pragma once

#include <cstdint>

namespace remat {

// One attention call. qkv is [rows, (H + 2 KV) D], rows = sequences x T: per row, H query heads
// of D features, then KV key heads and KV value heads; query head h reads key / value head
// h / (H / KV). Tensors marked "stored" hold fp32, or bf16 bits when bf16 (fp32 arithmetic,
// rounded to nearest even once when written); lse and delta are fp32, [rows, H].
struct AttentionCall {
  const void *qkv = nullptr;  // stored
  int rows = 0, T = 0, H = 0, KV = 0, D = 0;
  bool bf16 = false;
  bool fp32_dqkv = false;  // attention_grad_sum writes fp32 although bf16 (dqkv one term of a sum)
  // Dropout on the probabilities: P(t, s) of head h in sequence n is multiplied by scale or 0,
  // kept when the counter hash of (seed, step, block, ((n' H + h) T + t) T + s) has its top 32
  // bits >= threshold, with n' = (n T + first_row) / T: generators/kinds/dropout/algorithm.h's
  // counter_hash and attention_element, bit for bit.
  bool dropout = false;
  std::uint64_t seed = 0, threshold = 0;
  std::int32_t step = 0, block = 0, first_row = 0;
  float scale = 1;
};

// lse(h, row) = log sum_{s <= t} exp(q . k_s / sqrt(D)), t the row's position.
void attention_lse(const AttentionCall &a, float *lse);
// out [rows, H D] (stored) = sum_{s <= t} drop(exp(q . k_s / sqrt(D) - lse)) v_s, from lse (the
// forward's own or a saved one: a recompute gives the forward's bits).
void attention_out(const AttentionCall &a, const float *lse, void *out);
// The gradient dqkv [rows, (H + 2 KV) D] (stored) given dout [rows, H D] (stored) and
// delta(h, row) = dout . out over the head, in two steps. attention_grad_heads writes per_head
// [rows, 3 H D] fp32: for each query head its dq, then each query head's dk, then each one's dv
// (dq and dk before the 1 / sqrt(D)), a task per (sequence, query head) in one pass over the
// causal triangle. attention_grad_sum forms dqkv from it: dk and dv summed over the query heads of
// their group in head order.
void attention_grad_heads(const AttentionCall &a, const float *lse, const void *dout, const float *delta,
                          float *per_head);
void attention_grad_sum(const AttentionCall &a, const float *per_head, void *dqkv);
// Both steps.
void attention_grad(const AttentionCall &a, const float *lse, const void *dout, const float *delta, float *per_head,
                    void *dqkv);

}  // namespace remat
