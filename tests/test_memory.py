"""Memory truth on CPU: the activation probe, selective checkpointing in the solver and the runtime, the guard."""

import pytest
import torch

import lins_ds  # noqa: F401
from helpers import GAS, GPUS_PER_NODE, WORLD, max_err, param_groups, reference, run, state, tiny_llama, train

from lins_ds.plan import (BUILTIN_MODELS, MemorySpec, Topology, TrainingSpec, candidates,
                          get_cluster, solve)
from lins_ds.plan import cost
from lins_ds.plan.memory import ActivationProfile, formula_activations, memory

transformers = pytest.importorskip("transformers")


def probe_tiny(dtype=torch.float32, meta=False):
    from lins_ds.runtime.memory import memory_probe

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=512, max_position_embeddings=128)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    ids = [id(p) for p in model.parameters()]
    prof = memory_probe.probe(model, list(model.model.layers), 2, 64, 512, torch.device("cpu"))
    return prof, model, ids


def test_probe_measures_what_a_layer_and_the_head_keep():
    prof, _, _ = probe_tiny()
    assert prof.source == "measured:saved-tensors" and prof.tokens == 128
    assert prof.layer_saved > 20 * prof.layer_saved_ckpt > 0  # checkpointed: little more than the input
    assert prof.layer_saved_ckpt >= 128 * 64 * 4  # the layer input, fp32
    assert prof.head_peak > 128 * 512 * 4  # at least the fp32 logits
    half, _, _ = probe_tiny(torch.bfloat16)
    assert 0.4 < half.layer_saved / prof.layer_saved < 0.75  # bf16 halves most of it (norms upcast to fp32)


