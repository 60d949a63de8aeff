"""The host update against the host's memory bandwidth (issue 59): main's staged update and the blocked one, as the
runtime runs them, on this host.

    python bench/host_update_bench.py --old /tmp/old --new /tmp/new [--elems 5e8] [--threads 4,8,16] \\
        [--out host_update.json]

``--old`` and ``--new`` are two source trees (bench/gpu_issue59.sh: main's from .baseline/old.tgz, ``git archive``,
and its own). Each tree runs in a process of its own (its ``lins_ds`` on the path), so each path is the
tree's own code, not a copy of it: ``runtime.step.host_optimizer.HostOptimizer`` and ``update_piece`` over the masters
as ``HostUpdater`` holds them (fp32 pieces of the tree's ``HOST_PIECE`` elements, a gradient of ``--grad-dtype`` and a
bf16 copy up, in ``host_empty`` memory: pinned on a GPU), on a worker thread, with a clip coefficient of 0.5 and
the switch interval the updater sets. What it measures:

- the host's bandwidth (the new tree's ``profiler.host_bandwidth.measure``: STREAM-like copy and triad over arrays
  4 times the last-level cache) on each thread count;
- per tree, thread count (``--threads`` and ``runtime``: what the tree's updater runs on: the old one torch's
  default, the new one ``HostOptimizer.threads``) and what runs beside the update (``idle``; ``busy``: a training-like
  thread launching small kernels in a loop, on the GPU where there is one), the update of ``--elems`` elements:
  elements/s, the bytes per element its path moves (``plan.host_update``: staged 48, blocks 28 for bf16), achieved
  GB/s, and that as % of the measured triad and copy bandwidth on as many threads;
- the new tree's block sizes at its runtime thread count (``--blocks``);
- each tree's start-up measurement (``host_optimizer.measure``: what the planner prices a unit's update with).

Prints a table and writes JSON (``--out``). Best of ``--reps`` timed passes after one untimed (state made, pages
touched), each pass every piece once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

PATH_OF = {"old": "staged", "new": None}  # None: the tree's HostOptimizer.path says
SWITCH_INTERVAL_S = 5e-4  # HostUpdater's, while its worker runs


# --- the child: one tree's update ---------------------------------------------------------------------------------
class _Threads:
    """The calling thread's intra-op threads set to ``n`` (None: left as torch's default for a fresh thread, what the
    tree's updater gets unless it sets its own), then given back (torch's default for later threads with it)."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        import torch

        self.before = torch.get_num_threads()
        if self.n is not None and self.n != self.before:
            torch.set_num_threads(self.n)
        return torch.get_num_threads()

    def __exit__(self, *exc):
        import torch

        if torch.get_num_threads() != self.before:
            torch.set_num_threads(self.before)


