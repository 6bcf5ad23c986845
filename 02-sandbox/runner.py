"""The runner: the detail of each step of one call, from the request to the answer (sandbox.py shows the sequence).

Standard library only: it is also sent alone, as `python3 -I -c <source> --container OPTIONS`, to every Docker
container, whose container_main takes the same steps less those Docker provides. Why each step: docs/02-sandbox.md.
"""
from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import functools
import importlib
import io
import json
import linecache
import os
import resource
import select
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
import types
from typing import NoReturn

ANSWER_GRACE = 30.0  # seconds past the timeout before the caller gives up on an answer (a loaded machine is slow to fork and reap)
REQUEST_GRACE = 30.0  # seconds the code's process may take to receive its request before it is killed
REAP_GRACE = 1.0  # seconds the answer waits for the call's killed processes to exit; past it, it goes without them
IDLE_EXIT = 900.0  # seconds a warm container waits for its request before giving up
DEFAULT_CAP = 64 * 1024  # output cap when a request never arrived (the answer then only says why)
_OLD_STREAMS: list = []  # see _fresh_interpreter_state


def clean_env() -> dict:
    """The whole environment the sandbox's processes get: built from nothing, never copied."""
    threads = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"), "1")
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "USER": "sandbox", "MPLBACKEND": "Agg", **threads,
            "PYTHONDONTWRITEBYTECODE": "1", "MALLOC_ARENA_MAX": str(MALLOC_ARENAS)}


# Malloc arenas (why: docs/02-sandbox.md): the code's forked interpreter is capped by mallopt, what it starts by env.
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter, malloc.h


def preload(modules: list[str]) -> None:
    for name in modules:
        with contextlib.suppress(ImportError):  # a missing optional library fails in the code, as usual
            importlib.import_module(name)


# ------------------------------------------------------ The steps of a call, in the order sandbox.serve_call takes them


class CallFiles:
    """One call's files: stdout and stderr as memory files, and the pipe that takes _LIMITS to the supervisor."""

    def __init__(self) -> None:
        self.out, self.err = os.memfd_create("stdout"), os.memfd_create("stderr")
        self.limits_r, self.limits_w = os.pipe()


def exit_after(body, *args) -> NoReturn:
    """In a forked process: exit with body(*args)'s status, or 1 after printing what it raised: never return."""
    status = 1
    try:
        status = body(*args)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)


_LIMITS = struct.Struct("=dqq")  # what the supervisor learns of a request: time limit, output cap, memory cap


def take_request(request_fd: int, files: CallFiles) -> dict:
    """The code's process reads its own request; its supervisor gets only the time limit and the two caps."""
    os.close(files.limits_r)
    os.dup2(files.out, 1)  # first: anything that fails from here on is reported in the answer
    os.dup2(files.err, 2)
    receive = functools.partial(os.read, request_fd)
    request = json.loads(read_exactly(receive, struct.unpack(">I", read_exactly(receive, 4))[0]))  # length-prefixed
    os.write(files.limits_w, _LIMITS.pack(float(request["timeout"]), int(request["max_output_bytes"]), int(request["memory_mb"])))
    return request


def detach(workdir: str) -> None:
    """A session of its own, stdin from /dev/null, no descriptor of the sandbox left open, in the work dir."""
    os.setsid()  # a group of its own: a kill of the group never reaches the supervisor
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.closerange(3, 1 << 30)  # no socket, pipe or cgroup of the sandbox stays reachable
    os.chdir(workdir)


CALL_NOFILE = 256  # descriptors per process: bounds the socket and pipe buffers one process can hold
CALL_SIGPENDING = 64  # signals queued at once, per call: its share of the per-user count every call shares
# Every other limit as the server started with it, set again for every call: none comes from an earlier call.
_STARTING_LIMITS = {kind: resource.getrlimit(kind) for name, kind in vars(resource).items() if name.startswith("RLIMIT_")}


