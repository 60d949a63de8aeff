"""Measure to decide (docs/design.md §14): ``engine.relayout(plan)`` moves a running job onto another plan in
memory without changing a number it trains, and ``"plan": "tune"`` times the solver's candidates on the training
steps, keeps the fastest, and caches the decision."""

import dataclasses
import json
import os

import pytest
import torch

import lins_ds  # noqa: F401  (routes deepspeed.initialize to LinsEngine)
from helpers import GAS, GPUS_PER_NODE, SEQ, WORLD, batch, config, param_groups, run, tiny_llama
from lins_ds.plan import Factor, Layout, Topology, candidates, get_cluster
from lins_ds.plan import cost
from lins_ds.plan import tune as choose
from lins_ds.plan.offload import HOST, Placement

transformers = pytest.importorskip("transformers")

TOPO = Topology(WORLD // GPUS_PER_NODE, GPUS_PER_NODE)
REPLICATED = Layout(Factor(1, 1), Factor(1, 1), Factor(1, 1))
OS_SHARDED = Layout(Factor(1, 1), Factor(1, 1), Factor(2, 2))
ALL_SHARDED = Layout(Factor(2, 2), Factor(2, 2), Factor(2, 2))


def _engine(lins: dict, seed_model=None):
    import deepspeed

    model = seed_model or tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=config(lins))
    return engine


def _steps(engine, first: int, count: int) -> list:
    """``count`` optimizer steps of the tests' data from step ``first``; the window's mean loss after each."""
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(first, first + count):
        total = 0.0
        for micro in range(GAS):
            x = batch(step, micro, rank, 96)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / GAS)
    return losses


def _full_state(engine, path: str) -> dict:
    """Parameters (the module's state dict) and the optimizer state, whole, by parameter name, read back from a
    checkpoint (the code path of save and load, not the re-layout's)."""
    from lins_ds.checkpoint.load import ShardReader, read_meta

    engine.save_checkpoint(path, tag="t")
    out = {f"module/{k}": v.clone() for k, v in engine.module.state_dict().items()}
    meta = read_meta(os.path.join(path, "t"))
    reader = ShardReader(os.path.join(path, "t"), meta["index"])
    for name, info in meta["params"].items():
        if info["trainable"]:
            for key in ["master"] + meta["elementwise_state"]:
                t = torch.empty(torch.Size(info["shape"]).numel())
                reader.fill(t, name, 0, t.numel(), key)
                out[f"{key}/{name}"] = t
    for gi in range(len(meta["param_groups"])):
        for key in meta["scalar_state"]:
            out[f"scalar/{gi}/{key}"] = reader.scalar(gi, key)
    torch.distributed.barrier()
    return out


# --- relayout ------------------------------------------------------------------------------------------------
MOVES = "BCACBADACEC"  # every ordered pair of A, B, C; A to D and back, C to E and back (the same layout: no
# staging; C keeps its offloaded units' gradients on the host, E on the device); training goes on on C


def relayout_pairs(tmp: str):
    """Train on one plan, then move through every ordered pair of three plans (one with offload), comparing the
    whole state before and after each move; then train on and return the losses."""
    engine = _engine({"plan": {"p": [1, 1], "g": [1, 1], "os": [1, 1]}, "host_optimizer": "torch"})
    base = engine.lins.plan
    plans = {"A": base, "B": dataclasses.replace(base, layout=OS_SHARDED),
             "C": dataclasses.replace(base, layout=ALL_SHARDED, placement=Placement.of(2, g=HOST)),
             "D": dataclasses.replace(base, placement=Placement.of(2)),  # A's layout: only two units' OS move
             "E": dataclasses.replace(base, layout=ALL_SHARDED, placement=Placement.of(2))}
    losses = _steps(engine, 0, 2)
    checks = []
    before = _full_state(engine, f"{tmp}/0")
    x = batch(0, 0, torch.distributed.get_rank(), 96)
    for i, name in enumerate(MOVES):
        engine(input_ids=x, labels=x)  # a forward with grad and no backward leaves the root gathered (s_p > 1)
        rep = engine.relayout(plans[name])
        after = _full_state(engine, f"{tmp}/{i + 1}")
        exact = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
        grads_ok = (engine.lins._host.grads is not None) == plans[name].placement.offloads("g")
        checks.append((name, exact, engine.lins.layout == plans[name].layout,
                       len(engine.lins._host_units) == plans[name].placement.n_units and grads_ok, rep.seconds >= 0))
        before = after
    losses += _steps(engine, 2, 2)
    engine.destroy()
    return checks, losses


