module;
#include <Halide.h>

#include "attention.h"
#include "layers.h"
#include "schedules.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>
module remat.modelc;
import remat.tensors;

namespace remat::modelc {
namespace {

using namespace Halide;
using gen::Layers;
using gen::MatMul;
using gen::Scheduler;

static_assert(Scheduler::min_batch == min_kernel_rows, "the kernels' row minimum is remat::min_kernel_rows");

std::string str(const Name &n) { return std::string(n.view()); }

// A stored value as float: bf16 values (UInt(16) bits) are widened where they are read (an
// inlined Func).
Func widened(Func f) {
  if (f.type() != UInt(16)) return f;
  const gen::Vars v;  // named as every kernel's vars, so that schedules can split them
  std::vector<Var> at = {v.c, v.b};
  at.resize(f.dimensions());
  Func w(f.name() + "_f32");
  w(at) = gen::from_bf16_bits(f(at));
  return w;
}

Type halide_type(Element e) {
  switch (e) {
  case Element::f32: return Float(32);
  case Element::bf16: return UInt(16);  // the bits
  case Element::i32: return Int(32);
  case Element::u64: return UInt(64);
  case Element::boolean: return Bool();
  }
  return Float(32);
}

// A kernel's Halide arguments, declared from its signature (remat::signature) in its order:
// scalars and input buffers here, output buffers checked and ordered by outputs(). Buffers have
// static feature widths and a dynamic row count (the outermost dimension).
class Arguments {
public:
  Arguments(std::vector<KernelArg> signature, Precision precision)
      : signature(std::move(signature)), precision(precision) {
    for (const KernelArg &a : this->signature) {
      if (a.access == Access::write) continue;
      const std::string name = str(a.tensor.name);
      if (a.is_scalar()) {
        Parameter p(halide_type(a.element), false, 0, name);
        scalars.emplace(a.scalar, Internal::Variable::make(p.type(), name, p));
        order.push_back(Argument(name, Argument::InputScalar, p.type(), 0, p.get_argument_estimates()));
      } else {
        ImageParam ip(halide_type(a.element), a.tensor.dims, name);
        constrain(ip, a.tensor.dims, a.tensor.extent);
        images.emplace(name, ip);
        order.push_back(ip);
      }
    }
  }
  // An input buffer of the signature.
  ImageParam tensor(const std::string &name) const {
    if (auto it = images.find(name); it != images.end()) return it->second;
    throw std::runtime_error("the kernel reads " + name + ", which its signature does not list");
  }
  ImageParam tensor(const LocalTensor &lt) const { return tensor(str(lt.name)); }
  // The tensor as float values (a bf16 tensor is widened where it is read).
  Func read(const LocalTensor &lt) const { return widened(tensor(lt)); }
  Expr scalar(Scalar s) const {
    if (auto it = scalars.find(s); it != scalars.end()) return it->second;
    throw std::runtime_error("the kernel reads the scalar " + std::string(info(s).name) +
                             ", which its signature does not list");
  }
  template <class P>
  static void constrain(P &&p, int dims, std::array<int, 2> extent) {
    long long stride = 1;
    for (int d = 0; d < dims; ++d) {
      p.dim(d).set_min(0).set_stride(int(stride));
      if (extent[d] >= 0) {
        p.dim(d).set_extent(extent[d]);
        stride *= extent[d];
      } else {
        break;  // the batch dimension is outermost and dynamic
      }
    }
  }
  // The pipeline's outputs in the signature's order, with its layouts and element types: every
  // output buffer of the signature written by exactly one of `written`, and nothing else.
  std::vector<Func> outputs(const std::vector<Func> &written) const {
    std::map<std::string, Func> by_name;
    for (const Func &f : written) {
      const std::string name = f.name().substr(0, f.name().find('$'));  // Halide may add $<n> to a reused name
      if (!by_name.emplace(name, f).second) throw std::runtime_error("the kernel writes " + name + " twice");
    }
    std::vector<Func> out;
    for (std::size_t i = 0; i < signature.size(); ++i) {
      const KernelArg &a = signature[i];
      if (a.access != Access::write) continue;
      std::string name = str(a.tensor.name);
      const std::size_t dot = name.find('.');  // a Tuple's element (adamw.0): the Func's name
      const bool element = dot != std::string::npos;
      if (element && name.substr(dot + 1) != "0") continue;  // written with its first element
      if (element) name = name.substr(0, dot);
      auto it = by_name.find(name);
      if (it == by_name.end())
        throw std::runtime_error("the signature lists the output " + name + ", which the kernel does not write");
      const Func f = it->second;
      by_name.erase(it);
      for (std::size_t k = 0; k < f.output_buffers().size(); ++k) {
        const KernelArg &ak = signature[i + k];
        if (f.types()[k] != halide_type(ak.element))
          throw std::runtime_error("the kernel writes " + name + " as " + type_name(f.types()[k]) +
                                   ", its signature says " + type_name(halide_type(ak.element)));
      }
      constrain(f.output_buffers()[0], a.tensor.dims, a.tensor.extent);  // a Tuple's others follow the first
      out.push_back(f);
    }
    if (!by_name.empty())
      throw std::runtime_error("the kernel writes " + by_name.begin()->first + ", which its signature does not list");
    return out;
  }
  static std::string type_name(Type t) {
    std::ostringstream o;
    o << t;
    return o.str();
  }

