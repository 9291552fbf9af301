// module remat.trainer: what the example trainers share on top of the runtime. Data sources (idx
// files, text corpora), the trainer loop with its flags (CLI11) and JSON summary, the plan report,
// evaluation, sampling, and the --save-initial safetensors file.
module;
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>
export module remat.trainer;
export import remat.runtime;
import remat;

export namespace remat::runtime {

// Fashion-MNIST style idx files (gzip or plain): images scaled to [0, 1], labels 0..classes-1.
struct Dataset {
  int rows = 0, width = 0;
  std::vector<float> images;
  std::vector<std::int32_t> labels;
};
Dataset load_idx(const std::string &images_path, const std::string &labels_path, int classes);

// A text corpus as byte tokens (bytes >= vocab become '?'), split into train and validation.
struct Corpus {
  std::vector<std::int32_t> train, val;
  std::size_t files = 0;
};
// Every regular file of `dir` (sorted; fortune's .dat/.u8 index files skipped), concatenated.
Corpus load_corpus(const std::string &dir, int vocab, double val_fraction);

// Where a trainer's batches come from. A sample is one image or one sequence of block_size
// tokens (then every row is a next-token prediction).
class DataSource {
public:
  virtual ~DataSource() = default;
  virtual std::string describe() const = 0;
  virtual long train_samples() const = 0;  // one epoch
  virtual void next_train_batch(Executor &ex) = 0;
  virtual long eval_samples() const = 0;
  // Samples [first, first + batch) of the evaluation split; past its end, the batch is padded.
  virtual void load_eval_batch(Executor &ex, long first) = 0;
  // Where the training stream stands (shuffle order, RNG), for snapshots.
  virtual std::string state() const = 0;
  virtual void restore(const std::string &state) = 0;
};

struct DataOptions {
  std::string dir;
  int batch = 0;
  std::uint64_t seed = 0;
};
std::unique_ptr<DataSource> fashion_mnist(const Model &model, const DataOptions &o);
std::unique_ptr<DataSource> text_corpus(const Model &model, const DataOptions &o);

// What a trainer example passes to the shared trainer loop.
struct ModelInfo {
  std::string_view name;
  const Model &model;
  Policy default_policy;
  std::span<const Kernel> kernels;       // CPU
  std::span<const Kernel> cuda_kernels;  // CUDA (empty when the build made none)
  std::unique_ptr<DataSource> (*data)(const Model &, const DataOptions &);
  std::string_view default_data_dir;
  // Trainer defaults for this example (flags override them).
  int default_batch = 128;
  int default_epochs = 3;
  long default_max_steps = 0;  // 0: default_epochs worth
  double default_learning_rate = 1e-3;
  int default_warmup_steps = 0;
  int default_eval_samples = -1;  // -1: the whole evaluation split
  int default_eval_steps = 0;     // 0: evaluate only at the end
  int sample_length = 0;          // token models: characters to generate at the end
};

// --save-initial: a safetensors file with every parameter under its plan name
// (s<stage>.b<block>.p<layer>_w / _b; shapes [rows, contiguous]: a linear weight is [in, out]
// with y = x w + b, an embedding's _w is the token table [V, C] and its _b the position table
// [T, C], a LayerNorm's _w / _b are gamma / beta), the current batch as "inputs" (token ids
// int32 [B, T], or pixels fp32 [B, W]) and "labels" (int32 [B, T] or [B]), and `metadata` as the
// header's __metadata__. Written to <path>.tmp and renamed.
void save_initial(const std::string &path, const Model &model, const Plan &plan, Executor &ex,
                  const std::map<std::string, std::string> &metadata);

// The trainer shared by every example: flags, data, training, evaluation, JSON summary.
int train_main(int argc, char **argv, const ModelInfo &info);

// Prints what each block's kernels do, every tensor the plan saves for backward (block, name,
// shape, bytes, why), the peak, the recompute arithmetic and the step time `costs` predict.
void print_plan_report(std::FILE *out, const Model &model, const Plan &plan, const CostModel &costs = {},
                       std::string_view costs_from = "estimated from FLOPs and bytes");

// Policies from the command line. One policy: parts joined by '+' and composed (a | b): none,
// full, every_n_layers=N, sqrt_n, selective, offload. --checkpoint-policy takes one for every
// stage, or per repeat stage "s1:selective,s3:every_n_layers=2" over `base` (the model's own).
Policy parse_policy(std::string_view text);
StagePolicies parse_stage_policies(const Model &model, std::string_view text, StagePolicies base);
// --memory-budget: bytes with an optional unit (512MiB, 2GB, 1.5GiB, 1000000) or a percentage of
// the none plan's peak (60%).
Policy parse_budget(std::string_view text);

// Kernel costs (runtime/costs.cpp). The table is JSON: {machine: {cost_key: {kernel: seconds}}},
// kernels named kernel_name("", stage, variant, precision).
std::string machine_name(Device device);  // "CPU <model name>" or "GPU <name>"
std::string default_cost_table();         // $XDG_CACHE_HOME/remat/costs.json, else ~/.cache/remat/costs.json
std::string cost_key(std::string_view model, Precision precision, int batch, Device device);
std::optional<CostModel> load_costs(const std::string &path, const std::string &machine, const std::string &key);
void save_costs(const std::string &path, const std::string &machine, const std::string &key, const CostModel &costs);
// Times every kernel of the model (the plans of none, selective and full, and evaluation) on
// batches from `data`: the median call of each kernel.
CostModel calibrate(const ModelInfo &info, Device device, Precision precision, int batch, DataSource &data);
// An engine for `plan` ready to time: parameters initialized (seed 1), a batch from `data` loaded.
std::unique_ptr<Engine> engine_for_timing(Plan plan, const ModelInfo &info, Device device, DataSource &data);
// What each block's kernels do in `plan`: "forward_discard, forward_save*, backward_saved" (in
// schedule order; * marks a call that recomputes forward work).
std::string block_calls(const Plan &plan, const Unit &unit);
// The median time of a micro-batch (forward, loss, backward) of `plan` here.
double measured_step_ms(const Plan &plan, const ModelInfo &info, Device device, DataSource &data);

}  // namespace remat::runtime
