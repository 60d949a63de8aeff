"""A multi-process CPU run of accelerate (and so of the HF Trainer) with DeepSpeed counts one process.

Cause (accelerate 1.x, ``PartialState.__init__``): ``_prepare_backend(cpu=False)`` only recognises
accelerator backends, and treats CPU as distributed only when ``cpu=True``. On a machine without an
accelerator it therefore returns backend None; the DeepSpeed branch still initialises a gloo group of
every rank, but the "no backend" branch then sets ``num_processes = 1`` and ``process_index = 0`` on
every rank. Each rank then sees the whole dataset, the batch-size arithmetic uses world size 1 (the
Trainer fails DeepSpeed's batch check), and nothing is sharded.

Fix: in exactly that situation — no accelerator, ``cpu=False``, a launcher's LOCAL_RANK, DeepSpeed on —
report the gloo backend and MULTI_CPU, which is what DeepSpeed itself uses there, when the program imported
lins_ds or the DeepSpeed config is a Lins one (installed, lins_ds changes no other program's runs): the Trainer's, the
config file ``accelerate launch`` names, or a ``DeepSpeedPlugin(hf_ds_config=...)`` the script builds before its
``Accelerator``. Every other case goes to accelerate unchanged.
"""

from __future__ import annotations

import contextvars
import json
import os
import weakref

import torch

import lins_ds_autoload

from ..runtime.config import lins_block


def _no_accelerator() -> bool:
    return not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available())


_building_lins_args = contextvars.ContextVar("lins_training_args", default=False)  # TrainingArguments.__post_init__


def _is_lins(config) -> bool:
    """A DeepSpeed config (a dict, or a JSON file's path) with a ``lins`` block."""
    if isinstance(config, str) and config.endswith(".json") and os.path.isfile(config):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return False
    return isinstance(config, dict) and lins_block(config) is not None


_lins_plugins: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # id -> a live Lins DeepSpeedPlugin


def _lins_config_in_play() -> bool:
    """The DeepSpeed config accelerate is about to use has a ``lins`` block: the HF Trainer's (its
    TrainingArguments being built, or a live HfDeepSpeedConfig), ``accelerate launch``'s config file, or a
    ``DeepSpeedPlugin`` the script built itself (``DeepSpeedPlugin(hf_ds_config=<a Lins config>)``, then
    ``Accelerator(deepspeed_plugin=...)``: accelerate's state is made after the plugin)."""
    from .sharded_init import _hf_lins_config

    return (_building_lins_args.get() or _hf_lins_config() is not None
            or _is_lins(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")) or len(_lins_plugins) > 0)


def install_plugin() -> None:
    """Note every ``DeepSpeedPlugin`` built with a Lins config (a dict or a JSON file's path; accelerate reads either
    into ``deepspeed_config``) while it lives: the in-script form of ``accelerate launch``'s config file."""
    from accelerate.utils import DeepSpeedPlugin

    original = DeepSpeedPlugin.__post_init__
    if getattr(original, "_lins_patched", False):
        return

    def __post_init__(self):
        original(self)
        if _is_lins(getattr(self, "deepspeed_config", None)):
            _lins_plugins[id(self)] = self

    __post_init__._lins_patched = True
    DeepSpeedPlugin.__post_init__ = __post_init__
    install_config_process()


def install_config_process() -> None:
    """accelerate (and so the HF Trainer) fills every ``"auto"`` of a DeepSpeed config from its own values and refuses
    one it has none for ("... not found in kwargs"); the ``lins`` block's ``"auto"`` values (``lins.offload``,
    ``lins.tiling``, ...) are Lins' own, which accelerate knows nothing of: it walks the config without that block."""
    from accelerate.utils import DeepSpeedPlugin

    original = DeepSpeedPlugin.deepspeed_config_process
    if getattr(original, "_lins_patched", False):
        return

    def deepspeed_config_process(self, prefix="", mismatches=None, config=None, must_match=True, **kwargs):
        if not prefix:
            config = self.deepspeed_config if config is None else config
            if isinstance(config, dict) and isinstance(config.get("lins"), dict):
                config = {k: v for k, v in config.items() if k != "lins"}
        return original(self, prefix=prefix, mismatches=mismatches, config=config, must_match=must_match, **kwargs)

    deepspeed_config_process._lins_patched = True
    DeepSpeedPlugin.deepspeed_config_process = deepspeed_config_process


def install_training_args() -> None:
    """TrainingArguments sets accelerate's state up while it is built, before the HfDeepSpeedConfig that would tell
    a Lins config exists: say so for the duration of its ``__post_init__``."""
    from transformers.training_args import TrainingArguments

    original = TrainingArguments.__post_init__
    if getattr(original, "_lins_patched", False):
        return

    def __post_init__(self):
        token = _building_lins_args.set(_is_lins(getattr(self, "deepspeed", None)))
        try:
            original(self)
        finally:
            _building_lins_args.reset(token)

    __post_init__._lins_patched = True
    TrainingArguments.__post_init__ = __post_init__


def _applies() -> bool:
    return lins_ds_autoload.explicit or (lins_ds_autoload.lins_on() and _lins_config_in_play())


def install() -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend
    if getattr(original, "_lins_patched", False):
        return

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        backend_out, dtype = original(self, cpu, sagemaker_dp, backend)
        if (backend_out is None and not cpu and not sagemaker_dp and _no_accelerator()
                and int(os.environ.get("LOCAL_RANK", -1)) != -1
                and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and _applies()):
            return "gloo", DistributedType.MULTI_CPU
        return backend_out, dtype

    _prepare_backend._lins_patched = True
    PartialState._prepare_backend = _prepare_backend
    install_plugin()
