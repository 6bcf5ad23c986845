"""The sandboxfusion backend: Sandbox.run over HTTP, to any server speaking SandboxFusion's /run_code.

    SandboxConfig(backend="sandboxfusion", urls=("http://127.0.0.1:8080",), token=None)

The server can be the lab's own (02-sandbox/serve.py) or a real SandboxFusion. Calls
are spread over `urls` (a pool): the least busy server, ties taken in turn (so round
robin when idle). A server that refuses a connection, or drops one before it answers
(it died mid-call: while the request went out, or before the answer was whole), is
skipped for a few seconds and the call runs again on another one: a call's code has
no effects outside it, and its one answer is the one that arrives. Any other failure (no answer in time, an HTTP error, a SandboxError, an
answer that is not a well-formed RunCodeResponse) is the call's answer, never an
exception. A server's stdout and stderr come back capped as the local sandbox caps
them. `unreachable(urls)` is a run's preflight: every pool member must answer at
start. The story and the mapping: docs/02-service.md.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import runner

DOWN_SECONDS = 5.0  # a server that refused a connection is skipped this long (unless all are)
_CUT = re.compile(r"\n\.\.\. \[\d+ bytes cut\] \.\.\.\n")  # runner.read_answer's mark of a stream over the cap


class SandboxFusionBackend:
    """execute(request) -> answer, like the local backend; see Sandbox for the interface."""

    def __init__(self, cfg, error: type[Exception]) -> None:
        self._error = error
        self._urls = [url.rstrip("/") if url.rstrip("/").endswith("/run_code") else url.rstrip("/") + "/run_code"
                      for url in cfg.urls]
        token = cfg.token if cfg.token is not None else os.environ.get("SANDBOX_TOKEN")
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an http_proxy
        self._lock = threading.Lock()
        self._busy = [0] * len(self._urls)  # calls in flight per server
        self._down_until = [0.0] * len(self._urls)
        self._turn = int(os.environ.get("RANK", "0")) % len(self._urls)  # torchrun's ranks start at different members
        self._ready = False

    def execute(self, request: dict) -> dict:
        body = {"code": request["code"], "language": "python", "run_timeout": request["timeout"],
                "compile_timeout": request["timeout"], "memory_limit_MB": request["memory_mb"],
                "stdin": None, "files": {}, "fetch_files": []}
        deadline = request["timeout"] + runner.ANSWER_GRACE
        tried: set[int] = set()
        while True:
            index = self._pick(tried)
            try:
                response = self._post(index, body, deadline, 16 * request["max_output_bytes"] + (1 << 20))
            except (ConnectionError, http.client.IncompleteRead):  # refused, or dropped before the answer was whole
                with self._lock:
                    self._down_until[index] = time.monotonic() + DOWN_SECONDS
                tried.add(index)
                if len(tried) < len(self._urls):
                    continue  # no answer came back: another server runs it (the code has no effects outside the call)
                return runner.failure(f"SandboxError: no sandbox server answered ({', '.join(self._urls)})")
            except (OSError, ValueError, http.client.HTTPException) as e:  # a timeout, an HTTP error, not JSON
                return runner.failure(f"SandboxError: {self._urls[index]}: {_describe(e)}")
            finally:
                with self._lock:
                    self._busy[index] -= 1
            return to_answer(response, self._urls[index], request["max_output_bytes"])

    def ready(self) -> None:
        """Once: at least one server answers GET /v1/ping; the others are skipped until they do."""
        if self._ready:
            return
        problems = []
        for index, url in enumerate(self._urls):
            problem = self._ping(index)
            if problem:
                problems.append(problem)
                self._down_until[index] = time.monotonic() + DOWN_SECONDS
        if len(problems) == len(self._urls):
            raise self._error(f"no SandboxFusion server answers: {'; '.join(problems)}")
        self._ready = True

    def _ping(self, index: int) -> str | None:
        """None if the server answers GET /v1/ping, else what went wrong, naming it."""
        url = self._urls[index]
        ping = urllib.request.Request(url[: -len("/run_code")] + "/v1/ping", headers=self._headers)
        try:
            self._opener.open(ping, timeout=10).read()
        except (OSError, ValueError, http.client.HTTPException) as e:
            return f"{url}: {_describe(e)}"
        return None

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

    def _post(self, index: int, body: dict, timeout: float, limit: int) -> dict:
        """The server's JSON answer; at most `limit` bytes of it (two capped streams, JSON-escaped, and the rest)."""
        request = urllib.request.Request(self._urls[index], data=json.dumps(body).encode(), headers=self._headers)
        try:
            with self._opener.open(request, timeout=timeout) as response:
                data = response.read(limit + 1)
                if len(data) > limit:
                    raise ValueError(f"an answer over {limit:,} bytes")
                return json.loads(data)
        except urllib.error.URLError as e:
            if isinstance(e.reason, ConnectionError):  # refused, or reset or broken while the request was sent
                raise e.reason from None
            raise


def unreachable(cfg) -> list[str]:
    """A run's preflight over the pool of a SandboxConfig: one line per server that does not answer GET /v1/ping."""
    pool = SandboxFusionBackend(cfg, RuntimeError)
    return [problem for problem in map(pool._ping, range(len(pool._urls))) if problem]


def to_answer(response, url: str, cap: int = 64 * 1024) -> dict:
    """A RunCodeResponse as the answer dict Sandbox turns into an ExecResult (runner.read_answer's keys).

    Success/Failed with run_result Finished -> its return_code; TimeLimitExceeded -> timed out;
    SandboxError, no run_result, or fields of the wrong type or size -> a failed call whose
    stderr says why. A non-empty `message` on a failed call is the reason line (the lab's
    server puts it there). Each stream keeps at most `cap` bytes, head and tail, as the
    local sandbox's do.
    """
    run = response.get("run_result") if isinstance(response, dict) else None
    status = response.get("status") if isinstance(response, dict) else None
    message = response.get("message") if isinstance(response, dict) else None
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
    if isinstance(e, urllib.error.HTTPError):
        try:
            detail = json.loads(e.read()).get("detail", "")
        except (OSError, ValueError, AttributeError):
            detail = ""
        return f"HTTP {e.code}" + (f": {detail}" if detail else "")
    if isinstance(e, (socket.timeout, TimeoutError)) or isinstance(getattr(e, "reason", None), (socket.timeout, TimeoutError)):
        return "no answer in time"
    return str(getattr(e, "reason", None) or e)
