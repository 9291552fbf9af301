// The trainer shared by every model, in its steps: flags -> resolved run -> (the plan report, or
// the training loop) -> summary.
module;
#include <csignal>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
module remat.trainer;
import remat;

namespace remat::runtime {

int train_main(int argc, char **argv, const ModelInfo &info) {
  // as the user called it (the target's name: train-gpt-bpe for model gpt_bpe)
  const std::string program = argc > 0 && argv[0] && *argv[0] ? std::filesystem::path(argv[0]).filename().string()
                                                              : "train-" + std::string(info.name);
  std::signal(SIGXFSZ, SIG_IGN);  // past `ulimit -f` a write fails (EFBIG, reported) instead of killing the run
  const ParsedFlags flags = parse_flags(argc, argv, info, program);
  if (flags.exit_code) return *flags.exit_code;
  const Options &o = flags.options;
  try {
    const Run run = resolve(o, info, program);
    if (o.plan_report) {
      print_plan_report(stdout, info.model, run.plan, run.costs, run.costs_from);
      if (o.sweep) print_sweep(stdout, info, run, o, program);
      return 0;
    }
    const Summary summary = train(o, info, run, program);
    print_summary(o, info, run, summary);
    return 0;
  } catch (const InputError &e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
    return 2;
  } catch (const std::exception &e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
    return 1;
  } catch (const char *e) {  // the planner's constexpr code throws its messages so
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e);
    return 1;
  }
}

}  // namespace remat::runtime
