// The trainer as a user runs it: policies agree bit for bit, the planned peak is the measured
// peak, and bad input ends with one line on stderr, nothing on stdout and a non-zero exit.
#include <boost/test/unit_test.hpp>
#include <nlohmann/json.hpp>

#include "compare.h"

#include <cstring>
#include <iterator>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct Result {
  int exit_code;
  std::string out, err;
  std::vector<std::string> err_lines() const {
    std::vector<std::string> lines;
    std::istringstream in(err);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    return lines;
  }
};

std::string slurp(const fs::path &p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

fs::path scratch_dir() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("remat-test-trainer-" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

Result run(const std::string &program, const std::string &args) {
  const fs::path out = scratch_dir() / "stdout", err = scratch_dir() / "stderr";
  const std::string cmd = program + " " + args + " >" + out.string() + " 2>" + err.string() + " </dev/null";
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), slurp(out), slurp(err)};
}

Result train(const std::string &args) { return run(TRAIN_MLP, args); }
Result train_gpt(const std::string &args) { return run(TRAIN_GPT, args); }

nlohmann::json summary(const Result &r) {
  const auto last = r.out.find_last_of('\n', r.out.size() - 2);
  return nlohmann::json::parse(r.out.substr(last == std::string::npos ? 0 : last + 1));
}

void expect_one_line_error(const std::string &args, const std::string &mentions) {
  const Result r = train(args);
  BOOST_TEST(r.exit_code == 2, args << ": exit code " << r.exit_code);
  BOOST_TEST(r.out.empty(), args << ": wrote to stdout: " << r.out);
  const auto lines = r.err_lines();
  BOOST_TEST_REQUIRE(lines.size() == 1u, args << ": stderr was\n" << r.err);
  BOOST_TEST(lines[0].starts_with("train-mlp: error: "), lines[0]);
  BOOST_TEST(lines[0].find(mentions) != std::string::npos, lines[0] << " should mention " << mentions);
}

const std::string real_data = "/usr/share/datasets/fashion-mnist";

// A copy of the dataset folder with one file replaced by `make` (a shell command writing it).
std::string broken_dataset(const std::string &name, const std::string &file, const std::string &make) {
  const fs::path dir = scratch_dir() / name;
  fs::create_directories(dir);
  for (const auto &f : fs::directory_iterator(real_data))
    fs::copy_file(f.path(), dir / f.path().filename(), fs::copy_options::overwrite_existing);
  const std::string cmd = make + " > " + (dir / file).string();
  BOOST_TEST_REQUIRE(std::system(cmd.c_str()) == 0);
  return dir.string();
}

}  // namespace

BOOST_AUTO_TEST_CASE(policies_agree_and_peaks_are_exact) {
  std::map<std::string, nlohmann::json> runs;
  for (std::string policy :
       {"none", "selective", "full", "every_n_layers=2", "sqrt_n", "s1:every_n_layers=4+selective"}) {
    const Result r = train("--max-steps 1 --batch-size 256 --json --eval-samples 0 --checkpoint-policy " + policy);
    BOOST_TEST_REQUIRE(r.exit_code == 0, r.err);
    runs[policy] = summary(r);
    const auto &j = runs[policy];
    for (const char *key : {"steps", "loss_first", "loss_last", "eval_accuracy", "samples_per_s", "step_ms_median",
                            "planned_peak_bytes", "measured_peak_bytes", "activation_bytes", "grad_digest"})
      BOOST_TEST(j.contains(key), key);
    BOOST_TEST(j["measured_peak_bytes"] == j["planned_peak_bytes"], policy);
    BOOST_TEST(j["halide_heap_peak_bytes"] == 0, policy);
    BOOST_TEST(j["loss_first"].is_number(), policy);      // NaN would be null
    BOOST_TEST(j["step_heap_allocations"] == 0, policy);  // no heap allocation at all inside the steps
    BOOST_TEST(j["batch_size"] == 256);
  }
  for (const auto &[policy, j] : runs)
    BOOST_TEST(j["grad_digest"] == runs["none"]["grad_digest"], policy << " changes the gradients");
  const double full = runs["full"]["activation_bytes"], none = runs["none"]["activation_bytes"];
  BOOST_TEST(full <= 0.25 * none);
  BOOST_TEST(runs["full"]["planned_peak_bytes"] < runs["none"]["planned_peak_bytes"]);
}

