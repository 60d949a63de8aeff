"""A finished job leaves no process group to interpreter teardown: torch 2.13 can abort a process whose gloo
group is still open at exit (``terminate called without an active exception``, pytorch/pytorch#179291), which
torchrun reports as the job failing after its work is done. The shipped example scripts and ``lins_ds.run``
destroy the group themselves; these tests check that they do (the abort itself is too rare to test for)."""

import importlib.util
import os
import sys
import types

import torch

import lins_ds  # noqa: F401
from helpers import ROOT, run
from lins_ds.runtime.step.unit import ParamState

SYNCING = ParamState.SYNCING

LINS_SCRIPT = '''
import deepspeed, torch, lins_run_probe
from lins_ds.runtime.step.unit import ParamState
SYNCING = ParamState.SYNCING
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
       "lins": {"gpus_per_node": 2, "plan": {"p": [1, 1], "g": [2, 1], "os": [2, 1]},
                "unit_modules": ["Linear"], "overlap_param_sync": True}}
engine, *_ = deepspeed.initialize(model=model, config=cfg)
engine.backward(engine(torch.randn(2, 16)).sum())
engine.step()
lins_run_probe.engine = engine  # kept alive past the script, as a script's globals would be
lins_run_probe.in_flight = sum(u.param_state is SYNCING for u in engine.lins._units)
'''


def run_script(tmp: str, body: str) -> tuple:
    """``lins_ds.run`` on a script of ``body``: (what it raised, if anything; the group still initialized)."""
    from lins_ds.run import main

    path = os.path.join(tmp, f"script_{torch.distributed.get_rank()}.py")
    with open(path, "w") as f:
        f.write(body)
    try:
        main([path])
        raised = None
    except BaseException as e:  # noqa: BLE001 (SystemExit included: the script's exit is the result)
        raised = f"{type(e).__name__}: {e}"
    return raised, torch.distributed.is_initialized()


def reinit(tmp: str, name: str) -> None:
    """A fresh default group for the next script, where the last one was destroyed."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/{name}", rank=int(os.environ["RANK"]),
                                             world_size=int(os.environ["WORLD_SIZE"]))


def lins_run_cases(tmp: str) -> dict:
    sys.modules["lins_run_probe"] = probe = types.ModuleType("lins_run_probe")
    out = {"lins": run_script(tmp, LINS_SCRIPT)}
    if out["lins"][0] is not None:
        return out  # the script failed: its own error is the result, not what it did not leave behind
    out["in_flight"] = probe.in_flight
    out["engine_destroyed"] = probe.engine.lins.destroyed
    out["engine_waited"] = not any(u.param_state is SYNCING for u in probe.engine.lins._units)
    reinit(tmp, "again")
    allreduce = "import torch, torch.distributed as d\nd.all_reduce(torch.ones(1))\n"
    out["exit0"] = run_script(tmp, allreduce + "raise SystemExit(0)\n")
    reinit(tmp, "third")
    out["error"] = run_script(tmp, allreduce + "raise ValueError('the script failed')\n")
    return out


def test_lins_ds_run_destroys_the_engines_and_the_group_a_finished_script_left(tmp_path):
    for out in run(lins_run_cases, 2, str(tmp_path)):
        assert out["lins"] == (None, False), out["lins"]
        # the P all-gathers step() issued were not yet waited for when the script ended: waited for, then destroyed
        assert out["in_flight"] > 0 and out["engine_waited"] and out["engine_destroyed"]
        assert out["exit0"] == ("SystemExit: 0", False)
        # a failing script keeps its traceback as the last word: nothing more runs on the group
        assert out["error"] == ("ValueError: the script failed", True)


def train_llama_example(tmp: str) -> tuple:
    spec = importlib.util.spec_from_file_location("train_llama", os.path.join(ROOT, "examples", "train_llama.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(["--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero1.json"), "--model", "tiny",
                           "--seq-len", "32", "--steps", "2"])
    return len(losses), torch.distributed.is_initialized()


def test_train_llama_example_destroys_its_process_group(tmp_path):
    assert run(train_llama_example, 2, str(tmp_path)) == [(2, False)] * 2
