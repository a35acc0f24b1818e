"""``-p tests.examples.hf_imports`` for the runs of tests/examples/test_hf_causal_lm.py:
the launcher imports transformers' GPT-2 as it loads this plugin, before it forks the
workers, which find it imported instead of each importing it again (2.3 CPU s a worker).
Not datasets: its import starts a thread, and the launcher would spawn the workers
rather than fork a threaded process. It registers no hook: the runs are the example's."""

import transformers.models.gpt2.modeling_gpt2  # noqa: F401
from transformers import AutoModelForCausalLM  # noqa: F401
