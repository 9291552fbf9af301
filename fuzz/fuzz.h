// What the fuzz targets (fuzz/<target>.cpp) share: a scratch folder of this process, the input cut
// into parts written as files, and the rule every reader keeps: bad input is an InputError whose
// message is one line; anything else (a crash, another exception, a broken invariant) aborts,
// which libFuzzer reports and replay.cpp turns into a failed ctest entry.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>
#include <unistd.h>

#define REMAT_FUZZ_CHECK(condition)                                                             \
  do {                                                                                          \
    if (!(condition)) {                                                                         \
      std::fprintf(stderr, "fuzz: check failed: %s (%s:%d)\n", #condition, __FILE__, __LINE__); \
      std::abort();                                                                             \
    }                                                                                           \
  } while (false)

namespace remat::fuzz {

// A folder of this process under $TMPDIR, emptied for each input; removed at exit.
inline std::filesystem::path scratch() {
  struct Folder {
    std::filesystem::path path = std::filesystem::temp_directory_path() / ("remat-fuzz-" + std::to_string(::getpid()));
    ~Folder() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Folder folder;
  std::filesystem::remove_all(folder.path);
  std::filesystem::create_directories(folder.path);
  return folder.path;
}

inline std::string write(const std::filesystem::path &path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  REMAT_FUZZ_CHECK(out.good());
  return path.string();
}

// The input as `n` parts: each but the last is a 2-byte little-endian length and that many bytes
// (fewer where the input ends), the last is what remains.
inline std::vector<std::string_view> parts(const std::uint8_t *data, std::size_t size, std::size_t n) {
  std::string_view in(reinterpret_cast<const char *>(data), size);
  std::vector<std::string_view> out;
  for (std::size_t i = 0; i + 1 < n; ++i) {
    const std::size_t length = in.size() < 2 ? 0 : std::uint8_t(in[0]) | std::size_t(std::uint8_t(in[1])) << 8;
    in.remove_prefix(std::min<std::size_t>(2, in.size()));
    out.push_back(in.substr(0, length));
    in.remove_prefix(out.back().size());
  }
  out.push_back(in);
  return out;
}

// A reader's error: one line, not empty.
inline void check_message(const char *what) {
  if (*what && !std::strchr(what, '\n')) return;
  std::fprintf(stderr, "fuzz: an error message that is not one line: \"%s\"\n", what);
  std::abort();
}

}  // namespace remat::fuzz