// The gradient of the AdamW first moment after one step: m = (1 - beta1) g, read from a snapshot
// (the line "remat-snapshot 1", a JSON header line, then params, adam_m, adam_v as raw float32).
std::vector<float> first_moment(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  std::string line;
  std::getline(in, line);
  std::getline(in, line);
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  BOOST_TEST_REQUIRE(bytes.size() % 12 == 0u);
  std::vector<float> m(bytes.size() / 12);
  std::memcpy(m.data(), bytes.data() + bytes.size() / 3, bytes.size() / 3);
  return m;
}

// Two accumulated micro-batches of 64 are one batch of 128 (the data stream hands out the same
// 128 samples either way): the first step's gradients, seen through AdamW's first moment, agree.
// Not bit for bit: the 128-row sums are added in another order than two 64-row sums. Tolerance:
// within 3e-6 of the largest magnitude (observed worst 3.0e-7); one micro-batch's gradient alone
// is far outside it (asserted).
BOOST_AUTO_TEST_CASE(gradient_accumulation_equals_one_large_batch) {
  const std::string whole = (scratch_dir() / "batch128").string(), split = (scratch_dir() / "batch2x64").string(),
                    half = (scratch_dir() / "batch64").string();
  const std::string common = "--max-steps 1 --eval-samples 0 --json --save-snapshot ";
  const Result a = train("--batch-size 128 " + common + whole);
  const Result b = train("--batch-size 64 --gradient-accumulation-steps 2 " + common + split);
  const Result c = train("--batch-size 64 " + common + half);
  for (const Result *r : {&a, &b, &c}) BOOST_TEST_REQUIRE(r->exit_code == 0, r->err);
  const auto j = summary(b);
  BOOST_TEST(j["gradient_accumulation_steps"] == 2);
  BOOST_TEST(j["measured_peak_bytes"] == j["planned_peak_bytes"]);
  BOOST_TEST(j["step_heap_allocations"] == 0);
  const double loss128 = summary(a)["loss_first"].get<double>(), loss2x64 = j["loss_first"].get<double>();
  BOOST_TEST(std::abs(loss128 - loss2x64) <= 1e-6 * loss128, loss128 << " vs " << loss2x64);
  const std::vector<float> m128 = first_moment(whole), m2x64 = first_moment(split), m64 = first_moment(half);
  const remat::testing::Tolerance tol{3e-6, 0};
  const auto same = remat::testing::compare(m2x64, m128, tol);
  BOOST_TEST(same.ok(), same.describe());
  BOOST_TEST_MESSAGE("2 x 64 vs 128: " << same.describe());
  BOOST_TEST(remat::testing::compare(m64, m128, tol).mismatches > m128.size() / 4);
}

BOOST_AUTO_TEST_CASE(bad_flags_are_one_line_errors) {
  expect_one_line_error("--checkpoint-policy bogus", "unknown policy");
  expect_one_line_error("--checkpoint-policy every_n_layers=0", "every_n_layers");
  expect_one_line_error("--checkpoint-policy every_n_layers=x", "every_n_layers");
  expect_one_line_error("--max-steps -3", "--max-steps");
  expect_one_line_error("--max-steps abc", "--max-steps");
  expect_one_line_error("--batch-size 0", "--batch-size");
  expect_one_line_error("--batch-size 4", "--batch-size 4");
  expect_one_line_error("--learning-rate -0.1", "--learning-rate");
  expect_one_line_error("--gradient-accumulation-steps two", "--gradient-accumulation-steps");
  expect_one_line_error("--no-such-flag", "no-such-flag");
  expect_one_line_error("--device tpu", "--device");
  expect_one_line_error("--offload --max-steps 1", "nothing to offload");
  expect_one_line_error("--device cuda --offload --checkpoint-policy none", "keeps no checkpoints");
  expect_one_line_error("--checkpoint-policy full+sqrt_n", "at most one recompute schedule");
  expect_one_line_error("--checkpoint-policy s0:full", "s0:full names no repeat stage");
  expect_one_line_error("--checkpoint-policy s1:full,s9:none", "s9:none names no repeat stage");
  expect_one_line_error("--memory-budget 1KiB", "the smallest plan of this model needs");
  expect_one_line_error("--memory-budget lots", "--memory-budget lots");
  expect_one_line_error("--memory-budget 0%", "--memory-budget 0%");
  expect_one_line_error("--memory-budget 101%", "--memory-budget 101%");
  expect_one_line_error("--memory-budget 3XB", "--memory-budget 3XB");
  expect_one_line_error("--memory-budget 50% --checkpoint-policy full", "drop --checkpoint-policy");
  expect_one_line_error("--sweep", "--plan-report");
  expect_one_line_error("--device cuda --offload --memory-budget 90%", "decides which checkpoints to offload");
}

