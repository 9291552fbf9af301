module;
#include <Halide.h>

#include "attention.h"
#include "layers.h"
#include "schedules.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
module remat.modelc;
import remat;

namespace remat::modelc {
namespace {

using namespace Halide;
using gen::Layers;
using gen::MatMul;
using gen::Scheduler;

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

// Buffers with static feature widths and a dynamic batch; every kernel argument of one pipeline.
// Tensors are fp32 unless the precision makes them narrower (element_bytes, as the planner).
class Arguments {
public:
  explicit Arguments(Precision precision) : precision(precision) {}
  ImageParam tensor(const LocalTensor &lt) {
    return tensor(str(lt.name), lt.dims, lt.extent, element_bytes(lt, precision) == 2 ? UInt(16) : Float(32));
  }
  // The tensor as float values (a bf16 tensor is widened where it is read).
  Func read(const LocalTensor &lt) { return widened(tensor(lt)); }
  ImageParam tensor(const std::string &name, int dims, std::array<int, 2> extent,
                    std::optional<Type> type = {}) {
    if (auto it = images.find(name); it != images.end()) return it->second;
    ImageParam ip(type.value_or(Float(32)), dims, name);
    constrain(ip, dims, extent);
    images.emplace(name, ip);
    order.push_back(ip);
    return ip;
  }
  Param<bool> &flag(const std::string &name) {
    if (!flags.count(name)) {
      flags.emplace(name, Param<bool>(name));
      order.push_back(flags.at(name));
    }
    return flags.at(name);
  }
  template <class P> static void constrain(P &&p, int dims, std::array<int, 2> extent) {
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

  Precision precision;
  std::map<std::string, ImageParam> images;
  std::map<std::string, Param<bool>> flags;
  std::vector<Argument> order;
};

// A linear whose output only feeds a dropout / residual chain: the chain is applied in the
// GEMM's epilogue when its end is built.
struct PendingGemm {
  Func a, w, bias;
  int inner = 0;
  std::vector<std::function<Expr(Expr)>> epilogue;  // applied in order to sum + bias
  bool operand_buffered = true;                      // a is in memory
};

struct Values {
  std::vector<Func> out;                        // output of layer k (undefined while pending)
  std::vector<Func> stored;                     // ... as stored (bf16 bits or float): GEMM operands
  std::vector<bool> buffered;                   // out[k] is in memory (an input or an output)
  std::map<int, PendingGemm> pending;           // by layer
  std::map<int, Layers::LayerNormStats> stats;  // LayerNorm statistics, by layer
  std::map<int, Func> lse;                      // attention statistics, by layer
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

class StageKernels {
public:
  StageKernels(const Model &model, int stage, const Target &target, Precision precision)
      : blk(model.stages[stage]), stage(stage), needs_dx(needs_input_grad(model, stage)),
        token_input(model.token_input()), precision(precision),
        gemms(target.has_gpu_feature() || precision == Precision::fp32 ? Gemms::library : Gemms::halide),  // runtime::gemms_of
        extern_device(target.has_feature(Target::CUDA)     ? DeviceAPI::CUDA
                      : target.has_feature(Target::OpenCL) ? DeviceAPI::OpenCL
                                                           : DeviceAPI::Host),
        args(precision),
        L(Float(32), v, precision == Precision::bf16), tr(L, model.rows_per_sample()),
        sched(target, v) {
    for (int k = 0; k < blk.n_layers; ++k)
      if (blk.layers[k].op == Op::dropout || blk.layers[k].op == Op::attention) {
        Param<uint64_t> seed("seed"), threshold("drop_threshold");
        Param<int> step("step"), site("rng_block");
        Param<float> scale("drop_scale");
        for (Argument a : {seed.operator Argument(), step.operator Argument(), site.operator Argument(),
                           threshold.operator Argument(), scale.operator Argument()})
          args.order.push_back(a);
        drop = gen::Dropout(seed, step, site, threshold, scale);
        break;
      }
  }

