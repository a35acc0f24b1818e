"""engine/cpu_bf16.py and precision=bf16 on the CPU: the warning where the CPU has no
bf16 hardware (--dry-run, doctor, the run's first lines), and a real 2-process bf16
run that learns and resumes bit-identically after a kill mid-epoch."""

from __future__ import annotations

import re

import pytest

from engine import cpu_bf16
from tests import conftest
from tests.conftest import REPO, read_summary, run_cli, run_cli_here

RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")
# 96 samples, global batch 16: 6 steps an epoch. The kill after step 9 (rank 1) is
# mid-epoch 1, after the snapshot of step 8.
BF16_RUN = ("precision=bf16", "epochs=3", "checkpoint.every_steps=4")
KILL_STEP = 9
#: Whether this machine's CPU has bf16 hardware (the development machine's has not:
#: AVX2 only), so that the tests below assert the right thing on either kind.
SLOW_HERE = cpu_bf16.note_here() is not None


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 sve\n")
    assert cpu_bf16.cpu_flags(str(x86)) == {"fpu", "sse2", "avx2", "fma"}
    assert cpu_bf16.cpu_flags(str(arm)) == {"fp", "asimd", "bf16", "sve"}
    assert cpu_bf16.cpu_flags(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("flags, has", [
    ({"avx2", "fma"}, False),  # this project's development machine
    ({"avx512f", "avx512_bf16"}, True),  # Cooper Lake, Zen 4
    ({"avx512f", "amx_tile", "amx_bf16"}, True),  # Sapphire Rapids
    ({"asimd", "bf16"}, True),  # Arm with the BF16 extension
    (None, None),  # unknown: no warning rather than a wrong one
])
def test_bf16_hardware_is_one_of_the_bf16_flags(flags, has):
    assert cpu_bf16.has_bf16(flags) is has
    note = cpu_bf16.note(flags)
    if has is False:
        assert note.startswith("precision=bf16 on a CPU without bf16 hardware")
        assert "8x to 90x slower than fp32" in note and "precision=32" in note
    else:
        assert note is None


def test_dry_run_says_what_bf16_costs_on_this_cpu_and_nothing_for_fp32(tmp_path):
    bf16 = run_cli_here(RECIPE, "precision=bf16", f"out_dir={tmp_path}", "--dry-run",
                        check=True)
    row = re.search(r"^  precision {2,}bf16.*$", bf16.stdout, re.M).group(0)  # the plan's
    assert ("warning: precision=bf16 on a CPU without bf16 hardware" in row) == SLOW_HERE, row
    fp32 = run_cli_here(RECIPE, f"out_dir={tmp_path}", "--dry-run", check=True)
    assert "bf16 hardware" not in fp32.stdout


def test_doctor_names_the_cpus_bf16_hardware():
    proc = run_cli_here("doctor")
    assert re.search(r"^  CPU: \S+ \(torch's kernels\), bf16 hardware: "
                     f"{'no' if SLOW_HERE else 'yes'}$", proc.stdout, re.M), proc.stdout
    assert ("note    precision=bf16 on a CPU without bf16 hardware" in proc.stdout) == SLOW_HERE


def epoch_losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^epoch \d+/\d+  train loss \(epoch mean\) (\S+)", stdout, re.M)]


def test_bf16_on_the_cpu_learns_and_resumes_bit_identically_after_a_kill(tmp_path):
    reference = tmp_path / "reference"
    proc = run_cli(RECIPE, *BF16_RUN, f"out_dir={reference}", "--nproc", "2", check=True)
    losses = epoch_losses(proc.stdout)
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], proc.stdout  # it learns
    # The warning is among the run's first lines, once (rank 0), where it applies.
    assert proc.stderr.count("without bf16 hardware") == (1 if SLOW_HERE else 0), proc.stderr

    out = tmp_path / "resumed"
    resumed = conftest.killed_then_resumed(RECIPE, *BF16_RUN, f"out_dir={out}", "--nproc", "2",
                                           tmp_path=tmp_path, step=KILL_STEP)
    assert "epoch 2, step 8, batch 2 of the epoch" in resumed.stdout, resumed.stdout
    assert read_summary(out)["weights_sha256"] == read_summary(reference)["weights_sha256"]
