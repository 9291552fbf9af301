// The trainer shared by every model, in its steps: flags -> resolved run -> (the plan report, or
// the training loop) -> summary.
module;
#include <fmt/format.h>

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
  std::signal(SIGXFSZ, SIG_IGN);        // past `ulimit -f` a write fails (EFBIG, reported) instead of killing the run
  stop_on_sigterm();                    // the run stops after its step, with a snapshot
  const Ranks &ranks = Ranks::world();  // under mpirun: MPI's world, before anything runs
  const ParsedFlags flags = parse_flags(argc, argv, info, program);
  // under mpirun a failing rank ends the job (MPI_Abort: the others may wait for it); its line says which
  if (flags.exit_code && *flags.exit_code != 0 && ranks.size > 1) ranks.abort(*flags.exit_code);
  if (flags.exit_code) return *flags.exit_code;
  const Options &o = flags.options;
  const std::string who = ranks.size > 1 ? fmt::format("{} (rank {} of {})", program, ranks.rank, ranks.size) : program;
  auto failed = [&](const char *what, int code) {
    std::fprintf(stderr, "%s: error: %s\n", who.c_str(), what);
    if (ranks.size > 1) ranks.abort(code);
    return code;
  };
  try {
    const Run run = resolve(o, info, program);
    if (o.plan_report) {
      if (ranks.rank > 0) return 0;
      print_plan_report(stdout, info.model, run.plan, run.costs, run.costs_from);
      if (o.sweep) print_sweep(stdout, info, run, o, program);
      return 0;
    }
    const Summary summary = train(o, info, run, program);
    if (ranks.rank == 0) print_summary(o, info, run, summary);
    return 0;
  } catch (const InputError &e) { return failed(e.what(), 2); } catch (const std::exception &e) {
    return failed(e.what(), 1);
  } catch (const char *e) {  // the planner's constexpr code throws its messages so
    return failed(e, 1);
  }
}

}  // namespace remat::runtime