  Pipeline forward(Keep keep) {
    const KernelTensors kt = forward_tensors(blk, keep, gemms, precision);
    std::vector<Func> outputs;
    write_weight_copies(kt, outputs);
    Values f = build_forward(kt, false, outputs);
    outputs.insert(outputs.begin(), f.y);
    return Pipeline(outputs);
  }

  Pipeline backward(Keep keep) {
    const KernelTensors kt = backward_tensors(blk, keep, needs_dx, gemms, precision);
    std::vector<Func> outputs;
    write_weight_copies(kt, outputs);
    Values f = build_forward(kt, true, outputs);
    build_backward(f, outputs);
    return Pipeline(outputs);
  }

  std::vector<Argument> arguments() const { return args.order; }

private:
  Func x_stored() {
    if (token_input && stage == 0) return args.tensor("x", 1, {-1, 0}, Int(32));
    return args.tensor(rows("x", blk.in()));
  }
  Func param(int k, const char *which) {
    for (const LocalTensor &lt : params(blk))
      if (lt.name == cat("p", k, "_", which)) return args.tensor(lt);
    throw std::runtime_error("no parameter");
  }
  gen::Dropout dropout_at(int k) const { return drop.enabled ? drop.at(drop.block + k) : drop; }
  // Output buffers get the same layout constraints as inputs.
  void output(std::vector<Func> &outputs, Func f, const LocalTensor &lt) {
    Arguments::constrain(f.output_buffer(), lt.dims, lt.extent);
    outputs.push_back(f);
  }
  static bool listed(const std::vector<LocalTensor> &list, const Name &name) {
    for (const LocalTensor &lt : list)
      if (lt.name == name) return true;
    return false;
  }

  // ---- library GEMMs: extern stages (runtime/gemm.cpp) ----
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
  // Every parameter copy the plan gives the kernel is written, used or not (the plan counts it).
  void write_weight_copies(const KernelTensors &kt, std::vector<Func> &outputs) {
    for (const LocalTensor &lt : kt.workspace)
      if (lt.layer >= 0 && blk.layers[lt.layer].op == Op::linear) {
        if (lt.name == weight_copy_of(blk, lt.layer).name) gemm_weight(lt.layer, outputs);
        if (lt.name == bias_copy_of(blk, lt.layer).name) library_bias(lt.layer, outputs);
      }
  }
  Type stored_type() const { return precision == Precision::bf16 ? UInt(16) : Float(32); }
  // A bf16 copy of a parameter into its planned workspace, written once per call.
  Func bf16_copy(int k, const char *which, const LocalTensor &lt, std::vector<Func> &outputs) {
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
      output(outputs, copy, lt);
      copies[name] = copy;
    }
    return copies.at(name);
  }
  // The weight of linear k as a GEMM operand: fp32, or its bf16 copy.
  Func gemm_weight(int k, std::vector<Func> &outputs) {
    return weight_copy(precision) ? bf16_copy(k, "w", weight_copy_of(blk, k), outputs) : param(k, "w");
  }
  // The bias of linear k for a library GEMM's epilogue: fp32, or its bf16 copy for bf16 outputs.
  Func library_bias(int k, std::vector<Func> &outputs) {
    return bias_copy(gemms, precision) ? bf16_copy(k, "b", bias_copy_of(blk, k), outputs) : param(k, "b");
  }

  Func build_gemm(const std::string &name, const PendingGemm &p, int width) {
    MatMul m = L.matmul(name, p.a, p.w, p.inner, [&](Expr sum) {
      Expr e = sum + p.bias(v.c);
      for (const auto &op : p.epilogue) e = op(e);
      return L.store(e);
    });
    sched.matmul(m, -1, width, p.operand_buffered ? std::nullopt : std::optional<Func>(p.a));
    return m.out;
  }

