// Offload: checkpoints and named internals to the pinned host buffer and back.
module;
#include "cuda_device.h"
#include <fmt/format.h>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
module remat.runtime;
import remat;

namespace remat::runtime {

// CUDA: every copy runs on the copy stream, which first waits for everything queued on the compute
// stream before the step. Copy-out: copies, records `done`; the compute stream waits for that
// event only before the step after (which may reuse the memory). Fetch: copies into the restored
// tensor, records `done`; the reader waits for it. No device-wide synchronization. Other
// devices: plain copies (the host copy of the arena is the truth there).
Executor::Transfers::Transfers(const Plan &plan, Arena &arena) : plan(plan), arena(arena), bytes(plan.offload_bytes) {
  cuda_device = arena.device() == Device::cuda;
  host =
      static_cast<std::byte *>(cuda_device ? cuda::pinned_malloc(bytes) : std::aligned_alloc(arena_alignment, bytes));
  if (!host) throw std::runtime_error(fmt::format("cannot allocate {} bytes of host memory for offload", bytes));
  if (cuda_device)
    for (const Step &st : plan.train) {
      for (int t : st.offload) done[t] = cuda::event_create();
      for (auto [from, to] : st.fetch) done[to] = cuda::event_create();
    }
  if (cuda_device) ready = cuda::event_create();
}
Executor::Transfers::~Transfers() {
  for (auto &[t, e] : done) cuda::event_destroy(e);
  if (cuda_device) {
    cuda::event_destroy(ready);
    cuda::pinned_free(host);
  } else {
    std::free(host);
  }
}
std::byte *Executor::Transfers::device_at(int t) const { return arena.device_data() + plan.tensors[t].offset; }

void Executor::Transfers::before(const Step &st) {
  for (int t : st.await_out)
    if (cuda_device) cuda::wait(cuda::Stream::compute, done.at(t));
  if ((!st.offload.empty() || !st.fetch.empty()) && cuda_device) {
    cuda::record(ready, cuda::Stream::compute);
    cuda::wait(cuda::Stream::copy, ready);
  }
  for (int t : st.offload) {
    std::byte *dst = host + plan.tensors[t].host_offset;
    if (cuda_device) {
      cuda::copy_to_host(dst, device_at(t), plan.tensors[t].bytes(), cuda::Stream::copy);
      cuda::record(done.at(t), cuda::Stream::copy);
    } else {
      std::memcpy(dst, device_at(t), plan.tensors[t].bytes());
    }
  }
  for (auto [from, to] : st.fetch) {
    const std::byte *src = host + plan.tensors[from].host_offset;
    if (cuda_device) {
      cuda::copy_to_device(device_at(to), src, plan.tensors[to].bytes(), cuda::Stream::copy);
      cuda::record(done.at(to), cuda::Stream::copy);
    } else {
      std::memcpy(device_at(to), src, plan.tensors[to].bytes());
    }
  }
  for (int t : st.await_in)
    if (cuda_device) cuda::wait(cuda::Stream::compute, done.at(t));
}

}  // namespace remat::runtime
