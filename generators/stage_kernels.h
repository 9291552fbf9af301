// The model compiler's builder of one block kernel: StageKernels makes the Halide pipeline of one
// stage's kernel variant from the stage's layers, each built by its kind's rules
// (generators/kinds/<kind>/rules.h, which include this header), with its arguments declared from
// the kernel's signature (remat::signature).
#pragma once

#include <Halide.h>

#include "kinds/dropout/algorithm.h"
#include "layers.h"
#include "schedules.h"
#include "sequences.h"

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>
import remat.tensors;

namespace remat::modelc {

using namespace Halide;
using gen::Layers;
using gen::Scheduler;

inline std::string str(const Name &n) { return std::string(n.view()); }

// A stored value as float: bf16 values (UInt(16) bits) are widened where they are read (an
// inlined Func).
inline Func widened(Func f) {
  if (f.type() != UInt(16)) return f;
  const gen::Vars v;  // named as every kernel's vars, so that schedules can split them
  std::vector<Var> at = {v.c, v.b};
  at.resize(f.dimensions());
  Func w(gen::part(f.name(), "f32"));
  w(at) = gen::from_bf16_bits(f(at));
  return w;
}

inline Type halide_type(Element e) {
  switch (e) {
  case Element::f32: return Float(32);
  case Element::bf16: return UInt(16);  // the bits
  case Element::i32: return Int(32);
  case Element::u64: return UInt(64);
  case Element::boolean: return Bool();
  }
  return Float(32);
}

// The Funcs a kernel writes, each bound to the key of the signature's output it is (a Tuple's
// Func: to its first element's).
using Outputs = std::vector<std::pair<TensorKey, Func>>;

// A kernel's Halide arguments, declared from its signature (remat::signature) in its order:
// scalars and input buffers here, output buffers checked and ordered by outputs(). Buffers have
// static feature widths and a dynamic row count (the outermost dimension); Halide's names for
// them are name_of(key).
class Arguments {
public:
  Arguments(std::vector<KernelArg> signature, Precision precision)
      : signature(std::move(signature)), precision(precision) {
    for (const KernelArg &a : this->signature) {
      if (a.access == Access::write) continue;
      if (a.is_scalar()) {
        const std::string name(info(a.scalar).name);
        Parameter p(halide_type(a.element), false, 0, name);
        scalars.emplace(a.scalar, Internal::Variable::make(p.type(), name, p));
        order.push_back(Argument(name, Argument::InputScalar, p.type(), 0, p.get_argument_estimates()));
      } else {
        ImageParam ip(halide_type(a.element), a.tensor.dims, str(name_of(a.tensor.key)));
        constrain(ip, a.tensor.dims, a.tensor.extent);
        images.emplace(a.tensor.key, ip);
        order.push_back(ip);
      }
    }
  }
  // An input buffer of the signature.
  ImageParam tensor(const TensorKey &k) const {
    if (auto it = images.find(k); it != images.end()) return it->second;
    throw std::runtime_error("the kernel reads " + str(name_of(k)) + ", which its signature does not list");
  }
  // The tensor as float values (a bf16 tensor is widened where it is read).
  Func read(const LocalTensor &lt) const { return widened(tensor(lt.key)); }
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
  // output of the signature written by exactly one of `written` (a Tuple's Func writes its first
  // element's output and the ones after it), and nothing else.
  std::vector<Func> outputs(const Outputs &written) const {
    std::vector<bool> used(written.size());
    std::vector<Func> out;
    for (std::size_t i = 0; i < signature.size(); ++i) {
      const KernelArg &a = signature[i];
      if (a.access != Access::write) continue;
      const std::string name = str(name_of(a.tensor.key));
      std::size_t j = 0;
      while (j < written.size() && !(written[j].first == a.tensor.key)) ++j;
      if (j == written.size())
        throw std::runtime_error("the signature lists the output " + name + ", which the kernel does not write");
      for (std::size_t again = j + 1; again < written.size(); ++again)
        if (written[again].first == a.tensor.key) throw std::runtime_error("the kernel writes " + name + " twice");
      used[j] = true;
      const Func f = written[j].second;
      const std::size_t elements = f.output_buffers().size();
      for (std::size_t k = 0; k < elements; ++k) {
        const KernelArg &ak = signature[i + k];
        if (f.types()[k] != halide_type(ak.element))
          throw std::runtime_error("the kernel writes " + name + " as " + type_name(f.types()[k]) +
                                   ", its signature says " + type_name(halide_type(ak.element)));
      }
      constrain(f.output_buffers()[0], a.tensor.dims, a.tensor.extent);  // a Tuple's others follow the first
      out.push_back(f);
      i += elements - 1;
    }
    for (std::size_t j = 0; j < written.size(); ++j)
      if (!used[j])
        throw std::runtime_error("the kernel writes " + str(name_of(written[j].first)) +
                                 ", which its signature does not list");
    return out;
  }
  static std::string type_name(Type t) {
    std::ostringstream o;
    o << t;
    return o.str();
  }

