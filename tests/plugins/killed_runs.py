"""Runs SIGKILLed part-way, made once per test session and shared: a custom loop on
``engine.launch`` (it logs ``train/mse``, never ``train/loss``, and has no epoch-end hook)
and an ``engine-run`` of the tiny recipe. tests/plugins/test_csv_logger.py checks what
their metrics.csv kept; tests/engine/commands/test_report.py reports on them."""

from __future__ import annotations

import pathlib
import signal

from engine.testing import TINY_RECIPE, run_python
from tests.conftest import engine_env, made_once_per_session, run_cli

#: A loop from the docs' pattern: it kills itself (SIGKILL) when its fourth epoch
#: (index 3) starts, after the snapshot of its third.
CUSTOM_LOOP = '''\
import os, signal, sys

import torch
from torch import nn

import engine


def train(ctx, kill_at):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, optimizer = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = ctx.loader(data, batch_size=16)
    for epoch in ctx.epochs(6):
        if epoch == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            ctx.log({"train/mse": loss.item()})
        ctx.log({"val/mse": loss.item()})


if __name__ == "__main__":
    engine.launch(train, 3, nproc=1, config=engine.TrainConfig(out_dir=sys.argv[1]))
'''

#: engine-run killed right after this optimizer step (1 process, 8 steps per epoch,
#: log_every=2): in its second epoch, after the check point at step 12 logged step 10's
#: window.
ENGINE_RUN_KILL_STEP = 13


def made_once(tmp_path_factory, name: str, source: str, run) -> pathlib.Path:
    """``<session temp>/<name>/run``, made by ``run(folder, script, out)`` the first time
    asked in this test session (on any xdist worker: made_once_per_session), with
    ``source`` written to the folder's script first."""
    def make(base: pathlib.Path) -> None:
        script = base / "script.py"
        script.write_text(source)
        run(base, script, base / "run")

    return made_once_per_session(tmp_path_factory, name, make) / "run"


def killed_custom_loop(tmp_path_factory):
    """The out_dir of CUSTOM_LOOP, killed at the start of its fourth epoch."""
    def run(base, script, out):
        proc = run_python([str(script), str(out)], cwd=base, env=engine_env(), timeout=240)
        assert proc.returncode != 0, proc.stdout + proc.stderr  # killed, not finished

    return made_once(tmp_path_factory, "killed-custom-loop", CUSTOM_LOOP, run)


def killed_engine_run(tmp_path_factory):
    """The out_dir of the tiny recipe's engine-run, SIGKILLed after step 13."""
    def run(base, recipe, out):
        proc = run_cli(str(recipe), "epochs=3", "log_every=2", f"out_dir={out}",
                       "--nproc", "1", "-p", "tests.fault_plugin",
                       env=engine_env(ENGINE_FAULT_ACTION="kill",
                                      ENGINE_FAULT_STEP=str(ENGINE_RUN_KILL_STEP)))
        assert proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL, 1), (
            proc.returncode, proc.stdout + proc.stderr)

    return made_once(tmp_path_factory, "killed-engine-run", TINY_RECIPE, run)
