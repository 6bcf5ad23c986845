"""The code interpreter: run model-written Python so that it can harm nothing, fast.

During RL the policy writes thousands of programs per step. Some loop forever, fill
memory, print without end or fork; a few read what they should not (environment
secrets, the network, the lab's files, such as the answers in a data set). This module
runs each program in a fresh, contained process and returns what the model should see.

    from sandbox import Sandbox, SandboxConfig, format_observation
    with Sandbox(SandboxConfig(timeout=10)) as sb:
        r = sb.run("import sympy; print(sympy.factorint(2**64 - 1))")
        print(format_observation(r))                       # what the model reads
    python 02-sandbox/sandbox.py -c "print(1+1)"           # the same from a shell

Execution model (local backend, the default)
--------------------------------------------
1. A fork server: a separate interpreter, started with `subprocess` from a clean
   environment (never forked from the caller, which may run vLLM threads), imports
   math, numpy and sympy once and listens on a Unix socket in a private 0700 folder.
   A fresh `python -c` pays about 0.5 s for `import sympy`; a fork pays a few ms.
2. The server keeps `concurrency` supervisors ("slots") running. Each is the init
   (PID 1) of its own PID namespace and has its own mount namespace, where the lab
   is hidden and every file system is read-only. Before each call it enters fresh
   network and IPC namespaces and mounts empty scratch dirs, then waits in accept().
3. Per call the caller opens one connection; one slot accepts it and forks the user
   process, which drops to an unprivileged uid and runs the code with `exec` in a
   brand-new `__main__` module. Calls are independent: one connection, one slot and
   one set of fresh namespaces each, so one call's crash never touches another's.
   The code only ever runs in a fork of a slot, which runs only the sandbox's own
   code, so nothing one call defines or changes (globals, monkey-patched modules,
   files, shared memory, processes) is visible to the next.

Each safeguard and the failure it prevents
------------------------------------------
- Wall-clock timeout (the slot's alarm): infinite loops, sleeps, reads that never
  return. Before answering, the slot, being PID 1, kills every other process of its
  PID namespace (kill(-1)) and reaps them, so a daemon that called setsid and
  double-forked dies too, which a process-group kill would miss. After any call no
  process it started is alive.
- RLIMIT_CPU: a CPU-bound process that somehow outlives the wall clock.
- RLIMIT_AS (`memory_mb`): memory bombs fail with MemoryError in the code itself
  instead of waking the kernel's OOM killer, which may pick a process of the lab.
- RLIMIT_NPROC (`max_processes`) with a uid of its own per call: a fork bomb stalls
  at the limit without taking process slots from concurrent calls.
- The code's parent is PID 1 of its namespace and runs as root: the code can neither
  kill it (`os.kill(os.getppid(), 9)`) nor reach anything outside with `kill(-1)`.
- RLIMIT_FSIZE (`max_file_mb`): stdout and stderr are memory files (memfd) with this
  byte cap, as is every file the code writes, so a print flood or a 100 MB line ends
  with SIGXFSZ instead of filling the caller's memory or the disk. Only the first
  and last `max_output_bytes / 2` bytes of each stream come back; invalid UTF-8 is
  replaced, never raised.
- Network namespace: no interface is up, so any connection fails at once with
  "Network is unreachable" (no exfiltration, no downloads, no hanging on a socket).
- IPC namespace: System V shared memory, semaphores and message queues die with the
  call instead of outliving it in the machine's memory, where the next call could
  find them.
- Mount namespace: every file system read-only (world-writable folders such as
  /run/lock included), a private, size-capped tmpfs over /tmp, /var/tmp and /dev/shm
  that is replaced for every call (the work dir lives there), and an empty tmpfs over
  the lab's own folder and $HOME (`hidden_paths`: the code must not read ground-truth
  answers or tokens); only the interpreter's own folders inside are bound back, so
  imports keep working.
- Unprivileged uid, no_new_privs: the code cannot write outside its work dir, read
  /root, signal the lab's processes or regain root through a setuid binary.
- Clean environment: the server starts from an environment built from nothing, so
  tokens such as HF_TOKEN or WANDB_API_KEY never reach it. BLAS thread counts are
  pinned to 1 so that numpy does not oversubscribe the cores concurrent calls share.
- stdin is /dev/null: `input()` raises EOFError instead of blocking until timeout.
- stdout is unbuffered: what the code printed before `os._exit`, a segfault or a
  kill is kept, as the model would expect from a terminal.
- Random generators (random, numpy.random) are reseeded per call: a fork would
  otherwise hand every call the same "random" numbers.

Where the namespaces are not available (not root, or a kernel that forbids them) the
sandbox says so once, loudly (a RuntimeWarning), and runs in "plain" isolation: same
limits and clean environment, the process tree killed through a child subreaper
rather than a PID namespace, a real temporary work dir removed afterwards, but the
code sees the network and the file system with the caller's own rights.

Docker backend
--------------
The same runner (this very file, sent as `python3 -c <source>`) runs inside a
container with network_mode="none", memory/pids/CPU limits, a read-only root file
system, a small tmpfs on /tmp, all capabilities dropped and uid 65534. Containers are
single-use: a few are started ahead of need (their runner has already imported
sympy), each takes one call on stdin and is removed afterwards, so there is no state
to reset between calls. The image: 02-sandbox/Dockerfile (+ build_image.sh).

What the model sees (format_observation)
----------------------------------------
"short": stdout on success (empty stdout is a success); on failure only the last line
of stderr, e.g. `NameError: name 'a' is not defined`; on a timeout or a kill the
sandbox's own one-line reason; capped at 256 characters keeping head and tail.
"full": stdout, or on failure stdout and the traceback, keeping the tail.
ToRL's own rule, byte for byte, is chapter 03's protocol (rollout.torl_observation).

Verified by 02-sandbox/test_sandbox.py (every hostile case, both backends) and
measured by 02-sandbox/bench_sandbox.py (docs/02-sandbox.md has the figures).
"""
from __future__ import annotations

