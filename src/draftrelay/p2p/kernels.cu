// draftrelay.p2p native kernels: one-shot push all-reduce and argmax exchange between the GPUs of one
// host, driven by one controller process (one launch per rank, each on that rank's stream).
//
// Why plain CUDA C behind a C ABI (loaded with ctypes) rather than a torch C++ extension:
//  * this file includes no torch header, so plain `nvcc -shared` builds it in seconds, and a machine
//    without a CUDA torch (the CPU dev box, CI) can still compile-check it;
//  * the .so does not depend on torch's C++ ABI, so a torch upgrade never needs a rebuild;
//  * pip install never needs nvcc: native.py builds this file at first use on the GPU machine
//    (draftrelay/cudabuild.py) and caches the .so (keyed by source hash and arch).
// The kernels launch on the caller's stream handle, so they are captured into CUDA graphs like any
// torch kernel.
//
// Protocol (per rank r, per launch, per block b of a fixed grid of G blocks):
//   e = epoch + 1 (device-resident counter; a graph replay advances it), slot p = e & 1.
//   1. wait ack[q][b] >= e - 2 from every peer q: q has consumed what we pushed into slot p two
//      epochs ago (lazy consumption acknowledgment: usually already there, so it costs no round trip).
//   2. push our chunk into q's recv[p][r][b] (NVLink stores), then st.release.sys flag[p][r][b] = (e, tag)
//      on q.
//   3. wait (ld.acquire.sys) for every peer's flag[p][q][b] == (e, tag) on our own memory.
//   4. combine in fp32 in rank order 0..N-1 (the same bits on every rank), round once, store.
//   5. st.release.sys ack[r][b] = e on every peer q.
//   6. the last block to finish publishes epoch = e.
// Every wait is bounded by %globaltimer; a timeout, a bad flag/id, a host cancel or epoch exhaustion
// sets the rank's error word and mirrors a bit into every peer's error word. A launch that finds its
// error word non-zero does nothing (the pair stays poisoned until a drained reset).

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <math.h>
#include <time.h>

#define P2P_MAXR 8

// error bits (mirrored to the peers: local timeout -> peer timeout on them, the rest as is)
#define ERR_LOCAL_TIMEOUT 1u
#define ERR_PEER_TIMEOUT 2u
#define ERR_INVALID_ID 4u
#define ERR_CANCELLED 8u
#define ERR_EPOCH_EXHAUSTED 16u
#define ERR_SEEN 0x80000000u  // internal: the error word was already set by someone else

typedef unsigned long long u64;

// header words of one rank's state
#define H_EPOCH 0
#define H_DONE 1
#define H_ERR 2
#define H_ARRIVE 3

// protocol mode bits (runtime, for measuring the cost of each ordering choice; see docs/P2P.md)
#define M_SPIN_RELAXED 1u   // spin with relaxed loads, one acquire load once the value is there
#define M_ACK_RELAXED 2u    // consumption acks as relaxed stores (no release fence)
#define M_SINGLE_FLAG 4u    // one flag per op: the last block to finish pushing releases it
#define M_EAGER_CANCEL 8u   // poll the host cancel word from the first iterations (else after 20 us)
#define M_BLOCK_EPOCH 16u   // one epoch word per block (no end-of-kernel atomic to find the last block)
// Mode bits this build accepts; p2p_ctx_new refuses any other. A measurement build that includes this
// file (benchmarks/p2p_unfenced.cu) adds its own bits and its own P2P_FLAG_STORE.
#ifndef P2P_EXTRA_MODES
#define P2P_EXTRA_MODES 0u
#endif
#define P2P_KNOWN_MODES (M_SPIN_RELAXED | M_ACK_RELAXED | M_SINGLE_FLAG | M_EAGER_CANCEL | M_BLOCK_EPOCH | P2P_EXTRA_MODES)

struct Ctx {
  int rank, nranks, G, threads, dev;
  unsigned mode;
  u64 region;       // bytes of one (parity, source, block) receive region
  u64 timeout_ns;
  unsigned* hdr[P2P_MAXR];   // per rank: [epoch, done, err, pad]
  u64* flags[P2P_MAXR];      // per rank: [2][N][G]  (epoch << 32 | tag)
  u64* acks[P2P_MAXR];       // per rank: [N][G]     (epoch consumed by receiver q, written by q)
  unsigned* bep;             // this rank's per-block epochs [G] (M_BLOCK_EPOCH)
  char* recv[P2P_MAXR];      // per rank: [2][N][G][region]
  unsigned* cancel;          // host-mapped word: non-zero = cancel every wait
};

