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
import os
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
    # gloo, for an operation on a connection that an earlier one's timeout closed (a
    # collective started before the one that timed out, waited for after it).
    "Application timeout caused pair closure",
)


#: Texts of the errors a collective fails with when a peer's connection closed: that
#: process has ended or is ending, and its own error (or its launcher) says why.
_PEER_GONE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_is_gone(exc: BaseException) -> bool:
    """Whether a failed collective failed because a peer closed its connection (not a
    timeout): this rank's error is an echo of that peer's end, and a roll call has
    nothing to name. (It could wait its whole bound for a peer still on its way out,
    and then name it as one that stopped answering.)"""
    return any(m in str(exc) for m in _PEER_GONE_MARKERS)


def is_collective_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in _COLLECTIVE_FAILURE_MARKERS)


#: How long the roll call after a failed collective waits for the ranks to answer. It
#: bounds a non-zero rank's wait for rank 0 too (the roll call group's own timeout), so
#: a run whose rank 0 is stopped still ends within ``timeout_s`` plus this and the
#: launcher's clean-up (a group without a timeout would wait torch's default 30 minutes).
ROLL_CALL_S = 2.0

#: The gloo side groups: "epoch" (timeout ``timeout_s``) for the end-of-epoch barrier,
#: "roll_call" (timeout ``ROLL_CALL_S``) for :func:`missing_ranks`.
_GROUPS: dict = {}
LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def _side_group(name: str):
    """A gloo group of its own for these checks: monitored_barrier exists on gloo only,
    and after a collective of the main group times out, gloo closes that group's
    connections ("Application timeout caused pair closure"), so only a separate group
    can still ask who is there. monitored_barrier's ``timeout`` bounds rank 0's wait
    only; the other ranks wait for rank 0's answer under the group's own timeout, hence
    one group per bound."""
    return _GROUPS[name]


def prepare(timeout_s: float) -> None:
    """Create the gloo side groups up front (collectives: every rank, right after init).
    They connect lazily: their one collective, the monitored barrier, joins rank 0 and
    each other rank only, and one barrier each now makes those pairs (every rank but 0
    one per group; gloo's eager mesh connects all W - 1 peers), so a roll call after a
    failure finds them made. The roll call's bound is set after its first barrier, which
    waits for every rank to get here."""
    import torch.distributed as dist

    for name in ("epoch", "roll_call"):
        dist.monitored_barrier(group=gloo_group(name, timeout_s, lazy=True),
                               timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    dist.set_timeout(datetime.timedelta(seconds=ROLL_CALL_S), group=_GROUPS["roll_call"])
    phases.mark("health check groups")


def gloo_group(name: str, seconds: float, lazy: bool = False):
    """The gloo side group ``name`` with a timeout of ``seconds``, created on the first
    call (a collective: every rank at once), destroyed with the others by
    :func:`release`. Also the memory tier's ring (engine/memory/ring.py): a group of its
    own, for the transfers its background thread makes while the training thread uses
    the main group. ``lazy``: a pair connects at its first message (torch reads
    TORCH_GLOO_LAZY_INIT as it makes a gloo group: set here for this group only)."""
    if name not in _GROUPS:
        import torch.distributed as dist

        before = os.environ.get(LAZY_INIT)
        os.environ[LAZY_INIT] = "1" if lazy else (before or "0")
        try:
            _GROUPS[name] = dist.new_group(backend="gloo",
                                           timeout=datetime.timedelta(seconds=seconds))
        finally:
            if before is None:
                del os.environ[LAZY_INIT]
            else:
                os.environ[LAZY_INIT] = before
    return _GROUPS[name]


def release() -> None:
    """Destroy the side groups and drop our references to them, before the world group
    goes. A group still referenced at interpreter exit is torn down during C++
    finalisation, where gloo's threads abort the process ("terminate called without an
    active exception") after a run that finished."""
    if _GROUPS:
        import torch.distributed as dist

        groups = list(_GROUPS.values())
        _GROUPS.clear()
        for group in groups:
            dist.destroy_process_group(group)


def missing_ranks(timeout_s: float = ROLL_CALL_S) -> list[int] | None:
    """The ranks that do not reach a monitored barrier within ``timeout_s``; None when
    that cannot be found out (the check itself failed). On a rank other than 0, a rank 0
    that does not answer is the one missing."""
    import torch.distributed as dist

    try:
        dist.monitored_barrier(group=_side_group("roll_call"),
                               timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
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
        dist.monitored_barrier(group=_side_group("epoch"),
                               timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    except Exception as exc:
        match = _MISSING.search(str(exc))
        who = f"rank(s) {match.group(1)}" if match else "some rank"
        raise RunError(f"{who} did not reach the end of the epoch within {timeout_s:g}s "
                          f"(rank {dist.get_rank()} waited): {first_line(exc)}"
                          ) from None
