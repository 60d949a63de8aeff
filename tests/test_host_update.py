"""The host update at memory bandwidth (issue 59, docs/design.md §13): the bytes each host-optimizer path moves per
element and the floor they set, the host's memory bandwidth probe and its cache, and the blocked update giving
the bits the staged one gave."""

import json
import math
import os
import threading
from types import SimpleNamespace

import pytest
import torch

from lins_ds.plan.host_update import (BLOCKS, PIECE, STAGED, achieved_fraction, bytes_per_element,
                                      floor_seconds, passes)
from lins_ds.profiler import host_bandwidth
from lins_ds.runtime.step import host_memory, host_optimizer
from lins_ds.runtime.step.host_optimizer import (BLOCK_ALIGN, BLOCK_CACHE_BYTES, MIN_BLOCK, PER_THREAD_BLOCK,
                                                 HostOptimizer, block_elems, update_piece)
from lins_ds.runtime.step.host_memory import HOST_PIECE


# --- bytes per element and the floor ------------------------------------------------------------------------------
def test_bytes_per_element_of_each_path():
    # bf16 gradient and parameter copy, Adam (master + two moments, 12 bytes):
    assert bytes_per_element(STAGED) == (2 + 4) + (4 + 4) + (4 + 12 + 12) + (4 + 2) == 48
    assert bytes_per_element(PIECE) == (2 + 4) + (4 + 12 + 12) + (4 + 2) == 40
    assert bytes_per_element(BLOCKS) == 2 + 12 + 12 + 2 == 28
    # fp32 accumulator, fp32 parameters (the master goes up itself: no cast pass)
    assert bytes_per_element(STAGED, grad_bytes=4, param_bytes=0) == (4 + 4) + (4 + 4) + (4 + 12 + 12) == 44
    assert bytes_per_element(PIECE, grad_bytes=4, param_bytes=0) == 36
    assert bytes_per_element(BLOCKS, grad_bytes=4, param_bytes=0) == 4 + 24 == 28
    assert bytes_per_element(BLOCKS, state_bytes=16) == 36  # amsgrad's running maximum, read and written
    assert [p.what for p in passes(STAGED, param_bytes=0)][-1] == "optimizer step"
    with pytest.raises(ValueError, match="not one of"):
        bytes_per_element("fused")


def test_floor_and_achieved_fraction():
    assert floor_seconds(1e9, 100.0, BLOCKS) == pytest.approx(0.28)  # 28 GB at 100 GB/s
    assert floor_seconds(1e9, 100.0, STAGED) == pytest.approx(0.48)
    assert floor_seconds(2.5e8, 50.0, PIECE, grad_bytes=4, param_bytes=0) == pytest.approx(0.25 * 36 / 50)
    # 2.45 G elements/s moving 28 bytes each is 68.6 GB/s: 0.686 of a 100 GB/s host
    assert achieved_fraction(2.45e9, 100.0, BLOCKS) == pytest.approx(0.686)
    with pytest.raises(ValueError, match="not positive"):
        floor_seconds(1e9, 0.0, BLOCKS)


# --- the bandwidth probe and its cache ------------------------------------------------------------------------------
def test_the_probe_measures_positive_finite_bandwidth():
    bw = host_bandwidth.measure(1 << 22, reps=2)
    assert all(math.isfinite(v) and v > 0 for v in (bw.copy_gbs, bw.triad_gbs))
    assert bw.array_bytes == 1 << 22 and bw.threads == torch.get_num_threads()


