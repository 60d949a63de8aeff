"""Issue 58: calls real jobs make that training loops of our own did not — two ``engine.backward`` over one forward,
a forward, ``generate`` or ``state_dict()`` on one rank only, accelerate's in-script DeepSpeed plugin, a Lins
checkpoint loaded by plain DeepSpeed, the tensors ``state_dict()`` returns. Each is held to DeepSpeed ZeRO-1's
behaviour, or, where that cannot hold, to a clear error on every rank within seconds (fp32, 2 gloo ranks)."""

import json
import sys
import time

import pytest
import torch

import lins_ds  # noqa: F401
from helpers import MB, config, launch, run, tiny_llama, torchrun
from lins_ds import comm

REPLICATED = {"p": [1, 1], "g": [1, 1], "os": [1, 1]}
ZERO1_LIKE = {"p": [1, 1], "g": [1, 1], "os": ["all", 1]}
SHARDED = {"p": ["all", 1], "g": ["all", 1], "os": ["all", 1]}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
FAST = 60  # seconds: a rank still running after this is a hang, named by helpers.run


def tokens(step, micro, rank, length=8):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 96, (MB, length), generator=g)


def engine_for(lins, gas=1, optimizer=ADAMW, **extra):
    import deepspeed

    model = tiny_llama()
    cfg = config(lins, gradient_accumulation_steps=gas, **extra)
    if optimizer is not None and not callable(optimizer):
        cfg["optimizer"] = optimizer
    if lins is None:
        cfg["zero_optimization"] = {"stage": 1}
        cfg["zero_allow_untested_optimizer"] = True
    opt = optimizer(model.parameters()) if callable(optimizer) else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=opt, config=cfg)
    return engine


def _diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


# --- 1. two engine.backward calls over one forward ---------------------------------------------------------------
def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def two_backwards(lins, gas, split):
    """Two optimizer steps of ``gas`` micro-batches; each micro-batch's loss l1 + l2 given to the engine as two
    backwards over one forward (``split``) or as one."""
    rank = torch.distributed.get_rank()
    engine = engine_for(lins, gas, optimizer=sgd)
    for step in range(2):
        for micro in range(gas):
            x = tokens(step, micro, rank)
            out = engine(input_ids=x, labels=x)
            l1, l2 = out.loss, out.logits.float().pow(2).mean() * 0.1
            if split:
                engine.backward(l1, retain_graph=True)
                engine.backward(l2)
            else:
                engine.backward(l1 + l2)
            engine.step()
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return state


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("plan", [SHARDED, REPLICATED], ids=["sharded", "replicated"])
def test_two_backwards_over_one_forward_sum_their_gradients_as_zero1_does_one(plan, gas):
    """DeepSpeed calls the optimizer's backward prologue once per forward: the second backward found the root unit
    released (P sharded: setStorage ... storage of size 0) or its gradients dropped (replicated: only the first
    backward's counted). ZeRO-1 itself keeps only the last backward's gradient at a window's end unless
    ``coalesce_grad_reduction`` is used; the sum, as torch computes it, is what both mean."""
    zero1 = run(two_backwards, 2, None, gas, False, gpus_per_node=2, timeout=FAST)[0]
    ours = run(two_backwards, 2, {"plan": plan}, gas, True, gpus_per_node=2, timeout=FAST)[0]
    assert _diff(ours, zero1) <= 1e-6


def plain_second_backward(lins):
    """engine.backward, then a plain loss.backward() over the same forward: DeepSpeed tells the optimizer of neither
    its start nor its end."""
    rank = torch.distributed.get_rank()
    engine = engine_for(lins)
    x = tokens(0, 0, rank)
    out = engine(input_ids=x, labels=x)
    engine.backward(out.loss, retain_graph=True)
    try:
        out.logits.float().pow(2).mean().backward()
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    engine.destroy()
    return msg


@pytest.mark.parametrize("plan", [SHARDED, REPLICATED], ids=["sharded", "replicated"])
def test_a_plain_second_backward_over_one_forward_fails_naming_engine_backward(plan):
    for msg in run(plain_second_backward, 2, {"plan": plan}, gpus_per_node=2, timeout=FAST):
        assert "engine.backward(loss) for every backward" in msg, msg


