"""Logger ``tensorboard``: scalars under ``<out_dir>/tensorboard``, written by rank 0.

tensorboard is imported when the first scalar is written, never at start-up.
"""

from __future__ import annotations

import engine


class TensorBoardLogger:
    def __init__(self):
        self.writer = None

    @engine.hookimpl
    def engine_log(self, engine, metrics, step):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(engine.out_dir / "tensorboard"))
        for name, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(name, value, global_step=step)

    @engine.hookimpl
    def engine_run_end(self, engine, summary):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


_logger = TensorBoardLogger()
engine_log = _logger.engine_log
engine_run_end = _logger.engine_run_end
