"""The planner's price of host updates that start inside the window's last backward (``gradient_clipping: 0``, no
fp16 loss scaling: ``TrainingSpec.host_update_in_backward``; docs/design.md §13): the same numbers as before without
the flag, a hand-worked schedule with it, the solver and ``lins-ds plan`` passing it through. Pure Python."""

from dataclasses import replace

import pytest

from lins_ds.cli import main
from lins_ds.plan import ComputeSpec, MemorySpec, Topology, TrainingSpec, candidates, cost, get_cluster, load_model
from lins_ds.plan.offload import (HOST, HostSpec, OffloadSpec, Placement, exposed_seconds, gradient_final_seconds,
                                  hides_behind_forward, updates_in_backward)
from lins_ds.plan.solver import Plan, compute_seconds, evaluate, solve

TRAIN = TrainingSpec(2048, 1, 2)
IN_BACKWARD = replace(TRAIN, host_update_in_backward=True)
MODEL = load_model("llama-7b")
ONE = Topology(1, 1)
TABLE = get_cluster("a800-ib").table(cost.required_meshes(ONE, candidates(ONE)))
SLOW_HOST = HostSpec(capacity_gb=1000, update_elems_per_s=0.5e9)  # host updates outlast the forward

# the hand-worked case: a root of 2 G parameters and layers of 1, 2 and 1 G (4 G of layers)
UNITS = [2e9, 1e9, 2e9, 1e9]
# the host's sums and norms of the gradients (G on the host) as good as free: the schedule alone
QUARTER = HostSpec(capacity_gb=1000, update_elems_per_s=0.25e9, h2d_gbs=2.0, accumulate_elems_per_s=1e24,
                   norm_elems_per_s=1e24)


def _layout(p: int, g: int, os: int):
    return next(lay for lay in candidates(Topology(1, max(p, g, os)))
                if (lay.p.size, lay.g.size, lay.os.size) == (p, g, os))


