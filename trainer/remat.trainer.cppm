// module remat.trainer: what the trainers share on top of the runtime. Data sources (idx files, text
// corpora), the trainer (trainer/: flags (CLI11), the resolved run, the training loop with
// evaluation and sampling, the summary and JSON), the plan report, kernel costs, snapshot folders,
// files that survive a crash, safetensors files and the --save-initial file.
module;
#include <functional>
#include <iosfwd>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
export module remat.trainer;
export import remat.runtime;
import remat;

export namespace remat::runtime {

// What a snapshot holds besides the parameters and the AdamW moments: where the run stands and
// what shaped it, so that a run resumed with the same flags repeats the uninterrupted one exactly
// (a resume with other flags is refused).
struct SnapshotState {
  long step = 0, max_steps = 0;
  std::uint64_t seed = 0;
  std::string run;               // the flags that shape the run (steps, batch, schedule...); must match on resume
  std::string data;              // DataSource::state()
  std::string model_definition;  // definition_digest(model)
  std::string remat_version;     // of the remat that wrote it (load_snapshot fills it)
};

// Every parameter's AdamW moments in the flat parameters' layout.
struct Moments {
  std::span<const float> m, v;
};

// Snapshot folders (snapshot.cpp): built as <folder>.tmp, every file fsync'ed, then renamed.
// load_snapshot() checks every CRC-32, size, name and shape, that it is of this model and that
// its parameters are finite, before it changes anything.
// With a sharded optimizer (Plan::shard_slots) the moments are every rank's, in the flat
// parameters' layout (the trainer gathers them); load_snapshot keeps this plan's shard.
void save_snapshot(Engine &engine, const std::string &folder, const SnapshotState &state, const Moments &moments = {});
SnapshotState load_snapshot(Engine &engine, const std::string &folder);
// --init-from: the parameters from a safetensors file of PyTorch names and layouts
// (named_parameters; F32, BF16 or F16; a snapshot folder means its model.safetensors), every
// mismatch of names, shapes and dtypes listed in one InputError.
void load_weights(Engine &engine, const std::string &path);

// Files that survive a crash (files.cpp). write_atomically runs write(out) on <path>.tmp,
// fsyncs it, renames it to path and fsyncs the folder, so that no file is ever half-written;
// errors are one line (InputError) starting with `what` and the path (a full disk: "No space left
// on device").
void write_atomically(const std::string &path, std::string_view what, const std::function<void(std::ostream &)> &write);
void sync_path(const std::string &path, std::string_view what);  // fsync a file or a folder
// Before a long run that writes `path` at its end: one line (InputError) starting with `what` and
// the path now if it is a folder or <path>.tmp cannot be created.
void check_writable(const std::string &path, std::string_view what);
std::vector<std::byte> read_bytes(const std::string &path);  // errors: "<path>: <problem>"
std::string crc32_hex(std::span<const std::byte> bytes);     // zlib's CRC-32, 8 hex digits

// safetensors (huggingface/safetensors): an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {string: string}} padded with
// spaces, then the tensors' data back to back.
struct SafetensorsTensor {
  std::string name, dtype;  // "F32", "BF16", "I32"...
  std::vector<long long> shape;
  std::size_t begin = 0, end = 0;  // in the data section
};
struct Safetensors {
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsTensor> tensors;  // in header order
  std::vector<std::byte> bytes;            // the whole file
  std::size_t data_start = 0;
  const SafetensorsTensor *find(std::string_view name) const;
  std::span<const std::byte> data(const SafetensorsTensor &t) const;
};
// Every size, offset, dtype and shape checked before use (no holes, overlaps or trailing bytes);
// a problem is one InputError starting with `what`.
Safetensors parse_safetensors(std::vector<std::byte> file, std::string_view what);
Safetensors read_safetensors(const std::string &path);
// A floating-point tensor of a file as floats (F32, BF16 or F16).
std::vector<float> floats(const Safetensors &file, const SafetensorsTensor &t);
// tensors[i] (dtype and shape; offsets ignored) holds data[i]; each tensor's CRC-32 goes into the
// metadata as "crc32.<name>". Written with write_atomically.
void write_safetensors(const std::string &path, std::string_view what, std::map<std::string, std::string> metadata,
                       std::span<const SafetensorsTensor> tensors, std::span<const std::span<const std::byte>> data);

// The plan's parameters as PyTorch names and lays them out (snapshot.cpp): layer l of block b of
// stage s is stages.<s>.blocks.<b>.layers.<l>; a linear's weight [out, in] (nn.Linear's; remat
// keeps [in, out]: transposed) and bias [out]; a norm's weight and bias [C]; an embedding's
// token.weight [V, C] and position.weight [T, C].
struct NamedParameter {
  std::string name;
  TensorId id;
  std::vector<long long> shape;  // in the file
  bool transposed = false;       // the file holds the transpose of remat's [in, out]
};
std::vector<NamedParameter> named_parameters(const Plan &plan);
// A parameter's values in a buffer of the flat parameters' layout (params, grads, and adam_m,
// adam_v unless the optimizer is sharded: Plan::shard_slots).
template <class T>
std::span<T> parameter_in(std::span<T> flat, const Plan &plan, TensorId param) {
  const Tensor &t = plan.tensors[std::size_t(param.index)];
  if (t.view_of != plan.params().index) throw std::logic_error("a parameter outside the plan's parameter buffer");
  return flat.subspan(t.offset / sizeof(float), std::size_t(t.extent[0] * (t.dims == 2 ? t.extent[1] : 1)));
}
std::vector<float> to_file_layout(const NamedParameter &p, std::span<const float> values);
void from_file_layout(const NamedParameter &p, std::span<const float> file, std::span<float> values);
// A digest of what the parameters mean: the input, the stages and their layers (kinds and sizes;
// not policies or names).
std::string definition_digest(const Model &m);

// Snapshot folders of an --output-dir: snapshot-<step> by step (incomplete ones are *.tmp, not
// listed); resolve_snapshot() takes a snapshot folder, or a folder of them (then its newest);
// remove_old_snapshots() keeps the newest `keep` and removes what interrupted saves left;
// check_output_dir() probes that the folder (made by OutputDirLock) is writable and has room for a
// snapshot.
std::vector<std::pair<long, std::string>> snapshot_folders(const std::string &dir);
std::string resolve_snapshot(const std::string &path);
void remove_old_snapshots(const std::string &dir, int keep);
std::size_t snapshot_bytes(const Plan &plan);
std::string_view remat_version();  // the project's version (CMakeLists.txt)
void check_output_dir(const std::string &dir, std::size_t bytes);
// One run per --output-dir: DIR/.remat-lock, flock'ed for the run's life and naming its holder
// ("pid P host H"), emptied at a normal end. A second run into DIR is an InputError naming the
// holder; a name left by a run that died (its flock went with it) is taken over, and said so.
class OutputDirLock {
public:
  OutputDirLock() = default;  // none (no --output-dir, or not rank 0)
  explicit OutputDirLock(const std::string &dir);
  OutputDirLock(OutputDirLock &&other) noexcept : fd(std::exchange(other.fd, -1)) {}
  OutputDirLock &operator=(OutputDirLock &&) = delete;
  ~OutputDirLock();

private:
  int fd = -1;
};

// Fashion-MNIST style idx files (gzip or plain): images scaled to [0, 1], labels 0..classes-1. The
// header (magic, sizes: none 0, data bytes exactly their product), the label count and every label
// are checked; a bad file is an InputError naming it and the problem.
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
// Every regular file of `dir` (sorted; fortune's .dat/.u8 index files skipped), concatenated. A file
// of which more than 10% of the bytes are not text (printable ASCII, whitespace, UTF-8) is an
// InputError naming it, as are an empty folder and gzip'ed files that are truncated or corrupt.
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
  // Token sources: what the sample after training starts from (none: no sample).
  virtual std::vector<std::int32_t> sample_prompt() const { return {}; }
};

