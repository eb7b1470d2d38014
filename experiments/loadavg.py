"""The machine's load when a benchmark starts, so that every printed number says whether it was measured idle.

    from experiments.loadavg import machine_load
    load = machine_load()      # os.getloadavg() and os.cpu_count(), read now
    print(load.line())         # "load average 0.12 0.30 0.25 on 2 cores (0.06 per core): idle"
    header += load.tag()       # "" when idle, " [measured under load]" otherwise
    result.update(load.fields())

A run counts as "measured under load" when the 1-minute load average is above UNDER_LOAD_PER_CORE per core: other
processes were then competing for the cores the benchmark times.
"""

from __future__ import annotations

import dataclasses
import os

UNDER_LOAD_PER_CORE = 0.5


@dataclasses.dataclass(frozen=True)
class Load:
    """Load averages over 1, 5 and 15 minutes (runnable processes) and the number of cores."""

    one: float
    five: float
    fifteen: float
    cores: int

    @property
    def per_core(self) -> float:
        return self.one / self.cores

    @property
    def under_load(self) -> bool:
        return self.per_core > UNDER_LOAD_PER_CORE

    def line(self) -> str:
        state = "measured under load" if self.under_load else "idle"
        return (f"load average {self.one:.2f} {self.five:.2f} {self.fifteen:.2f} on {self.cores} cores "
                f"({self.per_core:.2f} per core; > {UNDER_LOAD_PER_CORE} is load): {state}")

    def tag(self) -> str:
        """The suffix for a table header: empty when idle."""
        return " [measured under load]" if self.under_load else ""

    def fields(self) -> dict:
        """The fields every benchmark's final JSON line carries."""
        return {"loadavg": [round(self.one, 2), round(self.five, 2), round(self.fifteen, 2)], "cpu_count": self.cores,
                "measured_under_load": self.under_load}


def machine_load() -> Load:
    """The load now (os.getloadavg; zeros where the platform has none) and os.cpu_count() cores."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        one = five = fifteen = 0.0
    return Load(float(one), float(five), float(fifteen), os.cpu_count() or 1)
