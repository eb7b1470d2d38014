"""The machine's load when a benchmark starts, so that every printed number says whether it was measured idle.

    from experiments.loadavg import machine_load
    load = machine_load()      # os.getloadavg() and os.cpu_count(), read now
    print(load.line())         # "load average 0.12 0.30 0.25 on 2 cores (0.06 per core): idle"
    header += load.tag()       # "" when idle, " [measured under load]" otherwise
    result.update(load.fields())

A run counts as "measured under load" when the 1-minute load average is above UNDER_LOAD_PER_CORE per core: other
processes were then competing for the cores the benchmark times.

The load average cannot judge a benchmark's later sections: it counts the benchmark's own threads (a bench that
kept both cores busy for a minute reads ~1.3 on its own). `ForeignCpu` measures what matters there, the cores that
*other* processes kept busy during a section (all cores' busy ticks in /proc/stat minus this process's and its
children's), and `Load.with_foreign` judges a section by that:

    meter = ForeignCpu()
    ...section...
    load = machine_load().with_foreign(meter.take())   # "... ; others used 0.02 cores: idle"
    start = machine_load().with_foreign(ForeignCpu.sample(1.0))  # before the first section
"""

from __future__ import annotations

import dataclasses
import os
import time

UNDER_LOAD_PER_CORE = 0.5
FOREIGN_PER_CORE = 0.25  # other processes' average busy cores per core during a section, above which it is loaded


@dataclasses.dataclass(frozen=True)
class Load:
    """Load averages over 1, 5 and 15 minutes (runnable processes) and the number of cores."""

    one: float
    five: float
    fifteen: float
    cores: int
    foreign: float | None = None  # cores other processes kept busy over the window judged (ForeignCpu), if measured

    @property
    def per_core(self) -> float:
        return self.one / self.cores

    @property
    def under_load(self) -> bool:
        if self.foreign is not None:
            return self.foreign / self.cores > FOREIGN_PER_CORE
        return self.per_core > UNDER_LOAD_PER_CORE

    def with_foreign(self, cores: float | None) -> "Load":
        """This load judged by other processes' CPU use instead of the load average (None keeps the average)."""
        return dataclasses.replace(self, foreign=cores)

    def line(self) -> str:
        state = "measured under load" if self.under_load else "idle"
        text = f"load average {self.one:.2f} {self.five:.2f} {self.fifteen:.2f} on {self.cores} cores "
        if self.foreign is None:
            return text + f"({self.per_core:.2f} per core; > {UNDER_LOAD_PER_CORE} is load): {state}"
        return text + (f"(its own threads included); other processes used {self.foreign:.2f} cores "
                       f"(> {FOREIGN_PER_CORE} per core is load): {state}")

    def tag(self) -> str:
        """The suffix for a table header: empty when idle."""
        return " [measured under load]" if self.under_load else ""

    def fields(self) -> dict:
        """The fields every benchmark's final JSON line carries."""
        out = {"loadavg": [round(self.one, 2), round(self.five, 2), round(self.fifteen, 2)], "cpu_count": self.cores,
               "measured_under_load": self.under_load}
        if self.foreign is not None:
            out["foreign_cores"] = round(self.foreign, 3)
        return out


def machine_load() -> Load:
    """The load now (os.getloadavg; zeros where the platform has none) and os.cpu_count() cores."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        one = five = fifteen = 0.0
    return Load(float(one), float(five), float(fifteen), os.cpu_count() or 1)


def _busy_ticks() -> int | None:
    """All cores' non-idle clock ticks since boot (/proc/stat: user nice system irq softirq steal)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


def _stat(pid) -> tuple[int, int] | None:
    """(ppid, ticks used by pid and its waited-for children) from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
    except (OSError, IndexError):
        return None
    # rest[0] is field 3 (state): ppid is field 4, utime stime cutime cstime are fields 14-17.
    return int(rest[1]), sum(int(x) for x in rest[11:15])


def _own_ticks() -> int:
    """Ticks used by this process, its waited-for children and its live descendants (a benchmark's workers)."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(name)) is not None:
            stats[int(name)] = st
    ours, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in stats.items():
            if ppid == parent and pid not in ours:
                ours.add(pid)
                frontier.append(pid)
    return sum(stats[pid][1] for pid in ours if pid in stats)


class ForeignCpu:
    """Cores that other processes kept busy between marks: the competition a benchmark's section timed against."""

    def __init__(self):
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._mark = self._now()

    def _now(self):
        busy = _busy_ticks()
        return None if busy is None else (time.monotonic(), busy, _own_ticks())

    @classmethod
    def sample(cls, seconds: float = 1.0) -> float | None:
        """Other processes' average busy cores over the next `seconds` (this process sleeps): the load a benchmark
        is about to compete with, which the decaying load average reports only a minute late."""
        meter = cls()
        time.sleep(seconds)
        return meter.take()

    def take(self) -> float | None:
        """Average busy cores of other processes since the last take (or construction); None off Linux."""
        now = self._now()
        before, self._mark = self._mark, now
        if before is None or now is None or now[0] <= before[0]:
            return None
        foreign_ticks = (now[1] - before[1]) - (now[2] - before[2])
        return max(foreign_ticks, 0) / self._hz / (now[0] - before[0])
