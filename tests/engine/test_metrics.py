"""engine/metrics.py: which way a named metric is better (read from its name unless the
config says), the one comparison the best snapshot and early stopping share, and the
checks of the names a config gives, in the config and in the launching process; early
stopping and the throughput's unit."""

from __future__ import annotations

import math

import pytest

import engine
from engine.config import TrainConfig
from engine.overrides import apply_overrides
from engine.errors import ConfigError
from engine.recipe import recipe_from_object
from engine.metrics import (EarlyStopping, Throughput, direction, improves, not_logged,
                            resolved_mode)
from tests.conftest import REPO, run_cli_here

TINY = str(REPO / "tests" / "recipes" / "tiny_parallel_recipe.py")


@pytest.mark.parametrize("name", [
    "val/loss", "train/epoch_loss", "val/error", "val/top1_error", "val/mae", "val/mse",
    "val/rmse", "val/perplexity", "val/ppl", "val/bits_per_char", "val/bpc", "val/wer",
    "val/cer", "val/nll", "val/char_error_rate", "val/kl_divergence", "val/fid", "loss",
    "val/dice_loss", "val/f1_loss", "val/negative_log_likelihood",  # the last word decides
])
def test_lower_is_better_for_losses_and_errors(name):
    assert direction(name) == "min"


@pytest.mark.parametrize("name", [
    "val/accuracy", "val/acc", "val/acc1", "val/top5", "val/top2", "train/epoch_accuracy",
    "val/f1", "val/macro_f1", "val/f1_score", "val/r2", "val/precision", "val/recall@10",
    "val/auc", "val/roc_auc", "val/AUROC", "val/bleu", "val/rougeL", "val/mIoU", "val/dice",
    "val/psnr", "val/ndcg10", "val/mAP50", "val/hit_rate", "val/log_likelihood",
    "val/neg_mean_squared_error", "val/neg_log_loss",  # sklearn's scorers: negated
    "train/epoch_samples_per_sec", "train/tokens_per_sec",
])
def test_higher_is_better_for_accuracies_and_scores(name):
    assert direction(name) == "max"


@pytest.mark.parametrize("name", [
    "val/score", "lr", "train/data_wait_fraction", "val/metric",
    "val/loss_and_accuracy", "val/acc_minus_loss",  # two metrics in one
])
def test_a_name_that_says_neither_or_both_has_no_direction(name):
    assert direction(name) is None


def test_an_explicit_mode_wins_and_auto_reads_the_name_or_asks():
    assert resolved_mode("val/loss", "max", "checkpoint.best_mode") == "max"
    assert resolved_mode("val/accuracy", "min", "early_stopping.mode") == "min"
    assert resolved_mode("val/loss", "auto", "checkpoint.best_mode") == "min"
    assert resolved_mode("val/accuracy", "auto", "early_stopping.mode") == "max"
    with pytest.raises(ConfigError) as error:
        resolved_mode("val/score", "auto", "checkpoint.best_mode")
    assert str(error.value) == (
        "config key 'checkpoint.best_mode': cannot tell from the name 'val/score' whether "
        "higher or lower is better; set checkpoint.best_mode=min or checkpoint.best_mode=max")


def test_improves_by_more_than_min_delta_and_never_with_a_non_finite_value():
    assert improves(1.0, None, "min") and improves(0.9, 1.0, "min")
    assert not improves(1.0, 1.0, "min") and not improves(1.0, 1.0, "max")  # equal: no
    assert improves(0.5, 0.4, "max") and not improves(0.4, 0.5, "max")
    assert not improves(0.96, 1.0, "min", min_delta=0.05)
    assert improves(0.94, 1.0, "min", min_delta=0.05)
    assert not improves(math.nan, None, "min") and not improves(math.inf, 1.0, "max")
    assert improves(1.0, math.nan, "min")  # a NaN an older run kept is no reference


def config(*overrides: str) -> TrainConfig:
    return apply_overrides(TrainConfig(), list(overrides))


def test_the_config_check_refuses_an_auto_mode_the_name_cannot_tell():
    assert config("checkpoint.best_metric=val/loss").checkpoint.best_mode == "auto"
    config("checkpoint.best_metric=val/score", "checkpoint.best_mode=max")  # said: fine
    for key, mode in (("checkpoint.best_metric", "checkpoint.best_mode"),
                      ("early_stopping.metric", "early_stopping.mode")):
        with pytest.raises(ConfigError, match=rf"^config key '{mode}': cannot tell from "
                                              rf"the name 'val/score' .*{mode}=max$"):
            config(f"{key}=val/score")


