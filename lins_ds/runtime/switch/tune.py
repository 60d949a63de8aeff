"""``"plan": "tune"``: time the solver's best candidates on the first training steps, keep the fastest
(docs/design.md §14).

Training starts on the solver's best plan. Once a candidate's step time is known — at least ``lins.tune.steps``
optimizer steps (the first ``lins.tune.warmup_steps`` not timed), and more until the median's 95 % interval is within
+-``lins.tune.precision`` of it, ``lins.tune.max_steps`` at most — the engine re-lays itself in memory onto the next
candidate (its ``relayout``: ``LinsRuntime.apply``) and goes on training; once each has been timed it moves to the
fastest measured candidate whose measured peak stayed within the budget — away from the solver's best only when the gain is
more than the noise (``lins_ds.plan.tune.fastest``) — prints the table, and caches the decision, so the next
launch of the same job starts on the winner with no trials. Every trial step is a real training step: the
trajectory is the one an untuned run on any of the plans follows (they are the same numbers, docs/design.md §3).
Every decision is taken on numbers all ranks agree on (the slowest rank's time, the largest peak).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from deepspeed.utils import logger

from ... import comm
from ...plan import Plan
from ...plan import tune as choose
from ...plan.offload import Placement
from ...plan.solver import fewest_offloaded, plan_of
from ..errors import RelayoutError


def _interval(times: list) -> Optional[list]:
    iv = choose.median_interval(times) if times else None
    return None if iv is None else [iv[0], iv[2]]


@dataclass
class Trial:
    candidate: choose.Candidate
    plan: Plan
    times: list = field(default_factory=list)
    steps: int = 0
    measured_s: Optional[float] = None
    peak_gb: Optional[float] = None
    relayout_s: Optional[float] = None  # the re-layout onto this candidate (None for the first)
    relayout_extra_gb: Optional[float] = None
    dropped: str = ""

    def row(self, chosen: bool) -> dict:
        e = self.candidate.evaluation
        return {"candidate": self.candidate.label, "kind": self.candidate.kind, "why": self.candidate.why,
                "plan": self.plan.to_json(), "predicted_step_s": self.candidate.predicted_step_s,
                "measured_step_s": self.measured_s, "step_times_s": self.times,
                "interval_s": _interval(self.times),
                "predicted_peak_gb": e.memory.allocated_gb, "measured_peak_gb": self.peak_gb,
                "relayout_s": self.relayout_s, "relayout_extra_gb": self.relayout_extra_gb,
                "dropped": self.dropped, "chosen": chosen}


# --- the candidates and the cached decision ---------------------------------------------------------------
def candidates(context, count: int) -> list:
    """The solver's candidates for this launch (``context``: the start-up SolveContext, with its Solution)."""
    sol = context.solution
    fitting = list(sol.fitting)
    best = fitting[0]
    depths = context.train.checkpoint_choices(context.model.num_layers)
    offloads = context.offload.choices(len(context.model.unit_params()))
    # the neighbours keep the best's placement (those of a GPU-resident best offload the OS alone); and the others
    place = best.placement if best.placement.n_units else Placement.of(1)
    near = choose.neighbours(best, lambda k, o: context.evaluate(best.layout, k, place.with_units(o)),
                             depths, offloads)
    for shape in (context.placements(best.layout) if best.placement.n_units else []):
        if shape != place.with_units(1):
            other, _ = fewest_offloaded(lambda o: context.evaluate(best.layout, best.ckpt_units, shape.with_units(o)),
                                        offloads)
            if other.fits and other.placement.n_units:
                near.append((other, "placement"))
    return choose.candidates(fitting, near, count, context.topo.world_size,
                             lambda e: choose.predicted_step_s(e, context.model, context.train, context.compute))


def decision_key(context, cfg, launch: dict, optimizer: str) -> dict:
    """What a decision depends on: the launch (as the profiler's cache key), the model's shape, the batch, the
    dtypes and sequence length, the budget, the offload offered, the optimizer and the tuning settings."""
    return {**launch, "model": _plain(dataclasses.asdict(context.model)), "train": _plain(dataclasses.asdict(context.train)),
            "memory": _plain(dataclasses.asdict(context.mem)), "offload": [context.offload.mode, context.offload.fraction, context.offload.grads,
                                                           context.offload.params],
            "objective": context.objective, "profile": cfg.profile, "optimizer": optimizer,
            "host_memory_gb": cfg.host_memory_gb, "host_optimizer": cfg.host_optimizer, "unit_modules": list(cfg.unit_modules or ()),
            "overlap_param_sync": cfg.overlap_param_sync, "tune": _plain(dataclasses.asdict(cfg.tune))}


def _plain(obj):
    return json.loads(json.dumps(obj, default=str))


def cache_dir(cfg) -> str:
    from ...profiler.cache import default_dir

    return cfg.profile_cache or default_dir()


def decision_path(key: dict, directory: str) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(directory, f"tune-{digest}.json")