def test_the_probe_is_cached_and_a_bad_file_is_measured_again(tmp_path):
    def obtain(**kw):
        return host_bandwidth.obtain(str(tmp_path), array_bytes=1 << 20, reps=1, **kw)

    first = obtain()
    assert first.origin.startswith("measured: no cached host bandwidth")
    again = obtain()
    assert again.origin.startswith("cached ") and (again.copy_gbs, again.triad_gbs) == (first.copy_gbs, first.triad_gbs)
    # another launch's key (more ranks share the node) is another file, measured anew
    assert obtain(ranks_per_node=2).origin.startswith("measured") and len(list(tmp_path.iterdir())) == 2
    # a file that says nothing usable (a zero bandwidth, a truncated write) is measured again, and replaced
    path = host_bandwidth.cache_path(host_bandwidth.host_key(1, 1 << 20), str(tmp_path))
    stored = json.loads(open(path).read())
    stored["bandwidth"]["copy_gbs"] = 0.0
    open(path, "w").write(json.dumps(stored))
    found = obtain()
    assert "unreadable" in found.origin and found.copy_gbs > 0
    open(path, "w").write("{")
    assert "unreadable" in obtain().origin
    assert obtain().origin == f"cached {path}"


def test_a_cache_that_cannot_be_written_is_no_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    found = host_bandwidth.obtain(str(blocker / "cache"), array_bytes=1 << 20, reps=1)
    assert found.copy_gbs > 0 and "not cached" in found.origin


def test_a_different_probe_version_is_another_key(monkeypatch):
    before = host_bandwidth.cache_path(host_bandwidth.host_key())
    monkeypatch.setattr(host_bandwidth, "PROBE_VERSION", host_bandwidth.PROBE_VERSION + 1)
    assert host_bandwidth.cache_path(host_bandwidth.host_key()) != before


def test_array_size_beats_the_cache_within_the_memory_share():
    llc = 300 << 20
    assert host_bandwidth.array_bytes_for(llc, 1e12) == 4 * llc
    assert host_bandwidth.array_bytes_for(1 << 20, 1e12) == host_bandwidth.MIN_ARRAY_BYTES
    assert host_bandwidth.array_bytes_for(llc, 8e9, 8) == host_bandwidth.array_bytes_for(llc, 1e9)  # 8 ranks at once
    capped = host_bandwidth.array_bytes_for(llc, 8e9)  # 1 GB for three arrays: a third of it each
    assert capped == int(8e9 / 8 / 3) // 4096 * 4096
    assert host_bandwidth.last_level_cache_bytes() > 0
    assert host_bandwidth.last_level_cache_bytes(set()) == host_bandwidth.ASSUMED_LLC_BYTES
    assert host_bandwidth._size_bytes("32768K") == 32 << 20 and host_bandwidth._size_bytes("2M") == 2 << 20


def test_measure_says_how_close_the_update_comes_to_the_bandwidth(tmp_path, monkeypatch):
    monkeypatch.setattr(host_bandwidth, "MIN_ARRAY_BYTES", 1 << 22)
    monkeypatch.setattr(host_bandwidth, "last_level_cache_bytes", lambda cpus=None: 1 << 20)
    basic = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], lr=1e-3)
    host, kind = host_optimizer.measure(basic, "torch", torch.device("cpu"), 8.0, elems=1 << 20,
                                        cache_dir=str(tmp_path))
    assert kind == "torch" and host.update_elems_per_s > 0
    assert f"for its {bytes_per_element(BLOCKS)} bytes per element ({BLOCKS})" in host.source
    assert "copy bandwidth" in host.source and len(list(tmp_path.iterdir())) == 1  # the bandwidth, cached


# --- the blocked update: fewer bytes, the same bits -----------------------------------------------------------------
def test_blocks_fit_the_cache_share_and_keep_the_kernels_alignment():
    llc = 300 << 20
    assert block_elems(llc) == llc // BLOCK_CACHE_BYTES // BLOCK_ALIGN * BLOCK_ALIGN  # 2.5 M elements
    assert block_elems(llc, sharers=2) == llc // (2 * BLOCK_CACHE_BYTES) // BLOCK_ALIGN * BLOCK_ALIGN
    assert block_elems(llc, sharers=8) == MIN_BLOCK  # eight ranks' updates share it: the fewest calls win
    assert block_elems(1 << 20) == MIN_BLOCK and block_elems(1 << 40) == HOST_PIECE
    assert all(block_elems(c) % BLOCK_ALIGN == 0 for c in (1 << 20, 105 << 20, 3 << 30))
    # each of 15 threads gets at least PER_THREAD_BLOCK of a block: 7.9 M, not the 1 M a 105 MiB cache gives
    assert block_elems(105 << 20) == MIN_BLOCK and block_elems(105 << 20, threads=15) == 15 * PER_THREAD_BLOCK
    assert block_elems(llc, threads=2) == block_elems(llc)  # the cache's share is larger: it decides


