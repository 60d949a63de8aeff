"""Simulate one training step of Lins and of DeepSpeed's baselines at any scale (pure Python).

Communication uses the planner's own pieces: each system's collectives are written as ``Collective``s
and timed with the same profile table (``cost.timed``). What differs per system is what it sends and
how much of it hides behind compute:

    zero0   gradient AllReduce over all ranks at the boundary (DeepSpeed's data parallelism)
    zero1   gradient AllReduce over all ranks at the boundary; after the update a global parameter
            AllGather
    zero2   gradient ReduceScatter over all ranks every micro-batch; after the update a global
            parameter AllGather
    zero3   per module (DeepSpeed fetches module by module) AllGather over all ranks in forward and
            again in backward, ReduceScatter over all ranks every micro-batch; prefetch overlaps them
            with the same phase's compute
    zeropp  ZeRO-3 with hpZ and no quantisation: forward gathers over all ranks, backward gathers from
            the node-local secondary copy, ReduceScatter over all ranks
    mics    shard group = one node: module gathers inside the node in forward and backward,
            ReduceScatter inside the node every micro-batch, AllReduce across nodes at the boundary
    lins    the solver's plan and the executor's schedule (``cost.schedule``); P-sync after the update
            not overlapped, as in the paper's comparison (it turned broadcast-forward overlap off)

Overlap (the assumption that decides the baselines' numbers): each DeepSpeed system as ``ds_configs/`` runs it.
ZeRO-0 reduces after the backward, exposed. ZeRO-1 and ZeRO-2 run with ``overlap_comm`` (``OVERLAP_COMM``): their
reduction runs bucket by bucket in the backward's hooks on a side stream, ZeRO-1's only in the last micro-batch's
backward (the boundary), ZeRO-2's in every one; both gather the parameters after the step, exposed. ZeRO-3, ZeRO++
and MiCS fetch each module on the critical path of its forward and backward. Lins overlaps as its executor does:
gathers and ReduceScatters with the same phase's compute (prefetch, asynchronous reduction), the boundary AllReduce
with the last backward; its P-sync stays exposed as in the paper. Exposed time of an overlapped phase =
max(0, comm - compute of that phase).

Compute: training FLOPs per token (``ModelSpec.flops_per_token``) at ``peak x efficiency``, backward
twice the forward, recompute one more forward under activation checkpointing (used by a system only
when it does not fit without). Optimizer update: the bytes it touches at full memory bandwidth.
Step = compute + update + exposed communication, each scaled by the system's ``Overheads`` where
they were fitted from GPU runs (``bench/calibrate.py``, ``python -m bench simulate --fit``); for the ZeRO-3 family
the exposed part is the slower of the link and its module fetches' own cost (``StepTerms.step``). The
efficiency is calibrated from one stated point.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from lins_ds.plan import cost
from lins_ds.plan.memory import memory
from lins_ds.plan.model import ModelSpec
from lins_ds.plan.profile_table import ProfileTable
from lins_ds.plan.solver import ComputeSpec, NoFeasiblePlan, compute_seconds, optimizer_seconds, solve
from lins_ds.plan.spec import MemorySpec, TrainingSpec
from lins_ds.plan.topology import Factor, Layout, PlanError, Topology

SYSTEMS = ("zero0", "zero1", "zero2", "zero3", "zeropp", "mics", "lins")
FETCH_SYSTEMS = ("zero3", "zeropp", "mics")  # DeepSpeed's stage-3 code: parameters fetched module by module
MODULES_PER_LAYER = 7  # q, k, v, o, gate, up, down: DeepSpeed gathers module by module (norms persist)
# DeepSpeed systems whose ds_configs/ set "overlap_comm": stage 1 and 2 then reduce in the backward's hooks on a side
# stream (stage_1_and_2.py: process_gradients -> reduce_ready_partitions_and_remove_grads; stage 1 at the boundary
# only), overlapped as Lins' executor overlaps its own (``cost.exposed_seconds``). Stage 3's overlap is its fetch model.
OVERLAP_COMM = ("zero1", "zero2")


@dataclass(frozen=True)
class SimResult:
    system: str
    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float
    mfu: float
    tokens_per_gpu_s: float
    memory_gb: float
    checkpointing: bool
    layout: dict
    fits: bool = True
    update_s: float = 0.0  # the optimizer update (exposed_comm_s holds the rest: communication, per-fetch and host
    # costs, and what the overlapped boundary AllReduce and P-sync still cost)
    checkpoint_units: int = 0  # layer units under activation checkpointing (Lins chooses how many)

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        out["memory_gb_per_gpu"] = out.pop("memory_gb")
        return out


def equivalent_layout(system: str, topo: Topology) -> Layout:
    """The (P, G, OS) placement each baseline keeps, for its memory."""
    L, M = topo.gpus_per_node, topo.nodes
    one, node, world = Factor(1, 1), Factor(L, 1), Factor(L, M)
    return {"zero0": Layout(one, one, one), "zero1": Layout(one, one, world), "zero2": Layout(one, world, world),
            "zero3": Layout(world, world, world),
            "zeropp": Layout(world, world, world), "mics": Layout(node, node, node)}[system]


def _c(state, phase, op, mesh, nbytes, calls):
    return cost.Collective(state, phase, op, "sim", mesh, int(nbytes), int(calls))


def baseline_schedule(system: str, topo: Topology, model: ModelSpec, train: TrainingSpec) -> list:
    """What DeepSpeed sends per step for ``system`` (untimed)."""
    K, pb, rb = train.grad_accum, train.param_bytes, train.reduce_bytes
    world, node = Factor(topo.gpus_per_node, topo.nodes), Factor(topo.gpus_per_node, 1)
    across = Factor(1, topo.nodes)
    layer, root, n_layers = model.layer_params(), model.root_params(), model.num_layers
    module = layer / MODULES_PER_LAYER
    param_gather = [_c("os", "param_sync", "all_gather", world, layer * pb, n_layers),
                    _c("os", "param_sync", "all_gather", world, root * pb, 1)]
    if system in ("zero0", "zero1"):
        reduce = [_c("g", "boundary", "all_reduce", world, layer * rb, n_layers),
                  _c("g", "boundary", "all_reduce", world, root * rb, 1)]
        return reduce + (param_gather if system == "zero1" else [])
    if system == "zero2":
        return [_c("g", "backward", "reduce_scatter", world, layer * rb, K * n_layers),
                _c("g", "backward", "reduce_scatter", world, root * rb, K)] + param_gather
    fwd_mesh = node if system == "mics" else world
    # ZeRO++'s backward gathers from its node-sized hpZ copy; with one GPU per node hpZ is off (size 1)
    bwd_mesh = node if system == "mics" or (system == "zeropp" and topo.gpus_per_node > 1) else world
    rs_mesh = node if system == "mics" else world
    out = [_c("p", "forward", "all_gather", fwd_mesh, module * pb, K * n_layers * MODULES_PER_LAYER),
           _c("p", "forward", "all_gather", fwd_mesh, root * pb, K),
           _c("p", "backward", "all_gather", bwd_mesh, module * pb, K * n_layers * MODULES_PER_LAYER),
           _c("g", "backward", "reduce_scatter", rs_mesh, module * rb, K * n_layers * MODULES_PER_LAYER),
           _c("g", "backward", "reduce_scatter", rs_mesh, root * rb, K)]
    if system == "mics" and topo.nodes > 1:
        out.append(_c("g", "boundary", "all_reduce", across, model.total_params() * rb / topo.gpus_per_node, 1))
    return out


@dataclass(frozen=True)
class Overheads:
    """Per-system costs the byte model leaves out, fitted from GPU runs of each system (``bench/calibrate.py``):
    ``comm_factor`` scales the modelled exposed communication (what the system's bucketing and scheduling make
    of the profiled collective times), ``update_factor`` the modelled optimizer update (bytes at full memory
    bandwidth; the real update makes extra copies and launches), ``overlap_factor`` the share of the time of the
    boundary AllReduce and P-sync that Lins' executor overlaps with the last backward and the next forward (for
    ZeRO-1, of the boundary reduction ``overlap_comm`` overlaps with the last backward; ``boundary_overlap``) that
    its step still pays (the overlapped kernels slowing each other, or the overlap
    falling short: the runs do not tell which), ``per_fetch_s`` is the cost of one module fetch
    of the ZeRO-3 family (its hooks and launches, forward and backward) on a host of ``host_s_per_module``, and
    ``per_fetch_byte_s`` its cost per byte it assembles (a fetch waits for its own gather). With the shape model,
    the host's work: ``per_layer_s`` a layer pass, ``per_ckpt_pass_s`` more for a checkpointed layer's forward and
    recompute, ``per_layer_step_s`` a layer once a step, ``per_step_s`` a step (``StepTerms.step``). ``compute``
    holds the fitted compute efficiency per model name."""

    systems: dict  # system -> {"comm_factor", "update_factor", "per_fetch_s", "per_fetch_byte_s"}
    compute: dict = field(default_factory=dict)  # model name -> achievable fraction of peak
    source: str = ""
    cluster: str = ""  # the compute model (cluster name) the efficiencies are fractions of
    host_s_per_module: Optional[float] = None  # the host speed (bench/host.py) at which per_fetch_s holds
    compute_table: Optional[dict] = None  # the shape model's device table (its JSON): ``compute["shape"]`` scales it

    @property
    def shape_model(self) -> bool:
        return self.compute_table is not None

    def compute_spec(self, base: ComputeSpec) -> ComputeSpec:
        """``base`` with this calibration's compute model: the shape model at its fitted factor, where it has one."""
        if self.compute_table is None:
            return base
        from bench.compute_model import ComputeTable

        return replace(base, table=ComputeTable.from_json(self.compute_table), achievable_mfu=self.compute["shape"])

    def terms(self, system: str) -> dict:
        return {**DEFAULT_TERMS, **self.systems.get(system, {})}

    def host_scale(self, host_s_per_module: Optional[float]) -> float:
        """How much slower than the calibration's a host measured at ``host_s_per_module`` drives a module fetch;
        1 where either is unknown (a cluster never measured: the calibration's host is assumed)."""
        if not host_s_per_module or not self.host_s_per_module:
            return 1.0
        return host_s_per_module / self.host_s_per_module

    def to_json(self) -> dict:
        return {"systems": self.systems, "compute_efficiency": self.compute, "source": self.source,
                "cluster": self.cluster, "host_s_per_module": self.host_s_per_module,
                "compute_table": self.compute_table}

    @classmethod
    def from_json(cls, obj: dict) -> "Overheads":
        host = obj.get("host_s_per_module")
        return cls({k: {t: float(d[t]) for t in DEFAULT_TERMS if t in d} for k, d in obj["systems"].items()},
                   {m: float(e) for m, e in obj.get("compute_efficiency", {}).items()}, str(obj.get("source", "")),
                   str(obj.get("cluster", "")), float(host) if host else None, obj.get("compute_table"))