def set_rlimits(request: dict, uid: int | None, mode: str) -> None:
    """Every rlimit, soft = hard but CPU time's: the request's, the call's (none for core dumps, and for locked memory and POSIX
    message queues, which no memory watch sees), and the server's starting value for the rest."""
    for kind, (soft, hard) in _STARTING_LIMITS.items():
        resource.setrlimit(kind, (soft, hard))  # fails where a hard limit was lowered: no call runs with it
    mb = 1024 * 1024
    _set_limit(resource.RLIMIT_AS, request["memory_mb"] * mb)
    # CPU time's hard limit a second above its soft one: the kernel sends SIGXCPU first, which names the cause
    _set_limit(resource.RLIMIT_CPU, int(request["timeout"]) + 2, hard_value=int(request["timeout"]) + 3)
    _set_limit(resource.RLIMIT_FSIZE, request["max_file_mb"] * mb)
    _set_limit(resource.RLIMIT_NOFILE, CALL_NOFILE)
    _set_limit(resource.RLIMIT_SIGPENDING, CALL_SIGPENDING)
    for kind in (resource.RLIMIT_CORE, resource.RLIMIT_MEMLOCK, resource.RLIMIT_MSGQUEUE):
        _set_limit(kind, 0)
    if mode == "userns" or (mode != "container" and uid is not None):  # the call's own user namespace, or uid: its budget
        _set_limit(resource.RLIMIT_NPROC, request["max_processes"])
    elif mode == "plain":  # the uid is shared with the caller: a budget on top of what it runs
        _set_limit(resource.RLIMIT_NPROC, _tasks_of_uid(os.getuid()) + request["max_processes"])
    # In a container the pids cgroup is the budget: RLIMIT_NPROC would count all containers' uid 65534 together.


def drop_privileges(uid: int | None) -> None:
    """Default signal handlers, the unprivileged uid (where one is given), no_new_privs, death with the supervisor."""
    for number in (signal.SIGCHLD, signal.SIGALRM, signal.SIGXFSZ, signal.SIGXCPU, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as `python -c` has it (a slot ignores SIGINT)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    prctl(38, 1)  # PR_SET_NO_NEW_PRIVS: setuid binaries cannot give root back
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: if the supervisor dies, so does the code


def install_seccomp(program: bytes) -> None:
    """Install confinement.seccomp_program's filter on this process and all it starts. Here because runner.py travels
    alone into every container, where the filter stacks on Docker's profile."""
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    prctl(22, 2, ctypes.byref(fprog), "prctl(PR_SET_SECCOMP)")  # needs no_new_privs


def run_code(source: str, workdir: str) -> int:
    """A clean environment and a fresh interpreter's state, then the code as `python -c` runs it; its exit status."""
    os.environ.clear()
    os.environ.update(clean_env(), HOME=workdir, TMPDIR=workdir)
    ctypes.CDLL(None).mallopt(_M_ARENA_MAX, MALLOC_ARENAS)
    _fresh_interpreter_state()
    _poll_where_epoll_is_refused()
    return _exec(source)


def collect(pid: int, files: CallFiles, answer_fd: int, limiter=None, may_copy: bool = False) -> None:
    """The supervisor's side: wait for the code's process up to the time limit, kill every process the call left, send
    the answer. limiter: a confinement.CallGroup or MemoryWatch, asked every limiter.TICK seconds (or None).
    may_copy: the output may pass through this process's memory where sendfile is refused (a single-use container)."""
    os.close(files.limits_w)
    ready, _, _ = select.select([files.limits_r], [], [], REQUEST_GRACE)  # sent once the code's process read the request
    limits = os.read(files.limits_r, _LIMITS.size) if ready else b""
    os.close(files.limits_r)
    if len(limits) != _LIMITS.size:  # no request, or a malformed one: the code's process says why on its stderr
        _kill_quietly(pid)
        status, timed_out = _wait_for(pid, None)
        cap = DEFAULT_CAP
    else:
        timeout, cap, memory_mb = _LIMITS.unpack(limits)
        over = getattr(limiter, "over", None)  # the limiter's look at the call: past its memory, or an OOM kill in it
        status, timed_out = _wait_for(pid, timeout, over and (lambda until: over(memory_mb, until)), getattr(limiter, "TICK", None))
    _kill_the_rest()  # before answering: when the caller has its result, no process of the call is left ...
    _reap_the_rest(REAP_GRACE)  # ... unless the kernel takes longer to end them: then none of them runs again
    oom_killed = limiter.oom_killed() if limiter is not None else False
    if oom_killed and os.WIFEXITED(status):  # a process of the call was killed for memory: the call failed, however it exited
        status = signal.SIGKILL
    try:
        _send_answer(answer_fd, status, timed_out, oom_killed, files.out, files.err, cap, may_copy)
    finally:
        os.close(files.out)
        os.close(files.err)
        _reap_the_rest()  # the rest, after answering: the slot takes no call before every process of this one is gone


# ---------------------------------------------------------------------------------- The detail of the supervisor's side


def _wait_for(user: int, timeout: float | None, over_memory=None, tick: float | None = None) -> tuple[int, bool]:
    """(wait status, timed out) of the code's process, killed past the time limit or when over_memory(deadline).
    It sleeps in sigtimedwait, never in a handler: a signal the code sends it wakes it at most."""
    deadline = None if timeout is None else time.monotonic() + timeout
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # from here on, an exit is noted, not lost
    try:
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)  # also reaps the code's orphans, which are ours
            except ChildProcessError:
                pid = 0
            if pid == user:
                return wait_status, False
            if pid:
                continue
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or (over_memory and over_memory(deadline or float("inf"))):
                break
            wait = min(x for x in (left, tick, 3600.0) if x is not None)
            signal.sigtimedwait([signal.SIGCHLD], wait)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
    _kill_quietly(user)
    _, status = os.waitpid(user, 0)
    return status, left is not None and left <= 0