  std::vector<KernelArg> signature;
  Precision precision;
  std::map<std::string, ImageParam> images;
  std::map<Scalar, Expr> scalars;
  std::vector<Argument> order;  // the scalars and inputs, for compile_to_module
};

// A linear whose output only feeds a dropout / residual chain: the chain is applied in the
// GEMM's epilogue when its end is built.
struct PendingGemm {
  Func a, w;
  std::optional<Func> bias;  // none for a linear without bias
  int inner = 0;
  std::vector<std::function<Expr(Expr)>> epilogue;  // applied in order to sum + bias
  bool operand_buffered = true;                     // a is in memory
};

struct Values {
  std::vector<Func> out;                   // output of layer k (undefined while pending)
  std::vector<Func> stored;                // ... as stored (bf16 bits or float): GEMM operands
  std::vector<bool> buffered;              // out[k] is in memory (an input or an output)
  std::map<int, PendingGemm> pending;      // by layer
  std::map<int, std::vector<Func>> stats;  // row statistics by layer, in the order of stats_of
  Func x, x_stored, y;
};

// A gradient contribution to one tensor: elementwise, or the product dy * wt of a linear's input
// gradient (built last, with the elementwise ones added in its epilogue).
struct Contribution {
  Func f;
  std::optional<std::pair<Func, Func>> product;  // {dy, wt}; library GEMMs: {dy as stored, w}
  int layer = -1;                                // the linear, for a product
  std::function<void(Func)> schedule;            // schedules f's internals inside the consumer
  // When it is the tensor's only contribution: builds and schedules the whole tensor itself,
  // given its name (its values as stored), instead of f.
  std::function<Func(const std::string &)> whole;
};

class StageKernels;

// A kind's rules for the model compiler (one unit per kind in generators/kinds/, listed in
// kinds/all.h by Op). A rule reads its inputs through the StageKernels it is given (value(j),
// stored(j), param(j, ...)) and hands back what it made.
struct Built {
  Func out;                // the layer's output as stored (undefined when pending)
  bool scheduled = false;  // out is scheduled already (a GEMM, a reduction); else pointwise where buffered
  bool pending = false;    // fused into a GEMM's epilogue chain, built by the chain's end
};
struct KindRules {
  Op op;
  // Before the output is made or read back (forward and backward kernels): row statistics,
  // computed and written as outputs, or read where the plan saved them. nullptr: none.
  void (*statistics)(StageKernels &k, int j) = nullptr;
  // The output of layer j (named `name`: h<j>, or y for the block's last layer).
  Built (*forward)(StageKernels &k, int j, const std::string &name) = nullptr;
  // Given the gradient of the output (as stored and as float), adds gradient contributions to
  // its inputs (k.add_grad) and writes its parameters' gradients.
  void (*backward)(StageKernels &k, int j, Func d_stored, Func d) = nullptr;
};
const KindRules &rules_of(Op op);

class StageKernels {
public:
  // The kernel of stage `stage` of this variant, for a target (whose kind sets the GEMMs).
  StageKernels(const Model &model, int stage, Variant variant, const Target &target, Precision precision)
      : blk(model.stages[stage]),
        stage(stage),
        needs_dx(needs_input_grad(model, stage)),
        token_input(model.token_input()),
        precision(precision),
        variant(variant),
        gemms(gemms_for(target.has_gpu_feature(), precision)),
        extern_device(target.has_feature(Target::CUDA)     ? DeviceAPI::CUDA
                      : target.has_feature(Target::OpenCL) ? DeviceAPI::OpenCL
                                                           : DeviceAPI::Host),
        args(signature(model, stage, variant, precision, gemms), precision),
        L(Float(32), v, precision == Precision::bf16),
        tr(L, model.rows_per_sample()),
        sched(target, v) {
    for (int k = 0; k < blk.n_layers; ++k)
      if (kind(blk.layers[k].op).draws_masks) {
        drop = gen::Dropout(args.scalar(Scalar::seed), args.scalar(Scalar::step), args.scalar(Scalar::rng_block),
                            args.scalar(Scalar::drop_threshold), args.scalar(Scalar::drop_scale));
        break;
      }
  }

