"""What real jobs do that training loops of our own did not (issue 47): hub configs that do not name the sequence
length, code that reads weights right after ``step()`` (EMA, RL weight sync), DeepSpeed's own helpers
(``GatheredParameters``, ``safe_get_full_*``), gradients read at the boundary. Every number is held to DeepSpeed
ZeRO-1's for the same job (fp32, 2 gloo ranks)."""

import time

import pytest
import torch

import lins_ds  # noqa: F401
from helpers import MB, config, run, tiny_llama
from lins_ds import comm

REPLICATED = {"p": [1, 1], "g": [1, 1], "os": [1, 1]}
ZERO1_LIKE = {"p": [1, 1], "g": [1, 1], "os": ["all", 1]}
SHARDED = {"p": ["all", 1], "g": ["all", 1], "os": ["all", 1]}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
TOL = 1e-6


def hub_llama():
    """A tiny LLaMA whose config says what a hub model's does: 131072 positions (Llama-3.1)."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=131072))


def tokens(step, micro, rank, length):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 96, (MB, length), generator=g)


# --- the sequence length comes from the batches --------------------------------------------------------------
def train_lengths(lins, lengths, gas=2):
    """Train on batches of ``lengths[step]`` tokens; (planned length, checkpointed units) after each step, weights."""
    import deepspeed

    rank = torch.distributed.get_rank()
    model = hub_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(lins, optimizer=ADAMW, gradient_accumulation_steps=gas))
    seen = []
    try:
        for step, n in enumerate(lengths):
            for micro in range(gas):
                x = tokens(step, micro, rank, n)
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
            seen.append((engine._lins_solve.train.seq_len, engine.lins.plan.activation_checkpointing_units))
    except Exception as e:  # noqa: BLE001 - the test reads every rank's message
        return str(e), None
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return seen, weights


BUDGET = {"plan": "solve", "profile": "synthetic", "gpu_memory_gb": 0.02}


def test_a_hub_config_trains_at_the_length_of_its_batches():
    """Sized for 131072 tokens nothing fits 0.02 GiB; the start-up plan takes a provisional length (checkpointing its
    layers), the first batches (8 tokens) re-size it (nothing checkpointed), a longer batch later (1024) re-sizes it
    again. The weights equal those of the same job with lins.seq_len given: the plans compute the same numbers."""
    seen, weights = run(train_lengths, 2, BUDGET, [8, 8, 1024], gpus_per_node=2)[0]
    assert seen == [(8, 0), (8, 0), (1024, 0)], seen
    _, given = run(train_lengths, 2, {**BUDGET, "seq_len": 1024}, [8, 8, 1024], gpus_per_node=2)[0]
    assert max((weights[k] - given[k]).abs().max().item() for k in given) <= TOL


def test_a_batch_no_plan_fits_fails_on_every_rank_naming_the_key():
    lins = {**BUDGET, "gpu_memory_gb": 0.006, "tiling": False}
    msgs = [m for m, _ in run(train_lengths, 2, lins, [8, 1024], gpus_per_node=2)]
    for m in msgs:
        assert "no plan fits in 0.006 GiB" in m and "sequence length 1024" in m and "lins.seq_len" in m, m


def test_a_batch_that_fits_only_tiled_trains_tiled():
    """The same batch with lins.tiling "auto" (the default): the re-size for its length tiles the logits (and the
    MLPs) where no plan fits untiled, moves onto that plan in memory, and trains on."""
    for seen, weights in run(train_lengths, 2, {**BUDGET, "gpu_memory_gb": 0.006}, [8, 1024], gpus_per_node=2):
        assert isinstance(seen, list) and seen[-1][0] == 1024, seen
        assert all(torch.isfinite(w).all() for w in weights.values())


def test_seq_len_in_the_config_is_kept():
    seen, _ = run(train_lengths, 2, {**BUDGET, "seq_len": 64}, [8, 16], gpus_per_node=2)[0]
    assert seen == [(64, 0), (64, 0)]


# --- weights read right after step() ---------------------------------------------------------------------------
def _slow_host_updates():
    """The host optimizer takes its time (each piece 20 ms late): a read right after step() would see old values."""
    from lins_ds.runtime.step import offload

    update = offload.HostUpdater._update
    offload.HostUpdater._update = lambda self, *a: (time.sleep(0.02), update(self, *a))[1]


def _lazy_param_sync():
    """The P-sync completes only when waited for (a slow link): a read that does not wait sees old values."""
    real = comm.all_gather

    class Lazy:
        def __init__(self, args):
            self.args, self.done = args, False

        def wait(self):
            if not self.done:
                self.done = True
                real(*self.args[0], **{**self.args[1], "async_op": False})

    def all_gather(groups, kind, out, inp, async_op=False, tag=""):
        if kind == "p_sync" and async_op and groups.size(kind) > 1:
            return Lazy(((groups, kind, out, inp), {"tag": tag}))
        return real(groups, kind, out, inp, async_op=async_op, tag=tag)

    comm.all_gather = all_gather


def read_after_step(lins, stage=0, slow=None):
    """Three steps; after each, every parameter read at once (as an EMA or an RL weight sync does), the gradient and
    fp32 master and exp_avg of one weight through DeepSpeed's helpers, and .grad at the boundary."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    if slow is not None:
        slow()
    rank = torch.distributed.get_rank()
    model = tiny_llama()
    cfg = config(lins, optimizer=ADAMW, gradient_accumulation_steps=1)
    if lins is None:
        cfg["zero_optimization"] = {"stage": stage}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    w = dict(engine.module.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    out = []
    for step in range(3):
        x = tokens(step, 0, rank, 8)
        engine.backward(engine(input_ids=x, labels=x).loss)
        grad_attr, grad = w.grad, safe_get_full_grad(w).clone()
        engine.step()
        params = list(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            read = {n: p.detach().clone() for n, p in params}
        out.append({"read": read, "grad": grad, "grad_attr_is_none": grad_attr is None,
                    "fp32": safe_get_full_fp32_param(w).clone(),
                    "exp_avg": safe_get_full_optimizer_state(w, "exp_avg").clone()})
    engine.destroy()
    return out


def _diff(a, b) -> float:
    if isinstance(a, dict):
        return max(_diff(a[k], b[k]) for k in b)
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def zero1():
    return run(read_after_step, 2, None, 1, gpus_per_node=2)[0]


@pytest.mark.parametrize("label,lins,slow", [
    ("replicated", {"plan": REPLICATED}, None),
    ("zero1-like, slow P-sync", {"plan": ZERO1_LIKE}, _lazy_param_sync),
    ("sharded", {"plan": SHARDED}, None),
    ("offloaded, slow host", {"plan": REPLICATED, "offload": {"os": "cpu"}}, _slow_host_updates),
    ("sharded + offloaded", {"plan": SHARDED, "offload": {"os": "cpu", "p": "cpu"}}, _slow_host_updates),
    ("parameters on the host, gradients not", {"plan": REPLICATED, "offload": {"os": "cpu", "p": "cpu", "g": "gpu"}},
     _slow_host_updates),
])
def test_reads_after_step_equal_zero1(zero1, label, lins, slow):
    for rank_out in run(read_after_step, 2, lins, 0, slow, gpus_per_node=2):
        for step, (ours, ref) in enumerate(zip(rank_out, zero1)):
            assert ours["grad_attr_is_none"], (label, step)  # as ZeRO-1: the window's gradient left .grad
            for key in ("read", "grad", "fp32", "exp_avg"):
                assert _diff(ours[key], ref[key]) <= TOL, (label, step, key, _diff(ours[key], ref[key]))


def sharded_reads():
    """Outside forward a partitioned parameter is ZeRO-3's empty tensor (never freed memory), its shape in ds_shape;
    GatheredParameters with modifier_rank writes a change back for good."""
    import deepspeed

    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config({"plan": SHARDED}, optimizer=ADAMW))
    w = engine.module.lm_head.weight
    seen = {"numel": w.numel(), "ds_shape": tuple(w.ds_shape)}
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        seen["gathered"] = tuple(w.shape)
        if torch.distributed.get_rank() == 0:
            w.data.fill_(0.5)
    with deepspeed.zero.GatheredParameters([w]):
        seen["kept"] = w.detach().clone()
    seen["after"] = w.numel()
    engine.destroy()
    return seen


def test_a_partitioned_parameter_reads_as_zero3s():
    for seen in run(sharded_reads, 2, gpus_per_node=2):
        assert seen["numel"] == 0 and seen["ds_shape"] == (96, 32) and seen["gathered"] == (96, 32)
        assert seen["after"] == 0 and torch.equal(seen["kept"], torch.full((96, 32), 0.5))


def state_dict_on_rank0_only():
    import deepspeed

    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config({"plan": SHARDED}, optimizer=ADAMW))
    msg = "no error"
    if torch.distributed.get_rank() == 0:
        try:
            engine.module.state_dict()
        except RuntimeError as e:
            msg = str(e)
    torch.distributed.barrier()
    engine.destroy()
    return msg