def _seal(key: dict, plan_json: dict) -> str:
    """What a decision file records of itself: an edit of its key or plan shows as another seal."""
    return hashlib.sha256(json.dumps({"key": key, "plan": plan_json}, sort_keys=True).encode()).hexdigest()


def cached_plan(path: str, key: dict, context=None) -> tuple:
    """(the cached winner for ``key``, or None; why it is not used, or "" where there is no file). A decision is
    data, not an instruction: it is used only where its key is this job's (the launch and lins_ds versions included),
    it is as written (its seal), and it is a plan this job may run (``invalid``). Rank 0 alone reads it: anything
    wrong means tune again, never a raise."""
    if not os.path.exists(path):
        return None, ""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        if obj.get("key") != key:
            return None, "its key is another job's"
        if obj.get("seal") != _seal(obj["key"], obj["plan"]):
            return None, "it was edited since it was written (its seal does not match)"
        plan = Plan.from_json(obj["plan"])
    except Exception as e:  # noqa: BLE001 - unreadable, truncated, a bad plan: tune again
        return None, f"it is unreadable ({type(e).__name__}: {e})"
    try:
        why = invalid(plan, context) if context is not None else ""
    except Exception as e:  # noqa: BLE001 - rank 0 alone: a plan the job's rules cannot even price, tune again
        why = f"it is not a plan this job can run ({type(e).__name__}: {e})"
    return (None, why) if why else (plan, "")


def invalid(plan: Plan, context) -> str:
    """Why ``plan`` is not one this job (``context``: its SolveContext) may run, or ''."""
    from ...plan.topology import check_layout

    train, model = context.train, context.model
    if plan.topology != context.topo:
        return f"it is for {plan.topology}, this job runs on {context.topo}"
    try:
        check_layout(plan.topology, plan.layout)
    except Exception as e:  # noqa: BLE001 - a layout the rules refuse
        return f"its layout {plan.layout} breaks the rules ({e})"
    if (plan.param_dtype, plan.grad_dtype) != (train.param_dtype, train.grad_accum_dtype or train.param_dtype):
        return f"its dtypes ({plan.param_dtype}, {plan.grad_dtype}) are not this job's"
    if plan.num_layers != model.num_layers or not 0 <= plan.activation_checkpointing_units <= model.num_layers:
        return f"it checkpoints {plan.activation_checkpointing_units} of {plan.num_layers} layers; the model has " \
               f"{model.num_layers}"
    units, place = len(model.unit_params()), plan.placement
    if not 0 <= place.n_units <= units or (place.n_units and context.offload.mode == "off"):
        return f"it offloads {place.n_units} of {units} units, which this job's offload does not allow"
    if not context.allows(plan.layout, place):
        return f"its placement ({place.placed()} {place.where()}) is not allowed for its layout"
    e = context.evaluate(plan.layout, plan.activation_checkpointing_units, place)
    if not e.fits:
        return "it does not fit this job's budget (GPU or host memory)"
    return ""


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def list_decisions(directory: str) -> list:
    """[(path, decision)] of every cached decision in ``directory`` (``lins-ds tune --show``)."""
    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.startswith("tune-") and name.endswith(".json"):
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    out.append((os.path.join(directory, name), json.load(f)))
            except (OSError, ValueError):
                continue
    return out