  Pipeline build() {
    const bool backward = is_backward(variant);
    const KernelTensors tensors = backward ? backward_tensors(blk, keep_of(variant), needs_dx, gemms, precision)
                                           : forward_tensors(blk, keep_of(variant), gemms, precision);
    std::vector<Func> outs;
    begin(tensors, backward, outs);
    write_weight_copies();
    build_forward();
    if (backward)
      build_backward();
    else
      outs.push_back(f.y);
    return Pipeline(args.outputs(outs));
  }

  std::vector<Argument> arguments() const { return args.order; }

  // ---- what the kinds' rules use ----
  // Layer j's output (-1: the block input) as float, as stored (bf16 bits or float: GEMM
  // operands), and whether it is in memory.
  Func value(int j) const { return j < 0 ? f.x : f.out[j]; }
  Func stored(int j) const { return j < 0 ? f.x_stored : f.stored[j]; }
  bool buffered(int j) const { return j < 0 || f.buffered[j]; }
  // Whether gradient flows into layer j's output (the block input's only when the plan asks for it).
  bool flows(int j) const { return j >= 0 || needs_dx; }
  void add_grad(int j, Contribution c) {
    if (flows(j)) grads[j].push_back(std::move(c));
  }
  Func param(int k, const char *which) { return args.tensor(str(cat("p", k, "_", which))); }
  // The name of the gradient of parameter `which` of layer k (g<k>_w).
  std::string grad_of(int k, const char *which) const { return str(grad_name(cat("p", k, "_", which))); }
  // Accumulating parameter gradient: g = (accumulate ? g_prev : 0) + new.
  Expr accumulated(const std::string &grad, Expr value, std::vector<Expr> at) {
    ImageParam prev = args.tensor(grad + "_prev");
    return select(args.scalar(Scalar::accumulate), prev(at), L.constant(0)) + value;
  }
  // Writes a 1-D parameter gradient made of a column sum over rows (`sum`, scheduled here).
  void write_column_sum_grad(int k, const char *which, Func sum, int width) {
    const std::string name = grad_of(k, which);
    Func g(name);
    g(v.c) = accumulated(name, sum(v.c), {v.c});
    sched.column_sum(g, sum, sum.rvars(0)[0], width);
    output(g);
  }
  gen::Dropout dropout_at(int k) const { return drop.enabled ? drop.at(drop.block + k) : drop; }
  // An output of the kernel (its layout comes from the signature, which must list it).
  void output(Func fn) { outputs->push_back(fn); }
  // Whether the plan saved a tensor of this kernel (then a backward kernel reads it).
  bool saved(const Name &name) const { return building_backward && listed(kt->saved, name); }
  static bool listed(const std::vector<LocalTensor> &list, const Name &name) {
    for (const LocalTensor &lt : list)
      if (lt.name == name) return true;
    return false;
  }
  Type stored_type() const { return precision == Precision::bf16 ? UInt(16) : Float(32); }

