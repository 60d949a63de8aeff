"""The package's import graph goes one way (docs/design.md §5):

    plan, version  <-  comm, dtypes  <-  profiler  <-  runtime  <-  checkpoint  <-  integrations  <-  cli, run, tools

and plan/ imports no torch; no module reaches itself through a chain of imports; and docs/design.md §5 shows the graph
as it is (``python tests/test_layout_imports.py`` rewrites that picture). Checked on the source (every import
statement, also those inside functions).
"""

import ast
import os

import lins_ds

PKG = os.path.dirname(lins_ds.__file__)
LAYERS = [{"plan", "version"}, {"comm", "dtypes"}, {"profiler"}, {"runtime"}, {"checkpoint"}, {"integrations"},
          {"cli", "run", "tools", "__init__"}]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# runtime/ in rooms by role, each importing only rooms before it: what every room reads (errors, the config), the
# step machinery, memory (probe, guard), start-up, the owner of a plan's runtime (runtime.runtime, and full_values: its
# verbs for one parameter's whole value), switching plans
ROOMS = [{"errors", "config"}, {"step"}, {"memory"}, {"startup"}, {"runtime", "full_values"}, {"switch"}]
ROOM_RANK = {name: i for i, room in enumerate(ROOMS) for name in room}


def part_of(module: str) -> str:
    """The top-level part of lins_ds a dotted module name (``lins_ds.x.y``) belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: str, module: str) -> list:
    """Every lins_ds module (and every top-level package) ``path`` imports, resolved to absolute names."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                out += [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                out.append(node.module)
    return out