def test_probe_drops_a_kv_cache_handed_to_the_layer_by_position():
    """GPT-2's blocks take the cache second, positionally: kept, the plain run appended its keys to it and the
    checkpointed run attended to them and failed (on every GPU start-up of a GPT-2 under Lins)."""
    from lins_ds.runtime.memory import memory_probe

    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128)
    for attn in ("sdpa", "eager"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
        prof = memory_probe.probe(model, list(model.transformer.h), 2, 64, 512, torch.device("cpu"))
        assert prof.layer_saved > 20 * prof.layer_saved_ckpt >= 20 * 128 * 64 * 4, attn


def test_probe_runs_a_meta_built_model_without_materialising_it():
    real, _, _ = probe_tiny()
    meta, model, ids = probe_tiny(meta=True)
    assert meta == real
    assert all(p.is_meta for p in model.parameters()) and [id(p) for p in model.parameters()] == ids


def test_activation_peak_falls_with_checkpointed_units():
    model, train, topo = BUILTIN_MODELS["llama-7b"], TrainingSpec(2048, 1), Topology(1, 8)
    layout = candidates(topo)[-1]
    mems = [memory(model, train, MemorySpec(80), topo, layout, k) for k in range(33)]
    peaks = [m.allocated_gb for m in mems]
    # to the last unit: checkpointing the top unit too saves nothing, it is recomputed at once
    assert all(a >= b for a, b in zip(peaks[:-1], peaks[1:-1]))
    assert mems[0].terms["activations"] > 3 * mems[-1].terms["activations"]


def _setting(ckpt=None):
    topo = Topology(1, 2)
    model, train = BUILTIN_MODELS["llama-1b"], TrainingSpec(2048, 4, 2, activation_checkpointing=ckpt)
    cluster = get_cluster("h200-emulated")
    return topo, model, train, cluster.table(cost.required_meshes(topo, candidates(topo))), cluster.compute()


def test_solver_checkpoints_only_as_many_units_as_the_budget_needs():
    topo, model, train, table, compute = _setting()
    layout = solve(model, topo, train, MemorySpec(1000), table, compute).plan.layout
    none, full = (memory(model, train, MemorySpec(1), topo, layout, k).total_gb for k in (0, model.num_layers))
    budget = (none + full) / 2  # full checkpointing is more than this budget needs, none does not fit
    sol = solve(model, topo, train, MemorySpec(budget), table, compute, layouts=[layout])
    k = sol.plan.activation_checkpointing_units
    assert 0 < k < model.num_layers and sol.plan.to_json()["activation_checkpointing_units"] == k
    assert memory(model, train, MemorySpec(budget), topo, layout, k - 1).total_gb > budget  # k is the fewest
    assert sol.best.recompute_s < solve(model, topo, _setting(True)[2], MemorySpec(budget), table, compute,
                                        layouts=[layout]).best.recompute_s


def test_a_measured_profile_changes_the_plan_the_formula_would_pick():
    topo, model, train, table, compute = _setting()
    formula = formula_activations(model, train)
    heavier = ActivationProfile("measured:test", formula.tokens, 1.5 * formula.layer_saved, formula.layer_saved_ckpt,
                                formula.layer_transient, 2 * formula.head_peak)
    a = solve(model, topo, train, MemorySpec(40), table, compute)
    b = solve(model, topo, train, MemorySpec(40), table, compute, activations=heavier)
    assert b.plan.memory_profile == "measured:test" and a.plan.memory_profile == "formula"
    assert b.best.memory.terms["activations"] > a.best.memory.terms["activations"]


def test_guard_names_the_excess_and_a_plan_that_fits():
    from lins_ds.runtime.memory.memory_guard import verdict
    from lins_ds.plan.context import SolveContext

    topo, model, train, table, compute = _setting()
    ctx = SolveContext(model, topo, train, MemorySpec(40), table, compute, candidates(topo), "step", None)
    plan = ctx.solve().plan
    ok, msg = verdict(plan, plan.predicted_peak_gb, plan.predicted_peak_gb + 9, 40, 2.0, ctx.solve)
    assert not ok and "measured peak" in msg and "predicted" in msg and "of 40 GiB (lins.gpu_memory_gb)" in msg
    over, msg = verdict(plan, 38.0, 60.0, 40, 2.0, ctx.solve)  # 38 x 1.05 + 2 = 41.9
    assert over and "1.90 GiB more than lins.gpu_memory_gb = 40" in msg
    assert "A plan that would fit" in msg and '"plan": {"p": [' in msg
    fits = ctx.solve(40 - (38.0 * 1.05 + 2.0 - plan.memory_gb)).plan
    assert str(fits.layout) in msg
    # a budget below the card holds the allocator to it: what the allocator held is judged, not the margin
    over, msg = verdict(plan, plan.predicted_peak_gb, 39.0, 40, 2.0, ctx.solve, capped=True)  # 39 + 2 = 41
    assert over and "1.00 GiB more than lins.gpu_memory_gb = 40" in msg and "39.00 held by the allocator" in msg
    ok, msg = verdict(plan, 37.2, 37.5, 40, 2.0, ctx.solve, capped=True)  # 37.2 x 1.05 + 2 > 40, but 37.5 + 2 fits
    assert not ok and "39.50 of 40 GiB (lins.gpu_memory_gb) held by the allocator" in msg


# --- the runtime: k of N units checkpointed, exactly the same training ----------------------------------
def checkpointed_runs(ref, plans):
    import deepspeed

    out = []
    for lins in plans:
        model = tiny_llama()
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(param_groups(model)),
            config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
                    "zero_optimization": {"stage": 0}, "lins": {"gpus_per_node": GPUS_PER_NODE, **lins}})
        states = train(engine, after_step=state)
        flags = [m.gradient_checkpointing for m in model.model.layers]
        out.append((engine.lins.plan.to_json(), flags, max(max_err(s, r) for s, r in zip(states, ref))))
        engine.destroy()
    return out


def test_runtime_checkpoints_the_first_k_units_and_trains_exactly(tmp_path):
    plans = [{"plan": {"p": [2, 1], "g": [2, 2], "os": [2, 2]}, "activation_checkpointing": 1},
             {"plan": "solve", "profile": "synthetic", "memory_profile": "measure", "seq_len": 8,
              "profile_cache": str(tmp_path / "profiles"),
              "gpu_memory_gb": 0.0004, "reserved_gb": 0}]
    (fixed, fixed_flags, fixed_err), (solved, _, solved_err) = run(checkpointed_runs, WORLD, reference("llama"),
                                                                   plans, gpus_per_node=GPUS_PER_NODE)[0]
    assert fixed["activation_checkpointing_units"] == 1 and fixed["num_layers"] == 2
    assert fixed_flags == [True, False] and fixed_err <= 1e-5
    assert solved["memory_profile"] == "measured:saved-tensors" and solved_err <= 1e-5
    assert "activation_checkpointing_units" in solved