  // ---- GEMMs ----
  // library GEMMs: extern stages (runtime/gemm.cpp).
  // out = op(a) op(b) [+ bias] [+ out when accumulate], over `inner` products; a and b are
  // buffers (kernel inputs, or Funcs that are kernel outputs) a_cols and b_cols wide (as stored),
  // op transposes when asked. The library asks for whole operands at run time (a bounds query),
  // which Halide cannot see when it sizes the buffers of the stages producing them: their widths
  // are bounded here, so those stages keep constant-size scratch (on the stack, not the heap).
  Func library_gemm(const std::string &name, Func a, int a_cols, bool trans_a, Func b, int b_cols, bool trans_b,
                    std::optional<Func> bias, Expr inner, Expr accumulate, Type type) {
    auto bound_width = [this](Func f, int width) {  // a computed Func (a kernel input's wrapper has its own vars)
      for (const Var &x : f.args())
        if (x.same_as(v.c)) f.bound(v.c, 0, width);
    };
    bound_width(a, a_cols);
    bound_width(b, b_cols);
    if (bias) bound_width(*bias, b_cols);  // the output's width: b is never transposed with a bias
    std::vector<ExternFuncArgument> in = {a, b};
    if (bias) in.push_back(*bias);
    in.push_back(cast(Int(32), inner));
    // flags: 1 transposes a, 2 transposes b, 4 says the kernel runs on OpenCL (the product goes back there)
    in.push_back(Expr(int32_t((trans_a ? 1 : 0) | (trans_b ? 2 : 0) | (extern_device == DeviceAPI::OpenCL ? 4 : 0))));
    in.push_back(cast(Int(32), accumulate));
    Func out(name);
    out.define_extern(bias ? "remat_gemm_bias" : "remat_gemm", in, type, {v.c, v.b}, NameMangling::C, extern_device);
    out.compute_root();
    return out;
  }
  // The weight of linear k as a GEMM operand: fp32, or its bf16 copy.
  Func gemm_weight(int k) { return weight_copy(precision) ? bf16_copy(k, "w", weight_copy_of(blk, k)) : param(k, "w"); }
  // The bias of linear k for a library GEMM's epilogue: fp32, or its bf16 copy for bf16 outputs.
  std::optional<Func> library_bias(int k) {
    if (!blk.layers[k].bias) return std::nullopt;
    return bias_copy(gemms, precision) ? bf16_copy(k, "b", bias_copy_of(blk, k)) : param(k, "b");
  }
  Func build_gemm(const std::string &name, const PendingGemm &p, int width) {
    MatMul m = L.matmul(name, p.a, p.w, p.inner, [&](Expr sum) {
      Expr e = p.bias ? sum + (*p.bias)(v.c) : sum;
      for (const auto &op : p.epilogue) e = op(e);
      return L.store(e);
    });
    sched.matmul(m, -1, width, p.operand_buffered ? std::nullopt : std::optional<Func>(p.a));
    return m.out;
  }
  // Continues the epilogue chain pending at layer `src` with op, or applies op elementwise.
  Built chain_link(int j, const std::string &name, std::function<Expr(Expr)> op) {
    const int src = blk.source(j);
    if (f.pending.count(src)) {  // continue the epilogue chain of a linear
      PendingGemm p = f.pending.at(src);
      p.epilogue.push_back(op);
      if (j + 1 < blk.n_layers && fused(blk, j)) {
        f.pending[j] = p;
        return {.pending = true};
      }
      return {build_gemm(name, p, blk.layers[j].out), true};
    }
    Func out(name);
    Func in = value(src);
    out(v.c, v.b) = L.store(op(in(v.c, v.b)));
    return {out};
  }
  // CPU attention (forward, and backward where its gradient is the qkv tensor's only one) by
  // (sequence, head) tiles where their buffers fit Halide's stack.
  bool attention_tiles(const Layer &l) const {
    return !sched.gpu && Scheduler::attention_tiles_fit(l.out, l.heads, tr.T);
  }

  const Block &blk;
  int stage;
  bool needs_dx, token_input;
  Precision precision;
  Variant variant;
  Gemms gemms;
  DeviceAPI extern_device;             // the device of a library GEMM's buffers (host, CUDA, or OpenCL for the tests)
  std::map<std::string, Func> copies;  // bf16 parameter copies, by name
  gen::Vars v;
  Arguments args;
  Layers L;
  gen::Transformer tr;
  Scheduler sched;
  gen::Dropout drop;
  // the kernel being built
  const KernelTensors *kt = nullptr;
  bool building_backward = false;
  std::vector<Func> *outputs = nullptr;
  Values f;
  std::map<int, std::vector<Contribution>> grads;  // by tensor; -1 is the block input
  Expr batch;                                      // the kernel's row count

private:
  void begin(const KernelTensors &tensors, bool backward, std::vector<Func> &outs) {
    kt = &tensors;
    building_backward = backward;
    outputs = &outs;
  }
  Func x_stored() { return args.tensor("x"); }
  // Every parameter copy the plan gives the kernel is written, used or not (the plan counts it).
  void write_weight_copies() {
    for (const LocalTensor &lt : kt->workspace)
      if (lt.layer >= 0 && kind(blk.layers[lt.layer].op).gemm) {
        if (lt.name == weight_copy_of(blk, lt.layer).name) gemm_weight(lt.layer);
        if (lt.name == bias_copy_of(blk, lt.layer).name) library_bias(lt.layer);
      }
  }
  // A bf16 copy of a parameter into its planned workspace, written once per call.
  Func bf16_copy(int k, const char *which, const LocalTensor &lt) {
    const std::string name = str(lt.name);
    if (!copies.count(name)) {
      Func p = param(k, which), copy(name);
      if (lt.dims == 2) {
        copy(v.c, v.b) = L.store(p(v.c, v.b));
        sched.pointwise(copy);
      } else {
        copy(v.c) = L.store(p(v.c));
        sched.flat(copy);
      }
      output(copy);
      copies[name] = copy;
    }
    return copies.at(name);
  }