DEFAULT_TERMS = {"comm_factor": 1.0, "overlap_factor": 0.0, "update_factor": 1.0, "per_fetch_s": 0.0,
                 "per_fetch_byte_s": 0.0, "per_layer_s": 0.0, "per_step_s": 0.0, "per_layer_step_s": 0.0,
                 "per_ckpt_pass_s": 0.0}
NO_OVERHEADS = Overheads({}, {}, "none")


def fetches(system: str, model: ModelSpec, train: TrainingSpec) -> int:
    """Module fetches per step of the ZeRO-3 family (forward and backward; norms persist); 0 for the others."""
    if system not in FETCH_SYSTEMS:
        return 0
    return train.grad_accum * 2 * (model.num_layers * MODULES_PER_LAYER + 2)


@dataclass(frozen=True)
class StepTerms:
    """One step of a system, by term (seconds)."""

    compute_s: float  # forward and backward of every micro-batch (recompute included)
    update_s: float  # the optimizer's element-wise update of this rank's OS share
    exposed_s: float  # modelled exposed communication
    comm_s: float  # all modelled communication
    fetches: int
    fetch_bytes: float = 0.0  # the parameter bytes the module fetches assemble (each module whole, fwd and bwd)
    host_scale: float = 1.0  # this host's time per module over the calibration host's (Overheads.host_scale)
    layers: int = 0  # layers x micro-batches: each a forward and a backward pass
    recomputes: int = 0  # checkpointed layers x micro-batches: each one more forward pass
    layer_fwd_s: float = 0.0  # the kernels of one layer's forward pass (compute_s's rate; 0 without the shape model)
    layer_bwd_s: float = 0.0  # and of its backward pass
    model_layers: int = 0  # the model's layers, for the host's work per layer once a step (0 without the shape model)
    overlapped_s: float = 0.0  # the boundary AllReduce and P-sync hidden behind compute (``boundary_overlap``)

    def host_passes(self, per_layer_s: float, per_ckpt_pass_s: float = 0.0, per_layer_step_s: float = 0.0) -> tuple:
        """(passes, their kernels' seconds, checkpointed passes among them, boundary passes among them): the layer
        passes whose host work (launches, hooks: ``per_layer_s`` at this host's speed) outlasts their kernels, so
        that the GPU waits for the host (see ``step``). A checkpointed layer's forward and its recompute each cost the
        host ``per_ckpt_pass_s`` more (measured on host-bound steps, ``bench/results/simulate/shapes/call17`` and
        ``call19``; presumably the checkpoint's saved-tensor hooks in the first and the recompute's set-up inside the
        backward in the second). The last micro-batch's backward of each layer (``model_layers`` passes) costs it
        ``per_layer_step_s`` more: the work a system does once a step per layer, inside that backward's hooks
        (DeepSpeed's stage 1 reduces each gradient there), which a pass with longer kernels hides too."""
        host, ckpt = per_layer_s * self.host_scale, (per_layer_s + per_ckpt_pass_s) * self.host_scale
        last = (per_layer_s + per_layer_step_s) * self.host_scale
        fwd, ck, bwd = host > self.layer_fwd_s, ckpt > self.layer_fwd_s, host > self.layer_bwd_s
        lb = last > self.layer_bwd_s
        plain, checkpointed = self.layers - self.recomputes, 2 * self.recomputes  # forwards, and ckpt fwd + recompute
        other = self.layers - self.model_layers  # backward passes of the earlier micro-batches
        return (fwd * plain + ck * checkpointed + bwd * other + lb * self.model_layers,
                (fwd * plain + ck * checkpointed) * self.layer_fwd_s + (bwd * other + lb * self.model_layers)
                * self.layer_bwd_s, ck * checkpointed, lb * self.model_layers)

    def waits(self, ov: dict) -> tuple:
        """(link, fetch): the exposed communication, and the fetches' own cost under ``ov``: their hooks and
        launches (host time, so scaled by the host's speed) and the bytes each fetch waits for."""
        return (ov["comm_factor"] * self.exposed_s,
                ov["per_fetch_s"] * self.fetches * self.host_scale + ov["per_fetch_byte_s"] * self.fetch_bytes)

    def fetch_bound(self, ov: dict) -> bool:
        """Whether the module fetches, not the link, set the pace (see ``step``)."""
        link, fetch = self.waits(ov)
        return fetch > link

    def step(self, ov: dict) -> float:
        """Compute + update + the slower of the link and the fetches + what the overlapped boundary AllReduce and
        P-sync still cost (``overlap_factor``) + what the host adds: a DeepSpeed fetch
        waits for its gather, and its hooks run while the prefetched gathers are in flight, so on a fast link
        (NVLink) the fetches' CPU cost is what is left exposed and on a slow one (sockets, a network) the
        transfers. A layer pass takes the longer of its kernels and the host's work to launch them and run its
        hooks (small layers wait for the host: ``host_passes``; a checkpointed layer's two forwards cost it more);
        each step has a fixed host cost too, and one per
        layer once a step (``per_layer_step_s``; e.g. DeepSpeed's stage 1 reduces each parameter's gradient, bucket
        by bucket, only in the last micro-batch's backward: ``reduce_ready_partitions_and_remove_grads``), which that
        backward's kernels hide as they hide the per-pass cost."""
        passes, kernels, checkpointed, boundary = self.host_passes(ov["per_layer_s"], ov["per_ckpt_pass_s"],
                                                                   ov["per_layer_step_s"])
        host = (ov["per_layer_s"] * passes + ov["per_ckpt_pass_s"] * checkpointed + ov["per_step_s"]
                + ov["per_layer_step_s"] * boundary)
        return (self.compute_s + ov["update_factor"] * self.update_s + max(self.waits(ov))
                + ov["overlap_factor"] * self.overlapped_s + host * self.host_scale - kernels)