# --- no parameter copy beyond DeepSpeed ZeRO-1's ----------------------------------------------------------------
def live_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (what an allocator would hold)."""
    import gc

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage.data_ptr() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def held_at_backward_start(lins: bool):
    """Live bytes when the second step's backward starts (activations at their largest) and after that step."""
    import deepspeed

    from helpers import batch

    model = tiny_llama()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 0 if lins else 1}, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    if lins:
        cfg["lins"] = {"plan": {"p": [1, 1], "g": [1, 1], "os": [1, 1]}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out = {}
    for step in range(2):
        x = batch(step, 0, 0, 96)
        loss = engine(input_ids=x, labels=x).loss
        out["backward start"] = live_bytes()
        engine.backward(loss)
        engine.step()
        out["after the step"] = live_bytes()
    engine.destroy()
    return out


def test_the_replicated_layout_holds_no_more_than_zero1():
    """Lins' replicated layout keeps params, fp32 master and Adam moments as ZeRO-1 does; its gradient accumulator
    exists only from the backward's first gradient to the step (a persistent one cost a parameter copy)."""
    lins = run(held_at_backward_start, 1, True)[0]
    zero1 = run(held_at_backward_start, 1, False)[0]
    for moment in lins:
        assert lins[moment] <= zero1[moment] * 1.01, (moment, lins, zero1)


def test_the_loss_backward_does_not_hold_the_output_embedding_grad():
    """The head's weight gradient is made after the loss's fp32 tensors are gone (the probe's head peak holds its
    making): the head phase does not add it; the later phases, where it waits for the root's reduction, do."""
    from lins_ds.plan.memory import backward_phases
    from lins_ds.plan.topology import Factor, Layout

    model, train, topo = BUILTIN_MODELS["llama-1b"], TrainingSpec(2048, 2, 2), Topology(1, 1)
    one = Factor(1, 1)
    acts = formula_activations(model, train)
    units = len(model.unit_params())
    phases = backward_phases(model, train, topo, Layout(one, one, one), model.num_layers, acts, host_grad_units=units)
    head_grad = model.vocab * model.hidden * train.param_bytes
    assert phases["head"]["grad_buffers"] == 0
    assert phases["recompute"]["grad_buffers"] >= head_grad and phases["end"]["grad_buffers"] >= head_grad


def test_a_budget_below_the_card_caps_the_allocator(monkeypatch):
    from lins_ds.runtime.memory import memory_guard

    got = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 140 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: got.append(f))
    cuda = torch.device("cuda", 0)
    # the budget less the reserve (2 GiB on GPUs by default, lins.reserved_gb where given): outside the allocator
    assert memory_guard.cap_allocator(80.0, cuda) == pytest.approx(78 / 140) and got == [pytest.approx(78 / 140)]
    assert memory_guard.cap_allocator(80.0, cuda, reserved=5.0) == pytest.approx(75 / 140)
    got.pop()
    assert memory_guard.cap_allocator(None, cuda) is None and memory_guard.cap_allocator(140.0, cuda) is None
    assert memory_guard.cap_allocator(80.0, torch.device("cpu")) is None and len(got) == 1


def test_the_probe_measures_a_long_sequence_at_a_length_whose_head_fits(monkeypatch):
    """A 64k-token Llama-3 head needs 31 GiB for the loss's fp32 copy alone: measured at full length beside the model,
    the probe ran out of memory where the plan fitted (one H100, Llama-3-8B widths, lins.gpu_memory_gb 79). The probe
    halves the length until the head's seq x vocab tensors take at most half the free memory; the fitted profile
    scales back to the length planned for."""
    from lins_ds.runtime.memory import memory_probe

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (26 * 2**30, 80 * 2**30))
    n = memory_probe.probe_length(65536, 1, 128256, cuda)
    assert n == 4096 and n * 128256 * memory_probe.HEAD_BYTES_PER_LOGIT <= 13 * 2**30 < 2 * n * 128256 * 14
    assert memory_probe.probe_length(2048, 1, 128256, cuda) == 2048  # fits: measured as asked
    assert memory_probe.probe_length(65536, 1, 128256, torch.device("cpu")) == 65536  # no device memory to run out of
    assert memory_probe.probe_length(64, 4, 10**9, cuda) == 16  # never below what the fit of two lengths needs


