// The trainer's flags (CLI11), Hugging Face's names where they have one, and the policies they
// spell. HF's spellings are second names of the settings remat shares with Transformers'
// TrainingArguments (--per_device_train_batch_size is --batch-size), --gradient-checkpointing and
// its kwargs are remat policies, --config FILE.json holds the same settings (nlohmann-json), and
// two settings that contradict are one error naming both, wherever each was given.
module;
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
module remat.trainer;
import remat;

namespace remat::runtime {
namespace {

// Flag validators with short messages (CLI11's ranges print the whole double range).
CLI::Validator number(bool (*ok)(double), const char *what) {
  return CLI::Validator(
      [ok, what](std::string &text) -> std::string {
        try {
          std::size_t used = 0;
          const double v = std::stod(text, &used);
          if (used == text.size() && std::isfinite(v) && ok(v)) return {};
        } catch (const std::exception &) {}
        return fmt::format("'{}' is not {}", text, what);
      },
      what);
}
const CLI::Validator positive = number([](double v) { return v > 0; }, "a positive number");
const CLI::Validator non_negative = number([](double v) { return v >= 0; }, "a number >= 0");
const CLI::Validator probability = number([](double v) { return v >= 0 && v < 1; }, "a probability in [0, 1)");

// A boolean flag: `--bf16`, `--bf16=false`, or HF's `--bf16 True`.
CLI::Option *flag(CLI::App &app, const std::string &names, bool &value, const std::string &help) {
  return app.add_flag(names, value, help)->expected(0, 1);
}

// The options, bound to `o`: --help shows o's values as the defaults. Settings Transformers'
// TrainingArguments (or its run_clm.py example) shares have HF's underscore name as a second name.
void add_training_options(CLI::App &app, Options &o, const ModelInfo &info) {
  const std::string group = "Training (HF's underscore names are the same settings)";
  app.add_option("--max-steps,--max_steps", o.max_steps, "optimizer steps (default: --num-train-epochs worth)")
      ->check(positive)
      ->group(group);
  app.add_option("--num-train-epochs,--num_train_epochs", o.num_train_epochs, "epochs when --max-steps is not given")
      ->check(positive)
      ->capture_default_str()
      ->group(group);
  app.add_option("--batch-size,--per_device_train_batch_size", o.batch_size,
                 fmt::format("samples per micro-batch (default {})", info.defaults.batch))
      ->check(positive)
      ->group(group);
  app.add_option("--gradient-accumulation-steps,--gradient_accumulation_steps", o.gradient_accumulation_steps,
                 "micro-batches per optimizer step")
      ->check(positive)
      ->capture_default_str()
      ->group(group);
  app.add_option("--learning-rate,--learning_rate", o.learning_rate,
                 "peak AdamW learning rate (0: the weights stay as they are, as for a --save-hf of --init-from's)")
      ->check(non_negative)
      ->capture_default_str()
      ->group(group);
  app.add_option("--weight-decay,--weight_decay", o.weight_decay, "AdamW decoupled weight decay on linear weights")
      ->check(non_negative)
      ->capture_default_str()
      ->group(group);
  app.add_option("--lr-scheduler-type,--lr_scheduler_type", o.lr_scheduler_type, "learning-rate schedule after warm-up")
      ->check(CLI::IsMember({"constant", "cosine"}))
      ->capture_default_str()
      ->group(group);
  app.add_option("--warmup-steps,--warmup_steps", o.warmup_steps, "linear warm-up steps")
      ->check(non_negative)
      ->capture_default_str()
      ->group(group);
  app.add_option("--seed", o.seed, "seed for initialization, shuffling and dropout")
      ->check(number([](double v) { return v >= 0 && v == std::floor(v); }, "a whole number >= 0"))
      ->capture_default_str()
      ->group(group);
  app.add_option("--dropout", o.dropout, "dropout probability of the model's dropout layers and attention")
      ->check(probability)
      ->capture_default_str()
      ->group(group);
  flag(app, "--bf16", o.bf16, "bf16 activations and GEMM operands (fp32 accumulation), fp32 master weights and AdamW")
      ->group(group);
}

void add_policy_options(CLI::App &app, Options &o, const ModelInfo &info) {
  const std::string group = "Checkpointing and memory";
  app.add_option(
         "--checkpoint-policy", o.checkpoint_policy,
         fmt::format(
             "none | full | every_n_layers=N | sqrt_n | selective, composed with + (every_n_layers=2+selective); "
             "per repeat stage s<i>:POLICY,...; +unfused_head runs an LM head whole instead of in row chunks "
             "(default: the model's, {})",
             policies_name(info.model, annotated(info.model, info.default_policy)).view()))
      ->group(group);
  flag(app, "--gradient-checkpointing,--gradient_checkpointing", o.gradient_checkpointing,
       "HF's gradient_checkpointing=True: every block checkpointed, i.e. --checkpoint-policy full, or what "
       "--gradient-checkpointing-kwargs says (false, Transformers' default, leaves the model's policy)")
      ->group(group);
  app.add_option("--gradient-checkpointing-kwargs,--gradient_checkpointing_kwargs", o.gradient_checkpointing_kwargs,
                 "with --gradient-checkpointing, a JSON object: every_n_layers N (--checkpoint-policy "
                 "every_n_layers=N), offload true (+offload); use_reentrant and preserve_rng_state are accepted and "
                 "change nothing (remat's recompute is planned ahead and its dropout masks are counter-based: the "
                 "gradients are those of no checkpointing either way)")
      ->group(group);
  app.add_option(
         "--memory-budget", o.memory_budget,
         "the fastest plan whose peak fits SIZE (512MiB, 2GB, 1000000) or a percentage of the none plan's peak (60%)")
      ->group(group);
  flag(app, "--offload", o.offload,
       "keep checkpoints in pinned host memory between forward and backward (--device cuda)")
      ->group(group);
  flag(app, "--shard-optimizer", o.shard_optimizer,
       "under mpirun: each rank keeps and updates the AdamW moments of 1 / ranks of the parameters (ZeRO stage 1; "
       "gradients reduce-scattered, parameters all-gathered)")
      ->group(group);
  flag(app, "--calibrate", o.calibrate,
       "time every kernel here first and store the costs in the cost table, for the budget planner")
      ->group(group);
  app.add_option("--cost-table", o.cost_table, fmt::format("the kernel cost table (default {})", default_cost_table()))
      ->group(group);
  flag(app, "--plan-report", o.plan_report, "print every tensor saved for backward under the policy, then exit")
      ->group(group);
  flag(
      app, "--sweep", o.sweep,
      "with --plan-report: the budget -> step time table from the smallest plan to none (also as <trainer>-sweep.json)")
      ->group(group);
}

void add_data_options(CLI::App &app, Options &o) {
  const std::string group = "Data and evaluation";
  app.add_option("--data-dir", o.data_dir, "dataset folder")->capture_default_str()->group(group);
  app.add_option("--train-file,--train_file", o.train_file,
                 "token data: the training tokens (default <--data-dir>/train.bin)")
      ->group(group);
  app.add_option("--validation-file,--validation_file", o.validation_file,
                 "token data: the validation tokens (default <--data-dir>/val.bin)")
      ->group(group);
  app.add_option("--eval-samples,--max_eval_samples", o.eval_samples,
                 "evaluation samples (default all, 0 skips evaluation)")
      ->check(non_negative)
      ->group(group);
  app.add_option("--eval-steps,--eval_steps", o.eval_steps, "also evaluate every N steps (0: only at the end)")
      ->check(non_negative)
      ->capture_default_str()
      ->group(group);
  app.add_option("--sample-length", o.sample_length,
                 "token models: tokens (characters) generated from a validation prompt after training (0: none)")
      ->check(non_negative)
      ->capture_default_str()
      ->group(group);
}

void add_output_options(CLI::App &app, Options &o) {
  const std::string group = "Progress, metrics, snapshots and devices";
  app.add_option("--logging-steps,--logging_steps", o.logging_steps,
                 "a progress line every N steps (on a terminal, also a live line rewritten every step)")
      ->check(positive)
      ->capture_default_str()
      ->group(group);
  app.add_option("--logging-dir,--logging_dir", o.logging_dir,
                 "write DIR/metrics.jsonl (one JSON object per step, as it happens) and, at the end, "
                 "DIR/trainer_state.json (HF's Trainer state: log_history, global_step, ...); DIR is created")
      ->group(group);
  flag(app, "--json", o.json, "print a JSON summary as the last line of stdout (progress goes to stderr)")
      ->group(group);
  app.add_option("--memory-timeline", o.memory_timeline,
                 "record the first step's allocations and frees as a PyTorch memory snapshot (pytorch.org/memory_viz)")
      ->group(group);
  app.add_option("--output-dir,--output_dir", o.output_dir,
                 "write snapshots to DIR/snapshot-<step>/ (model.safetensors, optimizer.safetensors, "
                 "trainer_state.json) every --save-steps and at the end; DIR is created")
      ->group(group);
  app.add_option("--save-steps,--save_steps", o.save_steps, "also write a snapshot every N steps (needs --output-dir)")
      ->check(positive)
      ->group(group);
  app.add_option("--save-total-limit,--save_total_limit", o.save_total_limit,
                 "keep only the newest K snapshots; an older one is removed after a newer is complete")
      ->check(positive)
      ->group(group);
  app.add_option("--resume-from-snapshot,--resume_from_checkpoint", o.resume_from_snapshot,
                 "continue a run from a snapshot folder, or from the newest snapshot in an --output-dir (same flags)")
      ->group(group);
  app.add_option("--init-from", o.init_from,
                 "start from the weights of FILE.safetensors (PyTorch names and layouts, as model.safetensors; F32, "
                 "BF16 or F16), of a snapshot folder, or of a Transformers folder (config.json and model.safetensors, "
                 "or its shards) of the model's architecture, with a fresh optimizer")
      ->group(group);
  app.add_option("--save-hf", o.save_hf,
                 "at the end (and at each --save-steps, as DIR/step-N), the weights as a Transformers folder that "
                 "AutoModelForCausalLM.from_pretrained(DIR) loads")
      ->group(group);
  app.add_option("--save-hf-dtype", o.save_hf_dtype, "the precision --save-hf writes the weights in")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str()
      ->group(group);
  app.add_option("--save-gradients", o.save_gradients,
                 "after the run's last step, every parameter's gradient as DIR/gradients.safetensors (Transformers' "
                 "names for a model of a Transformers architecture)")
      ->group(group);
  app.add_option("--skip-nonfinite-steps", o.skip_nonfinite_steps,
                 "skip up to N steps whose loss or gradients are NaN or infinite (each reported) before stopping")
      ->check(non_negative)
      ->capture_default_str()
      ->group(group);
  app.add_option("--exit-interval", o.exit_interval,
                 "stop after a step divisible by N (with a snapshot when --output-dir is given); a SIGTERM stops "
                 "the run the same way after its current step")
      ->check(positive)
      ->group(group);
  app.add_option("--save-snapshot", o.removed_save_snapshot)->group("");  // replaced: resolve() says by what
  app.add_option("--save-initial", o.save_initial,
                 "write the parameters and the first (micro-)batch, before the first step, as safetensors")
      ->group(group);
  app.add_option("--device", o.device, "where kernels run: cpu, or cuda (device 0)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str()
      ->group(group);
}

std::unique_ptr<CLI::App> make_app(Options &o, const ModelInfo &info, const std::string &program) {
  auto app = std::make_unique<CLI::App>(
      fmt::format("Train the {} model with remat (checkpoint policies, AdamW).", info.name), program);
  add_training_options(*app, o, info);
  add_policy_options(*app, o, info);
  add_data_options(*app, o);
  add_output_options(*app, o);
  app->add_option("--config", o.config,
                  "FILE.json: settings as keys, HF's underscore names or remat's flag names without the dashes "
                  "({\"per_device_train_batch_size\": 8, \"gradient_checkpointing\": true}); a flag on the command "
                  "line replaces the file's value of the same setting");
  app->footer(
      "HF's underscore spellings are second names of the same settings: a setting given twice, under either name, is "
      "an error. Settings that contradict (--gradient-checkpointing or its kwargs with --checkpoint-policy, "
      "--memory-budget with any of them, kwargs without --gradient-checkpointing) are one error naming both, whether "
      "each came from the command line or the --config file. Bad input exits with 2.");
  return app;
}

// Where each given setting came from, by its option's first name: its spelling on the command line
// ("--per_device_train_batch_size") or its key in the --config file.
struct Source {
  std::string name;  // as given: "--per_device_train_batch_size", or the file's key
  std::string file;  // the --config file, or empty: the command line
};
using Given = std::map<std::string, Source>;

std::string describe(const Source &s) { return s.file.empty() ? s.name : fmt::format("\"{}\" in {}", s.name, s.file); }

const CLI::Option *find_option(const CLI::App &app, const std::string &name) {
  const CLI::Option *opt = app.get_option_no_throw(name);
  return opt == app.get_help_ptr() ? nullptr : opt;
}

// The settings named on the command line; one named twice (under either of its names) is an
// error naming both spellings. Words that name no option are left to CLI11.
Given command_line_settings(const CLI::App &app, int argc, char **argv) {
  Given given;
  for (int i = 1; i < argc; ++i) {
    const std::string_view word = argv[i];
    if (word == "--") break;
    if (!word.starts_with("--")) continue;
    const std::string spelling(word.substr(0, word.find('=')));
    const CLI::Option *opt = find_option(app, spelling);
    if (!opt) continue;
    const auto [at, fresh] = given.emplace(opt->get_name(), Source{spelling, ""});
    if (!fresh)
      throw InputError(at->second.name == spelling
                           ? fmt::format("{} is given twice; give it once", spelling)
                           : fmt::format("{} and {} are one setting; give one", at->second.name, spelling));
  }
  return given;
}

// A --config key's value as command-line words for its option: a boolean for a flag, a number for
// a numeric option, a string otherwise (gradient_checkpointing_kwargs: an object, or its text).
std::vector<std::string> config_words(const CLI::Option &opt, const std::string &where, const nlohmann::json &value) {
  const std::string name = opt.get_name(), type = opt.get_type_name();
  auto wrong = [&](const char *expected) {
    return InputError(fmt::format("{}: expected {}, not {}", where, expected, value.dump()));
  };
  if (opt.get_expected_min() == 0) {
    if (!value.is_boolean()) throw wrong("true or false");
    return {name + (value.get<bool>() ? "=true" : "=false")};
  }
  if (type.starts_with("INT") || type.starts_with("UINT") || type.starts_with("FLOAT")) {
    if (!value.is_number()) throw wrong("a number");
    return {name, value.dump()};
  }
  if (name == "--gradient-checkpointing-kwargs" && value.is_object()) return {name, value.dump()};
  if (!value.is_string()) throw wrong(name == "--gradient-checkpointing-kwargs" ? "a JSON object" : "a string");
  return {name, value.get<std::string>()};
}

// --config FILE.json, parsed into `o` by the command line's options, one key at a time (each key
// an option's name without its dashes: HF's underscore names, remat's dashed ones or those with
// underscores). Every mistake is one line naming the file and the key.
Given read_config(const std::string &path, Options &o, const ModelInfo &info, const std::string &program) {
  std::ifstream in(path);
  if (!in) throw InputError(fmt::format("--config {}: cannot read the file", path));
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::set<std::string> keys;
  std::string twice;  // JSON allows a key twice (the last wins); a config file may not
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json &parsed) {
      if (depth == 1 && event == nlohmann::json::parse_event_t::key && !keys.insert(parsed.get<std::string>()).second &&
          twice.empty())
        twice = parsed.get<std::string>();
      return true;
    });
  } catch (const nlohmann::json::exception &e) {
    const std::string_view what = e.what();
    throw InputError(fmt::format("--config {}: not JSON ({})", path, what.substr(what.find(']') + 2)));
  }
  if (!j.is_object()) throw InputError(fmt::format("--config {}: not a JSON object of settings", path));
  if (!twice.empty()) throw InputError(fmt::format("--config {}: \"{}\" is given twice", path, twice));
  Given given;
  for (const auto &[key, value] : j.items()) {
    const std::unique_ptr<CLI::App> app = make_app(o, info, program);
    std::string dashed = key;
    std::ranges::replace(dashed, '_', '-');
    const CLI::Option *opt = find_option(*app, "--" + key);
    if (!opt) opt = find_option(*app, "--" + dashed);
    if (!opt || opt->get_name() == "--config")
      throw InputError(
          fmt::format("--config {}: unknown key \"{}\" (keys are the flags of --help without their "
                      "dashes: per_device_train_batch_size, checkpoint-policy, ...)",
                      path, key));
    const std::string where = fmt::format("--config {}: \"{}\"", path, key);
    const auto [at, fresh] = given.emplace(opt->get_name(), Source{key, path});
    if (!fresh)
      throw InputError(
          fmt::format("--config {}: \"{}\" and \"{}\" are one setting; give one", path, at->second.name, key));
    std::vector<std::string> words = config_words(*opt, where, value);
    std::ranges::reverse(words);  // CLI11 takes a vector of words last first
    try {
      app->parse(words);
    } catch (const CLI::ParseError &e) {
      std::string_view what = e.what();
      if (what.starts_with(opt->get_name() + ": ")) what.remove_prefix(opt->get_name().size() + 2);
      throw InputError(fmt::format("{}: {}", where, what));
    }
  }
  return given;
}

