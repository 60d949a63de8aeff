"""Every state transition of a unit (lins_ds/runtime/step/unit.py), as the code has them: a table of
(P placement, starting state, operation) -> resulting state, ``UnitStateError`` where ``_expect`` refuses (the
state then left as it was), or ``no-op`` (state unchanged, no collective issued, no host wait, no hold taken).

The units are real: one layer unit of the tiny LLaMA under ``deepspeed.initialize`` on 4 forked gloo ranks
(2 "nodes" of 2), every rank driving the same rows in the same order, so that the collectives match. One rank
alone cannot reach SYNCING (a P-sync group of one finishes at once), nor REDUCING / REPLICA_REDUCING. Placements:

    whole    P whole (sharded_p False), s_os = 4: P-sync group of 4; G whole (in place), replica AllReduce over 4
    sharded  P sharded (sharded_p True, s_p = 2), s_g = s_os = 4: P-sync group of 2; no G replica (FINAL at once)
    host     P whole but on the host (sharded_p False, ``releases``), s_os = 1: rests SHARDED; no P-sync

A starting state the placement cannot reach is not in the table: SHARDED and GATHERING need a unit that releases
(not ``whole``), SYNCING a P-sync group (not ``host``), REDUCING s_g > 1, REPLICA_REDUCING more than one replica.
UPDATING comes from ``begin_host_update`` with a fake host ticket (``ready`` / ``wait``); ``updating*`` is
UPDATING with the host update still running (``ready`` False), which only ``start_gather`` asks.
"""

import functools

import pytest
import torch

import lins_ds  # noqa: F401  (routes deepspeed.initialize to LinsEngine)
from helpers import config, param_groups, run, tiny_llama

transformers = pytest.importorskip("transformers")

ERR, NOOP = "UnitStateError", "no-op"
SH, GI, GD, SY, UP = "sharded", "gathering", "gathered", "syncing", "updating"
AC, RI, RD, RR, FI = "accumulating", "reducing", "reduced", "replica-reducing", "final"

PLACEMENTS = {  # name -> (lins config, the unit's facts: sharded_p, P on host, P-sync and G replica group sizes,
    # sharded_g, .grad in place); plans are [intra-node, inter-node] factors on 2 nodes of 2 ranks
    "whole": ({"plan": {"p": [1, 1], "g": [1, 1], "os": [2, 2]}}, (False, False, 4, 4, False, True)),
    "sharded": ({"plan": {"p": [2, 1], "g": [2, 2], "os": [2, 2]}}, (True, False, 2, 1, True, False)),
    "host": ({"plan": {"p": [1, 1], "g": [1, 1], "os": [1, 1]}, "offload": {"os": "cpu", "p": "cpu"},
              "host_optimizer": "torch"}, (False, True, 1, 4, False, False)),
}

P_OPS = ("start_gather", "wait_gather", "release", "hold", "unhold", "hold+unhold", "start_param_sync",
         "begin_host_update", "wait_host_update", "finish_host_update", "wait_param_sync", "wait_all")
