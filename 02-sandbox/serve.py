"""The lab's sandbox as a SandboxFusion-compatible HTTP service, for trainers that call code over HTTP.

    .venv/bin/python 02-sandbox/serve.py                     # http://127.0.0.1:8080, loopback only
    SANDBOX_TOKEN=<secret> .venv/bin/python 02-sandbox/serve.py --host 0.0.0.0    # other addresses need a token
    curl -s 127.0.0.1:8080/run_code -d '{"code": "print(1+1)", "language": "python"}'

Key decisions (the API, the token rule, limits and figures: docs/02-service.md):
1. SandboxFusion's request and response shapes, field for field; only Python runs, anything else is a SandboxError.
2. Loopback by default, any other address only with a token every request carries. Without one, a request must
   name a loopback Host and no foreign Origin: a web page cannot post code to it.
3. Bounded everywhere: one thread reads every request without blocking, under one deadline, so a slow client never
   holds a thread; connections stay below the open-files limit.
4. stdin and files reach the code through a prologue run inside the sandbox, with the code's own privileges.
"""
from __future__ import annotations

import base64
import binascii
import concurrent.futures
import contextlib
import errno
import hmac
import http
import http.client
import io
import ipaddress
import json
import os
import re
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sandbox import ExecResult, Sandbox, SandboxConfig, SandboxError  # noqa: E402

DEFAULT_PORT = 8080  # SandboxFusion's own port, so a client's default URL works unchanged
RUN_TIMEOUT = 10.0  # seconds, when a request gives no run_timeout (SandboxFusion's default, and ToRL's)
MAX_RUN_TIMEOUT = 60.0  # a request's run_timeout is cut to this: one call cannot hold a slot for long
MAX_REQUEST_KB = 1024  # larger bodies get 413 unread; model code is a few KB
MAX_CONNECTIONS = 256  # requests held at once (answered or waiting for a slot); more wait in the backlog
REQUEST_SECONDS = 10.0  # from connect to the request's last byte, whatever the pace: then 408 and the connection goes
MAX_SENDING = 1024  # connections still sending their request; past it, a refused one draining, or the one sending longest, is dropped
ACCEPT_BATCH = 64  # connections accepted at once (at most a quarter of MAX_SENDING's share) before the loop reads those that sent
FD_HEADROOM = 64  # descriptors kept free under the open-files limit, for the sandbox's calls and accept itself
ACCEPT_RETRY_SECONDS = 1.0  # out of descriptors: the listener rests until a connection closes, or this long
MAX_HEAD_BYTES = 64 * 1024  # request line and headers
DRAIN_SECONDS = 2.0  # after a refusal (401, 413, ...), how long the rest of the body is read and dropped
MIN_TOKEN_CHARS = 16
LANGUAGES = ("python", "python3")


def run_code(sandbox: Sandbox, body: dict, max_run_timeout: float) -> dict:
    """One /run_code request (already checked by request_problem) -> SandboxFusion's RunCodeResponse."""
    if body["language"] not in LANGUAGES:
        return _sandbox_error(f"language {body['language']!r} is not supported by this server: only python runs here")
    if body.get("fetch_files"):
        return _sandbox_error("fetch_files is not supported by this server: the code's files are not sent back")
    code = with_inputs(body["code"], body.get("stdin"), body.get("files") or {})
    timeout = float(min(body.get("run_timeout", RUN_TIMEOUT), max_run_timeout))  # 10**400 is past any float
    try:
        result = sandbox.run(code, timeout=timeout)
    except Exception as e:  # SandboxError or worse: still one answer, in the client's shape
        return _sandbox_error(f"{type(e).__name__}: {e}")
    return to_response(result)


def to_response(result: ExecResult) -> dict:
    """An ExecResult in SandboxFusion's shape (docs/02-service.md's table). stderr is the code's own; the line the
    sandbox adds when it stopped the code goes to `message`, where SandboxFusion puts its own reasons."""
    stderr, reason = split_reason(result)
    run = {"status": "Finished", "execution_time": result.latency, "return_code": result.returncode,
           "stdout": result.stdout, "stderr": stderr}
    if reason.startswith("SandboxError"):
        run.update(status="Error", return_code=None)
        return {**_sandbox_error(reason), "run_result": run}
    if result.timed_out:
        run.update(status="TimeLimitExceeded", return_code=None)
    return {**_sandbox_error(reason), "status": "Success" if result.ok else "Failed", "run_result": run}  # one shape


