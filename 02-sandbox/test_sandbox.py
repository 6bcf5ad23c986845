"""Hostile code against both backends: each test states what must be contained.

Every hostile test also checks that the sandbox still answers the next call correctly (with Docker, where
every call is a new container, once after the hostile kinds together: see assert_still_answers).
Docker tests skip, with the reason, when no engine or no sandbox image is reachable
(.ci/docker.sh installs and starts one and builds the image); the local backend's
namespace tests skip when not root, the one case where the kernel refuses them.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import platform
import pwd
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

import confinement
import sandbox as sandbox_module
from doc_pages import page, says
from sandbox import LAB_ROOT, ExecResult, Sandbox, SandboxConfig, SandboxError, format_observation


def docker_unavailable() -> str:
    """Why the docker backend cannot run here ('' when it can)."""
    try:
        import docker
    except ImportError:
        return "the docker Python SDK is not installed"
    try:
        client = docker.from_env(version="auto", timeout=10)
        client.ping()
    except Exception as e:
        return f"no Docker engine reachable ({type(e).__name__}); run .ci/docker.sh"
    try:
        client.images.get(SandboxConfig.image)
    except Exception:
        return f"image {SandboxConfig.image} missing; build it with 02-sandbox/build_image.sh"
    return ""


BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]
TIMEOUT = 20.0  # generous: on a loaded machine only runaway code may reach it
SHORT = 1.0  # the per-call limit of the tests of code that prints before it runs away, so that they stay quick
RUNAWAY = 0.5  # the limit of code that only runs away: whenever it is stopped, the check is the same
MAX_FILE_MB = 4
MAX_OUTPUT = 16 * 1024


def make_config(backend: str, **overrides) -> SandboxConfig:
    settings = dict(backend=backend, timeout=TIMEOUT, memory_mb=512, max_file_mb=MAX_FILE_MB,
                    max_output_bytes=MAX_OUTPUT, max_processes=32, concurrency=4)
    if backend == "docker":
        settings["preload"] = ()  # the tests need no sympy: containers start faster without it
    settings.update(overrides)
    return SandboxConfig(**settings)


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the local backend's namespaces and cgroups need root (the plain-isolation tests still run)")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    if request.param == "docker":
        reason = docker_unavailable()
        if reason:
            pytest.skip(f"docker backend: {reason}")
    else:
        needs_root()
    return request.param


@pytest.fixture(scope="module")
def sb(backend):
    with Sandbox(make_config(backend)) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def local_sb():
    """For ordinary code's edge cases: runner.py answers them, the same code inside a container, so one backend is enough."""
    needs_root()
    with Sandbox(make_config("local", preload=())) as sandbox:
        yield sandbox


def assert_answers(sb: Sandbox) -> None:
    r = sb.run("print(6 * 7)")
    assert r.ok and r.stdout == "42\n", r


def assert_still_answers(sb: Sandbox) -> None:
    """After hostile code, the next call answers. With Docker the next call is a new container that shares nothing
    with the one before: there the backend going on is checked where a call attacks it (killing its parent) and
    once after the hostile kinds that load the machine ran together (the mixed test)."""
    if sb.config.backend != "docker":
        assert_answers(sb)


