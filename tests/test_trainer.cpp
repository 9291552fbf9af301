// The trainer as a user runs it: policies agree bit for bit, the planned peak is the measured
// peak, and bad input ends with one line on stderr, nothing on stdout and a non-zero exit.
#include <boost/test/unit_test.hpp>
#include <nlohmann/json.hpp>

#include "compare.h"
#include "snapshot.h"
#include "trainer_run.h"

#include <array>
#include <cstdint>
#include <cmath>
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

using remat::testing::expect_one_line_error;
using remat::testing::Result;
using remat::testing::run;
using remat::testing::scratch_dir;
using remat::testing::slurp;
using remat::testing::summary;

Result train(const std::string &args) { return run(TRAIN_MLP, args); }
Result train_gpt(const std::string &args) { return run(TRAIN_GPT, args); }

void expect_one_line_error(const std::string &args, const std::string &mentions) {
  expect_one_line_error(TRAIN_MLP, args, {mentions});
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

// The gradient of the AdamW first moment after one step: m = (1 - beta1) g, every parameter's
// exp_avg of a snapshot's optimizer.safetensors, in the file's order.
std::vector<float> first_moment(const std::string &snapshot) {
  const auto file = remat::testing::read_safetensors_file(fs::path(snapshot) / "optimizer.safetensors");
  std::vector<float> m;
  for (const auto &[name, entry] : file.header.items()) {
    if (!name.ends_with(".exp_avg")) continue;
    const std::string &bytes = file.data.at(name);
    const std::size_t at = m.size();
    m.resize(at + bytes.size() / 4);
    std::memcpy(m.data() + at, bytes.data(), bytes.size());
  }
  BOOST_TEST_REQUIRE(!m.empty());
  return m;
}

namespace {
// Two accumulated micro-batches of `half` samples are one batch of 2 `half` (the data stream hands
// out the same samples either way; dropout's counters number the rows of a step, not of a
// micro-batch): the first step's gradients, seen through AdamW's first moment, agree within
// `tolerance` of the largest magnitude; one micro-batch's gradient alone is far outside it.
void expect_accumulation_is_one_large_batch(const std::string &trainer, const std::string &name, int half,
                                            const std::string &flags, double tolerance) {
  const fs::path dir = scratch_dir() / name;
  const std::string whole = (dir / "whole").string(), split = (dir / "split").string(), alone = (dir / "half").string(),
                    size = std::to_string(half);
  const std::string common = flags + " --max-steps 1 --eval-samples 0 --json --output-dir ";
  const Result a = run(trainer, "--batch-size " + std::to_string(2 * half) + " " + common + whole);
  const Result b = run(trainer, "--batch-size " + size + " --gradient-accumulation-steps 2 " + common + split);
  const Result c = run(trainer, "--batch-size " + size + " " + common + alone);
  for (const Result *r : {&a, &b, &c}) BOOST_TEST_REQUIRE(r->exit_code == 0, r->err);
  const auto j = summary(b);
  BOOST_TEST(j["gradient_accumulation_steps"] == 2);
  BOOST_TEST(j["measured_peak_bytes"] == j["planned_peak_bytes"]);
  BOOST_TEST(j["step_heap_allocations"] == 0);
  const double loss_whole = summary(a)["loss_first"].get<double>(), loss_split = j["loss_first"].get<double>();
  BOOST_TEST(std::abs(loss_whole - loss_split) <= 1e-6 * loss_whole, loss_whole << " vs " << loss_split);
  const std::vector<float> m_whole = first_moment(whole + "/snapshot-1"), m_split = first_moment(split + "/snapshot-1"),
                           m_half = first_moment(alone + "/snapshot-1");
  const remat::testing::Tolerance tol{tolerance, 0};
  const auto same = remat::testing::compare(m_split, m_whole, tol);
  BOOST_TEST(same.ok(), name << ": " << same.describe());
  BOOST_TEST_MESSAGE(name << " 2 x " << half << " vs " << 2 * half << ": " << same.describe());
  BOOST_TEST(remat::testing::compare(m_half, m_whole, tol).mismatches > m_whole.size() / 4);
}
}  // namespace

// The MLP: not bit for bit, the 128-row sums are added in another order than two 64-row sums.
// Tolerance: within 3e-6 of the largest magnitude (observed worst 3.0e-7).
BOOST_AUTO_TEST_CASE(gradient_accumulation_equals_one_large_batch) {
  expect_accumulation_is_one_large_batch(TRAIN_MLP, "mlp", 64, "", 3e-6);
}

// The GPT with dropout 0.1: the second micro-batch's masks are those of the large batch's second
// half (a dropout that restarted its rows at each micro-batch would repeat the first half's).
// Tolerance: 5e-6 of the largest magnitude (observed worst 8.7e-7).
BOOST_AUTO_TEST_CASE(gradient_accumulation_with_dropout_equals_one_large_batch) {
  expect_accumulation_is_one_large_batch(TRAIN_GPT, "gpt_dropout", 8, "--dropout 0.1", 5e-6);
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
  expect_one_line_error("--checkpoint-policy unfused_head+bogus", "unknown policy bogus");
  expect_one_line_error("--checkpoint-policy full+unfused_heads", "unknown policy unfused_heads");
  expect_one_line_error("--checkpoint-policy s0:full", "s0:full names no repeat stage");
  expect_one_line_error("--checkpoint-policy s1:full,s9:none", "s9:none names no repeat stage");
  expect_one_line_error("--memory-budget 1KiB", "the smallest plan of this model needs");
  expect_one_line_error("--memory-budget lots", "--memory-budget lots");
  expect_one_line_error("--memory-budget 0%", "--memory-budget 0%");
  expect_one_line_error("--memory-budget 101%", "--memory-budget 101%");
  expect_one_line_error("--memory-budget 3XB", "--memory-budget 3XB");
  expect_one_line_error("--memory-budget 50% --checkpoint-policy full", "the budget planner chooses the policy");
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
// prints the budget table and writes it as JSON; --calibrate stores a cost table that a later run
// reads.
// +unfused_head composes with any policy, per stage too (the MLP has no LM head: the plan is the same).
BOOST_AUTO_TEST_CASE(unfused_head_is_a_policy_part) {
  for (const std::string policy :
       {"full+unfused_head", "unfused_head+full", "s1:full+unfused_head", "unfused_head+full+unfused_head"}) {
    const Result r = train("--plan-report --checkpoint-policy " + policy);
    BOOST_TEST_REQUIRE(r.exit_code == 0, r.err);
    BOOST_TEST(r.out.find("plan under policy full+unfused_head ") != std::string::npos, r.out);
  }
  // alone, it keeps the model's policy (the MLP's is full)
  const Result alone = train("--plan-report --checkpoint-policy unfused_head");
  BOOST_TEST_REQUIRE(alone.exit_code == 0, alone.err);
  BOOST_TEST(alone.out.find("plan under policy full+unfused_head (") != std::string::npos, alone.out);
}

BOOST_AUTO_TEST_CASE(plan_report_shows_decisions_and_sweep) {
  const std::string table = (scratch_dir() / "costs.json").string();
  const Result r = train("--plan-report --sweep --memory-budget 95% --cost-table " + table);
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.err);
  BOOST_TEST(r.out.find("kernel calls in schedule order") != std::string::npos, r.out);
  BOOST_TEST(r.out.find("s1.b0 ") != std::string::npos, r.out);
  BOOST_TEST(r.out.find("predicted forward + loss + backward") != std::string::npos, r.out);
  BOOST_TEST(r.out.find("estimated from FLOPs and bytes") != std::string::npos, r.out);
  BOOST_TEST(r.out.find("budget sweep") != std::string::npos, r.out);
  const auto sweep = nlohmann::json::parse(slurp("train-mlp-sweep.json"));  // scripts/plot.py sweep draws it
  BOOST_TEST(sweep["model"] == "mlp");
  BOOST_TEST_REQUIRE(sweep["rows"].size() >= 2u);
  for (const auto &row : sweep["rows"]) {
    BOOST_TEST(row["planned_peak_bytes"].get<long long>() <= row["budget_bytes"].get<long long>());
    BOOST_TEST(row["predicted_ms"].get<double>() > 0);
    BOOST_TEST(row["measured_ms"].is_null());  // without --calibrate
    BOOST_TEST(row["launches"].get<int>() > 0);
  }
  BOOST_TEST(sweep["rows"].back()["budget_bytes"] == sweep["none_peak_bytes"]);
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
  const Result gpu = train_gpt("--device cuda --memory-budget 52% --plan-report --cost-table " + table);
  BOOST_TEST_REQUIRE(gpu.exit_code == 0, gpu.err);
  BOOST_TEST(gpu.out.find("forward_discard (offloads input)") != std::string::npos, gpu.out);
  BOOST_TEST(gpu.out.find("waits in pinned host memory between forward and backward (offload)") != std::string::npos,
             gpu.out);
  BOOST_TEST(gpu.out.find("B (4.0 MiB) of pinned host memory") != std::string::npos, gpu.out);
  const Result cpu = train_gpt("--memory-budget 52% --plan-report --cost-table " + table);
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
  const Result saved = train("--bf16 " + flags + " --save-steps 2 --output-dir " + snap);
  BOOST_TEST_REQUIRE(saved.exit_code == 0, saved.err);
  expect_one_line_error(flags + " --resume-from-snapshot " + snap + "/snapshot-2", "--bf16");
  const Result resumed = train("--bf16 " + flags + " --json --resume-from-snapshot " + snap + "/snapshot-2");
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

BOOST_AUTO_TEST_CASE(bad_seed_is_one_line_error) { expect_one_line_error("--seed -1", "--seed"); }

// ---- token files (train-gpt-bpe: vocabulary 4096, T = 64) ----------------------------------------
namespace {

constexpr int bpe_vocab = 4096, bpe_T = 64;

// Tokens as nanoGPT writes them (uint16, little-endian), after llm.c's header when `header` (256
// int32: magic, version, count, zeros) is not empty.
std::string token_bytes(const std::vector<std::uint16_t> &tokens) {
  std::string out;
  for (std::uint16_t t : tokens) out += {char(t & 0xff), char(t >> 8)};
  return out;
}
std::string llmc_header(std::int32_t magic, std::int32_t version, std::int32_t count) {
  std::string out(1024, '\0');
  for (int i = 0; i < 3; ++i) {
    const auto v = std::uint32_t(std::array{magic, version, count}[i]);
    for (int b = 0; b < 4; ++b) out[4 * i + b] = char(v >> 8 * b);
  }
  return out;
}
fs::path write_file(const std::string &name, const std::string &bytes) {
  const fs::path p = scratch_dir() / "tokens" / name;
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}
// n tokens of a fixed sequence below the vocabulary, different for each `salt`.
std::vector<std::uint16_t> some_tokens(std::size_t n, std::uint32_t salt) {
  std::vector<std::uint16_t> out(n);
  std::uint32_t x = 12345 + salt;
  for (auto &t : out) t = std::uint16_t((x = x * 1664525u + 1013904223u) >> 16) % bpe_vocab;
  return out;
}
std::string with_header(const std::vector<std::uint16_t> &tokens) {
  return llmc_header(20240520, 1, std::int32_t(tokens.size())) + token_bytes(tokens);
}

}  // namespace

// The same tokens train the same with and without llm.c's header, from <--data-dir>/train.bin and
// val.bin or from --train-file / --validation-file; the sample is token ids below the vocabulary.
BOOST_AUTO_TEST_CASE(token_files_train_with_and_without_the_header) {
  const auto train_tokens = some_tokens(3000, 1), val_tokens = some_tokens(1000, 2);
  write_file("llmc/train.bin", with_header(train_tokens));
  write_file("llmc/val.bin", with_header(val_tokens));
  const std::string raw_train = write_file("raw-train.bin", token_bytes(train_tokens)).string();
  const std::string raw_val = write_file("raw-val.bin", token_bytes(val_tokens)).string();
  const std::string common = "--max-steps 3 --batch-size 4 --eval-samples 8 --json --sample-length 100";
  const Result llmc = run(TRAIN_GPT_BPE, common + " --data-dir " + (scratch_dir() / "tokens/llmc").string());
  const Result raw = run(TRAIN_GPT_BPE, common + " --train-file " + raw_train + " --validation-file " + raw_val);
  BOOST_TEST_REQUIRE(llmc.exit_code == 0, llmc.err);
  BOOST_TEST_REQUIRE(raw.exit_code == 0, raw.err);
  const auto a = summary(llmc), b = summary(raw);
  for (const char *key : {"loss_first", "loss_last", "eval_loss", "grad_digest", "param_digest"})
    BOOST_TEST(a[key] == b[key], key << ": " << a[key] << " with the header, " << b[key] << " without");
  BOOST_TEST(a["measured_peak_bytes"] == a["planned_peak_bytes"]);
  BOOST_TEST(llmc.err.find("tokens: 3000 training tokens") != std::string::npos, llmc.err);
  // the sample (progress goes to stderr with --json): the prompt, val's first token, then 100 ids
  const auto at = llmc.err.find("sample ids: ");
  BOOST_TEST_REQUIRE(at != std::string::npos, llmc.err);
  std::istringstream ids(llmc.err.substr(at + 12, llmc.err.find('\n', at) - at - 12));
  std::vector<int> sample;
  for (int id; ids >> id;) sample.push_back(id);
  BOOST_TEST_REQUIRE(sample.size() == 101u);
  BOOST_TEST(sample[0] == val_tokens[0]);
  for (int id : sample) BOOST_TEST((id >= 0 && id < bpe_vocab), id);
  // other trainers read no token files
  expect_one_line_error(TRAIN_GPT, "--max-steps 1 --train-file " + raw_train, {"--train-file is for token files"});
  expect_one_line_error(TRAIN_MLP, "--max-steps 1 --validation-file " + raw_val,
                        {"--validation-file is for token files"});
}

// Every bad token file is one line naming the file and the problem, exit code 2.
BOOST_AUTO_TEST_CASE(bad_token_files_are_one_line_errors) {
  const std::string val = write_file("good-val.bin", with_header(some_tokens(200, 3))).string();
  auto expect = [&](const std::string &name, const std::string &bytes, const std::string &problem) {
    const std::string path = write_file(name, bytes).string();
    expect_one_line_error(TRAIN_GPT_BPE,
                          "--max-steps 1 --batch-size 1 --train-file " + path + " --validation-file " + val,
                          {path + ": ", problem});
  };
  auto tokens = some_tokens(500, 4);
  expect("odd.bin", token_bytes(tokens) + "x", "1001 bytes, an odd size: not uint16 tokens");
  expect("empty.bin", "", "empty file");
  expect("short.bin", token_bytes(some_tokens(bpe_T, 5)), "64 tokens are too few for sequences of 64 (at least 65)");
  expect("short-llmc.bin", with_header(some_tokens(10, 5)), "10 tokens are too few for sequences of 64");
  expect("truncated-header.bin", llmc_header(20240520, 1, 500).substr(0, 600),
         "truncated llm.c header: 600 bytes, the header alone is 1024");
  expect("version.bin", llmc_header(20240520, 2, 500) + token_bytes(tokens),
         "llm.c header version 2; only version 1 (uint16 tokens) is read");
  expect("count.bin", llmc_header(20240520, 1, 600) + token_bytes(tokens),
         "the llm.c header says 600 tokens but 1000 bytes follow it (2 bytes a token)");
  expect("negative-count.bin", llmc_header(20240520, 1, -1) + token_bytes(tokens), "the llm.c header says -1 tokens");
  tokens[123] = 5000;
  expect("vocab.bin", token_bytes(tokens), "token 5000 at index 123 is not below the model's vocabulary of 4096");
  expect("vocab-llmc.bin", with_header(tokens), "token 5000 at index 123 is not below the model's vocabulary of 4096");
  const std::string missing = (scratch_dir() / "tokens/nonexistent.bin").string();
  expect_one_line_error(TRAIN_GPT_BPE, "--max-steps 1 --train-file " + missing + " --validation-file " + val,
                        {missing + ": no such file"});
  // the validation file is checked too; without flags the files are <--data-dir>/train.bin, val.bin
  const fs::path dir = scratch_dir() / "tokens/no-val";
  fs::create_directories(dir);
  fs::copy_file(val, dir / "train.bin", fs::copy_options::overwrite_existing);
  expect_one_line_error(TRAIN_GPT_BPE, "--max-steps 1 --batch-size 1 --data-dir " + dir.string(),
                        {(dir / "val.bin").string() + ": no such file"});
}

// ---- HF-style configuration, progress and metrics ----------------------------------------------
namespace {

// The runs of `hf` and `remat` flags (after `common`) are one run: the same policy, plan and
// gradients.
void expect_same_run(const std::string &program, const std::string &common, const std::string &hf,
                     const std::string &remat) {
  const Result a = run(program, common + " " + hf), b = run(program, common + " " + remat);
  BOOST_TEST_REQUIRE(a.exit_code == 0, hf << ": " << a.err);
  BOOST_TEST_REQUIRE(b.exit_code == 0, remat << ": " << b.err);
  const auto x = summary(a), y = summary(b);
  for (const char *key : {"policy", "batch_size", "gradient_accumulation_steps", "steps", "grad_digest",
                          "activation_bytes", "planned_peak_bytes", "loss_last", "param_digest"})
    BOOST_TEST(x[key] == y[key], key << ": " << x[key] << " under " << hf << ", " << y[key] << " under " << remat);
}

fs::path write_text(const std::string &name, const std::string &text) {
  const fs::path p = scratch_dir() / "config" / name;
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
  return p;
}

std::vector<nlohmann::json> json_lines(const fs::path &p) {
  std::vector<nlohmann::json> out;
  std::istringstream in(slurp(p));
  for (std::string l; std::getline(in, l);) out.push_back(nlohmann::json::parse(l));
  return out;
}

}  // namespace

// HF's settings give exactly the run of the remat flags they stand for: --gradient-checkpointing is
// full, its kwargs every_n_layers=N (+offload), the underscore spellings are the same options, and a
// --config file of HF's keys is the command line (which replaces a key of the file).
BOOST_AUTO_TEST_CASE(hf_settings_are_the_equivalent_remat_flags) {
  const std::string gpt = "--max-steps 1 --json --eval-samples 0 --dropout 0.1";
  expect_same_run(TRAIN_GPT, gpt, "--gradient-checkpointing", "--checkpoint-policy full");
  const std::string mlp = "--max-steps 2 --json --eval-samples 0 --batch-size 64";
  expect_same_run(TRAIN_MLP, mlp,
                  "--gradient_checkpointing True --gradient_checkpointing_kwargs "
                  "'{\"every_n_layers\": 2, \"use_reentrant\": false}'",
                  "--checkpoint-policy every_n_layers=2");
  expect_same_run(TRAIN_MLP, "--max-steps 2 --json --eval-samples 0",
                  "--per_device_train_batch_size 32 --gradient_accumulation_steps 2 --learning_rate 0.003 "
                  "--warmup_steps 1 --lr_scheduler_type constant --weight_decay 0.1 --seed 7 --logging_steps 1",
                  "--batch-size 32 --gradient-accumulation-steps 2 --learning-rate 0.003 --warmup-steps 1 "
                  "--lr-scheduler-type constant --weight-decay 0.1 --seed 7 --logging-steps 1");
  const fs::path config = write_text("hf.json", R"({
    "per_device_train_batch_size": 64, "max_steps": 5, "learning_rate": 0.003, "seed": 7,
    "gradient_checkpointing": true, "gradient_checkpointing_kwargs": {"every_n_layers": 2},
    "eval-samples": 0, "lr_scheduler_type": "constant"})");
  expect_same_run(TRAIN_MLP, "--json", "--config " + config.string() + " --max-steps 2",
                  "--batch-size 64 --max-steps 2 --learning-rate 0.003 --seed 7 --checkpoint-policy every_n_layers=2 "
                  "--eval-samples 0 --lr-scheduler-type constant");
  // offload composes with +: the plans (on a GPU, where offload means something) are the same
  const std::string report = "--device cuda --plan-report --cost-table " + (scratch_dir() / "no-costs.json").string();
  const Result hf = run(TRAIN_GPT, report +
                                       " --gradient-checkpointing --gradient-checkpointing-kwargs "
                                       "'{\"every_n_layers\": 2, \"offload\": true}'");
  const Result remat = run(TRAIN_GPT, report + " --checkpoint-policy every_n_layers=2+offload");
  BOOST_TEST_REQUIRE(hf.exit_code == 0, hf.err);
  BOOST_TEST_REQUIRE(remat.exit_code == 0, remat.err);
  BOOST_TEST(hf.out == remat.out);
  BOOST_TEST(hf.out.find("pinned host memory") != std::string::npos, hf.out);
}

// Two settings that contradict, wherever each is given, are one line naming both, exit code 2; so
// is a bad --config file (naming the file and the key) or bad kwargs (naming the key).
BOOST_AUTO_TEST_CASE(contradicting_settings_are_one_line_naming_both) {
  const auto mlp = [](const std::string &args, const std::vector<std::string> &mentions) {
    expect_one_line_error(TRAIN_MLP, args, mentions);
  };
  mlp("--gradient-checkpointing --checkpoint-policy none", {"--gradient-checkpointing", "--checkpoint-policy none"});
  mlp("--checkpoint-policy full --gradient-checkpointing --gradient-checkpointing-kwargs '{\"every_n_layers\": 2}'",
      {"--checkpoint-policy full", "--gradient-checkpointing-kwargs"});
  mlp("--memory-budget 60% --gradient_checkpointing", {"--memory-budget 60%", "--gradient_checkpointing"});
  mlp("--memory-budget 50% --checkpoint-policy full", {"--memory-budget 50%", "--checkpoint-policy full"});
  mlp("--gradient-checkpointing-kwargs '{\"every_n_layers\": 2}'",
      {"--gradient-checkpointing-kwargs needs --gradient-checkpointing"});
  mlp("--batch-size 8 --per_device_train_batch_size 16", {"--batch-size", "--per_device_train_batch_size"});
  mlp("--max-steps 1 --max-steps=2", {"--max-steps is given twice"});
  mlp("--gradient-checkpointing --gradient-checkpointing-kwargs '{\"every_n_layers\": 2, \"context_fn\": 1}'",
      {"unknown key \"context_fn\"", "every_n_layers, offload, use_reentrant, preserve_rng_state"});
  mlp("--gradient-checkpointing --gradient-checkpointing-kwargs '{\"every_n_layers\": 0}'", {"every_n_layers", "0"});
  const std::string gc = write_text("gc.json", R"({"gradient_checkpointing": true})").string();
  mlp("--config " + gc + " --checkpoint-policy none",
      {"\"gradient_checkpointing\" in " + gc, "--checkpoint-policy none"});
  const std::string both = write_text("both.json", R"({"batch-size": 8, "per_device_train_batch_size": 16})").string();
  mlp("--config " + both, {both, "\"batch-size\"", "\"per_device_train_batch_size\""});
  const std::string missing = (scratch_dir() / "config" / "missing.json").string();
  mlp("--config " + missing, {missing, "cannot read"});
  const std::string not_json = write_text("not.json", "{\"max_steps\": 2,").string();
  mlp("--config " + not_json, {not_json, "not JSON"});
  const std::string unknown = write_text("unknown.json", R"({"max_steps": 2, "num_beams": 4})").string();
  mlp("--config " + unknown, {unknown, "unknown key \"num_beams\""});
  const std::string type = write_text("type.json", R"({"learning_rate": "3e-4"})").string();
  mlp("--config " + type, {type, "\"learning_rate\"", "expected a number"});
  const std::string flag = write_text("flag.json", R"({"bf16": "yes"})").string();
  mlp("--config " + flag, {flag, "\"bf16\"", "expected true or false"});
  const std::string range = write_text("range.json", R"({"per_device_train_batch_size": 0})").string();
  mlp("--config " + range, {range, "\"per_device_train_batch_size\"", "not a positive number"});
}

// --logging-dir: metrics.jsonl has one line per step as it happens (eval_loss on evaluation steps),
// trainer_state.json has HF's shape (log_history: the logging steps and the evaluations, the last
// one the final evaluation); the progress lines, not on a terminal, give the elapsed time and the
// time left. A folder that cannot be made is one line before training.
BOOST_AUTO_TEST_CASE(logging_dir_writes_metrics_and_trainer_state) {
  const fs::path dir = scratch_dir() / "logs" / "run";
  fs::remove_all(dir);
  const Result r = train(
      "--max-steps 4 --batch-size 64 --logging_steps 2 --eval_steps 2 --eval-samples 256 --json "
      "--logging_dir " +
      dir.string());
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.err);
  const auto s = summary(r);
  const auto lines = json_lines(dir / "metrics.jsonl");
  BOOST_TEST_REQUIRE(lines.size() == 4u);
  for (int i = 0; i < 4; ++i) {
    const auto &l = lines[i];
    BOOST_TEST(l["step"] == i + 1);
    for (const char *key : {"epoch", "loss", "learning_rate", "step_ms", "tokens_per_s", "train_accuracy"})
      BOOST_TEST(l[key].is_number(), key);
    BOOST_TEST(l.contains("eval_loss") == (i % 2 == 1), i);
  }
  BOOST_TEST(lines[0]["loss"] == s["loss_first"]);
  BOOST_TEST(lines[3]["loss"] == s["loss_last"]);
  BOOST_TEST(lines[3]["eval_loss"] == s["eval_loss"]);
  BOOST_TEST(lines[3]["eval_accuracy"] == s["eval_accuracy"]);
  const auto state = nlohmann::json::parse(slurp(dir / "trainer_state.json"));
  BOOST_TEST(state["global_step"] == 4);
  BOOST_TEST(state["max_steps"] == 4);
  BOOST_TEST(state["logging_steps"] == 2);
  BOOST_TEST(state["eval_steps"] == 2);
  BOOST_TEST(state["train_batch_size"] == 64);
  BOOST_TEST(state["num_train_epochs"] == 1);
  std::vector<long> logged, evaluated;
  nlohmann::json last_eval;
  for (const auto &e : state["log_history"]) {
    if (e.contains("loss")) logged.push_back(e["step"].get<long>());
    if (e.contains("eval_loss")) {
      evaluated.push_back(e["step"].get<long>());
      last_eval = e;
    }
  }
  BOOST_TEST(logged == (std::vector<long>{2, 4}), "logged at " << state["log_history"]);
  BOOST_TEST(evaluated == (std::vector<long>{2, 4}), "evaluated at " << state["log_history"]);
  BOOST_TEST(last_eval["eval_loss"] == s["eval_loss"]);
  // a logging step's loss is the mean over the steps since the last
  const double mean = (lines[2]["loss"].get<double>() + lines[3]["loss"].get<double>()) / 2;
  BOOST_TEST(std::abs(state["log_history"][2]["loss"].get<double>() - mean) < 1e-12 * mean);
  // progress (stderr with --json): elapsed and left on each step line, and no live line
  for (const char *step : {"step     2/4 | ", "step     4/4 | "}) {
    const auto at = r.err.find(step);
    BOOST_TEST_REQUIRE(at != std::string::npos, r.err);
    const std::string line = r.err.substr(at, r.err.find('\n', at) - at);
    BOOST_TEST(line.find("| elapsed ") != std::string::npos, line);
    BOOST_TEST(line.find("| left ") != std::string::npos, line);
  }
  BOOST_TEST(r.err.find('\r') == std::string::npos);
  // a folder under a file cannot be made
  const fs::path file = write_text("a-file", "x");
  expect_one_line_error(TRAIN_MLP, "--max-steps 1 --logging-dir " + (file / "logs").string(),
                        {"--logging-dir " + (file / "logs").string(), "cannot create"});
}

