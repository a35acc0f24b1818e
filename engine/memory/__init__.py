"""In-memory snapshots: the newest training state in shared memory every few optimizer
steps (``checkpoint.memory_every_steps``): a restarted worker loses at most that many
steps (docs/checkpoints.md, "In memory, from a peer, from disk"). One face,
:class:`~engine.memory.tier.MemoryTier`, which the snapshot layer (engine/snapshot.py)
opens, feeds and closes; imported only when the tier is on. One job per module::

    files.py      the folder, the run's id, the names    buffer.py   format, checksum
    copy_plan.py  the copies of each save                rows.py     RNG states, loss sums
    background.py the thread, the rows' exchange         pair.py     a rank's 2 buffers
    resume.py     the ranks' agreement at a resume       ring.py     fsdp's copies
    cost.py       the cost, auto's interval              tier.py     the face
"""

from engine.memory.tier import MemoryTier

__all__ = ["MemoryTier"]