// ------------------------------------------------------------------------------------------------
// memory-model helpers

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_relaxed_sys64(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_sys(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ unsigned ld_relaxed_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 gtimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ void raise_err(const Ctx& c, unsigned local_bits) {
  unsigned peer_bits = (local_bits & ~ERR_LOCAL_TIMEOUT) | ((local_bits & ERR_LOCAL_TIMEOUT) ? ERR_PEER_TIMEOUT : 0u);
  atomicOr_system(c.hdr[c.rank] + H_ERR, local_bits);
  for (int q = 0; q < c.nranks; ++q)
    if (q != c.rank) atomicOr_system(c.hdr[q] + H_ERR, peer_bits);
  __threadfence_system();
}

// Bounded spin on a 64-bit word. ready(v) returns 1 (done), 0 (keep waiting) or -1 (invalid).
// Returns 0 on success, else error bits (ERR_SEEN | bits when our error word was already set by a
// peer's mirror). The host cancel word lives in host memory: each read is a PCIe round trip, and such
// reads from many blocks serialize (~1 us per block per op measured with M_EAGER_CANCEL). So it is
// polled only once a wait is older than 20 us, every 16 iterations by block 0 and every 4096 by the
// others; a cancel seen by one block sets the local error word, which every block polls cheaply.
// (Polling from every block after 20 us was metastable on the pair: once an op took > 20 us, all 64
// blocks read host memory and every following op took ~68 us.)
template <class F>
__device__ unsigned bounded_wait(const Ctx& c, const u64* p, F ready) {
  const bool relaxed = c.mode & M_SPIN_RELAXED;
  u64 t0 = gtimer();
  for (unsigned it = 0;; ++it) {
    u64 v = relaxed ? ld_relaxed_sys64(p) : ld_acquire_sys(p);
    int r = ready(v);
    if (r != 0 && relaxed) r = ready(ld_acquire_sys(p));  // the acquire that orders what follows
    if (r > 0) return 0;
    if (r < 0) return ERR_INVALID_ID;
    if ((it & 15u) == 15u) {
      unsigned e = ld_relaxed_sys(c.hdr[c.rank] + H_ERR);
      if (e) return ERR_SEEN | e;
      u64 dt = gtimer() - t0;
      bool poll = (c.mode & M_EAGER_CANCEL) || (dt > 20000ull && (blockIdx.x == 0 || (it & 4095u) == 4095u));
      if (poll && ld_relaxed_sys(c.cancel)) return ERR_CANCELLED;
      if (dt > c.timeout_ns) return ERR_LOCAL_TIMEOUT;
    }
  }
}

__device__ __forceinline__ void note_err(const Ctx& c, unsigned r, unsigned* s_err) {
  if (!r) return;
  if (!(r & ERR_SEEN)) raise_err(c, r);
  atomicOr(s_err, r);
}

// Prologue, thread 0 only: refuse when poisoned, fail closed at exhaustion. Sets *s_e, *s_err.
__device__ void prologue(const Ctx& c, unsigned* s_e, unsigned* s_err) {
  unsigned err = ld_relaxed_sys(c.hdr[c.rank] + H_ERR);
  unsigned cur = (c.mode & M_BLOCK_EPOCH) ? *(volatile unsigned*)(c.bep + blockIdx.x)
                                          : *(volatile unsigned*)(c.hdr[c.rank] + H_EPOCH);
  *s_err = 0;
  if (err) {
    *s_err = ERR_SEEN | err;
  } else if (cur == 0xFFFFFFFFu) {
    raise_err(c, ERR_EPOCH_EXHAUSTED);
    *s_err = ERR_EPOCH_EXHAUSTED;
  }
  *s_e = cur + 1u;  // 0 only when exhausted, and then nothing is published
}

// Step 1: wait until every peer has consumed what we pushed into this slot two epochs ago.
// The ack word is read once at kernel start (in parallel with the prologue's loads); it is usually
// already there, so the common case costs no extra memory round trip.
__device__ __forceinline__ const u64* ack_word(const Ctx& c) {
  int q = (c.rank + (int)threadIdx.x) % c.nranks;
  return c.acks[c.rank] + (u64)q * c.G + blockIdx.x;
}
__device__ __forceinline__ u64 early_ack(const Ctx& c) {
  int t = threadIdx.x;
  return (t >= 1 && t < c.nranks) ? ld_acquire_sys(ack_word(c)) : 0ull;
}
__device__ void wait_acks(const Ctx& c, unsigned e, u64 early, unsigned* s_err) {
  int t = threadIdx.x;
  if (t >= 1 && t < c.nranks) {
    u64 need = e >= 2u ? (u64)(e - 2u) : 0ull;
    if (early >= need) return;
    unsigned r = bounded_wait(c, ack_word(c), [&](u64 v) { return v >= need ? 1 : 0; });
    note_err(c, r, s_err);
  }
}

__device__ __forceinline__ u64 slot_off(const Ctx& c, unsigned parity, int src) {
  return (((u64)parity * c.nranks + src) * c.G + blockIdx.x);
}

__device__ __forceinline__ u64 flag_index(const Ctx& c, unsigned parity, int src) {
  int blk = (c.mode & M_SINGLE_FLAG) ? 0 : blockIdx.x;
  return (((u64)parity * c.nranks + src) * c.G + blk);
}

// How a flag is published: a release store at system scope, so every push this block made before it
// is visible to the peer that acquires the flag. (Only a measurement build may redefine it.)
#ifndef P2P_FLAG_STORE
#define P2P_FLAG_STORE(c, p, v) st_release_sys((p), (v))
#endif

// Step 2b: publish our flags on every peer (after a barrier that ends every thread's pushes).
// Per-block: each block releases its own flag. M_SINGLE_FLAG: each block arrives on a local counter
// (acq_rel, gpu scope: orders its pushes before the arrival); the last one releases one flag per peer
// at system scope, which covers every block's pushes by cumulativity.
__device__ void publish_flags(const Ctx& c, unsigned e, unsigned tag) {
  int t = threadIdx.x;
  const u64 val = ((u64)e << 32) | tag;
  if (c.mode & M_SINGLE_FLAG) {
    if (t == 0) {
      unsigned old = atom_add_acq_rel_gpu(c.hdr[c.rank] + H_ARRIVE, 1u);
      if (old == (unsigned)c.G - 1u) {
        c.hdr[c.rank][H_ARRIVE] = 0u;  // the next launch (stream order) starts from zero
        for (int k = 1; k < c.nranks; ++k) {
          int q = (c.rank + k) % c.nranks;
          P2P_FLAG_STORE(c, c.flags[q] + flag_index(c, e & 1u, c.rank), val);
        }
      }
    }
    return;
  }
  if (t >= 1 && t < c.nranks) {
    int q = (c.rank + t) % c.nranks;
    P2P_FLAG_STORE(c, c.flags[q] + flag_index(c, e & 1u, c.rank), val);
  }
}

// Step 3: wait for every peer's flag for (slot, block) to carry (e, tag).
__device__ void wait_flags(const Ctx& c, unsigned e, unsigned tag, unsigned* s_err) {
  int t = threadIdx.x;
  if (t >= 1 && t < c.nranks) {
    int q = (c.rank + t) % c.nranks;
    const u64* f = c.flags[c.rank] + flag_index(c, e & 1u, q);
    unsigned older = e >= 2u ? e - 2u : 0u;
    unsigned r = bounded_wait(c, f, [&](u64 v) {
      unsigned ve = (unsigned)(v >> 32);
      if (ve == e) return ((unsigned)v == tag) ? 1 : -1;  // same epoch, other collective: desync
      if (ve == older || ve == 0u) return 0;                // the slot's previous use, or reset
      return -1;                                            // anything else: out of sequence
    });
    note_err(c, r, s_err);
  }
}

// Step 5: tell every peer we consumed its data in this slot.
__device__ void publish_acks(const Ctx& c, unsigned e) {
  int t = threadIdx.x;
  if (t >= 1 && t < c.nranks) {
    int q = (c.rank + t) % c.nranks;
    u64* a = c.acks[q] + (u64)c.rank * c.G + blockIdx.x;
    // relaxed is enough in practice: every read of the slot returned before the barrier above
    if (c.mode & M_ACK_RELAXED)
      st_relaxed_sys(a, (u64)e);
    else
      st_release_sys(a, (u64)e);
  }
}

// Step 6: the last block publishes the epoch (the next launch in stream order reads it).
// A launch refused at its start (poisoned, exhausted) advances nothing.
__device__ void epilogue(const Ctx& c, unsigned e, bool refused) {
  if (threadIdx.x == 0 && (c.mode & M_BLOCK_EPOCH)) {
    if (e != 0u && !refused) {
      c.bep[blockIdx.x] = e;
      if (blockIdx.x == 0) c.hdr[c.rank][H_EPOCH] = e;  // what the host reads
    }
    return;
  }
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned old = atomicAdd(c.hdr[c.rank] + H_DONE, 1u);
    if (old == (unsigned)c.G - 1u) {
      c.hdr[c.rank][H_DONE] = 0u;
      if (e != 0u && !refused) c.hdr[c.rank][H_EPOCH] = e;
      __threadfence();
    }
  }
}

// ------------------------------------------------------------------------------------------------
// all-reduce (sum)

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void __launch_bounds__(1024) k_allreduce(Ctx c, const T* __restrict__ x, T* y, long long n,
                                                    long long per, unsigned tag, int vec, int preload) {
  if (preload) return;
  __shared__ unsigned s_e, s_err;
  const u64 early = early_ack(c);  // overlaps the prologue's loads
  if (threadIdx.x == 0) prologue(c, &s_e, &s_err);
  __syncthreads();
  const unsigned e = s_e;
  const bool refused = s_err != 0;
  const int b = blockIdx.x, t = threadIdx.x, nt = blockDim.x, N = c.nranks;
  const long long start = (long long)b * per;
  const long long cnt = start < n ? min(per, n - start) : 0;
  const unsigned par = e & 1u;
  constexpr int VE = 16 / sizeof(T);
  const long long nv = vec ? cnt / VE : 0;  // full 16-byte vectors
  const long long v_end = nv * VE;

  if (!s_err) wait_acks(c, e, early, &s_err);
  __syncthreads();
  if (!s_err) {
    // push our chunk into every peer's receive region (one load, N-1 NVLink stores)
    const int4* xs = reinterpret_cast<const int4*>(x + start);
    for (long long i = t; i < nv; i += nt) {
      int4 v = xs[i];
      for (int k = 1; k < N; ++k) {
        int q = (c.rank + k) % N;
        int4* d = reinterpret_cast<int4*>(c.recv[q] + slot_off(c, par, c.rank) * c.region);
        d[i] = v;
      }
    }
    for (long long i = v_end + t; i < cnt; i += nt) {
      T v = x[start + i];
      for (int k = 1; k < N; ++k) {
        int q = (c.rank + k) % N;
        reinterpret_cast<T*>(c.recv[q] + slot_off(c, par, c.rank) * c.region)[i] = v;
      }
    }
  }
  __syncthreads();
  if (!s_err) {
    publish_flags(c, e, tag);
    wait_flags(c, e, tag, &s_err);
  }
  __syncthreads();
  if (!s_err) {
    // combine in rank order 0..N-1 in fp32 and round once: the same bits on every rank
    const int4* xs = reinterpret_cast<const int4*>(x + start);
    int4* ys = reinterpret_cast<int4*>(y + start);
    for (long long i = t; i < nv; i += nt) {
      float acc[VE];
      for (int k = 0; k < N; ++k) {
        int4 v = (k == c.rank) ? xs[i]
                               : reinterpret_cast<const int4*>(c.recv[c.rank] + slot_off(c, par, k) * c.region)[i];
        const T* vt = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int j = 0; j < VE; ++j) acc[j] = (k == 0) ? to_f<T>(vt[j]) : acc[j] + to_f<T>(vt[j]);
      }
      int4 o;
      T* ot = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int j = 0; j < VE; ++j) ot[j] = from_f<T>(acc[j]);
      ys[i] = o;
    }
    for (long long i = v_end + t; i < cnt; i += nt) {
      float acc = 0.f;
      for (int k = 0; k < N; ++k) {
        T v = (k == c.rank) ? x[start + i]
                            : reinterpret_cast<const T*>(c.recv[c.rank] + slot_off(c, par, k) * c.region)[i];
        acc = (k == 0) ? to_f<T>(v) : acc + to_f<T>(v);
      }
      y[start + i] = from_f<T>(acc);
    }
  }
  __syncthreads();
  if (!s_err) publish_acks(c, e);
  epilogue(c, e, refused);
}

