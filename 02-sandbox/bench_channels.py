"""How many bits can one call pass to another through what the machine shares, with the channels a filter can close closed? (About 30 s.)

    .venv/bin/python 02-sandbox/bench_channels.py                              # as root: the sandbox's default isolation
    .venv/bin/python 02-sandbox/bench_channels.py --results 02-channels        # also docs/results/02-channels.json

Each channel carries `--trials` 6-bit values from a sender call to a receiver call of one Sandbox; the script counts
the bits the receiver got right (half by chance). Other work on the machine moves the open channels.
docs/02-isolation.md, "Channels between calls", quotes it.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sandbox import Sandbox, SandboxConfig  # noqa: E402
from results import name_argument, save  # noqa: E402
from lab_cli import at_least, script_parser  # noqa: E402

BITS = 6
_READ_INODE = "import os\nprint(os.fstat(os.pipe()[0]).st_ino % 64)\n"  # a new pipe takes the machine's next inode
PAGE_GAP = 4 << 20  # pages this far apart: neither the sender's readahead nor the receiver's fault-around reaches the next


def inode_counter(sb: Sandbox, value: int, offset: int) -> int:
    """The sender moves the counter to the value; the receiver reads it, less what a call's start takes (offset)."""
    sb.run(f"import os\nwhile os.fstat(os.pipe()[0]).st_ino % 64 != {value}:\n    pass\n")
    return (int(sb.run(_READ_INODE).stdout) - offset) % 64


def page_cache(sb: Sandbox, value: int, path: str, first: int) -> int:
    """The sender reads the pages of the bits set; the receiver counts a major fault for each page it must read."""
    return _through_pages(sb, value, path, first, ", mmap, resource",
                          "    page = mmap.mmap(fd, 4096, prot=mmap.PROT_READ, offset=offset)\n"
                          "    before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt\n"
                          "    page[0]\n"
                          "    value |= (resource.getrusage(resource.RUSAGE_SELF).ru_majflt == before) << bit\n")


def tasks(sb: Sandbox, value: int) -> int:
    """Two calls at once: the sender holds `value` threads from 0.3 s to 1.5 s; the receiver counts the tasks."""
    sender = ("import threading, time\n"
              "time.sleep(0.3)\n"
              f"for _ in range({value}):\n"
              "    threading.Thread(target=time.sleep, args=(1.2,)).start()\n")
    return _concurrent(sb, sender, "int(open('/proc/loadavg').read().split()[3].split('/')[1])", 1)


def tcp_sockets(sb: Sandbox, value: int) -> int:
    """The same with TCP sockets and sockstat's count of them: closed, no socket can be made."""
    sender = ("import socket, time\n"
              "time.sleep(0.3)\n"
              f"held = [socket.socket() for _ in range(3 * {value})]\n"
              "time.sleep(1.2)\n")
    return _concurrent(sb, sender, "int([l for l in open('/proc/net/sockstat') if l.startswith('TCP:')][0].split()[8])", 3)


def _concurrent(sb: Sandbox, sender: str, count: str, per_unit: int) -> int:
    """The sender beside a receiver of how far `count` (an expression) moved from 0.1 s to 0.9 s, per_unit a unit."""
    receiver = ("import time\n"
                "time.sleep(0.1)\n"
                f"before = {count}\n"
                "time.sleep(0.8)\n"
                f"print({count} - before)\n")
    _, received = sb.run_many([sender, receiver])
    return max(0, min(63, round(int(received.stdout) / per_unit))) if received.ok else 0


def forks_counter(sb: Sandbox, value: int) -> int:
    """The sender forks `value` times; the receiver reads /proc/stat's forks since boot: closed, it reads 0."""
    sb.run(f"import os\nfor _ in range({value}):\n    os.fork() or os._exit(0)\n")
    received = sb.run("print([int(l.split()[1]) for l in open('/proc/stat') if l.startswith('processes')][0] % 64)\n")
    return int(received.stdout)