def failed_moves(tmp: str):
    """Rank 1 fails part-way through two moves — the second unit it moves to the host (same layout), the first
    unit it builds under another layout — after the other ranks have done theirs: every rank must raise
    RelayoutError and hold exactly the state it had."""
    from lins_ds.runtime.step import masters as opt_module
    from lins_ds.runtime import errors as relayout
    from lins_ds.runtime import runtime as rt_module

    engine = _engine({"plan": {"p": [1, 1], "g": [1, 1], "os": [1, 1]}, "host_optimizer": "torch"})
    _steps(engine, 0, 1)
    base = engine.lins.plan  # as the first batch sized it
    if torch.distributed.get_rank() == 1:
        real_moved, real_unit, calls = opt_module._moved, rt_module.build_unit, []

        def moved(*args):
            calls.append(1)
            if len(calls) == 3:  # each unit has two param groups: the second unit's first
                raise MemoryError("test: no host memory for the second unit")
            return real_moved(*args)

        def unit(*args, **kwargs):
            calls.append(2)
            if calls.count(2) == 1:
                raise MemoryError("test: no device memory for the new plan")
            return real_unit(*args, **kwargs)
        opt_module._moved, rt_module.build_unit = moved, unit
    out = []
    for target in (dataclasses.replace(base, placement=Placement.of(3)), dataclasses.replace(base, layout=ALL_SHARDED)):
        before = _full_state(engine, f"{tmp}/{len(out)}a")
        try:
            engine.relayout(target)
            raised = ""
        except relayout.RelayoutError as e:
            raised = str(e)
        after = _full_state(engine, f"{tmp}/{len(out)}b")
        same = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
        out.append((raised, same, engine.lins.plan == base, len(engine.lins._host_units)))
    losses = _steps(engine, 1, 2)
    engine.destroy()
    return out, losses


def test_a_move_that_fails_on_one_rank_leaves_every_rank_on_the_old_plan_with_its_state(tmp_path):
    results = run(failed_moves, WORLD, str(tmp_path), gpus_per_node=GPUS_PER_NODE)
    reference = run(untuned_losses, WORLD, {"p": [1, 1], "g": [1, 1], "os": [1, 1]}, 3, gpus_per_node=GPUS_PER_NODE)
    for (moves, losses), ref in zip(results, reference):
        (r1, same1, plan1, host1), (r2, same2, plan2, host2) = moves
        assert "no host memory for the second unit" in r1 and same1 and plan1 and host1 == 0, moves[0]
        assert "no device memory for the new plan" in r2 and same2 and plan2, moves[1]
        assert max(abs(a - b) for a, b in zip(losses, ref[1:])) <= 1e-5, (losses, ref)


def untuned_losses(layout_json: dict, steps: int) -> list:
    engine = _engine({"plan": layout_json, "host_optimizer": "torch"})
    losses = _steps(engine, 0, steps)
    engine.destroy()
    return losses


def test_relayout_between_every_pair_of_plans_keeps_the_state_exactly(tmp_path):
    results = run(relayout_pairs, WORLD, str(tmp_path), gpus_per_node=GPUS_PER_NODE)
    reference = run(untuned_losses, WORLD, {"p": [1, 1], "g": [1, 1], "os": [1, 1]}, 4, gpus_per_node=GPUS_PER_NODE)
    for (checks, losses), ref in zip(results, reference):
        assert [c[0] for c in checks] == list(MOVES)
        for name, exact, layout_ok, offload_ok, timed in checks:
            assert exact and layout_ok and offload_ok and timed, (name, exact, layout_ok, offload_ok)
        assert max(abs(a - b) for a, b in zip(losses, ref)) <= 1e-5, (losses, ref)


