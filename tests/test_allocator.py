"""The caching allocator under a budget (issue 61): Lins turns on expandable segments, so memory freed in pieces is
reusable by a larger request and a capped allocator does not fail a plan whose allocated peak fits. The CPU tests hold
the set-up's decisions; the GPU test (the ``gpu`` mark, run on the lent machines) fragments a capped allocator."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lins_ds.runtime.memory import memory_guard


@pytest.fixture
def cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(memory_guard, "_set_allocator_settings", calls.append)
    for key in memory_guard.ALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    return calls


def test_lins_turns_expandable_segments_on_and_says_so(cuda):
    note = memory_guard.setup_allocator()
    assert cuda == ["expandable_segments:True"] and "expandable segments on (set by Lins" in note


@pytest.mark.parametrize("key", memory_guard.ALLOC_ENV)
def test_a_users_own_setting_is_kept_and_named(cuda, monkeypatch, key):
    monkeypatch.setenv(key, "max_split_size_mb:128,expandable_segments:False")
    note = memory_guard.setup_allocator()
    assert cuda == [] and f"expandable segments off ({key}=" in note and "can still run out of memory" in note
    monkeypatch.setenv(key, "expandable_segments:True")
    assert cuda == [] and "expandable segments (" in memory_guard.setup_allocator()


def test_other_settings_of_the_user_do_not_stop_it(cuda, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    memory_guard.setup_allocator()
    assert cuda == ["expandable_segments:True"]


def test_cuda_malloc_async_is_left_alone(cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert "cudaMallocAsync" in memory_guard.setup_allocator() and cuda == []


def test_nothing_happens_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory_guard.setup_allocator() == ""


FRAGMENT = textwrap.dedent("""
    import sys, torch
    from lins_ds.runtime.memory import memory_guard
    if sys.argv[1] == "lins":
        memory_guard.setup_allocator()
    memory_guard.cap_allocator(4.0, torch.device("cuda", 0), reserved=0.0)
    print(torch.cuda.memory.get_allocator_backend(), file=sys.stderr)
    MB, GB = 2**20, 2**30
    whole = torch.empty(3 * GB, dtype=torch.uint8, device="cuda")  # a first window's big tensor, then freed:
    del whole  # its cached segment is carved up by the next ones
    blocks = [torch.empty(48 * MB, dtype=torch.uint8, device="cuda") for _ in range(60)]
    del blocks[::2]  # 1.4 GiB live, 1.4 GiB free in 48 MiB holes of one 3 GiB segment
    try:
        logits = torch.empty(int(1.5 * GB), dtype=torch.uint8, device="cuda")  # allocated 2.9 GiB < 4: it fits
        print("fits", torch.cuda.max_memory_reserved() / GB)
    except torch.cuda.OutOfMemoryError:
        print("oom")
""")


@pytest.mark.gpu
def test_a_capped_fragmented_allocator_serves_a_request_that_fits():
    env = {k: v for k, v in os.environ.items() if k not in memory_guard.ALLOC_ENV}
    runs = {mode: subprocess.run([sys.executable, "-c", FRAGMENT, mode], env=env, capture_output=True, text=True,
                                 timeout=120) for mode in ("torch", "lins")}
    out = {mode: r.stdout.split() + [r.stderr[-800:]] for mode, r in runs.items()}
    assert out["torch"][:1] == ["oom"], out  # torch's default fails: the test can tell
    assert out["lins"][0] == "fits" and float(out["lins"][1]) <= 4.0, out
