"""What vLLM starts with, for the server's options on each platform (pure: no engine)."""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.forkserver
import os
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from servers.engine.options import (
    TINY_MODEL_NAME,
    EngineOptions,
    RequestLimits,
    add_engine_arguments,
    engine_options_from_args,
)
from servers.engine.vllm_adapter import core_preload
from servers.engine.vllm_adapter.engine_args import (
    ContextTooLong,
    ModelNotFound,
    Platform,
    engine_arguments,
    resolved_model,
)

CPU = Platform(is_cpu=True)
GPU = Platform(is_cpu=False, sleep_mode_available=True)


def test_the_tiny_model_on_cpu_runs_in_one_process_on_one_thread() -> None:
    made = engine_arguments(EngineOptions(kv_cache_gib=2), RequestLimits(max_logprobs=5), CPU, "/m")
    args, env = made.args, made.environment
    assert args["model"] == "/m" and args["served_model_name"] == TINY_MODEL_NAME
    assert args["dtype"] == "float32"  # the tiny model's own dtype: exact outputs
    assert args["distributed_executor_backend"] == "uni" and args["max_logprobs"] == 5
    assert "gpu_memory_utilization" not in args and "enable_lora" not in args
    assert args["kv_cache_memory_bytes"] == 2 << 30
    assert env == {
        "SKYRL_WEIGHT_HEAP_SLACK": "1",
        "SKYRL_WEIGHT_COMMIT_PREPARE": "0",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def test_the_kv_cache_takes_a_fraction_of_a_gib_and_fits_the_model_by_default() -> None:
    def size(**options: object) -> int:
        made = engine_arguments(EngineOptions(**options), RequestLimits(), CPU, "/m")  # type: ignore[arg-type]
        return int(made.args["kv_cache_memory_bytes"])

    # vLLM's own VLLM_CPU_KVCACHE_SPACE takes whole GiB only; this is what it cannot say.
    assert size(kv_cache_gib=0.25) == 1 << 28
    assert size() == 1 << 27  # the tiny model: its whole context for 256 sequences
    assert size(model="/some/model") == 1 << 30
    with pytest.raises(ValueError, match="--kv-cache-gib 0: must be a positive number of GiB"):
        size(kv_cache_gib=0)
    # On a GPU vLLM sizes the cache from gpu_memory_utilization.
    gpu = engine_arguments(EngineOptions(), RequestLimits(), GPU, "/m")
    assert "kv_cache_memory_bytes" not in gpu.args


def test_a_local_model_path_that_is_not_there_fails_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelNotFound, match=f"--model {missing}: does not exist"):
        resolved_model(EngineOptions(model=missing))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFound, match="is a file, not a model directory"):
        resolved_model(EngineOptions(model=str(tmp_path / "weights.bin")))
    # What exists is served as given; anything else may be a Hugging Face repo id.
    assert resolved_model(EngineOptions(model=str(tmp_path))) == str(tmp_path)
    assert resolved_model(EngineOptions(model="org/name")) == "org/name"
    # A home-relative path reaches vLLM expanded (it would take "~/..." for a repo id).
    monkeypatch.setenv("HOME", str(tmp_path.parent))
    assert resolved_model(EngineOptions(model=f"~/{tmp_path.name}")) == str(tmp_path)


def test_a_model_of_ones_own_keeps_its_dtype_and_vllms_thread_binding() -> None:
    options = EngineOptions(model="/models/x", dtype="auto", tensor_parallel_size=2)
    made = engine_arguments(options, RequestLimits(), CPU, "/models/x")
    assert made.args["dtype"] == "auto" and made.args["served_model_name"] is None
    assert "distributed_executor_backend" not in made.args  # several workers: vLLM's executor
    assert "OMP_NUM_THREADS" not in made.environment


def test_lora_on_cpu_takes_one_more_slot_for_the_zero_adapter() -> None:
    options = EngineOptions(enable_lora=True, max_loras=2, max_lora_rank=16)
    cpu = engine_arguments(options, RequestLimits(), CPU, "/m").args
    gpu = engine_arguments(options, RequestLimits(), GPU, "/m").args
    assert (cpu["max_loras"], cpu["max_cpu_loras"]) == (3, 3)
    assert (gpu["max_loras"], gpu["max_cpu_loras"]) == (2, 2)
    assert cpu["max_lora_rank"] == gpu["max_lora_rank"] == 16


def test_gpu_arguments_and_extra_arguments_win() -> None:
    options = EngineOptions(
        model="/m", gpu_memory_utilization=0.5, extra_engine_args={"max_num_seqs": 7}
    )
    made = engine_arguments(options, RequestLimits(), GPU, "/m")
    assert made.args["gpu_memory_utilization"] == 0.5 and made.args["enable_sleep_mode"]
    assert made.args["max_num_seqs"] == 7
    assert made.environment == {  # nothing of CPU serving
        "SKYRL_WEIGHT_HEAP_SLACK": "1",
        "SKYRL_WEIGHT_COMMIT_PREPARE": "0",
    }