# --- 2. a call that gathers, made on some ranks only ---------------------------------------------------------------
def one_rank_call(call, other, lins=None, tmp=None):
    """Rank 0 makes ``call``; rank 1 meanwhile does ``other``: "barrier" (waits for rank 0, as after an evaluation on
    rank 0), "train" (its next training forward and backward), "leave" (destroys its engine and ends), or "late <s>"
    (the same call, s seconds later; "late T+1": LINS_ARRIVE_TIMEOUT_S + 1 s). Each rank's error message (or "no
    error"), the seconds it took, the warnings it saw, and what a training forward on every rank says afterwards."""
    import warnings

    rank = torch.distributed.get_rank()
    engine = engine_for(lins or {"plan": SHARDED})
    x = tokens(0, 0, rank)
    engine.backward(engine(input_ids=x, labels=x).loss)  # a step first: the one-rank call comes mid-training
    engine.step()
    calls = {"training forward": lambda: engine(input_ids=x, labels=x),
             "no-grad forward": lambda: torch.no_grad()(engine)(input_ids=x),
             "eval forward": lambda: (engine.eval(), engine(input_ids=x)),
             "generate": lambda: engine.module.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0),
             "state_dict": lambda: engine.module.state_dict(),
             "save": lambda: engine.save_checkpoint(tmp)}
    msg, t0 = "no error", time.monotonic()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            if rank == 0:
                calls[call]()
            elif other == "train":
                engine.backward(engine(input_ids=x, labels=x).loss)
            elif other.startswith("late"):
                delay = other.split()[1]
                time.sleep(comm.arrive_timeout() + 1 if delay == "T+1" else float(delay))
                calls[call]()
        except Exception as e:  # noqa: BLE001 - every rank's message is the test's
            msg = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    warned = [str(w.message) for w in seen if "lins" in str(w.message)]
    if other == "leave" and rank == 1:
        engine.destroy()
        return msg, took, warned, None
    later = "no error"
    if other == "barrier":
        torch.distributed.barrier()
        try:
            engine.train()
            engine(input_ids=x, labels=x)
        except Exception as e:  # noqa: BLE001
            later = str(e)
    engine.destroy()
    return msg, took, warned, later


@pytest.fixture
def short_wait(monkeypatch):
    monkeypatch.setenv(comm.ARRIVE_TIMEOUT_ENV, "3")


def test_the_default_wait_is_seconds_and_the_variable_sets_it(monkeypatch):
    monkeypatch.delenv(comm.ARRIVE_TIMEOUT_ENV, raising=False)
    assert comm.arrive_timeout() == 30.0
    monkeypatch.setenv(comm.ARRIVE_TIMEOUT_ENV, "0")
    assert comm.arrive_timeout() == 0.0  # the check off
    monkeypatch.setenv(comm.ARRIVE_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=comm.ARRIVE_TIMEOUT_ENV):
        comm.arrive_timeout()


ONE_RANK_CALLS = [("no-grad forward", "forward (evaluation"), ("eval forward", "forward (evaluation"),
                  ("generate", "generate()"), ("state_dict", "state_dict()")]


@pytest.mark.parametrize("call,named", ONE_RANK_CALLS)
def test_a_call_that_gathers_on_one_rank_fails_there_within_the_timeout(short_wait, call, named):
    """Rank 1 waits at a barrier for rank 0 (what follows an evaluation on rank 0): rank 0 fails after
    LINS_ARRIVE_TIMEOUT_S, naming the call and the fix, having issued no gather; its P group is then out of step: a
    later forward fails at once on every rank (rank 1's meets rank 0's abandoned call) instead of being matched."""
    (msg0, took0, _, later0), (msg1, _, _, later1) = run(one_rank_call, 2, call, "barrier", gpus_per_node=2,
                                                         timeout=FAST)
    assert named in msg0 and "within 3 s" in msg0 and "GatheredParameters" in msg0 and "every rank" in msg0, msg0
    assert "ArrivalError" in msg0 and 3 <= took0 < 10, (msg0, took0)
    assert msg1 == "no error"
    assert "out of step" in later0, later0
    assert f"rank 0 in {named}" in later1 and "different calls" in later1, later1


@pytest.mark.parametrize("call,named", ONE_RANK_CALLS)
def test_a_one_rank_call_meeting_another_ranks_training_step_fails_on_both_at_once(monkeypatch, call, named):
    """Rank 1 goes on to its next training step: its forward meets rank 0's call, and both fail at once (well
    before the 20 s wait), rank 1 naming rank 0's call; neither gathered anything the other answered."""
    monkeypatch.setenv(comm.ARRIVE_TIMEOUT_ENV, "20")
    lins = {"plan": SHARDED, "seq_len": 8}  # no length agreement at the window's first forward (a world collective)
    (msg0, took0, _, _), (msg1, took1, _, _) = run(one_rank_call, 2, call, "train", lins, gpus_per_node=2,
                                                   timeout=FAST)
    for msg, took in ((msg0, took0), (msg1, took1)):
        assert "different calls" in msg and f"rank 0 in {named}" in msg and "rank 1 in forward (training" in msg, msg
        assert took < 10, took