def modules():
    for folder, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                yield path, rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def test_imports_go_one_way():
    bad = []
    for path, module in modules():
        mine = part_of(module)
        for target in imports(path, module):
            if target.startswith("lins_ds.") or target == "lins_ds":
                theirs = part_of(target)
                if theirs in RANK and RANK[theirs] > RANK[mine]:
                    bad.append(f"{module} imports {target}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def room_of(module: str) -> str:
    """The room of a ``lins_ds.runtime.<room>[.x]`` module ('' for the package itself)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def test_runtime_rooms_import_only_rooms_before_them():
    bad, rooms = [], set()
    for path, module in modules():
        if part_of(module) != "runtime" or not room_of(module):
            continue
        mine = room_of(module)
        rooms.add(mine)
        for target in imports(path, module):
            if target.startswith("lins_ds.runtime.") and ROOM_RANK.get(room_of(target), -1) > ROOM_RANK[mine]:
                bad.append(f"{module} imports {target}")
    assert rooms == set(ROOM_RANK), rooms ^ set(ROOM_RANK)  # every module of runtime/ is in a room
    assert not bad, "imports into a later room:\n" + "\n".join(bad)


def test_every_part_has_a_layer():
    parts = {part_of(m) for _, m in modules()}
    assert parts <= set(RANK), parts - set(RANK)


def test_the_planner_imports_no_torch():
    for path, module in modules():
        if part_of(module) == "plan":
            heavy = [t for t in imports(path, module) if t.split(".")[0] in ("torch", "deepspeed", "transformers")]
            assert not heavy, (module, heavy)


def test_the_engine_never_imports_tools():
    for path, module in modules():
        if part_of(module) not in ("cli", "run", "tools", "__init__"):
            assert not any(t.startswith("lins_ds.tools") for t in imports(path, module)), module


def test_the_package_never_imports_the_benchmarks():
    for path, module in modules():
        assert not any(t == "bench" or t.startswith("bench.") for t in imports(path, module)), module


def test_the_wheel_installs_no_benchmark_code():
    """setup.py's packages: lins_ds and its subpackages, nothing of bench/, examples/ or tests/."""
    import ast as _ast

    root = os.path.dirname(PKG)
    call = next(n for n in _ast.walk(_ast.parse(open(os.path.join(root, "setup.py")).read()))
                if isinstance(n, _ast.Call) and getattr(n.func, "id", "") == "setup")
    packages = next(k.value for k in call.keywords if k.arg == "packages")
    from setuptools import find_packages

    found = find_packages(root, **{k.arg: _ast.literal_eval(k.value) for k in packages.keywords})
    assert found and all(p == "lins_ds" or p.startswith("lins_ds.") for p in found), found


def graph() -> dict:
    """lins_ds module (dotted, without "lins_ds.") -> the lins_ds modules it imports (resolved to modules)."""
    mods = {m: p for p, m in modules()}

    def resolve(target):
        while target not in mods:
            if "." not in target:
                return None
            target = target.rsplit(".", 1)[0]
        return target

    short = {m: m[len("lins_ds."):] if m != "lins_ds" else "lins_ds" for m in mods}
    out = {}
    for m, path in mods.items():
        found = {resolve(t) for t in imports(path, m) if t and (t == "lins_ds" or t.startswith("lins_ds."))}
        out[short[m]] = sorted(short[t] for t in found if t and t != m)
    return out


def cycles(g: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert not cycles(graph()), cycles(graph())


BEGIN, END = "<!-- import-graph: generated by python tests/test_layout_imports.py -->", "<!-- import-graph end -->"


def picture() -> str:
    """The parts as a layered graph (mermaid), then every module with the lins_ds modules it imports."""
    g = graph()
    part = {m: (m.split(".")[0] if m != "lins_ds" else "__init__") for m in g}
    edges = sorted({(part[a], part[b]) for a, bs in g.items() for b in bs if part[a] != part[b]})
    lines = [BEGIN, "```mermaid", "flowchart BT"]
    lines += [f"  {a.strip('_')} --> {b.strip('_')}" for a, b in edges]
    rooms = {room_of("lins_ds." + m) for m in g if part[m] == "runtime"} - {""}
    inner = sorted({(room_of("lins_ds." + a), room_of("lins_ds." + b)) for a, bs in g.items() if part[a] == "runtime"
                    for b in bs if part[b] == "runtime" and room_of("lins_ds." + b) != room_of("lins_ds." + a)
                    and room_of("lins_ds." + a) and room_of("lins_ds." + b)})
    lines += ["```", "", "runtime/'s rooms (`runtime.runtime` is the owner, `errors` and `config` what every room "
              "reads):", "", "```mermaid", "flowchart BT"]
    lines += [f"  {a} --> {b}" for a, b in inner] + [f"  {r}" for r in sorted(rooms) if not any(r in e for e in inner)]
    lines += ["```", "", "| part (layer) / room | module | imports |", "|---|---|---|"]
    def where(m):
        room = room_of("lins_ds." + m) if part[m] == "runtime" else ""
        return (RANK[part[m]], ROOM_RANK.get(room, -1), m), f"{part[m]} ({RANK[part[m]]})" + (
            f" / {room} ({ROOM_RANK[room]})" if room in ROOM_RANK else "")

    for m in sorted(g, key=lambda m: where(m)[0]):
        lines.append(f"| {where(m)[1]} | `{m}` | {', '.join(g[m]) or '-'} |")
    return "\n".join(lines + [END])


DESIGN = os.path.join(os.path.dirname(PKG), "docs", "design.md")


def test_the_design_shows_the_import_graph_as_it_is():
    text = open(DESIGN, encoding="utf-8").read()
    assert BEGIN in text and END in text, f"{DESIGN}: no generated import graph"
    shown = text[text.index(BEGIN):text.index(END) + len(END)]
    assert shown == picture(), "docs/design.md's import graph is out of date: run python tests/test_layout_imports.py"


if __name__ == "__main__":
    text = open(DESIGN, encoding="utf-8").read()
    new = text[:text.index(BEGIN)] + picture() + text[text.index(END) + len(END):]
    with open(DESIGN, "w", encoding="utf-8") as f:
        f.write(new)
    print(f"{DESIGN}: import graph rewritten")


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "timed_collective")
# who calls comm's collectives, and why: a unit's own, re-layout's gathers of whole units included (unit); the global
# gradient norm and the world sums of ZeRO's full-value helpers (runtime); the profiler's timed collectives, before
# training (profiler.measure)
COLLECTIVE_CALLERS = {"runtime.step.unit", "runtime.runtime", "profiler.measure"}


AGREEMENTS = ("agree", "all_gather_object", "broadcast_object", "all_ranks_arrive", "max_over_world",
              "max_over_world_cpu", "barrier", "check_order")
# who calls comm's agreements (object gathers, barriers, max over ranks), which hang a job as easily as a tensor
# collective when only some ranks reach them, and why each may: every rank reaches it at the same point
AGREEMENT_CALLERS = {
    "checkpoint.load": "every rank's outcome of reading and checking, before any of them fills the engine",
    "checkpoint.save": "every rank's outcome of writing, before the rename; rank 0's directory listing",
    "integrations.checkpointing": "save_checkpoint's and load_checkpoint's arrival checks (every rank must call them)",
    "profiler": "rank 0's cached or measured timing table, handed to every rank",
    "profiler.measure": "the slowest rank's time of each measured collective",
    "profiler.validate": "the same, for the validation of a profile",
    "runtime.memory.memory_guard": "the worst rank's peak, after the second step (every rank steps)",
    "runtime.memory.memory_probe": "rank 0's activation profile, handed to every rank",
    "runtime.runtime": "a re-layout's outcome on every rank (all go back on any failure)",
    "runtime.startup.materialize": "whether every rank built the model the same way, at deepspeed.initialize",
    "runtime.startup.planning": "the plan's digest and batch settings; the host's description (rank 0's)",
    "runtime.startup.seq_len": "the longest training batch every rank saw, at the window's start",
    "runtime.step.offload": "a host worker's failure on any rank, at the step, a save or a re-layout",
    "runtime.step.staging": "a re-layout's staging outcome on every rank",
    "runtime.switch.tune": "the slowest rank's step time, after each optimizer step",
    "runtime.switch.planner": "a cached tune decision (rank 0's), at start-up or the first batch",
    "tools.profile_cli": "`lins-ds profile`'s ranks done measuring before the process group goes",
}


# torch.distributed's collectives and agreements called directly, not through comm.py: only the demo, which is a
# user's training script (the loss it prints averaged over the ranks)
DIRECT_CALLERS = {"tools.demo"}
DIRECT = set(COLLECTIVES) | set(AGREEMENTS) | {"broadcast_object_list", "gather", "scatter", "all_to_all", "reduce",
                                               "all_gather_into_tensor", "reduce_scatter_tensor", "send", "recv",
                                               "gather_object", "scatter_object_list", "monitored_barrier"}


def callers_of(names, receivers: tuple) -> set:
    """The modules (but comm itself) that call ``receiver.name(...)`` for a name in ``names``."""
    callers = set()
    for path, module in modules():
        if module == "lins_ds.comm":
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
                    and ast.unparse(node.func.value) in receivers):
                callers.add(module[len("lins_ds."):])
    return callers