// The --config file named on the command line (empty: none).
std::string config_path(int argc, char **argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view word = argv[i];
    if (word == "--") break;
    if (word == "--config" && i + 1 < argc) return argv[i + 1];
    if (word.starts_with("--config=")) return std::string(word.substr(9));
  }
  return {};
}

// Settings that contradict, wherever each was given: one error naming both. (Checked on what the
// file and the command line give together.)
void check_conflicts(const Options &o, const Given &given) {
  auto named = [&](const char *name) -> const Source * {
    const auto it = given.find(name);
    return it == given.end() ? nullptr : &it->second;
  };
  auto with_value = [](const Source *s, const std::string &value) {
    return s->file.empty() ? fmt::format("{} {}", s->name, value) : describe(*s);
  };
  const Source *policy = named("--checkpoint-policy"), *kwargs = named("--gradient-checkpointing-kwargs"),
               *budget = named("--memory-budget");
  const Source *gc = o.gradient_checkpointing ? named("--gradient-checkpointing") : nullptr;
  if (policy && kwargs)
    throw InputError(fmt::format("{} and {} both choose the checkpoint policy; give one",
                                 with_value(policy, o.checkpoint_policy), describe(*kwargs)));
  if (policy && gc)
    throw InputError(
        fmt::format("{} and {} both choose the checkpoint policy ({} is --checkpoint-policy full); give one",
                    with_value(policy, o.checkpoint_policy), describe(*gc), gc->name));
  for (const Source *other : {gc, kwargs, policy})
    if (budget && other)
      throw InputError(fmt::format("{} and {}: the budget planner chooses the policy; give one",
                                   with_value(budget, o.memory_budget),
                                   other == policy ? with_value(policy, o.checkpoint_policy) : describe(*other)));
  if (kwargs && !gc)
    throw InputError(
        fmt::format("{} needs --gradient-checkpointing (without it the kwargs do nothing, as in "
                    "Transformers)",
                    describe(*kwargs)));
}

