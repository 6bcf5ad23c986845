"""The local backend's fork server: warm imports once, then slots that serve calls one at a time.

Started by local_backend.py. It keeps `spares` slots running, each forked (with namespaces, into a PID namespace of
its own) to run sandbox.slot_main until it retires; not root, it first enters a user namespace of its own ("userns").
The why: docs/02-sandbox.md.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import struct
import time

import confinement
import runner


def serve(options: dict, slot_main) -> None:
    """Run until the caller closes our stdin; the first stdout line says what isolation we got, or why none.
    slot_main(slot): sandbox.py's, handed over by the loader (the core imports its machinery, never the reverse)."""
    runner.preload(options["preload"])
    mode = options["isolation"]
    if mode == "namespaces" and os.geteuid() != 0:
        mode = "userns"  # the same containment, from a user namespace (docs/02-isolation.md)
    listener, cgroups = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), None
    try:  # first, before anything is made; named through its folder's descriptor, short however deep the folder
        listener.bind(f"/proc/self/fd/{os.open(options['folder'], os.O_PATH | os.O_DIRECTORY)}/socket")
    except OSError as e:
        return _hello(error=f"cannot listen in {options['folder']}: {e.strerror or e}")
    try:
        if mode != "plain":
            try:
                cgroups = confinement.Cgroups(f"tool-rl-lab-sandbox-{os.getpid()}")
            except OSError:
                if mode == "namespaces":
                    raise  # userns goes on without: where none can be had, each call is watched
        if mode == "userns":
            confinement.enter_user_namespace()  # after the cgroups: they are made as the caller, outside it
        program = confinement.seccomp_program(cgroup=cgroups is not None)
    except OSError as e:
        _remove_groups(cgroups, [])
        return _hello(error=e.strerror or str(e))
    try:
        _serve_slots(options, mode, listener, cgroups, program, slot_main)
    except BaseException:
        _remove_groups(cgroups, [])  # whatever went wrong, no group of ours stays
        raise


def _serve_slots(options: dict, mode: str, listener: socket.socket, cgroups, program: bytes, slot_main) -> None:
    """Keep `spares` slots running until the caller is gone; say hello once they are ready, or why they are not."""
    listener.listen(256)
    listener.setblocking(False)  # several slots poll it; the losers of a race get EAGAIN
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps finished slots
    gc.freeze()  # the warm objects stay out of every child's collections: fewer copied pages
    alive_r, alive_w = os.pipe()  # idle slots see EOF here when the server is gone
    leaving_r, leaving_w = os.pipe()  # a slot about to retire writes its token here
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY) if mode != "plain" else None
    slots: dict[int, int] = {}  # token -> pid
    tokens = iter(range(1, 1 << 62))

    def spawn() -> None:
        """Fork a slot and wait until it says its isolation is in place (or why it is not)."""
        token = next(tokens)
        # uid: a uid of the slot's own as root; None unprivileged (userns: the call makes its own)
        uid = confinement.call_uid(token) if mode == "namespaces" or (mode == "plain" and os.geteuid() == 0) else None
        report_r, report_w = os.pipe()
        if own_pid_ns is not None:
            confinement.unshare(confinement.CLONE_NEWPID)  # only the next child enters it, as its PID 1
        pid = os.fork()
        if pid == 0:  # the slot; with namespaces, as PID 1: the kernel tears them down when it exits
            for fd in (alive_w, leaving_r, report_r):
                os.close(fd)
            slot = Slot(listener, alive_r, token, uid, mode, options, cgroups, program, report_w, leaving_w)
            runner.exit_after(_slot, slot, slot_main)
        os.close(report_w)
        if own_pid_ns is not None:
            confinement.setns(own_pid_ns, confinement.CLONE_NEWPID)
        with os.fdopen(report_r, "rb") as f:
            if problem := f.read().decode(errors="replace"):
                raise SystemExit(problem)
        slots[token] = pid

    try:
        for _ in range(options["spares"]):
            spawn()
    except SystemExit as e:
        os.close(alive_w)  # the slots that did start see the server gone and exit
        _remove_groups(cgroups, list(slots.values()))
        return _hello(error=str(e))
    _hello(isolation=mode, cgroups=cgroups.paths if cgroups else [])
    poller = select.poll()
    poller.register(0, select.POLLIN)  # the caller's pipe: readable only at EOF, when it is gone
    poller.register(leaving_r, select.POLLIN)
    while True:
        events = poller.poll(1000)
        for fd, _ in events:
            if fd == 0:
                os.close(alive_w)
                _remove_groups(cgroups, list(slots.values()))
                return
            for (token,) in struct.iter_unpack("q", os.read(leaving_r, 8 * 512)):
                slots.pop(token, None)
                spawn()
        if not events:  # a quiet second: replace any slot that died
            for token, pid in list(slots.items()):
                if not _alive(pid):
                    del slots[token]
                    spawn()


