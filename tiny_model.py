"""A tiny Qwen2 causal LM with a tokenizer trained on the spot, for tests and the CPU demo.

No model hub needed. It is of the target models' family (Qwen2ForCausalLM), so transformers and vLLM load it by
the real model's code paths; its byte-level BPE encodes any text and has Qwen's special tokens. Heads are 64 wide
(hidden 128 = 2 heads x 64, one KV head): vLLM's CPU attention rejects head_dim 16.
"""
from __future__ import annotations

import os
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# vLLM's KV cache for the tiny model on a CPU (--cpu-kv-cache-gib): 1 KiB a token (2 layers x K and V x 64 x float32),
# 64k tokens, ample for any test. vLLM zeroes it as an engine starts (0.6 s a GiB on 2 cores): 2 GiB would take 1 s.
KV_CACHE_GIB = 1 / 16

# Text the tokenizer learns its merges from: the lab's prompt, code and output fences, digits and arithmetic.
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
    """Write a random-init Qwen2 model and its tokenizer to `out_dir` with `save_pretrained`; return the folder.
    The same seed and corpus give the same weights and the same vocabulary."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    tokenizer = train_tokenizer(corpus or DEFAULT_CORPUS, vocab_size)
    tokenizer.save_pretrained(out)  # makes the folder

    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # begins, ends and pads, as in Qwen's base models
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=True, bos_token_id=end, eos_token_id=end, pad_token_id=end,
                         torch_dtype="float32")
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(out)  # its generation config takes the ids above
    return out


def temp_tiny_model() -> Path:
    """build_tiny_model into a fresh temporary folder: the model of a script that is given none."""
    import tempfile

    return build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-model-")), seed=0)


def train_tokenizer(corpus: list[str], vocab_size: int = 512):
    """A byte-level BPE trained on `corpus` (every string round-trips), as a transformers tokenizer. Digits are one a
    token (as in Qwen's), so a number's tokens do not depend on which merges the corpus happened to teach."""
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