// Data-parallel training (trainer/ranks.cpp): the ranks of an `mpirun` launch (Open
// MPI), or one rank without it. Every rank runs the same plan on its share of each global batch;
// the sums (GradientReducer, Ranks::sum) are the same on every rank.
class Ranks {
public:
  static Ranks &world();  // MPI_Init on first use under mpirun, MPI_Finalize at exit
  int rank = 0, size = 1;
  // on this machine (MPI_COMM_TYPE_SHARED): they share its cores, and each takes its GPU
  int local_rank = 0, local_size = 1;
  // More than one rank, or REMAT_DATA_PARALLEL=1: one process then runs the data-parallel path
  // (the GradientReducer and its collectives) as a world of one rank, without mpirun (the check of
  // the NCCL path on a machine with one GPU).
  bool data_parallel = false;
  // A step's loss, correct predictions and ranks that found non-finite gradients, summed over the
  // ranks in rank order (each rank's travels the ring: MPI's own small all-reduce allocates at
  // every call).
  struct Sums {
    double loss = 0;
    long correct = 0, nonfinite = 0;
    long terminating = 0;  // ranks that got a SIGTERM: every rank stops after the same step
  };
  void sum(Sums &sums) const;
  // Ring collectives (MPI_Sendrecv to the next rank, from the one before) in place over chunks of
  // v: chunk c is [bounds[c], bounds[c + 1]) (ranks + 1 bounds). reduce_scatter: rank r's chunk r
  // becomes the sum over the ranks, v_r+1 + v_r+2 + ... + v_r around the ring, receiving into
  // `exchange` (planned in the arena: as long as the longest chunk); all_gather: every chunk c
  // becomes rank c's. Both together are an all-reduce with the same bits on every rank.
  void reduce_scatter(std::span<float> v, std::span<const std::size_t> bounds, std::span<float> exchange) const;
  void all_gather(std::span<float> v, std::span<const std::size_t> bounds) const;
  // Open MPI keeps a message that arrives before its receive is posted (ranks run the ring out of
  // step) in memory its allocator grows on demand and then keeps: grown here, at start-up, by
  // messages of every size up to 16 KiB arriving early, so that no step allocates.
  void expect_early_messages() const;
  std::size_t most(std::size_t v) const;        // the largest over the ranks
  void broadcast(std::span<char> bytes) const;  // rank 0's to every rank
  // Ends every rank's process with `code` (MPI_Abort: a rank that fails alone must not leave the
  // others waiting for it in a collective; mpirun names it).
  [[noreturn]] void abort(int code) const;
  // An InputError on every rank naming the first rank whose `value` differs from rank 0's.
  void check_same(std::string_view what, const std::string &value) const;
  Ranks(const Ranks &) = delete;
  Ranks &operator=(const Ranks &) = delete;

private:
  Ranks();
  ~Ranks();
  bool initialized = false;
  mutable std::vector<Sums> all_sums;  // each rank's, allocated at start-up
};

