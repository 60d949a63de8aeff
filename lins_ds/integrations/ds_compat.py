"""Every DeepSpeed internal LinsEngine relies on, in one place, checked when the engine is imported.

LinsEngine subclasses ``DeepSpeedEngine`` and overrides or calls a few of its methods that are not
public API, so a DeepSpeed release can break it (0.19.8 removed ``_configure_compression_scheduler``
and ``_configure_quantization``). Each name below is checked at import; a missing one is one clear
``ImportError`` naming the DeepSpeed version and the supported range, instead of an ``AttributeError``
from deep inside ``deepspeed.initialize``. ``tests/test_ds_compat.py`` holds this list against the
installed DeepSpeed.
"""

from __future__ import annotations

import deepspeed
import torch
from deepspeed.runtime.constants import GRADIENT_CLIPPING
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import register_output_backward_hooks

from ..runtime.step.executor import grad_tensors

SUPPORTED = ">=0.19.6,<0.20"  # what CI tests: 0.19.6 (the last with MiCS) and the newest 0.19.x

# DeepSpeedEngine methods LinsEngine overrides or calls, and why.
ENGINE_METHODS = {
    "_configure_optimizer": "overridden: builds LinsOptimizer instead of ZeRO / fp16 / bf16 wrappers",
    "_configure_basic_optimizer": "called: the optimizer named in the config's \"optimizer\" block",
    "_check_for_duplicates": "called: rejects a parameter listed in two param groups, as DeepSpeed does",
    "allreduce_gradients": "overridden: Lins' own reduction at the accumulation boundary",
    "clip_fp32_gradients": "overridden: LinsOptimizer clips on the global norm of the sharded gradients",
    "get_global_grad_norm": "overridden: the norm stays on the device until asked for",
    "is_gradient_accumulation_boundary": "called: starts the replica AllReduce in the boundary backward",
    "destroy": "overridden: waits for Lins' collectives and destroys its process groups",
    "_broadcast_model": "overridden: nothing to broadcast for a model built without values (lins_ds.init)",
    "_configure_bf16_optimizer": "overridden: an engine without an optimizer gets no bf16 wrapper (forward only)",
    "zero_grad": "overridden: drops the gradients Lins accumulated, as DeepSpeed drops .grad",
    "backward": "overridden: marks the engine busy and begins every backward (two over one forward sum)",
    "load_checkpoint": "wrapped for plain DeepSpeed engines (deepspeed_patch): a Lins checkpoint is named, not misread",
    "load_universal_checkpoint": "called by that wrapper: whether the load reads a universal checkpoint",
    "zero_optimization_stage": "called by that wrapper: the ZeRO stage its message names",
}
# Read where they exist, set by LinsEngine: transformers' generate runs with synced_gpus for a module carrying it.
EXTERNAL_NAMES = {"transformers.distributed.fsdp.is_fsdp_managed_module": "_is_fsdp_managed_module",
                  "deepspeed.runtime.zero.partition_parameters.GatheredParameters": "ds_id, all_gather, partition",
                  "deepspeed.utils.safe_get_full_fp32_param": "_hp_mapping, get_full_hp_param"}
# Attributes DeepSpeedEngine.__init__ sets that LinsEngine reads or writes.
ENGINE_ATTRIBUTES = ("inside_no_sync_ctxt", "_global_grad_norm", "_config")
# Called after the optimizer is built where this DeepSpeed has them (0.19.6; removed in 0.19.8): the
# engine's step reads the attributes they set.
OPTIONAL_ENGINE_SETUP = {"_configure_compression_scheduler": "compression_scheduler",
                         "_configure_quantization": "quantizer"}
# The sharded optimizer derives from ZeROOptimizer; the engine's backward calls these on it.
OPTIMIZER_HOOKS = ("backward_prologue", "backward_epilogue", "enter_backward", "exit_backward")
# deepspeed.initialize builds its engine through this module-global name (integrations/deepspeed_patch.py).
MODULE_GLOBALS = ("DeepSpeedEngine", "initialize")


def _missing() -> list:
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    gone = [f"DeepSpeedEngine.{m}" for m in ENGINE_METHODS if not callable(getattr(DeepSpeedEngine, m, None))]
    gone += [f"ZeROOptimizer.{m}" for m in OPTIMIZER_HOOKS if not callable(getattr(ZeROOptimizer, m, None))]
    gone += [f"deepspeed.{g}" for g in MODULE_GLOBALS if not hasattr(deepspeed, g)]
    return gone


def check() -> None:
    """Raise ImportError naming what this DeepSpeed lacks (attributes are checked on the first engine)."""
    gone = _missing()
    if gone:
        raise ImportError(f"lins_ds needs {', '.join(gone)}, which deepspeed {deepspeed.__version__} lacks; "
                          f"lins_ds supports deepspeed{SUPPORTED} (pip install 'deepspeed{SUPPORTED}')")


def check_engine_attributes(engine) -> None:
    gone = [a for a in ENGINE_ATTRIBUTES if not hasattr(engine, a)]
    if gone:
        raise RuntimeError(f"lins_ds needs DeepSpeedEngine attributes {gone}, which deepspeed "
                           f"{deepspeed.__version__} does not set; lins_ds supports deepspeed{SUPPORTED}")


def finish_optimizer_setup(engine) -> None:
    """What DeepSpeedEngine._configure_optimizer does after building the optimizer, on this release."""
    for method, attribute in OPTIONAL_ENGINE_SETUP.items():
        if hasattr(engine, method):
            setattr(engine, attribute, getattr(engine, method)())


def clipping_note(engine) -> str:
    """The start-up summary's line when the config leaves ``gradient_clipping`` out: DeepSpeed then clips the global
    gradient norm at its default (1.0 in 0.19.x), so a loop compared with torch DDP without clipping leaves it from
    the second AdamW update. Lins follows DeepSpeed; the line says so."""
    given = getattr(engine._config, "_param_dict", None)  # the user's config as parsed (None: unknown, say nothing)
    clip = engine.gradient_clipping()
    if given is None or GRADIENT_CLIPPING in given or not clip:
        return ""
    return (f"\n  gradient clipping: global norm {clip:g}, DeepSpeed's default (\"gradient_clipping\" is not set; "
            "set it to 0 for none)")


def _visible_to_deepspeed(out) -> bool:
    """Whether DeepSpeed's forward found a tensor to hook in ``out``: it walks tensors, tuples, lists and dicts
    only (``deepspeed.runtime.utils.OutputBackwardHookManager``)."""
    if isinstance(out, torch.Tensor):
        return out.grad_fn is not None
    if isinstance(out, (tuple, list)):
        return any(_visible_to_deepspeed(v) for v in out)
    if isinstance(out, dict):
        return any(_visible_to_deepspeed(v) for v in out.values())
    return False


def hook_hidden_outputs(engine, out) -> None:
    """A forward that returns its loss inside another object (a ``SimpleNamespace``, a plain dataclass): DeepSpeed
    hooks none of it, so no backward would tell the optimizer it starts (``backward_prologue``) and no gradient
    would be averaged over the accumulation steps. The same hooks go on the tensors inside it."""
    if _visible_to_deepspeed(out):
        return
    hidden = [t for t in grad_tensors(out) if t.grad_fn is not None]
    if hidden:
        register_output_backward_hooks(hidden, preprocess_once_fn=engine._backward_prologue,
                                       preprocess_per_tensor_fn=engine._backward_prologue_per_tensor)