def staged_update(opt, master, grad, up, scratch, coef, hyper):
    """The update before issue 59, pass by pass over the whole piece: copy, scale, the optimizer's step, cast."""
    g = scratch[:grad.numel()]
    g.copy_(grad)
    g.mul_(coef)
    master.grad = g.view_as(master)
    opt.step([master], hyper)
    master.grad = None
    if up is not None:
        up.copy_(master.data)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32)


def host_optimizer_for(make, n: int, block: int):
    master = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(1)))
    opt = HostOptimizer(make([torch.nn.Parameter(torch.zeros(1))]), [[master]], "torch", torch.device("cpu"))
    opt.block = block
    return opt, master


ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)  # noqa: E731
ADAM_L2 = lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05)  # noqa: E731
AMSGRAD = lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True)  # noqa: E731
SGD = lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01)  # noqa: E731


@pytest.mark.parametrize("make, path", [(ADAMW, BLOCKS), (ADAM_L2, BLOCKS), (AMSGRAD, BLOCKS), (SGD, PIECE)],
                         ids=["adamw", "adam-l2", "amsgrad", "sgd"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_the_update_gives_the_staged_updates_bits(make, path, param_dtype):
    """Against the staged update, over three steps with and without a clip coefficient: an odd size (the fused
    kernel's scalar tail), blocks of 2048 (several per piece, the last one short)."""
    n = 3 * 2048 + 333
    (new, m_new), (old, m_old) = host_optimizer_for(make, n, 2048), host_optimizer_for(make, n, 2048)
    assert new.path == path
    up_new, up_old = ((torch.empty(n, dtype=param_dtype), torch.empty(n, dtype=param_dtype))
                      if param_dtype != torch.float32 else (None, None))
    scratch_new, scratch_old = torch.empty(n), torch.empty(n)
    gen = torch.Generator().manual_seed(2)
    for step, coef in enumerate((0.37, 1.0, 1 / 3)):
        grad = (torch.randn(n, generator=gen) * 10 ** -step).to(param_dtype)  # as it lies on the host
        grad[:5] = 0.0
        update_piece(new, m_new, grad, up_new, scratch_new, coef, new.hyperparameters())
        staged_update(old, m_old, grad, up_old, scratch_old, coef, old.hyperparameters())
        assert torch.equal(bits(m_new), bits(m_old)), (step, (m_new != m_old).sum())
        if up_new is not None:
            assert torch.equal(bits(up_new), bits(up_old)), step
        s_new, s_old = new.opt.state[m_new], old.opt.state[m_old]
        assert s_new.keys() == s_old.keys()
        for key, value in s_old.items():
            assert (torch.equal(bits(s_new[key]), bits(value)) if value.dim() else
                    s_new[key].item() == value.item() and s_new[key].dtype == value.dtype), (step, key)
    assert not torch.equal(m_new, torch.randn(n, generator=torch.Generator().manual_seed(1)))  # it moved


def _adamw_one_group_l2(ps, **k):
    return torch.optim.AdamW([{"params": [ps[0]]}, {"params": [ps[1]], "decoupled_weight_decay": False}],
                             lr=1e-2, weight_decay=0.3, **k)


def _adam_two_groups(ps, **k):
    return torch.optim.Adam([{"params": [ps[0]], "lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.9)},
                             {"params": [ps[1]], "lr": torch.tensor(3e-3), "amsgrad": True, "maximize": True}],
                            decoupled_weight_decay=True, **k)


@pytest.mark.parametrize("make", [_adamw_one_group_l2, _adam_two_groups], ids=["adamw-group-l2", "adam-groups"])
def test_each_groups_hyperparameters_are_the_whole_tensor_optimizers(make):
    """Against the user's optimizer class, fused, stepping each whole tensor: a group's own weight-decay mode (torch's
    Adam.step reads ``decoupled_weight_decay`` per group), LR as a tensor, amsgrad and maximize in one group only."""
    n, gen = 3 * 2048 + 333, torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=gen) for _ in range(2)]
    ref_params = [torch.nn.Parameter(x.clone()) for x in init]
    ref = make(ref_params, fused=True)
    masters = [torch.nn.Parameter(x.clone()) for x in init]
    opt = HostOptimizer(make([torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]), [[m] for m in masters],
                        "torch", torch.device("cpu"))
    assert opt.path == BLOCKS
    opt.block, scratch = 2048, torch.empty(n)
    for _ in range(3):
        grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(2)]
        for p, g in zip(ref_params, grads):
            p.grad = g.float()
        ref.step()
        for m, g in zip(masters, grads):
            update_piece(opt, m, g, None, scratch, 1.0, opt.hyperparameters())
    for want, got in zip(ref_params, masters):
        assert torch.equal(bits(want), bits(got)), int((want != got).sum())