// ------------------------------------------------------------------------------------------------
// argmax exchange: per row (top1 value, global id, top2 value); ties go to the lower id; a NaN top1
// wins (like torch.max). top2 is the larger of the winner's top2 and every other rank's top1.

struct Entry {
  float v1;
  int idx;
  float v2;
  unsigned pad;
};

__device__ __forceinline__ bool better(float av, int ai, float bv, int bi) {
  bool an = isnan(av), bn = isnan(bv);
  if (an != bn) return an;
  if (!an && av != bv) return av > bv;
  return ai < bi;
}

__global__ void __launch_bounds__(1024) k_argmax_xchg(Ctx c, const float* v1, const long long* idx, const float* v2,
                                                      float* o1, long long* oidx, float* o2, long long rows,
                                                      long long per, long long vocab, unsigned tag, int preload) {
  if (preload) return;
  __shared__ unsigned s_e, s_err;
  const u64 early = early_ack(c);  // overlaps the prologue's loads
  if (threadIdx.x == 0) prologue(c, &s_e, &s_err);
  __syncthreads();
  const unsigned e = s_e;
  const bool refused = s_err != 0;
  const int b = blockIdx.x, t = threadIdx.x, N = c.nranks;
  const long long start = (long long)b * per;
  const long long cnt = start < rows ? min(per, rows - start) : 0;
  const unsigned par = e & 1u;

  if (!s_err) wait_acks(c, e, early, &s_err);
  __syncthreads();
  Entry mine;
  if (!s_err) {
    for (long long i = t; i < cnt; i += blockDim.x) {
      mine.v1 = v1[start + i];
      long long id = idx[start + i];
      mine.idx = (id >= 0 && id < vocab) ? (int)id : -1;  // an invalid id travels as -1
      mine.v2 = v2 ? v2[start + i] : -INFINITY;
      mine.pad = 0;
      for (int k = 1; k < N; ++k) {
        int q = (c.rank + k) % N;
        reinterpret_cast<Entry*>(c.recv[q] + slot_off(c, par, c.rank) * c.region)[i] = mine;
      }
    }
  }
  __syncthreads();
  if (!s_err) {
    publish_flags(c, e, tag);
    wait_flags(c, e, tag, &s_err);
  }
  __syncthreads();
  if (!s_err) {
    for (long long i = t; i < cnt; i += blockDim.x) {
      Entry en[P2P_MAXR];
      bool bad = false;
      for (int k = 0; k < N; ++k) {
        if (k == c.rank) {
          long long id = idx[start + i];
          en[k].v1 = v1[start + i];
          en[k].idx = (id >= 0 && id < vocab) ? (int)id : -1;
          en[k].v2 = v2 ? v2[start + i] : -INFINITY;
        } else {
          en[k] = reinterpret_cast<const Entry*>(c.recv[c.rank] + slot_off(c, par, k) * c.region)[i];
        }
        bad |= en[k].idx < 0;
      }
      if (bad) {
        note_err(c, ERR_INVALID_ID, &s_err);
        continue;
      }
      int w = 0;
      for (int k = 1; k < N; ++k)
        if (better(en[k].v1, en[k].idx, en[w].v1, en[w].idx)) w = k;
      float s2 = -INFINITY;
      for (int k = 0; k < N; ++k) {
        float cand = (k == w) ? en[k].v2 : en[k].v1;
        s2 = (cand > s2) ? cand : s2;
      }
      o1[start + i] = en[w].v1;
      oidx[start + i] = en[w].idx;
      if (o2) o2[start + i] = s2;
    }
  }
  __syncthreads();
  if (!s_err) publish_acks(c, e);
  epilogue(c, e, refused);
}