def eventually(condition, seconds: float = 10.0) -> bool:
    """For effects that follow a call asynchronously; waits, never asserts a speed."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def marker() -> str:
    """A process name (comm, at most 15 characters) to find leftovers by."""
    return "sbx" + uuid.uuid4().hex[:10]


def processes_named(name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == name:
                        found.append(int(entry))
            except OSError:
                pass
    return found


# ---------------------------------------------------------------- runaway code


def test_an_infinite_loop_is_stopped_at_the_timeout(sb):
    r = sb.run("while True:\n    pass", timeout=RUNAWAY)
    assert r.timed_out and not r.ok
    assert format_observation(r) == f"TimeoutError: execution exceeded the {RUNAWAY:g} s time limit"
    assert_still_answers(sb)


def test_sleeping_past_the_timeout_is_stopped_and_keeps_what_was_printed(sb):
    r = sb.run("import time\nprint('started')\ntime.sleep(60)", timeout=SHORT)
    assert r.timed_out and not r.ok
    assert r.stdout == "started\n"
    assert r.latency < 60  # stopped, not waited out
    assert_still_answers(sb)


def test_a_fork_bomb_is_contained_and_leaves_no_process(sb):
    name = marker()
    r = sb.run(
        "import ctypes, os\n"
        f"ctypes.CDLL(None).prctl(15, b'{name}')  # children inherit the name\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n",
        timeout=RUNAWAY,
    )
    assert r.timed_out and not r.ok
    assert processes_named(name) == []
    assert_still_answers(sb)


def test_a_memory_bomb_fails_with_memory_error_in_the_code(sb):
    r = sb.run("x = bytearray(8 * 1024**3)")
    assert format_observation(r) == "MemoryError"
    r = sb.run("chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024**2))")
    assert not r.ok and format_observation(r) == "MemoryError"
    assert_still_answers(sb)


def test_a_print_flood_is_cut_at_the_file_limit_keeping_head_and_tail(sb):
    r = sb.run("i = 0\nwhile True:\n    print(f'line {i}', 'x' * 1000)\n    i += 1")
    assert not r.ok and r.truncated and not r.timed_out
    assert r.stdout.startswith("line 0 xxx")
    assert "bytes cut" in r.stdout
    assert len(r.stdout.encode()) < MAX_OUTPUT + 100
    assert format_observation(r) == f"OutputLimitError: more than {MAX_FILE_MB} MB written to one stream or file"
    assert_still_answers(sb)


def test_a_100_mb_single_line_is_cut(sb):
    r = sb.run("print('y' * 100_000_000)")
    assert not r.ok and r.truncated
    head, marker_line, tail = r.stdout.split("\n")[:3]
    assert head == tail == "y" * (MAX_OUTPUT // 2)
    # Written up to exactly the file limit, then killed; the middle is dropped.
    assert marker_line == f"... [{MAX_FILE_MB * 1024 * 1024 - MAX_OUTPUT} bytes cut] ..."
    assert_still_answers(sb)


def test_binary_output_is_decoded_with_replacement_not_an_error(local_sb):
    r = local_sb.run("import sys\nsys.stdout.buffer.write(bytes(range(256)))\nprint('after')")
    assert r.ok
    assert r.stdout.startswith("\x00\x01\x02")
    assert "\ufffd" in r.stdout and r.stdout.endswith("after\n")
    assert_still_answers(local_sb)


# ---------------------------------------------------------------- reading and writing what it should not


def test_secrets_in_the_callers_environment_are_not_visible(backend, monkeypatch):
    secret = "hf_" + uuid.uuid4().hex
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("WANDB_API_KEY", secret)
    code = (
        "import os, glob\n"
        "print(dict(os.environ))\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        print(open(path, 'rb').read())\n"
        "    except OSError:\n"
        "        pass\n"
    )
    with Sandbox(make_config(backend, concurrency=1, preload=())) as fresh:  # created after the secret was set
        r = fresh.run(code)
    assert r.ok
    assert "HF_TOKEN" not in r.stdout and "WANDB_API_KEY" not in r.stdout and secret not in r.stdout


def test_no_network_connection_can_be_opened(sb):
    listener = socket.create_server(("127.0.0.1", 0))  # something to reach on this machine
    port = listener.getsockname()[1]
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # reachable from outside the sandbox
    try:
        r = sb.run(
            "import socket\n"
            f"for address in [('127.0.0.1', {port}), ('10.255.255.1', 80), ('1.1.1.1', 443)]:\n"
            "    try:\n"
            "        socket.create_connection(address, timeout=1).close()\n"
            "        print('connected', address)\n"
            "    except OSError as e:\n"
            "        print('failed', address, e)\n"
            "print(sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]))\n"
        )
    finally:
        listener.close()
    assert r.ok
    assert "connected" not in r.stdout
    assert r.stdout.count("failed") == 3
    assert "Network is unreachable" in r.stdout
    assert_still_answers(sb)


def test_writing_outside_the_work_dir_never_reaches_the_machine(sb):
    name = marker()
    targets = [os.path.join(LAB_ROOT, "02-sandbox", name), f"/tmp/{name}", f"/etc/{name}", f"/var/tmp/{name}",
               f"/run/lock/{name}", f"/dev/shm/{name}"]  # /run/lock is writable by anyone on this machine
    code = "\n".join(
        [f"for path in {targets!r}:", "    try:", "        open(path, 'w').write('escaped')",
         "        print('wrote', path)", "    except OSError as e:", "        print('denied', path, type(e).__name__)",
         "open('inside.txt', 'w').write('fine')", "print(open('inside.txt').read())"]
    )
    r = sb.run(code)
    assert r.ok and r.stdout.endswith("fine\n"), r
    for path in targets:
        assert not os.path.exists(path), path
    assert_still_answers(sb)


def test_the_labs_own_files_cannot_be_read(sb):
    r = sb.run(
        "import os\n"
        f"print(open({os.path.join(LAB_ROOT, '02-sandbox', 'sandbox.py')!r}).read()[:20])\n"
    )
    assert not r.ok
    assert format_observation(r).startswith("FileNotFoundError")
    assert_still_answers(sb)


def test_shared_memory_segments_do_not_outlive_the_call(sb):
    key = int(uuid.uuid4().hex[:7], 16)
    shmget = "import ctypes\nshmget = ctypes.CDLL(None, use_errno=True).shmget\n"
    r = sb.run(shmget + f"print(shmget({key}, 4096, 0o1000 | 0o600) >= 0)")  # IPC_CREAT
    assert r.ok and r.stdout == "True\n"
    r = sb.run(shmget + f"print(shmget({key}, 0, 0) >= 0)")  # the next call looks for it
    assert r.ok and r.stdout == "False\n"
    with open("/proc/sysvipc/shm") as f:  # nor is it left in this machine's memory
        assert all(int(line.split()[0]) != key for line in list(f)[1:])


# ---------------------------------------------------------------- attacks on the sandbox's own processes


def test_killing_the_parent_does_not_take_the_sandbox_down(sb):
    r = sb.run("import os\nos.kill(os.getppid(), 9)\nprint('still here')")
    assert isinstance(r, ExecResult)
    assert_answers(sb)
    r = sb.run("import os\nos.kill(-1, 9)")  # every process it may signal: only its own
    assert isinstance(r, ExecResult) and not r.ok
    assert_answers(sb)


def test_a_daemon_that_escapes_the_process_group_dies_with_the_call(sb):
    name = marker()
    r = sb.run(
        "import ctypes, os, time\n"
        "ready_r, ready_w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        ctypes.CDLL(None).prctl(15, b'{name}')\n"
        "        os.write(ready_w, b'x')\n"
        "        time.sleep(1000)\n"
        "    os._exit(0)\n"
        "os.read(ready_r, 1)\n"
        "print('daemon started')\n"
    )
    assert r.ok and r.stdout == "daemon started\n", r
    assert processes_named(name) == []
    assert_still_answers(sb)


# ---------------------------------------------------------------- ordinary failures, reported as python would


def test_deep_recursion_gives_recursion_error(local_sb):
    r = local_sb.run("def f(n):\n    return f(n + 1)\nf(0)")
    assert format_observation(r).startswith("RecursionError: maximum recursion depth exceeded")
    assert_still_answers(local_sb)


def test_recursion_that_overflows_the_c_stack_is_a_contained_crash(local_sb):
    # json's C encoder recurses on the C stack once the recursion limit is lifted: a segfault.
    r = local_sb.run(
        "import json, sys\nsys.setrecursionlimit(10**7)\nnested = []\n"
        "for _ in range(200000):\n    nested = [nested]\nprint('built')\njson.dumps(nested)"
    )
    assert not r.ok and r.returncode == -11 and r.stdout == "built\n"
    assert format_observation(r).startswith("Segmentation fault")
    assert_still_answers(local_sb)


def test_sys_exit_code_is_the_returncode(local_sb):
    r = local_sb.run("import sys\nprint('bye')\nsys.exit(3)")
    assert not r.ok and r.returncode == 3 and r.stdout == "bye\n"
    assert format_observation(r) == "Process exited with code 3"
    assert local_sb.run("import sys\nsys.exit(0)").ok
    assert_still_answers(local_sb)


def test_os_exit_keeps_output_printed_before_it(local_sb):
    r = local_sb.run("import os\nprint('kept', end='')\nos._exit(0)")
    assert r.ok and r.stdout == "kept"
    assert_still_answers(local_sb)


def test_reading_stdin_gets_end_of_file_not_a_hang(local_sb):
    r = local_sb.run("input()")
    assert not r.timed_out and format_observation(r) == "EOFError: EOF when reading a line"
    assert local_sb.run("import sys\nprint(repr(sys.stdin.read()))").stdout == "''\n"


def test_a_syntax_error_is_reported_by_its_last_line(local_sb):
    r = local_sb.run("x = (1,\nprint(x)")
    assert not r.ok and r.returncode == 1
    assert format_observation(r) == "SyntaxError: '(' was never closed"


def test_a_traceback_shows_the_codes_frames_and_source_not_the_sandboxs(local_sb):
    r = local_sb.run("def half(x):\n    return x / 0\n\nhalf(4)")
    assert not r.ok
    assert 'File "<string>", line 2, in half' in r.stderr
    assert "return x / 0" in r.stderr  # the source line, as from a file
    assert "sandbox.py" not in r.stderr
    assert format_observation(r) == "ZeroDivisionError: division by zero"
    assert format_observation(r, "full").endswith("ZeroDivisionError: division by zero\n")


def test_unicode_output_comes_back_exactly(local_sb):
    text = "∑ π ≈ 3.14159 — 日本語 😀"
    r = local_sb.run(f"print({text!r})")
    assert r.ok and r.stdout == text + "\n"


def test_code_that_prints_nothing_is_a_success_with_empty_output(local_sb):
    r = local_sb.run("x = 2 + 2")
    assert r.ok and r.stdout == "" and r.returncode == 0
    assert format_observation(r) == ""


def test_nothing_defined_by_one_call_is_visible_to_the_next(sb):
    first = sb.run("import math\nmath.pi = 3\nsecret = 42\nopen('note.txt', 'w').write('x')")
    assert first.ok
    r = sb.run("import math, os\nprint(math.pi, 'secret' in globals(), os.path.exists('note.txt'))")
    assert r.stdout == "3.141592653589793 False False\n"


def test_concurrent_calls_mixing_good_and_hostile_code_keep_their_own_results(backend):
    """Every hostile kind beside good calls, all at once: 32 calls in process. With Docker, a single-use container a
    call, the four kinds that load the machine beside two good calls (each kind also has its own test there)."""
    hostile = [  # (code, how it must end)
        ("while True: pass", "timeout"),
        ("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", "timeout"),
        ("x = bytearray(8 * 1024**3)", "MemoryError"),
        ("while True: print('flood' * 20000)", "OutputLimitError"),  # 100 KB a line: the limit comes fast even on a busy machine
        ("import os\nos.kill(os.getppid(), 9)", "any"),  # denied, or ignored by an init: either is contained
        ("import sys\nsys.exit(5)", "Process exited with code 5"),
        ("import time\ntime.sleep(60)", "timeout"),
        ("raise ValueError('boom')", "ValueError: boom"),
    ]
    calls = 32 if backend == "local" else 6
    hostile = hostile if backend == "local" else hostile[:4]
    spread = {round((k + 1) * calls / len(hostile)) - 1: kind for k, kind in enumerate(hostile)}  # among the good
    codes, expected, endings = [], {}, {}
    for i in range(calls):
        if i in spread:
            codes.append(spread[i][0])
            endings[i] = spread[i][1]
        else:
            codes.append(f"print({i} * {i}, 'ok')")
            expected[i] = f"{i * i} ok\n"
    with Sandbox(make_config(backend, concurrency=calls, docker_warm=0, preload=())) as sb:  # all at once, none kept warm
        results = sb.run_many(codes, timeout=2.0)  # ends the runaway ones; ample for the others
        assert_answers(sb)
    assert len(results) == calls and len(endings) == len(hostile)
    for i, text in expected.items():
        assert results[i].ok and results[i].stdout == text, (i, results[i])
    for i, ending in endings.items():
        if ending == "timeout":
            assert results[i].timed_out, (i, results[i])
        elif ending != "any":
            assert format_observation(results[i]).startswith(ending), (i, results[i])


def test_calls_from_many_threads_each_get_their_own_result(sb):
    results = {}

    def call(i):
        results[i] = sb.run(f"print('thread', {i})")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]  # twice the calls the sandbox runs at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: r.stdout for i, r in results.items()} == {i: f"thread {i}\n" for i in range(8)}


# ---------------------------------------------------------------- local backend specifics


def test_the_local_backend_uses_namespaces_when_root():
    needs_root()
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
        assert sb.isolation == "namespaces"
        r = sb.run("import os\nprint(os.getpid(), os.getuid() != 0, sorted(os.listdir('/proc'))[:0])")
        pid, unprivileged, _ = r.stdout.split(" ", 2)
        assert int(pid) <= 3 and unprivileged == "True"  # its own PID namespace, not root


def test_the_warm_interpreter_already_has_sympy_and_random_state_is_fresh_per_call(sandbox):
    needs_root()
    r = sandbox.run("import sys\nprint('sympy' in sys.modules, 'numpy' in sys.modules)")  # a run's defaults
    assert r.stdout == "True True\n"
    draws = [sandbox.run("import random, numpy\nprint(random.random(), numpy.random.rand())").stdout for _ in range(3)]
    assert len(set(draws)) == 3  # a fork would otherwise repeat the server's generator state


def readable_python() -> str:
    """An interpreter an unprivileged uid can run from the real file system (plain isolation as root needs one)."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(candidate)
        if not os.path.exists(real):
            continue
        base = subprocess.run([real, "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True).stdout.strip()
        folders = [os.path.dirname(real), base]
        if all(_every_user_may_enter(folder) for folder in folders):
            return candidate
    pytest.skip("no Python on this machine that an unprivileged user can read (plain isolation drops root)")


def _every_user_may_enter(folder: str) -> bool:
    while folder not in ("/", ""):
        if not os.stat(folder).st_mode & 0o001:
            return False
        folder = os.path.dirname(folder)
    return True


def test_plain_isolation_still_kills_an_escaped_daemon_and_stops_runaway_code():
    """The explicit weaker choice: no PID namespace, a child subreaper; never root."""
    name = marker()
    work_dirs_before = set(glob.glob("/tmp/sandbox-work-*"))
    with Sandbox(make_config("local", isolation="plain", concurrency=1, preload=(), python=readable_python())) as sb:
        assert sb.isolation == "plain"
        r = sb.run("import os\nprint(os.getuid() != 0, os.geteuid() != 0)")
        assert r.stdout == "True True\n"  # even when the caller is root
        r = sb.run(
            "import ctypes, os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            f"        ctypes.CDLL(None).prctl(15, b'{name}')\n"
            "        time.sleep(1000)\n"
            "    os._exit(0)\n"
            "time.sleep(0.3)\n"
            "print('done')\n"
        )
        assert r.ok and r.stdout == "done\n"
        assert processes_named(name) == []
        assert sb.run("while True: pass", timeout=RUNAWAY).timed_out
        assert_still_answers(sb)
    # The idle slot removes its prepared work dir once it sees the server gone.
    assert eventually(lambda: set(glob.glob("/tmp/sandbox-work-*")) <= work_dirs_before)


def test_a_slot_that_served_a_call_starts_the_next_one_clean(monkeypatch):
    """One slot (concurrency 1) serves consecutive calls and retires every 3: nothing carries over."""
    import local_backend

    needs_root()
    monkeypatch.setattr(local_backend, "SLOT_CALLS", 3)
    dirty = (
        "import ctypes, os\n"
        "open('/tmp/left.txt', 'w').write('x')\n"
        "open('/dev/shm/left.bin', 'w').write('x')\n"
        "open('work-file', 'w').write('x')\n"
        "print(ctypes.CDLL(None).shmget(0x5A5A5A, 4096, 0o1000 | 0o600) >= 0)\n"
    )
    check = (
        "import ctypes, os\n"
        # /tmp may also hold the mount point of the interpreter's folder, when a venv lives under /tmp
        "print('left.txt' in os.listdir('/tmp'), os.listdir('/dev/shm'), os.listdir('.'),\n"
        "      ctypes.CDLL(None).shmget(0x5A5A5A, 0, 0) >= 0)\n"
    )
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
        for _ in range(4):  # crosses a retirement: old slot, new slot
            assert sb.run(dirty).stdout == "True\n"
            assert sb.run(check).stdout == "False [] [] False\n"


def test_closing_the_sandbox_stops_its_fork_server():
    needs_root()
    sb = Sandbox(make_config("local", concurrency=1, preload=()))
    assert_still_answers(sb)
    server = sb._backend._server._proc
    sb.close()
    assert server.poll() is not None


def test_a_malformed_request_is_answered_with_the_reason_and_the_slot_serves_on():
    """The code's process reads the request itself; when that fails, the answer carries why on its stderr."""
    import runner

    needs_root()
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
        assert_still_answers(sb)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(TIMEOUT + runner.ANSWER_GRACE)
            conn.connect(sb._backend._server.socket_path)
            conn.sendall(struct.pack(">I", 8) + b"not json")
            answer = runner.read_answer(lambda size: runner.read_exactly(conn.recv, size))
        assert answer["returncode"] == 1 and "JSONDecodeError" in answer["stderr"], answer
        assert_still_answers(sb)


# ---------------------------------------------------------------- the boundary: memory, kernel, files, residue, failing closed


def test_memory_held_in_memory_files_is_charged_to_the_call(backend):
    """memfds are outside RLIMIT_AS: only the call's memory cgroup (or the container's) stops them."""
    code = (
        "import os\n"
        "held, files = 0, []\n"
        "while held < 640:\n"
        "    fd = os.memfd_create('hold')\n"
        f"    for _ in range({MAX_FILE_MB - 1}):\n"
        "        os.write(fd, b'x' * 1024 * 1024)\n"
        f"    files.append(fd)\n"
        f"    held += {MAX_FILE_MB - 1}\n"
        "    print('held', held, flush=True)\n"
    )
    with Sandbox(make_config(backend, memory_mb=256, concurrency=1, preload=())) as sb:
        r = sb.run(code)
        assert not r.ok and not r.timed_out, r
        held = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("held")]
        limit = 256 if backend == "local" else 256 + 4 * MAX_FILE_MB + 64  # a container also holds its runner and tmpfs
        assert max(held, default=0) < limit + MAX_FILE_MB, held  # never past the limit by more than one file
        if backend == "local":
            assert format_observation(r) == "MemoryError: the call used more than its 256 MB and was killed"
        assert_still_answers(sb)


SECCOMP_DENIED = ["keyctl", "add_key", "request_key", "ptrace", "mount", "umount2", "pivot_root", "unshare", "setns",
                  "bpf", "perf_event_open", "userfaultfd", "kexec_load", "init_module"]


def test_the_seccomp_filter_denies_what_math_code_never_needs():
    """Called with zero arguments, most of these fail with EFAULT or EINVAL, or succeed
    (unshare(0), ptrace(PTRACE_TRACEME)), without the filter; with it, each is EPERM."""
    needs_root()
    numbers = {name: confinement.SYSCALLS[name] for name in SECCOMP_DENIED}
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
        r = sb.run(
            "import ctypes\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"for name, number in {numbers!r}.items():\n"
            "    ctypes.set_errno(0)\n"
            "    print(name, libc.syscall(number, 0, 0, 0, 0, 0), ctypes.get_errno())\n"
            "print('Seccomp', open('/proc/self/status').read().split('Seccomp:')[1].split()[0])\n"
        )
        assert r.ok, r
        lines = r.stdout.splitlines()
        assert lines[-1] == "Seccomp 2"  # a filter is installed
        assert lines[:-1] == [f"{name} -1 1" for name in SECCOMP_DENIED]  # -1, errno EPERM
        assert_still_answers(sb)


def filter_answer(program: bytes, number: int, *args: int, arch: int | None = None) -> str:
    """What a seccomp program (the instructions seccomp_program writes) answers one call: 'allow', 'kill', or the
    errno's name ('0': answered 0 without running). The kernel's own reading of the same bytes, in Python."""
    arch = confinement._AUDIT_ARCH[platform.machine()] if arch is None else arch
    data = struct.pack("<iIQ6Q", number, arch, 0, *args, *[0] * (6 - len(args)))
    instructions = [struct.unpack_from("HBBI", program, at) for at in range(0, len(program), 8)]
    at = accumulator = 0
    while True:
        code, if_true, if_false, constant = instructions[at]
        if code == 0x06:  # return
            if constant in (0x7FFF0000, 0x80000000):
                return "allow" if constant == 0x7FFF0000 else "kill"
            assert constant & 0xFFFF0000 == 0x00050000, hex(constant)
            return errno.errorcode.get(constant & 0xFFFF, "0")
        if code == 0x20:  # load a word of the call's data
            accumulator, at = struct.unpack_from("<I", data, constant)[0], at + 1
            continue
        holds = {0x15: accumulator == constant, 0x35: accumulator >= constant, 0x45: bool(accumulator & constant)}[code]
        at += 1 + (if_true if holds else if_false)


BY_ARGUMENT = ("fcntl", "ioctl", "prctl", "madvise", "fadvise64", "socket", "socketpair", "preadv2", "pwritev2", "clone",
               "clone3", *confinement.SIGNAL_SENDERS, *confinement.SELF_ONLY)


@pytest.mark.skipif(platform.machine() not in confinement._TABLES, reason="no system-call table for this machine")
def test_the_filter_allows_its_list_fails_every_other_call_and_answers_newer_calls_enosys():
    """Every number the kernel may be called with, through the program itself: the listed calls run, the calls
    judged by an argument get their table's answer, every other call of the kernel the list was made against fails
    with EPERM, and every call added since with ENOSYS, as a kernel without it answers."""
    c, table = confinement, confinement.SYSCALLS
    with_cgroup, without = c.seccomp_program(), c.seccomp_program(cgroup=False)
    named = {table[name]: name for name in c.ALLOWED + c.CGROUP_ONLY + c.NO_EFFECT + c.NO_XATTRS + BY_ARGUMENT if name in table}
    for number in range(c.NEWEST + 1):
        name = named.get(number)
        expected = ("allow" if name in c.ALLOWED else "0" if name in c.NO_EFFECT else "ENOTSUP" if name in c.NO_XATTRS
                    else "EPERM")
        if name in BY_ARGUMENT:
            continue
        assert filter_answer(with_cgroup, number) == ("allow" if name in c.CGROUP_ONLY else expected), (number, name)
        assert filter_answer(without, number) == expected, (number, name)
    for number in (c.NEWEST + 1, c.NEWEST + 100, 0x3FFFFFFF):
        assert filter_answer(with_cgroup, number) == "ENOSYS"
    assert filter_answer(with_cgroup, table["getpid"], arch=0x40000003) == "kill"  # the 32-bit ABI
    fcntl, locks = c.FCNTL_ALLOWED, c.FCNTL_LOCKS
    judged = [("fcntl", (0, fcntl["F_GETFL"]), "allow"), ("fcntl", (0, locks["F_SETLK"]), "0"),
              ("fcntl", (0, locks["F_OFD_GETLK"]), "0"), ("fcntl", (0, 1031), "EPERM"),  # F_SETPIPE_SZ
              ("fcntl", (0, 1024), "EPERM"), ("fcntl", (0, 10), "EPERM"),  # F_SETLEASE, F_SETSIG
              ("ioctl", (1, c.IOCTL_ALLOWED["TCGETS"]), "allow"), ("ioctl", (1, c.IOCTL_ALLOWED["FIOCLEX"]), "allow"),
              ("ioctl", (1, 0x5412), "ENOTTY"), ("ioctl", (3, 0xB701), "ENOTTY"),  # TIOCSTI, NS_GET_USERNS
              ("prctl", (c.PRCTL_ALLOWED["PR_SET_NAME"],), "allow"), ("prctl", (78, 1, 1 << 20), "EINVAL"),  # PR_FUTEX_HASH
              ("prctl", (0x53564D41,), "EINVAL"), ("prctl", (22, 2), "EINVAL"),  # PR_SET_VMA, PR_SET_SECCOMP
              ("madvise", (0, 4096, c.MADVISE_ALLOWED["MADV_DONTNEED"]), "allow"), ("madvise", (0, 4096, 21), "EINVAL"),
              ("madvise", (0, 4096, 12), "EINVAL"),  # MADV_PAGEOUT, MADV_MERGEABLE
              ("fadvise64", (0, 0, 0, c.FADVISE_ALLOWED["POSIX_FADV_WILLNEED"]), "allow"),
              ("fadvise64", (0, 0, 0, 4), "0"),  # POSIX_FADV_DONTNEED: answered, ignored
              ("socket", (2, 1, 0), "ENETUNREACH"), ("socket", (1, 1, 0), "EAFNOSUPPORT"), ("socketpair", (1, 1, 0), "EAFNOSUPPORT"),
              ("preadv2", (0, 0, 1, 0, 0, 0), "allow"), ("preadv2", (0, 0, 1, 0, 0, c.RWF_NOWAIT), "ENOTSUP"),
              ("clone", (17,), "allow"), ("clone", (c.CLONE_NEWUSER | 17,), "EPERM"), ("clone", (34,), "EPERM"),
              ("clone3", (), "ENOSYS"), ("kill", (5, 9), "allow"), ("kill", (5, 34), "EPERM"),
              ("prlimit64", (0, 7), "allow"), ("prlimit64", (1, 7), "EPERM"), ("setpriority", (0, 0, 5), "allow"),
              ("setpriority", (2, 0, 5), "EPERM")]
    for name, args, expected in judged:
        assert filter_answer(with_cgroup, table[name], *args) == expected, (name, args)


@pytest.mark.e2e
def test_every_legitimate_workload_runs_under_the_filter_at_the_defaults(sandbox):
    """What the allow list was made from, at the default limits: sympy and numpy, fractions, subprocess (Python and
    the shell), multiprocessing's Pool and Queue, 16 threads doing numpy work, files in the scratch dir (fsync,
    shutil.copy2), sqlite3 in memory and on a file, selectors, numpy's files."""
    needs_root()
    assert sandbox.config == SandboxConfig()
    r = sandbox.run(WORKLOADS + "import numpy, sympy\n"
                    "print(sympy.factorint(2**32 + 1), sympy.integrate(sympy.Symbol('x') ** 2))\n"
                    "print(subprocess.run([sys.executable, '-c', 'import sympy; print(sympy.prime(100))'],"
                    " capture_output=True, text=True).stdout.strip())\n"
                    "with concurrent.futures.ThreadPoolExecutor(16) as pool:\n"
                    "    print(sum(pool.map(lambda n: int(numpy.ones((n, n)).dot(numpy.ones(n)).sum()), range(64))))\n"
                    "numpy.save('a.npy', numpy.arange(4))\nprint(numpy.load('a.npy').sum())\n")
    assert r.ok, r
    assert r.stdout.splitlines() == WORKLOADS_SEEN + ["{641: 1, 6700417: 1} x**3/3", "541", "85344", "6"]


# The standard library's part of the legitimate workloads (unprivileged, the interpreter may be Debian's, without numpy)
WORKLOADS = ("import concurrent.futures, fractions, multiprocessing, os, selectors, shutil, sqlite3, subprocess, sys, threading\n"
             "def square(x):\n    return x * x\n"
             "print(fractions.Fraction(3, 4) + fractions.Fraction(1, 6))\n"
             "print(subprocess.run('echo shell', shell=True, capture_output=True, text=True).stdout.strip())\n"
             "with multiprocessing.Pool(2) as pool:\n    print(sum(pool.map(square, range(10))))\n"
             "queue = multiprocessing.Queue()\n"
             "child = multiprocessing.Process(target=queue.put, args=('queue',))\n"
             "child.start(); print(queue.get()); child.join()\n"
             "with concurrent.futures.ThreadPoolExecutor(8) as pool:\n    print(sum(pool.map(square, range(10))))\n"
             "barrier = threading.Barrier(16)\n"
             "threads = [threading.Thread(target=barrier.wait) for _ in range(16)]\n"
             "[t.start() for t in threads]; [t.join() for t in threads]; print('16 threads')\n"
             "with open('data.txt', 'w') as f:\n    f.write('x' * 1000); f.flush(); os.fsync(f.fileno())\n"
             "shutil.copy2('data.txt', 'copy.txt'); print(os.path.getsize('copy.txt'))\n"
             "for name in (':memory:', 'scratch.db'):\n"
             "    db = sqlite3.connect(name)\n"
             "    db.execute('create table t (x)'); db.executemany('insert into t values (?)', [(i,) for i in range(10)])\n"
             "    db.commit(); print(db.execute('select sum(x) from t').fetchone()[0]); db.close()\n"
             "with selectors.DefaultSelector() as selector:\n    print('selector')\n")
WORKLOADS_SEEN = ["11/12", "shell", "285", "queue", "285", "16 threads", "1000", "45", "45", "selector"]


def test_the_code_cannot_create_a_user_namespace_or_mount_a_tmpfs():
    """A user namespace would give the code mounts of its own (a tmpfs is memory outside any cap)."""
    needs_root()
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
        r = sb.run(
            "import ctypes, os, threading\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.unshare({confinement.CLONE_NEWUSER | confinement.CLONE_NEWNS}), ctypes.get_errno())\n"
            f"print(libc.syscall({confinement.SYSCALLS['clone']}, {confinement.CLONE_NEWUSER} | 17, 0, 0, 0, 0), ctypes.get_errno())\n"
            "print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
            "pid = os.fork()\n"  # plain forks and threads still work
            "if pid == 0:\n"
            "    os._exit(7)\n"
            "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
            "t = threading.Thread(target=print, args=('thread',))\n"
            "t.start(); t.join()\n"
        )
        assert r.ok, r
        assert r.stdout == "-1 1\n-1 1\n-1 1\n7\nthread\n"
        assert_still_answers(sb)


def test_a_kernel_key_cannot_be_left_for_another_call():
    """Keys are not namespaced: one call's key, readable by others, would outlive it."""
    needs_root()
    description = marker()
    with Sandbox(make_config("local", concurrency=1, preload=())) as writer:
        r = writer.run(
            "import ctypes\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"key = libc.syscall({confinement.SYSCALLS['add_key']}, b'user', b'{description}', b'answer', 6, -4)\n"
            "print(key, ctypes.get_errno())\n"  # -4: the user keyring
        )
        assert r.ok and r.stdout == "-1 1\n", r
    with Sandbox(make_config("local", concurrency=1, preload=())) as reader:  # another uid, another sandbox
        r = reader.run("print(open('/proc/keys').read())")
        assert description not in r.stdout
    with open("/proc/keys") as f:
        assert description not in f.read()


def test_a_later_call_finds_nothing_of_an_earlier_call_in_its_memory():
    """The code and the output of a call never enter memory that a later call inherits.

    The scan looks for each marker as two halves that must be adjacent, so that the
    scanning code never holds the whole marker itself; a control string it builds
    at run time shows that the scan does find what is in memory.
    """
    needs_root()
    code_marker, output_marker = uuid.uuid4().hex, uuid.uuid4().hex
    # Tens of KB each, as real code and output are: small buffers are soon reused, these linger.
    earlier = f"secret = '{code_marker * 1000}'\nprint(''.join(reversed({output_marker[::-1]!r})) * 300)"
    halves = [(m[:16], m[16:]) for m in (code_marker, output_marker)]
    scan = SCAN.format(halves=halves)
    with Sandbox(make_config("local", concurrency=1, preload=("math",), max_output_bytes=64 * 1024)) as sb:  # one slot
        first = sb.run(earlier)
        assert first.ok and first.stdout == output_marker * 300 + "\n"
        for _ in range(3):
            r = sb.run(scan)
            assert r.ok, r
            assert r.stdout == "[False, False, True]\n"  # neither marker; the control is found


# A scan of the code's own memory for strings given as halves (head, tail) that must be adjacent, so that the scan
# never holds a whole string itself; a control string it builds at run time shows that it finds what is there.
SCAN = (
    "import ctypes, os, uuid\n"
    "ctypes.CDLL(None).prctl(4, 1)  # PR_SET_DUMPABLE: what a determined reader would do first\n"
    "control = uuid.uuid4().hex\n"
    "wanted = {halves!r} + [(control[:16], control[16:])]\n"
    "found = [False] * len(wanted)\n"
    "mem = os.open('/proc/self/mem', os.O_RDONLY)\n"
    "for line in open('/proc/self/maps').read().splitlines():\n"
    "    span, perms = line.split()[:2]\n"
    "    if perms[0] != 'r' or line.endswith(('[vvar]', '[vsyscall]', '[vvar_vclock]')):\n"
    "        continue\n"
    "    start, end = (int(x, 16) for x in span.split('-'))\n"
    "    try:\n"
    "        data = os.pread(mem, end - start, start)\n"
    "    except OSError:\n"
    "        continue\n"
    "    for i, (head, tail) in enumerate(wanted):\n"
    "        at = data.find(head.encode())\n"
    "        while at >= 0 and not found[i]:\n"
    "            found[i] = data.startswith(tail.encode(), at + len(head))\n"
    "            at = data.find(head.encode(), at + 1)\n"
    "print(found)\n"
)


def test_the_code_sees_only_an_allow_listed_file_system():
    needs_root()
    secret_dir = f"/sbx-{uuid.uuid4().hex[:12]}"  # anywhere on the machine, outside the lab
    os.mkdir(secret_dir, 0o755)
    try:
        with open(f"{secret_dir}/answers.txt", "w") as f:
            f.write("42")
        os.chmod(f"{secret_dir}/answers.txt", 0o644)  # readable by anyone: only the view protects it
        paths = [f"{secret_dir}/answers.txt", os.path.join(LAB_ROOT, "02-sandbox", "sandbox.py"), "/etc/shadow",
                 "/etc/hostname", "/sys/kernel", "/dev/fuse", "/dev/net/tun", "/home", "/opt", "/srv", "/mnt", "/boot",
                 "/proc/1/cmdline"]
        with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
            r = sb.run(
                "import json, os\n"
                f"print(json.dumps([p for p in {paths!r} if os.path.exists(p)]))\n"
                "print(json.dumps(sorted(os.listdir('/dev'))))\n"
                "print(json.dumps(sorted(os.listdir('/etc'))))\n"
                "print(json.dumps(sorted(os.listdir('/'))))\n"
                "print(json.dumps(sorted(os.listdir('/bin'))))\n"
                "open('/usr/lib/escaped', 'w')\n"
            )
    finally:
        os.remove(f"{secret_dir}/answers.txt")
        os.rmdir(secret_dir)
    visible, devices, etc, top, shell = (json.loads(line) for line in r.stdout.splitlines())
    assert visible == []
    assert devices == ["fd", "null", "shm", "stderr", "stdin", "stdout", "urandom", "zero"]
    assert set(etc) <= {"group", "hosts", "ld.so.cache", "passwd"}
    assert set(top) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "tmp", "usr", "var"} | {
        p.split("/")[1] for p in confinement.interpreter_paths()}  # the interpreter's own folders, wherever they are
    assert shell == ["sh"]  # the shell alone: a command it names is not found
    assert format_observation(r) == "OSError: [Errno 30] Read-only file system: '/usr/lib/escaped'"


