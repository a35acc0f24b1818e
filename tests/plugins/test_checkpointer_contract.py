"""The built-in checkpointers against engine.testing's checkpointer contract: the checks
a third-party checkpointer is run against, run against ours (real files, a real writer
process for async, a real SIGKILL of a writer half-way through its write)."""

from __future__ import annotations

import pytest

from engine.plugins.async_file import AsyncFileCheckpointer
from engine.plugins.dcp import AsyncDCPCheckpointer, DCPCheckpointer
from engine.plugins.torch_file import TorchFileCheckpointer
from engine.testing import CheckpointerContract


class TestTorchFile(CheckpointerContract):
    checkpointer_class = TorchFileCheckpointer


@pytest.mark.slow  # a writer process per checkpointer (seconds): not in the quick loop
class TestAsync(CheckpointerContract):
    checkpointer_class = AsyncFileCheckpointer


class TestDCP(CheckpointerContract):
    checkpointer_class = DCPCheckpointer


class TestAsyncDCP(CheckpointerContract):
    checkpointer_class = AsyncDCPCheckpointer
