"""Fine-tune a tiny LLaMA with the Hugging Face Trainer under Lins (or any DeepSpeed config), on CPU or GPU.

    torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed ds_configs/hf_lins.json \\
        --output_dir out --max_steps 20 --per_device_train_batch_size 4 --save_steps 10

Nothing here names lins_ds: installed, it makes the ``"lins"`` block of the DeepSpeed config the switch (the
same script trains under ZeRO with ``ds_configs/hf_zero1.json``). The text is generated here (arithmetic facts),
tokenised as bytes, so nothing is downloaded. Rank 0 writes ``<output_dir>/losses.json``.
"""

import json
import os
import random
from dataclasses import dataclass, field

import torch
import transformers
from transformers import HfArgumentParser, Trainer, TrainingArguments


@dataclass
class ModelArguments:
    seq_len: int = field(default=64)
    hidden_size: int = field(default=64)
    layers: int = field(default=2)
    samples: int = field(default=512, metadata={"help": "training sequences to generate"})
    from_config: bool = field(default=False, metadata={"help": "build with AutoModelForCausalLM.from_config, as "
                                                               "run_clm.py does (a Lins config: built sharded)"})
    lora_r: int = field(default=0, metadata={"help": "train PEFT LoRA adapters of this rank on q_proj and v_proj "
                                                    "instead of the whole model (0: no LoRA)"})


def make_text(n_lines: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"{a} plus {b} is {a + b}. ")
    return "".join(lines)


class ByteBlocks(torch.utils.data.Dataset):
    """Consecutive blocks of ``seq_len`` UTF-8 bytes; labels are the inputs (causal LM)."""

    def __init__(self, text: str, seq_len: int, samples: int):
        data = torch.tensor(list(text.encode()), dtype=torch.long)
        self.blocks = data[: samples * seq_len].view(samples, seq_len)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def build_model(m: ModelArguments):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=m.hidden_size, intermediate_size=m.hidden_size * 3,
                                   num_hidden_layers=m.layers, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=m.seq_len)
    if m.from_config:
        return transformers.AutoModelForCausalLM.from_config(cfg)
    return transformers.LlamaForCausalLM(cfg)


def main():
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    parser.set_defaults(logging_steps=1)  # show the loss every step (the Trainer's default is every 500)
    model_args, args = parser.parse_args_into_dataclasses()
    transformers.set_seed(args.seed)
    model = build_model(model_args)
    if model_args.lora_r:
        import peft

        lora = peft.LoraConfig(r=model_args.lora_r, lora_alpha=2 * model_args.lora_r,
                               target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(model, lora)
    data = ByteBlocks(make_text(model_args.samples * model_args.seq_len // 12 + 10), model_args.seq_len,
                      model_args.samples)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        logs = [{k: h[k] for k in ("step", "loss", "grad_norm", "learning_rate") if k in h}
                for h in trainer.state.log_history if "loss" in h]
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump({"world_size": args.world_size, "engine": type(trainer.model_wrapped).__name__, "log": logs}, f)
    trainer.accelerator.end_training()  # destroys the process group, as torch asks every process to


if __name__ == "__main__":
    main()
