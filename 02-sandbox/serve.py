"""The lab's sandbox as a SandboxFusion-compatible HTTP service, for trainers that call code over HTTP.

    .venv/bin/python 02-sandbox/serve.py                     # http://127.0.0.1:8080, loopback only
    SANDBOX_TOKEN=<secret> .venv/bin/python 02-sandbox/serve.py --host 0.0.0.0    # other addresses need a token
    curl -s 127.0.0.1:8080/run_code -d '{"code": "print(1+1)", "language": "python"}'

ToRL, verl's ReTool recipe and most tool-RL trainers send model code to
SandboxFusion's `POST /run_code`; pointing their sandbox URL here gives them the
lab's fork server (about 8 ms a sympy call) instead.

Key decisions (the API, the token rule, limits and figures: docs/02-service.md):
1. SandboxFusion's request and response shapes, field for field; only Python runs.
   Anything else is answered in that shape (status SandboxError), never a crash.
2. It runs code for whoever reaches it: loopback by default, any other address only
   with a shared token that every request carries (refused at start without one).
3. Bounded everywhere: calls at once (the sandbox's concurrency), connections held
   (more wait in the listen backlog, so none is lost), request size, run timeout.
4. stdin and files reach the code through a prologue that runs inside the sandbox,
   with the code's own privileges: the server never writes what a request sends.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import ipaddress
import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sandbox import ExecResult, Sandbox, SandboxConfig, SandboxError  # noqa: E402

DEFAULT_PORT = 8080  # SandboxFusion's own port, so a client's default URL works unchanged
RUN_TIMEOUT = 10.0  # seconds, when a request gives no run_timeout (SandboxFusion's default, and ToRL's)
MAX_RUN_TIMEOUT = 60.0  # a request's run_timeout is cut to this: one call cannot hold a slot for long
MAX_REQUEST_KB = 1024  # larger bodies get 413 unread; model code is a few KB
MAX_CONNECTIONS = 256  # requests held at once (running or waiting for a slot); more wait in the backlog
READ_TIMEOUT = 10.0  # seconds a client may stay silent while sending its request (a stalled sender frees its thread)
DRAIN_SECONDS = 2.0  # after a refusal (401, 413, ...), how long the rest of the body is read and dropped
MIN_TOKEN_CHARS = 16
LANGUAGES = ("python", "python3")


def run_code(sandbox: Sandbox, body: dict, max_run_timeout: float = MAX_RUN_TIMEOUT) -> dict:
    """One /run_code request (already checked by request_problem) -> SandboxFusion's RunCodeResponse."""
    if body["language"] not in LANGUAGES:
        return _sandbox_error(f"language {body['language']!r} is not supported by this server: only python runs here")
    if body.get("fetch_files"):
        return _sandbox_error("fetch_files is not supported by this server: the code's files are not sent back")
    code = with_inputs(body["code"], body.get("stdin"), body.get("files") or {})
    timeout = min(float(body.get("run_timeout", RUN_TIMEOUT)), max_run_timeout)
    try:
        result = sandbox.run(code, timeout=timeout)
    except Exception as e:  # SandboxError or worse: still one answer, in the client's shape
        return _sandbox_error(f"{type(e).__name__}: {e}")
    return to_response(result)


def to_response(result: ExecResult) -> dict:
    """An ExecResult in SandboxFusion's shape.

    stderr is the code's own; the line the sandbox adds when it stopped the code
    (timeout, a signal) goes to `message`, where SandboxFusion puts its own reasons.
        ok                   -> Success, run_result Finished, return_code 0
        exit status 3        -> Failed,  run_result Finished, return_code 3
        killed by signal 9   -> Failed,  run_result Finished, return_code -9
        timed out            -> Failed,  run_result TimeLimitExceeded, return_code None
        no answer from slot  -> SandboxError, run_result Error
    """
    stderr, reason = split_reason(result)
    run = {"status": "Finished", "execution_time": result.latency, "return_code": result.returncode,
           "stdout": result.stdout, "stderr": stderr}
    if reason.startswith("SandboxError"):
        run.update(status="Error", return_code=None)
        return {**_sandbox_error(reason), "run_result": run}
    if result.timed_out:
        run.update(status="TimeLimitExceeded", return_code=None)
    status = "Success" if result.ok else "Failed"
    return {"status": status, "message": reason, "compile_result": None, "run_result": run,
            "executor_pod_name": os.environ.get("MY_POD_NAME"), "files": {}}


