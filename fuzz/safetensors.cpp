// Fuzz target: safetensors files (parse_safetensors, which --init-from and a snapshot folder's
// model.safetensors and optimizer.safetensors go through). An accepted file: every tensor's bytes
// lie in the data section, back to back with no hole, as many as its shape and dtype say.
// Input: the file.
#include "fuzz.h"

import remat.trainer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  namespace rt = remat::runtime;
  std::vector<std::byte> file(size);
  if (size > 0) std::memcpy(file.data(), data, size);
  try {
    const rt::Safetensors st = rt::parse_safetensors(std::move(file), "model.safetensors");
    REMAT_FUZZ_CHECK(st.bytes.size() == size && st.data_start >= 8 && st.data_start <= size);
    std::size_t bytes = 0;
    for (const rt::SafetensorsTensor &t : st.tensors) {
      const std::span<const std::byte> d = st.data(t);
      REMAT_FUZZ_CHECK(d.size() == t.end - t.begin && d.data() == st.bytes.data() + st.data_start + t.begin);
      REMAT_FUZZ_CHECK(st.find(t.name) == &t);
      bytes += d.size();
    }
    REMAT_FUZZ_CHECK(st.data_start + bytes == size);
  } catch (const rt::InputError &e) { remat::fuzz::check_message(e.what()); }
  return 0;
}
