"""What contains a call of the local backend: namespaces, an allow-listed root, cgroups, seccomp.

sandbox.py's containment sequence calls these in the fork server's slots; docs/02-isolation.md says why each exists.
Each raises naming what could not be set up: the sandbox never runs code with less than it promised.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import platform
import re
import struct
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import runner

# -------------------------------------- Linux calls Python 3.11 does not wrap (os.unshare and os.setns arrived in 3.12)

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38  # PR_SET_SECCOMP: runner.py
_LIBC = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def unshare(flags: int) -> None:
    _check(_LIBC.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_LIBC.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [s.encode() if s is not None else None for s in (source, target, fstype, data)]
    _check(_LIBC.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")


def umount(target: str) -> None:
    _check(_LIBC.umount2(target.encode(), ctypes.c_int(MNT_DETACH)), f"umount {target}")


prctl = runner.prctl  # runner.py's, which travels alone into every container


# --------------------------------------------------- User namespaces: the same containment for a caller who is not root

CALL_UID = 65534  # the code's uid inside its own user namespace ("nobody"); outside, the caller's uid


def enter_user_namespace() -> None:
    """The fork server, when not root: uid 0 of a user namespace mapped to the caller's uid, and PID 1 of a PID
    namespace it owns (a fork; this process waits and exits with it). Raises OSError naming the refusal."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        unshare(CLONE_NEWUSER | CLONE_NEWPID)
    except OSError as e:
        raise OSError(e.errno, f"the kernel refuses an unprivileged user namespace ({e.strerror}; see "
                      "/proc/sys/user/max_user_namespaces, kernel.unprivileged_userns_clone, "
                      "kernel.apparmor_restrict_unprivileged_userns, or a seccomp profile of a container)") from None
    _write(None, "/proc/self/setgroups", "deny")  # the one mapping an unprivileged process may write requires it
    _write(None, "/proc/self/uid_map", f"0 {uid} 1")
    _write(None, "/proc/self/gid_map", f"0 {gid} 1")
    pid = os.fork()
    if pid:
        for fd in (0, 1):  # the caller's pipes are the server's now
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    prctl(PR_SET_PDEATHSIG, 9)  # SIGKILL: if the caller kills the process it started, the server goes too


def enter_call_user_namespace() -> None:
    """In the code's process (userns): a user namespace of the call's own, where the code is CALL_UID with no
    capability: no right over the slot's namespaces, and RLIMIT_NPROC (counted per user namespace) is per call."""
    unshare(CLONE_NEWUSER)
    _write(None, "/proc/self/uid_map", f"{CALL_UID} 0 1")
    _write(None, "/proc/self/setgroups", "deny")
    _write(None, "/proc/self/gid_map", f"{CALL_UID} 0 1")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(_LIBC.capset(header, (ctypes.c_uint32 * 6)()), "capset")  # effective, permitted, inheritable: none


# ------------------------------------------------------ The file system: a fresh root that holds only what Python needs

SYSTEM_LIBRARIES = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # the only places the code may write: one empty tmpfs behind all three, per call
WORKDIR = "/tmp/work"
# /proc's views of the kernel's keys (the caller's keyring, each user's counts): the filter denies key calls, not reads
PROC_MASKED = ("/proc/keys", "/proc/key-users")
# The machine's counters, which one call moves and the next reads (docs/02-isolation.md, channels): a copy of each
# with every number 0 is bound over it, its lines and names kept for what counts CPUs by them.
PROC_COUNTERS = ("/proc/stat", "/proc/vmstat", "/proc/zoneinfo", "/proc/diskstats", "/proc/softirqs", "/proc/interrupts",
                 "/proc/sys/fs/dentry-state", "/proc/sys/fs/inode-nr", "/proc/sys/fs/inode-state")
_NUMBER = re.compile(r"(?<![\w.-])\d+(?![\w.:-])")  # a number on its own: not the 0 of cpu0, the 2 of 2-edge or an interrupt line 9:
SHELL = "/bin/sh"  # subprocess(..., shell=True) runs it: bound alone, so a command it names that is not Python fails by name
SCRATCH_INODES = 16384  # files and folders the scratch tmpfs holds: each is kernel memory too
_BUILD_AT = "/tmp"  # where the new root is assembled in the slot's own mount namespace, before pivot_root
_ETC = {  # a minimal /etc: who is who, and the loader's cache so that native libraries load as usual
    "passwd": "root:x:0:0:root:/root:/bin/false\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost\n",
}


def interpreter_paths() -> list[str]:
    """The interpreter's files: executable, shared library, standard library, site-packages. A venv's prefix comes
    whole (it holds nothing else); a system prefix such as /usr only through its Python folders."""
    paths = {os.path.realpath(sys.executable)}
    for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        found = sysconfig.get_paths(vars=scheme_vars)
        paths.update(found[key] for key in ("stdlib", "platstdlib", "purelib", "platlib"))
    paths.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages", "lib-dynload")))
    if sys.prefix != sys.base_prefix:
        paths.add(sys.prefix)
    library = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("LDLIBRARY") or "")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and os.path.isfile(library):
        paths.update({library, os.path.realpath(library)})
    real = sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})
    return [p for p in real if not any(_inside(p, q) for q in real)]  # a path inside another comes with it


