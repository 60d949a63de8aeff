"""What a checkpoint's SHA-256 digests cost a save and a load (one process; a GPU or the CPU):

    torchrun --nproc_per_node 1 -m bench.checkpoint_cost --model bench/models/hub-qwen2.5-3b.json --dir /tmp/ck \
        [--out cost.json]

Builds the model under Lins (replicated, short sequences: only the state matters), takes one optimizer step so that
Adam's moments exist, then times save_checkpoint, the hashing of the files it wrote alone (what the digests add to
the save), load_checkpoint, and the hashing again (what checking them adds to the load). Prints a table; --out writes
it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch

import lins_ds  # noqa: F401
from lins_ds.checkpoint.formats import file_digest

from .train import build_model, setup_device


def main(argv=None) -> dict:
    import deepspeed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dir", required=True, help="where the checkpoint goes (removed afterwards)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    device = setup_device()
    torch.manual_seed(0)
    model = build_model(args.model, 512)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
           "zero_optimization": {"stage": 0},
           "lins": {"plan": {"p": [1, 1], "g": [1, 1], "os": [1, 1]}, "seq_len": 512, "offload": False}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randint(0, model.config.vocab_size, (1, 512), device=device)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    shutil.rmtree(args.dir, ignore_errors=True)
    t0 = time.perf_counter()
    engine.save_checkpoint(args.dir, tag="t")
    save_s = time.perf_counter() - t0
    tag = os.path.join(args.dir, "t")
    files = [os.path.join(tag, n) for n in sorted(os.listdir(tag)) if n != "meta.json"]
    size = sum(os.path.getsize(f) for f in files)
    t0 = time.perf_counter()
    for f in files:
        file_digest(f)
    hash_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.load_checkpoint(args.dir, tag="t")
    sync()
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for f in files:
        file_digest(f)
    hash_again_s = time.perf_counter() - t0
    out = {"model": args.model, "checkpoint_gb": size / 2**30, "save_s": save_s, "hash_s": hash_s, "load_s": load_s,
           "hash_on_load_s": hash_again_s, "hash_gb_per_s": size / 1e9 / hash_s,
           "share_of_save": hash_s / save_s, "share_of_load": hash_again_s / load_s}
    print("| checkpoint GiB | save s | of it hashing s | load s | of it checking s | hash GB/s |")
    print("|---|---|---|---|---|---|")
    print(f"| {out['checkpoint_gb']:.2f} | {save_s:.1f} | {hash_s:.1f} ({100 * out['share_of_save']:.0f} %) | "
          f"{load_s:.1f} | {hash_again_s:.1f} ({100 * out['share_of_load']:.0f} %) | {out['hash_gb_per_s']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    engine.destroy()
    shutil.rmtree(args.dir, ignore_errors=True)
    deepspeed.comm.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