def split_reason(result: ExecResult) -> tuple[str, str]:
    """(the code's stderr, the sandbox's reason): Sandbox.run adds one line when it stopped the code (time, signal)."""
    if not (result.timed_out or result.returncode < 0):
        return result.stderr, ""
    before, _, last = result.stderr.rstrip("\n").rpartition("\n")
    return (before + "\n" if before else ""), last


def _sandbox_error(message: str) -> dict:
    return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None,
            "executor_pod_name": os.environ.get("MY_POD_NAME"), "files": {}}


# Runs in the sandbox before the code: stdin becomes sys.stdin, files go to the work dir, then the code as `python -c`.
_PROLOGUE = """\
def _run(stdin, files, code):
    import base64, io, linecache, os, sys, traceback
    for path, data in files.items():
        if data is not None:
            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                with open(path, "wb") as f:
                    f.write(base64.b64decode(data))
            except OSError as e:  # the request's fault, not the code's: one line, no frames of this prologue
                print(f"{{type(e).__name__}}: files[{{path!r}}] cannot be written: {{e.strerror or e}}", file=sys.stderr)
                raise SystemExit(1)
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


# -------------------------- HTTP: one thread reads every request under a total deadline; a pool of threads answers them


class Server:
    """The accept loop reads requests without blocking, each under one deadline, and refuses what it can from the head
    before any body is read; whole requests go to max_connections answering threads, in arrival order."""

    def __init__(self, address, sandbox: Sandbox, token: str | None = None, max_connections: int = MAX_CONNECTIONS,
                 max_request_bytes: int = MAX_REQUEST_KB * 1024, max_run_timeout: float = MAX_RUN_TIMEOUT,
                 log: bool = False, request_seconds: float = REQUEST_SECONDS) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.max_sending = max_sending(max_connections)
        self.accept_batch = max(1, min(ACCEPT_BATCH, self.max_sending // 4))  # a round's accepts never crowd out each other
        self.listener = socket.create_server(address, family=family, backlog=1024)
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        self.sandbox, self.token, self.log, self.request_seconds = sandbox, token, log, request_seconds
        self.max_connections, self.max_request_bytes, self.max_run_timeout = max_connections, max_request_bytes, max_run_timeout
        self._answerers = concurrent.futures.ThreadPoolExecutor(max_connections, thread_name_prefix="answer")
        # Requests decoded at once, as many as calls run: one waiting for a slot holds its bytes alone (docs/02-service.md)
        self._decoding = threading.BoundedSemaphore(sandbox.config.concurrency if sandbox is not None else max_connections)
        self._lock = threading.Lock()
        self._busy = 0  # requests read whole and not yet answered
        self._stopping = False
        self._accept_rests_until = 0.0  # accept ran out of descriptors: not polled until a connection closes or then
        self._waker = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # written by shutdown() and each answer
        self._sending: dict[socket.socket, _Incoming] = {}  # connections whose request is still arriving, or draining
        self.answered: dict[str, int] = {}  # "200 Success", "401", ...: every answer, counted once

    def serve_forever(self) -> None:
        """Until shutdown(): accept, read, refuse or hand over; then answer what was read whole, and return."""
        with selectors.DefaultSelector() as selector:
            selector.register(self._waker, selectors.EVENT_READ)
            listening = False
            while not self._stopping:
                resting = time.monotonic() < self._accept_rests_until
                if listening != (self._busy < self.max_connections and not resting):  # the kernel's backlog holds the rest
                    listening = not listening
                    if listening:
                        selector.register(self.listener, selectors.EVENT_READ)
                    else:
                        selector.unregister(self.listener)
                deadlines = [c.deadline for c in self._sending.values()] + ([self._accept_rests_until] if resting else [])
                wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, _ in selector.select(wait):
                    if key.fileobj is self.listener:
                        self._accept(selector)
                    elif key.fileobj == self._waker:  # a request answered: its connection closed
                        with contextlib.suppress(BlockingIOError):  # woken already
                            os.eventfd_read(self._waker)
                        self._accept_rests_until = 0.0
                    else:
                        self._receive(selector, key.data)
                now = time.monotonic()
                for incoming in [c for c in self._sending.values() if c.deadline <= now]:
                    if incoming.phase == "drain":
                        self._close(selector, incoming)
                    else:
                        self._refuse(incoming, 408, f"the request did not arrive whole within {self.request_seconds:g} s")
            for incoming in list(self._sending.values()):
                self._close(selector, incoming)
        self.listener.close()

    def shutdown(self) -> None:
        """Stop accepting and reading (safe from a signal handler); requests read whole are still answered."""
        self._stopping = True
        with contextlib.suppress(OSError):  # closed already: nothing left to wake
            os.eventfd_write(self._waker, 1)

    def server_close(self) -> None:
        """Wait until every request read whole is answered."""
        self._answerers.shutdown(wait=True)
        os.close(self._waker)

    def _accept(self, selector) -> None:
        """Accept up to accept_batch waiting connections; the rest wait in the backlog (why: docs/02-service.md)."""
        for _ in range(self.accept_batch):
            try:
                conn, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):  # the connection stays queued
                    self._accept_rests_until = time.monotonic() + ACCEPT_RETRY_SECONDS  # polling now would spin
                    return
                continue  # reset before accept (ECONNABORTED): the next one may do
            if len(self._sending) >= self.max_sending:  # room: a refused connection draining, else the one sending longest
                self._close(selector, min(self._sending.values(), key=lambda c: (c.phase != "drain", c.deadline)))
            conn.setblocking(False)
            incoming = _Incoming(conn, peer[0], time.monotonic() + self.request_seconds)
            self._sending[conn] = incoming
            selector.register(conn, selectors.EVENT_READ, incoming)

    def _receive(self, selector, incoming: _Incoming) -> None:
        if self._sending.get(incoming.conn) is not incoming:  # dropped earlier in this round to make room
            return
        try:
            data = incoming.conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client closed (or reset) before its request was whole: no one to answer
            return self._close(selector, incoming)
        if incoming.phase == "drain":
            return
        incoming.data += data
        if incoming.phase == "head":
            end = incoming.data.find(b"\r\n\r\n")
            if end < 0:
                if len(incoming.data) > MAX_HEAD_BYTES:
                    self._refuse(incoming, 431, f"the request line and headers take more than {MAX_HEAD_BYTES} bytes")
                return
            head, incoming.data = bytes(incoming.data[:end + 2]), incoming.data[end + 4:]
            if refusal := self._read_head(incoming, head):
                return self._refuse(incoming, *refusal)
            if incoming.phase == "answer":  # GET: nothing more to read
                return self._hand_over(selector, incoming)
        if len(incoming.data) >= incoming.length:
            incoming.data = incoming.data[:incoming.length]
            self._hand_over(selector, incoming)

    def _read_head(self, incoming: _Incoming, head: bytes) -> tuple[int, str] | None:
        """Check what the request line and headers can tell before the body: None to go on, or (status, why)."""
        line, _, fields = head.partition(b"\r\n")
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return 400, f"not an HTTP/1 request line: {line[:100].decode('latin-1')!r}"
        incoming.method, target = parts[0][:20], parts[1]
        incoming.path = target.split("?")[0].rstrip("/")[:200]  # as logged and echoed: never the query (a ?token=)
        try:
            headers = http.client.parse_headers(io.BytesIO(fields + b"\r\n"))
        except http.client.HTTPException as e:
            return 431, f"the headers cannot be read: {type(e).__name__}"
        if incoming.method == "GET" and incoming.path in ("/v1/ping", ""):
            incoming.phase = "answer"  # open to health checks: it runs nothing and tells nothing
            return None if incoming.path == "/v1/ping" else (404, "no such endpoint: GET /")
        if incoming.path != "/run_code":
            return 404, f"no such endpoint: {incoming.method} {incoming.path}"
        if incoming.method != "POST":
            return 405, "run_code takes POST"
        if not self._authorized(headers, target):
            return 401, "this server needs its token: Authorization: Bearer <token>"
        if self.token is None and (problem := self._cross_site(headers)):
            return 403, problem
        lengths = headers.get_all("Content-Length") or []
        if len(lengths) != 1 or headers.get("Transfer-Encoding") is not None:
            return 411, "one Content-Length header is required (no chunked bodies)"
        if not re.fullmatch(r"[0-9]{1,18}", lengths[0].strip()):
            return 400, f"Content-Length must be a number of bytes in ASCII digits, got {lengths[0][:40]!r}"
        incoming.length = int(lengths[0])
        if incoming.length > self.max_request_bytes:
            return 413, f"the request is {incoming.length} bytes; this server takes at most {self.max_request_bytes}"
        if headers.get("Expect", "").lower() == "100-continue":  # curl waits for this before a body over 1 KB
            _send_now(incoming.conn, b"HTTP/1.1 100 Continue\r\n\r\n")
        incoming.phase = "body"
        return None

    def _authorized(self, headers, target: str) -> bool:
        """The token as `Authorization: Bearer T`, or `?token=T` for clients that cannot set headers."""
        if self.token is None:
            return True
        given = headers.get("Authorization", "")
        given = given[len("Bearer "):] if given.startswith("Bearer ") else ""
        for pair in target.partition("?")[2].split("&"):
            if pair.startswith("token=") and not given:
                given = pair[len("token="):]
        return hmac.compare_digest(given.encode(errors="replace"), self.token.encode())

    def _cross_site(self, headers) -> str:
        """Without a token, why a request may come from a web page, not a local client ('' if not; docs/02-service.md)."""
        hosts, origins = headers.get_all("Host") or [], headers.get_all("Origin") or []
        if len(hosts) > 1 or len(origins) > 1:
            return "one Host and at most one Origin header, please"
        if hosts and not self._is_own_address(hosts[0].strip()):
            return (f"Host {hosts[0][:100]!r} is not this server's loopback address and port: without a token, "
                    "only local clients may call it")
        if origins and not (hosts and origins[0].strip().lower() == f"http://{hosts[0].strip().lower()}"):
            return f"Origin {origins[0][:100]!r} is another site: without a token, web pages may not call this server"
        return ""

    def _is_own_address(self, host: str) -> bool:
        """Host names 'localhost' or a loopback address literally (a name is not resolved: that is the rebinding), and this port if any."""
        match = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\[\]]+)(?::([0-9]{1,5}))?", host)
        if not match:
            return False
        name, port = match[1].strip("[]").lower(), int(match[2] or self.server_address[1])
        try:
            loopback = name == "localhost" or ipaddress.ip_address(name).is_loopback
        except ValueError:
            loopback = False
        return loopback and port == self.server_address[1]

    def _hand_over(self, selector, incoming: _Incoming) -> None:
        selector.unregister(incoming.conn)
        del self._sending[incoming.conn]
        with self._lock:
            self._busy += 1
        self._answerers.submit(self._answer_request, incoming)

    def _answer_request(self, incoming: _Incoming) -> None:
        """In an answering thread: the whole request -> one JSON answer."""
        status, body = 500, {"detail": "the server failed on this request"}
        try:
            status, body = self._response(incoming)
        except Exception as e:
            print(f"serve.py: request from {incoming.peer} failed: {e!r}", file=sys.stderr)
        finally:
            try:
                incoming.conn.settimeout(self.request_seconds)  # a client that does not read its answer frees the thread
                incoming.conn.sendall(_http_answer(status, body))
                self._count(incoming, status, body.get("status") if isinstance(body, dict) else None)
            except OSError:  # the client gave up waiting: counted apart, so every request is counted once
                self._count(incoming, status, "client gone")
            finally:
                incoming.conn.close()
                with self._lock:
                    self._busy -= 1
                os.eventfd_write(self._waker, 1)

    def _response(self, incoming: _Incoming) -> tuple[int, object]:
        if incoming.method == "GET":
            return 200, "pong"
        with self._decoding:
            try:
                body = json.loads(incoming.data)
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                return 400, {"detail": f"the body is not JSON (or nests too deep): {type(e).__name__}: {str(e)[:200]}"}
            if problem := request_problem(body):
                return 422, {"detail": problem}
            return 200, run_code(self.sandbox, body, self.max_run_timeout)

    def _refuse(self, incoming: _Incoming, status: int, detail: str) -> None:
        """Answer without waiting on the client, then drop what it still sends for DRAIN_SECONDS: closing with unread
        data resets the connection, which could lose the answer."""
        sent = _send_now(incoming.conn, _http_answer(status, {"detail": detail}))
        self._count(incoming, status, None if sent else "client gone")
        with contextlib.suppress(OSError):
            incoming.conn.shutdown(socket.SHUT_WR)
        incoming.phase, incoming.deadline = "drain", time.monotonic() + DRAIN_SECONDS

    def _close(self, selector, incoming: _Incoming) -> None:
        selector.unregister(incoming.conn)
        del self._sending[incoming.conn]
        incoming.conn.close()
        self._accept_rests_until = 0.0  # a descriptor is free again

    def _count(self, incoming: _Incoming, status: int, run_status: str | None) -> None:
        key = f"{status} {run_status}" if run_status else str(status)
        with self._lock:
            self.answered[key] = self.answered.get(key, 0) + 1
        if self.log:  # the path without its query: a ?token= must not reach a log
            print(f"{incoming.peer} {printable(incoming.method or '-')} {printable(incoming.path or '-')} {status}",
                  file=sys.stderr, flush=True)


class _Incoming:
    """A connection whose request is arriving: phase head, then body (or answer), or drain after a refusal."""

    def __init__(self, conn: socket.socket, peer: str, deadline: float) -> None:
        self.conn, self.peer, self.deadline = conn, peer, deadline
        self.phase, self.data, self.length = "head", bytearray(), 0
        self.method, self.path = "", ""


def printable(text: str) -> str:
    """A client's words as a log may hold them: every byte but printable ASCII (and a backslash) as \\xNN."""
    return re.sub(r"[^\x21-\x5b\x5d-\x7e]", lambda match: f"\\x{ord(match[0]):02x}", text)


