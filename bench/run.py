"""``python -m bench run``: every mode side by side in one invocation, on one host and as emulated nodes.

Each mode is one ``bench/train.py`` run (same model, seed, batch and steps) launched by torchrun from the
repository root; its JSON summary is collected here. Reported per topology and mode: tokens/GPU/s, MFU,
median step, peak memory, exposed communication (step time minus the no-communication limit: the
same per-GPU work on one GPU alone), Lins' plan and predicted communication, and ratios to the best
DeepSpeed mode and to the limit. Writes ``bench.json``, ``throughput.png`` and ``loss.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

from lins_ds.plan import Layout

BASELINES = ("zero0", "zero1", "zero2", "zero3", "zeropp", "mics")
TOPOLOGIES = ("host", "emulated")  # the real host, or virtual nodes of --emulated-gpus-per-node GPUs
CONFIG_OF = {"nocomm": "zero0", "lins-budget": "lins"}  # modes that reuse another mode's config
LAUNCHER_EXCEPTIONS = ("ChildFailedError", "ProcessRaisedException")  # torchrun's report of a rank's failure
EXCEPTION_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt)\w*)\s*:(.*)$")
NATIVE_ABORT = re.compile(r"^\s*(terminate called .*|what\(\):.*|Fatal Python error: .*)$")  # C++ / interpreter


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: bench/ is not installed


def free_port() -> int:
    """A TCP port no process listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_size(args, topo: str, nproc: int) -> int:
    """GPUs per node: every GPU of the run on the real host, else the emulated node's."""
    return nproc if topo == "host" else args.emulated_gpus_per_node


def failure(output: str) -> str:
    """The last Python exception a failed run printed (``Type: message``), else a rank's native abort
    (``terminate called ...``: a peer's abort often follows the exception that caused it), else its last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln) for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = EXCEPTION_LINE.match(ln)
        if m and m.group(1) not in LAUNCHER_EXCEPTIONS:
            return f"{m.group(1)}:{m.group(2)}".strip()
    for ln in reversed(lines):
        if NATIVE_ABORT.match(ln):
            return ln.strip()
    return lines[-1].strip() if lines else "no output"


def run_mode(args, topo: str, mode: str, nproc: int, out_dir: str, steps: int, extra=(), label=None) -> dict:
    """One training run of ``mode``'s config (``label`` names its result, default the mode)."""
    label = label or mode
    out = os.path.abspath(os.path.join(out_dir, f"{topo}_{label}.json"))  # the run's cwd is the repository
    config = os.path.abspath(os.path.join(args.configs, CONFIG_OF.get(mode, mode) + ".json"))
    # node-sized settings (lins.gpus_per_node, hpZ and MiCS group sizes) follow the topology
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "-m", "bench.train", "--deepspeed_config", config,
           "--model", args.model, "--seq-len", str(args.seq_len), "--steps", str(steps), "--warmup-steps",
           str(args.warmup_steps), "--micro-batch-size", str(args.micro_batch_size), "--grad-accum",
           str(args.grad_accum), "--out", out, "--gpus-per-node", str(node_size(args, topo, nproc)), *extra]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if topo == "emulated":
        env.update(NCCL_SOCKET_NTHREADS="4", NCCL_NSOCKS_PERTHREAD="4")  # docs/design.md §11: tuned sockets
    t0 = time.time()
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(out):
        error = failure(r.stdout + "\n" + r.stderr)
        print(f"[bench run] {topo}/{label} FAILED: {error}\n{(r.stdout + r.stderr)[-1500:]}", flush=True)
        return {"mode": label, "topology": topo, "failed": True, "error": error}
    with open(out) as f:
        res = json.load(f)
    res.update(mode=label, topology=topo, wall_s=time.time() - t0)
    print(f"[bench run] {topo:8s} {label:12s} {res['tokens_per_gpu_s']:9.0f} tok/GPU/s  step {res['median_step_s']:.3f} s "
          f"({time.time() - t0:.0f} s)", flush=True)
    return res


def analyse(results: list, nocomm: dict, budget_gb) -> dict:
    table = {}
    for topo in TOPOLOGIES:
        rows = [r for r in results if r["topology"] == topo and not r.get("failed")]
        if not rows:
            continue
        base = [r for r in rows if r["mode"] in BASELINES]
        best = max(base, key=lambda r: r["tokens_per_gpu_s"]) if base else None
        for r in rows:
            r["exposed_comm_s"] = r["median_step_s"] - nocomm["median_step_s"] if nocomm else None
            r["vs_best_deepspeed"] = r["tokens_per_gpu_s"] / best["tokens_per_gpu_s"] if best else None
            r["vs_no_comm_limit"] = r["tokens_per_gpu_s"] / nocomm["tokens_per_gpu_s"] if nocomm else None
            r["within_budget"] = None if budget_gb is None or r.get("peak_memory_gb") is None else \
                r["peak_memory_gb"] <= budget_gb
            r["predicted_comm_s"] = r["plan"]["predicted_comm_s"] if r.get("plan") else None
        table[topo] = {"best_deepspeed": best["mode"] if best else None, "rows": rows}
    return table