def test_the_best_snapshot_and_early_stopping_must_agree_on_a_shared_metric():
    config("checkpoint.best_metric=val/loss", "early_stopping.metric=val/loss")
    with pytest.raises(ConfigError, match=r"^config keys 'checkpoint.best_mode' and "
                                          r"'early_stopping.mode' disagree on 'val/loss' "
                                          r"\(max and min, "):
        config("checkpoint.best_metric=val/loss", "checkpoint.best_mode=max",
               "early_stopping.metric=val/loss")


def test_the_error_for_a_name_not_logged_lists_the_names_and_the_closest():
    assert str(not_logged("checkpoint.best_metric", "val/acc",
                          ["val/loss", "val/accuracy", "lr"])) == (
        "config key 'checkpoint.best_metric': 'val/acc' is not a metric this run logs (did "
        "you mean 'val/accuracy'?); it logs: val/loss, val/accuracy, lr")


@pytest.mark.parametrize("override, message", [
    # No form a recipe's run logs: refused in the launching process (--dry-run starts
    # no worker), with what the key takes.
    ("checkpoint.best_metric=accuracy", "config key 'checkpoint.best_metric': 'accuracy' is "
     "not a metric a recipe's run logs; it takes val/NAME (a name eval_step returns), "
     "train/epoch_loss, train/NAME, train/epoch_NAME or lr"),
    ("early_stopping.metric=train/samples_per_sec", "config key 'early_stopping.metric': "
     "'train/samples_per_sec' is not a metric a recipe's run logs; it takes val/NAME"),
    ("checkpoint.best_metric=val/score", "config key 'checkpoint.best_mode': cannot tell "
     "from the name 'val/score' whether higher or lower is better; set "
     "checkpoint.best_mode=min or checkpoint.best_mode=max"),
])
def test_a_bad_name_is_refused_before_any_worker_starts(tmp_path, override, message):
    proc = run_cli_here(TINY, override, f"out_dir={tmp_path}", "--dry-run")
    assert proc.returncode == 2, proc.stdout
    assert f"error: {message}" in proc.stderr and len(proc.stderr.splitlines()) == 1, (
        proc.stderr)


def test_a_renamed_epoch_metric_answers_under_its_old_name_with_one_warning(capsys):
    """engine_epoch_end's metrics: train/loss became train/epoch_loss; a plugin reading
    the old name gets the value and one line naming the new one, not nothing."""
    from engine.metrics import EpochMetrics

    metrics = EpochMetrics({"train/epoch_loss": 0.5, "val/loss": 0.7})
    assert metrics["train/loss"] == 0.5 and metrics.get("train/loss") == 0.5
    assert metrics.get("train/nothing", 1.0) == 1.0 and metrics["val/loss"] == 0.7
    with pytest.raises(KeyError):
        metrics["train/nothing"]
    assert EpochMetrics({"val/loss": 0.7}).get("train/loss") is None
    assert capsys.readouterr().err.splitlines() == [
        "warning: metrics['train/loss'] in engine_epoch_end is now 'train/epoch_loss' (the "
        "epoch's mean); the old name works until 0.4.0"]


# ------------------------------------------ early stopping and the throughput's unit

def early_stopping(mode="min", patience=2, min_delta=0.0, metric="val/loss"):
    from engine.config import EarlyStoppingConfig
    from engine.stateful import TrainState

    cfg = EarlyStoppingConfig(metric=metric, mode=mode, patience=patience,
                              min_delta=min_delta)
    return EarlyStopping(cfg, TrainState())


@pytest.mark.parametrize("mode, values, stops_after", [
    ("min", [1.0, 0.9, 0.95, 0.91], 4),  # best 0.9 at epoch 2, two epochs without
    ("min", [1.0, 0.9, 0.8, 0.7], None),
    ("max", [0.1, 0.2, 0.2, 0.3], None),  # equal is not better, but 0.3 is
    ("max", [0.5, 0.4, 0.5], 3),
])
def test_early_stopping_counts_epochs_without_improvement(mode, values, stops_after):
    stopping = early_stopping(mode)
    stopped = [stopping.update({"val/loss": v}, epoch) for epoch, v in enumerate(values)]
    assert (stopped.index(True) + 1 if True in stopped else None) == stops_after


