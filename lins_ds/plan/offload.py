"""Offload as a plan dimension (docs/design.md §13): which units keep their optimizer state (OS), their gradients (G)
and their parameters (P) off the device, what that costs in host memory and in time, and what of it is hidden.

Where each state lives is one typed value, ``Placement``: ``n_units`` = k, the last k units in forward order (the root,
which runs first, only when k covers every unit), and a tier per state (``TIERS``: the device, the host). Their OS
leaves the device: the host optimizer updates them unit by unit in forward order, and each unit's updated parameters
return just in time for its next forward — so the last units' host work hides behind the first units' forward. Where
nothing waits for every gradient (no clipping, no fp16 loss scaling: ``TrainingSpec.host_update_in_backward``) each
starts instead as the unit's gradient is final in the window's last backward, last unit first. Their G may leave
too; each micro-batch's gradient of such a unit leaves the GPU as soon as its backward (and its reduction) is done,
and the host adds it up while the rest of the backward runs. Only where no replica AllReduce follows the
reduction (s_g = the world: ``grads_may_leave``). Without it, an offloaded unit's gradient goes down at the step.
A unit offloaded costs, per element of this rank's OS chunk: the host update and the parameter up, and the
gradient down at the step (G on the GPU) or, during backward, each micro-batch's gradient down and its host sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from .spec import GIB, TrainingSpec
from .topology import Layout, PlanError

MODES = ("off", "auto", "fixed")
GRAD_PLACES = ("auto", "cpu", "gpu")  # the offloaded units' G (or P): the solver's choice, always the host, never
PARAM_PLACES = GRAD_PLACES
HOST_STATE_BYTES = 4 + 8  # fp32 master and Adam's two fp32 moments, always on the host for an offloaded unit

TIERS = ("device", "host")  # where a state may live, the device first; a further tier (NVMe, another card): a name here
DEVICE, HOST = TIERS
PLACED = ("os", "g", "p")  # the states a placement places, in the order they leave the device


@dataclass(frozen=True)
class Placement:
    """Where each state of a plan's units lives: the last ``n_units`` units in forward order (root first) keep their
    optimizer state (``os``: fp32 master and moments) on a tier other than the device, and their gradients (``g``) and
    parameters (``p``) on the device or on the same tier; every other unit keeps all three on the device. One value,
    checked once here, so that the solver prices, the plan carries and the runtime places exactly the same thing; a
    further tier is a name in ``TIERS``, never another field threaded through every reader."""

    n_units: int = 0
    os: str = DEVICE
    g: str = DEVICE
    p: str = DEVICE

    def __post_init__(self) -> None:
        for state in PLACED:
            if self.tier(state) not in TIERS:
                raise PlanError(f"placement.{state}: {self.tier(state)!r} is not one of {TIERS}")
        if not isinstance(self.n_units, int) or isinstance(self.n_units, bool) or self.n_units < 0:
            raise PlanError(f"placement.n_units: {self.n_units!r} is not a count of units")
        if self.n_units == 0 and self.states():
            raise PlanError(f"placement: {self.placed()} off the device for no unit; a state leaves the device only "
                            "for the offloaded units (n_units > 0)")
        if self.n_units > 0 and self.os == DEVICE:
            raise PlanError(f"placement: {self.n_units} unit(s) offloaded with their optimizer state on the device; "
                            "OS is the first state to leave it")
        for state in ("g", "p"):
            if self.tier(state) not in (DEVICE, self.os):
                raise PlanError(f"placement.{state}: {self.tier(state)!r} with the optimizer state on {self.os!r}; "
                                f"{state.upper()} leaves the device only for OS's tier (the host optimizer reads G "
                                "and writes P where the master is)")

    @classmethod
    def of(cls, units: int, os: str = HOST, g: str = DEVICE, p: str = DEVICE) -> "Placement":
        """The last ``units`` units' states on these tiers; none offloaded: every state on the device, whatever the
        tiers say (what the solver's choice of zero units means)."""
        return cls(units, os, g, p) if units > 0 else cls()

    def with_units(self, units: int) -> "Placement":
        """The same tiers for another count of units (the solver's search over how many)."""
        return Placement.of(units, self.os, self.g, self.p) if units > 0 else Placement()

    def tier(self, state: str) -> str:
        """The tier of ``state`` ("os", "g" or "p") for the offloaded units."""
        return getattr(self, state)

    def offloads(self, state: str) -> bool:
        """Whether the offloaded units keep ``state`` off the device."""
        return self.tier(state) != DEVICE

    def units_of(self, state: str) -> int:
        """How many units keep ``state`` off the device."""
        return self.n_units if self.offloads(state) else 0

    def states(self) -> list:
        """The states the offloaded units keep off the device, OS first."""
        return [state for state in PLACED if self.offloads(state)]

    @property
    def on_host(self) -> bool:
        """Whether some state lives in host memory (the host's speeds and capacity then matter)."""
        return HOST in (self.os, self.g, self.p)

    def first(self, total: int) -> int:
        """Index of the first offloaded unit of ``total`` units (forward order, root first)."""
        return total - min(self.n_units, total)

    def order(self) -> tuple:
        """The tiers as a sort key (the device first): ties between plans go to the one that moves less."""
        return tuple(TIERS.index(self.tier(state)) for state in PLACED)

    def placed(self) -> str:
        """What of the offloaded units is off the device: "OS", "OS and G", "OS and P", "OS, G and P"."""
        names = [state.upper() for state in self.states()]
        return " and ".join(names) if len(names) < 3 else f"{names[0]}, {names[1]} and {names[2]}"

    def where(self) -> str:
        """Where the offloaded states are, in words (G and P are only ever on OS's tier): "on the host"."""
        return f"on the {self.os}"

    def to_json(self) -> dict:
        return {"units": self.n_units, **{state: self.tier(state) for state in PLACED}}

    @classmethod
    def from_json(cls, obj: dict) -> "Placement":
        return cls(int(obj.get("units", 0)), *(str(obj.get(state, DEVICE)) for state in PLACED))

    def legacy_json(self) -> dict:
        """The keys a plan wrote before this type (``offload_units``, ``offload_grads``, ``offload_params``), which
        tools, caches and tune decision files read: exact for the host tier, the count and which states leave for
        another."""
        return {"offload_units": self.n_units, "offload_grads": self.offloads("g"),
                "offload_params": self.offloads("p")}

    @classmethod
    def from_legacy(cls, obj: dict) -> "Placement":
        """A placement from those keys (a plan written before this type, or a tool's); the host was the one tier."""
        def tier(key: str) -> str:
            return HOST if obj.get(key, False) else DEVICE
        return cls.of(int(obj.get("offload_units", 0)), HOST, tier("offload_grads"), tier("offload_params"))


RESIDENT = Placement()  # every state of every unit on the device


@dataclass(frozen=True)
class HostSpec:
    """What this machine's host does for offload: measured at start-up (``lins_ds.runtime.step.host_optimizer.measure``)
    or given (``lins-ds plan --host-*``)."""

    capacity_gb: float  # host memory this rank may pin (the node's available memory / its ranks)
    update_elems_per_s: float = 1.0e9  # the host optimizer's throughput, elements per second
    h2d_gbs: float = 25.0  # pinned host-to-device copy bandwidth
    d2h_gbs: float = 25.0
    optimizer: str = "torch AdamW (fused, CPU)"  # the host optimizer, named in the summary
    source: str = "assumed"  # "measured on <device>" or "assumed"
    accumulate_elems_per_s: float = 4.0e9  # the host's sum of a micro-batch's gradient into the G accumulator
    norm_elems_per_s: float = 2.0e9  # the host's pass over a G accumulator for its norm
    kind: str = "torch"  # the host optimizer that runs: "torch" or "deepspeed" (DeepSpeedCPUAdam)
    # the update's rate where it starts inside the window's last backward, where a run on this host kept it
    # (``profiler.host_rate``: it ran slower there); None: ``update_elems_per_s``
    in_backward_update_elems_per_s: Optional[float] = None

    def update_rate(self, in_backward: bool) -> float:
        """The update's elements per second with the updates inside the last backward or after the step."""
        return (self.in_backward_update_elems_per_s or self.update_elems_per_s) if in_backward \
            else self.update_elems_per_s

    def to_json(self) -> dict:
        return dict(self.__dict__)


def host_optimizer_of(host: Optional[HostSpec], placement: Placement) -> str:
    """The host optimizer a plan runs (``Plan.host_optimizer``): the measured host's where the plan offloads."""
    return host.kind if host is not None and placement.offloads("os") else "torch"


@dataclass(frozen=True)
class OffloadSpec:
    """``mode``: "off" (never), "auto" (the solver decides; it costs time, so only where it pays or is needed)
    or "fixed" (``fraction`` of the units, rounded up, at least one)."""

    mode: str = "off"
    fraction: float = 1.0
    host: Optional[HostSpec] = None
    grads: str = "auto"  # the offloaded units' G on the host: "auto" (where the layout lets it), "cpu", "gpu"
    params: str = "gpu"  # the offloaded units' P on the host: the same choices

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PlanError(f"offload: {self.mode!r} is not one of {MODES}")
        if self.grads not in GRAD_PLACES:
            raise PlanError(f"offload.g: {self.grads!r} is not one of {GRAD_PLACES}")
        if self.params not in PARAM_PLACES:
            raise PlanError(f"offload.p: {self.params!r} is not one of {PARAM_PLACES}")
        if not 0 < self.fraction <= 1:
            raise PlanError(f"offload.os_fraction: {self.fraction!r} is not in (0, 1]")
        if self.mode != "off" and self.host is None:
            raise PlanError("offload: a host description (HostSpec) is needed to price offload")

    def choices(self, num_units: int) -> list:
        """How many units may keep their OS on the host, ascending."""
        if self.mode == "off":
            return [0]
        if self.mode == "fixed":
            return [max(1, min(num_units, math.ceil(self.fraction * num_units - 1e-9)))]
        return list(range(num_units + 1))


    def grad_choices(self, layout: Layout, world: int) -> list:
        """The tiers the offloaded units' G may take under ``layout``: [DEVICE], [HOST] or both (the solver prices
        both). [] when this offload requires the host and the layout does not allow it."""
        return _choices("off" if self.mode == "off" else self.grads, grads_may_leave(layout, world))

    def param_choices(self, layout: Layout) -> list:
        """The same for the offloaded units' P (``params_may_leave``)."""
        return _choices("off" if self.mode == "off" else self.params, params_may_leave(layout))

    def placements(self, layout: Layout, world: int) -> list:
        """The placements the solver prices for ``layout``, each of one unit (``Placement.with_units`` gives the same
        tiers for any count), the least offloaded first; [RESIDENT] where nothing is offloaded, [] when a placement this
        offload requires is not allowed."""
        if self.mode == "off":
            return [RESIDENT]
        return [Placement.of(1, HOST, g, p)
                for g in self.grad_choices(layout, world) for p in self.param_choices(layout)]


# --- the one offload policy (docs/design.md §13): an ordered ladder of typed specs and one driver that walks it ---
Rung = Callable[[], Optional[OffloadSpec]]  # the spec of one rung, or None where it cannot run here (no host)


def ladder(mode: str, host: Callable[[], Optional[HostSpec]], fraction: float = 1.0, grads: str = "auto",
           params: str = "gpu") -> list:
    """lins.offload (or ``lins-ds plan --offload``) as the rungs to price in turn, each only where none before gives a
    plan that fits: "off": GPU-resident; "fixed": the offload it names (``fraction``, ``grads``, ``params``); "auto":
    GPU-resident (offload costs step time, and measuring the host start-up time), then the optimizer state (and the
    gradients where that pays) of the fewest units that fit on the host with their parameters on the GPU, then their
    parameters free to go too. ``host()`` describes the host, measured the first time a rung needs it (None: no host
    optimizer runs here, and the rungs that need one are skipped). Each rung is a callable: nothing is measured
    before it is reached."""
    def resident() -> OffloadSpec:
        return OffloadSpec()

    def on_host(mode_: str, params_: str) -> Rung:
        def spec() -> Optional[OffloadSpec]:
            h = host()
            return None if h is None else OffloadSpec(mode_, fraction, h, grads, params_)
        spec.kind = (mode_, params_)
        return spec

    resident.kind = ("off", "gpu")
    if mode == "off":
        return [resident]
    if mode == "fixed":
        return [on_host("fixed", params)]
    if mode != "auto":
        raise PlanError(f"offload: {mode!r} is not one of {MODES}")
    return [resident, on_host("auto", "gpu"), on_host("auto", "auto")]


def rungs_from(rungs: list, spec: OffloadSpec) -> list:
    """The rungs from the one ``spec`` was made by on (a plan re-sized for another length starts where the last one
    stood: no lower rung fitted a shorter sequence)."""
    kind = (spec.mode, spec.params if spec.mode != "off" else "gpu")
    at = next((i for i, r in enumerate(rungs) if r.kind == kind), 0)
    return rungs[at:]


def walk(rungs: list, attempt: Callable, no_fit: tuple):
    """The one driver: ``attempt(spec)`` -> (result, fits) for each rung in turn (a rung whose spec is None cannot run
    here and is skipped); the first result that fits. Where none fits: the first result (a fixed layout that offload
    does not make fit runs GPU-resident, and the memory guard warns), else the last error among ``no_fit`` an attempt
    raised (the highest rung's: what the most offload still lacks)."""
    first, error = None, None
    for rung in rungs:
        spec = rung()
        if spec is None:
            continue
        try:
            result, fits = attempt(spec)
        except no_fit as e:
            error = e
            continue
        if fits:
            return result
        if first is None:
            first = (result,)
    if first is not None:
        return first[0]
    if error is None:
        raise PlanError("offload: no rung of the offload ladder can run here")
    raise error


def _choices(want: str, allowed: bool) -> list:
    """The tiers a state of the offloaded units may take: ``want`` is lins.offload's word for it ("gpu", "cpu",
    "auto"; "off": nothing offloaded), ``allowed`` whether the layout lets it leave the device."""
    if want in ("off", "gpu"):
        return [DEVICE]
    if want == "cpu":
        return [HOST] if allowed else []
    return [DEVICE, HOST] if allowed else [DEVICE]


def params_may_leave(layout: Layout) -> bool:
    """A unit's P may live on the host (uploaded, and gathered where s_p > 1, before each use) only where no P-sync
    follows the update (s_p = s_os): the host optimizer then writes the P chunk itself."""
    return layout.p.size == layout.os.size


def refusal(placement: Placement, layout: Layout, world: int) -> str:
    """Why ``layout`` on ``world`` ranks cannot carry ``placement`` (what the runtime checks before it places a
    unit), or ''."""
    if placement.offloads("g") and not grads_may_leave(layout, world):
        return (f"plan keeps gradients {placement.where()}, which {layout} on {world} ranks does not allow (a replica "
                "AllReduce follows its ReduceScatter)")
    if placement.offloads("p") and not params_may_leave(layout):
        return (f"plan keeps parameters {placement.where()}, which {layout} does not allow (s_p != s_os: a P-sync "
                "follows the update)")
    return ""


def grads_may_leave(layout: Layout, world: int) -> bool:
    """A unit's G accumulator may live on the host only where its reduction is complete on the GPU, i.e. no replica
    AllReduce follows the ReduceScatter (s_g = every rank; then s_os = s_g: the G chunk is the OS chunk)."""
    return layout.g.size == world


def updates_in_backward(train: TrainingSpec, layout: Layout, world: int, placement: Placement) -> bool:
    """Whether the offloaded units' host updates start inside the window's last backward (what the solver prices and
    ``Plan.host_update_in_backward`` tells the runtime): nothing waits for every gradient
    (``TrainingSpec.host_update_in_backward``), some unit's OS is off the device, and a unit's gradient is final as
    its reduction ends (``grads_may_leave``: no replica AllReduce follows, which ends only with the window)."""
    return train.host_update_in_backward and placement.offloads("os") and grads_may_leave(layout, world)


def offloaded(units: list, k: int) -> list:
    """The parameter counts of the offloaded units (forward order: the root first, then the layers)."""
    return units[len(units) - k:] if k else []


def hides_behind_forward(layout: Layout) -> bool:
    """Whether a unit's update may finish after ``step()`` returns, waited for by the unit's next use: only where
    no P-sync collective follows the update (s_os == s_p; else the P-syncs run in ``step()``, in order)."""
    return layout.os.size == layout.p.size


def grad_down_buffer(train: TrainingSpec) -> bool:
    """G on the host: whether a micro-batch's gradient comes down into a buffer of its own before the host adds it
    (a window's later micro-batches, or a reduce dtype other than the accumulator's); else straight into it."""
    return train.grad_accum > 1 or (train.grad_reduce_dtype or train.param_dtype) != (train.grad_accum_dtype
                                                                                         or train.param_dtype)


def host_gb(units: list, placement: Placement, s_os: int, train: TrainingSpec) -> float:
    """Host memory of the offloaded units' OS chunks on this rank: master, moments, the pinned gradient (the copy
    that comes down at the step, or the G accumulator itself with G on the host, and then a micro-batch's gradient
    too where ``grad_down_buffer``) and the pinned parameter copy that goes up (none for fp32 parameters: the
    master goes up), or with P on the host the P chunk itself (s_p = s_os)."""
    up = train.param_bytes if train.param_dtype != "fp32" or placement.offloads("p") else 0
    down = train.reduce_bytes if placement.offloads("g") and grad_down_buffer(train) else 0
    return sum(offloaded(units, placement.n_units)) / s_os * (HOST_STATE_BYTES + train.grad_bytes + up + down) / GIB


def unit_seconds(n: float, s_os: int, train: TrainingSpec, host: HostSpec, placement: Placement) -> float:
    """One offloaded unit of ``n`` parameters after the step: its gradient down (not with G on the host: it is
    there already), its host update and its parameters up (not with P on the host: they stay there)."""
    down, up = unit_copies(n, s_os, train, host, placement)
    return n / s_os / host.update_elems_per_s + down + up


def unit_copies(n: float, s_os: int, train: TrainingSpec, host: HostSpec, placement: Placement) -> tuple:
    """(down, up): one offloaded unit's gradient down and parameters up, in seconds; each runs on a copy lane of its
    own, beside the host's updates of the other units."""
    per = n / s_os
    return (0.0 if placement.offloads("g") else per * train.grad_bytes / host.d2h_gbs / 1e9,
            0.0 if placement.offloads("p") else per * train.param_bytes / host.h2d_gbs / 1e9)


def upload_seconds(units: list, k: int, layout: Layout, train: TrainingSpec, host: HostSpec) -> float:
    """P on the host, per step: each offloaded unit's P chunk up before its forward and again before its backward,
    every micro-batch (on a copy engine, beside the compute)."""
    return 2 * train.grad_accum * sum(offloaded(units, k)) / layout.p.size * train.param_bytes / host.h2d_gbs / 1e9


def host_sums(train: TrainingSpec) -> int:
    """G on the host: the passes a window's micro-batch gradients take into a unit's accumulator (a sum, or a copy
    that converts); the window's first lands in the accumulator itself where its dtype is the accumulator's."""
    same = (train.grad_reduce_dtype or train.param_dtype) == (train.grad_accum_dtype or train.param_dtype)
    return train.grad_accum - (1 if same else 0)


def backward_host_seconds(units: list, k: int, layout: Layout, train: TrainingSpec, host: HostSpec,
                          final_too: bool = True) -> float:
    """G on the host, per step: the host's sums of the offloaded units' micro-batch gradients into their
    accumulators and the pass that takes their norm at the window's end (each a read of the chunk). The copies
    down run on a copy engine beside the backward. ``final_too`` False: without what follows a unit's last
    gradient (``final_seconds_per_element``), which the host update waits for where it starts in the backward."""
    per = sum(offloaded(units, k)) / layout.os.size
    if final_too:
        return per * (host_sums(train) / host.accumulate_elems_per_s + 1 / host.norm_elems_per_s)
    return per * (host_sums(train) - min(1, host_sums(train))) / host.accumulate_elems_per_s


def final_seconds_per_element(train: TrainingSpec, host: HostSpec) -> float:
    """G on the host: the host's work on an element of a unit's chunk once the window's last backward made its
    gradient final, before its update can read it: the last micro-batch's sum (none where it came straight down into
    the accumulator) and the norm pass. The host thread that does it shares the cores and memory with the update."""
    return min(1, host_sums(train)) / host.accumulate_elems_per_s + 1 / host.norm_elems_per_s


def exposed_seconds(units: list, placement: Placement, layout: Layout, train: TrainingSpec, host: HostSpec,
                    forward_s: float, behind_s: float = 0.0, backward_s: float = 0.0) -> float:
    """What a step waits for the host: the offloaded units' transfers and updates, one after another in forward
    order, less what the next forward hides (``hides_behind_forward``): the first units run their forward
    meanwhile, and an offloaded unit's forward waits only for its own update. Where ``train.host_update_in_backward``
    the updates start inside the window's last backward (``backward_s``, recompute included) instead, and that
    backward hides them too (``updated_in_backward``). With G on the host and the backward given, a unit's update
    follows the host's last sum and norm of its gradient (``final_seconds_per_element``): inside the backward, unit by
    unit; after the step, once the host is done with every unit's (``host_final_done``). The host's other work on
    the gradients (``backward_host_seconds``) where it outlasts the GPU work it runs beside (``behind_s``: the
    window's compute from the first gradient on). With P on the host, the uploads (``upload_seconds``) where they
    outlast the window's compute."""
    k = placement.n_units
    off = offloaded(units, k)
    if not off:
        return 0.0
    s_os = layout.os.size
    in_backward = train.host_update_in_backward and backward_s > 0
    times = [n / s_os / host.update_rate(in_backward) for n in off]  # the worker's; the copies on their lanes
    downs, ups = zip(*(unit_copies(n, s_os, train, host, placement) for n in off))
    grads = placement.offloads("g")
    # G on the host: with the last backward known, the host's work on each unit's final gradient is priced from
    # when the unit is final (``final_seconds_per_element``); the window's other sums beside its compute
    behind = (max(0.0, backward_host_seconds(units, k, layout, train, host, backward_s <= 0) - behind_s) if grads
              else 0.0)
    if placement.offloads("p"):
        behind += max(0.0, upload_seconds(units, k, layout, train, host) - behind_s)
    final = [n / s_os * final_seconds_per_element(train, host) for n in off] if grads else [0.0] * len(off)
    # the step's gradient norm waits for the host's last sums and norms: nothing after the backward starts before
    late = max(0.0, host_final_done(units, final, backward_s) - backward_s) if grads and backward_s > 0 else 0.0
    if in_backward:  # each unit's last sum and norm, then its update: on the same cores and memory
        times = [t + f for t, f in zip(times, final)]
        return updated_in_backward(units, times, forward_s, backward_s, hides_behind_forward(layout), downs,
                                   ups, late) + behind
    # after the step, in forward order: the gradients down on the step's lane, each update once its gradient is down,
    # each unit's parameters up on the same lane once updated (behind every download)
    arrived, worker, up, ready = 0.0, 0.0, sum(downs), []
    for d, upd, u in zip(downs, times, ups):
        arrived += d
        worker = max(worker, arrived) + upd
        up = max(up, worker) + u
        ready.append(up)
    if not hides_behind_forward(layout):
        return late + up + behind
    return late + forward_waits(units, ready, forward_s) + behind


def forward_waits(units: list, ready: list, forward_s: float, start: float = 0.0) -> float:
    """How much longer than ``forward_s`` the next forward takes from ``start`` (one clock with ``ready``): the
    resident units' forward first, each of the last ``len(ready)`` units' once its update is there (``ready[i]``);
    each unit's forward takes its share of the parameters."""
    total, first = sum(units), len(units) - len(ready)
    per_unit_fwd = [forward_s * n / total for n in units]
    t = start + sum(per_unit_fwd[:first])  # the resident units' forward runs while the host works
    for r, fwd in zip(ready, per_unit_fwd[first:]):
        t = max(t, r) + fwd
    return max(0.0, t - (start + forward_s))


def gradient_final_seconds(units: list, backward_s: float) -> list:
    """When each unit's gradient is final in a backward of ``backward_s``, from its start (forward order): the
    backward completes the layers last first, each after its share of the layers' parameters; the root (embeddings,
    head) is reduced when the backward ends."""
    layers = sum(units[1:])
    final, left = [backward_s], layers
    for n in units[1:]:
        final.append(backward_s * left / layers)
        left -= n
    return final


def host_final_done(units: list, final: list, backward_s: float) -> float:
    """When the host is done with the last ``len(final)`` units' final gradients (``final[i]`` seconds each), from the
    last backward's start: one unit at a time, each from when it is final (last unit first)."""
    at = gradient_final_seconds(units, backward_s)[len(units) - len(final):]
    free = 0.0
    for f, work in sorted(zip(at, final)):
        free = max(free, f) + work
    return free


def updated_in_backward(units: list, times: list, forward_s: float, backward_s: float, hides: bool,
                        downs: Optional[tuple] = None, ups: Optional[tuple] = None, late: float = 0.0) -> float:
    """What a step waits for the updates of the last ``len(times)`` units (the worker's ``times[i]`` each) where each
    starts as its gradient is final in the window's last backward and down (``downs[i]``, on a copy lane, in the
    order they become final): one clock from that backward's start, the worker takes them one at a time, of those
    whose gradients are down the one the next forward needs first (the gradients become final last unit first, the
    root's last of all), and each unit's parameters go up on another lane once updated (``ups[i]``); the next
    forward starts when the backward ends (``late`` after it: the step waits for the host's last sums and norms), the
    resident units' first, and an offloaded unit's forward waits for its own upload. ``hides`` False (a P-sync
    follows every update, in ``step()``): the step waits for the last."""
    first = len(units) - len(times)
    downs, ups = downs or [0.0] * len(times), ups or [0.0] * len(times)
    final = gradient_final_seconds(units, backward_s)[first:]
    here, lane = [0.0] * len(times), 0.0
    for i in sorted(range(len(times)), key=lambda j: (final[j], -j)):  # last unit first
        lane = max(lane, final[i]) + downs[i]
        here[i] = lane
    done, free, up, left = [0.0] * len(times), 0.0, 0.0, set(range(len(times)))
    while left:
        free = max(free, min(here[i] for i in left))  # idle until a gradient is down
        i = min(j for j in left if here[j] <= free)  # forward order among those down
        free += times[i]
        up = max(up, free) + ups[i]
        done[i] = up
        left.remove(i)
    if not hides:
        return max(late, up - backward_s)
    return late + forward_waits(units, done, forward_s, backward_s + late)