def test_a_step_count_saved_as_an_int_is_taken_as_torch_keeps_it():
    """A checkpoint of DeepSpeedCPUAdam's kind holds Python int steps: the blocked update counts on from them."""
    n = 4096
    (new, m_new), (old, m_old) = host_optimizer_for(ADAMW, n, 1024), host_optimizer_for(ADAMW, n, 1024)
    grad, scratch = torch.randn(n).to(torch.bfloat16), torch.empty(n)
    for opt, m, update in ((new, m_new, update_piece), (old, m_old, staged_update)):
        update(opt, m, grad, None, scratch, 0.5, opt.hyperparameters())
        opt.opt.state[m]["step"] = int(opt.opt.state[m]["step"].item())
        update(opt, m, grad, None, scratch, 0.5, opt.hyperparameters())
    assert new.opt.state[m_new]["step"].dtype == torch.float32 and new.opt.state[m_new]["step"].item() == 2.0
    assert torch.equal(bits(m_new), bits(m_old))


# --- the threads the host's passes run on ---------------------------------------------------------------------------
def test_host_threads_leave_the_training_thread_its_core(monkeypatch):
    """A team of every core would put one of its threads on the training thread's core, and every parallel region
    (four per block of the blocked update) would wait for it a time slice: the host's threads are one core short of
    this rank's share, at most torch's own setting, at least one."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert host_memory.host_threads(1, cores=16) == 15
    assert host_memory.host_threads(2, cores=16) == 7  # two ranks' updaters and training threads on one node
    assert host_memory.host_threads(8, cores=16) == 1 and host_memory.host_threads(1, cores=1) == 1
    assert host_memory.host_threads(1, cores=2) == 1  # a 2-core slice: the worker alone beside the training thread
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # OMP_NUM_THREADS=4: never more than the user allows
    assert host_memory.host_threads(1, cores=16) == 4


def test_a_launchers_threads_per_rank_are_its_share(monkeypatch):
    """DeepSpeed's --bind_cores_to_rank binds each rank to its cores and sets OMP_NUM_THREADS to their count: that is
    the rank's share, not to be divided by the node's ranks again (8 ranks x 16 cores ran the update on 1 thread).
    A process that sees only a cpuset of the host (a container) without it still shares its cores among the ranks."""
    monkeypatch.setattr(host_memory, "usable_cores", lambda: 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    monkeypatch.setenv("OMP_NUM_THREADS", "16")
    assert host_memory.host_threads(8) == 15
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert host_memory.host_threads(8) == 1  # 16 cores seen by all 8 ranks: 2 each, one for the training thread


def test_usable_cores_heed_a_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    for text, want in (("max 100000", affinity), ("100000 100000", 1), ("150000 100000", min(affinity, 2)),
                       ("50000 100000", 1), ("garbage", affinity)):
        cpu_max.write_text(text + "\n")
        assert host_memory.usable_cores(str(cpu_max)) == want, text
    assert host_memory.usable_cores(str(tmp_path / "none")) == affinity


@pytest.mark.skipif(not host_memory.per_thread_counts(), reason="torch's native backend: one shared pool")
def test_a_host_thread_sets_its_own_team_and_gives_it_back():
    """The count is the calling thread's: the training thread keeps its own while the host thread runs on fewer,
    and torch's default for threads started later is its own again once the block ends."""
    main = torch.get_num_threads()
    seen = {}

    def host():
        seen["before"] = torch.get_num_threads()
        with host_memory.intra_op_threads(1):
            seen["inside"] = torch.get_num_threads()
            inside.set()
            go.wait()
        seen["after"] = torch.get_num_threads()

    inside, go = threading.Event(), threading.Event()
    t = threading.Thread(target=host)
    t.start()
    inside.wait()
    assert torch.get_num_threads() == main  # the training thread's own, while the host thread runs on one
    go.set()
    t.join()
    assert seen["before"] == seen["after"] == main and seen["inside"] == 1
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [main]


