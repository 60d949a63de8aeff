"""The simulator held to measurement (docs/design.md §11): the terms the byte model leaves out, fitted from GPU
runs of every system at once, and every run's predicted step next to its measured one.

A run is one row of a ``python -m bench run`` result (``bench.json``): a system (a DeepSpeed mode, or Lins with its
plan), a model, a batch, a topology (the real host, or emulated nodes). The simulator prices it term by term
(``simulate.StepTerms``) with the measured collective table of that topology. The measured step is then fitted
as a non-negative sum of those terms, in relative error (a 0.2 s run weighs as much as a 5 s one)::

    step = compute / efficiency[model]       compute at peak: the same for every system of a model
         + update_factor * update            the optimizer update's bytes at full memory bandwidth
         + max(comm_factor[system] * exposed,    the modelled exposed communication, per system, or
               per_fetch * fetches * host    DeepSpeed's module fetches, whichever is slower: their hooks and
               + per_fetch_byte * bytes)     launches (host time: scaled by the run's measured host over the
                                             median measured one, bench/host.py; 1 where a run did not
                                             measure it) and the bytes each fetch waits for. Shared by the
                                             ZeRO-3 family (ZeRO-3, ZeRO++ and MiCS run the same code); 0
                                             fetches for the others
         + overlap_factor[system] * overlapped   the boundary AllReduce and P-sync that Lins' executor hides
                                             behind the last backward and the next forward, and the boundary
                                             reduction DeepSpeed's ZeRO-1 hides behind the last backward
                                             (``overlap_comm``; ZeRO-2's, hidden within each backward, has no
                                             factor; the rest of DeepSpeed's is exposed): what of it the step
                                             still pays (``simulate.boundary_overlap``)

With the shape model (``--compute-table``) the compute is priced from each model's shape at one factor: the one
the table measured (its timed layers over their price, ``compute_model.in_training_factor``), held, where the table
timed layers; else fitted. Each system adds ``per_step``, and, for the layer passes whose kernels are shorter than
it, ``per_layer`` in their place (``simulate.StepTerms.step``); which passes those are is fitted as the branch
below, from 2 ms a pass. The last micro-batch's backward of each layer adds ``per_layer_step`` to that host work
(what a system does once a step per layer, in that backward's hooks: DeepSpeed's stage 1 reduces each gradient
there), hidden likewise behind longer kernels. A checkpointed layer's forward and recompute add ``per_ckpt_pass``,
one term for every system. The update factor is Lins' own and DeepSpeed's own (``_update_column``), and
``overlap_factor`` is held at 1 at most: hiding communication cannot cost a step more than exposing it.

The maximum is fitted by its active branch: each ZeRO-3-family run's regressor is the branch that is slower
under the previous round's terms (the first round sums both), repeated until no run changes branch. Tried
as a sum, the fit could not hold ZeRO-3 on 2 emulated nodes at both model sizes (+20 % at 1B, -26 % at 7B):
on sockets the fetch cost hides behind the transfers. Without the byte term one cost per fetch cannot hold the
one-host runs of both sizes (a 7B fetch costs 1.8x a 1B one: its modules are 2.5x larger): 7B's were 11-12 % low.

A term is shared unless the data can tell its values apart: within one model the compute and the update are
the same for every system, so with one efficiency per model a factor per optimizer implementation is not
determined (the fit trades it against the efficiency; tried, it gave updates at 14x the byte model and a 7B
efficiency of 1). The shape model's measured factor prices the compute, so there the two implementations' update
factors are told apart (the optimizer step by phase, ``shapes/call21``: DeepSpeed's 1.34-1.68x Lins'). Sharing also
leaves each term several runs, so a run left out of the fit can still be predicted: the leave-one-out column
of ``validate``, the honest figure. Lins' exposed time depends on the compute it overlaps, so the fit repeats
with the new efficiencies until they settle.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from lins_ds.plan import (ComputeSpec, Layout, MemorySpec, ModelSpec, PlanError, ProfileTable, Topology, TrainingSpec,
                          load_model)
import warnings

from .fit import nnls
from .simulate import FETCH_SYSTEMS, SYSTEMS, Overheads, StepTerms, system_terms
from bench.compute_model import ComputeTable, in_training_factor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_OF = {"nocomm": "zero0", "lins_as_zero3": "lins", "lins-budget": "lins"}  # bench modes -> systems
# the first round's host cost of a layer pass (launches and hooks), which picks the passes that wait for the host;
# each next round picks them with the last one's fit. Started from nothing, no pass would wait and none be fitted.
HOST_PER_LAYER_PASS_S = 2e-3


@dataclass(frozen=True)
class Run:
    system: str
    mode: str
    model: str
    topology: str  # "host" or "emulated"
    nodes: int
    gpus_per_node: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    step_s: float
    peak_gb: Optional[float]  # torch.cuda.max_memory_allocated
    planned_peak_gb: Optional[float]  # Lins: what its plan predicted at start-up (measured activations)
    over_nocomm_s: Optional[float]  # step minus the no-communication run's, where the bench ran one
    layout: Optional[Layout]  # Lins' plan
    host_s: Optional[float] = None  # the host's time per module during the run (bench/host.py); older results: None
    ckpt_units: Optional[int] = None  # layer units checkpointed (a tuned run's plan); None: as the solver fits it
    spec: Optional[ModelSpec] = None  # the model's shape when it has no built-in name (a tuned run's)

    @property
    def label(self) -> str:
        where = "1-GPU" if self.nodes * self.gpus_per_node == 1 and self.mode != "nocomm" else self.topology
        ckpt = f" ckpt {self.ckpt_units}" if self.ckpt_units is not None else ""
        return f"{self.model} {where} {self.mode}{ckpt}"

    @property
    def config(self) -> tuple:
        """What the model computes per step: runs of one config share a no-communication baseline."""
        return self.model, self.seq_len, self.micro_batch, self.grad_accum

    @property
    def key(self) -> tuple:
        """The mode a run measures: runs with the same key are repeats of one another (other leases)."""
        return self.label, str(self.layout or ""), self.config, self.nodes, self.gpus_per_node


def _flag(command: str, name: str, default: int) -> int:
    m = re.search(rf"--{name}[ =](\d+)", command)
    return int(m.group(1)) if m else default


def load_tune_runs(path: str) -> list:
    """The candidates ``"plan": "tune"`` measured (``tune-runs.jsonl`` beside the profiles), one run each: Lins with
    the candidate's layout and checkpointing. Candidates with optimizer state on the host are left out (the
    simulator has no offload term), and so is a candidate measured twice (another launch) but once per line."""
    runs = []
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for r in rows:
            plan, key = r["plan"], r["key"]
            if plan.get("offload_units") or r.get("measured_step_s") is None:
                continue
            spec = ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in key["model"].items()})
            train, nodes = key["train"], int(key["nodes"])
            runs.append(Run("lins", "lins-tune", spec.name, "host" if nodes == 1 else "emulated", nodes,
                            int(key["gpus_per_node"]), int(train["seq_len"]), int(train["micro_batch_size"]),
                            int(train["grad_accum"]), float(r["measured_step_s"]), r.get("measured_peak_gb"),
                            r.get("predicted_peak_gb"), None, Layout.from_json(plan), None,
                            int(plan.get("activation_checkpointing_units", 0)), spec))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, PlanError) as e:
        raise PlanError(f"{path}: not a tune-runs.jsonl of \"plan\": \"tune\" ({e})") from None
    return runs


def load_train_runs(directories: list) -> list:
    """One-GPU runs of ``bench/train.py`` (``<name>_<system>.json``: the shape grid, bench/gpu_compute_shapes.sh): each
    model is its ``--model`` config.json, its checkpointed layers as ``shapes.load`` reads them."""
    from .shapes import load

    runs = []
    try:
        for r in load(directories):
            spec = load_model(r["model"] if os.path.isabs(r["model"]) else os.path.join(ROOT, r["model"]))
            spec = replace(spec, name=os.path.basename(r["model"])[:-5])
            runs.append(Run(SYSTEM_OF.get(r["system"], r["system"]), r["system"], spec.name, "host", 1, 1, r["seq"],
                            r["mb"], 1, r["step_s"], None, None, None,
                            Layout.from_json(r["plan"]) if r.get("plan") else None, None, r["ckpt"], spec))
    except (OSError, ValueError, KeyError, TypeError, PlanError) as e:
        raise PlanError(f"{', '.join(directories)}: not folders of bench/train.py results ({e})") from None
    return runs


def load_all(paths: list) -> list:
    """The runs of every path (``load_runs``); the folders of ``bench/train.py`` results read together, so that a
    shape's runs split over two calls still pair up."""
    folders = [p for p in paths if os.path.isdir(p)]
    return [r for p in paths if not os.path.isdir(p) for r in load_runs(p)] + \
        (load_train_runs(folders) if folders else [])