// ------------------------------------------------------------------------------------------------
// local shard argmax (no communication): one block per row, deterministic (value, lowest id, top2).

struct Top {
  float v1;
  int i1;
  float v2;
};

__device__ __forceinline__ Top merge_top(Top a, Top b) {
  if (better(b.v1, b.i1, a.v1, a.i1)) {
    Top t = a;
    a = b;
    b = t;
  }
  // a wins; the runner-up value is the larger of a's second and b's first
  a.v2 = (b.v1 > a.v2) ? b.v1 : a.v2;
  return a;
}

template <typename T>
__global__ void __launch_bounds__(1024) k_shard_argmax(const T* logits, long long V, long long ld, long long offset,
                                                       float* o1, long long* oidx, float* o2, int preload) {
  if (preload) return;
  __shared__ Top s[32];
  const T* row = logits + (long long)blockIdx.x * ld;
  Top m = {-INFINITY, 0x7fffffff, -INFINITY};
  for (long long j = threadIdx.x; j < V; j += blockDim.x) {
    Top x = {to_f<T>(row[j]), (int)j, -INFINITY};
    m = merge_top(m, x);
  }
  for (int o = 16; o > 0; o >>= 1) {
    Top x;
    x.v1 = __shfl_down_sync(0xffffffffu, m.v1, o);
    x.i1 = __shfl_down_sync(0xffffffffu, m.i1, o);
    x.v2 = __shfl_down_sync(0xffffffffu, m.v2, o);
    m = merge_top(m, x);
  }
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (lane == 0) s[w] = m;
  __syncthreads();
  if (w == 0) {
    int nw = (blockDim.x + 31) >> 5;
    m = lane < nw ? s[lane] : Top{-INFINITY, 0x7fffffff, -INFINITY};
    for (int o = 16; o > 0; o >>= 1) {
      Top x;
      x.v1 = __shfl_down_sync(0xffffffffu, m.v1, o);
      x.i1 = __shfl_down_sync(0xffffffffu, m.i1, o);
      x.v2 = __shfl_down_sync(0xffffffffu, m.v2, o);
      m = merge_top(m, x);
    }
    if (lane == 0) {
      o1[blockIdx.x] = m.v1;
      oidx[blockIdx.x] = (long long)m.i1 + offset;
      if (o2) o2[blockIdx.x] = m.v2;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// helpers: state reset, peer probe, a bounded delay (for tests), preload

__global__ void k_reset(unsigned* hdr, u64* flags, u64* acks, unsigned* bep, long long nflags, long long nacks,
                        int G, unsigned base, int preload) {
  if (preload) return;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long stride = (long long)gridDim.x * blockDim.x;
  for (long long k = i; k < nflags; k += stride) flags[k] = 0ull;
  for (long long k = i; k < nacks; k += stride) acks[k] = (u64)base;
  for (long long k = i; k < G; k += stride) bep[k] = base;
  if (i == 0) {
    hdr[H_EPOCH] = base;
    hdr[H_DONE] = 0u;
    hdr[H_ERR] = 0u;
    hdr[3] = 0u;
  }
}

// peer write + peer read: writes a pattern into the peer's buffer and copies the peer's buffer back
__global__ void k_probe(unsigned* remote_dst, const unsigned* remote_src, unsigned* local_out, int n, unsigned seed,
                        int preload) {
  if (preload) return;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    remote_dst[i] = seed ^ (unsigned)(i * 2654435761u);
    local_out[i] = remote_src[i];
  }
}

__global__ void k_fill(unsigned* dst, int n, unsigned seed, int preload) {
  if (preload) return;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    dst[i] = seed ^ (unsigned)(i * 2654435761u);
}

__global__ void k_sleep(u64 ns, int preload) {
  if (preload) return;
  u64 t0 = gtimer();
  while (gtimer() - t0 < ns) {
  }
}

// ------------------------------------------------------------------------------------------------
// C ABI (ctypes). Every function returns 0 or a cudaError_t value (negative: our own codes).

#define CK(x)                              \
  do {                                     \
    cudaError_t _e = (x);                  \
    if (_e != cudaSuccess) return (int)_e; \
  } while (0)

#define E_BADARG -1
#define E_NOPEER -2
#define E_MISMATCH -3
#define E_TIMEOUT -4

// Restores the caller's current device on exit: torch and this library share the driver's current
// context, so a bare cudaSetDevice here would move torch's current device under it.
struct DevGuard {
  int old = -1;
  explicit DevGuard(int dev) {
    cudaGetDevice(&old);
    if (old != dev) cudaSetDevice(dev);
  }
  ~DevGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (old >= 0 && now != old) cudaSetDevice(old);
  }
};

extern "C" {

const char* p2p_cuda_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

int p2p_device_count(int* n) {
  CK(cudaGetDeviceCount(n));
  return 0;
}

int p2p_enable_peer(int dev, int peer) {
  int can = 0;
  CK(cudaDeviceCanAccessPeer(&can, dev, peer));
  if (!can) return E_NOPEER;
  DevGuard g(dev);
  cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // clear that (benign) error only
    return 0;
  }
  return (int)e;
}

// A real peer write and peer read between dev and peer (both directions are checked by calling it
// twice). Returns 0, a CUDA error, or E_MISMATCH.
int p2p_probe(int dev, int peer) {
  const int n = 1 << 16;
  unsigned *a = nullptr, *bsrc = nullptr, *bdst = nullptr;
  unsigned* host = nullptr;
  int rc = 0;
  const unsigned s1 = 0x9e3779b9u, s2 = 0x7f4a7c15u;
  DevGuard g(dev);
  CK(cudaSetDevice(peer));
  CK(cudaMalloc(&bsrc, n * 4));
  CK(cudaMalloc(&bdst, n * 4));
  CK(cudaMemset(bdst, 0, n * 4));
  k_fill<<<64, 256>>>(bsrc, n, s2, 0);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  CK(cudaSetDevice(dev));
  CK(cudaMalloc(&a, n * 4));
  k_probe<<<64, 256>>>(bdst, bsrc, a, n, s1, 0);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  CK(cudaMallocHost(&host, n * 4));
  CK(cudaMemcpy(host, a, n * 4, cudaMemcpyDeviceToHost));  // what dev read from peer
  for (int i = 0; i < n && !rc; ++i)
    if (host[i] != (s2 ^ (unsigned)(i * 2654435761u))) rc = E_MISMATCH;
  CK(cudaSetDevice(peer));
  CK(cudaMemcpy(host, bdst, n * 4, cudaMemcpyDeviceToHost));  // what dev wrote into peer
  for (int i = 0; i < n && !rc; ++i)
    if (host[i] != (s1 ^ (unsigned)(i * 2654435761u))) rc = E_MISMATCH;
  CK(cudaFree(bsrc));
  CK(cudaFree(bdst));
  CK(cudaSetDevice(dev));
  CK(cudaFree(a));
  CK(cudaFreeHost(host));
  return rc;
}

int p2p_malloc(int dev, u64 bytes, void** out) {
  DevGuard g(dev);
  CK(cudaMalloc(out, bytes));
  CK(cudaMemset(*out, 0, bytes));
  CK(cudaDeviceSynchronize());
  return 0;
}

int p2p_free(int dev, void* p) {
  DevGuard g(dev);
  CK(cudaFree(p));
  return 0;
}

// a pinned, device-mapped host word (the cancellation word); host and device pointers
int p2p_host_word(void** host, void** devp) {
  CK(cudaHostAlloc(host, 64, cudaHostAllocMapped | cudaHostAllocPortable));
  *(volatile unsigned*)(*host) = 0u;
  CK(cudaHostGetDevicePointer(devp, *host, 0));
  return 0;
}

int p2p_free_host(void* p) {
  CK(cudaFreeHost(p));
  return 0;
}

int p2p_stream_create(int dev, void** s) {
  DevGuard g(dev);
  CK(cudaStreamCreateWithFlags((cudaStream_t*)s, cudaStreamNonBlocking));
  return 0;
}

int p2p_stream_destroy(int dev, void* s) {
  DevGuard g(dev);
  CK(cudaStreamDestroy((cudaStream_t)s));
  return 0;
}

// bounded wait for a stream to drain (cudaStreamQuery polling)
int p2p_stream_wait(int dev, void* s, u64 timeout_ns) {
  DevGuard g(dev);
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CK(cudaEventRecord(ev, (cudaStream_t)s));
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      cudaEventDestroy(ev);
      return (int)e;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    u64 dt = (u64)(t1.tv_sec - t0.tv_sec) * 1000000000ull + (u64)(t1.tv_nsec - t0.tv_nsec);
    if (dt > timeout_ns) {
      cudaEventDestroy(ev);
      return E_TIMEOUT;
    }
  }
  CK(cudaEventDestroy(ev));
  return 0;
}