def split_reason(result: ExecResult) -> tuple[str, str]:
    """(the code's stderr, the sandbox's reason). Sandbox.run ends stderr with one reason
    line exactly when it stopped the code: a timeout or a signal (docs/02-sandbox.md)."""
    if not (result.timed_out or result.returncode < 0):
        return result.stderr, ""
    before, _, last = result.stderr.rstrip("\n").rpartition("\n")
    return (before + "\n" if before else ""), last


def _sandbox_error(message: str) -> dict:
    return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None,
            "executor_pod_name": os.environ.get("MY_POD_NAME"), "files": {}}


# Runs inside the sandbox, before the code, with the code's privileges: the request's stdin
# becomes sys.stdin and its files are written to the work dir. The code then runs as
# `python -c` runs it, and its traceback shows only its own frames and lines.
_PROLOGUE = """\
def _run(stdin, files, code):
    import base64, io, linecache, os, sys, traceback
    for path, data in files.items():
        if data is not None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(data))
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    linecache.cache["<string>"] = (len(code), None, code.splitlines(True), "<string>")
    del globals()["_run"]
    try:
        exec(compile(code, "<string>", "exec", dont_inherit=True), globals())
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        raise SystemExit(1)
_run({stdin!r}, {files!r}, {code!r})
"""


def with_inputs(code: str, stdin: str | None, files: dict) -> str:
    """The code itself, or behind the prologue when the request sends stdin or files."""
    if not stdin and not any(v is not None for v in files.values()):
        return code  # the code reads an empty stdin (/dev/null), as with SandboxFusion's default
    return _PROLOGUE.format(stdin=stdin or None, files=files, code=code)


