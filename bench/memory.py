"""``python -m bench memory``: Lins' predicted peak memory next to the measured one, and DeepSpeed ZeRO-1 and
ZeRO-3 on the same model and batch, one ``bench/train.py`` run each (docs/design.md §8).

Runs: DeepSpeed ZeRO-1 and ZeRO-3; Lins with ZeRO-1's layout and with ZeRO-3's layout (nothing
checkpointed, and ZeRO-3's layout with every layer unit checkpointed); Lins solving under a budget between
what ZeRO-3's layout needs without and with full checkpointing (so the solver checkpoints some units);
and, with ``--budget-gb``, Lins solving under that budget. Each row: predicted and measured peak (max
allocated + the fixed reserve, the same quantity both sides), the allocator's peak, step time, start-up.
Writes ``<out>/<model>.json`` and ``<out>/<model>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .run import ROOT, run_mode

RESERVED_GIB = 2.0  # the planner's fixed reserve on GPUs (lins.reserved_gb): CUDA context, communicators


def runs(args, partial_budget: float) -> list:
    """(name, config, extra bench/train.py arguments) of each run."""
    out = [("zero1", "zero1", []), ("zero3", "zero3", []),
           ("lins-zero1-layout", "lins_as_zero1", ["--lins-checkpointing", "false"]),
           ("lins-zero3-layout", "lins_as_zero3", ["--lins-checkpointing", "false"]),
           ("lins-zero3-layout-full-ckpt", "lins_as_zero3", ["--lins-checkpointing", "true"]),
           ("lins-partial-ckpt", "lins", ["--lins-memory-gb", f"{partial_budget:.3f}"])]
    if args.budget_gb:
        out.append((f"lins-{args.budget_gb:g}gib", "lins", ["--lins-memory-gb", str(args.budget_gb)]))
    return [r for r in out if not args.runs or r[0] in args.runs.split(",")]


def partial_budget(args, ngpu: int) -> tuple:
    """(budget GiB, note): halfway between what ZeRO-3's layout needs with no and with every layer unit
    checkpointed, from this device's measured activation profile (the same probe the engine runs)."""
    import torch
    import transformers

    from lins_ds.plan import MemorySpec, Topology, TrainingSpec, load_model
    from lins_ds.plan.memory import memory
    from lins_ds.plan.topology import Factor, Layout
    from lins_ds.runtime.memory import memory_probe
    from lins_ds.tools.llama import llama_config

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(args.model, args.seq_len)).to(torch.bfloat16)
    acts = None  # the formula, as the engine uses without a GPU; measured on one, as the engine does
    if device.type == "cuda":
        acts = memory_probe.probe(model, list(model.model.layers), args.micro_batch_size, args.seq_len,
                                  model.config.vocab_size, device)
    spec, topo = load_model(args.model), Topology(1, ngpu)
    train = TrainingSpec(args.seq_len, args.micro_batch_size, args.grad_accum)
    every = Factor(ngpu, 1)
    layout = Layout(every, every, every)
    need = [memory(spec, train, MemorySpec(1, RESERVED_GIB if device.type == "cuda" else 0), topo, layout, k,
                   acts).total_gb for k in (0, spec.num_layers)]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return sum(need) / 2, f"ZeRO-3's layout needs {need[0]:.2f} GiB without and {need[1]:.2f} GiB with full checkpointing"