  // The forward chain. In a forward kernel, the saved and scratch tensors of kt are outputs. In
  // a backward kernel, saved tensors are inputs and scratch tensors (what it rebuilds) outputs.
  void build_forward() {
    f = Values{};
    f.x_stored = x_stored();
    f.x = widened(f.x_stored);
    const int n = blk.n_layers;
    f.out.resize(n);
    f.stored.resize(n);
    f.buffered.resize(n);
    for (int j = 0; j < n; ++j) {
      const Layer &l = blk.layers[j];
      const bool last = j + 1 == n;
      const std::string name = last ? "y" : str(cat("h", j));
      if (!blk.produces(j)) {  // residual( passes its source on
        const int src = blk.source(j);
        f.out[j] = value(src);
        f.stored[j] = stored(src);
        f.buffered[j] = buffered(src);
        continue;
      }
      const KindRules &rules = rules_of(l.op);
      if (rules.statistics) rules.statistics(*this, j);
      if (!last && saved(cat("h", j))) {  // saved by the forward
        f.stored[j] = args.tensor(output_of(blk, j));
        f.out[j] = widened(f.stored[j]);
        f.buffered[j] = true;
        continue;
      }
      const Built b = rules.forward(*this, j, name);
      if (b.pending) continue;
      if (last) {
        if (!b.scheduled) sched.pointwise(b.out);
        f.y = b.out;
      } else {
        f.stored[j] = b.out;
        f.out[j] = widened(b.out);  // `out` is the stored value; layers read it as float
        if (listed(kt->saved, cat("h", j)) || listed(kt->scratch, cat("h", j))) {
          if (!b.scheduled) sched.pointwise(b.out);
          output(b.out);
          f.buffered[j] = true;
        }
      }
    }
  }

  // The gradient of one tensor, written to its buffer (rounded to the storage type): {as stored,
  // as float for the rules that read it}.
  std::pair<Func, Func> materialize(const std::string &name, const std::vector<Contribution> &parts, int width) {
    if (parts.size() == 1 && parts[0].whole) {
      Func out = parts[0].whole(name);
      output(out);
      return {out, widened(out)};
    }
    Func out;
    const Contribution *product = nullptr;
    for (const Contribution &c : parts)
      if (c.product) {
        if (product) throw std::runtime_error("two linear input gradients into one tensor are not supported");
        product = &c;
      }
    auto others = [&](Expr e) {
      for (const Contribution &c : parts)
        if (!c.product) e = e + c.f(v.c, v.b);
      return e;
    };
    const int inner = product ? blk.layers[product->layer].out : 0;  // the linear's output width
    if (product && gemms == Gemms::library) {
      // the library writes dy w^T into this tensor, or into dp<k> when other terms are added
      const bool alone = parts.size() == 1;
      if (alone == product_buffer(blk, product->layer, gemms))
        throw std::runtime_error("library GEMM: the plan's product buffer for linear " +
                                 std::to_string(product->layer) + " does not match the gradient of " + name);
      const std::string gemm_name = alone ? name : str(product_of(blk, product->layer).name);
      Func p = library_gemm(gemm_name, product->product->first, inner, false, product->product->second, inner, true,
                            std::nullopt, inner, Expr(0), alone ? stored_type() : Float(32));  // dp<k>: fp32
      if (alone) {
        out = p;
      } else {
        output(p);
        Func pv = widened(p);
        out = Func(name);
        out(v.c, v.b) = L.store(others(pv(v.c, v.b)));
        sched.pointwise(out);
      }
    } else if (product) {
      MatMul m = L.matmul(name, product->product->first, product->product->second, inner,
                          [&](Expr sum) { return L.store(others(sum)); });
      sched.matmul(m, -1, width);
      out = m.out;
    } else {
      out = Func(name);
      out(v.c, v.b) = L.store(others(L.constant(0)));
      const bool scheduled_by_part =
          std::any_of(parts.begin(), parts.end(), [](const Contribution &c) { return bool(c.schedule); });
      if (!scheduled_by_part) sched.pointwise(out);
    }
    for (const Contribution &c : parts)
      if (c.schedule) c.schedule(out);
    output(out);
    return {out, widened(out)};
  }

