"""make gpu-check: prepared for a GPU machine; here, without CUDA, it refuses in one line."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the check runs: minutes")
def test_make_gpu_check_refuses_without_a_gpu_in_one_line():
    """Run as bench-train runs (PYTHONPATH, no venv needed): the refusal comes before any model is built."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["make", "gpu-check", "STAMP=", f"PY={sys.executable}"], cwd=Path(__file__).parents[1],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if not line.startswith("make")]
    assert lines == ["error: make gpu-check needs a CUDA GPU and torch sees none here; on a CPU the tests (make test) "
                     "and the dry run (retool.py --preset torl-1.5b --dry-run) check this path"], done.stderr
    assert "06-train/gpu_check.py" in done.stdout and "PYTHONPATH=" in done.stdout
