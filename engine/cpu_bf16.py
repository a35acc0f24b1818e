"""Whether this CPU computes bf16 in hardware, and what ``precision=bf16`` costs when not.

bf16 autocast on a CPU is fast only with bf16 instructions (AVX-512 BF16 or AMX on x86,
the BF16 extension on Arm); without them it is emulated in software and the run is
many times slower than fp32, silently. ``--dry-run``, ``engine-run doctor`` and the
first lines of a bf16 run on the CPU say so (:func:`note_here`); the figures behind
:data:`SLOWDOWN`: docs/performance.md, "bf16 on a CPU without bf16 instructions".
"""

from __future__ import annotations

#: /proc/cpuinfo flags that mean bf16 arithmetic in hardware (x86: ``flags``; Arm:
#: ``Features``).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")

SLOWDOWN = ("8x to 90x slower than fp32 (measured on an AVX2 CPU: a small language "
            "model 8.6x, an MLP 17x, a 1024x1024 matmul 90x)")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags (those of its first processor), or None where the file
    cannot say (not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def has_bf16(flags: frozenset[str] | set[str] | None) -> bool | None:
    """True when ``flags`` include bf16 instructions, None when unknown."""
    if flags is None:
        return None
    return any(flag in flags for flag in BF16_FLAGS)


def note(flags: frozenset[str] | set[str] | None) -> str | None:
    """The warning for ``precision=bf16`` on a CPU with ``flags``, or None when it has
    bf16 hardware or its flags are unknown."""
    if has_bf16(flags) is not False:
        return None
    return ("precision=bf16 on a CPU without bf16 hardware (no AVX-512 BF16 or AMX flag "
            f"in /proc/cpuinfo): bf16 autocast is emulated here, {SLOWDOWN}; "
            "use precision=32 on this machine")


def note_here() -> str | None:
    """:func:`note` for this machine's CPU."""
    return note(cpu_flags())
