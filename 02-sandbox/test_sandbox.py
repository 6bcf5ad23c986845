"""Hostile code against both backends: each test states what must be contained.

Every hostile test also checks that the sandbox still answers the next call correctly.
Docker tests skip, with the reason, when no engine or no sandbox image is reachable
(.ci/docker.sh installs and starts one and builds the image); the local backend's
namespace tests skip when not root, the one case where the kernel refuses them.
"""
from __future__ import annotations

import glob
import json
import os
import platform
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid

import pytest

import confinement
from doc_pages import page, says
from sandbox import LAB_ROOT, ExecResult, Sandbox, SandboxConfig, format_observation


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
SHORT = 2.0  # the per-call limit of the tests of runaway code, so that they stay quick
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


def assert_still_answers(sb: Sandbox) -> None:
    r = sb.run("print(6 * 7)")
    assert r.ok and r.stdout == "42\n", r


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
    r = sb.run("while True:\n    pass", timeout=SHORT)
    assert r.timed_out and not r.ok
    assert format_observation(r) == f"TimeoutError: execution exceeded the {SHORT:g} s time limit"
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
        timeout=SHORT,
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


def test_binary_output_is_decoded_with_replacement_not_an_error(sb):
    r = sb.run("import sys\nsys.stdout.buffer.write(bytes(range(256)))\nprint('after')")
    assert r.ok
    assert r.stdout.startswith("\x00\x01\x02")
    assert "\ufffd" in r.stdout and r.stdout.endswith("after\n")
    assert_still_answers(sb)


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
    with Sandbox(make_config(backend, concurrency=1)) as fresh:  # created after the secret was set
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
            "print(sorted(name for _, name in socket.if_nameindex()))\n"
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
    assert_still_answers(sb)
    r = sb.run("import os\nos.kill(-1, 9)")  # every process it may signal: only its own
    assert isinstance(r, ExecResult) and not r.ok
    assert_still_answers(sb)


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


def test_deep_recursion_gives_recursion_error(sb):
    r = sb.run("def f(n):\n    return f(n + 1)\nf(0)")
    assert format_observation(r).startswith("RecursionError: maximum recursion depth exceeded")
    assert_still_answers(sb)


def test_recursion_that_overflows_the_c_stack_is_a_contained_crash(sb):
    # json's C encoder recurses on the C stack once the recursion limit is lifted: a segfault.
    r = sb.run(
        "import json, sys\nsys.setrecursionlimit(10**7)\nnested = []\n"
        "for _ in range(200000):\n    nested = [nested]\nprint('built')\njson.dumps(nested)"
    )
    assert not r.ok and r.returncode == -11 and r.stdout == "built\n"
    assert format_observation(r).startswith("Segmentation fault")
    assert_still_answers(sb)


def test_sys_exit_code_is_the_returncode(sb):
    r = sb.run("import sys\nprint('bye')\nsys.exit(3)")
    assert not r.ok and r.returncode == 3 and r.stdout == "bye\n"
    assert format_observation(r) == "Process exited with code 3"
    assert sb.run("import sys\nsys.exit(0)").ok
    assert_still_answers(sb)


def test_os_exit_keeps_output_printed_before_it(sb):
    r = sb.run("import os\nprint('kept', end='')\nos._exit(0)")
    assert r.ok and r.stdout == "kept"
    assert_still_answers(sb)


def test_reading_stdin_gets_end_of_file_not_a_hang(sb):
    r = sb.run("input()")
    assert not r.timed_out and format_observation(r) == "EOFError: EOF when reading a line"
    assert sb.run("import sys\nprint(repr(sys.stdin.read()))").stdout == "''\n"


def test_a_syntax_error_is_reported_by_its_last_line(sb):
    r = sb.run("x = (1,\nprint(x)")
    assert not r.ok and r.returncode == 1
    assert format_observation(r) == "SyntaxError: '(' was never closed"


def test_a_traceback_shows_the_codes_frames_and_source_not_the_sandboxs(sb):
    r = sb.run("def half(x):\n    return x / 0\n\nhalf(4)")
    assert not r.ok
    assert 'File "<string>", line 2, in half' in r.stderr
    assert "return x / 0" in r.stderr  # the source line, as from a file
    assert "sandbox.py" not in r.stderr
    assert format_observation(r) == "ZeroDivisionError: division by zero"
    assert format_observation(r, "full").endswith("ZeroDivisionError: division by zero\n")


