module;
#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>
module remat.trainer;
import remat;

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
    throw InputError(fmt::format("{}: expected {} data bytes after the header, found {} (truncated or corrupt)", path,
                                 count, d.size() - 4 - 4 * dims));
  return shape;
}

}  // namespace

Dataset load_idx(const std::string &images_path, const std::string &labels_path, int classes) {
  const auto images = read_file(images_path), labels = read_file(labels_path);
  const auto ishape = idx_shape(images, images_path, 3), lshape = idx_shape(labels, labels_path, 1);
  if (ishape[0] != lshape[0])
    throw InputError(
        fmt::format("{} has {} images but {} has {} labels", images_path, ishape[0], labels_path, lshape[0]));
  Dataset ds;
  ds.rows = int(ishape[0]);
  ds.width = int(ishape[1] * ishape[2]);
  ds.images.resize(std::size_t(ds.rows) * ds.width);
  for (std::size_t i = 0; i < ds.images.size(); ++i) ds.images[i] = images[16 + i] / 255.f;
  ds.labels.resize(ds.rows);
  for (int i = 0; i < ds.rows; ++i) {
    ds.labels[i] = labels[8 + i];
    if (ds.labels[i] >= classes)
      throw InputError(
          fmt::format("{}: label {} at row {} is not below the {} classes", labels_path, ds.labels[i], i, classes));
  }
  return ds;
}

}  // namespace remat::runtime