def test_the_fork_servers_command_line_names_no_path():
    """Every process can read every command line (ps); the code could read PID 1's."""
    needs_root()
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
        assert_still_answers(sb)
        server = sb._backend._server
        with open(f"/proc/{server._proc.pid}/cmdline", "rb") as f:
            interpreter, *arguments = f.read().decode().split("\0")
        # The interpreter's own path is on the code's allow list anyway (it runs it), and
        # where the venv lives inside the lab that path names the lab: judge the arguments.
        assert os.path.basename(interpreter).startswith("python")
        for secret in (server.socket_path, server.folder, LAB_ROOT):
            assert secret not in "\0".join(arguments)
        assert server.socket_path not in interpreter and server.folder not in interpreter
        r = sb.run("print(open('/proc/1/cmdline').read())")  # PID 1 of the call is its slot, a fork of the server
        assert format_observation(r) == "FileNotFoundError: [Errno 2] No such file or directory: '/proc/1/cmdline'"


@pytest.mark.parametrize("cgroups, reason", [
    ("none", "neither cgroup v1 memory and pids nor cgroup v2 is mounted"),
    ("v2 without controllers", "without memory and pids"),  # the v1 hierarchies hold them on this machine
])
def test_isolation_that_cannot_be_set_up_is_an_error_never_a_fallback(cgroups, reason):
    """Without a usable memory cgroup (hidden here by a mount namespace) the sandbox refuses to run code."""
    needs_root()
    script = (
        "import confinement\n"
        "from sandbox import Sandbox, SandboxConfig, SandboxError\n"
        "confinement.unshare(confinement.CLONE_NEWNS)\n"
        "confinement.mount(None, '/', None, confinement.MS_REC | confinement.MS_PRIVATE)\n"
        "confinement.mount('tmpfs', '/sys/fs/cgroup', 'tmpfs', 0)\n"
        + ("confinement.mount('none', '/sys/fs/cgroup', 'cgroup2', 0)\n" if cgroups.startswith("v2") else "")
        + "try:\n"
        "    with Sandbox(SandboxConfig(concurrency=1, preload=())) as sb:\n"
        "        print('ran:', sb.run('print(1)').stdout)\n"
        "except SandboxError as e:\n"
        "    print('refused:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.stdout.startswith("refused: isolation='namespaces' cannot be set up here: "), done
    assert reason in done.stdout and "Nothing was run" in done.stdout, done.stdout


def test_weaker_isolation_is_never_chosen_for_you():
    with pytest.raises(ValueError, match="isolation must be 'namespaces' or 'plain'"):
        SandboxConfig(isolation="auto")
    assert SandboxConfig().isolation == "namespaces"


# ---------------------------------------------------------------- what a red team found, closed


def test_pid_numbers_carry_nothing_from_one_call_to_the_next():
    """A call that forks until the PID counter reaches a value cannot pass it on: every call starts at PID 2."""
    needs_root()
    sender = (
        "import os\n"
        "value = 77\n"  # a byte to send
        "while True:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "    if pid % 256 == value - 1:\n"  # the next process the slot makes would get PID ...77
        "        break\n"
        "print(pid)\n"
    )
    receiver = "import os\nprint(os.getpid(), os.readlink('/proc/self'))"
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:  # one slot: consecutive calls share it
        for _ in range(2):
            sent = sb.run(sender)
            assert sent.ok and int(sent.stdout) % 256 == 76, sent
            assert sb.run(receiver).stdout == "2 2\n"
        r = sb.run("import os\nos.write(os.open('/proc/sys/kernel/ns_last_pid', os.O_WRONLY), b'500')")  # nor can it set it
        assert format_observation(r).startswith("PermissionError"), r


def test_concurrent_calls_cannot_signal_through_locks_or_notifications_on_shared_files():
    """Every slot binds the same files (the interpreter's, /dev/null): a lock one call holds (flock, fcntl, open-file
    locks) or an access another call is told of (inotify, dnotify) would carry bits between concurrent calls. A lock
    is answered 0 and never reaches the kernel, so two calls both get the same exclusive locks at once (sqlite3 and
    lockf go on); notifications are EPERM."""
    needs_root()
    attempts = (
        "import ctypes, errno, fcntl, os, struct, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "shared = os.__file__\n"  # the interpreter's own file, the same inode in every slot
        "fd, null = os.open(shared, os.O_RDONLY), os.open(os.devnull, os.O_RDWR)\n"
        "lock = struct.pack('hhqqi', fcntl.F_WRLCK, 0, 0, 0, 0)\n"
        "tries = {\n"
        "    'flock': lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB),\n"
        "    'F_SETLK': lambda: fcntl.fcntl(null, fcntl.F_SETLK, lock),\n"
        "    'F_GETLK': lambda: fcntl.fcntl(fd, fcntl.F_GETLK, lock) == lock or 1 / 0,\n"  # untouched: no answer
        "    'F_OFD_SETLK': lambda: fcntl.fcntl(null, 37, lock),\n"
        "    'F_NOTIFY': lambda: fcntl.fcntl(os.open(os.path.dirname(shared), os.O_RDONLY), 1026, 1),\n"
        "    'inotify_init1': lambda: os.fdopen(libc.inotify_init1(0)) if libc.inotify_init1(0) >= 0 else "
        "(_ for _ in ()).throw(OSError(ctypes.get_errno(), '')),\n"
        "}\n"
        "for name, attempt in tries.items():\n"
        "    try:\n"
        "        attempt()\n"
        "        print(name, 'allowed')\n"
        "    except OSError as e:\n"
        "        print(name, errno.errorcode[e.errno])\n"
        "print('F_GETFL', fcntl.fcntl(fd, fcntl.F_GETFL) >= 0)\n"  # ordinary fcntl still works
        "time.sleep(1)\n"  # held while the other call tries
    )
    with Sandbox(make_config("local", concurrency=2, preload=())) as sb:
        results = sb.run_many([attempts, attempts])  # two slots at once
    for r in results:
        assert r.ok, r
        assert r.stdout.splitlines() == [f"{name} allowed" for name in ("flock", "F_SETLK", "F_GETLK", "F_OFD_SETLK")] + [
            "F_NOTIFY EPERM", "inotify_init1 EPERM", "F_GETFL True"]


@pytest.mark.parametrize("setting, value", [
    ("timeout", float("inf")), ("timeout", float("nan")), ("memory_mb", True), ("memory_mb", 0.5), ("memory_mb", 2**62),
    ("memory_mb", "1024"), ("max_processes", 1.5), ("max_file_mb", 0.25), ("concurrency", 0.5),
    ("max_output_bytes", 0), ("docker_cpus", float("inf")), ("preload", ("numpy sympy",)), ("preload", "numpy"),
])
def test_a_setting_of_the_wrong_type_or_range_is_refused_at_construction_naming_it(setting, value):
    with pytest.raises(ValueError, match=f"^{setting} must be "):
        SandboxConfig(**{setting: value})


def test_a_timeout_per_call_out_of_range_is_refused_naming_it():
    needs_root()
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
        for bad in (float("inf"), 0, True):
            with pytest.raises(ValueError, match="^timeout must be "):
                sb.run("print(1)", timeout=bad)
        assert_still_answers(sb)


def test_a_refused_sandbox_leaves_nothing_behind(tmp_path, monkeypatch):
    """A setting refused at construction, an interpreter that does not exist or exits at once: no server folder
    (made under tempfile's folder, here a private one) and no cgroup is left."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError, match="^concurrency must be"):
        Sandbox(make_config("local", concurrency=0.5))
    with pytest.raises(SandboxError, match="cannot start the fork server with /nonexistent"):
        Sandbox(make_config("local", python="/nonexistent"))
    with pytest.raises(SandboxError, match="fork server did not start|cannot start the fork server"):
        Sandbox(make_config("local", python="/bin/false")).run("print(1)")  # an interpreter that exits at once
    assert eventually(lambda: not any(tmp_path.iterdir())), list(tmp_path.iterdir())


def test_a_temporary_folder_deeper_than_a_unix_socket_path_still_works_and_is_left_clean(tmp_path, monkeypatch):
    """A run's private TMPDIR, nested under pytest's, can pass the 107 bytes of an AF_UNIX path."""
    needs_root()
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
        assert_still_answers(sb)
        server_pid = sb._backend._server._proc.pid
    groups = [f"{folder}/tool-rl-lab-sandbox-{server_pid}" for folder in confinement._find_cgroups()[1]]
    assert eventually(lambda: not any(deep.iterdir()) and not any(os.path.exists(group) for group in groups))


def one_local_call(code: str) -> ExecResult:
    """One call in a sandbox of its own (local backend, one slot, nothing preloaded)."""
    needs_root()
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
        return sb.run(code)


SOCKETS = ("import errno, socket\n"  # no socket of any family can be made
           "for name, family, kind in [('AF_UNIX', 1, 1), ('AF_UNIX', 1, 2), ('AF_INET', 2, 1), ('AF_INET', 2, 2),\n"
           "                           ('AF_INET6', 10, 2), ('AF_NETLINK', 16, 3), ('AF_PACKET', 17, 2), ('AF_ALG', 38, 5),\n"
           "                           ('AF_VSOCK', 40, 1)]:\n"
           "    try:\n"
           "        socket.socket(family, kind).close()\n"
           "        print(name, 'ok')\n"
           "    except OSError as e:\n"
           "        print(name, errno.errorcode[e.errno])\n"
           "try:\n"
           "    socket.socketpair()\n"
           "except OSError as e:\n"
           "    print('socketpair', errno.errorcode[e.errno])\n")
SOCKETS_SEEN = ["AF_UNIX EAFNOSUPPORT", "AF_UNIX EAFNOSUPPORT", "AF_INET ENETUNREACH", "AF_INET ENETUNREACH",
                "AF_INET6 ENETUNREACH", "AF_NETLINK EAFNOSUPPORT", "AF_PACKET EAFNOSUPPORT", "AF_ALG EAFNOSUPPORT",
                "AF_VSOCK EAFNOSUPPORT", "socketpair EAFNOSUPPORT"]


def test_no_socket_can_be_made_so_none_holds_kernel_memory_or_reads_a_counter():
    """AF_UNIX and AF_NETLINK queues hold kernel memory the call's cgroup never counts (700 MB under a 256 MB cap);
    so do an IP socket's options (40 processes of 250 sockets held 2.1 GB of TCP MD5 keys beside a 75 MB cgroup);
    a socket's cookie and sockstat's TCP "alloc" are counters of the machine, which one call moves and the next (or
    a concurrent one) reads; AF_VSOCK reaches the hypervisor whatever the network namespace. IP families fail as on
    a machine without a network."""
    r = one_local_call(SOCKETS)
    assert r.ok and r.stdout.splitlines() == SOCKETS_SEEN, r


# Kernel memory a call can queue outside its processes' pages: System V semaphores and messages are charged
# to the call's memory cgroup (killed at its cap); pipes stop at the uid's share of pipe pages; the rest is refused.
KERNEL_MEMORY = {
    "semaphores": ("import ctypes, time\n"  # each set of 32,000 semaphores is about 2 MB of the kernel's
                   "libc = ctypes.CDLL(None, use_errno=True)\n"
                   "for n in range(1, 601):\n"
                   "    if libc.semget(0, 32000, 0o1600) < 0:\n"
                   "        print('refused', ctypes.get_errno(), flush=True)\n"
                   "        break\n"
                   "    print('held', 2 * n, flush=True)\n"
                   "time.sleep(10)\n"),
    "messages": ("import ctypes, time\n"  # 2 x 8 KB messages in each of up to 32,000 queues: 500 MB
                 "libc = ctypes.CDLL(None, use_errno=True)\n"
                 "message = ctypes.create_string_buffer(8 + 8192)\n"
                 "message[0] = 1\n"
                 "for n in range(1, 32001):\n"
                 "    queue = libc.msgget(0, 0o1600)\n"
                 "    if queue < 0 or libc.msgsnd(queue, message, 8192, 0) or libc.msgsnd(queue, message, 8192, 0):\n"
                 "        print('refused', ctypes.get_errno(), flush=True)\n"
                 "        break\n"
                 "    print('held', n // 64, flush=True)\n"
                 "time.sleep(10)\n"),
}
PIPES = ("import os, time\n"  # 40 processes, each filling 120 pipes and keeping only their read ends
         "for _ in range(39):\n"
         "    if os.fork() == 0:\n"
         "        break\n"
         "held = 0\n"
         "for _ in range(120):\n"
         "    r, w = os.pipe()\n"
         "    os.set_blocking(w, False)\n"
         "    try:\n"
         "        while True:\n"
         "            held += os.write(w, b'x' * 4096)\n"
         "    except BlockingIOError:\n"
         "        os.close(w)\n"
         "os.write(1, b'held %d\\n' % (held >> 10))\n"  # one write a line: print's pieces from 40 processes interleave
         "time.sleep(2)\n")
REFUSED = ("import ctypes, errno, os\n"  # POSIX message queues (RLIMIT_MSGQUEUE 0), pages gifted to a pipe, io_uring
           "libc = ctypes.CDLL(None, use_errno=True)\n"
           "for name, call in [('mq_open', lambda: libc.mq_open(b'/q', os.O_CREAT | os.O_RDWR, 0o600, None)),\n"
           "                   ('vmsplice', lambda: libc.syscall({vmsplice}, 0, 0, 0, 0)),\n"  # numbers: confinement.SYSCALLS
           "                   ('io_uring_setup', lambda: libc.syscall({io_uring_setup}, 8, 0))]:\n"
           "    print(name, call(), errno.errorcode[ctypes.get_errno()])\n")


@pytest.mark.parametrize("attack", list(KERNEL_MEMORY))
def test_kernel_memory_of_system_v_ipc_is_charged_to_the_call_and_stops_at_its_cap(attack):
    needs_root()
    with Sandbox(make_config("local", memory_mb=256, concurrency=1, preload=())) as sb:
        r = sb.run(KERNEL_MEMORY[attack])
        held = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("held")]
        assert format_observation(r) == "MemoryError: the call used more than its 256 MB and was killed", r
        assert max(held) < 256, held
        assert_answers(sb)


def test_pipes_and_the_other_kernel_queues_hold_nothing_past_the_cap():
    """Pipes stop at the uid's soft share of pipe pages (then 2 pages a pipe), the rest is refused."""
    needs_root()
    with Sandbox(make_config("local", memory_mb=256, concurrency=1, preload=(), max_processes=64)) as sb:
        r = sb.run(PIPES)
        held = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("held")]
        assert held and sum(held) < 256 * 1024, r  # kB; the cgroup may also kill a process of the 40 at its cap
        r = sb.run(REFUSED.format(vmsplice=278, io_uring_setup=425) if platform.machine() == "x86_64"
                   else REFUSED.format(vmsplice=75, io_uring_setup=425))
        assert r.ok and r.stdout.splitlines() == ["mq_open -1 EPERM", "vmsplice -1 EPERM", "io_uring_setup -1 EPERM"], r


