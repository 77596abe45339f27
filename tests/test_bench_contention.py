"""bench's "noisy" verdict (issue 48 item 13): measured, not assumed. A run is noisy when the
load before it started, other processes' CPU time while it ran, stolen time or the run-to-run
spread says so; the report names which. Checked on counters written here and on the machine's
own counters while two processes burn CPU beside a sleeping test."""

from __future__ import annotations

import subprocess
import sys
import time

from qpcbuild.bench.contention import CpuSnapshot, judge, snapshot

QUIET = CpuSnapshot(total=0, idle=0, steal=0, own_cpu_s=0.0, cores=2, load1=0.3)


def later(**changes) -> CpuSnapshot:
    """The counters 10 s later on 2 cores at 100 ticks/s (2,000 ticks), bench using one core."""
    base = dict(total=2000, idle=1000, steal=0, own_cpu_s=10.0, cores=2, load1=1.2)
    return CpuSnapshot(**{**base, **changes})


def test_a_quiet_machine_is_quiet():
    figures, reasons = judge(QUIET, later(), spread=0.02, ticks_per_s=100)
    assert reasons == []
    assert figures["others_cpu_share"] == 0.0 and figures["load_per_core_at_start"] == 0.15


def test_load_47_on_2_cores_before_bench_started_is_noisy_even_with_a_small_spread():
    busy = CpuSnapshot(total=0, idle=0, steal=0, own_cpu_s=0.0, cores=2, load1=4.7)
    _, reasons = judge(busy, later(), spread=0.01, ticks_per_s=100)
    assert reasons == ["load average 4.7 on 2 cores before bench started (2.4 per core, over 1)"]


def test_other_processes_cpu_time_while_bench_ran_is_noisy():
    figures, reasons = judge(QUIET, later(idle=200), spread=0.01, ticks_per_s=100)
    assert figures["others_cpu_share"] == 0.4  # 1,800 busy - 1,000 ours of 2,000
    assert len(reasons) == 1 and "other processes took 40% of the 2 cores" in reasons[0]


def test_stolen_time_and_spread_are_reasons_too():
    _, reasons = judge(QUIET, later(steal=200), spread=0.15, ticks_per_s=100)
    assert any("varied by 15%" in r for r in reasons)
    assert any("stole 10%" in r for r in reasons)


def test_real_counters_see_two_processes_burning_cpu_beside_us():
    burn = "import time\nend = time.time() + 3\nwhile time.time() < end: pass\n"
    start = snapshot()
    assert start is not None  # Linux: /proc/stat
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2)]
    try:
        time.sleep(1.5)
        end = snapshot()  # before the burners are reaped: their time is not ours
    finally:
        for p in burners:
            p.kill()
            p.wait()
    figures, reasons = judge(start, end, spread=0.0)
    assert figures["others_cpu_share"] > 0.25, figures
    assert any("other processes took" in r for r in reasons), reasons