  // The forward chain. In a forward kernel, the saved and scratch tensors of kt are outputs. In
  // a backward kernel, saved tensors are inputs and scratch tensors (what it rebuilds) outputs.
  Values build_forward(const KernelTensors &kt, bool backward, std::vector<Func> &outputs) {
    Values f;
    f.x_stored = x_stored();
    f.x = widened(f.x_stored);
    f.out.resize(blk.n_layers);
    f.stored.resize(blk.n_layers);
    f.buffered.resize(blk.n_layers);
    const int n = blk.n_layers;
    auto value = [&](int j) { return j < 0 ? f.x : f.out[j]; };
    auto stored = [&](int j) { return j < 0 ? f.x_stored : f.stored[j]; };
    auto buffered = [&](int j) { return j < 0 || f.buffered[j]; };
    for (int j = 0; j < n; ++j) {
      const Layer &l = blk.layers[j];
      const bool last = j + 1 == n;
      const std::string name = last ? "y" : str(cat("h", j));
      const int src = blk.source(j);
      // statistics: read when saved (backward), otherwise computed and written
      if (l.op == Op::layer_norm) {
        const LocalTensor mean = row_stat(cat("mean", j)), rstd = row_stat(cat("rstd", j));
        if (backward && listed(kt.saved, mean.name)) {
          f.stats[j] = {args.read(mean), args.read(rstd)};
        } else {
          Layers::LayerNormStats st = L.layer_norm_stats(str(mean.name), str(rstd.name), value(src), l.in);
          sched.row_reduction(st.mean, {st.sum});
          sched.row_reduction(st.rstd, {st.sq});
          output(outputs, st.mean, mean);
          output(outputs, st.rstd, rstd);
          f.stats[j] = st;
        }
      }
      if (!last && backward && listed(kt.saved, cat("h", j))) {  // saved by the forward
        f.stored[j] = args.tensor(output_of(blk, j));
        f.out[j] = widened(f.stored[j]);
        f.buffered[j] = true;
        if (l.op == Op::attention) f.lse[j] = args.read(stats_of(blk, j)[0]);
        continue;
      }
      Func out;
      bool gemm_or_reduction = false;
      switch (l.op) {
      case Op::residual_begin:
        f.out[j] = value(src);
        f.stored[j] = stored(src);
        f.buffered[j] = buffered(src);
        continue;
      case Op::linear: {
        if (gemms == Gemms::library) {
          if (!buffered(src)) throw std::runtime_error("library GEMM: the input of linear " + std::to_string(j) + " is not a buffer");
          out = library_gemm(name, stored(src), l.in, false, gemm_weight(j, outputs), l.out, false, library_bias(j, outputs), l.in,
                             Expr(0), stored_type());
          gemm_or_reduction = true;
          break;
        }
        PendingGemm p{value(src), widened(gemm_weight(j, outputs)), param(j, "b"), l.in, {}, buffered(src)};
        if (fused(blk, j)) {
          f.pending[j] = p;
          continue;
        }
        out = build_gemm(name, p, l.out);
        gemm_or_reduction = true;
        break;
      }
      case Op::dropout:
      case Op::residual_end: {
        std::function<Expr(Expr)> op;
        if (l.op == Op::dropout) {
          const gen::Dropout d = dropout_at(j);
          op = [this, d, w = l.out](Expr e) {
            return d.enabled ? e * tr.dropout_factor(d, tr.activation_element(v.c, v.b, w)) : e;
          };
        } else {
          Func skip = value(blk.skip_source(j));
          op = [this, skip](Expr e) { return e + skip(v.c, v.b); };
        }
        if (f.pending.count(src)) {  // continue the epilogue chain of a linear
          PendingGemm p = f.pending.at(src);
          p.epilogue.push_back(op);
          if (!last && fused(blk, j)) {
            f.pending[j] = p;
            continue;
          }
          out = build_gemm(name, p, l.out);
          gemm_or_reduction = true;
        } else {
          out = Func(name);
          Func in = value(src);
          out(v.c, v.b) = L.store(op(in(v.c, v.b)));
        }
        break;
      }
      case Op::layer_norm:
        out = L.layer_norm(name, value(src), f.stats[j], param(j, "w"), param(j, "b"));
        break;
      case Op::gelu: out = L.gelu(name, value(src)); break;
      case Op::relu: out = L.relu(name, value(src)); break;
      case Op::embedding: out = tr.embedding(name, f.x, param(j, "w"), param(j, "b"), l.vocab); break;
      case Op::attention: {
        const LocalTensor lse = stats_of(blk, j)[0];
        std::optional<Func> saved_lse;
        if (backward && listed(kt.saved, lse.name)) saved_lse = args.read(lse);
        const auto finish = [&](auto &a) {  // gen::Attention or gen::AttentionTiles
          if (!saved_lse) output(outputs, a.lse, lse);
          f.lse[j] = saved_lse ? *saved_lse : a.lse;
          out = a.out;
        };
        if (attention_tiles(l)) {
          gen::AttentionTiles a = tr.attention_tiles(str(cat("att", j)), value(src), l.out, l.heads, dropout_at(j),
                                                     saved_lse, name);
          finish(a);
          sched.attention_tiles(a, !saved_lse, l.out / l.heads, tr.T);
        } else {
          gen::Attention a = tr.attention(str(cat("att", j)), value(src), l.out, l.heads, dropout_at(j), saved_lse, name);
          finish(a);
          sched.attention(a, !saved_lse, l.out / l.heads, tr.T);
        }
        gemm_or_reduction = true;
        break;
      }
      }
      if (last) {
        if (!gemm_or_reduction) sched.pointwise(out);
        Arguments::constrain(out.output_buffer(), 2, {l.out, -1});
        f.y = out;
      } else {
        f.stored[j] = out;
        f.out[j] = widened(out);  // `out` is the stored value; layers read it as float
        if (listed(kt.saved, cat("h", j)) || listed(kt.scratch, cat("h", j))) {
          if (!gemm_or_reduction) sched.pointwise(out);
          output(outputs, out, output_of(blk, j));
          f.buffered[j] = true;
        }
      }
    }
    return f;
  }

