"""Stopping a training run without losing work: SIGTERM and Ctrl-C become a checkpoint, then an exit.

A signal raises `StopRequested` at once, or, while a step's update is held (`STOPPER.hold()` to `release()`), once
the step is recorded. The story: docs/05-runs.md, "Stops".
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from lab_cli import when_output_closes


class StopRequested(BaseException):
    """SIGTERM or Ctrl-C arrived: a BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopped(SystemExit):
    """A run ended by SIGTERM or Ctrl-C as asked, its line said: not a failure. Exits with 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)


class Stopper:
    """Turns SIGTERM and SIGINT into StopRequested, at once or, while held, at `release`; a second one stops at once."""

    def __init__(self) -> None:
        self.held, self.pending, self.requested = False, None, None  # requested: the first signal since install
        self._previous: dict = {}

    def install(self) -> None:
        self.held, self.pending, self.requested = False, None, None
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; there the defaults stay
        for signum in (signal.SIGTERM, signal.SIGINT):  # installed twice, the first handlers are still the ones kept
            self._previous.setdefault(signum, signal.signal(signum, self._handle))
        when_output_closes(self._output_closed)  # `| head`: the reader has its lines; Python ignores SIGPIPE itself

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        when_output_closes(None)

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise StopRequested(signum)

    def _output_closed(self) -> None:
        if self.requested is None:  # a stop already asked for (Ctrl-C, which also ended `| tee`) says its own line
            self._handle(signal.SIGPIPE, None)

    def _handle(self, signum, frame) -> None:
        self.requested = self.requested or signum
        if not self.held:
            raise StopRequested(signum)
        if self.pending not in (None, signal.SIGPIPE):  # the user's second signal; a closed output was nobody's
            raise KeyboardInterrupt
        self.pending = signum
        what = "the output's reader is gone (SIGPIPE)" if signum == signal.SIGPIPE else signal.Signals(signum).name
        print(f"\n{what}: stopping once this step is recorded (Ctrl-C again to stop now, losing the step)",
              file=sys.stderr)


STOPPER = Stopper()


def signal_self_for_tests(step: int) -> None:
    """RETOOL_TEST_SIGNAL=TERM@3 (or KILL@3, INT@3): send that signal to this process as step 3 begins (for tests)."""
    name, _, at = os.environ.get("RETOOL_TEST_SIGNAL", "").partition("@")
    if at and int(at) == step:
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
