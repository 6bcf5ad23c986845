"""How fast is the sandbox? Calls per second and latency against a fresh `python -c` per call (about a minute).

    make bench-sandbox                                   # both workloads: fresh python -c, fork server, HTTP service
    .venv/bin/python 02-sandbox/bench_sandbox.py --docker          # add the Docker backend's rows
    .venv/bin/python 02-sandbox/bench_sandbox.py --as-user root --as-user nobody   # the fork server run by each with /usr/bin/python3
    .venv/bin/python 02-sandbox/bench_sandbox.py --calls 400 --rounds 5
    make bench-sandbox ARGS="--results 02-bench-sandbox"       # also write docs/results/02-bench-sandbox.json

The designs (docs/02-sandbox.md, docs/02-service.md) take turns in rounds, with the same threads. calls/s counts
correct results only ("wrong": the rest); "cpu ms" is CPU time per call of everything involved but the Docker engine.
Targets: the fork server at least 20x the baseline's calls/s on the sympy snippet, and no slower on print(1+1).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import clean_env  # noqa: E402
from sandbox import ExecResult, Sandbox, SandboxConfig, SandboxError  # noqa: E402
from results import figure_key, make_command, name_argument, save  # noqa: E402
from lab_cli import at_least, script_parser  # noqa: E402

WORKLOADS = {  # name: (code, what it prints)
    "print(1+1)": ("print(1+1)", "2\n"),
    "sympy factorint": ("import sympy; print(sympy.factorint(2**64-1))", "{3: 1, 5: 1, 17: 1, 257: 1, 641: 1, 65537: 1, 6700417: 1}\n"),
}


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--calls", type=at_least(1), default=200, help="calls per round for the sandbox (default: %(default)s)")
    parser.add_argument("--rounds", type=at_least(1), default=3, help="rounds in which the designs take turns (default: %(default)s)")
    parser.add_argument("--concurrency", type=at_least(1), default=os.cpu_count() or 2, help="threads issuing calls (default: the CPU count, %(default)s)")
    parser.add_argument("--docker", action="store_true", help="also measure the Docker backend")
    parser.add_argument("--as-user", metavar="USER", action="append", default=[],
                        help=f"as root: also measure the fork server run by USER (not root: isolation userns) with "
                        f"{AsUser.PYTHON}; repeat for several users; workloads that Python cannot import are skipped")
    parser.add_argument("--results", metavar="NAME", type=name_argument,
                        help="also write the figures to docs/results/NAME.json, for the docs")
    args = parser.parse_args()

    meter = CpuMeter()  # before any child starts: children inherit the cgroup
    config = SandboxConfig(concurrency=args.concurrency)
    designs = {"fresh python -c": Baseline(config), "fork server": Sandbox(config), "service (http)": Service(config)}
    if args.docker:
        try:
            designs["docker"] = Sandbox(SandboxConfig(backend="docker", concurrency=args.concurrency))
        except SandboxError as e:
            print(f"docker rows skipped: {e}")
    for user in args.as_user:
        try:
            designs[f"as {user}"[:16]] = as_user = AsUser({"concurrency": args.concurrency}, user)
            print(f"rows 'as {user}': the fork server run by {user} with {AsUser.PYTHON}, isolation "
                  f"{as_user.isolation}; it preloads what that Python has (sympy: {as_user.imports})")
        except OSError as e:
            print(f"rows 'as {user}' skipped: {e}")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"concurrency {args.concurrency}; {args.rounds} rounds; "
          f"isolation of the fork server: {designs['fork server'].isolation}")
    print(f"{'workload':<17} {'design':<16} {'calls':>6} {'wrong':>6} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'cpu ms':>7}")
    speedups, wrong_results, http_share = {}, {}, {}
    figures = {"concurrency": args.concurrency, "rounds": args.rounds, "load_average_before": round(os.getloadavg()[0], 1)}
    for name, (code, expected) in WORKLOADS.items():
        rates = {}
        active = {design: runner for design, runner in designs.items() if getattr(runner, "can_run", lambda _: True)(code)}
        for design, runner in active.items():
            runner.run_many([code] * min(4, args.concurrency))  # warm: slots forked, containers started
        samples = {design: ([], 0.0, 0, 0.0) for design in active}  # latencies, wall s, wrong results, CPU s
        for _ in range(args.rounds):
            for design, runner in active.items():
                fast = design.startswith(("fork server", "service (http)", "as "))  # the others: fewer calls
                n = args.calls if fast else 20 if "sympy" in name else 50
                start, cpu_start = time.perf_counter(), meter.read()
                results = runner.run_many([code] * n)
                wall, cpu = time.perf_counter() - start, meter.read() - cpu_start
                wrong = sum(not r.ok or r.stdout != expected for r in results)  # e.g. starved past the timeout
                latencies, total, errors, cpu_total = samples[design]
                samples[design] = (latencies + [r.latency for r in results], total + wall, errors + wrong, cpu_total + cpu)
        for design, (latencies, total, errors, cpu_total) in samples.items():
            latencies.sort()
            rates[design] = (len(latencies) - errors) / total  # correct results per second
            wrong_results[design] = wrong_results.get(design, 0) + errors
            cpu_ms = "n/a" if not meter.works or design == "docker" else f"{1000 * cpu_total / len(latencies):.1f}"
            p50_ms, p99_ms = (1000 * percentile(latencies, q) for q in (50, 99))
            print(f"{name:<17} {design:<16} {len(latencies):>6} {errors:>6} {rates[design]:>9.1f} "
                  f"{p50_ms:>8.1f} {p99_ms:>8.1f} {cpu_ms:>7}")
            row = name.split("(")[0].split()[0] + "_" + figure_key(design)  # print_fork_server
            figures.update({f"{row}_calls_per_s": round(rates[design], 1), f"{row}_wrong": errors,
                            f"{row}_p50_ms": round(p50_ms, 1), f"{row}_p99_ms": round(p99_ms, 1)})
            if cpu_ms != "n/a":
                figures[f"{row}_cpu_ms"] = float(cpu_ms)
        speedups[name] = rates["fork server"] / rates["fresh python -c"]
        http_share[name] = rates["service (http)"] / rates["fork server"]
    for runner in designs.values():
        runner.close()
    meter.leave()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    sympy_ok = speedups["sympy factorint"] >= 20 and wrong_results["fork server"] == 0
    print_ok = speedups["print(1+1)"] >= 1 and wrong_results["fork server"] == 0
    print(f"speed-up of the fork server over fresh python -c: print(1+1) {speedups['print(1+1)']:.1f}x "
          f"(target >= 1x: {'met' if print_ok else 'MISSED'}), sympy {speedups['sympy factorint']:.1f}x "
          f"(target >= 20x: {'met' if sympy_ok else 'MISSED'})")
    print("the HTTP service's calls/s as a share of the fork server's: "
          + ", ".join(f"{name} {100 * share:.0f}%" for name, share in http_share.items()))
    if args.results:
        figures.update(load_average_after=round(os.getloadavg()[0], 1),
                       print_speedup=round(speedups["print(1+1)"], 1), sympy_speedup=round(speedups["sympy factorint"], 1),
                       print_service_share_percent=round(100 * http_share["print(1+1)"]),
                       sympy_service_share_percent=round(100 * http_share["sympy factorint"]))
        print(f"wrote {save(args.results, make_command('bench-sandbox', sys.argv[1:]), figures)}")
    return 0 if sympy_ok and print_ok else 1


class Baseline:
    """One fresh interpreter per call, with the sandbox's limits: the design to beat."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config

    def run_many(self, codes: list[str]) -> list:
        with concurrent.futures.ThreadPoolExecutor(self.config.concurrency) as pool:
            return list(pool.map(self.run, codes))

    def run(self, code: str):
        cfg = self.config
        mb = 1024 * 1024

        def limits() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (cfg.memory_mb * mb,) * 2)
            resource.setrlimit(resource.RLIMIT_CPU, (int(cfg.timeout) + 2,) * 2)
            resource.setrlimit(resource.RLIMIT_FSIZE, (cfg.max_file_mb * mb,) * 2)

        workdir = tempfile.mkdtemp(prefix="bench-baseline-")
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=workdir,
                                  env=clean_env(), preexec_fn=limits, timeout=cfg.timeout)
            returncode, out, err, timed_out = proc.returncode, proc.stdout, proc.stderr, False
        except subprocess.TimeoutExpired as e:
            returncode, out, err, timed_out = -9, e.stdout or b"", e.stderr or b"", True
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return ExecResult(ok=returncode == 0 and not timed_out, stdout=out.decode(errors="replace"),
                          stderr=err.decode(errors="replace"), returncode=returncode, timed_out=timed_out,
                          truncated=False, latency=time.perf_counter() - start)

    def close(self) -> None:
        pass


