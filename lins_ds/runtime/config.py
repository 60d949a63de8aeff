"""The ``"lins"`` block of a DeepSpeed config, parsed once into typed objects (no torch here).

DeepSpeed ignores unknown top-level keys, so this block is validated here, strictly: every error
names the key, the value and the rule, and is raised on every rank before Lins issues any collective.
Each field of ``LinsConfig`` carries its own rule (``_rule``); the parser walks the fields.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, fields
from typing import Callable, NamedTuple, Optional

from ..plan import Factor, Layout, STATES, Topology, check_layout
from ..plan.clusters import CLUSTERS
from ..plan.solver import OBJECTIVES
from ..plan.spec import DTYPES
from .errors import LinsConfigError  # noqa: F401  (its home; importable from here as before)


# --- rules: each takes (key, value) and returns the parsed value or raises LinsConfigError ------------------
def _bad(key: str, value, what: str):
    raise LinsConfigError(f"lins.{key}: {value!r} is not {what}")


def _boolean(key, value):
    return value if isinstance(value, bool) else _bad(key, value, "true or false")


def _optional(rule: Callable) -> Callable:
    return lambda key, value: None if value is None else rule(key, value)


def _positive_int(key, value):
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return value if ok else _bad(key, value, "a positive integer")


def _positive_gib(key, value):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if ok else _bad(key, value, "a positive number of GiB")


def _nonnegative_gib(key, value):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else _bad(key, value, "a number of GiB >= 0")


def _string(what: str) -> Callable:
    return lambda key, value: value if isinstance(value, str) else _bad(key, value, what)


def _one_of(choices) -> Callable:
    return lambda key, value: value if value in choices else _bad(key, value, f"one of {', '.join(map(str, choices))}")


def _auto_or_boolean(key, value):
    return value if value == "auto" or isinstance(value, bool) else _bad(key, value, "\"auto\", true or false")


def _checkpointing(key, value):
    if isinstance(value, bool) or (isinstance(value, int) and value >= 0):
        return value
    return _bad(key, value, "true, false, null or a number of layer units >= 0")


def _memory_profile(key, value):
    if not isinstance(value, str) or not (value in ("measure", "formula") or value.endswith(".json")):
        _bad(key, value, "\"measure\", \"formula\" or a memory profile .json path")
    return value


def _profile(key, value):
    if not isinstance(value, str) or not (value in ("measure", "synthetic") or value.endswith(".json")):
        _bad(key, value, "\"measure\", \"synthetic\" or a profile .json path")
    return value


def _class_names(key, value):
    if not isinstance(value, list) or not value or not all(isinstance(u, str) for u in value):
        _bad(key, value, "a non-empty list of module class names")
    return tuple(value)


def _plan(key, value):
    if value in ("solve", "tune"):
        return value
    if not isinstance(value, dict):
        _bad(key, value, "\"solve\", \"tune\" or {\"p\": [intra, inter], \"g\": [...], \"os\": [...]}")
    extra, missing = set(value) - set(STATES), set(STATES) - set(value)
    if extra or missing:
        raise LinsConfigError(f"lins.plan: keys must be exactly p, g, os (unknown: {sorted(extra)}, "
                              f"missing: {sorted(missing)})")
    ok = lambda x: x == "all" or (isinstance(x, int) and not isinstance(x, bool) and x >= 1)  # noqa: E731
    for s in STATES:
        f = value[s]
        if not isinstance(f, (list, tuple)) or len(f) != 2 or not all(ok(x) for x in f):
            raise LinsConfigError(f"lins.plan.{s}: {f!r} is not [intra, inter], each a positive integer or \"all\"")
    return {s: tuple(value[s]) for s in STATES}


@dataclass(frozen=True)
class TuneSpec:
    """``lins.tune``: how many of the solver's candidates to time; optimizer steps per candidate, at least ``steps``
    (the first ``warmup_steps`` not timed: the first step after a move allocates, the second pays the first host
    update under offload) and more until the median step time's 95 % interval is within +-``precision`` of it,
    ``max_steps`` at most (each candidate: the tuning takes up to candidates x max_steps optimizer steps, which the
    start-up summary states); whether the decision is cached for the next launch."""

    candidates: int = 3
    steps: int = 3
    precision: float = 0.03
    max_steps: int = 12
    warmup_steps: int = 2
    cache: bool = True


TUNE_KEYS = {f.name: f.default for f in fields(TuneSpec)}


def _tune(key, value):
    """{"candidates": k >= 1, "steps": n >= 2, "precision": 0 <= x < 1, "max_steps": >= steps,
    "warmup_steps": 1 <= w < steps, "cache": bool}, defaults filled in (warmup_steps: 2, or steps - 1 if fewer)."""
    if not isinstance(value, dict):
        _bad(key, value, "{\"candidates\": 3, \"steps\": 3, \"precision\": 0.03, \"max_steps\": 12, "
             "\"warmup_steps\": 2, \"cache\": true}")
    unknown = sorted(set(value) - set(TUNE_KEYS))
    if unknown:
        raise LinsConfigError(f"lins.tune.{unknown[0]}: unknown key (known keys: {', '.join(TUNE_KEYS)})")
    out = {**TUNE_KEYS, **value}
    for name, low in (("candidates", 1), ("steps", 2)):
        v = out[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            _bad(f"{key}.{name}", v, f"an integer >= {low}"
                 + (" (the first step of each candidate is not timed)" if name == "steps" else ""))
    v = out["precision"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        _bad(f"{key}.precision", v, "a number >= 0 and < 1 (the median step time's 95 % interval, +- this fraction)")
    v = out["max_steps"]
    if "max_steps" not in value:
        out["max_steps"] = max(v, out["steps"])
    elif isinstance(v, bool) or not isinstance(v, int) or v < out["steps"]:
        _bad(f"{key}.max_steps", v, f"an integer >= lins.tune.steps ({out['steps']})")
    v = out["warmup_steps"]
    if "warmup_steps" not in value:
        out["warmup_steps"] = min(v, out["steps"] - 1)
    elif isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < out["steps"]:
        _bad(f"{key}.warmup_steps", v, f"an integer >= 1 and < lins.tune.steps ({out['steps']}): a candidate's "
             "first steps are not timed, and at least one is")
    if not isinstance(out["cache"], bool):
        _bad(f"{key}.cache", out["cache"], "true or false")
    return TuneSpec(**out)


OFFLOAD_KEYS = ("os", "os_fraction", "p", "g")


class OffloadChoice(NamedTuple):
    """lins.offload parsed: ``mode`` "auto", "off" or "fixed"; ``fraction`` of the units (fixed); where the
    offloaded units' gradients (``grads``) and parameters (``params``) go: "auto" (the solver's choice), "cpu",
    "gpu". Under "auto" the parameters' rung of ``plan.offload.ladder`` (on the host only where nothing fits with
    them on the GPU) decides them."""

    mode: str
    fraction: float
    grads: str
    params: str


OFFLOAD_AUTO = OffloadChoice("auto", 1.0, "auto", "auto")
OFFLOAD_OFF = OffloadChoice("off", 1.0, "gpu", "gpu")


def _tiling(key, value):
    """\"auto\", false, or {"mlp": m, "logits": l} (tile counts, at least 1) as (m, l)."""
    if value == "auto" or value is False:
        return value
    if not isinstance(value, dict) or not value or set(value) - {"mlp", "logits"}:
        _bad(key, value, "\"auto\", false or {\"mlp\": 4, \"logits\": 8} (sequence tiles of the MLPs and of the "
             "logits with their loss)")
    for part in ("mlp", "logits"):
        n = value.get(part, 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            _bad(f"{key}.{part}", n, "a positive integer (1: not tiled)")
    return (value.get("mlp", 1), value.get("logits", 1))


def _activation_offload(key, value):
    """"auto", false, or a number of checkpointed layer units (>= 0) whose inputs wait on the host."""
    if value == "auto" or value is False:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _bad(key, value, "\"auto\", false or a number of checkpointed layer units >= 0")
    return value


def _offload(key, value):
    """\"auto\", false, or the fixed form {"os": "cpu", "os_fraction": f, "g": "cpu" | "gpu", "p": "cpu" | "auto" |
    "gpu"}, as an ``OffloadChoice`` (parameters "gpu" unless asked)."""
    if value == "auto":  # parameters on the host only where nothing fits with them on the GPU
        return OFFLOAD_AUTO
    if value is False:
        return OFFLOAD_OFF
    if not isinstance(value, dict):
        _bad(key, value, "\"auto\", false or {\"os\": \"cpu\", \"os_fraction\": 0.5}")
    unknown = sorted(set(value) - set(OFFLOAD_KEYS))
    if unknown:
        raise LinsConfigError(f"lins.offload.{unknown[0]}: unknown key (known keys: {', '.join(OFFLOAD_KEYS)})")
    grads, params = value.get("g", "auto"), value.get("p", "gpu")
    if grads not in ("cpu", "gpu", "auto"):
        _bad(f"{key}.g", grads, "\"cpu\" (the offloaded units' gradients on the host), \"gpu\", or left out "
             "(the solver decides)")
    if params not in ("cpu", "gpu", "auto"):
        _bad(f"{key}.p", params, "\"cpu\" (the offloaded units' parameters on the host), \"auto\" (the solver "
             "decides), or \"gpu\" (the default)")
    where = value.get("os", "cpu")
    if where not in ("cpu", "gpu"):
        _bad(f"{key}.os", where, "\"cpu\" or \"gpu\"")
    fraction = value.get("os_fraction", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        _bad(f"{key}.os_fraction", fraction, "a number in (0, 1]: the fraction of units whose OS is on the host")
    for state, place in (("g", grads), ("p", params)):
        if where != "cpu" and place == "cpu":
            _bad(f"{key}.{state}", place, "\"cpu\" only with \"os\": \"cpu\" (a unit's gradients and parameters "
                 "go to the host with its optimizer state)")
    return OffloadChoice("fixed", float(fraction), grads, params) if where == "cpu" else OFFLOAD_OFF


def _rule(default, rule: Callable, doc: str, shown: Optional[str] = None):
    """A field of the ``lins`` block: its default, its rule, and what README's key table says of it (``shown``:
    the default as a user reads it, when not the value itself)."""
    return field(default=default, metadata={"rule": rule, "doc": doc, "shown": shown})


@dataclass(frozen=True)
class LinsConfig:
    enabled: bool = _rule(True, _boolean, "`false` hands the config to DeepSpeed untouched")
    plan: object = _rule("solve", _plan, "`\"solve\"`, `\"tune\"` (time the solver's best candidates on the first "
                         "steps, keep the fastest; see `tune`), or fixed factors `{\"p\": [intra, inter], \"g\": [...], \"os\": "
                         "[...]}`; `\"all\"` is the whole dimension (`\"os\": [\"all\", \"all\"]` is ZeRO-1's OS)")
    tune: TuneSpec = _rule(TuneSpec(), _tune, "`\"plan\": \"tune\"`: candidates; steps each "
                           "(`warmup_steps` untimed), more till timed to +-`precision`, `max_steps` at most; cache "
                           "the pick",
                           "`{\"candidates\": 3, \"steps\": 3, \"precision\": 0.03, \"max_steps\": 12, "
                           "\"warmup_steps\": 2, \"cache\": true}`")
    gpus_per_node: Optional[int] = _rule(None, _optional(_positive_int),
                                         "GPUs per (emulated) node; must divide the world size",
                                         "the launcher's local world size")
    gpu_memory_gb: Optional[float] = _rule(None, _optional(_positive_gib), "the per-GPU budget the solver respects (GiB)",
                                           "the device's memory")
    reserved_gb: Optional[float] = _rule(None, _optional(_nonnegative_gib),
                                         "memory outside the allocator (CUDA context, communicators), GiB",
                                         "2 on GPUs, 0 on CPUs")
    activation_checkpointing: object = _rule(None, _optional(_checkpointing),
                                             "layer units recomputed in backward: `null` the solver picks k of N, "
                                             "`true`/`false` all or none, an integer the first k")
    seq_len: Optional[int] = _rule(None, _optional(_positive_int), "the sequence length the solver sizes activations "
                                   "for", "the training batches' (re-planned as they show it)")
    model: Optional[str] = _rule(None, _optional(_string("a model name, a config.json path or null")),
                                 "describes a non-HF model to the solver: a built-in name or a `config.json`",
                                 "the HF model's config")
    memory_profile: Optional[str] = _rule(None, _optional(_memory_profile),
                                          "activation memory: `\"measure\"` (at start-up, cached), `\"formula\"` or "
                                          "a JSON path",
                                          "`\"measure\"` on GPUs, `\"formula\"` on CPUs")
    objective: str = _rule("step", _one_of(OBJECTIVES),
                           "what the solver minimises: `\"step\"` (what a step waits for) or `\"comm\"` (the paper's)")
    profile: str = _rule("measure", _profile, "the solver's timing table: `\"measure\"` (cached, else measured at "
                         "start-up), `\"synthetic\"` (`cluster`) or a JSON path")
    profile_cache: Optional[str] = _rule(None, _optional(_string("a directory path or null")),
                                         "where measured tables are cached", "`~/.cache/lins_ds/profiles`")
    cluster: str = _rule("h200-emulated", _one_of(tuple(sorted(CLUSTERS))),
                         "the built-in cluster `\"profile\": \"synthetic\"` times with")
    grad_reduce_dtype: Optional[str] = _rule(None, _optional(_one_of(DTYPES)),
                                             "dtype of the gradient ReduceScatter / AllReduce", "the parameter dtype")
    unit_modules: Optional[tuple] = _rule(None, _optional(_class_names),
                                          "class names of the modules that become units",
                                          "the children of the largest repeated `nn.ModuleList`")
    overlap_param_sync: bool = _rule(True, _boolean, "the P-sync after the update overlaps the next forward; "
                                     "`false` waits in `step()`")
    sharded_load: Optional[bool] = _rule(None, _optional(_boolean),
                                         "`from_pretrained` under a Lins `TrainingArguments`: sharded (`true`), whole "
                                         "(`false`), `null`: sharded if whole copies do not fit the host")
    init: str = _rule("eager", _one_of(("eager", "per_module")), "values of a model built under `lins_ds.init`: "
                      "the eager build's, or `\"per_module\"` (each module's init, seeded by its name; faster)")
    offload: OffloadChoice = _rule(OFFLOAD_AUTO, _offload,
                           "OS, G and P on the host: `\"auto\"` (the solver decides; never on CPUs), `false`, or "
                           "`{\"os\": \"cpu\", \"os_fraction\": f, \"g\": \"cpu\", \"p\": \"cpu\"}`", "`\"auto\"`")
    tiling: object = _rule("auto", _tiling, "sequence tiling of the MLPs and of the logits + loss: `\"auto\"` (only "
                           "where nothing fits untiled), `false`, or `{\"mlp\": 4, \"logits\": 8}`")
    activation_offload: object = _rule("auto", _activation_offload, "checkpointed layers' inputs on the host: "
                                       "`\"auto\"` (fewest that fit, where nothing fits without), `false`, or a count")
    host_update_in_backward: object = _rule("auto", _auto_or_boolean, "`gradient_clipping: 0`, no fp16: host "
                                            "updates start in the last backward; `false`: after `step()`")
    host_memory_gb: Optional[float] = _rule(None, _optional(_positive_gib),
                                            "host memory offload may pin per node (GiB)", "what is free")
    host_optimizer: str = _rule("auto", _one_of(("auto", "torch", "deepspeed")),
                                "`\"torch\"` (fused CPU AdamW), `\"deepspeed\"` (DeepSpeedCPUAdam) or `\"auto\"` (timed)")
    elementwise_optimizer: bool = _rule(False, _boolean, "declares the optimizer element-wise; else a two-step "
                                        "probe decides")
    checkpoint_pickle: bool = _rule(False, _boolean, "`load_checkpoint` may unpickle any object (runs code: "
                                    "trusted checkpoints only)")
    check_collectives: bool = _rule(False, _boolean, "debug: each step, check all ranks issued the same "
                                    "collectives in order (also `LINS_CHECK_COLLECTIVES=1`)")

    @property
    def solve(self) -> bool:
        """The plan is the solver's (``"tune"`` solves too, then measures its best candidates)."""
        return self.plan in ("solve", "tune")

    @property
    def tuning(self) -> bool:
        return self.plan == "tune"

    def topology(self, world_size: int, local_world_size: int) -> Topology:
        """Nodes x GPUs per node for this launch; raises LinsConfigError on a mismatch."""
        L = self.gpus_per_node or local_world_size
        if world_size % L:
            raise LinsConfigError(f"lins.gpus_per_node: {L} does not divide the world size {world_size}")
        topo = Topology(world_size // L, L)
        if not self.solve:
            check_layout(topo, self.layout(topo))
        return topo

    def layout(self, topo: Topology) -> Layout:
        """The fixed plan with "all" resolved: intra "all" = gpus_per_node, inter "all" = nodes."""
        f = {s: Factor(topo.gpus_per_node if a == "all" else a, topo.nodes if b == "all" else b)
             for s, (a, b) in self.plan.items()}
        return Layout(f["p"], f["g"], f["os"])


AUTO_ALLOWED = ("lins.offload", "lins.offload.g", "lins.offload.p", "lins.host_optimizer", "lins.tiling",
                "lins.host_update_in_backward",
                "lins.activation_offload")


def _find_auto(obj, path="lins"):
    if obj == "auto" and path not in AUTO_ALLOWED:
        raise LinsConfigError(f"{path}: \"auto\" is not accepted inside lins (accelerate would fill it); use null")
    if isinstance(obj, dict):
        for k, v in obj.items():
            _find_auto(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _find_auto(v, f"{path}[{i}]")


def parse_lins_config(block) -> LinsConfig:
    if not isinstance(block, dict):
        raise LinsConfigError(f"lins: {block!r} is not an object")
    _find_auto(block)
    rules = {f.name: f.metadata["rule"] for f in fields(LinsConfig)}
    unknown = sorted(set(block) - set(rules))
    if unknown:
        raise LinsConfigError(f"lins.{unknown[0]}: unknown key (known keys: {', '.join(sorted(rules))})")
    return LinsConfig(**{key: rules[key](key, value) for key, value in block.items()})


def key_table() -> str:
    """README's table of the ``lins`` keys, from the fields' own docs (a test holds README to it)."""
    rows = ["| `lins` key | default | meaning |", "|---|---|---|"]
    for f in fields(LinsConfig):
        shown = f.metadata["shown"] or (f"`{json.dumps(f.default)}`")
        rows.append(f"| `{f.name}` | {shown} | {f.metadata['doc']} |")
    return "\n".join(rows)


def _offload_device(block) -> str:
    return block.get("device", "none") if isinstance(block, dict) else "none"


def translate_zero_offload(ds_config: dict) -> tuple:
    """(config, notes) for a ZeRO-Offload config switched to Lins (a ``lins`` block on): its
    ``zero_optimization.offload_optimizer`` (device "cpu"; ``ratio``, DeepSpeed's partial offload, the fraction)
    becomes ``lins.offload``'s fixed form unless the lins block sets ``offload``, with ``offload_param`` (device
    "cpu") as its ``"p": "auto"`` (the solver may keep parameters on the host where the layout allows); an ``offload_param`` without ``offload_optimizer`` is dropped with a note.
    DeepSpeed gets a copy without either, so that it neither rejects them (a ratio below 1 outside stage 3) nor
    builds its own CPU optimizer."""
    zero = ds_config.get("zero_optimization")
    if not isinstance(zero, dict) or not ({"offload_optimizer", "offload_param"} & set(zero)):
        return ds_config, []
    oo, op = zero.get("offload_optimizer"), zero.get("offload_param")
    new = copy.deepcopy(ds_config)
    for key in ("offload_optimizer", "offload_param"):
        new["zero_optimization"].pop(key, None)
    notes, device = [], _offload_device(oo)
    if device not in ("none", None):
        if device != "cpu":
            raise LinsConfigError(f"zero_optimization.offload_optimizer.device: {device!r} is not supported with "
                                  "lins; Lins offloads optimizer state to \"cpu\" (host memory)")
        ratio = oo.get("ratio", 1.0)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise LinsConfigError(f"zero_optimization.offload_optimizer.ratio: {ratio!r} is not a number in (0, 1]")
        params = _offload_device(op) == "cpu"  # ZeRO-3's offload_param: the same units' P on the host, if it pays
        if isinstance(new.get("lins"), dict) and "offload" not in new["lins"]:
            fixed = {"os": "cpu", "os_fraction": float(ratio), **({"p": "auto"} if params else {})}
            new["lins"] = {**new["lins"], "offload": fixed}
            notes.append(f"zero_optimization.offload_optimizer{' and offload_param' if params else ''} read as "
                         f"\"lins\": {{\"offload\": {json.dumps(fixed)}}} (Lins' host optimizer; DeepSpeed builds none)")
            op = None if params else op
    if _offload_device(op) not in ("none", None):
        notes.append("zero_optimization.offload_param ignored: Lins keeps parameters on the host only with their "
                     "optimizer state (offload_optimizer)")
    return new, notes


def lins_block(ds_config: dict) -> Optional[dict]:
    """The ``lins`` block if Lins should run for this DeepSpeed config, else None."""
    block = ds_config.get("lins") if isinstance(ds_config, dict) else None
    if block is None:
        return None
    if isinstance(block, dict) and block.get("enabled", True) is False:
        return None
    return block
