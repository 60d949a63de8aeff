"""lins_ds: Lins sharding (independent P/G/OS meshes) for DeepSpeed.

``import lins_ds`` makes ``deepspeed.initialize`` build a LinsEngine for configs with a ``"lins"``
block. It does so lazily: deepspeed (and torch) load only when the program imports them, so the
pure planner (``lins_ds.plan``, ``lins-ds plan``) never pulls torch in.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"


def _patch_deepspeed() -> None:
    from .integrations.deepspeed_patch import install

    install()


class _PatchDeepSpeedOnImport(importlib.abc.MetaPathFinder):
    """Runs ``_patch_deepspeed`` right after ``import deepspeed`` has executed. Stays installed until
    then: availability probes (``importlib.util.find_spec("deepspeed")``, as transformers does) get a
    spec too, but only an actual import executes it."""

    _busy = False

    def find_spec(self, name, path, target=None):
        if name != "deepspeed" or self._busy:
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
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _patch_deepspeed()

        spec.loader.exec_module = exec_then_patch
        return spec


if "deepspeed" in sys.modules:
    _patch_deepspeed()
elif not any(isinstance(f, _PatchDeepSpeedOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchDeepSpeedOnImport())


def initialize(*args, **kwargs):
    """Same arguments and 4-tuple as ``deepspeed.initialize``; builds a LinsEngine for a lins config."""
    from .integrations.deepspeed_patch import initialize as _initialize

    return _initialize(*args, **kwargs)
