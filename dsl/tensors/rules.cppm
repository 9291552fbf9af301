// Partition remat.tensors:rules: what each block kernel keeps, rebuilds and needs as workspace
// under a Keep (which outputs are materialized, saved, rebuilt, written over another's gradient).
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>
export module remat.tensors:rules;
import remat.language;
import :keys;

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
// Whether a later stage's layer shares parameter 0 of layer `layer` of `stage` (a tied table): the
// later stage's backward, which runs first, writes its gradient in every micro-batch, and this
// stage's backward adds to it whatever the micro-batch (its other gradients follow the micro-batch).
constexpr bool shared_by_later_stage(const Model &m, int stage, int layer) {
  for (int s = stage + 1; s < m.n_stages; ++s)
    for (int k = 0; k < m.stages[s].n_layers; ++k)
      if (m.stages[s].layers[k].tie_stage == stage && m.stages[s].layers[k].tie_layer == layer) return true;
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
// Whether a library call (a GEMM, the CPU attention) reads output j from a buffer.
constexpr bool feeds_library(const Block &b, int j) {
  for (int k = j + 1; k < b.n_layers; ++k)
    if (b.source(k) == j && (kind(b.layers[k].op).gemm || kind(b.layers[k].op).reads_input_buffer)) return true;
  return false;
}

// Output j has a buffer of its own whenever it exists outside registers: GEMM, GELU and
// attention outputs, every input of a linear or an attention, and the end of an epilogue chain
// (its dropout masks are hashed once, not by each reader). Everything else (LayerNorm output,
// ReLU, dropout and residual sums of buffered values) is rebuilt elementwise where it is used.
constexpr bool materialized(const Block &b, int j) {
  if (!b.produces(j)) return false;
  const Kind &k = kind(b.layers[j].op);
  if (k.buffered || feeds_library(b, j)) return true;
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
// A library call's input gradient (a GEMM's dy w^T, the CPU attention's dqkv) has a buffer of its
// own when other terms are added to it.
constexpr bool product_buffer(const Block &b, int k) {
  const Kind &kd = kind(b.layers[k].op);
  return (kd.gemm || kd.reads_input_buffer) && consumers(b, b.source(k)) > 1;
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

}  // namespace remat
