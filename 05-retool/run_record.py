"""Everything a run writes besides the weights' story: its folder, resume point, records, evaluations and stops.

The loop hands the record-keeping to one `RunRecord`; under torchrun every rank holds one, and rank 0 alone writes
files. The story: docs/05-runs.md; the loop's view of it: docs/05-retool.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from checkpoints import (append_jsonl, capture_rng, has_eval_row, load_optimizer, resume_point, save_checkpoint,
                         stop_with_checkpoint, truncate_jsonl, weights_damage)
from configuration import settings_changed
from eval import evaluate, mean, summary_line
from lab_cli import disk_problem, progress, shown
from plots import plot_run
from run_folders import hold_lock, recipe_changes
from stopping import STOPPER, StopRequested, signal_self_for_tests


class RunRecord:
    """One run folder: config.json, metrics.jsonl, eval.jsonl, checkpoints/, trackers; resumed when asked."""

    def __init__(self, cfg, run_dir: Path, resume: bool, dp, **facts) -> None:
        """`facts`: what the run found at start (the sandbox's isolation), recorded in config.json."""
        self.cfg, self.run_dir, self.dp = cfg, run_dir, dp
        if dp.is_main:  # held for the life of the process: a second run into this folder is refused
            run_dir.mkdir(parents=True, exist_ok=True)
            self.lock = hold_lock(run_dir)
        self.state = resume_point(run_dir) if resume else None  # {"path", "step"} or None
        if resume and self.state is None and dp.is_main:
            drop_broken_base(run_dir)
        self.start_step = self.state["step"] if self.state else 0
        self.finished = (self.state is not None and self.start_step >= cfg.steps
                         and has_eval_row(run_dir, cfg.steps, "after RL"))
        if self.finished:
            print(f"{run_dir} already finished: {self.start_step} of {cfg.steps} steps done and evaluated; "
                  f"nothing to do (pass --steps N to train further)")
            return
        self.metrics_path, self.eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
        if dp.is_main:
            if resume:  # a recipe changed on resume (--change-recipe) stays on record, with its step
                facts["recipe_changes"] = recipe_changes(run_dir, cfg, self.start_step)
            config = json.dumps({**dataclasses.asdict(cfg), **facts}, indent=1)
            print(f"settings: {shown(run_dir / 'config.json')}{settings_changed(cfg)}")  # the whole file would flood the console
            (run_dir / "config.json").write_text(config)
            truncate_jsonl(self.metrics_path, self.start_step)  # lines after the checkpoint: work the resume redoes
            truncate_jsonl(self.eval_path, self.start_step)
        if self.state:
            print(f"resuming {run_dir} from step {self.start_step}")
        from trackers import open_trackers

        self.trackers = open_trackers(cfg.log if dp.is_main else "", run_dir, dataclasses.asdict(cfg),
                                      start_step=self.start_step)
        self.finished_step, self.finished_rng = self.start_step, None  # the last finished step, its random state

    def restore_optimizer(self, model, optimizer) -> None:
        if self.state is not None:
            load_optimizer(self.state, self.dp.restorable_optimizer(model, optimizer))

    def steps(self, llm, sandbox, eval_problems: list[dict]):
        """The steps still to do, under a progress bar (rank 0's), each held-out evaluation when due between them."""
        self.evaluate_if_due(self.start_step, llm, sandbox, eval_problems, resumed=True)
        self.bar = progress(range(self.start_step, self.cfg.steps), desc="RL", initial=self.start_step,
                            total=self.cfg.steps, disable=not self.dp.is_main)
        for step in self.bar:
            signal_self_for_tests(step + 1)
            yield step
            self.evaluate_if_due(step + 1, llm, sandbox, eval_problems)

    def record_step(self, step: int, metrics: dict, problems: list[dict], model, optimizer, llm) -> dict:
        """After step `step` (1-based): the batch's metrics row, a checkpoint when due, the console line."""
        dp, cfg = self.dp, self.cfg
        row = {"step": step, **dp.reduce_metrics(metrics), "world_size": dp.world_size,
               "problem_ids": [p["id"] for p in problems]}
        if dp.is_main:
            append_jsonl(self.metrics_path, row)
        if step % cfg.save_every == 0 or step == cfg.steps:
            staging = self.run_dir / "checkpoints" / f".step-{step:06d}.optimizer"
            parts = dp.checkpoint_parts(model, optimizer, staging)  # every rank: FSDP2 gathers and writes shards
            if dp.is_main:
                save_checkpoint(self.run_dir, step, *parts, llm.get_tokenizer(), cfg.keep_checkpoints)
            dp.barrier()
        self.finished_step, self.finished_rng = step, capture_rng()
        self.trackers.log(row)
        if dp.is_main:
            self.bar.set_postfix(reward=f"{row['reward_mean']:+.2f}", code=f"{row['code_ratio']:.2f}", refresh=False)
            tqdm.write(f"step {step:4d} | reward {row['reward_mean']:+.3f} acc {row['accuracy']:.3f} "
                       f"code {row['code_ratio']:.2f} pass {row['code_pass_ratio']:.2f} "
                       f"len {row['response_length']:.0f} | clip {row['clip_low_frac'] + row['clip_high_frac']:.3f} "
                       f"ent {row.get('entropy', float('nan')):.3f} gnorm {row['grad_norm']:.3f} "
                       f"mismatch {row['mismatch_abs']:.4f} | {row['rollout_s']:.1f}s rollout "
                       f"{row['update_s']:.1f}s update")
        STOPPER.release()  # the step is recorded: a stop that waited for it happens now
        return row

    def evaluate_if_due(self, step: int, llm, sandbox, problems: list[dict], resumed: bool = False) -> None:
        """The held-out evaluation at `step` when due; `resumed`: at the resume point, only if a stop lost it."""
        cfg, dp = self.cfg, self.dp
        final = step == cfg.steps
        due = step == 0 or final or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
        if resumed:
            due = due and not has_eval_row(self.run_dir, step, "after RL" if final else None)
        if not dp.broadcast(due):  # rank 0's reading decides for every rank
            return
        tag = "before RL" if step == 0 else "after RL" if final else f"step {step}"
        for mode in ("tir", "text") if cfg.eval_text and (step == 0 or final) else ("tir",):
            result = evaluate(llm, problems[: cfg.eval_problems] if cfg.eval_problems else problems, sandbox,
                              self.run_dir / "eval_samples" / f"step-{step:06d}-{mode}.jsonl", dp,
                              k=cfg.eval_k, mode=mode, template=cfg.template, scorer=cfg.scorer, seed=cfg.seed,
                              max_response_tokens=cfg.eval_max_response_tokens, tool_budget=cfg.tool_budget,
                              temperature=cfg.eval_temperature)
            if dp.is_main:
                row = {"step": step, "tag": tag + (" (text only)" if mode == "text" else ""), **result}
                tqdm.write(f"eval {row['tag']}: {summary_line(result)}")  # on a line of its own, not after the RL bar
                append_jsonl(self.eval_path, row)
                self.trackers.log_eval(row)

    @contextmanager
    def stops_saved(self, model, optimizer, llm):
        """SIGTERM and Ctrl-C inside: a checkpoint of the last finished step, then exit with 128 + the signal."""
        if self.finished_rng is None:
            self.finished_rng = capture_rng()
        STOPPER.install()
        try:
            yield
        except StopRequested as stop:
            stop_with_checkpoint(stop, self.run_dir, self.finished_step, self.finished_rng, model, optimizer,
                                 llm.get_tokenizer(), self.cfg.keep_checkpoints, self.dp)
        finally:
            STOPPER.uninstall()
            self.trackers.close()

    def finish(self, trajectories: list, llm) -> None:
        """The last step's batch as JSONL and HTML, plots.png, and where to find them."""
        trajectories = self.dp.gather(trajectories)
        if not self.dp.is_main:
            return
        if trajectories:  # none when a resumed run only had its final evaluation left
            from rollout import save_trajectories
            from trajectory_view import render_html

            save_trajectories(trajectories, self.run_dir / "last_step.jsonl")
            html = render_html(trajectories[: 2 * self.cfg.group_size], llm.get_tokenizer(),
                               title=f"{self.run_dir.name}: last step", total=len(trajectories))
            (self.run_dir / "last_step.html").write_text(html)
        plot_run(self.run_dir)
        print(f"run folder: {shown(self.run_dir)}  (metrics.jsonl, eval.jsonl, plots.png, last_step.html, checkpoints/)")


def failure_line(failure: BaseException, run_dir: Path, new: bool) -> str | None:
    """After a run failed (not a stop): the one line to exit with, or None to show an unexpected error's traceback.
    A new run's folder goes unless it holds work, and only if this process made it; kept work gets its --resume."""
    kept = work_kept(run_dir) if new else "its work"
    if new and not kept and held_by_this_process(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
    go_on = f"go on with --resume {run_dir}"
    if isinstance(failure, SystemExit) and isinstance(failure.code, str):  # a refusal, which says what to do
        line = failure.code
        return line if not (new and kept) or "--resume" in line else f"{line}; {run_dir} keeps {kept}: then {go_on}"
    if full := disk_full(failure, run_dir):
        return f"{full}, then {go_on if kept else 'run the same command again'}"
    if new and kept:  # an unexpected error: its traceback follows
        print(f"{run_dir} keeps {kept}: {go_on}", file=sys.stderr)
    return None


def work_kept(run_dir: Path) -> str:
    """What a run that never finished a step holds that a resume goes on from, in a few words; "" if nothing."""
    metrics, base = run_dir / "metrics.jsonl", run_dir / "base"
    if metrics.exists() and metrics.read_text(errors="replace").strip():
        return "its recorded steps"
    if (base / "cold_start.json").exists() and not weights_damage(base):
        return "its cold-started base"
    if (base / "partial.pt").exists() or any((run_dir / "base-schedules").glob("*/cold_start.json")):
        return "its cold start so far"
    return ""


def held_by_this_process(run_dir: Path) -> bool:
    """Whether this process holds the run folder's lock: never remove another run's."""
    try:
        return (run_dir / ".lock").read_text().strip() == str(os.getpid())
    except OSError:
        return False


def drop_broken_base(run_dir: Path) -> None:
    """On resume before any checkpoint: a cold-started base cut short (a full disk) goes, so that it is made again."""
    base = run_dir / "base"
    if (base / "cold_start.json").exists() and (why := weights_damage(base)):
        print(f"note: {base} is not whole ({why}); the cold start makes it again")
        shutil.rmtree(base)


def disk_full(failure: BaseException, run_dir: Path) -> str | None:
    """The line for an error the disk caused (torch's failed write on a full disk names no errno); else None."""
    if line := disk_problem(failure):
        return line
    free = shutil.disk_usage(next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())).free
    if isinstance(failure, RuntimeError) and free < 2**27:
        return f"error: the disk is full ({free / 2**20:.0f} MiB free under {run_dir}): free space"
    return None


def outcome_metrics(trajectories, results) -> dict:
    """What the policy did this step: reward, accuracy, format, tool use, length, truncation."""
    called_tool = [t.num_tool_calls > 0 for t in trajectories]
    correct = [r.correct for r in results]
    calls = [call for t in trajectories for call in t.tool_calls]
    return {"reward_mean": mean([t.reward for t in trajectories]), "accuracy": mean(correct),
            "format_rate": mean([r.valid_format for r in results]),
            "code_ratio": mean(called_tool), "code_pass_ratio": mean([call.ok for call in calls]),
            "code_ratio_correct": mean([used for used, right in zip(called_tool, correct) if right]),
            "code_ratio_incorrect": mean([used for used, right in zip(called_tool, correct) if not right]),
            "tool_calls": mean([t.num_tool_calls for t in trajectories]), **self_correction(trajectories, correct),
            "response_length": mean([len(t.token_ids) for t in trajectories]),
            "truncation_rate": mean([t.truncated for t in trajectories]), "trajectories": float(len(trajectories))}


def start_memory_peak() -> None:
    """CUDA: count the peak from here, so that a step's peak_memory_gb is its own."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def measured_counterparts(timing: dict) -> dict:
    """What the dry run's plan assumed, as this step measured it: the memory peak (CUDA: the allocator's since
    start_memory_peak; CPU: the process's peak resident memory so far) and the sampler's decode rate."""
    import resource

    import torch

    reserved = {}
    if torch.cuda.is_available():
        peak_gb = torch.cuda.max_memory_allocated() / 1e9
        # torch's allocator's most, cached blocks included: what vLLM's wake had beside it
        reserved = {"peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}
    else:
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: kilobytes
    return {"peak_memory_gb": peak_gb, **reserved,
            "decode_tokens_per_s": timing["generated_tokens"] / timing["generate_s"] if timing["generate_s"] else 0.0}


def self_correction(trajectories, correct) -> dict:
    """Of the calls that failed (an error observation): the share the next call of the trajectory ran without
    error, and the share in trajectories whose final answer is right (ToRL's self-correction, docs/06-experiments.md)."""
    then_ok, then_correct = [], []
    for t, right in zip(trajectories, correct):
        for call, following in zip(t.tool_calls, [*t.tool_calls[1:], None]):
            if not call.ok:
                then_ok.append(following is not None and following.ok)
                then_correct.append(right)
    return {"error_then_call_ok": mean(then_ok), "error_then_correct": mean(then_correct), "errors": float(len(then_ok))}
