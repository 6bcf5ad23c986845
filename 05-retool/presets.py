"""The runs `make run-05 PRESET=...` knows: each a set of Config fields (configuration.py) over its defaults.

cpu-demo is Config's defaults. torl-1.5b is ToRL's scripts/torl_1.5b.sh value by value, simpletir-7b SimpleTIR's 7B
command: docs/05-torl.md sets each value beside its source, row by row. The others say what they are below.
"""
from __future__ import annotations

PRESETS: dict[str, dict] = {
    "cpu-demo": {},  # RL from the toy task's released base, 05-retool/base (`make base-05`)
    # ToRL's scripts/torl_1.5b.sh: every value the script's (or its verl's default), but the few memory settings of a
    # trainer kept on the GPU beside vLLM (no offload), one rank per GPU.
    "torl-1.5b": dict(
        model="Qwen/Qwen2.5-Math-1.5B", cold_start="none", scorer="torl", template="torl",
        train_file="data/torl_data/train.parquet", eval_file="data/torl_data/test.parquet",  # its data/torl_data/
        max_prompt_tokens=390,  # data.max_prompt_length=400; its loader keeps prompts of at most 400 - 10 tokens
        steps=67_200,  # total_epochs=300 of 224 steps (28,740 problems // 128); stop it when the curves flatten
        problems_per_step=128, group_size=16, max_response_tokens=3072, max_model_len=3472, tool_budget=1,
        temperature=1.0, lr=1e-6, num_minibatches=1, micro_batch_size=8, eps_low=0.2, eps_high=0.2,
        scale_advantages=True, gradient_checkpointing=True, save_every=20, dtype="bfloat16",
        eval_every=4, eval_problems=0, eval_k=1, eval_temperature=0.0, eval_max_response_tokens=3072,
        gpu_memory_utilization=0.5,  # vLLM's share while the trainer's weights and AdamW state stay on the GPU
        enforce_eager=False,  # compiled, with CUDA graphs, as verl's vLLM runs: thousands of decode steps repay it
    ),
    # A real pretrained model on the CPU learns to hand word problems to Python. Why each setting: docs/05-smollm2.md.
    "smollm2": dict(
        model="HuggingFaceTB/SmolLM2-135M-Instruct", cold_start="finetune", cold_start_steps=60,
        cold_start_tool_only_steps=20, cold_start_tool_fraction=0.4, cold_start_lr=1e-4, cold_start_batch_size=8,
        train_file="data/word_train.jsonl", eval_file="data/word_test.jsonl", template="smollm2-chat",
        steps=10, problems_per_step=8, group_size=8, max_response_tokens=64, max_model_len=256,
        lr=2e-5, num_minibatches=2, micro_batch_size=16, train_layers=8, trainer_threads=-1,
        eval_every=0, eval_problems=100, eval_max_response_tokens=64, eval_text=True, save_every=5,
        enforce_eager=False,  # its measured run compiled the engine
    ),
}
# The chained task, where calls chain (01-data/chained_problems.py). Sized, not tuned: docs/06-experiments.md says why
# each value. Write its data first: .venv/bin/python 01-data/chained_problems.py --out-dir data
PRESETS["cpu-chained"] = dict(
    cold_start="released",  # 06-train/base, made by these cold_start_* settings (make base-06); --cold-start scratch runs them
    train_file="data/chained_train.jsonl", eval_file="data/chained_test.jsonl",
    tool_budget=4, max_response_tokens=256, eval_max_response_tokens=256, steps=60,
    seed_rollouts=True,  # as ablation.py's runs: two runs of one seed draw the same samples until their policies part
    # The base: three cold starts, sized by the moves check, not by RL (docs/appendix/06-bases.md: how each was found).
    cold_start_steps=600, cold_start_tool_only_steps=450, cold_start_kv_heads=4, cold_start_rounds=2,
    cold_start_schedules="600:450 600:150:drills",
)
# ToRL-7B: the same script values with Qwen2.5-Math-7B, FSDP2 over the 8 GPUs of one node (make run-05 NPROC=8
# PRESET=torl-7b): its trainer state fits no single GPU. Memory plan: docs/06-scaling.md.
PRESETS["torl-7b"] = dict(
    PRESETS["torl-1.5b"], model="Qwen/Qwen2.5-Math-7B",
    strategy="fsdp",  # 16 problems (256 trajectories) of each step's 128 per GPU; micro-batches of 8, as torl-1.5b's
    gpu_memory_utilization=0.6,  # 48 GB: 15.2 of bf16 weights, about 31 of KV cache (57 KB a token; --dry-run)
)
# SimpleTIR-7B (ltzheng/SimpleTIR: its README's 7B training command over train.sh's defaults and recipe/simpletir/).
PRESETS["simpletir-7b"] = dict(
    PRESETS["torl-7b"], model="Qwen/Qwen2.5-7B",  # the base model, not the Math one; RL from it, no cold start
    scorer="lab",  # its reward, 1/0 from math-verify; the lab's ±1 gives the same std-scaled advantages
    train_file="data/simpletir/train.parquet",  # its datasets/simplelr_math_35/train + deepscaler/train, in one file
    eval_file="data/simpletir/test.parquet",  # simplelr_math_35/test, deepscaler/aime and aime25, in one file
    template="qwen-chat",  # the lab's ChatML tool instruction, not SimpleTIR's own text
    max_prompt_tokens=4096,  # SimpleTIR cuts a longer prompt from the left; the lab drops it
    steps=3100,  # total_epochs=100 over 48,838 problems in draws of 1,536 (oversample 3 x 512): 31 an epoch
    problems_per_step=512, max_response_tokens=8000, max_model_len=12096, tool_budget=5, eps_high=0.28,
    num_minibatches=4,  # ppo_mini_batch_size=128 of 512 prompts: four updates a step
    micro_batch_size=2,  # ppo_max_token_len_per_gpu=24000 packs two sequences at their longest, as two here do
    eval_every=10, eval_k=16, eval_temperature=1.0, eval_max_response_tokens=8000, save_every=10,
    gpu_memory_utilization=0.75,  # its engines run tensor parallel 2; the lab's 1
    filter_void_turns=True, mask_truncated=True,  # --mask_void_turns True, --remove_clip True
    dynamic_sampling=True,  # rejection_sample, --acc_filter 0.1_0.9, --oversample 3: the lab keeps groups whose
    dynamic_sampling_rounds=2,  # rewards differ, drawing up to 2 more rounds (3 x the problems), not the 0.1-0.9 band
)
# Presets sized for a CUDA GPU: refused up front on a machine without one.
GPU_PRESETS = {"torl-1.5b", "torl-7b", "simpletir-7b"}