def build_root() -> dict[str, int]:
    """Once per slot, after mount_proc: pivot into a small read-only tmpfs holding only the allow list. Returns O_PATH
    descriptors of interpreter folders inside a scratch dir (a venv under /tmp), which each call's scratch rebinds."""
    system = [p for p in SYSTEM_LIBRARIES if os.path.isdir(p) and not os.path.islink(p)]
    # A system Python's own folders (/usr/lib/python3.11) come with the system libraries.
    binds = [p for p in interpreter_paths() if not any(p == d or _inside(p, d) for d in system)] + system
    links = {p: os.readlink(p) for p in SYSTEM_LIBRARIES if os.path.islink(p)}
    links.update({"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0", "/dev/stdout": "/proc/self/fd/1",
                  "/dev/stderr": "/proc/self/fd/2"})
    # The name the code's subprocesses use, and each link on the way to the file (a venv's python ->
    # python3 -> /root/.pyenv/.../python3 -> python3.11): a link outside the binds is made again.
    executable = sys.executable
    for _ in range(40):  # the kernel's own bound on a chain of links
        if not os.path.islink(executable):
            break
        target = os.readlink(executable)
        if not any(executable == b or _inside(executable, b) for b in binds):
            links[executable] = target
        executable = os.path.join(os.path.dirname(executable), target)
    files = [path for path in ("/etc/ld.so.cache",) if os.path.isfile(path)]
    # Descriptors first: the sources may lie under the folder the new root is built on.
    sources = {path: os.open(path, os.O_PATH) for path in binds + files + list(DEVICES) + ["/proc"]}
    if os.path.isfile(SHELL):  # the shell's own file, wherever its links lead (/bin/sh -> dash, /bin -> usr/bin)
        sources[SHELL] = os.open(os.path.realpath(SHELL), os.O_PATH)
    root = _BUILD_AT
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, fd in sources.items():
        target = root + path
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(target, mode=0o755, exist_ok=True)
        else:
            open(target, "w").close()
        mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
        # Read-only and nosuid; devices keep dev (a nodev /dev/null cannot be opened); /proc keeps its own flags.
        if path != "/proc":
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
            mount(None, target, None, flags if path in DEVICES else flags | MS_NODEV)
        os.close(fd)
    for path, target in links.items():
        os.makedirs(os.path.dirname(root + path), mode=0o755, exist_ok=True)
        os.symlink(target, root + path)
    for path in ("/proc", "/etc", *SCRATCH_DIRS):
        os.makedirs(root + path, mode=0o755, exist_ok=True)
    for name, text in _ETC.items():
        Path(f"{root}/etc/{name}").write_text(text)
    os.chdir(root)
    _check(_LIBC.syscall(ctypes.c_long(SYSCALLS["pivot_root"]), b".", b"."), "pivot_root")  # the old root now sits on top of the new one ...
    umount(".")  # ... and goes, with every mount of the machine under it
    os.chdir("/")
    for path in PROC_MASKED:  # as Docker masks them: /dev/null bound over each
        mount("/dev/null", path, None, MS_BIND)
    for path in PROC_COUNTERS:
        _bind_counters_at_zero(path)
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return {p: os.open(p, os.O_PATH) for p in binds if any(_inside(p, d) for d in SCRATCH_DIRS)}


def _bind_counters_at_zero(path: str) -> None:
    """Bind over a /proc file of counters, where it exists, a copy with every number 0 (btime kept), then unlink it."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return
    text = "".join((line if line.startswith("btime") else _NUMBER.sub("0", line)) + "\n" for line in lines)
    copy = "/.counters"
    Path(copy).write_text(text)
    mount(copy, path, None, MS_BIND)
    mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.unlink(copy)


def mount_proc() -> tuple[int, int]:
    """A /proc of the slot's PID namespace with hidepid=2, mounted before build_root (why: docs/02-isolation.md).
    Returns descriptors of its PID counter and of a second proc without hidepid, for the memory watch, only the slot's."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        every_process = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)  # below the next: never in the code's root
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    except PermissionError as e:
        raise PermissionError(e.errno, f"{e.strerror} (in a user namespace the kernel mounts a new /proc only where "
                              "the machine's is wholly visible, not masked as in many containers)") from None
    return os.open("/proc/sys/kernel/ns_last_pid", os.O_WRONLY), every_process


_MOUNTED_SCRATCH: list[str] = []  # this slot's scratch mounts, in the order they were made