// On a terminal (script(1) gives the run one) the progress stream also gets a live line, rewritten
// in place: step, loss, samples/s, the planned and measured peak, elapsed and time left.
BOOST_AUTO_TEST_CASE(a_terminal_gets_a_live_progress_line) {
  const std::string cmd = std::string("script -qec '") + TRAIN_MLP +
                          " --max-steps 3 --batch-size 64 --eval-samples 0 --logging-steps 100' /dev/null";
  const Result r = run("", cmd);
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.err);
  const auto at = r.out.find("\r\033[Kstep 1/3 | loss ");
  BOOST_TEST_REQUIRE(at != std::string::npos, r.out);
  const std::string line = r.out.substr(at + 4, r.out.find('\r', at + 1) - at - 4);
  for (const char *part : {" samples/s | memory ", " MiB planned, ", " MiB measured | elapsed ", " | left "})
    BOOST_TEST(line.find(part) != std::string::npos, line << " should have " << part);
  BOOST_TEST(r.out.find("step     3/3 | epoch") != std::string::npos, r.out);
}

// ---- --memory-timeline -------------------------------------------------------------------------
namespace {

// The tensors the plan report lists as saved for backward, named as name_of prints them (s1.b0.h2).
std::vector<std::string> saved_tensors(const std::string &report) {
  std::vector<std::string> names;
  std::istringstream in(report.substr(report.find("saved for backward:")));
  std::string line;
  std::getline(in, line);
  std::getline(in, line);  // the header
  while (std::getline(in, line) && line.starts_with("s")) {
    std::istringstream words(line);
    std::string block, tensor;
    words >> block >> tensor;
    names.push_back(block + "." + tensor);
  }
  return names;
}

}  // namespace