import argparse
import atexit
import builtins
import concurrent.futures
import ctypes
import dataclasses
import gc
import io
import json
import linecache
import os
import queue
import re
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
import weakref
from pathlib import Path

# The lab's root: hidden from the code by default (its data may hold the answers).
LAB_ROOT = str(Path(__file__).resolve().parent.parent) if "__file__" in globals() else ""
DEFAULT_IMAGE = "tool-rl-lab-sandbox:latest"


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

    backend: str = "local"  # "local" (fork server, no daemon) or "docker"
    timeout: float = 10.0  # wall-clock seconds; math code needing more is nearly always a runaway loop, and a rollout waits for its slowest call
    memory_mb: int = 1024  # address-space cap (local) or container memory (docker); the warm interpreter itself takes about 140 MB of it
    max_output_bytes: int = 64 * 1024  # bytes of each of stdout and stderr that come back (head and tail); the model sees 256 characters anyway
    max_file_mb: int = 16  # largest stream or file the code may write; a print flood is killed here
    max_processes: int = 64  # processes and threads per call; stops fork bombs, leaves room for a thread pool
    concurrency: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 2)  # calls at once; math code is CPU-bound, so one per core
    isolation: str = "auto"  # local only: "namespaces", "plain", or "auto" (namespaces where the machine allows)
    preload: tuple[str, ...] = ("math", "numpy", "sympy")  # imported once by the warm interpreter; missing ones are skipped
    hidden_paths: tuple[str, ...] = (LAB_ROOT, os.path.expanduser("~"))  # local namespaces only: shown to the code as empty folders (the interpreter's own folders inside stay)
    python: str = sys.executable  # local only: the interpreter of the fork server
    image: str = DEFAULT_IMAGE  # docker only: built by 02-sandbox/build_image.sh or the Dockerfile
    docker_cpus: float = 1.0  # docker only: CPU share of one container
    docker_warm: int | None = None  # docker only: containers started ahead of need; None means `concurrency`

    def __post_init__(self) -> None:
        if self.backend not in ("local", "docker"):
            raise ValueError(f"backend must be 'local' or 'docker', got {self.backend!r}")
        if self.isolation not in ("auto", "namespaces", "plain"):
            raise ValueError(f"isolation must be 'auto', 'namespaces' or 'plain', got {self.isolation!r}")
        for name in ("timeout", "memory_mb", "max_output_bytes", "max_file_mb", "max_processes", "concurrency", "docker_cpus"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


class SandboxError(RuntimeError):
    """The sandbox itself cannot work (no engine, no image, server does not start)."""


class Sandbox:
    """Runs code in fresh, contained processes. Thread-safe; also a context manager."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._slots = threading.BoundedSemaphore(self.config.concurrency)
        self._backend = _LocalBackend(self.config) if self.config.backend == "local" else _DockerBackend(self.config)

    def run(self, code: str, timeout: float | None = None) -> ExecResult:
        """Run one program and return what it did; never raises for anything the code does.

        timeout: this call's wall-clock limit in seconds, instead of the config's.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        request = _request(code, self.config)
        if timeout is not None:
            request["timeout"] = timeout
        with self._slots:
            self._backend.ready()  # the first call waits for the warm imports; not part of its latency
            start = time.perf_counter()
            raw = self._backend.execute(request)
            return _result(raw, time.perf_counter() - start)

    def run_many(self, codes: list[str], timeout: float | None = None) -> list[ExecResult]:
        """Run programs concurrently (up to `concurrency` at once); results in input order."""
        codes = list(codes)
        if not codes:
            return []
        with concurrent.futures.ThreadPoolExecutor(min(len(codes), self.config.concurrency)) as pool:
            return list(pool.map(lambda code: self.run(code, timeout), codes))

    @property
    def isolation(self) -> str:
        """What contains the code: "namespaces", "plain" or "container"."""
        return self._backend.isolation()

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_observation(result: ExecResult, style: str = "short", max_chars: int | None = None) -> str:
    """The text the model reads after its code block, in the lab's two renderings.

    short (max 256 characters): stdout on success, else only the last line of the
    error. The last line names the exception and its message, which is what the
    model needs to fix its code; the frames above it are long, mostly about
    library internals, and would eat the context and the token budget of a rollout.
        ok, stdout "4\\n"                      -> "4\\n"
        NameError traceback                    -> "NameError: name 'a' is not defined"
        timeout                                -> "TimeoutError: execution exceeded the 10 s time limit"
    full (max 2048 characters): stdout on success, else stdout then stderr, keeping
    the tail so that the error itself is never cut.
    """
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


# --------------------------------------------------------------------------------------
# Caller side: requests, results, the two backends
# --------------------------------------------------------------------------------------

ANSWER_GRACE = 30.0  # seconds past the timeout before the caller gives up on an answer (a loaded machine is slow to fork and reap)
WARNED: set[str] = set()  # reasons already printed: "says so once"


def _request(code: str, cfg: SandboxConfig) -> dict:
    return {
        "code": code,
        "timeout": cfg.timeout,
        "memory_mb": cfg.memory_mb,
        "max_output_bytes": cfg.max_output_bytes,
        "max_file_mb": cfg.max_file_mb,
        "max_processes": cfg.max_processes,
    }


def _result(raw: dict, latency: float) -> ExecResult:
    return ExecResult(
        ok=raw["returncode"] == 0 and not raw["timed_out"],
        stdout=raw["stdout"],
        stderr=raw["stderr"],
        returncode=raw["returncode"],
        timed_out=raw["timed_out"],
        truncated=raw["truncated"],
        latency=latency,
    )


def _failure(reason: str) -> dict:
    """A result for a call whose supervisor gave no answer (killed, crashed)."""
    return {"stdout": "", "stderr": reason + "\n", "returncode": -signal.SIGKILL, "timed_out": False, "truncated": False}


class _LocalBackend:
    """Talks to the fork server: one Unix-socket connection per call."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self._cfg = cfg
        self._lock = threading.Lock()  # one thread at a time (re)starts the server
        self._closed = False
        self._server = _Server(cfg)  # starts importing now; waited for on first use

    def execute(self, request: dict) -> dict:
        server = self._ready_server()
        try:
            return server.call(request, request["timeout"] + ANSWER_GRACE)
        except (ConnectionRefusedError, FileNotFoundError):
            # The server died (killed from outside): start a new one and try once more.
            return self._ready_server(replace=server).call(request, request["timeout"] + ANSWER_GRACE)

    def isolation(self) -> str:
        return self._ready_server().isolation

    def ready(self) -> None:
        self._ready_server()

    def _ready_server(self, replace: _Server | None = None) -> _Server:
        with self._lock:
            if self._closed:
                raise SandboxError("the sandbox is closed")
            if self._server is replace or not self._server.alive():
                self._server.stop()
                self._server = _Server(self._cfg)
            self._server.wait_ready()
            return self._server

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._server.stop()


class _Server:
    """One fork-server process and the private folder holding its socket."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self._cfg = cfg
        self.folder = tempfile.mkdtemp(prefix="sandbox-server-")  # mode 0700: only our own uid reaches the socket
        self.socket_path = os.path.join(self.folder, "socket")
        self._log = open(os.path.join(self.folder, "server.log"), "wb")
        options = {
            "preload": list(cfg.preload),
            "isolation": cfg.isolation,
            "hidden_paths": [p for p in cfg.hidden_paths if p],
            "spares": cfg.concurrency,  # supervisors kept running: one per concurrent call
            "slot_calls": SLOT_CALLS,
            "max_file_mb": cfg.max_file_mb,
        }
        try:
            self._proc = subprocess.Popen(
                [cfg.python, str(Path(__file__).resolve()), "--serve", self.socket_path, json.dumps(options)],
                stdin=subprocess.PIPE,  # the server exits when this pipe closes: when we do, or die
                stdout=subprocess.PIPE,  # one line: "ready" and what isolation it got
                stderr=self._log,
                env=_clean_env(),
                cwd=self.folder,
                start_new_session=True,  # a Ctrl-C meant for the caller must not kill calls in flight
            )
        except OSError as e:
            raise SandboxError(f"cannot start the fork server with {cfg.python}: {e}") from None
        self.isolation = ""
        # Stops the server when the Sandbox is dropped without close(), or at exit.
        self._finalizer = weakref.finalize(self, _stop_server, self._proc, self.folder, self._log)

    def wait_ready(self, timeout: float = 120.0) -> None:
        if self.isolation:
            return
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise SandboxError(f"the fork server did not start: {self._log_tail()}")
        hello = json.loads(line)
        self.isolation = hello["isolation"]
        if hello.get("warning") and hello["warning"] not in WARNED:
            WARNED.add(hello["warning"])
            warnings.warn(hello["warning"], RuntimeWarning, stacklevel=4)

    def call(self, request: dict, timeout: float) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(self.socket_path)
            try:
                _send(conn, request)
                answer = _recv(conn)
            except socket.timeout:
                return _failure(f"SandboxError: no answer from the supervisor within {timeout:.0f} s")
            return answer if answer is not None else _failure("SandboxError: the supervisor of this call died without an answer")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> None:
        self._finalizer()

    def _log_tail(self) -> str:
        try:
            lines = Path(self.folder, "server.log").read_text(errors="replace").strip().splitlines()
            return lines[-1] if lines else f"exit status {self._proc.poll()}"
        except OSError:
            return f"exit status {self._proc.poll()}"


def _stop_server(proc: subprocess.Popen, folder: str, log) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
    proc.stdout.close()
    log.close()
    shutil.rmtree(folder, ignore_errors=True)


class _DockerBackend:
    """Single-use containers, started ahead of need, each running this file's runner."""

    def __init__(self, cfg: SandboxConfig) -> None:
        try:
            import docker
        except ImportError:
            raise SandboxError("the docker backend needs the docker Python SDK (pip install docker)") from None
        self._docker = docker
        self._cfg = cfg
        try:
            self._client = docker.from_env(version="auto", timeout=60, max_pool_size=cfg.concurrency + 8)
            self._client.ping()
        except Exception as e:
            raise SandboxError(f"no Docker engine reachable: {e}") from None
        try:
            self._client.images.get(cfg.image)
        except docker.errors.ImageNotFound:
            raise SandboxError(f"Docker image {cfg.image} not found: build it with 02-sandbox/build_image.sh") from None
        # The runner is this file, sent as `python3 -c` (about 60 KB; one argument may hold 128 KiB).
        self._source = Path(__file__).read_text()
        self._warm: queue.Queue = queue.Queue()  # (container id, time it was started)
        self._closed = False
        self._want = cfg.docker_warm if cfg.docker_warm is not None else cfg.concurrency
        self._chores = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="sandbox-docker")
        self._pending: set[concurrent.futures.Future] = set()
        self._pending_lock = threading.Lock()
        for _ in range(self._want):
            self._chore(self._start_warm)

    def isolation(self) -> str:
        return "container"

    def ready(self) -> None:
        pass  # containers are started on demand when none is warm

    def execute(self, request: dict) -> dict:
        container = self._take()
        self._chore(self._start_warm)  # replace the one taken, in the background
        try:
            return self._exchange(container, request, request["timeout"] + ANSWER_GRACE)
        except self._docker.errors.APIError:
            # A warm container can be gone (it gave up waiting, or was killed): use a new one.
            self._chore(self._remove, container)
            container = self._start()
            return self._exchange(container, request, request["timeout"] + ANSWER_GRACE)
        finally:
            self._chore(self._remove, container)

    def close(self) -> None:
        self._closed = True
        with self._pending_lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)
        while not self._warm.empty():
            self._remove(self._warm.get_nowait()[0])
        self._chores.shutdown(wait=True)

    def _take(self) -> str:
        """A warm container, or a new one; never one whose runner is about to give up waiting."""
        while True:
            try:
                container, started = self._warm.get_nowait()
            except queue.Empty:
                return self._start()
            if time.monotonic() - started < IDLE_EXIT - 60:
                return container
            self._chore(self._remove, container)

    def _start(self):
        """Create and start one container whose runner waits for a request on stdin."""
        cfg = self._cfg
        api = self._client.api
        host_config = api.create_host_config(
            network_mode="none",
            # The code's own cap is RLIMIT_AS (memory_mb), as in the local backend; the
            # container adds room for the runner (about 64 MB) and its tmpfs, and no swap.
            mem_limit=f"{cfg.memory_mb + 4 * cfg.max_file_mb + 64}m",
            memswap_limit=f"{cfg.memory_mb + 4 * cfg.max_file_mb + 64}m",
            pids_limit=cfg.max_processes + 8,  # the runner's own processes on top of the code's
            nano_cpus=int(cfg.docker_cpus * 1e9),
            read_only=True,
            tmpfs={"/tmp": f"size={4 * cfg.max_file_mb}m,mode=1777"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            auto_remove=True,  # a container whose runner gave up waiting removes itself
            log_config={"type": "none"},  # the answer comes over the attach stream, nothing to keep
        )
        created = api.create_container(
            cfg.image,
            command=["python3", "-c", self._source, "--container", json.dumps({"preload": list(cfg.preload)})],
            user="65534:65534",
            environment=_clean_env(),
            working_dir="/tmp",
            stdin_open=True,  # with detach=False the SDK also sets StdinOnce: stdin closes when we hang up
            detach=False,
            host_config=host_config,
            labels={"tool-rl-lab.sandbox": str(os.getpid())},
        )
        api.start(created["Id"])
        return created["Id"]

    def _start_warm(self) -> None:
        if not self._closed and self._warm.qsize() < self._want:
            container = self._start()
            self._warm.put((container, time.monotonic()))
            if self._closed:
                self._remove(container)

    def _exchange(self, container: str, request: dict, timeout: float) -> dict:
        api = self._client.api
        sock = api.attach_socket(container, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        raw = getattr(sock, "_sock", sock)
        try:
            raw.settimeout(timeout)
            raw.sendall(json.dumps(request).encode())
            raw.shutdown(socket.SHUT_WR)  # EOF on the runner's stdin: the request is complete
            out, err = _read_docker_stream(raw)
        except (socket.timeout, TimeoutError):
            return _failure(f"SandboxError: no answer from the container within {timeout:.0f} s")
        finally:
            raw.close()
            sock.close()
        try:
            return json.loads(out.split(b"\n", 1)[0])
        except ValueError:
            last = err.decode(errors="replace").strip().splitlines()
            return _failure("SandboxError: the container gave no answer" + (f": {last[-1]}" if last else " (killed: out of memory?)"))

    def _remove(self, container: str) -> None:
        try:
            self._client.api.remove_container(container, force=True)
        except self._docker.errors.NotFound:
            pass  # auto_remove got there first
        except self._docker.errors.APIError as e:
            if "already in progress" not in str(e):
                raise

    def _chore(self, fn, *args) -> None:
        if self._closed and fn is self._start_warm:
            return
        future = self._chores.submit(fn, *args)
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._chore_done)

    def _chore_done(self, future) -> None:
        with self._pending_lock:
            self._pending.discard(future)
        if future.exception() is not None and not self._closed:
            warnings.warn(f"sandbox docker chore failed: {future.exception()}", RuntimeWarning)


def _read_docker_stream(sock: socket.socket) -> tuple[bytes, bytes]:
    """Demultiplex an attach stream: frames of an 8-byte header (stream, size) and a payload.

    Stops at the first newline on stdout, the end of the runner's one-line answer, rather
    than at the end of the stream, which comes only once the container has exited.
    """
    streams = {1: bytearray(), 2: bytearray()}
    buffer = bytearray()
    while b"\n" not in streams[1]:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buffer += chunk
        while len(buffer) >= 8:
            kind, size = buffer[0], struct.unpack(">I", buffer[4:8])[0]
            if len(buffer) < 8 + size:
                break
            streams.setdefault(kind, bytearray()).extend(buffer[8:8 + size])
            del buffer[:8 + size]
    return bytes(streams[1]), bytes(streams[2])


def _clean_env() -> dict:
    """The whole environment the sandbox's processes get: built from nothing, never copied."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "USER": "sandbox", "MPLBACKEND": "Agg"}
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"):
        env[name] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


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


# --------------------------------------------------------------------------------------
# Inside: the fork server, its slots (supervisors), the user process, the container runner
# --------------------------------------------------------------------------------------

IDLE_EXIT = 900.0  # seconds a warm container waits for its request before giving up
_OLD_STREAMS: list = []  # see _fresh_interpreter_state


def _serve(socket_path: str, options: dict) -> None:
    """The fork server: warm imports, then keep `spares` supervisors ("slots") running.

    A slot is forked once, enters its namespaces, hides the lab and makes every file
    system read-only; then, call after call, it prepares a fresh network and IPC
    namespace and empty scratch dirs, waits in accept(), forks the user process, kills
    whatever that process left, and answers. A call therefore pays one fork on its
    critical path, and none of the namespace set-up. A slot retires after SLOT_CALLS
    calls (or dies) and the server forks a new one. In namespace isolation a slot is
    the init (PID 1) of its own PID namespace: the server unshares CLONE_NEWPID only
    for that fork and then returns to its own.
    """
    _preload(options["preload"])
    hidden = [p for p in options["hidden_paths"] if os.path.isdir(p) and p != "/"]
    mode, warning = _choose_isolation(options["isolation"], hidden, options["preload"])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(256)
    listener.setblocking(False)  # several slots poll it; the losers of a race get EAGAIN
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps finished slots
    gc.freeze()  # the warm objects stay out of every child's collections: fewer copied pages
    alive_r, alive_w = os.pipe()  # idle slots see EOF here when the server is gone
    leaving_r, leaving_w = os.pipe()  # a slot about to retire writes its token here
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY) if mode == "namespaces" else None
    slots: dict[int, int] = {}  # token -> pid
    tokens = iter(range(1, 1 << 62))

    def spawn() -> None:
        token = next(tokens)
        uid = _slot_uid(token) if mode == "namespaces" else None
        if own_pid_ns is not None:
            _unshare(CLONE_NEWPID)
        pid = os.fork()
        if pid == 0:
            os.close(alive_w)
            os.close(leaving_r)
            _slot(listener, alive_r, leaving_w, token, uid, mode, hidden, options)  # never returns
        if own_pid_ns is not None:
            _setns(own_pid_ns, CLONE_NEWPID)
        slots[token] = pid

    for _ in range(options["spares"]):
        spawn()
    sys.stdout.write(json.dumps({"isolation": mode, "warning": warning}) + "\n")
    sys.stdout.flush()
    poller = select.poll()
    poller.register(0, select.POLLIN)  # the caller's pipe: readable only at EOF, when it is gone
    poller.register(leaving_r, select.POLLIN)
    while True:
        events = poller.poll(1000)
        for fd, _ in events:
            if fd == 0:
                return
            for (token,) in struct.iter_unpack("q", os.read(leaving_r, 8 * 512)):
                slots.pop(token, None)
                spawn()
        if not events:  # a quiet second: replace any slot that died
            for token, pid in list(slots.items()):
                if not _alive(pid):
                    del slots[token]
                    spawn()


SLOT_CALLS = 200  # calls a slot serves before it retires: bounds how far its memory drifts from the server's


def _slot(listener: socket.socket, alive: int, leaving: int, token: int, uid: int | None, mode: str, hidden: list[str], options: dict) -> None:
    """One supervisor: set up isolation once, then serve calls one at a time."""
    status = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)  # the server's pipe from the caller stays with the server
        os.close(devnull)
        if mode == "namespaces":
            _unshare(CLONE_NEWNS)  # the PID namespace came with the fork
            keep = _private_filesystem(hidden)
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # the code sees only its own processes
        else:
            _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the code become ours to kill
        for _ in range(options["slot_calls"]):
            # Prepared before the call arrives, so that it costs the call nothing.
            if mode == "namespaces":
                _unshare(CLONE_NEWNET | CLONE_NEWIPC)  # the previous call's die with their last process
                workdir = _fresh_scratch(options, keep, uid)
            else:
                workdir = tempfile.mkdtemp(prefix="sandbox-work-")
            try:
                conn = _accept(listener, alive)
                if conn is None:
                    status = 0
                    return
                with conn:
                    request = _recv(conn)
                    if request is not None:
                        _send(conn, _execute(request, workdir, mode, uid))
            finally:
                if mode != "namespaces":  # in namespaces the tmpfs goes with the next call or the slot
                    shutil.rmtree(workdir, ignore_errors=True)
        os.write(leaving, struct.pack("q", token))
        status = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)  # as PID 1: the kernel tears the namespaces down


def _accept(listener: socket.socket, alive: int) -> socket.socket | None:
    """Wait for a call; None when the server exited first."""
    poller = select.poll()
    poller.register(listener.fileno(), select.POLLIN)
    poller.register(alive, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == alive:
                return None
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                continue  # another slot took it
            conn.setblocking(True)
            return conn


def _container_main(options: dict) -> None:
    """Inside a container: warm imports, wait for one request on stdin, answer on stdout."""
    _preload(options["preload"])
    ready, _, _ = select.select([0], [], [], IDLE_EXIT)
    if not ready:
        return
    request = json.loads(sys.stdin.buffer.read())
    workdir = tempfile.mkdtemp(prefix="work-")
    result = _execute(request, workdir, "container", None)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def _execute(request: dict, workdir: str, mode: str, uid: int | None) -> dict:
    """Run one request from its supervisor and collect its output; the supervisor survives."""
    out = os.memfd_create("stdout")
    err = os.memfd_create("stderr")
    report = _contain(request, workdir, out, err, uid, mode)
    stdout, cut_out = _read_capped(out, request["max_output_bytes"])
    stderr, cut_err = _read_capped(err, request["max_output_bytes"])
    returncode = _returncode(report["status"])
    reason = _reason(report, returncode, request)
    if reason:
        stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + reason + "\n"
    return {
        "stdout": stdout,
        "stderr": stderr,
        "returncode": returncode,
        "timed_out": report["timed_out"],
        "truncated": cut_out or cut_err,
    }


def _contain(request: dict, workdir: str, out: int, err: int, uid: int | None, mode: str) -> dict:
    """Fork the user process, wait for it up to the timeout, then kill all it started."""
    user = os.fork()
    if user == 0:
        _become_user_process(request, workdir, out, err, uid, mode)  # never returns
    timed_out = False

    def on_alarm(signum, frame):
        raise TimeoutError

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, request["timeout"])
    status = None
    try:
        while status is None:
            pid, wait_status = os.waitpid(-1, 0)  # also reaps the code's orphans, which are ours
            if pid == user:
                status = wait_status
    except TimeoutError:
        timed_out = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if timed_out:
        _kill_quietly(user)
        _, status = os.waitpid(user, 0)
    _kill_the_rest()  # before answering: when the caller has its result, nothing is left running
    return {"status": status, "timed_out": timed_out}


def _become_user_process(request: dict, workdir: str, out: int, err: int, uid: int | None, mode: str) -> None:
    """Turn this forked process into a fresh, unprivileged interpreter running the code."""
    status = 1
    try:
        os.setsid()  # a group of its own: a kill of the group never reaches the supervisor
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # no socket, pipe or memfd of the sandbox stays reachable
        os.chdir(workdir)
        mb = 1024 * 1024
        _set_limit(resource.RLIMIT_AS, request["memory_mb"] * mb)
        _set_limit(resource.RLIMIT_CPU, int(request["timeout"]) + 2)
        _set_limit(resource.RLIMIT_FSIZE, request["max_file_mb"] * mb)
        if mode == "namespaces":  # the uid is this call's own: the limit is this call's budget
            _set_limit(resource.RLIMIT_NPROC, request["max_processes"])
        elif mode == "plain":  # the uid is shared with the caller: a budget on top of what it runs
            _set_limit(resource.RLIMIT_NPROC, _tasks_of_uid(os.getuid()) + request["max_processes"])
        # In a container the pids cgroup is the budget: RLIMIT_NPROC would count every
        # container's processes together, since they all run as uid 65534.
        _set_limit(resource.RLIMIT_CORE, 0)
        for number in (signal.SIGCHLD, signal.SIGALRM, signal.SIGXFSZ, signal.SIGXCPU, signal.SIGTERM):
            signal.signal(number, signal.SIG_DFL)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries cannot give root back
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # if the supervisor dies, so does the code
        os.environ.clear()
        os.environ.update(_clean_env(), HOME=workdir, TMPDIR=workdir)
        _fresh_interpreter_state()
        status = _run_code(request["code"])
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)


def _run_code(source: str) -> int:
    """Run the code as `python -c` would and return its exit status."""
    name = "<string>"
    # Registering the source lets tracebacks show the offending line, as from a file.
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    try:
        exec(compile(source, name, "exec", dont_inherit=True), main.__dict__)
        status = 0
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:
        # Skip this function's own frame: the model should see only its code's frames.
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        status = 1
    try:
        for thread in threading.enumerate():  # the interpreter waits for non-daemon threads at exit
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    return status


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def _fresh_interpreter_state() -> None:
    """What a new interpreter would have and a fork does not."""
    # The server's stream objects own fds 0-2, which are now the code's: collecting
    # them would close those fds, so they are kept referenced until os._exit.
    _OLD_STREAMS.extend([sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__])
    sys.stdin = sys.__stdin__ = _io_text(0, "r")
    sys.stdout = sys.__stdout__ = _io_text(1, "w")
    sys.stderr = sys.__stderr__ = _io_text(2, "w")
    sys.argv = ["-c"]
    if sys.path:
        sys.path[0] = ""  # like `python -c`: the work dir, not the lab's folder
    import random

    random.seed()
    if "numpy.random" in sys.modules:  # not imported yet: it will seed itself when it is
        sys.modules["numpy.random"].seed()


def _io_text(fd: int, mode: str):
    """Unbuffered text stream on fd: output survives os._exit and crashes."""
    raw = io.FileIO(fd, mode, closefd=False)
    if mode == "r":
        return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors="replace")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)


SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # the only places the code may write: an empty tmpfs each, per call


def _private_filesystem(hidden: list[str]) -> dict[str, int]:
    """Once per slot, in its new mount namespace: hide folders, make everything read-only.

    Returns descriptors of the interpreter's folders that lie inside a scratch dir
    (a venv under /tmp), which every call's fresh tmpfs must bind back.
    """
    _mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    keep = _interpreter_paths()
    for path in hidden:
        if os.path.isdir(path):
            handles = {k: os.open(k, os.O_PATH) for k in keep if _inside(k, path)}
            _mask(path, "size=1m,mode=0755", handles)
            for fd in handles.values():
                os.close(fd)
    # World-writable folders outside the scratch dirs (/run/lock, say) would let one
    # call leave files for the next and on the machine: no file system stays writable.
    _read_only_mounts()
    return {k: os.open(k, os.O_PATH) for k in keep if any(_inside(k, d) for d in SCRATCH_DIRS)}


def _fresh_scratch(options: dict, keep: dict[str, int], uid: int) -> str:
    """Per call: empty tmpfs on the scratch dirs (the previous call's are detached), a work dir for uid."""
    size = f"size={4 * options['max_file_mb']}m"  # room for a few files of the largest size
    for path in SCRATCH_DIRS:
        if os.path.isdir(path):
            if path in _MOUNTED_SCRATCH:
                _umount(path)
            _mask(path, f"{size},mode=1777", {k: fd for k, fd in keep.items() if _inside(k, path)})
            _MOUNTED_SCRATCH.add(path)
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    os.chown(workdir, uid, uid)
    return workdir


_MOUNTED_SCRATCH: set[str] = set()  # scratch dirs that carry a tmpfs of ours in this slot


def _mask(path: str, options: str, handles: dict[str, int]) -> None:
    """Cover path with an empty tmpfs, then bind back the kept folders that were inside it.

    The interpreter may live inside a masked folder (a venv in the lab, pyenv under
    /root): it comes back through descriptors opened before the folder disappeared.
    """
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
    for kept, fd in handles.items():
        os.makedirs(kept, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", kept, None, MS_BIND | MS_REC)


def _read_only_mounts() -> None:
    """Remount every mount of this namespace read-only, keeping its nosuid/nodev/noexec."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    done = set()
    for fields in mounts:
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # a space comes as \040
        options = fields[5].split(",")
        if target in done or "ro" in options:
            continue
        done.add(target)
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        flags |= (MS_NODEV if "nodev" in options else 0) | (MS_NOEXEC if "noexec" in options else 0)
        try:
            _mount("none", target, None, flags)
        except OSError:
            pass  # a mount that refuses stays as it was; the unprivileged uid still guards it


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def _interpreter_paths() -> list[str]:
    """Folders the code needs to import the standard library and the installed packages."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    real = sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})
    # A folder inside another kept folder comes back with it.
    return [p for p in real if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in real)]


def _slot_uid(token: int) -> int:
    """A uid of its own per call (process limits count per uid); nobody where ids are scarce."""
    uid = 100000 + ((os.getpid() % (1 << 20)) << 10 | token % 1024)  # called in the server: its pid and the slot's token
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inner, _, count = (int(x) for x in line.split())
                if inner <= uid < inner + count:
                    return uid
    except (OSError, ValueError):
        pass
    return 65534


def _choose_isolation(wanted: str, hidden: list[str], preload: list[str]) -> tuple[str, str]:
    """(mode, warning): probe once whether this machine gives us the namespaces."""
    if wanted == "plain":
        return "plain", ""
    read_end, write_end = os.pipe()
    probe = os.fork()
    if probe == 0:
        os.close(read_end)
        _probe_namespaces(hidden, preload, write_end)  # never returns
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        why = f.read().decode(errors="replace").strip()
    os.waitpid(probe, 0)
    if not why:
        return "namespaces", ""
    if wanted == "namespaces":
        raise SystemExit(f"isolation='namespaces' was asked for but cannot work here: {why}")
    return "plain", (
        f"sandbox: no namespace isolation on this machine ({why}). Code runs WITH network access "
        "and with the caller's own file-system rights; limits, clean environment and process-tree "
        "kill still apply. Run as root for full isolation; see docs/02-sandbox.md."
    )


def _probe_namespaces(hidden: list[str], preload: list[str], report: int) -> None:
    """Set up exactly what a call gets, then check that an unprivileged process can import."""
    why = ""
    try:
        _unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC)
        uid = 65534
        _fresh_scratch({"max_file_mb": 1}, _private_filesystem(hidden), uid)
        child = os.fork()
        if child == 0:
            problem = 1
            try:
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                problem = 2
                for name in ["os", *preload]:  # the standard library and the warm imports
                    file = getattr(sys.modules.get(name), "__file__", None)
                    if file:
                        os.listdir(os.path.dirname(file))
                problem = 0
            except BaseException:
                pass
            os._exit(problem)
        status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        if status == 1:
            why = "cannot mount /proc or change uid in the new namespaces"
        elif status == 2:
            why = (f"an unprivileged user cannot read the interpreter's files ({sys.base_prefix}); "
                   "install Python where every user can read it")
        elif status != 0:
            why = f"probe failed with status {status}"
    except BaseException as e:
        why = str(e) or type(e).__name__
    os.write(report, why.encode())
    os._exit(0)


def _preload(modules: list[str]) -> None:
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a missing optional library is imported (and fails) in the code, as usual


def _read_capped(fd: int, cap: int) -> tuple[str, bool]:
    """Head and tail of a memory file, at most `cap` bytes, decoded with replacement."""
    size = os.fstat(fd).st_size
    if size <= cap:
        data = os.pread(fd, size, 0)
    else:
        tail = cap // 2
        head = os.pread(fd, cap - tail, 0)
        data = head + f"\n... [{size - cap} bytes cut] ...\n".encode() + os.pread(fd, tail, size - tail)
    os.close(fd)
    return data.decode("utf-8", errors="replace"), size > cap


def _returncode(status: int | None) -> int:
    return -signal.SIGKILL if status is None else os.waitstatus_to_exitcode(status)


def _reason(report: dict, returncode: int, request: dict) -> str:
    """The one line the sandbox adds when it, not the code, ended the run."""
    if report["timed_out"]:
        return f"TimeoutError: execution exceeded the {request['timeout']:g} s time limit"
    if returncode >= 0:
        return ""
    signum = -returncode
    reasons = {
        signal.SIGXFSZ: f"OutputLimitError: more than {request['max_file_mb']} MB written to one stream or file",
        signal.SIGXCPU: "TimeoutError: CPU time limit exceeded",
        signal.SIGSEGV: "Segmentation fault: the interpreter crashed (deep recursion or a native library)",
        signal.SIGKILL: "Killed (SIGKILL): out of memory or killed by another process",
    }
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = str(signum)
    return reasons.get(signum, f"Killed by signal {name}")


def _kill_the_rest() -> None:
    """Kill every process the code left behind (daemons, setsid, double forks) and reap it.

    A PID namespace's init (a slot, or a container's runner) kills them all with
    kill(-1). Without one, this supervisor is a child subreaper: every orphan of the
    code is re-parented to it, so killing its children until none is left is enough.
    """
    if os.getpid() == 1:
        _kill_quietly(-1)
        try:
            while True:
                os.waitpid(-1, 0)
        except ChildProcessError:
            return
    me = os.getpid()
    while True:
        children = _children_of(me)
        for pid in children:
            _kill_quietly(pid)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        if not children:
            time.sleep(0.001)


def _children_of(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent and fields[0] != "Z":
                found.append(int(entry))
    return found


def _tasks_of_uid(uid: int) -> int:
    """Processes and threads of a uid: what RLIMIT_NPROC counts."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
    return count


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _set_limit(kind: int, value: int) -> None:
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _send(conn: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    conn.sendall(struct.pack(">I", len(data)) + data)


def _recv(conn: socket.socket) -> dict | None:
    header = _recv_exactly(conn, 4)
    if header is None:
        return None
    body = _recv_exactly(conn, struct.unpack(">I", header)[0])
    return None if body is None else json.loads(body)


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = conn.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


# --------------------------------------------------------------------------------------
# Linux calls Python 3.10/3.11 does not wrap (os.unshare and os.setns arrived in 3.12)
# --------------------------------------------------------------------------------------

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
_LIBC = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> None:
    if _LIBC.unshare(ctypes.c_int(flags)) != 0:
        raise OSError(ctypes.get_errno(), f"unshare: {os.strerror(ctypes.get_errno())}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [s.encode() if s is not None else None for s in (source, target, fstype, data)]
    if _LIBC.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")


def _umount(target: str) -> None:
    if _LIBC.umount2(target.encode(), ctypes.c_int(MNT_DETACH)) != 0:
        raise OSError(ctypes.get_errno(), f"umount {target}: {os.strerror(ctypes.get_errno())}")


def _setns(fd: int, nstype: int) -> None:
    if _LIBC.setns(ctypes.c_int(fd), ctypes.c_int(nstype)) != 0:
        raise OSError(ctypes.get_errno(), f"setns: {os.strerror(ctypes.get_errno())}")


def _prctl(option: int, value: int) -> None:
    _LIBC.prctl(ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Internal modes, started by this module itself: not part of the command line's help.
    if argv[:1] == ["--serve"] and len(argv) == 3:
        _serve(argv[1], json.loads(argv[2]))  # the fork server
        return 0
    if argv[:1] == ["--container"] and len(argv) == 2:
        _container_main(json.loads(argv[1]))  # the runner inside a container
        return 0
    parser = argparse.ArgumentParser(description="Run Python code in the lab's sandbox and print what the model would see.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("-c", dest="code", help="the code to run")
    source.add_argument("file", nargs="?", help="a .py file to run")
    parser.add_argument("--backend", choices=["local", "docker"], default="local")
    parser.add_argument("--timeout", type=float, default=SandboxConfig.timeout, help="wall-clock seconds")
    parser.add_argument("--memory-mb", type=int, default=SandboxConfig.memory_mb)
    parser.add_argument("--style", choices=["short", "full"], default="short", help="how the observation is formatted")
    args = parser.parse_args(argv)
    if args.file:
        try:
            code = Path(args.file).read_text()
        except OSError as e:
            parser.error(f"cannot read {args.file}: {e.strerror}")
    else:
        code = args.code
    try:
        with Sandbox(SandboxConfig(backend=args.backend, timeout=args.timeout, memory_mb=args.memory_mb)) as sb:
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
