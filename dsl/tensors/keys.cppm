// Partition remat.tensors:keys: tensor keys (what a tensor is, made in one place), a tensor's
// name, a kernel's tensor (LocalTensor), precisions and element types.
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>
export module remat.tensors:keys;
import remat.language;

export namespace remat {

// ---------------------------------------------------------------------------------------------
// Tensor keys: what a tensor is, made in one place (the constructors in namespace `key` below) and
// compared as a value. A kernel's arguments (LocalTensor), the plan's tensors (Tensor) and the
// runtime's handles are found by their keys; name_of(key) is a tensor's name, for display only
// (plan report, messages, safetensors, Halide's Func names). R = rows (B samples x rows per
// sample); within a block, k is the layer:
//   x [R, C_in]  block input (token ids [R] for an embedding)     y [R, C_out] block output
//   h<k> [R, C]  output of layer k (k < last)                      dx, dy  their gradients
//   p<k>_w, p<k>_b  parameters of layer k (the kind's Kind::params: linear: w [K, O] row-major so
//                   y = x w + b; layer_norm: gamma, beta [C]; embedding: token table [V, C],
//                   positions [T, C]);   g<k>_w, g<k>_b  their gradients (g<k>_w_prev: what an
//                   accumulating backward reads)
//   mean<k>, rstd<k> [R] LayerNorm row statistics; att<k>_lse [R, H] attention log-sum-exp (the
//                   kind's Kind::stats)
// Backward workspace: dh<k> [R, C] gradient of h<k>; s<k>_1, s<k>_2 [R] LayerNorm row sums,
//   att<k>_delta [R, H] (the kind's Kind::workspace); p<k>_w16, p<k>_b16 bf16 copies of a
//   linear's weight and bias; dp<k> [R, K] a GEMM's product, when the linear's input has other
//   gradients too.
// ---------------------------------------------------------------------------------------------
enum class Slot : std::uint8_t {
  // a block's
  block_input,    // x
  block_output,   // y
  output_grad,    // dy
  input_grad,     // dx
  layer_output,   // h<layer>
  layer_grad,     // dh<layer>
  parameter,      // the layer's parameter `index` (its kind's Kind::params)
  gradient,       // ... its gradient
  gradient_prev,  // ... its gradient as an accumulating backward reads it
  statistic,      // the layer's statistic `index` (its kind's Kind::stats)
  workspace,      // the layer's backward workspace `index` (its kind's Kind::workspace)
  weight_copy,    // a linear's bf16 weight (index 0) or bias (index 1)
  product,        // a GEMM's product dy w^T
  // the loss kernel's
  logits,
  labels,
  dlogits,
  row_loss,
  row_correct,
  row_max,
  row_lse,
  // AdamW's, over a flat range of parameters (the plan's ranges: index 0 decayed, 1 not)
  adamw_param,
  adamw_grad,
  adamw_m,
  adamw_v,
  // the plan's persistent buffers (per-layer parameters and gradients are views into them)
  params,
  grads,
  adam_m,
  adam_v,
  inputs,
  exchange,  // data-parallel training: what a rank receives of another's gradient, to add
};

// The phase a plan tensor belongs to: a training micro-batch, or evaluation (forward and loss).
enum class Phase : std::uint8_t { train, eval };

struct TensorKey {
  Slot slot{};
  Op op{};                 // the kind of `layer` (its statistics and workspace are named by it)
  std::int8_t layer = -1;  // -1: none
  std::int8_t index = 0;   // which of the layer's parameters, statistics, workspace; AdamW's range
  std::int8_t stage = -1;  // plan tensors of a block: its stage and its index in the stage (-1: none)
  std::int16_t block = -1;
  Phase phase = Phase::train;
  constexpr bool operator==(const TensorKey &) const = default;
  constexpr auto operator<=>(const TensorKey &) const = default;
  // The same tensor of a kernel (no block placement, training phase), as signatures list it.
  constexpr TensorKey local() const {
    TensorKey k = *this;
    k.stage = -1;
    k.block = -1;
    k.phase = Phase::train;
    return k;
  }
  // The tensor of this kernel at block `b` of stage `s` in phase `p`.
  constexpr TensorKey at(int s, int b, Phase p = Phase::train) const {
    TensorKey k = *this;
    k.stage = std::int8_t(s);
    k.block = std::int16_t(b);
    k.phase = p;
    return k;
  }
};

// The keys, each made here only.
namespace key {
constexpr TensorKey of(Slot s) { return {.slot = s}; }
constexpr TensorKey of(Slot s, Op op, int layer, int index = 0) {
  return {.slot = s, .op = op, .layer = std::int8_t(layer), .index = std::int8_t(index)};
}
constexpr TensorKey of(Slot s, const Block &b, int layer, int index = 0) {
  return of(s, b.layers[layer].op, layer, index);
}
constexpr TensorKey block_input() { return of(Slot::block_input); }
constexpr TensorKey block_output() { return of(Slot::block_output); }
constexpr TensorKey output_grad() { return of(Slot::output_grad); }
constexpr TensorKey input_grad() { return of(Slot::input_grad); }
constexpr TensorKey layer_output(const Block &b, int k) { return of(Slot::layer_output, b, k); }
constexpr TensorKey layer_grad(const Block &b, int k) { return of(Slot::layer_grad, b, k); }
constexpr TensorKey parameter(const Block &b, int k, int i) { return of(Slot::parameter, b, k, i); }
constexpr TensorKey statistic(const Block &b, int k, int i) { return of(Slot::statistic, b, k, i); }
constexpr TensorKey workspace(const Block &b, int k, int i) { return of(Slot::workspace, b, k, i); }
constexpr TensorKey weight_copy(const Block &b, int k, int i) { return of(Slot::weight_copy, b, k, i); }
constexpr TensorKey product(const Block &b, int k) { return of(Slot::product, b, k); }
// A parameter's gradient (as written, or as an accumulating backward reads it).
constexpr TensorKey gradient(TensorKey parameter, bool previous = false) {
  parameter.slot = previous ? Slot::gradient_prev : Slot::gradient;
  return parameter;
}
// An AdamW argument over the plan's flat range `range` (0 decayed, 1 not; -1: the kernel's own).
constexpr TensorKey adamw(Slot s, int range = -1) { return {.slot = s, .index = std::int8_t(range)}; }
}  // namespace key

// A tensor's name, for display only (nothing in remat parses it; safetensors files carry it): s<stage>.b<block>.<local>
// for a block's tensors in a plan, eval. before those of evaluation, the local name alone in a kernel.
constexpr Name name_of(const TensorKey &k) {
  Name n;
  if (k.phase == Phase::eval) n.append("eval.");
  if (k.stage >= 0) n.append("s").append(int(k.stage)).append(".b").append(int(k.block)).append(".");
  const int l = k.layer;
  auto rule_name = [&](const TensorRule &r, std::string_view prefix = {}, std::string_view suffix = {}) -> Name & {
    return n.append(prefix.empty() ? r.stem : prefix).append(l).append(r.suffix).append(suffix);
  };
  const Kind &kd = kind(k.op);
  switch (k.slot) {
  case Slot::block_input: return n.append("x");
  case Slot::block_output: return n.append("y");
  case Slot::output_grad: return n.append("dy");
  case Slot::input_grad: return n.append("dx");
  case Slot::layer_output: return n.append("h").append(l);
  case Slot::layer_grad: return n.append("dh").append(l);
  case Slot::parameter: return rule_name(kd.params[k.index]);
  case Slot::gradient: return rule_name(kd.params[k.index], "g");
  case Slot::gradient_prev: return rule_name(kd.params[k.index], "g", "_prev");
  case Slot::statistic: return rule_name(kd.stats[k.index]);
  case Slot::workspace: return rule_name(kd.workspace[k.index]);
  case Slot::weight_copy: return n.append("p").append(l).append(k.index == 0 ? "_w16" : "_b16");
  case Slot::product: return n.append("dp").append(l);
  case Slot::logits: return n.append("logits");
  case Slot::labels: return n.append("labels");
  case Slot::dlogits: return n.append("dlogits");
  case Slot::row_loss: return n.append("row_loss");
  case Slot::row_correct: return n.append("row_correct");
  case Slot::row_max: return n.append("row_max");
  case Slot::row_lse: return n.append("row_lse");
  case Slot::adamw_param:
  case Slot::adamw_grad:
  case Slot::adamw_m:
  case Slot::adamw_v: {
    constexpr std::string_view parts[] = {"p", "g", "m", "v"};
    n.append(parts[int(k.slot) - int(Slot::adamw_param)]);
    return k.index < 0 ? n : n.append(k.index == 0 ? "_decayed" : "_plain");
  }
  case Slot::params: return n.append("params");
  case Slot::grads: return n.append("grads");
  case Slot::adam_m: return n.append("adam_m");
  case Slot::adam_v: return n.append("adam_v");
  case Slot::inputs: return n.append("inputs");
  case Slot::exchange: return n.append("gradient_exchange");
  }
  return n;
}

struct LocalTensor {
  // activation: values and gradients of the data flowing through the layers (bf16 in a bf16
  // plan); statistic: per-row sums, LayerNorm and attention statistics; parameter: weights and
  // their gradients. Statistics and parameters are always fp32. index: token ids, class labels
  // and per-row correctness (int32).
  enum class Kind : std::uint8_t { activation, statistic, parameter, index };
  TensorKey key;
  int dims = 2;                 // extent[0] is the innermost (contiguous) dimension
  std::array<int, 2> extent{};  // -1: the row count R
  bool decay = false;           // parameters: AdamW weight decay applies
  Kind kind = Kind::activation;
  Init init = Init::zeros;                           // parameters: how the trainer starts them
  constexpr int layer() const { return key.layer; }  // the layer that produces it (-1: none)
  constexpr long long elements(long long rows) const {
    long long n = 1;
    for (int d = 0; d < dims; ++d) n *= extent[d] < 0 ? rows : extent[d];
    return n;
  }
};

constexpr LocalTensor rows(TensorKey key, int width) { return {key, 2, {width, -1}}; }
constexpr LocalTensor row_stat(TensorKey key) { return {key, 1, {-1, 0}, false, LocalTensor::Kind::statistic}; }

// Precision of a plan and its kernels. bf16: activations, their gradients and GEMM operands are
// bf16 (every layer output is rounded to bf16 where it is computed, so a recompute rounds the
// same way); GEMMs and reductions accumulate in fp32; parameters, their gradients, the AdamW
// moments and all statistics stay fp32.
enum class Precision : std::uint8_t { fp32, bf16 };
constexpr std::string_view precision_name(Precision p) { return p == Precision::bf16 ? "bf16" : "fp32"; }
// The element type of a tensor in a kernel (bf16 values are stored as their 16 bits).
enum class Element : std::uint8_t { f32, bf16, i32, u64, boolean };
// Activations (layer outputs, the logits, their gradients) are the only tensors in the precision.
constexpr Element activation_element(Precision p) { return p == Precision::bf16 ? Element::bf16 : Element::f32; }
constexpr Element element_of(const LocalTensor &lt, Precision p) {
  if (lt.kind == LocalTensor::Kind::index) return Element::i32;
  return lt.kind == LocalTensor::Kind::activation ? activation_element(p) : Element::f32;
}
constexpr int element_bytes(Element e) {
  switch (e) {
  case Element::bf16: return 2;
  case Element::u64: return 8;
  case Element::boolean: return 1;
  case Element::f32:
  case Element::i32: return 4;
  }
  return 4;
}
constexpr int element_bytes(const LocalTensor &lt, Precision p) { return element_bytes(element_of(lt, p)); }

}  // namespace remat
