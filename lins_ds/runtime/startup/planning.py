"""The plan at engine start-up: fixed in the config, or solved (docs/design.md §7), then agreed by all ranks.

With ``"plan": "solve"`` the timing table is, by ``lins.profile``: ``"measure"`` — the cached measured
table for this launch, or a quick measurement (every rank takes part, every rank gets rank 0's table);
``"synthetic"`` — the built-in cluster ``lins.cluster``; or a profile JSON file. The summary names its source.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import psutil
import torch
from deepspeed.utils import logger

from ... import comm, dtypes
from ...plan import (MemorySpec, Plan, PlanError, ProfileTable, Topology, TrainingSpec, candidates, get_cluster,
                     load_model)
from ...plan.context import (SolveContext, check_placement as _check_placement, compute_for, compute_note,
                             read_activations, reserved_gb)
from ...plan import sequence
from ...plan.offload import HostSpec, OffloadSpec, host_optimizer_of, ladder, rungs_from, updates_in_backward, walk
from ...plan.solver import NoFeasiblePlan, _gib
from ...plan import cost, report
from ...plan.layout import needs_unsorted_groups
from ...plan.spec import ALIGN_BYTES
from ...plan.model import from_hf_config, measured
from ..step import host_optimizer, recompute, tiling
from .assign import assign_units, find_layers
from ..config import LinsConfig, LinsConfigError
from ..step.masters import steps_per_parameter
from .facts import LaunchFacts


def _model_spec(module: torch.nn.Module, cfg: LinsConfig):
    """The planner's description of the model: lins.model, else its Hugging Face config where the reader models
    that type, else the model's own parameter counts per unit (``measured``), which never blocks training."""
    if cfg.model:
        return load_model(cfg.model, key="lins.model")
    hf = getattr(module, "config", None)
    why = "not a Hugging Face model"
    if hf is not None and hasattr(hf, "to_dict"):
        try:
            # the implementation the model runs, which to_dict() leaves out: eager attention's memory is quadratic
            attention = {"_attn_implementation": getattr(hf, "_attn_implementation", None)}
            return from_hf_config({**hf.to_dict(), **attention}, type(module).__name__)
        except PlanError as e:
            why = str(e).split(": ", 1)[-1]
    return _measured_spec(module, cfg, why)


