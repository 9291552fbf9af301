// The trainers as a user runs them, for test_trainer and test_snapshots: a run's exit code, stdout
// and stderr, its JSON summary, the one-line-error check, a scratch folder per test process, and
// a reader of safetensors files (the format, read independently of remat's reader).
#pragma once

#include <boost/test/unit_test.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace remat::testing {
namespace fs = std::filesystem;

struct Result {
  int exit_code;
  std::string out, err;
  std::vector<std::string> err_lines() const {
    std::vector<std::string> lines;
    std::istringstream in(err);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    return lines;
  }
};

inline std::string slurp(const fs::path &p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// This process's folder under the system temp folder, removed with everything in it when the
// process exits (snapshot tests write gigabytes there; CI machines are reused).
inline fs::path scratch_dir() {
  struct Scratch {
    fs::path path = fs::temp_directory_path() / ("remat-test-" + std::to_string(::getpid()));
    Scratch() { fs::create_directories(path); }
    ~Scratch() {
      std::error_code ignored;
      fs::remove_all(path, ignored);
    }
  };
  static const Scratch scratch;
  return scratch.path;
}

// `program args` through /bin/sh; shell_prefix goes before it ("ulimit -f 100; "). A trainer
// generates no sample after training unless args ask for one (--sample-length N): the sample
// costs a token model's run more than a test's few steps.
inline Result run(const std::string &program, const std::string &args, const std::string &shell_prefix = "") {
  const fs::path out = scratch_dir() / "stdout", err = scratch_dir() / "stderr";
  const bool trainer = fs::path(program).filename().string().starts_with("train-");
  const std::string sample = trainer && args.find("--sample-length") == std::string::npos ? " --sample-length 0" : "";
  const std::string cmd =
      shell_prefix + program + " " + args + sample + " >" + out.string() + " 2>" + err.string() + " </dev/null";
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), slurp(out), slurp(err)};
}

inline nlohmann::json summary(const Result &r) {
  const auto last = r.out.find_last_of('\n', r.out.size() - 2);
  return nlohmann::json::parse(r.out.substr(last == std::string::npos ? 0 : last + 1));
}

// `program args` ends with exit code 2, nothing on stdout and one line on stderr that mentions
// each of `mentions`.
inline void expect_one_line_error(const std::string &program, const std::string &args,
                                  const std::vector<std::string> &mentions) {
  const Result r = run(program, args);
  BOOST_TEST(r.exit_code == 2, args << ": exit code " << r.exit_code);
  BOOST_TEST(r.out.empty(), args << ": wrote to stdout: " << r.out);
  const auto lines = r.err_lines();
  BOOST_TEST_REQUIRE(lines.size() == 1u, args << ": stderr was\n" << r.err);
  BOOST_TEST(lines[0].starts_with(fs::path(program).filename().string() + ": error: "), lines[0]);
  for (const std::string &m : mentions)
    BOOST_TEST(lines[0].find(m) != std::string::npos, lines[0] << " should mention " << m);
}

// A safetensors file: its header (JSON) and each tensor's bytes.
struct SafetensorsFile {
  nlohmann::json header;
  std::map<std::string, std::string> data;
};
inline SafetensorsFile read_safetensors_file(const fs::path &path) {
  const std::string bytes = slurp(path);
  BOOST_TEST_REQUIRE(bytes.size() >= 8u, path);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  BOOST_TEST_REQUIRE(n <= bytes.size() - 8, path);
  SafetensorsFile f{nlohmann::json::parse(bytes.substr(8, n)), {}};
  for (const auto &[name, entry] : f.header.items()) {
    if (name == "__metadata__") continue;
    const std::size_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
    f.data[name] = bytes.substr(8 + n + begin, end - begin);
  }
  return f;
}

}  // namespace remat::testing