  void build_backward() {
    Func dy_stored = args.tensor("dy");
    const ImageParam x = args.tensor("x");
    batch = x.dim(x.dimensions() - 1).extent();
    grads.clear();
    for (int k = blk.n_layers - 1; k >= 0; --k) {
      const Layer &l = blk.layers[k];
      const int src = blk.source(k);
      if (!blk.produces(k)) {  // residual( passes its gradient to its source
        if (flows(src))
          for (Contribution &c : grads[k]) grads[src].push_back(c);
        continue;
      }
      auto [d_stored, d] = k + 1 == blk.n_layers ? std::pair{dy_stored, widened(dy_stored)}
                                                 : materialize(str(cat("dh", k)), grads[k], l.out);
      rules_of(l.op).backward(*this, k, d_stored, d);
    }
    if (needs_dx) materialize("dx", grads[-1], blk.in());
  }
};

#include "kinds/all.h"

}  // namespace
}  // namespace remat::modelc

namespace remat::modelc {
namespace {

// Cross-entropy over the classes of each row. row_max and row_lse are small per-row outputs so
// that the kernel allocates nothing of its own.
Pipeline loss_kernel(int classes, const Arguments &args, const Target &target) {
  gen::Vars v;
  Layers L(Float(32), v, args.precision == Precision::bf16);
  Scheduler sched(target, v);
  auto ce = L.cross_entropy(args.read(rows("logits", classes)), args.tensor("labels"), classes,
                            args.scalar(Scalar::grad_scale));
  sched.cross_entropy(ce);
  return Pipeline(args.outputs({ce.dlogits, ce.row_loss, ce.row_correct, ce.row_max, ce.row_lse}));
}

// AdamW over a flat range, in place: p, m, v are read and written at the same element.
Pipeline adamw_kernel(const Arguments &args, const Target &target) {
  gen::Vars v;
  Layers L(Float(32), v);
  auto s = [&](Scalar x) { return args.scalar(x); };
  Func upd =
      L.adamw(args.tensor("p"), args.tensor("g"), args.tensor("m"), args.tensor("v"), s(Scalar::lr), s(Scalar::beta1),
              s(Scalar::beta2), s(Scalar::eps), s(Scalar::weight_decay), s(Scalar::bias1), s(Scalar::bias2));
  Scheduler(target, v).flat(upd);
  return Pipeline(args.outputs({upd}));
}

// Writes `text` only when it differs, so that Ninja skips whatever depends on an unchanged file.
void write_if_changed(const std::filesystem::path &path, const std::string &text) {
  std::ifstream in(path, std::ios::binary);
  std::string old((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.is_open() && old == text) return;
  in.close();
  const auto tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out << text;
    if (!out.flush()) throw std::runtime_error("cannot write " + tmp);
  }
  std::filesystem::rename(tmp, path);
}

// One generated kernel: the plan's kernel name, and its C symbol for one target. `api`: "" (CPU),
// "cuda", or "opencl" (the GPU schedules for OpenCL, so that tests can run them on PoCL).
struct Emitted {
  std::string name, symbol, api;
};

struct Emitter {
  std::filesystem::path staging;
  std::vector<std::string> objects;
  std::vector<Emitted> kernels;

