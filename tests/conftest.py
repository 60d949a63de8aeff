"""The test session: this checkout first on ``sys.path`` (``lins_ds``, ``bench``, ``helpers``), a JIT extension cache
of this environment's own, and in the parent process what every forked rank would otherwise import itself."""

import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path[:0] = [p for p in (ROOT, TESTS) if p not in sys.path]
# DeepSpeed JIT-builds its CPU ops into ~/.cache/torch_extensions, shared by every environment: one built by
# another DeepSpeed or torch fails to load here. Each environment (CI runs two) gets its own.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


def _prewarm() -> None:
    """Ranks are forked from this process: what they import after the fork, each pays for (seconds each, on every
    rank of every test). torch.optim's first optimizer imports torch's compiler stack, DeepSpeed probes its ops
    with compiler runs at its first ``initialize``, transformers imports model classes lazily."""
    import torch._dynamo  # noqa: F401
    import deepspeed.ops

    try:
        import setuptools  # noqa: F401  (DeepSpeed's op builders import it)
    except ImportError:
        pass

    deepspeed.ops.__compatible_ops__  # noqa: B018  (probed once, cached in the module)
    import lins_ds  # noqa: F401
    try:
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401
    except ImportError:
        pass


_prewarm()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: launches processes as a user would (launchers, HF Trainer, bench); "
                                       "run by .ci/run like the rest, deselect with -m 'not slow' while iterating")