def test_state_dict_on_one_rank_fails_clearly(monkeypatch):
    monkeypatch.setenv(comm.ARRIVE_TIMEOUT_ENV, "2")
    msg = run(state_dict_on_rank0_only, 2, gpus_per_node=2)[0]
    assert "Every one of them must call it" in msg and "within 2 s" in msg and "state_dict()" in msg, msg


# --- an engine without an optimizer (TRL's reference models) ----------------------------------------------------
def forward_only(lins):
    """A frozen model under deepspeed.initialize without an optimizer: its outputs are the model's own."""
    import deepspeed

    model, reference = tiny_llama(), tiny_llama()
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = config(lins)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    engine.eval()
    x = tokens(0, 0, torch.distributed.get_rank(), 8)
    with torch.no_grad():
        diff = (engine(input_ids=x).logits - reference(input_ids=x).logits).abs().max().item()
    out = (type(engine).__name__, str(engine.lins.plan.layout), diff, engine.optimizer is None)
    engine.destroy()
    return out


@pytest.mark.parametrize("lins,layout", [({"plan": "solve", "profile": "synthetic"}, "P=1x1 G=1x1 OS=1x1"),
                                         ({"plan": SHARDED}, "P=2x1 G=2x1 OS=2x1")])
def test_an_engine_without_an_optimizer_is_the_model_forward_only(lins, layout):
    for name, got, diff, no_optimizer in run(forward_only, 2, lins, gpus_per_node=2):
        assert name == "LinsEngine" and got == layout and no_optimizer and diff == 0.0