  // Accumulating parameter gradient: g = (accumulate ? g_prev : 0) + new.
  Expr accumulated(const std::string &grad, const LocalTensor &lt, Expr value, std::vector<Expr> at) {
    ImageParam prev = args.tensor(grad + "_prev", lt.dims, lt.extent);
    return select(args.flag("accumulate"), prev(at), L.constant(0)) + value;
  }
  std::pair<std::string, LocalTensor> grad_of(int k, const char *which) {
    for (const LocalTensor &lt : params(blk))
      if (lt.name == cat("p", k, "_", which)) return {str(grad_name(lt.name)), lt};
    throw std::runtime_error("no parameter");
  }

  // The gradient of one tensor, written to its buffer (rounded to the storage type): {as stored,
  // as float for the rules that read it}.
  std::pair<Func, Func> materialize(std::vector<Func> &outputs, const std::string &name,
                                    const std::vector<Contribution> &parts, int width) {
    if (parts.size() == 1 && parts[0].whole) {
      Func out = parts[0].whole(name);
      output(outputs, out, rows(Name{}.append(name), width));
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
        throw std::runtime_error("library GEMM: the plan's product buffer for linear " + std::to_string(product->layer) +
                                 " does not match the gradient of " + name);
      const std::string gemm_name = alone ? name : str(product_of(blk, product->layer).name);
      Func p = library_gemm(gemm_name, product->product->first, inner, false, product->product->second, inner, true, std::nullopt,
                            inner, Expr(0), alone ? stored_type() : Float(32));  // dp<k>: fp32
      if (alone) {
        out = p;
      } else {
        output(outputs, p, product_of(blk, product->layer));
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
      const bool scheduled_by_part = std::any_of(parts.begin(), parts.end(), [](const Contribution &c) { return bool(c.schedule); });
      if (!scheduled_by_part) sched.pointwise(out);
    }
    for (const Contribution &c : parts)
      if (c.schedule) c.schedule(out);
    output(outputs, out, rows(Name{}.append(name), width));
    return {out, widened(out)};
  }

  void build_backward(Values &f, std::vector<Func> &outputs) {
    Func dy_stored = args.tensor(rows("dy", blk.out()));
    Expr batch = (token_input && stage == 0) ? args.tensor("x", 1, {-1, 0}, Int(32)).dim(0).extent()
                                             : args.tensor(rows("x", blk.in())).dim(1).extent();
    std::map<int, std::vector<Contribution>> grads;  // by tensor; -1 is the block input
    auto value = [&](int j) { return j < 0 ? f.x : f.out[j]; };
    auto stored = [&](int j) { return j < 0 ? f.x_stored : f.stored[j]; };
    auto flows = [&](int j) { return j >= 0 || needs_dx; };
    for (int k = blk.n_layers - 1; k >= 0; --k) {
      const Layer &l = blk.layers[k];
      const int src = blk.source(k);
      if (!blk.produces(k)) {  // residual( passes its gradient to its source
        if (flows(src))
          for (Contribution &c : grads[k]) grads[src].push_back(c);
        continue;
      }
      auto [d_stored, d] = k + 1 == blk.n_layers ? std::pair{dy_stored, widened(dy_stored)}
                                                 : materialize(outputs, str(cat("dh", k)), grads[k], l.out);
      switch (l.op) {
      case Op::linear: {
        // dW = x^T dy (+ dW when accumulating), db a column sum, and the input gradient dy w^T
        auto [gw_name, gw_spec] = grad_of(k, "w");
        if (gemms == Gemms::library) {
          Func gw = library_gemm(gw_name, stored(src), l.in, true, d_stored, l.out, false, std::nullopt, batch, args.flag("accumulate"),
                                 Float(32));
          output(outputs, gw, gw_spec);
        } else {
          MatMul gw = L.linear_weight_grad(gw_name, value(src), d, batch, [&](Expr sum) {
            return accumulated(gw_name, gw_spec, sum, {v.c, v.b});
          });
          sched.matmul(gw, l.in, l.out);
          output(outputs, gw.out, gw_spec);
        }
        auto [gb_name, gb_spec] = grad_of(k, "b");
        Func gb_sum = L.column_sum(gb_name + "_sum", d, batch), gb(gb_name);
        gb(v.c) = accumulated(gb_name, gb_spec, gb_sum(v.c), {v.c});
        sched.column_sum(gb, gb_sum, gb_sum.rvars(0)[0], l.out);
        output(outputs, gb, gb_spec);
        if (!flows(src)) break;
        if (gemms == Gemms::library) {  // the library transposes the weight itself
          grads[src].push_back({Func(), std::pair{d_stored, gemm_weight(k, outputs)}, k, {}});
        } else {
          Func wt = L.transpose(str(cat("p", k, "_wt")), param(k, "w"));
          sched.transpose(wt);
          output(outputs, wt, {cat("p", k, "_wt"), 2, {l.in, l.out}});
          grads[src].push_back({Func(), std::pair{d, widened(wt)}, k, {}});
        }
        break;
      }
      case Op::layer_norm: {
        auto g = L.layer_norm_grad(str(cat("s", k, "_1")), str(cat("s", k, "_2")), str(cat("ln", k, "_dx")),
                                   value(src), f.stats[k], param(k, "w"), d, l.in, batch);
        auto [gw_name, gw_spec] = grad_of(k, "w");
        auto [gb_name, gb_spec] = grad_of(k, "b");
        Func gw(gw_name), gb(gb_name);
        gw(v.c) = accumulated(gw_name, gw_spec, g.dgamma(v.c), {v.c});
        gb(v.c) = accumulated(gb_name, gb_spec, g.dbeta(v.c), {v.c});
        sched.column_sum(gw, g.dgamma, g.dgamma.rvars(0)[0], l.in);
        sched.column_sum(gb, g.dbeta, g.dbeta.rvars(0)[0], l.in);
        output(outputs, gw, gw_spec);
        output(outputs, gb, gb_spec);
        if (flows(src)) {
          sched.row_reduction(g.s1);
          sched.row_reduction(g.s2);
          output(outputs, g.s1, row_stat(cat("s", k, "_1")));
          output(outputs, g.s2, row_stat(cat("s", k, "_2")));
          grads[src].push_back({g.dx});
        }
        break;
      }
      case Op::gelu:
        if (flows(src)) grads[src].push_back({L.gelu_grad(str(cat("gelu", k, "_dx")), value(src), d)});
        break;
      case Op::relu:
        if (flows(src)) grads[src].push_back({L.relu_grad(str(cat("relu", k, "_dx")), value(src), d)});
        break;
      case Op::dropout:
        if (flows(src)) grads[src].push_back({tr.dropout_grad(str(cat("drop", k, "_dx")), d, l.out, dropout_at(k))});
        break;
      case Op::residual_end:
        if (flows(src)) grads[src].push_back({d});
        if (flows(blk.skip_source(k))) grads[blk.skip_source(k)].push_back({d});
        break;
      case Op::attention: {
        gen::AttentionGrad g = tr.attention_grad(str(cat("att", k)), value(src), value(k), f.lse[k], d,
                                                 l.out, l.heads, dropout_at(k));
        sched.attention_delta(g.delta);
        output(outputs, g.delta, head_stat(cat("att", k, "_delta"), l.heads));
        const int head_dim = l.out / l.heads;
        Contribution c{g.dqkv, {}, -1, [this, g, head_dim](Func consumer) { sched.attention_grad(consumer, g, head_dim, tr.T); }};
        if (attention_tiles(l))
          c.whole = [this, qkv = value(src), lse = f.lse[k], dout = d, delta = g.delta, drop = dropout_at(k), batch, k, l,
                     head_dim](const std::string &name) {
            gen::AttentionTilesGrad t =
                tr.attention_tiles_grad(str(cat("datt", k)), qkv, delta, lse, dout, l.out, l.heads, drop, batch, name);
            sched.attention_tiles_grad(t, head_dim, tr.T);
            return t.dqkv;
          };
        grads[src].push_back(c);
        break;
      }
      case Op::embedding: {
        auto [gw_name, gw_spec] = grad_of(k, "w");
        auto [gb_name, gb_spec] = grad_of(k, "b");
        gen::EmbeddingGrad g = tr.embedding_grad(str(cat("emb", k)), f.x, d, l.vocab, batch,
                                                 accumulated(gw_name, gw_spec, L.constant(0), {v.c, v.b}),
                                                 accumulated(gb_name, gb_spec, L.constant(0), {v.c, v.b}),
                                                 gw_name, gb_name);
        sched.embedding_grad(g);
        output(outputs, g.dwte, gw_spec);
        output(outputs, g.dwpe, gb_spec);
        break;
      }
      case Op::residual_begin: break;
      }
    }
    if (needs_dx) materialize(outputs, "dx", grads[-1], blk.in());
  }

  // CPU attention (forward, and backward where its gradient is the qkv tensor's only one) by
  // (sequence, head) tiles where their buffers fit Halide's stack.
  bool attention_tiles(const Layer &l) const { return !sched.gpu && Scheduler::attention_tiles_fit(l.out, l.heads, tr.T); }

  const Block &blk;
  int stage;
  bool needs_dx, token_input;
  Precision precision;
  Gemms gemms;
  DeviceAPI extern_device;     // the device of a library GEMM's buffers (host, CUDA, or OpenCL for the tests)
  std::map<std::string, Func> copies;  // bf16 parameter copies, by name
  gen::Vars v;
  Arguments args;
  Layers L;
  gen::Transformer tr;
  Scheduler sched;
  gen::Dropout drop;
};

}  // namespace
}  // namespace remat::modelc

namespace remat::modelc {
namespace {

// Cross-entropy over the classes of each row. row_max and row_lse are small per-row outputs so
// that the kernel allocates nothing of its own.
Pipeline loss_kernel(int classes, Arguments &args, const Target &target) {
  gen::Vars v;
  Layers L(Float(32), v, args.precision == Precision::bf16);
  Scheduler sched(target, v);
  Func logits = args.read(rows("logits", classes));
  ImageParam labels = args.tensor("labels", 1, {-1, 0}, Int(32));
  Param<float> scale("grad_scale");
  args.order.push_back(scale);
  auto ce = L.cross_entropy(logits, labels, classes, scale);
  sched.cross_entropy(ce);
  std::vector<Func> outs = {ce.dlogits, ce.row_loss, ce.row_correct, ce.row_max, ce.row_lse};
  Arguments::constrain(ce.dlogits.output_buffer(), 2, {classes, -1});
  for (size_t i = 1; i < outs.size(); ++i) Arguments::constrain(outs[i].output_buffer(), 1, {-1, 0});
  return Pipeline(outs);
}

// AdamW over a flat range, in place: p, m, v are read and written at the same element.
Pipeline adamw_kernel(Arguments &args, const Target &target) {
  gen::Vars v;
  Layers L(Float(32), v);
  ImageParam p = args.tensor("p", 1, {-1, 0}), g = args.tensor("g", 1, {-1, 0}),
             m = args.tensor("m", 1, {-1, 0}), var = args.tensor("v", 1, {-1, 0});
  std::vector<Param<float>> s;
  for (const char *name : {"lr", "beta1", "beta2", "eps", "weight_decay", "bias1", "bias2"}) {
    s.emplace_back(name);
    args.order.push_back(s.back());
  }
  Func upd = L.adamw(p, g, m, var, s[0], s[1], s[2], s[3], s[4], s[5], s[6]);
  Scheduler(target, v).flat(upd);
  Arguments::constrain(upd.output_buffers()[0], 1, {-1, 0});  // the others follow the first
  return Pipeline(upd);
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
      auto [pipeline, args] = build(t);
      return pipeline.compile_to_module(args, fn, t);
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
              StageKernels k(model, s, t, precision);
              Pipeline p = backward ? k.backward(keep) : k.forward(keep);
              return std::pair{p, k.arguments()};
            });
          }
        }
      }
      emit(str(kernel_name(name, 0, Variant::loss, precision)), targets, [&](const Target &t) {
        Arguments args(precision);
        Pipeline p = loss_kernel(model.classes(), args, t);
        return std::pair{p, args.order};
      });
    }
    emit(str(kernel_name(name, 0, Variant::adamw)), targets, [&](const Target &t) {
      Arguments args(Precision::fp32);
      Pipeline p = adamw_kernel(args, t);
      return std::pair{p, args.order};
    });
  }
};

}  // namespace

