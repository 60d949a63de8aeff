"""Run a function on N gloo processes (fork, file:// rendezvous) and collect what each returns."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback

import torch.multiprocessing as mp


def _worker(local_rank, fn, world_size, gpus_per_node, tmp, args):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank % gpus_per_node),
                      LOCAL_WORLD_SIZE=str(gpus_per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=local_rank, world_size=world_size)
    try:
        result = fn(*args)
        with open(f"{tmp}/result.{local_rank}", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(f"{tmp}/error.{local_rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        try:
            import deepspeed.comm as dscomm
            dscomm.destroy_process_group() if dscomm.is_initialized() else None
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn, world_size: int, *args, gpus_per_node: int = None):
    """``fn(*args)`` on ``world_size`` ranks (``gpus_per_node`` per emulated node); returns the results by rank."""
    gpus_per_node = gpus_per_node or world_size
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_worker, args=(fn, world_size, gpus_per_node, tmp, args), nprocs=world_size,
                               start_method="fork")
        except Exception as e:
            errs = [open(f"{tmp}/{n}").read() for n in sorted(os.listdir(tmp)) if n.startswith("error.")]
            raise RuntimeError("a rank failed:\n" + "\n".join(errs)) from e
        out = []
        for r in range(world_size):
            with open(f"{tmp}/result.{r}", "rb") as f:
                out.append(pickle.load(f))
        return out
