"""lins_ds: Lins sharding (independent P/G/OS meshes) for DeepSpeed.

``import lins_ds`` makes ``deepspeed.initialize`` build a LinsEngine for configs with a ``"lins"`` block,
makes transformers' ``from_pretrained`` / ``from_config`` build sharded while a Lins
``TrainingArguments(deepspeed=...)`` is alive (``lins_ds.init``), and fixes accelerate's process count for
multi-process CPU runs with DeepSpeed (``integrations/accelerate_patch.py`` says why). It does so lazily,
right after the program imports those packages, so the pure planner (``lins_ds.plan``, ``lins-ds plan``)
never pulls torch in.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"


def _patch_deepspeed() -> None:
    from .integrations.deepspeed_patch import install

    install()


def _patch_accelerate() -> None:
    from .integrations.accelerate_patch import install

    install()


def _patch_transformers() -> None:
    from .integrations.sharded_init import install_hf

    install_hf()


_POST_IMPORT = {"deepspeed": _patch_deepspeed, "accelerate.state": _patch_accelerate,
                "transformers.modeling_utils": _patch_transformers}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after ``import deepspeed`` / ``accelerate.state`` has executed. Stays
    installed until then: availability probes (``importlib.util.find_spec("deepspeed")``, as
    transformers does) get a spec too, but only an actual import executes it."""

    _busy = False

    def find_spec(self, name, path, target=None):
        if name not in _POST_IMPORT or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _POST_IMPORT[name]()

        spec.loader.exec_module = exec_then_patch
        return spec


for _name, _patch in _POST_IMPORT.items():
    if _name in sys.modules:
        _patch()
if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchOnImport())


def init(config=None, seed=None):
    """Context manager: models built (or loaded with ``from_pretrained``) inside keep their parameters off
    the device, on no rank whole; ``deepspeed.initialize`` with a ``lins`` config materialises each rank's
    share, unit by unit, as ``deepspeed.zero.Init`` does for ZeRO-3. ``config``: that DeepSpeed config."""
    from .integrations.sharded_init import init as _init

    return _init(config, seed)


def initialize(*args, **kwargs):
    """Same arguments and 4-tuple as ``deepspeed.initialize``; builds a LinsEngine for a lins config."""
    from .integrations.deepspeed_patch import initialize as _initialize

    return _initialize(*args, **kwargs)
