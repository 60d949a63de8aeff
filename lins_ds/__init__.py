"""lins_ds: Lins sharding (independent P/G/OS meshes) for DeepSpeed.

Installed, lins_ds is active in every program that imports deepspeed (``lins_ds_autoload``, run at interpreter
start-up by ``lins_ds_autoload.pth``): ``deepspeed.initialize`` builds a LinsEngine for a config with a ``"lins"``
block; transformers' ``from_pretrained`` / ``from_config`` build sharded while a Lins
``TrainingArguments(deepspeed=...)`` is alive (``lins_ds.init``); and accelerate counts every process of a CPU run
of a Lins config (``integrations/accelerate_patch.py`` says why). ``import lins_ds`` does the same where autoload
is off (``LINS_DS_AUTOLOAD=0``) or lins_ds is not installed, and extends accelerate's fix to every DeepSpeed CPU
run. Each patch runs right after the program imports the package it patches, so the pure planner
(``lins_ds.plan``, ``lins-ds plan``) never pulls torch in.
"""

from __future__ import annotations

import lins_ds_autoload as _hook

from .version import __version__  # noqa: F401
_hook.explicit = _hook.explicit or not _hook.importing  # the program's own import, not the hook's


def post_import(name: str) -> None:
    """Patch the package ``name`` that the program has just imported (``lins_ds_autoload.WATCHED``)."""
    if name == "deepspeed":
        from .integrations.deepspeed_patch import install
    elif name == "accelerate.state":
        from .integrations.accelerate_patch import install
    elif name == "transformers.training_args":
        from .integrations.accelerate_patch import install_training_args as install
    elif name == "peft.tuners.tuners_utils":
        from .integrations.peft_patch import install
    else:
        from .integrations.sharded_init import install_hf as install
    install()


_hook.install()


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
