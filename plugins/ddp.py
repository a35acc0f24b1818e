"""Parallel mode ``ddp``: DistributedDataParallel, one device per process.

On CUDA, local rank i drives visible GPU i (NCCL; ``torch.cuda.set_device`` before the
process group); on a CPU-only machine every process computes on the CPU (gloo). The
batch is split across processes: each gets ``batch_size / world_size``.

The DDP options are this plugin's config group ``ddp`` (:class:`DDPConfig`, added to
every run's config through ``engine_register_config_groups``; ``engine-run RECIPE
ddp.bucket_cap_mb=50``):

- ``bucket_cap_mb`` (25): gradients are all-reduced in buckets of this size, each
  as soon as it is full, overlapping communication with the rest of the backward.
- ``gradient_as_bucket_view`` (true): ``.grad`` tensors are views into the buckets,
  which saves one copy of the gradients in memory and time.
- ``static_graph`` (false): the set of used parameters never changes; DDP can then
  skip work and support reentrant checkpointing.
- ``find_unused_parameters`` (false): walk the autograd graph after every forward to
  find parameters that get no gradient; only needed when some really are unused
  (it costs a graph traversal per step). Without it such a model fails in the second
  step; the engine's error then names this option.
- ``broadcast_buffers`` (true): rank 0's buffers (BatchNorm running statistics) are
  copied to every rank at the start of each forward, so the ranks stay identical.
- ``sync_batchnorm`` (false): convert BatchNorm layers to SyncBatchNorm, which
  normalises with the statistics of the global batch. torch supports it on GPUs only;
  on the CPU it is a clear error.
- ``reduce_per_tensor`` (false): one all-reduce per parameter instead of per bucket. At 3
  processes or more the order in which an all-reduce sums the ranks' values depends on
  where a value sits in the buffer, and DDP lays its buckets out anew after the first
  step: a resumed run's first step sums in another order than the uninterrupted run's
  did, so the weights agree to rounding, not bit for bit (a resume says so in one line).
  Per tensor, the order depends on the tensor alone: resumes are bit-identical at any
  number of processes, for one collective per parameter each step.

With one process there is nothing to synchronise: the model trains unwrapped, as with
``single``, and the mode says so.
"""

from __future__ import annotations

import contextlib
import inspect

import attrs

import engine
from engine.errors import ConfigError
from engine.parallel import Parallel, gpu_group, visible_gpus

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).


@attrs.define
class DDPConfig:
    """Options passed to torch's DistributedDataParallel. The defaults suit most models."""

    #: Keys a resume may change (engine.config.resume_safe): how gradients travel, not
    #: what they are. broadcast_buffers and sync_batchnorm change the arithmetic.
    RESUME_SAFE = frozenset({"bucket_cap_mb", "gradient_as_bucket_view", "static_graph",
                             "find_unused_parameters", "gpus_per_process",
                             "reduce_per_tensor"})

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True  # saves one copy of the gradients
    static_graph: bool = False
    find_unused_parameters: bool = False  # costs a graph traversal every step
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False
    reduce_per_tensor: bool = False  # bit-identical resumes at 3+ processes
    gpus_per_process: int = 0  # ddp-multigpu: GPUs each process drives (0: all it can)


def ddp_options(cfg) -> DDPConfig:
    """``cfg.ddp``, or the defaults for a config built without the plugin manager
    (a library caller's own TrainConfig, a tool)."""
    options = getattr(cfg, "ddp", None)
    return DDPConfig() if options is None else options


