"""HF Trainer and accelerate with a Lins config, 2 CPU processes launched as a user would."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf_trainer.py")
transformers = pytest.importorskip("transformers")
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def launch(args, out, *extra, launcher=None, port=29611):
    launcher = launcher or [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                            "--master_port", str(port)]
    cmd = launcher + args + ["--output_dir", str(out), "--logging_steps", "1", "--report_to", "none",
                             "--learning_rate", "1e-3", "--seed", "7", *extra]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f)


def trainer(config, out, *extra):
    return launch([EXAMPLE, "--deepspeed", os.path.join(ROOT, "ds_configs", config)], out, *extra)


def losses(run):
    return [h["loss"] for h in run["log"]]


def test_trainer_lins_matches_zero1_and_saves_loadable_weights(tmp_path):
    common = ("--max_steps", "6", "--per_device_train_batch_size", "4", "--save_strategy", "no")
    lins = trainer("hf_lins.json", tmp_path / "lins", *common)
    zero1 = trainer("hf_zero1.json", tmp_path / "zero1", *common)
    assert (lins["engine"], zero1["engine"]) == ("LinsEngine", "DeepSpeedEngine")
    assert lins["world_size"] == 2  # each rank its own data shard: accelerate counted both processes
    assert max(abs(a - b) for a, b in zip(losses(lins), losses(zero1))) <= 1e-5
    assert all(h["grad_norm"] > 0 for h in lins["log"]) and lins["log"][-1]["learning_rate"] < 1e-3
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lins")
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "zero1")
    sa, sb = a.state_dict(), b.state_dict()
    assert max((sa[k] - sb[k]).abs().max().item() for k in sb) <= 1e-5


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    four_by_one = trainer("hf_lins.json", tmp_path / "a", "--max_steps", "4", "--save_strategy", "no",
                          "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4")
    one_by_four = trainer("hf_lins.json", tmp_path / "b", "--max_steps", "4", "--save_strategy", "no",
                          "--per_device_train_batch_size", "4")
    assert max(abs(a - b) for a, b in zip(losses(four_by_one), losses(one_by_four))) <= 1e-5


def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(tmp_path):
    common = ("--per_device_train_batch_size", "4", "--save_steps", "3", "--max_steps", "6")
    full = trainer("hf_lins.json", tmp_path / "full", *common)
    assert os.path.isdir(tmp_path / "full" / "checkpoint-3" / "global_step3")
    resumed = trainer("hf_lins.json", tmp_path / "full", *common, "--resume_from_checkpoint",
                      str(tmp_path / "full" / "checkpoint-3"))
    after = [h for h in resumed["log"] if h["step"] > 3]  # steps 1-3 come back from trainer_state.json
    assert [h["step"] for h in after] == [4, 5, 6]
    assert max(abs(a["loss"] - b) for a, b in zip(after, losses(full)[3:])) <= 1e-5


def test_accelerate_launch_with_a_lins_deepspeed_config_file(tmp_path):
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                   f"deepspeed_config:\n  deepspeed_config_file: {ROOT}/ds_configs/hf_lins.json\n"
                   "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: false\nmain_process_port: 29623\n")
    run = launch([EXAMPLE, "--max_steps", "3", "--per_device_train_batch_size", "4", "--save_strategy", "no"],
                 tmp_path / "acc", launcher=[sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                             str(cfg)])
    assert run["engine"] == "LinsEngine" and run["world_size"] == 2


SCRIPT = '''
import deepspeed, torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
       "lins": {"plan": {"p": [1, 1], "g": [1, 1], "os": ["all", 1]}}}
engine, *_ = deepspeed.initialize(model=model, config=cfg)
loss = engine(torch.randn(1, 8)).sum()
engine.backward(loss)
engine.step()
print(f"ENGINE-{torch.distributed.get_rank()}:{type(engine).__name__}:{engine.global_steps}", flush=True)
'''


def test_lins_ds_run_activates_lins_for_scripts_that_do_not_import_it(tmp_path):
    script = tmp_path / "plain_script.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29631",
           "-m", "lins_ds.run", str(script)]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ENGINE-0:LinsEngine:1" in r.stdout and "ENGINE-1:LinsEngine:1" in r.stdout