def rwf_nowait(sb: Sandbox, value: int, path: str, first: int) -> int:
    """The receiver of page_cache, through preadv2(RWF_NOWAIT): a page it answers without EAGAIN was held."""
    return _through_pages(sb, value, path, first, "",
                          "    try:\n"
                          "        os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)\n"
                          "        value |= 1 << bit\n"
                          "    except OSError:\n"
                          "        pass\n")


def _through_pages(sb: Sandbox, value: int, path: str, first: int, imports: str, probe: str) -> int:
    """The file evicted (as memory pressure would), a call reads one page for each bit of the value set, then a call
    runs `probe` on each page (bit, offset), which sets the bit in `value` when the cache held the page."""
    pages = [first + bit * PAGE_GAP for bit in range(BITS)]
    _evict(path)
    sb.run("import os\n"
           f"fd = os.open({path!r}, os.O_RDONLY)\n"
           f"for bit, offset in enumerate({pages!r}):\n"
           f"    if {value} >> bit & 1:\n"
           "        os.pread(fd, 1, offset)\n")
    received = sb.run(f"import os{imports}\nfd, value = os.open({path!r}, os.O_RDONLY), 0\n"
                      f"for bit, offset in enumerate({pages!r}):\n{probe}print(value)\n")
    return int(received.stdout)


def _evict(path: str) -> None:
    """Drop the file's pages from the page cache (the script's own step, outside the sandbox)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold_file() -> str:
    """The largest file of the interpreter's prefix that is in the sandbox's root, and large enough for the pages."""
    best = max((entry for folder, _, names in os.walk(sys.prefix) for entry in
                (os.path.join(folder, name) for name in names) if os.path.isfile(entry) and not os.path.islink(entry)),
               key=os.path.getsize)
    if os.path.getsize(best) < (BITS + 1) * PAGE_GAP:
        raise SystemExit(f"bench_channels.py: no file under {sys.prefix} holds {BITS + 1} x {PAGE_GAP >> 20} MB")
    return os.path.realpath(best)


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--trials", type=at_least(1), default=12, help="6-bit values sent through each channel (default: %(default)s)")
    parser.add_argument("--results", metavar="NAME", type=name_argument, help="also write docs/results/NAME.json")
    args = parser.parse_args()
    rng, path = random.Random(59), cold_file()
    with Sandbox(SandboxConfig(concurrency=2, preload=(), timeout=20)) as sb:
        first = int(sb.run(_READ_INODE).stdout)  # what a call's start takes
        offset = (int(sb.run(_READ_INODE).stdout) - first) % 64
        channels = {
            "inode_counter": lambda v: inode_counter(sb, v, offset),
            "page_cache": lambda v, n=iter(range(10 ** 6)): page_cache(sb, v, path, next(n) * 4096 % PAGE_GAP),
            "tasks": lambda v: tasks(sb, v),
            "forks_counter": lambda v: forks_counter(sb, v),
            "rwf_nowait": lambda v, n=iter(range(10 ** 6)): rwf_nowait(sb, v, path, next(n) * 4096 % PAGE_GAP),
            "tcp_sockets": lambda v: tcp_sockets(sb, v),
        }
        print(f"isolation {sb.isolation}; {args.trials} values of {BITS} bits a channel; the file: {path}; "
              f"load average {os.getloadavg()[0]:.1f}")
        figures = {"trials": args.trials, "bits": args.trials * BITS, "load_average_before": round(os.getloadavg()[0], 1)}
        for name, channel in channels.items():
            values = [rng.randrange(64) for _ in range(args.trials)]
            right = sum(BITS - bin(v ^ channel(v)).count("1") for v in values)
            figures[f"{name}_bits_right"] = right
            print(f"{name:<15} {right:>4} of {args.trials * BITS} bits right (chance: half)")
    if args.results:
        command = f".venv/bin/python 02-sandbox/bench_channels.py --results {args.results}"
        print(f"wrote {save(args.results, command, figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