def test_a_containers_runner_adds_the_local_filter_to_dockers_profile(tmp_path):
    """Docker's profile allows AF_UNIX and AF_NETLINK, whose queues no container cgroup counts: runner.py, which
    travels alone into each container, installs the local filter on top. Run here as a container starts it."""
    needs_root()  # the code runs as the test's user: root, on this machine, with the filter only
    import io

    import runner
    from sandbox import _request

    code = ("import errno, socket\n"
            "for family, kind in [(1, 1), (16, 3), (2, 2)]:\n"
            "    try:\n"
            "        socket.socket(family, kind).close()\n"
            "        print(family, 'ok')\n"
            "    except OSError as e:\n"
            "        print(family, errno.errorcode[e.errno])\n")
    request = json.dumps(_request(code, make_config("local", preload=()))).encode()
    options = {"preload": [], "seccomp": confinement.seccomp_program().hex()}
    done = subprocess.run([sys.executable, "-I", "-c", open(runner.__file__).read(), "--container", json.dumps(options)],
                          input=struct.pack(">I", len(request)) + request, capture_output=True, timeout=60,
                          env={**runner.clean_env(), "TMPDIR": str(tmp_path)}, cwd=str(tmp_path))
    answer = runner.read_answer(io.BytesIO(done.stdout).read)
    assert answer["returncode"] == 0 and answer["stdout"] == "1 EAFNOSUPPORT\n16 EAFNOSUPPORT\n2 ENETUNREACH\n", (answer, done.stderr)


def test_the_callers_kernel_keys_are_not_visible_to_the_code():
    """The code inherits the caller's session keyring; /proc/keys would list its keys (names and sizes)."""
    needs_root()
    import ctypes

    description = marker()
    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(confinement.SYSCALLS["add_key"], b"user", description.encode(), b"x", 1, -3)  # the session keyring
    assert key > 0, os.strerror(ctypes.get_errno())
    try:
        r = one_local_call("print(repr(open('/proc/keys').read()), repr(open('/proc/key-users').read()))")
        assert r.ok and r.stdout == "'' ''\n", r
    finally:
        libc.syscall(confinement.SYSCALLS["keyctl"], 9, key, -3)  # KEYCTL_UNLINK


def test_the_code_can_start_the_interpreter_it_runs_in(local_sb):
    """sys.executable is a chain of links (a venv's python -> python3 -> the real file): each is in the root."""
    r = local_sb.run("import subprocess, sys\n"
                     "print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout, end='')")
    assert r.ok and r.stdout == "42\n", r