def row(args, name: str, res: dict, reserve: float) -> dict:
    plan = res.get("plan")
    measured = res.get("peak_memory_gb")
    out = {"model": args.model, "run": name, "mode": "lins" if plan else name,
           "plan": _layout(plan) if plan else {"zero1": "DeepSpeed ZeRO-1", "zero3": "DeepSpeed ZeRO-3"}.get(name, name),
           "activation_checkpointing": (f"{plan['activation_checkpointing_units']} of {plan['num_layers']}"
                                        if plan else None),
           "budget_gib": res.get("lins_memory_gb"), "memory_profile": plan.get("memory_profile") if plan else None,
           "predicted_peak_gib": plan["predicted_peak_gb"] + reserve if plan and plan.get("predicted_peak_gb") else None,
           "measured_peak_gib": measured + reserve if measured is not None else None,
           "measured_allocator_peak_gib": res["peak_reserved_gb"] + reserve if res.get("peak_reserved_gb") else None,
           "predicted_total_gib": plan.get("memory_gb") if plan else None,
           "step_s": res["median_step_s"], "startup_s": res.get("startup_s"),
           "startup_peak_gib": res.get("startup_peak_gb"), "memory_phases": res.get("memory_phases")}
    if out["predicted_peak_gib"] and out["measured_peak_gib"]:
        out["error_pct"] = 100 * (out["predicted_peak_gib"] / out["measured_peak_gib"] - 1)
    return out


def _layout(plan: dict) -> str:
    from lins_ds.plan import Layout

    return str(Layout.from_json(plan))


def print_rows(rows: list) -> None:
    fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
    print(f"\n{'run':<30}{'plan':<24}{'ckpt':>8}{'budget':>8}{'pred GiB':>9}{'meas GiB':>9}{'err %':>7}"
          f"{'alloc GiB':>10}{'step s':>8}")
    for r in rows:
        print(f"{r['run']:<30}{r['plan']:<24}{r['activation_checkpointing'] or '-':>8}{fmt(r['budget_gib'], '8.1f'):>8}"
              f"{fmt(r['predicted_peak_gib'], '9.2f'):>9}{fmt(r['measured_peak_gib'], '9.2f'):>9}"
              f"{fmt(r.get('error_pct'), '+7.1f'):>7}{fmt(r['measured_allocator_peak_gib'], '10.2f'):>10}"
              f"{r['step_s']:>8.3f}")


def plot(rows: list, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["predicted_peak_gib"] or 0 for r in rows], 0.4, label="predicted")
    ax.bar([x + 0.2 for x in xs], [r["measured_peak_gib"] or 0 for r in rows], 0.4, label="measured")
    ax.set_xticks(list(xs), [r["run"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("peak GiB (max allocated + reserve)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    import torch

    os.makedirs(args.out, exist_ok=True)
    ngpu = args.nproc or max(1, torch.cuda.device_count())
    budget, note = partial_budget(args, ngpu)
    print(f"[bench memory] partial-checkpointing budget {budget:.2f} GiB: {note}", flush=True)
    reserve = RESERVED_GIB if torch.cuda.is_available() else 0.0
    rows, failed = [], []
    for name, config, extra in runs(args, budget):
        res = run_mode(args, "host", config, ngpu, args.out, args.steps, extra, label=name)
        if res.get("failed"):
            failed.append(res)
            continue
        if "--lins-memory-gb" in extra:
            res["lins_memory_gb"] = float(extra[extra.index("--lins-memory-gb") + 1])
        rows.append(row(args, name, res, reserve))
        with open(os.path.join(args.out, f"{args.model}.json"), "w") as f:  # after each run: survives a cut
            json.dump({"command": " ".join(sys.argv), "partial_budget_note": note, "rows": rows, "failed": failed},
                      f, indent=1)
    print_rows(rows)
    if rows:
        plot(rows, os.path.join(args.out, f"{args.model}.png"), f"{args.model}: predicted vs measured peak")
    for r in failed:
        print(f"bench memory: {r['mode']} failed: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="1b", help="a planner built-in LLaMA: tiny, 1b, 7b, ... (default 1b)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per GPU per micro-batch (default 2)")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step (default 4)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default 4)")
    p.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the timing (default 1)")
    p.add_argument("--budget-gb", type=float, help="also run Lins solving under this budget (e.g. 80)")
    p.add_argument("--runs", help="comma-separated subset of the runs (default: all)")
    p.add_argument("--nproc", type=int, help="GPUs to use (default: all visible)")
    p.add_argument("--emulated-gpus-per-node", type=int, default=1, help="GPUs per virtual node (emulated runs)")
    p.add_argument("--configs", default=os.path.join(ROOT, "ds_configs"), help="the folder of the configs")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "memory"), help="where results go")