def test_a_rank_later_than_the_timeout_fails_too_instead_of_hanging(short_wait):
    """Both ranks evaluate, rank 1 LINS_ARRIVE_TIMEOUT_S + 1 s after rank 0 (a legitimately late rank): rank 0 gives
    up after the timeout; rank 1, coming later, reads that from what rank 0 sent and fails too (no gather waits for
    a rank that left)."""
    (msg0, took0, _, _), (msg1, took1, _, _) = run(one_rank_call, 2, "no-grad forward", "late T+1",
                                                   gpus_per_node=2, timeout=FAST)
    assert "within 3 s" in msg0 and 3 <= took0 < 10, (msg0, took0)
    assert "rank 0 stopped waiting" in msg1 and comm.ARRIVE_TIMEOUT_ENV in msg1, msg1
    assert took1 < 3 + 1 + 5, took1  # its own sleep, then at once


@pytest.mark.parametrize("call", ["no-grad forward", "generate", "state_dict"])
def test_a_rank_late_within_the_timeout_is_waited_for(short_wait, call):
    for msg, _, _, later in run(one_rank_call, 2, call, "late 1", gpus_per_node=2, timeout=FAST):
        assert msg == "no error" and later is None or later == "no error", msg


def test_a_training_forward_waits_for_a_late_rank_with_a_warning(short_wait):
    """Train mode with gradients: the partner may be busy alone (rank 0 writing files); rank 0 warns after the timeout
    and waits on."""
    lins = {"plan": SHARDED, "seq_len": 8}  # else the window's first forward agrees on the length first (and waits)
    (msg0, took0, warned0, _), (msg1, _, _, _) = run(one_rank_call, 2, "training forward", "late T+1", lins,
                                                     gpus_per_node=2, timeout=FAST)
    assert msg0 == msg1 == "no error" and took0 >= 4, (msg0, msg1, took0)
    assert any("has waited 3 s" in w and "waits on" in w for w in warned0), warned0


def test_a_save_on_one_rank_fails_clearly_when_the_others_leave(short_wait, tmp_path):
    (msg0, _, _, _), _ = run(one_rank_call, 2, "save", "leave", None, str(tmp_path), gpus_per_node=2, timeout=FAST)
    assert "save_checkpoint()" in msg0 and "every rank" in msg0, msg0


def gathered_on_every_rank(lins):
    """Every rank gathers the model (deepspeed.zero.GatheredParameters); rank 0 alone then runs it, generates and
    reads its state_dict, as under ZeRO-3; the outputs are the model's own."""
    import deepspeed

    rank = torch.distributed.get_rank()
    engine, reference = engine_for(lins), tiny_llama()
    x = tokens(0, 0, rank)
    out, t0 = None, time.monotonic()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        if rank == 0:
            with torch.no_grad():
                logits = engine(input_ids=x).logits
                want = reference(input_ids=x).logits
            kwargs = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
            got = engine.module.generate(x, **kwargs)
            state = engine.module.state_dict()
            out = ((logits - want).abs().max().item(), torch.equal(got, reference.generate(x, **kwargs)),
                   _diff(state, reference.state_dict()))
    took = time.monotonic() - t0
    torch.distributed.barrier()
    engine.destroy()
    return out, took


@pytest.mark.parametrize("plan", [SHARDED, REPLICATED], ids=["sharded", "replicated"])
def test_inside_gathered_parameters_one_rank_runs_the_model_alone(short_wait, plan):
    """The fix the messages name; on a replicated plan (nothing gathers: ZeRO-1's case) one rank alone needs nothing."""
    (out, took), _ = run(gathered_on_every_rank, 2, {"plan": plan}, gpus_per_node=2, timeout=FAST)
    logits_diff, same_tokens, state_diff = out
    assert logits_diff <= 1e-5 and same_tokens and state_diff == 0.0 and took < 3, out


def replicated_one_rank(kind):
    rank = torch.distributed.get_rank()
    engine = engine_for({"plan": REPLICATED})
    x = tokens(0, 0, rank)
    t0 = time.monotonic()
    if rank == 0:
        with torch.no_grad():
            engine(input_ids=x)
        engine.module.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0, synced_gpus=False)
        engine.module.state_dict()
    took = time.monotonic() - t0
    torch.distributed.barrier()
    engine.destroy()
    return took


def test_a_replicated_plan_runs_on_one_rank_at_once_as_zero1_does(short_wait):
    assert run(replicated_one_rank, 2, None, gpus_per_node=2, timeout=FAST)[0] < 3