def test_a_missing_temporary_folder_is_a_one_line_sandbox_error(monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent-sbx/tmp")
    with pytest.raises(SandboxError) as refused:
        Sandbox(make_config("local", preload=()))
    message = str(refused.value)
    assert "\n" not in message and "/nonexistent-sbx/tmp" in message and "TMPDIR" in message, message


def test_the_code_sees_no_host_cgroup_path_and_may_use_every_core():
    """/proc/self/cgroup is the call's own view; CPU is shared, not capped, as docs/02 says."""
    r = one_local_call("import os\nprint(sorted({line.split(':', 2)[2].strip() for line in open('/proc/self/cgroup')}))\n"
                       "print(len(os.sched_getaffinity(0)))")
    assert r.ok and r.stdout == f"['/']\n{len(os.sched_getaffinity(0))}\n", r
    says("02-isolation.md", "a runaway call takes as many cores as it runs processes")


def test_the_code_cannot_change_its_slots_limits_priority_or_cpus_nor_pass_them_on():
    """As root the kernel refuses (the slot is another uid) and so does the filter; the next call of the slot is clean."""
    needs_root()
    with Sandbox(make_config("local", preload=(), concurrency=1)) as sandbox:
        r = sandbox.run(POISON)
        assert r.ok and r.stdout.splitlines() == POISONED, r
        r = sandbox.run(NEXT)  # the one slot's next call
        mb = 1024 * 1024
        nice = os.getpriority(os.PRIO_PROCESS, 0)  # the slot's own, inherited: 5 under `nice -n 5 make test`
        assert r.ok and r.stdout.splitlines() == [f"({MAX_FILE_MB * mb}, {MAX_FILE_MB * mb}) (256, 256) (64, 64) (0, 0) (0, 0) (0, 0)",
                                                  f"{nice} {sorted(os.sched_getaffinity(0))}", "written"], r


def test_a_full_scratch_under_a_memory_mapped_file_is_reported_as_such(local_sb):
    r = local_sb.run("import mmap, os\n"  # fill the scratch tmpfs, then touch the pages of a sparse mapped file
                     "for i in range(4):\n"
                     "    try:\n"
                     f"        open(f'/tmp/{{i}}', 'wb').write(b'x' * ({MAX_FILE_MB} << 20))\n"
                     "    except OSError:\n"
                     "        pass\n"
                     "fd = os.open('/var/tmp/mapped', os.O_RDWR | os.O_CREAT)\n"
                     f"os.ftruncate(fd, {MAX_FILE_MB} << 20)\n"
                     f"m = mmap.mmap(fd, {MAX_FILE_MB} << 20)\n"
                     "for i in range(0, len(m), 4096):\n"
                     "    m[i] = 1\n")
    assert r.returncode == -signal.SIGBUS and format_observation(r) == (
        f"Bus error: a memory-mapped file had no page to give (past its end, or all files hold {4 * MAX_FILE_MB} MB)"), r


# ---------------------------------------------------------------- kernel memory no cgroup counts, and the machine's counters

COUNTERS = ("import ctypes, errno, mmap, os\n"  # the page cache read without timing, and counters of the machine
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "x86 = os.uname().machine == 'x86_64'\n"
            "fd, page = os.open(os.__file__, os.O_RDONLY), bytearray(4096)\n"
            "anonymous = mmap.mmap(-1, 4096)\n"
            "address = ctypes.addressof(ctypes.c_char.from_buffer(anonymous))\n"
            "def attempt(name, call):\n"
            "    try:\n"
            "        if call() == -1:\n"
            "            raise OSError(ctypes.get_errno(), '')\n"
            "        print(name, 'ok')\n"
            "    except OSError as e:\n"
            "        print(name, errno.errorcode[e.errno])\n"
            "buffer = ctypes.c_char_p(bytes(8))\n"
            "attempt('preadv2 RWF_NOWAIT', lambda: os.preadv(fd, [page], 0, os.RWF_NOWAIT))\n"
            "attempt('preadv2', lambda: os.preadv(fd, [page], 0, os.RWF_HIPRI))\n"
            "attempt('mincore', lambda: libc.syscall(27 if x86 else 232, ctypes.c_void_p(address), 4096, buffer))\n"
            "attempt('cachestat', lambda: libc.syscall(451, fd, ctypes.c_char_p(bytes(16)), ctypes.c_char_p(bytes(64)), 0))\n"
            "attempt('io_setup', lambda: libc.syscall(206 if x86 else 0, 1, ctypes.byref(ctypes.c_ulong(0))))\n"
            "attempt('pidfd_open', lambda: os.close(os.pidfd_open(os.getpid())))\n"
            "pidfd = ctypes.c_int(-1)\n"
            "child = libc.syscall(56 if x86 else 220, 0x1000 | 17, 0, ctypes.byref(pidfd), 0, 0)\n"  # CLONE_PIDFD | SIGCHLD
            "if child == 0:\n"
            "    os._exit(0)\n"
            "print('clone CLONE_PIDFD', 'ok' if child > 0 else errno.errorcode[ctypes.get_errno()])\n"
            "print(*[line.strip() for line in open('/proc/stat') if line.startswith(('processes', 'ctxt'))])\n"
            "print(*[line.strip() for line in open('/proc/vmstat') if line.startswith(('pgfault', 'pgmajfault '))])\n"
            # calls and options the kernel gained after the deny list was written: the allow list never named them
            "attempt('landlock', lambda: libc.syscall(444, None, 0, 1))\n"  # LANDLOCK_CREATE_RULESET_VERSION
            "attempt('setxattrat', lambda: libc.syscall(463, -100, b'.', 0, b'user.x', None, 0))\n"
            f"attempt('a call newer than the list', lambda: libc.syscall({confinement.NEWEST + 1}, 0, 0, 0))\n"
            "attempt('PR_FUTEX_HASH', lambda: libc.prctl(78, 1, 1 << 16, 0, 0))\n"  # PR_FUTEX_HASH_SET_SLOTS
            "for name in ('dentry-state', 'inode-nr', 'inode-state'):\n"  # moved by every lookup, file and inode
            "    print(name, *open(f'/proc/sys/fs/{name}').read().split())\n"
            "for name in ('diskstats', 'softirqs', 'interrupts', 'zoneinfo'):\n"  # block I/O, interrupts, pages
            "    print(name, sum(int(word) for word in open(f'/proc/{name}').read().split() if word.isdigit()))\n")
# RWF_NOWAIT answers EAGAIN for a page the cache lacks, mincore and cachestat say which pages it holds: one call reads
# pages, the next finds them, 96 of 96 bits. /proc/stat's "processes" (forks since boot), the inode number of a pidfd
# (pidfs counts every PID the machine allocates) and aio-nr are counters of the machine one call moves and the next reads;
# so are the dentry and inode caches (exactly: 96 of 96 bits), block I/O and interrupts. Landlock's rulesets and
# PR_FUTEX_HASH's table are kernel memory no cgroup charges unprivileged.
COUNTERS_SEEN = ["preadv2 RWF_NOWAIT ENOTSUP", "preadv2 ok", "mincore EPERM", "cachestat EPERM", "io_setup EPERM",
                 "pidfd_open EPERM", "clone CLONE_PIDFD EPERM", "ctxt 0 processes 0", "pgfault 0 pgmajfault 0",
                 "landlock EPERM", "setxattrat EPERM", "a call newer than the list ENOSYS", "PR_FUTEX_HASH EINVAL",
                 "dentry-state 0 0 0 0 0 0", "inode-nr 0 0", "inode-state 0 0 0 0 0 0 0", "diskstats 0", "softirqs 0",
                 "interrupts 0", "zoneinfo 0"]


def test_the_page_cache_and_the_machines_counters_cannot_be_read_as_a_channel():
    r = one_local_call("import os\nfor _ in range(20):\n    os.fork() or os._exit(0)\n")  # a call that moves the counter
    r = one_local_call(COUNTERS)
    assert r.ok and r.stdout.splitlines() == COUNTERS_SEEN, r


# A process's mappings (VMAs) are kernel memory its pages do not show: mprotect every other page of an untouched
# mapping and each page is a VMA of its own (about 0.2 kB), up to vm.max_map_count; a fork copies them all.
MAPPINGS = ("import ctypes, os, time\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]\n"
            "libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n"
            "size = 200 << 20\n"
            "base = libc.mmap(None, size, 1, 0x22, -1, 0)\n"  # PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, never touched
            "for page in range(0, size >> 12, 2):\n"
            "    libc.mprotect(base + (page << 12), 4096, 3)\n"
            "print('split', flush=True)\n"
            "for _ in range({processes} - 1):\n"
            "    if os.fork() == 0:\n"
            "        break\n"
            "time.sleep(30)\n")
# epoll watches: each (file, descriptor number) pair is a watch of its own (about 0.13 kB), and a watch outlives the
# number it was made under while the file stays open; as many as the user's fs.epoll.max_user_watches (millions).
WATCHES = ("import os, select, time\n"
           "for _ in range(5):\n"  # 6 processes
           "    if os.fork() == 0:\n"
           "        break\n"
           "files = []\n"
           "for _ in range(60):\n"
           "    r, w = os.pipe()\n"
           "    os.close(w)\n"
           "    files.append(r)\n"
           "epolls, held = [select.epoll() for _ in range(60)], 0\n"
           "for file in files:\n"  # 60 files x 120 numbers x 60 epolls: 432,000 watches a process, about 55 MB
           "    for number in range(130, 250):\n"
           "        os.dup2(file, number)\n"
           "        for ep in epolls:\n"
           "            ep.register(number, select.EPOLLIN)\n"
           "        os.close(number)\n"
           "        held += len(epolls)\n"
           "print('held', held, flush=True)\n"
           "time.sleep(30)\n")


@pytest.mark.parametrize("attack, code", [("mappings", MAPPINGS.format(processes=60)), ("epoll watches", WATCHES)])
def test_kernel_memory_of_mappings_and_epoll_watches_is_charged_to_the_call_and_stops_at_its_cap(attack, code):
    needs_root()
    with Sandbox(make_config("local", memory_mb=256, concurrency=1, preload=(), timeout=60)) as sb:
        r = sb.run(code)
        assert not r.timed_out and format_observation(r) == "MemoryError: the call used more than its 256 MB and was killed", r
        assert_answers(sb)


def test_a_call_is_answered_at_its_deadline_however_long_its_processes_take_to_exit():
    """60 processes of 51,000 mappings each take seconds to exit once killed: the answer does not wait for all of it."""
    import runner

    needs_root()
    with Sandbox(make_config("local", memory_mb=4096, concurrency=1, preload=(), max_processes=64)) as sb:
        r = sb.run(MAPPINGS.format(processes=60), timeout=4)
        assert r.timed_out and r.stdout == "split\n", r
        assert r.latency < 4 + runner.REAP_GRACE + 2, f"answered {r.latency:.1f} s after a 4 s deadline"
        assert_answers(sb)


@pytest.mark.parametrize("then", ["exit", "hold"])
def test_a_memory_bomb_in_child_processes_fails_the_whole_call(then):
    """On cgroup v1 the kernel kills only the child it picks. A parent that waits for children which exit would exit
    0 (the call reported ok); one that waits for children which hold on would wait until the timeout. The children
    hold their memory until all four have it (or one was killed): on a busy machine they would otherwise run one
    after another, never past the cap together."""
    needs_root()
    with Sandbox(make_config("local", memory_mb=256, concurrency=1, preload=())) as sb:
        r = sb.run("import os, time\n"
                   "ready, told = os.pipe()\n"
                   "go, start = os.pipe()\n"
                   "for _ in range(4):\n"
                   "    if os.fork() == 0:\n"  # each child takes 100 MB, each alone under RLIMIT_AS, together past the cap
                   "        os.close(start)\n"
                   "        held = bytearray(100 << 20)\n"
                   "        held[::4096] = bytes(len(held[::4096]))\n"
                   "        os.write(told, b'x')\n"
                   "        os.read(go, 1)\n"  # until the parent has heard from all four
                   f"        {'os._exit(0)' if then == 'exit' else 'time.sleep(60)'}\n"
                   "os.close(told)\n"
                   "heard = b''\n"
                   "while len(heard) < 4 and (byte := os.read(ready, 1)):\n"
                   "    heard += byte\n"
                   "os.close(start)\n"
                   "try:\n"
                   "    while True:\n"
                   "        os.wait()\n"
                   "except ChildProcessError:\n"
                   "    print('parent done')\n")
        assert not r.ok and r.returncode == -9, r
        assert format_observation(r) == "MemoryError: the call used more than its 256 MB and was killed", r
        assert_answers(sb)


def test_an_oom_kill_seen_only_after_the_code_exited_0_still_fails_the_call():
    """The race the test above cannot pin: the kernel kills a child, the parent exits 0 before the slot's next look.
    A supervisor of its own (a fork: runner.collect kills every child of its process) with a limiter that reports the
    kill only afterwards."""
    import runner

    class KilledUnseen:
        TICK = None

        def over(self, memory_mb: int, until: float) -> bool:
            return False

        def oom_killed(self) -> bool:
            return True

    answer_end, our_end = socket.socketpair()
    supervisor = os.fork()
    if supervisor == 0:
        def supervise():
            files = runner.CallFiles()
            code = os.fork()
            if code == 0:
                os.close(files.limits_r)
                os.write(files.limits_w, runner._LIMITS.pack(10.0, 1024, 256))
                os._exit(0)
            runner.collect(code, files, answer_end.fileno(), KilledUnseen())
            return 0
        runner.exit_after(supervise)
    answer_end.close()
    answer = runner.read_answer(lambda size: runner.read_exactly(our_end.recv, size))
    os.waitpid(supervisor, 0)
    assert answer["oom_killed"] and answer["returncode"] == -signal.SIGKILL, answer


UNIX_SOCKETS = {  # what needs an AF_UNIX socket (refused by the filter), and the line the model reads instead
    "asyncio": "import asyncio\nasync def main():\n    print(1)\nasyncio.run(main())\n",
    "socketpair": "import socket\nsocket.socketpair()\n",
    "Pipe": "import multiprocessing\nmultiprocessing.Pipe()\n",
    "Manager": "import multiprocessing\nmultiprocessing.Manager().list()\n",
}


@pytest.mark.parametrize("name", list(UNIX_SOCKETS))
def test_code_that_needs_a_unix_socket_is_told_why_and_what_to_use(local_sb, name):
    """Python's own last line would be an errno number, an EOFError from Manager's server, or asyncio's warning about
    a coroutine never awaited: none says why."""
    r = local_sb.run(UNIX_SOCKETS[name])
    assert not r.ok and format_observation(r) == sandbox_module._NO_SOCKETS, r


def test_the_ways_to_run_work_in_parallel_that_need_no_unix_socket_work(local_sb):
    r = local_sb.run("import concurrent.futures, multiprocessing\n"
                     "queue = multiprocessing.Queue()\nqueue.put(3)\nprint(queue.get())\n"
                     "r, w = multiprocessing.Pipe(duplex=False)\nw.send(5)\nprint(r.recv())\n"
                     "with concurrent.futures.ProcessPoolExecutor(2) as pool:\n    print(list(pool.map(abs, [-1, -2])))\n"
                     "with multiprocessing.Pool(2) as pool:\n    print(pool.map(abs, [-3]))\n")
    assert r.ok and r.stdout == "3\n5\n[1, 2]\n[3]\n", r


def test_a_shell_command_runs_in_the_shell_and_a_missing_command_is_named(local_sb):
    r = local_sb.run("import subprocess\n"
                     "print(subprocess.run('echo $((6 * 7)); ls', shell=True, capture_output=True, text=True))\n")
    assert r.ok and r.stdout == ("CompletedProcess(args='echo $((6 * 7)); ls', returncode=127, stdout='42\\n', "
                                 "stderr='/bin/sh: 1: ls: not found\\n')\n"), r


# ---------------------------------------------------------------- not root: the same containment from a user namespace

UNPRIVILEGED = "nobody"  # the user the tests run the sandbox as, from a root test run
# Run as that user with a Python it can read (the standard library only, as Debian's /usr/bin/python3):
# one Sandbox(memory_mb=256), the probes in order, and after some of them what the user itself sees on
# the machine right after the call (its processes, its files), printed as one JSON line.
UNPRIVILEGED_DRIVER = r"""
import json, os, socket, sys
folder, probes = sys.argv[1], json.loads(sys.stdin.read())
sys.path.insert(0, folder)
from sandbox import Sandbox, SandboxConfig, format_observation

def processes_named(name):
    found = []
    for entry in os.listdir('/proc'):
        try:
            with open(f'/proc/{entry}/comm') as f:
                found += [int(entry)] if f.read().strip() == name else []
        except (OSError, ValueError):
            pass
    return found

out = {'results': {}, 'after': {}, 'control': {}}
control = probes.pop('control')
out['control']['secret'] = open(control['secret']).read()  # the user itself may read its file ...
socket.create_connection(('127.0.0.1', control['port']), timeout=5).close()  # ... and reach the listener
out['control']['listener'] = 'connected'
out['control']['environment'] = os.environ.get('HF_TOKEN')
with Sandbox(SandboxConfig(memory_mb=256, concurrency=1, timeout=20)) as sb:
    out['isolation'] = sb.isolation
    for name, (code, timeout, marker, paths) in probes.items():
        r = sb.run(code, timeout=timeout)
        out['results'][name] = dict(ok=r.ok, stdout=r.stdout, timed_out=r.timed_out, observation=format_observation(r))
        out['after'][name] = dict(processes=processes_named(marker) if marker else [],
                                  paths=[p for p in paths if os.path.lexists(p)])
print(json.dumps(out))
"""


def unprivileged_unavailable() -> str:
    """Why the sandbox cannot be run as an unprivileged user from here ('' when it can)."""
    if os.geteuid() != 0:
        return f"the unprivileged tests switch to {UNPRIVILEGED!r} (runuser), which needs a root test run"
    if not shutil.which("runuser"):
        return "runuser (util-linux) is not installed"
    try:
        pwd.getpwnam(UNPRIVILEGED)
    except KeyError:
        return f"no user {UNPRIVILEGED!r} on this machine"
    python = readable_python()
    done = subprocess.run(["runuser", "-u", UNPRIVILEGED, "--", python, "-I", "-c",
                           "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
                           "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))"],
                          capture_output=True, text=True, cwd="/", timeout=60)
    if not done.stdout.startswith("0 "):
        return f"the kernel refuses {UNPRIVILEGED!r} a user namespace ({(done.stdout or done.stderr).strip()})"
    return ""


def as_unprivileged(python: str, folder: str, script: str, stdin: str = "", env: dict | None = None, timeout: float = 300):
    """Run a Python script as UNPRIVILEGED with the sandbox's modules (copied into folder) on its path."""
    return subprocess.run([shutil.which("runuser"), "-u", UNPRIVILEGED, "--", python, "-I", "-c", script, folder], input=stdin,
                          capture_output=True, text=True, cwd="/", timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


@pytest.fixture(scope="module")
def unprivileged_folder():
    """A folder the unprivileged user may read, with a copy of the sandbox's modules, one of its own files
    (mode 0600) and one folder it may write; removed after."""
    reason = unprivileged_unavailable()
    if reason:
        pytest.skip(reason)
    import local_backend

    user = pwd.getpwnam(UNPRIVILEGED)
    folder = tempfile.mkdtemp(prefix="sbx-unprivileged-")
    os.chmod(folder, 0o755)
    for name in set(local_backend._SERVER_MODULES) | {"local_backend", "sandbox"}:
        shutil.copy(os.path.join(os.path.dirname(confinement.__file__), f"{name}.py"), folder)
        os.chmod(os.path.join(folder, f"{name}.py"), 0o644)
    own = os.path.join(folder, "own")  # the user's own things on the machine
    os.mkdir(own, 0o700)
    with open(os.path.join(own, "answers.txt"), "w") as f:
        f.write("42")
    for path in (own, os.path.join(own, "answers.txt")):
        os.chown(path, user.pw_uid, user.pw_gid)
    yield readable_python(), folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def unprivileged(unprivileged_folder):
    """The probes, run by the unprivileged user in one Sandbox; what the code saw, what the user saw after
    each call, and what this (root) process saw: the listener's connections, leftover files and processes."""
    python, folder = unprivileged_folder
    own, secret = os.path.join(folder, "own"), "hf_" + uuid.uuid4().hex
    daemon, bomb, host_process, watched, named = marker(), marker(), marker(), uuid.uuid4().hex, uuid.uuid4().hex[:15]
    listener = socket.create_server(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0{host_process}")  # an abstract Unix socket of the machine's network namespace
    abstract.listen()
    outside = [os.path.join(own, "escaped"), f"/tmp/{daemon}", f"/dev/shm/{daemon}", f"/var/tmp/{daemon}",
               os.path.join(folder, "escaped")]
    probe = {
        "control": {"secret": os.path.join(own, "answers.txt"), "port": listener.getsockname()[1]},
        "identity": ("import ctypes, errno, fcntl, os\n"
                     "status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())\n"
                     "print(os.getuid(), os.geteuid(), os.getgid(), *(status[k].strip() for k in ('CapEff', 'NoNewPrivs', 'Seccomp')))\n"
                     "libc = ctypes.CDLL(None, use_errno=True)\n"
                     "tries = {'setuid(0)': lambda: os.setuid(0), 'setgroups': lambda: os.setgroups([0]),\n"
                     "         'flock': lambda: fcntl.flock(os.open(os.__file__, os.O_RDONLY), fcntl.LOCK_SH),\n"
                     "         'ns_last_pid': lambda: os.write(os.open('/proc/sys/kernel/ns_last_pid', os.O_WRONLY), b'9'),\n"
                     "         'unshare(user)': lambda: libc.unshare(0x10000000) and (_ for _ in ()).throw(OSError(ctypes.get_errno(), ''))}\n"
                     "for name, attempt in tries.items():\n"
                     "    try:\n"
                     "        attempt()\n"
                     "        print(name, 'allowed')\n"
                     "    except OSError as e:\n"
                     "        print(name, errno.errorcode[e.errno])\n", None, None, []),
        "files": ("import os\n"
                  f"for path in {[os.path.join(own, 'answers.txt'), own, folder, LAB_ROOT, '/root', '/home', pwd.getpwnam(UNPRIVILEGED).pw_dir]!r}:\n"
                  "    try:\n"
                  "        print(open(path).read() if os.path.isfile(path) else os.listdir(path))\n"
                  "    except OSError as e:\n"
                  "        print(type(e).__name__)\n", None, None, []),
        "environment": ("import glob, os\nprint(dict(os.environ))\n"
                        "for path in glob.glob('/proc/*/environ'):\n"
                        "    try:\n"
                        "        print(open(path, 'rb').read())\n"
                        "    except OSError:\n"
                        "        pass\n", None, None, []),
        "network": ("import socket\n"
                    f"for family, address in [(socket.AF_INET, ('127.0.0.1', {listener.getsockname()[1]})),"
                    f" (socket.AF_UNIX, '\\0{host_process}'), (socket.AF_INET, ('1.1.1.1', 443))]:\n"
                    "    try:\n"
                    "        s = socket.socket(family)\n"
                    "        s.settimeout(2)\n"
                    "        s.connect(address)\n"
                    "        print('connected')\n"
                    "    except OSError as e:\n"
                    "        print(type(e).__name__, e.errno)\n", None, None, []),
        "processes": ("import os\n"
                      "seen = {}\n"
                      "for entry in os.listdir('/proc'):\n"
                      "    if entry.isdigit():\n"
                      "        seen[int(entry)] = open(f'/proc/{entry}/comm').read().strip()\n"
                      "print(os.getpid(), sorted(seen), sorted(set(seen.values())))\n"
                      "for signum in (2, 14, 17, 9):\n"  # its supervisor, the caller's uid too: SIGINT, SIGALRM, SIGCHLD, SIGKILL
                      "    os.kill(1, signum)\n"
                      "try:\n"
                      "    os.kill(-1, 0)\n"  # every process it may signal, but itself
                      "except OSError as e:\n"
                      "    print(type(e).__name__)\n", None, None, []),
        "write": ("import os\n"
                  f"for path in {outside!r}:\n"
                  "    try:\n"
                  "        open(path, 'w').write('escaped')\n"
                  "    except OSError:\n"
                  "        pass\n"
                  "open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())\n", None, None, outside),
        "leave": ("import ctypes, os, socket\n"
                  "for path in ('/tmp/left', '/var/tmp/left', '/dev/shm/left', 'left'):\n"
                  "    open(path, 'w').write('x')\n"
                  "print(ctypes.CDLL(None).semget(0x5A5A5A, 1, 0o1000 | 0o600) >= 0)\n"
                  "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\n"  # the PID counter moves on
                  "print('left')\n", None, None, []),
        "find": ("import ctypes, os, socket\n"
                 "print(os.getpid(), os.listdir('/tmp'), os.listdir('/var/tmp'), os.listdir('/dev/shm'), os.listdir('.'),\n"
                 "      ctypes.CDLL(None).semget(0x5A5A5A, 0, 0) >= 0)\n", None, None, []),
        "name_in_maps": ("import ctypes, mmap, os, time\n"  # names the code chose, in the maps and status the watch reads
                         "ctypes.CDLL(None).prctl(4, 1)\n"  # PR_SET_DUMPABLE: the slot may read its maps
                         "held = []\n"
                         f"for i in range(100):\n"
                         f"    with open('{watched}%03d' % i, 'wb') as f:\n"
                         "        f.write(b'x')\n"
                         f"    with open('{watched}%03d' % i, 'rb') as f:\n"
                         "        held.append(mmap.mmap(f.fileno(), 1, prot=mmap.PROT_READ))\n"
                         f"ctypes.CDLL(None).prctl(15, b'{named}')\n"
                         "time.sleep(0.5)\n"  # 50 looks of the watch
                         "print('mapped')\n", None, None, []),
        "find_name": (SCAN.format(halves=[(watched[:16], watched[16:]), (named[:8], named[8:])]), None, None, []),
        "workloads": (WORKLOADS, None, None, []),
        "heap": ("x = bytearray(512 * 1024**2)", None, None, []),
        "memfd": ("import os\nos.memfd_create('hold')", None, None, []),
        "shm": ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"  # System V memory, messages, semaphores
                "print(libc.shmget(0, 64 * 1024**2, 0o1000 | 0o600), errno.errorcode[ctypes.get_errno()])\n"
                "print(libc.msgget(0, 0o1600), errno.errorcode[ctypes.get_errno()])\n"
                "print(libc.semget(0, 32000, 0o1600), errno.errorcode[ctypes.get_errno()])", None, None, []),
        "sockets": (SOCKETS, None, None, []),
        "counters": (COUNTERS, None, None, []),
        "epoll": ("import select\nselect.epoll()\n", None, None, []),
        "keys": ("print(repr(open('/proc/keys').read()), repr(open('/proc/key-users').read()))", None, None, []),
        "processes_memory": ("import os, time\n"  # 4 processes of 100 MB: each under RLIMIT_AS, together over the cap
                             "for _ in range(3):\n"
                             "    if os.fork() == 0:\n"
                             "        break\n"
                             "held = bytearray(100 * 1024**2)\n"
                             "held[::4096] = b'x' * len(held[::4096])\n"
                             "print('holding', flush=True)\n"
                             "time.sleep(30)\n", None, None, []),
        "tmpfs": ("import os\nwritten = 0\n"
                  "try:\n"
                  "    for i in range(100):\n"
                  "        with open(f'/dev/shm/{i}', 'wb') as f:\n"
                  "            f.write(b'x' * 8 * 1024**2)\n"
                  "        written += 8\n"
                  "except OSError as e:\n"
                  "    print(written, type(e).__name__, e.errno)\n", None, None, []),
        "daemon": ("import ctypes, os, time\n"
                   "ready_r, ready_w = os.pipe()\n"
                   "if os.fork() == 0:\n"
                   "    os.setsid()\n"
                   "    if os.fork() == 0:\n"
                   f"        ctypes.CDLL(None).prctl(15, b'{daemon}')\n"
                   "        os.write(ready_w, b'x')\n"
                   "        time.sleep(1000)\n"
                   "    os._exit(0)\n"
                   "os.read(ready_r, 1)\nprint('daemon started')\n", None, daemon, []),
        "fork_bomb": ("import ctypes, os\n"
                      f"ctypes.CDLL(None).prctl(15, b'{bomb}')\n"
                      "while True:\n"
                      "    try:\n"
                      "        os.fork()\n"
                      "    except OSError:\n"
                      "        pass\n", SHORT, bomb, []),
        "loop": ("while True:\n    pass", SHORT, None, []),
        "after": ("print(6 * 7)", None, None, []),
    }
    probes = {name: value if name == "control" else list(value) for name, value in probe.items()}
    host = subprocess.Popen([python, "-c", f"import ctypes, time; ctypes.CDLL(None).prctl(15, b'{host_process}'); "
                             "time.sleep(600)"], user=UNPRIVILEGED)  # one of the user's processes on the machine
    try:
        done = as_unprivileged(unprivileged_folder[0], folder, UNPRIVILEGED_DRIVER, json.dumps(probes), {"HF_TOKEN": secret})
        listener.setblocking(False)
        accepted = []
        while True:
            try:
                accepted.append(listener.accept()[0].close())
            except BlockingIOError:
                break
    finally:
        host.kill()
        host.wait()
        listener.close()
        abstract.close()
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    out.update(secret=secret, accepted=len(accepted), outside=outside, folder=folder,
               leftovers=[p for p in outside if os.path.lexists(p)], survivors=processes_named(daemon) + processes_named(bomb))
    return out


def test_unprivileged_the_isolation_is_a_user_namespace_and_the_controls_work(unprivileged):
    assert unprivileged["isolation"] == "userns"
    assert unprivileged["control"] == {"secret": "42", "listener": "connected", "environment": unprivileged["secret"]}


def test_unprivileged_the_code_is_not_the_user_has_no_capability_and_cannot_become_root(unprivileged):
    r = unprivileged["results"]["identity"]
    assert r["ok"], r
    assert r["stdout"].splitlines() == ["65534 65534 65534 0000000000000000 1 2", "setuid(0) EPERM", "setgroups EPERM",
                                        "flock allowed", "ns_last_pid EPERM", "unshare(user) EPERM"]


def test_unprivileged_every_legitimate_workload_of_the_standard_library_runs(unprivileged):
    r = unprivileged["results"]["workloads"]  # at 256 MB, without a cgroup: epoll refused, selectors polls
    assert r["ok"] and r["stdout"].splitlines() == WORKLOADS_SEEN, r


def test_the_memory_watch_reads_proc_through_a_buffer_it_zeroes():
    """The watch's reads of this process's own files: the right counts, and nothing of the files left in the buffer,
    which a slot's later calls would inherit."""
    proc, me = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY), str(os.getpid())
    try:
        mappings = len(Path(f"/proc/{me}/maps").read_text().splitlines())
        assert abs(confinement._count_mappings(proc, me) - mappings) <= 8  # the interpreter maps a few more meanwhile
        fields = confinement._fields(proc, me, "status", "RssAnon")
        assert set(fields) == {"RssAnon", "RssShmem", "VmSwap", "VmPTE", "Threads", "FDSize", "PPid", "VmSize"}, fields
        assert fields["PPid"] == os.getppid() and fields["Threads"] >= 1
        assert set(confinement._fields(proc, me, "smaps_rollup", "Pss_Anon")) == {"Pss_Anon", "Pss_Shmem", "SwapPss"}
        assert not any(confinement._PROC_BUFFER)
    finally:
        os.close(proc)


def test_unprivileged_the_memory_watch_leaves_no_name_the_code_chose_for_a_later_call(unprivileged):
    """The slot's watch reads each process's maps and status, which hold names the code chose (the files it maps,
    its own name), into a buffer it zeroes after each read: none reaches the slot's heap, which the next call inherits."""
    assert unprivileged["results"]["name_in_maps"]["stdout"] == "mapped\n", unprivileged["results"]["name_in_maps"]
    r = unprivileged["results"]["find_name"]
    assert r["ok"] and r["stdout"] == "[False, False, True]\n", r  # neither the file names nor the name; the control


def test_unprivileged_the_code_cannot_read_the_users_files_or_environment(unprivileged):
    r = unprivileged["results"]["files"]
    assert r["ok"] and r["stdout"].split() == ["FileNotFoundError"] * 7, r
    r = unprivileged["results"]["environment"]
    assert r["ok"] and unprivileged["secret"] not in r["stdout"] and "HF_TOKEN" not in r["stdout"], r


def test_unprivileged_the_code_reaches_no_host_listener(unprivileged):
    r = unprivileged["results"]["network"]
    assert r["ok"] and r["stdout"].split("\n")[:3] == ["OSError 101", "OSError 97", "OSError 101"], r  # 97: no AF_UNIX
    assert unprivileged["accepted"] == 1  # the user's own control connection, nothing from the code


def test_unprivileged_the_code_sees_and_signals_only_its_own_processes(unprivileged):
    r = unprivileged["results"]["processes"]
    assert r["ok"], r
    own_pid, pids, names = r["stdout"].split(" ", 2)
    assert own_pid == "2" and pids == "[2]" and names.startswith("['python"), r  # not its supervisor, nor the machine's
    # Its signals to its supervisor (PID 1 of the call's namespace, with no handler) are dropped, and there is
    # no other process it may signal; the sandbox answers on.
    assert r["stdout"].splitlines()[1:] == ["ProcessLookupError"]
    assert unprivileged["results"]["after"]["ok"]


def test_unprivileged_nothing_is_written_outside_the_call_and_nothing_is_left_for_the_next(unprivileged):
    assert unprivileged["results"]["write"]["stdout"] == "fine\n"
    assert unprivileged["after"]["write"]["paths"] == [] and unprivileged["leftovers"] == []
    assert unprivileged["results"]["leave"]["stdout"] == "False\nleft\n"  # semget is denied (below)
    assert unprivileged["results"]["find"]["stdout"] == "2 ['work'] [] [] [] False\n"


def test_unprivileged_memory_past_the_cap_fails_on_the_heap_in_memfds_shm_processes_and_files(unprivileged):
    results = unprivileged["results"]
    assert results["heap"]["observation"] == "MemoryError"
    assert results["memfd"]["observation"] == "PermissionError: [Errno 1] Operation not permitted"
    assert results["shm"]["stdout"] == "-1 EPERM\n" * 3
    r = results["processes_memory"]  # four processes, each under RLIMIT_AS: the slot's watch stops the call
    assert not r["timed_out"] and r["observation"] == "MemoryError: the call used more than its 256 MB and was killed", r
    written, error, errno = results["tmpfs"]["stdout"].split()
    assert int(written) <= 4 * SandboxConfig.max_file_mb and (error, errno) == ("OSError", "28"), results["tmpfs"]


def test_unprivileged_no_socket_can_queue_kernel_memory_or_read_a_cookie_and_no_key_is_visible(unprivileged):
    r = unprivileged["results"]["sockets"]
    assert r["ok"] and r["stdout"].splitlines() == SOCKETS_SEEN, r
    r = unprivileged["results"]["keys"]
    assert r["ok"] and r["stdout"] == "'' ''\n", r


def test_unprivileged_no_epoll_watch_holds_kernel_memory_the_watch_cannot_count(unprivileged):
    r = unprivileged["results"]["epoll"]  # no cgroup counts epoll's watches here: the filter refuses epoll
    assert r["observation"] == "PermissionError: [Errno 1] Operation not permitted", r


def test_unprivileged_the_page_cache_and_the_machines_counters_cannot_be_read_as_a_channel(unprivileged):
    r = unprivileged["results"]["counters"]
    assert r["ok"] and r["stdout"].splitlines() == COUNTERS_SEEN, r


def test_unprivileged_no_process_outlives_its_call_and_runaway_code_stops_at_the_timeout(unprivileged):
    assert unprivileged["results"]["daemon"]["stdout"] == "daemon started\n"
    assert unprivileged["after"]["daemon"]["processes"] == []  # as the user sees the machine, right after the call
    assert unprivileged["results"]["fork_bomb"]["timed_out"] and unprivileged["after"]["fork_bomb"]["processes"] == []
    assert unprivileged["results"]["loop"]["timed_out"]
    assert unprivileged["results"]["loop"]["observation"] == f"TimeoutError: execution exceeded the {SHORT:g} s time limit"
    assert unprivileged["survivors"] == []
    assert unprivileged["results"]["after"]["stdout"] == "42\n"


def test_unprivileged_where_the_kernel_refuses_user_namespaces_the_sandbox_refuses_in_one_line(unprivileged_folder):
    """Simulated with a seccomp filter that denies unshare (load the call's number; if it is unshare, EPERM;
    else allow), as a container's profile would."""
    python, folder = unprivileged_folder
    own_tmp = os.path.join(folder, "own", "tmp")  # the user's TMPDIR, where a server folder would be left
    os.mkdir(own_tmp, 0o700)
    user = pwd.getpwnam(UNPRIVILEGED)
    os.chown(own_tmp, user.pw_uid, user.pw_gid)
    done = as_unprivileged(python, folder, (
        "import struct, sys\nsys.path.insert(0, sys.argv[1])\n"
        "import confinement\nfrom sandbox import Sandbox, SandboxConfig, SandboxError\n"
        "confinement.prctl(confinement.PR_SET_NO_NEW_PRIVS, 1)\n"
        "instructions = [(0x20, 0, 0, 0), (0x15, 0, 1, confinement.SYSCALLS['unshare']), (0x06, 0, 0, 0x50001), (0x06, 0, 0, 0x7FFF0000)]\n"
        "confinement.install_seccomp(b''.join(struct.pack('HBBI', *i) for i in instructions))\n"
        "try:\n"
        "    Sandbox(SandboxConfig(concurrency=1)).run('print(1)')\n"
        "except SandboxError as e:\n"
        "    print(e)\n"), env={"TMPDIR": own_tmp})
    message = done.stdout.strip()
    assert "\n" not in message and message.startswith("isolation='namespaces' cannot be set up here: "), done
    for named in ("user namespace", "Nothing was run", "as root", "backend='docker'", "isolation='plain'"):
        assert named in message, message
    assert os.listdir(own_tmp) == []


# ---------------------------------------------------------------- not root: what a red team tried on the user-namespace mode

# The code and its slot are one uid on the machine, and every call is that uid: each attack below is judged by
# what the code got and by what the user saw (its own niceness and signal count, a later call's limits).
ATTACK_DRIVER = r"""
import json, os, signal, sys, threading, time
folder, attacks = sys.argv[1], json.loads(sys.stdin.read())
sys.path.insert(0, folder)
from sandbox import Sandbox, SandboxConfig, format_observation

def queued():  # the user's pending signals, all its processes together (what RLIMIT_SIGPENDING counts)
    return int(dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())['SigQ'].split('/')[0])

out = {'nice': os.getpriority(os.PRIO_PROCESS, 0)}  # what the user's processes and the slots start with
with Sandbox(SandboxConfig(memory_mb=256, concurrency=1, timeout=20)) as sb:
    def run(code):
        r = sb.run(code)
        return dict(ok=r.ok, stdout=r.stdout, timed_out=r.timed_out, observation=format_observation(r))
    out['poison'] = run(attacks['poison'])
    out['user_nice'] = os.getpriority(os.PRIO_PROCESS, 0)  # PRIO_USER would reach every process of the user
    out['next'] = run(attacks['next'])
    out['affinity'] = sorted(os.sched_getaffinity(0))
    for name in attacks['memory']:
        out[name] = run(attacks[name])
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
    before, call = queued(), {}
    worker = threading.Thread(target=lambda: call.update(run(attacks['signals'])))
    worker.start()
    seen, steady = before, 0
    while worker.is_alive() and steady < 50:  # until the call's count stops growing (or the call ends)
        time.sleep(0.01)
        now = queued()
        steady, seen = (steady + 1, seen) if now == seen else (0, now)
    own, libc = 0, __import__('ctypes').CDLL(None)
    for _ in range(64):  # the user's own signals, while the call holds what it could queue
        if libc.sigqueue(os.getpid(), signal.SIGRTMIN, 0) != 0:
            break
        own += 1
    while signal.sigtimedwait([signal.SIGRTMIN], 0) is not None:
        pass
    worker.join()
    out['signals'] = dict(call, held=seen - before, own=own)
print(json.dumps(out))
"""
HOLD = ("import ctypes, mmap, os, sys, threading, time\n"  # 4 processes of {mb} MB each, {how}: together past 256 MB
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        break\n"
        "def hold():\n"
        "    {hold}\n"
        "    for i in range(0, len(m), 4096):\n"
        "        m[i] = 1\n"
        "    print('holding', flush=True)\n"
        "    time.sleep(30)\n")
HELD = "sum(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith(('RssAnon', 'RssShmem')))"  # kB
# 60 fresh interpreters, each holding about what the slot holds (1 MB less): a watch that subtracts the slot's
# footprint from every process counts them as nothing
EXEC_INTERPRETERS = ("import subprocess, sys, time\n"
                     f"target = {HELD} - 1024\n"  # the code's process is a fork of the slot: it holds what the slot holds
                     "child = ('import sys, time\\n'\n"
                     f"         {'m = bytearray(max(int(sys.argv[1]) - ' + HELD + ', 1024) << 10)'!r} + '\\n'\n"
                     "         'm[::4096] = bytes(len(m[::4096]))\\n'\n"
                     "         'time.sleep(30)\\n')\n"
                     "for _ in range(60):\n"
                     "    subprocess.Popen([sys.executable, '-c', child, str(target)])\n"
                     "print('holding', 60 * target >> 10, 'MB', flush=True)\n"
                     "time.sleep(30)\n")
MEMORY_ATTACKS = {
    "shared_anonymous": HOLD.format(mb=150, how="MAP_SHARED|MAP_ANONYMOUS", hold="m = mmap.mmap(-1, 150 << 20, mmap.MAP_SHARED)")
    + "hold()\n",
    "shared_dev_zero": HOLD.format(mb=150, how="MAP_SHARED of /dev/zero",
                                   hold="m = mmap.mmap(os.open('/dev/zero', os.O_RDWR), 150 << 20, mmap.MAP_SHARED)") + "hold()\n",
    "non_dumpable": HOLD.format(mb=100, how="each hidden from a hidepid /proc", hold="m = bytearray(100 << 20)")
    + "libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0\nhold()\n",
    "exec_interpreters": EXEC_INTERPRETERS,
    "mappings": MAPPINGS.format(processes=60),
    "leader_gone": HOLD.format(mb=100, how="held by a thread whose leader exited", hold="m = bytearray(100 << 20)")
    + "threading.Thread(target=lambda: (time.sleep(1), hold())).start()\n"
    "libc.syscall(60 if os.uname().machine == 'x86_64' else 93, 0)  # exit: this thread only, the leader\n",
}
POOL = ("import fractions, multiprocessing\n"  # four workers of tens of MB each: under the cap, never killed
        "def work(n):\n"
        "    return len([fractions.Fraction(i, n) for i in range(200000)])\n"
        "with multiprocessing.Pool(4) as pool:\n"
        "    print(pool.map(work, [1, 2, 3, 4]))\n")
POISON = ("import errno, os, resource\n"  # the slot is PID 1 of the call's PID namespace, and the caller's uid
          "attempts = {\n"
          "    'prlimit fsize': lambda: resource.prlimit(1, resource.RLIMIT_FSIZE, (0, 0)),\n"
          "    'prlimit nofile': lambda: resource.prlimit(1, resource.RLIMIT_NOFILE, (8, 8)),\n"
          "    'prlimit read': lambda: resource.prlimit(1, resource.RLIMIT_NOFILE),\n"
          "    'nice slot': lambda: os.setpriority(os.PRIO_PROCESS, 1, 19),\n"
          "    'nice user': lambda: os.setpriority(os.PRIO_USER, 0, 19),\n"
          "    'affinity slot': lambda: os.sched_setaffinity(1, {0}),\n"
          "    'pipe size': lambda: __import__('fcntl').fcntl(os.pipe()[0], 1031, 1 << 20),\n"
          "    'own limit': lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100)),\n"
          "    'own nice': lambda: os.nice(1),\n"
          "}\n"
          "for name, attempt in attempts.items():\n"
          "    try:\n"
          "        attempt()\n"
          "        print(name, 'allowed')\n"
          "    except OSError as e:\n"
          "        print(name, errno.errorcode[e.errno])\n")
POISONED = ["prlimit fsize EPERM", "prlimit nofile EPERM", "prlimit read EPERM", "nice slot EPERM", "nice user EPERM",
            "affinity slot EPERM", "pipe size EPERM", "own limit allowed", "own nice allowed"]
NEXT = ("import os, resource\n"
        "print(*(resource.getrlimit(getattr(resource, 'RLIMIT_' + k))\n"
        "        for k in ('FSIZE', 'NOFILE', 'SIGPENDING', 'CORE', 'MEMLOCK', 'MSGQUEUE')))\n"
        "print(os.getpriority(os.PRIO_PROCESS, 0), sorted(os.sched_getaffinity(0)))\n"
        "open('f', 'wb').write(b'x' * (1 << 20))\nprint('written')\n")
SIGNALS = ("import ctypes, errno, os, signal, time\n"  # queue real-time signals to itself until refused, then hold them
           "libc = ctypes.CDLL(None, use_errno=True)\n"
           "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])\n"
           "for name, send in (('kill', lambda: os.kill(os.getpid(), signal.SIGRTMIN)),\n"
           "                   ('sigqueue', lambda: libc.sigqueue(os.getpid(), signal.SIGRTMIN, 0) == 0 or 1 / 0),\n"
           "                   ('timer_create', lambda: libc.timer_create(1, None, ctypes.byref(ctypes.c_void_p())) == 0 or 1 / 0)):\n"
           "    n = 0\n"
           "    try:\n"
           "        while n < 200000:\n"
           "            send()\n"
           "            n += 1\n"
           "    except (OSError, ZeroDivisionError) as e:\n"
           "        print(name, n, errno.errorcode[getattr(e, 'errno', None) or ctypes.get_errno()], flush=True)\n"
           "time.sleep(3)\n")


@pytest.fixture(scope="module")
def attacks(unprivileged_folder):
    python, folder = unprivileged_folder
    stdin = json.dumps({"poison": POISON, "next": NEXT, "signals": SIGNALS, "memory": list(MEMORY_ATTACKS) + ["pool"],
                        "pool": POOL, **MEMORY_ATTACKS})
    done = as_unprivileged(python, folder, ATTACK_DRIVER, stdin)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_unprivileged_the_code_cannot_change_its_slots_limits_priority_or_cpus_nor_pass_them_on(attacks):
    """prlimit, setpriority and sched_setaffinity reach any process of one's uid: the slot, the user's others."""
    r = attacks["poison"]
    assert r["ok"] and r["stdout"].splitlines() == POISONED, r
    assert attacks["user_nice"] == attacks["nice"]  # the user's own processes were not reniced
    r = attacks["next"]  # the slot's next call: every limit is the call's own, not what the last call left
    mb = 1024 * 1024
    assert r["ok"] and r["stdout"].splitlines() == [
        f"({SandboxConfig.max_file_mb * mb}, {SandboxConfig.max_file_mb * mb}) (256, 256) (64, 64) (0, 0) (0, 0) (0, 0)",
        f"{attacks['nice']} {attacks['affinity']}", "written"], r


@pytest.mark.parametrize("attack", list(MEMORY_ATTACKS))
def test_unprivileged_memory_the_watch_cannot_miss_is_counted_shared_hidden_or_held_by_threads(attacks, attack):
    r = attacks[attack]
    assert not r["timed_out"] and r["observation"] == "MemoryError: the call used more than its 256 MB and was killed", r


def test_unprivileged_a_pool_of_workers_under_the_cap_is_not_killed(attacks):
    r = attacks["pool"]
    assert r["ok"] and r["stdout"] == "[200000, 200000, 200000, 200000]\n", r


def test_unprivileged_a_call_holds_only_its_share_of_the_users_pending_signals(attacks):
    r = attacks["signals"]
    # kill() and sigqueue() could queue past every limit; what counts against RLIMIT_SIGPENDING (a timer's
    # signal) stops at the call's own (EAGAIN), not the user's
    assert r["stdout"].splitlines() == ["kill 0 EPERM", "sigqueue 0 EPERM", "timer_create 64 EAGAIN"], r
    assert r["held"] <= 64 and r["own"] == 64, r  # the user's own signals still queue


# ---------------------------------------------------------------- what the model sees


def result(**fields) -> ExecResult:
    base = dict(ok=True, stdout="", stderr="", returncode=0, timed_out=False, truncated=False, latency=0.0)
    base.update(fields)
    return ExecResult(**base)


def test_short_observation_is_stdout_on_success():
    assert format_observation(result(stdout="4\n")) == "4\n"


def test_short_observation_is_only_the_last_line_of_the_error():
    tb = "Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\nNameError: name 'a' is not defined\n"
    r = result(ok=False, stdout="partial\n", stderr=tb, returncode=1)
    assert format_observation(r) == "NameError: name 'a' is not defined"


def test_short_observation_is_capped_at_256_characters_keeping_head_and_tail():
    text = "HEAD" + "x" * 1000 + "TAIL"
    obs = format_observation(result(stdout=text))
    assert len(obs) == 256
    assert obs.startswith("HEAD") and obs.endswith("TAIL") and "\n...\n" in obs


def test_full_observation_keeps_the_tail_of_the_traceback():
    tb = "Traceback\n" + "  frame\n" * 500 + "KeyError: 'k'\n"
    obs = format_observation(result(ok=False, stderr=tb, returncode=1), "full", max_chars=100)
    assert len(obs) == 100 and obs.endswith("KeyError: 'k'\n")


def test_an_unknown_style_or_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="style must be"):
        format_observation(result(), "json")
    with pytest.raises(ValueError, match="backend must be"):
        SandboxConfig(backend="k8s")
    with pytest.raises(ValueError, match="timeout must be positive, a number of at most 86400"):
        SandboxConfig(timeout=0)


