"""In-memory snapshots: the newest training state in shared memory every few optimizer
steps (``checkpoint.memory_every_steps``), so that a restarted worker loses at most that
many steps instead of everything since the last disk snapshot (docs/checkpoints.md,
"In memory, from a peer, from disk", says what it trusts, when buffers go, what it costs).

One face, :class:`~engine.memory.tier.MemoryTier`, which the snapshot layer
(engine/snapshot.py's Snapshots) opens, feeds and closes; imported only when the tier is
on. Each module one job::

    files.py       this user's folder in the tmpfs, the run's id, the buffers' names
    buffer.py      a buffer's format and checksum, reading one back
    copy_plan.py   where each tensor goes, the copies done again at each save
    rows.py        each rank's exchange row: its RNG states and loss sums
    background.py  the thread that finishes a snapshot off the step's path; the rows'
                   exchange
    pair.py        this rank's two buffers (MemorySnapshots)
    resume.py      the ranks' agreement on the snapshot to resume from
    ring.py        under fsdp, each rank's copy of its predecessor's snapshot
    cost.py        what the snapshots cost; auto's interval
    tier.py        the face
"""

from engine.memory.tier import MemoryTier

__all__ = ["MemoryTier"]
