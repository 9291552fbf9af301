// The launches of a CUDA pipeline, read off its lowered code: for each GPU kernel, its grid and
// block extents and the shared memory it allocates, as expressions of the pipeline's buffers.
// Buffers have static feature widths and a dynamic row count (generators/stage_kernels.h), so an
// extent is either a constant or grows with the rows (the batch times the context). The model
// compiler holds every launch to an H100's limits for any row count: the block and its shared
// memory constant and within the device's, the grid's y and z axes constant (65,535 at most: only
// x takes 2^31 - 1), the rows on x.
#pragma once

#include <Halide.h>

#include "../runtime/launch_limits.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace remat::gen {

struct CudaLaunch {
  std::string kernel;                // the GPU kernel's loop name
  std::array<Halide::Expr, 3> grid;  // undefined: 1
  std::array<Halide::Expr, 3> block;
  Halide::Expr shared_bytes;  // the sum of its shared allocations (Halide may pad each)

  static std::string text(const Halide::Expr &e) {
    if (!e.defined()) return "1";
    std::ostringstream o;
    o << e;
    return o.str();
  }
  static unsigned narrow(std::int64_t v) { return unsigned(std::clamp<std::int64_t>(v, 0, UINT32_MAX)); }
  static std::optional<std::int64_t> constant(const Halide::Expr &e) {
    if (!e.defined()) return 1;
    return Halide::Internal::as_const_int(e);
  }
  // Why this launch may not fit an H100 for some row count ("" when it fits every one): the block,
  // its shared memory and the grid's y and z must not grow with the rows, and fit the device
  // (cuda::launch_problem); the grid's x, which grows with them, takes 2^31 - 1 blocks.
  std::string problem() const {
    const char *axis[3] = {"x", "y", "z"};
    cuda::Launch l{{1, 1, 1}, {1, 1, 1}, 0};
    for (int d = 0; d < 3; ++d) {
      const auto b = constant(block[d]), g = constant(grid[d]);
      if (!b) return std::string("its block's ") + axis[d] + " extent grows with the rows: " + text(block[d]);
      if (!g && d > 0) return std::string("its grid's ") + axis[d] + " extent grows with the rows: " + text(grid[d]);
      l.block[d] = narrow(*b);
      if (g) l.grid[d] = narrow(*g);
    }
    const auto shared = constant(shared_bytes);
    if (!shared) return "its shared memory grows with the rows: " + text(shared_bytes);
    l.shared = narrow(*shared);
    return cuda::launch_problem(l);
  }
  // "<kernel> grid <x> <y> <z> block <x> <y> <z> shared <bytes>", "rows" for an extent that grows with them
  std::string describe() const {
    auto field = [](const Halide::Expr &e) {
      const auto c = constant(e);
      return c ? std::to_string(*c) : std::string("rows");
    };
    return kernel + " grid " + field(grid[0]) + " " + field(grid[1]) + " " + field(grid[2]) + " block " +
           field(block[0]) + " " + field(block[1]) + " " + field(block[2]) + " shared " + field(shared_bytes);
  }
};

// A lowering pass that changes nothing and records the launches of the CUDA loops it sees.
class CudaLaunches : public Halide::Internal::IRMutator {
  using IRMutator = Halide::Internal::IRMutator;
  using Expr = Halide::Expr;
  using Stmt = Halide::Internal::Stmt;
  using For = Halide::Internal::For;

public:
  explicit CudaLaunches(std::vector<CudaLaunch> &out) : out(out) {}

protected:
  using IRMutator::visit;
  Stmt visit(const Halide::Internal::LetStmt *op) override {
    lets[op->name] = Halide::Internal::simplify(resolved(op->value));
    return IRMutator::visit(op);
  }
  Stmt visit(const For *op) override {
    const bool block = op->for_type == Halide::Internal::ForType::GPUBlock;
    const bool thread = op->for_type == Halide::Internal::ForType::GPUThread;
    if (!block && !thread) {  // a host loop: the shared sizes stored in it are their maximum over it
      host_loops.push_back(op);
      Stmt s = IRMutator::visit(op);
      host_loops.pop_back();
      return s;
    }
    const bool outermost = block && !launch;
    if (outermost) launch = CudaLaunch{op->name};
    if (launch) {
      std::array<Expr, 3> &dims = block ? launch->grid : launch->block;
      Expr &dim = dims[axis(op->name)];
      const Expr extent = Halide::Internal::simplify(resolved(op->extent));
      dim = dim.defined() ? Halide::Internal::simplify(Halide::max(dim, extent)) : extent;
    }
    Stmt s = IRMutator::visit(op);
    if (outermost) {
      if (!launch->shared_bytes.defined()) launch->shared_bytes = 0;
      out.push_back(*launch);
      launch.reset();
    }
    return s;
  }
  Stmt visit(const Halide::Internal::Allocate *op) override {
    if (launch && op->memory_type == Halide::MemoryType::GPUShared) {
      Expr bytes = Halide::Internal::make_const(Halide::Int(64), op->type.bytes());
      for (const Expr &e : op->extents) bytes = bytes * Halide::cast<std::int64_t>(resolved(e));
      launch->shared_bytes =
          Halide::Internal::simplify(launch->shared_bytes.defined() ? launch->shared_bytes + bytes : bytes);
    }
    return IRMutator::visit(op);
  }

  // Halide sizes a kernel's shared allocations on the host, in a one-element buffer
  // <allocation>.shared_size stored before the launch.
  Stmt visit(const Halide::Internal::Store *op) override {
    if (!op->name.ends_with(".shared_size")) return IRMutator::visit(op);
    Expr size = resolved(op->value);  // max(the size so far, this iteration's)
    for (auto loop = host_loops.rbegin(); loop != host_loops.rend(); ++loop) {
      const auto first = CudaLaunch::constant(resolved((*loop)->min)),
                 n = CudaLaunch::constant(resolved((*loop)->extent));
      if (!first || !n) continue;  // left unresolved: the launch check says so
      Expr most;
      for (std::int64_t i = *first; i < *first + *n; ++i) {
        const Expr at = Halide::Internal::substitute((*loop)->name, Halide::Expr(int(i)), size);
        most = most.defined() ? Halide::max(most, at) : at;
      }
      size = Halide::Internal::simplify(most);
    }
    shared_sizes[op->name] = Halide::Internal::simplify(size);
    return IRMutator::visit(op);
  }

private:
  // 0, 1, 2 from the x, y or z of the loop name's block_id_ / thread_id_ (which Halide may follow
  // with a $N of its own: "h1$13.s0.c.co.block_id_y$1")
  static int axis(const std::string &name) {
    const std::size_t at = name.rfind("_id_") + 4;
    return at < name.size() ? name[at] - 'x' : 0;
  }
  // e with the lets and shared sizes seen so far put in
  Expr resolved(const Expr &e) const {
    struct Sizes : IRMutator {
      const std::map<std::string, Expr> &sizes;
      explicit Sizes(const std::map<std::string, Expr> &sizes) : sizes(sizes) {}
      using IRMutator::visit;
      Expr visit(const Halide::Internal::Load *op) override {
        const auto it = sizes.find(op->name);
        return it == sizes.end() ? IRMutator::visit(op) : Halide::cast(op->type, it->second);
      }
    } sizes(shared_sizes);
    return sizes.mutate(Halide::Internal::substitute(lets, e));
  }

  std::vector<CudaLaunch> &out;
  std::map<std::string, Expr> lets, shared_sizes;
  std::vector<const For *> host_loops;  // around the node being visited
  std::optional<CudaLaunch> launch;
};

}  // namespace remat::gen