# ---------------------------------------------------------------- the page and the code


def test_the_page_states_the_defaults_and_constants_of_the_code():
    """docs/02 restates SandboxConfig's defaults and the sandbox's constants; each fragment is built from the code."""
    import local_backend
    import runner

    cfg, name = SandboxConfig(), "02-sandbox.md"
    assert cfg.concurrency == (os.cpu_count() or 2)
    says(name, "| `concurrency` | CPU count |", f'`SandboxConfig(isolation="{cfg.isolation}")` is the default',
         f"imports `preload` ({', '.join(cfg.preload)}) once")
    says(name, f"| `timeout` | {cfg.timeout:g} s |", f"`TimeoutError: execution exceeded the {cfg.timeout:g} s time limit`",
         f"needs more than {cfg.timeout:g} s on one core")
    says(name, f"| `memory_mb` | {cfg.memory_mb} |", f"more than its {cfg.memory_mb} MB and was killed`",
         f"so {cfg.memory_mb // 1024} GiB of address space")
    says(name, f"| `max_file_mb` | {cfg.max_file_mb} |",
         f"`OutputLimitError: more than {cfg.max_file_mb} MB written to one stream or file`")
    says(name, f"| `max_output_bytes` | {cfg.max_output_bytes // 1024} KiB |",
         f"{cfg.max_output_bytes // 1024} KiB of output is far more")
    says(name, f"| `max_processes` | {cfg.max_processes} |", f"{cfg.max_processes} processes leave room for a thread pool")
    says(name, f"A slot retires after {local_backend.SLOT_CALLS} calls (`local_backend.SLOT_CALLS`)",
         f"at most {'a second' if runner.REAP_GRACE == 1 else f'{runner.REAP_GRACE:g} s'} (`runner.REAP_GRACE`)",
         f"every {confinement.CallGroup.TICK * 1000:g} ms whether the call is past its memory")
    says("02-isolation.md", f"removes itself after {runner.IDLE_EXIT / 60:g} minutes")
    says("02-isolation.md", f"the work dir is `{confinement.WORKDIR}`",
         "| " + ", ".join(f"`{path}`" for path in confinement.SCRATCH_DIRS) + " | fresh size-capped tmpfs per call",
         ", ".join(f"`{os.path.basename(device)}`" for device in confinement.DEVICES) + " (bound)",
         ", ".join(f"`{file}`" for file in confinement._ETC) + " written by the sandbox")
    says(name, f"| (descriptors, pending signals) | {runner.CALL_NOFILE}, {runner.CALL_SIGPENDING} |")
    says(name, f"the code runs with {runner.MALLOC_ARENAS} malloc arenas (`runner.MALLOC_ARENAS`)")
    says("02-seccomp.md", f"The tests call {NUMBER_WORDS[len(SECCOMP_DENIED)]} of the unlisted calls")
    says("02-isolation.md", f"knows the system-call numbers of {' and '.join(confinement._TABLES)}")
    if platform.machine() == "x86_64":
        says("02-seccomp.md", f"{len(confinement.seccomp_program()) // 8} instructions on x86_64")