def test_the_updater_runs_each_update_on_the_optimizers_threads():
    """``HostUpdater``'s worker applies ``HostOptimizer.threads`` around the step's updates (and ``measure`` times
    the update on the same count)."""
    from lins_ds.runtime.step.host_updater import HostTicket, HostUpdater
    from lins_ds.runtime.step.storage import Copied

    class Opt:
        threads = 1

    updater = HostUpdater.__new__(HostUpdater)  # only what the worker reads
    updater.opt, updater.coef, updater._lane = Opt(), torch.ones(1), host_memory.PinnedHost(torch.device("cpu")).lane()
    piece = SimpleNamespace(master=SimpleNamespace(param=torch.zeros(4)))
    updater.by_unit = [(_Unit("u0"), [piece]), (_Unit("u1"), [piece])]
    updater._error, updater._interval = None, 0.005
    updater._t0, updater._backward_end, updater._ready_at, updater.updated = 0.0, None, {}, [0, 0.0]
    updater._tickets = [HostTicket(updater, "u0"), HostTicket(updater, "u1")]
    seen = []
    updater._update = lambda s, coef, hyper: seen.append(torch.get_num_threads())
    updater._upload = lambda slices: Copied()
    t = threading.Thread(target=updater._run, args=([Copied(), Copied()], []))
    t.start()
    t.join()
    assert updater._error is None and all(tk.ready() for tk in updater._tickets)
    assert [row[0] for row in updater.last_timeline["units"]] == ["u0", "u1"]  # after the step: no backward's end
    assert updater.last_timeline["backward_end_ms"] is None
    assert updater.updated[0] == 8 and updater.updated[1] >= 0  # the elements and seconds every worker updated
    assert seen == ([1, 1] if host_memory.per_thread_counts() else [torch.get_num_threads()] * 2)
    master = torch.nn.Parameter(torch.zeros(8))
    opt = HostOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), [[master]], "torch",
                        torch.device("cpu"))
    assert opt.threads == host_memory.host_threads(1)


# --- inside the last backward: the worker takes a unit whose gradient is there ------------------------------------
class _Unit:
    def __init__(self, name):
        self.name = name


class _Grads:
    """HostGrads' side the worker sees: which units' sums are final."""

    def __init__(self, units):
        self.final = {u: threading.Event() for u in units}

    def is_final(self, unit):
        return self.final[unit].is_set()

    def wait_final(self, unit):
        self.final[unit].wait()

    def error(self):
        return ""