// --memory-budget as a user runs it: every budget from the smallest plan's peak up trains with
// none's gradients (dropout on), the measured peak is the planned one and within the budget; the
// smallest plan (nested recompute) runs many more recompute launches than full.
BOOST_AUTO_TEST_CASE(memory_budgets_train_with_nones_gradients) {
  const std::string args = "--max-steps 1 --json --eval-samples 0 --dropout 0.1";
  const Result base = train_gpt(args + " --checkpoint-policy none");
  BOOST_TEST_REQUIRE(base.exit_code == 0, base.err);
  const auto none_run = summary(base);
  const Result tiny = train_gpt("--memory-budget 1MiB");
  BOOST_TEST_REQUIRE(tiny.exit_code == 2);
  const std::string needs = "needs ";
  const auto at = tiny.err.find(needs);
  BOOST_TEST_REQUIRE(at != std::string::npos, tiny.err);
  const long long least = std::stoll(tiny.err.substr(at + needs.size()));
  const long long most = none_run["planned_peak_bytes"].get<long long>();
  BOOST_TEST(least < most / 2);
  const Result full = train_gpt(args + " --checkpoint-policy full");
  BOOST_TEST_REQUIRE(full.exit_code == 0, full.err);
  for (const std::string &budget : {std::to_string(least), std::to_string((least + most) / 2), std::string("80%")}) {
    const Result r = train_gpt(args + " --memory-budget " + budget);
    BOOST_TEST_REQUIRE(r.exit_code == 0, r.err);
    const auto j = summary(r);
    BOOST_TEST(j["grad_digest"] == none_run["grad_digest"], budget);
    BOOST_TEST(j["measured_peak_bytes"] == j["planned_peak_bytes"], budget);
    const long long limit = budget.ends_with('%') ? most * 80 / 100 : std::stoll(budget);
    BOOST_TEST(j["planned_peak_bytes"].get<long long>() <= limit, budget);
    BOOST_TEST(j["step_heap_allocations"] == 0, budget);
    if (budget == std::to_string(least))
      BOOST_TEST(j["recompute_launches"].get<int>() > summary(full)["recompute_launches"].get<int>(), budget);
  }
  // one budget of the Llama-style model too
  const Result llama_none = run(TRAIN_LLAMA, args + " --batch-size 4 --checkpoint-policy none");
  const Result llama_budget = run(TRAIN_LLAMA, args + " --batch-size 4 --memory-budget 85%");
  BOOST_TEST_REQUIRE(llama_none.exit_code == 0, llama_none.err);
  BOOST_TEST_REQUIRE(llama_budget.exit_code == 0, llama_budget.err);
  BOOST_TEST(summary(llama_budget)["grad_digest"] == summary(llama_none)["grad_digest"]);
  BOOST_TEST(summary(llama_budget)["measured_peak_bytes"] == summary(llama_budget)["planned_peak_bytes"]);
}

// The plan report of a budget plan: each block's kernel calls, the predicted step time; --sweep
// prints the budget table and writes its plot; --calibrate stores a cost table that a later run
// reads.
BOOST_AUTO_TEST_CASE(plan_report_shows_decisions_and_sweep) {
  const std::string table = (scratch_dir() / "costs.json").string();
  const Result r = train("--plan-report --sweep --memory-budget 95% --cost-table " + table);
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.err);
  BOOST_TEST(r.out.find("kernel calls in schedule order") != std::string::npos, r.out);
  BOOST_TEST(r.out.find("s1.b0 ") != std::string::npos, r.out);
  BOOST_TEST(r.out.find("predicted forward + loss + backward") != std::string::npos, r.out);
  BOOST_TEST(r.out.find("estimated from FLOPs and bytes") != std::string::npos, r.out);
  BOOST_TEST(r.out.find("budget sweep") != std::string::npos, r.out);
  BOOST_TEST(fs::exists("train-mlp-sweep.svg"));
  const Result cal = train("--plan-report --memory-budget 95% --calibrate --batch-size 64 --cost-table " + table);
  BOOST_TEST_REQUIRE(cal.exit_code == 0, cal.err);
  BOOST_TEST(cal.out.find("calibrated") != std::string::npos, cal.out);
  BOOST_TEST(fs::exists(table));
  const auto stored = nlohmann::json::parse(slurp(table));
  BOOST_TEST(stored.size() == 1u);
  BOOST_TEST(stored.begin().value().contains("mlp/fp32/batch64/cpu"));
  const Result later = train("--plan-report --memory-budget 95% --batch-size 64 --cost-table " + table);
  BOOST_TEST_REQUIRE(later.exit_code == 0, later.err);
  BOOST_TEST(later.out.find("costs measured on") != std::string::npos, later.out);
}

