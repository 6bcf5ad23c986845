"""Start the lab's scripts in tests as `python script.py ARGS` does, without paying their imports each time.

Importing torch, transformers and vLLM takes 15 to 20 s of one core, and the tests start scripts many times. A
PreloadedPython imported them once; each run is a fork of it that runs the script as __main__ with its own argv,
environment, working folder, streams and exit status: from argument parsing to exit, the path a shell's run takes.

    python = PreloadedPython()            # conftest.py's `preloaded_python` fixture
    done = python.run([script, "--flag"], cwd=folder, env=env, timeout=300)   # a CompletedProcess
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

# What the lab's scripts import that costs seconds; a fork shares them.
PRELOAD = ("torch", "transformers", "vllm", "vllm.entrypoints.llm", "sympy", "matplotlib.pyplot")
# What a vLLM engine imports as it starts, on this machine's build (skipped where they do not import): 3 s less an engine.
ENGINE_PRELOAD = ("vllm.v1.worker.cpu_worker", "vllm.model_executor.models.qwen2",
                  "vllm.model_executor.layers.quantization.compressed_tensors.utils")


class PreloadedPython:
    def __init__(self):
        self._log = tempfile.NamedTemporaryFile(prefix="preloaded-python-", suffix=".log", delete=False)
        self._server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log, text=True)
        self._ready = False

    def run(self, argv: list, *, cwd, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        """Run `python *argv` in a fork; stdout and stderr come back as text, as with capture_output=True."""
        return self.run_together([argv], cwd=cwd, envs=[env], timeout=timeout)[0]

    def run_together(self, argvs: list[list], *, cwd, envs: list[dict | None], timeout: float = 600
                     ) -> list[subprocess.CompletedProcess]:
        """Run several at once (the ranks of a world, each with its environment); wait for all of them."""
        if not self._ready:
            self._ready = self._read_line(timeout) == "ready"
            if not self._ready:
                raise RuntimeError(f"preloaded python did not start: {open(self._log.name).read()[-2000:]}")
        with tempfile.TemporaryDirectory() as streams:
            jobs = [{"argv": [str(a) for a in argv], "cwd": str(cwd), "env": dict(os.environ if env is None else env),
                     "stdout": os.path.join(streams, f"stdout-{i}"), "stderr": os.path.join(streams, f"stderr-{i}")}
                    for i, (argv, env) in enumerate(zip(argvs, envs))]
            self._server.stdin.write(json.dumps(jobs) + "\n")
            self._server.stdin.flush()
            pids = json.loads(self._read_line(10))
            try:
                returncodes = json.loads(self._read_line(timeout))
            except subprocess.TimeoutExpired:
                for pid in pids:
                    os.kill(pid, 9)
                self._read_line(10)
                raise subprocess.TimeoutExpired(argvs, timeout) from None
            return [subprocess.CompletedProcess(argv, code, Path(job["stdout"]).read_text(),
                                                Path(job["stderr"]).read_text())
                    for argv, job, code in zip(argvs, jobs, returncodes)]

    def close(self) -> None:
        """Stop it: at once while it has run nothing (it may still be importing), else when its runs have ended."""
        if not self._ready:
            self._server.kill()
        self._server.stdin.close()
        self._server.wait(timeout=30)
        os.unlink(self._log.name)

    def _read_line(self, timeout: float) -> str:
        if not select.select([self._server.stdout], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("preloaded python", timeout)
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"preloaded python ended: {open(self._log.name).read()[-2000:]}")
        return line.strip()


def serve() -> None:
    """Import PRELOAD and ENGINE_PRELOAD; then for each line of jobs on stdin, fork one process a job and answer
    their pids, then their exit statuses."""
    import contextlib
    import gc
    import importlib
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    for name in ENGINE_PRELOAD:
        with contextlib.suppress(Exception):  # another build's modules: its engines import what they need themselves
            importlib.import_module(name)
    # The imported objects are kept for good: frozen, a collection in a fork no longer walks them
    # (an engine start collects five times: 1.5 s less) and a fork's pages stay shared.
    gc.freeze()
    assert threading.active_count() == 1, "a fork copies only the thread that forks: nothing may run beside it"
    print("ready", flush=True)
    for line in sys.stdin:
        pids = []
        for job in json.loads(line):
            pid = os.fork()
            if pid == 0:
                _run_job(job)  # never returns
            pids.append(pid)
        print(json.dumps(pids), flush=True)
        print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]), flush=True)
    os._exit(0)  # no teardown of what was imported


def _run_job(job: dict) -> None:
    import runpy
    import traceback

    from lab_cli import exit_now

    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.argv = job["argv"]
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # what `python script.py` puts first
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as ended:  # as the interpreter reads it: None is 0, a message is printed and is 1
        code = 0 if ended.code is None else ended.code if isinstance(ended.code, int) else 1
        if not isinstance(ended.code, (int, type(None))):
            print(ended.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        exit_now(code)  # the interpreter's exit (threads, then exit handlers), without the teardown


if __name__ == "__main__":
    serve()
