module;
#include <Halide.h>

#include "layers.h"

#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
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

std::string str(const Name &n) { return std::string(n.view()); }

// Buffers with static feature widths and a dynamic batch; every kernel argument of one pipeline.
class Arguments {
public:
  explicit Arguments(Type t) : t(t) {}
  ImageParam tensor(const LocalTensor &lt) { return tensor(str(lt.name), lt.dims, lt.extent); }
  ImageParam tensor(const std::string &name, int dims, std::array<int, 2> extent,
                    std::optional<Type> type = {}) {
    if (auto it = images.find(name); it != images.end()) return it->second;
    ImageParam ip(type.value_or(t), dims, name);
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

  Type t;
  std::map<std::string, ImageParam> images;
  std::map<std::string, Param<bool>> flags;
  std::vector<Argument> order;
};

// Schedules, one per kernel shape; every Func of a given role gets the same one in every
// variant, so a recomputed value is bit-identical to the one computed the first time.
class Scheduler {
public:
  Scheduler(const Target &target, const gen::Vars &v)
      : v(v), vec(target.natural_vector_size<float>()) {}

  // Register tiles of tile_c x tile_b outputs accumulate over the whole inner dimension. Tiles
  // never run past a static extent (tile sizes divide it), and a dynamic row count (the batch)
  // uses overlapping last tiles (ShiftInwards), which needs rows >= min_batch.
  static constexpr int min_batch = 8;
  void matmul(MatMul &m, int rows /* -1: the batch */, int cols) {
    Var co("co"), bo("bo"), ci("ci"), bi("bi");
    int tile_c = 0, tile_b = 1;
    for (int t : {2 * vec, vec})
      if (!tile_c && cols % t == 0) tile_c = t;
    for (int t : {6, 4, 2})
      if (tile_b == 1 && (rows < 0 ? t <= min_batch : rows % t == 0)) tile_b = t;
    const TailStrategy row_tail = rows < 0 ? TailStrategy::ShiftInwards : TailStrategy::GuardWithIf;
    if (!tile_c) {  // narrow outputs (e.g. 10 classes): whole rows, scalar
      m.out.compute_root().split(v.b, bo, bi, tile_b, row_tail).reorder(v.c, bi, bo).parallel(bo);
      m.acc.compute_at(m.out, bo);
      m.acc.update().reorder(v.c, v.b, m.k);
      return;
    }
    m.out.compute_root()
        .split(v.c, co, ci, tile_c, TailStrategy::GuardWithIf)
        .split(v.b, bo, bi, tile_b, row_tail)
        .reorder(ci, bi, bo, co)
        .vectorize(ci, vec)
        .unroll(ci)
        .unroll(bi)
        .parallel(co);
    m.acc.compute_at(m.out, bo).vectorize(v.c, vec).unroll(v.c).unroll(v.b);
    m.acc.update().reorder(v.c, v.b, m.k).vectorize(v.c, vec).unroll(v.c).unroll(v.b);
  }
  void pointwise(Func f) {
    Var co("co"), ci("ci");
    f.compute_root().split(v.c, co, ci, vec, TailStrategy::GuardWithIf).vectorize(ci).parallel(v.b, 8, TailStrategy::GuardWithIf);
  }
  void transpose(Func f) {
    Var co("co"), ci("ci"), bo("bo"), bi("bi");
    f.compute_root()
        .tile(v.c, v.b, co, bo, ci, bi, vec, vec, TailStrategy::GuardWithIf)
        .vectorize(ci)
        .unroll(bi)
        .parallel(bo);
  }
  // f(b) = g(reduction over the features of row b); `partial` are the row reductions it reads
  void row_reduction(Func f, std::vector<Func> partial = {}) {
    f.compute_root().parallel(v.b, 16, TailStrategy::GuardWithIf);
    if (f.has_update_definition()) f.update().parallel(v.b, 16, TailStrategy::GuardWithIf);
    for (Func &p : partial) p.compute_at(f, v.b);
  }
  // out(c) = epilogue(sum over rows of ...): `sum` is computed vector by vector inside `out`
  void column_sum(Func out, Func sum, RVar rows, int cols) {
    Var co("co"), ci("ci");
    if (cols % vec != 0) {  // narrow: scalar columns
      out.compute_root();
      sum.compute_at(out, v.c);
      return;
    }
    out.compute_root().split(v.c, co, ci, vec).vectorize(ci).parallel(co);
    sum.compute_at(out, co).vectorize(v.c);
    sum.update().reorder(v.c, rows).vectorize(v.c);
  }

