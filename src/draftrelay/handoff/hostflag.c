/*
 * hostflag.c - the hot atomics of the hand-off, shared by the engine and the proxy process.
 *
 * Plain C11 atomics on 32/64-bit words that live in a shared memfd region (which the GPU also
 * maps). No CUDA, no Python objects: the Python side calls these through ctypes, which drops the
 * GIL for the duration of every call, so a wait here never stalls other Python threads.
 *
 * Counters are compared the way cuStreamWaitValue32(GEQ) compares them: (int32_t)(a - b) >= 0,
 * so the host and the GPU agree on "at least t" even across a 2^32 wrap.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define HF_API __attribute__((visibility("default")))

typedef _Atomic uint32_t a32;
typedef _Atomic uint64_t a64;

static inline int geq32(uint32_t a, uint32_t b) { return (int32_t)(a - b) >= 0; }

HF_API uint64_t hf_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

HF_API uint32_t hf_load32(void *w) { return atomic_load_explicit((a32 *)w, memory_order_acquire); }
HF_API void hf_store32(void *w, uint32_t v) { atomic_store_explicit((a32 *)w, v, memory_order_release); }
HF_API uint64_t hf_load64(void *w) { return atomic_load_explicit((a64 *)w, memory_order_acquire); }
HF_API void hf_store64(void *w, uint64_t v) { atomic_store_explicit((a64 *)w, v, memory_order_release); }
HF_API uint32_t hf_add32(void *w, uint32_t v) { return atomic_fetch_add_explicit((a32 *)w, v, memory_order_acq_rel); }

/* Raise *w to v if it is below v (wrap-aware). Two publishers (proxy, watchdog) may release the
 * same round; the word must never go backwards. Returns 1 if this call raised it. */
HF_API int hf_store_max32(void *w, uint32_t v) {
    uint32_t cur = atomic_load_explicit((a32 *)w, memory_order_acquire);
    while (!geq32(cur, v)) {
        if (atomic_compare_exchange_weak_explicit((a32 *)w, &cur, v, memory_order_acq_rel,
                                                  memory_order_acquire))
            return 1;
    }
    return 0;
}

/* Claim: succeed only if nobody has claimed at or above `floor` yet, then set the word to v
 * (floor <= v < floor + 2 encodes who won). Exactly one caller wins per floor. */
