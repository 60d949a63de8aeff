"""Sequence tiling as a planned dimension (issue 60, docs/design.md §8): ``lins.tiling`` fixed trains as untiled (the
plan carries the tile counts and ``apply`` installs them), ``"auto"`` tiles nothing that fits untiled, and a model the
tiling cannot take is refused on every rank, naming the key, before any collective."""

import pytest
import torch

import lins_ds  # noqa: F401  (routes deepspeed.initialize to LinsEngine)
from helpers import config, micro_losses, param_groups, run, tiny_gpt2, tiny_llama

pytest.importorskip("transformers")

OS_SHARDED = {"p": [1, 1], "g": [1, 1], "os": [2, 1]}


def _losses(lins: dict, steps: int = 3) -> tuple:
    import deepspeed

    from lins_ds.runtime.step.tiling import tiling_of

    torch.manual_seed(0)
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=config({"host_optimizer": "torch", **lins}))
    losses = micro_losses(engine, 0, steps)
    plan, installed = engine.lins.plan, tiling_of(engine.module)
    engine.destroy()
    return losses, (plan.mlp_tiles, plan.logits_tiles), None if installed is None else (installed.mlp_tiles,
                                                                                         installed.logits_tiles)


def _tiled_and_not() -> tuple:
    return (_losses({"plan": OS_SHARDED, "tiling": {"mlp": 2, "logits": 3}}), _losses({"plan": OS_SHARDED}),
            _losses({"plan": "solve", "profile": "synthetic", "seq_len": 8}))


def test_a_fixed_tiling_trains_as_untiled_and_auto_tiles_nothing_that_fits(tmp_path):
    for tiled, plain, solved in run(_tiled_and_not, 2, gpus_per_node=2):
        assert tiled[1] == (2, 3) and tiled[2] == (2, 3), tiled[1:]
        assert plain[1] == (1, 1) and plain[2] is None and solved[1] == (1, 1) and solved[2] is None
        assert max(abs(a - b) for a, b in zip(tiled[0], plain[0])) <= 1e-5, (tiled[0], plain[0])


def _refused() -> str:
    import deepspeed

    model = tiny_gpt2()
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                             config=config({"plan": OS_SHARDED, "tiling": {"mlp": 2, "logits": 2}}))
    except Exception as e:  # noqa: BLE001 - the type and message are asserted
        return f"{type(e).__name__}: {e}"
    return ""


def test_a_model_the_tiling_cannot_take_is_refused_on_every_rank_naming_the_key():
    for raised in run(_refused, 2, gpus_per_node=2):
        assert raised.startswith("LinsConfigError: lins.tiling: 2 MLP and 2 logits tiles") and "GPT2LMHeadModel" in raised


def test_the_memory_model_takes_the_tiled_tensors_out_and_the_step_pays_their_recompute():
    from lins_ds.plan import load_model, sequence
    from lins_ds.plan.memory import TILED_HIDDEN_COPIES, TILED_LOSS_BYTES, formula_activations, mlp_bytes, tiled_activations
    from lins_ds.plan.spec import TrainingSpec

    model = load_model("llama-1b")
    train = TrainingSpec(4096, 1)
    acts = formula_activations(model, train)
    tiled = tiled_activations(acts, model, sequence.tiled(train, 4, 8))
    mlp = mlp_bytes(model, train)
    assert tiled.layer_saved == pytest.approx(acts.layer_saved - mlp)
    assert tiled.layer_transient == pytest.approx(acts.layer_transient - mlp * 3 / 4)
    # the head: what grows with the final hidden states, one tile of logits, the lm_head gradient the tiles sum
    assert tiled.head_peak == pytest.approx(TILED_HIDDEN_COPIES * 4096 * model.hidden * 2 + 512 * model.vocab * TILED_LOSS_BYTES
                                            + model.vocab * model.hidden * 2)
    long = TrainingSpec(65536, 1)  # where tiling is planned, the head is a fraction of the untiled one
    assert tiled_activations(formula_activations(model, long), model, sequence.tiled(long, 1, 8)).head_peak < \
        formula_activations(model, long).head_peak / 3
    assert tiled_activations(acts, model, train) is acts  # untiled: untouched
    flops = sequence.extra_flops(model, sequence.tiled(train, 4, 8))
    assert flops == pytest.approx(4096 * (model.num_layers * 2 * 3 * model.hidden * model.intermediate
                                          + 2 * model.vocab * model.hidden))


def test_auto_offers_the_ladder_only_to_a_model_it_can_tile():
    from lins_ds.plan import sequence

    assert sequence.rungs("auto", True) == [(*t, False) for t in sequence.LADDER] and sequence.LADDER[0] == (1, 1)
    assert sequence.rungs("auto", False) == [(1, 1, False)] == sequence.rungs(False, True)
    assert sequence.rungs((2, 4), True) == [(2, 4, False)]


def test_the_head_tiling_note_only_where_it_saves_host_units_and_time():
    from types import SimpleNamespace as NS

    from lins_ds.plan import sequence
    from lins_ds.plan.offload import Placement

    note = sequence.head_tiling_note(1.2997, 23, 0.9988, 14)
    assert "14 units' optimizer state would be on the host instead of 23" in note
    assert "998.8 ms instead of 1299.7" in note
    assert sequence.head_tiling_note(1.3, 23, 1.4, 14) == ""  # slower (the tiles' recompute outweighs the host)
    assert sequence.head_tiling_note(1.3, 23, 1.2, 23) == "" and sequence.head_tiling_note(1.3, 23, None, 0) == ""
    plan = NS(mlp_tiles=1, logits_tiles=1, activation_offload_units=0)
    best = NS(objective="step", objective_s=1.3, placement=Placement.of(23))
    other = NS(objective="step", objective_s=1.0, placement=Placement.of(14))

    def never():
        raise AssertionError("priced where it should not be")

    assert "8 tiles" in sequence.head_tiling("auto", True, plan, best, lambda: other, (ValueError,))
    # the user's setting, either way; a model that cannot be tiled
    for choice, supported in (((1, 1), True), (False, True), ("auto", False)):
        assert sequence.head_tiling(choice, supported, plan, best, never, (ValueError,)) == ""
    resident = NS(objective="step", objective_s=1.3, placement=Placement.of(0))
    assert sequence.head_tiling("auto", True, plan, resident, never, (ValueError,)) == ""
    assert sequence.head_tiling("auto", True, NS(mlp_tiles=1, logits_tiles=8, activation_offload_units=0), best, never,
                                (ValueError,)) == ""

    def no_fit():
        raise ValueError("no tiled plan fits")

    assert sequence.head_tiling("auto", True, plan, best, no_fit, (ValueError,)) == ""
