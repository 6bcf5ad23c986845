"""How far past its cap can a call's memory go where no cgroup counts it (isolation "userns")? (About a minute.)

    sudo .venv/bin/python 02-sandbox/bench_memory_burst.py                  # as root: runs the sandbox as nobody
    sudo .venv/bin/python 02-sandbox/bench_memory_burst.py --results 02-memory-burst   # also docs/results/02-memory-burst.json

The burst: one call, run unprivileged with /usr/bin/python3, forks into max_processes processes that each touch what
RLIMIT_AS allows, at once, while root samples MemAvailable every millisecond: how far it fell, and how long the call
held more than its cap (docs/02-isolation.md). Run it on a quiet machine; read the median.
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from results import name_argument, save  # noqa: E402  (the lab's root, whichever Python runs this)
from lab_cli import at_least, script_parser  # noqa: E402
from bench_sandbox import AsUser  # noqa: E402
from sandbox import format_observation  # noqa: E402
BURST = ("import os, time\n"  # every process the call may have, each touching what its address space allows, at once
         "start_r, start_w = os.pipe()\n"
         "for _ in range({processes} - 1):\n"
         "    if os.fork() == 0:\n"
         "        os.close(start_w)\n"
         "        os.read(start_r, 1)\n"  # wait until every process is there
         "        break\n"
         "else:\n"
         "    os.close(start_w)\n"
         "m = bytearray({mb} << 20)\n"
         "m[::4096] = b'x' * len(m[::4096])\n"
         "time.sleep(5)\n")


def available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--user", default="nobody", help="the unprivileged user to run the sandbox as (default: %(default)s)")
    parser.add_argument("--memory-mb", type=at_least(64), default=256, help="the call's cap (default: %(default)s)")
    parser.add_argument("--processes", type=at_least(1), default=64, help="max_processes, all used by the burst (default: %(default)s)")
    parser.add_argument("--tries", type=at_least(1), default=10, help="bursts, one call each (default: %(default)s)")
    parser.add_argument("--results", metavar="NAME", type=name_argument,
                        help="also write the figures to docs/results/NAME.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("run it as root: it starts the sandbox as --user and watches the machine's memory from outside")
    load_before = os.getloadavg()[0]  # other work on the machine moves MemAvailable too
    worker = AsUser({"concurrency": 1, "preload": [], "timeout": 20, "memory_mb": args.memory_mb,
                     "max_processes": args.processes}, args.user)
    try:
        if worker.isolation != "userns":
            raise SystemExit(f"the sandbox got isolation {worker.isolation!r}, not 'userns': nothing to measure")
        # what each process may touch: RLIMIT_AS less the interpreter's own mappings (about 30 MB)
        code = BURST.format(processes=args.processes, mb=max(args.memory_mb - 40, 8))
        drops, held_s, observations = [], [], []
        for _ in range(args.tries):
            time.sleep(1.0)
            before = statistics.median(available_mb() for _ in range(50))
            samples, done = [], threading.Event()

            def watch() -> None:
                while not done.is_set():
                    samples.append((time.monotonic(), before - available_mb()))
                    time.sleep(0.001)

            watcher = threading.Thread(target=watch)
            watcher.start()
            result = worker.run_many([code])[0]  # one call, once the baseline is taken
            done.set()
            watcher.join()
            over = [t for t, drop in samples if drop > args.memory_mb]
            drops.append(max(drop for _, drop in samples))
            held_s.append(over[-1] - over[0] if over else 0.0)
            observations.append(format_observation(result))
    finally:
        worker.close()
    killed = sum(o.startswith("MemoryError") for o in observations)
    print(f"{args.tries} bursts of {args.processes} processes under a {args.memory_mb} MB cap, as {args.user} (userns), "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after:")
    print(f"  MemAvailable fell by at most {max(drops):.0f} MB (median {statistics.median(drops):.0f} MB)")
    print(f"  above the cap for at most {max(held_s) * 1000:.0f} ms (median {statistics.median(held_s) * 1000:.0f} ms)")
    print(f"  calls killed with MemoryError: {killed} of {args.tries}")
    if args.results:
        figures = {"cap_mb": args.memory_mb, "processes": args.processes, "tries": args.tries, "killed": killed,
                   "load_average_before": round(load_before, 1), "load_average_after": round(os.getloadavg()[0], 1),
                   "drop_max_mb": round(max(drops)), "drop_median_mb": round(statistics.median(drops)),
                   "over_cap_max_ms": round(max(held_s) * 1000), "over_cap_median_ms": round(statistics.median(held_s) * 1000)}
        command = f".venv/bin/python 02-sandbox/bench_memory_burst.py --results {args.results}"
        print(f"wrote {save(args.results, command, figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
