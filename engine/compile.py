"""torch.compile for the run's model (``compile.*``; docs/compile.md says why and how).

In torchtitan's order: build_model -> .to(device) -> [activation checkpointing] ->
compile -> parallel wrap. The whole model, or (``compile.regional``) every submodule of
the named classes, is compiled in place (``nn.Module.compile``), so ``state_dict`` keys
stay plain (no ``_orig_mod.``). The compile time is torch's own count (``compile_s``).
"""

from __future__ import annotations

import logging
import sys

from engine.errors import ConfigError, first_line

# torch._dynamo is imported inside the functions, and only where a run has imported it
# already: a run that never compiled reads nothing (and pays nothing) here.


def compile_model(model, options, say=print):
    """``model`` compiled as ``options`` (a CompileConfig) say, in place; returned.
    ``say`` tells the user (rank 0) why the first steps will be slow."""
    if not options.enabled:
        if options.regional:
            raise ConfigError("config key 'compile.regional' compiles only with "
                              "compile.enabled=true; set it too, or leave regional unset")
        return model
    logging.getLogger("torch.utils.cpp_extension").addFilter(not_cuda_home_line)
    kwargs = {"mode": None if options.mode == "default" else options.mode,
              "backend": options.backend, "fullgraph": options.fullgraph}
    try:
        for module in regions(model, options.regional):
            module.compile(**kwargs)
    except Exception as exc:  # torch checks the backend and the mode here
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"compile: {first_line(exc)} (compile.backend="
                          f"{options.backend!r}, compile.mode={options.mode!r})") from None
    say(f"compile: {what(model, options)} compiled (mode {options.mode}, backend "
        f"{options.backend}) by the first training and validation steps, which take longer")
    return model


def not_cuda_home_line(record) -> bool:
    """False for torch's "No CUDA runtime is found, using CUDA_HOME=..." (inductor imports
    cpp_extension, which says it on every rank of a CPU run where a CUDA toolkit is)."""
    return not record.getMessage().startswith("No CUDA runtime is found")


def regions(model, class_names: tuple[str, ...]) -> list:
    """The modules to compile: the model, or its outermost submodules whose class is
    named in ``class_names`` (a block inside a compiled block is compiled with it)."""
    if not class_names:
        return [model]
    wanted = set(class_names)
    found, inside = [], set()
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if type(module).__name__ in wanted:
            found.append(module)
            inside.add(f"{name}." if name else "")
    missing = wanted - {type(m).__name__ for m in found}
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            f"compile.regional={','.join(class_names)}: the model "
            f"{type(model).__name__} has no submodule of class "
            f"{', '.join(sorted(missing))}; its classes are {', '.join(present)}")
    return found


def what(model, options) -> str:
    """The compiled module(s), for the messages: ``Net`` or ``the Block modules``."""
    if options.regional:
        return f"the {', '.join(options.regional)} modules of {type(model).__name__}"
    return type(model).__name__


def seconds_spent() -> float | None:
    """Seconds this process spent compiling so far (dynamo and the backend, forward and
    backward, recompiles included), by torch's own count; None before any compile."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    total = spent.get("total_wall_time") or (
        spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0))
    if not total:
        # torch 2.11 left these timers at 0 in a forked process that compiled 6 graphs (seen
        # on an H200); each graph's own record (forward and backward) still has its duration.
        from torch._dynamo.utils import get_compilation_metrics

        total = sum(getattr(m, "duration_us", None) or 0
                    for m in get_compilation_metrics()) / 1e6
    return round(total, 3) if total else None


def report(options, before: float | None) -> tuple[float | None, str | None]:
    """``compile_s`` for the summary, and the line that tells it (None when off):
    torch's count now, less ``before`` (its count when the run started: a process may
    run several, through the library door)."""
    if not options.enabled:
        return None, None
    spent = round(max(0.0, (seconds_spent() or 0.0) - (before or 0.0)), 3)
    return spent, (f"compile: {spent:.1f} s spent compiling on rank 0 (torch's count: the "
                   f"forward, backward and validation graphs; {graphs_compiled()} "
                   "graph(s) compiled in this process)")


def graphs_compiled() -> int:
    """How many frames torch compiled in this process (each forward graph once)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import get_compilation_metrics

    return len(get_compilation_metrics())


def explain_failure(exc: BaseException, model, options) -> ConfigError | None:
    """One line for an error raised by torch.compile during a step, naming the compiled
    module and the compiler's first line, with the way out; None for other errors."""
    if not options.enabled or "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.exc import TorchDynamoException

    if not isinstance(exc, TorchDynamoException):
        return None
    # BackendCompilerFailed's own first line is "backend='inductor' raised:".
    cause = getattr(exc, "inner_exception", None) or exc
    return ConfigError(
        f"compile: {what(model, options)} failed to compile ({type(cause).__name__}: "
        f"{first_line(cause)}); run without compile (compile.enabled=false)"
        + ("" if options.regional else ", or compile only its repeated blocks "
           "(compile.regional=BlockClass)"))