def _send_answer(fd: int, status: int, timed_out: bool, oom_killed: bool, out: int, err: int, cap: int, may_copy: bool) -> None:
    """A header (sizes, exit status), then head and tail of each stream, at most `cap` bytes each, copied by sendfile
    in the kernel: the output never enters this process's memory (but with may_copy, where sendfile is refused)."""
    header = {"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out, "oom_killed": oom_killed}
    pieces = []
    for name, stream in (("stdout", out), ("stderr", err)):
        size = os.fstat(stream).st_size
        head, tail = (size, 0) if size <= cap else (cap - cap // 2, cap // 2)
        header[name] = [size, head, tail]
        pieces += [(stream, 0, head), (stream, size - tail, tail)]
    data = json.dumps(header).encode()
    _write_all(fd, struct.pack(">I", len(data)) + data)
    for stream, offset, count in pieces:
        while count > 0:
            try:
                sent = os.sendfile(fd, stream, offset, count)
            except OSError:
                if not may_copy:
                    raise
                sent = _write_all(fd, os.pread(stream, count, offset))
            if sent == 0:
                raise OSError("the output file ended early")
            offset, count = offset + sent, count - sent


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return len(data)


def read_exactly(receive, size: int) -> bytes:
    """size bytes from receive(n) (os.read on a descriptor, recv on a socket), which may return fewer."""
    chunks = bytearray()
    while len(chunks) < size:
        chunk = receive(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise EOFError(f"the request ended after {len(chunks)} of {size} bytes")
        chunks += chunk
    return bytes(chunks)


def read_answer(read_exactly) -> dict:
    """The caller's side of _send_answer, through read_exactly(n). Invalid UTF-8 is replaced, never raised; a stream
    over the cap comes back as head, a line saying how much was cut, and tail."""
    header = json.loads(read_exactly(struct.unpack(">I", read_exactly(4))[0]))
    answer = {"returncode": header["returncode"], "timed_out": header["timed_out"],
              "oom_killed": header["oom_killed"], "truncated": False}
    for name in ("stdout", "stderr"):
        size, head, tail = header[name]
        data = read_exactly(head)
        if head + tail < size:
            data += f"\n... [{size - head - tail} bytes cut] ...\n".encode() + read_exactly(tail)
            answer["truncated"] = True
        answer[name] = data.decode("utf-8", errors="replace")
    return answer


def failure(reason: str) -> dict:
    """An answer for a call whose supervisor gave none (killed, crashed, too slow)."""
    return {"stdout": "", "stderr": "", "returncode": -signal.SIGKILL, "timed_out": False, "oom_killed": False,
            "truncated": False, "error": reason}


def _kill_the_rest() -> None:
    """Kill every process the code left behind: one kill(-1) as a PID namespace's init (_reap_the_rest reaps them);
    elsewhere, a child subreaper that the code's orphans are re-parented to, kill and reap children until none is left."""
    if os.getpid() == 1:
        _kill_quietly(-1)
        return
    me = os.getpid()
    while True:
        children = _children_of(me)
        for pid in children:
            _kill_quietly(pid)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        if not children:
            time.sleep(0.001)


def _reap_the_rest(seconds: float | None = None) -> None:
    """As a PID namespace's init: reap every process of the call (killed), at most `seconds` (None: however long)."""
    if os.getpid() != 1:
        return
    deadline = None if seconds is None else time.monotonic() + seconds
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # an exit between waitpid and the wait is noted
    try:
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0]:
                    continue
            except ChildProcessError:
                return
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return
            signal.sigtimedwait([signal.SIGCHLD], left)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])


def _children_of(parent: int) -> list[int]:
    stats = ((pid, text.rsplit(")", 1)[1].split()) for pid, text in _proc_files("stat"))  # state, then parent
    return [pid for pid, fields in stats if int(fields[1]) == parent and fields[0] != "Z"]


