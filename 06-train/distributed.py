"""Data parallel RL across the devices of one node or several, with torch.distributed; see docs/06-scaling.md.

    torchrun --nproc-per-node 8 05-retool/retool.py --preset torl-1.5b     # 8 GPUs, DDP
    make run-05 NPROC=8 PRESET=torl-7b                                       # 8 GPUs, FSDP2
    make run-05 NPROC=2 ARGS="--model runs/x/base --steps 4"                 # 2 CPU processes, gloo

Without torchrun, `setup()` returns a world of one and every method below is the identity. Each rank owns one
device, its own vLLM engine and its own trainer replica (DDP) or shard (FSDP2).
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a rank waits in a collective: the slowest rank's evaluation, or rank 0's checkpoint save, must fit in it.
COLLECTIVE_TIMEOUT = timedelta(minutes=60)
STRATEGIES = ("ddp", "fsdp")  # how the trainer is spread over ranks: replicated, or sharded (FSDP2)


def load_policy(model_path, device: str | torch.device | None = None):
    """The trainer's copy of the model: float32 weights on `device` (CUDA if there is one)."""
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)


def any_rank(flag: bool) -> bool:
    """Whether this rank or any other says yes: one all-reduce under torchrun, else this rank's own answer."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64)  # gloo carries CPU tensors, also on GPU nodes
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def unwrap(model):
    """The Hugging Face model inside a DDP wrapper; any other model as it is (FSDP2 shards in place: no wrapper)."""
    return getattr(model, "module", model)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor from an FSDP2 shard (a DTensor: a collective, every rank must call it)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gradient_sync(model, sync: bool):
    """Wraps a micro-batch's forward, where DDP arms its exchange: DDP, and HSDP across nodes, exchange gradients on
    the mini-batch's last micro-batch only. FSDP2 still reduce-scatters within the node after every backward: else
    every GPU would hold a whole float32 gradient."""
    if hasattr(model, "set_requires_all_reduce"):  # FSDP2; with one node there is nothing to all-reduce
        model.set_requires_all_reduce(sync)
    return model.no_sync() if hasattr(model, "no_sync") and not sync else nullcontext()


class RanksInStep:
    """What grpo_step does alike on every rank under torchrun; in one process, the single-process step."""

    def __init__(self, model, global_normalizer=None):
        self.model, self.global_normalizer = model, global_normalizer
        self.several = dist.is_available() and dist.is_initialized()

    def denominator(self, local: float) -> float:
        """A mini-batch's loss denominator: this rank's count, or with `global_normalizer` every rank's count over N."""
        return local if self.global_normalizer is None else self.global_normalizer(local)

    def zero_grad(self, optimizer) -> None:
        """Zero the gradients; freed, except under DDP, whose gradients are views of its all-reduce buckets: freed,
        the next no_sync backward would allocate them again beside the buckets."""
        optimizer.zero_grad(set_to_none=not self.several or unwrap(self.model) is self.model)

    def pad(self, passes: list, filler, at_least: int = 1) -> list:
        """As many passes as the rank that needs the most, and `at_least`, the missing ones `filler`: the gradient
        exchange happens inside the backward passes, and FSDP2 gathers each layer's weights in every forward."""
        if not self.several or (unwrap(self.model) is self.model
                                and not any(hasattr(p, "full_tensor") for p in self.model.parameters())):
            return passes  # one process, or a model neither wrapped in DDP nor sharded by FSDP2
        most = torch.tensor([len(passes)], dtype=torch.int64)  # gloo carries CPU tensors, also on GPU nodes
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return passes + [filler] * (max(int(most), at_least) - len(passes))

    def exchange(self, last: bool):
        return gradient_sync(self.model, sync=last) if self.several else nullcontext()

    def whole_norm(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over every rank's shard (FSDP2: a collective); the norm itself otherwise."""
        return full_tensor(grad_norm) if self.several else grad_norm


class DataParallel:
    """This process's place in the world: rank, world size, device, and the collectives the loop needs."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0, strategy: str = "ddp",
                 per_node: int | None = None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.per_node, self.strategy = per_node or world_size, strategy  # per_node: torchrun's LOCAL_WORLD_SIZE
        self.loaded_weights = None  # load_policy: whether this rank read the weights (False: built on meta)
        self._weights_for_wrap = None  # load_policy under FSDP2: rank 0's full state dict ({} elsewhere) for wrap
        self.device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")

    is_main = property(lambda self: self.rank == 0)
    distributed = property(lambda self: self.world_size > 1)
    sharded = property(lambda self: self.strategy == "fsdp" and self.distributed)  # FSDP2 across ranks

    @property
    def nodes(self) -> int:
        """Nodes of equal size: FSDP2 shards within each and replicates across them (HSDP); 1 otherwise."""
        return self.world_size // self.per_node if self.world_size % self.per_node == 0 else 1

    def shard(self, items: list, num_minibatches: int) -> list:
        """This rank's share of a step's problems: `num_minibatches` consecutive chunks, as grpo_step cuts the
        trajectories, each cut into one slice per rank, so that the optimizer steps are one process's."""
        if not self.distributed:
            return items
        if len(items) % (num_minibatches * self.world_size):
            raise ValueError(f"{len(items)} problems do not split into {num_minibatches} mini-batches"
                             f" x {self.world_size} ranks")
        per = len(items) // (num_minibatches * self.world_size)
        starts = [(chunk * self.world_size + self.rank) * per for chunk in range(num_minibatches)]
        return [item for start in starts for item in items[start: start + per]]

    def global_normalizer(self, local: float) -> float:
        """grpo_step's loss denominator on this rank: the count summed over ranks, over N."""
        if not self.distributed:
            return local
        count = torch.tensor([float(local)], dtype=torch.float64)  # gloo carries CPU tensors, also on GPU nodes
        dist.all_reduce(count)
        return float(count) / self.world_size

    def rank_seed(self, seed: int | None) -> int | None:
        """This rank's seed for sampling (rank 0 keeps the single-process one): with one seed every rank's engine
        would draw the same samples."""
        return None if seed is None else seed + 1_000_003 * self.rank

    def load_policy(self, model_path):
        """The trainer's float32 policy, for `wrap` next. Under FSDP2 only rank 0 reads the weights (on the CPU) and
        `wrap` fills the other ranks' shards, built on the meta device; `loaded_weights` says which."""
        self.loaded_weights = not self.sharded or self.is_main
        if not self.sharded:
            return load_policy(model_path, device=self.device)
        if self.is_main:
            model = load_policy(model_path, device="cpu")
            self._weights_for_wrap = model.state_dict()  # the full tensors, kept past fully_shard's re-sharding
            return model
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
        self._weights_for_wrap = {}
        return model

    def _fill_from_rank0(self, model) -> None:
        """After fully_shard of a `load_policy` model: every rank's shards and buffers get rank 0's values."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full, self._weights_for_wrap = self._weights_for_wrap, None
        if not self.is_main:
            model.to_empty(device=self.device)  # memory for this rank's shards, uninitialised until the broadcast
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        # Non-persistent buffers (Qwen2's rotary inv_freq and original_inv_freq) are in no state dict, and
        # to_empty left them uninitialised on the meta ranks: rank 0's, computed from the config, are sent too.
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)

    def wrap(self, model):
        """DDP (a full replica per rank) or FSDP2 (each rank holds 1/N of weights, gradients, AdamW state)."""
        if not self.distributed:
            return model
        if self.strategy == "fsdp":
            return self.fully_shard(model)
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.local_rank] if self.device.type == "cuda" else None
        # gradients as views of DDP's all-reduce buckets: one copy, not two, while RanksInStep.zero_grad keeps them
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)

    def fully_shard(self, model):
        """FSDP2 in place, every decoder layer and then the root; also in a world of one (make gpu-check)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # GPU: bf16 compute on the gathered weights, float32 shards and reductions (as autocast); CPU: float32
        on_cuda = self.device.type == "cuda"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if on_cuda else None, reduce_dtype=torch.float32)
        mesh = None  # one node: torch's 1-D mesh over every rank
        if self.nodes > 1:  # HSDP: shard within a node, replicate across nodes, so weights cross nodes only as
            from torch.distributed.device_mesh import init_device_mesh  # one gradient all-reduce a mini-batch

            mesh = init_device_mesh(self.device.type, (self.nodes, self.per_node),
                                    mesh_dim_names=("replicate", "shard"))
        for layer in model.model.layers:  # one all-gather per decoder layer, freed after use
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if self._weights_for_wrap is not None:  # built by load_policy: weights on rank 0 only
            self._fill_from_rank0(model)
        return model

    unwrap = staticmethod(unwrap)

    def checkpoint_parts(self, model, optimizer, staging):
        """(model, optimizer) to hand to save_checkpoint on rank 0; every rank must call it. FSDP2: the model is
        gathered into rank 0's host memory (a Hugging Face folder), while each rank writes its shard of the optimizer
        state into `staging`: AdamW's moments (61 GB at 7B) never meet on one rank."""
        if not self.sharded:
            return self.unwrap(model), optimizer
        import shutil

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.is_main:
            shutil.rmtree(staging, ignore_errors=True)  # a stopped save's leftovers
        self.barrier()
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(staging))
        self.barrier()
        return _FullModel(model, full), _OptimizerShards(model, optimizer, staging)

    def restorable_optimizer(self, model, optimizer):
        """What retool's load_optimizer loads into: the optimizer, or (FSDP2) its shards."""
        return _OptimizerShards(model, optimizer, None) if self.sharded else optimizer

    def reduce_metrics(self, metrics: dict) -> dict:
        """One metrics dict for the whole step from every rank's; see `combine_metrics` for the rules."""
        return combine_metrics(self.gather([metrics])) if self.distributed else metrics

    def gather(self, items: list) -> list:
        """Every rank's list, concatenated in rank order (on every rank)."""
        if not self.distributed:
            return items
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, items)
        return [x for part in gathered for x in part]

    def share(self, items: list) -> tuple[list[int], list]:
        """This rank's share of work that needs no exchange (the evaluation): every world-th item from its
        rank, with the items' indices. Dealt in turn, not cut in blocks: a set sorted by difficulty spreads evenly."""
        indices = list(range(self.rank, len(items), self.world_size))
        return indices, [items[i] for i in indices]

    def gather_in_order(self, results: list, indices: list[int]) -> list:
        """Every rank's results, one per index of its `share`, back in the items' order (on every rank)."""
        if len(results) != len(indices):
            raise ValueError(f"gather_in_order: {len(results)} results for {len(indices)} indices")
        pairs = self.gather(list(zip(indices, results)))
        return [result for _, result in sorted(pairs, key=lambda pair: pair[0])]

    def broadcast(self, value):
        """Rank 0's value of a picklable object, on every rank."""
        box = [value]
        if self.distributed:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    @contextmanager
    def main_first(self):
        """Rank 0 runs the block (writes a file, trains the cold start); then the others, which find its result."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def engine_kwargs(self) -> dict:
        """Arguments for make_llm: an engine that joins torchrun's process group and samples alone."""
        return {"distributed_executor_backend": "external_launcher"} if self.distributed else {}

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def setup(strategy: str = "ddp") -> DataParallel:
    """Join torchrun's world if this process was started by it; otherwise a world of one. NCCL on GPUs (one per
    rank, by LOCAL_RANK), gloo on CPU; vLLM joins the group later, and requires it to exist first."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be {' or '.join(STRATEGIES)}, got {strategy!r}")
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return DataParallel(strategy=strategy)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"  # NCCL for GPU tensors, gloo for objects
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise SystemExit(f"error: rank {rank} wants GPU {local} but this node has {torch.cuda.device_count()}")
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    return DataParallel(rank, world, local, strategy, per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def cores_per_rank() -> int:
    """This rank's share of the node's cores: what its sandbox may run at once (math code is CPU-bound), so that
    the node's ranks together start one slot a core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def combine_metrics(per_rank: list[dict]) -> dict:
    """Combine per-rank metric dicts into the whole step's (docs/06-scaling.md): a value the rules below do not
    name is kept when equal on every rank, else the plain mean; lists are concatenated; anything else is rank 0's."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    sums = {"trajectories", "tokens", "sequences", "degenerate_groups", "errors", "generated_tokens", "rows_skipped",
            "computed_tokens"}
    maxima = {"mismatch_max", "ratio_max", "peak_memory_gb", "peak_reserved_gb"}  # the plan must fit the fullest rank
    per_token = {"entropy", "mismatch_abs", "mismatch_kl", "clip_low_frac", "clip_high_frac", "ratio_mean", "approx_kl",
                 "informative_frac", "tis_masked_frac"}

    def weight(m: dict, key: str) -> float:
        """What a rank's value of `key` is a share of."""
        n = m.get("trajectories", 1.0)
        if key in ("ratio_mean", "approx_kl", "entropy", "mismatch_abs", "mismatch_kl", "tis_masked_frac"):
            return m.get("computed_tokens", m.get("tokens", 1.0))  # the tokens the update computed on, not skipped rows'
        of = {"code_pass_ratio": m.get("tool_calls", 0.0) * n, "code_ratio_correct": m.get("accuracy", 0.0) * n,
              "code_ratio_incorrect": (1.0 - m.get("accuracy", 0.0)) * n, "error_then_call_ok": m.get("errors", 0.0),
              "error_then_correct": m.get("errors", 0.0), "tis_masked_seq_frac": m.get("sequences", 1.0)}
        return m.get("tokens", 1.0) if key in per_token else of.get(key, n)

    outcome = {"reward_mean", "accuracy", "format_rate", "code_ratio", "code_pass_ratio", "code_ratio_correct",
               "code_ratio_incorrect", "tool_calls", "response_length", "truncation_rate", "error_then_call_ok",
               "error_then_correct", "tis_masked_seq_frac"}
    out = {}
    for key, first in per_rank[0].items():
        values = [m.get(key) for m in per_rank]
        if isinstance(first, list):
            out[key] = [x for v in values for x in v]
        elif not isinstance(first, (int, float)) or isinstance(first, bool):
            out[key] = first
        elif key in sums:
            out[key] = float(sum(values))
        elif key.endswith("_s") or key in maxima:
            out[key] = max((v for v in values if not math.isnan(v)), default=float("nan"))  # NaN: none on that rank
        elif key in per_token or key in outcome:
            pairs = [(v, weight(m, key)) for v, m in zip(values, per_rank) if not math.isnan(v) and weight(m, key) > 0]
            total = sum(w for _, w in pairs)
            out[key] = sum(v * w for v, w in pairs) / total if total else float("nan")
        elif all(v == first for v in values):
            out[key] = first  # the same on every rank (grad_norm after DDP, weight_version)
        else:
            out[key] = sum(values) / len(values)
    return out


