"""Installed, lins_ds makes a config's "lins" block the switch: unmodified DeepSpeed scripts build a LinsEngine
under every launcher, LINS_DS_AUTOLOAD=0 turns it off loudly, and the start-up hook costs nothing measurable."""

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT, cpu_env, free_port, launch, torchrun

SCRIPT = '''
import json, sys
import deepspeed, torch
deepspeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=sys.argv[-1])
rank = torch.distributed.get_rank()
g = torch.Generator().manual_seed(rank)
losses = []
for step in range(3):
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
weights = [v.sum().item() for v in engine.module.state_dict().values()]  # the state dict waits for the P-sync
with open(f"result-{rank}.json", "w") as f:
    json.dump({"engine": type(engine).__name__, "losses": losses, "weights": weights}, f)
deepspeed.comm.destroy_process_group()
'''
BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
LINS = {**BASE, "zero_optimization": {"stage": 0},
        "lins": {"plan": {"p": [1, 1], "g": [2, 1], "os": [2, 1]}, "unit_modules": ["Linear"]}}
ZERO1 = {**BASE, "zero_optimization": {"stage": 1}}


def installed() -> bool:
    """lins_ds installed with its start-up hook (what a user gets from pip), not only importable from here."""
    probe = "import sys; print('lins_ds_autoload' in sys.modules)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=cpu_env(PYTHONPATH=""),
                           cwd="/").stdout.strip() == "True"


needs_install = pytest.mark.skipif(not installed(), reason="lins_ds is not pip-installed (no lins_ds_autoload.pth)")


def results(folder) -> dict:
    """What each rank of the last run wrote (and remove it)."""
    out = {}
    for rank in (0, 1):
        path = folder / f"result-{rank}.json"
        out[rank] = json.loads(path.read_text())
        path.unlink()
    return out


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    (d / "train.py").write_text(SCRIPT)
    for name, cfg in (("lins", LINS), ("zero1", ZERO1)):
        (d / f"{name}.json").write_text(json.dumps(cfg))
    return d


def run_plain(script, launcher: list, config: str, **env) -> tuple:
    out = launch(launcher + [str(script / "train.py"), str(script / f"{config}.json")], cwd=script, **env)
    return results(script), out


@needs_install
@pytest.mark.slow
def test_an_unmodified_script_under_torchrun_builds_lins_and_trains_like_zero1(script):
    lins, printed = run_plain(script, torchrun(2), "lins")
    zero1, _ = run_plain(script, torchrun(2), "zero1")
    assert {r["engine"] for r in lins.values()} == {"LinsEngine"} and len(lins) == 2
    assert "the config's \"lins\" block builds a LinsEngine" in printed
    for rank in (0, 1):
        assert max(abs(a - b) for a, b in zip(lins[rank]["losses"], zero1[rank]["losses"])) <= 1e-6
        assert max(abs(a - b) for a, b in zip(lins[rank]["weights"], zero1[rank]["weights"])) <= 1e-5


@needs_install
@pytest.mark.slow
def test_an_unmodified_script_under_the_deepspeed_launcher_builds_lins(script):
    exe = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.exists(exe):
        pytest.skip("the deepspeed launcher script is not installed next to this python")
    got, _ = run_plain(script, [exe, "--num_gpus", "2", "--master_port", str(free_port())], "lins")
    assert {r["engine"] for r in got.values()} == {"LinsEngine"} and len(got) == 2


@needs_install
@pytest.mark.slow
def test_autoload_off_trains_plain_deepspeed_and_says_so(script):
    got, printed = run_plain(script, torchrun(2), "lins", LINS_DS_AUTOLOAD="0")
    assert {r["engine"] for r in got.values()} == {"DeepSpeedEngine"}
    assert printed.count("WARNING lins_ds: this DeepSpeed config has a \"lins\" block") == 1  # rank 0 only
    assert "Lins is off (LINS_DS_AUTOLOAD=0 and the program does not import lins_ds)" in printed
    # importing lins_ds turns it on whatever the variable says
    got, _ = run_plain(script, torchrun(2) + ["-m", "lins_ds.run"], "lins", LINS_DS_AUTOLOAD="0")
    assert {r["engine"] for r in got.values()} == {"LinsEngine"}


@needs_install
def test_the_start_up_hook_imports_nothing_but_itself_and_costs_under_5_ms():
    probe = ("import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('lins_ds', 'lins_ds_autoload', 'torch', 'deepspeed', 'transformers', 'accelerate')))")
    env = cpu_env(PYTHONPATH="")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                          cwd="/").stdout.strip() == "['lins_ds_autoload']"
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: compiled once, then read from its .pyc
    costs = []
    for _ in range(3):
        timing = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                                env=env, cwd="/").stderr
        line = next(ln for ln in timing.splitlines() if re.search(r"\|\s+lins_ds_autoload$", ln.rstrip()))
        costs.append(int(line.split("|")[1]))  # cumulative microseconds: the hook and all it imports
    assert min(costs) < 5000, costs


def test_lins_is_on_unless_the_variable_turns_it_off(monkeypatch):
    import lins_ds_autoload as hook

    monkeypatch.setattr(hook, "explicit", False)
    for value, on in (("0", False), ("false", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv(hook.ENV, value)
        assert hook.lins_on() is on, value
    monkeypatch.setattr(hook, "explicit", True)  # the program imported lins_ds: on whatever the variable says
    assert hook.lins_on()


def test_importing_lins_ds_after_transformers_is_the_programs_own_import():
    """transformers' import brings lins_ds in through the hook first; the program's own `import lins_ds` (or `from
    lins_ds import ...`) afterwards finds it loaded, and must still count: Lins is on with LINS_DS_AUTOLOAD=0."""
    code = ("import transformers.modeling_utils, lins_ds_autoload as h, sys\n"
            "before = ('lins_ds' in sys.modules, h.lins_on())\n"
            "import json\n"
            "unrelated = h.lins_on()\n"
            "from lins_ds import init\n"
            "print(before, unrelated, h.lins_on())\n")
    env = {**os.environ, "LINS_DS_AUTOLOAD": "0", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/").stdout
    assert out.strip().endswith("(True, False) False True"), out
