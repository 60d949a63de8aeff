"""``lins-ds profile``: run on every rank under torchrun / deepspeed; rank 0 prints and writes."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as tdist

from ..plan import Topology, TrainingSpec, candidates, load_model
from ..plan.cost import model_units, required_meshes
from ..plan.profile_table import bus_factor
from .. import comm
from ..comm import local_world_size, set_virtual_node
from ..profiler import cache
from ..profiler.measure import FULL, QUICK, measure, sizes


def _init():
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def summary(table) -> str:
    """busbw per op x mesh at the smallest, a middle and the largest measured size."""
    measured = next(iter(table.series.values())).sizes
    shown_sizes = sorted({measured[0], measured[len(measured) // 2], measured[-1]})
    lines = [f"{'op':<15}{'mesh':>7}" + "".join(f"{s / 2**20:>10.2f}MiB" for s in shown_sizes) + "   (busbw GB/s)"]
    for (op, i, j), s in sorted(table.series.items()):
        n = i * j
        cells = "".join(f"{bus_factor(op, n) * x / s.time(x) / 1e9:>13.2f}" for x in shown_sizes)
        lines.append(f"{op:<15}{f'{i}x{j}':>7}{cells}")
    return "\n".join(lines)


def _measure(args, topo: Topology, device, extra_meta: dict) -> tuple:
    """(table, seconds): every op on every candidate mesh, written to --out or the cache (rank 0)."""
    meshes = required_meshes(topo, candidates(topo))
    params = dict(QUICK if args.quick else FULL)
    if args.max_mb:
        params["max_bytes"] = int(args.max_mb * 2**20)
    total = len([m for m in meshes if m.size > 1]) * 4 * len(sizes(params["min_bytes"], params["max_bytes"], params["step"]))
    bar = None
    if tdist.get_rank() == 0:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="lins profile", unit="point")
    key = cache.launch_key(topo, device)
    t0 = time.perf_counter()
    table = measure(topo, meshes, device, meta={**key, "source": f"measured:{'quick' if args.quick else 'full'}",
                                                **extra_meta},
                    progress=(lambda _: bar.update(1)) if bar else None, **params)
    elapsed = time.perf_counter() - t0
    if tdist.get_rank() == 0:
        bar.close()
        out = args.out or cache.cache_path(key)
        cache.save(out, table)
        print(summary(table))
        print(f"measured {total} points over {len(meshes)} meshes in {elapsed:.1f} s; wrote {out}")
    return table, elapsed


def _validate(args, table, topo: Topology, device, elapsed: float) -> None:
    """Time every candidate plan's collectives on their real groups; prediction error per collective."""
    from ..profiler.validate import validate

    train = TrainingSpec(args.seq_len, args.micro_batch_size, args.grad_accum)
    report = validate(table, topo, candidates(topo), model_units(load_model(args.model)), train, device)
    if tdist.get_rank() != 0:
        return
    for r in report["rows"]:
        print(f"{r['layout']:<28} {r['op']:<15} {r['group']:<10} {r['mesh']:>5} {r['bytes'] / 2**20:>9.1f} MiB "
              f"predicted {r['predicted_s'] * 1e3:8.3f} ms  measured {r['measured_s'] * 1e3:8.3f} ms  "
              f"error {100 * r['relative_error']:5.1f} %")
    print(f"prediction vs measurement: median error {100 * report['median_relative_error']:.1f} %, "
          f"worst {100 * report['worst_relative_error']:.1f} % over {len(report['rows'])} collectives")
    path = (args.out or cache.cache_path(cache.launch_key(topo, device))).replace(".json", "") + ".validate.json"
    with open(path, "w") as f:
        json.dump({"elapsed_s": elapsed, **report}, f, indent=1)


def _memory(args, device) -> None:
    """The activation memory of --model at --seq-len and --micro-batch-size in --dtype, measured as the engine
    does at start-up (one layer unit and the head) and cached beside the profiles, where the engine finds it."""
    import transformers

    from .. import dtypes
    from ..runtime.memory import memory_probe
    from .llama import llama_config

    with torch.device("meta"):  # only the head and one layer unit get memory, for the probe
        model = transformers.LlamaForCausalLM(llama_config(args.model, args.seq_len)).to(dtypes.torch_dtype(args.dtype))
    directory = os.path.dirname(os.path.abspath(args.out)) if args.out else cache.default_dir()
    prof = memory_probe.obtain(model, list(model.model.layers), args.micro_batch_size, args.seq_len,
                               model.config.vocab_size, device, directory)
    if tdist.get_rank() == 0:
        print(f"activation memory of {args.model}, micro-batch {args.micro_batch_size} x {args.seq_len} tokens, "
              f"{args.dtype} ({prof.source}): a layer keeps {prof.layer_saved / 2**20:.1f} MiB "
              f"({prof.layer_saved_ckpt / 2**20:.1f} MiB checkpointed), its backward needs "
              f"{prof.layer_transient / 2**20:.1f} MiB more; the head peaks at {prof.head_peak / 2**20:.1f} MiB")


def run(args, measure_meta=None) -> int:
    """``measure_meta(device)``, run by every rank before measuring: more entries for the table's meta (the
    benchmark's host probe)."""
    if args.gpus_per_node:
        set_virtual_node(args.gpus_per_node)
    device = _init()
    L = args.gpus_per_node or local_world_size()
    topo = Topology(tdist.get_world_size() // L, L)
    table, elapsed = _measure(args, topo, device, measure_meta(device) if measure_meta else {})
    if args.validate:
        _validate(args, table, topo, device, elapsed)
    if args.memory:
        _memory(args, device)
    comm.barrier()  # every rank done measuring before the group goes
    tdist.destroy_process_group()
    return 0
