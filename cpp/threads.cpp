// The threads of attnpp's parallel loops: the process-wide thread count, and the team that runs a loop's shares
// (common.hpp's parallel_for, which owns how a loop's tasks are split). The team is OpenMP's when the build has
// OpenMP (CMake's ATTNPP_OPENMP: -fopenmp defines _OPENMP), else a pool of std::thread: Apple's Clang and other
// compilers without an OpenMP runtime build the same core. Either way task i is computed by the same body(i), so
// results are bit for bit the same on every thread count and with either runtime (tests/test_threads.py,
// tools/bitwise_builds.py). Built for the baseline, like dispatch.cpp.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#if defined(_OPENMP)
#include <omp.h>
#else
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif
#if defined(__linux__)
#include <sched.h>
#endif
#endif

#include "common.hpp"

namespace attnpp {

#if defined(_OPENMP)

namespace {
int default_thread_count() { return omp_get_max_threads(); }  // OMP_NUM_THREADS, else the CPUs this process has
}  // namespace

void run_team(int threads, TeamTask task, void* context) {
#pragma omp parallel num_threads(threads)
  task(context, omp_get_thread_num());
}

std::string threading_runtime() { return "OpenMP " + std::to_string(_OPENMP); }

#else

namespace {

// OMP_NUM_THREADS as OpenMP reads it (its first value), else the CPUs this process may run on.
int default_thread_count() {
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    const long n = std::strtol(env, nullptr, 10);
    if (n >= 1) return int(std::min<long>(n, 256));
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// A spin-wait's pause: the core's hint that this is a spin loop.
inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// Worker threads 1, 2, ... that wait for a team's task; the caller is member 0. One caller at a time: another
// (a second Python thread, a loop inside a loop's body) runs its loop alone, as OpenMP gives a nested region a
// team of one. As OpenMP's, the threads spin a while before they sleep, the caller too before it waits for them:
// a thread woken from its sleep comes tens of microseconds (a loaded machine: milliseconds) late, and back-to-back
// loops of a few hundred microseconds (one layer's attention) then ran on the caller alone. They live until the
// process exits.
class Pool {
 public:
  bool run(int threads, TeamTask task, void* context) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    std::unique_lock<std::mutex> lock(mutex_);
    while (int(workers_) < threads - 1) {
      std::thread(&Pool::work, this, int(workers_) + 1, generation_.load()).detach();
      ++workers_;
    }
    task_ = task, context_ = context, members_ = threads, remaining_ = threads - 1;
    generation_.fetch_add(1);
    lock.unlock();
    wake_.notify_all();
    task(context, 0);
    for (int i = 0; i < kSpins && remaining_.load() != 0; ++i) pause();
    lock.lock();
    done_.wait(lock, [&] { return remaining_.load() == 0; });
    return true;
  }

 private:
  static constexpr int kSpins = 1 << 14;  // (some 100 us to 1 ms)

  void work(int member, unsigned long seen) {
    for (;;) {
      for (int i = 0; i < kSpins && generation_.load() == seen; ++i) pause();
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      seen = generation_.load();
      if (member >= members_) continue;  // a smaller team this time
      lock.unlock();
      task_(context_, member);
      lock.lock();
      if (remaining_.fetch_sub(1) == 1) done_.notify_one();
    }
  }

  std::mutex busy_;   // held by the caller whose loop the pool runs
  std::mutex mutex_;  // guards everything below (the atomics are read outside it too, by the spinning threads)
  std::condition_variable wake_, done_;
  unsigned workers_ = 0;
  std::atomic<unsigned long> generation_{0};  // one per loop
  TeamTask task_ = nullptr;
  void* context_ = nullptr;
  int members_ = 0;
  std::atomic<int> remaining_{0};
};

// The pool, never destroyed (its threads are detached and may be waiting at exit). A child process made by fork()
// has none of its parent's threads: it starts a pool of its own.
std::atomic<Pool*> the_pool{nullptr};
Pool& pool() {
  static const bool registered = [] {
#if defined(__unix__) || defined(__APPLE__)
    pthread_atfork(nullptr, nullptr, [] { the_pool.store(new Pool); });
#endif
    return true;
  }();
  (void)registered;
  Pool* p = the_pool.load();
  if (!p) {
    Pool* fresh = new Pool;
    if (the_pool.compare_exchange_strong(p, fresh)) return *fresh;
    delete fresh;
  }
  return *p;
}

}  // namespace

void run_team(int threads, TeamTask task, void* context) {
  if (threads <= 1 || !pool().run(threads, task, context)) task(context, 0);
}

std::string threading_runtime() { return "std::thread pool (built without OpenMP)"; }

#endif

namespace {
std::atomic<int>& thread_count_setting() {
  static std::atomic<int> n{default_thread_count()};
  return n;
}
}  // namespace

int thread_count() { return thread_count_setting().load(std::memory_order_relaxed); }
void set_thread_count(int n) { thread_count_setting() = n; }

}  // namespace attnpp