def step_terms(system: str, colls, model: ModelSpec, train: TrainingSpec, compute: ComputeSpec, ckpt_units: int,
               s_os: int, overlap_param_sync: bool = False, overlap_comm: bool = True) -> StepTerms:
    """Lins overlaps as its executor does (``cost.exposed_seconds``; the P-sync only with
    ``overlap_param_sync``, off in the paper's comparison); ZeRO-1 and ZeRO-2 (``OVERLAP_COMM``) overlap their
    reduction the same way (``overlap_comm``: False prices them as DeepSpeed's default for stage 1 and 2 runs them,
    all exposed) and gather the parameters after the step, exposed; the rest of DeepSpeed's collectives are taken as
    exposed."""
    fwd, bwd = compute_seconds(model, train, compute, ckpt_units)
    layer_fwd, layer_bwd = layer_seconds(model, train, compute)
    total = sum(c.total_s for c in colls)
    overlaps = system == "lins" or (overlap_comm and system in OVERLAP_COMM)
    sync = overlap_param_sync and system == "lins"
    exposed = cost.exposed_seconds(list(colls), fwd, bwd, train.grad_accum, sync) if overlaps else total
    overlapped = boundary_overlap(colls, fwd, bwd, sync) if overlaps else 0.0
    n = fetches(system, model, train)
    # a group of one rank gathers nothing: ZeRO-3's fetch then only points the module at its own copy
    # (partition_parameters._no_gather_coalesced), MiCS's gathers on a one-rank group (a local copy at memory
    # speed, priced as nothing); the hooks still run
    gathers = any(c.state == "p" and c.op == "all_gather" and c.mesh.size > 1 for c in colls)
    return StepTerms(train.grad_accum * (fwd + bwd), optimizer_seconds(model, train, s_os, compute), exposed, total,
                     n, 2.0 * train.grad_accum * model.total_params() * train.param_bytes if n and gathers else 0.0,
                     layers=train.grad_accum * model.num_layers,
                     recomputes=train.grad_accum * min(ckpt_units, model.num_layers), layer_fwd_s=layer_fwd,
                     layer_bwd_s=layer_bwd, model_layers=model.num_layers if compute.table is not None else 0,
                     overlapped_s=overlapped)


