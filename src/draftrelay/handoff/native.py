"""ctypes bindings of hostflag.c (the compiled `_hostflag` shared object in this package).

ctypes releases the GIL around every foreign call, so the waits below never hold up other Python
threads. Words are addressed by raw pointers (region base address + byte offset).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _find_library() -> Path:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = _HERE / f"_hostflag{suffix}"
        if candidate.exists():
            return candidate
    raise ImportError(
        f"draftrelay's native helper (_hostflag*.so) is not built in {_HERE}; "
        "install the package with `pip install .` (or `pip install -e .`), which compiles hostflag.c"
    )


lib = ctypes.CDLL(str(_find_library()))

_p, _u32, _u64, _i64, _int = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int


def _sig(name: str, restype, *argtypes) -> None:
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)


_sig("hf_now_ns", _u64)
_sig("hf_load32", _u32, _p)
_sig("hf_store32", None, _p, _u32)
_sig("hf_load64", _u64, _p)
_sig("hf_store64", None, _p, _u64)
_sig("hf_add32", _u32, _p, _u32)
_sig("hf_store_max32", _int, _p, _u32)
_sig("hf_claim32", _int, _p, _u32, _u32)
_sig("hf_wait_geq32", _int, _p, _u32, _u32, _u32, _i64, _p)
_sig("hf_wait_geq32_block", _int, _p, _u32, _u32, _u32, _i64, _p)
_sig("hf_wake32", None, _p)
_sig("hf_store32_wake", None, _p, _u32)
_sig("hf_store_max32_wake", _int, _p, _u32)
_sig("hf_heartbeat_start", _p, _p, _u32)
_sig("hf_heartbeat_stop", None, _p)
_sig("hf_watchdog_start", _p, _p, _u64, _u64, _u64, _u64, _u64, _u64, _u64, _u32)
_sig("hf_watchdog_lock", None, _p)
_sig("hf_watchdog_unlock", None, _p)
_sig("hf_watchdog_reset", None, _p, ctypes.POINTER(_u64), _u32)
_sig("hf_watchdog_fires", _u64, _p)
_sig("hf_watchdog_assists", _u64, _p)
_sig("hf_watchdog_stop", None, _p)
# newer than the rest: a helper built from an older hostflag.c lacks it (Watchdog.use_stamps says so)
HAS_WATCHDOG_STAMPS = hasattr(lib, "hf_watchdog_use_stamps")
if HAS_WATCHDOG_STAMPS:
    _sig("hf_watchdog_use_stamps", None, _p, _u64, _u32)

now_ns = lib.hf_now_ns
load32 = lib.hf_load32
store32 = lib.hf_store32
load64 = lib.hf_load64
store64 = lib.hf_store64
add32 = lib.hf_add32
store_max32 = lib.hf_store_max32
claim32 = lib.hf_claim32
wake32 = lib.hf_wake32
store32_wake = lib.hf_store32_wake  # store, then wake blocking waiters on the word
store_max32_wake = lib.hf_store_max32_wake

WAIT_OK, WAIT_TIMEOUT, WAIT_ABORTED = 0, 1, 2


def wait_geq32(addr: int, value: int, spin_us: int, nap_us: int, timeout_us: int, abort_addr: int = 0) -> int:
    """Wait until the word at `addr` is >= value (wrap-aware). Returns WAIT_OK / WAIT_TIMEOUT / WAIT_ABORTED."""
    return lib.hf_wait_geq32(addr, value & 0xFFFFFFFF, spin_us, nap_us, timeout_us, abort_addr or None)


def wait_geq32_block(addr: int, value: int, spin_us: int, slice_us: int, timeout_us: int, abort_addr: int = 0) -> int:
    """wait_geq32 that sleeps in the kernel instead of polling (hostflag.c, "Blocking waits"): woken
    by the *_wake stores at once, and re-checks the word at least every slice_us whoever wrote it."""
    return lib.hf_wait_geq32_block(addr, value & 0xFFFFFFFF, spin_us, slice_us, timeout_us, abort_addr or None)


WAITS = ("poll", "block")


def set_timer_slack_ns(ns: int) -> None:
    """Shrink this thread's timer slack so short naps stay short (Linux; harmless elsewhere)."""
    try:
        ctypes.CDLL(None).prctl(29, ctypes.c_ulong(ns), 0, 0, 0)  # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        pass


def geq32(a: int, b: int) -> bool:
    """The GEQ of cuStreamWaitValue32 and of the native waits: (int32)(a - b) >= 0."""
    d = (a - b) & 0xFFFFFFFF
    return d < 0x80000000


class Watchdog:
    """The native watchdog thread (see hostflag.c). Lives in the engine process."""

    def __init__(self, base: int, off_gathered: int, off_released: int, off_claims: tuple[int, int],
                 off_fires: int, deadline_us: int, poll_us: int = 1000, off_budget: int = 0) -> None:
        """off_budget: a u64 word (round << 32) | microseconds that round gets beyond deadline_us (the
        proxy writes it from the round's size once it has parsed the round); 0: every round deadline_us."""
        self._h = lib.hf_watchdog_start(base, off_gathered, off_released, off_claims[0], off_claims[1],
                                        off_fires, off_budget, deadline_us, poll_us)
        if not self._h:
            raise OSError("could not start the native watchdog thread")

    @property
    def fires(self) -> int:
        return int(lib.hf_watchdog_fires(self._h)) if self._h else 0

    @property
    def assists(self) -> int:
        return int(lib.hf_watchdog_assists(self._h)) if self._h else 0

    def use_stamps(self, off_stamp: int, slice_us: int) -> None:
        """Every writer of `gathered` stamps the announcement's CLOCK_MONOTONIC ns at off_stamp (u64)
        first: the watchdog then sleeps between checks instead of napping every poll (hostflag.c,
        watchdog_main), a slice at most while idle and until the deadline while a round is pending.
        Never with a GPU writing `gathered`. A native helper built from an older hostflag.c keeps
        napping, with a warning."""
        if not HAS_WATCHDOG_STAMPS:
            import logging

            logging.getLogger("draftrelay").warning(
                "draftrelay: the native helper %s predates hf_watchdog_use_stamps (rebuild it: pip install -e . "
                "or python setup.py build_ext --inplace); the watchdog naps every poll", _find_library())
            return
        lib.hf_watchdog_use_stamps(self._h, off_stamp, slice_us)

    def reset_words(self, offsets: list[int]) -> None:
        arr = (ctypes.c_uint64 * len(offsets))(*offsets)
        lib.hf_watchdog_reset(self._h, arr, len(offsets))

    def hold(self) -> None:
        lib.hf_watchdog_lock(self._h)

    def unhold(self) -> None:
        lib.hf_watchdog_unlock(self._h)

    def stop(self) -> None:
        if self._h:
            lib.hf_watchdog_stop(self._h)
            self._h = None


class Heartbeat:
    """A native thread storing CLOCK_MONOTONIC ns into a 64-bit word every `interval_us`."""

    def __init__(self, addr: int, interval_us: int) -> None:
        self._h = lib.hf_heartbeat_start(addr, interval_us)
        if not self._h:
            raise OSError("could not start the native heartbeat thread")

    def stop(self) -> None:
        if self._h:
            lib.hf_heartbeat_stop(self._h)
            self._h = None