// ---- sources ---------------------------------------------------------------------------------
namespace remat::runtime {
namespace {

class FashionMnist final : public DataSource {
public:
  FashionMnist(const Model &model, const DataOptions &o)
      : train(load_idx(o.dir + "/train-images-idx3-ubyte.gz", o.dir + "/train-labels-idx1-ubyte.gz", model.classes())),
        test(load_idx(o.dir + "/t10k-images-idx3-ubyte.gz", o.dir + "/t10k-labels-idx1-ubyte.gz", model.classes())),
        batch(o.batch),
        rng(o.seed ^ 0x5eedf00dull) {
    for (const Dataset *ds : {&train, &test})
      if (ds->width != model.input.width)
        throw InputError(
            fmt::format("{}: images have {} pixels but the model takes {}", o.dir, ds->width, model.input.width));
    order.resize(train.rows);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
  }
  std::string describe() const override {
    return fmt::format("Fashion-MNIST: {} training and {} test images", train.rows, test.rows);
  }
  long train_samples() const override { return train.rows; }
  long eval_samples() const override { return test.rows; }
  void next_train_batch(Executor &ex) override {
    if (cursor + batch > order.size()) {  // next epoch
      std::shuffle(order.begin(), order.end(), rng);
      cursor = 0;
    }
    copy(train, [&](std::size_t r) { return order[cursor + r]; }, ex);
    cursor += batch;
  }
  void load_eval_batch(Executor &ex, long first) override {
    copy(test, [&](std::size_t r) { return first + long(r) < test.rows ? int(first + r) : 0; }, ex);
  }
  std::string state() const override {
    std::ostringstream out;
    out << rng << ' ' << cursor;
    for (int i : order) out << ' ' << i;
    return out.str();
  }
  void restore(const std::string &state) override {
    std::istringstream in(state);
    in >> rng >> cursor;
    std::vector<int> restored(order.size());
    for (int &i : restored) in >> i;
    std::vector<bool> seen(order.size());
    bool permutation = bool(in);
    for (int i : restored) {
      permutation = permutation && i >= 0 && std::size_t(i) < seen.size() && !seen[i];
      if (permutation) seen[i] = true;
    }
    if (!permutation || cursor > order.size() || !(in >> std::ws).eof())
      throw InputError("--resume-from-snapshot: the snapshot's data state does not fit this dataset");
    order = restored;
  }

private:
  template <class Row>
  void copy(const Dataset &ds, Row row, Executor &ex) {
    auto labels = ex.tensor<std::int32_t>(ex.plan.labels());
    images.resize(labels.size() * ds.width);
    for (std::size_t r = 0; r < labels.size(); ++r) {
      const int i = row(r);
      std::copy_n(ds.images.begin() + std::size_t(i) * ds.width, ds.width, images.begin() + r * ds.width);
      labels[r] = ds.labels[i];
    }
    ex.set_values(ex.plan.inputs(), images);  // fp32 or bf16, as the plan's precision
    ex.upload(ex.plan.inputs());
    ex.upload(ex.plan.labels());
  }
  Dataset train, test;
  std::vector<float> images;  // one batch, before it goes to the arena
  std::size_t batch;
  std::mt19937_64 rng;
  std::vector<int> order;
  std::size_t cursor = 0;
};

// Next-token prediction: a sample is a window of T tokens; its labels are the window shifted
// by one. Training windows start at random offsets; evaluation windows tile the validation text.
class TextCorpus final : public DataSource {
public:
  TextCorpus(const Model &model, const DataOptions &o)
      : corpus(load_corpus(o.dir, model.input.vocab, 0.1)), T(model.input.block_size), rng(o.seed ^ 0x7e87ull) {
    if (corpus.val.size() < std::size_t(T) + 1 || corpus.train.size() < std::size_t(T) + 1)
      throw InputError(fmt::format("{}: {} characters are too few for sequences of {}", o.dir,
                                   corpus.train.size() + corpus.val.size(), T));
  }
  std::string describe() const override {
    return fmt::format("text: {} files, {} training and {} validation characters", corpus.files, corpus.train.size(),
                       corpus.val.size());
  }
  long train_samples() const override { return long(corpus.train.size()) / T; }
  long eval_samples() const override { return long(corpus.val.size() - 1) / T; }
  void next_train_batch(Executor &ex) override {
    std::uniform_int_distribution<std::size_t> start(0, corpus.train.size() - T - 1);
    fill(ex, [&](std::size_t) { return start(rng); }, corpus.train);
  }
  void load_eval_batch(Executor &ex, long first) override {
    fill(
        ex, [&](std::size_t s) { return std::size_t(first + long(s) < eval_samples() ? first + s : 0) * T; },
        corpus.val);
  }
  std::string state() const override {
    std::ostringstream out;
    out << rng;
    return out.str();
  }
  void restore(const std::string &state) override {
    std::istringstream in(state);
    in >> rng;
    if (!in || !(in >> std::ws).eof())
      throw InputError("--resume-from-snapshot: the snapshot's data state does not fit this corpus");
  }

private:
  template <class Start>
  void fill(Executor &ex, Start start, const std::vector<std::int32_t> &text) {
    auto inputs = ex.tensor<std::int32_t>(ex.plan.inputs());
    auto labels = ex.tensor<std::int32_t>(ex.plan.labels());
    for (std::size_t s = 0; s < inputs.size() / T; ++s) {
      const std::size_t at = start(s);
      std::copy_n(text.begin() + at, T, inputs.begin() + s * T);
      std::copy_n(text.begin() + at + 1, T, labels.begin() + s * T);
    }
    ex.upload(ex.plan.inputs());
    ex.upload(ex.plan.labels());
  }
  Corpus corpus;
  int T;
  std::mt19937_64 rng;
};

}  // namespace

Corpus load_corpus(const std::string &dir, int vocab, double val_fraction) {
  if (!std::filesystem::is_directory(dir))
    throw InputError(fmt::format("{}: no such folder (install the text package or pass --data-dir)", dir));
  std::vector<std::filesystem::path> files;
  for (const auto &e : std::filesystem::directory_iterator(dir)) {
    const auto ext = e.path().extension();
    if (e.is_regular_file() && !e.is_symlink() && ext != ".dat" && ext != ".u8") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  const std::int32_t unknown = vocab > '?' ? '?' : 0;  // bytes past the vocabulary
  std::vector<std::int32_t> text;
  for (const auto &f : files)
    for (std::uint8_t c : read_file(f.string())) text.push_back(c < vocab ? c : unknown);
  if (files.empty() || text.empty()) throw InputError(fmt::format("{}: no text files", dir));
  Corpus out;
  out.files = files.size();
  const auto split = std::size_t(double(text.size()) * (1 - val_fraction));
  out.train.assign(text.begin(), text.begin() + split);
  out.val.assign(text.begin() + split, text.end());
  return out;
}

std::unique_ptr<DataSource> fashion_mnist(const Model &model, const DataOptions &o) {
  return std::make_unique<FashionMnist>(model, o);
}
std::unique_ptr<DataSource> text_corpus(const Model &model, const DataOptions &o) {
  return std::make_unique<TextCorpus>(model, o);
}
std::unique_ptr<DataSource> data_source(const ModelInfo &info, const DataOptions &o) {
  switch (info.defaults.data) {
  case Data::text: return text_corpus(info.model, o);
  case Data::fashion_mnist: return fashion_mnist(info.model, o);
  }
  throw std::logic_error("a data source remat does not have");
}

}  // namespace remat::runtime
