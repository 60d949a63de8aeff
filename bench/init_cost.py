"""What ``lins.init: "eager"`` costs a rank at start-up, on the CPU (``python -m bench init-cost --model 7b``):
building the model under ``lins_ds.init`` with its initialisation recorded (the eager build's random draws made
and dropped), then replaying every parameter's initialisation whole (what materialisation does, one parameter at a
time), against the same build with ``"per_module"`` (no recording; each module's init at materialisation)."""

from __future__ import annotations

import json
import time

import torch


def measure(model: str, seq_len: int = 2048) -> dict:
    import transformers

    import lins_ds
    from lins_ds.runtime.startup.materialize import REPLAY
    from lins_ds.tools.llama import llama_config

    config = llama_config(model, seq_len)
    out = {"model": model, "threads": torch.get_num_threads()}
    for mode in ("per_module", "eager"):
        cfg = {"zero_optimization": {"stage": 0}, "lins": {"plan": "solve", "init": mode}}
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with lins_ds.init(config=cfg):
            built = transformers.LlamaForCausalLM(config)
        out[f"{mode}_build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    params = 0
    for p in built.parameters():
        replay = getattr(p, REPLAY, None)
        if replay is not None and replay.usable:
            replay.full()
            params += p.numel()
    out["eager_replay_s"] = time.perf_counter() - t0
    out["replayed_params"] = params
    return out


def main(args) -> int:
    for model in args.model.split(","):
        print(json.dumps(measure(model)), flush=True)
    return 0