HF_API int hf_claim32(void *w, uint32_t floor, uint32_t v) {
    uint32_t cur = atomic_load_explicit((a32 *)w, memory_order_acquire);
    while (!geq32(cur, floor)) {
        if (atomic_compare_exchange_weak_explicit((a32 *)w, &cur, v, memory_order_acq_rel,
                                                  memory_order_acquire))
            return 1;
    }
    return 0;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void nap(uint32_t us) {
    if (us == 0) {
        sched_yield();
        return;
    }
    struct timespec ts = {.tv_sec = us / 1000000u, .tv_nsec = (long)(us % 1000000u) * 1000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
    }
}

/* Wait until *w >= v. Spin for spin_us, then nap nap_us between polls. timeout_us < 0 waits
 * forever. If abort_w is non-NULL, a nonzero *abort_w ends the wait early.
 * Returns 0 when reached, 1 on timeout, 2 when aborted. */
HF_API int hf_wait_geq32(void *w, uint32_t v, uint32_t spin_us, uint32_t nap_us, int64_t timeout_us,
                         void *abort_w) {
    if (geq32(atomic_load_explicit((a32 *)w, memory_order_acquire), v)) return 0;
    uint64_t start = hf_now_ns();
    uint64_t spin_end = start + (uint64_t)spin_us * 1000ull;
    uint64_t deadline = timeout_us < 0 ? UINT64_MAX : start + (uint64_t)timeout_us * 1000ull;
    unsigned n = 0;
    for (;;) {
        if (geq32(atomic_load_explicit((a32 *)w, memory_order_acquire), v)) return 0;
        if (abort_w && atomic_load_explicit((a32 *)abort_w, memory_order_acquire)) return 2;
        if ((++n & 63u) != 0) { /* read the clock every 64 polls only: it is the costly part */
            cpu_relax();
            continue;
        }
        uint64_t now = hf_now_ns();
        if (now >= deadline) return 1;
        if (now >= spin_end) nap(nap_us);
        else cpu_relax();
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Blocking waits, for a waiter that must not take CPU from anyone (the emulated stream and the proxy
 * on a CPU-only machine, where every poll competes with the target's compute). The waiter sleeps in
 * the kernel (a futex on the word: the region is a shared mapping, so it works across processes)
 * and a writer that stores with hf_store32_wake / hf_store_max32_wake wakes it at once. The word
 * keeps its meaning: the waiter still decides by the GEQ compare alone, and a futex sleep never
 * lasts longer than slice_us, so a writer that does not wake (a GPU, an older process) is seen
 * within a slice anyway. No wake-up can be lost: FUTEX_WAIT sleeps only while the word still holds
 * the value the waiter last saw, and the writers store before they wake. */

static void word_sleep(void *w, uint32_t seen, uint64_t ns) {
#ifdef __linux__
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    syscall(SYS_futex, w, FUTEX_WAIT, seen, &ts, NULL, 0);
#else
    (void)w;
    (void)seen;
    nap((uint32_t)(ns / 1000ull));
#endif
}

HF_API void hf_wake32(void *w) {
#ifdef __linux__
    syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#else
    (void)w;
#endif
}

HF_API void hf_store32_wake(void *w, uint32_t v) {
    hf_store32(w, v);
    hf_wake32(w);
}

HF_API int hf_store_max32_wake(void *w, uint32_t v) {
    int raised = hf_store_max32(w, v);
    hf_wake32(w);
    return raised;
}

/* Wait until *w >= v: spin spin_us, then sleep on the word (slices of at most slice_us). Same
 * timeout, abort and return codes as hf_wait_geq32; the abort word is checked once per slice. */
HF_API int hf_wait_geq32_block(void *w, uint32_t v, uint32_t spin_us, uint32_t slice_us, int64_t timeout_us,
                               void *abort_w) {
    if (geq32(atomic_load_explicit((a32 *)w, memory_order_acquire), v)) return 0;
    uint64_t start = hf_now_ns();
    uint64_t spin_end = start + (uint64_t)spin_us * 1000ull;
    uint64_t deadline = timeout_us < 0 ? UINT64_MAX : start + (uint64_t)timeout_us * 1000ull;
    uint64_t slice = (uint64_t)(slice_us ? slice_us : 1000u) * 1000ull;
    int spinning = spin_us > 0;
    unsigned n = 0;
    for (;;) {
        uint32_t cur = atomic_load_explicit((a32 *)w, memory_order_acquire);
        if (geq32(cur, v)) return 0;
        if (abort_w && atomic_load_explicit((a32 *)abort_w, memory_order_acquire)) return 2;
        if (spinning) {
            if ((++n & 63u) != 0) { /* the clock every 64 polls only */
                cpu_relax();
                continue;
            }
            uint64_t t = hf_now_ns();
            if (t >= deadline) return 1;
            if (t < spin_end) {
                cpu_relax();
                continue;
            }
            spinning = 0;
        }
        uint64_t now = hf_now_ns();
        if (now >= deadline) return 1;
        uint64_t left = deadline - now;
        word_sleep(w, cur, left < slice ? left : slice);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Heartbeat: a native thread storing CLOCK_MONOTONIC ns into a 64-bit word every interval. It
 * keeps beating while the proxy's Python code is busy in a round (slow but live), and stops when
 * the process is stopped or killed, which is exactly what the engine's loss detector judges. */

typedef struct {
    pthread_t thread;
    void *word;
    uint32_t interval_us;
    a32 stop;
} hf_heartbeat_t;

static void *heartbeat_main(void *arg) {
    hf_heartbeat_t *hb = (hf_heartbeat_t *)arg;
    while (!atomic_load_explicit(&hb->stop, memory_order_acquire)) {
        hf_store64(hb->word, hf_now_ns());
        nap(hb->interval_us);
    }
    return NULL;
}

HF_API void *hf_heartbeat_start(void *word, uint32_t interval_us) {
    hf_heartbeat_t *hb = calloc(1, sizeof(*hb));
    if (!hb) return NULL;
    hb->word = word;
    hb->interval_us = interval_us ? interval_us : 1000;
    hf_store64(word, hf_now_ns());
    if (pthread_create(&hb->thread, NULL, heartbeat_main, hb) != 0) {
        free(hb);
        return NULL;
    }
    return hb;
}

HF_API void hf_heartbeat_stop(void *h) {
    hf_heartbeat_t *hb = (hf_heartbeat_t *)h;
    if (!hb) return;
    atomic_store_explicit(&hb->stop, 1, memory_order_release);
    pthread_join(hb->thread, NULL);
    free(hb);
}

/* ------------------------------------------------------------------------------------------ */
/* Watchdog: a native thread in the engine process. At most one round is pending at a time (the
 * stream writes gathered=t+1 only after it passed released>=t), so it tracks the newest gathered
 * value, remembers when it first saw it, and once that round is older than the deadline it tries
 * to claim it as the watchdog (claim word := 2t+1). Whether it wins or the proxy already claimed
 * (2t: the proxy wrote its reply before claiming, so the reply is final), it releases the round.
 * The engine trusts only the claim word it copies with the reply, so a late proxy cannot turn a
 * watchdog round into a draft. A mutex around each check lets the engine reset the words safely. */

typedef struct {
    pthread_t thread;
    pthread_mutex_t lock;
    char *base;
    uint64_t off_gathered, off_released, off_claim0, off_claim1, off_fires;
    uint64_t off_budget; /* u64 (round << 32) | extra us for that round, written by the proxy; 0: none */
    uint64_t deadline_ns;
    uint32_t poll_us;
    a32 stop;
    uint32_t last_g;
    uint64_t seen_ns;
    uint64_t off_stamp; /* nonzero: writers stamp each announcement here (hf_watchdog_use_stamps) */
    a32 slice_us;       /* with stamps: the longest sleep between checks */
    a32 bell;           /* what a stamped watchdog sleeps on: rung by stop only */
    uint64_t sleep_ns;  /* with stamps: what the last check leaves the sleep to */
    a64 fires;   /* rounds this watchdog claimed */
    a64 assists; /* rounds it released after the proxy had claimed but not yet released */
} hf_watchdog_t;

static void watchdog_check(hf_watchdog_t *wd) {
    char *b = wd->base;
    uint32_t g = hf_load32(b + wd->off_gathered);
    uint32_t r = hf_load32(b + wd->off_released);
    uint64_t now = hf_now_ns();
    if (g != wd->last_g) {
        uint64_t seen = now;
        if (wd->off_stamp) {
            /* the writer stamped the announcement before storing `gathered`: the round's age is exact
             * however long ago this thread last looked. A stamp no newer than the last change seen is
             * not this round's (a writer that does not stamp): then the age starts now, as polling */
            uint64_t stamp = hf_load64(b + wd->off_stamp);
            if (stamp > wd->seen_ns && stamp <= now) seen = stamp;
        }
        wd->last_g = g;
        wd->seen_ns = seen;
    }
    /* with stamps (see watchdog_main): idle, the next check is a slice (at most a deadline) away; with
     * a round pending, at its deadline */
    uint64_t slice = (uint64_t)atomic_load_explicit(&wd->slice_us, memory_order_relaxed) * 1000ull;
    wd->sleep_ns = slice < wd->deadline_ns ? slice : wd->deadline_ns;
    if (g == 0 || geq32(r, g)) return; /* nothing pending */
    uint64_t limit = wd->deadline_ns;
    if (wd->off_budget) { /* the round's size asked for more time (the proxy's RoundBudget) */
        uint64_t e = hf_load64(b + wd->off_budget);
        if ((uint32_t)(e >> 32) == g) limit += (e & 0xFFFFFFFFull) * 1000ull;
    }
    if (now - wd->seen_ns < limit) {
        /* sleeping to the steady deadline before the proxy wrote the round's budget is safe: the next
         * check re-reads the word and sleeps the rest */
        uint64_t left = limit - (now - wd->seen_ns);
        if (left < wd->sleep_ns) wd->sleep_ns = left;
        return;
    }
    void *claim = b + ((g & 1u) ? wd->off_claim1 : wd->off_claim0);
    if (hf_claim32(claim, 2u * g, 2u * g + 1u)) {
        atomic_fetch_add_explicit(&wd->fires, 1, memory_order_relaxed);
        if (wd->off_fires) hf_add32(b + wd->off_fires, 1);
    } else {
        atomic_fetch_add_explicit(&wd->assists, 1, memory_order_relaxed);
    }
    hf_store_max32_wake(b + wd->off_released, g); /* wake a stream parked in a blocking wait */
}

/* Between checks the watchdog naps poll_us: a wake-up every poll, on whatever core the target or the
 * drafter runs on, and a round's age known to a poll. Once hf_watchdog_use_stamps() said that every
 * writer of `gathered` stamps the announcement's time first (the emulated stream and the engine thread
 * on a CPU-only machine), it sleeps instead: idle, a slice at most (never longer than a deadline, so a
 * round announced meanwhile is seen before its deadline); with a round pending, until that round's
 * deadline, its age from the stamp. Nobody wakes it (an announcement or a release waking it would put
 * its wake-up on the round's critical path): about one wake-up per slice, the deadline kept exactly. */
static void *watchdog_main(void *arg) {
    hf_watchdog_t *wd = (hf_watchdog_t *)arg;
    while (!atomic_load_explicit(&wd->stop, memory_order_acquire)) {
        pthread_mutex_lock(&wd->lock);
        watchdog_check(wd);
        uint64_t ns = wd->off_stamp ? wd->sleep_ns : 0;
        pthread_mutex_unlock(&wd->lock);
        if (ns)
            word_sleep(&wd->bell, 0, ns);
        else
            nap(wd->poll_us);
    }
    return NULL;
}

/* Writers stamp each announcement (u64 CLOCK_MONOTONIC ns at off_stamp, stored before `gathered`):
 * sleep between checks, at most slice_us at a time (see watchdog_main). Never with a GPU writing
 * `gathered`, which cannot stamp. */
HF_API void hf_watchdog_use_stamps(void *h, uint64_t off_stamp, uint32_t slice_us) {
    hf_watchdog_t *wd = (hf_watchdog_t *)h;
    pthread_mutex_lock(&wd->lock);
    atomic_store_explicit(&wd->slice_us, slice_us ? slice_us : 1000u, memory_order_relaxed);
    wd->off_stamp = off_stamp;
    pthread_mutex_unlock(&wd->lock);
}

HF_API void *hf_watchdog_start(void *base, uint64_t off_gathered, uint64_t off_released,
                               uint64_t off_claim0, uint64_t off_claim1, uint64_t off_fires,
                               uint64_t off_budget, uint64_t deadline_us, uint32_t poll_us) {
    hf_watchdog_t *wd = calloc(1, sizeof(*wd));
    if (!wd) return NULL;
    wd->base = (char *)base;
    wd->off_gathered = off_gathered;
    wd->off_released = off_released;
    wd->off_claim0 = off_claim0;
    wd->off_claim1 = off_claim1;
    wd->off_fires = off_fires;
    wd->off_budget = off_budget;
    wd->deadline_ns = deadline_us * 1000ull;
    wd->poll_us = poll_us ? poll_us : 1000;
    wd->last_g = hf_load32(wd->base + off_gathered);
    wd->seen_ns = hf_now_ns();
    pthread_mutex_init(&wd->lock, NULL);
    if (pthread_create(&wd->thread, NULL, watchdog_main, wd) != 0) {
        pthread_mutex_destroy(&wd->lock);
        free(wd);
        return NULL;
    }
    return wd;
}

/* Hold the watchdog between checks (for resets and for freezing it in tests). */
HF_API void hf_watchdog_lock(void *h) { pthread_mutex_lock(&((hf_watchdog_t *)h)->lock); }
HF_API void hf_watchdog_unlock(void *h) {
    hf_watchdog_t *wd = (hf_watchdog_t *)h;
    /* whatever the words hold now is a fresh start: the age of a round restarts at unlock */
    wd->last_g = hf_load32(wd->base + wd->off_gathered);
    wd->seen_ns = hf_now_ns();
    pthread_mutex_unlock(&wd->lock);
}

/* Reset the hand-off words to zero under the watchdog's lock. Only legal once the stream is
 * drained and the proxy is gone: the caller guarantees nobody else touches the words. */
HF_API void hf_watchdog_reset(void *h, uint64_t *offsets, uint32_t n) {
    hf_watchdog_t *wd = (hf_watchdog_t *)h;
    pthread_mutex_lock(&wd->lock);
    for (uint32_t i = 0; i < n; i++) hf_store32(wd->base + offsets[i], 0);
    wd->last_g = 0;
    wd->seen_ns = hf_now_ns();
    pthread_mutex_unlock(&wd->lock);
}

HF_API uint64_t hf_watchdog_fires(void *h) {
    return atomic_load_explicit(&((hf_watchdog_t *)h)->fires, memory_order_relaxed);
}
HF_API uint64_t hf_watchdog_assists(void *h) {
    return atomic_load_explicit(&((hf_watchdog_t *)h)->assists, memory_order_relaxed);
}

HF_API void hf_watchdog_stop(void *h) {
    hf_watchdog_t *wd = (hf_watchdog_t *)h;
    if (!wd) return;
    atomic_store_explicit(&wd->stop, 1, memory_order_release);
    atomic_store_explicit(&wd->bell, 1, memory_order_release); /* a sleeping watchdog: stop now */
    hf_wake32((void *)&wd->bell);
    pthread_join(wd->thread, NULL);
    pthread_mutex_destroy(&wd->lock);
    free(wd);
}
