// Fuzz target: DataSource::restore, the data position a snapshot carries, for the Fashion-MNIST
// source (RNG state, position, an order of its images) and a token source (RNG state) over small
// made-up datasets. A refused state must leave the source as it was; an accepted one must give a
// state that restores to itself. Input: a byte (even: images, odd: text), then the state string.
#include "fuzz.h"

import remat.trainer;
import mlp;
import gpt;

namespace {

namespace rt = remat::runtime;

struct Sources {
  std::unique_ptr<rt::DataSource> images, text;
};

// Three 28 x 28 images labelled 0, 1, 2 (both splits, batch 2), and a text of 2000 characters.
Sources &sources() {
  static Sources s = [] {
    const std::filesystem::path dir = remat::fuzz::scratch();
    std::string images("\0\0\x08\x03\0\0\0\x03\0\0\0\x1c\0\0\0\x1c", 16),
        labels("\0\0\x08\x01\0\0\0\x03\0\x01\x02", 11);
    images.append(3 * 28 * 28, '\x80');
    for (const char *split : {"train", "t10k"}) {
      remat::fuzz::write(dir / (std::string(split) + "-images-idx3-ubyte.gz"), images);
      remat::fuzz::write(dir / (std::string(split) + "-labels-idx1-ubyte.gz"), labels);
    }
    std::filesystem::create_directory(dir / "text");
    std::string text;
    while (text.size() < 2000) text += "The quick brown fox jumps over the lazy dog.\n";
    remat::fuzz::write(dir / "text" / "a", text);
    return Sources{rt::fashion_mnist(mlp::model, {.dir = dir.string(), .batch = 2, .seed = 1}),
                   rt::text_corpus(gpt::model, {.dir = (dir / "text").string(), .batch = 2, .seed = 1})};
  }();
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  if (size == 0) return 0;
  rt::DataSource &source = data[0] % 2 == 0 ? *sources().images : *sources().text;
  const std::string state(reinterpret_cast<const char *>(data) + 1, size - 1), before = source.state();
  try {
    source.restore(state);
    const std::string after = source.state();
    source.restore(after);
    REMAT_FUZZ_CHECK(source.state() == after);
  } catch (const rt::InputError &e) {
    remat::fuzz::check_message(e.what());
    REMAT_FUZZ_CHECK(source.state() == before);
  }
  return 0;
}
