"""Route ``deepspeed.initialize`` to LinsEngine when the config has an enabled ``lins`` block.

``deepspeed.initialize`` builds its engine through the module-global name ``deepspeed.DeepSpeedEngine``,
and HF Trainer and accelerate look ``deepspeed.initialize`` up at call time, so swapping the function
once makes every entry point (scripts, ``deepspeed`` launcher, torchrun, Trainer, accelerate) use Lins.
Any other config reaches DeepSpeed untouched. Where Lins is off (``LINS_DS_AUTOLOAD=0`` and the program does not
import lins_ds), a config with a ``lins`` block reaches DeepSpeed too, and rank 0 says so loudly.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
import sys

import deepspeed
import lins_ds_autoload

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
    if not lins_ds_autoload.lins_on():
        _say(f"WARNING lins_ds: this DeepSpeed config has a \"lins\" block ({json.dumps(config['lins'])[:200]}) but "
             f"Lins is off ({lins_ds_autoload.ENV}={os.environ.get(lins_ds_autoload.ENV)} and the program does not "
             f"import lins_ds): plain DeepSpeed trains it, with its zero_optimization stage "
             f"{(config.get('zero_optimization') or {}).get('stage', 0)}. Unset {lins_ds_autoload.ENV} (or "
             f"`import lins_ds`) to train with Lins; remove the block to silence this.")
        return _original_initialize(*args, **kwargs)
    if not lins_ds_autoload.explicit:
        _say_once("lins_ds: the config's \"lins\" block builds a LinsEngine (lins_ds is installed; "
                  f"{lins_ds_autoload.ENV}=0 turns that off)")
    from .engine import LinsEngine
    from ..runtime.config import translate_zero_offload

    config, notes = translate_zero_offload(config)
    for note in notes:
        _say_once(f"lins_ds: {note}")

    saved = deepspeed.DeepSpeedEngine
    deepspeed.DeepSpeedEngine = LinsEngine
    try:
        # the config read once, here, with its ZeRO-Offload keys translated, given to DeepSpeed where it came from
        a = bound.arguments
        if a.get("config") is None and a.get("config_params") is not None:
            bound.arguments["config_params"] = config
        else:
            if a.get("config") is None and a.get("args") is not None:
                bound.arguments["args"] = copy.copy(bound.arguments["args"])  # DeepSpeed takes one source only
                for attr in ("deepspeed_config", "deepscale_config"):
                    if hasattr(bound.arguments["args"], attr):
                        setattr(bound.arguments["args"], attr, None)
            bound.arguments["config"] = config
        return _original_initialize(*bound.args, **bound.kwargs)
    finally:
        deepspeed.DeepSpeedEngine = saved


def _say(message: str) -> None:
    """On rank 0 (by the launcher's RANK: the process group may not exist yet), to stderr."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


_said = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        _say(message)


def install() -> None:
    from ..checkpoint import zero_to_fp32

    deepspeed.initialize = initialize
    zero_to_fp32.install()
