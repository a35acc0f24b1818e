"""No hangs: telling which rank failed, and checking that all ranks are still there.

A rank that dies makes the others fail at their next collective; one that hangs makes
them wait for the process-group timeout (``cfg.timeout_s``). Either way the user needs
*which* rank: after a failed collective, :func:`missing_ranks` (rank 0's monitored
barrier with a short timeout) names every rank that does not answer, and at epoch ends
:func:`epoch_barrier` names a rank stuck outside the collectives (its data pipeline).
"""

from __future__ import annotations

import datetime
import re

from engine import phases
from engine.errors import RunError, first_line

# torch is imported inside the functions that use it: engine.distributed imports this
# module, and the launching process imports that one without torch.

_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")

#: Texts of the errors torch raises when a collective cannot complete.
_COLLECTIVE_FAILURE_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
    "Broken pipe", "NCCL communicator was aborted", "failed to pass monitoredBarrier",
    "Socket Timeout", "ProcessGroupGloo", "gloo", "NCCL error",
    # gloo, for a collective waited for after a later one's timeout closed the pairs
    "Application timeout caused pair closure",
)


#: A peer's connection closed: it has ended or is ending, and its own error says why.
_PEER_GONE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_is_gone(exc: BaseException) -> bool:
    """Whether a collective failed because a peer closed its connection (not a timeout):
    an echo of that peer's end, and a roll call would name a peer still on its way out."""
    return any(m in str(exc) for m in _PEER_GONE_MARKERS)


def is_collective_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    # DistError: torch 2.2 on (pyproject allows 2.1)
    return isinstance(exc, getattr(dist, "DistError", ())) or (isinstance(
        exc, RuntimeError) and any(m in str(exc) for m in _COLLECTIVE_FAILURE_MARKERS))


#: How long the roll call after a failed collective waits for the ranks to answer; also
#: a non-zero rank's wait for rank 0 (its group's timeout), so a run whose rank 0 is
#: stopped ends within ``timeout_s`` plus this and the launcher's clean-up.
ROLL_CALL_S = 2.0

#: The gloo side groups: "epoch" (timeout ``timeout_s``) for the end-of-epoch barrier,
#: "roll_call" (timeout ``ROLL_CALL_S``) for :func:`missing_ranks`.
_GROUPS: dict = {}


def _barrier(name: str, timeout_s: float) -> None:
    """A monitored barrier (gloo's only) on the side group ``name``: a group of its own,
    since gloo closes a group's pairs when a collective times out. ``timeout_s`` bounds
    rank 0's wait; the others wait for rank 0 under the group's timeout (one per bound)."""
    import torch.distributed as dist

    dist.monitored_barrier(group=_GROUPS[name], wait_all_ranks=True,
                           timeout=datetime.timedelta(seconds=timeout_s))


def prepare(timeout_s: float) -> None:
    """Create the side groups (collectives: every rank, right after init), each with its
    bound. Eager: gloo's lazily connected groups (TORCH_GLOO_LAZY_INIT, which made a rank
    other than 0 connect to rank 0 only) aborted a finished run in gloo's teardown
    ("state_ <= CONNECTED. 5 vs 4") once in about 700 runs (docs/scale.md)."""
    for name, seconds in (("epoch", timeout_s), ("roll_call", ROLL_CALL_S)):
        gloo_group(name, seconds)
    phases.mark("health check groups")


def gloo_group(name: str, seconds: float):
    """The gloo side group ``name`` (timeout ``seconds``), made at the first call (every
    rank at once), destroyed by :func:`release`; also the memory ring's (ring.py)."""
    if name not in _GROUPS:
        import torch.distributed as dist

        _GROUPS[name] = dist.new_group(backend="gloo",
                                       timeout=datetime.timedelta(seconds=seconds))
    return _GROUPS[name]


def release() -> None:
    """Destroy the side groups, and our references, before the world group: one still
    referenced at exit is torn down in C++ finalisation, where gloo's threads abort the
    process ("terminate called without an active exception") after a finished run."""
    if _GROUPS:
        import torch.distributed as dist

        groups = list(_GROUPS.values())
        _GROUPS.clear()
        for group in groups:
            dist.destroy_process_group(group)


def missing_ranks(timeout_s: float = ROLL_CALL_S) -> list[int] | None:
    """The ranks that miss a monitored barrier within ``timeout_s`` (on a rank other than 0:
    rank 0, where it does not answer); None where that cannot be found out."""
    import torch.distributed as dist

    try:
        _barrier("roll_call", timeout_s)
    except Exception as exc:  # the point of the exercise
        match = _MISSING.search(str(exc))
        if match:
            return [int(r) for r in match.group(1).replace(" ", "").split(",") if r]
        if dist.get_rank() != 0 and "from rank 0" in str(exc):
            return [0]
        return None
    return []


def epoch_barrier(timeout_s: float) -> None:
    """All ranks meet at the end of an epoch; a rank that does not come is named."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    try:
        _barrier("epoch", timeout_s)
    except Exception as exc:
        match = _MISSING.search(str(exc))
        who = f"rank(s) {match.group(1)}" if match else "some rank"
        raise RunError(f"{who} did not reach the end of the epoch within {timeout_s:g}s "
                          f"(rank {dist.get_rank()} waited): {first_line(exc)}"
                          ) from None
