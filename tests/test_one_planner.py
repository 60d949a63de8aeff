"""One place decides (issue 62): ``lins-ds plan`` and the engine's start-up reach their plan through the same driver
(``plan.offload.ladder`` walked by ``plan.offload.walk``, over the same ``SolveContext`` rules), so that what the CLI
prints is what the engine runs: held for offload off / auto / fixed, budgets that force each rung of "auto"'s ladder,
and "solve" and "tune" (whose first plan is the solver's best). The engine runs on 2 gloo ranks, on a profile the CLI
reads too; its host is the CLI's (on a CPU, "auto" never offloads: the test gives the engine the CLI's host). On a GPU
the engine's memory probe also times a layer and prices compute at that rate (``plan.context.compute_for``): the CLI
prices the same given the same profile (``--memory-profile``, held below)."""

import json

import pytest

from lins_ds.cli import main

GPUS = 2
HOST = {"host_memory_gb": 64.0, "update": 1.0, "copy": 25.0}
KEYS = ("plan", "activation_checkpointing_units", "offload_units", "offload_grads", "offload_params", "memory_gb_per_gpu",
        "objective_s_per_step")


def engine_plan(profile, lins):
    import deepspeed
    import torch
    from helpers import config, param_groups, tiny_llama

    from lins_ds.plan import report
    from lins_ds.plan.offload import HostSpec
    from lins_ds.runtime.startup import planning

    def given_host(self):  # the CLI's host, on this CPU too
        if self.cfg.offload.mode == "off":
            return None
        self.kind = "torch"
        return HostSpec(HOST["host_memory_gb"] / GPUS, HOST["update"] * 1e9, HOST["copy"], HOST["copy"],
                        source="given (test)")

    planning.HostProbe._describe = given_host
    model = tiny_llama(layers=4)
    block = {"profile": profile, "seq_len": 64, "memory_profile": "formula", "host_memory_gb": HOST["host_memory_gb"],
             "tune": {"cache": False}, **lins}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=config(block))
    out = report.to_json(engine._lins_solve.solution)
    engine.destroy()
    return out


def cli_plan(tmp_path, capsys, gb, offload) -> dict:
    args = ["plan", "--model", str(tmp_path / "config.json"), "--nodes", "1", "--gpus-per-node", str(GPUS),
            "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum", "2", "--dtype", "fp32", "--gpu-memory-gb",
            str(gb), "--profile", str(tmp_path / "profile.json"), "--format", "json", *offload]
    assert main(args) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


HOST_ARGS = ["--host-memory-gb", str(HOST["host_memory_gb"]), "--host-update-gelems", str(HOST["update"]),
             "--host-copy-gbs", str(HOST["copy"])]