class _Busy:
    """A training-like thread beside the update: small kernel launches in a loop (on the GPU where there is one),
    a little Python between them, a synchronize every 64 so the launch queue never fills; on a CPU, the same loop
    on tiny CPU tensors. It holds the GIL between launches and keeps a core busy, as the training thread does."""

    def __init__(self, device):
        self.device, self.stop, self.launches = device, threading.Event(), 0

    def _run(self):
        import torch

        x = torch.zeros(1024, device=self.device)
        while not self.stop.is_set():
            for _ in range(64):
                k = 0
                for i in range(20):  # the Python a hook or a module's forward runs between launches
                    k += i
                x.add_(1.0)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.launches += 64

    def __enter__(self):
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def child(args) -> None:
    """Run in a process whose path holds one tree: time its update; one JSON line per measurement on stdout."""
    import torch

    from lins_ds.runtime.step import host_memory, host_optimizer
    from lins_ds.runtime.step.host_optimizer import HostOptimizer, update_piece

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    grad_dtype = getattr(torch, args.grad_dtype)
    piece, n = host_memory.HOST_PIECE, int(args.elems)
    sizes = [min(piece, n - a) for a in range(0, n, piece)]
    t0 = time.perf_counter()
    masters = [torch.nn.Parameter(torch.zeros(k, dtype=torch.float32)) for k in sizes]
    grads = [host_memory.host_empty(k, grad_dtype, device).fill_(1e-3) for k in sizes]
    ups = [host_memory.host_empty(k, torch.bfloat16, device) for k in sizes]
    scratch = torch.empty(max(sizes), dtype=torch.float32)
    basic = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    opt = HostOptimizer(basic, [masters], "torch", device)
    hyper = opt.hyperparameters()
    path = PATH_OF[args.tree] or getattr(opt, "path", "staged")
    runtime_threads = getattr(opt, "threads", None)  # the new updater's own count; the old one: torch's default
    emit({"kind": "setup", "tree": args.tree, "path": path, "block": getattr(opt, "block", None),
          "runtime_threads": runtime_threads, "torch_threads": torch.get_num_threads(), "pieces": len(sizes),
          "piece": piece, "optimizer": opt.name, "setup_s": time.perf_counter() - t0})

    def one_pass():
        for m, g, u in zip(masters, grads, ups):
            update_piece(opt, m, g, u, scratch, 0.5, hyper)

    def timed(threads, beside, block=None):
        """Best and median of ``args.reps`` passes on a fresh worker thread, as HostUpdater runs them."""
        out = {}

        def worker():
            with torch.no_grad(), _Threads(threads) as used:
                out["threads"] = used
                one_pass()  # the first: Adam's state made, every page touched
                times = []
                for _ in range(args.reps):
                    t = time.perf_counter()
                    one_pass()
                    times.append(time.perf_counter() - t)
                out["times"] = times

        saved = getattr(opt, "block", None)
        if block is not None:
            opt.block = block
        interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            if beside == "busy":
                with _Busy(device) as busy:
                    w = threading.Thread(target=worker)
                    w.start()
                    w.join()
                out["busy_launches_per_s"] = busy.launches / sum(out["times"]) if out.get("times") else 0
            else:
                w = threading.Thread(target=worker)
                w.start()
                w.join()
        finally:
            sys.setswitchinterval(interval)
            if block is not None:
                opt.block = saved
        best = min(out["times"])
        return {"kind": "update", "tree": args.tree, "path": path, "threads": out["threads"],
                "setting": "runtime" if threads in (None, runtime_threads) and block is None else str(threads),
                "beside": beside, "block": block or getattr(opt, "block", None), "elems": n, "seconds": out["times"],
                "best_s": best, "median_s": statistics.median(out["times"]), "elems_per_s": n / best,
                "busy_launches_per_s": out.get("busy_launches_per_s")}

    settings = [runtime_threads] + [t for t in args.threads if t != runtime_threads]
    for beside in args.beside:
        for threads in settings:
            emit(timed(threads, beside))
    if args.tree == "new" and getattr(opt, "block", None) is not None:
        for block in args.blocks:
            emit({**timed(runtime_threads, "idle", block), "setting": f"block {block}"})
    # the start-up measurement: what the planner prices a unit's update with
    try:
        host, kind = host_optimizer.measure(basic, "torch", device, 64.0)
        emit({"kind": "measure", "tree": args.tree, "update_elems_per_s": host.update_elems_per_s,
              "h2d_gbs": host.h2d_gbs, "d2h_gbs": host.d2h_gbs, "source": host.source})
    except Exception as e:  # noqa: BLE001 - reported, the rest stands
        emit({"kind": "measure", "tree": args.tree, "error": f"{type(e).__name__}: {e}"})


def emit(obj) -> None:
    print("@@ " + json.dumps(obj), flush=True)


