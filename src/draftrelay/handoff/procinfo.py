"""What this process holds, read from /proc: the leak checks of refusals, drills, tests and probes."""

from __future__ import annotations

import os


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