  // One kernel for `targets` (best first): with more than one, an object per target and a
  // wrapper that picks the first one the running CPU can use (halide_can_use_target_features;
  // runtime/executor.cpp can force the last). `build` makes the pipeline for a target, scheduled
  // for its vector width.
  using Build = std::function<std::pair<Pipeline, std::vector<Argument>>(const Target &)>;
  void emit(const std::string &name, const std::vector<Target> &targets, const Build &build) {
    const Target &base = targets.back();
    const std::string api = base.has_feature(Target::CUDA) ? "cuda" : base.has_feature(Target::OpenCL) ? "opencl" : "";
    const std::string symbol = api.empty() ? name : name + "_" + api;
    const auto prefix = (staging / symbol).string();
    std::map<OutputFileType, std::string> files = {{OutputFileType::object, prefix + ".o"},
                                                   {OutputFileType::c_header, prefix + ".h"}};
    if (std::getenv("REMAT_STMT")) files[OutputFileType::stmt] = prefix + ".stmt";  // for reading schedules
    std::vector<Target> no_runtime;
    std::vector<std::string> suffixes;
    for (const Target &t : targets) {
      no_runtime.push_back(t.with_feature(Target::NoRuntime));
      suffixes.push_back(t.has_feature(Target::AVX512) ? "avx512" : "avx2");
    }
    compile_multitarget(symbol, files, no_runtime, suffixes, [&](const std::string &fn, const Target &t) {
      try {
        auto [pipeline, args] = build(t);
        return pipeline.compile_to_module(args, fn, t);
      } catch (const std::runtime_error &e) { throw std::runtime_error(name + ": " + e.what()); }
    });
    if (targets.size() == 1) {
      objects.push_back(prefix + ".o");
    } else {
      for (const std::string &suffix : suffixes) objects.push_back(prefix + "-" + suffix + ".o");
      objects.push_back(prefix + "_wrapper.o");
    }
    kernels.push_back({name, symbol, api});
  }

  // Every kernel of the model for `targets`, in both precisions (AdamW is fp32 only).
  void emit_model(const Model &model, const std::string &name, const std::vector<Target> &targets) {
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      for (int s = 0; s < model.n_stages; ++s) {
        // Plain stages keep everything (and evaluation runs forward_discard); blocks of a repeat
        // stage get every variant the policies use.
        const bool checkpointable = model.stages[s].checkpointable;
        for (Keep keep : {Keep::all, Keep::nothing, Keep::selective}) {
          for (bool backward : {false, true}) {
            if (!checkpointable && (keep == Keep::selective || (backward && keep == Keep::nothing))) continue;
            const Variant variant = backward ? backward_variant(keep) : forward_variant(keep);
            emit(str(kernel_name(name, s, variant, precision)), targets, [&](const Target &t) {
              StageKernels k(model, s, variant, t, precision);
              Pipeline p = k.build();
              return std::pair{p, k.arguments()};
            });
          }
        }
      }
      emit(str(kernel_name(name, 0, Variant::loss, precision)), targets, [&](const Target &t) {
        const Arguments args(signature(model, -1, Variant::loss, precision, gemms_for(t.has_gpu_feature(), precision)),
                             precision);
        return std::pair{loss_kernel(model.classes(), args, t), args.order};
      });
    }
    emit(str(kernel_name(name, 0, Variant::adamw)), targets, [&](const Target &t) {
      const Arguments args(signature(model, -1, Variant::adamw, Precision::fp32, Gemms::library), Precision::fp32);
      return std::pair{adamw_kernel(args, t), args.order};
    });
  }
};

}  // namespace

// CUDA kernels: PTX for a pinned compute capability (a bare host-cuda target would ask the
// driver at build time), host code for the pinned CPU features.
Target cuda_target(const std::string &cpu_target, int capability) {
  const std::map<int, Target::Feature> features = {{70, Target::CUDACapability70},
                                                   {75, Target::CUDACapability75},
                                                   {80, Target::CUDACapability80},
                                                   {86, Target::CUDACapability86}};
  if (!features.count(capability))
    throw std::runtime_error("unsupported --cuda-capability " + std::to_string(capability));
  return Target(cpu_target).with_feature(Target::CUDA).with_feature(features.at(capability));
}

