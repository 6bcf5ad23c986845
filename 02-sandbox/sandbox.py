"""The code interpreter: run model-written Python in a fresh, contained process, fast.

    from sandbox import Sandbox, SandboxConfig, format_observation
    with Sandbox(SandboxConfig(timeout=10)) as sb:
        r = sb.run("import sympy; print(sympy.factorint(2**64 - 1))")
        print(format_observation(r))                       # what the model reads
    .venv/bin/python 02-sandbox/sandbox.py -c "print(1+1)"           # the same from a shell

The file opens with the caller's side (what chapter 03 uses), then the containment sequence in its seven steps.
Each step's hardening lives behind the call made here: confinement.py, runner.py, fork_server.py, local_backend.py.

Key decisions (the why, the threat model and the figures: docs/02-sandbox.md):
1. A warm fork server imports sympy once and runs the sequence in its slots: a call costs one fork.
2. It fails closed: isolation that cannot be set up raises SandboxError; "plain" is an explicit, weaker choice.
3. The code's process reads its own request and the kernel copies the answer, so no call's code or output stays
   in memory a later call inherits.
4. Docker (docker_backend.py) is the other backend: runner.py alone in a single-use container.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import confinement
import runner

HERE = Path(__file__).resolve().parent
LAB_ROOT = str(HERE.parent)  # never visible to the code: it holds the data sets and their answers
DEFAULT_IMAGE = "tool-rl-lab-sandbox:latest"

# ------------------------------------------------------------------------------------------------- The caller's side


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """What one execution produced."""

    ok: bool  # exited with status 0 and did not time out; empty stdout is still ok
    stdout: str  # decoded with invalid UTF-8 replaced; head and tail if over the cap
    stderr: str  # the same; ends with the sandbox's one-line reason when it stopped the code
    returncode: int  # exit status, or -N when killed by signal N (-9 on timeout)
    timed_out: bool  # the wall-clock limit stopped it
    truncated: bool  # stdout or stderr exceeded max_output_bytes and lost its middle
    latency: float  # seconds from sending the code to having the result (queueing excluded)


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """How code runs. Defaults suit math code written by a policy under RL."""

    backend: str = "local"  # "local" (fork server, no daemon), "docker" or "sandboxfusion" (HTTP servers at `urls`)
    timeout: float = 10.0  # wall-clock seconds; math code needing more is nearly always a runaway loop, and a rollout waits for its slowest call
    memory_mb: int = 1024  # address-space cap and the call's memory cgroup (local), or container memory (docker); the warm interpreter itself maps about 170 MB of it
    max_output_bytes: int = 64 * 1024  # bytes of each of stdout and stderr that come back (head and tail); the model sees 256 characters anyway
    max_file_mb: int = 16  # largest stream or file the code may write; a print flood is killed here
    max_processes: int = 64  # processes and threads per call; stops fork bombs, leaves room for a thread pool
    concurrency: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 2)  # calls at once; math code is CPU-bound, so one per core
    isolation: str = "namespaces"  # local only: "namespaces" (as root, or in a user namespace when not) or "plain" (weaker, explicit: docs/02-isolation.md)
    preload: tuple[str, ...] = ("math", "numpy", "sympy")  # imported once by the warm interpreter (1 s to start); missing ones are skipped
    python: str = sys.executable  # local only: the interpreter of the fork server
    image: str = DEFAULT_IMAGE  # docker only: built by 02-sandbox/build_image.sh or the Dockerfile
    docker_cpus: float = 1.0  # docker only: CPU share of one container
    docker_warm: int | None = None  # docker only: containers started ahead of need; None means `concurrency`
    urls: tuple[str, ...] = ()  # sandboxfusion only: servers of SandboxFusion's /run_code (serve.py or the real one); calls go to the least busy
    token: str | None = dataclasses.field(default=None, repr=False)  # sandboxfusion only: sent as a bearer token; None reads $SANDBOX_TOKEN

    def __post_init__(self) -> None:
        if self.backend not in ("local", "docker", "sandboxfusion"):
            raise ValueError(f"backend must be 'local' or 'docker', or 'sandboxfusion' with urls, got {self.backend!r}")
        if self.backend == "sandboxfusion" and not (self.urls and all(u.startswith(("http://", "https://")) for u in self.urls)):
            raise ValueError(f"urls must name at least one http:// or https:// server for backend 'sandboxfusion', got {self.urls!r}")
        if not (isinstance(self.preload, tuple)
                and all(isinstance(m, str) and all(part.isidentifier() for part in m.split(".")) for m in self.preload)):
            raise ValueError(f"preload must be a tuple of module names (like 'numpy' or 'os.path'), got {self.preload!r}")
        if self.isolation not in ("namespaces", "plain"):
            raise ValueError(f"isolation must be 'namespaces' or 'plain' (weaker isolation is never chosen for you), got {self.isolation!r}")
        for name in _RANGES:  # here, not later in a slot, where a bad value would fail every call or leave state behind
            if not (name == "docker_warm" and self.docker_warm is None):
                _check_range(name, getattr(self, name))


_RANGES = {  # setting: (type, smallest, largest); a number (float) must be above 0, an integer at least `smallest`
    "timeout": (float, 0, 86400.0), "memory_mb": (int, 1, 1 << 24), "max_output_bytes": (int, 1, 1 << 30),
    "max_file_mb": (int, 1, 1 << 20), "max_processes": (int, 1, 1 << 22), "concurrency": (int, 1, 1024),
    "docker_cpus": (float, 0, 1024.0), "docker_warm": (int, 0, 1024),
}


def _check_range(name: str, value) -> None:
    """Bools are not numbers here; nan and inf are out of range."""
    kind, low, high = _RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) \
            or not (low < value if kind is float else low <= value) or not value <= high:
        floor = "positive" if kind is float or low > 0 else f"{low} or more"
        raise ValueError(f"{name} must be {floor}, {'a number' if kind is float else 'an integer'} of at most {high}, got {value!r}")


class SandboxError(RuntimeError):
    """The sandbox itself cannot work (isolation not available, no engine, no image, server does not start)."""


class Sandbox:
    """Runs code in fresh, contained processes. Thread-safe; also a context manager. A backend has four methods:
    execute(request) -> answer dict, ready() (waits until calls can run), isolation() and close()."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._slots = threading.BoundedSemaphore(self.config.concurrency)
        if self.config.backend == "local":
            from local_backend import LocalBackend

            # the request maker builds the probe call that must show the isolation before any code runs
            self._backend = LocalBackend(self.config, SandboxError, lambda code: _request(code, self.config))
        elif self.config.backend == "sandboxfusion":
            from sandboxfusion_backend import SandboxFusionBackend  # over HTTP: docs/02-service.md

            self._backend = SandboxFusionBackend(self.config, SandboxError)
        else:
            from docker_backend import DockerBackend

            self._backend = DockerBackend(self.config, SandboxError)

    def run(self, code: str, timeout: float | None = None) -> ExecResult:
        """Run one program and return what it did; never raises for anything the code does.
        timeout: this call's wall-clock limit in seconds, instead of the config's."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        request = _request(code, self.config)
        if timeout is not None:
            _check_range("timeout", timeout)
            request["timeout"] = timeout
        with self._slots:
            self._backend.ready()  # the first call waits for the warm imports; not part of its latency
            start = time.perf_counter()
            answer = self._backend.execute(request)
            return _result(answer, request, time.perf_counter() - start)

    def run_many(self, codes: list[str], timeout: float | None = None) -> list[ExecResult]:
        """Run programs concurrently (up to `concurrency` at once); results in input order."""
        codes = list(codes)
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(codes), self.config.concurrency))) as pool:
            return list(pool.map(lambda code: self.run(code, timeout), codes))

    @property
    def isolation(self) -> str:
        """What contains the code: "namespaces" (root), "userns" (not root), "plain", "container", ... (docs/02-isolation.md)."""
        return self._backend.isolation()

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_observation(result: ExecResult, style: str = "short", max_chars: int | None = None) -> str:
    """The text the model reads after its code block, in the lab's two renderings (ToRL's own rule: chapter 03's
    rollout.torl_observation; why: docs/02-sandbox.md). short (max 256 characters): stdout on success, else the error's
    last line. full (max 2048): stdout, then after a failure stderr, keeping the tail: the error is never cut."""
    if style == "short":
        limit = 256 if max_chars is None else max_chars
        text = result.stdout if result.ok else _last_line(result)
        return _clip_middle(text, limit)
    if style == "full":
        limit = 2048 if max_chars is None else max_chars
        if result.ok:
            return _clip_middle(result.stdout, limit)
        text = result.stdout + (result.stderr or _last_line(result))
        return text if len(text) <= limit else "..." + text[len(text) - limit + 3:]
    raise ValueError(f"style must be 'short' or 'full', got {style!r}")


def _request(code: str, cfg: SandboxConfig) -> dict:
    """What travels to the runner: the code and its limits, nothing else."""
    limits = ("timeout", "memory_mb", "max_output_bytes", "max_file_mb", "max_processes")
    return {"code": code, **{name: getattr(cfg, name) for name in limits}}


def _result(answer: dict, request: dict, latency: float) -> ExecResult:
    """The runner's answer as an ExecResult, stderr ending with the sandbox's reason when it stopped the code or
    refused a socket the code needed (Python's own last line, often a warning, would not say why)."""
    stderr, reason = answer["stderr"], answer.get("error") or _reason(answer, request)
    if not reason and answer["returncode"] != 0 and _REFUSED_FAMILY in stderr:
        reason = _NO_SOCKETS
    if reason:
        stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + reason + "\n"
    return ExecResult(ok=answer["returncode"] == 0 and not answer["timed_out"], stdout=answer["stdout"], stderr=stderr,
                      returncode=answer["returncode"], timed_out=answer["timed_out"], truncated=answer["truncated"],
                      latency=latency)


_REFUSED_FAMILY = "[Errno 97] Address family not supported by protocol"  # EAFNOSUPPORT, from the filter (docs/02-isolation.md)
_NO_SOCKETS = ("OSError: this sandbox has no network and makes no socket: asyncio, socket.socketpair, "
               "multiprocessing.Pipe() and Manager() need one (AF_UNIX); use threads, multiprocessing.Pool or Queue")


def _reason(answer: dict, request: dict) -> str:
    """The one line the sandbox adds when it, not the code, ended the run."""
    if answer["timed_out"]:
        return f"TimeoutError: execution exceeded the {request['timeout']:g} s time limit"
    if answer["oom_killed"]:
        return f"MemoryError: the call used more than its {request['memory_mb']} MB and was killed"
    if answer["returncode"] >= 0:
        return ""
    signum = -answer["returncode"]
    reasons = {
        signal.SIGXFSZ: f"OutputLimitError: more than {request['max_file_mb']} MB written to one stream or file",
        signal.SIGXCPU: "TimeoutError: CPU time limit exceeded",
        signal.SIGSEGV: "Segmentation fault: the interpreter crashed (deep recursion or a native library)",
        signal.SIGBUS: f"Bus error: a memory-mapped file had no page to give (past its end, or all files hold {4 * request['max_file_mb']} MB)",
        signal.SIGKILL: "Killed (SIGKILL): out of memory or killed by another process",
    }
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = str(signum)
    return reasons.get(signum, f"Killed by signal {name}")


def _last_line(result: ExecResult) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"Process exited with code {result.returncode}"


def _clip_middle(text: str, limit: int) -> str:
    """Keep head and tail: the first lines say what the code printed, the last what it ended with."""
    if len(text) <= limit:
        return text
    marker = "\n...\n"
    keep = max(limit - len(marker), 0)
    return text[: keep - keep // 2] + marker + (text[len(text) - keep // 2:] if keep // 2 else "")


# ---------------------- The containment sequence: one call's path in seven steps, run by the fork server's slots
# (fork_server.py), each PID 1 of its own PID namespace. The detail behind each named call: confinement.py, runner.py.


def slot_main(slot) -> None:
    """A slot's life: its start once, then serve_call for each call, one at a time, until it served slot.calls
    calls (it then retires, and the server forks a new slot) or the server is gone."""
    enter_slot(slot)
    slot.ready()  # the server waits for this, or for the exception that stopped enter_slot
    for call_index in range(slot.calls):
        if not serve_call(slot, call_index):
            return
    slot.retire()


def enter_slot(slot) -> None:
    """Step 1, the slot's start, once. With namespaces (root, or "userns": inside the server's user namespace)
    the slot is PID 1 of its PID namespace: its kill(-1) after each call reaches every process the call left."""
    if slot.mode == "plain":  # no namespaces: the code's orphans are re-parented to the slot, which kills them
        confinement.prctl(confinement.PR_SET_CHILD_SUBREAPER, 1)
        return
    confinement.unshare(confinement.CLONE_NEWNS)  # mounts of the slot's own: nothing it mounts reaches the machine
    slot.last_pid, slot.proc = confinement.mount_proc()  # /proc of this PID namespace, hidepid=2: the code sees only its own processes
    # pivot_root into a small read-only tmpfs holding only the allow list (docs/02-isolation.md): the lab is not there
    slot.interpreter_in_scratch = confinement.build_root()


def serve_call(slot, call_index: int) -> bool:
    """Steps 2 to 7 for one call, in order; False when the server went away before a call came. slot: a
    fork_server.Slot (mode, the calls' uid, cgroups, seccomp program, listener); call_index names the call's cgroup."""
    # Step 2, namespaces, and the call's part of step 3, limits: made before the call arrives, out of its latency.
    if slot.mode != "plain":
        confinement.unshare(confinement.CLONE_NEWNET | confinement.CLONE_NEWIPC)  # no interface up, no IPC of an earlier call
        os.pwrite(slot.last_pid, b"1", 0)  # the PID counter (ns_last_pid) back to 1: the code is PID 2, whatever the last call forked
        # one empty tmpfs of 4 x max_file_mb behind /tmp, /var/tmp and /dev/shm; the work dir is /tmp/work
        workdir = confinement.fresh_scratch(slot.max_file_mb, slot.interpreter_in_scratch, slot.uid)
        # the call's memory and pids cgroup; where none can be had (unprivileged), the slot watches the call's memory
        limiter = confinement.CallGroup(slot.cgroups, f"call-{slot.token}-{call_index}") if slot.cgroups \
            else confinement.MemoryWatch(slot.proc)
    else:
        workdir, limiter = confinement.plain_workdir(slot.uid), None  # plain: a temporary folder, no cgroup
    try:
        conn = slot.accept()
        if conn is None:
            return False
        with conn:
            files = runner.CallFiles()  # stdout and stderr as memfds, and a pipe for three numbers (time limit, output and memory caps)
            pid = os.fork()  # the one fork per call: a copy of this warm slot becomes the code
            if pid == 0:
                runner.exit_after(code_process, conn.fileno(), files, workdir, slot, limiter)  # steps 3 to 5; never returns
            # Step 6, the answer: wait up to the timeout, asking the limiter every TICK whether the call is past its
            # memory; kill and reap what is left; sendfile copies head and tail of each memfd, never through the slot.
            try:
                runner.collect(pid, files, conn.fileno(), limiter)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the caller gave up waiting; the call's processes are already gone
        return True
    finally:  # Step 7, the clean-up: the call's processes are gone (step 6); its cgroup goes now, its tmpfs and namespaces
        if limiter is not None:  # when the next call gets fresh ones (or the slot exits)
            limiter.remove()
        if slot.mode == "plain":  # plain: the temporary folder goes now
            shutil.rmtree(workdir, ignore_errors=True)


def code_process(request_fd: int, files: runner.CallFiles, workdir: str, slot, limiter) -> int:
    """The forked process that becomes the code; returns its exit status. Each step needs a right that a later one
    takes away (root for the cgroup, unshare for the namespaces, setuid for the uid), hence the order."""
    request = runner.take_request(request_fd, files)  # it reads its own request (decision 3); the slot learns the time limit and two caps
    # Step 3, limits, the process's part
    if limiter is not None:
        limiter.join(request["memory_mb"], request["max_processes"])  # the memory and pids limits written, then it moves in, still root
    if slot.mode != "plain":
        confinement.unshare(confinement.CLONE_NEWCGROUP)  # after the join: its own view of cgroups (/proc/self/cgroup says "/")
        if slot.mode == "userns":
            confinement.enter_call_user_namespace()  # uid 65534 in a user namespace of the call's own, with no capability
    runner.detach(workdir)  # setsid, stdin /dev/null, every descriptor of the sandbox closed, chdir into the work dir
    # every rlimit, the call's own (docs/02-sandbox.md's table): address space, CPU time, file size, processes, ...
    runner.set_rlimits(request, slot.uid, slot.mode)
    runner.drop_privileges(slot.uid)  # setgroups([]), setgid, setuid to the slot's uid (if any); PR_SET_NO_NEW_PRIVS; PR_SET_PDEATHSIG
    # Step 4, the filter, last: the steps above make calls it denies (unshare, capset, setuid), and it needs no_new_privs.
    # slot.program is confinement.seccomp_program: an allow list of the calls math code makes; every other call fails.
    confinement.install_seccomp(slot.program)
    # Step 5, the run: an environment built from nothing, a fresh interpreter's state, exec(code) in a new __main__
    return runner.run_code(request["code"], workdir)


# ------------------------------------------------------------------------------------------------------ Command line


def main(argv: list[str] | None = None) -> int:
    from lab_cli import script_parser

    parser = script_parser(__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("-c", dest="code", help="the code to run")
    source.add_argument("file", nargs="?", help="a .py file to run")
    parser.add_argument("--backend", choices=["local", "docker"], default="local", help="default: %(default)s")
    parser.add_argument("--isolation", choices=["namespaces", "plain"], default=SandboxConfig.isolation,
                        help="local backend: namespaces (root's, or a user namespace's when not root) or the weaker plain (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=SandboxConfig.timeout, help="wall-clock seconds (default: %(default)s)")
    parser.add_argument("--memory-mb", type=int, default=SandboxConfig.memory_mb,
                        help="address-space cap and memory cgroup of the call, in MB (default: %(default)s)")
    parser.add_argument("--style", choices=["short", "full"], default="short", help="default: %(default)s")
    args = parser.parse_args(argv)
    code = args.code
    if args.file:
        try:
            code = Path(args.file).read_text()
        except OSError as e:
            parser.error(f"cannot read {args.file}: {e.strerror}")
    try:
        config = SandboxConfig(backend=args.backend, isolation=args.isolation, timeout=args.timeout, memory_mb=args.memory_mb)
        with Sandbox(config) as sb:
            result = sb.run(code)
    except (SandboxError, ValueError) as e:
        print(f"sandbox.py: {e}", file=sys.stderr)
        return 2
    observation = format_observation(result, args.style)
    sys.stdout.write(observation if observation.endswith("\n") else observation + "\n")
    print(f"-- ok={result.ok} returncode={result.returncode} timed_out={result.timed_out} "
          f"truncated={result.truncated} latency={result.latency * 1000:.1f} ms", file=sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
