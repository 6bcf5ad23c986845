"""The local backend, caller's side: start the fork server, then one Unix-socket connection per call.

The server (fork_server.py) is a new interpreter with a clean environment, never a fork of the caller, which may run
vLLM threads. Its command line, which every process can read, names no path or socket: source and options come on
stdin (_BOOT). Before the first call, its hello and a probe call must show the isolation in place, else SandboxError.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

import confinement
import runner

HERE = Path(__file__).resolve().parent

# The server's whole command line: it loads the modules sent on stdin, then runs fork_server.serve with slot_main.
_BOOT = (
    "import json, sys, types\n"
    "boot = json.loads(sys.stdin.buffer.readline())\n"
    "for name, path, source in boot['modules']:\n"
    "    module = sys.modules[name] = types.ModuleType(name)\n"
    "    module.__file__ = path\n"
    "    exec(compile(source, name + '.py', 'exec'), module.__dict__)\n"
    "sys.modules['fork_server'].serve(boot['options'], sys.modules['sandbox'].slot_main)\n"
)
SLOT_CALLS = 200  # calls a slot serves before it retires: bounds how far its memory drifts from the server's
_SERVER_MODULES = ("runner", "confinement", "sandbox", "fork_server")  # in import order; sandbox holds the containment sequence
# The first call of every server: the code is not root and reads the warm modules' files.
_PROBE = (
    "import os, sys\n"
    "assert os.getuid() != 0 and os.geteuid() != 0, 'the code would run as root'\n"
    "for name in {preload!r}:\n"
    "    if getattr(sys.modules.get(name), '__file__', None):\n"
    "        os.listdir(os.path.dirname(sys.modules[name].__file__))\n"
    "import decimal, fractions\n"
    "print('ready')\n"
)


class LocalBackend:
    """Talks to the fork server; starts a new one if it died. See Sandbox for the interface."""

    def __init__(self, cfg, error: type[Exception], make_request) -> None:
        self._cfg, self._error, self._make_request = cfg, error, make_request  # make_request: code -> request
        self._lock = threading.Lock()  # one thread at a time (re)starts the server
        self._closed = False
        self._server = _Server(cfg, error, make_request)  # starts importing now; waited for on first use

    def execute(self, request: dict) -> dict:
        server = self._ready_server()
        try:
            return server.call(request)
        except (ConnectionRefusedError, FileNotFoundError):  # the server died (killed from outside): a new one, once
            return self._ready_server(replace=server).call(request)

    def isolation(self) -> str:
        return self._ready_server().isolation

    def ready(self) -> None:
        self._ready_server()

    def _ready_server(self, replace: _Server | None = None) -> _Server:
        with self._lock:
            if self._closed:
                raise self._error("the sandbox is closed")
            if self._server is replace or not self._server.alive():
                self._server.stop()
                self._server = _Server(self._cfg, self._error, self._make_request)
            self._server.wait_ready()
            return self._server

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._server.stop()


class _Server:
    """One fork-server process and the private folder holding its socket."""

    def __init__(self, cfg, error: type[Exception], make_request) -> None:
        self._cfg, self._error, self._make_request = cfg, error, make_request
        try:
            self.folder = tempfile.mkdtemp(prefix="sandbox-server-")  # mode 0700: only our own uid reaches the socket
        except OSError as e:  # no writable temporary folder (TMPDIR, /tmp): say so in one line
            where = f" {e.filename}" if e.filename else ""
            raise error(f"cannot make the fork server's folder{where}: {e.strerror or e} "
                        "(set TMPDIR to a writable folder)") from None
        self._folder_fd = os.open(self.folder, os.O_PATH | os.O_DIRECTORY)
        self.socket_path = f"/proc/self/fd/{self._folder_fd}/socket"  # AF_UNIX takes 107 bytes: short, however deep
        self._log = open(os.path.join(self.folder, "server.log"), "wb")
        options = {"folder": self.folder, "preload": list(cfg.preload), "isolation": cfg.isolation,
                   "spares": cfg.concurrency,  # supervisors kept running: one per concurrent call
                   "max_file_mb": cfg.max_file_mb, "slot_calls": SLOT_CALLS}
        modules = [(name, str(HERE / f"{name}.py"), (HERE / f"{name}.py").read_text()) for name in _SERVER_MODULES]
        try:
            self._proc = subprocess.Popen(
                [cfg.python, "-I", "-c", _BOOT], stderr=self._log, env=runner.clean_env(), cwd="/",
                stdin=subprocess.PIPE,  # the boot line, then kept open: the server exits at its EOF, when we close or die
                stdout=subprocess.PIPE,  # one line: what isolation it got, or why none
                start_new_session=True,  # a Ctrl-C meant for the caller must not kill calls in flight
            )
            self._proc.stdin.write(json.dumps({"modules": modules, "options": options}).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError as e:  # no such interpreter, or one that exited at once: a refusal leaves nothing behind
            _stop_server(getattr(self, "_proc", None), self.folder, self._folder_fd, self._log, [])
            raise self._error(f"cannot start the fork server with {cfg.python}: {e}") from None
        self.isolation, self.cgroups = "", []  # what the server's hello says (wait_ready)
        # Stops the server when the Sandbox is dropped without close(), or at exit.
        self._finalizer = weakref.finalize(self, _stop_server, self._proc, self.folder, self._folder_fd, self._log, self.cgroups)

    def wait_ready(self) -> None:
        if self.isolation:
            return
        ready, _, _ = select.select([self._proc.stdout], [], [], 120.0)  # seconds for the imports and the first slots
        line = self._proc.stdout.readline() if ready else b""
        if not line:
            tail = f"exit status {self._proc.poll()}"  # or the log's last line, read before stop() removes it
            with contextlib.suppress(OSError, IndexError):
                tail = Path(self.folder, "server.log").read_text(errors="replace").strip().splitlines()[-1]
            self.stop()
            raise self._error(f"the fork server did not start: {tail}")
        hello = json.loads(line)
        if "error" in hello:
            self.stop()
            raise self._error(
                f"isolation={self._cfg.isolation!r} cannot be set up here: {hello['error']}. Nothing was run. "
                "Run as root on a machine with cgroups, or as a user the kernel allows user namespaces, or use "
                "backend='docker', or choose the weaker isolation='plain' explicitly (docs/02-isolation.md)")
        self.cgroups.extend(hello["cgroups"])
        probe = runner.failure("")
        try:
            probe = self.call(self._make_request(_PROBE.format(preload=list(self._cfg.preload))))
        except OSError as e:
            probe["error"] = str(e)
        if probe["stdout"] != "ready\n":
            self.stop()
            last = (probe["stderr"].strip().splitlines() or [probe.get("error") or f"exit status {probe['returncode']}"])[-1]
            raise self._error(f"the sandbox's first call failed, so it refuses to run code: {last} "
                              "(the code runs as an unprivileged uid: in plain isolation it must be able to read "
                              f"the interpreter's files, {self._cfg.python})")
        self.isolation = hello["isolation"]

    def call(self, request: dict) -> dict:
        timeout = request["timeout"] + runner.ANSWER_GRACE
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(self.socket_path)
            try:
                data = json.dumps(request).encode()
                conn.sendall(struct.pack(">I", len(data)) + data)
                return runner.read_answer(lambda size: runner.read_exactly(conn.recv, size))
            except socket.timeout:
                return runner.failure(f"SandboxError: no answer from the supervisor within {timeout:.0f} s")
            except (EOFError, ConnectionResetError):
                return runner.failure("SandboxError: the supervisor of this call died without an answer")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> None:
        self._finalizer()


def _stop_server(proc: subprocess.Popen | None, folder: str, folder_fd: int, log, cgroups: list[str]) -> None:
    if proc is not None:  # (None: it never started)
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        proc.stdout.close()
    log.close()
    os.close(folder_fd)
    shutil.rmtree(folder, ignore_errors=True)
    confinement.remove_groups(cgroups)  # left by a server that was killed, or a call still ending: empty once its processes die
