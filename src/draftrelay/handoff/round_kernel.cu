// One hand-off round as one kernel, one block (docs/ORDERING.md; launched by handoff/cuda_stream.py,
// built with NVRTC at start by handoff/cuda_kernels.py, checked there before any round uses it).
//
// Ordering: every thread fences its staging stores at system scope before the block barrier, thread 0
// then stores `gathered` with release semantics; thread 0 polls `released` with acquire loads and the
// block barrier orders every thread's reply loads after it (the same "one thread acquires, bar.sync,
// all read" pattern as NCCL's); host memory is read with .relaxed.sys loads, which are never served
// from a stale cached line; `consumed` is stored once every reply load has returned. The host reads the
// mirror only after the round's event, i.e. after the kernel finished and all its stores are visible.
typedef unsigned int u32;
typedef unsigned long long u64;

struct RoundArgs {
    const unsigned char* src;         // rows + descriptor: device memory or mapped pinned host memory
    u64 nbytes;                       // bytes of src to stage (at most a staging slot)
    unsigned char* staging[2];        // staging[slot] in the registered region
    const unsigned char* reply[2];    // reply[slot] in the registered region (claim word first)
    unsigned char* dev[2];            // the engine's device reply buffers
    unsigned char* mirror[2];         // their pinned host mirrors (what decode_reply reads)
    u32* gathered;
    u32* released;
    u32* consumed;
    u32* counter;                     // device memory: the last round this kernel ran
    u32 reply_bytes;                  // a multiple of 16
    u32 tok_off;                      // staging offset of the tokens: stage only the used part; 0 = all
    u32 t;                            // the round; 0 = *counter + 1 (graph replays)
    u32 stamp;                        // 1: write t into the descriptor's round field
};
// Passed by value from a ctypes twin (cuda_kernels.RoundArgs): the layout is pinned on both sides.
static_assert(sizeof(RoundArgs) == 128, "RoundArgs layout changed: update cuda_kernels.RoundArgs");

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_relaxed_sys(const void* p) {
    u32 v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint4 ld16(const void* p) {  // coherent at system scope: never a stale cached line
    uint4 v;
    asm volatile("ld.relaxed.sys.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(u32* p, u32 v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// dst[0, n) = src[0, n), 16 bytes a thread at a time, four loads in flight before their stores
// (a load from host memory is a bus round trip: one per thread, not one per vector).
__device__ __forceinline__ void copy_block(unsigned char* dst, const unsigned char* src, u64 n) {
    const u64 tid = threadIdx.x, nth = blockDim.x;
    if ((((u64)dst | (u64)src) & 15) == 0) {
        const u64 nv = n >> 4;
        u64 i = tid;
        for (; i + 3 * nth < nv; i += 4 * nth) {
            uint4 a = ld16(src + 16 * i), b = ld16(src + 16 * (i + nth));
            uint4 c = ld16(src + 16 * (i + 2 * nth)), d = ld16(src + 16 * (i + 3 * nth));
            *(uint4*)(dst + 16 * i) = a;
            *(uint4*)(dst + 16 * (i + nth)) = b;
            *(uint4*)(dst + 16 * (i + 2 * nth)) = c;
            *(uint4*)(dst + 16 * (i + 3 * nth)) = d;
        }
        for (; i < nv; i += nth) *(uint4*)(dst + 16 * i) = ld16(src + 16 * i);
        for (i = 16 * nv + tid; i < n; i += nth) dst[i] = src[i];
    } else {
        for (u64 i = tid; i < n; i += nth) dst[i] = src[i];
    }
}

extern "C" __global__ void __launch_bounds__(256) draftrelay_round(const RoundArgs a) {
    const u32 t = a.t ? a.t : *(volatile u32*)a.counter + 1u;
    const u32 s = t & 1u;
    unsigned char* stg = s ? a.staging[1] : a.staging[0];  // (a select, not an index: no local-memory copy of a)
    // 1. stage the rows (only the used part when the descriptor says how many tokens there are)
    u64 n = a.nbytes;
    if (a.tok_off && n >= a.tok_off + 16ull) {
        const u64 used = (u64)a.tok_off + 4ull * ld_relaxed_sys(a.src + 8);  // descriptor: round, n_req, n_tok
        if (used < n) n = used;
    }
    copy_block(stg, a.src, n);
    __threadfence_system();  // every thread's staging stores are visible to the host ...
    __syncthreads();         // ... before thread 0 goes on
    if (threadIdx.x == 0) {
        if (a.stamp) *(volatile u32*)stg = t;  // the descriptor names round t (graphs: t comes from the counter)
        __threadfence_system();
        st_release_sys(a.gathered, t);  // 2. gathered = t
        while ((int)(ld_acquire_sys(a.released) - t) < 0) {  // 3. park until released >= t (GEQ, wrapping)
        }
    }
    __syncthreads();  // the acquire above orders every thread's reply loads after the release
    // 4. reply[s] (claim word included) -> device buffer and host mirror, from the same registers
    const unsigned char* rep = s ? a.reply[1] : a.reply[0];
    unsigned char* dev = s ? a.dev[1] : a.dev[0];
    unsigned char* mir = s ? a.mirror[1] : a.mirror[0];
    for (u32 i = threadIdx.x; i < a.reply_bytes / 16u; i += blockDim.x) {
        const uint4 v = ld16(rep + 16u * i);
        *(uint4*)(dev + 16u * i) = v;
        *(uint4*)(mir + 16u * i) = v;
    }
    __syncthreads();  // every reply load has returned: the slot may be reused
    if (threadIdx.x == 0) {
        st_relaxed_sys(a.consumed, t);  // 5. consumed = t
        *a.counter = t;
    }
}
