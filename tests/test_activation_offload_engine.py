"""Activation offload through the engine (issue 60, docs/design.md §8): ``lins.activation_offload`` fixed trains
exactly as without (the plan carries the count, ``apply`` installs it, the inputs really go to the host), "auto" offloads
nothing that fits without, and a bad value is refused on every rank, naming the key, before any collective."""

import pytest
import torch

import lins_ds  # noqa: F401  (routes deepspeed.initialize to LinsEngine)
from helpers import config, micro_losses, param_groups, run, tiny_llama

pytest.importorskip("transformers")

OS_SHARDED = {"p": [1, 1], "g": [1, 1], "os": [2, 1]}


def _losses(lins: dict, steps: int = 3) -> tuple:
    import deepspeed

    torch.manual_seed(0)
    model = tiny_llama(layers=4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=config({"host_optimizer": "torch", **lins}))
    losses = micro_losses(engine, 0, steps)
    stats = engine.lins.activation_offload_stats()
    plan = engine.lins.plan
    engine.destroy()
    return losses, plan.activation_offload_units, plan.activation_checkpointing_units, stats


def _offloaded_and_not() -> tuple:
    fixed = {"plan": OS_SHARDED, "activation_checkpointing": True}
    return (_losses({**fixed, "activation_offload": 3}), _losses(fixed),
            _losses({"plan": "solve", "profile": "synthetic", "seq_len": 8}))


def test_a_fixed_activation_offload_trains_exactly_as_without_and_auto_offloads_nothing_that_fits():
    for offloaded, plain, solved in run(_offloaded_and_not, 2, gpus_per_node=2):
        assert offloaded[1:3] == (3, 4) and offloaded[3].offloaded > 0, offloaded[1:]
        assert (offloaded[3].prefetched, offloaded[3].on_demand) == (offloaded[3].offloaded, 0)  # all came up ahead
        assert plain[1] == 0 and plain[3] is None and solved[1] == 0 and solved[3] is None
        assert offloaded[0] == plain[0]  # the same bytes back: bit-identical losses


def _refused(value) -> str:
    import deepspeed

    model = tiny_llama()
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                             config=config({"plan": OS_SHARDED, "activation_offload": value}))
    except Exception as e:  # noqa: BLE001 - the type and message are asserted
        return f"{type(e).__name__}: {e}"
    return ""


@pytest.mark.parametrize("value", [-1, "yes", True, 1.5])
def test_a_bad_value_is_refused_on_every_rank_naming_the_key(value):
    for message in run(_refused, 2, value, gpus_per_node=2):
        assert message.startswith("LinsConfigError: lins.activation_offload: "), message
        assert "a number of checkpointed layer units" in message
