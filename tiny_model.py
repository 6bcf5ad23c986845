"""A tiny Qwen2 causal LM with a tokenizer trained on the spot, for tests and the CPU demo.

No machine this lab runs on needs a model hub. The lab's target models are
Qwen2.5-Math, so the tiny model is of the same family (Qwen2ForCausalLM): the
code paths that load it in transformers and in vLLM are the ones the real model
takes. Its tokenizer is a byte-level BPE trained here with `tokenizers`, so any
text can be encoded (unknown words fall back to bytes) and the special tokens
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` exist as in Qwen's vocabulary.

Sizes are chosen for vLLM's CPU backend: its attention rejects head_dim 16, so
heads are 64 wide (hidden 128 = 2 heads x 64, one KV head).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# vLLM's KV cache for the default model on a CPU (`cpu_kv_cache_gib`, --cpu-kv-cache-gib): 1 KiB a token
# (2 layers x K and V x 1 head x 64 x float32), so 64 MiB holds 64k tokens, ample for any test. vLLM zeroes
# the whole cache as an engine starts (0.6 s a GiB on 2 cores): the default 2 GiB would cost a second.
KV_CACHE_GIB = 1 / 16

# Text the tokenizer learns its merges from: the lab's prompt, code and output
# fences, digits and arithmetic. Enough for a few hundred useful merges.
DEFAULT_CORPUS = [
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n",
    "User: Please integrate natural language reasoning with programs to solve the problem above, "
    "and put your final answer within \\boxed{}.\n",
    "What is 123 * 456? Compute the product. Assistant:\n",
    "Let me compute it with Python.\n```python\nprint(123 * 456)\n```\n```output\n56088\n```\n",
    "The answer is \\boxed{56088}.\n",
    "import sympy\nx = sympy.symbols('x')\nprint(sympy.solve(x**2 - 4, x))\n",
    "0123456789 + - * / = ( ) [ ] { } , . : ; ' \" # _ < > ! ? % ^ & | ~ `\n",
    "def f(n):\n    return n * (n + 1) // 2\nfor i in range(10):\n    print(i, f(i))\n",
]


def build_tiny_model(out_dir: str | os.PathLike, corpus: list[str] | None = None, vocab_size: int = 512,
                     hidden_size: int = 128, num_layers: int = 2, num_heads: int = 2, num_kv_heads: int = 1,
                     intermediate_size: int = 256, max_position_embeddings: int = 4096, seed: int = 0) -> Path:
    """Write a random-init Qwen2 model and its tokenizer to `out_dir`; return the folder.
    The folder holds config.json, model.safetensors, tokenizer.json and tokenizer_config.json, written by
    `save_pretrained`, so `AutoModelForCausalLM.from_pretrained(path)` and `vllm.LLM(path)` both load it. The same seed
    and corpus give the same weights and the same vocabulary."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus or DEFAULT_CORPUS, vocab_size)
    tokenizer.save_pretrained(out)

    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # begins, ends and pads, as in Qwen's base models
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=True, bos_token_id=end, eos_token_id=end, pad_token_id=end,
                         torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    return out


def temp_tiny_model() -> Path:
    """build_tiny_model into a fresh temporary folder: the model of a script that is given none."""
    import tempfile

    return build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-model-")), seed=0)


def train_tokenizer(corpus: list[str], vocab_size: int = 512):
    """Train a byte-level BPE on `corpus` and wrap it as a transformers tokenizer.
    Byte-level means every string round-trips: what the BPE never saw is spelled byte by byte. Digits are split one per
    token (as in Qwen's tokenizer), so a number's tokens do not depend on which merges the corpus happened to teach."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   clean_up_tokenization_spaces=False)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build a tiny random-init Qwen2 model with a local tokenizer.")
    parser.add_argument("out_dir", help="folder to write the model and tokenizer into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = build_tiny_model(args.out_dir, seed=args.seed)
    print(json.dumps({"path": str(path)}))