// On a GPU the budget planner may offload checkpoints to pinned host memory: the plan report
// (which needs no GPU) marks them; on the CPU, whose arena is host memory, the same budget
// offloads nothing. Costs estimated (an empty table), so the plans do not depend on this machine.
BOOST_AUTO_TEST_CASE(budget_plans_offload_on_a_gpu_only) {
  const std::string table = (scratch_dir() / "no-costs.json").string();
  const Result gpu = train_gpt("--device cuda --memory-budget 55% --plan-report --cost-table " + table);
  BOOST_TEST_REQUIRE(gpu.exit_code == 0, gpu.err);
  BOOST_TEST(gpu.out.find("forward_discard (offloads input)") != std::string::npos, gpu.out);
  BOOST_TEST(gpu.out.find("waits in pinned host memory between forward and backward (offload)") != std::string::npos,
             gpu.out);
  BOOST_TEST(gpu.out.find("B (2.0 MiB) of pinned host memory") != std::string::npos, gpu.out);
  const Result cpu = train_gpt("--memory-budget 55% --plan-report --cost-table " + table);
  BOOST_TEST_REQUIRE(cpu.exit_code == 0, cpu.err);
  BOOST_TEST(cpu.out.find("offload") == std::string::npos, cpu.out);
}

// Without a GPU, --device cuda is one line naming why (before anything is allocated); with one,
// a short run succeeds.
// Without the CUDA toolkit at build time the error says the build has no CUDA support.
BOOST_AUTO_TEST_CASE(device_cuda_needs_a_gpu) {
  const Result r = train("--device cuda --max-steps 1 --json");
  if (r.exit_code == 0) {
    BOOST_TEST(REMAT_BUILT_WITH_CUDA);
    BOOST_TEST(summary(r)["device"] == "cuda");
    return;
  }
  expect_one_line_error("--device cuda --max-steps 1 --json", REMAT_BUILT_WITH_CUDA
                                                                  ? "--device cuda: no usable GPU (0 device(s) found"
                                                                  : "this build of remat has no CUDA support");
}

BOOST_AUTO_TEST_CASE(bad_datasets_are_one_line_errors) {
  expect_one_line_error("--max-steps 1 --data-dir /nonexistent", "no such file");
  const std::string images = "train-images-idx3-ubyte.gz";
  const std::string truncated =
      broken_dataset("truncated", images, "zcat " + real_data + "/" + images + " | head -c 100000 | gzip");
  expect_one_line_error("--max-steps 1 --data-dir " + truncated, "truncated or corrupt");
  const std::string garbage = broken_dataset("garbage", images, "echo 'not an idx file at all' | gzip");
  expect_one_line_error("--max-steps 1 --data-dir " + garbage, "not an idx file");
  const std::string bad_gzip = broken_dataset("bad-gzip", images, "head -c 5000 " + real_data + "/" + images);
  expect_one_line_error("--max-steps 1 --data-dir " + bad_gzip, "gzip");
}

// One step of `program` under every policy with `args`: each keeps measured == planned, no heap
// allocation, a finite loss; all give the gradients of `none`. Returns the runs by policy.
std::map<std::string, nlohmann::json> expect_policies_agree(const std::string &program, const std::string &args) {
  std::map<std::string, nlohmann::json> runs;
  for (std::string policy : {"none", "full", "every_n_layers=2", "sqrt_n", "selective"}) {
    const Result r = run(program, args + " --checkpoint-policy " + policy);
    BOOST_TEST_REQUIRE(r.exit_code == 0, r.err);
    runs[policy] = summary(r);
    BOOST_TEST(runs[policy]["measured_peak_bytes"] == runs[policy]["planned_peak_bytes"], policy);
    BOOST_TEST(runs[policy]["halide_heap_peak_bytes"] == 0, policy);
    BOOST_TEST(runs[policy]["step_heap_allocations"] == 0, policy);
    BOOST_TEST(runs[policy]["loss_first"].is_number(), policy);  // NaN would be null
    BOOST_TEST(runs[policy].contains("val_loss"));
    BOOST_TEST(runs[policy].contains("tokens_per_s"));
  }
  for (const auto &[policy, j] : runs)
    BOOST_TEST(j["grad_digest"] == runs["none"]["grad_digest"], policy << " changes the gradients");
  return runs;
}

