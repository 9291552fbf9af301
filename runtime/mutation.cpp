// Deliberately broken runs, for the mutation test (tests/mutations.py): REMAT_MUTATION=<name> breaks
// the executor in one way a bug could, and the ordinary tests must then fail. Read once; a run
// with it set says so on stderr. The snapshot faults (a byte flipped after its checksum, fsync
// removed) are the I/O interposer's (tests/io_witness.cpp), not the runtime's.
module;
#include <HalideRuntime.h>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <utility>
#include <vector>
module remat.runtime;
import remat;

namespace remat::runtime {
namespace {
enum class Mutation { none, skip_recompute, swap_saved, shift_offset, drop_accumulate, reuse_dropout_rows };

constexpr std::array<std::pair<std::string_view, Mutation>, 5> mutations = {{
    {"skip_recompute", Mutation::skip_recompute},          // the first forward rebuilt in backward is not run
    {"swap_saved", Mutation::swap_saved},                  // a backward reads two saved tensors swapped
    {"shift_offset", Mutation::shift_offset},              // a backward reads a saved tensor one element off
    {"drop_accumulate", Mutation::drop_accumulate},        // gradients never add to the previous micro-batch's
    {"reuse_dropout_rows", Mutation::reuse_dropout_rows},  // every micro-batch's dropout rows start at row 0
}};

Mutation mutation() {
  static const Mutation m = [] {
    const char *name = std::getenv("REMAT_MUTATION");
    if (!name) return Mutation::none;
    for (auto [n, value] : mutations)
      if (n == name) {
        std::fprintf(stderr, "REMAT_MUTATION=%s: this run is broken on purpose (tests/mutations.py)\n", name);
        return value;
      }
    return Mutation::none;  // another part's fault (the I/O interposer's)
  }();
  return m;
}

bool saved(Role r) { return r == Role::block_input || r == Role::internal || r == Role::recomputed; }

bool same_shape(const halide_buffer_t &p, const halide_buffer_t &q) {
  if (p.type != q.type || p.dimensions != q.dimensions) return false;
  for (int d = 0; d < p.dimensions; ++d)
    if (p.dim[d].extent != q.dim[d].extent) return false;
  return true;
}

std::int32_t zero_row = 0;
bool never = false;
}  // namespace

void Executor::break_on_purpose() {
  const Mutation m = mutation();
  if (m == Mutation::none) return;
  bool done = false;  // the one-step faults break the first step they fit
  for (std::size_t i = 0; i < train_calls.size(); ++i) {
    const Step &st = plan.train[i];
    Bound &b = *train_calls[i];
    const int n_scalars = int(st.scalars.size());
    for (int a = 0; a < n_scalars; ++a) {
      if (m == Mutation::drop_accumulate && st.scalars[a] == Scalar::accumulate) b.argv[a] = &never;
      if (m == Mutation::reuse_dropout_rows && st.scalars[a] == Scalar::first_row) b.argv[a] = &zero_row;
    }
    if (done) continue;
    if (m == Mutation::skip_recompute && st.recompute && !is_backward(st.variant)) done = b.skipped = true;
    if (!is_backward(st.variant) || (m != Mutation::swap_saved && m != Mutation::shift_offset)) continue;
    std::vector<int> reads;  // argument positions of the saved tensors it reads
    for (int a = n_scalars; a < int(b.argv.size()); ++a)
      if (const Arg &arg = st.args[a - n_scalars]; arg.access == Access::read && saved(plan.tensors[arg.tensor].role))
        reads.push_back(a);
    if (m == Mutation::shift_offset && !reads.empty() && b.buffers[reads.front()].host) {  // host arenas
      halide_buffer_t &buf = b.buffers[reads.front()];
      const long elem = buf.type.bytes();
      const bool room =
          buf.host + buf.size_in_bytes() + elem <= reinterpret_cast<std::uint8_t *>(arena.data()) + arena.size();
      buf.host += room ? elem : -elem;
      done = true;
    }
    for (std::size_t x = 0; m == Mutation::swap_saved && !done && x < reads.size(); ++x)
      for (std::size_t y = x + 1; !done && y < reads.size(); ++y)
        if (same_shape(b.buffers[reads[x]], b.buffers[reads[y]])) {
          std::swap(b.argv[reads[x]], b.argv[reads[y]]);
          done = true;
        }
  }
}
}  // namespace remat::runtime
