"""Human and JSON renderings of a Solution."""

from __future__ import annotations

from .cost import per_state
from .memory import TERMS
from .solver import Evaluation, Plan, Solution
from .topology import STATES

STATE_NAMES = {"p": "P (parameters)", "g": "G (gradients)", "os": "OS (optimizer)", "scalar": "scalars"}


def _ms(s: float) -> str:
    return f"{s * 1e3:9.2f} ms"


def _bytes(b: float) -> str:
    """A size with a unit that keeps small figures readable (tiny CPU models as much as 30B)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= 0.1 * scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _gib(gib: float) -> str:
    return _bytes(gib * 2**30)


def explain_loss(winner: Evaluation, other: Evaluation) -> str:
    """Why ``other`` lost to ``winner``: the terms where it is slower."""
    w, o = per_state(list(winner.collectives)), per_state(list(other.collectives))
    parts = [f"T_{k} {1e3 * (o[k] - w[k]):+.2f} ms" for k in STATES if abs(o[k] - w[k]) > 1e-9]
    if winner.objective == "step" and other.exposed_s != winner.exposed_s:
        parts.append(f"exposed {1e3 * (other.exposed_s - winner.exposed_s):+.2f} ms")
    if other.optimizer_s != winner.optimizer_s:
        parts.append(f"optimizer {1e3 * (other.optimizer_s - winner.optimizer_s):+.2f} ms")
    if other.offload_s != winner.offload_s:
        parts.append(f"offload {1e3 * (other.offload_s - winner.offload_s):+.2f} ms")
    if other.recompute_s != winner.recompute_s:
        parts.append(f"recompute {1e3 * (other.recompute_s - winner.recompute_s):+.2f} ms")
    delta = other.objective_s - winner.objective_s
    return f"{1e3 * delta:+.2f} ms per step" + (f" ({', '.join(parts)})" if parts else " (tie, more sharded)")


def describe(e: Evaluation) -> str:
    p = e.placement
    off = f", {p.placed()} of {p.n_units} of {e.num_units} units {p.where()}" if p.n_units else ""
    return f"{e.layout}{f', {e.ckpt_units} of {e.num_layers} layer units checkpointed' if e.checkpointing else ''}{off}"


def to_json(sol: Solution) -> dict:
    best = sol.best
    return {
        "plan": best.layout.to_json(),
        "activation_checkpointing": best.checkpointing,
        "activation_checkpointing_units": best.ckpt_units,
        "num_layers": best.num_layers,
        "memory_gb_per_gpu": round(best.memory.total_gb, 4),
        "predicted_peak_allocated_gb": round(best.memory.allocated_gb, 4),
        "peak_phase": best.memory.phase,
        "memory_profile": best.memory.activation_source,
        "memory_breakdown_gb": best.memory.to_json(),
        "headroom_gb": round(best.capacity_gb - best.memory.total_gb, 4),
        "predicted_comm_s_per_step": best.comm_s,
        "predicted_recompute_s_per_step": best.recompute_s,
        "predicted_optimizer_s_per_step": best.optimizer_s,
        "predicted_exposed_comm_s_per_step": best.exposed_s,
        **best.placement.legacy_json(), "placement": best.placement.to_json(), "num_units": best.num_units,
        "host_memory_gb": round(best.memory.host_gb, 4),
        "predicted_offload_s_per_step": best.offload_s,
        "mlp_tiles": sol.plan.mlp_tiles, "logits_tiles": sol.plan.logits_tiles,
        "activation_offload_units": best.act_offload_units,
        "activation_host_gb": round(best.memory.activation_host_gb, 4),
        "predicted_activation_offload_s_per_step": best.act_offload_s,
        "objective": best.objective, "objective_s_per_step": best.objective_s,
        "predicted_s_per_state": per_state(list(best.collectives)),
        "collectives": [c.to_json() for c in best.collectives],
        "candidates_considered": sol.considered,
        "feasible": sol.feasible,
        "solve_time_s": sol.elapsed_s,
        "runner_up": None if sol.runner_up is None else {
            "plan": sol.runner_up.layout.to_json(), "activation_checkpointing": sol.runner_up.checkpointing,
            "activation_checkpointing_units": sol.runner_up.ckpt_units,
            "offload_units": sol.runner_up.placement.n_units,
            "predicted_comm_s_per_step": sol.runner_up.comm_s, "why_lost": explain_loss(best, sol.runner_up)},
        "fastest_infeasible": None if sol.fastest_infeasible is None else {
            "plan": sol.fastest_infeasible.layout.to_json(), "offload_units": sol.fastest_infeasible.placement.n_units,
            "memory_gb_per_gpu": round(sol.fastest_infeasible.memory.total_gb, 4)},
        "profile": sol.plan.profile_source,
        "plan_record": sol.plan.to_json(),
        "inputs": sol.inputs,
    }


def _offload_hidden_by(plan: Plan) -> str:
    """What hides the offloaded units' host updates in ``plan``: where nothing waits for every gradient (no clipping,
    no fp16 loss scaling) they start inside the last backward (``Plan.host_update_in_backward``), else once it ends."""
    if plan.host_update_in_backward:
        return "not hidden by the last backward and the next forward"
    return "not hidden by the next forward (clipping waits for every gradient)"


def to_table(sol: Solution) -> str:
    best, plan = sol.best, sol.plan
    topo, off = plan.topology, best.placement
    lines = [
        f"Lins plan for {plan.model} on {topo.nodes} node(s) x {topo.gpus_per_node} GPU(s) "
        f"(profile: {plan.profile_source})",
        f"  activation checkpointing: {best.ckpt_units} of {best.num_layers} layer units"
        + (f" (recompute {_ms(best.recompute_s).strip()} per step)" if best.checkpointing else ""),
        f"  optimizer state {off.where() if off.n_units else 'on the host'}: {off.n_units} of {best.num_units} units"
        + (f" (the last ones{', their gradients too' if off.offloads('g') else ''}"
           f"{', their parameters too' if off.offloads('p') else ''}; "
           f"{_gib(best.memory.host_gb)} pinned per rank of {_gib(best.host_capacity_gb)}; "
           f"{_ms(best.offload_s).strip()} per step {_offload_hidden_by(plan)})" if off.n_units else ""),
        *([f"  sequence tiling: the MLPs in {plan.mlp_tiles} tile(s), the logits and loss in {plan.logits_tiles} "
           "(each recomputed in the backward)"] if plan.mlp_tiles > 1 or plan.logits_tiles > 1 else []),
        *([f"  activation offload: the inputs of {best.act_offload_units} of the {best.ckpt_units} checkpointed layer "
           f"units held on the host until their recompute ({_gib(best.memory.activation_host_gb)} pinned per rank; "
           f"{_ms(best.act_offload_s).strip()} per step not hidden by compute)"] if best.act_offload_units else []),
        "",
        f"  {'state':<16}{'mesh intra x inter':>20}{'bytes/GPU':>14}{'predicted/step':>18}",
    ]
    times = per_state(list(best.collectives))
    terms = {"p": "params", "g": "grads", "os": "optimizer"}
    for s, f in best.layout.factors().items():
        lines.append(f"  {STATE_NAMES[s]:<16}{str(f) + f' (s={f.size})':>20}"
                     f"{_gib(best.memory.terms[terms[s]]):>14}{_ms(times[s]):>18}")
    lines += ["", "  collectives per step:"]
    for c in best.collectives:
        lines.append(f"    {c.state:<6} {c.phase:<10} {c.op:<14} group {c.group:<9} mesh {str(c.mesh):<6} "
                     f"{_bytes(c.nbytes):>11} x {c.calls:<4} {_ms(c.total_s)}")
    if not best.collectives:
        lines.append("    none (a single rank)")
    lines += ["", f"  predicted communication: {_ms(best.comm_s).strip()} per step ({_ms(best.exposed_s).strip()} "
              f"exposed after overlap); optimizer update {_ms(best.optimizer_s).strip()}; objective "
              f"({best.objective}) {_ms(best.objective_s).strip()}", "",
              f"  memory per GPU (activations: {best.memory.activation_source}; the peak is in the {best.memory.phase}):"]
    for k in TERMS:
        lines.append(f"    {k:<14}{_gib(best.memory.terms[k]):>12}")
    lines.append(f"    {'peak allocated':<14}{_gib(best.memory.allocated_gb):>12}")
    lines.append(f"    {'total':<14}{_gib(best.memory.total_gb):>12} of {_gib(best.capacity_gb)} "
                 f"(headroom {_gib(best.capacity_gb - best.memory.total_gb)})")
    lines.append("")
    if sol.runner_up is not None:
        lines.append(f"  runner-up: {describe(sol.runner_up)}: {explain_loss(best, sol.runner_up)}")
    if sol.fastest_infeasible is not None:
        e = sol.fastest_infeasible
        lines.append(f"  faster but does not fit: {describe(e)} needs {_gib(e.memory.total_gb)} "
                     f"({e.objective_s * 1e3:.2f} ms per step)")
    lines.append(f"  searched {sol.considered} candidates, {sol.feasible} fit; solved in {sol.elapsed_s * 1e3:.1f} ms")
    return "\n".join(lines)