  const gen::Vars &v;
  int vec;
};

enum class Mode { save, discard, recompute };

struct ForwardFuncs {
  std::vector<Func> h;                            // output of layer k, k < n - 1
  std::map<int, Layers::LayerNormStats> stats;    // by layer index
  Func y;
};

class StageKernels {
public:
  StageKernels(const Block &blk, bool needs_dx, const Target &target)
      : blk(blk), needs_dx(needs_dx), target(target), args(Float(32)), L(Float(32), v),
        sched(target, v) {}

  Pipeline forward(Mode mode) {
    std::vector<Func> outputs;
    ForwardFuncs f = build_forward(mode, outputs);
    outputs.insert(outputs.begin(), f.y);
    return Pipeline(outputs);
  }

  Pipeline backward(Mode mode) {
    std::vector<Func> outputs;
    ForwardFuncs f;
    if (mode == Mode::recompute) {
      f = build_forward(mode, outputs);
    } else {
      for (int k = 0; k + 1 < blk.n_layers; ++k)
        f.h.push_back(args.tensor(rows(cat("h", k), blk.width_after(k))));
      for (int k = 0; k < blk.n_layers; ++k)
        if (blk.layers[k].op == Op::layer_norm)
          f.stats[k] = {args.tensor(row_stat(cat("mean", k))), args.tensor(row_stat(cat("rstd", k)))};
    }
    build_backward(f, outputs);
    return Pipeline(outputs);
  }

  std::vector<Argument> arguments() const { return args.order; }

private:
  Func x() { return args.tensor(rows("x", blk.in())); }
  Func param(int k, const char *which) {
    for (const LocalTensor &lt : params(blk))
      if (lt.name == cat("p", k, "_", which)) return args.tensor(lt);
    throw std::runtime_error("no parameter");
  }
  // Output buffers get the same layout constraints as inputs.
  void output(std::vector<Func> &outputs, Func f, const LocalTensor &lt) {
    Arguments::constrain(f.output_buffer(), lt.dims, lt.extent);
    outputs.push_back(f);
  }

  ForwardFuncs build_forward(Mode mode, std::vector<Func> &outputs) {
    ForwardFuncs f;
    Func cur = x();
    const int n = blk.n_layers;
    for (int k = 0; k < n; ++k) {
      const Layer &l = blk.layers[k];
      const bool last = k + 1 == n;
      const std::string name = last ? "y" : str(cat("h", k));
      Func out;
      switch (l.op) {
      case Op::linear: {
        Func input = x();
        MatMul m = L.matmul(name, cur, param(k, "w"), l.in, [&](Expr sum) {
          Expr e = sum + param(k, "b")(v.c);
          return last && blk.residual ? e + input(v.c, v.b) : e;  // residual folded in
        });
        sched.matmul(m, -1, l.out);
        out = m.out;
        break;
      }
      case Op::layer_norm: {
        Layers::LayerNormStats st = L.layer_norm_stats(str(cat("mean", k)), str(cat("rstd", k)), cur, l.in);
        sched.row_reduction(st.mean, {st.sum});
        sched.row_reduction(st.rstd, {st.sq});
        output(outputs, st.mean, row_stat(cat("mean", k)));
        output(outputs, st.rstd, row_stat(cat("rstd", k)));
        f.stats[k] = st;
        out = L.layer_norm(name, cur, st, param(k, "w"), param(k, "b"));
        break;
      }
      case Op::gelu: out = L.gelu(name, cur); break;
      case Op::relu: out = L.relu(name, cur); break;
      }
      if (last) {
        if (l.op != Op::linear && blk.residual) {
          Func input = x(), y("y");
          y(v.c, v.b) = out(v.c, v.b) + input(v.c, v.b);
          out = y;
        }
        if (l.op != Op::linear) sched.pointwise(out);
        Arguments::constrain(out.output_buffer(), 2, {l.out, -1});
        f.y = out;
      } else {
        f.h.push_back(out);
        const bool materialize = mode == Mode::save || !cheap_to_recompute(l.op);
        if (materialize) {
          if (l.op != Op::linear) sched.pointwise(out);
          output(outputs, out, rows(cat("h", k), l.out));
        }
      }
      cur = out;
    }
    return f;
  }

  // Accumulating parameter gradient: g = (accumulate ? g_prev : 0) + new.
  Expr accumulated(const std::string &grad, const LocalTensor &lt, Expr value,
                   std::vector<Expr> at) {
    ImageParam prev = args.tensor(grad + "_prev", lt.dims, lt.extent);
    return select(args.flag("accumulate"), prev(at), L.constant(0)) + value;
  }