def _hello(**fields) -> None:
    print(json.dumps(fields), flush=True)


class Slot:
    """What a slot's calls need, set when the slot is forked (interpreter_in_scratch: once its root is built)."""

    def __init__(self, listener: socket.socket, alive: int, token: int, uid: int | None, mode: str, options: dict,
                 cgroups, program: bytes, report_fd: int, leaving_fd: int) -> None:
        self.listener, self.alive = listener, alive  # the server's socket; EOF on alive: the server is gone
        self.token, self.uid, self.mode = token, uid, mode  # uid: of this slot's calls, None where we are not root
        self.cgroups, self.program = cgroups, program  # program: the seccomp filter
        self.max_file_mb, self.calls = options["max_file_mb"], options["slot_calls"]  # calls: served before it retires
        # The server reads report_fd until ready() closes it (empty, or why not); retire() writes to leaving_fd.
        self.report_fd, self.leaving_fd = report_fd, leaving_fd
        self.interpreter_in_scratch: dict[str, int] = {}  # interpreter folders under a scratch dir (a venv in /tmp): every call binds them back
        self.last_pid: int | None = None  # the PID namespace's counter (/proc/sys/kernel/ns_last_pid), once /proc is ours
        self.proc: int | None = None  # the same /proc without hidepid, for the memory watch: the code's processes, all

    def ready(self) -> None:
        """Its isolation is in place: the server goes on (with the next slot, or its hello)."""
        os.close(self.report_fd)
        self.report_fd = None

    def retire(self) -> None:
        os.write(self.leaving_fd, struct.pack("q", self.token))

    def accept(self) -> socket.socket | None:
        """Wait for a call; None when the server exited first."""
        poller = select.poll()
        poller.register(self.listener.fileno(), select.POLLIN)
        poller.register(self.alive, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self.alive:
                    return None
                try:
                    conn, _ = self.listener.accept()
                except BlockingIOError:
                    continue  # another slot took it
                conn.setblocking(True)
                return conn


def _slot(slot: Slot, slot_main) -> int:
    """One supervisor's process: its signals and stdin, then the core's slot_main; its exit status.
    An exception before slot.ready() is sent to the server as the reason the slot could not start."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as PID 1 with no handler: deaf to the code's signals
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)  # the server's pipe from the caller stays with the server
        os.close(devnull)
        slot_main(slot)
    except BaseException as e:
        if slot.report_fd is not None:
            os.write(slot.report_fd, f"{type(e).__name__}: {e}".encode())
        raise
    return 0


def _remove_groups(cgroups, slot_pids: list[int]) -> None:
    """At exit: give idle slots a moment to remove their prepared groups, then remove ours."""
    if cgroups is None:
        return
    deadline = time.monotonic() + 2.0
    while any(_alive(pid) for pid in slot_pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    confinement.remove_groups(cgroups.paths)  # a call still running keeps its group: the caller removes it later


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
