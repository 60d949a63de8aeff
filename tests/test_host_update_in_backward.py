"""Host updates inside the window's last backward (issue 59; docs/design.md §13): with ``gradient_clipping: 0`` the
step's coefficient is known before the backward, so each offloaded unit's host update starts as its gradient becomes
final. It must train exactly as the update after ``step()`` does, on every placement that allows it, and everything a
user could do between that backward and ``step()`` that would see (or change) the early update is refused, naming
the way out."""

import pytest
import torch

import lins_ds  # noqa: F401  (routes deepspeed.initialize to LinsEngine)
from helpers import GAS, GPUS_PER_NODE, STEPS, WORLD, batch, config, max_err, param_groups, run, state, tiny_llama, train

pytest.importorskip("transformers")

ALL_SHARDED = {"p": [2, 2], "g": [2, 2], "os": [2, 2]}  # s_os == s_p, G sharded over every rank: final as reduced
SHARDED_ONE_NODE = {"p": [2, 1], "g": [2, 1], "os": [2, 1]}  # the same on two ranks of one node
REPLICATED = {"p": [1, 1], "g": [1, 1], "os": [1, 1]}  # a replica AllReduce follows each reduction: not final then
PLACEMENTS = [{"os": "cpu", "g": "cpu"}, {"os": "cpu", "os_fraction": 0.5, "g": "cpu"}, {"os": "cpu", "g": "gpu"},
              {"os": "cpu", "g": "cpu", "p": "cpu"}]


def count_ahead_starts() -> list:
    """Patch this rank's HostUpdater to count the updates started inside a backward; the list it appends to."""
    from lins_ds.runtime.step.host_updater import HostUpdater

    starts, real = [], HostUpdater.start_ahead

    def counted(self, coef):
        starts.append(coef)
        real(self, coef)

    HostUpdater.start_ahead = counted
    return starts


def engine_for(plan, offload, ahead="auto", clip=0.0):
    """An engine over the tiny LLaMA with ``plan`` and ``offload``, AdamW, ``gradient_clipping`` ``clip``."""
    import deepspeed

    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)), config=config(
        {"plan": plan, "offload": offload, "host_optimizer": "torch", "host_update_in_backward": ahead},
        gradient_clipping=clip))
    return engine


def trajectories(cases):
    starts = count_ahead_starts()
    out = []
    for plan, offload, ahead, clip in cases:
        engine = engine_for(plan, offload, ahead, clip)
        before = len(starts)
        states = train(engine, after_step=state)
        out.append((states, len(starts) - before, engine.lins.plan.host_update_in_backward))
        engine.destroy()
    return out


def test_updates_begun_inside_the_last_backward_train_exactly_as_after_the_step():
    cases = [(ALL_SHARDED, o, a, 0.0) for o in PLACEMENTS for a in ("auto", False)]
    for rank_results in run(trajectories, WORLD, cases, gpus_per_node=GPUS_PER_NODE):
        for i in range(0, len(cases), 2):
            (early, n_early, planned), (late, n_late, planned_late) = rank_results[i], rank_results[i + 1]
            name = cases[i][1]
            assert planned and not planned_late, name
            assert n_early == STEPS and n_late == 0, (name, n_early, n_late)  # one per window: the early path ran
            for step, (a, b) in enumerate(zip(early, late)):
                assert max_err(a, b) == 0.0, (name, step, max_err(a, b))
            assert max_err(early[-1], early[0]) > 1e-4, name


def test_clipping_or_a_replica_allreduce_keeps_the_update_after_the_step():
    cases = [(ALL_SHARDED, PLACEMENTS[0], "auto", 1.0), (REPLICATED, {"os": "cpu"}, "auto", 0.0)]
    for rank_results in run(trajectories, WORLD, cases, gpus_per_node=GPUS_PER_NODE):
        for (states, n, planned), case in zip(rank_results, cases):
            assert not planned and n == 0, case
            assert len(states) == STEPS


def between_backward_and_step(what):
    """One window, then ``what`` between its last backward and the step; the error each rank raised (None)."""
    import deepspeed

    engine = engine_for(SHARDED_ONE_NODE, PLACEMENTS[0], "auto" if what != "allowed read" else False)
    rank, p = torch.distributed.get_rank(), next(engine.module.parameters())
    for micro in range(GAS):
        x = batch(0, micro, rank, 96)
        engine.backward(engine(input_ids=x, labels=x).loss)
        if micro < GAS - 1:
            engine.step()
    error = None
    try:
        if what in ("read", "allowed read"):
            deepspeed.utils.safe_get_full_fp32_param(p)
        elif what == "zero_grad":
            engine.zero_grad()
        elif what == "forward":
            engine(input_ids=x, labels=x)
        elif what == "save":
            engine.save_checkpoint("/nonexistent-lins-test")
        elif what == "lr":
            engine.optimizer.param_groups[0]["lr"] *= 0.5
        deepspeed.utils.safe_get_full_grad(p)  # the gradient is readable: the update does not change it
        engine.step()
    except RuntimeError as e:
        error = str(e)
    if what not in ("lr", "allowed read"):  # the step goes on after a refusal: the updates are this step's
        engine.step()
    engine.destroy()
    return error


@pytest.mark.parametrize("what", ["read", "zero_grad", "forward", "save", "lr", "allowed read"])
def test_what_would_see_the_early_update_is_refused_naming_the_way_out(what):
    for error in run(between_backward_and_step, 2, what, gpus_per_node=2):
        if what == "allowed read":
            assert error is None
        elif what == "lr":
            assert error is not None and "param_groups[0]['lr'] changed" in error, error
            assert "host_update_in_backward" in error
        else:
            assert error is not None and "engine.step() first" in error, error
            assert '"host_update_in_backward": false' in error


def bad_ahead(value, clip):
    from lins_ds.runtime.errors import LinsConfigError

    try:
        engine_for(SHARDED_ONE_NODE, PLACEMENTS[0], value, clip)
    except LinsConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("value,clip,words", [("yes", 0.0, "lins.host_update_in_backward: 'yes'"),
                                              (True, 1.0, "gradient_clipping")])
def test_bad_values_are_named_on_every_rank(value, clip, words):
    for error in run(bad_ahead, 2, value, clip, gpus_per_node=2):
        assert error is not None and words in error, error