// The parameter gradients summed over the ranks while backward goes on: a bucket is what one
// train step finishes, handed over as soon as the last step that writes each of its gradients has
// run. CPU: to a communication thread running the MPI ring (Ranks) through the planned gradient
// exchange buffer. CUDA: to NCCL on the collectives stream, after an event of the compute stream,
// in place (its own buffers are outside the arena: device_bytes_outside_arena).
class GradientReducer {
public:
  GradientReducer(const Ranks &ranks, Executor &ex);
  ~GradientReducer();
  void start();  // before the train phase of a step's last micro-batch
  struct Times {
    double busy_ms = 0;  // the collectives' time (the communication thread's, or NCCL's on the GPU)
    double wait_ms = 0;  // what backward's end waited for them: what was not hidden
  };
  Times finish();  // after that phase: every bucket summed
  // What the collectives hold of device memory outside the arena (NCCL's buffers, measured around
  // its set-up and first collectives at start-up); 0 on CPUs.
  std::size_t device_bytes_outside_arena() const;
  std::string describe() const;  // "MPI ring" / "NCCL 2.30.7"
  // The gradients this rank holds summed: all of them, or with a sharded optimizer its shard's.
  std::span<const float> summed_gradients() const;
  // With a sharded optimizer, after AdamW: every rank's shard of the parameters to every rank.
  void gather_parameters();
  // ... and for a snapshot: every rank's moments, whole (m and v get the flat parameters' size).
  Moments gather_moments(std::vector<float> &m, std::vector<float> &v);
  GradientReducer(const GradientReducer &) = delete;
  GradientReducer &operator=(const GradientReducer &) = delete;
  struct State;  // (ranks.cpp: the MPI ring's and NCCL's)

private:
  std::unique_ptr<State> state;
};

