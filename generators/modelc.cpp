// The model compiler (module remat.modelc's main): builds every kernel of a model with
// StageKernels and its kinds' rules, the loss and AdamW kernels, and writes them with their
// kernel tables.
#include <Halide.h>

#include "cuda_launches.h"
#include "cuda_strict.h"
#include "layers.h"
#include "schedules.h"
#include "stage_kernels.h"
#include "kind_rules.h"  // generated: every kind's rules.h (generators/kinds/list.h)

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
import remat.tensors;

namespace remat::modelc {

// Every kind's rules, by Op.
const RuleTable &rules_of(Op op) {
  static constexpr std::array<RuleTable, n_ops> table = {{
#define REMAT_KIND(name) rule_table_entry<Op::name>(),
#include "kinds/list.h"
#undef REMAT_KIND
  }};
  return table[std::size_t(op)];
}

}  // namespace remat::modelc

namespace remat::modelc {
namespace {

// Cross-entropy over the classes of each row. row_max and row_lse are small per-row outputs so
// that the kernel allocates nothing of its own.
Pipeline loss_kernel(int classes, const Arguments &args, const Target &target) {
  gen::Vars v;
  Layers L(Float(32), v, args.precision == Precision::bf16);
  Scheduler sched(target, v);
  auto ce = L.cross_entropy(args.read(rows(key::of(Slot::logits), classes)), args.tensor(key::of(Slot::labels)),
                            classes, args.scalar(Scalar::grad_scale));
  sched.cross_entropy(ce);
  return Pipeline(args.outputs({{key::of(Slot::dlogits), ce.dlogits},
                                {key::of(Slot::row_loss), ce.row_loss},
                                {key::of(Slot::row_correct), ce.row_correct},
                                {key::of(Slot::row_max), ce.row_max},
                                {key::of(Slot::row_lse), ce.row_lse}}));
}

// AdamW over a flat range, in place: p, m, v are read and written at the same element.
Pipeline adamw_kernel(const Arguments &args, const Target &target) {
  gen::Vars v;
  Layers L(Float(32), v);
  auto s = [&](Scalar x) { return args.scalar(x); };
  Func upd = L.adamw(args.tensor(key::adamw(Slot::adamw_param)), args.tensor(key::adamw(Slot::adamw_grad)),
                     args.tensor(key::adamw(Slot::adamw_m)), args.tensor(key::adamw(Slot::adamw_v)), s(Scalar::lr),
                     s(Scalar::beta1), s(Scalar::beta2), s(Scalar::eps), s(Scalar::weight_decay), s(Scalar::bias1),
                     s(Scalar::bias2));
  Scheduler(target, v).flat(upd);
  return Pipeline(args.outputs({{key::adamw(Slot::adamw_param), upd}}));  // the Tuple {p, m, v}
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

// One generated kernel: its key, its name, and its C symbol for one target. `api`: "" (CPU), "cuda",
// or "opencl" (the GPU schedules for OpenCL, so that tests can run them on PoCL).
struct Emitted {
  KernelKey key;
  std::string name, symbol, api;
};

struct Emitter {
  std::filesystem::path staging;
  std::vector<std::string> objects;
  std::vector<Emitted> kernels;
  std::string launch_report;  // every CUDA launch, a line each (<model>.cuda-launches.txt)

  // One kernel for `targets` (best first): with more than one, an object per target and a
  // wrapper that picks the first one the running CPU can use (halide_can_use_target_features;
  // runtime/executor.cpp can force the last). `build` makes the pipeline for a target, scheduled
  // for its vector width.
  using Build = std::function<std::pair<Pipeline, std::vector<Argument>>(const Target &)>;
  void emit(const std::string &model, const KernelKey &key, const std::vector<Target> &targets, const Build &build) {
    const std::string name = str(name_of(model, key));
    const Target &base = targets.back();
    const std::string api = base.has_feature(Target::CUDA) ? "cuda" : base.has_feature(Target::OpenCL) ? "opencl" : "";
    const std::string symbol = api.empty() ? name : name + "_" + api;
    const auto prefix = (staging / symbol).string();
    std::map<OutputFileType, std::string> files = {{OutputFileType::object, prefix + ".o"},
                                                   {OutputFileType::c_header, prefix + ".h"}};
    if (std::getenv("REMAT_STMT")) files[OutputFileType::stmt] = prefix + ".stmt";  // for reading schedules
    std::vector<gen::CudaLaunch> launches;
    std::vector<Target> no_runtime;
    std::vector<std::string> suffixes;
    for (const Target &t : targets) {
      no_runtime.push_back(t.with_feature(Target::NoRuntime));
      suffixes.push_back(t.has_feature(Target::AVX512) ? "avx512" : "avx2");
    }
    compile_multitarget(symbol, files, no_runtime, suffixes, [&](const std::string &fn, const Target &t) {
      try {
        auto [pipeline, args] = build(t);
        if (t.has_feature(Target::CUDA)) {
          pipeline.add_custom_lowering_pass(new gen::KeepMultipliesApart);
          pipeline.add_custom_lowering_pass(new gen::CudaLaunches(launches));
        }
        return pipeline.compile_to_module(args, fn, t);
      } catch (const std::runtime_error &e) { throw std::runtime_error(name + ": " + e.what()); }
    });
    for (const gen::CudaLaunch &l : launches) {
      if (const std::string problem = l.problem(); !problem.empty())
        throw std::runtime_error(name + ": the CUDA kernel " + l.kernel + " cannot launch on an H100: " + problem);
      launch_report += name + " " + l.describe() + "\n";
    }
    if (targets.size() == 1) {
      objects.push_back(prefix + ".o");
    } else {
      for (const std::string &suffix : suffixes) objects.push_back(prefix + "-" + suffix + ".o");
      objects.push_back(prefix + "_wrapper.o");
    }
    kernels.push_back({key, name, symbol, api});
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
            emit(name, kernel_key(s, variant, precision), targets, [&](const Target &t) {
              StageKernels k(model, s, variant, t, precision);
              Pipeline p = k.build();
              return std::pair{p, k.arguments()};
            });
          }
        }
      }
      emit(name, kernel_key(-1, Variant::loss, precision), targets, [&](const Target &t) {
        const Arguments args(signature(model, -1, Variant::loss, precision), precision);
        return std::pair{loss_kernel(model.classes(), args, t), args.order};
      });
    }
    emit(name, kernel_key(-1, Variant::adamw, Precision::fp32), targets, [&](const Target &t) {
      const Arguments args(signature(model, -1, Variant::adamw, Precision::fp32), Precision::fp32);
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

// The module interface: the kernel tables (CPU, CUDA, OpenCL), each kernel by its key.
std::string kernels_module(const std::string &name, const std::vector<Emitted> &kernels) {
  std::string cppm = "// Generated by the remat model compiler from the model module `" + name +
                     "`. Do not edit.\nmodule;\n#include <HalideRuntime.h>\n\n#include <span>\n";
  for (const Emitted &k : kernels) cppm += "#include \"" + k.symbol + ".h\"\n";
  cppm += "export module " + name + ".kernels;\nimport remat;\nimport remat.runtime;\n\nexport namespace " + name +
          "_kernels {\n";
  for (const std::string api : {"", "cuda", "opencl"}) {
    std::string rows;
    for (const Emitted &k : kernels)
      if (k.api == api)
        rows += "    {{" + std::to_string(k.key.stage) +
                ", remat::Variant::" + std::string(variant_name(k.key.variant)) +
                ", remat::Precision::" + std::string(precision_name(k.key.precision)) + "}, \"" + k.name + "\", &" +
                k.symbol + "_argv, &" + k.symbol + "_metadata},\n";
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
  return cppm;
}

// --cpu-targets BEST,...,BASELINE
std::vector<Target> targets_of(std::string_view list) {
  std::vector<Target> cpu;
  for (std::string_view rest = list; !rest.empty();) {
    const std::size_t comma = rest.find(',');
    cpu.emplace_back(std::string(rest.substr(0, comma)));
    rest = comma == rest.npos ? std::string_view{} : rest.substr(comma + 1);
  }
  if (cpu.empty()) throw std::runtime_error("--cpu-targets names no target");
  return cpu;
}

// Copies the staged files to the output folder, each only if it changed (so that a build does not
// recompile what includes them).
void publish(const std::filesystem::path &staging, const std::string &out_dir, const std::vector<std::string> &files) {
  for (const auto &file : files) {
    std::ifstream in(staging / file, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + (staging / file).string());
    write_if_changed(std::filesystem::path(out_dir) / file,
                     std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
  }
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
    const int longest =
        int(name.size()) + name_of("", kernel_key(max_stages - 1, Variant::backward_selective, Precision::bf16)).size();
    if (longest + 1 >= int(Name{}.chars.size()))
      throw std::runtime_error("model name '" + name + "' is too long for kernel names");
    // a staging folder of its own: models generated into one folder at once (tests/kernels) each
    // write a halide_runtime.o, of other features (OpenCL or not)
    if (capability) gen::keep_cuda_adds_rounded();
    Emitter e{std::filesystem::path(out_dir) / ("staging-" + name)};
    std::filesystem::create_directories(e.staging);
    // CPU kernels: one variant per target, the running CPU picks; the last (the baseline) is
    // also the host code of the GPU kernels and the runtime's target.
    const std::vector<Target> cpu = targets_of(cpu_targets);
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

    write_if_changed(std::filesystem::path(out_dir) / (name + ".kernels.cppm"), kernels_module(name, e.kernels));
    if (capability)
      write_if_changed(std::filesystem::path(out_dir) / (name + ".cuda-launches.txt"),
                       "rows_per_sample " + std::to_string(model.rows_per_sample()) + "\n" + e.launch_report);
    std::vector<std::string> published = {"lib" + name + "_kernels.a"};
    for (const Emitted &k : e.kernels) published.push_back(k.symbol + ".h");
    publish(e.staging, out_dir, published);
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
