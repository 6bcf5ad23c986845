"""Fixtures shared by every chapter's tests.

The tiny model is built once per test session (a few seconds) and the vLLM
engine over it is started once, eager (without compilation it starts in about
6 s on a 2-core CPU instead of 22): every test that needs real vLLM shares that
one engine, and the tests that only run code through a sandbox share one. A test
that changes the engine's weights (06-train's weight sync) must put the original
weights back before it ends.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """Folder of a random-init Qwen2 (head_dim 64) with a locally trained tokenizer."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_path):
    """One real vLLM engine over the tiny model, float32, shared by the whole session."""
    from rollout import make_llm
    from tiny_model import KV_CACHE_GIB

    return make_llm(tiny_model_path, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
                    cpu_kv_cache_gib=KV_CACHE_GIB)  # kept to the exit


@pytest.fixture(scope="session")
def sandbox():
    """One sandbox with a run's defaults, shared by the tests that only run code through it: each start imports
    numpy and sympy once more (1.3 s). Chapter 02's tests of the sandbox's rules start their own."""
    from sandbox import Sandbox

    with Sandbox() as sb:
        yield sb


_preloaded = []  # the one PreloadedPython of the session, once started


# Tests that start no engine and no sandbox and use one core: they run first, while the preloaded interpreter
# imports on the other core, so that chapter 02's sandbox calls do not run beside those imports.
ONE_CORE_FIRST = ("test_spine.py", "test_results.py", "01-data/", "04-reward/")


def pytest_collection_modifyitems(session, config, items):
    """The one-core chapters first, then the others as collected; last the tests that fork the preloaded interpreter."""
    items.sort(key=lambda item: ("preloaded_python" in getattr(item, "fixturenames", ()),
                                 not item.nodeid.startswith(ONE_CORE_FIRST)))  # stable: else as collected


FORKING = ("05-retool", "06-train")  # the chapters with tests that fork the preloaded interpreter


def pytest_sessionstart(session):
    """Start the preloaded interpreter before collection when the run includes a whole chapter whose tests fork it:
    its imports then take the other core while the tests are collected and the one-core chapters run."""
    root, here = session.config.rootpath, session.config.invocation_params.dir
    for arg in session.config.args:
        path = (here / arg.split("::")[0]).resolve()
        if any(path == root / name or path in (root / name).parents for name in FORKING):
            _start_preloaded()
            return


def pytest_collection_finish(session):
    """Or as soon as the run is known to need it."""
    if any("preloaded_python" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_preloaded()


def _start_preloaded():
    from preloaded_python import PreloadedPython

    if not _preloaded:
        _preloaded.append(PreloadedPython())
    return _preloaded[0]


@pytest.fixture(scope="session")
def preloaded_python():
    """Runs the lab's scripts as `python script.py` does, each a fork of one interpreter that imported
    torch, transformers and vLLM once (preloaded_python.py): 15-20 s less a start."""
    return _start_preloaded()


def pytest_sessionfinish(session):
    """Stop the preloaded interpreter if it was started, used or not: never left importing after the run."""
    if _preloaded:
        _preloaded.pop().close()
