// Snapshot folders as a user relies on them: a resumed run is the same run, a kill at any moment
// leaves a newest complete snapshot, damage is found before anything trains, the non-finite guard
// names the step and the tensor, and a full disk costs nothing but the snapshot being written.
#include <boost/test/unit_test.hpp>
#include <nlohmann/json.hpp>
#include <zlib.h>

#include "trainer_run.h"

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;
using remat::testing::expect_one_line_error;
using remat::testing::Result;
using remat::testing::run;
using remat::testing::scratch_dir;
using remat::testing::slurp;
using remat::testing::summary;

namespace {

// What an --output-dir holds but its lock file (.remat-lock), by name.
std::set<std::string> snapshots_in(const fs::path &dir) {
  std::set<std::string> out;
  for (const auto &e : fs::directory_iterator(dir))
    if (e.path().filename() != ".remat-lock") out.insert(e.path().filename().string());
  return out;
}

// Each step's loss from --logging-dir's metrics.jsonl.
std::map<long, double> losses(const fs::path &logging_dir) {
  std::map<long, double> out;
  std::istringstream in(slurp(logging_dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    out[j["step"].get<long>()] = j["loss"].get<double>();
  }
  return out;
}

std::string crc32_hex(const std::string &bytes) {
  char text[9];
  std::snprintf(text, sizeof text, "%08lx",
                ::crc32(0L, reinterpret_cast<const Bytef *>(bytes.data()), uInt(bytes.size())));
  return text;
}

void write_bytes(const fs::path &p, const std::string &bytes) { std::ofstream(p, std::ios::binary) << bytes; }

// A copy of `snapshot` whose model.safetensors `change` edits (header and tensor bytes), rewritten
// with consistent checksums everywhere (the tensors' in the metadata, the file's and
// trainer_state.json's own), so that only the reader's other checks can catch it.
fs::path consistent_copy(const fs::path &snapshot, const std::string &name,
                         const std::function<void(nlohmann::json &, std::map<std::string, std::string> &)> &change) {
  const fs::path copy = scratch_dir() / name;
  fs::remove_all(copy);
  fs::copy(snapshot, copy);
  auto file = remat::testing::read_safetensors_file(copy / "model.safetensors");
  change(file.header, file.data);
  std::string data;
  for (auto &[tensor, entry] : file.header.items()) {
    if (tensor == "__metadata__") continue;
    entry["data_offsets"] = {data.size(), data.size() + file.data[tensor].size()};
    file.header["__metadata__"]["crc32." + tensor] = crc32_hex(file.data[tensor]);
    data += file.data[tensor];
  }
  std::string header = file.header.dump();
  header.resize((header.size() + 7) / 8 * 8, ' ');
  std::string bytes(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  bytes += header + data;
  write_bytes(copy / "model.safetensors", bytes);
  auto state = nlohmann::json::parse(slurp(copy / "trainer_state.json"));
  state["files"]["model.safetensors"] = {{"bytes", bytes.size()}, {"crc32", crc32_hex(bytes)}};
  state.erase("crc32");
  state["crc32"] = crc32_hex(state.dump());
  write_bytes(copy / "trainer_state.json", state.dump(1));
  return copy;
}

// A copy of `snapshot` with `bytes` bytes of `file` from `offset` inverted.
fs::path flipped_copy(const fs::path &snapshot, const std::string &name, const std::string &file, std::size_t offset,
                      int bytes) {
  const fs::path copy = scratch_dir() / name;
  fs::remove_all(copy);
  fs::copy(snapshot, copy);
  std::string content = slurp(copy / file);
  BOOST_TEST_REQUIRE(offset + bytes <= content.size());
  for (int i = 0; i < bytes; ++i) content[offset + i] = char(~content[offset + i]);
  write_bytes(copy / file, content);
  return copy;
}

}  // namespace

// 20 steps straight, and 10 steps (stopped by --exit-interval, with a snapshot) then a new process
// resuming from the --output-dir: the same loss at every step and byte-identical
// model.safetensors and optimizer.safetensors; --save-total-limit 2 leaves the same two snapshots.
// The MLP with gradient accumulation (resumed under another policy: gradients are the same under
// every policy) and the GPT with dropout (its masks follow the step).
BOOST_AUTO_TEST_CASE(resumed_runs_repeat_the_uninterrupted_run) {
  for (auto [program, extra] :
       {std::pair{std::string(TRAIN_MLP), std::string("--batch-size 32 --gradient-accumulation-steps 2")},
        {std::string(TRAIN_GPT), std::string("--batch-size 4 --dropout 0.1")}}) {
    const fs::path dir = scratch_dir() / fs::path(program).filename();
    const std::string common =
        "--max-steps 20 --warmup-steps 2 --save-steps 5 --save-total-limit 2 --logging-steps 1 "
        "--eval-samples 0 --json " +
        extra;
    auto in = [&](const std::string &name) { return (dir / name).string(); };
    const Result whole = run(program, common + " --output-dir " + in("a") + " --logging-dir " + in("log-a"));
    const Result first =
        run(program, common + " --exit-interval 10 --output-dir " + in("b") + " --logging-dir " + in("log-b1"));
    BOOST_TEST_REQUIRE(whole.exit_code == 0, whole.err);
    BOOST_TEST_REQUIRE(first.exit_code == 0, first.err);
    BOOST_TEST(first.err.find("stopped after step 10 (--exit-interval 10)") != std::string::npos, first.err);
    BOOST_TEST((snapshots_in(in("b")) == std::set<std::string>{"snapshot-10", "snapshot-5"}));
    const Result resumed = run(program, common + " --checkpoint-policy full --output-dir " + in("b") +
                                            " --logging-dir " + in("log-b2") + " --resume-from-snapshot " + in("b"));
    BOOST_TEST_REQUIRE(resumed.exit_code == 0, resumed.err);
    BOOST_TEST(resumed.err.find("resuming from " + in("b/snapshot-10") + " at step 10") != std::string::npos,
               resumed.err);
    const auto a = losses(in("log-a")), b1 = losses(in("log-b1")), b2 = losses(in("log-b2"));
    BOOST_TEST_REQUIRE(a.size() == 20u);
    BOOST_TEST_REQUIRE((b1.size() == 10u && b2.size() == 10u));
    for (long step = 1; step <= 20; ++step)
      BOOST_TEST(a.at(step) == (step <= 10 ? b1 : b2).at(step), program << " step " << step);
    for (const char *d : {"a", "b"})
      BOOST_TEST((snapshots_in(in(d)) == std::set<std::string>{"snapshot-15", "snapshot-20"}), d);
    for (const char *file : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"})
      BOOST_TEST(slurp(in("a/snapshot-20/") + file) == slurp(in("b/snapshot-20/") + file), program << " " << file);
    BOOST_TEST(summary(resumed)["param_digest"] == summary(whole)["param_digest"]);
    BOOST_TEST(summary(resumed)["measured_peak_bytes"] == summary(resumed)["planned_peak_bytes"]);
    // other shaping flags would not repeat the run: refused
    expect_one_line_error(
        program, "--max-steps 21 --warmup-steps 2 --eval-samples 0 " + extra + " --resume-from-snapshot " + in("b"),
        {"the snapshot's run used", "--max-steps 20"});
  }
}

// `command` in the background, its output discarded.
pid_t spawn(const std::string &command) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::dup2(null, 2);
    ::execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), nullptr);
    ::_exit(127);
  }
  return pid;
}
// Waits until the run's first save has begun (a snapshot-* entry in `dir`, complete or not); false
// if the process ended first.
bool wait_for_first_save(const fs::path &dir, pid_t pid, int &status) {
  auto saving = [&] {
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
      if (it->path().filename().string().starts_with("snapshot-")) return true;
    return false;
  };
  while (!saving()) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// SIGKILL at random moments of a run that saves a snapshot after every step (saving takes most of
// its time), from when its first save begins to its end (the start-up before it, whose length
// varies with the machine's load, is left out): every time, the newest snapshot-<step> loads and
// the resumed run ends with the same parameters as a run never killed, or (killed before the
// first snapshot was complete) a resume finds none; no incomplete folder is ever named
// snapshot-<step>.
BOOST_AUTO_TEST_CASE(a_kill_at_any_moment_leaves_a_complete_snapshot) {
  const fs::path dir = scratch_dir() / "kill";
  const std::string flags = "--max-steps 4 --save-steps 1 --save-total-limit 2 --eval-samples 0 --batch-size 64";
  const std::string command = std::string(TRAIN_MLP) + " " + flags + " --output-dir ";
  int status = 0;
  const pid_t reference = spawn(command + (dir / "reference").string());
  BOOST_TEST_REQUIRE(wait_for_first_save(dir / "reference", reference, status));
  const auto t0 = std::chrono::steady_clock::now();
  ::waitpid(reference, &status, 0);
  const auto window = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  BOOST_TEST_REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  const std::string final_model = slurp(dir / "reference/snapshot-4/model.safetensors");
  std::mt19937 rng(std::random_device{}());
  int resumed = 0, mid_save = 0, none_yet = 0, finished = 0;
  constexpr int trials = 16;
  for (int trial = 0; trial < trials; ++trial) {
    const fs::path out = dir / ("trial" + std::to_string(trial));
    const int delay_ms = std::uniform_int_distribution(0, int(window.count() * 0.9))(rng);
    const pid_t pid = spawn(command + out.string());
    if (wait_for_first_save(out, pid, status)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    if (WIFEXITED(status)) {  // it ended before the kill
      ++finished;
      continue;
    }
    const auto left = snapshots_in(out);
    mid_save += std::ranges::any_of(left, [](const std::string &n) { return n.find('.') != std::string::npos; });
    const Result r =
        run(TRAIN_MLP, flags + " --output-dir " + out.string() + " --resume-from-snapshot " + out.string());
    if (std::ranges::none_of(left, [](const std::string &n) { return n.find('.') == std::string::npos; })) {
      ++none_yet;
      BOOST_TEST(r.exit_code == 2);
      BOOST_TEST(r.err.find("no snapshot-<step> folders") != std::string::npos, r.err);
      continue;
    }
    if (r.exit_code == 2 &&
        r.err.find("not before --max-steps 4") != std::string::npos) {  // killed after the last save
      ++finished;
      continue;
    }
    BOOST_TEST(r.exit_code == 0, "trial " << trial << " after " << delay_ms << " ms: " << r.err);
    BOOST_TEST(slurp(out / "snapshot-4/model.safetensors") == final_model, "trial " << trial);
    ++resumed;
    fs::remove_all(out);  // ~90 MB a trial
  }
  BOOST_TEST_MESSAGE("SIGKILL trials: " << trials << " over " << window.count() << " ms of steps and saves; resumed "
                                        << resumed << ", killed while saving " << mid_save
                                        << ", before the first snapshot " << none_yet << ", after the last "
                                        << finished);
  BOOST_TEST(resumed >= trials / 3);  // about 3 in 5 resume (the rest: killed in the first save)
  BOOST_TEST(mid_save >= 5);
}

// One run per --output-dir: a second run into the folder of a running trainer stops at once, one
// line naming the first run's pid and host, exit 2, having written nothing; once the first is
// killed, the next run takes its lock over and says so; a normal end leaves the lock file empty.
BOOST_AUTO_TEST_CASE(a_second_run_into_the_same_output_dir_is_refused) {
  const fs::path dir = scratch_dir() / "locked";
  const std::string flags = "--eval-samples 0 --batch-size 64 --output-dir " + dir.string();
  const pid_t first = spawn(std::string(TRAIN_MLP) + " --max-steps 1000000 " + flags);
  const std::string holder = "pid " + std::to_string(first) + " host ";
  int status = 0;
  while (slurp(dir / ".remat-lock").find(holder) == std::string::npos) {
    BOOST_TEST_REQUIRE(::waitpid(first, &status, WNOHANG) == 0, "the first run ended: status " << status);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  expect_one_line_error(TRAIN_MLP, "--max-steps 1 " + flags, {dir.string(), "in use by another run (" + holder});
  BOOST_TEST(snapshots_in(dir).empty());
  ::kill(first, SIGKILL);
  ::waitpid(first, &status, 0);
  const Result next = run(TRAIN_MLP, "--max-steps 1 " + flags);
  BOOST_TEST(next.exit_code == 0, next.err);
  BOOST_TEST(
      next.err.find("taking over the lock of a run that ended without releasing it (" + holder) != std::string::npos,
      next.err);
  BOOST_TEST(fs::exists(dir / "snapshot-1/model.safetensors"));
  BOOST_TEST(slurp(dir / ".remat-lock").empty());
}

// Damage of every kind is found before anything trains: one line, exit code 2.
BOOST_AUTO_TEST_CASE(damaged_snapshots_are_refused) {
  const fs::path dir = scratch_dir() / "damaged";
  const std::string flags = "--max-steps 3 --batch-size 4 --eval-samples 0";
  const Result made = run(TRAIN_GPT, flags + " --save-steps 1 --output-dir " + dir.string());
  BOOST_TEST_REQUIRE(made.exit_code == 0, made.err);
  const fs::path good = dir / "snapshot-1";
  const Result fine = run(TRAIN_GPT, flags + " --resume-from-snapshot " + good.string());
  BOOST_TEST_REQUIRE(fine.exit_code == 0, fine.err);
  auto refused = [&](const fs::path &snapshot, const std::vector<std::string> &mentions) {
    expect_one_line_error(TRAIN_GPT, flags + " --resume-from-snapshot " + snapshot.string(), mentions);
  };
  const std::size_t model_bytes = fs::file_size(good / "model.safetensors");
  refused(flipped_copy(good, "data-flip", "model.safetensors", model_bytes / 2, 3),
          {"model.safetensors is damaged (its CRC-32 does not match)"});
  refused(flipped_copy(good, "header-flip", "model.safetensors", 40, 1), {"model.safetensors is damaged"});
  refused(flipped_copy(good, "optimizer-flip", "optimizer.safetensors", 5000, 1), {"optimizer.safetensors is damaged"});
  refused(flipped_copy(good, "state-flip", "trainer_state.json", 30, 1), {"trainer_state.json"});
  const fs::path cut = flipped_copy(good, "truncated", "model.safetensors", 0, 0);
  fs::resize_file(cut / "model.safetensors", model_bytes / 3);
  refused(cut, {"model.safetensors has", "truncated"});
  const fs::path no_state = flipped_copy(good, "no-state", "model.safetensors", 0, 0);
  fs::remove(no_state / "trainer_state.json");
  refused(no_state, {"no trainer_state.json"});
  // consistent checksums, wrong content: a 2-D weight's shape swapped, a NaN weight
  refused(consistent_copy(good, "wrong-shape",
                          [](nlohmann::json &header, auto &) {
                            auto &shape = header.at("stages.1.blocks.0.layers.2.weight").at("shape");
                            std::swap(shape[0], shape[1]);
                          }),
          {"stages.1.blocks.0.layers.2.weight is [128, 384] in the file, [384, 128] in the model"});
  refused(consistent_copy(good, "nan-weight",
                          [](nlohmann::json &, std::map<std::string, std::string> &data) {
                            const float nan = std::nanf("");
                            std::memcpy(data.at("stages.2.blocks.0.layers.1.weight").data() + 64, &nan, 4);
                          }),
          {"stages.2.blocks.0.layers.1.weight holds NaN"});
  // another model's snapshot; a newest snapshot that is damaged is named, not skipped
  expect_one_line_error(TRAIN_MLP, "--max-steps 3 --resume-from-snapshot " + good.string(),
                        {"a snapshot of model gpt"});
  fs::resize_file(dir / "snapshot-3/optimizer.safetensors", 100);
  refused(dir, {(dir / "snapshot-3").string(), "optimizer.safetensors has 100 bytes"});
  refused(scratch_dir() / "no-such-folder", {"no such folder"});
  // --init-from: every mismatch in one line (the GPT's weights are not the Llama's)
  expect_one_line_error(TRAIN_LLAMA, "--max-steps 1 --init-from " + (good / "model.safetensors").string(),
                        {"mismatches with model llama", "missing", "is not a parameter of the model"});
}

// --learning-rate 1e6: the guard stops the run at the first non-finite step, naming the step and
// the tensor; the snapshots written before stay whole. --skip-nonfinite-steps 2 skips two such
// steps, each reported, then stops.
BOOST_AUTO_TEST_CASE(the_nonfinite_guard_names_the_step_and_the_tensor) {
  const fs::path dir = scratch_dir() / "guard";
  const std::string flags = "--max-steps 20 --learning-rate 1e6 --batch-size 4 --eval-samples 0 --save-steps 1";
  const Result r = run(TRAIN_GPT, flags + " --output-dir " + dir.string());
  BOOST_TEST(r.exit_code == 1);
  const auto lines = r.err_lines();
  BOOST_TEST_REQUIRE(lines.size() == 1u, r.err);
  const std::string &line = lines[0];
  BOOST_TEST(line.starts_with("train-gpt: error: step "), line);
  BOOST_TEST(line.find("NaN or infinite values; the first non-finite tensor is s") != std::string::npos, line);
  BOOST_TEST(line.find("kernel of stage ") != std::string::npos, line);
  BOOST_TEST(line.find("--learning-rate 1000000 is likely too high") != std::string::npos, line);
  const long failed = std::stol(line.substr(std::strlen("train-gpt: error: step ")));
  BOOST_TEST_REQUIRE(failed >= 2);
  BOOST_TEST((snapshots_in(dir).size() == std::size_t(failed - 1)));  // every step before it, none after
  // the last good snapshot is whole: resumed, it repeats the failure exactly (the same step and tensor)
  const Result again =
      run(TRAIN_GPT, flags + " --output-dir " + dir.string() + " --resume-from-snapshot " + dir.string());
  BOOST_TEST(again.exit_code == 1);
  BOOST_TEST(again.err_lines() == lines, again.err);

  const Result skipping = run(TRAIN_GPT, flags + " --skip-nonfinite-steps 2 --output-dir " + (dir / "skip").string());
  BOOST_TEST(skipping.exit_code == 1);
  std::size_t skipped = 0;
  for (std::size_t at = 0; (at = skipping.out.find("of --skip-nonfinite-steps 2)", at)) != std::string::npos; ++at)
    ++skipped;
  BOOST_TEST(skipped == 2u, skipping.out);
  BOOST_TEST(skipping.err.find("(2 steps skipped before)") != std::string::npos, skipping.err);
}

// A full disk (here `ulimit -f`) while saving: reported in one line, the snapshot being written
// removed, the previous one intact and resumable. Unusable output folders and replaced flags are
// refused before training.
BOOST_AUTO_TEST_CASE(a_full_disk_keeps_the_previous_snapshot) {
  const fs::path dir = scratch_dir() / "full";
  const std::string flags = "--max-steps 4 --save-steps 2 --eval-samples 0 --output-dir " + dir.string();
  BOOST_TEST_REQUIRE(run(TRAIN_MLP, flags).exit_code == 0);
  fs::remove_all(dir / "snapshot-4");
  const std::string before = slurp(dir / "snapshot-2/model.safetensors");
  // 40000 blocks of 512 bytes: model.safetensors (17.7 MB) fits, optimizer.safetensors does not
  const Result full = run(TRAIN_MLP, flags + " --resume-from-snapshot " + dir.string(), "ulimit -f 40000; ");
  BOOST_TEST(full.exit_code == 2);
  BOOST_TEST_REQUIRE(full.err_lines().size() == 1u, full.err);
  BOOST_TEST(full.err.find("optimizer.safetensors: File too large") != std::string::npos, full.err);
  BOOST_TEST((snapshots_in(dir) == std::set<std::string>{"snapshot-2"}));
  BOOST_TEST(slurp(dir / "snapshot-2/model.safetensors") == before);
  const Result again = run(TRAIN_MLP, flags + " --resume-from-snapshot " + dir.string());
  BOOST_TEST(again.exit_code == 0, again.err);
  BOOST_TEST((snapshots_in(dir) == std::set<std::string>{"snapshot-2", "snapshot-4"}));

  expect_one_line_error(TRAIN_MLP, "--max-steps 1 --output-dir /etc/passwd/snapshots",
                        {"--output-dir", "cannot create"});
  expect_one_line_error(TRAIN_MLP, "--max-steps 1 --save-steps 1", {"--save-steps needs --output-dir"});
  expect_one_line_error(TRAIN_MLP, "--max-steps 1 --save-snapshot x", {"use --output-dir DIR"});
  expect_one_line_error(TRAIN_MLP, "--max-steps 1 --init-from a --resume-from-snapshot b",
                        {"--init-from and --resume-from-snapshot"});
}
