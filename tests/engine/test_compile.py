"""engine/compile.py: ``compile.*`` through the real doors.

Compiling is slow on this machine (tens of seconds for the first graph; torch's cache
under /tmp/torchinductor_$USER makes a repeated one a few seconds), so the suite has
ONE compiled multi-process run (two gloo processes, whole model), shared by the tests
below with the eager run of the same recipe and a resume of the compiled run (the
same graphs: torch's cache answers). The regional compile runs once, in this process,
through the library door."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import engine
from engine.checkpoint import load_model_state, plain_keys
from engine.compile import compile_model, regions
from engine.config import CompileConfig
from engine.errors import ConfigError
from tests.conftest import read_summary, run_cli
from tests.recipes.tiny_parallel_runs import TINY_RECIPE, tiny_env

#: Compiled and eager kernels round differently (inductor fuses and reorders sums):
#: the losses of the same 16 steps agree to this.
LOSS_TOLERANCE = 1e-4
COMPILE_TIMEOUT_S = 600  # a first compile on a loaded 2-core machine


def tiny(out, *args, nproc=2, **env):
    return run_cli(TINY_RECIPE, f"out_dir={out}", "--nproc", str(nproc), "epochs=2",
                   *args, env={**tiny_env(), **env}, timeout=COMPILE_TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The eager run, the compiled run and the compiled run resumed from its epoch-1
    snapshot (2 processes each), with their summaries."""
    root = tmp_path_factory.mktemp("compile")
    eager = tiny(root / "eager")
    # CUDA_HOME names a folder: torch then warns of it wherever no CUDA runtime is found.
    compiled = tiny(root / "compiled", "compile.enabled=true", CUDA_HOME=str(root))
    assert eager.returncode == 0, eager.stderr
    assert compiled.returncode == 0, compiled.stderr
    first_epoch = next((root / "compiled" / "checkpoints").glob("snapshot-e0001-*.pt"))
    resumed = tiny(root / "resumed", "compile.enabled=true", "--resume", str(first_epoch))
    assert resumed.returncode == 0, resumed.stderr
    return {name: (proc, read_summary(root / name), root / name)
            for name, proc in (("eager", eager), ("compiled", compiled),
                               ("resumed", resumed))}


def test_compiled_and_eager_runs_reach_the_same_losses(runs):
    (_, eager, _), (_, compiled, _) = runs["eager"], runs["compiled"]
    for key in ("train_loss", "val_loss"):
        assert compiled[key] == pytest.approx(eager[key], abs=LOSS_TOLERANCE), key
    # DDP reduced the compiled module's gradients: the ranks finished with equal weights.
    assert len(set(compiled["weights_sha256_per_rank"])) == 1


def test_compile_time_is_measured_printed_once_and_in_the_summary(runs):
    proc, compiled, _ = runs["compiled"]
    assert runs["eager"][1]["compile_s"] is None
    assert compiled["compile_s"] > 0
    said = re.findall(r"^compile: ([\d.]+) s spent compiling on rank 0 .*; (\d+) graph",
                      proc.stdout, re.M)
    assert len(said) == 1, proc.stdout  # rank 0 only, once
    assert float(said[0][0]) == pytest.approx(compiled["compile_s"], abs=0.05)
    assert int(said[0][1]) >= 2  # the training and the validation graphs
    assert proc.stdout.count("compile: TinyNet compiled (mode default") == 1


def test_a_cpu_run_does_not_print_torchs_cuda_home_warning_per_rank(runs):
    proc, _, _ = runs["compiled"]
    assert "CUDA_HOME" not in proc.stderr, proc.stderr


def test_a_resumed_compiled_run_compiles_again_and_ends_identically(runs):
    _, compiled, _ = runs["compiled"]
    _, resumed, _ = runs["resumed"]
    assert resumed["resumed_from"] is not None
    assert resumed["compile_s"] > 0
    assert resumed["weights_sha256"] == compiled["weights_sha256"]


def test_compiled_snapshots_hold_plain_keys_that_load_into_plain_and_compiled_models(runs):
    from tests.recipes.tiny_parallel_recipe import ModelConfig, TinyNet

    _, compiled, out = runs["compiled"]
    snap = torch.load(compiled["final_checkpoint"], map_location="cpu", weights_only=True)
    assert not [k for k in snap["model"] if "_orig_mod" in k]
    plain, user_compiled = TinyNet(ModelConfig()), torch.compile(TinyNet(ModelConfig()))
    for model in (plain, user_compiled):
        load_model_state(model, snap["model"])
        got = plain_keys(model.state_dict())
        assert all(torch.equal(got[k], v) for k, v in snap["model"].items())
    # ... and the compiled weights are the eager run's, up to rounding.
    eager = torch.load(runs["eager"][1]["final_checkpoint"], map_location="cpu",
                       weights_only=True)["model"]
    for key, value in snap["model"].items():
        assert torch.allclose(value, eager[key], atol=1e-4), key


