"""One way a plan takes effect (issue 62, docs/design.md §14): start-up, a re-size for the training batches' length, a
tune candidate and a user's ``relayout`` all go through ``LinsRuntime.apply``, and each lands exactly where a fresh
start on the same plan stands: from the state at the switch (a checkpoint written just before it), the next 3 steps'
losses are identical (bit for bit), at 2 and 4 gloo ranks."""

import dataclasses

import pytest
import torch

import lins_ds  # noqa: F401  (routes deepspeed.initialize to LinsEngine)
from helpers import GPUS_PER_NODE, batch, config, micro_losses, param_groups, run, tiny_llama
from lins_ds.plan import Factor, Layout
from lins_ds.plan.offload import HOST, Placement
from lins_ds.runtime.runtime import runs_differently

pytest.importorskip("transformers")

AFTER = 3  # steps compared after the switch
BUDGET_GB = 0.0008  # the start-up plan (sized for the provisional 64 tokens) shards and checkpoints; the batches'
# 8 tokens re-size it to another layout without checkpointing, at 2 and at 4 ranks (a move, not only new predictions)


def _engine(lins: dict):
    import deepspeed

    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=config({"host_optimizer": "torch", **lins}))
    return engine


def _fixed(plan) -> dict:
    """The lins block of a fresh start on ``plan``: its layout, checkpointing, offload, tiling and activation offload
    fixed in the config."""
    lins = {"plan": {s: [f.intra, f.inter] for s, f in plan.layout.factors().items()},
            "activation_checkpointing": plan.activation_checkpointing_units}
    place = plan.placement
    if place.n_units:
        units = 1 + plan.num_layers  # the root unit and the layers
        lins["offload"] = {"os": "cpu", "os_fraction": place.n_units / units,
                           "g": "cpu" if place.offloads("g") else "gpu", "p": "cpu" if place.offloads("p") else "gpu"}
    if plan.mlp_tiles > 1 or plan.logits_tiles > 1:
        lins["tiling"] = {"mlp": plan.mlp_tiles, "logits": plan.logits_tiles}
    if plan.activation_offload_units:
        lins["activation_offload"] = plan.activation_offload_units
    return lins


def _switched(path: str, tmp: str) -> dict:
    """Train up to the switch ``path`` makes, write the state just before it, switch, train ``AFTER`` steps."""
    world = torch.distributed.get_world_size()
    if path == "start-up":  # the planner's first plan, applied as the runtime is built
        engine = _engine({"plan": "solve", "profile": "synthetic", "seq_len": 8, "gpu_memory_gb": BUDGET_GB,
                          "reserved_gb": 0})
        engine.save_checkpoint(tmp, tag="switch")
        first, moved = 0, True
    elif path == "re-size":  # the first training batch's length: the planner re-sizes and applies at its forward
        engine = _engine({"plan": "solve", "profile": "synthetic", "gpu_memory_gb": BUDGET_GB, "reserved_gb": 0})
        before = engine.lins.plan
        engine.save_checkpoint(tmp, tag="switch")
        first, moved = 0, None  # known after the first training forward
    elif path == "tune":  # the tuner's trials move between candidates; the winner is applied after its last
        engine = _engine({"plan": "tune", "profile": "synthetic", "seq_len": 8, "activation_checkpointing": False,
                          "tune": {"candidates": 2, "steps": 2, "max_steps": 2, "cache": False}})
        first = 0
        while engine.lins_tuner is not None:
            micro_losses(engine, first, 1)
            first += 1
        engine.save_checkpoint(tmp, tag="switch")  # the winner runs: a fresh start on it must go on identically
        moved = len(engine.lins_tune_report or []) >= 2
    else:  # a user's relayout onto another layout, offload, checkpointing, sequence tiling and activation offload
        engine = _engine({"plan": {"p": [1, 1], "g": [1, 1], "os": [1, 1]}})
        micro_losses(engine, 0, 1)
        engine.save_checkpoint(tmp, tag="switch")
        sharded = Factor(2, 1) if world == 2 else Factor(2, 2)
        target = dataclasses.replace(engine.lins.plan, layout=Layout(Factor(1, 1), sharded, sharded),
                                     activation_checkpointing_units=1, placement=Placement.of(2, g=HOST),
                                     mlp_tiles=2, logits_tiles=3, activation_offload_units=1)
        engine.relayout(target)
        first, moved = 1, True
    if path == "re-size":
        losses = micro_losses(engine, first, AFTER)
        moved = runs_differently(engine.lins.plan, before)
    else:
        losses = micro_losses(engine, first, AFTER)
    plan = engine.lins.plan
    engine.destroy()
    return {"plan": plan, "first": first, "losses": losses, "moved": moved}


def _fresh(plan, first: int, tmp: str) -> dict:
    """A fresh engine with ``plan`` fixed in its config, the state at the switch loaded, ``AFTER`` steps."""
    engine = _engine(_fixed(plan))
    same = not runs_differently(engine.lins.plan, plan)
    engine.load_checkpoint(tmp, tag="switch")
    losses = micro_losses(engine, first, AFTER)
    engine.destroy()
    return {"same_plan": same, "losses": losses}


def _both(path: str, tmp: str) -> tuple:
    switched = _switched(path, f"{tmp}/{path}")
    fresh = _fresh(switched["plan"], switched["first"], f"{tmp}/{path}")
    return switched, fresh


PATHS = ("start-up", "re-size", "tune", "relayout")


def _all_paths(tmp: str) -> list:
    return [(path, *_both(path, tmp)) for path in PATHS]


@pytest.mark.parametrize("world", [2, 4])
def test_every_switch_lands_where_a_fresh_start_on_its_plan_stands(world, tmp_path):
    results = run(_all_paths, world, str(tmp_path), gpus_per_node=GPUS_PER_NODE)
    for rank_results in results:
        for path, switched, fresh in rank_results:
            assert switched["moved"], (path, "the switch must run a plan other than the one before it")
            assert fresh["same_plan"], (path, switched["plan"])
            assert switched["losses"] == fresh["losses"], (path, switched["losses"], fresh["losses"])


def _inside_a_window(tmp: str) -> tuple:
    engine = _engine({"plan": {"p": [1, 1], "g": [1, 1], "os": [1, 1]}})
    x = batch(0, 0, torch.distributed.get_rank(), 96)
    engine.backward(engine(input_ids=x, labels=x).loss)  # one backward of a window of GAS
    target = dataclasses.replace(engine.lins.plan, layout=Layout(Factor(1, 1), Factor(1, 1), Factor(2, 1)))
    try:
        engine.relayout(target)
        raised = ""
    except Exception as e:  # noqa: BLE001 - the type is asserted
        raised = f"{type(e).__name__}: {e}"
    kept = engine.lins.plan.layout
    engine.step()  # the window goes on, on the plan it had
    engine.destroy()
    return raised, str(kept)


def test_apply_refuses_inside_an_accumulation_window_before_any_collective(tmp_path):
    for raised, kept in run(_inside_a_window, 2, str(tmp_path), gpus_per_node=2):
        assert raised.startswith("RelayoutError: relayout: only at an accumulation boundary") and "no step has applied" in raised
        assert kept == "P=1x1 G=1x1 OS=1x1"
