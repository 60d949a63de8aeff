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


def _lins_checkpoint_refusal(engine, load_dir, tag):
    """The message for a Lins checkpoint that plain DeepSpeed ``engine`` is asked to load (None for anything else):
    ``load_dir``/``tag`` resolved as DeepSpeed resolves them (``latest``, or ``latest_universal`` under its
    ``load_universal``)."""
    import glob

    from ..checkpoint.formats import LATEST_UNIVERSAL, LINS, identify
    from ..checkpoint.layout_free import LATEST

    if not isinstance(load_dir, (str, os.PathLike)) or not os.path.isdir(load_dir):
        return None
    if tag is None:
        pointer = os.path.join(load_dir, LATEST_UNIVERSAL if engine.load_universal_checkpoint() else LATEST)
        try:
            with open(pointer) as f:
                tag = f.read().strip()
        except (OSError, UnicodeDecodeError):
            return None
    path = os.path.join(load_dir, str(tag))
    found = identify(path) if os.path.isdir(path) else None
    if found is None or found.kind != LINS or glob.glob(os.path.join(path, "*model_states.pt")):
        return None
    script = os.path.join(load_dir, "zero_to_fp32.py")
    weights = f"`lins-ds consolidate {load_dir} OUT_DIR --tag {tag}`" + (
        f" (or `python {script} {load_dir} OUT_DIR --tag {tag}`)" if os.path.isfile(script) else "")
    return (f"load_checkpoint: {path} is a Lins checkpoint (lins_ds' own format: meta.json and one shard file per "
            f"writing rank), which this DeepSpeed engine (ZeRO stage {engine.zero_optimization_stage()}; its config "
            "has no \"lins\" block) cannot read. To resume it under DeepSpeed, convert it to DeepSpeed's universal "
            f"format: `lins-ds convert {load_dir} OUT_DIR --tag {tag} --to deepspeed-universal`, then load OUT_DIR "
            "(the same tag) with \"checkpoint\": {\"load_universal\": true} in the config; for the weights alone, "
            + weights + "; or resume under Lins: add the \"lins\" block to this run's DeepSpeed config "
            "(docs/checkpoints.md)")


def _refuse_lins_checkpoints() -> None:
    """DeepSpeed's own ``load_checkpoint`` (a ZeRO or stage-0 engine; LinsEngine has its own) on a Lins checkpoint
    fails with a bare AssertionError (no ``*model_states.pt``): it fails naming the checkpoint and the conversion, on
    every rank (each reads the same files: no collective)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    real = DeepSpeedEngine.load_checkpoint
    if getattr(real, "_lins", False):
        return

    @functools.wraps(real)
    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        why = _lins_checkpoint_refusal(self, load_dir, tag)
        if why is not None:
            from ..checkpoint.formats import LinsCheckpointError

            raise LinsCheckpointError(why)
        return real(self, load_dir, tag, *args, **kwargs)

    load_checkpoint._lins = True
    DeepSpeedEngine.load_checkpoint = load_checkpoint


def install() -> None:
    from ..checkpoint import zero_to_fp32

    deepspeed.initialize = initialize
    zero_to_fp32.install()
    _refuse_lins_checkpoints()
