// A test-only kernel: the real one, then a planted fault (a write 2 bytes past one of its buffer
// arguments, or a heap allocation), so that tests show each check of the executor fires
// (tests/test_arena.cpp on the CPU, tests/test_cuda.cpp on the device). Include after
// `import remat; import remat.runtime;`. Everything is in remat::testing.
#pragma once

#include <boost/test/unit_test.hpp>

#include <HalideRuntime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace remat::testing {

struct Planted {
  int (*real)(void **) = nullptr;
  int call = 0, on_call = 0;  // the fault is planted on that call of the kernel (0: the first)
  int argument = -1;          // overrun: write 2 bytes past the end of this buffer argument
  std::size_t allocate = 0;   // allocate (and free) this many bytes from the heap
  // the overrun's write, when the buffer is not in host memory (CUDA: past buf->device); by
  // default 2 zero bytes at buf->host + buf->size_in_bytes()
  void (*overrun)(halide_buffer_t *buf) = nullptr;
};
inline Planted planted;

inline int faulty_kernel(void **args) {
  const int err = planted.real(args);
  if (planted.call++ != planted.on_call) return err;
  if (planted.argument >= 0) {
    auto *buf = static_cast<halide_buffer_t *>(args[planted.argument]);
    if (planted.overrun)
      planted.overrun(buf);
    else
      std::memset(buf->host + buf->size_in_bytes(), 0, 2);
  }
  if (planted.allocate) {
    void *volatile p = std::malloc(planted.allocate);
    std::free(p);
  }
  return err;
}

// The kernel table with kernel `key` replaced by the faulty kernel.
inline std::vector<remat::runtime::Kernel> with_fault(std::span<const remat::runtime::Kernel> table,
                                                      const remat::KernelKey &key, Planted fault) {
  std::vector<remat::runtime::Kernel> out(table.begin(), table.end());
  auto it = std::ranges::find_if(out, [&](const remat::runtime::Kernel &k) { return k.key == key; });
  BOOST_TEST_REQUIRE((it != out.end()), name_of("", key).view());
  fault.real = it->argv;
  planted = fault;
  it->argv = faulty_kernel;
  return out;
}

// Position of a step's buffer argument among its kernel's arguments (the signature's order:
// the step's scalars come first).
inline int argument_index(const Step &st, const Arg &arg) { return int(st.scalars.size() + (&arg - st.args.data())); }

// Where 2 bytes written just past a tensor that a train step writes land: in the guard (the
// tensor ends at the plan's peak), in free memory, in a live tensor the step does not write, or
// (past a gradient view) in the flat gradient buffer where the step writes nothing.
enum class Landing { guard, free_memory, neighbour, other_gradient };

// The first train step, and its written argument, whose overrun lands as asked (replaying the plan).
struct Site {
  int step = -1;
  const Arg *arg = nullptr;  // into the plan's steps
  KernelKey key;             // the kernel that step calls
  std::string kernel;        // ... its name (in the executor's messages)
  int call = 0;              // which of that kernel's calls in the train phase it is (0: the first)
  int argument = -1;         // the argument's position among the kernel's
  std::string neighbour;     // what the overrun lands in, if a tensor
};
inline Site overrun_site(const Plan &plan, Landing landing, std::string_view model) {
  auto kernel = [&](int i) { return kernel_key(plan.train[i].stage, plan.train[i].variant, plan.precision); };
  auto site = [&](int i, const Arg &a, const Name &neighbour) {
    int call = 0;
    for (int j = 0; j < i; ++j) call += kernel(j) == kernel(i);
    return Site{i,
                &a,
                kernel(i),
                std::string(name_of(model, kernel(i)).view()),
                call,
                argument_index(plan.train[i], a),
                std::string(neighbour.view())};
  };
  std::vector<int> live;
  for (int t = 0; t < int(plan.tensors.size()); ++t)
    if (plan.tensors[t].view_of < 0 && persistent(plan.tensors[t].role)) live.push_back(t);
  for (int i = 0; i < int(plan.train.size()); ++i) {
    const Step &st = plan.train[i];
    live.insert(live.end(), st.alloc.begin(), st.alloc.end());
    auto written = [&](int t) {
      return std::ranges::any_of(st.args, [&](const Arg &a) { return a.access == Access::write && a.tensor == t; });
    };
    for (const Arg &a : st.args) {
      const Tensor &t = plan.tensors[a.tensor];
      if (landing == Landing::other_gradient && a.access == Access::write && t.role == Role::grads && t.view_of >= 0) {
        const std::size_t end = plan.arena_offset(a.tensor) + t.bytes();
        const bool unwritten = std::ranges::none_of(st.args, [&](const Arg &o) {
          const Tensor &x = plan.tensors[o.tensor];
          return o.access == Access::write && plan.arena_offset(o.tensor) < end + 2 &&
                 end < plan.arena_offset(o.tensor) + x.bytes();
        });
        const Tensor &root = plan.tensors[t.view_of];
        if (unwritten && end + 2 <= root.offset + root.bytes()) return site(i, a, name_of(root.key));
      }
      if (a.access != Access::write || t.view_of >= 0 || landing == Landing::other_gradient) continue;
      const std::size_t end = t.offset + t.bytes();
      const auto hit = std::ranges::find_if(live, [&](int o) {
        const Tensor &x = plan.tensors[o];
        return x.offset < end + 2 && end < x.offset + x.bytes();
      });
      const bool lands = landing == Landing::guard         ? end == plan.peak_bytes
                         : landing == Landing::free_memory ? end + 2 <= plan.peak_bytes && hit == live.end()
                                                           : hit != live.end() && !written(*hit);
      if (lands) return site(i, a, hit == live.end() ? Name{} : name_of(plan.tensors[*hit].key));
    }
    for (int t : st.free) std::erase(live, t);
  }
  return {};
}

// The kernel table with the kernel of `site` planting 2 bytes past its argument, on that step's
// call (`overrun` writes them where the buffer is not in host memory).
inline std::vector<runtime::Kernel> with_overrun(std::span<const runtime::Kernel> table, const Site &site,
                                                 void (*overrun)(halide_buffer_t *) = nullptr) {
  const auto real = std::ranges::find_if(table, [&](const runtime::Kernel &k) { return k.key == site.key; });
  BOOST_TEST_REQUIRE((real != table.end()), "no kernel " << site.kernel);
  Planted fault;
  fault.on_call = site.call;
  fault.argument = site.argument;
  BOOST_TEST_REQUIRE(site.argument < real->metadata()->num_arguments,
                     site.kernel << " has no argument " << site.argument);
  fault.overrun = overrun;
  return with_fault(table, site.key, fault);
}

}  // namespace remat::testing