  std::vector<KernelArg> signature;
  Precision precision;
  std::map<TensorKey, ImageParam> images;
  std::map<Scalar, Expr> scalars;
  std::vector<Argument> order;  // the scalars and inputs, for compile_to_module
};

struct Values {
  std::vector<Func> out;                   // output of layer k
  std::vector<Func> stored;                // ... as stored (bf16 bits or float): GEMM operands
  std::vector<bool> buffered;              // out[k] is in memory (an input or an output)
  std::map<int, std::vector<Func>> stats;  // row statistics by layer, in the order of stats_of
  Func x, x_stored, y;
};

// A gradient contribution to one tensor: elementwise, or the product dy w^T of a linear's input
// gradient (the GEMM writes it; the elementwise ones are added after).
struct Contribution {
  Func f;
  std::optional<std::pair<Func, Func>> product;  // {dy as stored, w}: the GEMM dy w^T
  int layer = -1;                                // the linear, for a product
  std::function<void(Func)> schedule;            // schedules f's internals inside the consumer
  // When it is the tensor's only contribution: builds and schedules the whole tensor itself,
  // given its name (its values as stored), instead of f.
  std::function<Func(const std::string &)> whole;
};

class StageKernels;

// What a kind's rule hands back for its layer's output.
struct Built {
  Func out;                // the layer's output as stored
  bool scheduled = false;  // out is scheduled already (a GEMM, a reduction); else pointwise where buffered
};

// A kind's rules for the model compiler: in its folder, generators/kinds/<kind>/rules.h, a
// specialization KindRules<Op::<kind>> with any of these static functions (a kind with none
// produces nothing: residual_begin). A rule reads its inputs through the StageKernels it is given
// (value(j), stored(j), param(j, i)) and hands back what it made.
//   void statistics(StageKernels &k, int j): before the output is made or read back (forward and
//     backward kernels), the row statistics, computed and written as outputs, or read where the
//     plan saved them.
//   Built forward(StageKernels &k, int j, const std::string &name): the output of layer j (named
//     `name`: h<j>, or y for the block's last layer).
//   void backward(StageKernels &k, int j, Func d_stored, Func d): given the gradient of the output
//     (as stored and as float), adds gradient contributions to its inputs (k.add_grad) and writes
//     its parameters' gradients.
template <Op op>
struct KindRules {};

// A kind's rules as StageKernels calls them (nullptr: the kind has no such rule).
struct RuleTable {
  void (*statistics)(StageKernels &k, int j) = nullptr;
  Built (*forward)(StageKernels &k, int j, const std::string &name) = nullptr;
  void (*backward)(StageKernels &k, int j, Func d_stored, Func d) = nullptr;
};
template <Op op>
constexpr RuleTable rule_table_entry() {
  using R = KindRules<op>;
  RuleTable e;
  if constexpr (requires { &R::statistics; }) e.statistics = &R::statistics;
  if constexpr (requires { &R::forward; }) e.forward = &R::forward;
  if constexpr (requires { &R::backward; }) e.backward = &R::backward;
  return e;
}
// Every kind's (generators/modelc.cpp, from generators/kinds/list.h).
const RuleTable &rules_of(Op op);

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
        extern_device(target.has_feature(Target::CUDA)     ? DeviceAPI::CUDA
                      : target.has_feature(Target::OpenCL) ? DeviceAPI::OpenCL
                                                           : DeviceAPI::Host),
        args(signature(model, stage, variant, precision), precision),
        L(Float(32), v, precision == Precision::bf16),
        seq(L, model.rows_per_sample()),
        sched(target, v) {
    for (int k = 0; k < blk.n_layers; ++k) shared_later.push_back(shared_by_later_stage(model, stage, k));
    for (int k = 0; k < blk.n_layers; ++k)
      if (kind(blk.layers[k].op).draws_masks) {
        drop = gen::Dropout(args.scalar(Scalar::seed), args.scalar(Scalar::step), args.scalar(Scalar::rng_block),
                            args.scalar(Scalar::drop_threshold), args.scalar(Scalar::drop_scale),
                            args.scalar(Scalar::first_row));
        break;
      }
  }

