"""No hangs: telling which rank failed, and checking that all ranks are still there.

A rank that dies makes the others fail at their next collective (gloo notices the
closed connection at once); a rank that hangs makes them wait for the process-group
timeout (``cfg.timeout_s``). Either way, what the user needs is *which* rank. After a
failed collective, the surviving ranks call :func:`missing_ranks`: rank 0 runs a
monitored barrier with a short timeout, which names every rank that does not answer.
At epoch boundaries :func:`epoch_barrier` does the same check while all is well, so a
rank stuck outside the collectives (say, in its data pipeline) is named there too.
"""

from __future__ import annotations

import datetime
import re

_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")

#: Texts of the errors torch raises when a collective cannot complete.
_COLLECTIVE_FAILURE_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
    "Broken pipe", "NCCL communicator was aborted", "failed to pass monitoredBarrier",
    "Socket Timeout", "ProcessGroupGloo", "gloo", "NCCL error",
)


def is_collective_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in _COLLECTIVE_FAILURE_MARKERS)


def _side_group():
    """A gloo group of its own for these checks: monitored_barrier exists on gloo only,
    and after a collective of the main group times out, gloo closes that group's
    connections ("Application timeout caused pair closure"), so only a separate group
    can still ask who is there."""
    import torch.distributed as dist

    global _GLOO_GROUP
    if _GLOO_GROUP is None:
        _GLOO_GROUP = dist.new_group(backend="gloo")
    return _GLOO_GROUP


_GLOO_GROUP = None


def prepare() -> None:
    """Create the gloo side group up front (a collective: every rank, right after init)."""
    _side_group()


def release() -> None:
    """Destroy the side group and drop our reference to it, before the world group goes.
    A group still referenced at interpreter exit is torn down during C++ finalisation,
    where gloo's threads abort the process ("terminate called without an active
    exception") after a run that finished."""
    global _GLOO_GROUP
    if _GLOO_GROUP is not None:
        import torch.distributed as dist

        group, _GLOO_GROUP = _GLOO_GROUP, None
        dist.destroy_process_group(group)


def missing_ranks(timeout_s: float = 5.0) -> list[int] | None:
    """The ranks that do not reach a monitored barrier within ``timeout_s``; None when
    that cannot be found out (not rank 0, or the check itself failed)."""
    import torch.distributed as dist

    try:
        dist.monitored_barrier(group=_side_group(),
                               timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    except Exception as exc:  # the point of the exercise
        match = _MISSING.search(str(exc))
        if match:
            return [int(r) for r in match.group(1).replace(" ", "").split(",") if r]
        return None
    return []


def epoch_barrier(timeout_s: float) -> None:
    """All ranks meet at the end of an epoch; a rank that does not come is named."""
    import torch.distributed as dist

    from engine.errors import RunError

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    try:
        dist.monitored_barrier(group=_side_group(),
                               timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    except Exception as exc:
        match = _MISSING.search(str(exc))
        who = f"rank(s) {match.group(1)}" if match else "some rank"
        raise RunError(f"{who} did not reach the end of the epoch within {timeout_s:g}s "
                          f"(rank {dist.get_rank()} waited): {str(exc).splitlines()[0]}"
                          ) from None
