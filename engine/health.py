"""No hangs: telling which rank failed, and checking that all ranks are still there.

A rank that dies makes the others fail at their next collective; one that hangs makes
them wait for the process-group timeout (``cfg.timeout_s``). Either way the user needs
*which* rank: after a failed collective, :func:`missing_ranks` (a roll call with a short
bound) names every rank that does not answer, and at epoch ends :func:`epoch_barrier`
names a rank stuck outside the collectives (its data pipeline). Both meet on the store the
ranks met on at the start (engine/distributed.py): no group, no connection of their own.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from typing import Callable

from engine.errors import RunError

# torch is imported inside the functions that use it: engine.distributed imports this
# module, and the launching process imports that one without torch.

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


#: How long the roll call after a failed collective waits for the ranks to answer; a rank
#: other than 0 waits this long again for rank 0's answer, so a run whose rank 0 is
#: stopped ends within ``timeout_s`` plus twice this and the launcher's clean-up.
ROLL_CALL_S = 2.0

#: The longest pause between two looks at the store while waiting for a key: a rank
#: that checks in is seen within it (a look is one small request to the store).
CHECK_S = 0.05

#: The store the checks meet on (:func:`prepare`); None: no checks (one process).
_STORE = None
_MET: dict[str, int] = {}  # per kind of meeting, how many this process has joined
_GROUPS: dict = {}  # gloo_group's, by name


def prepare(store) -> None:
    """Keep ``store`` (the ranks' rendezvous store, under a prefix of the checks' own):
    every rank, right after the process group is made."""
    global _STORE
    _STORE = store
    _MET.clear()


def _meet(kind: str, timeout_s: float) -> list[int]:
    """Every rank sets its key of this meeting; rank 0 waits ``timeout_s`` for all of
    them and posts the ranks whose key is missing, which the others wait for ROLL_CALL_S
    longer. Returns the ranks missing: [0] on a rank other than 0 that rank 0's answer
    does not reach. The waits look at the keys (:func:`poll_keys`): a store's wait that
    times out has torch print two lines."""
    import torch.distributed as dist

    count = _MET[kind] = _MET.get(kind, 0) + 1
    rank, size = dist.get_rank(), dist.get_world_size()
    meeting, post = f"{kind}/{count}", f"{kind}/{count}/missing"
    # The last meeting's keys go (an epoch barrier per epoch would leave W a time on the
    # store's host): each rank's own as it comes to this one, rank 0's post once every
    # rank is here (each has read it).
    last = f"{kind}/{count - 1}" if count > 1 else None
    if rank != 0:
        answer = []

        # Rank 0's bound and a roll call's more: the ranks enter a meeting at different
        # moments (each saw the failed collective at its own).
        patience = timeout_s + ROLL_CALL_S
        deadline = time.monotonic() + patience

        def ask() -> None:
            if last:
                _STORE.delete_key(f"{last}/{rank}")
            _STORE.set(f"{meeting}/{rank}", "1")
            if poll_keys(_STORE, [post], deadline):
                answer.append(json.loads(_STORE.get(post)))

        # In a thread, bounded: a stopped rank 0 (SIGSTOP) hosting the store answers no
        # request, and the store's client would wait for it without end.
        asking = threading.Thread(target=ask, daemon=True, name="engine-health")
        asking.start()
        asking.join(patience)
        return answer[0] if answer else [0]  # rank 0 did not answer: it is the one missing
    _STORE.set(f"{meeting}/{rank}", "1")
    keys = [f"{meeting}/{r}" for r in range(size)]
    if poll_keys(_STORE, keys, time.monotonic() + timeout_s):
        missing = []
        if last:
            _STORE.delete_key(f"{last}/0")
            _STORE.delete_key(f"{last}/missing")
    else:  # one look at each key says who did not come
        missing = [r for r, key in enumerate(keys) if not _STORE.check([key])]
    _STORE.set(post, json.dumps(missing))
    return missing


def gloo_group(name: str, seconds: float):
    """The gloo group ``name`` (timeout ``seconds``), made at the first call (every rank
    at once), destroyed by :func:`release`: the memory ring's (ring.py). Eager: gloo's
    lazily connected groups (TORCH_GLOO_LAZY_INIT) aborted a finished run in gloo's
    teardown ("state_ <= CONNECTED. 5 vs 4") once in about 700 runs (docs/scale.md)."""
    if name not in _GROUPS:
        import torch.distributed as dist

        _GROUPS[name] = dist.new_group(backend="gloo",
                                       timeout=datetime.timedelta(seconds=seconds))
    return _GROUPS[name]


def release() -> None:
    """Forget the store; destroy the groups, and our references, before the world group:
    one still referenced at exit is torn down in C++ finalisation, where gloo's threads
    abort the process ("terminate called without an active exception") after a finished
    run."""
    global _STORE
    _STORE = None
    if _GROUPS:
        import torch.distributed as dist

        groups = list(_GROUPS.values())
        _GROUPS.clear()
        for group in groups:
            dist.destroy_process_group(group)


def poll_keys(store, keys: list[str], deadline: float,
              while_waiting: Callable[[], None] | None = None) -> bool:
    """True once every key of ``store`` exists, False at the deadline; ``while_waiting()``
    between two looks (the rendezvous, engine/distributed.py, and the meetings here).
    ``check``, not ``store.wait``: torch logs a warning for each wait timed out."""
    pause = 0.01
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if while_waiting is not None:
            while_waiting()
        time.sleep(min(pause, left))
        pause = min(pause * 2, CHECK_S)
    return True


def missing_ranks(timeout_s: float = ROLL_CALL_S) -> list[int] | None:
    """The ranks that miss the roll call within ``timeout_s`` (on a rank other than 0: as
    rank 0 saw them, or rank 0 where it does not answer); None where that cannot be found
    out (no store, or the store fails)."""
    if _STORE is None:
        return None
    try:
        return _meet("roll_call", timeout_s)
    except Exception:
        return None


def epoch_barrier(timeout_s: float) -> None:
    """All ranks meet at the end of an epoch; a rank that does not come is named."""
    import torch.distributed as dist

    if _STORE is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    missing = _meet("epoch", timeout_s)
    if missing:
        raise RunError(f"rank(s) {', '.join(map(str, missing))} did not reach the end of the "
                       f"epoch within {timeout_s:g}s (rank {dist.get_rank()} waited)")