P_GRID = [  # placement, start: the result of each of P_OPS, in order
    ("whole", GD, [NOOP, NOOP, NOOP, GD, NOOP, NOOP, SY, UP, NOOP, ERR, NOOP, NOOP]),
    ("whole", SY, [GD, GD, NOOP, GD, NOOP, GD, ERR, ERR, NOOP, ERR, GD, GD]),
    ("whole", UP, [GD, GD, NOOP, GD, NOOP, GD, ERR, ERR, UP, GD, GD, ERR]),  # wait_all: a P-sync collective
    ("sharded", SH, [GI, GD, NOOP, GD, NOOP, SH, SY, UP, NOOP, ERR, NOOP, NOOP]),
    # unhold with no hold before it (5th column) releases the unit (waiting for a prefetch first), even one a forward
    # gathered for use: it is what ZeRO-3's param.partition() does, which integrations/zero_api.py maps onto it.
    ("sharded", GI, [NOOP, GD, SH, GD, SH, SH, ERR, ERR, NOOP, ERR, NOOP, GD]),
    # the same unbalanced unhold of a unit gathered for use releases it (its parameters become empty), as partition()
    ("sharded", GD, [NOOP, NOOP, SH, GD, SH, NOOP, ERR, ERR, NOOP, ERR, NOOP, NOOP]),
    ("sharded", SY, [GI, GD, NOOP, GD, NOOP, SH, ERR, ERR, NOOP, ERR, SH, SH]),
    # finish_host_update: SHARDED though this layout's P-sync (group of 2) has not run: the caller's (documented);
    # start_gather: a collective gather of a unit UPDATING waits for its use, done or not (the same on every rank)
    ("sharded", UP, [NOOP, GD, NOOP, GD, NOOP, SH, ERR, ERR, UP, SH, SH, ERR]),  # wait_all: as above
    ("host", SH, [GI, GD, NOOP, GD, NOOP, SH, NOOP, UP, NOOP, ERR, NOOP, NOOP]),
    ("host", GI, [NOOP, GD, SH, GD, SH, SH, ERR, ERR, NOOP, ERR, NOOP, GD]),  # unhold: partition(), as above
    ("host", GD, [NOOP, NOOP, SH, GD, SH, NOOP, ERR, ERR, NOOP, ERR, NOOP, NOOP]),  # unhold: partition(), as above
    ("host", UP, [GI, GD, NOOP, GD, NOOP, SH, ERR, ERR, UP, SH, SH, SH]),
]
P_EXTRA = [("whole", "updating*", "start_gather", NOOP), ("sharded", "updating*", "start_gather", NOOP),
           ("host", "updating*", "start_gather", NOOP)]  # a prefetch does not block on a running host update

G_OPS = ("begin_backward", "start_reduce", "finish_reduce", "start_replica_reduce", "finish_replica_reduce",
         "reset_grads", "wait_all")
G_GRID = [  # placement, start: the result of each of G_OPS, in order
    ("whole", AC, [AC, RD, ERR, RR, ERR, AC, NOOP]),  # s_g == 1: start_reduce straight to REDUCED
    ("whole", RD, [AC, ERR, ERR, RR, ERR, AC, NOOP]),
    ("whole", RR, [ERR, ERR, ERR, ERR, FI, ERR, FI]),
    # begin_backward from FINAL: another backward over the window's last micro-batch (engine.backward twice on one
    # forward); the window's sum stays on the first replica only (zeros elsewhere), counted once by the next AllReduce
    ("whole", FI, [AC, ERR, ERR, ERR, ERR, AC, NOOP]),
    ("sharded", AC, [AC, RI, ERR, FI, ERR, AC, NOOP]),  # one replica: start_replica_reduce straight to FINAL
    ("sharded", RI, [ERR, ERR, RD, ERR, ERR, ERR, RD]),
    ("sharded", RD, [AC, ERR, ERR, FI, ERR, AC, NOOP]),
    ("sharded", FI, [AC, ERR, ERR, ERR, ERR, AC, NOOP]),
]

P_ROWS = [("param", pl, start, op, want) for pl, start, wants in P_GRID for op, want in zip(P_OPS, wants)] + \
    [("param", *row) for row in P_EXTRA]
G_ROWS = [("grad", pl, start, op, want) for pl, start, wants in G_GRID for op, want in zip(G_OPS, wants)]
ROWS = P_ROWS + G_ROWS


class FakeHost:
    """What a unit asks of its HostTicket while UPDATING: ``ready`` (a prefetch) and ``wait`` (counted)."""

    def __init__(self):
        self.is_ready, self.waits = True, 0

    def ready(self):
        return self.is_ready

    def wait(self):
        self.waits += 1


P_CALLS = {
    "start_gather": lambda u, h: u.start_gather(), "wait_gather": lambda u, h: u.wait_gather(),
    "release": lambda u, h: u.release(), "hold": lambda u, h: u.hold(), "unhold": lambda u, h: u.unhold(),
    "hold+unhold": lambda u, h: (u.hold(), u.unhold()),
    "start_param_sync": lambda u, h: u.start_param_sync(async_op=True),
    "begin_host_update": lambda u, h: u.begin_host_update(h), "wait_host_update": lambda u, h: u.wait_host_update(),
    "finish_host_update": lambda u, h: u.finish_host_update(), "wait_param_sync": lambda u, h: u.wait_param_sync(),
    "wait_all": lambda u, h: u.wait_all(),
}
G_CALLS = {
    "begin_backward": lambda u, s: u.begin_backward(), "start_reduce": lambda u, s: u.start_reduce(s),
    "finish_reduce": lambda u, s: u.finish_reduce(), "start_replica_reduce": lambda u, s: u.start_replica_reduce(),
    "finish_replica_reduce": lambda u, s: u.finish_replica_reduce(), "reset_grads": lambda u, s: u.reset_grads(),
    "wait_all": lambda u, s: u.wait_all(),
}


