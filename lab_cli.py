"""What every script of the lab does with its command line: a mistake is one line naming the flag, exit status 2
(argparse's own for usage errors), no usage dump and no traceback; numbers are checked as they are read."""
from __future__ import annotations

import argparse
import atexit
import errno
import os
import sys
import tempfile
import threading
from pathlib import Path

MIN_PYTHON = (3, 11)  # vLLM 0.32, scipy 1.17 and numpy 2.3 need it (pyproject.toml, the Makefile's setup say the same)
if sys.version_info < MIN_PYTHON:  # every script imports this module first: one line, not an ImportError deep in a library
    sys.exit(f"error: this is Python {sys.version.split()[0]} ({sys.executable}); the lab needs Python "
             f"{'.'.join(map(str, MIN_PYTHON))} or newer: make setup PYTHON=python3.11")


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` refuse with "error: ... (see --help)" on one line, exit status 2."""
    def error(message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

    parser.error = error
    return parser


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser with one-line refusals: its docstring's first paragraph, then the rest as written."""
    description, _, epilog = doc.partition("\n\n")
    return one_line_errors(argparse.ArgumentParser(description=description, epilog=epilog,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))


def at_least(low: int | float, kind=int, at_most: int | float | None = None):
    """An argparse type: a number of `kind` that is at least `low` ("at least 1, got 0"), and `at_most` if given."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: '{text}'") from None
        if not value >= low:  # nan too: it compares false with every number
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be at most {at_most:{'g' if kind is float else 'd'}}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def comma_list(text: str) -> tuple[str, ...]:
    """A setting given as comma-separated names ("math,numpy,sympy"); "" is none."""
    return tuple(name for name in text.split(",") if name)


def private_tmp(prefix: str = "tool-rl-lab-") -> str:
    """A temporary folder of this process's own, made the default for it and its children, gone at exit. A killed
    run leaves vLLM's and the sandbox's files: at every start, the folders of processes now gone are removed."""
    import getpass
    import shutil

    base = tempfile.gettempdir()
    # torch.compile's cache stays where torch keeps it by default, shared by every run: in the
    # private folder each process would compile vLLM's sampler kernels anew (16 s on 2 cores).
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry, as in some containers: torch's own fallback
        user = f"uid_{os.getuid()}"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, f"torchinductor_{user}"))
    for entry in os.scandir(base):
        if entry.name.startswith(prefix) and entry.name[len(prefix):].isdigit() and entry.is_dir(follow_symlinks=False):
            pid = int(entry.name[len(prefix):])
            if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
                shutil.rmtree(entry.path, ignore_errors=True)
    own = os.path.join(base, f"{prefix}{os.getpid()}")
    os.makedirs(own, mode=0o755, exist_ok=True)
    os.chmod(own, 0o755)  # the sandbox's unprivileged code may need to reach what its server keeps here
    tempfile.tempdir = os.environ["TMPDIR"] = own
    atexit.register(shutil.rmtree, own, True)
    keep_caches_writable(own)
    return own


_cache = {"kept": True}


def keep_caches_writable(tmp: str) -> None:
    """An unwritable cache folder (XDG_CACHE_HOME=/proc, a read-only home) becomes none: one notice, not a traceback.
    The lab's, Hugging Face's and vLLM's caches live under it; they then go in `tmp` and are gone at exit."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if why := cannot_write(cache):
        print(f"note: the cache folder {cache} cannot be written ({why}): this run keeps no cache", file=sys.stderr)
        os.environ["XDG_CACHE_HOME"] = os.path.join(tmp, "cache")
        _cache["kept"] = False


def caches_kept() -> bool:
    """Whether what is cached now is kept for later runs (False after keep_caches_writable fell back)."""
    return _cache["kept"]


def cannot_write(folder) -> str | None:
    """Why nothing can be written in `folder` (or, if it does not exist yet, its nearest existing parent); None if it can.
    A real file is made and removed: permission bits say nothing of a read-only disk or of /proc."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        if os.path.islink(existing):  # mkdir would fail on it: "File exists"
            return f"{existing} is a symbolic link to {os.readlink(existing)}, which does not exist"
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file"
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".write-check-")
    except OSError as e:
        return f"{existing}: {e.strerror or type(e).__name__}"
    os.close(handle)
    os.unlink(probe)
    return None


def refuse_chapter_folder() -> None:
    """Refuse, in one line, to run from inside one of the lab's chapter folders: data/ and runs/ would land there."""
    here, root = Path.cwd().resolve(), Path(__file__).resolve().parent
    if here.parent == root and (root / "Makefile").exists() and here.name[:2].isdigit():
        raise SystemExit(f"error: run from the lab's root folder ({root}), not from {here.name}/: "
                         "data/ and runs/ are relative to it")


def shown(path) -> str:
    """`path` as a message shows it: as given when this process runs in the lab's folder, else absolute, so that
    data/ and runs/ written in another folder say where they went."""
    root = Path(__file__).resolve().parent
    return str(path) if Path.cwd().resolve() == root else str(Path(path).resolve())


def run_script(main) -> None:
    """Run a script's `main`: a one-line refusal (SystemExit with a message) exits 2, as a usage error does; a numeric
    exit (a stop's 128 + signal, a count of failures) passes through; exit comes right after the exit handlers."""
    quiet_console()
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before a script's own handler is installed (its first seconds)
        print("stopped by SIGINT (Ctrl-C)", file=sys.stderr)
        exit_now(130)
    except Exception as e:  # the disk's fault is one line; the lab's or a library's, its traceback without the
        if (line := disk_problem(e)) is None:  # teardown's noise (a failed engine's leaked objects, a line each)
            import traceback

            traceback.print_exception(e)
            exit_now(1)
        print(line + ", then run the same command again", file=sys.stderr)
        exit_now(2)
    except SystemExit as refusal:
        if isinstance(refusal.code, str):
            print(refusal.code, file=sys.stderr)
            exit_now(2)  # without the teardown, where a failed engine's leaked objects would each print a line
        if isinstance(refusal.code, int) and refusal.code >= 128:
            exit_now(refusal.code)
        raise
    exit_now(0)


def disk_problem(error: BaseException) -> str | None:
    """The line for an error the disk caused (full, a quota, read-only or not ours to write, a file past
    `ulimit -f`), without its advice's end; None for any other error."""
    fixes = {errno.ENOSPC: "free space", errno.EDQUOT: "free space", errno.EROFS: "choose a folder on a writable disk",
             errno.EACCES: "choose a folder you may write to", errno.EFBIG: file_size_fix(),
             errno.ENAMETOOLONG: "choose a shorter name"}
    if not isinstance(error, OSError):  # torch's and safetensors' own types for a failed write name no errno
        text = (str(error).splitlines() or [""])[0]
        if "File too large" in text or (file_size_limit() is not None and "unexpected pos" in text):
            return f"error: a write failed past the file-size limit ({text[:100]}): {file_size_fix()}"
        return None
    if error.errno not in fixes:
        return None
    what = error.strerror or os.strerror(error.errno)
    if str(error.filename).startswith(STREAM_PREFIX):  # the console's output itself: a file the shell named for it
        stream, target = str(error.filename)[len(STREAM_PREFIX):].split(" ", 1)
        return (f"error: {what} writing {stream} to {target}: send {stream} to another file "
                f"(> FILE) or {fixes[error.errno]} there")
    where = f" ({error.filename})" if error.filename else ""
    return f"error: {what}{where}: {fixes[error.errno]}"


def write_fix(error: BaseException) -> str:
    """What to do when a write failed: raise the file-size limit if one is set and could be the cause (EFBIG, or a
    library's write error that names no errno), else free space."""
    code = getattr(error, "errno", None)
    if code == errno.EFBIG:
        return file_size_fix()
    if code is None and file_size_limit() is not None:  # torch's failed write names no errno: either may be the cause
        return f"{file_size_fix()} or free space"
    return "free space"


def file_size_limit() -> int | None:
    """The shell's file-size limit (`ulimit -f`) in bytes; None when there is none."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def file_size_fix() -> str:
    limit = file_size_limit()
    now = f", now {limit // 1024} KiB a file" if limit is not None else ""
    return f"raise the shell's file-size limit (ulimit -f{now}; ulimit -f unlimited)"


def name_too_long(path) -> str | None:
    """Why `path` cannot be made because a name in it is longer than its file system allows; None if none is."""
    existing = os.path.abspath(path)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for name in str(path).split(os.sep):
        if len(os.fsencode(name)) > limit:
            return (f"the name {name[:24]}... is {len(os.fsencode(name))} bytes long, and this file system allows "
                    f"at most {limit}")
    return None


STREAM_PREFIX = "<console> "  # an OSError's filename for a write to stdout or stderr (_Closable)


def missing_console() -> str | None:
    """The line for a console stream the shell closed (`>&-`, `2>&-`); None when both are open."""
    closed = [name for name in ("stdout", "stderr") if getattr(sys, name) is None]
    if not closed:
        return None
    shell = {"stdout": (">&-", "> out.log"), "stderr": ("2>&-", "2> err.log")}
    return (f"error: {' and '.join(closed)} {'is' if len(closed) == 1 else 'are'} closed "
            f"({' '.join(shell[name][0] for name in closed)}): the lab writes its lines there; send "
            f"{'it' if len(closed) == 1 else 'them'} to a file instead ({', '.join(shell[name][1] for name in closed)}; "
            "or /dev/null)")


def quiet_console() -> None:
    """Before any library loads: the lab's lines, one bar per phase and errors, not the libraries' chatter (Hugging
    Face's bars, torch's C++ warnings). To a file or a pipe, stdout goes line by line, in order with the bars."""
    if line := missing_console():  # before anything would write to a stream that is not there
        if (open_one := sys.stderr or sys.stdout) is not None:
            print(line, file=open_one, flush=True)
        os._exit(2)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import signal

    if threading.current_thread() is threading.main_thread():  # past `ulimit -f` a write fails (EFBIG) and says so,
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # where the kernel's SIGXFSZ would end the process unexplained
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):  # a real stream, not a test's capture
        sys.stdout.reconfigure(line_buffering=True)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if hasattr(stream, "reconfigure") and not isinstance(stream, _Closable):
            stream.reconfigure(errors="replace")  # PYTHONIOENCODING=ascii: "?" for a "±", not a UnicodeEncodeError
            setattr(sys, name, _Closable(stream))


_output = {"closed": None}  # called once when the reader of stdout or stderr has gone (when_output_closes)


def when_output_closes(hook) -> None:
    """Call `hook()` once when the reader of stdout or stderr goes away (`| head -5` has its lines), or None for
    nothing: a training run then stops as on a signal, and its stop line goes wherever output still goes."""
    _output["closed"] = hook


class _Closable:
    """A console stream whose reader may go away: its writes then go nowhere, not into a BrokenPipeError."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self._guarded(lambda: self.stream.write(text), len(text))

    def flush(self) -> None:
        self._guarded(lambda: self.stream.flush(), None)

    def _guarded(self, call, if_gone):
        """`call()` on the stream; a gone reader makes it, and every later one, a no-op answering `if_gone`."""
        try:
            return call()
        except BrokenPipeError:
            self.stream = open(os.devnull, "w")
            _output["gone"] = True
            return if_gone
        except OSError as e:  # /dev/full, past `ulimit -f`: the error names the stream and where it goes
            raise self._named(e) from None
        finally:
            self._say_closed()

    def _named(self, error: OSError) -> OSError:
        name = "stderr" if self.stream is sys.__stderr__ else "stdout"
        try:  # where the stream goes, for the message: the file the shell opened for it (/dev/full, a log)
            target = os.readlink(f"/proc/self/fd/{self.stream.fileno()}")
        except (OSError, ValueError, AttributeError):
            target = "its file"
        named = OSError(error.errno, error.strerror, f"{STREAM_PREFIX}{name} {target}")
        self.stream = open(os.devnull, "w")  # the line that says so goes to stderr; this stream takes no more
        return named

    @staticmethod
    def _say_closed() -> None:
        """The hook, once, from the main thread (a stop raised in another would end only that thread)."""
        if _output.get("gone") and _output["closed"] and threading.current_thread() is threading.main_thread():
            hook, _output["closed"] = _output["closed"], None
            hook()

    def __getattr__(self, name):  # isatty, fileno, encoding...: the stream's own
        return getattr(self.stream, name)


def progress(iterable, **kwargs):
    """A tqdm bar for a phase. In a terminal as usual; to a file or a pipe, a line every 20 s, not frames: long
    enough not to flood a log, short enough that a reader never waits long to see the work go on."""
    from tqdm import tqdm

    if not sys.stderr.isatty():  # miniters 1: no refresh from tqdm's monitor thread, which repeats a stale count
        kwargs = {"file": _Lines(sys.stderr), "mininterval": 20, "miniters": 1, **kwargs}
    return tqdm(iterable, **kwargs)


class _Lines:
    """tqdm's frames as lines: each new count on a line of its own; blanking writes and repeats dropped."""

    def __init__(self, stream) -> None:
        self.stream, self.last = stream, None

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        count = line.split(" [")[0]  # "RL:  50%|█████     | 1/2": what changed, without the times
        if line and count != self.last:
            self.stream.write(line + "\n")
            self.last = count

    def __getattr__(self, name):  # flush, encoding...: the stream's own
        return getattr(self.stream, name)


def exit_now(code: int) -> None:
    """Exit after the exit handlers, which write and close all a run keeps, without the interpreter's teardown:
    freeing torch's and vLLM's million objects one by one took 3 s of the 5 an engine's process took to exit."""
    threading._shutdown()  # what the interpreter does first at exit: join the threads that are not daemons
    if "vllm_engine" in sys.modules:  # an engine's teardown frees memory, which the exit does too: 2 s less
        sys.modules["vllm_engine"].skip_teardown_at_exit()
    atexit._run_exitfuncs()  # then the exit handlers: the temporary folder, logging's flush
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