def test_only_the_named_modules_agree_across_ranks():
    callers = callers_of(AGREEMENTS, ("comm",))
    assert callers == set(AGREEMENT_CALLERS), callers ^ set(AGREEMENT_CALLERS)


def test_nothing_but_comm_calls_torch_distributed_s_collectives():
    """One module owns collectives: a direct ``torch.distributed`` (or ``dist`` / ``tdist``) call of a collective or
    an agreement escapes both tests above."""
    callers = callers_of(DIRECT, ("dist", "tdist", "torch.distributed", "deepspeed.comm"))
    assert callers == DIRECT_CALLERS, callers ^ DIRECT_CALLERS


def test_only_the_named_modules_issue_collectives():
    """Every collective goes through comm.py, from these modules alone: host offload copies (HostParams uploads a
    P chunk; the unit gathers it), the runtime and checkpoints ask units."""
    callers = callers_of(COLLECTIVES, ("comm",))
    assert callers == COLLECTIVE_CALLERS, callers ^ COLLECTIVE_CALLERS


# What a plan holds belongs to LinsRuntime (docs/design.md §4): a unit's buffers and groups, the master slices, the host
# side of offload, the executor and its progress. Outside runtime/step/ (the machinery itself) and runtime/runtime.py
# (its owner) no module reads these attributes of another object; it asks the runtime. The runtime keeps its own
# private (RUNTIME_PRIVATE, held by test_the_runtime_keeps_its_state_private), a unit its transitions' state
# (``_param_state``, ...: read-only properties); the former public names stay listed, so that none comes back as a
# reach-in. ``unit``: a master slice's ``OSRange`` knows its unit; only the step machinery follows it.
RUNTIME_PRIVATE = {"_units", "_host_units", "_masters", "_groups", "_progress", "_host", "_reads_pending",
                   "_os_replicas", "_plan", "_topo", "_layout", "_device", "_is_checkpoint_writer", "_forward_only",
                   "_module", "_overlap_param_sync", "_outside", "_basic", "_executor", "_slot_of"}
