module;
#include <fmt/format.h>
#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>
module remat.runtime;

namespace remat::runtime {
namespace {

// The whole file, gunzipped when it is gzip (zlib reads plain files as they are).
std::vector<std::uint8_t> read_file(const std::string &path) {
  if (!std::filesystem::is_regular_file(path))
    throw InputError(fmt::format("{}: no such file (install the dataset package or pass --data-dir)", path));
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw InputError(fmt::format("{}: cannot open", path));
  std::vector<std::uint8_t> out;
  std::uint8_t chunk[1 << 16];
  int n;
  while ((n = gzread(f, chunk, sizeof chunk)) > 0) out.insert(out.end(), chunk, chunk + n);
  int err = 0;
  const char *msg = gzerror(f, &err);
  const bool failed = n < 0 || (err != Z_OK && err != Z_BUF_ERROR);
  const std::string why = failed ? msg : "";
  gzclose(f);
  if (failed) throw InputError(fmt::format("{}: corrupt gzip data ({})", path, why));
  return out;
}

std::uint32_t be32(const std::vector<std::uint8_t> &d, std::size_t at) {
  return std::uint32_t(d[at]) << 24 | std::uint32_t(d[at + 1]) << 16 | std::uint32_t(d[at + 2]) << 8 | d[at + 3];
}

// idx header: 0x00 0x00 type(0x08 = ubyte) ndims, then ndims big-endian sizes.
std::vector<std::uint32_t> idx_shape(const std::vector<std::uint8_t> &d, const std::string &path, int dims) {
  if (d.size() < 4 + 4u * dims || d[0] != 0 || d[1] != 0 || d[2] != 0x08 || d[3] != dims)
    throw InputError(fmt::format("{}: not an idx file of unsigned bytes with {} dimension(s)", path, dims));
  std::vector<std::uint32_t> shape;
  std::uint64_t count = 1;
  for (int i = 0; i < dims; ++i) {
    shape.push_back(be32(d, 4 + 4 * i));
    count *= shape.back();
  }
  if (d.size() != 4 + 4u * dims + count)
    throw InputError(fmt::format("{}: expected {} data bytes after the header, found {} (truncated or corrupt)",
                                 path, count, d.size() - 4 - 4 * dims));
  return shape;
}

}  // namespace

Dataset load_idx(const std::string &images_path, const std::string &labels_path, int classes) {
  const auto images = read_file(images_path), labels = read_file(labels_path);
  const auto ishape = idx_shape(images, images_path, 3), lshape = idx_shape(labels, labels_path, 1);
  if (ishape[0] != lshape[0])
    throw InputError(fmt::format("{} has {} images but {} has {} labels", images_path, ishape[0],
                                 labels_path, lshape[0]));
  Dataset ds;
  ds.rows = int(ishape[0]);
  ds.width = int(ishape[1] * ishape[2]);
  ds.images.resize(std::size_t(ds.rows) * ds.width);
  for (std::size_t i = 0; i < ds.images.size(); ++i) ds.images[i] = images[16 + i] / 255.f;
  ds.labels.resize(ds.rows);
  for (int i = 0; i < ds.rows; ++i) {
    ds.labels[i] = labels[8 + i];
    if (ds.labels[i] >= classes)
      throw InputError(fmt::format("{}: label {} at row {} is not below the {} classes", labels_path,
                                   ds.labels[i], i, classes));
  }
  return ds;
}

}  // namespace remat::runtime
