"""PEFT on a sharded load gives the adapters PEFT's own values: the same model, and the same training, as PEFT on an
eagerly loaded model (docs/design.md §10)."""

import pytest
import torch

import lins_ds  # noqa: F401
from helpers import GPUS_PER_NODE, WORLD, batch, config, max_err, run, tiny_llama

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
PLAN = {"p": [2, 2], "g": [2, 2], "os": [2, 2]}  # parameters sharded: the deferred path reads shares only


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_llama().save_pretrained(path)
    return str(path)


def adapted(path, form, init):
    """A LoRA model on the pretrained tiny LLaMA, built ``form``: eager, sharded (get_peft_model inside or after
    lins_ds.init) or the Trainer's way (a live TrainingArguments with a Lins config)."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=init)
    cfg = config({"plan": PLAN})
    transformers.set_seed(7)
    if form == "eager":
        return peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path), lora)
    if form == "inside":
        with lins_ds.init(config=cfg):
            return peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path), lora)
    if form == "after":
        with lins_ds.init(config=cfg):
            base = transformers.AutoModelForCausalLM.from_pretrained(path)
        return peft.get_peft_model(base, lora)
    cfg["lins"]["sharded_load"] = True  # the tiny model would load whole on every rank by default
    args = transformers.TrainingArguments(output_dir="unused", deepspeed=cfg, report_to="none")  # noqa: F841
    return peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path), lora)


def train_adapted(path, forms, init):
    import deepspeed

    rank, out = torch.distributed.get_rank(), {}
    for form in forms:
        model = adapted(path, form, init)
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-2),
                                          config=config({"plan": PLAN}))
        states = [{k: v.float().clone() for k, v in engine.module.state_dict().items()}]
        for step in range(5):
            for micro in range(2):
                x = batch(step, micro, rank, 96)
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
            states.append({k: v.float().clone() for k, v in engine.module.state_dict().items()})
        out[form] = states
        engine.destroy()
    return out


@pytest.mark.parametrize("init", [True, "gaussian"], ids=["default", "gaussian"])
def test_lora_on_a_sharded_load_is_lora_on_an_eager_load(pretrained, init):
    out = run(train_adapted, WORLD, pretrained, ["eager", "inside", "after", "trainer"], init,
              gpus_per_node=GPUS_PER_NODE)[0]
    eager = out.pop("eager")
    lora_b = [v for k, v in eager[0].items() if "lora_B" in k]
    assert lora_b and (init != True or all(float(v.abs().max()) == 0 for v in lora_b))  # noqa: E712 (PEFT's zero B)
    for form, states in out.items():
        assert max_err(states[0], eager[0]) == 0, form  # the same model at step 0
        assert max(max_err(s, r) for s, r in zip(states, eager)) <= 1e-6, form  # and after 5 steps


def pissa(path):
    try:
        adapted(path, "after", "pissa")
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_an_init_that_reads_the_base_weights_is_refused_on_a_sharded_load(pretrained):
    for msg in run(pissa, 2, pretrained, gpus_per_node=2):
        assert msg.startswith("LinsConfigError: lins: PEFT adapter 'default': init_lora_weights='pissa' initialises "
                              "the adapter from the base weights"), msg
