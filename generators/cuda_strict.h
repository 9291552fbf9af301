// CUDA kernels keep every float multiply and add apart, as the CPU kernels do (strict_float).
//
// Halide lowers a strict_float pipeline's arithmetic to strict_mul / strict_add calls and LLVM
// sees plain fmul and fadd, but Halide runs LLVM's PTX back end with FPOpFusion::Fast: it fuses a
// multiply feeding an add into one fma.rn.f32 (one rounding instead of two) wherever the pattern
// shows, strict or not, and the pattern depends on what surrounds it in each kernel. ptxas may do
// the same to a mul.f32 and an add.f32 printed without a rounding mode. So a recompute kernel
// could round differently from the forward kernel it must reproduce, and no CUDA result could be
// held to the CPU's arithmetic.
//
// `KeepMultipliesApart`, run on a CUDA pipeline's lowered code, turns every 32-bit float product
// inside the GPU loops into llvm.nvvm.mul.rn.f, a multiply the back end selects as mul.rn.f32 and
// never fuses, and every quotient into llvm.nvvm.div.rn.f (LLVM turns a division by a power of
// two into a product, which it would then fuse). Halide expands exp and log in its code generator, after this pass:
// they are expanded here first (Halide's own polynomials, as on the CPU) so that their products are kept apart too.
// `-nvptx-fma-level=0` (set by `keep_cuda_adds_rounded` before Halide starts LLVM) has every remaining add, sub and mul
// printed with .rn, which ptxas may not contract. tests/test_cuda.cpp's PTX lint checks the result: no fma.rn.f32 and
// no f32 add, sub or mul without a rounding mode in any kernel.
#pragma once

#include <Halide.h>

#include <cstdlib>
#include <string>

namespace remat::gen {

class KeepMultipliesApart : public Halide::Internal::IRMutator {
  using IRMutator = Halide::Internal::IRMutator;
  using Expr = Halide::Expr;
  using Stmt = Halide::Internal::Stmt;
  using Call = Halide::Internal::Call;

  int gpu_loops = 0;  // depth of the CUDA loops around the node being mutated

  static bool f32(const Expr &e) { return e.type() == Halide::Float(32); }
  Expr opaque(const char *intrinsic, const Expr &a, const Expr &b) {
    return Call::make(Halide::Float(32), intrinsic, {mutate(a), mutate(b)}, Call::PureExtern);
  }
  Expr product(const Expr &a, const Expr &b) { return opaque("llvm.nvvm.mul.rn.f", a, b); }
  Expr quotient(const Expr &a, const Expr &b) { return opaque("llvm.nvvm.div.rn.f", a, b); }

protected:
  using IRMutator::visit;
  Stmt visit(const Halide::Internal::For *op) override {
    const bool gpu = op->device_api == Halide::DeviceAPI::CUDA;
    gpu_loops += gpu;
    Stmt s = IRMutator::visit(op);
    gpu_loops -= gpu;
    return s;
  }
  Expr visit(const Halide::Internal::Mul *op) override {
    return gpu_loops && f32(op->a) ? product(op->a, op->b) : IRMutator::visit(op);
  }
  Expr visit(const Halide::Internal::Div *op) override {
    return gpu_loops && f32(op->a) ? quotient(op->a, op->b) : IRMutator::visit(op);
  }
  Expr visit(const Call *op) override {
    if (!gpu_loops || !f32(op)) return IRMutator::visit(op);
    if (op->is_intrinsic(Call::strict_mul)) return product(op->args[0], op->args[1]);
    if (op->is_intrinsic(Call::strict_div)) return quotient(op->args[0], op->args[1]);
    if (op->name == "exp_f32") return mutate(Halide::Internal::halide_exp(op->args[0]));
    if (op->name == "log_f32") return mutate(Halide::Internal::halide_log(op->args[0]));
    return IRMutator::visit(op);
  }
};

// The LLVM flag of the comment above, added to HL_LLVM_ARGS (Halide reads it once, when it first
// starts LLVM: call this before compiling anything). It concerns only the PTX back end.
inline void keep_cuda_adds_rounded() {
  const char *given = std::getenv("HL_LLVM_ARGS");
  const std::string args = std::string(given ? given : "") + (given && *given ? " " : "") + "-nvptx-fma-level=0";
  setenv("HL_LLVM_ARGS", args.c_str(), 1);
}

}  // namespace remat::gen