def boundary_overlap(colls, forward_s: float, backward_s: float, overlap_param_sync: bool) -> float:
    """The part of the boundary AllReduce and the P-sync that Lins' executor (or DeepSpeed's ``overlap_comm``) hides
    behind the last backward and the next forward (``cost.exposed_seconds`` leaves the rest exposed): what
    ``overlap_factor`` prices, fitted on 2-GPU runs whose plans (P and G whole; DeepSpeed's ZeRO-1) have no other
    communication. The gathers and ReduceScatters overlapped within each pass (a sharded plan's, ZeRO-2's) are left
    out: one factor for them and ZeRO-2's four modes was tried and moved a one-GPU grid shape past 10 %.
    ``forward_s`` / ``backward_s``: one micro-batch."""
    ph = cost.per_phase(list(colls))
    return min(ph["boundary"], backward_s) + (min(ph["param_sync"], forward_s) if overlap_param_sync else 0.0)


def layer_seconds(model: ModelSpec, train: TrainingSpec, compute: ComputeSpec) -> tuple:
    """(forward, backward) kernels of one layer and micro-batch at ``compute``'s factor, from the model's shape;
    (0, 0) without the shape model (which is also the only one with a host cost per layer pass)."""
    if compute.table is None:
        return 0.0, 0.0
    from bench.compute_model import step_compute

    one = step_compute(model, replace(train, grad_accum=1), compute.table)
    return one.layer_forward_s / compute.achievable_mfu, one.layer_backward_s / compute.achievable_mfu