RUNTIME_OWNED = {"units", "unit", "host_units", "slices", "update_batches", "masters", "host", "updater", "host_grads",
                 "host_params", "p_shard", "g_acc", "full", "spec", "groups", "progress", "reads_pending",
                 "os_replicas", "_lins_solve", "_status", "_param_state", "_grad_state", "_held", "_host_grads",
                 "_host_params"} | RUNTIME_PRIVATE
REACH_IN_ALLOWED = {  # (module, attribute): why
    ("runtime.startup.materialize", "spec"): "a Unit hands itself to the materializer while it is built",
    ("runtime.startup.materialize", "full"): "the same: the unit's buffer it fills",
    ("runtime.startup.materialize", "p_shard"): "the same: the P chunk it fills",
    ("runtime.startup.planning", "host"): "context.offload.host: the plan's OffloadSpec (data), not the runtime's",
    ("runtime.switch.tune", "host"): "the same: the candidates' host optimizer is the OffloadSpec's",
    ("integrations.optimizer", "full"): "torch.full (a tensor), not a unit's buffer",
    ("integrations.sharded_init", "full"): "its own replay records' values",
}


def test_nothing_outside_the_runtime_reads_what_a_plan_holds():
    found = set()
    for path, module in modules():
        short = module[len("lins_ds."):] if module != "lins_ds" else module
        if part_of(module) == "plan" or short.startswith("runtime.step.") or short == "runtime.runtime":
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if (isinstance(node, ast.Attribute) and node.attr in RUNTIME_OWNED
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                found.add((short, node.attr, f"line {node.lineno}: {ast.unparse(node)}"))
    bad = sorted(f"{m}: {where}" for m, attr, where in found if (m, attr) not in REACH_IN_ALLOWED)
    assert not bad, "reach-ins into what LinsRuntime owns:\n" + "\n".join(bad)
    unused = set(REACH_IN_ALLOWED) - {(m, attr) for m, attr, _ in found}
    assert not unused, f"allowed reach-ins no module makes any more (drop them): {sorted(unused)}"


def _self_attributes_assigned(cls: ast.ClassDef) -> set:
    """The names ``self.<name> = ...`` (plain, annotated, augmented, or one of a tuple) assigns in ``cls``'s methods."""
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    out.add(el.attr)
    return out


def test_the_runtime_keeps_its_state_private():
    """LinsRuntime (and its mixin FullValues) assigns only private attributes (issue 62, "real encapsulation"):
    what others read of it is a read-only property (``plan``, ``topo``, ``layout``, ``device``, ...) or a verb, and
    none hands out a unit: ``zero_api`` asks ``zero3_params`` and ``show_zero3_status``. RUNTIME_PRIVATE names what
    it holds."""
    assigned = set()
    for name, cls_name in (("runtime.py", "LinsRuntime"), ("full_values.py", "FullValues")):
        tree = ast.parse(open(os.path.join(PKG, "runtime", name)).read())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
        assigned |= _self_attributes_assigned(cls)
    public = sorted(a for a in assigned if not a.startswith("_"))
    assert not public, f"public attributes of LinsRuntime (private, and a property where others read them): {public}"
    gone = RUNTIME_PRIVATE - assigned
    assert not gone, f"RUNTIME_PRIVATE names what LinsRuntime holds no more: {gone}"
    from lins_ds.runtime.runtime import LinsRuntime

    assert not hasattr(LinsRuntime, "units") and not hasattr(LinsRuntime, "host_units")


def test_one_offload_policy_site():
    """Which offload is tried, in which order, is decided in one place (issue 62): ``plan.offload.ladder``, walked by
    ``plan.offload.walk``. No other module of lins_ds builds an offload that is not GPU-resident (an ``OffloadSpec``
    with arguments), walks offloads of its own (a loop that calls the solver once per offload), or names a hidden
    placement ("needed")."""
    builders, needed = set(), set()
    for path, module in modules():
        text = open(path).read()
        for node in ast.walk(ast.parse(text, path)):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "OffloadSpec"
                    and (node.args or node.keywords)):
                builders.add(module[len("lins_ds."):])
            if isinstance(node, ast.Constant) and node.value == "needed":
                needed.add(module[len("lins_ds."):])
    assert builders == {"plan.offload"}, builders
    assert not needed, needed
    from lins_ds.plan import offload

    assert not hasattr(offload, "widened") and "needed" not in offload.PARAM_PLACES
