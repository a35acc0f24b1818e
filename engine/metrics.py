"""Metrics a config names (``checkpoint.best_metric``, ``early_stopping.metric``,
``scheduler_metric``): which way is better, what counts as an improvement, and whether
the run logs them.

The best snapshot and early stopping both ask :func:`resolved_mode` (an explicit min or
max, else :func:`direction` from the name; a name that says none is refused before
anything starts) and :func:`improves`, so they never disagree. :func:`check_forms`
refuses, in the launching process, a name no recipe run logs; the worker checks the
rest before the first step (:class:`NamedMetrics`); :func:`not_logged` is
both's error. The summary keys, throughput names and units here are shared by the
summary, the console and ``engine-report``. No torch here: the launching process and
the config checks import it.
"""

from __future__ import annotations

import difflib
import math
import re

from engine.errors import ConfigError, warn

#: A word of a metric's name (its part after the last ``/``, split at anything that is
#: not a letter or a digit) that says lower is better...
LOWER_IS_BETTER = frozenset({
    "loss", "losses", "nll", "error", "errors", "err", "eer", "mae", "mse", "rmse", "msle",
    "rmsle", "mape", "smape", "wer", "cer", "ter", "perplexity", "ppl", "bpc", "bpb", "bpd",
    "fid", "kid", "kl", "kld", "divergence", "distance", "fpr", "fnr", "far", "frr", "cost",
    "regret", "latency",
})
#: ... or that higher is.
HIGHER_IS_BETTER = frozenset({
    "accuracy", "acc", "f1", "f2", "fbeta", "fscore", "r2", "precision", "recall", "auc",
    "auroc", "auprc", "ap", "map", "bleu", "rouge", "rougel", "meteor", "chrf", "cider",
    "iou", "miou", "dice", "psnr", "ssim", "snr", "ndcg", "mrr", "hit", "hits", "hitrate",
    "kappa", "mcc", "specificity", "sensitivity", "tpr", "tnr", "jaccard", "reward",
    "return", "correct", "likelihood",
})
#: Words of several parts (matched on the words joined by ``_``).
LOWER_PHRASES = ("bits_per_char", "bits_per_byte", "bits_per_dim", "bits_per_token",
                 "error_rate")
HIGHER_PHRASES = ("f1_score", "f_score", "roc_auc", "hit_rate", "r_squared", "per_sec",
                  "per_second")  # and a throughput (train/epoch_samples_per_sec)
#: top1, acc5, recall10, ndcg10, hits3...: a higher-is-better word with a number.
HIGHER_NUMBERED = re.compile(r"(top|acc|ap|map|hits?|recall|precision|ndcg|mrr)\d+")
#: A word that turns the name round: sklearn's neg_mean_squared_error, neg_log_loss
#: (higher is better), a negative log likelihood (lower is).
NEGATING = frozenset({"neg", "negative"})
#: A word that makes a name of two metrics (a difference, one and another): no direction.
COMBINING = frozenset({"and", "vs", "versus", "minus", "diff", "delta"})