// State layout of one rank, 256-aligned pieces:
//   [hdr 256 B][flags 2*N*G u64][acks N*G u64][block epochs G u32][recv 2*N*G*region]
static u64 align256(u64 x) { return (x + 255ull) & ~255ull; }
u64 p2p_state_bytes(int nranks, int G, u64 region) {
  u64 f = align256(2ull * nranks * G * 8ull), a = align256((u64)nranks * G * 8ull), b = align256((u64)G * 4ull);
  return 256ull + f + a + b + 2ull * nranks * G * region;
}

static void layout(char* base, int nranks, int G, unsigned** hdr, u64** flags, u64** acks, unsigned** bep,
                   char** recv) {
  u64 f = align256(2ull * nranks * G * 8ull), a = align256((u64)nranks * G * 8ull), b = align256((u64)G * 4ull);
  *hdr = (unsigned*)base;
  *flags = (u64*)(base + 256);
  *acks = (u64*)(base + 256 + f);
  *bep = (unsigned*)(base + 256 + f + a);
  *recv = base + 256 + f + a + b;
}

void* p2p_ctx_new(int dev, int rank, int nranks, int G, int threads, u64 region, u64 timeout_ns, void** bases,
                  void* cancel_dev, unsigned mode) {
  if (nranks < 1 || nranks > P2P_MAXR || rank < 0 || rank >= nranks || G < 1 || region % 16) return nullptr;
  if (mode & ~P2P_KNOWN_MODES) return nullptr;  // a mode bit this build does not implement
  Ctx* c = new Ctx();
  c->dev = dev;
  c->mode = mode;
  c->rank = rank;
  c->nranks = nranks;
  c->G = G;
  c->threads = threads;
  c->region = region;
  c->timeout_ns = timeout_ns;
  for (int q = 0; q < nranks; ++q) {
    unsigned* bep = nullptr;
    layout((char*)bases[q], nranks, G, &c->hdr[q], &c->flags[q], &c->acks[q], &bep, &c->recv[q]);
    if (q == rank) c->bep = bep;
  }
  c->cancel = (unsigned*)cancel_dev;
  return c;
}