// HF's gradient checkpointing as the policy --checkpoint-policy spells: full, or every_n_layers=N,
// with +offload. Keys as Transformers passes them on (every_n_layers, offload; use_reentrant and
// preserve_rng_state change nothing here); any other key is an error naming the known ones.
std::string hf_policy(const std::string &kwargs, const std::string &where) {
  if (kwargs.empty()) return "full";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(kwargs);
  } catch (const nlohmann::json::exception &e) {
    const std::string_view what = e.what();
    throw InputError(fmt::format("{}: not JSON ({})", where, what.substr(what.find(']') + 2)));
  }
  if (!j.is_object()) throw InputError(fmt::format("{}: expected a JSON object, not {}", where, j.dump()));
  std::string policy = "full", offload;
  for (const auto &[key, value] : j.items()) {
    if (key == "every_n_layers") {
      if (!value.is_number_integer() || value.get<long long>() < 1)
        throw InputError(fmt::format("{}: every_n_layers needs a whole number N >= 1, not {}", where, value.dump()));
      policy = fmt::format("every_n_layers={}", value.get<long long>());
    } else if (key == "offload" || key == "use_reentrant" || key == "preserve_rng_state") {
      if (!value.is_boolean())
        throw InputError(fmt::format("{}: {} needs true or false, not {}", where, key, value.dump()));
      if (key == "offload" && value.get<bool>()) offload = "+offload";
    } else {
      throw InputError(
          fmt::format("{}: unknown key \"{}\" (known: every_n_layers, offload, use_reentrant, "
                      "preserve_rng_state)",
                      where, key));
    }
  }
  return policy + offload;
}