// A data source reads samples [rank x batch, (rank + 1) x batch) of each global batch of
// ranks x batch samples: the same samples, in the same order, as one process with the global batch.
struct DataOptions {
  std::string dir;
  int batch = 0;
  std::uint64_t seed = 0;
  std::string train_file, val_file;  // token files (empty: <dir>/train.bin, <dir>/val.bin)
  int rank = 0, ranks = 1;
};
std::unique_ptr<DataSource> fashion_mnist(const Model &model, const DataOptions &o);
std::unique_ptr<DataSource> text_corpus(const Model &model, const DataOptions &o);
// llm.c / nanoGPT token files: uint16 little-endian tokens, after llm.c's header when the file
// starts with its magic (256 int32: 20240520, version 1, the token count). Every token is checked
// against `vocab`; a bad file is an InputError naming it and the problem.
std::vector<std::uint16_t> load_tokens(const std::string &path, int vocab);
std::unique_ptr<DataSource> token_files(const Model &model, const DataOptions &o);

// What a trainer reads: remat_add_trainer(<target> MODEL <name> DATA text | fashion_mnist | ...).
enum class Data : std::uint8_t {
  text,           // a folder of text files read as bytes: next-token prediction (a token model)
  fashion_mnist,  // Fashion-MNIST idx files: 28 x 28 images, 10 classes
  tokens,         // token files train.bin / val.bin (llm.c / nanoGPT layout): next-token prediction
};

// A model as the shared trainer runs it: its name, its value, its default policy and trainer
// defaults (its model module's), its kernel tables (its kernels module's), and the data its trainer
// reads. The generated main of a trainer (remat_add_trainer) passes one to train_main.
struct ModelInfo {
  std::string_view name;
  const Model &model;
  Policy default_policy;
  TrainerDefaults defaults;
  std::span<const Kernel> kernels;       // CPU
  std::span<const Kernel> cuda_kernels;  // CUDA (empty when the build made none)
  Data data = Data::text;
};
// The data source a model's trainer reads (ModelInfo::data).
std::unique_ptr<DataSource> data_source(const ModelInfo &info, const DataOptions &o);

// --save-initial: a safetensors file with every parameter under its plan name
// (s<stage>.b<block>.p<layer>_w / _b; shapes [rows, contiguous]: a linear weight is [in, out]
// with y = x w + b, an embedding's _w is the token table [V, C] and its _b the position table
// [T, C], a LayerNorm's _w / _b are gamma / beta), the current batch as "inputs" (token ids
// int32 [B, T], or pixels fp32 [B, W]) and "labels" (int32 [B, T] or [B]), and `metadata` as the
// header's __metadata__. Written to <path>.tmp and renamed.
void save_initial(const std::string &path, const Model &model, const Plan &plan, Executor &ex,
                  const std::map<std::string, std::string> &metadata);

// Transformers model folders (transformers.cpp), for a model whose module names an architecture
// (TrainerDefaults::transformers). Its layout: each Transformers tensor holds columns [first,
// first + count) of a remat parameter (row-major [rows, cols]; 1-D: rows 1), stored [count, rows]
// when `linear` (nn.Linear's [out, in]), else [rows, count] ([count] for 1-D): GPT-2's Conv1D
// weights are remat's own layout, its c_attn one tensor for q, k and v; Llama's q/k/v and gate/up
// projections are column ranges of remat's fused linears. A tied head is not a tensor of its own.
struct TransformersTensor {
  std::string name;
  TensorId param;
  long long rows = 1, cols = 0, first = 0, count = 0;
  bool linear = false;
  std::vector<long long> shape() const;
  void read(std::span<const float> file, std::span<float> param) const;   // into the parameter's values
  void write(std::span<const float> param, std::span<float> file) const;  // out of them
};
struct TransformersLayout {
  std::string architecture;  // GPT2LMHeadModel, LlamaForCausalLM
  std::vector<TransformersTensor> tensors;
  std::string tied_head;  // "lm_head.weight" when the head is the token table
};
// InputError when the model is not of the architecture's form.
TransformersLayout transformers_layout(const Model &m, const Plan &plan, std::string_view architecture,
                                       std::string_view model);
bool is_transformers_folder(const std::string &path);  // a folder with config.json
// --init-from DIR: config.json checked field by field against the compiled model (one line naming
// the field and both values), every tensor's name, shape and dtype (F32, BF16, F16) checked, then
// the weights loaded. Returns config.json's text, for --save-hf.
std::string load_transformers_folder(Executor &ex, const Plan &plan, const ModelInfo &info, const std::string &dir,
                                     std::string_view program);