def fresh_scratch(max_file_mb: int, interpreter_in_scratch: dict[str, int], uid: int | None) -> str:
    """Per call: one empty tmpfs of 4 x max_file_mb (the previous call's detached) on /tmp, a folder of it bound over
    each scratch dir, /tmp's last so that the tmpfs's own root stays hidden; and a work dir for uid."""
    while _MOUNTED_SCRATCH:
        umount(_MOUNTED_SCRATCH.pop())
    below = SCRATCH_DIRS[0]
    mount("tmpfs", below, "tmpfs", MS_NOSUID | MS_NODEV, f"size={4 * max_file_mb}m,nr_inodes={SCRATCH_INODES},mode=0755")
    _MOUNTED_SCRATCH.append(below)
    for path in sorted(SCRATCH_DIRS, key=lambda p: p == below):  # /tmp last: it covers the folders of the others
        folder = f"{below}/{path.strip('/').replace('/', '-')}"
        os.mkdir(folder, 0o1777)
        os.chmod(folder, 0o1777)  # past the umask
        mount(folder, path, None, MS_BIND)
        _MOUNTED_SCRATCH.append(path)
        for folder_of_python, fd in interpreter_in_scratch.items():  # build_root's: bound back, read-only
            if _inside(folder_of_python, path):
                os.makedirs(folder_of_python, mode=0o755, exist_ok=True)
                mount(f"/proc/self/fd/{fd}", folder_of_python, None, MS_BIND)
                mount(None, folder_of_python, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
                _MOUNTED_SCRATCH.append(folder_of_python)
    os.mkdir(WORKDIR, 0o700)
    if uid is not None:  # userns: the slot's own uid, which is the code's in the call's user namespace
        os.chown(WORKDIR, uid, uid)
    return WORKDIR


def plain_workdir(uid: int | None) -> str:
    """Per call, in plain isolation: a new temporary folder of the machine's, owned by the call's uid."""
    workdir = tempfile.mkdtemp(prefix="sandbox-work-")
    if uid is not None:
        os.chown(workdir, uid, uid)
    return workdir


def _inside(path: str, folder: str) -> bool:
    return path != folder and path.startswith(folder.rstrip("/") + "/")


def call_uid(token: int) -> int:
    """A uid of its own per slot, so that RLIMIT_NPROC counts only this call; nobody where ids are scarce."""
    uid = 100000 + ((os.getpid() % (1 << 20)) << 10 | token % 1024)  # called in the server: its pid and the slot's token
    try:
        for line in Path("/proc/self/uid_map").read_text().splitlines():
            inner, _, count = (int(x) for x in line.split())
            if inner <= uid < inner + count:
                return uid
    except (OSError, ValueError):
        pass
    return 65534


# ------------------------------ Cgroups: every page the call touches (heap, memfds, tmpfs, page cache) is charged to it


class Cgroups:
    """A group per call under a group of this server's own, in cgroup v1 (memory + pids) or v2, made through
    descriptors opened before pivot_root (a slot's root holds no /sys). The code's process joins it, still root."""

    def __init__(self, name: str) -> None:
        self.version, self.paths = _find_cgroups()
        self.bases: list[int] = []
        try:
            for path in self.paths:
                remove_groups([f"{path}/{name}"])  # left by a killed server whose pid was ours, if any
                if os.path.isdir(f"{path}/{name}"):  # it still holds a process: say so, not mkdir's "File exists"
                    raise OSError(errno.EBUSY, f"{path}/{name}, left by a killed server, still holds a process")
                os.mkdir(f"{path}/{name}", 0o700)
                self.bases.append(os.open(f"{path}/{name}", os.O_RDONLY | os.O_DIRECTORY))
                if self.version == 2:
                    _write(self.bases[-1], "cgroup.subtree_control", "+memory +pids")
        except OSError as e:
            for fd in self.bases:
                os.close(fd)
            raise OSError(e.errno, f"cannot create a cgroup under {self.paths}: {e.strerror}") from None
        self.paths = [f"{path}/{name}" for path in self.paths]


def remove_groups(paths: list[str]) -> None:
    """A server's groups, each with the call groups left in it; one that still holds a process stays."""
    for group in paths:
        for path in sorted(Path(group).glob("call-*")) + [Path(group)]:
            with contextlib.suppress(OSError):
                path.rmdir()


class CallGroup:
    """One call's groups: limits written and joined by the code's process, removed after the call."""

    def __init__(self, groups: Cgroups, name: str) -> None:
        self.groups, self.name = groups, name
        self.dirs = []
        for base in groups.bases:
            os.mkdir(name, 0o700, dir_fd=base)
            self.dirs.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=base))

    def join(self, memory_mb: int, max_processes: int) -> None:
        """In the code's process, still root: set the limits, then move itself in."""
        limit = str(memory_mb * 1024 * 1024)
        if self.groups.version == 1:
            memory, pids = self.dirs
            _write(memory, "memory.limit_in_bytes", limit)
            _write(memory, "memory.memsw.limit_in_bytes", limit, optional=True)  # swap counted too, where it is accounted
            _write(memory, "memory.swappiness", "0", optional=True)
            _write(pids, "pids.max", str(max_processes))
        else:
            (both,) = self.dirs
            _write(both, "memory.max", limit)
            _write(both, "memory.swap.max", "0", optional=True)
            _write(both, "memory.oom.group", "1", optional=True)  # an OOM kill takes the whole call
            _write(both, "pids.max", str(max_processes))
        for fd in self.dirs:
            _write(fd, "cgroup.procs", "0")  # 0: the writing process itself
            os.close(fd)

    TICK = 0.01  # seconds between two looks at the call's OOM kills

    def over(self, memory_mb: int, until: float) -> bool:
        """An OOM kill ends the whole call: cgroup v1 kills only the process it picked, and the rest would go on."""
        return self.oom_killed()

    def oom_killed(self) -> bool:
        name = "memory.oom_control" if self.groups.version == 1 else "memory.events"
        try:
            counts = dict(line.split() for line in _read(self.dirs[0], name).splitlines() if line.strip())
            return int(counts.get("oom_kill", "0")) > 0
        except ValueError:
            return False

    def remove(self) -> None:
        for fd in self.dirs:
            os.close(fd)
        for base in self.groups.bases:
            for _ in range(100):  # the last exiting tasks may take a moment to leave
                try:
                    os.rmdir(self.name, dir_fd=base)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    os.sched_yield()