def test_unicode_output_comes_back_exactly(sb):
    text = "∑ π ≈ 3.14159 — 日本語 😀"
    r = sb.run(f"print({text!r})")
    assert r.ok and r.stdout == text + "\n"


def test_code_that_prints_nothing_is_a_success_with_empty_output(sb):
    r = sb.run("x = 2 + 2")
    assert r.ok and r.stdout == "" and r.returncode == 0
    assert format_observation(r) == ""


def test_nothing_defined_by_one_call_is_visible_to_the_next(sb):
    first = sb.run("import math\nmath.pi = 3\nsecret = 42\nopen('note.txt', 'w').write('x')")
    assert first.ok
    r = sb.run("import math, os\nprint(math.pi, 'secret' in globals(), os.path.exists('note.txt'))")
    assert r.stdout == "3.141592653589793 False False\n"


def test_32_concurrent_calls_mixing_good_and_hostile_code_keep_their_own_results(backend):
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
    codes, expected, endings = [], {}, {}
    for i in range(32):
        if i % 4 == 3:
            codes.append(hostile[i // 4][0])
            endings[i] = hostile[i // 4][1]
        else:
            codes.append(f"print({i} * {i}, 'ok')")
            expected[i] = f"{i * i} ok\n"
    with Sandbox(make_config(backend, concurrency=32, docker_warm=4)) as sb:  # all 32 at once
        results = sb.run_many(codes, timeout=5.0)  # ends the runaway ones; ample for the others
        assert_still_answers(sb)
    assert len(results) == 32
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

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: r.stdout for i, r in results.items()} == {i: f"thread {i}\n" for i in range(12)}


# ---------------------------------------------------------------- local backend specifics


def test_the_local_backend_uses_namespaces_when_root():
    needs_root()
    with Sandbox(make_config("local", concurrency=1)) as sb:
        assert sb.isolation == "namespaces"
        r = sb.run("import os\nprint(os.getpid(), os.getuid() != 0, sorted(os.listdir('/proc'))[:0])")
        pid, unprivileged, _ = r.stdout.split(" ", 2)
        assert int(pid) <= 3 and unprivileged == "True"  # its own PID namespace, not root


def test_the_warm_interpreter_already_has_sympy_and_random_state_is_fresh_per_call():
    needs_root()
    with Sandbox(make_config("local", concurrency=1)) as sb:
        r = sb.run("import sys\nprint('sympy' in sys.modules, 'numpy' in sys.modules)")
        assert r.stdout == "True True\n"
        draws = [sb.run("import random, numpy\nprint(random.random(), numpy.random.rand())").stdout for _ in range(3)]
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
        assert sb.run("while True: pass", timeout=SHORT).timed_out
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
    import local_backend
    import runner

    needs_root()
    with Sandbox(make_config("local", concurrency=1, preload=())) as sb:
        assert_still_answers(sb)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(TIMEOUT + runner.ANSWER_GRACE)
            conn.connect(sb._backend._server.socket_path)
            conn.sendall(struct.pack(">I", 8) + b"not json")
            answer = runner.read_answer(lambda size: local_backend._recv_exactly(conn, size))
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
    with Sandbox(make_config(backend, memory_mb=256, concurrency=1)) as sb:
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
    scan = (
        "import ctypes, os, uuid\n"
        "ctypes.CDLL(None).prctl(4, 1)  # PR_SET_DUMPABLE: what a determined reader would do first\n"
        "control = uuid.uuid4().hex\n"
        f"wanted = {halves!r} + [(control[:16], control[16:])]\n"
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
        "            found[i] = data.startswith(tail.encode(), at + 16)\n"
        "            at = data.find(head.encode(), at + 1)\n"
        "print(found)\n"
    )
    with Sandbox(make_config("local", concurrency=1, preload=("math",), max_output_bytes=64 * 1024)) as sb:  # one slot
        first = sb.run(earlier)
        assert first.ok and first.stdout == output_marker * 300 + "\n"
        for _ in range(3):
            r = sb.run(scan)
            assert r.ok, r
            assert r.stdout == "[False, False, True]\n"  # neither marker; the control is found


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
                "open('/usr/lib/escaped', 'w')\n"
            )
    finally:
        os.remove(f"{secret_dir}/answers.txt")
        os.rmdir(secret_dir)
    visible, devices, etc, top = (json.loads(line) for line in r.stdout.splitlines())
    assert visible == []
    assert devices == ["fd", "null", "shm", "stderr", "stdin", "stdout", "urandom", "zero"]
    assert set(etc) <= {"group", "hosts", "ld.so.cache", "passwd"}
    assert set(top) <= {"dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "tmp", "usr", "var"} | {
        p.split("/")[1] for p in confinement.interpreter_paths()}  # the interpreter's own folders, wherever they are
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
    with pytest.raises(ValueError, match="timeout must be positive"):
        SandboxConfig(timeout=0)


# ---------------------------------------------------------------- the page and the code


def test_the_page_states_the_defaults_and_constants_of_the_code():
    """docs/02 restates SandboxConfig's defaults and the sandbox's constants; each fragment is built from the code."""
    import local_backend
    import runner

    cfg, name = SandboxConfig(), "02-sandbox.md"
    assert cfg.concurrency == (os.cpu_count() or 2)
    says(name, "| `concurrency` | CPU count |", f'`SandboxConfig(isolation="{cfg.isolation}")` is the default',
         f"imported {', '.join(cfg.preload)} once")
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
         f"removes itself after {runner.IDLE_EXIT / 60:g} minutes")
    says(name, f"the work dir is `{confinement.WORKDIR}`",
         "| " + ", ".join(f"`{path}`" for path in confinement.SCRATCH_DIRS) + " | fresh size-capped tmpfs per call",
         ", ".join(f"`{os.path.basename(device)}`" for device in confinement.DEVICES) + " (bound)",
         ", ".join(f"`{file}`" for file in confinement._ETC) + " written by the sandbox")
    says(name, f"knows the system-call numbers of {' and '.join(confinement._TABLES)}",
         f"the tests call {NUMBER_WORDS[len(SECCOMP_DENIED)]} of the denied calls")
    if platform.machine() == "x86_64":
        says(name, f"{len(confinement.seccomp_program()) // 8} instructions on x86_64")