void p2p_ctx_free(void* c) { delete (Ctx*)c; }
void p2p_ctx_set_timeout(void* c, u64 ns) { ((Ctx*)c)->timeout_ns = ns; }

// drained reset of one rank's state on a side stream (the caller has drained every stream first)
int p2p_reset_state(void* ctx, unsigned base, void* stream) {
  Ctx* c = (Ctx*)ctx;
  DevGuard g(c->dev);
  long long nflags = 2ll * c->nranks * c->G, nacks = (long long)c->nranks * c->G;
  k_reset<<<8, 256, 0, (cudaStream_t)stream>>>(c->hdr[c->rank], c->flags[c->rank], c->acks[c->rank], c->bep, nflags,
                                               nacks, c->G, base, 0);
  CK(cudaGetLastError());
  return 0;
}

// copy this rank's header words (epoch, done, err, pad) to host on a side stream, bounded
int p2p_read_header(void* ctx, unsigned* out4, void* stream, u64 timeout_ns) {
  Ctx* c = (Ctx*)ctx;
  DevGuard g(c->dev);
  CK(cudaMemcpyAsync(out4, c->hdr[c->rank], 16, cudaMemcpyDeviceToHost, (cudaStream_t)stream));
  return p2p_stream_wait(c->dev, stream, timeout_ns);
}