def uneven_generation():
    """Under a plan that partitions the parameters, rank 0 stops generating after 2 tokens, rank 1 after 6: every
    forward gathers over both ranks, so rank 1 needs rank 0 to keep joining (transformers' synced_gpus)."""
    import deepspeed

    model, reference = tiny_llama(), tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config({"plan": SHARDED}, optimizer=ADAMW))
    rank = torch.distributed.get_rank()
    x, n = tokens(0, 0, rank, 4), 2 if rank == 0 else 6
    kwargs = {"max_new_tokens": n, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        got = engine.module.generate(x, **kwargs)
        want = reference.generate(x, **kwargs)
    flagged = all(getattr(m, "_is_fsdp_managed_module", False) for m in engine.module.modules())  # a wrapper's too
    engine.destroy()
    return got.shape[1], torch.equal(got, want), flagged


def test_generation_keeps_ranks_in_step_under_a_partitioned_plan():
    assert run(uneven_generation, 2, gpus_per_node=2, timeout=120) == [(6, True, True), (10, True, True)]


# --- ZeRO habits --------------------------------------------------------------------------------------------
def zero_grad_in_the_window(lins):
    """gas 2: the first micro-batch's gradients are dropped by engine.zero_grad(), as DeepSpeed drops them."""
    import deepspeed

    rank = torch.distributed.get_rank()
    model = tiny_llama()
    cfg = config(lins, optimizer=ADAMW, gradient_accumulation_steps=2)
    if lins is None:
        cfg["zero_optimization"] = {"stage": 1}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(2):
        for micro in range(2):
            x = tokens(step, micro, rank, 8)
            engine.backward(engine(input_ids=x, labels=x).loss)
            if micro == 0:
                engine.zero_grad()
            engine.step()
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return state


@pytest.mark.parametrize("lins", [{"plan": REPLICATED}, {"plan": SHARDED},
                                  {"plan": REPLICATED, "offload": {"os": "cpu", "p": "cpu", "g": "gpu"}}])
def test_zero_grad_inside_a_window_drops_its_gradients_as_deepspeed_does(lins):
    zero1 = run(zero_grad_in_the_window, 2, None, gpus_per_node=2)[0]
    ours = run(zero_grad_in_the_window, 2, lins, gpus_per_node=2)[0]
    assert _diff(ours, zero1) <= TOL


def test_the_batch_length_is_its_tokens_per_sequence_of_the_micro_batch():
    from lins_ds.runtime.startup.seq_len import batch_length

    ids = torch.zeros(2, 512, dtype=torch.long)
    assert batch_length((), {"input_ids": ids}, 2) == 512
    assert batch_length((), {"input_ids": torch.zeros(1, 1024, dtype=torch.long)}, 2) == 512  # packed, padding-free
    assert batch_length((), {"inputs_embeds": torch.zeros(2, 64, 32)}, 2) == 64
    assert batch_length((ids,), {}, 2) == 512
    assert batch_length((torch.zeros(2, 3, 224, 224),), {"attention_mask": torch.ones(2, 1, 8, 8)}, 2) is None


def parameter_count(lins, slow):
    """transformers' num_parameters (the Trainer's FLOP count calls it after every micro-step) counts a partitioned
    parameter whole, and waits for nothing."""
    import deepspeed

    if slow is not None:
        slow()
    model = tiny_llama()
    want = model.num_parameters()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(lins, optimizer=ADAMW, gradient_accumulation_steps=1))
    x = tokens(0, 0, torch.distributed.get_rank(), 8)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    pending = engine.lins._reads_pending
    got = engine.module.num_parameters(), engine.module.num_parameters(exclude_embeddings=True)
    still = engine.lins._reads_pending
    engine.destroy()
    return want, got, pending, still