def test_a_model_that_fails_to_compile_is_one_line_naming_it(tmp_path):
    """fullgraph=true turns the recipe's graph break into torch.compile's error: found
    while tracing, before any code is generated, so this run is fast."""
    proc = run_cli(TINY_RECIPE, f"out_dir={tmp_path}", "--nproc", "1",
                   "model.host_branch=true", "compile.enabled=true", "compile.fullgraph=true",
                   env=tiny_env(), timeout=COMPILE_TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"\[rank 0\] error: compile: TinyNet failed to compile \(\w+: .+\); "
                        r"run without compile \(compile\.enabled=false\).*", line), proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------- the library door, regional


def regional_loop(ctx):
    """A loop whose model has two Linear blocks, compiled one by one (compile.regional);
    returns the loss curve and the snapshot's keys."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ctx.wrap(model, optimizer)
    inputs = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    loader = ctx.loader(torch.utils.data.TensorDataset(inputs, inputs[:, :4].argmax(1)),
                        batch_size=16)
    losses = []
    for _ in ctx.epochs(2):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    compiled = [type(m).__name__ for m in ctx.module.modules() if m._compiled_call_impl]
    return {"losses": torch.stack(losses).tolist(), "compiled": compiled}


def user_compiled_loop(ctx, epochs, compiled: bool):
    """The user's own torch.compile (aot_eager: no code generation, so it is quick)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if compiled:
        model = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ctx.wrap(model, optimizer)
    inputs = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    loader = ctx.loader(torch.utils.data.TensorDataset(inputs, inputs[:, :4].argmax(1)),
                        batch_size=16)
    for _ in ctx.epochs(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return plain_keys(ctx.module.state_dict())


def test_regional_compile_through_the_library_door(tmp_path):
    config = engine.TrainConfig(out_dir=str(tmp_path / "eager"))
    eager = engine.launch(regional_loop, nproc=1, config=config)
    config = engine.TrainConfig(out_dir=str(tmp_path / "regional"))
    config.compile = CompileConfig(enabled=True, regional=("Linear",))
    regional = engine.launch(regional_loop, nproc=1, config=config)
    assert eager["compiled"] == []
    assert regional["compiled"] == ["Linear", "Linear"]
    assert regional["losses"] == pytest.approx(eager["losses"], abs=LOSS_TOLERANCE)
    assert read_summary(tmp_path / "regional")["compile_s"] > 0


def test_a_user_compiled_model_saves_plain_keys_and_resumes_into_a_plain_one(tmp_path):
    def config():
        return engine.TrainConfig(out_dir=str(tmp_path / "run"))

    straight = engine.launch(user_compiled_loop, 2, False,
                             config=engine.TrainConfig(out_dir=str(tmp_path / "plain")),
                             nproc=1)
    engine.launch(user_compiled_loop, 1, True, config=config(), nproc=1)
    snapshot = read_summary(tmp_path / "run")["final_checkpoint"]
    keys = torch.load(snapshot, map_location="cpu", weights_only=True)["model"]
    assert sorted(keys) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # The plain model resumes the compiled one's snapshot and trains its second epoch.
    resumed = engine.launch(user_compiled_loop, 2, False, config=config(), nproc=1)
    assert read_summary(tmp_path / "run")["resumed_from"] == snapshot
    for key, value in straight.items():
        assert torch.allclose(resumed[key], value, atol=1e-5), key


def test_ddp_optimizer_splits_the_module_compiled_before_the_wrap_at_its_buckets(tmp_path):
    """The order compile -> DDP keeps torch's DDPOptimizer: the module compiles inside
    DDP's forward, and its graph reaches the backend in one piece per bucket (four 1 MB
    layers, 1 MB buckets). A counting backend: no code is generated."""
    import torch.distributed as dist
    from torch._dynamo import register_backend
    from torch.nn.parallel import DistributedDataParallel as DDP

    graphs = []

    @register_backend(name="count_graphs_for_test")
    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    compile_model(model, CompileConfig(enabled=True, backend="count_graphs_for_test"),
                  say=lambda _: None)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        DDP(model, bucket_cap_mb=1)(torch.randn(2, 512)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert len(graphs) == 4


# ------------------------------------------------------------- no compile needed


def test_regions_are_the_outermost_modules_of_the_named_classes():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

    model = nn.Sequential(Block(), nn.ReLU(), Block(), nn.Linear(2, 2))
    assert regions(model, ()) == [model]
    assert regions(model, ("Block",)) == [model[0], model[2]]
    # A Linear inside a compiled Block is compiled with it, not again.
    assert regions(model, ("Block", "Linear")) == [model[0], model[2], model[3]]
    with pytest.raises(ConfigError, match=r"compile.regional=Blok: the model Sequential "
                                          r"has no submodule of class Blok; its classes "
                                          r"are Block, Linear, ReLU, Sequential"):
        regions(model, ("Blok",))


def test_compile_options_are_checked_before_anything_compiles():
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="'compile.regional' compiles only with "
                                          "compile.enabled=true"):
        compile_model(model, CompileConfig(regional=("Linear",)))
    with pytest.raises(ConfigError, match=r"compile: .*nope.* \(compile.backend='nope'"):
        compile_model(model, CompileConfig(enabled=True, backend="nope"), say=lambda _: None)
    assert compile_model(model, CompileConfig()) is model
    assert model._compiled_call_impl is None