def direction(name: str) -> str | None:
    """``"min"`` when the metric's name says lower is better, ``"max"`` when it says
    higher is, None when it says neither (``val/score``, ``lr``) or combines two
    (``val/loss_and_accuracy``). Where its words say both, the last one decides, as
    the head of a compound noun: ``top1_error`` and ``dice_loss`` are lower-is-better,
    ``loss_recall`` is not a thing. ``neg``/``negative`` turns it round."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.rsplit("/", 1)[-1].lower()) if w]
    if COMBINING.intersection(words):
        return None
    found = None
    for i, word in enumerate(words):
        so_far = "_".join(words[:i + 1])
        if (word in LOWER_IS_BETTER
                or any(so_far.endswith(phrase) for phrase in LOWER_PHRASES)):
            found = "min"
        elif (word in HIGHER_IS_BETTER or HIGHER_NUMBERED.fullmatch(word)
              or any(so_far.endswith(phrase) for phrase in HIGHER_PHRASES)):
            found = "max"
    if found is not None and NEGATING.intersection(words):
        found = "max" if found == "min" else "min"
    return found


def resolved_mode(metric: str, mode: str, key: str) -> str:
    """``min`` or ``max``: ``mode`` when it is one (set by the user: it wins), else
    (``auto``) the direction :func:`direction` reads in ``metric``'s name. ``key`` (the
    setting, ``checkpoint.best_mode``) names what to set when the name says nothing."""
    if mode in ("min", "max"):
        return mode
    found = direction(metric)
    if found is None:
        raise ConfigError(f"config key {key!r}: cannot tell from the name {metric!r} "
                          f"whether higher or lower is better; set {key}=min or {key}=max")
    return found


def improves(value: float, reference: float | None, mode: str,
             min_delta: float = 0.0) -> bool:
    """Whether ``value`` is better than ``reference`` (None: there is none yet) by more
    than ``min_delta``, lower or higher as ``mode`` says. A value that is not finite
    never improves; a reference that is not finite (a NaN an older run kept) is no
    reference."""
    if not math.isfinite(value):
        return False
    if reference is None or not math.isfinite(reference):
        return True
    return value < reference - min_delta if mode == "min" else value > reference + min_delta


# ---------------------------------------------------------------- names a run logs

#: The config keys that name a metric; early stopping and a scheduler that steps on a
#: metric see the metrics of an epoch's end only (the best snapshot, every metric
#: logged before the snapshot).
BEST, EARLY, SCHEDULER = "checkpoint.best_metric", "early_stopping.metric", "scheduler_metric"
EPOCH_END = (EARLY, SCHEDULER)


def named(cfg) -> list[tuple[str, str]]:
    """``(key, metric)`` for each metric the config names."""
    return [(key, metric) for key, metric in ((BEST, cfg.checkpoint.best_metric),
                                              (EARLY, cfg.early_stopping.metric),
                                              (SCHEDULER, cfg.scheduler_metric)) if metric]


def expected_mode(cfg, metric: str) -> tuple[str, str] | None:
    """Which way is better for ``metric``, and what says so: its name, else the mode of
    the best snapshot or early stopping when they follow the same metric (a name that
    says neither needs theirs set); None when nothing says (a scheduler's own mode then
    decides)."""
    found = direction(metric)
    if found is not None:
        return found, "read from the name"
    for key, mode in ((BEST, cfg.checkpoint.best_mode), (EARLY, cfg.early_stopping.mode)):
        if dict(named(cfg)).get(key) == metric and mode in ("min", "max"):
            return mode, f"as {key.replace('metric', 'mode')} says"
    return None


def check_modes(cfg) -> None:
    """The config checks (engine.config.check, every run): each named metric's mode is
    known (an ``auto`` one from the name), and the best snapshot and early stopping,
    when both follow the same metric, agree on which way is better."""
    best, stopping = cfg.checkpoint, cfg.early_stopping
    modes = {}
    if best.best_metric:
        modes[BEST] = resolved_mode(best.best_metric, best.best_mode, "checkpoint.best_mode")
    if stopping.metric:
        modes[EARLY] = resolved_mode(stopping.metric, stopping.mode, "early_stopping.mode")
    if len(modes) == 2 and best.best_metric == stopping.metric and len(set(modes.values())) == 2:
        raise ConfigError(
            f"config keys 'checkpoint.best_mode' and 'early_stopping.mode' disagree on "
            f"{best.best_metric!r} ({modes[BEST]} and {modes[EARLY]}, as given or read "
            "from the name): set both to min or both to max")


def check_forms(cfg) -> None:
    """In the launching process, for a recipe's run (engine-run, engine.fit): a name of
    no form the engine logs is refused before any worker starts. The worker checks the
    rest against the names this run logs (the recipe's are known once it runs)."""
    for key, metric in named(cfg):
        if key in EPOCH_END:
            ok = (metric == "lr" or metric.startswith(("val/", "train/epoch_"))
                  or metric == "train/data_wait_fraction")
            forms = ("val/NAME (a name eval_step returns), train/epoch_loss, "
                     "train/epoch_NAME, train/epoch_<unit>_per_sec, "
                     "train/data_wait_fraction or lr (an epoch's metrics)")
        else:
            ok = metric == "lr" or metric.startswith(("val/", "train/"))
            forms = ("val/NAME (a name eval_step returns), train/epoch_loss, train/NAME, "
                     "train/epoch_NAME or lr")
        if not ok or metric in ("val/", "train/", "train/epoch_"):
            raise ConfigError(f"config key {key!r}: {metric!r} is not a metric a recipe's "
                              f"run logs; it takes {forms}")


def not_logged(key: str, metric: str, logged) -> ConfigError:
    """The one-line error for a named metric the run does not log: the names it logs
    (those ``key`` may name), and the closest when one is close."""
    logged = list(dict.fromkeys(logged))
    # val/acc for val/accuracy; else a near spelling (not val/mae for val/acc).
    close = ([name for name in logged
              if name.startswith(metric) and metric.rsplit("/", 1)[-1]][:1]
             or difflib.get_close_matches(metric, logged, n=1, cutoff=0.8))
    at = " at an epoch's end" if key in EPOCH_END else ""
    return ConfigError(f"config key {key!r}: {metric!r} is not a metric this run logs{at}"
                       + (f" (did you mean {close[0]!r}?)" if close else "")
                       + f"; it logs: {', '.join(logged) if logged else 'nothing'}")


class NamedMetrics:
    """The metrics the config names, checked against those this run logs as soon as each
    is known: before the first step with the val/* names ``val_names()`` reads from one
    batch (None: after the first validation), train_step's extras at the first
    micro-batch. One not logged stops the run with one line listing those that are."""

    def __init__(self, cfg, throughput: Throughput, val_names):
        self.throughput = throughput
        self.extras: list[str] = []  # train_step's extras, once known
        self.val_names: list[str] | None = []
        self.unchecked: list[tuple[str, str]] = []  # (key, metric), once more is known
        wanted = named(cfg)
        if wanted:
            self.val_names = val_names()
            self.unchecked = self.refuse_unlogged(wanted, extras_known=False)

    def extras_known(self, names: list[str]) -> None:
        self.extras = names
        if self.unchecked:
            self.unchecked = self.refuse_unlogged(self.unchecked, extras_known=True)

    def validated(self, metrics: dict) -> None:
        """After a validation: the val/ names are known now."""
        if self.unchecked:
            self.val_names = [name for name in metrics if name.startswith("val/")]
            self.unchecked = self.refuse_unlogged(self.unchecked, extras_known=True)

    def logged(self, key: str) -> list[str]:
        """The metrics this run logs that config key ``key`` may name, as far as known:
        an epoch's for early stopping and a scheduler, any for the best snapshot."""
        names = [*(self.val_names or []), "train/epoch_loss",
                 *(f"train/epoch_{n}" for n in self.extras),
                 self.throughput.epoch_metric, "train/data_wait_fraction"]
        if key not in EPOCH_END:  # a log window's
            names += [*(f"train/{n}" for n in self.extras), self.throughput.metric]
        return [*names, "lr"]

    def refuse_unlogged(self, wanted: list[tuple[str, str]], extras_known: bool
                        ) -> list[tuple[str, str]]:
        """Raise for the first of ``wanted`` this run does not log; return those it may
        yet log (a train/ name before the extras are known, a val/ name before they are)."""
        later = []
        for key, metric in wanted:
            logged = self.logged(key)
            if metric in logged:
                continue
            if ((not extras_known and metric.startswith("train/"))
                    or (self.val_names is None and metric.startswith("val/"))):
                later.append((key, metric))
                continue
            raise not_logged(key, metric, logged)
        return later


class EarlyStopping:
    """``early_stopping.*``: stop when ``metric`` has not improved by more than
    ``min_delta`` (which counts the patience only: the best is compared as the
    checkpointer compares) for ``patience`` validations. Every rank decides alike (the
    metrics are reduced); the count is in the TrainState, which snapshots save."""

    def __init__(self, cfg, state, by_steps: bool = False):
        self.metric = cfg.metric
        self.mode = (resolved_mode(cfg.metric, cfg.mode, "early_stopping.mode")
                     if cfg.metric else None)
        self.patience = cfg.patience
        self.min_delta = cfg.min_delta
        self.state = state
        # val_every_steps: the patience counts validations, inside epochs too, and the
        # best is named by its step.
        self.by_steps = by_steps

    def update(self, metrics: dict, epoch: int, step: int = 0) -> bool:
        """After a validation in ``epoch`` (from 0; at its end, or after optimizer step
        ``step`` with val_every_steps): True when the run must stop now."""
        if not self.metric:
            return False
        if self.metric not in metrics:
            raise not_logged(EARLY, self.metric, sorted(metrics))
        value, s = metrics[self.metric], self.state
        if s.reference_metric is None:  # a snapshot written before the field: its best
            s.reference_metric = s.best_metric  # was the reference
        if improves(value, s.best_metric, self.mode):
            s.best_metric, s.best_epoch, s.best_step = value, epoch + 1, step
        if improves(value, s.reference_metric, self.mode, self.min_delta):
            s.reference_metric, s.epochs_without_improvement = value, 0
        else:
            s.epochs_without_improvement += 1
        s.stopped_early = s.epochs_without_improvement >= self.patience
        return s.stopped_early

    def message(self) -> str:
        s = self.state
        at = (f"step {s.best_step} (epoch {s.best_epoch})" if self.by_steps
              else f"epoch {s.best_epoch}")
        best = "none" if s.best_metric is None else f"{s.best_metric:.4g} at {at}"
        compared = ("" if not self.min_delta or s.reference_metric is None else
                    f" by more than {self.min_delta:g} on {s.reference_metric:.4g}")
        counted = "validations" if self.by_steps else "epochs"
        return (f"early stopping: {self.metric} did not improve{compared} for "
                f"{s.epochs_without_improvement} {counted}; best {best}")


class Throughput:
    """What ``train/<unit>_per_sec`` (a log window's) and ``train/epoch_<unit>_per_sec``
    count: samples (a step's global batch), or the recipe's ``throughput_unit = "tokens"``
    with ``count_throughput(batch) -> int`` (read from the shapes: no device sync)."""

    def __init__(self, recipe):
        self.unit = recipe.optional("throughput_unit") or "samples"
        self.count = recipe.optional("count_throughput")
        if (self.count is None) != (self.unit == "samples"):
            raise ConfigError(
                f"the recipe declares throughput_unit={self.unit!r} "
                + ("without count_throughput(batch) -> int (the units in a micro-batch)"
                   if self.count is None else "as samples with a count_throughput: "
                   "name its unit, e.g. throughput_unit = 'tokens'"))
        self.metric = f"train/{self.unit}_per_sec"
        self.epoch_metric = f"train/epoch_{self.unit}_per_sec"


# ------------------------------------------- names the summary, console and runs read

#: Summary keys taken from the latest metrics (and every ``val/NAME`` as ``val_NAME``).
#: ``train_loss`` is the last log window's mean loss, ``train_epoch_loss`` the last epoch's
#: (docs/outputs.md: metric names).
SUMMARY_METRICS = {"train/loss": "train_loss", "train/epoch_loss": "train_epoch_loss",
                   "val/loss": "val_loss",
                   "train/data_wait_fraction": "data_wait_fraction"}


def validation_summary(metrics: dict) -> dict:
    """``val_NAME`` for each ``val/NAME`` the recipe's eval_step reported."""
    return {"val_" + name[len("val/"):]: value for name, value in metrics.items()
            if name.startswith("val/")}


def throughput_unit(name: str) -> str | None:
    """The unit of a throughput metric's name: ``train/<unit>_per_sec`` (a log
    window's) or ``train/epoch_<unit>_per_sec`` (an epoch's); None for other names."""
    if not (name.startswith("train/") and name.endswith("_per_sec")):
        return None
    unit = name[len("train/"):-len("_per_sec")]
    return unit.removeprefix("epoch_")


def throughput_of(metrics: dict) -> tuple[str, float] | None:
    """``(unit, value)`` of the throughput among ``metrics`` (samples by default, a
    recipe's own unit such as tokens): the epoch's where there is one, else the log
    window's; None without either."""
    found = {name.startswith("train/epoch_"): (unit, value)
             for name, value in metrics.items()
             if (unit := throughput_unit(name)) is not None}
    return found.get(True) or found.get(False)


def throughput_summary(metrics: dict) -> dict:
    """The summary's throughput keys: ``throughput_unit`` and ``<unit>_per_sec``
    (``samples_per_sec``, ``tokens_per_sec``), the last epoch's (the last window's in a
    run that ended before an epoch did); runs before units had ``images_per_sec``."""
    found = throughput_of(metrics)
    unit, value = found if found else ("samples", None)
    return {"throughput_unit": unit, f"{unit}_per_sec": value}


#: Public metric names that were renamed, old -> new (CHANGELOG.md), and the version in
#: which the old name stops working.
RENAMED = {"train/loss": "train/epoch_loss"}
RENAMED_UNTIL = "0.4.0"


class EpochMetrics(dict):
    """The metrics ``engine_epoch_end`` hands to plugins. A name renamed since 0.1.0
    (``train/loss``: the epoch's mean is ``train/epoch_loss``; ``train/loss`` is one log
    window's) still answers under the old name, with a one-line warning naming the new
    one, until :data:`RENAMED_UNTIL`: a plugin that reads it does not silently get
    nothing."""

    def __missing__(self, key):
        if key in RENAMED and RENAMED[key] in self:
            warn(f"metrics[{key!r}] in engine_epoch_end is now {RENAMED[key]!r} (the "
                 f"epoch's mean); the old name works until {RENAMED_UNTIL}")
            return self[RENAMED[key]]
        raise KeyError(key)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default