def _tasks_of_uid(uid: int) -> int:
    """Processes and threads of a uid: what RLIMIT_NPROC counts."""
    statuses = (dict(line.split(":", 1) for line in text.splitlines() if ":" in line) for _, text in _proc_files("status"))
    return sum(int(fields["Threads"]) for fields in statuses if int(fields["Uid"].split()[0]) == uid)


def _proc_files(name: str):
    """(pid, text of /proc/PID/name) for every process still there to be read."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/{name}") as f:
                    text = f.read()
            except OSError:
                continue
            yield int(entry), text


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------- The detail of the code's side


def _set_limit(kind: int, value: int, hard_value: int | None = None) -> None:
    _, hard = resource.getrlimit(kind)
    limits = (value, value if hard_value is None else hard_value)
    if hard != resource.RLIM_INFINITY:
        limits = tuple(min(v, hard) for v in limits)
    resource.setrlimit(kind, limits)


def prctl(option: int, value: int, pointer=None, what: str = "prctl") -> None:
    """prctl(2), which Python does not wrap; OSError naming `what` where the kernel refuses. confinement.py's too."""
    third = pointer if pointer is not None else ctypes.c_ulong(0)
    if ctypes.CDLL(None, use_errno=True).prctl(ctypes.c_int(option), ctypes.c_ulong(value), third, ctypes.c_ulong(0), ctypes.c_ulong(0)):
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _exec(source: str) -> int:
    """Run the code as `python -c` would and return its exit status."""
    name = "<string>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # tracebacks show lines, as of a file
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    try:
        exec(compile(source, name, "exec", dont_inherit=True), main.__dict__)
        status = 0
    except SystemExit as e:  # as the interpreter exits: None is 0, a number its low byte, anything else printed and 1
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        status = e.code & 0xFF if isinstance(e.code, int) else int(e.code is not None)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # only the code's frames, not this one
        status = 1
    try:
        for thread in threading.enumerate():  # the interpreter waits for non-daemon threads at exit
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    return status


def _fresh_interpreter_state() -> None:
    """What a new interpreter would have and a fork does not."""
    # The server's stream objects own fds 0-2, now the code's: kept referenced, so that collecting them closes nothing.
    _OLD_STREAMS.extend([sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__])
    sys.stdin = sys.__stdin__ = _io_text(0, "r")
    sys.stdout = sys.__stdout__ = _io_text(1, "w")
    sys.stderr = sys.__stderr__ = _io_text(2, "w")
    sys.argv = ["-c"]
    sys.path[:] = [""] + [p for p in sys.path[1:] if os.path.isdir(p)]  # as `python -c`: the work dir first
    import random

    random.seed()
    if "numpy.random" in sys.modules:  # not imported yet: it will seed itself when it is
        sys.modules["numpy.random"].seed()


def _poll_where_epoll_is_refused() -> None:
    """Where the filter refuses epoll, selectors.DefaultSelector is poll's, as on a system without epoll."""
    try:
        select.epoll().close()
    except OSError:
        import selectors

        selectors.DefaultSelector = selectors.PollSelector


def _io_text(fd: int, mode: str):
    """Unbuffered text stream on fd: output survives os._exit and crashes."""
    raw = io.FileIO(fd, mode, closefd=False)
    if mode == "r":
        return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors="replace")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)


# ---------------------------------------------------------- Inside a container: one call, then the container is removed


def container_main(options: dict) -> None:
    """Warm imports, one request on stdin, the answer on stdout: sandbox.serve_call's steps less those Docker provides.
    options["seccomp"] (hex): the local backend's filter, on top of Docker's profile (why: docker_backend.py)."""
    preload(options["preload"])
    ready, _, _ = select.select([0], [], [], IDLE_EXIT)
    if not ready:
        return
    workdir, files = tempfile.mkdtemp(prefix="work-"), CallFiles()
    pid = os.fork()
    if pid == 0:
        exit_after(_container_code, files, workdir, bytes.fromhex(options.get("seccomp", "")))
    collect(pid, files, 1, may_copy=True)  # single-use: output copied through memory reaches no later call


def _container_code(files: CallFiles, workdir: str, program: bytes) -> int:
    request = take_request(0, files)
    detach(workdir)
    set_rlimits(request, None, "container")
    drop_privileges(None)
    if program:
        install_seccomp(program)
    return run_code(request["code"], workdir)


if __name__ == "__main__":  # in a container, as docker_backend.py starts it: --container OPTIONS (JSON)
    container_main(json.loads(sys.argv[sys.argv.index("--container") + 1]))