int p2p_allreduce(void* ctx, int dtype, const void* x, void* y, long long n, unsigned tag, int preload, void* stream) {
  Ctx* c = (Ctx*)ctx;
  DevGuard g(c->dev);
  const int esz = dtype == 0 ? 4 : 2, VE = 16 / esz;
  long long per = (n + c->G - 1) / c->G;
  per = (per + VE - 1) / VE * VE;
  if (n < 0 || (u64)per * esz > c->region) return E_BADARG;
  int vec = ((uintptr_t)x % 16 == 0) && ((uintptr_t)y % 16 == 0);
  cudaStream_t s = (cudaStream_t)stream;
  if (dtype == 0)
    k_allreduce<float><<<c->G, c->threads, 0, s>>>(*c, (const float*)x, (float*)y, n, per, tag, vec, preload);
  else if (dtype == 1)
    k_allreduce<__nv_bfloat16><<<c->G, c->threads, 0, s>>>(*c, (const __nv_bfloat16*)x, (__nv_bfloat16*)y, n, per,
                                                           tag, vec, preload);
  else
    return E_BADARG;
  CK(cudaGetLastError());
  return 0;
}

int p2p_argmax_xchg(void* ctx, const float* v1, const long long* idx, const float* v2, float* o1, long long* oidx,
                    float* o2, long long rows, long long vocab, unsigned tag, int preload, void* stream) {
  Ctx* c = (Ctx*)ctx;
  DevGuard g(c->dev);
  long long per = (rows + c->G - 1) / c->G;
  if (rows < 0 || (u64)per * sizeof(Entry) > c->region) return E_BADARG;
  k_argmax_xchg<<<c->G, c->threads, 0, (cudaStream_t)stream>>>(*c, v1, idx, v2, o1, oidx, o2, rows, per, vocab, tag,
                                                               preload);
  CK(cudaGetLastError());
  return 0;
}

