// Fuzz target: a token file (llm.c / nanoGPT layout), as train-gpt-bpe reads it: load_tokens (the
// gpt_bpe model's vocabulary of 4096), then the trainer's data source with it as both splits.
// Input: the file.
#include "fuzz.h"

import remat.trainer;
import gpt_bpe;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  namespace rt = remat::runtime;
  const std::filesystem::path dir = remat::fuzz::scratch();
  const std::string path =
      remat::fuzz::write(dir / "train.bin", std::string_view(reinterpret_cast<const char *>(data), size));
  try {
    const std::vector<std::uint16_t> tokens = rt::load_tokens(path, gpt_bpe::vocab);
    std::int32_t magic = 0;
    if (size >= 4) std::memcpy(&magic, data, 4);
    const bool llmc = magic == 20240520;  // llm.c's header
    REMAT_FUZZ_CHECK(tokens.size() == (llmc ? (size - 1024) / 2 : size / 2));
    for (const std::uint16_t token : tokens) REMAT_FUZZ_CHECK(token < gpt_bpe::vocab);
    const auto source = rt::token_files(
        gpt_bpe::model, {.dir = dir.string(), .batch = 2, .seed = 1, .train_file = path, .val_file = path});
    REMAT_FUZZ_CHECK(source->train_samples() >= 1 && source->eval_samples() >= 1);
  } catch (const rt::InputError &e) { remat::fuzz::check_message(e.what()); }
  return 0;
}
