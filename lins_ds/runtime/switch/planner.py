"""One place decides (issue 62, docs/design.md §7): the start-up plan, its re-size for the training batches' length,
tuning and its cache, and the memory guard. The ``Planner`` answers the engine's events — the first plan, a training
batch, a step ended — with a plan, which it hands to ``LinsRuntime.apply`` (the whole switch: the accumulation boundary
checked, checkpointing, the host optimizer and the ZeRO view set; start-up is the runtime's first ``apply``). It reads
the launch from ``LaunchFacts``, never the engine."""

from __future__ import annotations

import warnings
from typing import Optional

from ... import comm
from ...plan import Plan
from ...profiler import host_rate
from ..config import LinsConfig
from ..memory import memory_guard
from ..runtime import runs_differently
from ..step.host_optimizer import update_elems
from ..step.host_report import HostTimeReport
from ..startup.facts import LaunchFacts
from ..startup.planning import agree_on_plan, announce, forward_only_plan, misaligned_note, plan_for_length, start_plan
from ..startup.seq_len import LengthWatch, batch_length
from . import tune

GUARD_AFTER_STEPS = 2  # the memory guard's step: the first whose forward and backward hold the optimizer's state


class Planner:
    def __init__(self, facts: LaunchFacts, cfg: LinsConfig):
        self.facts, self.cfg = facts, cfg
        self.context = None  # the SolveContext of the running plan (None: a fixed plan without a prediction)
        self.lengths: Optional[LengthWatch] = None  # lins.seq_len not set: the batches size the plan
        self.tuner: Optional[tune.Tuner] = None  # "plan": "tune", while trials run
        self.tune_report: Optional[list] = None  # the trials' table once tuning is over
        self._tune_pending = False  # "tune" waits for the batches' length
        self._host_report = HostTimeReport()  # the host time steps 3-5 waited, against the start-up's price
        self._trials: Optional[tuple] = None  # (candidates, decision) to start once the runtime exists

    # --- the first plan ------------------------------------------------------------------------------------
    def first(self, settings: dict, notes: str = "") -> tuple:
        """(plan, whether any rank asked for the collective-order check) of a training engine: solved or fixed, sized
        for the start-up length, a cached tune decision applied; agreed by every rank and announced with ``notes``
        (what the engine adds: the allocator, clipping)."""
        plan, summary, self.context = start_plan(self.facts, self.cfg)
        if self.context is not None and self.cfg.seq_len is None:
            self.lengths = LengthWatch(self.context.train.seq_len)
            summary += (f"\n  sequence length: {self.context.train.seq_len} until the first training batch, "
                        "then the batches' (lins.seq_len not set)")
        if self.cfg.tuning and self.context is not None:
            if self.lengths is not None:
                self._tune_pending = True  # the candidates depend on the length: chosen at the first batch
            else:
                plan, summary, cands, decision = self._tune_start(plan, summary)
                self._trials = (cands, decision) if cands is not None else None
        check = agree_on_plan(plan, self.cfg.check_collectives or comm.check_requested(), settings)
        announce(summary + notes + misaligned_note(self.facts.module, self.facts.gemm_dtype))
        return plan, check

    def forward_only(self, settings: dict) -> Plan:
        """The plan of an engine without an optimizer (only P matters), agreed and announced."""
        plan, summary = forward_only_plan(self.facts, self.cfg)
        agree_on_plan(plan, settings=settings)
        announce(summary)
        return plan

    def start_trials(self, runtime) -> None:
        """Once the runtime runs the first plan: the tuner's trials, where tuning has candidates to time."""
        if self._trials is not None:
            cands, decision = self._trials
            self._trials = None
            ctx = self.context
            self.tuner = tune.Tuner(runtime.apply, ctx, runtime.plan, self.facts.device, cands, self.cfg.tune,
                                    ctx.mem.capacity_gb - ctx.mem.reserved_gb, decision)

    def started(self, runtime, seconds: float) -> None:
        """The engine is built: its start-up time and peaks reported (the memory guard's first look)."""
        memory_guard.report_startup(runtime, self.context, seconds)

    # --- a training batch ----------------------------------------------------------------------------------
    def on_batch(self, args: tuple, kwargs: dict, window_start: bool, global_steps: int, runtime) -> None:
        """A training batch (the forward's arguments) is about to run: at the agreed points, the plan re-sized for
        the longest length every rank saw (and tuning started where it waited for it), applied to ``runtime``."""
        watch = self.lengths
        if watch is None:
            return
        length = batch_length(args, kwargs, self.facts.micro_batch)
        watch.see(length)
        if not watch.due(window_start, global_steps):
            watch.warn_if_longer(length)
            return
        longest = watch.agree(global_steps)
        if longest is not None:
            self._size_for_length(longest, runtime)

    def _size_for_length(self, n: int, runtime) -> None:
        watch, ctx, old = self.lengths, self.context, runtime.plan
        first, before = not watch.settled, watch.planned
        if n != ctx.train.seq_len:
            plan, summary, self.context = plan_for_length(self.facts, self.cfg, ctx, old, n)
            rep = runtime.apply(plan)  # the same execution: only this length's predictions change, nothing moves
            moved = f"; moved onto it in {rep.seconds:.1f} s" if runs_differently(plan, old) else ""
            why = "the first training batches are" if first else f"a training batch is longer than {before}:"
            announce(f"lins: {why} {n} tokens long; plan re-sized for {n}{moved}\n{summary}")
        watch.settled, watch.planned = True, n
        if self._tune_pending:
            self._tune_pending = False
            running = runtime.plan
            plan, summary, cands, decision = self._tune_start(running, "lins tune (sequence length "
                                                              f"{n}, from the training batches):")
            announce(summary)
            if plan is not running and runs_differently(plan, running):
                runtime.apply(plan)
            if cands is not None:
                self._trials = (cands, decision)
                self.start_trials(runtime)

    # --- a step ended --------------------------------------------------------------------------------------
    def after_step(self, before: int, after: int, runtime) -> None:
        """After DeepSpeed's step (``before`` / ``after``: its global step count): the memory guard after the second
        optimizer step (the first window runs before the optimizer's state exists, so its peak is below every later
        one's), and the tuner's next trial or decision."""
        if before == GUARD_AFTER_STEPS - 1 and after == GUARD_AFTER_STEPS:
            memory_guard.check(runtime.plan, self.context, runtime.device, runtime.host_gb())
        if after != before and self._host_report.wants(after):
            stats = runtime.host_stats()
            said = self._host_report.after_step(after, stats, *self._host_prediction(runtime.plan))
            if said is not None:
                announce(said + self._keep_host_rate(runtime.device, stats))  # rank 0's
        if self.tuner is not None and after != before and self.tuner.after_step():
            self.tune_report, self.tuner = self.tuner.report, None

    def _keep_host_rate(self, device, stats: dict) -> str:
        """Rank 0: the worker's update rate in training kept for this host's next start-up (``profiler.host_rate``),
        and the words that say so ('' where it was not kept)."""
        rate = self._host_report.rate
        if comm.rank() != 0 or rate is None or not stats.get("update_key"):
            return ""
        path = host_rate.save(self.cfg.profile_cache, host_rate.key(device.type, comm.local_world_size(),
                                                                    **stats["update_key"]),
                              rate, stats["worker_elems"], update_elems())
        return f"; kept for this host's next start-up ({path})" if path else ""

    def _host_prediction(self, plan: Plan) -> tuple:
        """(the exposed host time per step the start-up priced for ``plan``, the host update rate it priced with);
        None for what it did not price (a fixed plan, a plan the tuner or a re-layout put in its place)."""
        ctx = self.context
        sol = ctx.solution if ctx is not None else None
        return ((sol.best.offload_s if sol is not None and sol.plan == plan else None),
                ctx.host_update_rate(plan.host_update_in_backward) if ctx is not None else None)

    # --- tuning's start ------------------------------------------------------------------------------------
    def _tune_start(self, plan: Plan, summary: str) -> tuple:
        """(plan to start on, summary, candidates or None, (decision path, key) or None): a cached decision for this
        job means no trials (rank 0 reads it, every rank gets it)."""
        from ...profiler.cache import launch_key

        cfg, ctx = self.cfg, self.context
        key = tune.decision_key(ctx, cfg, launch_key(ctx.topo, self.facts.device),
                                type(self.facts.optimizer).__name__)
        path = tune.decision_path(key, tune.cache_dir(cfg)) if cfg.tune.cache else None
        cached = None
        if path is not None and comm.rank() == 0:
            cached, why = tune.cached_plan(path, key, ctx)
            if why:
                warnings.warn(f"lins tune: the cached decision {path} is not used: {why}; tuning again",
                              RuntimeWarning, stacklevel=2)
        cached = comm.broadcast_object(cached.to_json() if cached is not None else None)
        if cached is not None:
            return (Plan.from_json(cached), summary + f"\n  tune: the cached decision {path} (no trials): "
                    f"{Plan.from_json(cached).layout}", None, None)
        cands = tune.candidates(ctx, cfg.tune.candidates)
        if len(cands) < 2:
            return plan, summary + "\n  tune: only one candidate fits; nothing to try", None, None
        lines = [f"    {i}. {c.label} ({c.why}; predicted {c.predicted_step_s:.3f} s)" for i, c in enumerate(cands)]
        t = cfg.tune
        summary += (f"\n  tune: {len(cands)} candidates, {t.steps} optimizer steps each (the first {t.warmup_steps} "
                    f"untimed), more until timed to +-{t.precision:.0%}, {t.max_steps} each at most: "
                    f"{len(cands) * t.steps} to {len(cands) * t.max_steps} steps of tuning; then the fastest "
                    "measured:\n" + "\n".join(lines))
        return plan, summary, cands, (path, key) if path is not None else None
