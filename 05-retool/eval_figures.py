"""Evaluations' figures for the docs, read from eval.py's output folders into one results file (results.py).

    .venv/bin/python 05-retool/eval_figures.py 05-eval-modes --commands 'make run-05 ARGS="--run-dir runs/cpu-demo"' \\
        'VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python 05-retool/eval.py --model runs/cpu-demo/base ... --out runs/eval-05/base-tir' ...

reads each eval.py command's --out folder into docs/results/NAME.json, recorded with every command given, then this
one. Per folder: accuracy, code_ratio, and counts of responses that box, open a ```python block, or follow it with an
```output fence (in text mode the model wrote it).
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from lab_cli import run_script, script_parser
from results import save


def folder_of(command: str) -> Path | None:
    """The --out folder of an eval.py command; None for any other command (a run that made the model)."""
    words = shlex.split(command)
    if not any(word.endswith("eval.py") for word in words):
        return None
    outs = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--out"]
    if len(outs) != 1:
        raise SystemExit(f"error: an eval.py command names not one --out folder to read: {command}")
    return Path(outs[0])


def figures(folder: Path) -> dict:
    """One evaluation's accuracy and tool use (summary.json) and what its responses hold (samples.jsonl)."""
    label = folder.name.replace("-", "_")
    if not re.fullmatch(r"\w+", label) or not (folder / "summary.json").exists() or not (folder / "samples.jsonl").exists():
        raise SystemExit(f"error: {folder}: no summary.json and samples.jsonl under a plain name: not an eval.py folder")
    result = json.loads((folder / "summary.json").read_text())
    summary = result["sets"].get("all") or next(iter(result["sets"].values()))  # "all" when there are several sets
    samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines() if line.strip()]
    texts = [sample["text"] for sample in samples]
    counts = {"boxed": sum(s["valid_format"] for s in samples), "code_block": sum("```python" in t for t in texts),
              "code_then_output": sum("```output" in t.partition("```python")[2] for t in texts)}
    out = {"accuracy": round(summary[f"avg@{result['k']}"], 3), "code_ratio": round(summary["code_ratio"], 2), **counts}
    return {f"{label}_{key}": value for key, value in out.items()}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("name", help="the results file: docs/results/NAME.json")
    parser.add_argument("--commands", nargs="+", required=True, metavar="CMD",
                        help="every command that made the figures, in order: the run, then each eval.py with its --out")
    args = parser.parse_args()
    folders = [folder for folder in map(folder_of, args.commands) if folder is not None]
    if not folders or len({folder.name for folder in folders}) < len(folders):
        raise SystemExit("error: --commands needs eval.py commands whose --out folders have different names")
    out = {key: value for folder in folders for key, value in figures(folder).items()}
    command = "; ".join([*args.commands, f".venv/bin/python 05-retool/eval_figures.py {args.name} --commands "
                         + " ".join(map(shlex.quote, args.commands))])
    print(f"wrote {save(args.name, command, out)}")


if __name__ == "__main__":
    run_script(main)