# --- tune ------------------------------------------------------------------------------------------------------
DELAY_S = 0.08  # per collective whose group spans the two emulated nodes
CANDIDATES = 5  # one of each kind of layout: the replicated one, priced slowest, among them
TUNE_STEPS = 12  # optimizer steps of the tuned runs: 5 candidates x 2 steps of trials, then 2 on the winner


def slow_all_reduce_profile(path: str) -> str:
    """A profile that knows nothing of the injected delay, and prices AllReduce 1000x too slow: the solver then
    prefers layouts that replace the replicas' AllReduce by more ReduceScatters and AllGathers across nodes,
    which the delay makes the slowest."""
    table = get_cluster("h200-emulated").table(cost.required_meshes(TOPO, candidates(TOPO)))
    obj = table.to_json()
    for m in obj["measurements"]:
        if m["op"] == "all_reduce":
            m["time_s"] = [t * 1000 for t in m["time_s"]]
    with open(path, "w") as f:
        json.dump(obj, f)
    return path


def tune_config(tmp: str, seq_len=SEQ, **tune) -> dict:
    """``seq_len`` None: the batches say it, and the trials start at the first (``test_tuning_waits_for_...``)."""
    return {"plan": "tune", "profile": f"{tmp}/profile.json", "profile_cache": f"{tmp}/cache",
            "activation_checkpointing": False, "host_optimizer": "torch", "seq_len": seq_len,
            "tune": {"candidates": CANDIDATES, "steps": 2, "max_steps": 2, **tune}}


def tuned_run(tmp: str, steps: int = TUNE_STEPS, seq_len=SEQ) -> dict:
    os.environ["LINS_TEST_INTER_NODE_DELAY_S"] = str(DELAY_S)
    engine = _engine(tune_config(tmp, seq_len))
    first = engine.lins.plan
    trials = engine.lins_tuner is not None
    losses = _steps(engine, 0, 1)
    trials = trials or (engine.lins_tuner is not None or engine.lins_tune_report is not None)
    losses += _steps(engine, 1, steps - 1)
    out = {"first": first.layout, "trials": trials, "report": engine.lins_tune_report, "losses": losses,
           "final": engine.lins.plan, "tuner_done": engine.lins_tuner is None}
    engine.destroy()
    return out


def untuned_run(layout: Layout, steps: int = TUNE_STEPS) -> list:
    os.environ["LINS_TEST_INTER_NODE_DELAY_S"] = str(DELAY_S)
    fixed = {s: [f.intra, f.inter] for s, f in layout.factors().items()}
    engine = _engine({"plan": fixed, "activation_checkpointing": False})
    losses = _steps(engine, 0, steps)
    engine.destroy()
    return losses