# --- measuring ----------------------------------------------------------------------------------------------
def measured_peak_gb(device: torch.device) -> Optional[float]:
    """The allocator's peak since the last reset (None on CPUs, where nothing measures it)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Tuner:
    """Drives the trials from ``LinsEngine.step`` (``after_step``, every rank, after each optimizer step)."""

    def __init__(self, relayout: Callable, context, running, device: torch.device, cands: list, spec,
                 budget_gb: Optional[float], decision: Optional[tuple]):
        """``relayout(plan)``: the engine's move onto a plan (a RelayoutReport, or RelayoutError on every rank);
        ``context``: the start-up SolveContext the candidates come from; ``running``: the plan training started on
        (the solver's best); ``spec``: lins.tune (steps, precision, max_steps, warmup_steps)."""
        self.relayout, self.budget_gb, self.decision = relayout, budget_gb, decision
        self.steps, self.precision, self.max_steps = spec.steps, spec.precision, spec.max_steps
        self.warmup = spec.warmup_steps
        self.trials = [Trial(c, plan_of(c.evaluation, context.topo, context.model, context.train, context.table,
                                     context.offload.host))
                       for c in cands]
        self.trials[0].plan = running
        self.current = 0  # the trial whose plan the engine runs now
        self.device = device
        self.report: list = []
        _reset_peak(self.device)
        self._last = _clock(self.device)

    def after_step(self) -> bool:
        """Count and time this optimizer step; switch or decide when a trial is done. True once tuning is over."""
        now = _clock(self.device)
        trial = self.trials[self.current]
        if trial.steps >= self.warmup:  # the slowest rank's time of this step: every rank holds the same times,
            trial.times.append(comm.max_over_world(now - self._last, self.device))  # so takes the same decisions
        trial.steps += 1
        if trial.steps < self.steps or (trial.steps < self.max_steps
                                        and not choose.settled(trial.times, self.precision)):
            self._last = now
            return False
        self._finish(trial)
        for nxt in range(self.current + 1, len(self.trials)):
            if self._switch(nxt):
                _reset_peak(self.device)
                self._last = _clock(self.device)
                return False
        self._decide()
        return True

    def _finish(self, trial: Trial) -> None:
        """The median step (of the slowest rank's step times) and the largest peak; over budget drops it (on every
        rank alike)."""
        trial.measured_s = statistics.median(trial.times)
        peak = measured_peak_gb(self.device)
        peak = comm.max_over_world(-1.0 if peak is None else peak, self.device)
        trial.peak_gb = None if peak < 0 else peak
        if self.budget_gb is not None and trial.peak_gb is not None and trial.peak_gb > self.budget_gb:
            trial.dropped = f"measured peak {trial.peak_gb:.2f} GiB over the budget {self.budget_gb:.2f} GiB"

    def _switch(self, index: int, trial_move: bool = True) -> bool:
        """Move onto trial ``index``'s plan: a trial's move is recorded (its time, or why it was dropped); the move
        back to the winner is not. False where it failed (every rank alike, back on the running plan)."""
        trial = self.trials[index]
        try:
            rep = self.relayout(trial.plan)
        except RelayoutError as e:
            if trial_move:
                trial.dropped = f"could not switch: {e}"
            return False
        if trial_move:
            trial.relayout_s, trial.relayout_extra_gb = rep.seconds, rep.extra_peak_gb
        self.current = index
        return True

    def _decide(self) -> None:
        measured = [(None if t.dropped else t.times, t.peak_gb) for t in self.trials]
        win = choose.fastest(measured, self.budget_gb, self.precision)
        if win is not None and win != self.current and not self._switch(win, trial_move=False):
            win = self.current if not self.trials[self.current].dropped else None
        self.report = [t.row(i == win) for i, t in enumerate(self.trials)]
        if comm.rank() == 0:
            msg = table(self.report, self.budget_gb)
            logger.info("\n" + msg)
            print(msg, flush=True)
            if self.decision is not None and win is not None:
                self._save(win)

    def _save(self, win: int) -> None:
        """Rank 0 alone, inside a training step: a file it cannot write is a warning, never an error (the other
        ranks are already on their way to the next collective)."""
        path, key = self.decision
        try:
            plan_json = self.trials[win].plan.to_json()
            _write_json(path, {"key": key, "plan": plan_json, "seal": _seal(key, plan_json), "trials": self.report,
                               "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
            _append_runs(os.path.join(os.path.dirname(path), "tune-runs.jsonl"), key, self.report)
        except OSError as e:
            warnings.warn(f"lins tune: the decision was not cached ({e}); the next launch tunes again",
                          RuntimeWarning, stacklevel=2)


def _append_runs(path: str, key: dict, rows: list) -> None:
    """Every measured candidate, one JSON line each: calibration data for the simulator."""
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            if r["measured_step_s"] is not None:
                f.write(json.dumps({"key": key, **{k: v for k, v in r.items() if k != "step_times_s"}}) + "\n")


def table(rows: list, budget_gb: Optional[float]) -> str:
    def gb(x):
        return "-" if x is None else f"{x:.2f}"

    out = [f"lins tune: {len(rows)} candidate(s), measured on the training steps"
           + (f" (budget {budget_gb:.2f} GiB allocated)" if budget_gb is not None else ""),
           f"  {'#':>2} {'candidate':<44} {'why':<22} {'pred s':>7} {'meas s':>7} {'pred GiB':>8} {'peak GiB':>8}"
           f" {'switch s':>8}  result"]
    for i, r in enumerate(rows):
        meas = "-" if r["measured_step_s"] is None else f"{r['measured_step_s']:.3f}"
        iv = r.get("interval_s")
        spread = "" if iv is None or not r["measured_step_s"] else \
            f" +-{100 * max(iv[1] - r['measured_step_s'], r['measured_step_s'] - iv[0]) / r['measured_step_s']:.1f}%"
        sw = "-" if r["relayout_s"] is None else f"{r['relayout_s']:.2f}"
        res = "chosen" if r["chosen"] else (f"dropped: {r['dropped']}" if r["dropped"] else "")
        out.append(f"  {i:>2} {r['candidate']:<44} {r['why']:<22} {r['predicted_step_s']:>7.3f} {meas:>7} "
                   f"{gb(r['predicted_peak_gb']):>8} {gb(r['measured_peak_gb']):>8} {sw:>8}  {res}"
                   + (f" (n={len(r['step_times_s'])}{spread})" if r["step_times_s"] else ""))
    if not any(r["chosen"] for r in rows):
        out.append("  no candidate was measured within the budget: training goes on on the last plan")
    return "\n".join(out)