  Pipeline build() {
    const bool backward = is_backward(variant);
    const KernelTensors tensors = backward ? backward_tensors(blk, keep_of(variant), needs_dx, precision)
                                           : forward_tensors(blk, keep_of(variant), precision);
    Outputs outs;
    begin(tensors, backward, outs);
    write_weight_copies();
    build_forward();
    if (backward)
      build_backward();
    else
      outs.push_back({key::block_output(), f.y});
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
  // Parameter `index` of layer j (its kind's Kind::params: 0 the weight or gain, 1 the bias), and
  // the key of its gradient.
  Func param(int j, int index) { return args.tensor(key::parameter(blk, j, index)); }
  TensorKey gradient(int j, int index) const { return key::gradient(key::parameter(blk, j, index)); }
  // Statistic or workspace `index` of layer j (its kind's Kind::stats, Kind::workspace).
  TensorKey statistic(int j, int index) const { return key::statistic(blk, j, index); }
  TensorKey workspace(int j, int index) const { return key::workspace(blk, j, index); }
  // A tensor's name as its Func's (Halide's names are for display only).
  static std::string name(const TensorKey &k) { return str(name_of(k)); }
  // The name of a Func that is not a tensor: <stem><j>[_<what>] (gelu3_dx, att3).
  static std::string layer_name(std::string_view stem, int j, std::string_view what = {}) {
    const std::string base = std::string(stem) + std::to_string(j);
    return what.empty() ? base : gen::part(base, what);
  }
  // Whether parameter gradient `gradient` adds to what it holds: in a micro-batch after the first
  // (the scalar accumulate), and always for a table a later stage shares (tied_to), whose backward
  // ran first and wrote it in this micro-batch.
  Expr adds_to(const TensorKey &gradient) const {
    return gradient.index == 0 && shared_later[std::size_t(gradient.layer)] ? Expr(true)
                                                                            : args.scalar(Scalar::accumulate);
  }
  // Accumulating parameter gradient: g = (adds_to(g) ? g_prev : 0) + new.
  Expr accumulated(const TensorKey &gradient, Expr value, std::vector<Expr> at) {
    ImageParam prev = args.tensor(key::gradient(gradient, true));
    return select(adds_to(gradient), prev(at), L.constant(0)) + value;
  }
  // Writes the gradient of 1-D parameter `index` of layer j, made of a column sum over rows (`sum`,
  // scheduled here).
  void write_column_sum_grad(int j, int index, Func sum, int width) {
    const TensorKey k = gradient(j, index);
    Func g(name(k));
    g(v.c) = accumulated(k, sum(v.c), {v.c});
    sched.column_sum(g, sum, sum.rvars(0)[0], width);
    output(k, g);
  }
  gen::Dropout dropout_at(int k) const { return drop.enabled ? drop.at(drop.block + k) : drop; }
  // An output of the kernel: the tensor of the signature it writes (its layout comes from there).
  void output(const TensorKey &k, Func fn) { outputs->push_back({k, fn}); }
  // Whether the plan saved a tensor of this kernel (then a backward kernel reads it).
  bool saved(const TensorKey &k) const { return building_backward && listed(kt->saved, k); }
  // Whether the forward built here writes layer j's output to its buffer (the block's output, or a
  // tensor saved or rebuilt as scratch), rather than leaving it inline in its readers.
  bool writes_output(int j) const {
    if (j + 1 == blk.n_layers) return true;
    const TensorKey out = key::layer_output(blk, j);
    return listed(kt->saved, out) || listed(kt->scratch, out);
  }
  static bool listed(const std::vector<LocalTensor> &list, const TensorKey &k) {
    for (const LocalTensor &lt : list)
      if (lt.key == k) return true;
    return false;
  }
  Type stored_type() const { return precision == Precision::bf16 ? UInt(16) : Float(32); }

  // ---- GEMMs ----
  // GEMMs: extern stages calling a library (runtime/gemm.cpp).
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
  Func gemm_weight(int k) { return weight_copy(precision) ? bf16_copy(k, 0, weight_copy_of(blk, k)) : param(k, 0); }
  // The bias of linear k for a GEMM's epilogue: fp32, or its bf16 copy for bf16 outputs.
  std::optional<Func> gemm_bias(int k) {
    if (!blk.layers[k].bias) return std::nullopt;
    return bias_copy(precision) ? bf16_copy(k, 1, bias_copy_of(blk, k)) : param(k, 1);
  }
  // A link of an epilogue chain (dropout, residual sum): op applied elementwise.
  Built chain_link(int j, const std::string &name, std::function<Expr(Expr)> op) {
    const int src = blk.source(j);
    Func out(name);
    Func in = value(src);
    out(v.c, v.b) = L.store(op(in(v.c, v.b)));
    return {out};
  }

  const Block &blk;
  int stage;
  bool needs_dx, token_input;
  Precision precision;
  Variant variant;
  DeviceAPI extern_device;           // the device of a library GEMM's buffers (host, CUDA, or OpenCL for the tests)
  std::map<TensorKey, Func> copies;  // bf16 parameter copies
  gen::Vars v;
  Arguments args;
  Layers L;
  gen::Sequences seq;
  Scheduler sched;
  gen::Dropout drop;
  std::vector<bool> shared_later;  // by layer: its table is shared by a later stage (adds_to)
  // the kernel being built
  const KernelTensors *kt = nullptr;
  bool building_backward = false;
  Outputs *outputs = nullptr;
  Values f;
  std::map<int, std::vector<Contribution>> grads;  // by tensor; -1 is the block input
  Expr batch;                                      // the kernel's row count

private:
  void begin(const KernelTensors &tensors, bool backward, Outputs &outs) {
    kt = &tensors;
    building_backward = backward;
    outputs = &outs;
  }
  Func x_stored() { return args.tensor(key::block_input()); }
  // Every parameter copy the plan gives the kernel is written, used or not (the plan counts it).
  void write_weight_copies() {
    for (const LocalTensor &lt : kt->workspace)
      if (lt.layer() >= 0 && kind(blk.layers[lt.layer()].op).gemm) {
        if (lt.key == weight_copy_of(blk, lt.layer()).key) gemm_weight(lt.layer());
        if (lt.key == bias_copy_of(blk, lt.layer()).key) gemm_bias(lt.layer());
      }
  }
  // A bf16 copy of a parameter into its planned workspace, written once per call.
  Func bf16_copy(int k, int index, const LocalTensor &lt) {
    if (!copies.count(lt.key)) {
      Func p = param(k, index), copy(name(lt.key));
      if (lt.dims == 2) {
        copy(v.c, v.b) = L.store(p(v.c, v.b));
        sched.pointwise(copy);
      } else {
        copy(v.c) = L.store(p(v.c));
        sched.flat(copy);
      }
      output(lt.key, copy);
      copies[lt.key] = copy;
    }
    return copies.at(lt.key);
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
      const TensorKey out_key = last ? key::block_output() : key::layer_output(blk, j);
      const std::string out_name = name(out_key);
      if (!blk.produces(j)) {  // residual( passes its source on
        const int src = blk.source(j);
        f.out[j] = value(src);
        f.stored[j] = stored(src);
        f.buffered[j] = buffered(src);
        continue;
      }
      const RuleTable &rules = rules_of(l.op);
      if (rules.statistics) rules.statistics(*this, j);
      if (!last && saved(out_key)) {  // saved by the forward
        f.stored[j] = args.tensor(out_key);
        f.out[j] = widened(f.stored[j]);
        f.buffered[j] = true;
        continue;
      }
      const Built b = rules.forward(*this, j, out_name);
      if (last) {
        if (!b.scheduled) sched.pointwise(b.out);
        f.y = b.out;
      } else {
        f.stored[j] = b.out;
        f.out[j] = widened(b.out);  // `out` is the stored value; layers read it as float
        if (writes_output(j)) {
          if (!b.scheduled) sched.pointwise(b.out);
          output(out_key, b.out);
          f.buffered[j] = true;
        }
      }
    }
  }