  void build_backward(ForwardFuncs &f, std::vector<Func> &outputs) {
    ImageParam dy = args.tensor(rows("dy", blk.out()));
    Expr batch = args.tensor(rows("x", blk.in())).dim(1).extent();
    Func d = dy;  // gradient of the current layer's output
    auto grad_of = [&](int k, const char *which) -> std::pair<std::string, LocalTensor> {
      for (const LocalTensor &lt : params(blk))
        if (lt.name == cat("p", k, "_", which)) return {str(grad_name(lt.name)), lt};
      throw std::runtime_error("no parameter");
    };
    for (int k = blk.n_layers - 1; k >= 0; --k) {
      const Layer &l = blk.layers[k];
      Func in = k == 0 ? x() : f.h[k - 1];
      const bool grad_in = k > 0 || needs_dx;
      const bool to_dx = k == 0;
      const std::string din_name = to_dx ? "dx" : str(cat("dh", k - 1));
      auto add_residual = [&](Expr e) { return to_dx && blk.residual ? e + dy(v.c, v.b) : e; };
      std::optional<Func> din;
      switch (l.op) {
      case Op::linear: {
        auto [gw_name, gw_spec] = grad_of(k, "w");
        MatMul gw = L.linear_weight_grad(gw_name, in, d, batch, [&](Expr sum) {
          return accumulated(gw_name, gw_spec, sum, {v.c, v.b});
        });
        sched.matmul(gw, l.in, l.out);
        output(outputs, gw.out, gw_spec);
        auto [gb_name, gb_spec] = grad_of(k, "b");
        Func gb_sum = L.column_sum(gb_name + "_sum", d, batch), gb(gb_name);
        gb(v.c) = accumulated(gb_name, gb_spec, gb_sum(v.c), {v.c});
        sched.column_sum(gb, gb_sum, gb_sum.rvars(0)[0], l.out);
        output(outputs, gb, gb_spec);
        if (grad_in) {
          Func wt = L.transpose(str(cat("p", k, "_wt")), param(k, "w"));
          sched.transpose(wt);
          output(outputs, wt, {cat("p", k, "_wt"), 2, {l.in, l.out}});
          MatMul dx = L.matmul(din_name, d, wt, l.out, add_residual);
          sched.matmul(dx, -1, l.in);
          din = dx.out;
        }
        break;
      }
      case Op::layer_norm: {
        auto g = L.layer_norm_grad(str(cat("s", k, "_1")), str(cat("s", k, "_2")), din_name + "_ln",
                                   in, f.stats[k], param(k, "w"), d, l.in, batch);
        auto [gw_name, gw_spec] = grad_of(k, "w");
        auto [gb_name, gb_spec] = grad_of(k, "b");
        Func gw(gw_name), gb(gb_name);
        gw(v.c) = accumulated(gw_name, gw_spec, g.dgamma(v.c), {v.c});
        gb(v.c) = accumulated(gb_name, gb_spec, g.dbeta(v.c), {v.c});
        sched.column_sum(gw, g.dgamma, g.dgamma.rvars(0)[0], l.in);
        sched.column_sum(gb, g.dbeta, g.dbeta.rvars(0)[0], l.in);
        output(outputs, gw, gw_spec);
        output(outputs, gb, gb_spec);
        if (grad_in) {
          sched.row_reduction(g.s1);
          sched.row_reduction(g.s2);
          output(outputs, g.s1, row_stat(cat("s", k, "_1")));
          output(outputs, g.s2, row_stat(cat("s", k, "_2")));
          Func dx(din_name);
          dx(v.c, v.b) = add_residual(g.dx(v.c, v.b));
          sched.pointwise(dx);
          din = dx;
        }
        break;
      }
      case Op::gelu:
      case Op::relu: {
        Func raw = l.op == Op::gelu ? L.gelu_grad(din_name + "_raw", in, d)
                                    : L.relu_grad(din_name + "_raw", in, d);
        Func dx(din_name);
        dx(v.c, v.b) = add_residual(raw(v.c, v.b));
        sched.pointwise(dx);
        din = dx;
        break;
      }
      }
      if (din) {
        output(outputs, *din, rows(Name{}.append(din_name), l.in));
        d = *din;
      }
    }
  }

  const Block &blk;
  bool needs_dx;
  Target target;
  gen::Vars v;
  Arguments args;
  Layers L;
  Scheduler sched;
};

}  // namespace
}  // namespace remat::modelc