def bandwidth(args) -> None:
    """Run in the new tree's process: the host's copy and triad bandwidth on each thread count."""
    import torch

    from lins_ds.profiler import host_bandwidth

    size = host_bandwidth.array_bytes_for(host_bandwidth.last_level_cache_bytes(), _available())
    try:  # the new updater's own count (runtime.step.host_memory.host_threads), where the tree has one
        from lins_ds.runtime.step.host_memory import host_threads

        runtime = [host_threads(1)]
    except ImportError:
        runtime = []
    done = set()
    for threads in [None] + runtime + args.threads:
        if threads in done:
            continue
        done.add(threads)
        out = {}

        def worker():
            with _Threads(threads) as used:
                out["bw"], out["threads"] = host_bandwidth.measure(size), used

        w = threading.Thread(target=worker)
        w.start()
        w.join()
        bw = out["bw"]
        emit({"kind": "bandwidth", "threads": out["threads"], "setting": "default" if threads is None else str(threads),
              "copy_gbs": bw.copy_gbs, "triad_gbs": bw.triad_gbs, "array_bytes": bw.array_bytes,
              "llc_bytes": host_bandwidth.last_level_cache_bytes(), "torch_threads": torch.get_num_threads()})


def _available() -> float:
    import psutil

    return psutil.virtual_memory().available