// --save-hf DIR: config.json (the one read by --init-from, else made from the model) and
// model.safetensors in fp32 or bf16, as AutoModelForCausalLM.from_pretrained(DIR) loads them.
void save_transformers_folder(Executor &ex, const Plan &plan, const ModelInfo &info, const std::string &dir, bool bf16,
                              const std::string &source_config);
// --save-gradients DIR: DIR/gradients.safetensors, every parameter's gradient after the step, under
// Transformers' names and layouts (or remat's PyTorch-style names for other models).
void save_gradients(Executor &ex, const Plan &plan, const ModelInfo &info, const std::string &dir);

// A SIGTERM (a scheduler's preemption) stops the run after its current step, with a snapshot
// when --output-dir is given (loop.cpp).
void stop_on_sigterm();

// The trainer shared by every model: flags -> resolved run -> training loop -> summary
// (trainer/). Returns the process exit code (bad input: 2, with one line on stderr).
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

// Kernel costs (trainer/costs.cpp). The table is JSON: {machine: {cost_key: [{stage, variant,
// precision, seconds}, ...]}}, one entry per KernelKey.
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

// --memory-timeline FILE (trainer/timeline.cpp): every allocation and free of an engine's
// arena over one training step (its micro-batches and the optimizer), written as the pickle
// torch.cuda.memory._snapshot() returns (PyTorch's memory viewer opens it). Its maximum of live
// bytes is the step's measured peak, which these add up to (the trainer's measured_peak_bytes).
struct MeasuredPeak {
  std::size_t arena_high_water = 0, halide_heap_peak = 0, step_heap_bytes = 0;  // the last on the CPU only
  std::size_t total() const { return arena_high_water + halide_heap_peak + step_heap_bytes; }
};
class MemoryTimeline {
public:
  MemoryTimeline(std::string path, std::string program);  // an InputError if `path` cannot be written
  ~MemoryTimeline();
  // before the step: records its executor's calls
  void start(Engine &engine, std::string_view model_name, std::string_view policy);
  void finish(const MeasuredPeak &measured);  // after it: stops and writes the file

private:
  struct Recorder;
  std::string path, program, model, policy;
  Engine *engine = nullptr;
  std::unique_ptr<Recorder> r;
};

}  // namespace remat::runtime