def _baseline_memory(system: str, model: ModelSpec, topo: Topology, train: TrainingSpec, mem: MemorySpec) -> tuple:
    """(checkpointed units, MemoryBreakdown) of a baseline: no checkpointing unless it does not fit without."""
    layout = equivalent_layout(system, topo)
    for k in (0, model.num_layers):
        breakdown = memory(model, train, mem, topo, layout, k)
        if breakdown.total_gb <= mem.capacity_gb:
            break
    return k, breakdown


def system_terms(system: str, model: ModelSpec, topo: Topology, train: TrainingSpec, mem: MemorySpec,
                 table: ProfileTable, compute: ComputeSpec, layout: Optional[Layout] = None,
                 overlap_param_sync: bool = False, overlap_comm: bool = True) -> Optional[tuple]:
    """(StepTerms, layout, checkpointed units, MemoryBreakdown) of ``system``; Lins solves unless ``layout`` is given
    (the paper's objective, communication); None when no Lins plan fits. ``overlap_comm``: DeepSpeed's ZeRO-1 and
    ZeRO-2 overlap their reduction (``step_terms``)."""
    if system == "lins":
        try:
            layouts = [layout] if layout is not None else None
            sol = solve(model, topo, train, MemorySpec(1e9 if layout is not None else mem.capacity_gb,
                                                       mem.reserved_gb), table, compute, layouts=layouts,
                        objective="comm")
        except NoFeasiblePlan:
            return None
        best = sol.best
        terms = step_terms(system, best.collectives, model, train, compute, best.ckpt_units, best.layout.os.size,
                           overlap_param_sync)
        return terms, best.layout, best.ckpt_units, best.memory
    layout = equivalent_layout(system, topo)
    ckpt, breakdown = _baseline_memory(system, model, topo, train, mem)
    given = train.activation_checkpointing
    if isinstance(given, int) and not isinstance(given, bool):  # a run that checkpointed (bench/train.py --checkpointing)
        ckpt, breakdown = given, memory(model, train, mem, topo, layout, given)
    colls = cost.timed(baseline_schedule(system, topo, model, train), table)
    terms = step_terms(system, colls, model, train, compute, ckpt, layout.os.size, overlap_comm=overlap_comm)
    return terms, layout, ckpt, breakdown


