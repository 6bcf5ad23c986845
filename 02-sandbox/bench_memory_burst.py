"""How far past its cap can a call's memory go where no cgroup counts it (isolation "userns")? (About a minute.)

    sudo .venv/bin/python 02-sandbox/bench_memory_burst.py                  # as root: runs the sandbox as nobody
    sudo .venv/bin/python 02-sandbox/bench_memory_burst.py --results 02-memory-burst   # also docs/results/02-memory-burst.json

Without a cgroup the slot's MemoryWatch samples the call every 10 ms, and between two looks
each of the call's processes may fault in up to memory_mb (RLIMIT_AS). The burst: one call
forks into max_processes processes that each touch as much as RLIMIT_AS lets them, as
fast as they can. This script runs the sandbox as an unprivileged user (the only way to
get the watch; Debian's /usr/bin/python3, standard library only), and from outside, as
root, samples the machine's MemAvailable every millisecond: how far it fell below where
it stood before the call, and for how long the call held more than its cap. Other work
on the machine moves MemAvailable too: run it on a quiet machine, and read the median.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from results import name_argument, save  # noqa: E402  (the lab's root, whichever Python runs this)
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
DRIVER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from sandbox import Sandbox, SandboxConfig, format_observation
settings = json.loads(sys.stdin.readline())
with Sandbox(SandboxConfig(concurrency=1, preload=(), timeout=20, **settings)) as sb:
    print(json.dumps({"isolation": sb.isolation}), flush=True)
    for line in sys.stdin:  # one call a line, once the caller has its baseline
        r = sb.run(json.loads(line))
        print(json.dumps({"observation": format_observation(r), "latency": r.latency}), flush=True)
"""


def available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--user", default="nobody", help="the unprivileged user to run the sandbox as (default: %(default)s)")
    parser.add_argument("--python", default="/usr/bin/python3", help="a Python that user may run (default: %(default)s)")
    parser.add_argument("--memory-mb", type=int, default=256, help="the call's cap (default: %(default)s)")
    parser.add_argument("--processes", type=int, default=64, help="max_processes, all used by the burst (default: %(default)s)")
    parser.add_argument("--tries", type=int, default=10, help="bursts, one call each (default: %(default)s)")
    parser.add_argument("--results", metavar="NAME", type=name_argument,
                        help="also write the figures to docs/results/NAME.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("run it as root: it starts the sandbox as --user and watches the machine's memory from outside")
    load_before = os.getloadavg()[0]  # other work on the machine moves MemAvailable too
    folder = tempfile.mkdtemp(prefix="sbx-burst-")
    os.chmod(folder, 0o755)
    for name in ("runner", "confinement", "sandbox", "fork_server", "local_backend"):
        os.chmod(shutil.copy(HERE / f"{name}.py", folder), 0o644)
    driver = subprocess.Popen([shutil.which("runuser") or "/usr/sbin/runuser", "-u", args.user, "--", args.python, "-I", "-c", DRIVER, folder],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/", env={"PATH": "/usr/bin:/bin"})
    try:
        driver.stdin.write(json.dumps({"memory_mb": args.memory_mb, "max_processes": args.processes}) + "\n")
        driver.stdin.flush()
        isolation = json.loads(driver.stdout.readline())["isolation"]
        if isolation != "userns":
            raise SystemExit(f"the sandbox got isolation {isolation!r}, not 'userns': nothing to measure")
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
            driver.stdin.write(json.dumps(code) + "\n")
            driver.stdin.flush()
            answer = json.loads(driver.stdout.readline())
            done.set()
            watcher.join()
            over = [t for t, drop in samples if drop > args.memory_mb]
            drops.append(max(drop for _, drop in samples))
            held_s.append(over[-1] - over[0] if over else 0.0)
            observations.append(answer["observation"])
    finally:
        driver.stdin.close()
        driver.wait()
        shutil.rmtree(folder, ignore_errors=True)
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