def test_early_stopping_min_delta_and_message():
    """min_delta counts the patience (0.97 and 0.96 are no improvement on 1 by more than
    0.05); the best is the lowest value, as the best snapshot's, and the message says
    both."""
    stopping = early_stopping(min_delta=0.05)
    for epoch, value in enumerate([1.0, 0.97, 0.96]):
        stopping.update({"val/loss": value}, epoch)
    assert stopping.state.stopped_early
    assert stopping.message() == ("early stopping: val/loss did not improve by more than "
                                  "0.05 on 1 for 2 epochs; best 0.96 at epoch 3")
    plain = early_stopping()
    for epoch, value in enumerate([1.0, 0.9, 0.95, 0.91]):
        plain.update({"val/loss": value}, epoch)
    assert plain.message() == (
        "early stopping: val/loss did not improve for 2 epochs; best 0.9 at epoch 2")


def test_early_stopping_reads_its_direction_from_the_name_unless_told():
    for metric, mode, values, best_epoch in (
            ("val/loss", "auto", [1.0, 0.5, 0.8], 2), ("val/accuracy", "auto", [0.5, 0.9, 0.7], 2),
            ("val/accuracy", "min", [0.5, 0.9, 0.7], 1)):
        stopping = early_stopping(mode, patience=5, metric=metric)
        for epoch, value in enumerate(values):
            stopping.update({metric: value}, epoch)
        assert stopping.state.best_epoch == best_epoch, (metric, mode)
    with pytest.raises(ConfigError, match=r"^config key 'early_stopping.mode': cannot tell "):
        early_stopping("auto", metric="val/score")


def test_early_stopping_and_the_best_snapshot_agree_on_the_best_epoch(tmp_path):
    """The same values through both, min_delta set: the checkpointer's best is early
    stopping's best epoch, and a NaN is neither's best."""
    from engine.config import TrainConfig
    from engine.plugins.torch_file import TorchFileCheckpointer

    values = [float("nan"), 1.0, 0.98, 0.97, 0.99]
    stopping = early_stopping("auto", patience=10, min_delta=0.05)
    cfg = TrainConfig()
    cfg.checkpoint.best_metric = "val/loss"  # best_mode auto: min, from the name
    store = TorchFileCheckpointer(tmp_path, cfg)
    paths = []
    for epoch, value in enumerate(values):
        stopping.update({"val/loss": value}, epoch)
        paths.append(store.save({"step": epoch}, epoch=epoch + 1, step=epoch + 1,
                                metrics={"val/loss": value}))
    assert stopping.state.best_epoch == 4 and store.best() == paths[3]
    assert stopping.state.epochs_without_improvement == 3  # none by more than 0.05 on 1.0


def test_a_snapshot_from_before_the_reference_field_counts_on_from_its_best():
    stopping = early_stopping(min_delta=0.05)
    stopping.state.load_state_dict({"best_metric": 1.0, "best_epoch": 1,
                                    "epochs_without_improvement": 1})
    assert stopping.update({"val/loss": 0.97}, 2) is True  # not 0.05 below 1.0
    assert stopping.state.best_epoch == 3 and stopping.state.reference_metric == 1.0


def test_early_stopping_off_by_default_and_an_unknown_metric_names_the_key():
    assert early_stopping(metric="").update({}, 0) is False
    with pytest.raises(ConfigError, match=r"^config key 'early_stopping.metric': 'val/acc' "
                                          r"is not a metric this run logs at an epoch's end; "
                                          r"it logs: val/loss$"):
        early_stopping(metric="val/acc").update({"val/loss": 1.0}, 0)


def test_throughput_is_in_samples_unless_the_recipe_names_and_counts_its_unit():
    class Samples:
        Config = engine.TrainConfig
        build_model = build_datasets = build_optimizer = None
        train_step = staticmethod(lambda batch, ctx: None)

    class Tokens(Samples):
        throughput_unit = "tokens"

    assert Throughput(recipe_from_object(Samples)).metric == "train/samples_per_sec"
    with pytest.raises(ConfigError, match="throughput_unit='tokens' without "
                                          r"count_throughput\(batch\) -> int"):
        Throughput(recipe_from_object(Tokens))
    Tokens.count_throughput = staticmethod(lambda batch: batch.numel())
    assert Throughput(recipe_from_object(Tokens)).metric == "train/tokens_per_sec"
