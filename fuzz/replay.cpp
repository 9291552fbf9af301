// A fuzz target without libFuzzer (ctest: fuzz_replay_<target>): every file named on the command
// line, and every file under each folder named (sorted), goes through the target's
// LLVMFuzzerTestOneInput once. A crash, an exception other than a one-line InputError or a failed
// check aborts; no input at all fails; otherwise it prints how many inputs it ran.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size);

int main(int argc, char **argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    if (!fs::is_directory(argv[i])) {
      inputs.emplace_back(argv[i]);
      continue;
    }
    for (const auto &e : fs::recursive_directory_iterator(argv[i]))
      if (e.is_regular_file() && e.path().filename().string()[0] != '.') inputs.push_back(e.path());
  }
  std::sort(inputs.begin(), inputs.end());
  if (inputs.empty()) {  // a replay of nothing would pass whatever the target does
    std::fprintf(stderr, "no inputs to replay (a seed folder is empty or missing)\n");
    return 1;
  }
  for (const fs::path &p : inputs) {
    std::ifstream in(p, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "%s: cannot read\n", p.c_str());
      return 1;
    }
    const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    std::fprintf(stderr, "%s\n", p.c_str());  // the input that was running, should it crash
    LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t *>(bytes.data()), bytes.size());
  }
  std::printf("%zu inputs: no crash, every error one line\n", inputs.size());
  return 0;
}