def test_tune_measures_a_faster_plan_than_the_solver_predicted_and_trains_as_it_would(tmp_path, capsys):
    tmp = str(tmp_path)
    slow_all_reduce_profile(f"{tmp}/profile.json")
    results = run(tuned_run, WORLD, tmp, gpus_per_node=GPUS_PER_NODE)
    report = results[0]["report"]
    decided = [[(r["measured_step_s"], r["chosen"], r["dropped"]) for r in res["report"]] for res in results]
    assert all(d == decided[0] for d in decided), "every rank decides alike"
    assert results[0]["trials"] and results[0]["tuner_done"] and len(report) == CANDIDATES
    measured = [r["measured_step_s"] for r in report]
    chosen = [i for i, r in enumerate(report) if r["chosen"]]
    assert len(chosen) == 1 and chosen[0] != 0, report  # the solver's best measured slower
    assert measured[chosen[0]] == min(measured)
    assert measured[0] > measured[chosen[0]] + 2 * DELAY_S, measured  # at least two delayed collectives a step apart
    winner = results[0]["final"].layout
    assert str(winner) == report[chosen[0]]["candidate"].split(" ckpt")[0]
    # the trajectory is the one an untuned run on the winning plan follows
    untuned = run(untuned_run, WORLD, winner, gpus_per_node=GPUS_PER_NODE)
    for tuned, plain in zip(results, untuned):
        assert max(abs(a - b) for a, b in zip(tuned["losses"], plain)) <= 1e-5, (tuned["losses"], plain)
    # the next launch of the same job starts on the winner, with no trials
    again = run(tuned_run, WORLD, tmp, 2, gpus_per_node=GPUS_PER_NODE)
    assert all(not r["trials"] and r["first"] == winner and r["report"] is None for r in again)
    decisions = [n for n in os.listdir(f"{tmp}/cache") if n.startswith("tune-") and n.endswith(".json")]
    assert len(decisions) == 1
    with open(f"{tmp}/cache/tune-runs.jsonl") as f:
        assert len(f.readlines()) == CANDIDATES  # every measured candidate: calibration data
    from lins_ds.cli import main

    capsys.readouterr()
    assert main(["tune", "--show", "--dir", f"{tmp}/cache"]) == 0
    shown = capsys.readouterr().out
    assert "LlamaForCausalLM" in shown and "chosen" in shown and str(winner) in shown, shown
    assert main(["tune", "--forget", "--dir", f"{tmp}/cache"]) == 0
    assert not [n for n in os.listdir(f"{tmp}/cache") if n.startswith("tune-") and n.endswith(".json")]


def failing_candidates_run(tmp: str) -> dict:
    """Rank 1 measures candidate 1 over the budget; rank 2 cannot build candidate 2 (an allocation failure
    outside any collective). Every rank must drop both and go back to candidate 0."""
    from lins_ds.runtime.switch import tune

    rank = torch.distributed.get_rank()
    peaks, builds = [], []
    if rank == 1:
        def peak(device):
            peaks.append(device)
            return 1e6 if len(peaks) == 2 else None
        tune.measured_peak_gb = peak
    if rank == 2:  # the first unit of candidate 2 fails to allocate, after its process groups exist
        from lins_ds.runtime import runtime as rt_module

        real_build, real_unit, fail = rt_module.LinsRuntime._rebuild, rt_module.build_unit, []

        def build(runtime, plan, staged):
            builds.append(plan.layout)
            if len(builds) == 2:
                fail.append(True)
            return real_build(runtime, plan, staged)

        def unit(*args, **kwargs):
            if fail:
                fail.clear()
                raise MemoryError("test: no memory for this candidate")
            return real_unit(*args, **kwargs)
        rt_module.LinsRuntime._rebuild, rt_module.build_unit = build, unit
    engine = _engine(tune_config(tmp, candidates=3))
    losses = _steps(engine, 0, 8)
    out = {"report": [(r["chosen"], r["dropped"]) for r in engine.lins_tune_report], "losses": losses,
           "final": engine.lins.plan.layout, "first": engine._lins_solve.solution.plan.layout}
    engine.destroy()
    return out


def test_a_candidate_over_budget_or_failing_on_one_rank_is_dropped_on_every_rank(tmp_path):
    tmp = str(tmp_path)
    slow_all_reduce_profile(f"{tmp}/profile.json")
    results = run(failing_candidates_run, WORLD, tmp, gpus_per_node=GPUS_PER_NODE, timeout=300)
    for res in results:
        assert res["report"] == results[0]["report"]
        (c0, d0), (c1, d1), (c2, d2) = res["report"]
        assert c0 and not d0 and not c1 and not c2, res["report"]
        assert d1.startswith("measured peak 1000000.00 GiB over the budget"), d1
        assert "could not switch" in d2 and "test: no memory for this candidate" in d2, d2
        assert res["final"] == res["first"]
    untuned = run(untuned_run, WORLD, results[0]["first"], 8, gpus_per_node=GPUS_PER_NODE)
    for res, plain in zip(results, untuned):
        assert max(abs(a - b) for a, b in zip(res["losses"], plain)) <= 1e-5