class MemoryWatch:
    """Where no cgroup can be had: every TICK seconds of the wait the slot sums what a cgroup would charge the call
    and kills it past memory_mb (what it counts, and what closes the rest: docs/02-isolation.md)."""

    TICK = 0.01

    def __init__(self, proc: int) -> None:
        self.proc = proc  # a descriptor of the slot's /proc without hidepid
        me = str(os.getpid())
        self.base_kb = _held_kb(proc, me, _PROPORTIONAL) or 0  # the slot's share of the pages its forks inherit
        self.mappings = {me: _count_mappings(proc, me) or 0}  # pid -> mappings at its last count (a new one: its parent's)
        self.killed = False

    def join(self, memory_mb: int, max_processes: int) -> None:
        """Nothing to join: the slot watches (the code's process calls this where it would join a cgroup)."""

    def over(self, memory_mb: int, until: float = float("inf")) -> bool:
        """Does the call hold more than memory_mb (once it did, it stays "OOM-killed")? Past `until`, the deadline,
        it answers what it knows. A non-dumpable process refuses its smaps_rollup and counts whole."""
        me, cap_kb, status = str(os.getpid()), memory_mb * 1024, {}
        for pid in os.listdir(self.proc):
            if pid.isdigit() and pid != me:
                status[pid] = _fields(self.proc, pid, "status", "RssAnon")
        self._count_one(status, until)
        kernel = sum(self._kernel_kb(pid, fields) for pid, fields in status.items())
        resident = {pid: _sum_kb(fields, _RESIDENT[1]) for pid, fields in status.items()}
        if sum(resident.values()) + kernel - self.base_kb > cap_kb:
            total = kernel
            for pid, kb in resident.items():
                if time.monotonic() > until:
                    return self.killed  # the deadline ends the call; an unfinished sum decides nothing
                share = _held_kb(self.proc, pid, _PROPORTIONAL)
                total += kb if share is None else share
            self.killed = self.killed or total - self.base_kb > cap_kb
        return self.killed

    def _kernel_kb(self, pid: str, fields: dict[str, int]) -> float:
        """A process's kernel memory: status's counts (_KERNEL_KB) and its mappings at their last count."""
        if pid not in self.mappings:  # a fork copies its parent's mappings
            self.mappings[pid] = self.mappings.get(str(fields.get("PPid")), self.mappings[str(os.getpid())])
        return sum(_sum_kb(fields, (name,)) * kb for name, kb in _KERNEL_KB.items()) + self.mappings[pid] * VMA_KB

    def _count_one(self, status: dict[str, dict[str, int]], until: float) -> None:
        """Count one process's mappings a tick (a maps file is dear): new ones first, then the longest uncounted."""
        me = str(os.getpid())
        for pid in [pid for pid in self.mappings if pid != me and pid not in status]:
            del self.mappings[pid]
        waiting = [pid for pid in status if pid not in self.mappings] + [pid for pid in self.mappings if pid in status]
        if waiting and time.monotonic() < until:
            pid = waiting[0]
            counted = _count_mappings(self.proc, pid)
            if counted is None:  # refused (non-dumpable): as many as its address space can hold
                counted = min(_sum_kb(status[pid], ("VmSize",)) // 4, _max_map_count(self.proc))
            self.mappings.pop(pid, None)
            self.mappings[pid] = counted  # last in the order: counted most recently

    def oom_killed(self) -> bool:
        return self.killed

    def remove(self) -> None:
        pass


# (file, fields) of anonymous memory, private or shared, resident or swapped: status counts pages whole, smaps_rollup
# the process's share of each
_RESIDENT = ("status", ("RssAnon", "RssShmem", "VmSwap"))
_PROPORTIONAL = ("smaps_rollup", ("Pss_Anon", "Pss_Shmem", "SwapPss"))
# Kernel memory a cgroup charges and no page shows, kB per unit of a status field: page tables, stacks, descriptor slots
_KERNEL_KB = {"VmPTE": 1.0, "Threads": 16.0, "FDSize": 0.5}
VMA_KB = 0.25  # a mapping (VMA): its vm_area_struct and share of the maple tree, about 0.2 kB measured


def _sum_kb(fields: dict[str, int], names: tuple[str, ...]) -> int:
    return sum(fields.get(name, 0) for name in names)


# The watch reads /proc into this buffer alone and zeroes what it read: no name the code chose stays in the slot's heap.
_PROC_BUFFER = bytearray(1 << 16)


def _read_into_buffer(proc: int, path: str, each) -> bool:
    """Read proc/path into _PROC_BUFFER, each(size) on every chunk, zeroed after it; False where gone or refused."""
    try:
        fd = os.open(path, os.O_RDONLY, dir_fd=proc)
    except OSError:
        return False
    size = 0
    try:
        while True:
            size = os.readv(fd, [_PROC_BUFFER])
            if not size:
                return True
            each(size)
            _PROC_BUFFER[:size] = bytes(size)
    except OSError:
        return False
    finally:
        _PROC_BUFFER[:size] = bytes(size)
        os.close(fd)


def _count_mappings(proc: int, pid: str) -> int | None:
    """How many mappings (VMAs) a process has: lines of its maps; None once it is gone, or where it is refused."""
    for path in _task_paths(proc, pid, "maps"):
        lines: list[int] = []
        if not _read_into_buffer(proc, path, lambda size: lines.append(_PROC_BUFFER.count(b"\n", 0, size))):
            return None
        if sum(lines):
            return sum(lines)
    return None


@functools.cache
def _max_map_count(proc: int) -> int:
    """vm.max_map_count, the most mappings a process may have; read once."""
    return int(_read(proc, "sys/vm/max_map_count") or 65530)


def _held_kb(proc: int, pid: str, kind: tuple[str, tuple[str, ...]]) -> int | None:
    """What a process holds in memory (kind's fields), in kB; None once it is gone, or where it is refused."""
    name, held = kind
    fields = _fields(proc, pid, name, held[0])
    return _sum_kb(fields, held) if held[0] in fields else None


def _fields(proc: int, pid: str, name: str, first: str) -> dict[str, int]:
    """The _WATCHED numbers of /proc/PID/name; where the leader exited (its files show no memory), a thread's."""
    fields = {}
    for path in _task_paths(proc, pid, name):
        fields = _numbers(proc, path)
        if fields.get(first) is not None:
            break
    return fields


def _task_paths(proc: int, pid: str, name: str):
    """PID/name, then the same file of each of its threads."""
    yield f"{pid}/{name}"
    try:
        fd = os.open(f"{pid}/task", os.O_RDONLY | os.O_DIRECTORY, dir_fd=proc)
        try:
            threads = os.listdir(fd)
        finally:
            os.close(fd)
    except OSError:
        threads = []
    for tid in threads:
        yield f"{pid}/task/{tid}/{name}"


_WATCHED = (*_RESIDENT[1], *_PROPORTIONAL[1], *_KERNEL_KB, "PPid", "VmSize")  # numbers only, never a name


def _numbers(proc: int, path: str) -> dict[str, int]:
    """The _WATCHED fields of a status-like file as numbers ({} where gone): only digits leave the buffer."""
    found = {}

    def parse(size: int) -> None:
        for name in _WATCHED:
            at = _PROC_BUFFER.find(b"\n" + name.encode() + b":", 0, size)
            if at >= 0:
                start = at + len(name) + 2
                end = _PROC_BUFFER.find(b"\n", start, size)
                digits = _PROC_BUFFER[start:end if end >= 0 else size].split()
                if digits and digits[0].isdigit():
                    found[name] = int(digits[0])

    return found if _read_into_buffer(proc, path, parse) else {}


def _read(dir_fd: int, path: str) -> str:
    """A small file's text; '' where it is gone already, or refused."""
    try:
        fd = os.open(path, os.O_RDONLY, dir_fd=dir_fd)
        try:
            return os.read(fd, 1 << 16).decode()
        finally:
            os.close(fd)
    except OSError:
        return ""


def _write(dir_fd: int | None, name: str, text: str, optional: bool = False) -> None:
    """optional: a file this kernel lacks, or a value it refuses, is passed over; a file it will not open is not."""
    try:
        fd = os.open(name, os.O_WRONLY, dir_fd=dir_fd)
    except FileNotFoundError:
        if optional:
            return
        raise
    try:
        os.write(fd, text.encode())
    except OSError:
        if not optional:
            raise
    finally:
        os.close(fd)


def _find_cgroups() -> tuple[int, list[str]]:
    """(version, [folders to create groups in]): v1 memory and pids, else v2 with both; OSError saying why neither."""
    mounts: dict[str, tuple[str, str]] = {}  # controller or "v2" -> (mount point, root of the mount)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ")
        fields, (fstype, _, options) = left.split(), right.split()[:3]
        # A later mount over a folder hides the earlier ones at or below it.
        mounts = {k: v for k, v in mounts.items() if not (v[0] == fields[4] or _inside(v[0], fields[4]))}
        if fstype == "cgroup":
            for controller in ("memory", "pids"):
                if controller in options.split(","):
                    mounts[controller] = (fields[4], fields[3])
        elif fstype == "cgroup2":
            mounts.setdefault("v2", (fields[4], fields[3]))
    own: dict[str, str] = {}  # controller or "v2" -> this process's cgroup
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        own.update(dict.fromkeys(controllers.split(",") if controllers else ["v2"], path))

    def folder(key: str) -> str:
        point, root = mounts[key]
        path = own.get(key, "/")
        path = path[len(root):] if root != "/" and path.startswith(root) else path
        return os.path.normpath(point + "/" + path)

    if "memory" in mounts and "pids" in mounts:
        paths = [folder("memory"), folder("pids")]
        if all(os.access(p, os.W_OK) for p in paths):
            return 1, paths
        if "v2" not in mounts or os.geteuid() == 0:
            raise OSError(13, f"cgroup v1 memory and pids are mounted but {paths} are not writable (root is needed)")
    if "v2" not in mounts:  # (not root and v1 not writable: a delegated cgroup v2 is the one chance left)
        raise OSError(2, "neither cgroup v1 memory and pids nor cgroup v2 is mounted")
    path, point = folder("v2"), mounts["v2"][0]
    try:
        available = Path(f"{path}/cgroup.controllers").read_text().split()
    except OSError as e:
        raise OSError(e.errno, f"cgroup v2 at {path} is not readable: {e.strerror}") from None
    if not {"memory", "pids"} <= set(available):
        raise OSError(2, f"cgroup v2 at {path} offers {available}, without memory and pids")
    # A cgroup that holds processes (ours holds the caller) cannot hand controllers to children, except the root: our
    # groups go under the nearest cgroup that already does, ours or an ancestor, or under the root, which we may enable.
    candidate = path
    while True:
        enabled = Path(f"{candidate}/cgroup.subtree_control").read_text().split()
        # Not root: the call's process must also be allowed to move itself in below it.
        if {"memory", "pids"} <= set(enabled) and os.access(f"{candidate}/cgroup.procs", os.W_OK):
            return 2, [candidate]
        if candidate == point:
            break
        candidate = os.path.dirname(candidate)
    try:
        Path(f"{point}/cgroup.subtree_control").write_text("+memory +pids")
        return 2, [point]
    except OSError as e:
        raise OSError(e.errno, f"cgroup v2: no cgroup from {path} up to {point} hands memory and pids to its "
                      f"children, and the root refuses ({e.strerror}); run the lab in a delegated cgroup, "
                      "e.g. systemd-run --scope -p Delegate=yes") from None


# -------------------------------------- Seccomp: a small BPF program, installed through prctl in the code's own process

# The calls the filter allows, what the lab's workloads call, name=(x86_64, aarch64) of asm/unistd_64.h and
# asm-generic/unistd.h (None: the machine lacks it), grouped as docs/02-isolation.md compares them with Docker's.
_ALLOWED = dict(
    # files and descriptors: the scratch tmpfs, the read-only root, pipes
    read=(0, 63), write=(1, 64), readv=(19, 65), writev=(20, 66), pread64=(17, 67), pwrite64=(18, 68), preadv=(295, 69),
    pwritev=(296, 70), open=(2, None), openat=(257, 56), openat2=(437, 437), creat=(85, None), close=(3, 57),
    close_range=(436, 436), dup=(32, 23), dup2=(33, None), dup3=(292, 24), lseek=(8, 62), stat=(4, None), fstat=(5, 80),
    lstat=(6, None), newfstatat=(262, 79), statx=(332, 291), statfs=(137, 43), fstatfs=(138, 44), access=(21, None),
    faccessat=(269, 48), faccessat2=(439, 439), readlink=(89, None), readlinkat=(267, 78), getdents=(78, None),
    getdents64=(217, 61), getcwd=(79, 17), chdir=(80, 49), fchdir=(81, 50), mkdir=(83, None), mkdirat=(258, 34),
    rmdir=(84, None), rename=(82, None), renameat=(264, 38), renameat2=(316, 276), unlink=(87, None),
    unlinkat=(263, 35), link=(86, None), linkat=(265, 37), symlink=(88, None), symlinkat=(266, 36), chmod=(90, None),
    fchmod=(91, 52), fchmodat=(268, 53), fchmodat2=(452, 452), chown=(92, None), fchown=(93, 55), fchownat=(260, 54),
    lchown=(94, None), umask=(95, 166), truncate=(76, 45), ftruncate=(77, 46), fallocate=(285, 47), utime=(132, None),
    utimes=(235, None), utimensat=(280, 88), futimesat=(261, None), mknod=(133, None), mknodat=(259, 33),
    sendfile=(40, 71), copy_file_range=(326, 285), splice=(275, 76), tee=(276, 77), pipe=(22, None), pipe2=(293, 59),
    readahead=(187, 213),
    # waiting on descriptors
    select=(23, None), pselect6=(270, 72), poll=(7, None), ppoll=(271, 73), epoll_ctl=(233, 21), epoll_wait=(232, None),
    epoll_pwait=(281, 22), epoll_pwait2=(441, 441), eventfd=(284, None), eventfd2=(290, 19), signalfd=(282, None),
    signalfd4=(289, 74), timerfd_create=(283, 85), timerfd_settime=(286, 86), timerfd_gettime=(287, 87),
    # memory of its own
    brk=(12, 214), mmap=(9, 222), munmap=(11, 215), mremap=(25, 216), mprotect=(10, 226),
    # processes and threads (clone by its flags, below)
    fork=(57, None), vfork=(58, None), execve=(59, 221), execveat=(322, 281), exit=(60, 93), exit_group=(231, 94),
    wait4=(61, 260), waitid=(247, 95), getpid=(39, 172), getppid=(110, 173), gettid=(186, 178), getpgrp=(111, None),
    getpgid=(121, 155), setpgid=(109, 154), getsid=(124, 156), setsid=(112, 157), set_tid_address=(218, 96),
    set_robust_list=(273, 99), rseq=(334, 293), futex=(202, 98), sched_yield=(24, 124), sched_getaffinity=(204, 123),
    sched_getparam=(143, 121), sched_getscheduler=(145, 120), sched_getattr=(315, 275),
    sched_get_priority_max=(146, 125), sched_get_priority_min=(147, 126), sched_rr_get_interval=(148, 127),
    getpriority=(140, 141), getrlimit=(97, 163), setrlimit=(160, 164), getrusage=(98, 165), times=(100, 153),
    getuid=(102, 174), geteuid=(107, 175), getgid=(104, 176), getegid=(108, 177), getgroups=(115, 158),
    getresuid=(118, 148), getresgid=(120, 150), capget=(125, 90), uname=(63, 160), sysinfo=(99, 179),
    getrandom=(318, 278), getcpu=(309, 168), arch_prctl=(158, None), restart_syscall=(219, 128),
    # signals and time
    rt_sigaction=(13, 134), rt_sigprocmask=(14, 135), rt_sigreturn=(15, 139), rt_sigpending=(127, 136),
    rt_sigtimedwait=(128, 137), rt_sigsuspend=(130, 133), sigaltstack=(131, 132), pause=(34, None), alarm=(37, None),
    getitimer=(36, 102), setitimer=(38, 103), timer_create=(222, 107), timer_settime=(223, 110),
    timer_gettime=(224, 108), timer_getoverrun=(225, 109), timer_delete=(226, 111), clock_gettime=(228, 113),
    clock_getres=(229, 114), clock_nanosleep=(230, 115), nanosleep=(35, 101), gettimeofday=(96, 169), time=(201, None),
)
# Allowed only where a cgroup counts the call's memory: memfds, epoll watches and System V IPC hold memory no page shows
_CGROUP_ONLY = dict(
    memfd_create=(319, 279), epoll_create=(213, None), epoll_create1=(291, 20), shmget=(29, 194), shmat=(30, 196),
    shmdt=(67, 197), shmctl=(31, 195), semget=(64, 190), semop=(65, 193), semtimedop=(220, 192), semctl=(66, 191),
    msgget=(68, 186), msgsnd=(69, 189), msgrcv=(70, 188), msgctl=(71, 187),
)
# Answered 0 without reaching the kernel: a sync reaches the machine's disk; a lock on files every slot binds carries
# bits between calls (sqlite3 and lockf in one call need only the answer).
_NO_EFFECT = dict(
    fsync=(74, 82), fdatasync=(75, 83), sync=(162, 81), syncfs=(306, 267), sync_file_range=(277, 84), msync=(26, 227),
    flock=(73, 32),
)
# Extended attributes fail as on a file system without them (EOPNOTSUPP: shutil.copy2 goes on without them)
_NO_XATTRS = dict(
    getxattr=(191, 8), lgetxattr=(192, 9), fgetxattr=(193, 10), listxattr=(194, 11), llistxattr=(195, 12),
    flistxattr=(196, 13), setxattr=(188, 5), lsetxattr=(189, 6), fsetxattr=(190, 7), removexattr=(197, 14),
    lremovexattr=(198, 15), fremovexattr=(199, 16),
)
ALLOWED, CGROUP_ONLY, NO_EFFECT, NO_XATTRS = (tuple(d) for d in (_ALLOWED, _CGROUP_ONLY, _NO_EFFECT, _NO_XATTRS))
# Calls allowed by an argument. fcntl: these; record locks answered 0, as flock; the rest EPERM (docs/02-isolation.md).
FCNTL_ALLOWED = {"F_DUPFD": 0, "F_GETFD": 1, "F_SETFD": 2, "F_GETFL": 3, "F_SETFL": 4, "F_DUPFD_CLOEXEC": 1030,
                 "F_GETPIPE_SZ": 1032, "F_ADD_SEALS": 1033, "F_GET_SEALS": 1034}
FCNTL_LOCKS = {"F_GETLK": 5, "F_SETLK": 6, "F_SETLKW": 7, "F_OFD_GETLK": 36, "F_OFD_SETLK": 37, "F_OFD_SETLKW": 38}
# ioctl: a terminal's questions (isatty, its size) and a descriptor's flags; any other request fails with ENOTTY,
# as on a file that has no such request (CPython's os.set_inheritable uses FIOCLEX, and fails on EPERM)
IOCTL_ALLOWED = {"TCGETS": 0x5401, "TIOCGPGRP": 0x540F, "TIOCGWINSZ": 0x5413, "FIONREAD": 0x541B, "FIONBIO": 0x5421,
                 "FIONCLEX": 0x5450, "FIOCLEX": 0x5451}
# prctl: these options, of the process itself; any other EINVAL, as an option the kernel does not know (PR_FUTEX_HASH)
PRCTL_ALLOWED = {"PR_SET_PDEATHSIG": 1, "PR_GET_PDEATHSIG": 2, "PR_GET_DUMPABLE": 3, "PR_SET_DUMPABLE": 4,
                 "PR_SET_NAME": 15, "PR_GET_NAME": 16, "PR_GET_SECCOMP": 21, "PR_SET_NO_NEW_PRIVS": 38,
                 "PR_GET_NO_NEW_PRIVS": 39}
# madvise: advice about the process's own memory; any other EINVAL. Left out: MADV_COLD and MADV_PAGEOUT (they evict
# a file's pages from the page cache, a channel), MADV_MERGEABLE (merged with others' pages), MADV_COLLAPSE, root's
MADVISE_ALLOWED = {"MADV_NORMAL": 0, "MADV_RANDOM": 1, "MADV_SEQUENTIAL": 2, "MADV_WILLNEED": 3, "MADV_DONTNEED": 4,
                   "MADV_FREE": 8, "MADV_REMOVE": 9, "MADV_DONTFORK": 10, "MADV_DOFORK": 11, "MADV_HUGEPAGE": 14,
                   "MADV_NOHUGEPAGE": 15, "MADV_DONTDUMP": 16, "MADV_DODUMP": 17, "MADV_WIPEONFORK": 18,
                   "MADV_KEEPONFORK": 19, "MADV_POPULATE_READ": 22, "MADV_POPULATE_WRITE": 23}
# posix_fadvise: these hints; any other is answered 0 and ignored, as any hint may be (DONTNEED evicts shared pages)
FADVISE_ALLOWED = {"POSIX_FADV_NORMAL": 0, "POSIX_FADV_RANDOM": 1, "POSIX_FADV_SEQUENTIAL": 2,
                   "POSIX_FADV_WILLNEED": 3, "POSIX_FADV_NOREUSE": 5}
# Allowed on the calling process only (each listed argument 0): the slot, of the same uid, would pass them on.
SELF_ONLY = {"prlimit64": (0,), "setpriority": (0, 1), "sched_setaffinity": (0,), "sched_setscheduler": (0,),
             "sched_setparam": (0,), "sched_setattr": (0,)}
# Calls that send a signal, and which argument is its number: real-time ones (32 and up) queue past every limit.
SIGNAL_SENDERS = {"kill": 1, "tkill": 1, "tgkill": 2, "rt_sigqueueinfo": 1, "rt_tgsigqueueinfo": 2}
_REALTIME = 32
# No socket, IP families failing as without a network (why: docs/02-isolation.md). Math code needs none.
NETWORK_FAMILIES = {"AF_INET": 2, "AF_INET6": 10}
# preadv2 and pwritev2 with RWF_NOWAIT (EOPNOTSUPP): EAGAIN tells a page the cache lacks from one it holds
RWF_NOWAIT = 8
CLONE_PIDFD = 0x1000  # a pidfd from clone: its inode number is a counter of the machine
# The newest call the list was judged against (file_setattr, Linux 6.17): a newer one gets ENOSYS, so libc falls back.
NEWEST = 469
# The numbers of the calls judged by an argument, and of others build_root and the tests make (each fails as unlisted)
_NUMBERS = dict(
    **_ALLOWED, **_CGROUP_ONLY, **_NO_EFFECT, **_NO_XATTRS,
    fcntl=(72, 25), ioctl=(16, 29), prctl=(157, 167), madvise=(28, 233), fadvise64=(221, 223), socket=(41, 198),
    socketpair=(53, 199), preadv2=(327, 286), pwritev2=(328, 287), clone=(56, 220), clone3=(435, 435), kill=(62, 129),
    tkill=(200, 130), tgkill=(234, 131), rt_sigqueueinfo=(129, 138), rt_tgsigqueueinfo=(297, 240), prlimit64=(302, 261),
    setpriority=(141, 140), sched_setaffinity=(203, 122), sched_setscheduler=(144, 119), sched_setparam=(142, 118),
    sched_setattr=(314, 274), keyctl=(250, 219), add_key=(248, 217), request_key=(249, 218), ptrace=(101, 117),
    mount=(165, 40), umount2=(166, 39), pivot_root=(155, 41), unshare=(272, 97), setns=(308, 268), bpf=(321, 280),
    perf_event_open=(298, 241), userfaultfd=(323, 282), kexec_load=(246, 104), init_module=(175, 105),
    io_setup=(206, 0), io_uring_setup=(425, 425), mincore=(27, 232), cachestat=(451, 451), pidfd_open=(434, 434),
    inotify_init1=(294, 26), landlock_create_ruleset=(444, 444), landlock_add_rule=(445, 445),
    landlock_restrict_self=(446, 446), memfd_secret=(447, 447), mbind=(237, 235), file_setattr=(469, 469),
)
_TABLES = {machine: {name: pair[i] for name, pair in _NUMBERS.items() if pair[i] is not None}
           for i, machine in enumerate(("x86_64", "aarch64"))}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = _TABLES.get(platform.machine(), {})
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET

_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_RET_ZERO = _RET_ERRNO | 0  # the call is not made, and returns 0
_EPERM, _EINVAL, _ENOTTY, _ENOSYS, _EOPNOTSUPP, _EAFNOSUPPORT, _ENETUNREACH = 1, 22, 25, 38, 95, 97, 101
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
_NR, _ARCH, _ARGS = 0, 4, (16, 24, 32, 40, 48, 56)  # offsets in struct seccomp_data (arguments' low 32 bits: little-endian)


def seccomp_program(cgroup: bool = True) -> bytes:
    """The filter, one BPF instruction (code, jump if true, jump if false, constant) a tuple: the calls judged by an
    argument, then a test and a return per listed call; the rest EPERM. cgroup=False leaves CGROUP_ONLY out."""
    machine = platform.machine()
    if machine not in _TABLES:
        raise OSError(_ENOSYS, f"no seccomp system-call table for {machine} (known: {sorted(_TABLES)})")
    table = _TABLES[machine]
    program = [
        (_LD_ABS, 0, 0, _ARCH),
        (_JEQ, 1, 0, _AUDIT_ARCH[machine]),  # a call through another ABI (32-bit) would bypass the numbers
        (_RET, 0, 0, _RET_KILL_PROCESS),
        (_LD_ABS, 0, 0, _NR),
    ]
    if machine == "x86_64":
        program += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _RET_ERRNO | _EPERM)]  # the x32 ABI's numbers
    program += [(_JGE, 0, 1, NEWEST + 1), (_RET, 0, 0, _RET_ERRNO | _ENOSYS)]  # newer than the list
    allow = [(_JEQ, value, _RET_ALLOW) for value in FCNTL_ALLOWED.values()]
    locks = [(_JEQ, command, _RET_ZERO) for command in FCNTL_LOCKS.values()]
    program += _by_argument(table["fcntl"], _ARGS[1], allow + locks, _RET_ERRNO | _EPERM)
    for name, argument, allowed, otherwise in (("ioctl", 1, IOCTL_ALLOWED, _RET_ERRNO | _ENOTTY),
                                               ("prctl", 0, PRCTL_ALLOWED, _RET_ERRNO | _EINVAL),
                                               ("madvise", 2, MADVISE_ALLOWED, _RET_ERRNO | _EINVAL),
                                               ("fadvise64", 3, FADVISE_ALLOWED, _RET_ZERO)):
        program += _by_argument(table[name], _ARGS[argument], [(_JEQ, value, _RET_ALLOW) for value in allowed.values()],
                                otherwise)
    program += _by_argument(table["socket"], _ARGS[0], [(_JEQ, family, _RET_ERRNO | _ENETUNREACH)
                                                       for family in NETWORK_FAMILIES.values()], _RET_ERRNO | _EAFNOSUPPORT)
    program += [(_JEQ, 0, 1, table["socketpair"]), (_RET, 0, 0, _RET_ERRNO | _EAFNOSUPPORT)]  # AF_UNIX is its one family
    for name in ("preadv2", "pwritev2"):
        program += _by_argument(table[name], _ARGS[5], [(_JSET, RWF_NOWAIT, _RET_ERRNO | _EOPNOTSUPP)], _RET_ALLOW)
    # clone: no new namespace, no pidfd, and no real-time signal for the parent when the child exits (0xE0: 32 and up)
    program += _by_argument(table["clone"], _ARGS[0], [(_JSET, NAMESPACE_FLAGS | CLONE_PIDFD, _RET_ERRNO | _EPERM),
                                                      (_JSET, 0xE0, _RET_ERRNO | _EPERM)], _RET_ALLOW)
    # clone3's flags are in memory a filter cannot read: ENOSYS, and the C library falls back to clone (as under Docker)
    program += [(_JEQ, 0, 1, table["clone3"]), (_RET, 0, 0, _RET_ERRNO | _ENOSYS)]
    for name, argument in SIGNAL_SENDERS.items():
        program += _by_argument(table[name], _ARGS[argument], [(_JGE, _REALTIME, _RET_ERRNO | _EPERM)], _RET_ALLOW)
    for name, arguments in SELF_ONLY.items():
        program += _self_only(table[name], arguments)
    for names, result in ((NO_EFFECT, _RET_ZERO), (NO_XATTRS, _RET_ERRNO | _EOPNOTSUPP),
                          (ALLOWED + (CGROUP_ONLY if cgroup else ()), _RET_ALLOW)):
        for name in names:
            if name in table:  # (aarch64 lacks the older calls: open, stat, fork, ...)
                program += [(_JEQ, 0, 1, table[name]), (_RET, 0, 0, result)]
    program += [(_RET, 0, 0, _RET_ERRNO | _EPERM)]
    return b"".join(struct.pack("HBBI", *instruction) for instruction in program)


def _by_argument(number: int, argument: int, tests: list[tuple[int, int, int]], otherwise: int) -> list[tuple]:
    """"Is it call `number`? then return by an argument": tests (jump code, constant, result), then `otherwise`."""
    body = [(_LD_ABS, 0, 0, argument)]
    for code, constant, result in tests:
        body += [(code, 0, 1, constant), (_RET, 0, 0, result)]
    body.append((_RET, 0, 0, otherwise))
    return [(_JEQ, 0, len(body), number)] + body


def _self_only(number: int, arguments: tuple[int, ...]) -> list[tuple]:
    """Instructions for "is it call `number`? then allow it only if every listed argument is 0; else go on"."""
    body = []
    for i, argument in enumerate(arguments):  # a non-zero one jumps over the rest to the EPERM at the end
        body += [(_LD_ABS, 0, 0, _ARGS[argument]), (_JEQ, 0, 2 * (len(arguments) - 1 - i) + 1, 0)]
    body += [(_RET, 0, 0, _RET_ALLOW), (_RET, 0, 0, _RET_ERRNO | _EPERM)]
    return [(_JEQ, 0, len(body), number)] + body


install_seccomp = runner.install_seccomp  # the filter on this process and all it will start; needs no_new_privs, not root
