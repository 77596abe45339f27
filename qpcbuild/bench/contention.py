"""Was the machine quiet while bench measured? Judged on what was measured, not assumed: the
load already there before bench started (per core), the CPU time other processes took while it
ran (the machine's busy time minus bench's own), the CPU time the hypervisor stole, and how far
target-only tokens/s moved from repeat to repeat. Any one over its limit marks the run noisy,
and the report says which."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Any

NOISY_SPREAD = 0.10  # target-only tokens/s varying more than this across repeats
NOISY_LOAD_PER_CORE = 1.0  # runnable tasks per core before bench started: others wanted it all
NOISY_OTHERS_SHARE = 0.25  # other processes took a quarter of the machine's CPU time meanwhile
NOISY_STEAL_SHARE = 0.05  # a twentieth of the CPU time went to other virtual machines


@dataclass(frozen=True)
class CpuSnapshot:
    """The machine's CPU counters (/proc/stat, in clock ticks, all CPUs) and this process's
    own CPU time (itself and its finished children, seconds)."""

    total: int
    idle: int
    steal: int
    own_cpu_s: float
    cores: int
    load1: float | None


def _own_cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), \
        resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def snapshot(stat_text: str | None = None) -> CpuSnapshot | None:
    """Now; None where the system has no /proc/stat (then only the spread judges)."""
    try:
        text = stat_text if stat_text is not None else open("/proc/stat").read()
        lines = text.splitlines()
        fields = [int(x) for x in lines[0].split()[1:]]
        cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    except (OSError, ValueError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already
    # counted in user, so it is left out of the total.
    fields = (fields + [0] * 8)[:8]
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = None
    return CpuSnapshot(total=sum(fields), idle=fields[3] + fields[4], steal=fields[7],
                       own_cpu_s=_own_cpu_s(), cores=max(cores, 1), load1=load1)


def judge(start: CpuSnapshot | None, end: CpuSnapshot | None, spread: float,
          ticks_per_s: float | None = None) -> tuple[dict[str, Any], list[str]]:
    """(the figures, the reasons the run was noisy: empty when it was quiet)."""
    figures: dict[str, Any] = {"target_only_spread": round(spread, 4)}
    reasons = []
    if spread > NOISY_SPREAD:
        reasons.append(f"target-only tokens/s varied by {spread:.0%} across repeats "
                       f"(over {NOISY_SPREAD:.0%})")
    if start is None or end is None or end.total <= start.total:
        return figures, reasons
    ticks = ticks_per_s or os.sysconf("SC_CLK_TCK")
    elapsed = end.total - start.total
    busy = elapsed - (end.idle - start.idle)
    own = (end.own_cpu_s - start.own_cpu_s) * ticks
    others = max(0.0, busy - own) / elapsed
    steal = (end.steal - start.steal) / elapsed
    figures.update({"cores": start.cores, "others_cpu_share": round(others, 3),
                    "steal_share": round(steal, 3)})
    if others > NOISY_OTHERS_SHARE:
        reasons.append(f"other processes took {others:.0%} of the {start.cores} cores' CPU time "
                       f"while bench ran (over {NOISY_OTHERS_SHARE:.0%})")
    if steal > NOISY_STEAL_SHARE:
        reasons.append(f"the hypervisor stole {steal:.0%} of the CPU time (over "
                       f"{NOISY_STEAL_SHARE:.0%})")
    if start.load1 is not None:
        per_core = start.load1 / start.cores
        figures["load_per_core_at_start"] = round(per_core, 2)
        if per_core > NOISY_LOAD_PER_CORE:
            reasons.append(f"load average {start.load1:.1f} on {start.cores} cores before bench "
                           f"started ({per_core:.1f} per core, over {NOISY_LOAD_PER_CORE:g})")
    return figures, reasons

