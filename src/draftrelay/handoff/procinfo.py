"""What this process holds, read from /proc (the leak checks of refusals, drills, tests and probes),
and where it runs (`machine_info`, recorded with every benchmark and probe result)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def memfd_maps(name: str = "memfd:draftrelay") -> int:
    """Mappings of the hand-off region(s) in this process."""
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


def memfd_fds(name: str = "memfd:draftrelay") -> int:
    """Open fds of the hand-off region(s) (mmap keeps a dup of the region's fd, so 2 per region)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += name in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def proc_state(pid: int) -> str:
    """The state letter of a process (R, S, T stopped, Z zombie, ...) or 'gone'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_states() -> dict[int, str]:
    """This process's children and their state letters."""
    me, out = os.getpid(), {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                if int(rest[1]) == me:
                    out[int(pid)] = rest[0]
            except OSError:
                pass
    return out


def children() -> set[int]:
    return set(children_states())


GPU_ENV = ("CUDA_MODULE_LOADING", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"


def machine_info(topology: bool = False) -> dict:
    """Where a figure was measured: Python, kernel, host, CPU and cores, load, and the numpy / torch / CUDA /
    cuda-bindings versions that are installed; on a GPU machine nvidia-smi's GPUs, driver, clocks and power
    limit (and `nvidia-smi topo -m` with topology=True), the GPU-related environment switches, and torch's
    view of the GPUs if the caller imported torch. Versions come from the installed distributions."""
    info: dict = {"python": platform.python_version(), "kernel": platform.release(), "host": platform.node(),
                  "cores": os.cpu_count(), "loadavg_1_5_15": list(os.getloadavg())}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        info["cpu"] = platform.processor()
    for dist in ("numpy", "torch", "cuda-bindings"):
        try:
            info[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist.replace("-", "_")] = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["torch_cuda"] = torch.version.cuda
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if shutil.which("nvidia-smi"):  # also for a torch-free caller timing a GPU worker (wire_step)
        info["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit",
                                   "--format=csv,noheader"])
        if topology:
            info["topology"] = _run(["nvidia-smi", "topo", "-m"])
        info["env"] = {k: os.environ.get(k) for k in GPU_ENV}
    return info
