module;
#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
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
// by one. Training windows start at random offsets; evaluation windows tile the validation split.
// The tokens are kept as the source has them (Token) and widened to int32 into the batch.
template <class Token>
class TokenWindows : public DataSource {
public:
  long train_samples() const override { return long(train.size()) / T; }
  long eval_samples() const override { return long(val.size() - 1) / T; }
  void next_train_batch(Executor &ex) override {
    std::uniform_int_distribution<std::size_t> start(0, train.size() - T - 1);
    fill(ex, [&](std::size_t) { return start(rng); }, train);
  }
  void load_eval_batch(Executor &ex, long first) override {
    fill(ex, [&](std::size_t s) { return std::size_t(first + long(s) < eval_samples() ? first + s : 0) * T; }, val);
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

protected:
  // Both splits must hold one window and its next token.
  TokenWindows(std::vector<Token> train_tokens, std::vector<Token> val_tokens, const Model &model, std::uint64_t seed)
      : train(std::move(train_tokens)), val(std::move(val_tokens)), T(model.input.block_size), rng(seed ^ 0x7e87ull) {}
  std::vector<Token> train, val;
  int T;

private:
  template <class Start>
  void fill(Executor &ex, Start start, const std::vector<Token> &tokens) {
    auto inputs = ex.tensor<std::int32_t>(ex.plan.inputs());
    auto labels = ex.tensor<std::int32_t>(ex.plan.labels());
    for (std::size_t s = 0; s < inputs.size() / T; ++s) {
      const std::size_t at = start(s);
      std::copy_n(tokens.begin() + at, T, inputs.begin() + s * T);
      std::copy_n(tokens.begin() + at + 1, T, labels.begin() + s * T);
    }
    ex.upload(ex.plan.inputs());
    ex.upload(ex.plan.labels());
  }
  std::mt19937_64 rng;
};

// A folder of text read as bytes (load_corpus), 90% train, 10% validation.
class TextCorpus final : public TokenWindows<std::int32_t> {
public:
  TextCorpus(const Model &model, const DataOptions &o)
      : TextCorpus(load_corpus(o.dir, model.input.vocab, 0.1), model, o) {}
  std::string describe() const override {
    return fmt::format("text: {} files, {} training and {} validation characters", files, train.size(), val.size());
  }
  std::vector<std::int32_t> sample_prompt() const override { return {'\n'}; }

private:
  TextCorpus(Corpus corpus, const Model &model, const DataOptions &o)
      : TokenWindows(std::move(corpus.train), std::move(corpus.val), model, o.seed), files(corpus.files) {
    if (val.size() < std::size_t(T) + 1 || train.size() < std::size_t(T) + 1)
      throw InputError(
          fmt::format("{}: {} characters are too few for sequences of {}", o.dir, train.size() + val.size(), T));
  }
  std::size_t files;
};

// Token files in the llm.c / nanoGPT layout (load_tokens): <dir>/train.bin and <dir>/val.bin unless
// --train-file / --validation-file say otherwise.
class TokenFiles final : public TokenWindows<std::uint16_t> {
  struct Splits {
    std::string train_path, val_path;
    std::vector<std::uint16_t> train, val;
  };

public:
  TokenFiles(const Model &model, const DataOptions &o) : TokenFiles(model, o.seed, load(model, o)) {}
  std::string describe() const override {
    return fmt::format("tokens: {} training tokens ({}), {} validation tokens ({}), vocabulary {}", train.size(),
                       train_path, val.size(), val_path, vocab);
  }
  std::vector<std::int32_t> sample_prompt() const override { return {val.front()}; }  // the validation split's first

private:
  TokenFiles(const Model &model, std::uint64_t seed, Splits s)
      : TokenWindows(std::move(s.train), std::move(s.val), model, seed),
        train_path(std::move(s.train_path)),
        val_path(std::move(s.val_path)),
        vocab(model.input.vocab) {}
  // The training file, then the validation file.
  static Splits load(const Model &model, const DataOptions &o) {
    Splits s{o.train_file.empty() ? o.dir + "/train.bin" : o.train_file,
             o.val_file.empty() ? o.dir + "/val.bin" : o.val_file};
    s.train = load_split(s.train_path, model);
    s.val = load_split(s.val_path, model);
    return s;
  }
  static std::vector<std::uint16_t> load_split(const std::string &path, const Model &model) {
    std::vector<std::uint16_t> tokens = load_tokens(path, model.input.vocab);
    const int T = model.input.block_size;
    if (tokens.size() < std::size_t(T) + 1)
      throw InputError(
          fmt::format("{}: {} tokens are too few for sequences of {} (at least {})", path, tokens.size(), T, T + 1));
    return tokens;
  }
  std::string train_path, val_path;
  int vocab;
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

std::vector<std::uint16_t> load_tokens(const std::string &path, int vocab) {
  static_assert(std::endian::native == std::endian::little, "token files are little-endian, read in place");
  constexpr std::int32_t magic = 20240520, version = 1;  // llm.c's dev/data/data_common.py
  constexpr std::uintmax_t header_bytes = 256 * 4;
  if (!std::filesystem::is_regular_file(path))
    throw InputError(fmt::format(
        "{}: no such file (write it with scripts/bpe.py, or pass --data-dir, --train-file, --validation-file)", path));
  const std::uintmax_t size = std::filesystem::file_size(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot open", path));
  if (size == 0) throw InputError(fmt::format("{}: empty file, no tokens", path));
  std::int32_t head[3] = {};
  in.read(reinterpret_cast<char *>(head), std::streamsize(std::min<std::uintmax_t>(size, sizeof head)));
  std::uintmax_t offset = 0, count = size / 2;
  if (size >= 4 && head[0] == magic) {  // llm.c's header
    if (size < header_bytes)
      throw InputError(
          fmt::format("{}: truncated llm.c header: {} bytes, the header alone is {}", path, size, header_bytes));
    if (head[1] != version)
      throw InputError(
          fmt::format("{}: llm.c header version {}; only version {} (uint16 tokens) is read", path, head[1], version));
    if (head[2] < 0 || 2 * std::uintmax_t(head[2]) != size - header_bytes)
      throw InputError(fmt::format("{}: the llm.c header says {} tokens but {} bytes follow it (2 bytes a token)", path,
                                   head[2], size - header_bytes));
    offset = header_bytes;
    count = std::uintmax_t(head[2]);
  } else if (size % 2 != 0) {
    throw InputError(fmt::format("{}: {} bytes, an odd size: not uint16 tokens", path, size));
  }
  std::vector<std::uint16_t> tokens(count);
  in.seekg(std::streamoff(offset));
  in.read(reinterpret_cast<char *>(tokens.data()), std::streamsize(2 * count));
  if (!in) throw InputError(fmt::format("{}: cannot read {} bytes", path, size));
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= vocab)
      throw InputError(
          fmt::format("{}: token {} at index {} is not below the model's vocabulary of {}", path, tokens[i], i, vocab));
  return tokens;
}

std::unique_ptr<DataSource> fashion_mnist(const Model &model, const DataOptions &o) {
  return std::make_unique<FashionMnist>(model, o);
}
std::unique_ptr<DataSource> text_corpus(const Model &model, const DataOptions &o) {
  return std::make_unique<TextCorpus>(model, o);
}
std::unique_ptr<DataSource> token_files(const Model &model, const DataOptions &o) {
  return std::make_unique<TokenFiles>(model, o);
}
std::unique_ptr<DataSource> data_source(const ModelInfo &info, const DataOptions &o) {
  if (info.data != Data::fashion_mnist && (info.model.input.vocab <= 0 || info.model.input.block_size <= 0))
    throw InputError(fmt::format("model {} reads {}, which needs a token input: remat::tokens(vocab, block_size)",
                                 info.name, info.data == Data::text ? "text" : "tokens"));
  switch (info.data) {
  case Data::text: return text_corpus(info.model, o);
  case Data::fashion_mnist: return fashion_mnist(info.model, o);
  case Data::tokens: return token_files(info.model, o);
  }
  throw std::logic_error("a data source remat does not have");
}

}  // namespace remat::runtime
