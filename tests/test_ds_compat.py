"""The DeepSpeed internals LinsEngine relies on are listed in one place and present in this DeepSpeed."""

import pytest

deepspeed = pytest.importorskip("deepspeed")

from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402

from lins_ds.integrations import ds_compat  # noqa: E402
from lins_ds.integrations.engine import LinsEngine  # noqa: E402
from lins_ds.integrations.optimizer import LinsOptimizer  # noqa: E402


def test_every_engine_method_lins_overrides_is_listed():
    overridden = {name for name in vars(LinsEngine) if callable(getattr(DeepSpeedEngine, name, None))}
    overridden -= {"__init__", "forward", "step", "save_checkpoint", "load_checkpoint"}  # public API, kept stable
    assert overridden <= set(ds_compat.ENGINE_METHODS), overridden - set(ds_compat.ENGINE_METHODS)


def test_every_optimizer_hook_lins_overrides_is_listed():
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    overridden = {name for name in vars(LinsOptimizer) if callable(getattr(ZeROOptimizer, name, None))}
    overridden -= {"__init__", "step", "zero_grad", "state_dict", "load_state_dict"}  # torch's Optimizer API
    assert overridden <= set(ds_compat.OPTIMIZER_HOOKS), overridden - set(ds_compat.OPTIMIZER_HOOKS)


def test_the_installed_deepspeed_has_every_listed_name():
    ds_compat.check()
    for name in ds_compat.ENGINE_METHODS:
        assert callable(getattr(DeepSpeedEngine, name)), name


def test_a_missing_internal_is_one_clear_error_naming_the_version(monkeypatch):
    monkeypatch.setitem(ds_compat.ENGINE_METHODS, "_no_such_method", "for this test")
    with pytest.raises(ImportError) as e:
        ds_compat.check()
    msg = str(e.value)
    assert "DeepSpeedEngine._no_such_method" in msg and deepspeed.__version__ in msg
    assert ds_compat.SUPPORTED in msg


def test_the_supported_range_matches_setup_py():
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    setup = open(os.path.join(root, "setup.py")).read()
    assert re.search(r'"deepspeed' + re.escape(ds_compat.SUPPORTED) + '"', setup), ds_compat.SUPPORTED
    ci = open(os.path.join(root, ".ci", "run")).read()  # CI tests both ends of that range
    assert '"==0.19.6"' in ci and f'"{ds_compat.SUPPORTED}"' in ci
