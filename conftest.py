"""Fixtures shared by every chapter's tests.

The tiny model is built once per test session (a few seconds) and the vLLM
engine over it is started once, eager (without compilation it starts in about
6 s on a 2-core CPU instead of 22): every test that needs real vLLM shares that
one engine, and the tests that only run code through a sandbox share one. A test
that changes the engine's weights (06-train's weight sync) must put the original
weights back before it ends.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """Folder of a random-init Qwen2 (head_dim 64) with a locally trained tokenizer."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_path):
    """One real vLLM engine over the tiny model, float32, shared by the whole session."""
    from rollout import make_llm
    from tiny_model import KV_CACHE_GIB

    return make_llm(tiny_model_path, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
                    cpu_kv_cache_gib=KV_CACHE_GIB)  # kept to the exit


@pytest.fixture(scope="session")
def sandbox():
    """One sandbox with a run's defaults, shared by the tests that only run code through it: each start imports
    numpy and sympy once more (1.3 s). Chapter 02's tests of the sandbox's rules start their own."""
    from sandbox import Sandbox

    with Sandbox() as sb:
        yield sb


_preloaded = []  # the one PreloadedPython of the session, once started


# Tests that start no engine and no sandbox and use one core: they run first, while the preloaded interpreter
# imports on the other core, so that chapter 02's sandbox calls do not run beside those imports.
ONE_CORE_FIRST = ("test_spine.py", "test_results.py", "01-data/", "04-reward/")


# The end-to-end tier (`make test-all`, pytest -m e2e), besides every test marked @pytest.mark.e2e where it is
# written: each test that runs a lab script (it forks the preloaded interpreter), probes the unprivileged mode as
# its own user or runs code in the Docker backend's containers, and these, which each take a second or more on two
# cores: real cold starts and bases, ranks and nodes, sockets under load, deadlines that must pass. A name is a test
# or the start of a parametrized one's id. `make test` leaves them out; every chapter's contracts stay in it.
E2E_FIXTURES = ("preloaded_python", "unprivileged", "attacks")
E2E = {
    "02-sandbox/test_sandbox.py": (
        "test_a_call_is_answered_at_its_deadline_however_long_its_processes_take_to_exit",
        "test_concurrent_calls_mixing_good_and_hostile_code_keep_their_own_results",  # local and docker
        "test_calls_from_many_threads_each_get_their_own_result[docker]",
        "test_kernel_memory_of_mappings_and_epoll_watches_is_charged_to_the_call_and_stops_at_its_cap",  # both kinds
        "test_pipes_and_the_other_kernel_queues_hold_nothing_past_the_cap",
        "test_plain_isolation_still_kills_an_escaped_daemon_and_stops_runaway_code",
        "test_sleeping_past_the_timeout_is_stopped_and_keeps_what_was_printed[local]",
    ),
    "02-sandbox/test_sandbox_pool.py": (
        "test_a_call_waits_for_a_free_slot_outside_its_deadline_when_the_client_is_sized_to_the_pool",
        "test_a_pool_member_killed_mid_run_loses_and_repeats_no_call",
        "test_one_deadline_ends_a_call_however_a_member_paces_its_bytes[_flood_continue]",
        "test_one_deadline_ends_a_call_however_a_member_paces_its_bytes[_trickle_a_body]",
        "test_one_deadline_ends_a_call_however_a_member_paces_its_bytes[_trickle_a_head]",
    ),
    "02-sandbox/test_serve.py": (
        "test_idle_connections_past_the_open_files_limit_neither_starve_a_call_nor_spin_the_server",
        "test_legitimate_calls_are_answered_while_2000_connections_come_and_go[1024-2000-kinds1]",
        "test_legitimate_calls_are_answered_while_2000_connections_come_and_go[None-2000-kinds0]",
        "test_out_of_descriptors_the_accept_loop_rests_instead_of_spinning",
        "test_run_timeout_is_cut_to_the_servers_maximum",
        "test_slow_clients_hold_neither_the_accept_loop_nor_a_thread_and_each_gets_408_at_its_deadline",
        "test_the_backend_round_trip_gives_the_in_process_sandboxs_results",
        "test_under_load_every_request_is_answered_exactly_once",
    ),
    "04-reward/test_torl_scorer.py": (  # the scorer's command line, a script of its own
        "test_command_line_scores_a_jsonl_file_in_order",
    ),
    "03-rollout/test_rollout.py": (  # the second schedule's slowest variants; its equivalence test stays
        "test_tool_budget_caps_executions_then_output_no_longer_stops[rounds-2]",
        "test_stop_string_ending_inside_a_token_keeps_the_whole_token[rounds]",
        "test_samples_of_one_group_differ[rounds]",
        "test_printed_special_tokens_stay_text[rounds-",
    ),
    "05-retool/test_chained_task.py": (
        "test_a_cold_start_on_the_chained_task_trains_on_its_chained_traces",
        "test_cold_start_traces_show_each_move_at_the_low_rate_with_the_sandboxs_real_output",
        "test_every_answer_is_scored_plus_one_and_the_multi_call_policy_earns_it_in_the_sandbox",
        "test_the_single_call_policy_solves_only_the_one_step_unpadded_problems",
    ),
    "05-retool/test_cold_start.py": (
        "test_a_stopped_cold_start_goes_on_from_its_partial_checkpoint_to_the_same_model",
    ),
    "05-retool/test_failures.py": (
        "test_a_run_written_to_a_file_holds_the_labs_lines_and_nothing_of_the_libraries",
    ),
    "05-retool/test_mistakes.py": (
        "test_a_run_piped_into_head_stops_at_its_next_line_with_a_checkpoint_to_resume",
    ),
    "05-retool/test_retool.py": (
        "test_a_refusal_exits_2_with_one_line_and_no_traceback",
        "test_loop_runs_is_stopped_killed_and_resumes_where_it_stopped",
        "test_the_dry_run_prints_the_plan_and_names_the_missing_data_in_seconds",
    ),
    "06-train/test_distributed.py": (
        "test_each_ranks_engine_draws_its_own_samples_for_the_same_prompt",
        "test_one_failing_rank_ends_the_run_instead_of_a_hang",
        "test_two_nodes_on_loopback_make_the_run_two_ranks_on_one_node_make",
        "test_two_ranks_write_one_run_with_the_global_batch",
    ),
    "06-train/test_experiment.py": (
        "test_a_base_of_several_schedules_is_the_chain_of_separate_cold_starts",
        "test_run_06_end_to_end_at_toy_sizes",
    ),
    "06-train/test_grpo.py": (
        "test_all_options_run_together_in_a_real_step",
        "test_at_ratio_one_each_objective_takes_ppo_clips_step[gspo-against1]",
        "test_each_new_objective_and_mask_runs_real_steps_with_finite_metrics",
        "test_micro_batch_size_does_not_change_the_update[sequence-mean]",
        "test_micro_batch_size_does_not_change_the_update[token-sum]",
        "test_no_forward_runs_for_a_metric_alone_entropy_and_mismatch_describe_the_rows_the_update_runs",
        "test_the_first_minibatch_takes_pi_old_from_its_own_forward_and_the_step_is_the_same[False-1]",
        "test_the_plans_logit_bytes_are_what_the_chunks_hold",
        "test_tis_weight_is_old_over_sampler_capped_and_scales_the_update",
    ),
    "06-train/test_released_base.py": (
        "test_a_release_writes_the_files_whole_and_the_hashes_that_then_check_them",
        "test_the_recipe_holds_the_kernels_whatever_instruction_sets_the_machine_would_pick",
        "test_the_recipe_is_the_presets_cold_starts_at_one_thread_resumed_and_refused_as_another",
    ),
}


