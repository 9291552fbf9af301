// Data-parallel ranks on MPI (Open MPI's mpirun): the world, sums over it, and the start-up check
// that every rank runs the same build and flags.
module;
#include <HalideRuntime.h>
#include <mpi.h>

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
  local_size = environment_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
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
  MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);  // (MPI_Abort does not return)
}

std::size_t Ranks::most(std::size_t v) const {
  unsigned long most = v;
  if (size > 1) MPI_Allreduce(MPI_IN_PLACE, &most, 1, MPI_UNSIGNED_LONG, MPI_MAX, MPI_COMM_WORLD);
  return most;
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

struct GradientReducer::State {
  struct Gradient {
    std::span<float> values;
    std::vector<std::size_t> bounds;  // of its chunks (gradient_chunk), from its first slot
  };
  const Ranks &ranks;
  Executor &ex;
  const bool sharded;
  std::vector<std::vector<Gradient>> buckets;  // by train step: the gradients it finishes
  std::span<float> exchange;                   // the plan's receive buffer
  std::vector<std::size_t> shard_bounds;       // of the ranks' shards of the flat parameters
  // the steps whose buckets wait, in order (room for every step: nothing allocated while training)
  std::vector<std::size_t> queue;
  std::size_t queued = 0, reduced = 0;
  double busy_ms = 0;
  bool ready = false, stopping = false;
  std::mutex mutex;
  std::condition_variable changed;
  std::thread thread;

  State(const Ranks &ranks, Executor &ex) : ranks(ranks), ex(ex), sharded(ex.plan.policies.shard_optimizer) {
    make_buckets();
    const Plan &plan = ex.plan;
    for (int c = 0; c <= ranks.size; ++c)
      shard_bounds.push_back(std::size_t(std::min(plan.shard_slots * c, plan.tensors[plan.params().index].extent[0])));
    queue.resize(plan.train.size());
    // MPI sets up what it keeps for these exchanges (request lists, per-thread and per-peer state)
    // at their first use: here, before any step, on the threads that make them (every bucket on
    // the communication thread, the parameters' gather here; nothing is initialized yet)
    Ranks::Sums sums;
    ranks.sum(sums);
    if (sharded) gather_parameters();
    thread = std::thread([this] {
      this->ranks.expect_early_messages();
      for (std::size_t step = 0; step < buckets.size(); ++step) reduce(step);
      run();
    });
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return ready; });
  }
  ~State() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    changed.notify_all();
    thread.join();
  }
  // Each gradient goes to the bucket of the last train step that writes it.
  void make_buckets() {
    const Plan &plan = ex.plan;
    std::vector<int> last_writer(plan.tensors.size(), -1);
    for (std::size_t t = 0; t < plan.tensors.size(); ++t)
      if (plan.tensors[t].role == Role::exchange) exchange = ex.tensor<float>(TensorId{int(t)});
    if (exchange.empty()) throw std::logic_error("a data-parallel plan without a gradient exchange buffer");
    for (std::size_t i = 0; i < plan.train.size(); ++i)
      for (const Arg &a : plan.train[i].args)
        if (a.access == Access::write && plan.tensors[std::size_t(a.tensor)].role == Role::grads)
          last_writer[std::size_t(a.tensor)] = int(i);
    buckets.resize(plan.train.size());
    for (std::size_t t = 0; t < plan.tensors.size(); ++t) {
      if (last_writer[t] < 0) continue;
      Gradient g{ex.tensor<float>(TensorId{int(t)}), {}};
      const long long first = (long long)plan.tensors[t].offset / 4;
      for (int c = 0; c < ranks.size; ++c)
        g.bounds.push_back(std::size_t(gradient_chunk(plan, plan.tensors[t], c).first - first));
      g.bounds.push_back(g.values.size());
      buckets[std::size_t(last_writer[t])].push_back(std::move(g));
    }
  }
  void reduce(std::size_t step) {  // sharded: each rank needs its shard's sums only
    for (const Gradient &g : buckets[step]) {
      ranks.reduce_scatter(g.values, g.bounds, exchange);
      if (!sharded) ranks.all_gather(g.values, g.bounds);
    }
  }
  void gather_parameters() { ranks.all_gather(ex.tensor<float>(ex.plan.params()), shard_bounds); }
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
    if (buckets[step].empty()) return;
    {
      std::lock_guard lock(mutex);
      queue[queued++] = step;
    }
    changed.notify_all();
  }
};

GradientReducer::GradientReducer(const Ranks &ranks, Executor &ex) : state(std::make_unique<State>(ranks, ex)) {}
GradientReducer::~GradientReducer() = default;

void GradientReducer::start() {
  std::lock_guard lock(state->mutex);
  state->queued = state->reduced = 0;
  state->busy_ms = 0;
  state->ex.finished = [s = state.get()](std::size_t step) { s->finished(step); };
}

GradientReducer::Times GradientReducer::finish() {
  state->ex.finished = nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock lock(state->mutex);
  state->changed.wait(lock, [&] { return state->reduced == state->queued; });
  return {state->busy_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count()};
}

std::span<const float> GradientReducer::summed_gradients() const {
  const Plan &plan = state->ex.plan;
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
    const std::span<const float> mine = state->ex.tensor<float>(shard);
    std::copy_n(mine.begin(), plan.shard_end - plan.shard_first, whole->begin() + plan.shard_first);
    state->ranks.all_gather(*whole, state->shard_bounds);
  }
  return {m, v};
}

}  // namespace remat::runtime
