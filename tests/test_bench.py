"""Benchmarks must keep running: each prints one JSON object as its last line (figures are not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # each runs a benchmark's quick mode: tens of seconds

BENCH = Path(__file__).resolve().parent.parent / "bench"


def quick_run(name: str, timeout: float = 150) -> dict[str, Any]:
    """Run ``bench/<name>.py --quick`` and return its last line, which must be its JSON object."""
    out = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--quick"], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == name, out.stdout
    return result


@pytest.mark.timeout(120)
def test_ipc_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("ipc", timeout=110)
    assert result["lossless"] is True
    for key in ("tether_events_per_s", "baseline_events_per_s", "ratio", "tether_p50_us", "tether_p99_us"):
        assert result[key] > 0


@pytest.mark.timeout(170)
def test_orphan_exit_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("orphan_exit")
    assert result["quick"] is True
    assert result["survivors"] == 0 and result["drill_survivors"] == 0, result
    assert result["drill_processes"] == 3 * (2 + 6 + 6)  # per worker: idle (runner, guard), busy (+ four helpers)
    for key in ("default_p99_ms", "default_group_p99_ms", "pdeathsig_p99_ms", "lifeline_p99_ms", "poll_p99_ms"):
        assert result[key] > 0
    assert result["seed_poll_p99_ms"] > 0
    for name, trials in result["trials"].items():  # every runner exit kept, for the docs' distributions
        assert len(result["samples_ms"][name]) == trials, (name, result["samples_ms"])


@pytest.mark.timeout(170)
def test_detect_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("detect")
    assert result["quick"] is True
    assert result["lost_events"] == 0, result
    assert result["p99_ms"] > 0
    assert result["baseline_p99_ms"] > 0
    samples = result["samples_ms"]  # every trial kept, for the docs' distributions
    assert len(samples["all_terminal"]) == len(samples["failed_status"]) == result["trials"], samples
    assert len(samples["baseline"]) == result["baseline_trials"], samples


@pytest.mark.timeout(170)
def test_memory_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("memory")
    assert result["quick"] is True
    for key in (
        "footprint_sample_p50_us",
        "footprint_sample_p99_us",
        "debug_footprint_sample_p50_us",
        "group_sample_p50_us",
        "group_sample_p99_us",
        "node_sample_p50_us",
        "node_sample_p99_us",
        "tokens_per_s_without_sampling",
        "tokens_per_s_with_sampling",
        "ratio",
        "ratio_default_interval",
        "sampling_interval_s",
        "debug_ratio",
        "runner_rss_mib",
        "runner_footprint_mib",
    ):
        assert result[key] > 0, (key, result)
    assert result["target_ratio"] == 0.99
    assert isinstance(result["meets_target"], bool)
    assert isinstance(result["gpu"], str) and result["gpu"]


@pytest.mark.timeout(120)
def test_hang_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("hang", timeout=110)
    assert result["quick"] is True
    assert result["wrong_cause"] == 0 and result["errors"] == 0, result
    assert result["stacks_captured"] == result["stacks_expected"] > 0, result
    assert result["all_declared_p99_ms"] is not None


@pytest.mark.timeout(150)
@pytest.mark.model  # its quick run loads the default model too
def test_cancel_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("cancel", timeout=140)
    assert result["quick"] is True
    assert result["wrong_state"] == 0 and result["extra_mismatch"] == 0, result
    assert result["debug_tokens_after_max"] <= 1, result
    if result["llama_skipped"] is None:
        assert result["llama_tokens_after_max"] <= 1, result


@pytest.mark.timeout(120)
def test_resume_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("resume", timeout=110)
    assert result["quick"] is True and result["ok"] is True and result["errors"] == [], result
    assert result["mismatch_count"] == 0, result["cases"]
    assert {case["case"] for case in result["cases"]} == {"debug N=8"}, result
    for case in result["cases"]:
        n = case["streams"]
        assert case["completed"] == case["equal_solo"] == case["resumed"] == case["pauses"] == n, case
        assert case["baseline_lost_without_retry"] == case["baseline_completed"] == n, case  # the retries completed
        for key in ("pause_p50_s", "restart_s", "baseline_recovery_p50_s", "ratio_p50"):
            assert case[key] > 0, (key, case)


@pytest.mark.cores
@pytest.mark.timeout(330)
@pytest.mark.model  # its quick run loads the default model too
def test_serve_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("serve", timeout=320)
    if result.get("skipped"):
        pytest.skip(result["skipped"])
    assert result["quick"] is True and result["error"] is None, result
    assert result["errors"] == 0 and result["leftover_processes"] == 0, result
    assert result["tokens_per_s_ratio"] > 0 and result["ttft_added_ms"] is not None
    if result["llama_server_skipped"] is None:  # only where llama-server is already built: --quick never builds
        for c in result["concurrency"]:
            assert result[f"tokens_per_s_ratio_vs_llama_server_c{c}"] > 0, (c, result)
            assert result[f"llama_server_ttft_p50_ms_c{c}"] > 0, (c, result)
        assert isinstance(result["llama_server_outputs_identical"], bool), result
    # tether without speculation answered the same requests, and the texts were compared
    assert result["tether_nospec_skipped"] is None and result["speculation_compared_texts"] > 0, result


@pytest.mark.cores
@pytest.mark.timeout(180)
@pytest.mark.model  # its quick run loads the default model too
def test_swap_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("swap", timeout=170)
    assert result["quick"] is True and result["error"] is None and result["ok"] is True, result
    assert result["errors"] == 0 and result["leftover_processes"] == 0, result
    assert result["wrong_evictions"] == 0 and result["instance_failures"] == 0, result
    assert not result["oom_kills"], result  # 0, or None where there is no memory cgroup
    for key in ("swap_ttft_p50_ms", "baseline_swap_ttft_p50_ms", "ratio", "load_s", "loaded_idle_ttft_p50_ms"):
        assert result[key] > 0, (key, result)
    assert result["loaded_during_load_ttft_p50_ms"] > 0 and result["loaded_during_load_requests"] > 0, result
    assert result["loaded_model_added_gap_ms"] is not None, result  # a difference of medians: its sign is the data's
    if result["eviction_by"] == "memory":
        assert result["cgroup_limit_bytes"] > 0 and result["reclaim_p50_ms"] > 0, result
        assert result["baseline_reclaim_p50_ms"] >= 1000 * result["baseline_reclaim_poll_s"], result


@pytest.mark.cores
@pytest.mark.timeout(150)
@pytest.mark.model  # its quick run loads the default model too
def test_load_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("load", timeout=140)
    assert result["quick"] is True and result["error"] is None and result["ok"] is True, result
    assert result["lost_requests"] == 0 and result["failed_requests"] == 0, result
    assert result["completed"] == result["requests"] > 0, result
    # at 256 clients the queue of 128 fills: refused with Retry-After, retried until complete
    assert result["rejected_503"] > 0 and result["rejected_without_retry_after"] == 0, result
    assert result["leftover_processes"] == 0, result
    for c in (64, 256):
        for side in ("tether", "baseline"):
            assert result[f"c{c}_{side}_tokens_per_s"] > 0, (c, side, result)
            assert result[f"c{c}_{side}_request_ttft_p99_ms"] > 0, (c, side, result)
        assert result[f"c{c}_tokens_per_s_ratio"] > 0 and result[f"c{c}_ttft_p99_ratio"] > 0, result
    if result["model_skipped"] is None:
        assert result["model_errors"] == 0 and result["model_leftover_processes"] == 0, result
        assert result["model_c8_tokens_per_s_ratio"] > 0 and result["model_c8_tether_ttft_p50_ms"] > 0, result


@pytest.mark.timeout(120)
def test_soak_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("soak", timeout=110)
    assert result["quick"] is True and result["ok"] is True and result["minutes"] == 0.4, result
    for key in ("lost_requests", "hung", "misclassified", "rejected_without_retry_after", "leftover_runners"):
        assert result[key] == 0, (key, result)
    assert set(result["faults"]) == {"SIGKILL", "SIGSEGV", "SIGABRT", "SIGSTOP", "disconnect", "cancel_storm"}, result
    assert result["restarts"] == result["runner_faults"] >= 4, result
    assert result["completed"] > 0 and len(result["windows"]) == 3, result
    assert result["p99_ms_first_window"] > 0 and result["p99_ms_last_window"] > 0, result
    assert result["rss_start_mib"] > 0 and result["fds_start"] > 0 and result["samples"] >= 10, result


@pytest.mark.timeout(60)
def test_gpu_check_runs_or_says_why_not() -> None:
    """bench/gpu.py is the GPU machine's check (see its docstring); without a GPU it must say why and exit 0."""
    out = subprocess.run([sys.executable, str(BENCH / "gpu.py")], capture_output=True, text=True, timeout=50)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "gpu", out.stdout
    if result.get("skipped"):
        assert out.returncode == 0 and result["ok"] is None, out
        assert "NVML" in result["skipped"] or "torch" in result["skipped"] or "CUDA" in result["skipped"], result
    else:
        assert out.returncode == 0 and result["ok"] is True, out.stdout + out.stderr


@pytest.mark.serial  # its worker rounds leave a SIGKILLed worker's ranks on purpose: another test's reap ends them
@pytest.mark.timeout(120)
def test_ranks_bench_quick_run_prints_its_json_line() -> None:
    result = quick_run("ranks", timeout=110)
    assert result["quick"] is True and result["ok"] is True and result["errors"] == [], result
    assert result["rounds"] == 2 and result["same_ports"] is True, result
    assert result["orphans"] == 0 and result["leftover_processes"] == 0, result
    assert result["baseline_crash_loop"] is True and result["baseline_lives"] == 3, result  # its quick policy's limit
    assert result["baseline_orphans"] > 0, result
    for key in (
        "rank_fail_all_p50_ms",
        "rank_fail_all_p99_ms",
        "request_failed_p50_ms",
        "ranks_gone_p50_ms",
        "replacement_ready_p50_ms",
        "replacement_ready_max_ms",
        "baseline_failed_after_ms",
        "tether_new_worker_ready_ms",
    ):
        assert result[key] > 0, (key, result)
