// Fuzz target: Fashion-MNIST idx files (gzip'ed or plain), as train-mlp reads them: load_idx, then
// the trainer's data source over the same files (the mlp model: 784 pixels, 10 classes; batch 2)
// and its data state round trip. Input: the images file, then the labels file (fuzz.h's parts).
#include "fuzz.h"

import remat.trainer;
import mlp;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  namespace rt = remat::runtime;
  const auto files = remat::fuzz::parts(data, size, 2);
  const std::filesystem::path dir = remat::fuzz::scratch();
  const std::string images = remat::fuzz::write(dir / "train-images-idx3-ubyte.gz", files[0]);
  const std::string labels = remat::fuzz::write(dir / "train-labels-idx1-ubyte.gz", files[1]);
  std::filesystem::copy_file(images, dir / "t10k-images-idx3-ubyte.gz");
  std::filesystem::copy_file(labels, dir / "t10k-labels-idx1-ubyte.gz");
  try {
    const rt::Dataset ds = rt::load_idx(images, labels, mlp::classes);
    REMAT_FUZZ_CHECK(ds.rows > 0 && ds.width > 0 && ds.labels.size() == std::size_t(ds.rows));
    REMAT_FUZZ_CHECK(ds.images.size() == std::size_t(ds.rows) * std::size_t(ds.width));
    for (const std::int32_t label : ds.labels) REMAT_FUZZ_CHECK(label >= 0 && label < mlp::classes);
    for (const float pixel : ds.images) REMAT_FUZZ_CHECK(pixel >= 0 && pixel <= 1);
    const auto source = rt::fashion_mnist(mlp::model, {.dir = dir.string(), .batch = 2, .seed = 1});
    REMAT_FUZZ_CHECK(source->train_samples() >= 2 && source->eval_samples() >= 1);
    source->restore(source->state());
  } catch (const rt::InputError &e) { remat::fuzz::check_message(e.what()); }
  return 0;
}
