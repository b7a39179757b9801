"""Exclusive ownership of a GPU by one worker, keyed by the GPU's UUID (stable across CUDA_VISIBLE_DEVICES
renumbering, unlike an index): an flock on /tmp/draftrelay-gpu-<uuid>.lock held for the worker's
lifetime. The kernel drops the lock when the process dies, however it dies, so a stale file never
blocks. A second worker on the same GPU is refused with the holder's PID unless it asks to share.
Inspecting tools call `holder()`, which never blocks and never takes the lock.
"""

from __future__ import annotations

import fcntl
import os
import re

LOCK_DIR_ENV = "DRAFTRELAY_LOCK_DIR"


class GpuBusy(RuntimeError):
    def __init__(self, uuid: str, pid: int | None, path: str) -> None:
        who = f"PID {pid}" if pid else "another process"
        super().__init__(f"GPU {uuid} is in use by a draftrelay worker ({who}; lock {path}); stop it, pick another "
                         f"GPU, or pass --share-gpu to run both on it")
        self.uuid, self.pid, self.path = uuid, pid, path


def lock_path(uuid: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", uuid)
    return os.path.join(os.environ.get(LOCK_DIR_ENV, "/tmp"), f"draftrelay-gpu-{safe}.lock")


def _read_pid(fd: int) -> int | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 32).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


class GpuLock:
    """Held from acquire() until release() or the process's end."""

    def __init__(self, uuid: str) -> None:
        self.uuid, self.path = uuid, lock_path(uuid)
        self.fd: int | None = None

    def acquire(self) -> GpuLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise GpuBusy(self.uuid, pid, self.path) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def holder(uuid: str) -> int | None:
    """The PID holding `uuid`'s lock (0 if held but unnamed), None if free. Non-blocking, and leaves the
    lock free: a probe that gets it lets go at once."""
    path = lock_path(uuid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def gpu_uuids(device: str) -> list[str]:
    """UUIDs of the CUDA devices `device` ('cuda', 'cuda:N') uses; [] on CPU."""
    if not device.startswith("cuda"):
        return []
    import torch

    if not torch.cuda.is_available():
        return []  # the drafter's loader names what is missing
    index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        return []
    return [f"GPU-{torch.cuda.get_device_properties(index).uuid}"]


def acquire_all(uuids: list[str], share: bool) -> tuple[list[GpuLock], list[str]]:
    """(locks held, warnings). Refuses (GpuBusy) a held GPU unless `share`: then it warns and goes on."""
    held, notes = [], []
    try:
        for u in uuids:
            try:
                held.append(GpuLock(u).acquire())
            except GpuBusy as exc:
                if not share:
                    raise
                notes.append(f"sharing GPU {u} with PID {exc.pid} (--share-gpu)")
    except BaseException:
        for lk in held:
            lk.release()
        raise
    return held, notes
