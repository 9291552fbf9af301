// Files that survive a crash (written under a temporary name, fsync'ed, renamed, the folder
// fsync'ed), CRC-32 checksums, and safetensors files read with every size, offset, dtype and shape
// checked before use.
module;
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>
module remat.trainer;
import remat;

namespace remat::runtime {
namespace fs = std::filesystem;
static_assert(std::endian::native == std::endian::little, "safetensors store little-endian values");

// ---------------------------------------------------------------------------------------------
// Durable files
namespace {
std::string errno_text(int e) { return e ? std::error_code(e, std::system_category()).message() : "write failed"; }

}  // namespace

void sync_path(const std::string &path, std::string_view what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int e = errno;
    if (fd >= 0) ::close(fd);
    throw InputError(fmt::format("{} {}: fsync: {}", what, path, errno_text(e)));
  }
  ::close(fd);
}

namespace {
fs::path folder_of(const fs::path &path) { return path.has_parent_path() ? path.parent_path() : fs::path("."); }
}  // namespace

void check_writable(const std::string &path, std::string_view what) {
  if (fs::is_directory(path)) throw InputError(fmt::format("{} {}: a folder", what, path));
  const std::string probe = path + ".tmp";
  if (!std::ofstream(probe)) throw InputError(fmt::format("{} {}: cannot write", what, path));
  fs::remove(probe);
}

void write_atomically(const std::string &path, std::string_view what,
                      const std::function<void(std::ostream &)> &write) {
  const std::string tmp = path + ".tmp";
  try {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError(fmt::format("{} {}: cannot write", what, path));
    errno = 0;
    write(out);
    out.close();
    if (!out) throw InputError(fmt::format("{} {}: {}", what, path, errno_text(errno)));
    sync_path(tmp, what);
    fs::rename(tmp, path);
    sync_path(folder_of(path).string(), what);
  } catch (const fs::filesystem_error &e) {
    fs::remove(tmp);
    throw InputError(fmt::format("{} {}: {}", what, path, e.code().message()));
  } catch (...) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    throw;
  }
}

std::string crc32_hex(std::span<const std::byte> bytes) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  for (std::size_t at = 0; at < bytes.size();) {  // zlib takes 32-bit lengths
    const auto n = uInt(std::min<std::size_t>(bytes.size() - at, 1u << 30));
    crc = ::crc32(crc, reinterpret_cast<const Bytef *>(bytes.data() + at), n);
    at += n;
  }
  return fmt::format("{:08x}", crc);
}

