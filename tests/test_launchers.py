"""Every launcher the README names, as a user types it, on CPU: the plan sees 1 node x 2 processes."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_llama.py")
CONFIG = os.path.join(ROOT, "ds_configs", "lins.json")
ARGS = ["--deepspeed_config", CONFIG, "--model", "tiny", "--steps", "3", "--seq-len", "32"]


def env(tmp_path):
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                XDG_CACHE_HOME=str(tmp_path / "cache"))


def launch(cmd, tmp_path):
    r = subprocess.run(cmd, env=env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "on 1 node(s) x 2 GPU(s)" in out, out[-4000:]  # the launcher's processes per node were read
    assert "step    3" in out, out[-4000:]
    return out


def deepspeed_launcher():
    import shutil

    exe = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.exists(exe):
        pytest.skip("the deepspeed launcher script is not installed next to this python")
    return [exe, "--num_gpus", "2", "--master_port", "29651"]


def test_deepspeed_launcher_runs_an_example_script_by_path(tmp_path):
    launch(deepspeed_launcher() + [EXAMPLE] + ARGS, tmp_path)


def test_deepspeed_launcher_with_module(tmp_path):
    """``deepspeed --module lins_ds.run SCRIPT``: lins_ds imported first, then the script by path."""
    launch(deepspeed_launcher()[:-1] + ["29652", "--module", "lins_ds.run", EXAMPLE] + ARGS, tmp_path)


def test_torchrun_runs_the_example_by_path(tmp_path):
    launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29653",
            EXAMPLE] + ARGS, tmp_path)


def test_running_a_file_inside_the_package_does_not_shadow_the_standard_library(tmp_path):
    """A file run by path puts its folder first on sys.path; no folder of lins_ds may shadow a stdlib module."""
    import lins_ds

    pkg = os.path.dirname(lins_ds.__file__)
    stdlib = set(sys.stdlib_module_names)
    for folder, dirs, files in os.walk(pkg):
        names = {d for d in dirs} | {f[:-3] for f in files if f.endswith(".py")}
        assert not (names & stdlib), (folder, sorted(names & stdlib))
