// Dispatch of the batch-invariant kernels: the instruction set (AVX2 + FMA where the CPU has
// both, else the portable build: the same results either way), a small thread pool that splits
// rows, tiles or (query, head) pairs among threads, and the seeded Gumbel-max sampler.
#include "exact.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace moe_rl {
namespace exact {

bool avx2_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool avx512_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return avx2_supported() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

namespace {

const Isa* current_isa() {
  static const Isa* isa = avx512_supported() ? &isa_avx512() : avx2_supported() ? &isa_avx2() : &isa_generic();
  return isa;
}
std::atomic<const Isa*> g_isa{nullptr};

const Isa& isa() {
  const Isa* p = g_isa.load(std::memory_order_relaxed);
  if (!p) {
    p = current_isa();
    g_isa.store(p);
  }
  return *p;
}

std::atomic<int> g_last_threads{1};

// Runs fn over [0, n) in chunks of `chunk` items on up to `threads` threads (the caller is one
// of them). Which thread takes which chunk changes nothing: every output is computed whole by
// one call of fn. A call made while another is running (another Python thread) runs alone.
class Pool {
 public:
  void run(int64_t n, int64_t chunk, int threads, const std::function<void(int64_t, int64_t)>& fn) {
    chunk = std::max<int64_t>(chunk, 1);
    const int64_t chunks = (n + chunk - 1) / chunk;
    threads = int(std::min<int64_t>(threads, chunks));
    std::unique_lock<std::mutex> submit(submit_, std::try_to_lock);
    if (threads <= 1 || !submit.owns_lock()) {
      g_last_threads.store(1);
      fn(0, n);
      return;
    }
    g_last_threads.store(threads);
    ensure_workers(threads - 1);
    {
      std::lock_guard<std::mutex> lk(m_);
      fn_ = &fn;
      n_ = n;
      chunk_ = chunk;
      next_.store(0);
      tickets_ = threads - 1;
      ++gen_;
    }
    cv_work_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(m_);
    tickets_ = 0;  // every chunk is taken: late workers need not start
    cv_done_.wait(lk, [&] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work() {
    for (;;) {
      const int64_t b = next_.fetch_add(1) * chunk_;
      if (b >= n_) return;
      (*fn_)(b, std::min(n_, b + chunk_));
    }
  }
  void loop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      cv_work_.wait(lk, [&] { return gen_ != seen && tickets_ > 0; });
      seen = gen_;
      --tickets_;
      ++busy_;
      lk.unlock();
      work();
      lk.lock();
      if (--busy_ == 0) cv_done_.notify_all();
    }
  }
  void ensure_workers(int n) {
    if (pid_ != getpid()) {  // a forked child has none of its parent's threads
      (void)new std::vector<std::thread>(std::move(workers_));  // never joined: leaked on purpose
      workers_.clear();
      pid_ = getpid();
    }
    while (int(workers_.size()) < n) {
      workers_.emplace_back([this] { loop(); });
      workers_.back().detach();
    }
  }

