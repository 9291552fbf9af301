// remat's CPU attention (runtime/attention.cpp, what the CPU kernels call) forward and backward at
// the real models' head shapes: GPT-2's 12 heads of 64 and SmolLM2's 9 query / 3 key-value heads
// of 64, causal, batch 1, context lengths given. Forward is the statistics pass and the output
// pass (as a kernel that saves lse runs them), backward the gradient of q, k and v. Prints one
// JSON object (bench/attention.py puts PyTorch's scaled_dot_product_attention beside it).
#include <HalideRuntime.h>
#include <attention.h>
#include <bf16.h>
#include <fmt/format.h>
#include <gemm.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

template <class F>
double median_ms(F run, int reps) {
  std::vector<double> ms;
  run();  // warm-up
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::ranges::sort(ms);
  return ms[ms.size() / 2];
}

nlohmann::json measure(int T, int H, int KV, int D, bool bf16, int reps) {
  const std::size_t width = std::size_t(H + 2 * KV) * D, rows = T;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> qkv(rows * width), dout(rows * H * D), out(rows * H * D), dqkv(rows * width),
      per_head(rows * 3 * H * D), lse(rows * H), delta(rows * H);
  for (float &x : qkv) x = normal(rng);
  for (float &x : dout) x = normal(rng);
  // bf16 tensors live in the first half of the same vectors
  if (bf16) {
    auto *q16 = reinterpret_cast<std::uint16_t *>(qkv.data()), *d16 = reinterpret_cast<std::uint16_t *>(dout.data());
    for (std::size_t i = 0; i < qkv.size(); ++i) q16[i] = remat::float_to_bf16(qkv[i]);
    for (std::size_t i = 0; i < dout.size(); ++i) d16[i] = remat::float_to_bf16(dout[i]);
  }
  remat::AttentionCall call{.qkv = qkv.data(), .rows = int(rows), .T = T, .H = H, .KV = KV, .D = D, .bf16 = bf16};
  const double forward = median_ms(
      [&] {
        remat::attention_lse(call, lse.data());
        remat::attention_out(call, lse.data(), out.data());
      },
      reps);
  const double backward = median_ms(
      [&] { remat::attention_grad(call, lse.data(), dout.data(), delta.data(), per_head.data(), dqkv.data()); }, reps);
  // causal: T (T + 1) / 2 scores a head; forward 2 GEMM-sized products, backward 4 (dq, dk, dv, dP)
  const double products = double(T) * (T + 1) / 2 * D * 2 * H;
  return {{"T", T},
          {"H", H},
          {"KV", KV},
          {"D", D},
          {"precision", bf16 ? "bf16" : "fp32"},
          {"forward_ms", forward},
          {"backward_ms", backward},
          {"gflops", (2 + 4) * products / ((forward + backward) * 1e6)}};
}

}  // namespace

int main(int argc, char **argv) {
  std::vector<int> lengths;
  int reps = 3;
  std::vector<bool> precisions = {false, true};  // bf16?
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (arg == "--precision" && i + 1 < argc &&
               (argv[i + 1] == std::string("fp32") || argv[i + 1] == std::string("bf16"))) {
      precisions = {argv[++i] == std::string("bf16")};
    } else if (std::all_of(arg.begin(), arg.end(), ::isdigit) && !arg.empty()) {
      lengths.push_back(std::atoi(arg.c_str()));
    } else {
      fmt::print(stderr, "usage: bench-attention [--reps N] [--precision fp32|bf16] T...\n");
      return 2;
    }
  }
  if (lengths.empty()) lengths = {1024, 4096, 8192};
  if (reps < 1 || std::ranges::any_of(lengths, [](int t) { return t < 1; })) {
    fmt::print(stderr, "bench-attention: context lengths and --reps must be >= 1\n");
    return 2;
  }
  remat::gemm_warm_up();
  nlohmann::json rows = nlohmann::json::array();
  for (int T : lengths)
    for (bool bf16 : precisions) {
      rows.push_back(measure(T, 12, 12, 64, bf16, reps));  // GPT-2 124M
      rows.push_back(measure(T, 9, 3, 64, bf16, reps));    // SmolLM2-135M
    }
  fmt::print("{}\n", nlohmann::json{{"threads", remat::gemm_thread_count()}, {"rows", rows}}.dump());
  return 0;
}