# --- 3. accelerate's own loop, the Lins config given in the script ---------------------------------------------------
ACCELERATE_SCRIPT = '''
import json

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
       "gradient_clipping": 1.0, "steps_per_print": 1000,
       "lins": {"plan": {"p": [1, 1], "g": [1, 1], "os": ["all", 1]}, "gpus_per_node": 2}}
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
loss = model(torch.randn(2, 8) + accelerator.process_index).sum()
accelerator.backward(loss)
opt.step()
losses = accelerator.gather(loss.detach().reshape(1))
with open(f"result-{accelerator.process_index}.json", "w") as f:
    json.dump([accelerator.num_processes, type(model).__name__, losses.numel()], f)
'''


def _installed() -> bool:
    import subprocess

    from helpers import cpu_env

    probe = "import sys; print('lins_ds_autoload' in sys.modules)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=cpu_env(PYTHONPATH=""),
                          cwd="/").stdout.strip() == "True"


@pytest.mark.slow
@pytest.mark.skipif(not _installed(), reason="lins_ds is not pip-installed (no lins_ds_autoload.pth)")
def test_accelerate_with_a_lins_plugin_built_in_the_script_counts_every_process(tmp_path):
    """Under torchrun, a script that never imports lins_ds and builds its DeepSpeedPlugin from a Lins config dict:
    accelerate counted one process (its CPU bug, which lins_ds fixes for a Lins config: it saw only the Trainer's
    config and accelerate launch's file) and ``gather`` failed."""
    script = tmp_path / "accelerate_loop.py"
    script.write_text(ACCELERATE_SCRIPT)
    launch(torchrun(2) + [str(script)], cwd=str(tmp_path), timeout=300)
    for rank in (0, 1):  # both processes counted, a LinsEngine, and gather's result from each
        assert json.loads((tmp_path / f"result-{rank}.json").read_text()) == [2, "LinsEngine", 2]


# --- 4. a Lins checkpoint loaded by plain DeepSpeed -------------------------------------------------------------------
def lins_checkpoint_under_zero1(tmp):
    """A Lins save, then a ZeRO-1 engine (what accelerate's load_state calls) loading it, by ``latest`` and by tag; a
    ZeRO-1 checkpoint still loads under ZeRO-1."""
    rank = torch.distributed.get_rank()
    engine = engine_for({"plan": SHARDED})
    x = tokens(0, 0, rank)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    engine.save_checkpoint(f"{tmp}/lins", tag="pytorch_model")
    engine.destroy()
    zero1 = engine_for(None)
    seen = []
    for tag in (None, "pytorch_model"):
        try:
            zero1.load_checkpoint(f"{tmp}/lins", tag)
            seen.append("no error")
        except Exception as e:  # noqa: BLE001
            seen.append(f"{type(e).__name__}: {e}")
    zero1.save_checkpoint(f"{tmp}/zero1")
    path, _ = zero1.load_checkpoint(f"{tmp}/zero1")
    return seen, path is not None


def test_plain_deepspeed_loading_a_lins_checkpoint_names_it_and_the_conversion(tmp_path):
    for seen, zero1_loads in run(lins_checkpoint_under_zero1, 2, str(tmp_path), gpus_per_node=2, timeout=FAST):
        assert zero1_loads
        for msg in seen:
            assert "is a Lins checkpoint" in msg and "lins-ds convert" in msg and "load_universal" in msg, msg
            assert "lins-ds consolidate" in msg and "zero_to_fp32.py" in msg and "ZeRO stage 1" in msg, msg


# --- 5. what state_dict() returns ------------------------------------------------------------------------------------
def state_dict_tensors(lins):
    """Whether engine.module.state_dict()'s tensors share the parameters' storage (aliases) and still equal them after a
    step, as ZeRO-1's do."""
    rank = torch.distributed.get_rank()
    engine = engine_for(lins)
    x = tokens(0, 0, rank)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    sd = engine.module.state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    now = {k: v.clone() for k, v in engine.module.state_dict().items()}
    params = dict(engine.module.named_parameters())
    aliases = all(sd[k].data_ptr() == p.data_ptr() and p.numel() for k, p in params.items())
    follows = _diff(sd, now) == 0.0 and _diff(before, now) > 0
    engine.destroy()
    return aliases, follows


@pytest.mark.parametrize("lins,aliases", [(None, True), ({"plan": ZERO1_LIKE}, True), ({"plan": REPLICATED}, True),
                                          ({"plan": SHARDED}, False)],
                         ids=["zero1", "z1-like", "replicated", "sharded"])
def test_state_dict_returns_aliases_where_the_parameters_stay_whole(lins, aliases):
    """Replicated P: the parameters' own tensors, which a step updates in place (ZeRO-1's). Partitioned P: a gathered
    copy, since the full buffer is freed once read (ZeRO-3 gives copies too)."""
    for got in run(state_dict_tensors, 2, lins, gpus_per_node=2, timeout=FAST):
        assert got == (aliases, aliases)