@pytest.mark.parametrize("lins,slow", [({"plan": SHARDED}, None), ({"plan": ZERO1_LIKE}, _lazy_param_sync)])
def test_num_parameters_counts_whole_and_waits_for_nothing(lins, slow):
    want, (total, no_embeddings), pending, still = run(parameter_count, 2, lins, slow, gpus_per_node=2)[0]
    assert total == want and no_embeddings == want - 96 * 32
    assert still == pending and (pending or slow is None)  # what was in flight is left in flight


def checkpoint_habits(tmp):
    """load_checkpoint of a directory that does not exist is DeepSpeed's (None, None); exclude_frozen_parameters
    leaves the frozen base out; DeepSpeed's zero_to_fp32 reads the checkpoint."""
    import os

    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config({"plan": SHARDED}, optimizer=ADAMW))
    missing = engine.load_checkpoint(f"{tmp}/never-saved")
    engine.save_checkpoint(f"{tmp}/full")
    engine.save_checkpoint(f"{tmp}/lora-like", exclude_frozen_parameters=True)
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    out = {"missing": missing, "state": state}
    if torch.distributed.get_rank() == 0:
        size = lambda d: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)  # noqa: E731
        out["sizes"] = (size(f"{tmp}/full"), size(f"{tmp}/lora-like"))
        out["fp32"] = get_fp32_state_dict_from_zero_checkpoint(f"{tmp}/full")
        out["fp32_excluded"] = sorted(get_fp32_state_dict_from_zero_checkpoint(f"{tmp}/lora-like"))
        out["script"] = os.path.isfile(f"{tmp}/full/zero_to_fp32.py")
    return out


def test_checkpoint_habits_of_deepspeed(tmp_path):
    out = run(checkpoint_habits, 2, str(tmp_path), gpus_per_node=2)[0]
    assert out["missing"] == (None, None)
    full, lora_like = out["sizes"]
    assert lora_like < full - 96 * 32 * 4 * 0.9  # the frozen embedding (96 x 32 fp32) is not in it
    assert _diff(out["fp32"], out["state"]) == 0.0 and "model.embed_tokens.weight" not in out["fp32_excluded"]
    assert out["script"]


# --- a model loaded while a Lins TrainingArguments is alive -------------------------------------------------------
def resized_then_trained(path, lins):
    """from_pretrained with a Lins (or ZeRO-1) TrainingArguments alive, resize_token_embeddings before
    deepspeed.initialize (a pad token added), two steps; then from_pretrained again in the same process."""
    import deepspeed
    import transformers

    cfg = config(lins, optimizer=ADAMW, gradient_accumulation_steps=1)
    if lins is None:
        cfg["zero_optimization"] = {"stage": 1}
    args = transformers.TrainingArguments(output_dir=path, deepspeed=cfg, report_to=[],  # noqa: F841
                                          per_device_train_batch_size=MB)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(100, mean_resizing=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = torch.distributed.get_rank()
    for step in range(2):
        x = tokens(step, 0, rank, 8)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    again = transformers.AutoModelForCausalLM.from_pretrained(path)
    return state, any(p.is_meta for p in again.parameters())


def test_a_model_resized_before_initialize_trains_as_under_zero1(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    zero1, _ = run(resized_then_trained, 2, str(tmp_path), None, gpus_per_node=2)[0]
    for plan in (REPLICATED, SHARDED):
        ours, meta_again = run(resized_then_trained, 2, str(tmp_path), {"plan": plan}, gpus_per_node=2)[0]
        assert ours["lm_head.weight"].shape == (100, 32) and not meta_again
        assert _diff(ours, zero1) <= TOL