// What the flags' values say beyond their own checks.
void check_settings(const Options &o, const ModelInfo &info) {
  for (const auto &[flag, value] :
       {std::pair{"--train-file", &o.train_file}, {"--validation-file", &o.validation_file}})
    if (info.data != Data::tokens && !value->empty())
      throw InputError(fmt::format("{} is for token files; this trainer reads {} (--data-dir)", flag,
                                   info.data == Data::text ? "text" : "Fashion-MNIST"));
}

}  // namespace

// The model's defaults; the --config file's settings over them; the command line's over those;
// then the contradictions, and HF's gradient checkpointing as a policy.
ParsedFlags parse_flags(int argc, char **argv, const ModelInfo &info, const std::string &program) {
  Options o;
  const TrainerDefaults &d = info.defaults;
  o.num_train_epochs = d.epochs;
  o.max_steps = d.max_steps;
  o.learning_rate = d.learning_rate;
  o.warmup_steps = d.warmup_steps;
  o.eval_samples = d.eval_samples;
  o.eval_steps = d.eval_steps;
  o.sample_length = d.sample_length;
  o.data_dir = d.data_dir;
  try {
    Options scratch = o;
    const Given command_line = command_line_settings(*make_app(scratch, info, program), argc, argv);
    Given given;
    if (const std::string path = config_path(argc, argv); !path.empty()) given = read_config(path, o, info, program);
    const std::unique_ptr<CLI::App> app = make_app(o, info, program);
    try {
      app->parse(argc, argv);
    } catch (const CLI::CallForHelp &e) { return {o, app->exit(e)}; } catch (const CLI::ParseError &e) {
      throw InputError(e.what());
    }
    for (const auto &[name, source] : command_line) given.insert_or_assign(name, source);
    check_conflicts(o, given);
    check_settings(o, info);
    if (o.gradient_checkpointing) {
      const auto kwargs = given.find("--gradient-checkpointing-kwargs");
      const Source &k = kwargs == given.end() ? Source{} : kwargs->second;
      o.checkpoint_policy = hf_policy(o.gradient_checkpointing_kwargs,
                                      k.file.empty() ? k.name : fmt::format("--config {}: \"{}\"", k.file, k.name));
    }
  } catch (const InputError &e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
    return {o, 2};
  }
  return {o, std::nullopt};
}