def test_structured_outputs_settings_reach_vllm_or_are_refused_naming_the_flag() -> None:
    """``--structured-outputs-config`` as vLLM's own flag takes it: compact JSON on xgrammar
    reaches the engine; what vLLM refuses (free whitespace off on its "auto" backend, a
    setting it does not have) fails when the arguments are made, naming the flag."""
    from servers.engine.options import add_engine_arguments, engine_options_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    compact = '{"backend": "xgrammar", "disable_any_whitespace": true}'
    options = engine_options_from_args(parser.parse_args(["--structured-outputs-config", compact]))
    config = engine_arguments(options, RequestLimits(), CPU, "/m").args["structured_outputs_config"]
    assert config.backend == "xgrammar" and config.disable_any_whitespace is True
    assert (
        "structured_outputs_config"
        not in engine_arguments(EngineOptions(), RequestLimits(), CPU, "/m").args
    )
    for refused in ({"disable_any_whitespace": True}, {"no_such_setting": 1}):
        with pytest.raises(ValueError, match="--structured-outputs-config"):
            engine_arguments(
                EngineOptions(structured_outputs_config=refused), RequestLimits(), CPU, "/m"
            )
    with pytest.raises(SystemExit):  # not JSON: argparse names the flag
        parser.parse_args(["--structured-outputs-config", "{disable"])


def test_the_weight_heap_slack_reaches_the_workers_environment() -> None:
    """The workers' weight-transfer engine reads it there (vLLM's config has no place for it);
    a negative slack means never give freed memory back."""
    for platform in (CPU, GPU):
        options = EngineOptions(model="/m", weight_heap_slack=-1)
        made = engine_arguments(options, RequestLimits(), platform, "/m")
        assert made.environment["SKYRL_WEIGHT_HEAP_SLACK"] == "-1"
    half = engine_arguments(EngineOptions(weight_heap_slack=0.5), RequestLimits(), CPU, "/m")
    assert half.environment["SKYRL_WEIGHT_HEAP_SLACK"] == "0.5"


def test_preparing_layers_ahead_of_the_commit_reaches_the_workers_environment() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for argv, value in (([], "0"), (["--weight-commit-prepare"], "1")):
        options = engine_options_from_args(parser.parse_args(["--model", "/m", *argv]))
        made = engine_arguments(options, RequestLimits(), CPU, "/m")
        assert made.environment["SKYRL_WEIGHT_COMMIT_PREPARE"] == value
    # Refused in one line where a swap is unsound.
    for platform, eager in ((GPU, True), (CPU, False)):
        options = EngineOptions(weight_commit_prepare=True, enforce_eager=eager)
        with pytest.raises(ValueError, match="--weight-commit-prepare: CPU engines in eager mode"):
            engine_arguments(options, RequestLimits(), platform, "/m")


def test_the_engine_core_forks_from_a_preloaded_process_only_where_that_is_safe() -> None:
    one = EngineOptions()
    assert core_preload.wanted(one, cpu_build=True, ray_actor=False)
    assert not core_preload.wanted(one, cpu_build=False, ray_actor=False)  # GPUs fork already
    assert not core_preload.wanted(one, cpu_build=True, ray_actor=True)  # vLLM spawns in Ray
    assert not core_preload.wanted(EngineOptions(tensor_parallel_size=2), True, False)
    assert not core_preload.wanted(EngineOptions(preload_engine_core=False), True, False)


def _report_variable_and_title(name: str, answer: Connection) -> None:
    import setproctitle  # what vLLM names its engine core with

    setproctitle.setproctitle("VLLM::EngineCore")
    with open("/proc/self/comm") as comm:
        answer.send((os.environ.get(name), comm.read().strip()))


def test_a_forkserver_child_gets_the_environment_its_parent_had_when_it_started_it() -> None:
    """As a spawned child would: vLLM sets variables after the forkserver started; and it can
    still name itself (ps shows the engine core as such)."""
    context = core_preload._PreloadedContext()
    variable = "SKYRL_TEST_SET_AFTER_THE_FORKSERVER_STARTED"
    multiprocessing.forkserver.ensure_running()
    os.environ[variable] = "seen"
    try:
        ours, theirs = multiprocessing.Pipe()
        child = context.Process(target=_report_variable_and_title, args=(variable, theirs))
        child.start()
        assert ours.poll(60), "the child never answered"
        assert ours.recv() == ("seen", "VLLM::EngineCor")  # the kernel keeps 15 characters
        child.join(60)
        assert child.exitcode == 0
    finally:
        del os.environ[variable]


def test_a_max_model_len_over_the_models_context_fails_naming_the_flag(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve --max-model-len 4096` on the embedded model (512 tokens): at once, by name, not a
    pydantic error after vLLM's imports."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ContextTooLong, match=r"--max-model-len 4096: the embedded model has a "
                       r"context of 512 tokens.*at most 512"):  # fmt: skip
        resolved_model(EngineOptions(max_model_len=4096))
    assert resolved_model(EngineOptions(max_model_len=512)) == str(tiny_model_dir)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own override
    assert resolved_model(EngineOptions(max_model_len=4096)) == str(tiny_model_dir)
