// Partition remat.tensors:kernels: kernel variants, keys and names, their arithmetic, and every
// kernel's typed signature (its ordered arguments).
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>
export module remat.tensors:kernels;
import remat.language;
import :keys;
import :rules;

export namespace remat {

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
