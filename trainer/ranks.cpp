// Data-parallel ranks on MPI (Open MPI's mpirun): the world, sums over it, and the start-up check
// that every rank runs the same build and flags.
module;
#include <HalideRuntime.h>
#include <mpi.h>

#include "cuda_device.h"
#include "nccl.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <vector>
module remat.trainer;

namespace remat::runtime {
namespace {

// mpirun (Open MPI) and other PMIx launchers set these in every rank's environment.
bool launched_by_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK"); }

int environment_int(const char *name, int otherwise) {
  const char *v = std::getenv(name);
  return v ? std::atoi(v) : otherwise;
}

}  // namespace

Ranks::Ranks() {
  data_parallel = environment_int("REMAT_DATA_PARALLEL", 0) == 1;
  if (!launched_by_mpirun()) return;
  // MPI calls come from one thread at a time: the communication thread during backward
  // (GradientReducer), the main thread otherwise
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  if (provided < MPI_THREAD_SERIALIZED) {
    MPI_Finalize();
    throw std::runtime_error("this MPI cannot take calls from a communication thread (MPI_THREAD_SERIALIZED)");
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm machine = MPI_COMM_NULL;  // the ranks that share this one's memory
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &machine);
  MPI_Comm_rank(machine, &local_rank);
  MPI_Comm_size(machine, &local_size);
  MPI_Comm_free(&machine);
  data_parallel = data_parallel || size > 1;
  initialized = true;
  all_sums.resize(std::size_t(size));
  // the ranks on this machine share its cores: Halide's threads (and the GEMMs on them) split
  // them, unless HL_NUM_THREADS says otherwise
  if (local_size > 1 && !std::getenv("HL_NUM_THREADS"))
    halide_set_num_threads(std::max(1, int(std::thread::hardware_concurrency()) / local_size));
}

Ranks::~Ranks() {
  if (initialized) MPI_Finalize();
}

Ranks &Ranks::world() {
  static Ranks ranks;
  return ranks;
}

void Ranks::sum(Sums &sums) const {
  if (size == 1) return;
  all_sums[std::size_t(rank)] = sums;
  const int next = (rank + 1) % size, before = (rank + size - 1) % size;
  for (int s = 0; s < size - 1; ++s)  // pass each rank's on: rank - s out, rank - s - 1 in
    MPI_Sendrecv(&all_sums[std::size_t((rank - s + size) % size)], sizeof(Sums), MPI_BYTE, next, 2,
                 &all_sums[std::size_t((rank - s - 1 + size) % size)], sizeof(Sums), MPI_BYTE, before, 2,
                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  sums = {};
  for (const Sums &s : all_sums) {
    sums.loss += s.loss;
    sums.correct += s.correct;
    sums.nonfinite += s.nonfinite;
    sums.terminating += s.terminating;
  }
}

namespace {
// Chunk c (mod ranks) of v.
std::span<float> chunk_of(std::span<float> v, std::span<const std::size_t> bounds, int c, int size) {
  c = (c % size + size) % size;
  return v.subspan(bounds[std::size_t(c)], bounds[std::size_t(c) + 1] - bounds[std::size_t(c)]);
}
void exchange_with_ring(int rank, int size, std::span<float> out, std::span<float> in, int tag) {
  MPI_Sendrecv(out.data(), int(out.size()), MPI_FLOAT, (rank + 1) % size, tag, in.data(), int(in.size()), MPI_FLOAT,
               (rank + size - 1) % size, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
}
}  // namespace

void Ranks::reduce_scatter(std::span<float> v, std::span<const std::size_t> bounds, std::span<float> exchange) const {
  for (int s = 0; s < size - 1; ++s) {  // chunk rank - s - 2 arrives from the rank before, summed that far
    const std::span<float> mine = chunk_of(v, bounds, rank - s - 2, size);
    exchange_with_ring(rank, size, chunk_of(v, bounds, rank - s - 1, size), exchange.first(mine.size()), 0);
    for (std::size_t i = 0; i < mine.size(); ++i) mine[i] += exchange[i];
  }
}

void Ranks::all_gather(std::span<float> v, std::span<const std::size_t> bounds) const {
  for (int s = 0; s < size - 1; ++s)  // chunk rank - s goes on, chunk rank - s - 1 arrives
    exchange_with_ring(rank, size, chunk_of(v, bounds, rank - s, size), chunk_of(v, bounds, rank - s - 1, size), 1);
}

void Ranks::expect_early_messages() const {
  if (size == 1) return;
  constexpr int early = 8, largest = 16384;
  const int next = (rank + 1) % size, before = (rank + size - 1) % size;
  std::vector<char> out(largest), in(std::size_t(early) * largest);
  std::vector<MPI_Request> sent(early);
  for (int bytes = 8; bytes <= largest; bytes *= 2) {
    for (int k = 0; k < early; ++k)
      MPI_Isend(out.data(), bytes, MPI_BYTE, next, 3, MPI_COMM_WORLD, &sent[std::size_t(k)]);
    MPI_Barrier(MPI_COMM_WORLD);  // they have arrived, unexpected
    for (int k = 0; k < early; ++k)
      MPI_Recv(in.data() + std::size_t(k) * largest, bytes, MPI_BYTE, before, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Waitall(early, sent.data(), MPI_STATUSES_IGNORE);
  }
}

void Ranks::abort(int code) const {
  std::fflush(stdout);
  std::fflush(stderr);
  if (initialized) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);  // (MPI_Abort does not return)
}

std::size_t Ranks::most(std::size_t v) const {
  unsigned long most = v;
  if (size > 1) MPI_Allreduce(MPI_IN_PLACE, &most, 1, MPI_UNSIGNED_LONG, MPI_MAX, MPI_COMM_WORLD);
  return most;
}

void Ranks::broadcast(std::span<char> bytes) const {
  if (size > 1) MPI_Bcast(bytes.data(), int(bytes.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
}

void Ranks::check_same(std::string_view what, const std::string &value) const {
  if (size == 1) return;
  // every rank's value, its length first
  const int length = int(value.size());
  std::vector<int> lengths(std::size_t(size), 0);
  MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::vector<int> offsets(std::size_t(size), 0);
  for (int r = 1; r < size; ++r) offsets[std::size_t(r)] = offsets[std::size_t(r - 1)] + lengths[std::size_t(r - 1)];
  std::string all(std::size_t(offsets.back() + lengths.back()), '\0');
  MPI_Allgatherv(value.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(), MPI_CHAR, MPI_COMM_WORLD);
  auto of = [&](int r) {
    return std::string_view(all).substr(std::size_t(offsets[std::size_t(r)]), lengths[std::size_t(r)]);
  };
  for (int r = 1; r < size; ++r)
    if (of(r) != of(0))
      throw InputError(
          fmt::format("rank {} of {} runs with other {} than rank 0 ({} against {})", r, size, what, of(r), of(0)));
}

}  // namespace remat::runtime

// ---- GradientReducer -------------------------------------------------------------------------
namespace remat::runtime {

// What both kinds share: the buckets and the ranks' shards of the flat parameters.
struct GradientReducer::State {
  const Ranks &ranks;
  Executor &ex;
  const bool sharded;
  std::vector<std::vector<TensorId>> buckets;  // by train step: the gradients it is the last to write
  std::vector<std::size_t> shard_bounds;       // of the ranks' shards of the flat parameters (ranks + 1)
  // the steps whose buckets were handed over since start(), in order (room for every step: nothing
  // allocated while training)
  std::vector<std::size_t> queue;
  std::size_t queued = 0;

  State(const Ranks &ranks, Executor &ex) : ranks(ranks), ex(ex), sharded(ex.plan.policies.shard_optimizer) {
    const Plan &plan = ex.plan;
    std::vector<int> last_writer(plan.tensors.size(), -1);
    for (std::size_t i = 0; i < plan.train.size(); ++i)
      for (const Arg &a : plan.train[i].args)
        if (a.access == Access::write && plan.tensors[std::size_t(a.tensor)].role == Role::grads)
          last_writer[std::size_t(a.tensor)] = int(i);
    buckets.resize(plan.train.size());
    for (std::size_t t = 0; t < plan.tensors.size(); ++t)
      if (last_writer[t] >= 0) buckets[std::size_t(last_writer[t])].push_back(TensorId{int(t)});
    for (int c = 0; c <= ranks.size; ++c)
      shard_bounds.push_back(std::size_t(std::min(plan.shard_slots * c, plan.tensors[plan.params().index].extent[0])));
    queue.resize(plan.train.size());
  }
  virtual ~State() = default;
  virtual void start() = 0;
  virtual GradientReducer::Times finish() = 0;
  virtual void gather_parameters() = 0;  // sharded
  virtual std::size_t device_bytes_outside_arena() const { return 0; }
  virtual std::string describe() const = 0;
};

namespace {

// CPU ranks: the MPI ring on a communication thread.
struct RingReducer final : GradientReducer::State {
  struct Gradient {
    std::span<float> values;
    std::vector<std::size_t> bounds;  // of its chunks (gradient_chunk), from its first slot
  };
  std::vector<std::vector<Gradient>> gradients;  // by train step
  std::span<float> exchange;                     // the plan's receive buffer
  std::size_t reduced = 0;
  double busy_ms = 0;
  bool ready = false, stopping = false;
  std::mutex mutex;
  std::condition_variable changed;
  std::thread thread;

  RingReducer(const Ranks &ranks, Executor &ex) : State(ranks, ex) {
    const Plan &plan = ex.plan;
    for (std::size_t t = 0; t < plan.tensors.size(); ++t)
      if (plan.tensors[t].role == Role::exchange) exchange = ex.tensor<float>(TensorId{int(t)});
    if (exchange.empty() && ranks.size > 1)
      throw std::logic_error("a data-parallel plan without a gradient exchange buffer");
    gradients.resize(buckets.size());
    for (std::size_t step = 0; step < buckets.size(); ++step)
      for (TensorId t : buckets[step]) {
        Gradient g{ex.tensor<float>(t), {}};
        const long long first = (long long)plan.tensors[std::size_t(t.index)].offset / 4;
        for (int c = 0; c < ranks.size; ++c)
          g.bounds.push_back(std::size_t(gradient_chunk(plan, plan.tensors[std::size_t(t.index)], c).first - first));
        g.bounds.push_back(g.values.size());
        gradients[step].push_back(std::move(g));
      }
    // MPI sets up what it keeps for these exchanges (request lists, per-thread and per-peer state)
    // at their first use: here, before any step, on the threads that make them (every bucket on
    // the communication thread, the parameters' gather here; nothing is initialized yet)
    Ranks::Sums sums;
    ranks.sum(sums);
    if (sharded) gather_parameters();
    thread = std::thread([this] {
      this->ranks.expect_early_messages();
      for (std::size_t step = 0; step < gradients.size(); ++step) reduce(step);
      run();
    });
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return ready; });
  }
  ~RingReducer() override {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    changed.notify_all();
    thread.join();
  }
  void reduce(std::size_t step) {  // sharded: each rank needs its shard's sums only
    for (const Gradient &g : gradients[step]) {
      ranks.reduce_scatter(g.values, g.bounds, exchange);
      if (!sharded) ranks.all_gather(g.values, g.bounds);
    }
  }
  void gather_parameters() override { ranks.all_gather(ex.tensor<float>(ex.plan.params()), shard_bounds); }
  void run() {  // the communication thread
    std::unique_lock lock(mutex);
    ready = true;
    changed.notify_all();
    while (true) {
      changed.wait(lock, [&] { return stopping || reduced < queued; });
      if (reduced == queued) return;  // stopping
      const std::size_t step = queue[reduced];
      lock.unlock();
      const auto t0 = std::chrono::steady_clock::now();
      reduce(step);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      lock.lock();
      busy_ms += ms;
      ++reduced;
      changed.notify_all();
    }
  }
  void finished(std::size_t step) {  // the executor's thread, after each train step
    if (gradients[step].empty()) return;
    {
      std::lock_guard lock(mutex);
      queue[queued++] = step;
    }
    changed.notify_all();
  }
  void start() override {
    std::lock_guard lock(mutex);
    queued = reduced = 0;
    busy_ms = 0;
    ex.finished = [this](std::size_t step) { finished(step); };
  }
  GradientReducer::Times finish() override {
    ex.finished = nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return reduced == queued; });
    return {busy_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count()};
  }
  std::string describe() const override { return "MPI ring"; }
};

// CUDA ranks: NCCL on the collectives stream, each bucket after an event of the compute stream
// recorded behind the kernel that finished it; the compute stream waits for the last bucket before
// the optimizer. With a sharded optimizer each part of a gradient in rank c's shard is reduced to
// rank c (ncclReduce, in place), and each rank's shard of the parameters broadcast after AdamW.
struct NcclReducer final : GradientReducer::State {
  std::size_t device_bytes = 0;
  std::unique_ptr<cuda::Nccl> nccl;
  // per train step with a bucket: its kernel done (compute stream), its collectives begun and done
  std::vector<cuda::Event> kernel_done, began, done;
  cuda::Event backward_done, reduced, optimized, gathered;

  static cuda::NcclId shared_id(const Ranks &ranks) {
    cuda::NcclId id{};
    if (ranks.rank == 0) id = cuda::nccl_unique_id();
    ranks.broadcast(id);
    return id;
  }
  NcclReducer(const Ranks &ranks, Executor &ex) : State(ranks, ex) {
    const std::size_t used_before = cuda::device_used_bytes();
    nccl = std::make_unique<cuda::Nccl>(shared_id(ranks), ranks.rank, ranks.size);
    for (std::size_t step = 0; step < buckets.size(); ++step) {
      const bool bucket = !buckets[step].empty();
      kernel_done.push_back(bucket ? cuda::event_create() : cuda::Event{});
      began.push_back(bucket ? cuda::event_create(true) : cuda::Event{});
      done.push_back(bucket ? cuda::event_create(true) : cuda::Event{});
    }
    backward_done = cuda::event_create(true);
    reduced = cuda::event_create(true);
    optimized = cuda::event_create();
    gathered = cuda::event_create();
    // NCCL connects its peers and allocates its buffers at a communicator's first collectives:
    // every bucket once, and the parameters' gather, before any step (the gradients are not yet
    // written; what they sum is overwritten by the first step)
    for (std::size_t step = 0; step < buckets.size(); ++step)
      if (!buckets[step].empty()) enqueue(step);
    if (sharded) gather_parameters();
    cuda::record(reduced, cuda::Stream::collectives);
    wait_for(reduced);
    const std::size_t used_after = cuda::device_used_bytes();  // (device-wide: others may free)
    device_bytes = used_after > used_before ? used_after - used_before : 0;
  }
  ~NcclReducer() override {
    for (auto *events : {&kernel_done, &began, &done})
      for (cuda::Event e : *events)
        if (e.handle) cuda::event_destroy(e);
    for (cuda::Event e : {backward_done, reduced, optimized, gathered}) cuda::event_destroy(e);
  }
  // The host waits for e, asking NCCL meanwhile whether a collective failed (a peer gone, a
  // network error): blocked in the CUDA runtime it would wait for ever.
  void wait_for(cuda::Event e) const {
    while (!cuda::done(e)) {
      nccl->check();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    nccl->check();
  }
  void enqueue(std::size_t step) {
    cuda::record(kernel_done[step], cuda::Stream::compute);
    cuda::wait(cuda::Stream::collectives, kernel_done[step]);
    cuda::record(began[step], cuda::Stream::collectives);
    const Plan &plan = ex.plan;
    nccl->group_start();
    for (TensorId t : buckets[step]) {
      float *g = ex.device_tensor<float>(t);
      const Tensor &tensor = plan.tensors[std::size_t(t.index)];
      if (!sharded) {
        nccl->all_reduce(g, tensor.bytes() / 4);
        continue;
      }
      const long long first = (long long)tensor.offset / 4;
      for (int c = 0; c < ranks.size; ++c)
        if (auto [from, to] = gradient_chunk(plan, tensor, c); to > from)
          nccl->reduce(g + (from - first), std::size_t(to - from), c);
    }
    nccl->group_end();
    cuda::record(done[step], cuda::Stream::collectives);
  }
  void start() override {
    queued = 0;
    ex.finished = [this](std::size_t step) {
      if (buckets[step].empty()) return;
      enqueue(step);
      queue[queued++] = step;
    };
  }
  GradientReducer::Times finish() override {
    ex.finished = nullptr;
    cuda::record(backward_done, cuda::Stream::compute);
    cuda::record(reduced, cuda::Stream::collectives);
    cuda::wait(cuda::Stream::compute, reduced);  // the optimizer reads the sums
    wait_for(reduced);
    cuda::synchronize(backward_done);  // (kernels after the last bucket's may still run)
    GradientReducer::Times times;
    for (std::size_t i = 0; i < queued; ++i) times.busy_ms += cuda::elapsed_ms(began[queue[i]], done[queue[i]]);
    times.wait_ms = std::max(0.f, cuda::elapsed_ms(backward_done, reduced));
    return times;
  }
  void gather_parameters() override {
    cuda::record(optimized, cuda::Stream::compute);
    cuda::wait(cuda::Stream::collectives, optimized);
    float *params = ex.device_tensor<float>(ex.plan.params());
    nccl->group_start();
    for (int c = 0; c < ranks.size; ++c)
      if (const std::size_t n = shard_bounds[std::size_t(c) + 1] - shard_bounds[std::size_t(c)]; n > 0)
        nccl->broadcast(params + shard_bounds[std::size_t(c)], n, c);
    nccl->group_end();
    cuda::record(gathered, cuda::Stream::collectives);
    cuda::wait(cuda::Stream::compute, gathered);
  }
  std::size_t device_bytes_outside_arena() const override { return device_bytes; }
  std::string describe() const override { return "NCCL " + cuda::Nccl::version(); }
};

std::unique_ptr<GradientReducer::State> make_reducer(const Ranks &ranks, Executor &ex) {
  if (ex.plan.policies.exchange_buffer) return std::make_unique<RingReducer>(ranks, ex);
  return std::make_unique<NcclReducer>(ranks, ex);
}

}  // namespace

GradientReducer::GradientReducer(const Ranks &ranks, Executor &ex) : state(make_reducer(ranks, ex)) {}
GradientReducer::~GradientReducer() = default;

void GradientReducer::start() { state->start(); }
GradientReducer::Times GradientReducer::finish() { return state->finish(); }
std::size_t GradientReducer::device_bytes_outside_arena() const { return state->device_bytes_outside_arena(); }
std::string GradientReducer::describe() const { return state->describe(); }

std::span<const float> GradientReducer::summed_gradients() const {
  const Plan &plan = state->ex.plan;
  state->ex.download(plan.grads());  // (CUDA; after the optimizer's wait for the last bucket)
  const std::span<const float> all = state->ex.tensor<float>(plan.grads());
  return state->sharded ? all.subspan(std::size_t(plan.shard_first), std::size_t(plan.shard_end - plan.shard_first))
                        : all;
}

void GradientReducer::gather_parameters() {
  if (state->sharded) state->gather_parameters();
}

Moments GradientReducer::gather_moments(std::vector<float> &m, std::vector<float> &v) {
  if (!state->sharded) return {};
  const Plan &plan = state->ex.plan;
  for (auto [whole, shard] : {std::pair{&m, plan.adam_m()}, std::pair{&v, plan.adam_v()}}) {
    whole->assign(state->shard_bounds.back(), 0.f);
    state->ex.download(shard);
    const std::span<const float> mine = state->ex.tensor<float>(shard);
    std::copy_n(mine.begin(), plan.shard_end - plan.shard_first, whole->begin() + plan.shard_first);
    state->ranks.all_gather(*whole, state->shard_bounds);  // (host memory: the MPI ring on GPUs too)
  }
  return {m, v};
}

}  // namespace remat::runtime