# --- the candidates (pure) ---------------------------------------------------------------------------------------
def _eval(layout, k=0, o=0, objective=1.0, fits=True, layers=8, units=9):
    from lins_ds.plan.memory import MemoryBreakdown  # noqa: F401 (the evaluation's memory is a stand-in here)

    class Mem:
        total_gb = 1.0 if fits else 99.0
        allocated_gb = 0.5
        host_gb = 0.0

    from lins_ds.plan.solver import Evaluation

    return Evaluation(layout, k, Mem(), (), 0.0, 10.0, exposed_s=objective, num_layers=layers,
                      placement=Placement.of(o), num_units=units)


def test_layout_kinds_in_zero_words():
    assert choose.kind(REPLICATED, 4) == "replicated"
    assert choose.kind(OS_SHARDED, 4) == "ZeRO-1-like"
    assert choose.kind(Layout(Factor(1, 1), Factor(2, 1), Factor(2, 2)), 4) == "ZeRO-2-like"
    assert choose.kind(Layout(Factor(2, 1), Factor(2, 2), Factor(2, 2)), 4) == "hpZ/MiCS-like"
    assert choose.kind(ALL_SHARDED, 4) == "ZeRO-3-like"


def test_candidates_are_the_best_then_one_of_each_other_kind_then_neighbours_each_once():
    hpz = Layout(Factor(2, 1), Factor(2, 2), Factor(2, 2))
    fitting = [_eval(hpz, objective=1.0), _eval(Layout(Factor(2, 1), Factor(2, 1), Factor(2, 2)), objective=1.1),
               _eval(ALL_SHARDED, objective=1.2), _eval(REPLICATED, objective=3.0), _eval(OS_SHARDED, objective=2.0)]
    near = [(_eval(hpz, k=2, objective=1.5), "checkpointing"), (_eval(hpz, objective=1.0), "checkpointing")]
    out = choose.candidates(fitting, near, 10, 4, lambda e: e.exposed_s + 1)
    assert [(c.kind, c.why) for c in out] == [("hpZ/MiCS-like", "solver's best"), ("ZeRO-3-like", "best ZeRO-3-like"),
                                              ("replicated", "best replicated"), ("ZeRO-1-like", "best ZeRO-1-like"),
                                              ("hpZ/MiCS-like", "checkpointing")]
    assert out[0].predicted_step_s == 2.0 and out[-1].label == "P=2x1 G=2x2 OS=2x2 ckpt 2/8"
    assert len(choose.candidates(fitting, near, 2, 4, lambda e: 0.0)) == 2
    assert choose.candidates([], near, 3, 4, lambda e: 0.0) == []


def test_neighbours_vary_the_checkpointing_depth_and_the_offload_and_never_offer_what_does_not_fit():
    best = _eval(REPLICATED, k=2, o=1, layers=16)

    def evaluate(k, o):  # fits from 2 checkpointed units with one offloaded, from 0 with two
        return _eval(REPLICATED, k, o, fits=(k >= 2 and o >= 1) or o >= 2, layers=16)

    got = [(e.ckpt_units, e.placement.n_units, why) for e, why in choose.neighbours(best, evaluate, list(range(17)),
                                                                                  [0, 1, 2, 3])]
    # depths 4, 0, 16, 6 (a step of 16/8 = 2 each way, and every layer), each with its fewest offload; offloads 2
    # and 3 (and 0, which nothing makes fit), each with its fewest checkpointing
    assert got == [(4, 1, "checkpointing"), (0, 2, "checkpointing"), (16, 1, "checkpointing"), (6, 1, "checkpointing"),
                   (0, 2, "offload"), (0, 3, "offload")]


def test_the_fastest_within_the_budget_wins():
    assert choose.fastest([([2.0], 10.0), ([1.0], 50.0), ([1.5], None)], 40.0) == 2
    assert choose.fastest([(None, 1.0), (None, None)], 40.0) is None
    assert choose.fastest([([2.0], None), ([1.0], None)], None) == 1
    assert choose.fastest([([2.0], 99.0), ([1.9], None)], 40.0, precision=0.5) == 1  # the solver's dropped


