"""The prompt templates of chapter 03's rollout, one a model family. The story: docs/03-rollout.md.

Each is a `str.format` string with one field, {question}; braces of the text are doubled. Add a family's beside these.
"""
from __future__ import annotations

TEMPLATES = {
    # ToRL's tir_base_0309 for base models, verbatim: the instruction precedes "the problem above".
    "torl": (
        "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n"
        "User: Please integrate natural language reasoning with programs to solve the problem above, "
        "and put your final answer within \\boxed{{}}.\n{question}\nAssistant:\n"
    ),
    # The same instruction for a chat model in Qwen's ChatML (e.g. Qwen2.5-Math-Instruct).
    "qwen-chat": (
        "<|im_start|>system\nPlease integrate natural language reasoning with programs to solve the problem, "
        "and put your final answer within \\boxed{{}}.<|im_end|>\n"
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    ),
    # Text-only baselines: Qwen2.5-Math's chain-of-thought instruction in the frames above, no word of a tool.
    "cot": (
        "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n"
        "User: Please reason step by step, and put your final answer within \\boxed{{}}.\n{question}\nAssistant:\n"
    ),
    "qwen-chat-cot": (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{{}}.<|im_end|>\n"
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    ),
    # SmolLM2-Instruct's ChatML, its system message one line: a CPU pays for each prompt token in every forward pass.
    "smollm2-chat": (
        "<|im_start|>system\nSolve with Python, then put the final answer in \\boxed{{}}.<|im_end|>\n"
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    ),
}


def render_prompt(question: str, template: str = "torl") -> str:
    return TEMPLATES[template].format(question=question)