def _http_answer(status: int, body) -> bytes:
    """Every answer, errors included: JSON, then the connection closes (one request per connection)."""
    data = json.dumps(body).encode()
    extra = "WWW-Authenticate: Bearer\r\n" if status == 401 else ""
    return (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nServer: tool-rl-lab-sandbox\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n{extra}Connection: close\r\n\r\n").encode() + data


def _send_now(conn: socket.socket, data: bytes) -> bool:
    """Send what the socket's buffer takes now (a small answer: all of it); never wait on the client."""
    try:
        return conn.send(data) == len(data)
    except OSError:
        return False


def raise_open_files_limit() -> None:
    """The soft limit of open files raised to the hard one (often 1,024 of 1,048,576): every connection holds one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def max_sending(max_connections: int) -> int:
    """How many connections may be still sending: MAX_SENDING, or fewer so that they, the max_connections
    being answered and FD_HEADROOM fit under the open-files limit beside the descriptors open now."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        return MAX_SENDING
    free = limit - len(os.listdir("/proc/self/fd")) - FD_HEADROOM
    if free - max_connections < 1:
        raise ValueError(f"--max-connections {max_connections} leaves no descriptor for new connections under "
                         f"the open-files limit ({limit}, {FD_HEADROOM} kept free): lower it, or raise `ulimit -n`")
    return min(MAX_SENDING, free - max_connections)


def start_process(*args: str, env: dict | None = None, **popen) -> tuple[subprocess.Popen, str]:
    """serve.py as a process, on a free loopback port unless args name one: (process, base URL) once it listens.
    SIGTERM stops it: it answers the requests in flight, then prints what it answered."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--port", "0", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    line = proc.stdout.readline()
    if " on http" not in line:
        proc.kill()
        raise SandboxError(f"serve.py did not start: {line}{proc.communicate()[1]}".strip())
    return proc, line.split(" on ")[1].split("/run_code")[0]


def is_loopback(host: str) -> bool:
    """127.0.0.0/8 or ::1, or a name every address of which is one of them (resolved now: a name is
    what /etc/hosts or DNS says); anything else (0.0.0.0, "", a name that does not resolve) may be reached from elsewhere."""
    return bool(host) and all(ipaddress.ip_address(address).is_loopback for address in _addresses(host))


def _addresses(host: str) -> list[str]:
    with contextlib.suppress(ValueError):  # a name, not an address
        return [ipaddress.ip_address(host).compressed]
    try:
        return sorted({info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except (OSError, UnicodeError):
        return ["0.0.0.0"]  # unresolvable: not loopback


MAX_SECONDS = 86400.0  # the largest timeout a flag takes: the sandbox's own, and far below what select() overflows at


def main(argv: list[str] | None = None) -> int:
    from lab_cli import at_least, comma_list, script_parser

    parser = script_parser(__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s); "
                        "any non-loopback address needs --token")
    parser.add_argument("--port", type=at_least(0, at_most=65535), default=DEFAULT_PORT, help="port, 0 for any free one (default: %(default)s)")
    parser.add_argument("--token", default=os.environ.get("SANDBOX_TOKEN") or None,  # set but empty: no token
                        help=f"shared secret every request must carry (default: $SANDBOX_TOKEN; at least {MIN_TOKEN_CHARS} "
                        "characters); prefer the variable: a command line is visible to every process")
    parser.add_argument("--concurrency", type=at_least(1), default=os.cpu_count() or 2,
                        help="calls running at once (default: the CPU count, %(default)s)")
    parser.add_argument("--isolation", choices=["namespaces", "plain"], default=SandboxConfig.isolation,
                        help="the local sandbox's isolation (default: %(default)s; see docs/02-sandbox.md)")
    parser.add_argument("--memory-mb", type=at_least(64), default=SandboxConfig.memory_mb,
                        help="memory of one call, in MB (default: %(default)s); a request's memory_limit_MB is not used")
    parser.add_argument("--preload", default=",".join(SandboxConfig.preload), help="modules the warm interpreter "
                        "imports once, comma-separated, '' for none (default: %(default)s)")
    parser.add_argument("--max-run-timeout", type=at_least(0.1, float, at_most=MAX_SECONDS), default=MAX_RUN_TIMEOUT,
                        help="a request's run_timeout is cut to this many seconds (default: %(default)s)")
    parser.add_argument("--max-request-kb", type=at_least(1, at_most=1 << 20), default=MAX_REQUEST_KB,
                        help="largest request body; larger ones get 413 (default: %(default)s)")
    parser.add_argument("--max-connections", type=at_least(1, at_most=1 << 16), default=MAX_CONNECTIONS,
                        help="requests held at once; more wait in the listen backlog (default: %(default)s)")
    parser.add_argument("--request-timeout", type=at_least(0.1, float, at_most=MAX_SECONDS), default=REQUEST_SECONDS,
                        help="seconds from connect to a request's last byte, at any pace; then 408 (default: %(default)s)")
    parser.add_argument("--log", action="store_true", help="one line per request on stderr")
    args = parser.parse_args(argv)
    if args.token is not None and len(args.token) < MIN_TOKEN_CHARS:
        parser.error(f"--token must be at least {MIN_TOKEN_CHARS} characters")
    if not is_loopback(args.host) and args.token is None:
        parser.error(f"--host {args.host!r} is not a loopback address: whoever reaches it could run code, "
                     "so it needs a token (--token or $SANDBOX_TOKEN)")
    raise_open_files_limit()

    try:
        config = SandboxConfig(concurrency=args.concurrency, isolation=args.isolation, memory_mb=args.memory_mb,
                               timeout=RUN_TIMEOUT, preload=comma_list(args.preload))
    except ValueError as e:
        parser.error(str(e))
    try:
        sandbox = Sandbox(config)
        sandbox.run("pass")  # one real call: the containment works, or it says why before listening
        host = args.host if args.token is not None else _addresses(args.host)[0]  # the address just judged loopback
        server = Server((host, args.port), sandbox, args.token, args.max_connections,
                        args.max_request_kb * 1024, args.max_run_timeout, args.log, args.request_timeout)
    except (SandboxError, OSError, ValueError) as e:
        print(f"serve.py: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signum, frame: server.shutdown())
    signal.signal(signal.SIGINT, lambda signum, frame: server.shutdown())
    host, port = server.server_address[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    print(f"serving SandboxFusion's run_code on {url}/run_code ({sandbox.isolation}, {args.concurrency} at once, "
          f"{'token required' if args.token else 'no token: loopback only'})", flush=True)
    started = time.monotonic()
    server.serve_forever()
    server.server_close()  # waits for the requests read whole: each is answered before the sandbox closes
    sandbox.close()
    counts = ", ".join(f"{key}: {n}" for key, n in sorted(server.answered.items())) or "none"
    print(f"stopped after {time.monotonic() - started:.0f} s; answered {sum(server.answered.values())} ({counts})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
