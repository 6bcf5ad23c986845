"""A pool of sandbox servers behind the sandboxfusion backend: a member that dies, a member that misbehaves.

Real sockets on loopback throughout: two serve.py processes for the pool (root, as the
local sandbox inside them needs), and for answers no real server gives, a small HTTP
server in this process that sends exactly the bytes a test names.
"""
from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import struct
import threading
import time

import pytest

import runner
import sandboxfusion_backend
from sandbox import Sandbox, SandboxConfig
from test_serve import start_server, stop_server

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="serve.py runs the local sandbox, which needs root")


def free_port_url() -> str:
    """A loopback URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@needs_root
def test_a_pool_member_killed_mid_run_loses_and_repeats_no_call(monkeypatch):
    monkeypatch.setattr(sandboxfusion_backend, "DOWN_SECONDS", 600.0)  # once dead, skipped for the test
    (first, first_url), (second, second_url) = start_server(), start_server()
    try:
        with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(first_url, second_url), concurrency=8)) as pool:
            served = []
            post = pool._backend._post
            pool._backend._post = lambda index, *a: served.append(index) or post(index, *a)
            warm = pool.run_many([f"print({i})" for i in range(8)])
            assert [r.stdout for r in warm] == [f"{i}\n" for i in range(8)] and set(served) == {0, 1}  # both serve
            # 16 calls that each take a while, so several are in flight on the first server when it dies
            codes = [f"import time\ntime.sleep(0.4)\nprint({i} * {i})" for i in range(16)]
            results = []
            runner = threading.Thread(target=lambda: results.extend(pool.run_many(codes)))
            runner.start()
            while served.count(0) < 6:  # the first server has taken calls of this batch
                threading.Event().wait(0.01)
            first.kill()  # SIGKILL: no goodbye, its open connections drop
            runner.join(timeout=120)
            assert not runner.is_alive()
            assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(16)]  # each call's own answer, once
            assert all(r.ok for r in results)
            after = pool.run_many([f"print({i})" for i in range(4)])
            assert [r.stdout for r in after] == [f"{i}\n" for i in range(4)]
    finally:
        first.kill()
        first.wait(timeout=60)
        stop_server(second)


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers /v1/ping with 200 and every POST with the server's `status` and `answer` bytes."""

    def do_GET(self):
        self._send(b'"pong"')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(self.server.answer, self.server.status)

    def _send(self, body: bytes, status: int = 200):
        self.send_response(status)
        for name, value in self.server.extra_headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    """A loopback server that answers what the test sets in `server.answer`; (server, url)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.answer, server.status, server.extra_headers = b"{}", 200, {}
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def resetting_server() -> tuple[socket.socket, str]:
    """A loopback server that answers a ping, and resets each other request after reading a little of it (a member
    dying while a request goes out); (its socket, its url)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return  # closed: the test is over
            if connection.recv(1024).startswith(b"GET"):
                connection.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\n"pong"')
                connection.close()
                continue
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
            connection.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_member_that_resets_a_request_while_it_is_sent_is_skipped_and_the_call_runs_elsewhere(scripted):
    server, good = scripted
    server.answer = run_result(stdout="answered\n")
    listener, resetting = resetting_server()
    try:
        code = "# a request long enough to be on its way when the reset comes\n" + "#" * (4 << 20) + "\nprint(1)"
        with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(resetting, good), concurrency=1)) as pool:
            served = []
            post = pool._backend._post
            pool._backend._post = lambda index, *a: served.append(index) or post(index, *a)
            results = pool.run_many([code] * 4)
    finally:
        listener.close()
    assert served[0] == 0 and served.count(1) == 4  # the resetting member was tried, then skipped
    assert [(r.ok, r.stdout) for r in results] == [(True, "answered\n")] * 4


def run_result(**fields) -> bytes:
    return json.dumps({"status": "Success", "message": "", "run_result": {
        "status": "Finished", "return_code": 0, "stdout": "", "stderr": "", **fields}}).encode()