// The Llama-style example (RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases) with
// attention dropout: every policy gives the same gradients.
BOOST_AUTO_TEST_CASE(llama_policies_agree_with_dropout) {
  expect_policies_agree(TRAIN_LLAMA, "--max-steps 1 --json --eval-samples 0 --batch-size 4 --dropout 0.1");
}

// The GPT with dropout: every policy, selective included, gives the same gradients.
BOOST_AUTO_TEST_CASE(gpt_policies_agree_with_dropout) {
  const auto runs = expect_policies_agree(TRAIN_GPT, "--max-steps 1 --json --eval-samples 0 --dropout 0.1");
  // dropout changes the gradients (the mask is applied), and only through the mask
  const Result no_dropout = train_gpt("--max-steps 1 --json --eval-samples 0 --checkpoint-policy selective");
  BOOST_TEST_REQUIRE(no_dropout.exit_code == 0, no_dropout.err);
  BOOST_TEST(summary(no_dropout)["grad_digest"] != runs.at("none")["grad_digest"]);
}

// --bf16 as a user runs it: both examples train (the MLP's images go to the arena as bf16), every
// GPT policy gives the same gradients, the planned peak is the measured one and is below fp32's,
// and a bf16 snapshot does not resume an fp32 run.
BOOST_AUTO_TEST_CASE(bf16_runs_agree_across_policies) {
  std::map<std::string, nlohmann::json> runs;
  for (std::string policy : {"none", "full", "every_n_layers=2", "selective"}) {
    const Result r =
        train_gpt("--bf16 --max-steps 2 --json --eval-samples 16 --dropout 0.1 --checkpoint-policy " + policy);
    BOOST_TEST_REQUIRE(r.exit_code == 0, r.err);
    runs[policy] = summary(r);
    BOOST_TEST(runs[policy]["precision"] == "bf16");
    BOOST_TEST(runs[policy]["measured_peak_bytes"] == runs[policy]["planned_peak_bytes"], policy);
    BOOST_TEST(runs[policy]["halide_heap_peak_bytes"] == 0, policy);
    BOOST_TEST(runs[policy]["step_heap_allocations"] == 0, policy);
    BOOST_TEST(runs[policy]["loss_first"].is_number(), policy);  // NaN would be null
    BOOST_TEST(runs[policy]["eval_loss"].is_number());
  }
  for (const auto &[policy, j] : runs)
    BOOST_TEST(j["grad_digest"] == runs["none"]["grad_digest"], policy << " changes the bf16 gradients");
  const Result fp32 = train_gpt("--max-steps 2 --json --eval-samples 0 --dropout 0.1 --checkpoint-policy none");
  BOOST_TEST_REQUIRE(fp32.exit_code == 0, fp32.err);
  const auto f = summary(fp32);
  BOOST_TEST(f["precision"] == "fp32");
  BOOST_TEST(f["grad_digest"] != runs["none"]["grad_digest"]);
  BOOST_TEST(runs["none"]["activation_bytes"].get<double>() < 0.6 * f["activation_bytes"].get<double>());
  BOOST_TEST(std::abs(runs["none"]["loss_first"].get<double>() - f["loss_first"].get<double>()) <
             0.02 * f["loss_first"].get<double>());

  const Result mlp = train("--bf16 --max-steps 20 --batch-size 64 --json --eval-samples 512");
  BOOST_TEST_REQUIRE(mlp.exit_code == 0, mlp.err);
  const auto m = summary(mlp);
  BOOST_TEST(m["measured_peak_bytes"] == m["planned_peak_bytes"]);
  BOOST_TEST(m["loss_last"].get<double>() < m["loss_first"].get<double>());
  BOOST_TEST(m["eval_accuracy"].get<double>() > 0.5);  // 10 classes: chance is 0.1

  const std::string snap = (scratch_dir() / "bf16-snapshot").string();
  const std::string flags = "--max-steps 3 --batch-size 64 --eval-samples 0";
  const Result saved = train("--bf16 " + flags + " --save-steps 2 --save-snapshot " + snap);
  BOOST_TEST_REQUIRE(saved.exit_code == 0, saved.err);
  expect_one_line_error(flags + " --resume-from-snapshot " + snap + ".step2", "--bf16");
  const Result resumed = train("--bf16 " + flags + " --json --resume-from-snapshot " + snap + ".step2");
  BOOST_TEST_REQUIRE(resumed.exit_code == 0, resumed.err);
}