NUMBER_WORDS = {12: "twelve", 13: "thirteen", 14: "fourteen", 15: "fifteen", 16: "sixteen"}


def test_the_isolation_page_states_the_constants_of_the_code():
    """docs/02-isolation restates the unprivileged path's constants and the filter's lists; built from the code."""
    name = "02-isolation.md"
    says(name, f"every {confinement.MemoryWatch.TICK * 1000:g} ms of the wait (`MemoryWatch.TICK`)",
         f"the slot's watch of the whole call every {confinement.MemoryWatch.TICK * 1000:g} ms",
         f"{confinement.SCRATCH_INODES} inodes", f"the code is uid {confinement.CALL_UID}",
         ", ".join(f"`{call}`" for call in confinement.CGROUP_ONLY[:-1]) + f" and `{confinement.CGROUP_ONLY[-1]}`")
    says("02-seccomp.md", ", ".join(f"`{family}`" for family in confinement.NETWORK_FAMILIES) + " fail with ENETUNREACH")
    says("glossary.md", f"every {confinement.MemoryWatch.TICK * 1000:g} ms it sums each of the call's processes'")
    kernel = confinement._KERNEL_KB
    says(name, f"{kernel['Threads']:g} kB of kernel stack a thread", f"{kernel['FDSize']:g} kB a slot of the descriptor table",
         f"{confinement.VMA_KB:g} kB a mapping")
    import runner

    says(name, f"{runner.CALL_SIGPENDING} queued (timers' signals)", f"the {runner.CALL_NOFILE} descriptors each may hold",
         f"{runner.CALL_NOFILE} descriptors a process")
    says("02-seccomp.md", "`prlimit64`, `setpriority`, `sched_setaffinity`, `sched_setscheduler`, "
         "`sched_setparam`, `sched_setattr` on any process but the caller")
    says("02-seccomp.md", f"(`confinement.NEWEST`, `file_setattr` of Linux 6.17)", "The tests call fourteen of the unlisted calls")
    if platform.machine() in confinement._TABLES:
        assert confinement.SYSCALLS["file_setattr"] == confinement.NEWEST == max(confinement.SYSCALLS.values())
    assert set(confinement.SELF_ONLY) == {"prlimit64", "setpriority", "sched_setaffinity", "sched_setscheduler",
                                          "sched_setparam", "sched_setattr"}