// CUDA kernels: PTX for a pinned compute capability (a bare host-cuda target would ask the
// driver at build time), host code for the pinned CPU features.
Target cuda_target(const std::string &cpu_target, int capability) {
  const std::map<int, Target::Feature> features = {{70, Target::CUDACapability70}, {75, Target::CUDACapability75},
                                                   {80, Target::CUDACapability80}, {86, Target::CUDACapability86}};
  if (!features.count(capability)) throw std::runtime_error("unsupported --cuda-capability " + std::to_string(capability));
  return Target(cpu_target).with_feature(Target::CUDA).with_feature(features.at(capability));
}

int main(int argc, char **argv, const Model &model, std::string_view model_name) {
  std::string out_dir, cpu_targets = "host";
  int capability = 0;  // 0: no CUDA kernels
  bool opencl = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--opencl") opencl = true;
    else if (flag == "--out" && i + 1 < argc) out_dir = argv[++i];
    else if (flag == "--cpu-targets" && i + 1 < argc) cpu_targets = argv[++i];
    else if (flag == "--cuda-capability" && i + 1 < argc) capability = std::atoi(argv[++i]);
    else out_dir.clear(), i = argc;  // unknown: print the usage
  }
  if (out_dir.empty()) {
    std::fprintf(stderr, "usage: %s --out DIR [--cpu-targets BEST,...,BASELINE] [--cuda-capability NN] [--opencl]\n", argv[0]);
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
    compile_standalone_runtime(runtime, runtime_target.without_feature(Target::StrictFloat));  // Halide's own code is not strict
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
                       std::string((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>()));
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
