"""Data parallel training equals one process on the whole batch (gloo, two CPU ranks, tiny model)."""
import math

import pytest
import torch
from dataclasses import replace

from distributed import DataParallel, combine_metrics, full_tensor
from grpo import GRPOConfig, group_advantages, grpo_step, load_policy, make_optimizer
from rollout import Trajectory
from tiny_model import KV_CACHE_GIB

PROBLEMS, GROUP = 8, 4
# 3 does not divide a rank's 8 rows. No row is skipped here, so that every metric covers every row;
# the skipping scenarios (SKIP_CFG) skip the same rows on the ranks as in the one-process reference.
CFG = GRPOConfig(lr=1e-3, num_minibatches=2, micro_batch_size=3, skip_zero_advantage=False)


def group_trajectories(seed=0):
    """8 problems x 4 samples; response lengths differ a lot between problems, so ranks hold unequal token counts."""
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.randint(0, 2, (PROBLEMS * GROUP,), generator=g) * 2 - 1).tolist()
    advantages, _ = group_advantages(rewards, GROUP)
    out = []
    for i in range(PROBLEMS * GROUP):
        problem = i // GROUP
        n = 6 + 5 * (problem % 3) + (i % GROUP)
        tokens = torch.randint(3, 400, (n,), generator=g).tolist()
        mask = [1] * n
        mask[2:4] = [0, 0]  # an interpreter-output span
        out.append(Trajectory(str(problem), i % GROUP, "", torch.randint(3, 400, (5,), generator=g).tolist(),
                              tokens, [0.0] * n, mask, "", reward=float(rewards[i]), advantage=advantages[i]))
    return out


# Skipping under data parallel: problems 0 and 1 (rank 0's first mini-batch) and 6 (rank 1's second) all
# right, so every row of rank 0's first mini-batch is skipped and rank 1 skips 4 of its 8 rows in its second.
SKIP_CFG = replace(CFG, skip_zero_advantage=True)
ALL_RIGHT = (0, 1, 6)


def skewed_trajectories():
    out = group_trajectories()
    for t in out:
        if int(t.problem_id) in ALL_RIGHT:
            t.reward, t.advantage = 1.0, 0.0
    return out


def by_problem(trajectories):
    groups = {}
    for t in trajectories:
        groups.setdefault(t.problem_id, []).append(t)
    return list(groups.values())


def _step_on_ranks(rank, world, model_path, global_denominator, strategy, staging, skip=False, minibatches=2):
    """One grpo_step on this rank's half of the groups; the weights (FSDP2: gathered), the combined metrics,
    and this rank's own: its metrics, forwards (rows in each), its gradients' storages after the step, and the
    device mesh of its shards. "hsdp": FSDP2 over two nodes of one rank each (sharded within, replicated across)."""
    dp = DataParallel(rank, world, strategy="fsdp" if strategy == "hsdp" else strategy,
                      per_node=1 if strategy == "hsdp" else None)
    torch.manual_seed(0)
    model = dp.wrap(load_policy(model_path, device="cpu"))
    cfg = replace(SKIP_CFG if skip else CFG, num_minibatches=minibatches)
    optimizer = make_optimizer(model, cfg)
    forwards = []
    model.register_forward_hook(lambda module, args, output: forwards.append(len(output.logits)))
    trajectories = skewed_trajectories() if skip else group_trajectories()
    groups = dp.shard(by_problem(trajectories), cfg.num_minibatches)  # whole groups per rank
    local = [t for group in groups for t in group]
    own = grpo_step(model, optimizer, local, cfg, global_normalizer=dp.global_normalizer if global_denominator else None)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    storages = {g.untyped_storage().data_ptr() for g in grads}  # DDP's buckets: a few storages for every gradient
    mesh = getattr(next(model.parameters()), "device_mesh", None)
    per_rank = dp.gather([{"metrics": own, "forwards": forwards, "grads": len(grads), "storages": len(storages),
                           "parameters": len(list(model.parameters())),
                           "mesh": mesh and (tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape))}])
    metrics = dp.reduce_metrics(own)
    weights = dp.checkpoint_parts(model, optimizer, staging)[0].state_dict()  # FSDP2: gathered
    return {"weights": weights, "metrics": metrics, "per_rank": per_rank}


def _checkpoint_on_ranks(rank, world, model_path, run_dir):
    """FSDP2: a step, a checkpoint (optimizer as each rank's shard), a fresh model and optimizer loaded from it."""
    from pathlib import Path

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from transformers import AutoTokenizer

    from checkpoints import load_optimizer, save_checkpoint

    dp = DataParallel(rank, world, strategy="fsdp")
    model = dp.wrap(load_policy(model_path, device="cpu"))
    optimizer = make_optimizer(model, CFG)
    groups = dp.shard(by_problem(group_trajectories()), CFG.num_minibatches)
    grpo_step(model, optimizer, [t for g in groups for t in g], CFG, global_normalizer=dp.global_normalizer)
    run_dir = Path(run_dir)
    parts = dp.checkpoint_parts(model, optimizer, run_dir / "checkpoints" / ".step-000001.optimizer")
    if rank == 0:
        save_checkpoint(run_dir, 1, *parts, AutoTokenizer.from_pretrained(model_path), keep=2)
    torch.distributed.barrier()
    final = run_dir / "checkpoints" / "step-000001"
    again = dp.wrap(load_policy(final, device="cpu"))
    restored = make_optimizer(again, CFG)
    load_optimizer({"path": str(final)}, dp.restorable_optimizer(again, restored))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"saved": get_optimizer_state_dict(model, optimizer, options=full),
            "loaded": get_optimizer_state_dict(again, restored, options=full),
            "files": sorted(p.name for p in final.iterdir())}