def test_the_probe_splits_the_tiled_head_into_a_tile_s_bytes_per_logit_and_the_rest():
    """Under logits tiling the head holds what grows with the tokens, one tile's logits and the lm_head gradient the
    tiles accumulate; two tile counts separate them (``memory_probe.tiled_terms``), and the planner puts them back
    together at any length and tile count (``memory.tiled_head_bytes``)."""
    from lins_ds.plan import load_model
    from lins_ds.plan.memory import tiled_activations, tiled_head_bytes
    from lins_ds.plan.sequence import tiled
    from lins_ds.runtime.memory import memory_probe

    tokens, vocab, hidden = 4096, 1000, 64
    weight = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    base, per_logit = 3.0e6, 17.0
    peaks = [base + weight.numel() * 2 + tokens * vocab * per_logit / t for t in memory_probe.TILE_COUNTS]
    assert memory_probe.tiled_terms(peaks, tokens, weight) == pytest.approx((base, per_logit))

    model = load_model("llama-1b")
    train = TrainingSpec(4096, 1)
    measured = ActivationProfile("measured:test", 2048, 1.0, 1.0, 1.0, 1.0, seq_len=2048,
                                 tiled_head=(base, per_logit))
    assert ActivationProfile.from_json(measured.to_json()) == measured
    assert "tiled_head" not in formula_activations(model, train).to_json()  # a profile without it: as before
    acts = measured.scaled(4096, 4096)
    assert acts.tiled_head == (2 * base, per_logit)  # its base grows with the tokens, a logit's bytes do not
    head = tiled_activations(acts, model, tiled(train, 1, 8)).head_peak
    assert head == pytest.approx(2 * base + 512 * model.vocab * per_logit + model.vocab * model.hidden * 2)
    assert head == pytest.approx(tiled_head_bytes(model, tiled(train, 1, 8), acts.tiled_head))


def test_the_probe_measures_the_tiled_head_and_puts_the_model_s_own_tiling_back():
    from lins_ds.runtime.memory import memory_probe
    from lins_ds.runtime.step import tiling

    model = tiny_llama()
    tiling.apply_tiling(model, 1, 3)
    layers = [m for m in model.model.layers]
    tokens = torch.randint(0, 96, (2, 32))
    out = memory_probe._tiled_head(model, layers, {"input_ids": tokens, "labels": tokens}, torch.device("cpu"),
                                   torch.Tensor)
    assert len(out) == 2 and all(v >= 0 for v in out)
    assert tiling.tiling_of(model).logits_tiles == 3  # the model's tiling is back
    assert memory_probe._tiled_head(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64)), [], {}, torch.device("cpu"), torch.Tensor) == ()