namespace remat::modelc {
namespace {

// Cross-entropy over the classes of each row. row_max and row_lse are small per-row outputs so
// that the kernel allocates nothing of its own.
Pipeline loss_kernel(int classes, Arguments &args, const Target &target) {
  gen::Vars v;
  Layers L(Float(32), v);
  Scheduler sched(target, v);
  ImageParam logits = args.tensor("logits", 2, {classes, -1});
  ImageParam labels = args.tensor("labels", 1, {-1, 0}, Int(32));
  Param<float> scale("grad_scale");
  args.order.push_back(scale);
  auto ce = L.cross_entropy(logits, labels, classes, scale);
  ce.row_max.compute_root().parallel(v.b, 16, TailStrategy::GuardWithIf);
  ce.row_max.update().parallel(v.b, 16, TailStrategy::GuardWithIf);
  ce.row_lse.compute_root().parallel(v.b, 16, TailStrategy::GuardWithIf);
  ce.sum_exp.compute_at(ce.row_lse, v.b);
  for (Func f : {ce.row_loss, ce.row_correct}) f.compute_root().parallel(v.b, 16, TailStrategy::GuardWithIf);
  sched.pointwise(ce.dlogits);
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
  const int vec = target.natural_vector_size<float>();
  Var co("co"), ci("ci");
  upd.compute_root()
      .split(v.c, co, ci, vec * 64, TailStrategy::GuardWithIf)
      .parallel(co)
      .vectorize(ci, vec, TailStrategy::GuardWithIf);
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
  std::ofstream(tmp, std::ios::binary) << text;
  std::filesystem::rename(tmp, path);
}

struct Emitter {
  std::filesystem::path out, staging;
  Target target;
  std::vector<std::string> objects, names;

  void emit(const std::string &name, Pipeline p, const std::vector<Argument> &args) {
    const auto base = (staging / name).string();
    p.compile_to({{OutputFileType::object, base + ".o"}, {OutputFileType::c_header, base + ".h"}},
                 args, name, target.with_feature(Target::NoRuntime));
    objects.push_back(base + ".o");
    names.push_back(name);
  }
};

}  // namespace

int main(int argc, char **argv, const Model &model, std::string_view model_name) {
  std::string out_dir, cpu_target = "host";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--out") out_dir = argv[i + 1];
    else if (flag == "--cpu-target") cpu_target = argv[i + 1];
  }
  if (out_dir.empty()) {
    std::fprintf(stderr, "usage: %s --out DIR [--cpu-target TARGET]\n", argv[0]);
    return 2;
  }
  try {
    const std::string name(model_name);
    Emitter e{out_dir, std::filesystem::path(out_dir) / "staging", Target(cpu_target)};
    std::filesystem::create_directories(e.staging);
    for (int s = 0; s < model.n_stages; ++s) {
      const Block &blk = model.stages[s];
      std::vector<Variant> variants = {Variant::forward_save, Variant::forward_discard,
                                       Variant::backward_saved};
      if (blk.checkpointable) variants.push_back(Variant::backward_recompute);
      for (Variant var : variants) {
        StageKernels k(blk, s > 0, e.target);
        Pipeline p = var == Variant::forward_save      ? k.forward(Mode::save)
                     : var == Variant::forward_discard ? k.forward(Mode::discard)
                     : var == Variant::backward_saved  ? k.backward(Mode::save)
                                                       : k.backward(Mode::recompute);
        e.emit(str(kernel_name(name, s, var)), p, k.arguments());
      }
    }
    {
      Arguments args(Float(32));
      Pipeline p = loss_kernel(model.classes(), args, e.target);
      e.emit(str(kernel_name(name, 0, Variant::loss)), p, args.order);
    }
    {
      Arguments args(Float(32));
      Pipeline p = adamw_kernel(args, e.target);
      e.emit(str(kernel_name(name, 0, Variant::adamw)), p, args.order);
    }
    const auto runtime = (e.staging / "halide_runtime.o").string();
    compile_standalone_runtime(runtime, e.target);
    std::vector<std::string> all = e.objects;
    all.push_back(runtime);
    const auto lib = (e.staging / ("lib" + name + "_kernels.a")).string();
    create_static_library(all, e.target, lib);

    // The module interface: the kernel table, by name.
    std::string cppm = "// Generated by the remat model compiler from the model module `" + name +
                       "`. Do not edit.\nmodule;\n#include <HalideRuntime.h>\n";
    for (const auto &n : e.names) cppm += "#include \"" + n + ".h\"\n";
    cppm += "export module " + name + ".kernels;\nimport remat.runtime;\n\nexport namespace " + name +
            "_kernels {\ninline constexpr remat::runtime::Kernel table[] = {\n";
    for (const auto &n : e.names)
      cppm += "    {\"" + n + "\", &" + n + "_argv, &" + n + "_metadata},\n";
    cppm += "};\n}  // namespace " + name + "_kernels\n";
    write_if_changed(std::filesystem::path(out_dir) / (name + ".kernels.cppm"), cppm);
    std::vector<std::string> published = {"lib" + name + "_kernels.a"};
    for (const auto &n : e.names) published.push_back(n + ".h");
    for (const auto &file : published) {
      std::ifstream in(e.staging / file, std::ios::binary);
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