def simulate(model: ModelSpec, topo: Topology, train: TrainingSpec, mem: MemorySpec, table: ProfileTable,
             compute: ComputeSpec, systems=SYSTEMS, overheads: Overheads = NO_OVERHEADS,
             overlap_comm: bool = True) -> dict:
    """Every system's step; the fetch cost at the speed of ``table``'s host where its profile measured it
    (``meta.host_s_per_module``, ``lins-ds profile``), else the calibration host's. ``overlap_comm``: whether
    DeepSpeed's ZeRO-1 and ZeRO-2 overlap their reduction with the backward (as ``ds_configs/`` runs them)."""
    results = {}
    scale = overheads.host_scale(table.meta.get("host_s_per_module"))
    for system in systems:
        found = system_terms(system, model, topo, train, mem, table, compute, overlap_comm=overlap_comm)
        if found is None:
            continue
        terms, layout, ckpt, breakdown = found
        terms = replace(terms, host_scale=scale)
        mem_gb, ov = breakdown.total_gb, overheads.terms(system)
        step = terms.step(ov)
        tokens_gpu_s = train.tokens_per_micro_batch * train.grad_accum / step
        mfu = tokens_gpu_s * model.flops_per_token(train.seq_len) / (compute.peak_tflops * 1e12)
        update_s = ov["update_factor"] * terms.update_s
        results[system] = SimResult(system, step, terms.compute_s, step - terms.compute_s - update_s, terms.comm_s,
                                    mfu, tokens_gpu_s, mem_gb, ckpt > 0, layout.to_json(), mem_gb <= mem.capacity_gb,
                                    update_s, ckpt)
    return results


def sim_train(model: ModelSpec, topo: Topology, seq_len: int, micro_batch: int, global_batch_tokens: int,
              param_dtype: str = "bf16") -> TrainingSpec:
    """Micro-batches per step from the global batch: the paper's strong scaling (fixed 4M tokens)."""
    per_step = topo.world_size * micro_batch * seq_len
    if global_batch_tokens % per_step:
        raise PlanError(f"--global-batch-tokens: {global_batch_tokens} is not a multiple of GPUs x micro-batch x "
                        f"seq-len = {per_step}")
    return TrainingSpec(seq_len, micro_batch, global_batch_tokens // per_step, param_dtype)


def calibrate(model: ModelSpec, topo: Topology, train: TrainingSpec, mem: MemorySpec, table: ProfileTable,
              compute: ComputeSpec, system: str, target_mfu: float, overheads: Overheads = NO_OVERHEADS,
              overlap_comm: bool = True) -> ComputeSpec:
    """The compute efficiency at which ``system`` (with ``overheads``) simulates to ``target_mfu`` (bisection)."""
    lo, hi = 0.05, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        got = simulate(model, topo, train, mem, table, compute.at(mid), (system,), overheads, overlap_comm)[system].mfu
        lo, hi = (mid, hi) if got < target_mfu else (lo, mid)
    return compute.at((lo + hi) / 2)