class DistributedDataParallel(Parallel):
    name = "ddp"
    #: ``auto`` picks ddp first whenever there are several processes.
    priority = 10
    #: GPUs each process drives (ddp-multigpu overrides it).
    gpus_per_process = 1
    idle_gpus_advice = ("start one process per GPU (--nproc; spawn's default) or use "
                        "--parallel ddp-multigpu")

    @classmethod
    def detect(cls, world) -> bool:
        return world.world_size > 1

    @property
    def options(self) -> DDPConfig:
        return ddp_options(self.cfg)

    @property
    def devices(self):
        import torch

        visible = visible_gpus()
        if not visible:
            return [torch.device("cpu")]
        indices = gpu_group(self.name, self.world, self.gpus_per_process, visible)
        return [torch.device("cuda", i) for i in indices]

    @property
    def backend(self):
        return "nccl" if self.device.type == "cuda" else "gloo"

    def check(self):
        device = self.devices[0]  # raises when the node lacks GPUs for its processes
        if (self.options.sync_batchnorm and device.type == "cpu"
                and self.world.world_size > 1):
            import torch

            raise ConfigError(
                f"ddp.sync_batchnorm=true needs GPUs: SyncBatchNorm in torch "
                f"{torch.__version__.split('+')[0]} synchronises CUDA tensors only; on "
                "the CPU set ddp.sync_batchnorm=false (each process then normalises with "
                "the statistics of its own share of the batch)"
            )

    def setup_device(self):
        import torch

        if self.device.type == "cuda":
            # Before the process group: NCCL binds each rank to the current device.
            torch.cuda.set_device(self.device)
            self.warn_idle_gpus(self.gpus_per_process * self.world.local_world_size,
                                self.idle_gpus_advice)

    # ---------------------------------------------------------------- model

    def wrap(self, model):
        import torch

        if self.world.world_size == 1:
            self.warn(f"parallel mode {self.name!r} with one process: nothing to "
                      "synchronise, training the model unwrapped (as 'single')")
            return model
        if self.options.sync_batchnorm:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return self.ddp(model, device_ids=[self.device.index]
                        if self.device.type == "cuda" else None)

    def ddp(self, module, device_ids):
        """torch's DistributedDataParallel around ``module`` with the ``cfg.ddp`` options."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        opts = self.options
        # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (same meaning
        # during training) and warns on the old name.
        sync_buffers = ("forward_sync_buffers" if "forward_sync_buffers" in
                        inspect.signature(DDP.__init__).parameters else "broadcast_buffers")
        ddp = DDP(
            module,
            device_ids=device_ids,
            bucket_cap_mb=opts.bucket_cap_mb,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
            find_unused_parameters=opts.find_unused_parameters,
            **{sync_buffers: opts.broadcast_buffers},
        )
        if opts.reduce_per_tensor:
            ddp.register_comm_hook(None, all_reduce_per_tensor)
        return ddp

    def unwrap(self, model):
        from torch.nn.parallel import DistributedDataParallel as DDP

        return model.module if isinstance(model, DDP) else model

    def no_sync(self, model):
        from torch.nn.parallel import DistributedDataParallel as DDP

        # DDP.no_sync: gradients accumulate locally; the next step outside it reduces
        # them all in one all-reduce per bucket.
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()

    def sync_buffers(self, model):
        """DDP broadcasts rank 0's buffers at the start of every forward, but each rank
        then updates them with its own batch: after the last step the ranks' BatchNorm
        statistics differ. Broadcast rank 0's once more (unless the user turned buffer
        broadcasting off to keep them per rank)."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not isinstance(model, DDP) or not self.options.broadcast_buffers:
            return
        for buffer in model.module.buffers():
            dist.broadcast(buffer, src=0)

    def explain(self, exc):
        text = str(exc)
        if "Expected to have finished reduction" in text:
            if "static_graph" in text:
                return ("the set of parameters used changed between steps, which "
                        "ddp.static_graph=true forbids; set ddp.static_graph=false "
                        "(and ddp.find_unused_parameters=true if some are unused)")
            if "Since `find_unused_parameters=True` is enabled" in text:
                return ("ddp.find_unused_parameters is on, so some forward outputs do "
                        "not reach the loss; make every output the model returns take "
                        "part in the loss")
            return ("some parameters received no gradient in the last step; if the model "
                    "really leaves parameters unused, set ddp.find_unused_parameters=true")
        if "Duplicate GPU detected" in text:
            return ("two processes drive the same GPU; give each process its own "
                    "(CUDA_VISIBLE_DEVICES, srun --gpus-per-task) or start fewer (--nproc)")
        return None


def all_reduce_per_tensor(_, bucket):
    """A DDP comm hook: the bucket's mean as DDP's own hook takes it (divided, then
    summed), one all-reduce per gradient, so each value's place in its all-reduce (and so
    the order its ranks' values are summed in) does not depend on DDP's bucket layout."""
    import torch
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    futures, offset = [], 0
    for grad in bucket.gradients():  # the buffer holds them back to back, in this order
        view = buffer[offset:offset + grad.numel()]
        futures.append(dist.all_reduce(view, async_op=True).get_future())
        offset += grad.numel()
    return torch.futures.collect_all(futures).then(lambda _: buffer)


def resumed_in_another_order(ctx) -> str | None:
    """The line a resume at 3+ processes under DDP says (reduce_per_tensor off), or None."""
    if (ctx.resumed_from is None or ctx.world.world_size < 3
            or not isinstance(ctx.parallel, DistributedDataParallel)
            or ddp_options(ctx.cfg).reduce_per_tensor):
        return None
    return (f"resumed at {ctx.world.world_size} processes: DDP's first step after a resume "
            "sums the ranks' gradients in another order than the uninterrupted run did (its "
            "buckets are laid out anew after a first step), so the weights agree with it to "
            "rounding, not bit for bit; ddp.reduce_per_tensor=true makes resumes "
            "bit-identical (one all-reduce per parameter)")


@engine.hookimpl
def engine_run_start(ctx):
    line = resumed_in_another_order(ctx)
    if line is not None:
        ctx.print(line)


@engine.hookimpl
def engine_register_parallel(registry):
    registry.add(DistributedDataParallel)


@engine.hookimpl
def engine_register_config_groups():
    return {"ddp": DDPConfig}