def _exchanges_on_ranks(rank, world, model_path):
    """DDP: how many gradient exchanges one grpo_step makes (a communication hook counts each one's last bucket)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    dp = DataParallel(rank, world, strategy="ddp")
    model = dp.wrap(load_policy(model_path, device="cpu"))
    exchanges = []

    def counting_hook(state, bucket):
        exchanges.append(bucket.is_last())
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_hook)
    groups = dp.shard(by_problem(group_trajectories()), CFG.num_minibatches)
    grpo_step(model, make_optimizer(model, CFG), [t for g in groups for t in g], CFG,
              global_normalizer=dp.global_normalizer)
    return sum(exchanges)


def _engine_weights_on_ranks(rank, world, model_path):
    """FSDP2: the dtype each weight has when its gather starts, and whether the gathered tensor is the full one."""
    import weight_sync

    dp = DataParallel(rank, world, strategy="fsdp")
    model = dp.wrap(load_policy(model_path, device="cpu"))
    full = dict(load_policy(model_path, device="cpu").named_parameters())  # what the sync hands over (tied: once)
    gathered_dtypes, real_gather = [], weight_sync.full_tensor

    def recording_gather(tensor):
        gathered_dtypes.append(tensor.dtype)
        return real_gather(tensor)

    weight_sync.full_tensor = recording_gather
    try:
        weights = dict(weight_sync.engine_weights(model, torch.bfloat16))
    finally:
        weight_sync.full_tensor = real_gather
    exact = all(torch.equal(weights[name], full[name].detach().to(torch.bfloat16)) for name in weights)
    return {"gathered_dtypes": set(gathered_dtypes), "exact": exact, "names": sorted(weights) == sorted(full)}


FIXED_INPUT = torch.arange(3, 19).reshape(2, 8)


def _loading_on_ranks(rank, world, model_path):
    """FSDP2 via load_policy (weights read on rank 0 only): each rank's gathered weights, buffers and logits."""
    dp = DataParallel(rank, world, strategy="fsdp")
    model = dp.wrap(dp.load_policy(model_path))
    weights = {name: full_tensor(p).detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(FIXED_INPUT).logits
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    return dp.gather([{"loaded_weights": dp.loaded_weights, "weights": weights, "buffers": buffers, "logits": logits}])


def _evaluation_on_ranks(rank, world):
    """Each rank's share of 5 problems, 2 results each, gathered back in the problems' order (what eval.evaluate does)."""
    dp = DataParallel(rank, world)
    indices, share = dp.share([f"problem {i}" for i in range(5)])
    return dp.gather_in_order([[f"{problem} sample {j} by rank {rank}" for j in range(2)] for problem in share], indices)


def _rank(rank, world, store, model_path, run_dir, out):
    """Every two-rank scenario in one process group: starting ranks costs more than the scenarios."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results = {f"{strategy}-{denominator}": _step_on_ranks(rank, world, model_path, denominator == "global", strategy,
                                                               f"{out}.{strategy}-{denominator}.optimizer")
                   for strategy, denominator in [("ddp", "global"), ("fsdp", "global"), ("hsdp", "global"),
                                                 ("ddp", "per-rank")]}
        for strategy in ("ddp", "fsdp"):
            for minibatches in (2, 1):  # 1: pi_old from the update's forward, a pass of its own for skipped rows only
                results[f"{strategy}-skip-{minibatches}"] = _step_on_ranks(
                    rank, world, model_path, True, strategy, f"{out}.{strategy}-skip-{minibatches}.optimizer",
                    skip=True, minibatches=minibatches)
        results["checkpoint"] = _checkpoint_on_ranks(rank, world, model_path, run_dir)
        results["ddp-exchanges"] = _exchanges_on_ranks(rank, world, model_path)
        results["engine-weights"] = _engine_weights_on_ranks(rank, world, model_path)
        results["evaluation"] = _evaluation_on_ranks(rank, world)
        results["loading"] = _loading_on_ranks(rank, world, model_path)
        if rank == 0:
            torch.save(results, out)
        # Tear down together: a rank that leaves while the other still holds the
        # connection can abort in gloo's teardown (seen once on a loaded machine).
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_model_path, preloaded_python):
    """The scenarios' results from two gloo ranks, and where the checkpoint scenario wrote its run."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    script = tmp / "ranks.py"  # 06-train is on the venv's path, as every chapter is
    script.write_text("import os, sys\nfrom test_distributed import _rank\n_rank(int(os.environ['RANK']), 2, *sys.argv[1:])\n")
    ranks = preloaded_python.run_together(
        [[script, tmp / "store", tiny_model_path, tmp / "run", tmp / "out.pt"]] * 2, cwd=tmp, envs=ranks_environment(), timeout=600)
    assert all(done.returncode == 0 for done in ranks), [done.stderr[-3000:] for done in ranks]
    return torch.load(tmp / "out.pt", weights_only=False), tmp / "run"


@pytest.fixture(scope="module")
def one_process(tiny_model_path):
    torch.manual_seed(0)
    model = load_policy(tiny_model_path, device="cpu")
    optimizer = make_optimizer(model, CFG)
    metrics = grpo_step(model, optimizer, group_trajectories(), CFG)
    return model.state_dict(), metrics


@pytest.fixture(scope="module")
def one_process_skipping(tiny_model_path):
    """minibatches -> (weights, metrics) of one process on the whole skewed batch."""
    out = {}
    for minibatches in (2, 1):
        torch.manual_seed(0)
        model = load_policy(tiny_model_path, device="cpu")
        cfg = replace(SKIP_CFG, num_minibatches=minibatches)
        out[minibatches] = model.state_dict(), grpo_step(model, make_optimizer(model, cfg), skewed_trajectories(), cfg)
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_skip_zero_advantage_rows_unevenly_run_the_same_passes_and_take_one_process_step(
        two_ranks, one_process_skipping, tiny_model_path, strategy):
    single, single_metrics = one_process_skipping[2]
    ranks = two_ranks[0][f"{strategy}-skip-2"]
    per_rank = ranks["per_rank"]
    # rank 0: mini-batch 1 all skipped (8 rows), mini-batch 2 none; rank 1: none, then 4 of 8
    assert [r["metrics"]["rows_skipped"] for r in per_rank] == [8, 4]
    # the old-log-prob pass over the second mini-batch's rows each rank trains, in the update's micro-batches
    # (rank 0: 8, rank 1: 4, padded with one pass of one row); then 3 + 3 passes on each rank: rank 0 pads its
    # empty first mini-batch with 3 passes of one row, rank 1 its 4 rows' 2 passes with one
    assert per_rank[0]["forwards"] == [3, 3, 2] + [1, 1, 1] + [3, 3, 2]
    assert per_rank[1]["forwards"] == [3, 1, 1] + [3, 3, 2] + [3, 1, 1]
    assert single_metrics["rows_skipped"] == ranks["metrics"]["rows_skipped"] == 12
    assert max_difference(single, load_policy(tiny_model_path, device="cpu").state_dict()) > 1e-3
    assert max_difference(ranks["weights"], single) < 2e-5
    for key in ("loss", "grad_norm", "tokens", "sequences", "entropy", "clip_low_frac", "ratio_mean", "approx_kl",
                "mismatch_abs", "informative_frac"):
        assert ranks["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_with_one_minibatch_ranks_pad_the_skipped_rows_pass_and_the_update_alike(
        two_ranks, one_process_skipping, strategy):
    """Rank 0 (problems 0-3) skips 8 rows, rank 1 (4-7) skips 4: no pass of their own (pi_old is the update's
    forward), and rank 0's update is padded to rank 1's count of passes: FSDP2 gathers in every forward."""
    single, single_metrics = one_process_skipping[1]
    ranks = two_ranks[0][f"{strategy}-skip-1"]
    per_rank = ranks["per_rank"]
    assert [r["metrics"]["rows_skipped"] for r in per_rank] == [8, 4]
    assert per_rank[0]["forwards"] == [3, 3, 2, 1]  # the update's 8 rows, padded by 1
    assert per_rank[1]["forwards"] == [3, 3, 3, 3]  # the update's 12 rows
    assert max_difference(ranks["weights"], single) < 2e-5
    for key in ("loss", "grad_norm", "tokens", "entropy", "ratio_mean", "approx_kl", "mismatch_abs", "mismatch_max",
                "informative_frac"):
        assert ranks["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key


@pytest.mark.e2e
def test_ddp_gradients_stay_views_of_its_buckets_after_a_step(two_ranks):
    """zero_grad(set_to_none=True) would free them: the next no_sync backward would allocate a second copy."""
    for result in two_ranks[0]["ddp-global"]["per_rank"]:
        assert result["grads"] == result["parameters"]  # kept, zeroed in place
        assert result["storages"] < result["parameters"] / 4  # a few buckets hold them all


@pytest.mark.e2e
def test_fsdp_checkpoints_keep_each_ranks_optimizer_shard_and_load_them_back(two_ranks):
    results, run = two_ranks
    result = results["checkpoint"]
    assert "optimizer" in result["files"] and "optimizer.pt" not in result["files"]  # shards, not one gathered file
    assert not list((run / "checkpoints").glob(".step-*"))  # the staging folder became the checkpoint's
    saved, loaded = result["saved"]["state"], result["loaded"]["state"]
    assert saved.keys() == loaded.keys() and saved
    for name in saved:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(saved[name][key]), torch.as_tensor(loaded[name][key])), (name, key)


@pytest.mark.e2e
def test_fsdp_reads_the_weights_on_rank_0_only_and_every_rank_ends_with_one_process_model(two_ranks, tiny_model_path):
    per_rank = two_ranks[0]["loading"]
    assert [r["loaded_weights"] for r in per_rank] == [True, False]  # rank 1 built the model on meta, read no weights
    reference = load_policy(tiny_model_path, device="cpu")
    expected = dict(reference.named_parameters())
    with torch.no_grad():
        logits = reference(FIXED_INPUT).logits
    for rank, result in enumerate(per_rank):
        assert result["weights"].keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(result["weights"][name], tensor.detach()), (rank, name)
        buffers = dict(reference.named_buffers())  # the rotary inv_freq: in no state dict, so not in the broadcast
        assert buffers and result["buffers"].keys() == buffers.keys()
        for name, tensor in buffers.items():
            assert torch.equal(result["buffers"][name], tensor), (rank, name)
        assert torch.allclose(result["logits"], logits, atol=1e-5, rtol=0), (rank, float((result["logits"] - logits).abs().max()))


@pytest.mark.e2e
def test_ddp_exchanges_gradients_once_per_minibatch_not_per_micro_batch(two_ranks):
    # each rank: 16 rows in 2 mini-batches of 8, micro-batches of 3 (3 per mini-batch): 6 exchanges if no_sync leaked
    assert two_ranks[0]["ddp-exchanges"] == CFG.num_minibatches


@pytest.mark.e2e
def test_fsdp_weight_sync_casts_each_shard_before_the_gather(two_ranks):
    result = two_ranks[0]["engine-weights"]
    assert result["gathered_dtypes"] == {torch.bfloat16}  # the gather moves bf16, not float32
    assert result["exact"] and result["names"]  # and still hands vLLM every full weight, exactly cast


def test_the_ranks_of_a_node_share_its_cores_for_their_sandboxes(monkeypatch):
    from configuration import sandbox_config
    from retool import Config

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(224)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert sandbox_config(Config()).concurrency == 28  # not 224 on each of 8 ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "300")
    assert sandbox_config(Config()).concurrency == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert sandbox_config(Config()).concurrency == 224  # one process: every core
    assert sandbox_config(Config(sandbox_concurrency=6)).concurrency == 6  # a pool sized by hand


@pytest.mark.parametrize("visible, processes", [(None, 8), ("0,1", 2), ("2,-1,3", 1), ("", 1)])
def test_make_starts_one_process_per_gpu_cuda_visible_devices_shows(tmp_path, visible, processes):
    """NPROC for a GPU preset: the GPUs CUDA would show this process, not every GPU of the node."""
    import os
    import re
    import subprocess
    from pathlib import Path

    fake = tmp_path / "nvidia-smi"  # a node of 8 GPUs, as `nvidia-smi -L` lists them
    fake.write_text("#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: H100\"; done\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    plan = subprocess.run(["make", "-n", "run-05", "PRESET=torl-1.5b", "DEVICE=cuda", "STAMP="], env=env,
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, check=True).stdout
    started = re.search(r"--nproc-per-node (\d+)", plan)
    assert (int(started.group(1)) if started else 1) == processes, plan


def test_make_refuses_to_install_cuda_packages_into_an_environment_built_for_the_cpu(tmp_path):
    """pip would keep the CPU build's torch (2.13.0+cpu satisfies torch==2.13.0): one environment per device."""
    import subprocess
    from pathlib import Path

    import os

    (tmp_path / ".installed-cpu").touch()  # what `make setup` leaves in a venv it built for the CPU
    gpu = tmp_path.with_name(tmp_path.name + "-bin") / "nvidia-smi"  # a GPU machine's: else make says first that
    gpu.parent.mkdir()  # there is no GPU
    gpu.write_text("#!/bin/sh\necho 'GPU 0: H100'\n")
    gpu.chmod(0o755)
    done = subprocess.run(["make", "setup", "DEVICE=cuda", f"VENV={tmp_path}"], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, env={**os.environ, "PATH": f"{gpu.parent}:{os.environ['PATH']}"})
    assert done.returncode != 0
    assert f"error: {tmp_path} was built for cpu, not cuda" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [".installed-cpu"]  # nothing installed


def test_make_refuses_a_python_older_than_3_11_before_it_makes_the_environment(tmp_path):
    """vLLM 0.32 and scipy 1.17 need 3.11: on 3.10 pip would fail partway through the install."""
    import subprocess
    from pathlib import Path

    old = tmp_path / "python3.10"  # answers as a Python 3.10 would
    old.write_text("#!/bin/sh\n[ \"$1\" = -V ] && { echo Python 3.10.12; exit 0; }\nexit 1\n")
    old.chmod(0o755)
    done = subprocess.run(["make", "setup", "DEVICE=cpu", f"PYTHON={old}", f"VENV={tmp_path / 'venv'}"],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert done.returncode != 0
    assert f"error: {old} is Python 3.10.12, and the lab needs Python 3.11 or newer" in done.stdout
    assert not (tmp_path / "venv").exists()  # nothing made, nothing installed


def test_every_script_refuses_a_python_older_than_3_11_in_one_line():
    """lab_cli, which every script imports first, says so before anything else runs."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys; sys.version_info = (3, 10, 12); import lab_cli"],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "the lab needs Python 3.11 or newer" in done.stderr, done.stderr


def max_difference(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_shard_deals_each_rank_a_slice_of_every_minibatch():
    items = list(range(8))
    assert DataParallel(0, 2).shard(items, 2) == [0, 1, 4, 5]
    assert DataParallel(1, 2).shard(items, 2) == [2, 3, 6, 7]
    assert DataParallel(0, 1).shard(items[:7], 2) == items[:7]  # one process: any size, order kept
    with pytest.raises(ValueError, match="do not split"):
        DataParallel(0, 2).shard(list(range(6)), 2)


@pytest.mark.e2e
def test_evaluation_shares_are_dealt_in_turn_and_gathered_back_in_the_problems_order(two_ranks):
    items = list("abcde")
    assert DataParallel(0, 2).share(items) == ([0, 2, 4], ["a", "c", "e"])
    assert DataParallel(1, 2).share(items) == ([1, 3], ["b", "d"])
    assert DataParallel(0, 1).share(items) == ([0, 1, 2, 3, 4], items)
    assert DataParallel(0, 1).gather_in_order(["z", "y"], [1, 0]) == ["y", "z"]
    with pytest.raises(ValueError, match="2 results for 1 indices"):
        DataParallel(0, 1).gather_in_order(["z", "y"], [0])
    owner = [0, 1, 0, 1, 0]  # two real ranks: rank 1's problems come back between rank 0's
    assert two_ranks[0]["evaluation"] == [[f"problem {i} sample {j} by rank {owner[i]}" for j in range(2)]
                                          for i in range(5)]


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "hsdp"])
def test_two_ranks_on_half_batches_take_the_same_step_as_one_process_on_the_whole(two_ranks, one_process,
                                                                                  tiny_model_path, strategy):
    """hsdp: two "nodes" of one rank (a 2-D mesh, replicate x shard): each micro-batch reduce-scatters within the
    node, and the gradient crosses nodes once a mini-batch, in the last micro-batch's all-reduce."""
    single, single_metrics = one_process
    ranks = two_ranks[0][f"{strategy}-global"]
    meshes = {"ddp": None, "fsdp": ((), (2,)), "hsdp": (("replicate", "shard"), (2, 1))}
    assert [r["mesh"] for r in ranks["per_rank"]] == [meshes[strategy]] * 2
    initial = load_policy(tiny_model_path, device="cpu").state_dict()
    assert max_difference(single, initial) > 1e-3  # the step moved the weights
    # float32 sums in another order (FSDP2 reduces after every micro-batch); a wrong denominator gives > 1e-4
    assert max_difference(ranks["weights"], single) < 2e-5
    for key in ("loss", "grad_norm", "tokens", "sequences", "entropy", "clip_low_frac", "ratio_mean", "mismatch_abs",
                "informative_frac"):
        assert ranks["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key


@pytest.mark.e2e
def test_dividing_by_each_ranks_own_token_count_gives_a_different_step(two_ranks, one_process):
    """The rule the equivalence rests on: the token-mean denominator is global, not per rank."""
    naive = two_ranks[0]["ddp-per-rank"]
    assert max_difference(naive["weights"], one_process[0]) > 1e-4
    print("per-rank denominator: max weight difference", max_difference(naive["weights"], one_process[0]))


def test_combined_metrics_weigh_ranks_by_what_each_metric_counts():
    a = {"trajectories": 4.0, "tokens": 100.0, "accuracy": 0.5, "tool_calls": 1.0, "code_pass_ratio": 1.0,
         "entropy": 1.0, "mismatch_max": 0.1, "rollout_s": 3.0, "grad_norm": 2.0, "problem_ids": ["a"], "step": 1}
    b = {"trajectories": 4.0, "tokens": 300.0, "accuracy": 0.0, "tool_calls": 0.0, "code_pass_ratio": float("nan"),
         "entropy": 2.0, "mismatch_max": 0.3, "rollout_s": 5.0, "grad_norm": 2.0, "problem_ids": ["b"], "step": 1}
    m = combine_metrics([a, b])
    assert m["trajectories"] == 8 and m["tokens"] == 400 and m["accuracy"] == 0.25
    assert m["code_pass_ratio"] == 1.0  # rank b made no calls: its NaN carries no weight
    assert m["entropy"] == pytest.approx(1.75)  # token-weighted
    assert m["mismatch_max"] == 0.3 and m["rollout_s"] == 5.0 and m["grad_norm"] == 2.0
    none_ran = {**a, "entropy": float("nan"), "mismatch_max": float("nan")}  # a rank that skipped every row
    assert combine_metrics([none_ran, b])["mismatch_max"] == 0.3 and combine_metrics([none_ran, b])["entropy"] == 2.0
    assert m["problem_ids"] == ["a", "b"] and m["step"] == 1
    assert math.isnan(combine_metrics([b, {**b, "tool_calls": 0.0}])["code_pass_ratio"])
    # self-correction by each rank's failed calls, masked shares by its tokens and sequences
    c = {"trajectories": 4.0, "tokens": 100.0, "sequences": 4.0, "errors": 1.0, "error_then_call_ok": 1.0,
         "tis_masked_frac": 0.0, "tis_masked_seq_frac": 0.0}
    d = {"trajectories": 4.0, "tokens": 300.0, "sequences": 12.0, "errors": 3.0, "error_then_call_ok": 0.0,
         "tis_masked_frac": 0.4, "tis_masked_seq_frac": 0.5}
    m = combine_metrics([c, d])
    assert m["errors"] == 4 and m["error_then_call_ok"] == 0.25
    assert m["tis_masked_frac"] == pytest.approx(0.3) and m["tis_masked_seq_frac"] == pytest.approx(0.375)


def test_each_step_logs_the_allocators_reserved_peak_on_cuda_and_the_fullest_rank_counts(monkeypatch):
    """max_memory_reserved counts torch's cached blocks too: what vLLM's wake had beside it (weight_sync.py)."""
    from run_record import measured_counterparts

    timing = {"generated_tokens": 10.0, "generate_s": 2.0}
    assert "peak_reserved_gb" not in measured_counterparts(timing)  # CPU: the process's peak alone
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 30e9)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 41e9)
    step = measured_counterparts(timing)
    assert (step["peak_memory_gb"], step["peak_reserved_gb"]) == (30.0, 41.0)
    assert combine_metrics([step, {**step, "peak_reserved_gb": 52.0}])["peak_reserved_gb"] == 52.0


DYNAMIC_SAMPLING_RANK = """
import json, sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch.distributed as dist

from batch_filters import keep_informative_groups

dist.init_process_group("gloo")
rank = dist.get_rank()


@dataclass
class Rollout:
    seed: int = 7


def scored(problems, rollout_cfg):  # a problem is its group's rewards; a trajectory carries its reward
    trajectories = [SimpleNamespace(reward=r) for rewards in problems for r in rewards]
    return trajectories, [None] * len(trajectories)


# rank 0 holds two informative groups at once; rank 1 none, and only its second extra round gives two
own = [[1, -1], [-1, 1]] if rank == 0 else [[1, 1], [-1, -1]]
asked = []


def more_problems(extra_round):
    asked.append(extra_round)
    return [[1, -1], [1, -1]] if extra_round == 2 else [[1, 1], [1, 1]]


cfg = SimpleNamespace(dynamic_sampling=True, group_size=2, dynamic_sampling_rounds=4)
trajectories, _, metrics = keep_informative_groups(*scored(own, None), scored, Rollout(), more_problems, cfg)
print("RESULT", json.dumps({"rounds": metrics["dynamic_rounds"], "asked": asked,
                            "rewards": [t.reward for t in trajectories]}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.e2e
def test_ranks_agree_on_dynamic_samplings_extra_rounds(tmp_path):
    """A rank whose groups are all informative still runs the round the others need (drawing nothing), so no rank
    waits in the next collective for more than one round of another's (gloo, two ranks)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "rounds.py"
    script.write_text(DYNAMIC_SAMPLING_RANK)
    ranks = [subprocess.Popen([sys.executable, script], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in ranks_environment()]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err[-2000:] for _, err in outputs]
    results = [json.loads(out.split("RESULT ", 1)[1].splitlines()[0]) for out, _ in outputs]
    assert [r["rounds"] for r in results] == [2.0, 2.0]  # alone, rank 0 would have stopped at 0
    assert results[0]["asked"] == [] and results[1]["asked"] == [1, 2]
    assert results[0]["rewards"] == [1, -1, -1, 1] and results[1]["rewards"] == [1, -1, 1, -1]


@pytest.mark.e2e
def test_one_failing_rank_ends_the_run_instead_of_a_hang(tmp_path, preloaded_python):
    """Rank 1 raises while rank 0 waits for it in a collective: torchrun stops rank 0 and names rank 1.

    torchrun runs as `python -m torch.distributed.run` would, in a fork of the preloaded interpreter;
    it starts each rank as a new interpreter, as always.
    """
    import torch.distributed.run

    script = tmp_path / "fail.py"
    script.write_text(
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "from distributed import setup\n"
        "@record\n"
        "def main():\n"
        "    dp = setup()\n"
        "    if dp.rank == 1:\n"
        "        raise RuntimeError('sandbox exploded on rank 1')\n"
        "    dp.barrier()  # would wait for rank 1 for the collective timeout (an hour)\n"
        "main()\n")
    done = preloaded_python.run([torch.distributed.run.__file__, "--standalone", "--nproc-per-node", "2", script],
                                cwd=tmp_path, timeout=120)
    assert done.returncode != 0
    report = done.stdout + done.stderr
    assert "sandbox exploded on rank 1" in report and "rank      : 1" in report


def ranks_environment(world: int = 2) -> list[dict]:
    """What torchrun --standalone gives each of `world` ranks on one machine (its rendezvous is the master's port)."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    return [{**common, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(world)]


@pytest.mark.e2e
@pytest.mark.vllm
def test_two_ranks_write_one_run_with_the_global_batch(tmp_path, tiny_model_path, preloaded_python):
    """Two CPU ranks, each with its own vLLM engine: one metrics.jsonl of the global batch, then a resume.

    The evaluations, dealt over the ranks, equal one process's sample for sample (sampled, k=2, over 3
    problems: rank 1's problem comes back between rank 0's two, seeded by its index in the whole set).
    The ranks get torchrun's environment and are forks of one preloaded
    interpreter (a launch without 20 s of imports); torchrun itself starts the
    ranks of test_one_failing_rank_ends_the_run_instead_of_a_hang.
    """
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    retool = repo / "05-retool" / "retool.py"
    run = tmp_path / "run"
    small = ["--model", str(tiny_model_path), "--cold-start", "none", "--problems-per-step", "4", "--group-size", "2",
             "--max-response-tokens", "16", "--eval-problems", "3", "--eval-max-response-tokens", "16",
             "--eval-k", "2", "--eval-temperature", "1.0",
             "--micro-batch-size", "2", "--enforce-eager", "true", "--cpu-kv-cache-gib", str(KV_CACHE_GIB),
             "--skip-zero-advantage", "false",  # every row runs, so the mismatch is measured though every reward is -1
             "--sandbox-preload", ""]  # the random model's code imports nothing: a sandbox start without numpy, sympy

    def launch(args):
        for done in preloaded_python.run_together([[retool, *args]] * 2, cwd=tmp_path, envs=ranks_environment(),
                                                  timeout=900):
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    launch(["--run-dir", str(run), "--steps", "1", *small])
    launch(["--resume", str(run), "--steps", "2"])  # two ranks pick up rank 0's checkpoint

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # one writer, no duplicate lines
    for r in rows:
        assert r["world_size"] == 2
        assert r["trajectories"] == 4 * 2 and r["sequences"] == 4 * 2  # the global batch, not one rank's half
        assert len(set(r["problem_ids"])) == 4
    # Every rank's engine samples what its trainer scores (float32 rounding only), also after the
    # resume. The random model earns -1 everywhere, so no step moves the weights here: that a sync
    # carries an update is test_grpo's job; here every rank runs the sync through its DDP wrapper.
    assert all(r["mismatch_abs"] < 1e-4 for r in rows)
    assert rows[1]["weight_version"] == 2  # the resumed engines hold the step-1 checkpoint, then one sync
    assert (run / "checkpoints" / "step-000002" / "state.json").exists()
    evals = [json.loads(line)["tag"] for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evals == ["before RL", "after RL", "after RL"]  # one writer (end of each launch)

    single = tmp_path / "one-process"  # the same run in one process: the same weights after step 1 (none moved)
    done = preloaded_python.run([retool, "--run-dir", single, "--steps", "1", *small], cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    evals = {folder: (folder / "eval.jsonl").read_text().splitlines()[:2] for folder in (run, single)}
    assert evals[run] == evals[single]
    for name in ("step-000000-tir.jsonl", "step-000001-tir.jsonl"):
        samples = {folder: (folder / "eval_samples" / name).read_text() for folder in (run, single)}
        assert samples[run] == samples[single], name
        assert len(samples[run].splitlines()) == 3 * 2, name


@pytest.mark.e2e
@pytest.mark.vllm
def test_each_ranks_engine_draws_its_own_samples_for_the_same_prompt(tmp_path, tiny_model_path, preloaded_python):
    """Two ranks (torchrun's environment, as above) start their engines as the loop does (rank_seed) and sample one prompt, unseeded.

    Then both reseed torch's generator alike and sample again: equal samples
    show that the seed alone made the difference (one seed for every rank's
    engine would make every rank's samples the same, problem for problem).
    """
    import json

    script = tmp_path / "samples.py"
    script.write_text(
        "import json, sys, torch\n"
        "from vllm import SamplingParams\n"
        "from distributed import setup\n"
        "from retool import Config, start_sampler\n"
        "dp = setup()\n"
        f"cfg = Config(max_model_len=64, enforce_eager=True, cpu_kv_cache_gib={KV_CACHE_GIB})\n"
        "llm = start_sampler(cfg, sys.argv[1], None, dp)\n"
        "params = SamplingParams(n=4, max_tokens=8, temperature=1.0, ignore_eos=True)\n"
        "def draw():\n"
        "    out = llm.generate([{'prompt_token_ids': [5, 6, 7, 8]}], params, use_tqdm=False)[0]\n"
        "    every = [None] * dp.world_size\n"
        "    torch.distributed.all_gather_object(every, [list(c.token_ids) for c in out.outputs])\n"
        "    return every\n"
        "own = draw()\n"
        "torch.manual_seed(0)\n"
        "common = draw()\n"
        "if dp.rank == 0:\n"
        "    print('SAMPLES', json.dumps({'own': own, 'common': common}), flush=True)\n"
        "dp.close()\n"
        "import os; os._exit(0)  # skip vLLM's shutdown, a full garbage collection of seconds\n")
    ranks = preloaded_python.run_together([[script, tiny_model_path]] * 2, cwd=tmp_path, envs=ranks_environment(),
                                          timeout=600)
    assert all(done.returncode == 0 for done in ranks), [done.stderr[-3000:] for done in ranks]
    samples = json.loads(ranks[0].stdout.split("SAMPLES ", 1)[1].splitlines()[0])
    assert samples["own"][0] != samples["own"][1]  # each rank's engine seed: different samples of one prompt
    assert samples["common"][0] == samples["common"][1]  # one seed: the same samples on both ranks


def node_environment(node, world_size: int = 2) -> dict:
    """One "node" of a cluster on this machine: its own temporary folder and caches; only the run folder is shared."""
    import os

    for name in ("tmp", "cache"):
        (node / name).mkdir(parents=True)
    return {**os.environ, "TMPDIR": str(node / "tmp"), "XDG_CACHE_HOME": str(node / "cache"),
            "VLLM_CACHE_ROOT": str(node / "cache" / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(node / "cache" / "inductor"),
            "OMP_NUM_THREADS": "1"}


@pytest.mark.e2e
@pytest.mark.vllm
def test_two_nodes_on_loopback_make_the_run_two_ranks_on_one_node_make(tmp_path, tiny_model_path, preloaded_python):
    """Two torchrun launchers, one rank each, meet by c10d rendezvous on loopback, as two nodes of a cluster would.

    Each "node" has its own temporary folder and caches, and the run folder is the only one they
    share. The run equals two ranks on one node (the same trajectories, metrics and weights), and
    it resumes from the checkpoint both nodes wrote.
    """
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    retool = Path(__file__).resolve().parent.parent / "05-retool" / "retool.py"
    small = ["--model", str(tiny_model_path), "--cold-start", "none", "--problems-per-step", "4", "--group-size", "2",
             "--max-response-tokens", "16", "--eval-problems", "2", "--eval-max-response-tokens", "16",
             "--micro-batch-size", "2", "--enforce-eager", "true", "--cpu-kv-cache-gib", str(KV_CACHE_GIB),
             "--skip-zero-advantage", "false",  # every row runs, so the mismatch is measured though every reward is -1
             "--sandbox-preload", "", "--strategy", "fsdp"]  # FSDP2: every rank writes its optimizer shard
    one, two = tmp_path / "one-node", tmp_path / "two-nodes"
    for done in preloaded_python.run_together([[retool, "--run-dir", one, "--steps", "1", *small]] * 2, cwd=tmp_path,
                                              envs=ranks_environment(), timeout=900):
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    nodes = [node_environment(tmp_path / f"node-{i}") for i in range(2)]

    def launch_nodes(args, attempt):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launchers = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"lab-{attempt}",
             "--node-rank", str(i), str(retool), *map(str, args)], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i, env in enumerate(nodes)]
        for launcher in launchers:
            out, _ = launcher.communicate(timeout=900)
            assert launcher.returncode == 0, out[-4000:]

    launch_nodes(["--run-dir", two, "--steps", "1", *small], 1)
    rows = {run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (one, two)}
    for key in ("world_size", "trajectories", "problem_ids", "reward_mean", "tokens", "loss", "response_length"):
        assert rows[two][0][key] == rows[one][0][key], key
    same_batch = [[(t["token_ids"], t["reward"]) for t in map(json.loads, (run / "last_step.jsonl").read_text().splitlines())]
                  for run in (one, two)]
    assert same_batch[0] == same_batch[1] and len(same_batch[0]) == 4 * 2  # the same trajectories, in rank order
    weights = [load_file(run / "checkpoints" / "step-000001" / "model.safetensors") for run in (one, two)]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])

    launch_nodes(["--resume", two, "--steps", "2"], 2)  # both nodes pick up the checkpoint in the shared run folder
    rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["world_size"] == 2 and r["trajectories"] == 8 for r in rows)
    assert rows[1]["weight_version"] == 2 and (two / "checkpoints" / "step-000002" / "state.json").exists()
    shards = sorted(p.name for p in (two / "checkpoints" / "step-000002" / "optimizer").glob("*.distcp"))
    assert len(shards) == 2  # one optimizer shard from each node, in the shared run folder
    # each node's processes kept their temporary files and caches in that node's own folders
    for node in (tmp_path / "node-0", tmp_path / "node-1"):
        assert list((node / "tmp").glob("torchelastic_*")) and list((node / "cache" / "vllm").iterdir()), node