def test_a_timed_layer_sets_the_rate_compute_is_priced_at():
    """The probe times one layer's forward and backward on a GPU (``ActivationProfile.timed``); the solver then prices
    compute at that rate, not the cluster model's assumed share of the peak (which priced a 3B model's backward 1.45x
    longer than it ran, and so the host time it hides). Kept through the cache, a re-size and the fit of two lengths."""
    from lins_ds.plan import context

    topo, model, train, table, _ = _setting()
    base = context.compute_for(table, "h200-emulated")
    flops = 3 * 8192 * model.layer_forward_flops_per_token(4096)
    timed = ActivationProfile("measured:test", 8192, 1.0, 0.1, 0.5, 2.0, seq_len=4096,
                              timed=(flops / (0.55 * 989e12), 8192, 4096))
    fast = context.compute_for(table, "h200-emulated", model, timed)
    assert base.achievable_mfu == 0.35 and fast.achievable_mfu == pytest.approx(0.55)
    assert context.compute_for(table, "h200-emulated", model, None) == base  # not timed (CPU, formula): as before
    broken = ActivationProfile("measured:test", 8192, 1.0, 0.1, 0.5, 2.0, seq_len=4096, timed=(60.0, 8192, 4096))
    assert context.compute_for(table, "h200-emulated", model, broken) == base
    assert "not believable" in context.compute_note(model, broken, base, "h200-emulated")
    note = context.compute_note(model, timed, fast, "h200-emulated")
    assert "544 TFLOP/s, 55 % of 989" in note and "assumes 35 %" in note
    assert context.compute_note(model, None, base, "h200-emulated") == ""
    assert ActivationProfile.from_json(timed.to_json()) == timed
    assert timed.scaled(4096, 2048).timed == timed.timed  # a rate: not stretched with the tokens
    assert "timed" not in ActivationProfile("m", 1, 1.0, 1.0, 1.0, 1.0).to_json()  # written as before it existed
    # the faster rate prices the same plan's backward (and so the recompute, what it hides) shorter
    from lins_ds.plan.solver import compute_seconds

    assert compute_seconds(model, train, fast, 4)[1] == pytest.approx(compute_seconds(model, train, base, 4)[1] * 35 / 55)


def test_a_timing_is_not_a_rate_for_an_moe_layer_or_above_the_peak():
    """The probe's empty weights route every token of an MoE layer to the same experts (a few large GEMMs where
    training runs many small ones); a rate above the peak is a FLOP count that is not the layer's. Both keep the
    cluster's model, and say why."""
    from lins_ds.plan import context
    from lins_ds.plan.model import load_model

    topo, model, train, table, _ = _setting()
    base = context.compute_for(table, "h200-emulated")
    flops = 3 * 8192 * model.layer_forward_flops_per_token(4096)
    above = ActivationProfile("measured:test", 8192, 1.0, 0.1, 0.5, 2.0, seq_len=4096,
                              timed=(flops / (1.2 * 989e12), 8192, 4096))
    assert context.compute_for(table, "h200-emulated", model, above) == base
    moe = load_model("bench/models/family-qwen3-h1024-l28.json")
    moe = type(moe)(**{**moe.__dict__, "experts": 8, "experts_per_token": 2})
    timed = ActivationProfile("measured:test", 8192, 1.0, 0.1, 0.5, 2.0, seq_len=4096,
                              timed=(3 * 8192 * moe.layer_forward_flops_per_token(4096) / (0.5 * 989e12), 8192, 4096))
    assert context.compute_for(table, "h200-emulated", moe, timed) == base
    assert "MoE" in context.compute_note(moe, timed, base, "h200-emulated")


def test_the_probe_times_a_layer_only_on_a_gpu():
    from lins_ds.runtime.memory import memory_probe

    prof, model, _ = probe_tiny()
    assert prof.timed == ()  # CPU: no CUDA events, the cluster's model prices compute
    cpu = torch.device("cpu")
    assert memory_probe.cache_key(model, 2, 64, cpu)["timed"] is False
    # under DeepSpeed's torch_autocast the engine asks for no timing: a profile timed without it is not reused
    cuda = torch.device("cuda")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "get_device_name", lambda device=None: "test")
        assert memory_probe.cache_key(model, 2, 64, cuda, time_layer=False) != memory_probe.cache_key(model, 2, 64, cuda)
    from lins_ds.plan.memory import fitted

    a = ActivationProfile("m", 256, 4.0, 1.0, 1.0, 8.0, seq_len=128, timed=(0.01, 256, 128))
    b = ActivationProfile("m", 128, 2.0, 0.5, 0.5, 4.0, seq_len=64, timed=(0.004, 128, 64))
    assert fitted(a, b).timed == a.timed


@pytest.mark.gpu
def test_the_probe_times_a_layer_on_a_gpu():
    from lins_ds.runtime.memory import memory_probe

    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=8, vocab_size=4096, max_position_embeddings=2048)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).cuda()
    prof = memory_probe.probe(model, list(model.model.layers), 2, 1024, 4096, torch.device("cuda"))
    seconds, tokens, seq = prof.timed
    assert (tokens, seq) == (2048, 1024) and 1e-5 < seconds < 1.0