# --- the parent: both trees, the table ----------------------------------------------------------------------------
def run_child(tree: str, src: str, args, mode: str) -> list:
    env = dict(os.environ)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != os.path.abspath(src)
             and not os.path.isdir(os.path.join(p, "lins_ds"))]  # the site (DeepSpeed's wheels), no other tree
    env["PYTHONPATH"] = os.pathsep.join([src] + extra)
    cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--tree", tree, "--elems", str(args.elems),
           "--threads", ",".join(map(str, args.threads)), "--beside", ",".join(args.beside),
           "--blocks", ",".join(map(str, args.blocks)), "--reps", str(args.reps), "--grad-dtype", args.grad_dtype]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=args.timeout)
    rows = [json.loads(line[3:]) for line in proc.stdout.splitlines() if line.startswith("@@ ")]
    if proc.returncode:
        sys.stderr.write(f"{tree} {mode}: rc {proc.returncode}\n{proc.stderr[-4000:]}\n")
        rows.append({"kind": "error", "tree": tree, "mode": mode, "rc": proc.returncode, "stderr": proc.stderr[-4000:]})
    print(f"# {tree} {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def host_facts() -> dict:
    facts = {"python": platform.python_version(), "cpus": os.cpu_count(),
             "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    try:
        with open("/proc/cpuinfo") as f:
            facts["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        facts["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        pass
    return facts


def table(rows: list, bpe: dict) -> list:
    """Each update row with its bytes per element, GB/s and share of the bandwidth measured on as many threads."""
    bw = {r["threads"]: r for r in rows if r["kind"] == "bandwidth"}
    out = []
    for r in rows:
        if r["kind"] != "update":
            continue
        per = bpe[r["path"]]
        gbs = r["elems_per_s"] * per / 1e9
        ref = bw.get(r["threads"])
        out.append({**r, "bytes_per_elem": per, "achieved_gbs": gbs,
                    "triad_gbs": ref and ref["triad_gbs"], "copy_gbs": ref and ref["copy_gbs"],
                    "pct_triad": ref and 100 * gbs / ref["triad_gbs"], "pct_copy": ref and 100 * gbs / ref["copy_gbs"]})
    return out


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [q for q in sys.path if os.path.abspath(q or ".") != here]  # bench/'s modules shadow no library
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", help="main's tree (a directory holding lins_ds)")
    p.add_argument("--new", help="the branch's tree")
    p.add_argument("--elems", type=float, default=5e8, help="elements updated per pass (fp32 masters)")
    p.add_argument("--threads", default="4,8,16", help="intra-op thread counts besides the runtime's own")
    p.add_argument("--beside", default="idle,busy", help="what runs beside the update: idle, busy (a launch loop)")
    p.add_argument("--blocks", default="1048576,2097152,4194304,8388608", help="the new tree's block sizes to try")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--grad-dtype", default="bfloat16")
    p.add_argument("--timeout", type=float, default=300, help="seconds per child process")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--mode", default="parent", choices=["parent", "update", "bandwidth"], help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.elems = int(args.elems)
    args.threads = [int(t) for t in args.threads.split(",") if t]
    args.beside = [b for b in args.beside.split(",") if b]
    args.blocks = [int(b) for b in args.blocks.split(",") if b]
    if args.mode == "update":
        child(args)
        return 0
    if args.mode == "bandwidth":
        bandwidth(args)
        return 0
    if not args.new:
        p.error("--new is required (and --old for the comparison)")
    rows = run_child("new", args.new, args, "bandwidth")
    for tree, src in (("old", args.old), ("new", args.new)):
        if src:
            rows += run_child(tree, src, args, "update")
    sys.path.insert(0, args.new)
    from lins_ds.plan.host_update import BLOCKS, PIECE, STAGED, bytes_per_element

    g = {"bfloat16": 2, "float16": 2, "float32": 4}[args.grad_dtype]
    bpe = {path: bytes_per_element(path, grad_bytes=g, param_bytes=2) for path in (STAGED, PIECE, BLOCKS)}
    updates = table(rows, bpe)
    for r in (r for r in rows if r["kind"] == "bandwidth"):
        print(f"bandwidth on {r['threads']:3d} threads ({r['setting']}): copy {r['copy_gbs']:7.1f} GB/s, "
              f"triad {r['triad_gbs']:7.1f} GB/s ({r['array_bytes'] / 2**30:.2f} GiB arrays)")
    for r in (r for r in rows if r["kind"] == "setup"):
        print(f"{r['tree']}: {r['path']}, block {r['block']}, runtime threads {r['runtime_threads']} "
              f"(torch {r['torch_threads']}), {r['pieces']} pieces of {r['piece']}, {r['optimizer']}")
    print(f"{'tree':4s} {'path':7s} {'setting':14s} {'thr':>3s} {'beside':6s} {'block':>9s} {'Gelem/s':>8s} "
          f"{'B/el':>4s} {'GB/s':>7s} {'%triad':>6s} {'%copy':>6s} {'median/best':>11s}")
    for r in updates:
        pct = (lambda v: f"{v:6.1f}" if v is not None else "     -")
        print(f"{r['tree']:4s} {r['path']:7s} {r['setting']:14s} {r['threads']:3d} {r['beside']:6s} "
              f"{r['block'] or 0:9d} {r['elems_per_s'] / 1e9:8.3f} {r['bytes_per_elem']:4d} {r['achieved_gbs']:7.1f} "
              f"{pct(r['pct_triad'])} {pct(r['pct_copy'])} {r['median_s'] / r['best_s']:11.3f}")
    for r in (r for r in rows if r["kind"] == "measure"):
        print(f"{r['tree']} start-up measure: " + (f"{r['update_elems_per_s'] / 1e9:.3f} Gelem/s; {r['source']}"
                                                   if "error" not in r else r["error"]))
    def key(r):  # the runtime's own settings pair with each other whatever their counts; the rest by count
        return ("runtime" if r["setting"] == "runtime" else r["threads"], r["beside"])

    pairs = {key(r): r for r in updates if r["tree"] == "old"}
    ratios = {}
    for r in updates:
        o = pairs.get(key(r)) if r["tree"] == "new" and not r["setting"].startswith("block") else None
        if o:
            ratios[f"{key(r)[0]}/{r['beside']}"] = r["elems_per_s"] / o["elems_per_s"]
            print(f"new/old speed, {r['setting']} ({o['threads']} -> {r['threads']} threads), {r['beside']}: "
                  f"{r['elems_per_s'] / o['elems_per_s']:.3f}")
    result = {"host": host_facts(), "args": {k: v for k, v in vars(args).items() if k not in ("mode", "tree")},
              "bytes_per_elem": bpe, "new_over_old": ratios, "rows": rows, "updates": updates}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 1 if any(r["kind"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