def request_problem(body) -> str:
    """Why a decoded body is not a RunCodeRequest ('' when it is one)."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    for name in ("code", "language"):
        if not isinstance(body.get(name), str):
            return f"field '{name}' is required and must be a string"
    for name in ("run_timeout", "compile_timeout"):
        value = body.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            return f"field '{name}' must be a positive number of seconds, got {value!r}"
    memory = body.get("memory_limit_MB", -1)
    if isinstance(memory, bool) or not isinstance(memory, (int, float)):
        return "field 'memory_limit_MB' must be a number"
    if body.get("stdin") is not None and not isinstance(body["stdin"], str):
        return "field 'stdin' must be a string or null"
    files = body.get("files") or {}
    if not isinstance(files, dict) or not all(isinstance(v, (str, type(None))) for v in files.values()):
        return "field 'files' must map file paths to base64 strings"
    for path, data in files.items():
        try:
            base64.b64decode(data or "", validate=True)
        except binascii.Error:
            return f"files[{path!r}] is not valid base64"
    fetch = body.get("fetch_files") or []
    if not isinstance(fetch, list) or not all(isinstance(p, str) for p in fetch):
        return "field 'fetch_files' must be a list of paths"
    return ""


# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    """POST /run_code and GET /v1/ping, as SandboxFusion; one request per connection."""

    server: Server
    timeout = READ_TIMEOUT  # on the socket: a client that stops sending is dropped
    server_version = "tool-rl-lab-sandbox"

    def do_POST(self) -> None:
        if self.path.split("?")[0].rstrip("/") != "/run_code":
            return self._answer(404, {"detail": f"no such endpoint: POST {self.path.split('?')[0]}"})
        if not self._authorized():
            return self._answer(401, {"detail": "this server needs its token: Authorization: Bearer <token>"})
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return self._answer(411, {"detail": "a Content-Length header is required"})
        if int(length) > self.server.max_request_bytes:
            return self._answer(413, {"detail": f"the request is {int(length)} bytes; this server takes at most "
                                                f"{self.server.max_request_bytes}"})
        try:
            data = self.rfile.read(int(length))
        except OSError:
            return  # the client stopped sending (READ_TIMEOUT) or went away: no one to answer
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return self._answer(400, {"detail": f"the body is not JSON: {e}"})
        problem = request_problem(body)
        if problem:
            return self._answer(422, {"detail": problem})
        self._answer(200, run_code(self.server.sandbox, body, self.server.max_run_timeout))

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path == "/v1/ping":
            return self._answer(200, "pong")  # open to health checks: it runs nothing and tells nothing
        if path == "/run_code":
            return self._answer(405, {"detail": "run_code takes POST"})
        self._answer(404, {"detail": f"no such endpoint: GET {path}"})

    def _authorized(self) -> bool:
        """The token as `Authorization: Bearer T`, or `?token=T` for clients that cannot set headers."""
        token = self.server.token
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        given = given[len("Bearer "):] if given.startswith("Bearer ") else ""
        for pair in self.path.partition("?")[2].split("&"):
            if pair.startswith("token=") and not given:
                given = pair[len("token="):]
        return hmac.compare_digest(given.encode(), token.encode())

    def _answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:  # the client gave up waiting: counted apart, so every request is counted once
            return self.server.count(status, "client gone")
        self.server.count(status, body.get("status") if isinstance(body, dict) else None)
        if status != 200:
            self._drain()

    def _drain(self) -> None:
        """After a refusal, read and drop what the client is still sending, for at most DRAIN_SECONDS:
        closing with unread data resets the connection, and the client could lose the answer."""
        deadline = time.monotonic() + DRAIN_SECONDS
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            while time.monotonic() < deadline:
                self.connection.settimeout(max(deadline - time.monotonic(), 0.01))
                if not self.connection.recv(1 << 20):
                    break
        except OSError:
            pass

    def log_message(self, format: str, *args) -> None:
        if self.server.log:  # the path without its query: a ?token= must not reach a log
            sys.stderr.write(f"{self.address_string()} {self.command} {self.path.split('?')[0]} {args[1] if len(args) > 1 else ''}\n")


class Server(ThreadingHTTPServer):
    """A thread per request, at most max_connections at once: the accept loop waits for a free
    one, and connections beyond it wait in the listen backlog, so none is refused or lost."""

    request_queue_size = 1024  # the listen backlog
    daemon_threads = False
    block_on_close = True  # on shutdown, requests in flight are answered first

    def __init__(self, address, sandbox: Sandbox, token: str | None = None, max_connections: int = MAX_CONNECTIONS,
                 max_request_bytes: int = MAX_REQUEST_KB * 1024, max_run_timeout: float = MAX_RUN_TIMEOUT,
                 log: bool = False) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.sandbox, self.token, self.log = sandbox, token, log
        self.max_request_bytes, self.max_run_timeout = max_request_bytes, max_run_timeout
        self._held = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self.answered: dict[str, int] = {}  # "200 Success", "401", ...: every answer, counted once
        super().__init__(address, Handler)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's own would look the host's name up in DNS
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request, client_address) -> None:
        print(f"serve.py: request from {client_address[0]} failed: {sys.exc_info()[1]!r}", file=sys.stderr)

    def process_request(self, request, client_address) -> None:
        self._held.acquire()  # blocks the accept loop: the kernel's backlog holds the rest
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._held.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._held.release()

    def count(self, status: int, run_status: str | None) -> None:
        key = f"{status} {run_status}" if run_status else str(status)
        with self._lock:
            self.answered[key] = self.answered.get(key, 0) + 1

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def start_process(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """serve.py as a process of its own, on a free loopback port unless args name one: (process, base URL)
    once it listens. Stop it with SIGTERM: it answers the requests in flight, then prints what it answered."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--port", "0", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if " on http" not in line:
        proc.kill()
        raise SandboxError(f"serve.py did not start: {line}{proc.communicate()[1]}".strip())
    return proc, line.split(" on ")[1].split("/run_code")[0]


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; anything else (0.0.0.0, a name, "") can be reached from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    from lab_cli import at_least, comma_list, one_line_errors

    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    # where it listens, and who may call it
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s); "
                        "any non-loopback address needs --token")
    parser.add_argument("--port", type=at_least(0), default=DEFAULT_PORT, help="port, 0 for any free one (default: %(default)s)")
    parser.add_argument("--token", default=os.environ.get("SANDBOX_TOKEN"),
                        help=f"shared secret every request must carry (default: $SANDBOX_TOKEN; at least {MIN_TOKEN_CHARS} "
                        "characters); prefer the variable: a command line is visible to every process")
    # the sandbox behind it
    parser.add_argument("--concurrency", type=at_least(1), default=os.cpu_count() or 2,
                        help="calls running at once (default: the CPU count, %(default)s)")
    parser.add_argument("--isolation", choices=["namespaces", "plain"], default=SandboxConfig.isolation,
                        help="the local sandbox's isolation (default: %(default)s; see docs/02-sandbox.md)")
    parser.add_argument("--memory-mb", type=at_least(64), default=SandboxConfig.memory_mb,
                        help="memory of one call, in MB (default: %(default)s); a request's memory_limit_MB is not used")
    parser.add_argument("--preload", default=",".join(SandboxConfig.preload),
                        help="modules the warm interpreter imports once, comma-separated, '' for none "
                        "(default: %(default)s)")
    # limits of a request
    parser.add_argument("--max-run-timeout", type=at_least(0.1, float), default=MAX_RUN_TIMEOUT,
                        help="a request's run_timeout is cut to this many seconds (default: %(default)s)")
    parser.add_argument("--max-request-kb", type=at_least(1), default=MAX_REQUEST_KB,
                        help="largest request body; larger ones get 413 (default: %(default)s)")
    parser.add_argument("--max-connections", type=at_least(1), default=MAX_CONNECTIONS,
                        help="requests held at once; more wait in the listen backlog (default: %(default)s)")
    parser.add_argument("--log", action="store_true", help="one line per request on stderr")
    args = parser.parse_args(argv)
    if args.token is not None and len(args.token) < MIN_TOKEN_CHARS:
        parser.error(f"--token must be at least {MIN_TOKEN_CHARS} characters")
    if not is_loopback(args.host) and args.token is None:
        parser.error(f"--host {args.host!r} is not a loopback address: whoever reaches it could run code, "
                     "so it needs a token (--token or $SANDBOX_TOKEN)")

    try:
        config = SandboxConfig(concurrency=args.concurrency, isolation=args.isolation, memory_mb=args.memory_mb,
                               timeout=RUN_TIMEOUT, preload=comma_list(args.preload))
    except ValueError as e:
        parser.error(str(e))
    try:
        sandbox = Sandbox(config)
        sandbox.run("pass")  # one real call: the containment works, or it says why before listening
        server = Server((args.host, args.port), sandbox, args.token, args.max_connections,
                        args.max_request_kb * 1024, args.max_run_timeout, args.log)
    except (SandboxError, OSError) as e:
        print(f"serve.py: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum, frame) -> None:  # shutdown() waits for serve_forever: call it from another thread
        if not stop.is_set():
            stop.set()
            threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"serving SandboxFusion's run_code on {server.url}/run_code ({sandbox.isolation}, {args.concurrency} at once, "
          f"{'token required' if args.token else 'no token: loopback only'})", flush=True)
    started = time.monotonic()
    server.serve_forever()
    server.server_close()  # joins the requests in flight: each is answered before the sandbox closes
    sandbox.close()
    counts = ", ".join(f"{key}: {n}" for key, n in sorted(server.answered.items())) or "none"
    print(f"stopped after {time.monotonic() - started:.0f} s; answered {sum(server.answered.values())} ({counts})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