class _FullModel:
    """A sharded model that saves like a Hugging Face model, from a gathered full state dict."""

    def __init__(self, model, full_state: dict):
        self.model, self.full_state = model, full_state  # empty on ranks other than 0

    def state_dict(self) -> dict:
        return self.full_state

    def save_pretrained(self, path, **kwargs):
        state = self.full_state
        if getattr(self.model.config, "tie_word_embeddings", False):  # one tensor, saved once as an unsharded model's
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # is, however the gather copied it
        self.model.save_pretrained(path, state_dict=state, **kwargs)


class _OptimizerShards:
    """An FSDP2 optimizer saved as each rank's shard (torch.distributed.checkpoint) and loaded back the same way."""

    def __init__(self, model, optimizer, staging):
        self.model, self.optimizer, self.staging = model, optimizer, staging  # staging: where the shards were written

    def move_into(self, folder) -> None:
        """Rank 0, inside save_checkpoint: the shards every rank wrote become the checkpoint's optimizer folder."""
        os.replace(self.staging, folder)

    def load_shards(self, folder) -> None:
        """Every rank reads its own shard (the state is made first, so the load has keys to fill)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = get_optimizer_state_dict(self.model, self.optimizer)
        dcp.load(state, checkpoint_id=str(folder))
        set_optimizer_state_dict(self.model, self.optimizer, state)
