"""The sandboxfusion backend: Sandbox.run over HTTP, to any server speaking SandboxFusion's /run_code.

    SandboxConfig(backend="sandboxfusion", urls=("http://127.0.0.1:8080",), token=None)

The server can be the lab's own (02-sandbox/serve.py) or a real SandboxFusion. A call goes to the least busy member
of `urls`; no member is trusted (exchange): any failure is the call's answer, never an exception. `unreachable(cfg)`
is a run's preflight. The story and the mapping: docs/02-service.md.
"""
from __future__ import annotations

import json
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse

import runner

DOWN_SECONDS = 5.0  # a server that refused a connection is skipped this long (unless all are)
PING_SECONDS = 10.0  # the preflight's deadline for one member's GET /v1/ping
HEAD_BYTES = 64 * 1024  # an answer's status line and headers; more is no sandbox server's answer
_CUT = re.compile(r"\n\.\.\. \[\d+ bytes cut\] \.\.\.\n")  # runner.read_answer's mark of a stream over the cap


class Dropped(ConnectionError):
    """The member closed the connection before its answer was whole: it may have died mid-call."""


class SandboxFusionBackend:
    def __init__(self, cfg, error: type[Exception]) -> None:
        self._error = error
        self._urls = [url.rstrip("/").removesuffix("/run_code") + "/run_code" for url in cfg.urls]
        token = cfg.token if cfg.token is not None else os.environ.get("SANDBOX_TOKEN")
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        self._lock = threading.Lock()
        self._busy = [0] * len(self._urls)  # calls in flight per server
        self._down_until = [0.0] * len(self._urls)
        self._turn = int(os.environ.get("RANK", "0")) % len(self._urls)  # torchrun's ranks start at different members
        self._ready = False

    def execute(self, request: dict) -> dict:
        body = {"code": request["code"], "language": "python", "run_timeout": request["timeout"],
                "compile_timeout": request["timeout"], "memory_limit_MB": request["memory_mb"],
                "stdin": None, "files": {}, "fetch_files": []}
        deadline = time.monotonic() + request["timeout"] + runner.ANSWER_GRACE  # one for the call, retries included
        tried: set[int] = set()
        while True:
            index = self._pick(tried)
            try:
                response = self._post(index, body, deadline, 16 * request["max_output_bytes"] + (1 << 20))
            except ConnectionError:  # refused, or dropped before the answer was whole
                with self._lock:
                    self._down_until[index] = time.monotonic() + DOWN_SECONDS
                tried.add(index)
                if len(tried) < len(self._urls) and time.monotonic() < deadline:
                    continue  # no answer came back: another server runs it (the code has no effects outside the call)
                return runner.failure(f"SandboxError: no sandbox server answered ({', '.join(self._urls)})")
            except Exception as e:  # a timeout, an HTTP error, not JSON, too deep: whatever it answered, not ours to raise
                return runner.failure(f"SandboxError: {self._urls[index]}: {_describe(e)}")
            finally:
                with self._lock:
                    self._busy[index] -= 1
            return to_answer(response, self._urls[index], request["max_output_bytes"])

    def ready(self) -> None:
        """Once: at least one server answers GET /v1/ping; the others are skipped until they do."""
        if not self._ready:
            problems = self._unanswered()
            if len(problems) == len(self._urls):
                raise self._error(f"no SandboxFusion server answers: {'; '.join(problems)}")
            self._ready = True

    def _unanswered(self) -> list[str]:
        """One line per server that does not answer GET /v1/ping with 200, saying why; each is skipped a while."""
        problems = []
        for index, url in enumerate(self._urls):
            try:
                status, _ = exchange(url[: -len("/run_code")] + "/v1/ping", "GET", b"", self._headers,
                                     time.monotonic() + PING_SECONDS, 1 << 16)
                problem = None if status == 200 else _status_problem(status, b"")
            except Exception as e:  # whatever the member does, the preflight names it
                problem = _describe(e)
            if problem:
                problems.append(f"{url}: {problem}")
                self._down_until[index] = time.monotonic() + DOWN_SECONDS
        return problems

    def isolation(self) -> str:
        return "remote"  # whatever the servers provide; the lab's own: docs/02-sandbox.md

    def close(self) -> None:
        pass  # no connection outlives its call

    def _pick(self, tried: set[int]) -> int:
        """The least busy server that is up and not yet tried; ties go round in turn."""
        with self._lock:
            now, n = time.monotonic(), len(self._urls)
            candidates = [i for i in range(n) if i not in tried] or list(range(n))
            up = [i for i in candidates if self._down_until[i] <= now] or candidates
            index = min(up, key=lambda i: (self._busy[i], (i - self._turn) % n))
            self._turn = (index + 1) % n
            self._busy[index] += 1
            return index

    def _post(self, index: int, body: dict, deadline: float, limit: int) -> dict:
        """The server's JSON answer, whole by `deadline`, at most `limit` bytes of it."""
        status, data = exchange(self._urls[index], "POST", json.dumps(body).encode(), self._headers, deadline, limit)
        if status != 200:
            raise ValueError(_status_problem(status, data))
        try:
            return json.loads(data)
        except RecursionError:
            raise ValueError("an answer nested deeper than the JSON decoder recurses") from None