DataOptions data_options(const Options &o, int batch) {
  return {o.data_dir, batch, o.seed, o.train_file, o.validation_file, Ranks::world().rank, Ranks::world().size};
}

Policy parse_policy(std::string_view text) {
  Policy out;
  std::string_view rest = text;
  while (true) {
    const std::size_t plus = rest.find('+');
    const std::string_view part = rest.substr(0, plus);
    constexpr std::string_view every = "every_n_layers=";
    Policy p;
    if (part == "none")
      p = none;
    else if (part == "full")
      p = full;
    else if (part == "sqrt_n")
      p = sqrt_n;
    else if (part == "selective")
      p = selective;
    else if (part == "offload")
      p = offload;
    else if (part.starts_with(every)) {
      int n = 0;
      const auto digits = part.substr(every.size());
      const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
      if (digits.empty() || err != std::errc() || end != digits.data() + digits.size() || n < 1)
        throw InputError(fmt::format("--checkpoint-policy {}: every_n_layers needs a whole number N >= 1", text));
      p = Policy{Policy::Kind::every_n_layers, n};
    } else {
      throw InputError(
          fmt::format("--checkpoint-policy {}: unknown policy {} (use none, full, every_n_layers=N, sqrt_n, "
                      "selective, offload or unfused_head, composed with +)",
                      text, part));
    }
    if (const std::string_view why = composition_error(out, p); !why.empty())
      throw InputError(fmt::format("--checkpoint-policy {}: {}", text, why));
    out = out | p;
    if (plus == std::string_view::npos) break;
    rest = rest.substr(plus + 1);
  }
  return out;
}

