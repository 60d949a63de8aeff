"""Every launcher the README names, as a user types it, on CPU: the plan sees 1 node x 2 processes."""

import os
import shutil
import sys

import pytest

from helpers import ROOT, free_port, launch, torchrun

EXAMPLE = os.path.join(ROOT, "examples", "train_llama.py")
ARGS = ["--deepspeed_config", os.path.join(ROOT, "ds_configs", "lins.json"), "--model", "tiny", "--steps", "3",
        "--seq-len", "32"]


def trains(out: str) -> None:
    assert "on 1 node(s) x 2 GPU(s)" in out, out[-4000:]  # the launcher's processes per node were read
    assert "step    3" in out, out[-4000:]


def deepspeed_launcher() -> list:
    exe = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.exists(exe):
        pytest.skip("the deepspeed launcher script is not installed next to this python")
    return [exe, "--num_gpus", "2", "--master_port", str(free_port())]


@pytest.mark.slow
def test_deepspeed_launcher_runs_an_example_script_by_path(tmp_path):
    trains(launch(deepspeed_launcher() + [EXAMPLE] + ARGS, cwd=tmp_path, XDG_CACHE_HOME=str(tmp_path)))


@pytest.mark.slow
def test_deepspeed_launcher_with_module(tmp_path):
    """``deepspeed --module lins_ds.run SCRIPT``: lins_ds imported first, then the script by path."""
    trains(launch(deepspeed_launcher() + ["--module", "lins_ds.run", EXAMPLE] + ARGS, cwd=tmp_path,
                  XDG_CACHE_HOME=str(tmp_path)))


@pytest.mark.slow
def test_torchrun_runs_the_example_by_path(tmp_path):
    trains(launch(torchrun(2) + [EXAMPLE] + ARGS, cwd=tmp_path, XDG_CACHE_HOME=str(tmp_path)))


def test_running_a_file_inside_the_package_does_not_shadow_the_standard_library():
    """A file run by path puts its folder first on sys.path; no folder of lins_ds may shadow a stdlib module."""
    import lins_ds

    pkg = os.path.dirname(lins_ds.__file__)
    stdlib = set(sys.stdlib_module_names)
    for folder, dirs, files in os.walk(pkg):
        names = set(dirs) | {f[:-3] for f in files if f.endswith(".py")}
        assert not (names & stdlib), (folder, sorted(names & stdlib))