def _model_case():
    """llama-7b on one GPU with a third of its units' OS on the slow host: (args, forward, backward, behind)."""
    (layout,) = candidates(ONE)
    fwd, bwd = compute_seconds(MODEL, TRAIN, ComputeSpec(), 0)
    units = MODEL.unit_params()
    return (units, Placement.of(len(units) // 3), layout), fwd, bwd, TRAIN.grad_accum * (fwd + bwd) - fwd


def test_flag_off_is_todays_price_exactly():
    """Without the flag the backward changes the price only where G is on the host: the updates after the step wait
    for the host's last sums and norms where those outlast the last backward."""
    (units, placement, layout), fwd, bwd, behind = _model_case()
    for p in (placement, Placement.of(placement.n_units, HOST, HOST), Placement.of(len(units))):
        before = exposed_seconds(units, p, layout, TRAIN, SLOW_HOST, fwd, behind)
        assert exposed_seconds(units, p, layout, IN_BACKWARD, SLOW_HOST, fwd, behind, backward_s=0.0) == before
        known = exposed_seconds(units, p, layout, TRAIN, SLOW_HOST, fwd, behind, backward_s=bwd)
        assert known == before if not p.offloads("g") else known > before


def test_updates_in_backward_hide_more_where_they_outlast_the_forward():
    (units, placement, layout), fwd, bwd, behind = _model_case()
    off = exposed_seconds(units, placement, layout, TRAIN, SLOW_HOST, fwd, behind, backward_s=bwd)
    on = exposed_seconds(units, placement, layout, IN_BACKWARD, SLOW_HOST, fwd, behind, backward_s=bwd)
    assert off > 0 and on < off  # the update outlasts the forward: the backward hides part of it
    fast = HostSpec(capacity_gb=1000, update_elems_per_s=1e12, h2d_gbs=1e6, d2h_gbs=1e6)
    for train in (TRAIN, IN_BACKWARD):  # what the forward hides alone stays hidden
        hidden = exposed_seconds(units, placement, layout, train, fast, fwd, behind, backward_s=bwd)
        assert hidden == pytest.approx(0.0, abs=1e-12)


def test_gradients_final_last_layer_first_and_the_root_at_the_end():
    assert gradient_final_seconds(UNITS, 8.0) == [8.0, 8.0, 6.0, 2.0]
    assert gradient_final_seconds([5.0], 3.0) == [3.0]  # a root alone: final when the backward ends


def test_hand_worked_schedule_behind_the_forward():
    """G and P on the host (nothing comes down or goes up at the step): unit 2 updates in 8 s, unit 3 in 4 s.
    Backward 8 s: unit 3's gradient final at 2, unit 2's at 6; the worker: unit 3 in [2, 6], unit 2 in [6, 14].
    Forward 6 s (1 s per G parameters) from 8: root and unit 1 to 11, unit 2 waits to 14 and ends 16, unit 3
    ends 17; 17 - (8 + 6) = 3 s exposed. Without the flag: updates from the forward's start, done at 8 and 12;
    forward 3, 8 -> 10, 12 -> 13; 13 - 6 = 7 s."""
    layout = _layout(1, 1, 1)
    assert hides_behind_forward(layout)
    place = Placement.of(2, HOST, HOST, HOST)
    no_behind = 1e9  # the host's gradient sums and the uploads hide behind the window's compute

    def exposed(train, behind=no_behind):
        return exposed_seconds(UNITS, place, layout, train, QUARTER, 6.0, behind, backward_s=8.0)

    assert exposed(IN_BACKWARD) == pytest.approx(3.0, abs=1e-9)
    assert exposed(TRAIN) == pytest.approx(7.0, abs=1e-9)
    # the terms beside the updates (here the uploads beyond the compute: 2 x 2 micro-batches x 3 G x 2 bytes at 2
    # GB/s) are added unchanged
    assert exposed(IN_BACKWARD, 0.0) - exposed(IN_BACKWARD) == pytest.approx(12.0)
    assert exposed(TRAIN, 0.0) - exposed(TRAIN) == pytest.approx(12.0)


def test_updates_inside_the_backward_are_priced_at_the_rate_kept_for_that_mode():
    """A host whose runs kept a slower rate for updates inside the last backward (``profiler.host_rate``) prices
    those plans at it, the others at its after-step rate: at 0.125 G/s unit 3 in [2, 10], unit 2 in [10, 26]; the
    forward from 8: unit 2 waits to 26, ends 28, unit 3 ends 29: 29 - 14 = 15 s. After the step: 7 s, as before."""
    layout = _layout(1, 1, 1)
    place = Placement.of(2, HOST, HOST, HOST)
    kept = replace(QUARTER, in_backward_update_elems_per_s=0.125e9)
    assert exposed_seconds(UNITS, place, layout, IN_BACKWARD, kept, 6.0, 1e9, backward_s=8.0) == pytest.approx(15.0)
    assert exposed_seconds(UNITS, place, layout, TRAIN, kept, 6.0, 1e9, backward_s=8.0) == pytest.approx(7.0)


def test_the_step_waits_for_the_hosts_last_sums_and_norms_in_both_modes():
    """The step's gradient norm waits for the host's last sums and norms (G on the host), so nothing after the
    backward hides them: updates as good as free, the host adding and norming 1 G elements/s, unit 3's in [2, 4],
    unit 2's in [6, 10]: 2 s past the backward's end, exposed with the updates inside the backward or after it (the
    resident units' forward does not hide it: it starts after the norm)."""
    layout = _layout(1, 1, 1)
    place = Placement.of(2, HOST, HOST, HOST)
    free = replace(QUARTER, update_elems_per_s=1e24, accumulate_elems_per_s=1e9, norm_elems_per_s=1e9)
    for train in (TRAIN, IN_BACKWARD):
        assert exposed_seconds(UNITS, place, layout, train, free, 6.0, 1e9, backward_s=8.0) == pytest.approx(2.0)


def test_hand_worked_schedule_with_the_hosts_last_sum_and_norm_before_each_update():
    """As above, with the host adding and norming 1 G elements/s: a unit's update follows its last micro-batch's sum
    and its norm (2 s per G elements), on the same cores and memory. Inside the backward: unit 3 in [2, 8] (6 s),
    unit 2 in [8, 20] (12 s); forward from 8: root and unit 1 to 11, unit 2 waits to 20 and ends 22, unit 3 ends
    23: 23 - 14 = 9 s. After the step: the host sums and norms unit 3 in [2, 4] and unit 2 in [6, 10], 2 s past the
    backward's end, then updates as before (7 s): 9 s. The window's first micro-batch came down into the
    accumulators: no earlier sum to hide, so without compute beside them only the uploads (12 s) add."""
    layout = _layout(1, 1, 1)
    place = Placement.of(2, HOST, HOST, HOST)
    sums = replace(QUARTER, accumulate_elems_per_s=1e9, norm_elems_per_s=1e9)

    def exposed(train, behind=1e9):
        return exposed_seconds(UNITS, place, layout, train, sums, 6.0, behind, backward_s=8.0)

    assert exposed(IN_BACKWARD) == pytest.approx(9.0, abs=1e-9)
    assert exposed(TRAIN) == pytest.approx(9.0, abs=1e-9)
    assert exposed(IN_BACKWARD, 0.0) == pytest.approx(9.0 + 12.0)
    assert exposed(TRAIN, 0.0) == pytest.approx(9.0 + 12.0)
    three = replace(TRAIN, grad_accum=3)  # one earlier sum (3 G elements, 3 s) beside the compute, or not
    assert exposed(three) == pytest.approx(9.0) and exposed(three, 0.0) == pytest.approx(9.0 + 3.0 + 2 * 18.0 / 2)


def test_hand_worked_schedule_with_a_p_sync_after_each_update():
    """s_p = 1 < s_os = 2 (a P-sync follows every update, in step()): the step waits for the last upload.
    Per unit: half its parameters updated at 0.25 G/s (2 s per G parameters) and uploaded at 2 GB/s in bf16 (0.5 s
    per G parameters, on a copy lane beside the next update; G on the host). Worker: unit 3 in [2, 4], up to 4.5;
    unit 2 in [6, 10], up to 11; 11 - 8 = 3 s. Without the flag, after the backward: unit 2 in [0, 4], up to 5, unit
    3 in [4, 6], up to 6.5: 6.5 s."""
    layout = _layout(1, 2, 2)
    assert not hides_behind_forward(layout)
    place = Placement.of(2, HOST, HOST)

    def exposed(train):
        return exposed_seconds(UNITS, place, layout, train, QUARTER, 6.0, 1e9, backward_s=8.0)

    assert exposed(IN_BACKWARD) == pytest.approx(3.0, abs=1e-9)
    assert exposed(TRAIN) == pytest.approx(6.5, abs=1e-9)


def test_solver_prices_the_updates_in_the_backward():
    (layout,) = candidates(ONE)
    mem, spec = MemorySpec(80), OffloadSpec("auto", host=SLOW_HOST)
    units = len(MODEL.unit_params())

    def ev(train):
        return evaluate(ONE, layout, 0, MODEL, train, mem, TABLE, ComputeSpec(), placement=Placement.of(units // 2),
                        offload=spec)

    before, after = ev(TRAIN), ev(IN_BACKWARD)
    assert 0 <= after.offload_s < before.offload_s
    old, new = (solve(MODEL, ONE, train, mem, TABLE, offload=spec) for train in (TRAIN, IN_BACKWARD))
    assert old.best.placement.n_units > 0 and new.best.offload_s < old.best.offload_s
    assert new.plan.host_update_in_backward and not old.plan.host_update_in_backward
    assert Plan.from_json(new.plan.to_json()) == new.plan and new.plan.to_json()["host_update_in_backward"] is True
    assert "host_update_in_backward" not in old.plan.to_json()  # the JSON and digest of every other plan as before
    resident = solve(MODEL, ONE, IN_BACKWARD, MemorySpec(1000), TABLE, offload=spec).plan
    assert resident.placement.n_units == 0 and not resident.host_update_in_backward  # nothing to start early


def test_a_replica_allreduce_keeps_the_updates_after_the_backward():
    """s_g = 1 on 2 ranks: a unit's gradient is final only when its replica AllReduce ends with the window, so the
    runtime starts no update inside the backward and the price is the one after it."""
    two = Topology(1, 2)
    table = get_cluster("a800-ib").table(cost.required_meshes(two, candidates(two)))
    spec, units = OffloadSpec("auto", host=SLOW_HOST), len(MODEL.unit_params())
    for layout, early in ((_layout(1, 1, 2), False), (_layout(2, 2, 2), True)):
        assert updates_in_backward(IN_BACKWARD, layout, 2, Placement.of(units // 2)) is early
        old, new = (evaluate(two, layout, 0, MODEL, train, MemorySpec(80), table, ComputeSpec(),
                             placement=Placement.of(units // 2), offload=spec) for train in (TRAIN, IN_BACKWARD))
        assert (new.offload_s < old.offload_s) if early else (new.offload_s == old.offload_s)


CLI = ["plan", "--model", "llama-7b", "--nodes", "1", "--gpus-per-node", "1", "--seq-len", "2048",
       "--micro-batch-size", "1", "--gpu-memory-gb", "80", "--host-memory-gb", "400"]


def _offload_line(capsys, *extra) -> str:
    assert main([*CLI, *extra]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "optimizer state on the host" in x]
    return line


def test_plan_cli_clipping_zero_prices_updates_in_the_backward(capsys):
    default = _offload_line(capsys)
    assert "not hidden by the next forward (clipping waits for every gradient)" in default
    assert _offload_line(capsys, "--gradient-clipping", "1.0") == default  # DeepSpeed's default, as absent
    assert "not hidden by the last backward and the next forward" in _offload_line(capsys, "--gradient-clipping", "0")


def test_plan_cli_fp16_keeps_waiting_for_every_gradient(capsys):
    line = _offload_line(capsys, "--gradient-clipping", "0", "--dtype", "fp16")  # loss scaling checks every gradient
    assert "not hidden by the next forward (clipping waits for every gradient)" in line


def test_the_worker_takes_the_unit_the_forward_needs_first_of_those_final():
    """Root + four equal layers, the last three offloaded, 1 s each on the host, a backward of 1 s (the layers final at
    0.25, 0.5, 0.75 s, last first) and a forward of 4 s (0.8 s a unit). At 1.25 s the worker has the fourth layer done
    and the second and third final: it takes the second (the forward's next), done at 2.25 s, then the third (3.25 s).
    The forward from 1 s: root and first layer until 2.6 s, then the second (done), the third (done at 3.25 < 3.4),
    the fourth: nothing waits. In the order they came (fourth, third, second) the second would be done at 3.25 s and
    the step would wait 0.65 s."""
    from lins_ds.plan.offload import updated_in_backward

    assert abs(updated_in_backward([1, 1, 1, 1, 1], [1.0, 1.0, 1.0], 4.0, 1.0, True)) < 1e-9
    assert abs(updated_in_backward([1, 1, 1, 1, 1], [1.0, 1.0, 1.0], 4.0, 1.0, False) - 2.25) < 1e-9