BOOST_AUTO_TEST_CASE(gpt_plan_report_lists_saved_tensors) {
  const Result sel = train_gpt("--plan-report --checkpoint-policy selective");
  BOOST_TEST_REQUIRE(sel.exit_code == 0, sel.err);
  BOOST_TEST(sel.out.find("causal_self_attention row statistics") != std::string::npos, sel.out);
  BOOST_TEST(sel.out.find("att3_lse") != std::string::npos);
  BOOST_TEST(sel.out.find("total saved") != std::string::npos);
  // selective saves the fused q/k/v GEMM output but not the attention output h3 or the GELU h10
  BOOST_TEST(sel.out.find(" h2 ") != std::string::npos);
  BOOST_TEST(sel.out.find(" h3 ") == std::string::npos);
  BOOST_TEST(sel.out.find(" h10 ") == std::string::npos);
  const Result full = train_gpt("--plan-report --checkpoint-policy full");
  BOOST_TEST_REQUIRE(full.exit_code == 0, full.err);
  BOOST_TEST(full.out.find(" h2 ") == std::string::npos);  // full keeps only block inputs
  expect_one_line_error("--dropout 0.1 --max-steps 1", "no dropout layers");
}

// A run resumed from a snapshot repeats the uninterrupted run exactly: the same last loss and
// the same final parameters, bit for bit (dropout included: its masks follow the step).
BOOST_AUTO_TEST_CASE(resumed_runs_repeat_the_uninterrupted_run) {
  const std::string snap = (scratch_dir() / "snapshot").string();
  for (auto [program, extra] : {std::pair{std::string(TRAIN_MLP), std::string("--batch-size 64")},
                                {std::string(TRAIN_GPT), std::string("--batch-size 4 --dropout 0.1")}}) {
    // past warm-up, in the cosine phase, with gradient accumulation
    const std::string common =
        "--max-steps 5 --warmup-steps 1 --gradient-accumulation-steps 2 --json --eval-samples 0 " + extra;
    const Result whole = run(program, common + " --save-steps 2 --save-snapshot " + snap);
    BOOST_TEST_REQUIRE(whole.exit_code == 0, whole.err);
    BOOST_TEST_REQUIRE(fs::exists(snap + ".step2"));
    // the policy may change on resume: the gradients are the same under every policy
    const Result resumed = run(program, common + " --checkpoint-policy full --resume-from-snapshot " + snap + ".step2");
    BOOST_TEST_REQUIRE(resumed.exit_code == 0, resumed.err);
    const auto a = summary(whole), b = summary(resumed);
    BOOST_TEST(b["loss_last"] == a["loss_last"], program);
    BOOST_TEST(b["param_digest"] == a["param_digest"], program);
    BOOST_TEST(b["measured_peak_bytes"] == b["planned_peak_bytes"]);
    // other flags would not repeat the run: refused
    const Result other =
        run(program, "--max-steps 6 --warmup-steps 1 --gradient-accumulation-steps 2 --eval-samples 0 " + extra +
                         " --resume-from-snapshot " + snap + ".step2");
    BOOST_TEST(other.exit_code == 2);
    BOOST_TEST(other.err.find("the snapshot's run used") != std::string::npos, other.err);
  }
  // a snapshot of the GPT does not resume the MLP; a cut file is refused
  expect_one_line_error("--max-steps 4 --resume-from-snapshot " + snap, "a snapshot of model gpt");
  const std::string cut = (scratch_dir() / "cut").string();
  BOOST_TEST_REQUIRE(std::system(("head -c 5000000 " + snap + " > " + cut).c_str()) == 0);
  const Result r = run(TRAIN_GPT,
                       "--max-steps 5 --warmup-steps 1 --gradient-accumulation-steps 2 --batch-size 4 "
                       "--dropout 0.1 --resume-from-snapshot " +
                           cut);
  BOOST_TEST(r.exit_code == 2);
  BOOST_TEST(r.err.find("truncated") != std::string::npos, r.err);
  expect_one_line_error("--max-steps 1 --save-snapshot /nonexistent/dir/snap", "cannot write");
  expect_one_line_error("--seed -1", "--seed");
}