def _measured_spec(module: torch.nn.Module, cfg: LinsConfig, why: str):
    """A model the planner's reader does not know: its exact parameters per unit, its widths where its config
    names them (else estimated from a layer's size as a transformer layer's, 12 x hidden^2)."""
    trainable = {p: 0 for p in module.parameters() if p.requires_grad}
    root, layers = assign_units(module, trainable, cfg.unit_modules)
    units = [sum(p.numel() for _, p in root or [])] + [sum(p.numel() for _, p in ps) for _, _, ps in layers]
    hf = getattr(module, "config", None)

    def width(*keys):
        return next((int(getattr(hf, k)) for k in keys if isinstance(getattr(hf, k, None), int)), 0)

    layer = max(units[1:], default=units[0])
    hidden = width("hidden_size", "n_embd", "d_model") or max(1, int((layer / 12) ** 0.5))
    vocab = width("vocab_size") or max(1, units[0] // hidden)
    note = (f"{why}; parameters per unit counted on the model, activations "
            + ("measured by the memory probe" if (cfg.memory_profile or "measure") == "measure" else
               f"estimated as a LLaMA layer of hidden {hidden}"))
    return measured(type(module).__name__, units, hidden, vocab, width("intermediate_size", "n_inner", "ffn_dim"),
                    width("num_attention_heads", "n_head"), note)


def _memory_gb(cfg: LinsConfig, device: torch.device) -> float:
    if cfg.gpu_memory_gb is not None:
        return cfg.gpu_memory_gb
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return psutil.virtual_memory().total / 2**30 / max(1, comm.local_world_size())


PROVISIONAL_SEQ = 2048  # the start-up plan's length when neither lins.seq_len nor a batch has said it


def start_seq_len(module: torch.nn.Module, cfg: LinsConfig) -> tuple:
    """(length, whether the training batches decide it) for the start-up plan: lins.seq_len, else a provisional
    min(max_position_embeddings, PROVISIONAL_SEQ) that the first training batch replaces
    (``runtime/startup/seq_len.py``): a hub model's max_position_embeddings (32k-128k) is what it can read, not what
    a job trains at."""
    if cfg.seq_len:
        return cfg.seq_len, False
    hf = getattr(module, "config", None)
    n = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", None)
    if not n:
        raise LinsConfigError("lins.seq_len: needed with \"plan\": \"solve\" when the model does not say it")
    return min(int(n), PROVISIONAL_SEQ), True


def seq_note(train: TrainingSpec, inferred: bool) -> str:
    """How the plan's sequence length was chosen, for messages that depend on it."""
    if not inferred:
        return f"sized for sequence length {train.seq_len} x micro-batch {train.micro_batch_size} (lins.seq_len)"
    return (f"sized for sequence length {train.seq_len} x micro-batch {train.micro_batch_size}, as the training "
            "batches showed or, before the first, a provisional length; set lins.seq_len to the longest sequence "
            "the job trains on")


def _timing_table(cfg: LinsConfig, topo: Topology, model, train: TrainingSpec, device) -> ProfileTable:
    meshes = cost.required_meshes(topo, candidates(topo))
    if cfg.profile == "synthetic":
        return get_cluster(cfg.cluster).table(meshes)
    if cfg.profile == "measure":
        from ...profiler import obtain

        largest = max(model.unit_params()) * train.param_bytes
        return obtain(topo, meshes, device, quick=True, max_bytes=largest, cache_dir=cfg.profile_cache,
                      log=lambda msg: print(msg, flush=True) if comm.rank() == 0 else None)
    return ProfileTable.load(cfg.profile, key="lins.profile")


def layer_units(module: torch.nn.Module, cfg: LinsConfig) -> list:
    """The layer units' modules, in order (what activation checkpointing counts)."""
    return [[m] for _, m in find_layers(module, cfg.unit_modules)]


def checkpoint_units(module: torch.nn.Module, cfg: LinsConfig):
    """The solver's checkpointing input: lins.activation_checkpointing, or what the model already does
    (``activation_checkpointing_enable`` before deepspeed.initialize fixes how many units, all or every n-th), or
    None: the solver picks."""
    if cfg.activation_checkpointing is not None:
        return cfg.activation_checkpointing
    already = len(recompute.checkpointed_units(layer_units(module, cfg)))
    return already if already else None


def activation_profile(module: torch.nn.Module, cfg: LinsConfig, train: TrainingSpec, device,
                       time_layer: bool = True) -> tuple:
    """(ActivationProfile or None for the formula, a note on its source) per lins.memory_profile; ``time_layer``: the
    probe times a layer (``memory_probe.probe``)."""
    source = cfg.memory_profile or ("measure" if device.type == "cuda" else "formula")
    if source == "formula":
        return None, "formula"
    if source != "measure":
        try:
            return read_activations(source, "lins.memory_profile"), source
        except PlanError as e:
            raise LinsConfigError(str(e)) from None
    from ...profiler.cache import default_dir
    from ..memory import memory_probe

    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    layers = [mods[0] for mods in layer_units(module, cfg)]
    if not vocab or not layers:
        return None, "formula (the memory probe needs a causal LM with a vocab_size and layer units)"
    prof = memory_probe.obtain(module, layers, train.micro_batch_size, train.seq_len, vocab, device,
                               cfg.profile_cache or default_dir(),
                               log=lambda msg: print(msg, flush=True) if comm.rank() == 0 else None,
                               time_layer=time_layer)
    return prof, prof.source


def check_placement(spec: OffloadSpec, layout, topo: Topology) -> None:
    """``plan.context.check_placement``, its error a config error (raised on every rank alike)."""
    try:
        _check_placement(spec, layout, topo)
    except PlanError as e:
        raise LinsConfigError(str(e)) from None


def host_capacity_gb(cfg: LinsConfig) -> float:
    """Host memory this rank may pin: lins.host_memory_gb (per node) or the node's available memory, shared by
    the node's ranks."""
    node = cfg.host_memory_gb if cfg.host_memory_gb is not None else psutil.virtual_memory().available / 2**30
    return node / max(1, comm.local_world_size())


class HostProbe:
    """The host's description for the offload rungs (``plan.offload.ladder``), made the first time a rung needs it:
    measured on every rank and rank 0's kept (every rank must price the same plan) on a GPU, assumed on a CPU. None
    where "auto" cannot offload here (a CPU device; a host optimizer that does not run: said, and training goes on
    without offload); a fixed offload that cannot run raises on every rank. The spec's ``kind`` is the host optimizer
    it chose (a plan that offloads runs it: ``Plan.host_optimizer``)."""

    def __init__(self, basic, cfg: LinsConfig, device: torch.device, grad_dtypes: tuple = (torch.bfloat16,) * 2,
                 given: Optional[HostSpec] = None):
        self.basic, self.cfg, self.device, self.grad_dtypes = basic, cfg, device, grad_dtypes
        self._done, self._host = given is not None, given

    def __call__(self) -> Optional[HostSpec]:
        if not self._done:
            self._done, self._host = True, self._describe()
        return self._host

    def _describe(self) -> Optional[HostSpec]:
        cfg, device = self.cfg, self.device
        if cfg.offload.mode == "auto" and device.type != "cuda":
            return None
        capacity = host_capacity_gb(cfg)
        if device.type != "cuda":
            kind = "torch" if cfg.host_optimizer == "auto" else cfg.host_optimizer
            return HostSpec(capacity, source="assumed: a CPU device", kind=kind)
        try:
            found, error = host_optimizer.measure(self.basic, cfg.host_optimizer, device, capacity,
                                                  grad_dtypes=self.grad_dtypes, cache_dir=cfg.profile_cache), None
        except Exception as e:  # noqa: BLE001 - agreed below: every rank fails (or falls back) together
            found, error = None, str(e) if isinstance(e, LinsConfigError) else f"lins.offload: {type(e).__name__}: {e}"
        error = comm.agree(error)
        if error and cfg.offload.mode == "auto":  # offload is only an option: train without it, and say why
            announce(f"lins: offload off ({error})")
            return None
        if error:
            raise LinsConfigError(error)
        host, kind = comm.broadcast_object(found)
        return dataclasses.replace(host, kind=kind)


def offload_rungs(cfg: LinsConfig, host) -> list:
    """lins.offload's rungs (``plan.offload.ladder``: the one policy, ``lins-ds plan``'s too)."""
    mode, fraction, grads, params = cfg.offload
    return ladder(mode, host, fraction, grads, params)


def solve_context(facts: LaunchFacts, cfg: LinsConfig, ckpt=None, table: Optional[ProfileTable] = None,
                  offload: Optional[OffloadSpec] = None, seq_len: int = 0, tiles: tuple = (1, 1)) -> SolveContext:
    """The solver's inputs for this launch's model, batch, dtypes, optimizer and device (``offload``: one rung of
    ``offload_rungs``; ``seq_len``: the length to size for, else ``start_seq_len``'s; ``tiles``: one rung of
    ``tiling_rungs``, (MLP tiles, logits tiles[, activation offload]))."""
    module, topo = facts.module, facts.topology
    model = _model_spec(module, cfg)
    train = TrainingSpec(seq_len or start_seq_len(module, cfg)[0], facts.micro_batch, facts.grad_accum,
                         facts.param_dtype, dtypes.name_of(facts.accum_dtype), cfg.grad_reduce_dtype,
                         activation_checkpointing=ckpt, optimizer_per_unit=steps_per_parameter(facts.optimizer),
                         mlp_tiles=tiles[0], logits_tiles=tiles[1],
                         activation_offload=tiles[2] if len(tiles) > 2 else False,
                         host_update_in_backward=wants_updates_in_backward(facts, cfg))
    device = facts.device
    table = table or _timing_table(cfg, topo, model, train, device)
    # the probe runs outside DeepSpeed's torch_autocast: a layer timed in the parameters' dtype is not the GEMMs' rate
    acts, acts_note = activation_profile(module, cfg, train, device,
                                         time_layer=dtypes.name_of(facts.gemm_dtype) == facts.param_dtype)
    reserved = reserved_gb(cfg.reserved_gb, device.type)
    layouts = candidates(topo)
    if not comm.SUPPORTS_UNSORTED_GROUPS:  # older torch: only layouts whose groups are in rank order
        layouts = [lay for lay in layouts if not needs_unsorted_groups(topo, lay)]
    spec = offload if offload is not None else OffloadSpec()
    compute = compute_for(table, cfg.cluster, model, acts)
    return SolveContext(model, topo, train, MemorySpec(_memory_gb(cfg, device), reserved), table, compute, layouts,
                        cfg.objective, acts, acts_note, spec,
                        compute_note=compute_note(model, acts, compute, cfg.cluster))


def wants_updates_in_backward(facts: LaunchFacts, cfg: LinsConfig) -> bool:
    """Whether the offloaded units' host updates may start inside the window's last backward: lins.host_update_in_backward
    not false, and nothing the step does needs every gradient first (``gradient_clipping`` 0, no fp16 loss scaling).
    ``true`` where something does is refused, naming both keys (every rank, at start-up)."""
    free = facts.gradient_clipping == 0 and facts.param_dtype != "fp16"
    if cfg.host_update_in_backward is True and not free:
        raise LinsConfigError(
            f"lins.host_update_in_backward: true needs gradient_clipping 0 and no fp16 loss scaling (gradient_clipping "
            f"is {facts.gradient_clipping:g}, parameters {facts.param_dtype}): clipping and the overflow check need "
            "every gradient before any update starts")
    return free and cfg.host_update_in_backward is not False


def _offload_note(context: SolveContext, plan: Plan) -> str:
    host = context.offload.host
    if not plan.placement.on_host or host is None:
        return ""
    inside = (f" ({host.in_backward_update_elems_per_s / 1e9:.2f} inside the last backward)"
              if plan.host_update_in_backward and host.in_backward_update_elems_per_s else "")
    return (f"\n  offload: host optimizer {host.optimizer}, {host.update_elems_per_s / 1e9:.2f} G elements/s{inside}; "
            f"copies {host.h2d_gbs:.1f} GB/s up, {host.d2h_gbs:.1f} GB/s down"
            + (f", gradient sums {host.accumulate_elems_per_s / 1e9:.2f} and norms {host.norm_elems_per_s / 1e9:.2f} G "
               "elements/s" if plan.placement.offloads("g") else "")
            + f" ({host.source}); "
            f"{plan.host_gb:.2f} GiB host memory per rank of {host.capacity_gb:.2f}\n  offload: {FIRST_UPDATE_NOTE}"
            + (f"\n  offload: {IN_BACKWARD_NOTE}" if plan.host_update_in_backward else ""))


IN_BACKWARD_NOTE = ("with gradient_clipping 0 each offloaded unit's host update starts inside the window's last "
                    "backward, as its gradient is final; between that backward and step(), what would read or change "
                    "the updated parameters is refused (lins.host_update_in_backward: false keeps them after step())")

# Said once, at start-up: on one H100's host the step after the first waited 2.1-3.2x the steady wait (Qwen2.5-3B
# widths at 19-40 GiB, bench/results/offload/again_h100/; Llama-3-8B widths at 65536 tokens, long_context/)
FIRST_UPDATE_NOTE = ("the first host update of a fresh run also makes the optimizer's moments on the host, so the "
                     "step after it waits longer for the host; the steps after that are steady")


def solve_plan(facts: LaunchFacts, cfg: LinsConfig, offload=None, seq_len: int = 0, tiles: tuple = (1, 1)) -> tuple:
    """(plan, summary, context) of the fastest plan that fits."""
    context = solve_context(facts, cfg, checkpoint_units(facts.module, cfg), offload=offload, seq_len=seq_len,
                            tiles=tiles)
    return solved(context, cfg.seq_len is None)


def solved(context: SolveContext, inferred: bool) -> tuple:
    """(plan, summary, context with its Solution) of the fastest plan that fits ``context``; ``inferred``: the
    sequence length is not the user's (the error then says how it was chosen)."""
    try:
        sol = context.solve()
    except NoFeasiblePlan as e:
        raise NoPlanFits(f"{e}; {seq_note(context.train, inferred)}") from None
    except PlanError as e:  # the training spec's keys are the lins block's
        msg = str(e)
        raise LinsConfigError("lins." + msg if msg.startswith("activation_checkpointing:") else msg) from None
    summary = report.to_table(sol) + f"\n  memory profile: {context.activations_note}"
    if context.compute_note:
        summary += f"\n  compute: {context.compute_note}"
    summary += _offload_note(context, sol.plan)
    if context.model.unmodelled:
        summary += f"\n  model: {context.model.unmodelled}"
    return sol.plan, summary, dataclasses.replace(context, solution=sol)


def fixed_plan(facts: LaunchFacts, cfg: LinsConfig, offload=None, seq_len: int = 0, tiles: tuple = (1, 1)) -> tuple:
    """(plan, summary, context or None) of the config's fixed layout, with the memory the planner predicts
    for it where the model's shape is known (lins.model or a Hugging Face config)."""
    topo = facts.topology
    layout = cfg.layout(topo)
    n = len(layer_units(facts.module, cfg))
    ck = cfg.activation_checkpointing
    k = 0 if ck is None else (n if ck is True else 0 if ck is False else ck)
    if k > n:
        raise LinsConfigError(f"lins.activation_checkpointing: {k} layer units, but the model has {n}")
    plan = Plan(topo, layout, k, facts.param_dtype, dtypes.name_of(facts.accum_dtype),
                model=type(facts.module).__name__, profile_source="fixed in config", num_layers=n,
                mlp_tiles=tiles[0], logits_tiles=tiles[1], activation_offload_units=_fixed_offload(tiles, k))
    summary = _fixed_summary(plan)
    spec = offload if offload is not None else OffloadSpec()
    if spec.mode == "fixed":
        check_placement(spec, layout, topo)
    try:  # predicted with a synthetic timing table: a fixed plan needs no measurement of collectives
        table = get_cluster(cfg.cluster).table(cost.required_meshes(topo, [layout]))
        context = solve_context(facts, cfg, k, table, offload, seq_len, tiles)
    except PlanError as e:  # a prediction never blocks a fixed plan; a fixed offload still applies
        if spec.mode == "fixed":
            # the least this offload asks for: its first placement (check_placement: the layout carries one)
            placement = spec.placements(layout, topo.world_size)[0].with_units(spec.choices(n + 1)[0])
            plan = dataclasses.replace(plan, placement=placement,
                                       host_optimizer=host_optimizer_of(spec.host, placement))
        return plan, summary + _fixed_offload_note(plan) + f" (memory not predicted: {e})", None
    return fixed_predicted(context, plan, summary)


def fixed_predicted(context: SolveContext, plan: Plan, summary: str) -> tuple:
    """(plan, summary, context) of a fixed layout with the offload ``context`` allows and the memory it predicts."""
    layout, k = plan.layout, plan.activation_checkpointing_units
    check_placement(context.offload, layout, context.topo)
    e = context.fewest_offloaded(layout, k) if context.offload.mode != "off" else context.evaluate(layout, k)
    if e.memory.host_gb > e.host_capacity_gb:
        raise LinsConfigError(f"lins.offload: the fixed plan's offloaded state and activations need "
                              f"{_gib(e.memory.host_gb)} "
                              f"GiB of host memory per rank, {_gib(e.host_capacity_gb)} GiB available "
                              "(lins.host_memory_gb / ranks per node)")
    plan = dataclasses.replace(plan, memory_gb=e.memory.total_gb, predicted_peak_gb=e.memory.allocated_gb,
                               memory_profile=e.memory.activation_source, placement=e.placement,
                               host_gb=e.memory.host_gb,
                               host_optimizer=host_optimizer_of(context.offload.host, e.placement),
                               host_update_in_backward=updates_in_backward(context.train, layout,
                                                                           context.topo.world_size, e.placement))
    summary += _fixed_offload_note(plan)
    summary += (f"; predicted peak {e.memory.allocated_gb:.2f} GiB allocated, {e.memory.total_gb:.2f} GiB with "
                f"margin and reserve (activations: {context.activations_note})")
    if context.model.unmodelled:
        summary += f"; model: {context.model.unmodelled}"
    return plan, summary + _offload_note(context, plan), context


STATE_WORDS = {"os": "optimizer state", "g": "gradients", "p": "parameters"}


def _fixed_offload_note(plan: Plan) -> str:
    place = plan.placement
    what = ", ".join(STATE_WORDS[state] for state in place.states())
    return f"; {what} of the last {place.n_units} unit(s) {place.where()}" if place.n_units else ""


class NoPlanFits(LinsConfigError):
    """No plan fits the GPU budget (with the offload the solver was offered)."""


def tiling_rungs(cfg: LinsConfig, module: torch.nn.Module) -> list:
    """lins.tiling's and lins.activation_offload's rungs (``plan.sequence.rungs``: "auto" offers tiling only where no
    plan fits untiled, and only for a model ``runtime.step.tiling`` can tile; a fixed tiling is its one rung, refused
    for another model; then activation offload, where Lins solves the plan)."""
    why = tiling.unsupported(module)
    if isinstance(cfg.tiling, tuple) and cfg.tiling != (1, 1) and why:
        raise LinsConfigError(f"lins.tiling: {cfg.tiling[0]} MLP and {cfg.tiling[1]} logits tiles, but "
                              f"{why.removeprefix('lins: ')}")
    act = cfg.activation_offload  # a fixed layout offloads a fixed number of layers' inputs, never "auto"'s fewest
    return sequence.rungs(cfg.tiling, not why, act if cfg.solve or act != "auto" else False)


def with_host(spec: OffloadSpec, activation_offload, host: "HostProbe") -> OffloadSpec:
    """``plan.sequence.with_host`` with the measured host (``HostProbe``), else this host's memory with the link
    assumed (a CPU device, where the copies are plain ones)."""
    return sequence.with_host(spec, activation_offload,
                              lambda: host() or HostSpec(host_capacity_gb(host.cfg), source="assumed"))


def _tiling_note(plan: Plan, cfg: LinsConfig) -> str:
    if plan.mlp_tiles == 1 and plan.logits_tiles == 1:
        return ""
    why = "lins.tiling" if isinstance(cfg.tiling, tuple) else "no plan fits untiled"
    note = (f"\n  sequence tiling: the MLPs in {plan.mlp_tiles} tile(s), the logits and loss in {plan.logits_tiles} "
            f"({why})")
    if plan.logits_tiles > 1:  # the tiled loss never makes the logits whole: a script that reads them must say so
        note += ("; a training forward with labels returns the loss and empty logits: where the script reads "
                 "outputs.logits, set lins.tiling to {\"mlp\": n} or false")
    return note


def make_plan(facts: LaunchFacts, cfg: LinsConfig, seq_len: int = 0) -> tuple:
    """(plan, summary, solve context or None): solved, or the fixed layout of the config, on the first rung of
    lins.offload's ladder that fits (``offload_rungs``, walked by ``plan.offload.walk``: "auto" offers offload only
    where no GPU-resident plan fits; a fixed offload is its one rung), on the first rung of lins.tiling's that has one
    (``tiling_rungs``, walked by ``plan.sequence.walk``: untiled first)."""
    build = solve_plan if cfg.solve else fixed_plan
    wants_updates_in_backward(facts, cfg)  # a refused lins.host_update_in_backward before anything is timed
    host = HostProbe(facts.optimizer, cfg, facts.device, (facts.accum_dtype, facts.reduce_dtype))

    def tiled(mlp: int, logits: int, act) -> tuple:
        def attempt(spec: OffloadSpec) -> tuple:
            spec = with_host(spec, act, host)
            plan, summary, context = build(facts, cfg, spec, seq_len=seq_len, tiles=(mlp, logits, act))
            fits = cfg.solve or context is None or plan.memory_gb <= context.mem.capacity_gb
            return (plan, summary + _tiling_note(plan, cfg), context), fits
        return walk(offload_rungs(cfg, host), attempt, (NoPlanFits,))

    plan, summary, context = sequence.walk(tiling_rungs(cfg, facts.module), tiled, (NoPlanFits,))
    return plan, summary + head_tiling_note(facts, cfg, plan, context, host), context


def head_tiling_note(facts: LaunchFacts, cfg: LinsConfig, plan: Plan, context: Optional[SolveContext],
                     host: "HostProbe") -> str:
    """``sequence.head_tiling`` for a solved plan, priced from its ``context`` (its timing table, activation profile
    and the host already measured): nothing is measured again and no collective runs, so ranks whose budgets differ
    never wait on each other here."""
    if not cfg.solve or context is None or context.solution is None:
        return ""
    train = sequence.tiled(context.train, *sequence.HEAD_TILES)

    def tiled_best():
        def attempt(spec: OffloadSpec) -> tuple:
            ctx = dataclasses.replace(context, offload=spec, train=train, solution=None)
            return solved(ctx, cfg.seq_len is None)[2].solution.best, True
        return walk(offload_rungs(cfg, host), attempt, (NoPlanFits,))

    return sequence.head_tiling(cfg.tiling, not tiling.unsupported(facts.module), plan, context.solution.best,
                                tiled_best, (NoPlanFits, LinsConfigError))


def start_plan(facts: LaunchFacts, cfg: LinsConfig) -> tuple:
    """``make_plan`` at start-up. Where the training batches will decide the length (lins.seq_len not set) and no
    plan fits the provisional one, shorter lengths are tried, down to ``SHORTEST_START_SEQ``: the first batch
    re-sizes the plan anyway, and fails then, naming its length, if it does not fit."""
    seq, inferred = start_seq_len(facts.module, cfg) if cfg.solve else (0, False)
    while True:
        try:
            return make_plan(facts, cfg, seq_len=seq)
        except NoPlanFits:
            if not inferred or seq <= SHORTEST_START_SEQ:
                raise
            seq = max(SHORTEST_START_SEQ, seq // 2)


SHORTEST_START_SEQ = 128


FORWARD_SHARE = 0.5  # of the device memory left, what a forward-only engine's parameters may take unsharded


def forward_only_plan(facts: LaunchFacts, cfg: LinsConfig) -> tuple:
    """(plan, summary) of an engine without an optimizer (a reference, frozen or inference model): only P matters.
    A fixed plan's P is kept; else P is replicated where the parameters take at most ``FORWARD_SHARE`` of the memory
    still free (a training engine may be there already), else sharded inside a node, else over every rank."""
    from ...plan import Factor, Layout

    topo, param_dtype, module, device = facts.topology, facts.param_dtype, facts.module, facts.device
    need = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30
    if not cfg.solve:
        p = cfg.layout(topo).p
        why = "fixed in config"
    else:
        free = _memory_gb(cfg, device) - reserved_gb(cfg.reserved_gb, device.type)
        if device.type == "cuda":  # what another engine holds; this model, already moved here, is not counted
            mine = sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type == "cuda")
            free -= (torch.cuda.memory_allocated(device) - mine) / 2**30
        free = min(comm.all_gather_object(free))  # every rank the same choice
        sizes = [Factor(1, 1), Factor(topo.gpus_per_node, 1), Factor(topo.gpus_per_node, topo.nodes)]
        p = next((f for f in sizes if need / f.size <= FORWARD_SHARE * free), sizes[-1])
        why = f"parameters {need:.2f} GiB, {max(free, 0):.2f} GiB free"
    layout = Layout(p, p, p)
    plan = Plan(topo, layout, 0, param_dtype, param_dtype, model=type(module).__name__,
                profile_source="forward only", num_layers=len(layer_units(module, cfg)))
    return plan, (f"Lins plan (forward only: no optimizer) on {topo.nodes} node(s) x {topo.gpus_per_node}: "
                  f"P={p} ({why})")


def plan_for_length(facts: LaunchFacts, cfg: LinsConfig, context: SolveContext, plan: Plan, seq_len: int) -> tuple:
    """(plan, summary, context) sized for ``seq_len`` from the last plan's ``context``
    (its timing table, activation profile and offload: nothing is measured again, except the host where offload
    becomes necessary, on every rank alike). The ladder is walked from the rung the context stands on. A fixed layout
    keeps its layout and checkpointing."""
    context = dataclasses.replace(context, train=dataclasses.replace(context.train, seq_len=seq_len), solution=None)
    inferred = cfg.seq_len is None
    host = HostProbe(facts.optimizer, cfg, facts.device, (facts.accum_dtype, facts.reduce_dtype), context.offload.host)

    def tiled(mlp: int, logits: int, act) -> tuple:
        train = sequence.tiled(context.train, mlp, logits, act)
        fixed = dataclasses.replace(plan, mlp_tiles=mlp, logits_tiles=logits, activation_offload_units=_fixed_offload(
            (mlp, logits, act), plan.activation_checkpointing_units))

        def attempt(spec: OffloadSpec) -> tuple:
            ctx = dataclasses.replace(context, offload=with_host(spec, act, host), train=train)
            out = solved(ctx, inferred) if cfg.solve else fixed_predicted(ctx, fixed, _fixed_summary(fixed))
            return (out[0], out[1] + _tiling_note(out[0], cfg), out[2]), \
                cfg.solve or out[0].memory_gb <= context.mem.capacity_gb
        return walk(rungs_from(offload_rungs(cfg, host), context.offload), attempt, (NoPlanFits,))

    plan, summary, context = sequence.walk(tiling_rungs(cfg, facts.module), tiled, (NoPlanFits,))
    return plan, summary + head_tiling_note(facts, cfg, plan, context, host), context


def _fixed_offload(tiles: tuple, ckpt_units: int) -> int:
    """A fixed layout's activation offload: lins.activation_offload's number of layers, of those it checkpoints."""
    act = tiles[2] if len(tiles) > 2 else False
    return min(act, ckpt_units) if not isinstance(act, bool) else 0


def _fixed_summary(plan: Plan) -> str:
    k, n = plan.activation_checkpointing_units, plan.num_layers
    return (f"Lins plan (fixed in config) on {plan.topology.nodes} node(s) x {plan.topology.gpus_per_node}: "
            f"{plan.layout}" + (f", {k} of {n} layer units checkpointed" if k else "")
            + (f", the inputs of {plan.activation_offload_units} of them held on the host"
               if plan.activation_offload_units else ""))


def agree_on_plan(plan: Plan, check_collectives: bool = False, settings: Optional[dict] = None) -> bool:
    """Every rank must execute the same plan, with the same batch settings (``settings``: config key -> value, e.g.
    the micro-batch, the accumulation steps, the dtypes: a rank that accumulates over fewer micro-batches would reduce
    at another time than the others and hang them): compared on every rank, and every rank fails, naming the key and
    each rank's value, where they differ. Returns whether any rank asked for the collective-order check (an
    environment variable may reach only some ranks; the check is a collective, so all of them run it)."""
    views = comm.all_gather_object((plan.digest(), check_collectives, settings or {}))
    for key in sorted(settings or {}):
        values = [v.get(key) for _, _, v in views]
        if len(set(map(repr, values))) != 1:
            by_value: dict = {}
            for r, v in enumerate(values):
                by_value.setdefault(repr(v), []).append(r)
            raise LinsConfigError(f"{key}: the ranks differ ({'; '.join(f'{v} on ranks {rs}' for v, rs in by_value.items())}); "
                                  "every rank must train with the same settings")
    digests = [d for d, _, _ in views]
    if len(set(digests)) != 1:
        raise LinsConfigError(f"lins: ranks computed different plans (digests {digests}); "
                              "check that every rank sees the same config, model and profile")
    return any(c for _, c, _ in views)


def misaligned_note(module: torch.nn.Module, dtype: torch.dtype) -> str:
    """A line for the start-up summary naming the linear layers with a width that is not a multiple of 16 bytes (8
    bf16 elements): an LM head over an odd vocabulary, as ``resize_token_embeddings`` leaves one added token. cuBLAS
    runs their GEMMs on slower kernels; the shape compute model prices them so (bench/compute_model.py). Layers
    holding under 0.1 % of the linear layers' weights (a LoRA adapter of rank 4) are not worth padding and go
    unnamed. Empty where there are none."""
    align = ALIGN_BYTES // dtype.itemsize  # ``dtype``: the GEMMs' (``gemm_dtype``)
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    total = sum(m.in_features * m.out_features for _, m in linears)  # shapes, not numel: weights may be sharded
    odd = [f"{name} ({m.in_features} -> {m.out_features})" for name, m in linears
           if (m.in_features % align or m.out_features % align) and m.in_features * m.out_features >= 1e-3 * total]
    if not odd:
        return ""
    more = f" and {len(odd) - 3} more" if len(odd) > 3 else ""
    return (f"\nlins: note: {', '.join(odd[:3])}{more}: a width not a multiple of {align} runs its GEMMs on slower "
            f"kernels (in bf16 on an H200 at 0.12-0.36 of the aligned rate: one token added to a vocabulary of "
            f"128256 made a 1.2B LLaMA's step about 40 % longer, two to four tokens 9-16 %). Pad it, e.g. "
            f"model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64) for a vocabulary.")


def announce(summary: str) -> None:
    if comm.rank() == 0:
        logger.info("\n" + summary)
        print(summary, flush=True)