int p2p_shard_argmax(int dev, int dtype, const void* logits, long long rows, long long V, long long ld, long long offset,
                     float* o1, long long* oidx, float* o2, int preload, void* stream) {
  if (rows < 1 && !preload) return 0;
  DevGuard g(dev);
  int grid = rows < 1 ? 1 : (int)rows;
  cudaStream_t s = (cudaStream_t)stream;
  if (dtype == 0)
    k_shard_argmax<float><<<grid, 512, 0, s>>>((const float*)logits, V, ld, offset, o1, oidx, o2, preload);
  else if (dtype == 1)
    k_shard_argmax<__nv_bfloat16><<<grid, 512, 0, s>>>((const __nv_bfloat16*)logits, V, ld, offset, o1, oidx, o2,
                                                       preload);
  else
    return E_BADARG;
  CK(cudaGetLastError());
  return 0;
}

int p2p_sleep(int dev, u64 ns, void* stream) {
  DevGuard g(dev);
  k_sleep<<<1, 1, 0, (cudaStream_t)stream>>>(ns, 0);
  CK(cudaGetLastError());
  return 0;
}

// Launch every kernel once on dev (each returns at once): CUDA lazy loading may otherwise load a
// module on a kernel's first launch, which can wait for the device while a collective spins on it.
int p2p_preload(void* ctx) {
  Ctx* c = (Ctx*)ctx;
  DevGuard g(c->dev);
  k_allreduce<float><<<1, 32>>>(*c, nullptr, nullptr, 0, 0, 0, 0, 1);
  k_allreduce<__nv_bfloat16><<<1, 32>>>(*c, nullptr, nullptr, 0, 0, 0, 0, 1);
  k_argmax_xchg<<<1, 32>>>(*c, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 0, 0, 1);
  k_shard_argmax<float><<<1, 32>>>(nullptr, 0, 0, 0, nullptr, nullptr, nullptr, 1);
  k_shard_argmax<__nv_bfloat16><<<1, 32>>>(nullptr, 0, 0, 0, nullptr, nullptr, nullptr, 1);
  k_reset<<<1, 32>>>(nullptr, nullptr, nullptr, nullptr, 0, 0, 0, 0, 1);
  k_probe<<<1, 32>>>(nullptr, nullptr, nullptr, 0, 0, 1);
  k_fill<<<1, 32>>>(nullptr, 0, 0, 1);
  k_sleep<<<1, 1>>>(0, 1);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return 0;
}

}  // extern "C"