namespace {
// Takes every part "unfused_head" (composed with + anywhere, for the whole model) out of `text`.
bool take_unfused_head(std::string &text) {
  constexpr std::string_view part = "unfused_head";
  bool taken = false;
  std::size_t at = 0;
  while ((at = text.find(part, at)) != std::string::npos) {
    const std::size_t end = at + part.size();
    const bool starts = at == 0 || text[at - 1] == '+',
               ends = end == text.size() || text[end] == '+' || text[end] == ',';
    if (!starts || !ends) {
      ++at;
      continue;
    }
    const std::size_t from = at == 0 ? 0 : at - 1;  // with the + before it, or else the separator after it
    text.erase(from, end - from + (at == 0 && end < text.size() ? 1 : 0));
    taken = true;
    at = from;
  }
  return taken;
}
}  // namespace

StagePolicies parse_stage_policies(const Model &model, std::string_view flag, StagePolicies base) {
  std::string without_head(flag);
  const bool unfused = take_unfused_head(without_head);
  base.unfused_head = base.unfused_head || unfused;
  if (without_head.empty()) return base;  // only +unfused_head: the policies stay
  const std::string_view text = without_head;
  if (text.find(':') == std::string_view::npos) {
    StagePolicies every(parse_policy(text));
    every.unfused_head = base.unfused_head;
    // a stage's selective set (and what it offloads) is fixed in its kernels: the annotation's
    for (int s = 0; s < model.n_stages; ++s) every.stage[s].selection = model.stages[s].policy.selection;
    return every;
  }
  std::string repeat_stages;
  for (int s = 0; s < model.n_stages; ++s)
    if (model.stages[s].checkpointable) repeat_stages += fmt::format("{}s{}", repeat_stages.empty() ? "" : ", ", s);
  std::string_view rest = text;
  while (true) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const std::size_t colon = item.find(':');
    int stage = -1;
    if (colon != std::string_view::npos && item.starts_with('s')) {
      const auto [end, err] = std::from_chars(item.data() + 1, item.data() + colon, stage);
      if (err != std::errc() || end != item.data() + colon) stage = -1;
    }
    if (stage < 0 || stage >= model.n_stages || !model.stages[stage].checkpointable)
      throw InputError(
          fmt::format("--checkpoint-policy {}: {} names no repeat stage (per stage: s<i>:POLICY,... with i one of {})",
                      text, item, repeat_stages.empty() ? "none: the model has no repeat stage" : repeat_stages));
    Policy p = parse_policy(item.substr(colon + 1));
    // a stage's selective set is fixed in its kernels: the annotation's
    p.selection = model.stages[stage].policy.selection;
    base.stage[stage] = p;
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return base;
}

Policy parse_budget(std::string_view text) {
  auto bad = [&] {
    return InputError(
        fmt::format("--memory-budget {}: expected bytes with an optional unit (512MiB, 2GB, 1000000) or a "
                    "percentage of the none plan's peak (60%)",
                    text));
  };
  double value = 0;
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (err != std::errc() || !(value > 0)) throw bad();
  std::string unit(end, text.data() + text.size());
  std::ranges::transform(unit, unit.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (unit == "%") {
    if (value > 100 || value != std::floor(value)) throw bad();
    return budget_percent(int(value));
  }
  const std::map<std::string, double> units = {
      {"", 1},       {"b", 1},         {"kb", 1e3},        {"mb", 1e6},
      {"gb", 1e9},   {"kib", 1024.0},  {"mib", 1048576.0}, {"gib", 1073741824.0},
      {"k", 1024.0}, {"m", 1048576.0}, {"g", 1073741824.0}};
  const auto u = units.find(unit);
  if (u == units.end() || value * u->second < 1 || value * u->second > 9e18) throw bad();
  return budget((long long)(value * u->second));
}

}  // namespace remat::runtime