def test_the_worker_updates_a_unit_that_is_ready_before_waiting_for_the_next_forwards():
    """Gradients become final last unit first; the host adds each up in the order they came. Where the next forward's
    unit is not added up yet, the worker takes a unit that is (it waited for the next forward's before, idle while the
    host added up the units ahead of it); of those ready, the one the next forward needs first; with none ready, the
    first that came. The timeline says when each was final, ready and done."""
    import queue
    import time

    from lins_ds.runtime.step.host_updater import HostTicket, HostUpdater, timeline

    a, b, c, d = units = [_Unit(n) for n in "abcd"]  # forward order
    up = HostUpdater.__new__(HostUpdater)
    up.by_unit = [(u, [u.name]) for u in units]
    up._tickets = [HostTicket(up, u.name) for u in units]
    up._grads, up._arrivals, up._t0, up._ready_at = _Grads(units), queue.Queue(), time.perf_counter(), {}
    for u in (d, c, b, a):  # the backward made all four final; the host added up d and b only
        up._arrivals.put((u, [u.name], None, time.perf_counter()))
    up._grads.final[d].set()
    up._grads.final[b].set()
    stuck = threading.Timer(5.0, lambda: [e.set() for e in up._grads.final.values()])  # a worker that waits, freed
    stuck.start()
    work = up._ahead(coef=1.0)
    got = [next(work)[0]]  # b: ready, and needed before d
    got.append(next(work)[0])  # d: the only one ready (a and c are not)
    threading.Timer(0.05, up._grads.final[c].set).start()  # the host adds c, then a
    threading.Timer(0.10, up._grads.final[a].set).start()
    got.append(next(work)[0])  # none ready: the first that came of the rest (c)
    got.append(next(work)[0])
    stuck.cancel()
    assert got == [["b"], ["d"], ["c"], ["a"]]
    assert set(up._ready_at) == {"a", "b", "c", "d"} and all(r >= f >= 0 for f, r in up._ready_at.values())
    rows = [(n, *up._ready_at[n], up._ready_at[n][1] + 0.001) for n in "bdca"]
    out = timeline(rows, up._t0 + 0.002, up._t0)
    assert out["backward_end_ms"] == 2.0 and [r[0] for r in out["units"]] == list("bdca")
    assert out["units"][2][2] >= 50.0  # c was ready only when the host had added it up


# --- the block loop as one TorchScript call -----------------------------------------------------------------------
def test_the_block_loop_runs_scripted_and_a_compiler_that_changes_the_bits_is_not_used(monkeypatch):
    """The blocked update's loop runs as one TorchScript call (no GIL hand-over per op; the bitwise tests above run
    through it). A compiled loop that does not give the Python loop's bits (here one that drops the kernel, as
    TorchScript dropped it while no one read the lists it wrote) is not used: the same loop runs as Python."""
    from lins_ds.runtime.step import host_blocks

    assert host_blocks.scripted() is not None  # this torch scripts it, and it passed the bit check

    def dropped(p, g_in, m, v, vmax, up, scratch, steps, coef, block, decoupled, lr, beta1, beta2, wd, eps, ams, mx):
        if up is not None:
            up.copy_(p)

    monkeypatch.setattr(host_blocks, "_compiled", [])
    monkeypatch.setattr(host_blocks.torch.jit, "script", lambda fn: dropped)
    assert host_blocks.scripted() is None
    calls = []
    real = host_blocks._loop
    monkeypatch.setattr(host_blocks, "_loop", lambda *a: (calls.append(1), real(*a)))
    p = torch.zeros(8)
    host_blocks.fused_blocks(p, torch.ones(8, dtype=torch.bfloat16), torch.zeros(8), torch.zeros(8), None, None,
                             torch.empty(8), [torch.ones(())], 1.0, 4, True, 0.1, 0.9, 0.999, 0.0, 1e-8, False, False)
    assert calls == [1] and not torch.equal(p, torch.zeros(8))  # the Python loop updated