  std::mutex submit_, m_;
  std::condition_variable cv_work_, cv_done_;
  std::vector<std::thread> workers_;
  pid_t pid_ = getpid();
  uint64_t gen_ = 0;
  int tickets_ = 0, busy_ = 0;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  std::atomic<int64_t> next_{0};
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: its threads may outlive static destruction
  return *p;
}

// Threads worth using for `work` multiply-adds: fewer than ~512k per thread (~20 us) costs more to wake
// the thread than it saves.
int threads_for(int threads, double work) {
  const double per = 524288.0;
  return int(std::max(1.0, std::min(double(std::max(threads, 1)), work / per)));
}

// items per chunk: a few chunks per thread, each at least `min_work` multiply-adds
int64_t chunk_for(int64_t n, int threads, double work_per_item) {
  const int64_t by_threads = (n + 4 * threads - 1) / (4 * threads);
  const int64_t by_work = int64_t(std::ceil(16384.0 / std::max(work_per_item, 1.0)));
  return std::max<int64_t>(1, std::min(std::max(by_threads, by_work), n));
}

// Splits n items (work_per_item multiply-adds each) among threads: fn(i0, i1) per chunk.
template <class F>
void split(int64_t n, double work_per_item, int threads, F&& fn) {
  const int nt = threads_for(threads, work_per_item * double(n));
  pool().run(n, chunk_for(n, nt, work_per_item), nt, fn);
}

uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

uint32_t row_key(int64_t seed, int64_t pos) {
  const uint64_t s = uint64_t(seed), p = uint64_t(pos);
  uint32_t h = mix32(uint32_t(s) ^ mix32(uint32_t(s >> 32) + 0x9e3779b9u));
  h = mix32(h ^ uint32_t(p));
  return mix32(h ^ mix32(uint32_t(p >> 32) + 0x7f4a7c15u));
}

// a uniform in (0, 1): the hash's top 24 bits, centred in their interval (exact in fp32)
float uniform(uint32_t key, int64_t v) {
  const uint32_t h = mix32(key + uint32_t(v) * 0x9e3779b9u);
  return (float(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

}  // namespace

const char* isa_name() { return isa().name; }

int last_threads() { return g_last_threads.load(); }

void set_isa(const char* name) {
  const std::string n(name);
  if (n == "avx512") {
    if (!avx512_supported()) throw std::invalid_argument("this CPU lacks AVX-512F/VL (or AVX2 + FMA)");
    g_isa.store(&isa_avx512());
  } else if (n == "avx2") {
    if (!avx2_supported()) throw std::invalid_argument("this CPU lacks AVX2 + FMA");
    g_isa.store(&isa_avx2());
  } else if (n == "generic") {
    g_isa.store(&isa_generic());
  } else {
    throw std::invalid_argument("isa must be 'avx512', 'avx2' or 'generic', got '" + n + "'");
  }
}

void linear(const LinearArgs& a, int threads) {
  if (a.offs) {  // group ends: non-decreasing from >= 0, the last = M
    int64_t prev = 0;
    for (int64_t g = 0; g < a.groups; ++g) {
      if (a.offs[g] < prev) throw std::invalid_argument("grouped linear: offs must be non-decreasing group ends >= 0");
      prev = a.offs[g];
    }
    if (a.groups > 0 && prev != a.M)
      throw std::invalid_argument("grouped linear: the last group end (" + std::to_string(prev) +
                                  ") must equal the rows (" + std::to_string(a.M) + ")");
  }
  if (a.M == 0 || a.N == 0) return;
  // tasks: row blocks x column blocks (x groups); a task's outputs come from one call
  constexpr int64_t RB = 32, CB = 96;
  std::vector<LinearTask> tasks;
  const int64_t groups = a.offs ? a.groups : 1;
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t end = a.offs ? a.offs[g] : a.M;
    for (int64_t m = start; m < end; m += RB)
      for (int64_t n = 0; n < a.N; n += CB)
        tasks.push_back({m, n, int32_t(std::min(RB, end - m)), int32_t(std::min(CB, a.N - n)), int32_t(g)});
    start = end;
  }
  const Isa& f = isa();
  const LinearTask* t = tasks.data();
  split(int64_t(tasks.size()), double(std::min(RB, a.M)) * double(std::min(CB, a.N)) * double(a.K), threads,
        [&](int64_t t0, int64_t t1) { f.linear(a, t, t0, t1); });
}

void rms_norm(const RmsNormArgs& a, int threads) {
  const Isa& f = isa();
  split(a.M, double(a.H) * 4, threads, [&](int64_t r0, int64_t r1) { f.rms_norm(a, r0, r1); });
}

void softmax(const SoftmaxArgs& a, int threads) {
  const Isa& f = isa();
  split(a.M, double(a.V) * 8, threads, [&](int64_t r0, int64_t r1) { f.softmax(a, r0, r1); });
}

void attention(const AttentionArgs& a, int threads) {
  if (a.Hkv <= 0 || a.Hq % a.Hkv) throw std::invalid_argument("attention: Hq must be a multiple of Hkv");
  if (a.Dqk > MAX_HEAD_DIM || a.Dv > MAX_HEAD_DIM)
    throw std::invalid_argument("attention: head dims above " + std::to_string(MAX_HEAD_DIM));
  if (a.cu_q[0] != 0 || a.cu_q[a.S] != a.Nq) throw std::invalid_argument("attention: cu_seqlens_q must run from 0 to Nq");
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t n = a.cu_q[s + 1] - a.cu_q[s];
    if (n < 0) throw std::invalid_argument("attention: cu_seqlens_q decreases at sequence " + std::to_string(s));
    if (n == 0) continue;
    if (a.pos0[s] < 0 || a.kv_seq[s] < 0 || a.kv_seq[s] >= a.Sk || a.kv_start[s] < 0 ||
        a.kv_start[s] + a.pos0[s] + n > a.T)
      throw std::out_of_range("attention: sequence " + std::to_string(s) + " reads keys outside the key buffers");
  }
  const Isa& f = isa();
  // work of an item ~ its keys x head dims; the longest context bounds it
  int64_t longest = 1;
  for (int64_t s = 0; s < a.S; ++s)
    longest = std::max<int64_t>(longest, a.pos0[s] + (a.cu_q[s + 1] - a.cu_q[s]));
  if (a.window > 0) longest = std::min(longest, a.window);
  split(a.Nq * a.Hq, double(longest) * double(a.Dqk + a.Dv + 8) * 0.5, threads,
        [&](int64_t i0, int64_t i1) { f.attention(a, i0, i1); });
}

void eltwise(const EltwiseArgs& a, int threads) {
  const Isa& f = isa();
  split(a.rows, double(a.cols) * 16, threads, [&](int64_t r0, int64_t r1) { f.eltwise(a, r0, r1); });
}

void combine(const CombineArgs& a, int threads) {
  const Isa& f = isa();
  split(a.T, double(a.k) * double(a.H), threads, [&](int64_t r0, int64_t r1) { f.combine(a, r0, r1); });
}

void exp(const float* x, float* y, int64_t n) { isa().exp(x, y, n); }

void gumbel_argmax(const float* logp, int64_t sl, int64_t R, int64_t V, const int64_t* seed, const int64_t* pos,
                   int64_t* out, int threads) {
  split(R, double(V) * 32, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = logp + r * sl;
      const uint32_t key = row_key(seed[r], pos[r]);
      float best = -INFINITY;
      int64_t arg = 0;
      for (int64_t v = 0; v < V; ++v) {
        if (!(x[v] > -INFINITY)) continue;  // excluded (or NaN): never picked
        const float g = -std::log(-std::log(uniform(key, v)));
        const float z = x[v] + g;
        if (z > best) {
          best = z;
          arg = v;
        }
      }
      out[r] = arg;
    }
  });
}

void gumbel_uniform(const int64_t* seed, const int64_t* pos, int64_t R, int64_t V, float* out) {
  for (int64_t r = 0; r < R; ++r) {
    const uint32_t key = row_key(seed[r], pos[r]);
    for (int64_t v = 0; v < V; ++v) out[r * V + v] = uniform(key, v);
  }
}

}  // namespace exact
}  // namespace moe_rl
