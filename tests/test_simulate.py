import json

import pytest

from lins_ds.cli import main
from lins_ds.plan import BUILTIN_MODELS, MemorySpec, Topology, candidates, get_cluster, solve
from lins_ds.plan.cost import required_meshes
from lins_ds.plan.simulate import sim_train, simulate

PAPER = ["--cluster", "a800-ib", "--gpus-per-node", "8", "--seq-len", "4096", "--micro-batch-size", "1",
         "--global-batch-tokens", "4194304"]


def test_json_contract_and_paper_ordering(capsys):
    assert main(["simulate", "--model", "llama-7b", "--nodes", "128", *PAPER, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    systems = out["systems"]
    assert set(systems) == {"zero1", "zero3", "zeropp", "mics", "lins"}
    for r in systems.values():
        for key in ("mfu", "tokens_per_gpu_s", "step_s", "exposed_comm_s", "memory_gb_per_gpu", "layout"):
            assert key in r
    assert systems["lins"]["mfu"] > systems["mics"]["mfu"] > systems["zeropp"]["mfu"]
    assert abs(100 * systems["zero1"]["mfu"] - 36) <= 5  # the paper's ZeRO-1 7B at 1024 GPUs
    assert "calibrated" in out["calibration"]


def test_lins_uses_the_planners_own_cost_model():
    topo, model = Topology(4, 8), BUILTIN_MODELS["llama-7b"]
    cluster = get_cluster("a800-ib")
    table = cluster.table(required_meshes(topo, candidates(topo)))
    train = sim_train(model, topo, 4096, 1, 4096 * 32 * 4)
    mem = MemorySpec(80)
    sim = simulate(model, topo, train, mem, table, cluster.compute(), ("lins",))["lins"]
    assert sim.comm_s == pytest.approx(solve(model, topo, train, mem, table, cluster.compute()).best.comm_s)


def test_sweep_writes_a_plot(tmp_path, capsys):
    png = tmp_path / "scaling.png"
    assert main(["simulate", "--model", "llama-7b", *PAPER, "--sweep-nodes", "1,2,4", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert "MFU" in capsys.readouterr().out


def test_global_batch_must_divide(capsys):
    assert main(["simulate", "--model", "llama-7b", "--nodes", "3", "--cluster", "a800-ib", "--gpus-per-node", "8",
                 "--seq-len", "4096", "--micro-batch-size", "1", "--global-batch-tokens", "4194304"]) == 2