def test_the_median_interval_is_the_binomial_order_statistics():
    assert choose.median_interval([1.0] * 5) is None  # 5 times cannot hold the median at 95 %
    assert choose.median_interval([5, 1, 3, 2, 6, 4]) == (1, 3.5, 6)  # 96.9 %: the extremes
    assert choose.median_interval(list(range(9))) == (1, 4, 7)  # 96.1 %: one in from each end
    assert choose.median_interval(list(range(11))) == (1, 5, 9)
    assert choose.median_interval(list(range(20))) == (5, 9.5, 14)  # 95.9 %
    one_slow = [1.0, 1.01, 0.99, 1.0, 1.02, 5.0, 1.0, 0.98, 1.01]  # a slow step moves the interval by one rank
    assert choose.settled(one_slow, 0.03) and not choose.settled(one_slow[:6], 0.03)


def test_the_solver_pick_stays_unless_the_gain_is_more_than_the_noise():
    solver = [1.00, 1.02, 0.98, 1.01, 0.99, 1.00, 1.03]
    within_noise = [0.985, 0.99, 0.97, 1.0, 0.98, 0.99, 0.975]  # median 1.5 % faster, intervals overlap
    clearly = [0.90, 0.91, 0.92, 0.90, 0.91, 0.90, 0.92]
    assert choose.fastest([(solver, None), (within_noise, None)], None, 0.03) == 0
    assert choose.fastest([(solver, None), (within_noise, None), (clearly, None)], None, 0.03) == 2
    assert choose.fastest([([1.0, 1.0], None), ([0.98, 0.98], None)], None, 0.03) == 0  # too few: by precision
    assert choose.fastest([([1.0, 1.0], None), ([0.9, 0.9], None)], None, 0.03) == 1


