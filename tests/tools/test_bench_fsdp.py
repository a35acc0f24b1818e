"""tools/bench_fsdp.py, smoke-sized: fsdp against ddp (losses, bytes per rank) and
against a hand-written FSDP2 loop (identical final weights), and the activation memory
that checkpointing saves. The numbers themselves are the benchmark's business; the
sharding's halving of the bytes per rank is arithmetic, so it is checked."""

from __future__ import annotations

import json

from engine.testing import run_python
from tests.conftest import REPO, engine_env


def test_bench_fsdp_reports_equal_losses_half_the_bytes_and_identical_weights(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python(
        [str(REPO / "tools" / "bench_fsdp.py"), "--reps", "1", "--size", "256",
         "--batch", "32", "--json", str(out)],
        cwd=REPO, env=engine_env(ENGINE_START_METHOD="fork"), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["steps"] == 8 and result["losses_close"]
    assert result["bytes_ratio"] <= 0.55, result["bytes_per_rank"]
    assert result["weights_identical"] and result["ratio"] > 0
    saves = result["dcp_saves"]  # async_save of the sharded state, on gloo
    assert 0 < saves["async_blocking_s"] <= saves["async_total_s"]
    memory = result["activation_bytes"]
    assert 0 < memory["Conv2d,Linear"] < memory["none"]
    assert "fsdp / ddp bytes per rank: 0.5" in proc.stdout


def test_bench_fsdp_snapshots_times_what_each_dcp_checkpointer_blocks_the_loop(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python(
        [str(REPO / "tools" / "bench_fsdp.py"), "--snapshots", "--reps", "1", "--size",
         "256", "--batch", "32", "--snapshot-every", "3", "--json", str(out)],
        cwd=REPO, env=engine_env(ENGINE_START_METHOD="fork"), timeout=600)
    # Exit 0: the runs with and without snapshots ended with the same weights.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    snapshots = json.loads(out.read_text())["engine_snapshots"]
    # 8 steps: snapshots after steps 3 and 6, and the epoch's end (the loop's own).
    assert snapshots["snapshots"] == {"dcp": 3, "dcp-async": 3}
    assert all(0 < s < 60 for s in snapshots["blocking_s"].values())
    assert set(snapshots["loop_s"]) == {"fsdp", "fsdp@dcp", "fsdp@dcp-async"}
    assert "dcp-async blocks " in proc.stdout


def test_bench_fsdp_on_cuda_without_a_gpu_says_so_in_one_line():
    # The CUDA path itself: tests/gpu/test_cuda_fsdp.py.
    proc = run_python([str(REPO / "tools" / "bench_fsdp.py"), "--device", "cuda"],
                      cwd=REPO, env=engine_env(), timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: --device cuda: no CUDA device is visible"), proc.stderr


def test_bench_fsdp_compares_losses_as_fp32_and_says_where_they_first_differ():
    # Losses near 4.5 off by two units in fp32's last place (char_lm's clipping: 1.2e-6):
    # close by fp32's tolerances, which Python floats (float64's) would refuse.
    report = load_tool().report
    ddp = [5.0, 4.75, 4.5, 4.25]
    fsdp = [5.0, 4.75, 4.5 + 2 ** -20, 4.25 - 2 ** -20]
    bytes_ = {"params": 4, "grads": 4, "optimizer": 8}
    result = report([{"variant": "ddp+probe", "losses": ddp, "bytes": bytes_},
                     {"variant": "fsdp+probe", "losses": fsdp, "bytes": bytes_}],
                    [], {}, None)
    assert result["losses_close"] and not result["losses_bit_identical"]
    assert (result["first_differing_step"], result["differing_steps"]) == (3, 2)
    wrong = [5.0, 4.75, 4.6, 4.25]
    assert not report([{"variant": "ddp+probe", "losses": ddp, "bytes": bytes_},
                       {"variant": "fsdp+probe", "losses": wrong, "bytes": bytes_}],
                      [], {}, None)["losses_close"]


def load_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_fsdp",
                                                  REPO / "tools" / "bench_fsdp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