class Service(Sandbox):
    """serve.py in a process of its own, called by the sandboxfusion backend: the fork server plus HTTP."""

    def __init__(self, config: SandboxConfig) -> None:
        import serve

        self.proc, url = serve.start_process("--concurrency", str(config.concurrency))
        super().__init__(SandboxConfig(backend="sandboxfusion", urls=(url,), concurrency=config.concurrency))

    def close(self) -> None:
        super().close()
        self.proc.terminate()
        self.proc.communicate(timeout=60)


class AsUser:
    """The fork server run by another user (not root: "userns") with SandboxConfig(**settings), in a worker
    (`runuser -u USER -- PYTHON`) that runs each batch of codes and sends back their results."""

    PYTHON = "/usr/bin/python3"  # a Python every user may run

    WORKER = (
        "import dataclasses, json, sys\nsys.path.insert(0, sys.argv[1])\nfrom sandbox import Sandbox, SandboxConfig\n"
        "settings = json.loads(sys.argv[2])\npreload = tuple(settings.pop('preload', SandboxConfig.preload))\n"
        "with Sandbox(SandboxConfig(preload=preload, **settings)) as sb:\n"
        "    print(json.dumps(sb.isolation), flush=True)\n"
        "    for line in sys.stdin:\n"
        "        print(json.dumps([dataclasses.asdict(r) for r in sb.run_many(json.loads(line))]), flush=True)\n"
    )

    def __init__(self, settings: dict, user: str) -> None:
        import local_backend

        self.folder = tempfile.mkdtemp(prefix="sbx-modules-")  # the modules a Sandbox needs, readable by every user
        os.chmod(self.folder, 0o755)
        for name in (*local_backend._SERVER_MODULES, "local_backend"):
            os.chmod(shutil.copy(Path(__file__).resolve().parent / f"{name}.py", self.folder), 0o644)
        command = ["runuser", "-u", user, "--", self.PYTHON, "-I"]
        self.proc = subprocess.Popen(command + ["-c", self.WORKER, self.folder, json.dumps(settings)], cwd="/",
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise OSError(f"the fork server did not start as {user} with {self.PYTHON}")
        self.isolation = json.loads(line)
        self.imports = subprocess.run(command + ["-c", "import sympy"], cwd="/", capture_output=True).returncode == 0

    def can_run(self, code: str) -> bool:
        return "sympy" not in code or self.imports

    def run_many(self, codes: list[str]) -> list:
        self.proc.stdin.write(json.dumps(codes) + "\n")
        self.proc.stdin.flush()
        return [ExecResult(**fields) for fields in json.loads(self.proc.stdout.readline())]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


class CpuMeter:
    """CPU seconds used by this process and all its descendants, through a cgroup of our own."""

    def __init__(self) -> None:
        self.works = False
        for root, stat in (("/sys/fs/cgroup/cpuacct", "cpuacct.usage"), ("/sys/fs/cgroup", "cpu.stat")):
            if os.path.exists(os.path.join(root, stat)) and os.path.exists(os.path.join(root, "cgroup.procs")):
                self.root, self.group = root, os.path.join(root, f"bench-sandbox-{os.getpid()}")
                self.stat = os.path.join(self.group, stat)
                try:
                    os.makedirs(self.group, exist_ok=True)
                    Path(self.group, "cgroup.procs").write_text(str(os.getpid()))
                    self.works = True
                    return
                except OSError:
                    with contextlib.suppress(OSError):
                        os.rmdir(self.group)

    def read(self) -> float:
        if not self.works:
            return 0.0
        text = Path(self.stat).read_text()
        if self.stat.endswith("cpuacct.usage"):
            return int(text) / 1e9  # nanoseconds
        return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6

    def leave(self) -> None:
        if self.works:
            Path(self.root, "cgroup.procs").write_text(str(os.getpid()))
            for _ in range(50):  # the server's last processes may still be exiting
                try:
                    os.rmdir(self.group)
                    return
                except OSError:
                    time.sleep(0.1)


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[round(q / 100 * (len(sorted_values) - 1))]  # q from 0 to 100


if __name__ == "__main__":
    sys.exit(main())