def timed_until_settled(tmp: str) -> dict:
    """Each rank's clock says its own step times: rank 1's first steps of every candidate are noisy, rank 0's
    steady. The tuner must time each candidate on the slowest rank's times until their median is known to 3 %,
    and every rank must switch at the same step."""
    from lins_ds.runtime.switch import tune

    rank = torch.distributed.get_rank()
    noisy = [1.5, 0.7, 1.4, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    clock = {"t": 0.0, "trial": None, "i": 0, "engine": None}

    def fake_clock(device):
        tuner = getattr(clock["engine"], "lins_tuner", None)
        trial = tuner.current if tuner is not None else None
        if trial != clock["trial"]:
            clock["trial"], clock["i"] = trial, 0
        step = noisy[clock["i"] % len(noisy)] if rank == 1 else 1.0
        clock["i"] += 1
        clock["t"] += step * (1.0 + 0.1 * (trial or 0))  # candidate k takes 1 + 0.1 k s a step
        return clock["t"]

    tune._clock = fake_clock
    engine = clock["engine"] = _engine(tune_config(tmp, candidates=2, max_steps=12))
    _steps(engine, 0, 20)
    out = {"report": [(r["step_times_s"], r["chosen"]) for r in engine.lins_tune_report]}
    engine.destroy()
    return out


def test_a_candidate_is_timed_until_its_median_is_known_on_every_rank_alike(tmp_path):
    tmp = str(tmp_path)
    slow_all_reduce_profile(f"{tmp}/profile.json")
    results = run(timed_until_settled, 2, tmp, gpus_per_node=1, timeout=300)
    assert results[0]["report"] == results[1]["report"], "every rank times and decides alike"
    (t0, c0), (t1, c1) = results[0]["report"]
    assert len(t0) > 6 and choose.settled(t0, 0.03) and not choose.settled(t0[:-1], 0.03), t0  # rank 1's noise
    assert c0 and not c1, results[0]["report"]  # 10 % slower: the solver's plan stays


@pytest.mark.parametrize("block, error", [
    ({"plan": "tune", "tune": {"steps": 1}}, "lins.tune.steps: 1 is not an integer >= 2"),
    ({"plan": "tune", "tune": {"candidates": 0}}, "lins.tune.candidates: 0 is not an integer >= 1"),
    ({"plan": "tune", "tune": {"cache": "yes"}}, "lins.tune.cache: 'yes' is not true or false"),
    ({"plan": "tune", "tune": {"trials": 3}}, "lins.tune.trials: unknown key"),
    ({"plan": "tune", "tune": {"precision": 1.5}}, "lins.tune.precision: 1.5 is not a number >= 0 and < 1"),
    ({"plan": "tune", "tune": {"steps": 4, "max_steps": 3}}, "lins.tune.max_steps: 3 is not an integer >= lins.tune"),
    ({"plan": "tune", "tune": {"steps": 3, "warmup_steps": 3}},
     "lins.tune.warmup_steps: 3 is not an integer >= 1 and < lins.tune.steps (3)"),
    ({"plan": "tunes"}, "lins.plan: 'tunes' is not \"solve\", \"tune\""),
])
def test_bad_tune_settings_are_named(block, error):
    from lins_ds.runtime.config import LinsConfigError, parse_lins_config

    with pytest.raises(LinsConfigError, match=None) as e:
        parse_lins_config(block)
    assert str(e.value).startswith(error), str(e.value)


def test_a_candidates_warm_up_steps_are_not_timed(monkeypatch):
    """The first lins.tune.warmup_steps of a candidate are left out of its times (the second step under offload pays
    the first host update: 4.1 s against 1.8 on one H200, bench/results/tune_repeat); fewer steps than the default
    warm-up leave one timed step."""
    from lins_ds.runtime.switch import tune
    from lins_ds.runtime.config import parse_lins_config

    assert parse_lins_config({"plan": "tune"}).tune.warmup_steps == 2
    assert parse_lins_config({"plan": "tune", "tune": {"steps": 2}}).tune.warmup_steps == 1
    ticks = iter([0.0, 10.0, 15.0, 16.0, 17.0, 18.0])  # steps of 10, 5, then 1 s
    monkeypatch.setattr(tune, "_clock", lambda device: next(ticks))
    monkeypatch.setattr(tune.comm, "max_over_world", lambda x, device: x)
    tuner = tune.Tuner.__new__(tune.Tuner)
    tuner.trials, tuner.current, tuner.device = [tune.Trial(candidate=None, plan=None)], 0, None
    tuner.steps, tuner.precision, tuner.max_steps, tuner.warmup = 3, 0.03, 12, 2
    tuner._last = tune._clock(None)
    assert not any(tuner.after_step() for _ in range(5))
    assert tuner.trials[0].times == [1.0, 1.0, 1.0] and tuner.trials[0].steps == 5


def test_a_moved_step_count_is_what_torch_keeps_whatever_optimizer_held_it():
    from lins_ds.runtime.step.masters import scalar_state

    p = torch.zeros(3)
    step = scalar_state(7, p, {})  # DeepSpeedCPUAdam's int
    assert torch.is_tensor(step) and step.dtype == torch.float32 and step.item() == 7.0 and step.device.type == "cpu"
    t = torch.tensor(5.0)
    assert scalar_state(t, p, {"fused": True}) is not t  # a copy


def test_tuning_waits_for_the_batches_where_the_length_is_not_given(tmp_path):
    """Without lins.seq_len the candidates depend on the batches' length: the trials start at the first training
    batch, the decision is cached under that length, and the next launch moves onto the winner at its first batch."""
    tmp = str(tmp_path)
    slow_all_reduce_profile(f"{tmp}/profile.json")
    results = run(tuned_run, WORLD, tmp, TUNE_STEPS, None, gpus_per_node=GPUS_PER_NODE)
    report = results[0]["report"]
    assert results[0]["trials"] and results[0]["tuner_done"] and len(report) == CANDIDATES
    winner = results[0]["final"]
    again = run(tuned_run, WORLD, tmp, 2, None, gpus_per_node=GPUS_PER_NODE)
    assert all(r["report"] is None and r["final"].layout == winner.layout for r in again)
