"""The sandboxfusion backend: Sandbox.run over HTTP, to any server speaking SandboxFusion's /run_code.

    SandboxConfig(backend="sandboxfusion", urls=("http://127.0.0.1:8080",), token=None)

The server can be the lab's own (02-sandbox/serve.py) or a real SandboxFusion. Calls
are spread over `urls`: the least busy server, ties taken in turn (so round robin
when idle). A server that refuses connections is skipped for a few seconds and the
call goes to another one; any other failure (no answer in time, an HTTP error, a
SandboxError) is the call's answer, never an exception, so one lost server costs one
observation, not a rollout. The story and the mapping: docs/02-service.md.
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
        self._turn = 0
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
                response = self._post(index, body, deadline)
            except ConnectionRefusedError:
                with self._lock:
                    self._down_until[index] = time.monotonic() + DOWN_SECONDS
                tried.add(index)
                if len(tried) < len(self._urls):
                    continue  # nothing ran: another server may take it
                return runner.failure(f"SandboxError: no sandbox server accepts connections ({', '.join(self._urls)})")
            except (OSError, ValueError, http.client.HTTPException) as e:  # a timeout, a reset, an HTTP error, not JSON
                return runner.failure(f"SandboxError: {self._urls[index]}: {_describe(e)}")
            finally:
                with self._lock:
                    self._busy[index] -= 1
            return to_answer(response, self._urls[index])

    def ready(self) -> None:
        """Once: at least one server answers GET /v1/ping; the others are skipped until they do."""
        if self._ready:
            return
        problems = []
        for index, url in enumerate(self._urls):
            ping = urllib.request.Request(url[: -len("/run_code")] + "/v1/ping", headers=self._headers)
            try:
                self._opener.open(ping, timeout=10).read()
            except (OSError, ValueError) as e:
                problems.append(f"{url}: {_describe(e)}")
                self._down_until[index] = time.monotonic() + DOWN_SECONDS
        if len(problems) == len(self._urls):
            raise self._error(f"no SandboxFusion server answers: {'; '.join(problems)}")
        self._ready = True

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

    def _post(self, index: int, body: dict, timeout: float) -> dict:
        request = urllib.request.Request(self._urls[index], data=json.dumps(body).encode(), headers=self._headers)
        try:
            with self._opener.open(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.URLError as e:
            if isinstance(e.reason, ConnectionRefusedError):
                raise e.reason from None
            raise


def to_answer(response, url: str) -> dict:
    """A RunCodeResponse as the answer dict Sandbox turns into an ExecResult (runner.read_answer's keys).

    Success/Failed with run_result Finished -> its return_code; TimeLimitExceeded -> timed out;
    SandboxError, or no run_result -> a failed call whose stderr says why. A non-empty
    `message` on a failed call is the reason line (the lab's server puts it there).
    """
    run = response.get("run_result") if isinstance(response, dict) else None
    status = response.get("status") if isinstance(response, dict) else None
    if status not in ("Success", "Failed") or not isinstance(run, dict) or run.get("status") not in ("Finished", "TimeLimitExceeded"):
        message = response.get("message") if isinstance(response, dict) else None
        return runner.failure(f"SandboxError: {url} answered {status or 'something else than a RunCodeResponse'}"
                              + (f": {message}" if message else ""))
    timed_out = run["status"] == "TimeLimitExceeded"
    code = run.get("return_code")
    stdout, stderr = run.get("stdout") or "", run.get("stderr") or ""
    answer = {"stdout": stdout, "stderr": stderr, "returncode": -9 if timed_out or code is None else int(code),
              "timed_out": timed_out, "oom_killed": False, "truncated": bool(_CUT.search(stdout) or _CUT.search(stderr))}
    if status == "Failed" and response.get("message"):
        answer["error"] = response["message"]
    return answer


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
