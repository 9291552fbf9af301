module;
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
module remat.trainer;
import remat;

namespace remat::runtime {
namespace {

// The whole file, gunzipped when it is gzip (zlib reads plain files as they are). A gzip stream that
// ends early (Z_BUF_ERROR: "unexpected end of file") or fails its checks is an error.
std::vector<std::uint8_t> read_file(const std::string &path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw InputError(fmt::format("{}: no such file (install the dataset package or pass --data-dir)", path));
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw InputError(fmt::format("{}: cannot open ({})", path, std::strerror(errno)));
  std::vector<std::uint8_t> out;
  std::vector<std::uint8_t> chunk(1 << 16);
  int n;
  while ((n = gzread(f, chunk.data(), unsigned(chunk.size()))) > 0)
    out.insert(out.end(), chunk.data(), chunk.data() + n);
  int err = 0;
  std::string_view msg = gzerror(f, &err);
  if (msg.starts_with(path + ": ")) msg.remove_prefix(path.size() + 2);  // zlib names the file too
  const std::string why = err == Z_BUF_ERROR     ? "truncated gzip data: unexpected end of file"
                          : n < 0 || err != Z_OK ? fmt::format("corrupt gzip data ({})", msg)
                                                 : "";
  gzclose(f);
  if (!why.empty()) throw InputError(fmt::format("{}: {}", path, why));
  return out;
}

std::uint32_t be32(const std::vector<std::uint8_t> &d, std::size_t at) {
  return std::uint32_t(d[at]) << 24 | std::uint32_t(d[at + 1]) << 16 | std::uint32_t(d[at + 2]) << 8 | d[at + 3];
}

// idx header: 0x00 0x00 type(0x08 = ubyte) ndims, then ndims big-endian sizes, none 0; the data
// after it must be exactly their product (computed in 128 bits: three 32-bit sizes cannot wrap).
std::vector<std::uint32_t> idx_shape(const std::vector<std::uint8_t> &d, const std::string &path, int dims) {
  const std::size_t header = 4 + 4 * std::size_t(dims);
  if (d.size() < header || d[0] != 0 || d[1] != 0 || d[2] != 0x08 || d[3] != dims)
    throw InputError(fmt::format("{}: not an idx file of unsigned bytes with {} dimension(s)", path, dims));
  std::vector<std::uint32_t> shape;
  unsigned __int128 count = 1;
  for (int i = 0; i < dims; ++i) {
    shape.push_back(be32(d, 4 + 4 * i));
    count *= shape.back();
  }
  if (count == 0) throw InputError(fmt::format("{}: the idx header has a size of 0: no data", path));
  if (count != d.size() - header)
    throw InputError(fmt::format(
        "{}: the idx header's sizes {} need {} data bytes, the file has {} (truncated or corrupt)", path,
        fmt::join(shape, " x "), count > UINT64_MAX ? std::string("over 2^64") : std::to_string(std::uint64_t(count)),
        d.size() - header));
  return shape;
}

}  // namespace

Dataset load_idx(const std::string &images_path, const std::string &labels_path, int classes) {
  const auto images = read_file(images_path), labels = read_file(labels_path);
  const auto ishape = idx_shape(images, images_path, 3), lshape = idx_shape(labels, labels_path, 1);
  if (ishape[0] != lshape[0])
    throw InputError(
        fmt::format("{} has {} images but {} has {} labels", images_path, ishape[0], labels_path, lshape[0]));
  // sizes below 2^31: rows and pixels index ints (each is at most the file's size)
  if (ishape[0] > INT32_MAX || std::uint64_t(ishape[1]) * ishape[2] > INT32_MAX)
    throw InputError(fmt::format("{}: {} images of {} x {} pixels are more than remat reads", images_path, ishape[0],
                                 ishape[1], ishape[2]));
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
        rank(std::size_t(o.rank)),
        ranks(std::size_t(o.ranks)),
        rng(o.seed ^ 0x5eedf00dull) {
    for (const Dataset *ds : {&train, &test})
      if (ds->width != model.input.width)
        throw InputError(
            fmt::format("{}: images have {} pixels but the model takes {}", o.dir, ds->width, model.input.width));
    if (std::size_t(train.rows) < batch)
      throw InputError(fmt::format("{}: {} training images are fewer than a batch of {}", o.dir, train.rows, batch));
    order.resize(train.rows);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
  }
  std::string describe() const override {
    return fmt::format("Fashion-MNIST: {} training and {} test images", train.rows, test.rows);
  }
  long train_samples() const override { return train.rows; }
  long eval_samples() const override { return test.rows; }
  void next_train_batch(Executor &ex) override {  // this rank's share of the global batch
    if (cursor + batch * ranks > order.size()) {  // next epoch
      std::shuffle(order.begin(), order.end(), rng);
      cursor = 0;
    }
    copy(train, [&](std::size_t r) { return order[cursor + rank * batch + r]; }, ex);
    cursor += batch * ranks;
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
  // Read in full and checked (RNG state, a position within the epoch, an order of every training
  // image, nothing after it) before anything changes.
  void restore(const std::string &state) override {
    auto bad = [](const std::string &why) {
      return InputError("--resume-from-snapshot: the snapshot's data state does not fit this dataset: " + why);
    };
    std::istringstream in(state);
    std::mt19937_64 restored_rng;
    long long at = -1;
    if (!(in >> restored_rng >> at)) throw bad("no shuffle state and position");
    if (at < 0 || std::uint64_t(at) > order.size())
      throw bad(fmt::format("position {} is not within its {} training images", at, order.size()));
    std::vector<int> restored(order.size());
    std::vector<bool> seen(order.size());
    for (int &i : restored) {
      if (!(in >> i) || i < 0 || std::size_t(i) >= seen.size() || seen[i])
        throw bad(fmt::format("not an order of its {} training images", order.size()));
      seen[i] = true;
    }
    if (!(in >> std::ws).eof()) throw bad(fmt::format("more than an order of its {} training images", order.size()));
    rng = restored_rng;
    cursor = std::size_t(at);
    order = std::move(restored);
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
  std::size_t batch, rank, ranks;
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
  // the global batch's window starts, drawn in order; this rank's share of them
  void next_train_batch(Executor &ex) override {
    std::uniform_int_distribution<std::size_t> start(0, train.size() - T - 1);
    if (ex.tensor<std::int32_t>(ex.plan.inputs()).size() != batch * T)
      throw std::logic_error("a token source's batch is not its plan's");
    for (std::size_t &s : starts) s = start(rng);
    fill(ex, [&](std::size_t s) { return starts[rank * batch + s]; }, train);
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
    std::mt19937_64 restored;
    if (!(in >> restored) || !(in >> std::ws).eof())
      throw InputError(
          "--resume-from-snapshot: the snapshot's data state does not fit this corpus: not a sampler state");
    rng = restored;
  }

protected:
  // Both splits must hold one window and its next token.
  TokenWindows(std::vector<Token> train_tokens, std::vector<Token> val_tokens, const Model &model, const DataOptions &o)
      : train(std::move(train_tokens)),
        val(std::move(val_tokens)),
        T(model.input.block_size),
        batch(std::size_t(o.batch)),
        rank(std::size_t(o.rank)),
        starts(batch * std::size_t(o.ranks)),
        rng(o.seed ^ 0x7e87ull) {}
  std::vector<Token> train, val;
  int T;
  std::size_t batch, rank;
  std::vector<std::size_t> starts;  // of the global batch's windows (allocated once: a step allocates nothing)

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
      : TokenWindows(std::move(corpus.train), std::move(corpus.val), model, o), files(corpus.files) {
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
  TokenFiles(const Model &model, const DataOptions &o) : TokenFiles(model, o, load(model, o)) {}
  std::string describe() const override {
    return fmt::format("tokens: {} training tokens ({}), {} validation tokens ({}), vocabulary {}", train.size(),
                       train_path, val.size(), val_path, vocab);
  }
  std::vector<std::int32_t> sample_prompt() const override { return {val.front()}; }  // the validation split's first

private:
  TokenFiles(const Model &model, const DataOptions &o, Splits s)
      : TokenWindows(std::move(s.train), std::move(s.val), model, o),
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

namespace {

// Bytes that are not text: neither printable ASCII, nor whitespace (\t \n \v \f \r), nor part of a
// UTF-8 sequence (a lead byte C2..F4 and its continuation bytes).
std::size_t non_text_bytes(const std::vector<std::uint8_t> &bytes) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < bytes.size();) {
    const std::uint8_t c = bytes[i];
    const std::size_t tail = c >= 0xc2 && c <= 0xdf ? 1 : c >= 0xe0 && c <= 0xef ? 2 : c >= 0xf0 && c <= 0xf4 ? 3 : 0;
    std::size_t n = 1;
    while (n <= tail && i + n < bytes.size() && (bytes[i + n] & 0xc0) == 0x80) ++n;
    const bool text = (c >= 0x20 && c < 0x7f) || (c >= '\t' && c <= '\r') || (tail > 0 && n == tail + 1);
    if (!text) ++bad;
    i += text ? n : 1;
  }
  return bad;
}

// A file of a text corpus may have at most this share of bytes that are not text (Debian's fortunes
// have at most 0.11%: overstruck and escaped characters; random bytes about 60%; Latin-1 prose a few %).
constexpr double max_non_text = 0.10;

// The regular files of `dir` (sorted; fortune's .dat/.u8 index files and symbolic links skipped).
std::vector<std::filesystem::path> corpus_files(const std::string &dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    throw InputError(fmt::format("{}: no such folder (install the text package or pass --data-dir)", dir));
  std::vector<std::filesystem::path> files;
  std::filesystem::directory_iterator it(dir, ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    std::error_code kind;
    const auto ext = it->path().extension();
    if (it->is_regular_file(kind) && !it->is_symlink(kind) && ext != ".dat" && ext != ".u8")
      files.push_back(it->path());
  }
  if (ec) throw InputError(fmt::format("{}: cannot list the folder ({})", dir, ec.message()));
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

Corpus load_corpus(const std::string &dir, int vocab, double val_fraction) {
  const std::vector<std::filesystem::path> files = corpus_files(dir);
  const std::int32_t unknown = vocab > '?' ? '?' : 0;  // bytes past the vocabulary
  std::vector<std::int32_t> text;
  for (const auto &f : files) {
    const std::vector<std::uint8_t> bytes = read_file(f.string());
    if (const std::size_t bad = non_text_bytes(bytes); double(bad) > max_non_text * double(bytes.size()))
      throw InputError(fmt::format(
          "{}: {:.0f}% of its {} bytes are not text (printable ASCII, whitespace or UTF-8); a text corpus file may "
          "have at most {:.0f}%",
          f.string(), 100.0 * double(bad) / double(bytes.size()), bytes.size(), 100 * max_non_text));
    for (std::uint8_t c : bytes) text.push_back(c < vocab ? c : unknown);
  }
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
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw InputError(fmt::format(
        "{}: no such file (write it with scripts/bpe.py, or pass --data-dir, --train-file, --validation-file)", path));
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  std::ifstream in(path, std::ios::binary);
  if (ec || !in) throw InputError(fmt::format("{}: cannot open ({})", path, ec ? ec.message() : std::strerror(errno)));
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