def enter_param(u, start, host):
    """The unit at rest (nothing held, in flight or gathered for use), then in ``start`` by public methods."""
    while u.held:
        u.unhold()
    u.wait_param_sync()  # a host update left UPDATING by the row before: its P-sync, on every rank alike
    u.wait_all()
    u.release()
    host.is_ready = start != "updating*"
    if start == GI:
        u.start_gather()
    elif start == GD:
        u.wait_gather()
    elif start == SY:
        u.start_param_sync(async_op=True)
    elif start in (UP, "updating*"):
        u.begin_host_update(host)
    assert u.param_state.value == start.rstrip("*"), (start, u.param_state)


def enter_grad(u, start, staging):
    u.wait_param_sync()
    u.wait_all()
    u.reset_grads()
    if start in (RI, RD, RR, FI):
        u.start_reduce(staging)
    if start in (RD, RR, FI) and u.grad_state.value == RI:
        u.finish_reduce()
    if start in (RR, FI):
        u.start_replica_reduce()
    if start == FI and u.grad_state.value == RR:
        u.finish_replica_reduce()
    assert u.grad_state.value == start, (start, u.grad_state)


def drive(rows):
    """On each rank: every row's outcome, (resulting state or ERR, whether it acted), by row."""
    import deepspeed
    from lins_ds import comm
    from lins_ds.runtime.step.unit import UnitStateError

    out = {}
    for name, (lins, facts) in PLACEMENTS.items():
        model = tiny_llama()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                          config=config(lins))
        unit, host = engine.lins._units[1], FakeHost()  # the first layer
        assert facts == (unit.sharded_p, unit.host_params is not None, unit.groups.size("p_sync"),
                         unit.groups.size("g_replica"), unit.sharded_g, unit.in_place), name
        staging = torch.zeros(unit.spec.padded, dtype=unit._reduce_dtype, device=unit.device)
        for kind, pl, start, op, _ in rows:
            if pl != name:
                continue
            grad = kind == "grad"
            enter_grad(unit, start, staging) if grad else enter_param(unit, start, host)
            state = lambda: (unit.grad_state if grad else unit.param_state).value  # noqa: E731
            before, waits, held = state(), host.waits, unit.held
            with comm.recording() as rec:
                try:
                    G_CALLS[op](unit, staging) if grad else P_CALLS[op](unit, host)
                    got = state()
                except UnitStateError:
                    got = ERR if state() == before else f"{ERR}, left {state()}"
            acted = bool(rec.calls) or host.waits != waits or unit.held != held
            out[(kind, pl, start, op)] = (got, acted)
        enter_grad(unit, AC, staging)
        enter_param(unit, unit._at_rest.value, host)
        engine.destroy()
    return out


@functools.lru_cache(maxsize=None)
def outcomes() -> dict:
    """Every row, run once per session on 4 ranks (which must agree)."""
    by_rank = run(drive, 4, ROWS, gpus_per_node=2, timeout=300)
    assert all(r == by_rank[0] for r in by_rank[1:]), "ranks disagree"
    return by_rank[0]


@pytest.mark.parametrize("kind, placement, start, op, want",
                         [pytest.param(*r, id="-".join(r[:4])) for r in ROWS])
def test_transition(kind, placement, start, op, want):
    got, acted = outcomes()[(kind, placement, start, op)]
    if want == NOOP:
        assert (got, acted) == (start.rstrip("*"), False), f"expected no-op, got {got} (acted: {acted})"
    else:
        assert got == want


