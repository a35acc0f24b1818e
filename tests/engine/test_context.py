"""engine/context.py: one worker context under engine-run and in custom loops, and one
summary.json, the same keys from both (and from every end of a run)."""

from __future__ import annotations

import ast
import datetime
import json
import textwrap

import pytest
import torch

import engine
from engine.api import Context
from engine.context import WorkerContext
from engine.engine import Engine
from tests.conftest import REPO, engine_env, read_summary, run_cli

RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")


def custom_loop(ctx, epochs, fail=False):
    """A small loop of one's own: one linear layer, two epochs of three steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, optimizer = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(48, 4), torch.arange(48) % 2)
    loader = ctx.loader(data, batch_size=16)
    for _ in ctx.epochs(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        ctx.log(ctx.reduce({"train/loss": 0.5}))
        if fail:
            raise ValueError("diverged")


def library_run(out_dir, fail=False, plugins=()) -> dict:
    cfg = engine.TrainConfig(out_dir=str(out_dir))
    if fail:
        with pytest.raises(ValueError, match="diverged"):
            engine.launch(custom_loop, 2, fail, nproc=1, config=cfg, plugins=plugins)
    else:
        engine.launch(custom_loop, 2, nproc=1, config=cfg, plugins=plugins)
    return read_summary(out_dir)


PROBE = textwrap.dedent("""
    import json
    from engine.hookspecs import RunContext

    def engine_run_end(engine, summary):
        # What a plugin is promised (engine.hookspecs.RunContext), checked on the real
        # object a hook receives.
        names = [n for n in dir(RunContext) if not n.startswith("_")]
        names += list(RunContext.__annotations__)
        missing = sorted(n for n in set(names) if not hasattr(engine, n))
        (engine.out_dir / "probe.json").write_text(json.dumps(
            {"missing": missing, "is_run_context": isinstance(engine, RunContext)}))
""")


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A plugin module, context_probe, that checks the hook's engine argument."""
    (tmp_path / "context_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "context_probe"


def test_both_loops_are_one_worker_context():
    assert issubclass(Engine, WorkerContext) and issubclass(Context, WorkerContext)


def test_engine_run_and_a_custom_loop_write_the_same_summary_keys(tmp_path, probe):
    run_cli(RECIPE, "epochs=1", f"out_dir={tmp_path / 'cli'}", "--nproc", "1", "-p", probe,
            "checkpoint.best_metric=val/accuracy",
            env=engine_env(PYTHONPATH=f"{tmp_path}:{REPO}"), check=True)
    cli = read_summary(tmp_path / "cli")
    lib = library_run(tmp_path / "lib", plugins=[probe])
    # The same keys, but for the validation metrics each loop logged (val_NAME each).
    assert sorted(k for k in cli if k != "val_accuracy") == sorted(lib)
    # Every key either path wrote before they shared one builder is still there.
    assert {"status", "recipe", "world_size", "launcher", "parallel", "epochs_completed",
            "global_step", "wall_time_s", "train_loss", "train_epoch_loss", "val_loss",
            "val_accuracy", "samples_per_sec", "throughput_unit", "data_wait_fraction",
            "weights_sha256",
            "weights_sha256_per_rank", "metrics"} <= set(cli)

    for summary, recipe, requested in ((cli, RECIPE, 1), (lib, __file__, 2)):
        assert summary["status"] == "completed" and summary["error"] is None
        assert summary["recipe"] == recipe
        assert summary["epochs_requested"] == summary["epochs_completed"] == requested
        started = datetime.datetime.fromisoformat(summary["started_at"])
        ended = datetime.datetime.fromisoformat(summary["ended_at"])
        assert started.utcoffset() == datetime.timedelta(0) and started <= ended
        assert summary["torch_version"] == torch.__version__
        assert summary["engine_version"] == engine.__version__
        assert (summary["resumed_from"], summary["stopped_early"]) == (None, False)
        assert summary["final_checkpoint"].endswith(".pt")
        assert summary["weights_sha256"] == summary["weights_sha256_per_rank"][0]
    # The best snapshot is the checkpointer's, where a metric picks one.
    assert cli["best_checkpoint"] == cli["final_checkpoint"] and lib["best_checkpoint"] is None
    assert lib["train_loss"] == 0.5 == lib["metrics"]["train/loss"]
    assert cli["metrics"]["train/loss"] == cli["train_loss"]
    # Library mode records its config too, as engine-run does; both contexts give the
    # hooks everything engine.hookspecs.RunContext promises.
    for name in ("cli", "lib"):
        assert json.loads((tmp_path / name / "probe.json").read_text()) == {
            "missing": [], "is_run_context": True}
        assert json.loads((tmp_path / name / "config.json").read_text())["out_dir"] == str(
            tmp_path / name)


def test_a_failed_custom_loop_writes_the_same_keys_with_its_error(tmp_path):
    completed = library_run(tmp_path / "ok")
    failed = library_run(tmp_path / "failed", fail=True)
    assert sorted(failed) == sorted(completed)
    assert (failed["status"], failed["error"]) == ("failed", "ValueError: diverged")
    assert failed["epochs_completed"] == 0 and failed["global_step"] == 3
    assert failed["weights_sha256"] is None  # a collective: never on the failure path


def test_the_summary_throughput_is_the_epochs_else_the_windows():
    from engine.context import throughput_summary

    window = {"train/loss": 1.0, "train/tokens_per_sec": 900.0}
    assert throughput_summary(window) == {"throughput_unit": "tokens", "tokens_per_sec": 900.0}
    # An epoch's own name wins over the last window's, whatever the order.
    both = {"train/epoch_tokens_per_sec": 800.0, **window}
    assert throughput_summary(both) == {"throughput_unit": "tokens", "tokens_per_sec": 800.0}
    assert throughput_summary({"lr": 0.1}) == {"throughput_unit": "samples",
                                               "samples_per_sec": None}


# ------------------------------------------------- who sets the run's attributes

#: The names engine/ binds the run object to (the Engine, a Context: hooks' ``engine``,
#: recipes' ``ctx``, the loop's ``eng``), and a helper's ``self.engine`` or ``self.ctx``.
RUN_NAMES = {"engine", "eng", "ctx", "context", "run_ctx"}


def run_object(node) -> bool:
    """``node`` names the run object: one of RUN_NAMES, or ``self.engine``/``self.ctx``."""
    return ((isinstance(node, ast.Name) and node.id in RUN_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in ("engine", "ctx")
                and isinstance(node.value, ast.Name) and node.value.id == "self"))


def attribute_writes(tree) -> list[tuple[int, ast.Attribute]]:
    """Every ``X.attr = ...`` (also augmented, annotated, in tuples) and
    ``setattr(X, ...)``/``delattr(X, ...)``, as ``(line, target)``."""
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and node.args):
            found.append((node.lineno, ast.Attribute(value=node.args[0], attr="?")))
        for target in targets:
            stack = [target]
            while stack:
                each = stack.pop()
                if isinstance(each, (ast.Tuple, ast.List)):
                    stack.extend(each.elts)
                elif isinstance(each, ast.Attribute):
                    found.append((each.lineno, each))
    return found