def load_runs(path: str) -> list:
    """The runs of a ``python -m bench run`` result, of a tuned job's ``tune-runs.jsonl``, or of a folder of
    ``bench/train.py`` results."""
    if path.endswith(".jsonl"):
        return load_tune_runs(path)
    if os.path.isdir(path):
        return load_train_runs([path])
    try:
        with open(path, encoding="utf-8") as f:
            bench = json.load(f)
        rows = [(t, r) for t, table in bench["table"].items() for r in table["rows"]]
        command = bench.get("command", "")
        nocomm = bench.get("no_comm_limit")
        if nocomm:
            rows.append(("host", dict(nocomm, mode="nocomm", world_size=1, gpus_per_node=1)))
        mb = int(bench.get("micro_batch_size") or _flag(command, "micro-batch-size", 2))  # older results: the
        gas = int(bench.get("grad_accum") or _flag(command, "grad-accum", 2))  # command line, bench's defaults
        runs = []
        for topo, r in rows:
            world, step = int(r["world_size"]), float(r["median_step_s"])
            if r.get("samples_per_gpu_per_step", mb * gas) != mb * gas:
                raise ValueError(f"{r['mode']}: {r['samples_per_gpu_per_step']} samples per GPU per step, not "
                                 f"micro-batch {mb} x grad-accum {gas}")
            per_node, plan = int(r.get("gpus_per_node") or world), r.get("plan")
            runs.append(Run(SYSTEM_OF.get(r["mode"], r["mode"]), r["mode"], load_model(str(r["model"])).name, topo,
                            world // per_node,
                            per_node, int(r["seq_len"]), mb, gas, step, r.get("peak_memory_gb"),
                            (plan or {}).get("predicted_peak_gb"),
                            step - nocomm["median_step_s"] if nocomm and r["mode"] != "nocomm" else None,
                            Layout.from_json(plan) if plan else None, r.get("host_s_per_module")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, PlanError) as e:
        raise PlanError(f"{path}: not a python -m bench run result ({e})") from None
    return runs


def terms_of(run: Run, tables: dict, compute: ComputeSpec, host_scale: float = 1.0) -> tuple:
    """(StepTerms, MemoryBreakdown) of a run, with its topology's measured table (``tables[run.topology]``), its
    fetches priced at ``host_scale`` times the calibration host's time."""
    model = run.spec or load_model(run.model)
    topo = Topology(run.nodes, run.gpus_per_node)
    train = TrainingSpec(run.seq_len, run.micro_batch, run.grad_accum, activation_checkpointing=run.ckpt_units)
    table = tables.get(run.topology if topo.world_size > 1 else "host")
    if table is None:
        raise PlanError(f"{run.label}: no profile for the {run.topology} topology (--profile / --emulated-profile)")
    found = system_terms(run.system, model, topo, train, MemorySpec(1e9), table, compute, run.layout,
                         overlap_param_sync=True)
    if found is None:
        raise PlanError(f"{run.label}: no plan")
    return replace(found[0], host_scale=host_scale), found[3]


def compute_key(run: Run, compute: ComputeSpec) -> str:
    """Whose compute efficiency prices a run: its model's (compute from FLOPs at peak), or the one factor of the
    shape model (compute from the model's shape with the device's measured table: ``compute.table``)."""
    return "shape" if compute.table is not None else run.model


def _columns(run: Run, terms: StepTerms, efficiency: float, bound: Optional[bool], key: str,
             per_layer_s: float = HOST_PER_LAYER_PASS_S, per_ckpt_pass_s: float = 0.0,
             per_layer_step_s: float = HOST_PER_LAYER_PASS_S) -> dict:
    """The run's regressors: what each fitted coefficient multiplies. ``bound``: whether the run's fetches,
    not its link, set the pace (None: not yet known, both count). With the shape model (``key`` "shape") each
    system also has a host cost per step, one per layer once a step (e.g. DeepSpeed's stage 1 reduces
    gradients parameter by parameter at the boundary only: gas 2 runs tell it from the per-pass cost), and one per layer
    pass, which only the passes that wait for the host at ``per_layer_s`` (the previous round's) pay, in their
    kernels' place; of those, a checkpointed layer's forward and recompute pay one more cost each (``ckpt``,
    shared: the checkpoint is PyTorch's, whichever system runs it) and wait at ``per_layer_s + per_ckpt_pass_s``."""
    passes, kernels, checkpointed, boundary = (terms.host_passes(per_layer_s, per_ckpt_pass_s, per_layer_step_s)
                                               if key == "shape" else (0, 0.0, 0, 0))
    cols = {f"compute:{key}": (terms.compute_s - kernels) * efficiency,  # at peak / as measured: coefficient 1/eff.
            _update_column(run.system, key): terms.update_s}
    if key == "shape":
        cols[f"layer:{run.system}"] = passes * terms.host_scale
        cols[f"step:{run.system}"] = terms.host_scale
        cols[f"boundary:{run.system}"] = boundary * terms.host_scale
        cols["ckpt"] = checkpointed * terms.host_scale
    if not terms.fetches or bound is not True:
        cols[f"comm:{run.system}"] = terms.exposed_s
    if terms.overlapped_s > 0:  # what the overlapped boundary AllReduce and P-sync still cost the step
        cols[f"overlap:{run.system}"] = terms.overlapped_s
    if terms.fetches and bound is not False:
        cols["fetch"] = terms.fetches * terms.host_scale
        cols["fetch_byte"] = terms.fetch_bytes
    return cols


def _solve(runs: list, cols: list, names: list, fixed: dict) -> dict:
    """The coefficients of ``names`` minimising the runs' relative errors (NNLS), those of ``fixed`` held."""
    free = [n for n in names if n not in fixed]
    a = np.array([[c.get(n, 0.0) / r.step_s for n in free] for r, c in zip(runs, cols)])
    rhs = np.array([1.0 - sum(c.get(n, 0.0) * v for n, v in fixed.items()) / r.step_s for r, c in zip(runs, cols)])
    return dict(zip(free, nnls(a, rhs)), **fixed)


def _sides(host_passes: tuple) -> tuple:
    """Which passes wait for the host (``StepTerms.host_passes`` without the kernels' seconds): what a round of the
    fit settles on."""
    passes, _, checkpointed, boundary = host_passes
    return passes, checkpointed, boundary


def _update_column(system: str, key: str) -> str:
    """The update factor a run's optimizer step shares: with the shape model, Lins' own, or DeepSpeed's (its ZeRO
    optimizers keep fp32 master weights and copy every gradient into them: a step by phase,
    bench/results/simulate/shapes/call21, takes 1.34-1.68 times Lins' on the same shape); one otherwise."""
    if key != "shape":
        return "update"
    return "update:lins" if system == "lins" else "update:deepspeed"


def _update_factor(coef: dict, system: str) -> Optional[float]:
    """A system's fitted update factor: its implementation's (Lins' or DeepSpeed's); where the runs had none of that
    implementation, the other's (closer than the byte model's 1, which prices the step 3-4 times too cheap)."""
    own = _update_column(system, "shape")
    other = "update:deepspeed" if own == "update:lins" else "update:lins"
    return coef.get(own, coef.get(other, coef.get("update")))


def host_of(run: Run, tables: dict) -> Optional[float]:
    """The host speed a run is priced at: its own measurement, else its topology's profile's (``lins-ds profile``
    records it), else None (the calibration host's, as ``simulate`` assumes for a profile without one)."""
    table = tables.get(run.topology)
    return run.host_s or (table.meta.get("host_s_per_module") if table is not None else None)


def reference_host(runs: list) -> Optional[float]:
    """The host the fitted per-fetch cost holds at: the median of the runs' measurements."""
    measured = [r.host_s for r in runs if r.host_s]
    return float(np.median(measured)) if measured else None


def fit(runs: list, tables: dict, compute: ComputeSpec, source: str = "", rounds: int = 30, cluster: str = "",
        host_s: Optional[float] = None) -> Overheads:
    """Every system's terms and every model's compute efficiency, fitted from ``runs`` (module docstring); the
    per-fetch cost at a host of ``host_s`` (default: ``reference_host(runs)``)."""
    keys = [compute_key(r, compute) for r in runs]
    eff = {k: 1.0 if k == "shape" else compute.achievable_mfu for k in keys}
    host = Overheads({}, host_s_per_module=host_s or reference_host(runs))
    bound, layer_s, step_s, ckpt_s, seen, fits = [None] * len(runs), {}, {}, 0.0, [], []
    table = compute.table.to_json() if compute.table is not None else None
    # a table with timed layers measured the shape model's factor itself (kernels among other kernels): not fitted
    fixed = {"compute:shape": in_training_factor(compute.table)} if compute.table is not None and compute.table.layers \
        else {}
    for _ in range(rounds):
        terms = [terms_of(r, tables, compute.at(eff[k]), host.host_scale(host_of(r, tables)))[0]
                 for r, k in zip(runs, keys)]
        cols = [_columns(r, t, eff[k], b and b[0], k, layer_s.get(r.system, HOST_PER_LAYER_PASS_S), ckpt_s,
                         step_s.get(r.system, HOST_PER_LAYER_PASS_S))
                for r, t, b, k in zip(runs, terms, bound, keys)]
        names = sorted({n for c in cols for n, v in c.items() if v > 0})
        coef = _solve(runs, cols, names, fixed)
        over = {n: 1.0 for n, v in coef.items() if n.startswith("overlap:") and v > 1.0}
        if over:  # hiding communication behind compute cannot cost a step more than leaving it exposed
            coef = _solve(runs, cols, names, dict(fixed, **over))
        missing = [m for m in eff if coef.get(f"compute:{m}", 0.0) <= 0]
        if missing:
            raise PlanError(f"{missing}: the runs do not determine this model's compute efficiency")
        new = {m: 1.0 / coef[f"compute:{m}"] for m in eff}
        ov = _overheads(coef, new, source, cluster, host.host_s_per_module, table)
        new_bound = [(t.fetch_bound(ov.terms(r.system)) if t.fetches else None,
                      _sides(t.host_passes(*(ov.terms(r.system)[n] for n in ("per_layer_s", "per_ckpt_pass_s",
                                                                              "per_layer_step_s"))))
                      if k == "shape" else None)
                     for r, t, k in zip(runs, terms, keys)]
        settled = max(abs(new[m] - eff[m]) for m in eff) < 1e-4 and new_bound == bound
        cycle = new_bound != bound and new_bound in seen  # back to an earlier round's sides: a cycle
        eff, bound = new, new_bound
        seen.append(new_bound)
        fits.append(ov)
        layer_s, ckpt_s = {s: ov.terms(s)["per_layer_s"] for s in ov.systems}, ov.terms("lins")["per_ckpt_pass_s"]
        step_s = {s: ov.terms(s)["per_layer_step_s"] for s in ov.systems}
        if settled:
            break
        if cycle:  # each round's terms were fitted to the sides the one before chose: keep the cycle's best
            rounds_in_cycle = fits[seen.index(new_bound) + 1:]
            ov = min(rounds_in_cycle, key=lambda o: _error(o, runs, tables, compute, keys, host))
            warnings.warn(f"python -m bench simulate --fit: {len(rounds_in_cycle)} rounds go round a cycle (runs "
                          f"changing between link- and fetch-bound, or layer passes between host- and GPU-bound); "
                          f"the terms of the one that predicts the runs best are used")
            break
    else:
        warnings.warn(f"python -m bench simulate --fit: the terms did not settle in {rounds} rounds (a run keeps changing "
                      f"between link- and fetch-bound, or a layer pass between host- and GPU-bound); the last round's "
                      f"terms are used")
    return ov


def _error(ov: Overheads, runs: list, tables: dict, compute: ComputeSpec, keys: list, host: Overheads) -> float:
    """The sum of the squared relative errors of the runs' steps as ``ov`` predicts them (its own sides)."""
    total = 0.0
    for r, k in zip(runs, keys):
        terms = terms_of(r, tables, compute.at(ov.compute[k]), host.host_scale(host_of(r, tables)))[0]
        total += (terms.step(ov.terms(r.system)) / r.step_s - 1.0) ** 2
    return total


def _overheads(coef: dict, efficiency: dict, source: str, cluster: str, host_s: Optional[float],
               compute_table: Optional[dict] = None) -> Overheads:
    """Per-system terms from the fitted coefficients, for every system (the shared ones apply to a system with no
    run too); a term no run determined keeps its default."""
    out = {}
    for s in SYSTEMS:
        terms = {"comm_factor": coef.get(f"comm:{s}"), "overlap_factor": coef.get(f"overlap:{s}"),
                 "update_factor": _update_factor(coef, s),
                 "per_fetch_s": coef.get("fetch") if s in FETCH_SYSTEMS else None,
                 "per_fetch_byte_s": coef.get("fetch_byte") if s in FETCH_SYSTEMS else None,
                 "per_layer_s": coef.get(f"layer:{s}"), "per_step_s": coef.get(f"step:{s}"),
                 "per_layer_step_s": coef.get(f"boundary:{s}"), "per_ckpt_pass_s": coef.get("ckpt")}
        out[s] = {t: float(v) for t, v in terms.items() if v is not None}
    return Overheads(out, {m: float(e) for m, e in efficiency.items()}, source, cluster, host_s, compute_table)


def predict(run: Run, tables: dict, compute: ComputeSpec, overheads: Overheads) -> tuple:
    """(predicted step, StepTerms, MemoryBreakdown, efficiency) of a run under fitted terms."""
    if overheads.shape_model:  # any model: its compute from its shape, at the one fitted factor
        compute = overheads.compute_spec(compute)
        efficiency = compute.achievable_mfu
    elif run.model not in overheads.compute:
        raise PlanError(f"{run.label}: the calibration has no compute efficiency for model {run.model!r} "
                        f"(it has {sorted(overheads.compute)}); fit with a run of it, or fit the shape model "
                        f"(--compute-table)")
    else:
        efficiency = overheads.compute[run.model]
    terms, breakdown = terms_of(run, tables, compute.at(efficiency), overheads.host_scale(host_of(run, tables)))
    return terms.step(overheads.terms(run.system)), terms, breakdown, efficiency


def validate(runs: list, tables: dict, compute: ComputeSpec, overheads: Overheads, leave_one_out: bool = False) -> list:
    """Per run: predicted next to measured step (and, with ``leave_one_out``, the prediction of a fit made
    without that run and its repeats: a repeat left in would predict it), the step over the no-communication
    run, and the peak allocated memory."""
    rows, base = [], {}
    for r in runs:
        step, terms, breakdown, efficiency = predict(r, tables, compute, overheads)
        if r.mode == "nocomm":
            base[r.config] = step
        ov = overheads.terms(r.system)
        rows.append({"run": r.label, "mode": r.label + (f" {r.layout}" if r.layout else ""),
                     "setting": f"{r.nodes}x{r.gpus_per_node} GPUs, seq {r.seq_len}, micro-batch {r.micro_batch} x "
                                f"{r.grad_accum}", "system": r.system, "plan": str(r.layout) if r.layout else None,
                     "compute_efficiency": efficiency, "measured_step_s": r.step_s, "predicted_step_s": step,
                     "error_pct": 100 * (step / r.step_s - 1), "measured_over_nocomm_s": r.over_nocomm_s,
                     "host_s_per_module": r.host_s, "host_scale": terms.host_scale,
                     "measured_peak_gb": r.peak_gb,
                     "predicted_peak_gb": r.planned_peak_gb if r.planned_peak_gb is not None else breakdown.allocated_gb,
                     "peak_source": "plan" if r.planned_peak_gb is not None else "simulator (formula activations)",
                     "terms": {"compute_s": terms.compute_s, "update_s": ov["update_factor"] * terms.update_s,
                               "exposed_comm_s": terms.waits(ov)[0], "fetch_s": terms.waits(ov)[1],
                               "overlapped_comm_s": ov["overlap_factor"] * terms.overlapped_s,
                               "fetches": terms.fetches, "fetch_bound": terms.fetch_bound(ov)}})
    left_out = {}  # key -> the fit made without that mode's runs
    for r, row in zip(runs, rows):
        if r.config in base and r.mode != "nocomm":
            row["predicted_over_nocomm_s"] = row["predicted_step_s"] - base[r.config]
        if leave_one_out:
            if r.key not in left_out:
                left_out[r.key] = _fit_without(r.key, runs, tables, compute, overheads.host_s_per_module)
            others = left_out[r.key]
            known = others and (others.shape_model or r.model in others.compute)
            loo = predict(r, tables, compute, others)[0] if known else None
            row["loo_predicted_step_s"] = loo
            row["loo_error_pct"] = 100 * (loo / r.step_s - 1) if loo is not None else None
    return rows


def _fit_without(key: tuple, runs: list, tables: dict, compute: ComputeSpec,
                 host_s: Optional[float]) -> Optional[Overheads]:
    """The fit made without the runs of one mode (at the full fit's reference host, so that the unmeasured runs
    keep the host they are taken at), or None where the others do not determine it."""
    try:
        return fit([o for o in runs if o.key != key], tables, compute, host_s=host_s)
    except PlanError:
        return None


def per_mode(rows: list) -> list:
    """One row per mode: its repeated measurements (median, range) next to the median of their predictions (runs
    differ only in their hosts' measured speed). The median is what a prediction is held to; the range is how far
    the same command moved between leases."""
    groups = {}
    for r in rows:
        groups.setdefault((r["mode"], r["setting"]), []).append(r)
    out = []
    for (mode, setting), g in groups.items():
        measured = [r["measured_step_s"] for r in g]
        median = float(np.median(measured))
        predicted = float(np.median([r["predicted_step_s"] for r in g]))  # one value unless the hosts were measured
        loo = [r["loo_predicted_step_s"] for r in g if r.get("loo_predicted_step_s") is not None]
        out.append({"mode": mode, "setting": setting, "runs": len(g), "measured_median_s": median, "measured_min_s": min(measured),
                    "measured_max_s": max(measured), "predicted_step_s": predicted,
                    "error_pct": 100 * (predicted / median - 1),
                    "loo_error_pct": 100 * (float(np.median(loo)) / median - 1) if loo else None})
    return out


def per_mode_text(modes: list) -> str:
    out = [f"{'mode':<46}{'runs':>5}{'median s':>10}{'range s':>15}{'spread':>8}{'predicted':>10}{'error':>8}"
           f"{'loo err':>9}"]
    for m in modes:
        spread = 100 * (m["measured_max_s"] / m["measured_min_s"] - 1)
        loo = f"{m['loo_error_pct']:+.1f}%" if m["loo_error_pct"] is not None else "-"
        out.append(f"{m['mode']:<46}{m['runs']:>5}{m['measured_median_s']:>10.3f}"
                   f"{m['measured_min_s']:>7.3f}-{m['measured_max_s']:<7.3f}{spread:>7.0f}%"
                   f"{m['predicted_step_s']:>10.3f}{m['error_pct']:>+7.1f}%{loo:>9}")
    within = sum(abs(m["error_pct"]) <= 10 for m in modes)
    out.append(f"predicted within 10 % of the median: {within} of {len(modes)} modes")
    return "\n".join(out)


def table_text(rows: list) -> str:
    fmt = lambda v, f, suffix="": format(v, f) + suffix if v is not None else "-"  # noqa: E731
    out = [f"{'run':<27}{'plan':<22}{'eff':>6}{'host us':>8}{'measured s':>11}{'predicted':>10}{'error':>8}"
           f"{'loo err':>9}{'over 1-GPU meas':>16}{'pred':>7}{'peak GiB meas':>14}{'pred':>7}"]
    for r in rows:
        host = r.get("host_s_per_module")
        out.append(f"{r['run']:<27}{(r['plan'] or ''):<22}{r['compute_efficiency']:>6.3f}"
                   f"{fmt(host and 1e6 * host, '.1f'):>8}{r['measured_step_s']:>11.3f}"
                   f"{r['predicted_step_s']:>10.3f}{r['error_pct']:>+7.1f}%{fmt(r.get('loo_error_pct'), '+.1f', '%'):>9}"
                   f"{fmt(r['measured_over_nocomm_s'], '.3f'):>16}{fmt(r.get('predicted_over_nocomm_s'), '.3f'):>7}"
                   f"{fmt(r['measured_peak_gb'], '.1f'):>14}{r['predicted_peak_gb']:>7.1f}")
    return "\n".join(out)


def terms_text(overheads: Overheads) -> str:
    host = overheads.host_s_per_module
    shape = overheads.shape_model
    measured = shape and ComputeTable.from_json(overheads.compute_table).layers
    model = (f"compute from each model's shape with the {overheads.compute_table.get('device')} table "
             f"({overheads.compute_table.get('source')}) at a factor of {overheads.compute['shape']:.3f}"
             + (f", the one its timed layers measured (they took {1 / overheads.compute['shape']:.3f} of their "
                f"price)" if measured else ", fitted") if shape
             else "compute efficiency: " + ", ".join(f"{m} {e:.3f}" for m, e in sorted(overheads.compute.items())))
    out = [model,
           "per-fetch cost at a host of " + (f"{1e6 * host:.1f} us per module (bench/host.py; scaled by each "
                                             "run's own)" if host else "unmeasured speed (no run measured its host)"),
           f"{'system':<8}{'comm_factor':>12}{'overlap':>8}{'update_factor':>14}{'per_fetch_ms':>13}{'fetch_GB/s':>11}"
           + (f"{'per_layer_ms':>13}{'per_step_ms':>12}{'layer_step_ms':>14}" if shape else "")]
    if shape:
        ckpt = overheads.systems.get("lins", {}).get("per_ckpt_pass_s")
        out.insert(2, "checkpointed layer: " + (
            f"its forward and its recompute each cost the host {1e3 * ckpt:.3f} ms more, every system (at that host)"
            if ckpt is not None else "no host cost of its own (not fitted: no checkpointed pass of these runs waited "
                                     "for the host, or a calibration from before the term)"))
    defaulted = False
    for s, fitted in overheads.systems.items():
        t = overheads.terms(s)
        own = (("comm_factor", "update_factor") + (("per_fetch_s", "per_fetch_byte_s") if s in FETCH_SYSTEMS else ())
               + (("overlap_factor",) if s in ("lins", "zero1") else ()))  # those with an overlapped boundary
        mark = {k: "*" if k in own and k not in fitted else " " for k in t}
        defaulted |= "*" in mark.values()
        out.append(f"{s:<8}{t['comm_factor']:>11.3f}{mark['comm_factor']}{t['overlap_factor']:>7.3f}"
                   f"{mark['overlap_factor']}{t['update_factor']:>13.3f}"
                   f"{mark['update_factor']}{1e3 * t['per_fetch_s']:>12.3f}{mark['per_fetch_s']}"
                   + (f"{1e-9 / t['per_fetch_byte_s']:>10.0f}" if t["per_fetch_byte_s"] else f"{'-':>10}")
                   + mark["per_fetch_byte_s"]
                   + (f"{1e3 * t['per_layer_s']:>12.3f} {1e3 * t['per_step_s']:>11.2f} "
                      f"{1e3 * t['per_layer_step_s']:>13.3f}" if shape else ""))
    if defaulted:
        out.append("* not determined by these runs (the system has none, or all on the other branch): the default")
    return "\n".join(out)


def write_calibrated_profile(profile_path: str, out: str, overheads: Overheads, rows: list) -> None:
    """The measured profile with the fitted terms in its meta (``meta["simulator"]``), stored with the profile
    they were fitted against, where ``python -m bench simulate --profile`` finds them."""
    try:
        with open(profile_path, encoding="utf-8") as f:
            obj = json.load(f)
        obj["meta"]["simulator"] = {"overheads": overheads.to_json(), "fit": rows}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlanError(f"{profile_path}: not a profile table ({e})") from None
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


def stored(table: ProfileTable, path: str) -> Optional[Overheads]:
    """The terms ``write_calibrated_profile`` stored with a profile, or None."""
    sim = table.meta.get("simulator")
    if sim is None:
        return None
    try:
        return Overheads.from_json(sim["overheads"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanError(f"{path}: meta.simulator is not what 'python -m bench simulate --fit' writes ({e})") from None