// --memory-timeline writes the first step as a PyTorch memory snapshot (tests/snapshot.h replays
// it: every free of a live allocation, none overlapping another, what stays live the segment's
// allocated blocks): its live bytes peak at measured_peak_bytes, the persistent tensors alone stay
// live, and the tensors are named as the plan report names them, with their phase. The GPT under
// every_n_layers=2, the MLP under full with two micro-batches; an unwritable path is one line.
BOOST_AUTO_TEST_CASE(memory_timeline_peaks_at_the_measured_peak) {
  const fs::path file = scratch_dir() / "timeline.pickle";
  for (const auto &[program, args] :
       {std::pair<std::string, std::string>{TRAIN_GPT, "--checkpoint-policy every_n_layers=2 --max-steps 1"},
        {TRAIN_MLP, "--checkpoint-policy full --gradient-accumulation-steps 2 --batch-size 128 --max-steps 2"}}) {
    const Result r = run(program, args + " --eval-samples 0 --json --memory-timeline " + file.string());
    BOOST_TEST_REQUIRE(r.exit_code == 0, r.err);
    const nlohmann::json j = summary(r), snapshot = remat::testing::read_pickle(file);
    const remat::testing::Replay replay = remat::testing::replay(snapshot);
    BOOST_TEST(replay.peak == j["measured_peak_bytes"].get<long long>(), program << " " << args);
    BOOST_TEST(snapshot["remat"]["measured_peak_bytes"] == j["measured_peak_bytes"]);
    BOOST_TEST(snapshot["remat"]["policy"] == j["policy"]);
    for (const auto &[addr, e] : replay.live)
      BOOST_TEST(e["frames"][0]["name"].get<std::string>().ends_with(" (persistent)"), e.dump());
    for (const char *phase : {"persistent", "forward", "recompute", "backward"})
      BOOST_TEST(replay.phases.contains(phase), program << ": no " << phase << " allocation");
    for (const std::string &name : {"params", "grads", "adam_m", "adam_v", "inputs", "labels", "dlogits"})
      BOOST_TEST(replay.names.contains(name), name);
    const Result report = run(program, args + " --plan-report");
    BOOST_TEST_REQUIRE(report.exit_code == 0, report.err);
    const std::vector<std::string> saved = saved_tensors(report.out);
    BOOST_TEST(!saved.empty());
    for (const std::string &name : saved) BOOST_TEST(replay.names.contains(name), name << " of the plan report");
    for (const std::string &name : replay.names)  // a plan tensor, or a hole of the arena
      BOOST_TEST((name.starts_with("s") || name.starts_with("arena hole") || !name.contains('.')), name);
    // 0: the persistent tensors; then each micro-batch
    BOOST_TEST(replay.micro_batches.size() == (args.contains("accumulation-steps 2") ? 3u : 2u));
  }
  expect_one_line_error("--max-steps 1 --memory-timeline /nonexistent/folder/t.pickle", "--memory-timeline");
}