NUMBER_WORDS = {12: "twelve", 13: "thirteen", 14: "fourteen", 15: "fifteen", 16: "sixteen"}


def test_the_page_states_what_format_observation_keeps():
    short = format_observation(result(stdout="x" * 1000))
    head, tail = short.split("\n...\n")
    full = format_observation(result(stdout="x" * 5000), "full")
    says("02-sandbox.md", f"`short` (default, max {len(short)} characters)",
         f"the first {len(head)} and the last {len(tail)} around", f"keeping the tail, {len(full)} characters by default")


def test_the_page_states_the_limits_a_call_really_gets():
    """CPU time, the scratch tmpfs and the warm interpreter's address space, as a call with the defaults sees them."""
    needs_root()
    cfg = SandboxConfig(concurrency=1)
    with Sandbox(cfg) as sb:
        r = sb.run("import os, resource\n"
                   "print(resource.getrlimit(resource.RLIMIT_CPU)[0])\n"
                   "fs = os.statvfs('/tmp')\n"
                   "print(fs.f_blocks * fs.f_frsize // 2**20)\n"
                   "print([int(line.split()[1]) // 1024 for line in open('/proc/self/status') if line.startswith('VmSize')][0])\n")
    cpu_s, scratch_mb, mapped_mb = map(int, r.stdout.split())
    says("02-sandbox.md", f"| (CPU time) | timeout + {cpu_s - int(cfg.timeout)} s |",
         f"each scratch tmpfs holds {scratch_mb // cfg.max_file_mb} x `max_file_mb`")
    stated = int(re.search(r"interpreter already maps about (\d+) MB", page("02-sandbox.md")).group(1))
    assert abs(mapped_mb - stated) <= stated // 4, f"a call starts with {mapped_mb} MB mapped; docs/02 says about {stated}"
    says("02-sandbox.md", f"leaves the code about {round(cfg.memory_mb - stated, -1)} MB")