def test_the_page_states_what_format_observation_keeps():
    short = format_observation(result(stdout="x" * 1000))
    head, tail = short.split("\n...\n")
    full = format_observation(result(stdout="x" * 5000), "full")
    says("02-sandbox.md", f"`short` (default, max {len(short)} characters)",
         f"the first {len(head)} and the last {len(tail)} around", f"keeping the tail, {len(full)} characters by default")


def test_the_page_states_the_limits_a_call_really_gets(sandbox):
    """CPU time, the scratch tmpfs and the warm interpreter's address space, as a call with the defaults sees them."""
    needs_root()
    cfg = sandbox.config
    assert cfg == SandboxConfig()
    r = sandbox.run("import os, resource\n"
                    "print(*resource.getrlimit(resource.RLIMIT_CPU))\n"
                    "fs = os.statvfs('/tmp')\n"
                    "print(fs.f_blocks * fs.f_frsize // 2**20)\n"
                    "print([int(line.split()[1]) // 1024 for line in open('/proc/self/status') if line.startswith('VmSize')][0])\n")
    cpu_s, cpu_hard_s, scratch_mb, mapped_mb = map(int, r.stdout.split())
    assert cpu_hard_s > cpu_s, "soft = hard: the kernel would send SIGKILL, not SIGXCPU, at the CPU limit"
    # A CPU hog past the soft limit (lowered to 1 s here) gets SIGXCPU, and the page's line names it
    hog = sandbox.run("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1, resource.getrlimit(resource.RLIMIT_CPU)[1]))\n"
                      "while True:\n    pass\n")
    says("02-sandbox.md", f"| `{hog.stderr.strip().splitlines()[-1]}` |")
    says("02-sandbox.md", f"| (CPU time) | timeout + {cpu_s - int(cfg.timeout)} s |",
         f"the scratch tmpfs holds {scratch_mb // cfg.max_file_mb} x `max_file_mb`")
    stated = int(re.search(r"interpreter already maps about (\d+) MB", page("02-sandbox.md")).group(1))
    assert abs(mapped_mb - stated) <= stated // 4, f"a call starts with {mapped_mb} MB mapped; docs/02 says about {stated}"
    says("02-sandbox.md", f"leaves the code about {round(cfg.memory_mb - stated, -1)} MB")


def test_an_optional_cgroup_setting_is_passed_over_only_where_the_kernel_lacks_or_refuses_it(tmp_path):
    """A limit file this kernel does not have is skipped; one it has but will not open stops the set-up: the sandbox
    never runs a call with less than it promised (a swap cap that could not be written would let memory spill)."""
    confinement._write(None, str(tmp_path / "memory.swap.max"), "0", optional=True)  # absent: passed over
    assert not (tmp_path / "memory.swap.max").exists()
    (tmp_path / "not-a-file").mkdir()
    with pytest.raises(IsADirectoryError):
        confinement._write(None, str(tmp_path / "not-a-file"), "0", optional=True)
