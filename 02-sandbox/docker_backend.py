"""The Docker backend: single-use containers, started ahead of need, each running runner.py.

A container runs `python3 -I -c <runner.py's source> --container OPTIONS` (so the image never goes stale), takes one
call and is removed: no state to reset. What it gets and when to prefer it: docs/02-isolation.md; the image:
02-sandbox/Dockerfile (+ build_image.sh).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import socket
import struct
import time
import warnings
from pathlib import Path

import confinement
import runner


class DockerBackend:
    def __init__(self, cfg, error: type[Exception]) -> None:
        try:
            import docker
        except ImportError:
            raise error("the docker backend needs the docker Python SDK (pip install docker)") from None
        self._docker, self._cfg = docker, cfg
        try:
            self._client = docker.from_env(version="auto", timeout=60, max_pool_size=cfg.concurrency + 8)
            self._client.ping()
        except Exception as e:
            raise error(f"no Docker engine reachable: {e}") from None
        try:
            self._client.images.get(cfg.image)
        except docker.errors.ImageNotFound:
            raise error(f"Docker image {cfg.image} not found: build it with 02-sandbox/build_image.sh") from None
        self._source = Path(runner.__file__).read_text()  # sent as `python3 -c`: one argument may hold 128 KiB
        # The local backend's filter on top of Docker's profile, which allows sockets (why: docs/02-isolation.md).
        try:
            self._filter = confinement.seccomp_program().hex()
        except OSError as e:
            raise error(str(e)) from None
        self._warm: queue.Queue = queue.Queue()  # (container id, time it was started)
        self._closed = False
        self._want = cfg.docker_warm if cfg.docker_warm is not None else cfg.concurrency
        self._chores = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="sandbox-docker")
        for _ in range(self._want):
            self._chore(self._start_warm)

    def isolation(self) -> str:
        return "container"

    def ready(self) -> None:
        pass  # containers are started on demand when none is warm

    def execute(self, request: dict) -> dict:
        container = self._take()
        self._chore(self._start_warm)  # replace the one taken, in the background
        deadline = request["timeout"] + runner.ANSWER_GRACE
        try:
            return self._exchange(container, request, deadline)
        except self._docker.errors.APIError:  # a warm container can be gone (it gave up waiting, or was killed)
            self._chore(self._remove, container)
            container = self._start()
            return self._exchange(container, request, deadline)
        finally:
            self._chore(self._remove, container)

    def close(self) -> None:
        self._closed = True
        self._chores.shutdown(wait=True)  # every chore done: a container started meanwhile is in the queue, or removed
        while not self._warm.empty():
            self._remove(self._warm.get_nowait()[0])

    def _take(self) -> str:
        """A warm container, or a new one; never one whose runner is about to give up waiting."""
        while True:
            try:
                container, started = self._warm.get_nowait()
            except queue.Empty:
                return self._start()
            if time.monotonic() - started < runner.IDLE_EXIT - 60:
                return container
            self._chore(self._remove, container)

    def _start(self):
        """Create and start one container whose runner waits for a request on stdin."""
        cfg, api = self._cfg, self._client.api
        memory = f"{cfg.memory_mb + 4 * cfg.max_file_mb + 64}m"  # the code's RLIMIT_AS, its tmpfs, the runner; no swap
        host_config = api.create_host_config(
            network_mode="none", mem_limit=memory, memswap_limit=memory, nano_cpus=int(cfg.docker_cpus * 1e9),
            pids_limit=cfg.max_processes + 8,  # the runner's own processes on top of the code's
            read_only=True, tmpfs={"/tmp": f"size={4 * cfg.max_file_mb}m,mode=1777"}, cap_drop=["ALL"],
            security_opt=["no-new-privileges"], auto_remove=True,  # one whose runner gave up waiting removes itself
            log_config={"type": "none"},  # the answer comes over the attach stream, nothing to keep
        )
        options = json.dumps({"preload": list(cfg.preload), "seccomp": self._filter})
        created = api.create_container(
            cfg.image, command=["python3", "-I", "-c", self._source, "--container", options], user="65534:65534",
            environment=runner.clean_env(), working_dir="/tmp", host_config=host_config,
            stdin_open=True, detach=False,  # so the SDK also sets StdinOnce: stdin closes when we hang up
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
        sock = self._client.api.attach_socket(container, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        raw = getattr(sock, "_sock", sock)
        stream = _AttachStream(raw)
        try:
            raw.settimeout(timeout)
            data = json.dumps(request).encode()
            raw.sendall(struct.pack(">I", len(data)) + data)
            raw.shutdown(socket.SHUT_WR)  # EOF on the runner's stdin: the request is complete
            return runner.read_answer(stream.read_exactly)
        except (socket.timeout, TimeoutError):
            return runner.failure(f"SandboxError: no answer from the container within {timeout:.0f} s")
        except (EOFError, ValueError):
            last = stream.stderr.decode(errors="replace").strip().splitlines()
            return runner.failure("SandboxError: the container gave no answer" + (f": {last[-1]}" if last else " (killed: out of memory?)"))
        finally:
            raw.close()
            sock.close()

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
        self._chores.submit(fn, *args).add_done_callback(self._chore_done)

    def _chore_done(self, future) -> None:
        if future.exception() is not None and not self._closed:
            warnings.warn(f"sandbox docker chore failed: {future.exception()}", RuntimeWarning)


class _AttachStream:
    """Demultiplexes an attach stream (frames of an 8-byte header: stream, size; then the payload).
    read_exactly reads the runner's stdout; its stderr is kept to explain a missing answer."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self._buffer, self._stdout, self.stderr = sock, bytearray(), bytearray(), bytearray()

    def read_exactly(self, size: int) -> bytes:
        while len(self._stdout) < size:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise EOFError
            self._buffer += chunk
            while len(self._buffer) >= 8:
                kind, length = self._buffer[0], struct.unpack(">I", self._buffer[4:8])[0]
                if len(self._buffer) < 8 + length:
                    break
                (self._stdout if kind == 1 else self.stderr).extend(self._buffer[8:8 + length])
                del self._buffer[:8 + length]
        data = bytes(self._stdout[:size])
        del self._stdout[:size]
        return data
