// A MEASUREMENT build of the P2P kernels, never used by the package: mode bit 32 publishes the flags
// as relaxed stores, with no ordering of the pushed payload before the flag. A peer may then read a
// stale payload, so this is unsafe for real work; it exists only to price the release fence
// (benchmarks/p2p_allreduce.py --modes 51 builds and loads it through P2PGroup's `kernels` hook).
#define M_FLAG_RELAXED 32u
#define P2P_EXTRA_MODES M_FLAG_RELAXED
#define P2P_FLAG_STORE(c, p, v) \
  do {                                                \
    if ((c).mode & M_FLAG_RELAXED)                    \
      st_relaxed_sys((p), (v));                       \
    else                                              \
      st_release_sys((p), (v));                       \
  } while (0)
#include "kernels.cu"
