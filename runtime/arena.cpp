// The arena (one allocation a plan's tensors live in, with the canary and the guard) and the
// heap counters the executor and the tests read (runtime/heap_hooks.cpp counts).
module;
#include "cuda_device.h"
#include <fmt/format.h>
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
module remat.runtime;
import remat;

extern "C" std::atomic<size_t> remat_halide_heap_current, remat_halide_heap_peak;
extern "C" std::atomic<bool> remat_heap_counting;
extern "C" std::atomic<size_t> remat_heap_allocations, remat_heap_bytes;

namespace remat::runtime {

HalideHeap halide_heap() { return {remat_halide_heap_current.load(), remat_halide_heap_peak.load()}; }
void reset_halide_heap_peak() { remat_halide_heap_peak = remat_halide_heap_current.load(); }
StepHeap step_heap() { return {remat_heap_allocations.load(), remat_heap_bytes.load()}; }
void reset_step_heap() {
  remat_heap_allocations = 0;
  remat_heap_bytes = 0;
}

CountedHeap::CountedHeap() { remat_heap_counting = true; }
CountedHeap::~CountedHeap() { remat_heap_counting = false; }

// ---- Arena -------------------------------------------------------------------------------------
namespace {
// A NaN payload no kernel produces, as fp32 (0x7FA57FA5) and as each of its bf16 halves; the
// arena is filled and scanned in 16-bit units (every tensor is a whole number of them).
constexpr std::uint16_t canary = 0x7FA5u;
constexpr std::size_t canary_units(std::size_t bytes) { return (bytes + 1) / 2; }
}  // namespace

Arena::Arena(std::size_t size, Device device) : bytes(size), where(device) {
  const std::size_t total = align_up(size + guard_bytes);
  host = static_cast<std::byte *>(std::aligned_alloc(arena_alignment, total));
  if (!host) throw std::runtime_error(fmt::format("cannot allocate an arena of {} bytes", size));
  if (device == Device::cuda) {
    try {
      cuda::init();
      dev = static_cast<std::byte *>(cuda::device_malloc(total));
    } catch (...) {
      std::free(host);
      throw;
    }
  }
  fill_canary(bytes, guard_bytes);  // the guard holds the canary from the start, filled or not
  upload(bytes, guard_bytes);
}

Arena::~Arena() {
  if (dev) cuda::device_free(dev);
  std::free(host);
}

void Arena::upload(std::size_t offset, std::size_t n) {
  if (dev) cuda::copy_to_device(dev + offset, host + offset, n, cuda::Stream::compute);
}

void Arena::download(std::size_t offset, std::size_t n) {
  if (!dev) return;
  cuda::copy_to_host(host + offset, dev + offset, n, cuda::Stream::compute);
  cuda::synchronize(cuda::Stream::compute);
}

void Arena::synchronize() {
  if (dev) cuda::synchronize(cuda::Stream::compute);
}

void Arena::fill_canary(std::size_t offset, std::size_t n) {
  auto *units = reinterpret_cast<std::uint16_t *>(host + offset);
  std::fill(units, units + canary_units(n), canary);
}

void Arena::fill_canary() {
  filled = true;
  released_high = 0;
  fill_canary(0, bytes + guard_bytes);
  upload(0, canary_units(bytes + guard_bytes) * 2);
}

long Arena::first_written(std::size_t offset, std::size_t n) const {
  const auto *units = reinterpret_cast<const std::uint16_t *>(host + offset);
  const auto *end = units + canary_units(n);
  const auto *hit = std::find_if(units, end, [](std::uint16_t u) { return u != canary; });
  return hit == end ? -1 : long(offset + 2 * (hit - units));
}

namespace {
// One past the last unit of [begin, end) that is not canary, as a byte offset from `base`; 0 if none.
std::size_t written_end(const std::byte *base, std::size_t begin, std::size_t end) {
  const auto *units = reinterpret_cast<const std::uint16_t *>(base);
  for (std::size_t i = canary_units(end); i > begin / 2; --i)
    if (units[i - 1] != canary) return i * 2;
  return 0;
}
}  // namespace

void Arena::release(std::size_t offset, std::size_t n) {
  released_high = std::max(released_high, written_end(host, offset, offset + n));
  fill_canary(offset, n);
}

std::size_t Arena::high_water() {
  download(0, canary_units(bytes + guard_bytes) * 2);
  return std::max(released_high, written_end(host, 0, bytes + guard_bytes));
}

long Arena::guard_damage() {
  download(bytes, guard_bytes);
  const long at = first_written(bytes, guard_bytes);
  return at < 0 ? -1 : at - long(bytes);
}
}  // namespace remat::runtime
