"""LinsEngine trains exactly like a single process on the global batch, under every valid plan."""

import pytest
import sys, os
sys.path.insert(0, os.path.dirname(__file__))
import torch

import lins_ds  # noqa: F401  (routes deepspeed.initialize to LinsEngine)
from distributed import run
from lins_ds.plan import Topology, TrainingSpec, candidates
from lins_ds.plan.cost import schedule

transformers = pytest.importorskip("transformers")

WORLD, GPUS_PER_NODE, GAS, MB, SEQ, STEPS = 4, 2, 2, 2, 8, 3


def tiny_llama(vocab=96, tied=False, layers=2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=64, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def freeze_some(model):
    model.model.embed_tokens.weight.requires_grad_(False)
    for p in model.model.layers[0].mlp.parameters():
        p.requires_grad_(False)
    return model


def param_groups(model, lr=1e-3):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1, "lr": lr}, {"params": other, "weight_decay": 0.0, "lr": 2 * lr}]


def batch(step, micro, rank, vocab):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, vocab, (MB, SEQ), generator=g)


def reference(make_model, vocab):
    """Single process, AdamW on the global batch: the parameters after each step."""
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model))
    out = []
    for step in range(STEPS):
        for micro in range(GAS):
            for rank in range(WORLD):
                x = batch(step, micro, rank, vocab)
                (model(input_ids=x, labels=x).loss / (GAS * WORLD)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def ds_config(plan, dtype="fp32"):
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 0}, "steps_per_print": 1000,
           "lins": {"plan": plan, "gpus_per_node": GPUS_PER_NODE}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_plans(make_model, vocab, plans):
    import deepspeed
    from lins_ds import comm

    rank = torch.distributed.get_rank()
    ref = reference(make_model, vocab)
    results = []
    for plan in plans:
        model = make_model()
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                                 config=ds_config(plan))
        errors, recorded = [], None
        for step in range(STEPS):
            with comm.recording() as rec:
                for micro in range(GAS):
                    x = batch(step, micro, rank, vocab)
                    engine.backward(engine(input_ids=x, labels=x).loss)
                    engine.step()
            recorded = recorded or rec.counts()
            state = engine.module.state_dict()
            errors.append(max((state[k].float() - v.float()).abs().max().item() for k, v in ref[step].items()))
        expected = {}
        train = TrainingSpec(SEQ, MB, GAS, "fp32")
        for c in schedule(engine.lins.topo, engine.lins.layout, engine.lins.unit_sizes(), train):
            key = (c.op, c.group, c.nbytes)
            expected[key] = expected.get(key, 0) + c.calls
        results.append((plan, errors, recorded, expected, type(engine).__name__, engine.get_global_grad_norm()))
        engine.destroy()
    return results


def as_config(layout):
    return {s: [f.intra, f.inter] for s, f in layout.factors().items()}


ALL_PLANS = [as_config(lay) for lay in candidates(Topology(WORLD // GPUS_PER_NODE, GPUS_PER_NODE))]


def check(results):
    for plan, errors, recorded, expected, engine_name, norm in results:
        assert engine_name == "LinsEngine"
        assert max(errors) <= 1e-5, (plan, errors)
        assert recorded == expected, (plan, recorded, expected)
        assert norm is not None and norm > 0


def test_all_ten_plans_match_single_process_reference():
    assert len(ALL_PLANS) == 10
    for rank_results in run(train_plans, WORLD, tiny_llama, 96, ALL_PLANS, gpus_per_node=GPUS_PER_NODE):
        check(rank_results)


def test_tied_weights_and_odd_vocabulary():
    make = lambda: tiny_llama(vocab=97, tied=True)  # noqa: E731
    plans = [ALL_PLANS[0], ALL_PLANS[4], ALL_PLANS[-1]]
    for rank_results in run(train_plans, WORLD, make, 97, plans, gpus_per_node=GPUS_PER_NODE):
        check(rank_results)


def test_frozen_parameters():
    make = lambda: freeze_some(tiny_llama())  # noqa: E731
    plans = [ALL_PLANS[0], ALL_PLANS[5], ALL_PLANS[-1]]
    for rank_results in run(train_plans, WORLD, make, 96, plans, gpus_per_node=GPUS_PER_NODE):
        check(rank_results)