def print_table(table: dict, nocomm: dict) -> None:
    if nocomm:
        print(f"no-communication limit: {nocomm['tokens_per_gpu_s']:.0f} tokens/GPU/s, step {nocomm['median_step_s']:.3f} s")
    for topo, t in table.items():
        print(f"\n{topo} (best DeepSpeed mode: {t['best_deepspeed']})")
        print(f"{'mode':<12}{'tok/GPU/s':>11}{'MFU':>7}{'step s':>8}{'peak GiB':>9}{'exposed s':>10}"
              f"{'pred s':>8}{'vs best':>8}{'vs limit':>9}{'start s':>8}{'start GiB':>10}  plan")
        for r in t["rows"]:
            plan = r.get("plan")
            layout = str(Layout.from_json(plan)) if plan else ""
            fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
            print(f"{r['mode']:<12}{r['tokens_per_gpu_s']:>11.0f}{fmt(r.get('mfu') and 100 * r['mfu'], '6.1f'):>7}"
                  f"{r['median_step_s']:>8.3f}{fmt(r.get('peak_memory_gb'), '9.1f'):>9}"
                  f"{fmt(r.get('exposed_comm_s'), '10.3f'):>10}{fmt(r.get('predicted_comm_s'), '8.3f'):>8}"
                  f"{fmt(r.get('vs_best_deepspeed'), '8.2f'):>8}{fmt(r.get('vs_no_comm_limit'), '9.2f'):>9}"
                  f"{fmt(r.get('startup_s'), '8.1f'):>8}{fmt(r.get('startup_peak_gb'), '10.1f'):>10}  {layout}")


def plot(table: dict, results: list, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4), squeeze=False)
    for ax, (topo, t) in zip(axes[0], table.items()):
        rows = t["rows"]
        ax.bar([r["mode"] for r in rows], [r["tokens_per_gpu_s"] for r in rows],
               color=["tab:red" if r["mode"].startswith("lins") else "tab:gray" for r in rows])
        ax.set_title(f"{topo}: tokens / GPU / s")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "throughput.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        if r.get("losses") and len(r["losses"]) >= 20:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['topology']}/{r['mode']}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=120)


def main(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    import torch

    ngpu = args.nproc or max(1, torch.cuda.device_count())
    results, nocomm = [], None
    if args.no_comm_limit:
        nocomm = run_mode(args, "host", "nocomm", 1, args.out, args.steps)
        nocomm = None if nocomm.get("failed") else nocomm
    for topo in args.topologies.split(","):
        for mode in args.modes.split(","):
            if topo == "emulated" and mode in ("mics", "zeropp") and args.emulated_gpus_per_node == 1:
                continue  # node-sized groups of one GPU: MiCS degenerates, hpZ equals ZeRO-3
            long = mode in ("zero1", "lins") and topo == args.loss_topology
            results.append(run_mode(args, topo, mode, ngpu, args.out, args.loss_steps if long else args.steps))
            with open(os.path.join(args.out, "partial.json"), "w") as f:  # survives a run cut short
                json.dump(results, f)
        if args.memory_budget_gb and topo == "host":
            results.append(run_mode(args, topo, "lins-budget", ngpu, args.out, args.steps,
                                    ["--lins-memory-gb", str(args.memory_budget_gb), "--trace-summary",
                                     os.path.join(args.out, "trace_lins_budget.txt")]))
    table = analyse(results, nocomm, args.memory_budget_gb)
    print_table(table, nocomm)
    failed = [r for r in results if r.get("failed")]
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"command": " ".join(sys.argv), "micro_batch_size": args.micro_batch_size,
                   "grad_accum": args.grad_accum, "no_comm_limit": nocomm, "table": table, "failed": failed,
                   "memory_budget_gb": args.memory_budget_gb}, f, indent=1)
    if table:
        plot(table, results + ([nocomm] if nocomm else []), args.out)
    for r in failed:
        print(f"bench run: {r['topology']}/{r['mode']} failed: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


def add_arguments(p) -> None:
    p.add_argument("--model", default="1b", help="a planner built-in LLaMA: tiny, 1b, 7b, 13b, 30b (default 1b)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per GPU per micro-batch (default 2)")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step (default 2)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per mode (default 10)")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of the timing (default 3)")
    p.add_argument("--loss-steps", type=int, default=50, help="steps for the Lins and ZeRO-1 loss curves")
    p.add_argument("--loss-topology", default="host", help="the topology of the loss curves (default host)")
    p.add_argument("--modes", default="zero0,zero1,zero2,zero3,zeropp,mics,lins",
                   help="comma-separated configs of --configs to run (default: every DeepSpeed mode and Lins)")
    p.add_argument("--topologies", default="host,emulated",
                   help="host (the real host), emulated (virtual nodes of --emulated-gpus-per-node GPUs), or both")
    p.add_argument("--emulated-gpus-per-node", type=int, default=1,
                   help="GPUs per virtual node for the emulated topology (2 nodes x 4 on 8 GPUs: 4)")
    p.add_argument("--memory-budget-gb", type=float, help="also run Lins under this solver budget")
    p.add_argument("--no-comm-limit", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the no-communication limit (the same per-GPU work on one GPU)")
    p.add_argument("--nproc", type=int, help="GPUs to use (default: all visible)")
    p.add_argument("--configs", default=os.path.join(ROOT, "ds_configs"), help="the folder of the mode configs")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out"), help="where results and plots go")