def is_e2e(item) -> bool:
    path, _, name = item.nodeid.partition("::")
    fixtures = getattr(item, "fixturenames", ())
    on_docker = item.get_closest_marker("docker") or getattr(item, "callspec", None) and \
        item.callspec.params.get("backend") == "docker"  # a container per call: the Docker backend end to end
    return bool(on_docker) or any(f in fixtures for f in E2E_FIXTURES) or any(name.startswith(t) for t in E2E.get(path, ()))


def pytest_collection_modifyitems(session, config, items):
    """Mark the end-to-end tier; then the one-core chapters first, the others as collected, and last the tests
    that fork the preloaded interpreter."""
    for item in items:
        if is_e2e(item):
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda item: ("preloaded_python" in getattr(item, "fixturenames", ()),
                                 not item.nodeid.startswith(ONE_CORE_FIRST)))  # stable: else as collected


FORKING = ("05-retool", "06-train")  # the chapters with tests that fork the preloaded interpreter


def pytest_sessionstart(session):
    """Start the preloaded interpreter before collection when the run includes a whole chapter whose tests fork it:
    its imports then take the other core while the tests are collected and the one-core chapters run. Only the
    end-to-end tier forks it: `make test` (-m "not e2e") never starts it."""
    if "not e2e" in (session.config.option.markexpr or ""):
        return
    root, here = session.config.rootpath, session.config.invocation_params.dir
    for arg in session.config.args:
        path = (here / arg.split("::")[0]).resolve()
        if any(path == root / name or path in (root / name).parents for name in FORKING):
            _start_preloaded()
            return


def pytest_collection_finish(session):
    """Or as soon as the run is known to need it."""
    if any("preloaded_python" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_preloaded()


def _start_preloaded():
    from preloaded_python import PreloadedPython

    if not _preloaded:
        _preloaded.append(PreloadedPython())
    return _preloaded[0]


@pytest.fixture(scope="session")
def preloaded_python():
    """Runs the lab's scripts as `python script.py` does, each a fork of one interpreter that imported
    torch, transformers and vLLM once (preloaded_python.py): 15-20 s less a start."""
    return _start_preloaded()


def pytest_sessionfinish(session):
    """Stop the preloaded interpreter if it was started, used or not: never left importing after the run."""
    if _preloaded:
        _preloaded.pop().close()
