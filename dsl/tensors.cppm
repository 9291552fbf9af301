// module remat.tensors: the tensor rules. What each block kernel keeps, rebuilds and needs as
// workspace under a Keep, the element type of each tensor under a precision, and every kernel's
// typed signature (its ordered arguments). The model compiler imports this (and the language it
// re-exports), not the planner: editing the planner regenerates no kernels.
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>
export module remat.tensors;
export import remat.language;

export namespace remat {

// Whether a stage's backward computes the gradient of its block input: every stage but the
// model's first, and the first too when it is repeated (its later blocks feed each other).
constexpr bool needs_input_grad(const Model &m, int stage) { return stage > 0 || m.stages[0].repeat > 1; }

// What a block's forward keeps for its backward.
enum class Keep : std::uint8_t {
  all,        // everything backward reads
  selective,  // all but what selective_recomputes() rebuilds
  nothing,    // only the block input is kept elsewhere; backward recomputes everything
};

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

constexpr LocalTensor output_of(const Block &b, int k) { return rows(key::layer_output(b, k), b.layers[k].out); }

// The tensor rule `index` of a kind's `slot` (parameter, statistic or workspace) describes, for
// layer k of block b.
constexpr LocalTensor tensor_of(Slot slot, int index, const Block &b, int k, LocalTensor::Kind kind) {
  const Layer &l = b.layers[k];
  const TensorRules &rules = slot == Slot::parameter   ? remat::kind(l.op).params
                             : slot == Slot::statistic ? remat::kind(l.op).stats
                                                       : remat::kind(l.op).workspace;
  const TensorRule &r = rules[std::size_t(index)];
  LocalTensor t{key::of(slot, b, k, index), r.dims, {}, r.decay, kind, r.init};
  for (int d = 0; d < r.dims; ++d) t.extent[d] = int(dim_of(l, r.extent[d]));
  if (slot == Slot::parameter && index == 0 && l.tied()) t.extent = {l.in, l.out};  // the token table [V, C]
  return t;
}

// A tied linear's weight (remat::tied_to) is its target's parameter: the plan gives it no slot of
// its own, and the kernels read it (and write its gradient) transposed.
constexpr bool tied_weight(const Block &b, const TensorKey &k) {
  return k.slot == Slot::parameter && k.index == 0 && b.layers[k.layer].tied();
}
// Whether a later stage's layer shares a parameter of `stage`: its backward then adds to a
// gradient that the later stage's backward wrote first in the same micro-batch.
constexpr bool shares_parameter(const Model &m, int stage) {
  for (int s = stage + 1; s < m.n_stages; ++s)
    for (int k = 0; k < m.stages[s].n_layers; ++k)
      if (m.stages[s].layers[k].tie_stage == stage) return true;
  return false;
}
constexpr void add_tensors(std::vector<LocalTensor> &to, Slot slot, const Block &b, int k, LocalTensor::Kind kind,
                           bool input_grad = true) {
  const Kind &kd = remat::kind(b.layers[k].op);
  const TensorRules &rules = slot == Slot::parameter ? kd.params : slot == Slot::statistic ? kd.stats : kd.workspace;
  for (int i = 0; i < int(rules.size()); ++i)
    if (present(rules[std::size_t(i)], b.layers[k], input_grad)) to.push_back(tensor_of(slot, i, b, k, kind));
}

constexpr std::vector<LocalTensor> stats_of(const Block &b, int k) {
  std::vector<LocalTensor> out;
  add_tensors(out, Slot::statistic, b, k, LocalTensor::Kind::statistic);
  return out;
}

// How many layers read output j (as their input, or as the skip of a residual).
constexpr int consumers(const Block &b, int j) {
  int n = 0;
  for (int k = j + 1; k < b.n_layers; ++k)
    n += (b.produces(k) && b.source(k) == j) + (b.layers[k].op == Op::residual_end && b.skip_source(k) == j);
  return n;
}

// Every GEMM of a linear layer is an extern stage calling a GEMM library (MKL on the CPU,
// cuBLASLt on CUDA, a host GEMM for the OpenCL test build): its operands and result are buffers,
// its only epilogue the bias. So every linear input and output is a buffer.

// An epilogue chain: linear -> dropout / residual sum -> ..., each element computed once from
// the linear's output: it runs elementwise from the GEMM's buffer. Output j continues such a chain
// when it starts or continues one, nothing reads it but the next layer of the chain, and backward
// does not read it.
constexpr bool continues_chain(const Block &b, int j) {
  if (!is_internal(b, j) || read_by_backward(b, j) || consumers(b, j) != 1) return false;
  if (!kind(b.layers[j + 1].op).chain_link || b.source(j + 1) != j) return false;
  const Kind &k = kind(b.layers[j].op);
  if (k.gemm) return true;
  return k.chain_link && b.source(j) >= 0 && continues_chain(b, b.source(j));
}
constexpr bool feeds_linear(const Block &b, int j) {
  for (int k = j + 1; k < b.n_layers; ++k)
    if (b.source(k) == j && kind(b.layers[k].op).gemm) return true;
  return false;
}

// Output j has a buffer of its own whenever it exists outside registers: GEMM, GELU and
// attention outputs, every linear input, and the end of an epilogue chain (its dropout masks are
// hashed once, not by each reader). Everything else (LayerNorm output, ReLU, dropout and
// residual sums of buffered values) is rebuilt elementwise where it is used.
constexpr bool materialized(const Block &b, int j) {
  if (!b.produces(j)) return false;
  const Kind &k = kind(b.layers[j].op);
  if (k.buffered || feeds_linear(b, j)) return true;
  return k.chain_link && b.source(j) >= 0 && continues_chain(b, b.source(j)) && !continues_chain(b, j);
}

constexpr bool saved(const Block &b, int j, Keep keep) {
  switch (keep) {
  case Keep::all: return read_by_backward(b, j);
  case Keep::selective: return read_by_backward(b, j) && materialized(b, j) && !selective_recomputes(b, j);
  case Keep::nothing: return false;
  }
  return false;
}

// bf16 GEMMs read a bf16 copy of the linear's weight, made once per kernel call into its own
// workspace (the master weights stay fp32), and a bf16 copy of its bias (cuBLASLt's bias
// epilogue takes the output's element type).
constexpr bool weight_copy(Precision p) { return p == Precision::bf16; }
constexpr bool bias_copy(Precision p) { return p == Precision::bf16; }
constexpr LocalTensor weight_copy_of(const Block &b, int k) {
  const Layer &l = b.layers[k];
  return {key::weight_copy(b, k, 0), 2, l.tied() ? std::array{l.in, l.out} : std::array{l.out, l.in}};
}
constexpr LocalTensor bias_copy_of(const Block &b, int k) {
  return {key::weight_copy(b, k, 1), 1, {b.layers[k].out, 0}};
}
constexpr void add_parameter_copies(std::vector<LocalTensor> &to, const Block &b, int k, Precision p) {
  if (!kind(b.layers[k].op).gemm) return;
  if (weight_copy(p)) to.push_back(weight_copy_of(b, k));
  if (bias_copy(p) && b.layers[k].bias) to.push_back(bias_copy_of(b, k));
}

// A kernel's tensors besides x, y, dy, dx and parameters.
struct KernelTensors {
  std::vector<LocalTensor> saved;      // written by forward and kept; read by backward
  std::vector<LocalTensor> scratch;    // internals written and dropped within the kernel call
  std::vector<LocalTensor> workspace;  // the kernel's own short-lived buffers (gradients, weight copies)
};

// Forward: what the policy keeps is written out; outputs that cannot be rebuilt in registers
// (GEMM, GELU, attention, statistics) go to scratch; cheap ones stay in registers.
constexpr KernelTensors forward_tensors(const Block &b, Keep keep, Precision p = Precision::fp32) {
  KernelTensors t;
  for (int j = 0; j < b.n_layers; ++j) {
    if (is_internal(b, j)) {
      if (saved(b, j, keep))
        t.saved.push_back(output_of(b, j));
      else if (materialized(b, j))
        t.scratch.push_back(output_of(b, j));
    }
    for (const LocalTensor &st : stats_of(b, j)) (keep == Keep::nothing ? t.scratch : t.saved).push_back(st);
    add_parameter_copies(t.workspace, b, j, p);
  }
  return t;
}

// Backward: reads the saved tensors; rebuilds what it reads but was not saved, with the
// outputs those depend on (materialized unless cheap); and its own workspace.
// The input gradient of linear k is written by the GEMM into its own buffer dp<k> when the
// linear's input also gets gradient from elsewhere (then the sum is formed after, and rounded
// once: dp<k> stays fp32, like a statistic).
constexpr bool product_buffer(const Block &b, int k) {
  return kind(b.layers[k].op).gemm && consumers(b, b.source(k)) > 1;
}
constexpr LocalTensor product_of(const Block &b, int k) {
  return {key::product(b, k), 2, {b.layers[k].in, -1}, false, LocalTensor::Kind::statistic};
}

// The outputs a backward under `keep` rebuilds: those it reads but were not saved, and the
// outputs those depend on.
constexpr std::array<bool, max_block_layers> rebuilt_by_backward(const Block &b, Keep keep) {
  std::array<bool, max_block_layers> needed{};
  for (int j = 0; j < b.n_layers; ++j) needed[j] = read_by_backward(b, j) && !saved(b, j, keep);
  for (int j = b.n_layers - 1; j >= 0; --j) {  // inputs of what is rebuilt are needed too
    if (!needed[j]) continue;
    for (int i : {b.source(j), b.layers[j].op == Op::residual_end ? b.skip_source(j) : -1})
      if (i >= 0 && !saved(b, i, keep)) needed[i] = true;
  }
  return needed;
}

// Backward writes the gradient of output j over the gradient of its one reader k when k is
// elementwise: each element of dh<j> comes from the same element of dh<k>, which nothing reads
// after. The reader whose gradient's memory dh<j> takes (-1: none).
constexpr int gradient_written_over(const Block &b, int j) {
  if (!is_internal(b, j) || consumers(b, j) != 1) return -1;
  for (int k = j + 1; k < b.n_layers; ++k)
    if (b.produces(k) && b.source(k) == j)
      return kind(b.layers[k].op).elementwise && is_internal(b, k) && b.layers[k].out == b.layers[j].out ? k : -1;
  return -1;  // read by a residual's skip alone
}
// The layer whose gradient's memory dh<j> uses: j, or the end of a chain of such readers.
constexpr int gradient_memory(const Block &b, int j) {
  for (int k = gradient_written_over(b, j); k >= 0; k = gradient_written_over(b, k)) j = k;
  return j;
}

constexpr KernelTensors backward_tensors(const Block &b, Keep keep, bool needs_input_grad,
                                         Precision p = Precision::fp32) {
  KernelTensors t;
  const std::array<bool, max_block_layers> needed = rebuilt_by_backward(b, keep);
  for (int j = 0; j < b.n_layers; ++j) {
    if (is_internal(b, j) && saved(b, j, keep)) t.saved.push_back(output_of(b, j));
    // A rebuilt value that a linear's weight gradient reads is buffered even when cheap: the
    // gradient GEMM reads each element once per output tile.
    if (is_internal(b, j) && needed[j] && materialized(b, j)) t.scratch.push_back(output_of(b, j));
    for (const LocalTensor &st : stats_of(b, j)) (keep == Keep::nothing ? t.scratch : t.saved).push_back(st);
  }
  for (int j = 0; j < b.n_layers; ++j) {  // workspace
    const Layer &l = b.layers[j];
    const bool grad_in = b.source(j) >= 0 || needs_input_grad;
    if (is_internal(b, j)) t.workspace.push_back(rows(key::layer_grad(b, j), l.out));
    add_tensors(t.workspace, Slot::workspace, b, j, LocalTensor::Kind::statistic, grad_in);
    add_parameter_copies(t.workspace, b, j, p);
    if (product_buffer(b, j) && grad_in) t.workspace.push_back(product_of(b, j));
  }
  return t;
}

constexpr std::vector<LocalTensor> params(const Block &b) {
  std::vector<LocalTensor> out;
  for (int k = 0; k < b.n_layers; ++k) add_tensors(out, Slot::parameter, b, k, LocalTensor::Kind::parameter);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Kernels and the plan
// ---------------------------------------------------------------------------------------------
enum class Variant : std::uint8_t {
  forward_save,        // writes the block output and every internal backward reads
  forward_selective,   // ... except what the selective policy recomputes
  forward_discard,     // writes the block output; internals only as short-lived scratch
  backward_saved,      // backward from saved internals
  backward_selective,  // backward recomputing the attention core and GELU inside the kernel
  backward_recompute,  // backward with the whole forward recompute fused in; takes the block input
  loss,                // softmax cross-entropy: per-row loss, correctness and logits gradient
  adamw,               // optimizer update over a flat range of parameters
};

// The arithmetic of one call of a block's kernel over `rows` rows: its kinds' flops (GEMMs and
// attention products), backward's multiple of them, and the forward work a variant recomputes.
constexpr double kernel_flops(const Block &b, Variant v, long long rows) {
  double forward = 0, backward = 0, rebuilt_by_selective = 0;
  const std::array<bool, max_block_layers> rebuilt = rebuilt_by_backward(b, Keep::selective);
  for (int j = 0; j < b.n_layers; ++j) {
    const Kind &k = kind(b.layers[j].op);
    if (!k.flops) continue;
    const double f = double(rows) * k.flops(b.layers[j]);
    forward += f;
    backward += k.backward_flops * f;
    if (rebuilt[j]) rebuilt_by_selective += f;
  }
  switch (v) {
  case Variant::forward_save:
  case Variant::forward_selective:
  case Variant::forward_discard: return forward;
  case Variant::backward_saved: return backward;
  case Variant::backward_selective: return backward + rebuilt_by_selective;
  case Variant::backward_recompute: return backward + forward;
  case Variant::loss:
  case Variant::adamw: return 0;
  }
  return 0;
}

constexpr std::string_view variant_name(Variant v) {
  switch (v) {
  case Variant::forward_save: return "forward_save";
  case Variant::forward_selective: return "forward_selective";
  case Variant::forward_discard: return "forward_discard";
  case Variant::backward_saved: return "backward_saved";
  case Variant::backward_selective: return "backward_selective";
  case Variant::backward_recompute: return "backward_recompute";
  case Variant::loss: return "loss";
  case Variant::adamw: return "adamw";
  }
  return "?";
}

constexpr Variant forward_variant(Keep k) {
  return k == Keep::all         ? Variant::forward_save
         : k == Keep::selective ? Variant::forward_selective
                                : Variant::forward_discard;
}
constexpr Variant backward_variant(Keep k) {
  return k == Keep::all         ? Variant::backward_saved
         : k == Keep::selective ? Variant::backward_selective
                                : Variant::backward_recompute;
}

// What a kernel is: stage `stage`'s block kernel of a variant (stage -1: the loss or AdamW kernel) in
// a precision (AdamW works on fp32 only). The generated kernel tables list their kernels by it;
// the executor and the costs find kernels by it.
struct KernelKey {
  int stage = -1;
  Variant variant{};
  Precision precision = Precision::fp32;
  constexpr bool operator==(const KernelKey &) const = default;
  constexpr auto operator<=>(const KernelKey &) const = default;
};
constexpr KernelKey kernel_key(int stage, Variant v, Precision p) {
  if (v == Variant::loss || v == Variant::adamw) stage = -1;
  return {stage, v, v == Variant::adamw ? Precision::fp32 : p};
}
// A kernel's name, for display and as its C symbol (the model compiler's): <model>_s<stage>_<variant>,
// <model>_loss, <model>_adamw, with a _bf16 suffix for bf16 kernels; without a model, the name
// within one (_s2_backward_saved).
constexpr Name name_of(std::string_view model, const KernelKey &k) {
  Name n;
  n.append(model);
  if (k.stage >= 0) n.append("_s").append(k.stage);
  n.append("_").append(variant_name(k.variant));
  return k.precision == Precision::bf16 ? n.append("_bf16") : n;
}

// ---------------------------------------------------------------------------------------------
// Kernel signatures: the ordered, typed arguments of every kernel. The model compiler declares its
// Halide arguments from the signature, in order, and checks that the pipeline writes exactly its
// outputs; the planner binds every argument to a tensor of the plan (or a run-time scalar); the
// executor passes them by position. Order: the scalars, the buffers the kernel reads, the buffers
// it writes (Halide's own order: its inputs as declared, then the pipeline's outputs).
// ---------------------------------------------------------------------------------------------
// Whether a kernel reads a buffer or writes it (a Halide input or output). A buffer read and
// written in place (gradients accumulated, AdamW's state) is two arguments, one each way.
enum class Access : std::uint8_t { read, write };

// What an argument is to the plan: how the planner binds it.
enum class ArgRole : std::uint8_t {
  scalar,        // a run-time value (Scalar)
  block_input,   // x: the block's input (token ids for a token embedding); the loss kernel's logits
  block_output,  // y
  output_grad,   // dy, the gradient of y
  input_grad,    // dx, the gradient of x; the loss kernel's dlogits
  labels,        // the loss kernel's class of each row
  metric,        // the loss kernel's per-row loss, correctness, max and log-sum-exp
  saved,         // written by a forward and kept for the backward, which reads it
  scratch,       // an internal written and dropped within the call (a rebuilt one in backward)
  workspace,     // the kernel's own short-lived buffers (gradients inside the block, copies)
  in_place,      // a gradient inside the block written over another's (gradient_memory): its tensor
  parameter,     // a parameter; AdamW writes it in place
  gradient,      // a parameter's gradient: written by backward (read back as <name>_prev when
                 // accumulating), read by AdamW
  moment,        // AdamW's first or second moment, updated in place
};

enum class Scalar : std::uint8_t {
  accumulate,
  grad_scale,
  lr,
  beta1,
  beta2,
  eps,
  weight_decay,
  bias1,
  bias2,
  seed,
  step,
  rng_block,
  drop_threshold,
  drop_scale,
  first_row,
};
struct ScalarInfo {
  Scalar scalar;
  std::string_view name;
  Element element;
};
inline constexpr ScalarInfo scalars[] = {
    {Scalar::accumulate, "accumulate", Element::boolean},  // add to the gradients instead of overwriting them
    {Scalar::grad_scale, "grad_scale", Element::f32},      // 1 / rows per optimizer step
    {Scalar::lr, "lr", Element::f32},
    {Scalar::beta1, "beta1", Element::f32},
    {Scalar::beta2, "beta2", Element::f32},
    {Scalar::eps, "eps", Element::f32},
    {Scalar::weight_decay, "weight_decay", Element::f32},
    {Scalar::bias1, "bias1", Element::f32},  // AdamW bias corrections 1 - beta^t
    {Scalar::bias2, "bias2", Element::f32},
    {Scalar::seed, "seed", Element::u64},  // dropout: masks hash (seed, step, rng_block, element)
    {Scalar::step, "step", Element::i32},
    {Scalar::rng_block, "rng_block", Element::i32},  // per kernel call, from the plan
    {Scalar::drop_threshold, "drop_threshold", Element::u64},
    {Scalar::drop_scale, "drop_scale", Element::f32},
    // dropout: the call's first row within the optimizer step's global batch (over micro-batches
    // and ranks), so that every row of the global batch draws its own mask, whoever runs it
    {Scalar::first_row, "first_row", Element::i32},
};
static_assert(
    [] {
      for (int i = 0; i < int(std::size(scalars)); ++i)
        if (int(scalars[i].scalar) != i) return false;
      return true;
    }(),
    "remat::scalars must list the Scalars in the order of the enum");
constexpr const ScalarInfo &info(Scalar s) { return scalars[int(s)]; }

struct KernelArg {
  LocalTensor tensor;  // buffers: key, dims, extent (-1: rows), kind, init (scalars: none)
  ArgRole role{};
  Access access = Access::read;
  Element element = Element::f32;
  Scalar scalar{};   // role scalar: which
  int read_by = -1;  // saved: the layer whose backward reads it
  constexpr bool is_scalar() const { return role == ArgRole::scalar; }
};

constexpr bool is_backward(Variant v) {
  return v == Variant::backward_saved || v == Variant::backward_selective || v == Variant::backward_recompute;
}
constexpr Keep keep_of(Variant v) {
  switch (v) {
  case Variant::forward_save:
  case Variant::backward_saved: return Keep::all;
  case Variant::forward_selective:
  case Variant::backward_selective: return Keep::selective;
  default: return Keep::nothing;
  }
}

// Every kernel call gets at least this many rows (Halide's own GEMMs once needed it; it stays so
// that plans and the fused head's chunks, planner/strategy.cppm, are what they were).
inline constexpr int min_kernel_rows = 8;

// The signature of a kernel: stage s's block kernel of variant v, or the loss / AdamW kernel.
constexpr std::vector<KernelArg> signature(const Model &m, int stage, Variant v, Precision p) {
  std::vector<KernelArg> out, reads, writes;
  auto scalar = [&](Scalar s) { out.push_back({{}, ArgRole::scalar, Access::read, info(s).element, s}); };
  auto buffer = [&](const LocalTensor &t, ArgRole role, Access access, int read_by = -1) {
    (access == Access::read ? reads : writes).push_back({t, role, access, element_of(t, p), {}, read_by});
  };
  auto flat = [](TensorKey k, LocalTensor::Kind kind = LocalTensor::Kind::parameter) {
    return LocalTensor{k, 1, {-1, 0}, false, kind};
  };
  if (v == Variant::loss) {
    scalar(Scalar::grad_scale);
    buffer(rows(key::of(Slot::logits), m.classes()), ArgRole::block_input, Access::read);
    buffer(flat(key::of(Slot::labels), LocalTensor::Kind::index), ArgRole::labels, Access::read);
    buffer(rows(key::of(Slot::dlogits), m.classes()), ArgRole::input_grad, Access::write);
    buffer(row_stat(key::of(Slot::row_loss)), ArgRole::metric, Access::write);
    buffer(flat(key::of(Slot::row_correct), LocalTensor::Kind::index), ArgRole::metric, Access::write);
    buffer(row_stat(key::of(Slot::row_max)), ArgRole::metric, Access::write);
    buffer(row_stat(key::of(Slot::row_lse)), ArgRole::metric, Access::write);
  } else if (v == Variant::adamw) {  // over a flat range of parameters
    for (Scalar s :
         {Scalar::lr, Scalar::beta1, Scalar::beta2, Scalar::eps, Scalar::weight_decay, Scalar::bias1, Scalar::bias2})
      scalar(s);
    buffer(flat(key::adamw(Slot::adamw_param)), ArgRole::parameter, Access::read);
    buffer(flat(key::adamw(Slot::adamw_grad)), ArgRole::gradient, Access::read);
    buffer(flat(key::adamw(Slot::adamw_m)), ArgRole::moment, Access::read);
    buffer(flat(key::adamw(Slot::adamw_v)), ArgRole::moment, Access::read);
    // the kernel's Tuple output {p, m, v}, written in place over its inputs
    buffer(flat(key::adamw(Slot::adamw_param)), ArgRole::parameter, Access::write);
    buffer(flat(key::adamw(Slot::adamw_m)), ArgRole::moment, Access::write);
    buffer(flat(key::adamw(Slot::adamw_v)), ArgRole::moment, Access::write);
  } else {
    const Block &b = m.stages[stage];
    const bool backward = is_backward(v), needs_dx = needs_input_grad(m, stage);
    const std::vector<LocalTensor> ps = params(b);
    bool masks = false;
    for (int k = 0; k < b.n_layers; ++k) masks = masks || kind(b.layers[k].op).draws_masks;
    if (backward && !ps.empty()) scalar(Scalar::accumulate);
    if (masks)
      for (Scalar s : {Scalar::seed, Scalar::step, Scalar::rng_block, Scalar::drop_threshold, Scalar::drop_scale,
                       Scalar::first_row})
        scalar(s);
    const LocalTensor x = m.token_input() && stage == 0 ? flat(key::block_input(), LocalTensor::Kind::index)
                                                        : rows(key::block_input(), b.in());
    buffer(x, ArgRole::block_input, Access::read);
    if (backward) buffer(rows(key::output_grad(), b.out()), ArgRole::output_grad, Access::read);
    for (const LocalTensor &t : ps) buffer(t, ArgRole::parameter, Access::read);
    if (backward && needs_dx) buffer(rows(key::input_grad(), b.in()), ArgRole::input_grad, Access::write);
    if (!backward) buffer(rows(key::block_output(), b.out()), ArgRole::block_output, Access::write);
    for (const LocalTensor &t : ps)
      if (backward) {
        LocalTensor grad = t, prev = t;
        grad.key = key::gradient(t.key);
        prev.key = key::gradient(t.key, true);
        buffer(prev, ArgRole::gradient, Access::read);
        buffer(grad, ArgRole::gradient, Access::write);
      }
    const KernelTensors kt =
        backward ? backward_tensors(b, keep_of(v), needs_dx, p) : forward_tensors(b, keep_of(v), p);
    for (const LocalTensor &t : kt.saved)
      buffer(t, ArgRole::saved, backward ? Access::read : Access::write,
             t.kind == LocalTensor::Kind::statistic ? t.layer() : reader_of(b, t.layer()));
    for (const LocalTensor &t : kt.scratch) buffer(t, ArgRole::scratch, Access::write);
    for (const LocalTensor &t : kt.workspace) {
      const bool in_place = t.key.slot == Slot::layer_grad && gradient_memory(b, t.layer()) != t.layer();
      buffer(t, in_place ? ArgRole::in_place : ArgRole::workspace, Access::write);
    }
  }
  for (const auto *list : {&reads, &writes})
    for (const KernelArg &a : *list) out.push_back(a);
  return out;
}

}  // namespace remat
