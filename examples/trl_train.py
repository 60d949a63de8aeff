"""Preference and RL training with TRL under Lins (or any DeepSpeed config): DPO, KTO or GRPO on a tiny LLaMA.

    torchrun --nproc_per_node 2 examples/trl_train.py --trainer dpo --deepspeed ds_configs/hf_lins.json \\
        --output_dir out --max_steps 10 --per_device_train_batch_size 2

Nothing here names lins_ds. TRL builds the reference model itself (``from_pretrained`` of the policy's path) and hands
it to ``deepspeed.initialize`` without an optimizer; under a Lins config that is a forward-only Lins engine. The model,
its word-level tokenizer and the data (arithmetic facts, right and wrong) are made here and saved under
``<output_dir>/init``, so nothing is downloaded. Rank 0 writes ``<output_dir>/losses.json``.
"""

import json
import os
import random
import sys
from dataclasses import dataclass, field

import torch
import transformers
from transformers import HfArgumentParser

WORDS = [str(i) for i in range(200)] + ["plus", "minus", "is", "."]
SPECIAL = ["<pad>", "<eos>", "<unk>"]


@dataclass
class ScriptArguments:
    trainer: str = field(default="dpo", metadata={"help": "dpo, kto or grpo"})
    hidden_size: int = field(default=32)
    layers: int = field(default=2)
    samples: int = field(default=64)
    eos_bias: float = field(default=0.0, metadata={"help": "GRPO: make the untrained model end its completions early "
                                                           "(completions of many lengths, different on each rank)"})


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def build(path: str, s: ScriptArguments, seed: int) -> None:
    """The initial model and tokenizer, saved where TRL (and its reference model) load them from."""
    tok = tokenizer()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=s.hidden_size, intermediate_size=2 * s.hidden_size,
                                   num_hidden_layers=s.layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                                   eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg)
    if s.eos_bias:  # the eos logit raised by about eos_bias where the final hidden state looks like an average one
        with torch.no_grad():
            h = model.model(input_ids=torch.randint(3, len(tok), (8, 16))).last_hidden_state.reshape(-1, s.hidden_size)
            mean = h.mean(0)
            model.lm_head.weight[tok.eos_token_id] += s.eos_bias * mean / mean.square().sum()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def facts(n: int, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append((f"{a} plus {b} is", f" {a + b} .", f" {a + b + rng.randint(1, 9)} ."))
    return out


def dataset(kind: str, n: int, seed: int):
    from datasets import Dataset

    rows = facts(n, seed)
    if kind == "dpo":
        return Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in rows])
    if kind == "kto":
        return Dataset.from_list([{"prompt": p, "completion": c if i % 2 else r, "label": bool(i % 2)}
                                  for i, (p, c, r) in enumerate(rows)])
    return Dataset.from_list([{"prompt": p} for p, _, _ in rows])


def reward_length(completions, **kwargs):
    """GRPO's reward: longer completions score higher (anything that varies between completions will do)."""
    return [float(len(c.split())) for c in completions]


def main():
    import trl

    kind = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--trainer=")), None)
    if kind is None and "--trainer" in sys.argv:
        kind = sys.argv[sys.argv.index("--trainer") + 1]
    config_class = {"dpo": trl.DPOConfig, "kto": trl.KTOConfig, "grpo": trl.GRPOConfig}[kind or "dpo"]
    parser = HfArgumentParser((ScriptArguments, config_class))
    parser.set_defaults(logging_steps=1, report_to="none", save_strategy="no", bf16=torch.cuda.is_available())
    script, args = parser.parse_args_into_dataclasses()
    path = os.path.join(args.output_dir, "init")
    if args.process_index == 0:
        build(path, script, args.seed)
    data = dataset(script.trainer, script.samples, args.seed)
    if getattr(args, "precompute_ref_log_probs", False):
        # TRL caches the reference log-probs next to the dataset's files and every rank reads rank 0's: a dataset
        # held in memory has its cache in a temporary directory of each process, so it goes to disk first
        from datasets import load_from_disk

        if args.process_index == 0:
            data.save_to_disk(os.path.join(args.output_dir, "data"))
    args.distributed_state.wait_for_everyone()
    if getattr(args, "precompute_ref_log_probs", False):
        data = load_from_disk(os.path.join(args.output_dir, "data"))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if script.trainer == "dpo":
        trainer = trl.DPOTrainer(model=path, args=args, train_dataset=data, processing_class=tok)
    elif script.trainer == "kto":
        trainer = trl.KTOTrainer(model=path, args=args, train_dataset=data, processing_class=tok)
    else:
        trainer = trl.GRPOTrainer(model=path, args=args, train_dataset=data, processing_class=tok,
                                  reward_funcs=reward_length)
    trainer.train()
    if trainer.is_world_process_zero():
        keep = ("step", "loss", "grad_norm", "rewards/chosen", "rewards/margins", "kl", "reward",
                "completions/mean_length", "completions/min_length", "completions/max_length")
        logs = [{k: h[k] for k in keep if k in h} for h in trainer.state.log_history if "loss" in h]
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump({"engine": type(trainer.model_wrapped).__name__,
                       "ref_engine": type(getattr(trainer, "ref_model", None)).__name__, "log": logs}, f)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