def exchange(url: str, method: str, body: bytes, headers: dict, deadline: float, limit: int) -> tuple[int, bytes]:
    """One HTTP/1.1 request and its final answer, (status, body), all by `deadline` (TimeoutError), at most `limit`
    bytes; no redirect followed, no proxy (why not urllib: docs/02-service.md). A connection cut short raises Dropped."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    sock = socket.create_connection((host, port), timeout=_left(deadline))
    try:
        if parts.scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc.rpartition('@')[2]}", "Connection: close",
                 f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
        outgoing = memoryview(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        while outgoing:
            sock.settimeout(_left(deadline))
            outgoing = outgoing[sock.send(outgoing):]
        answer = _Answer(sock, deadline, limit)
        status, head = answer.head()
        while 100 <= status < 200:  # 100 Continue and the like: the final answer comes after
            status, head = answer.head()
        if "chunked" in head.get("transfer-encoding", "").lower():
            return status, _unchunked(answer.until_close(b"0\r\n\r\n"))
        if "content-length" in head:
            if not head["content-length"].isdigit():
                raise ValueError(f"a Content-Length that is no number: {head['content-length'][:40]!r}")
            return status, answer.exactly(int(head["content-length"]))
        return status, answer.until_close()
    finally:
        sock.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no answer in time")
    return left


class _Answer:
    """The bytes of an answer as they arrive, each receive waiting only for what is left of the deadline."""

    def __init__(self, sock: socket.socket, deadline: float, limit: int) -> None:
        self.sock, self.deadline, self.limit = sock, deadline, limit
        self.data, self.total = bytearray(), 0

    def more(self, end_ok: bool = False) -> bool:
        """Receive what comes next; False at the end of the stream, which only `end_ok` readers expect."""
        self.sock.settimeout(_left(self.deadline))
        chunk = self.sock.recv(1 << 16)
        self.total += len(chunk)
        if self.total > self.limit:
            raise ValueError(f"an answer over {self.limit:,} bytes")
        if not chunk and not end_ok:
            raise Dropped(f"the connection closed after {self.total:,} bytes, before the answer was whole")
        self.data += chunk
        return bool(chunk)

    def head(self) -> tuple[int, dict[str, str]]:
        """The next status line and headers, taken off the data: (status, lower-cased header names -> values)."""
        searched = 0
        while (end := self.data.find(b"\r\n\r\n", max(0, searched - 3))) < 0:
            if len(self.data) > HEAD_BYTES:
                raise ValueError(f"an answer whose status line and headers take more than {HEAD_BYTES // 1024} KB")
            searched = len(self.data)
            self.more()
        status_line, *fields = bytes(self.data[:end]).decode("latin-1").split("\r\n")
        del self.data[:end + 4]
        match = re.fullmatch(r"HTTP/1\.[01] ([1-5][0-9][0-9])(?: .*)?", status_line)
        if not match:
            raise ValueError(f"not an HTTP answer: {status_line[:80]!r}")
        return int(match[1]), {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}

    def exactly(self, length: int) -> bytes:
        while len(self.data) < length:
            self.more()
        return bytes(self.data[:length])

    def until_close(self, last: bytes | None = None) -> bytes:
        """Everything until the server closes, or until the data ends with `last` (a chunked answer's end)."""
        while not (last and self.data.endswith(last)) and self.more(end_ok=True):
            pass
        return bytes(self.data)


def _unchunked(body: bytes) -> bytes:
    """A chunked body decoded: each chunk is its size in hex, CRLF, the bytes, CRLF; size 0 ends it."""
    out, at = bytearray(), 0
    while True:
        line_end = body.find(b"\r\n", at)
        size = body[at:line_end].split(b";")[0].strip() if line_end >= 0 else b""
        if not re.fullmatch(rb"[0-9a-fA-F]{1,8}", size) or len(body) < line_end + 2 + int(size, 16):
            raise ValueError("a chunked answer that is cut short or malformed")
        if int(size, 16) == 0:
            return bytes(out)
        out += body[line_end + 2:line_end + 2 + int(size, 16)]
        at = line_end + 2 + int(size, 16) + 2


def _status_problem(status: int, data: bytes) -> str:
    if 300 <= status < 400:
        return f"HTTP {status}, a redirect: not followed (the token goes to no other address)"
    try:
        detail = json.loads(data).get("detail", "")
    except (ValueError, AttributeError, RecursionError):
        detail = ""
    return f"HTTP {status}" + (f": {detail}" if isinstance(detail, str) and detail else "")


def unreachable(cfg) -> list[str]:
    """A run's preflight over the pool of a SandboxConfig: one line per server that does not answer GET /v1/ping."""
    return SandboxFusionBackend(cfg, RuntimeError)._unanswered()


def to_answer(response, url: str, cap: int) -> dict:
    """A RunCodeResponse as runner.read_answer's dict, each stream at most `cap` bytes: anything but Success/Failed
    with a well-formed run_result is a failed call saying why; a Failed call's `message` is the reason line."""
    response = response if isinstance(response, dict) else {}
    run, status, message = response.get("run_result"), response.get("status"), response.get("message")
    message = message if isinstance(message, str) else None
    if status not in ("Success", "Failed") or not isinstance(run, dict) or run.get("status") not in ("Finished", "TimeLimitExceeded"):
        shown = status if isinstance(status, str) and status else "something else than a RunCodeResponse"
        return runner.failure(f"SandboxError: {url} answered {shown[:200]}" + (f": {message[:1000]}" if message else ""))
    timed_out = run["status"] == "TimeLimitExceeded"
    code, stdout, stderr = run.get("return_code"), run.get("stdout") or "", run.get("stderr") or ""
    exit_status = code is None or (isinstance(code, int) and not isinstance(code, bool) and -(1 << 31) <= code < 1 << 31)
    if not exit_status or not isinstance(stdout, str) or not isinstance(stderr, str):
        return runner.failure(f"SandboxError: {url} answered a run_result whose return_code, stdout or stderr "
                              "is not an exit status and text")
    (stdout, cut_out), (stderr, cut_err) = _capped(stdout, cap), _capped(stderr, cap)
    answer = {"stdout": stdout, "stderr": stderr, "returncode": -9 if timed_out or code is None else code,
              "timed_out": timed_out, "oom_killed": False,
              "truncated": cut_out or cut_err or bool(_CUT.search(stdout) or _CUT.search(stderr))}
    if status == "Failed" and message:
        answer["error"] = message[:1000]
    return answer


def _capped(text: str, cap: int) -> tuple[str, bool]:
    """At most `cap` bytes of a stream: head and tail with a line saying how much was cut (runner.read_answer's)."""
    data = text.encode("utf-8", errors="replace")
    if len(_CUT.sub("", text, count=1).encode("utf-8", errors="replace")) <= cap:  # the lab's server cut it already
        return text, False
    head, tail = cap - cap // 2, cap // 2
    kept = data[:head] + f"\n... [{len(data) - head - tail} bytes cut] ...\n".encode() + data[len(data) - tail:]
    return kept.decode("utf-8", errors="replace"), True


def _describe(e: Exception) -> str:
    """One line naming what went wrong with a member."""
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "no answer in time"
    text = str(e) if isinstance(e, (ValueError, OSError)) and str(e) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:300]
