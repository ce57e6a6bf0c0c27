"""How busy other processes keep this machine: what tells a timing taken beside other work from
one taken on a quiet machine.

The tuner (autotune.py) times the machine once and caches what it measured. A measurement taken
while a compile job held a core says "no tree pays" and would stand for good; so every cached
measurement records the cores other processes kept busy while it ran, and one taken beside more
than BUSY_CORES of other work is timed again by the first call that finds the machine quiet.

Other work is the machine's busy CPU time (/proc/stat's first line, every CPU) less this
process's own (its threads' user and system time), over the wall time between two marks.
"""

from __future__ import annotations

import os
import time

BUSY_CORES = 0.3          # other processes' average cores above which a timing counts as busy
QUIET_SAMPLE = 0.25       # seconds the quiet check watches the machine


def _machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    ticks = [int(v) for v in fields[1:9]]
    idle = ticks[3] + ticks[4]           # idle and iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


class LoadMark:
    """A point in time to measure other processes' load from (`others`)."""

    def __init__(self):
        times = os.times()
        self.wall = time.perf_counter()
        self.busy = _machine_busy_seconds()
        self.own = times.user + times.system

    def others(self) -> float:
        """Cores other processes kept busy on average since the mark; 0 where /proc/stat is
        not there to tell (no Linux) or the span is too short for its ticks."""
        now = LoadMark()
        span = now.wall - self.wall
        if self.busy is None or now.busy is None or span < 0.05:
            return 0.0
        return max(0.0, (now.busy - self.busy) - (now.own - self.own)) / span


def machine_is_quiet(seconds: float = QUIET_SAMPLE) -> bool:
    """Whether other processes keep less than BUSY_CORES busy now (watched for `seconds`)."""
    mark = LoadMark()
    time.sleep(seconds)
    return mark.others() <= BUSY_CORES