def test_the_table_covers_every_reachable_start():
    """Each placement's grid lists every ParamState / GradState it can reach, and every operation for each."""
    from lins_ds.runtime.step.unit import GradState, ParamState

    starts = lambda grid, pl: {s for p, s, _ in grid if p == pl}  # noqa: E731
    assert starts(P_GRID, "sharded") == {s.value for s in ParamState}
    assert starts(P_GRID, "whole") | starts(P_GRID, "host") == {s.value for s in ParamState}
    assert starts(G_GRID, "whole") | starts(G_GRID, "sharded") == {s.value for s in GradState}
    assert all(len(w) == len(P_OPS) for *_, w in P_GRID) and all(len(w) == len(G_OPS) for *_, w in G_GRID)


# --- the host side's protocol (lins_ds/runtime/step/offload.py: HostOffload) ----------------------------------------
H_OPS = ("push", "drain_grads", "start_updates", "begin", "ahead", "take", "settle")
H_GRID = """
idle        idle      drained   refused     refused   ahead    refused   idle
drained     refused   drained   downloaded  refused   refused  refused   idle
downloaded  refused   refused   refused     updating  refused  refused   idle
updating    updating  refused   refused     refused   refused  refused   idle
ahead       ahead     refused   refused     refused   refused  updating  refused
"""  # phase, then the result of each of H_OPS: the phase it leaves, or HostProtocolError (the phase kept)


class _FakeUnit:
    """What HostGrads asks of a unit: its G chunk's size and a wait for its last host update."""

    g_numel, name = 8, "layer0"

    def wait_host_update(self):
        pass


def host_protocol_rows():
    """Each (phase, operation) on a real HostOffload (CPU device, one unit's host G accumulator): what the phase
    becomes, or 'refused'. Every rank drives the same rows (settle agrees over the world)."""
    from lins_ds.runtime.errors import HostProtocolError
    from lins_ds.runtime.step.offload import HostOffload, HostPhase

    unit = _FakeUnit()
    out = {}
    for line in H_GRID.strip().splitlines():
        start = line.split()[0]
        for op in H_OPS:
            host = HostOffload(torch.device("cpu"), torch.float32)
            host.place_grads([unit])
            host.protocol.phase = HostPhase(start)
            call = {"push": lambda: host.grads.push(unit, torch.ones(8)), "drain_grads": host.drain_grads,
                    "start_updates": lambda: host.start_updates(torch.ones(())), "begin": host.begin,
                    "ahead": lambda: host.begin_ahead(1.0), "take": lambda: (host.backward_ended(), host.take()), "settle": host.settle}[op]
            try:
                call()
                out[start, op] = host.protocol.phase.value
            except HostProtocolError:
                assert host.protocol.phase.value == start, (start, op)  # a refusal changes nothing
                out[start, op] = "refused"
            host.close()
    return out


def test_every_host_offload_transition_gives_what_the_table_says():
    """The host updates never start before the gradients are final (start_updates only after drain_grads), no
    gradient comes down between the drain and the update's start, a step boundary settles any phase but AHEAD (updates
    begun inside the last backward, which only the step takes), and those begin only from IDLE."""
    want = {}
    for line in H_GRID.strip().splitlines():
        start, *results = line.split()
        want.update({(start, op): r for op, r in zip(H_OPS, results)})
    for got in run(host_protocol_rows, 2):
        assert got == want, {k: (got[k], want[k]) for k in want if got.get(k) != want[k]}


def skipped_drain():
    """A step whose update starts without draining the host's gradient sums (what a refactor that dropped
    ``drain_grads`` would do): refused on every rank before any host update reads an accumulator."""
    import deepspeed

    from lins_ds.runtime.errors import HostProtocolError
    from lins_ds.runtime.step.offload import HostOffload

    HostOffload.drain_grads = lambda self: None
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)), config=config(
        {"plan": {"p": [1, 1], "g": [2, 2], "os": [2, 2]}, "offload": {"os": "cpu", "g": "cpu"},
         "host_optimizer": "torch", "host_update_in_backward": False}, gradient_clipping=0.0))
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    msg = ""
    try:
        for _ in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
    except HostProtocolError as e:
        msg = str(e)
    return msg


def test_an_update_started_before_the_gradients_are_final_is_refused():
    for msg in run(skipped_drain, 4, gpus_per_node=2):
        assert "start_updates in phase idle, expected drained" in msg, msg