// Not exported: the trainer's steps, one implementation unit each (trainer/).
namespace remat::runtime {

// The flags (flags.cpp), with the model's defaults until a flag says otherwise.
struct Options {
  long max_steps = 0;  // 0: derived from num_train_epochs
  int num_train_epochs = 0;
  int batch_size = 0;
  int gradient_accumulation_steps = 1;
  double learning_rate = 0;
  double weight_decay = 0.01;
  std::string lr_scheduler_type = "cosine";
  int warmup_steps = 0;
  std::uint64_t seed = 42;
  std::string checkpoint_policy;
  bool gradient_checkpointing = false;        // HF's: --checkpoint-policy full, or what the kwargs say
  std::string gradient_checkpointing_kwargs;  // JSON: every_n_layers, offload (use_reentrant, ...: no effect)
  std::string memory_budget;
  bool calibrate = false;
  std::string cost_table;
  bool sweep = false;
  double dropout = 0;
  std::string data_dir;
  std::string train_file, validation_file;  // Data::tokens only
  int eval_samples = -1;
  int eval_steps = 0;
  int sample_length = 0;  // token models: tokens generated after training (0: none)
  int logging_steps = 50;
  std::string logging_dir;  // metrics.jsonl and trainer_state.json
  bool json = false;
  bool plan_report = false;
  std::string memory_timeline;  // the first step as a PyTorch memory snapshot (timeline.cpp)
  std::string output_dir;       // snapshot-<step> folders
  long save_steps = 0;          // a snapshot every N steps (and one at the end)
  int save_total_limit = 0;     // keep the newest K snapshots (0: all)
  std::string resume_from_snapshot, init_from, save_initial;
  std::string save_hf, save_hf_dtype = "fp32", save_gradients;  // Transformers folders (transformers.cpp)
  std::string removed_save_snapshot;                            // --save-snapshot FILE: replaced by --output-dir
  int skip_nonfinite_steps = 0;
  long exit_interval = 0;  // stop (with a snapshot) after a step divisible by N, as Megatron-LM's       // steps with a
                           // NaN/Inf loss or gradient skipped before the guard stops
  std::string device = "cpu";
  bool offload = false;
  bool bf16 = false;
  bool shard_optimizer = false;  // ZeRO-1 over the mpirun ranks
  std::string config;            // --config FILE.json
};
// The options, or the exit code when there is nothing to run (--help: 0; a bad flag: 2, said on
// stderr).
struct ParsedFlags {
  Options options;
  std::optional<int> exit_code;
};
ParsedFlags parse_flags(int argc, char **argv, const ModelInfo &info, const std::string &program);
// What the data source reads, by the flags.
DataOptions data_options(const Options &o, int batch);

// What the flags resolve to (resolve.cpp): each stage's policy, where and in which precision the
// kernels run, the batch, the kernel costs and the plan.
struct Run {
  StagePolicies policies;
  Device device = Device::cpu;
  Precision precision = Precision::fp32;
  int batch = 0, micro = 1;  // samples per micro-batch, micro-batches per step
  CostModel costs;
  std::string costs_from;  // where the costs come from, for the plan report
  Plan plan;
  std::string policy_label;
};
Run resolve(const Options &o, const ModelInfo &info, const std::string &program);

// The budget -> step time table from the smallest plan to none's peak, printed and written to
// <program>-sweep.json, which scripts/plot.py sweep draws (report.cpp).
void print_sweep(std::FILE *out, const ModelInfo &info, const Run &run, const Options &o, const std::string &program);

// What a training run measured (loop.cpp), and its report (summary.cpp).
struct Evaluation {
  double loss = 0, accuracy = 0;
  long samples = 0;
};
struct Summary {
  long first_step = 1, max_steps = 0;
  long last_step = 0;  // max_steps, or where --exit-interval or a SIGTERM stopped the run
  double loss_first = 0, loss_last = 0;
  std::optional<Evaluation> eval;
  std::vector<double> step_ms;
  std::vector<GradientReducer::Times> allreduce;  // per step, with ranks
  std::string collectives;                        // GradientReducer::describe(), with ranks
  std::size_t collectives_device_bytes = 0;       // outside the arena (NCCL's buffers)
  double train_seconds = 0;
  std::size_t measured_peak = 0, activation_bytes_none = 0;
  std::string grad_digest, param_digest;
};
Summary train(const Options &o, const ModelInfo &info, const Run &run, const std::string &program);
void print_summary(const Options &o, const ModelInfo &info, const Run &run, const Summary &s);

// --logging-dir DIR (metrics.cpp): DIR/metrics.jsonl, one JSON object per optimizer step, written
// and flushed as it happens, and at the end DIR/trainer_state.json in the shape of Hugging Face's
// Trainer state (log_history: an entry per logging step and per evaluation; global_step,
// max_steps, ...; at its top level only TrainerState's fields, so that TrainerState.load_from_json
// reads it).
struct StepMetrics {
  long step = 0;
  double epoch = 0, loss = 0, learning_rate = 0, train_accuracy = 0, step_ms = 0, tokens_per_s = 0;
};
class MetricsLog {
public:
  struct Setup {
    long max_steps = 0, num_train_epochs = 0, save_steps = 0;
    int logging_steps = 0, eval_steps = 0, train_batch_size = 0;
  };
  MetricsLog(const std::string &dir, Setup setup);  // creates DIR, opens metrics.jsonl: an InputError if it cannot
  ~MetricsLog();
  // A line of metrics.jsonl (with eval_loss and eval_accuracy on an evaluation step), flushed; an
  // evaluation also goes to log_history.
  void step(const StepMetrics &m, const std::optional<Evaluation> &eval);
  // log_history's entry of a logging step: `window` holds the means over the steps since the last.
  void logged(const StepMetrics &window);
  // The run's last entry (train_loss: the mean over its `steps`, train_runtime: its wall time, ...)
  // and trainer_state.json.
  void finish(long step, double epoch, double train_loss, double train_seconds, long steps, long samples);

private:
  struct State;
  std::unique_ptr<State> state;
};

// --device cuda: a usable GPU, kernels for it, and room for `arena_bytes` (loop.cpp); "12.3 MiB"
// (summary.cpp).
void check_cuda(const ModelInfo &info, std::size_t arena_bytes);
std::string mib(std::size_t bytes);

}  // namespace remat::runtime