#: Writes from outside that are known and due to go, by ``file: attribute written``.
KNOWN_OUTSIDE_WRITES: set[str] = set()


def test_no_engine_module_sets_attributes_on_the_run_object_from_outside():
    """The run's attributes are set by its own classes (engine/context.py, engine.py,
    api.py: through ``self``); what the loop drives goes into its RunParts record, which
    only engine/worker_setup.py's steps fill from outside (``ctx.run_parts.model = ...``),
    besides context.py's own attributes that stand for the record's fields
    (``ctx.model``). engine/snapshot.py records a resume through ``ctx.record_resume``."""
    from tests.engine.test_imports import ENGINE

    outside, parts_outside = [], []
    for path in sorted(ENGINE.rglob("*.py")):
        where = path.relative_to(ENGINE.parent)
        for line, target in attribute_writes(ast.parse(path.read_text(), str(path))):
            if run_object(target.value) and (
                    f"{where}: {ast.unparse(target)}" not in KNOWN_OUTSIDE_WRITES):
                outside.append(f"{where}:{line}: {ast.unparse(target)}")
            elif (isinstance(target.value, ast.Attribute) and target.value.attr == "run_parts"
                  and run_object(target.value.value)
                  and path.name not in ("worker_setup.py", "context.py")):
                parts_outside.append(f"{where}:{line}: {ast.unparse(target)}")
    assert outside == [] and parts_outside == []


def test_the_scan_sees_each_way_of_setting_an_attribute():
    source = textwrap.dedent("""
        ctx.model = m
        eng.memory, other = None, 1
        self.engine.steps: int = 1
        self.ctx.resumed_from = path
        eng.epochs_requested += 1
        setattr(engine, "resumed_from", path)
        ctx.run_parts.model = m
        eng.state.epoch = 2       # the state's own attribute: not the run's
        run.status = "completed"  # not a name of the run object
    """)
    writes = attribute_writes(ast.parse(source))
    assert sorted((line, ast.unparse(t)) for line, t in writes if run_object(t.value)) == [
        (2, "ctx.model"), (3, "eng.memory"), (4, "self.engine.steps"),
        (5, "self.ctx.resumed_from"), (6, "eng.epochs_requested"), (7, "engine.?")]
    assert [ast.unparse(t) for _, t in writes if ast.unparse(t.value) == "ctx.run_parts"] == [
        "ctx.run_parts.model"]