int main(int argc, char **argv, const Model &model, std::string_view model_name) {
  std::string out_dir, cpu_targets = "host";
  int capability = 0;  // 0: no CUDA kernels
  bool opencl = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--opencl")
      opencl = true;
    else if (flag == "--out" && i + 1 < argc)
      out_dir = argv[++i];
    else if (flag == "--cpu-targets" && i + 1 < argc)
      cpu_targets = argv[++i];
    else if (flag == "--cuda-capability" && i + 1 < argc)
      capability = std::atoi(argv[++i]);
    else
      out_dir.clear(), i = argc;  // unknown: print the usage
  }
  if (out_dir.empty()) {
    std::fprintf(stderr, "usage: %s --out DIR [--cpu-targets BEST,...,BASELINE] [--cuda-capability NN] [--opencl]\n",
                 argv[0]);
    return 2;
  }
  try {
    const std::string name(model_name);
    // kernel names (<model>_s<stage>_backward_selective_bf16) must fit remat::Name
    const Name longest = kernel_name(name, 9, Variant::backward_selective, Precision::bf16);
    if (longest.size() + 1 >= int(Name{}.chars.size()) || longest.view().find(name) != 0)
      throw std::runtime_error("model name '" + name + "' is too long for kernel names");
    Emitter e{std::filesystem::path(out_dir) / "staging"};
    std::filesystem::create_directories(e.staging);
    // CPU kernels: one variant per target, the running CPU picks; the last (the baseline) is
    // also the host code of the GPU kernels and the runtime's target.
    std::vector<Target> cpu;
    for (std::string_view rest = cpu_targets; !rest.empty();) {
      const std::size_t comma = rest.find(',');
      cpu.emplace_back(std::string(rest.substr(0, comma)));
      rest = comma == rest.npos ? std::string_view{} : rest.substr(comma + 1);
    }
    if (cpu.empty()) throw std::runtime_error("--cpu-targets names no target");
    const std::string cpu_target = cpu.back().to_string();
    e.emit_model(model, name, cpu);
    // One Halide runtime for all: a GPU target's runtime includes the CPU one.
    Target runtime_target = capability ? cuda_target(cpu_target, capability) : cpu.back();
    if (capability) e.emit_model(model, name, {runtime_target});
    if (opencl) {
      e.emit_model(model, name, {cpu.back().with_feature(Target::OpenCL)});
      runtime_target = runtime_target.with_feature(Target::OpenCL);
    }
    const auto runtime = (e.staging / "halide_runtime.o").string();
    compile_standalone_runtime(runtime,
                               runtime_target.without_feature(Target::StrictFloat));  // Halide's own code is not strict
    std::vector<std::string> all = e.objects;
    all.push_back(runtime);
    const auto lib = (e.staging / ("lib" + name + "_kernels.a")).string();
    create_static_library(all, runtime_target, lib);

    // The module interface: the kernel tables (CPU and CUDA), by the plan's kernel names.
    std::string cppm = "// Generated by the remat model compiler from the model module `" + name +
                       "`. Do not edit.\nmodule;\n#include <HalideRuntime.h>\n\n#include <span>\n";
    for (const Emitted &k : e.kernels) cppm += "#include \"" + k.symbol + ".h\"\n";
    cppm += "export module " + name + ".kernels;\nimport remat.runtime;\n\nexport namespace " + name + "_kernels {\n";
    for (const std::string api : {"", "cuda", "opencl"}) {
      std::string rows;
      for (const Emitted &k : e.kernels)
        if (k.api == api) rows += "    {\"" + k.name + "\", &" + k.symbol + "_argv, &" + k.symbol + "_metadata},\n";
      if (api.empty()) {
        cppm += "inline constexpr remat::runtime::Kernel table[] = {\n" + rows + "};\n";
      } else if (rows.empty()) {  // not generated in this build
        cppm += "inline constexpr std::span<const remat::runtime::Kernel> " + api + "_table;\n";
      } else {
        cppm += "inline constexpr remat::runtime::Kernel " + api + "_kernels[] = {\n" + rows + "};\n" +
                "inline constexpr std::span<const remat::runtime::Kernel> " + api + "_table = " + api + "_kernels;\n";
      }
    }
    cppm += "}  // namespace " + name + "_kernels\n";
    write_if_changed(std::filesystem::path(out_dir) / (name + ".kernels.cppm"), cppm);
    std::vector<std::string> published = {"lib" + name + "_kernels.a"};
    for (const Emitted &k : e.kernels) published.push_back(k.symbol + ".h");
    for (const auto &file : published) {
      std::ifstream in(e.staging / file, std::ios::binary);
      if (!in) throw std::runtime_error("cannot read " + (e.staging / file).string());
      write_if_changed(std::filesystem::path(out_dir) / file,
                       std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
    }
  } catch (const Halide::CompileError &err) {
    std::fprintf(stderr, "remat model compiler: %s\n", err.what());
    return 1;
  } catch (const std::exception &err) {
    std::fprintf(stderr, "remat model compiler: %s\n", err.what());
    return 1;
  }
  return 0;
}

}  // namespace remat::modelc
