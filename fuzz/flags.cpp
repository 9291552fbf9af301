// Fuzz target: the trainer's flags and its --config file (parse_flags, as train-gpt runs it: the
// gpt model, text data), then the policy and budget strings they carry (parse_stage_policies,
// parse_budget, as resolve() reads them). Input: when it starts with "--", its first line is the
// command line's words (split at spaces); the rest, if any, is the --config file. parse_flags prints its
// error: at most one line, "train-gpt: error: ...".
module;
#include "fuzz.h"

#include <stdio.h>
module remat.trainer;
import remat;
import gpt;

namespace remat::runtime {

// (in the namespace: clang-19 does not see the module's own declarations through a using-directive)
void fuzz_flags(const std::uint8_t *data, std::size_t size) {
  std::string_view in(reinterpret_cast<const char *>(data), size), line;
  if (in.starts_with("--")) {
    line = in.substr(0, in.find('\n'));
    in.remove_prefix(std::min(in.size(), line.size() + 1));
  }
  std::vector<std::string> words = {"train-gpt"};
  for (std::size_t at = 0; at < line.size();) {
    const std::size_t end = std::min(line.size(), line.find(' ', at));
    if (end > at) words.emplace_back(line.substr(at, end - at));
    at = end + 1;
  }
  if (!in.empty()) {
    words.push_back("--config");
    words.push_back(remat::fuzz::write(remat::fuzz::scratch() / "config.json", in));
  }
  std::vector<char *> argv;
  for (std::string &w : words) argv.push_back(w.data());
  const ModelInfo info{"gpt", gpt::model, gpt::policy, gpt::trainer, {}, {}, Data::text};
  char *said = nullptr;
  std::size_t said_size = 0;
  FILE *const real_stderr = stderr;
  stderr = open_memstream(&said, &said_size);  // what parse_flags says (glibc's stderr is a variable)
  const ParsedFlags flags = parse_flags(int(argv.size()), argv.data(), info, "train-gpt");
  std::fclose(stderr);
  stderr = real_stderr;
  const std::string_view message(said, said_size);
  REMAT_FUZZ_CHECK(!flags.exit_code || *flags.exit_code != 2 ||
                   (message.starts_with("train-gpt: error: ") && message.find('\n') == message.size() - 1));
  std::free(said);
  if (flags.exit_code) return;
  try {
    if (!flags.options.checkpoint_policy.empty())
      parse_stage_policies(gpt::model, flags.options.checkpoint_policy, annotated(gpt::model, gpt::policy));
    if (!flags.options.memory_budget.empty()) parse_budget(flags.options.memory_budget);
  } catch (const InputError &e) { remat::fuzz::check_message(e.what()); }
}

}  // namespace remat::runtime

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  remat::runtime::fuzz_flags(data, size);
  return 0;
}