// ---------------------------------------------------------------------------------------------
// safetensors
namespace {
std::size_t dtype_bytes(std::string_view dtype) {
  static const std::map<std::string_view, std::size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"I64", 8},     {"U64", 8}, {"F64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}
}  // namespace

std::vector<std::byte> read_bytes(const std::string &path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw InputError(fmt::format("{}: a folder, not a file", path));
  if (!fs::exists(path, ec)) throw InputError(fmt::format("{}: no such file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot read ({})", path, errno_text(errno)));
  in.seekg(0, std::ios::end);
  const auto size = std::streamoff(in.tellg());
  in.seekg(0);
  std::vector<std::byte> bytes(std::size_t(std::max<std::streamoff>(size, 0)));
  if (size < 0 || !in.read(reinterpret_cast<char *>(bytes.data()), size))
    throw InputError(fmt::format("{}: cannot read", path));
  return bytes;
}

const SafetensorsTensor *Safetensors::find(std::string_view name) const {
  const auto it = std::ranges::find(tensors, name, &SafetensorsTensor::name);
  return it == tensors.end() ? nullptr : &*it;
}
std::span<const std::byte> Safetensors::data(const SafetensorsTensor &t) const {
  return std::span(bytes).subspan(data_start + t.begin, t.end - t.begin);
}

Safetensors parse_safetensors(std::vector<std::byte> file, std::string_view what) {
  auto bad = [&](std::string_view problem) { return InputError(fmt::format("{}: {}", what, problem)); };
  if (file.size() < 8) throw bad(fmt::format("{} bytes: not a safetensors file (too short)", file.size()));
  std::uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, file.data(), 8);
  if (header_bytes > file.size() - 8 || header_bytes > (100u << 20))
    throw bad(fmt::format("the header length {} exceeds the file's {} bytes: not a safetensors file, or truncated",
                          header_bytes, file.size()));
  Safetensors st;
  st.data_start = 8 + std::size_t(header_bytes);
  const std::size_t data_bytes = file.size() - st.data_start;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(std::string_view(reinterpret_cast<const char *>(file.data()) + 8, header_bytes));
  } catch (const nlohmann::json::exception &) {
    throw bad("the header is not JSON: corrupt or not a safetensors file");
  }
  if (!header.is_object()) throw bad("the header is not a JSON object");
  for (const auto &[name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw bad("__metadata__ is not an object");
      for (const auto &[k, v] : entry.items()) {
        if (!v.is_string()) throw bad(fmt::format("metadata {} is not a string", k));
        st.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const auto field = [&](const char *key) -> const nlohmann::json & {
      if (!entry.is_object() || !entry.contains(key)) throw bad(fmt::format("tensor {}: no {}", name, key));
      return entry.at(key);
    };
    SafetensorsTensor t{.name = name};
    const nlohmann::json &dtype = field("dtype"), &shape = field("shape"), &offsets = field("data_offsets");
    if (!dtype.is_string() || dtype_bytes(dtype.get<std::string>()) == 0)
      throw bad(fmt::format("tensor {}: unknown dtype {}", name, dtype.dump()));
    t.dtype = dtype.get<std::string>();
    if (!shape.is_array() || shape.size() > 8) throw bad(fmt::format("tensor {}: bad shape {}", name, shape.dump()));
    std::uint64_t count = 1;
    for (const nlohmann::json &d : shape) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > (1ull << 40))
        throw bad(fmt::format("tensor {}: bad shape {}", name, shape.dump()));
      t.shape.push_back(d.get<long long>());
      count = d.get<std::uint64_t>() == 0 || count <= (1ull << 40) / d.get<std::uint64_t>()
                  ? count * d.get<std::uint64_t>()
                  : throw bad(fmt::format("tensor {}: shape {} is too large", name, shape.dump()));
    }
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      throw bad(fmt::format("tensor {}: bad data_offsets {}", name, offsets.dump()));
    t.begin = offsets[0].get<std::uint64_t>();
    t.end = offsets[1].get<std::uint64_t>();
    if (t.begin > t.end || t.end > data_bytes)
      throw bad(fmt::format("tensor {}: data_offsets [{}, {}) outside the {} data bytes (truncated?)", name, t.begin,
                            t.end, data_bytes));
    if (t.end - t.begin != count * dtype_bytes(t.dtype))
      throw bad(
          fmt::format("tensor {}: {} bytes for a {} tensor of shape {}", name, t.end - t.begin, t.dtype, shape.dump()));
    st.tensors.push_back(std::move(t));
  }
  // The data: every byte belongs to exactly one tensor (the format allows no holes or overlaps).
  std::vector<const SafetensorsTensor *> by_offset;
  for (const SafetensorsTensor &t : st.tensors) by_offset.push_back(&t);
  std::ranges::sort(by_offset, {}, [](const SafetensorsTensor *t) { return std::pair(t->begin, t->end); });
  std::size_t at = 0;
  for (const SafetensorsTensor *t : by_offset) {
    if (t->begin != at) throw bad(fmt::format("tensor {}: its data overlaps another's or leaves a hole", t->name));
    at = t->end;
  }
  if (at != data_bytes) throw bad(fmt::format("{} bytes after the last tensor's data", data_bytes - at));
  st.bytes = std::move(file);
  return st;
}

Safetensors read_safetensors(const std::string &path) { return parse_safetensors(read_bytes(path), path); }

void write_safetensors(const std::string &path, std::string_view what, std::map<std::string, std::string> metadata,
                       std::span<const SafetensorsTensor> tensors, std::span<const std::span<const std::byte>> data) {
  nlohmann::json header = nlohmann::json::object();
  std::size_t at = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsTensor &t = tensors[i];
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + data[i].size()}}};
    metadata["crc32." + t.name] = crc32_hex(data[i]);
    at += data[i].size();
  }
  header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  write_atomically(path, what, [&](std::ostream &out) {
    const std::uint64_t length = text.size();
    out.write(reinterpret_cast<const char *>(&length), 8);
    out << text;
    for (const std::span<const std::byte> d : data)
      out.write(reinterpret_cast<const char *>(d.data()), std::streamsize(d.size()));
  });
}

}  // namespace remat::runtime
