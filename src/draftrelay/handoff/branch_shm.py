"""Where branch tables wait for the engine: a small memfd of two slots, written by the proxy process
and read by the engine (host selection on the emulated path; the CUDA path's device selection would
read the same bytes from a mapped copy, see engine/spec_cache.py).

    header line   magic u32, version u32, slot capacity u32, epoch u32 (engine-owned), fan-out word u32
                  (engine-owned: 0 = the round spec's fan-out; F + 1 = send the STEPs with fan-out F, so
                  1 asks the proxy to send them without one: tables paused), written u32 (proxy-owned:
                  tables written so far, stored with a futex wake after each, so an engine waiting for
                  a table sleeps in the kernel and wakes the moment it lands)
    slot[2]       seq u32, stamp u32, epoch u32, n_bytes u32, crc32 u32 (one line), body[capacity]

The table that follows stream round t goes into slot t & 1, written as a seqlock: seq becomes odd,
the body and the stamp/epoch/length/crc are written, seq becomes even again (release stores). The
reader copies the slot, and believes the copy only if seq was even and unchanged around the copy,
the stamp is the round it expects, the epoch is the engine's current one (bumped when the proxy is
replaced, so nothing a previous proxy wrote can match) and the crc matches the body. Anything else
is a miss. numpy + the native atomics only: the proxy imports it.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib

import numpy as np

from draftrelay.handoff import native
from draftrelay.handoff.region import shared_memfd

MAGIC = 0x48435253  # "SRCH"
VERSION = 1
LINE = 64
_HEAD = struct.Struct("<IIII")  # magic, version, capacity, epoch
_SLOT = struct.Struct("<IIIII")  # seq, stamp, epoch, n_bytes, crc
WRITTEN = 20  # header offset of the written word (after magic, version, capacity, epoch, fan-out)


class ShmError(ValueError):
    pass


class TableShm:
    def __init__(self, fd: int, mm: mmap.mmap, capacity: int, owner: bool) -> None:
        self.fd, self.mm, self.capacity, self.owner = fd, mm, capacity, owner
        self._u8 = np.frombuffer(mm, np.uint8)
        self.base = int(self._u8.ctypes.data)

    @staticmethod
    def size_for(capacity: int) -> int:
        return LINE + 2 * (LINE + capacity)

    def _slot(self, s: int) -> int:
        return LINE + s * (LINE + self.capacity)

    @classmethod
    def create(cls, capacity: int = 1 << 20) -> TableShm:
        if not 1024 <= capacity <= 1 << 26:
            raise ShmError(f"table capacity {capacity} outside [1 KiB, 64 MiB]")
        capacity = (capacity + LINE - 1) // LINE * LINE
        size = cls.size_for(capacity)
        fd, mm = shared_memfd("draftrelay-branches", size)
        _HEAD.pack_into(mm, 0, MAGIC, VERSION, capacity, 1)
        return cls(fd, mm, capacity, owner=True)

    @classmethod
    def open(cls, fd: int) -> TableShm:
        try:
            st = os.fstat(fd)
            head = os.pread(fd, _HEAD.size, 0)
        except OSError as exc:
            raise ShmError(f"branch table fd {fd}: {exc}") from None
        if len(head) < _HEAD.size:
            raise ShmError(f"branch table fd {fd}: {st.st_size} bytes, too small")
        magic, version, capacity, _ = _HEAD.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise ShmError(f"branch table fd {fd}: magic {magic:#x} version {version}, expected {MAGIC:#x} v{VERSION}")
        if st.st_size != cls.size_for(capacity):
            raise ShmError(f"branch table fd {fd}: {st.st_size} bytes, capacity {capacity} implies "
                           f"{cls.size_for(capacity)}")
        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(os.dup(fd), mm, capacity, owner=False)  # its own fd: closing one never closes the other

    # -- epoch (engine) ---------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return native.load32(self.base + 12)

    def bump_epoch(self) -> int:
        """Invalidate every table written so far (a new proxy generation)."""
        return native.add32(self.base + 12, 1) + 1

    # -- fan-out word (engine writes, proxy reads before each STEP) --------------------------------------
    @property
    def paused(self) -> bool:
        return native.load32(self.base + 16) == 1

    def set_paused(self, paused: bool) -> None:
        """Ask the proxy for no more tables (its STEPs carry no fan-out, so the worker does no branch work)
        until unpaused; a STEP already sent still brings its table."""
        self.set_fanout(0 if paused else None)

    def set_fanout(self, fanout: int | None) -> None:
        """The fan-out of the proxy's next STEPs: F (0: none, tables paused) or None (the round spec's)."""
        if fanout is not None and not 0 <= fanout < 0xFFFF:
            raise ShmError(f"fan-out {fanout} outside [0, 65535)")
        native.store32(self.base + 16, 0 if fanout is None else fanout + 1)

    def fanout(self, default: int) -> int:
        """The fan-out the engine asks for now (`default`: the round spec's, when it asks none of its own)."""
        w = native.load32(self.base + 16)
        return default if w == 0 else w - 1

    # -- proxy side --------------------------------------------------------------------------------
    def write(self, stamp: int, body: bytes, crc: int | None = None) -> bool:
        """Publish `body` as the table following stream round `stamp`. False if it does not fit.
        `crc` overrides the checksum (fault injection only)."""
        if len(body) > self.capacity:
            return False
        off = self._slot(stamp & 1)
        a_seq = self.base + off
        odd = native.load32(a_seq) | 1  # (already odd only if a writer died mid-write)
        native.store32(a_seq, odd)  # odd: being written
        self._u8[off + LINE:off + LINE + len(body)] = np.frombuffer(body, np.uint8)
        crc = zlib.crc32(body) if crc is None else crc
        native.store32(a_seq + 4, stamp & 0xFFFFFFFF)
        native.store32(a_seq + 8, self.epoch)
        native.store32(a_seq + 12, len(body))
        native.store32(a_seq + 16, crc & 0xFFFFFFFF)
        native.store32(a_seq, (odd + 1) & 0xFFFFFFFF)  # even again: complete
        # after the slot is complete: a waiter woken here finds it whole (one writer: the proxy)
        native.store32_wake(self.base + WRITTEN, (native.load32(self.base + WRITTEN) + 1) & 0xFFFFFFFF)
        return True

    # -- the written word (proxy stores, engine waits on it) --------------------------------------
    @property
    def written(self) -> int:
        """Tables written so far (wraps at 2^32): read it before looking at a slot, then wait_written."""
        return native.load32(self.base + WRITTEN)

    def wait_written(self, seen: int, timeout_s: float) -> bool:
        """Sleep until a table is written after `written` read `seen`, at most timeout_s: True if one was.
        A kernel sleep (a futex on the word), not a poll: the write wakes it at once, and nothing is lost
        between the read of `seen` and the sleep (the futex sleeps only while the word still holds it)."""
        us = max(1, int(timeout_s * 1e6))
        return native.wait_geq32_block(self.base + WRITTEN, seen + 1, 0, us, us) == native.WAIT_OK

    # -- engine side -------------------------------------------------------------------------------
    def read(self, stamp: int) -> tuple[bytes | None, str]:
        """(body, '') for a complete table of round `stamp` in the current epoch, else (None, why)."""
        off = self._slot(stamp & 1)
        a_seq = self.base + off
        seq = native.load32(a_seq)
        if seq == 0:
            return None, "absent"
        if seq & 1:
            return None, "torn"
        st, ep, n, crc = (native.load32(a_seq + 4 * i) for i in range(1, 5))
        if st != stamp & 0xFFFFFFFF:
            return None, "absent" if _older(st, stamp) else "stale"
        if ep != self.epoch:
            return None, "stale"
        if n > self.capacity:
            return None, "corrupt"
        body = bytes(self._u8[off + LINE:off + LINE + n])
        if native.load32(a_seq) != seq:
            return None, "torn"
        if zlib.crc32(body) != crc:
            return None, "corrupt"
        return body, ""

    def close(self) -> None:
        if self.mm is None:
            return
        self._u8 = None
        self.mm.close()
        self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _older(a: int, b: int) -> bool:
    return ((a - b) & 0xFFFFFFFF) >= 0x80000000
