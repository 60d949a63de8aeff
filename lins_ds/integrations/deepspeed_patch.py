"""Route ``deepspeed.initialize`` to LinsEngine when the config has an enabled ``lins`` block.

``deepspeed.initialize`` builds its engine through the module-global name ``deepspeed.DeepSpeedEngine``,
and HF Trainer and accelerate look ``deepspeed.initialize`` up at call time, so swapping the function
once makes every entry point (scripts, ``deepspeed`` launcher, torchrun, Trainer, accelerate) use Lins.
Any other config reaches DeepSpeed untouched.
"""

from __future__ import annotations

import functools
import inspect

import deepspeed

_original_initialize = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)


def _config_of(bound: inspect.BoundArguments):
    a = bound.arguments
    config = a.get("config") or a.get("config_params")
    args = a.get("args")
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and not isinstance(config, dict):
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
        config = load_ds_config(config)
    return config


@functools.wraps(_original_initialize)
def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with the same arguments and return value; a config whose ``lins`` block
    is present and not disabled builds a LinsEngine."""
    from ..runtime.config import lins_block

    bound = inspect.signature(_original_initialize).bind(*args, **kwargs)
    config = _config_of(bound)
    if lins_block(config) is None:
        return _original_initialize(*args, **kwargs)
    from .engine import LinsEngine

    saved = deepspeed.DeepSpeedEngine
    deepspeed.DeepSpeedEngine = LinsEngine
    try:
        if "config" in bound.arguments and not isinstance(bound.arguments["config"], dict):
            bound.arguments["config"] = config  # read the file once, here
        return _original_initialize(*bound.args, **bound.kwargs)
    finally:
        deepspeed.DeepSpeedEngine = saved


def install() -> None:
    deepspeed.initialize = initialize