CASES = {  # name -> (lins block, budget GiB, lins-ds plan's offload arguments)
    "solve, offload off, room": ({"plan": "solve", "offload": False}, 1.0, ["--offload", "off"]),
    "solve, offload off, tight": ({"plan": "solve", "offload": False}, 0.0012, ["--offload", "off"]),
    "solve, auto, GPU-resident rung": ({"plan": "solve", "offload": "auto"}, 1.0, HOST_ARGS),
    "solve, auto, tight but resident": ({"plan": "solve", "offload": "auto"}, 0.0012, HOST_ARGS),
    "solve, auto, OS on the host": ({"plan": "solve", "offload": "auto"}, 0.0009, HOST_ARGS),
    "solve, auto, P on the host too": ({"plan": "solve", "offload": "auto"}, 0.00085, HOST_ARGS),
    "solve, fixed OS": ({"plan": "solve", "offload": {"os": "cpu"}}, 1.0, [*HOST_ARGS, "--offload", "fixed"]),
    "solve, fixed half, G on the host": ({"plan": "solve", "offload": {"os": "cpu", "os_fraction": 0.5, "g": "cpu"}},
                                         1.0, [*HOST_ARGS, "--offload", "fixed", "--os-fraction", "0.5",
                                               "--offload-g", "cpu"]),
    "tune, auto": ({"plan": "tune", "offload": "auto"}, 0.0012, HOST_ARGS),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from helpers import tiny_llama

    from lins_ds.plan import Topology, candidates, cost, get_cluster

    tmp = tmp_path_factory.mktemp("one_planner")
    topo = Topology(1, GPUS)
    obj = get_cluster("h200-emulated").table(cost.required_meshes(topo, candidates(topo))).to_json()
    obj["meta"]["device"] = "cpu"
    (tmp / "profile.json").write_text(json.dumps(obj))
    tiny_llama(layers=4).config.to_json_file(tmp / "config.json")
    # the formula's activations for the CLI's batch, as a memory profile file: without, and with a layer timed at 70 %
    # of the peak (a GPU's profile: the engine prices compute at that rate)
    from dataclasses import replace

    from lins_ds.plan import TrainingSpec, load_model
    from lins_ds.plan.memory import formula_activations

    model = load_model(str(tmp / "config.json"))
    acts = replace(formula_activations(model, TrainingSpec(64, 2, 2, "fp32")), source="measured:test")
    (tmp / "memory.json").write_text(json.dumps({"profile": acts.to_json()}))
    seconds = 3 * acts.tokens * model.layer_forward_flops_per_token(64) / (0.7 * 989e12)
    (tmp / "memory_timed.json").write_text(json.dumps({"profile": replace(acts, timed=(seconds, acts.tokens, 64)).to_json()}))
    return tmp


@pytest.mark.parametrize("case", list(CASES))
def test_the_cli_prints_the_plan_the_engine_runs(files, capsys, case):
    from helpers import run

    lins, gb, offload = CASES[case]
    want = run(engine_plan, GPUS, str(files / "profile.json"), {**lins, "gpu_memory_gb": gb}, gpus_per_node=GPUS)[0]
    got = cli_plan(files, capsys, gb, offload)
    for key in KEYS:
        assert got[key] == want[key], (case, key, got[key], want[key])


def test_a_timed_memory_profile_gives_the_cli_the_engine_s_rate_and_plan(files, capsys):
    """A GPU's memory profile, its layer timed (the rate the engine prices compute at, ``plan.context.compute_for``),
    given to both (lins.memory_profile, --memory-profile): the same plan and predicted step; the same profile without
    the timing prices the recompute otherwise (the rate is used, not ignored by both)."""
    from helpers import run

    lins, gb, offload = CASES["solve, offload off, tight"]
    timed = str(files / "memory_timed.json")
    want = run(engine_plan, GPUS, str(files / "profile.json"), {**lins, "gpu_memory_gb": gb, "memory_profile": timed},
               gpus_per_node=GPUS)[0]
    got = cli_plan(files, capsys, gb, [*offload, "--memory-profile", timed])
    for key in (*KEYS, "predicted_recompute_s_per_step"):
        assert got[key] == want[key], (key, got[key], want[key])
    untimed = cli_plan(files, capsys, gb, [*offload, "--memory-profile", str(files / "memory.json")])
    assert untimed["activation_checkpointing_units"] == got["activation_checkpointing_units"] > 0
    assert got["predicted_recompute_s_per_step"] == pytest.approx(untimed["predicted_recompute_s_per_step"] * 35 / 70)
    assert main(["plan", "--model", "llama-7b", "--nodes", "1", "--gpus-per-node", "1", "--seq-len", "64",
                 "--micro-batch-size", "1", "--memory-profile", str(files / "config.json")]) == 2
    assert "--memory-profile: " in capsys.readouterr().err  # not a memory profile: named, not a traceback


def test_the_cases_reach_every_rung(files, capsys):
    """The budgets above force each rung of "auto"'s ladder: GPU-resident, OS (and G) on the host, P too."""
    rungs = {}
    for case in ("solve, auto, GPU-resident rung", "solve, auto, OS on the host", "solve, auto, P on the host too"):
        _, gb, offload = CASES[case]
        out = cli_plan(files, capsys, gb, offload)
        rungs[case] = (out["offload_units"] > 0, out["offload_params"])
    assert list(rungs.values()) == [(False, False), (True, False), (True, True)], rungs


def engine_summary(profile, lins, vocab):
    """What the engine's start-up said (rank 0), on the tiny LLaMA with ``vocab``, given the CLI's host."""
    import deepspeed
    import torch
    from helpers import config, param_groups, tiny_llama

    from lins_ds.runtime.switch import planner

    said = []
    planner.announce = said.append
    from lins_ds.plan.offload import HostSpec
    from lins_ds.runtime.startup import planning

    def given_host(self):
        self.kind = "torch"
        return HostSpec(HOST["host_memory_gb"] / GPUS, HOST["update"] * 1e9, HOST["copy"], HOST["copy"],
                        source="given (test)")

    planning.HostProbe._describe = given_host
    from lins_ds import comm
    priced = planning.head_tiling_note

    def without_collectives(*args):  # ranks whose budgets differ walk different rungs here: none may wait on another
        # nor make a solve context anew: with a measured profile each one agrees on it (a collective per rung)
        names = ("broadcast_object", "all_gather_object", "agree", "barrier", "max_over_world_cpu")
        saved = [(comm, n, getattr(comm, n)) for n in names] + [(planning, "solve_context", planning.solve_context)]
        for owner, n, _ in saved:
            setattr(owner, n, lambda *a, _n=n, **k: (_ for _ in ()).throw(AssertionError(f"{_n} in head_tiling")))
        try:
            return priced(*args)
        finally:
            for owner, n, f in saved:
                setattr(owner, n, f)

    planning.head_tiling_note = without_collectives
    model = tiny_llama(vocab=vocab, layers=4)
    block = {"profile": profile, "seq_len": 64, "host_memory_gb": HOST["host_memory_gb"], "tune": {"cache": False},
             **lins}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=config(block))
    engine.destroy()
    return "\n".join(said)


def test_the_head_tiling_a_plan_could_use_is_said_alike(files, capsys):
    """Where the logits in 8 tiles would keep optimizer state on the GPU, the engine's start-up and lins-ds plan say
    so in the same words (lins.tiling "auto"), priced without a collective (the engine's ranks may have different
    budgets, so different ladders); never where the user set lins.tiling, and the plan stays untiled."""
    from helpers import run, tiny_llama

    tiny_llama(vocab=4096, layers=4).config.to_json_file(files / "config_4096.json")
    args = ["plan", "--model", str(files / "config_4096.json"), "--nodes", "1", "--gpus-per-node", str(GPUS),
            "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum", "2", "--dtype", "fp32", "--gpu-memory-gb",
            "0.008", "--profile", str(files / "profile.json"), "--format", "json", *HOST_ARGS]
    assert main(args) == 0, capsys.readouterr().err
    cli = json.loads(capsys.readouterr().out)
    assert cli["offload_units"] == 5 and "8 tiles" in cli["head_tiling"], cli.get("head_tiling")
    lins = {"plan": "solve", "offload": "auto", "gpu_memory_gb": 0.008, "memory_profile": "formula"}
    said = run(engine_summary, GPUS, str(files / "profile.json"), lins, 4096, gpus_per_node=GPUS)[0]
    assert cli["head_tiling"] in said and "sequence tiling" not in said
    said = run(engine_summary, GPUS, str(files / "profile.json"), {**lins, "tiling": False}, 4096,
               gpus_per_node=GPUS)[0]
    assert "8 tiles" not in said
