// Fuzz target: a text corpus folder, as train-gpt reads it: load_corpus (the gpt model's byte
// vocabulary of 128), then the trainer's data source over it (sequences of 64) and its data state
// round trip. Input: four files a, b, c.gz and d.dat (fuzz.h's parts; fortune's .dat index files are
// skipped, .gz is only a name: zlib reads gzip by its bytes).
#include "fuzz.h"

import remat.trainer;
import gpt;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  namespace rt = remat::runtime;
  const auto files = remat::fuzz::parts(data, size, 4);
  const std::filesystem::path dir = remat::fuzz::scratch();
  const char *names[] = {"a", "b", "c.gz", "d.dat"};
  for (std::size_t i = 0; i < files.size(); ++i) remat::fuzz::write(dir / names[i], files[i]);
  try {
    const rt::Corpus corpus = rt::load_corpus(dir.string(), gpt::vocab, 0.1);
    REMAT_FUZZ_CHECK(corpus.files == 3 && corpus.train.size() + corpus.val.size() > 0);
    for (const auto *split : {&corpus.train, &corpus.val})
      for (const std::int32_t token : *split) REMAT_FUZZ_CHECK(token >= 0 && token < gpt::vocab);
    const auto source = rt::text_corpus(gpt::model, {.dir = dir.string(), .batch = 2, .seed = 1});
    REMAT_FUZZ_CHECK(source->train_samples() >= 1 && source->eval_samples() >= 1);
    source->restore(source->state());
  } catch (const rt::InputError &e) { remat::fuzz::check_message(e.what()); }
  return 0;
}