@pytest.mark.parametrize("answer", [
    b"not json at all",
    b'{"status": "Success", "run_result": {"status": "Finished", "return_code": 1e400}}',  # infinity
    b'{"status": "Success", "run_result": {"status": "Finished", "return_code": Infinity}}',
    run_result(return_code=10 ** 40),
    run_result(return_code="zero"),
    run_result(return_code=True),
    run_result(stdout=42),
    run_result(stderr=["a", "list"]),
    b'{"status": 5, "message": {"not": "text"}}',
    b'{"status": "Success", "run_result": "Finished"}',
    b"[1, 2, 3]",
    b'"just a string"',
    b"{" + b'"pad": "' + b"x" * (3 << 20) + b'"}',  # past what two capped streams can take
    b"[" * 200_000 + b"]" * 200_000,  # deeper than the JSON decoder recurses
    b'{"status": "Success", "run_result": ' * 20_000 + b"{}" + b"}" * 20_000,
])
def test_a_misbehaving_servers_answer_is_a_failed_call_never_an_exception(scripted, answer):
    server, url = scripted
    server.answer = answer
    with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(url,), max_output_bytes=64 * 1024)) as sb:
        result = sb.run("print(1)")
    assert not result.ok and result.stdout == "" and "SandboxError" in result.stderr


def test_a_servers_streams_come_back_capped_as_the_local_sandboxs(scripted):
    server, url = scripted
    cap = 1000
    server.answer = run_result(stdout="a" * 600 + "b" * 5000 + "c" * 600, stderr="short\n")
    with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(url,), max_output_bytes=cap)) as sb:
        result = sb.run("print(1)")
    assert result.ok and result.truncated and result.stderr == "short\n"
    # head and tail of cap bytes in all, and the line the local sandbox writes between them
    assert result.stdout == "a" * 500 + "\n... [5200 bytes cut] ...\n" + "c" * 500


@needs_root
def test_a_capped_stream_reads_as_the_local_sandboxs(scripted):
    server, url = scripted
    text = "".join(f"{i}\n" for i in range(40_000))
    server.answer = run_result(stdout=text)
    with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(url,), max_output_bytes=4096)) as remote, \
            Sandbox(SandboxConfig(max_output_bytes=4096)) as local:
        over_http, in_process = remote.run("print(1)"), local.run("for i in range(40_000): print(i)")
    assert (over_http.stdout, over_http.truncated) == (in_process.stdout, in_process.truncated) and in_process.truncated


def test_the_preflight_names_each_pool_member_that_does_not_answer(scripted, tmp_path, monkeypatch):
    import retool

    _, live = scripted
    dead = free_port_url()
    config = SandboxConfig(backend="sandboxfusion", urls=(live, dead))
    problems = sandboxfusion_backend.unreachable(config)
    assert len(problems) == 1 and problems[0].startswith(f"{dead}/run_code: ")
    assert sandboxfusion_backend.unreachable(SandboxConfig(backend="sandboxfusion", urls=(live,))) == []
    cfg = retool.Config(sandbox_backend="sandboxfusion", sandbox_urls=f"{live},{dead}")
    with pytest.raises(SystemExit, match=f"error: the sandbox pool is not whole: {dead}/run_code: "):
        retool.start_sandbox(cfg)


# --------------------------------------------------------------------------------------
# A member trusted with nothing: redirects, pace, malformed HTTP
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def member(answer_post, seconds: float = 20.0):
    """A loopback server that answers GET /v1/ping with "pong" and hands each POST's connection, its request
    read, to answer_post(connection, stop) (stop: an Event set when the test is over, or after `seconds`);
    yields its url and the requests it read."""
    listener, requests, stop = socket.create_server(("127.0.0.1", 0)), [], threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(seconds)
            try:
                data = b""
                while b"\r\n\r\n" not in data and (chunk := conn.recv(1 << 16)):
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length and (chunk := conn.recv(1 << 16)):
                    body += chunk
                requests.append(head)
                if head.startswith(b"GET"):
                    conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\n"pong"')
                else:
                    answer_post(conn, stop)
            except OSError:  # the client went: its call is over
                pass

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the test is over
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    timer = threading.Timer(seconds, stop.set)  # every script ends by then, whatever its client does
    timer.daemon = True
    timer.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", requests
    finally:
        stop.set()
        timer.cancel()
        listener.close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_a_failed_call_and_the_token_goes_to_no_other_address(scripted, status):
    server, url = scripted
    token = "a-token-that-must-stay-home"
    with member(lambda conn, stop: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                                % (len(run_result(stdout="elsewhere\n")), run_result(stdout="elsewhere\n")))
                ) as (elsewhere, seen_elsewhere):
        server.status, server.extra_headers = status, {"Location": elsewhere + "/run_code"}
        server.answer = run_result(stdout="redirected\n")
        with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(url,), token=token)) as sb:
            result = sb.run("print(1)")
    assert not result.ok and result.stdout == "" and f"HTTP {status}, a redirect: not followed" in result.stderr
    assert seen_elsewhere == []  # no request, so no token, reached the other port


