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


def slow_host_step(delay_s=0.02) -> None:
    """This rank's host optimizer steps ``delay_s`` late, its master's gradient already set: the device units' update
    (``step()``) then runs while host updates begun in the backward are still in flight, as on a GPU."""
    import time

    from lins_ds.runtime.step.host_optimizer import HostOptimizer

    real = HostOptimizer.step
    HostOptimizer.step = lambda self, *a: (time.sleep(delay_s), real(self, *a))[1]


def trajectories(cases):
    slow_host_step()
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


P_SYNCED = {"p": [1, 1], "g": [2, 1], "os": [2, 1]}  # s_p < s_os: a P-sync collective follows every update


def between_backward_and_step(what):
    """One window, then ``what`` between its last backward and the step; the error each rank raised (None)."""
    import deepspeed

    plan = P_SYNCED if what == "destroy" else SHARDED_ONE_NODE
    engine = engine_for(plan, PLACEMENTS[0], "auto" if what != "allowed read" else False)
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
        elif what == "set grad":
            deepspeed.utils.safe_set_full_grad(p, torch.zeros_like(deepspeed.utils.safe_get_full_grad(p)))
        elif what == "destroy":  # a script that stops there (its atexit too): no unit left waiting on a P-sync
            engine.destroy()
            return None
        deepspeed.utils.safe_get_full_grad(p)  # the gradient is readable: the update does not change it
        engine.step()
    except RuntimeError as e:
        error = str(e)
    if what not in ("lr", "allowed read"):  # the step goes on after a refusal: the updates are this step's
        engine.step()
    engine.destroy()
    return error


@pytest.mark.parametrize("what", ["read", "zero_grad", "forward", "save", "lr", "set grad", "destroy", "allowed read"])
def test_what_would_see_the_early_update_is_refused_naming_the_way_out(what):
    for error in run(between_backward_and_step, 2, what, gpus_per_node=2):
        if what in ("allowed read", "destroy"):
            assert error is None
        elif what == "lr":
            assert error is not None and "param_groups[0]['lr'] changed" in error, error
            assert "host_update_in_backward" in error and "load a checkpoint" in error
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


def skipping_the_last_layers(ahead):
    """Three layers, the last two skipped by every forward of the second window (LayerDrop): their units, unused,
    still hold the first window's update when the second's last backward begins (a slow host: a prefetch finds it
    still running and leaves it)."""
    import time

    import deepspeed

    from lins_ds.runtime.step.host_updater import HostUpdater

    real = HostUpdater._update
    HostUpdater._update = lambda self, *a: (time.sleep(0.05), real(self, *a))[1]
    skip = {"on": False}
    model = tiny_llama(layers=3)

    class Skipping(torch.nn.ModuleList):
        def __getitem__(self, idx):
            return list(self)[:1][idx] if isinstance(idx, slice) and skip["on"] else super().__getitem__(idx)

    model.model.layers.__class__ = Skipping
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)), config=config(
        {"plan": SHARDED_ONE_NODE, "offload": PLACEMENTS[0], "host_optimizer": "torch",
         "host_update_in_backward": ahead}, gradient_clipping=0.0))
    rank = torch.distributed.get_rank()
    for step in range(3):  # no read between the steps: a state_dict() would finish the units' updates itself
        skip["on"] = step == 1
        for micro in range(GAS):
            x = batch(step, micro, rank, 96)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
    out = state(engine)
    engine.destroy()
    return out


def test_units_a_window_skips_train_as_after_the_step():
    for early, late in zip(run(skipping_the_last_layers, 2, "auto", gpus_per_node=2),
                           run(skipping_the_last_layers, 2, False, gpus_per_node=2)):
        assert max_err(early, late) == 0.0, max_err(early, late)


def broken_backward_then_load(tmp):
    """A last backward that raises midway (an OOM): the step refuses (some units took the update, some did not),
    and a checkpoint load brings training back."""
    engine = engine_for(SHARDED_ONE_NODE, {"os": "cpu", "g": "gpu"})
    rank, boom = torch.distributed.get_rank(), {"on": False}

    def hook(grad):
        if boom["on"]:
            boom["on"] = False
            raise RuntimeError("boom (an OOM midway through the backward)")
        return grad

    first = engine.module.model.layers[0]
    first.register_forward_hook(lambda m, a, o: (o[0] if isinstance(o, tuple) else o).register_hook(hook) and None)
    train(engine, steps=1)
    engine.save_checkpoint(tmp, tag="one")
    saved = state(engine)
    messages = []
    for micro in range(GAS):
        x = batch(1, micro, rank, 96)
        loss = engine(input_ids=x, labels=x).loss
        boom["on"] = micro == GAS - 1
        try:
            engine.backward(loss)
        except RuntimeError as e:
            messages.append(str(e))
        if micro < GAS - 1:
            engine.step()
    try:
        engine.step()
    except RuntimeError as e:
        messages.append(str(e))
    engine.load_checkpoint(tmp, tag="one")
    loaded = state(engine)
    train(engine, steps=1)  # and on: no worker left waiting, no unit left updating
    engine.destroy()
    return messages, max_err(loaded, saved)


def test_a_last_backward_that_breaks_off_is_refused_at_the_step_and_a_load_goes_on(tmp_path):
    for messages, err in run(broken_backward_then_load, 2, str(tmp_path), gpus_per_node=2, timeout=300):
        assert len(messages) == 2 and "boom" in messages[0], messages
        assert "broke off" in messages[1] and "load a checkpoint" in messages[1], messages
        assert err == 0.0