  // The gradient of one tensor, written to its buffer (rounded to the storage type): {as stored,
  // as float for the rules that read it}.
  std::pair<Func, Func> materialize(const TensorKey &tensor, const std::vector<Contribution> &parts, int width) {
    const std::string name = this->name(tensor);
    if (parts.size() == 1 && parts[0].whole) {
      Func out = parts[0].whole(name);
      output(tensor, out);
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
    if (product) {
      // the library writes dy w^T into this tensor, or into dp<k> when other terms are added
      const bool alone = parts.size() == 1;
      if (alone == product_buffer(blk, product->layer))
        throw std::runtime_error("GEMM: the plan's product buffer for linear " + std::to_string(product->layer) +
                                 " does not match the gradient of " + name);
      const TensorKey gemm_key = alone ? tensor : product_of(blk, product->layer).key;
      const std::string gemm_name = this->name(gemm_key);
      // dy w^T; a tied weight is stored as w^T already (its target's token table [O, K])
      const Layer &l = blk.layers[product->layer];
      Func p = library_gemm(gemm_name, product->product->first, inner, false, product->product->second,
                            l.tied() ? l.in : inner, !l.tied(), std::nullopt, inner, Expr(0),
                            alone ? stored_type() : Float(32));  // dp<k>: fp32
      if (alone) {
        out = p;
      } else {
        output(gemm_key, p);
        Func pv = widened(p);
        out = Func(name);
        out(v.c, v.b) = L.store(others(pv(v.c, v.b)));
        sched.pointwise(out);
      }
    } else {
      out = Func(name);
      out(v.c, v.b) = L.store(others(L.constant(0)));
      const bool scheduled_by_part =
          std::any_of(parts.begin(), parts.end(), [](const Contribution &c) { return bool(c.schedule); });
      if (!scheduled_by_part) sched.pointwise(out);
    }
    for (const Contribution &c : parts)
      if (c.schedule) c.schedule(out);
    output(tensor, out);
    return {out, widened(out)};
  }

  void build_backward() {
    Func dy_stored = args.tensor(key::output_grad());
    const ImageParam x = args.tensor(key::block_input());
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
                                                 : materialize(key::layer_grad(blk, k), grads[k], l.out);
      rules_of(l.op).backward(*this, k, d_stored, d);
    }
    if (needs_dx) materialize(key::input_grad(), grads[-1], blk.in());
  }
};

}  // namespace remat::modelc