def _trickle_a_body(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    while not stop.wait(0.2):
        conn.sendall(b" ")


def _trickle_a_head(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while not stop.wait(0.2):
        conn.sendall(b"X")


def _flood_continue(conn, stop):
    while not stop.wait(0.05):
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")


@pytest.mark.parametrize("pace", [_trickle_a_body, _trickle_a_head, _flood_continue])
def test_one_deadline_ends_a_call_however_a_member_paces_its_bytes(monkeypatch, pace):
    """Each member sends something every 0.2 s or faster, for up to 20 s: a timeout per receive would never fire."""
    monkeypatch.setattr(runner, "ANSWER_GRACE", 1.0)  # the call's deadline: its 0.5 s timeout and 1 s of grace
    with member(pace) as (url, _):
        with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(url,))) as sb:
            start = time.monotonic()
            result = sb.run("print(1)", timeout=0.5)
            took = time.monotonic() - start
    assert not result.ok and "no answer in time" in result.stderr
    assert took < 10, f"the call took {took:.1f} s against a deadline of 1.5 s"


def _send(data: bytes):
    return lambda conn, stop: conn.sendall(data)


def _flood_body(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
    for _ in range(10_000):  # 640 MB at most: the client stops reading long before
        if stop.is_set():
            return
        conn.sendall(b"x" * (1 << 16))


@pytest.mark.parametrize("script, reason", [
    (_send(b"SSH-2.0-OpenSSH\r\n\r\n"), "not an HTTP answer"),
    (_send(b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n{}"), "Content-Length that is no number"),
    (_send(b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"y" * (1 << 17) + b"\r\n\r\n"), "more than 64 KB"),
    (_send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"), "chunked answer"),
    (_send(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 18\r\n\r\n{\"detail\": \"boom\"}"), "HTTP 500: boom"),
    (_flood_body, "an answer over"),
])
def test_malformed_http_from_a_member_is_a_failed_call_in_one_line(script, reason):
    with member(script) as (url, _):
        with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(url,), max_output_bytes=4096)) as sb:
            result = sb.run("print(1)")
    assert not result.ok and result.stdout == "" and reason in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_well_formed_answer_in_any_http_framing_is_read(monkeypatch):
    body = run_result(stdout="framed\n")
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    for answer in (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
                   b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\n\r\n",
                   b"HTTP/1.0 200 OK\r\n\r\n" + body):  # no length: the body ends when the connection does
        with member(_send(answer)) as (url, _):
            with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(url,))) as sb:
                result = sb.run("print(1)")
        assert (result.ok, result.stdout) == (True, "framed\n"), answer[:60]


@needs_root
def test_a_call_waits_for_a_free_slot_outside_its_deadline_when_the_client_is_sized_to_the_pool(monkeypatch):
    """The deadline starts once the client admits a call: sized to the pool's slots, waits are never 'timed out'.

    A member with one slot and calls of 1 s under a deadline of 2 s + grace 0.5 s: a client that sends one call at
    a time (concurrency = the pool's slots; retool's --sandbox-concurrency) runs all three; a client that sends all
    three at once has the member queue them, so the third's wait is counted against it and it fails.
    """
    monkeypatch.setattr(runner, "ANSWER_GRACE", 0.5)
    proc, url = start_server("--concurrency", "1")
    codes = ["import time\ntime.sleep(1)\nprint('done')"] * 3
    try:
        with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(url,), concurrency=1, timeout=2)) as sized:
            results = sized.run_many(codes)
        assert [r.stdout for r in results] == ["done\n"] * 3 and all(r.ok for r in results), results
        with Sandbox(SandboxConfig(backend="sandboxfusion", urls=(url,), concurrency=3, timeout=2)) as oversized:
            results = oversized.run_many(codes)
        assert sum(r.ok for r in results) < 3 and any("SandboxError" in r.stderr for r in results), results
    finally:
        stop_server(proc)
