"""The ``"lins"`` block of a DeepSpeed config, parsed once into typed objects (no torch here).

DeepSpeed ignores unknown top-level keys, so this block is validated here, strictly: every error
names the key, the value and the rule, and is raised on every rank before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..plan import Factor, Layout, PlanError, Topology, check_layout
from ..plan.clusters import CLUSTERS

DTYPES = ("fp32", "bf16", "fp16")


class LinsConfigError(PlanError):
    """A bad ``lins`` block: raised on every rank before any process group exists."""


@dataclass(frozen=True)
class LinsConfig:
    enabled: bool = True
    gpus_per_node: Optional[int] = None
    plan: object = "solve"  # "solve", or {"p": (intra, inter), ...} with ints or "all"
    activation_checkpointing: Optional[bool] = None
    gpu_memory_gb: Optional[float] = None
    reserved_gb: Optional[float] = None  # None: 2 GiB on GPUs (CUDA context, communicators), 0 on CPU
    seq_len: Optional[int] = None
    model: Optional[str] = None
    cluster: str = "h200-emulated"
    profile: str = "measure"  # "measure" (cached or quick-measured), "synthetic" (lins.cluster), or a JSON path
    profile_cache: Optional[str] = None  # directory of cached measured profiles
    grad_reduce_dtype: Optional[str] = None
    unit_modules: Optional[tuple] = None
    overlap_param_sync: bool = True  # the paper switches this off for its comparisons
    objective: str = "comm"  # the solver's: "comm" (paper) or "step" (also the optimizer update)

    @property
    def solve(self) -> bool:
        return self.plan == "solve"

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


def _check_type(key: str, value, types, what: str, nullable: bool = True):
    if value is None and nullable:
        return
    if isinstance(value, bool) and bool not in types:
        raise LinsConfigError(f"lins.{key}: {value!r} is not {what}")
    if not isinstance(value, types):
        raise LinsConfigError(f"lins.{key}: {value!r} is not {what}")


def _parse_plan(value) -> object:
    if value == "solve":
        return value
    if not isinstance(value, dict):
        raise LinsConfigError(f"lins.plan: {value!r} is neither \"solve\" nor "
                              "{\"p\": [intra, inter], \"g\": [...], \"os\": [...]}")
    extra = set(value) - {"p", "g", "os"}
    missing = {"p", "g", "os"} - set(value)
    if extra or missing:
        raise LinsConfigError(f"lins.plan: keys must be exactly p, g, os (unknown: {sorted(extra)}, "
                              f"missing: {sorted(missing)})")
    factors = {}
    for s in ("p", "g", "os"):
        f = value[s]
        ok = lambda x: x == "all" or (isinstance(x, int) and not isinstance(x, bool) and x >= 1)  # noqa: E731
        if not isinstance(f, (list, tuple)) or len(f) != 2 or not all(ok(x) for x in f):
            raise LinsConfigError(f"lins.plan.{s}: {f!r} is not [intra, inter], each a positive integer or \"all\"")
        factors[s] = tuple(f)
    return factors


def _find_auto(obj, path="lins"):
    if obj == "auto":
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
    known = set(LinsConfig.__dataclass_fields__)
    unknown = sorted(set(block) - known)
    if unknown:
        raise LinsConfigError(f"lins.{unknown[0]}: unknown key (known keys: {', '.join(sorted(known))})")
    b = dict(block)
    _check_type("enabled", b.get("enabled", True), (bool,), "true or false", nullable=False)
    _check_type("gpus_per_node", b.get("gpus_per_node"), (int,), "a positive integer or null")
    if b.get("gpus_per_node") is not None and b["gpus_per_node"] < 1:
        raise LinsConfigError(f"lins.gpus_per_node: {b['gpus_per_node']} is not a positive integer")
    _check_type("activation_checkpointing", b.get("activation_checkpointing"), (bool,), "true, false or null")
    _check_type("gpu_memory_gb", b.get("gpu_memory_gb"), (int, float), "a positive number of GiB or null")
    if b.get("gpu_memory_gb") is not None and not b["gpu_memory_gb"] > 0:
        raise LinsConfigError(f"lins.gpu_memory_gb: {b['gpu_memory_gb']} must be positive")
    _check_type("reserved_gb", b.get("reserved_gb"), (int, float), "a number of GiB >= 0 or null")
    if b.get("reserved_gb") is not None and b["reserved_gb"] < 0:
        raise LinsConfigError(f"lins.reserved_gb: {b['reserved_gb']} must be >= 0")
    _check_type("seq_len", b.get("seq_len"), (int,), "a positive integer or null")
    if b.get("seq_len") is not None and b["seq_len"] < 1:
        raise LinsConfigError(f"lins.seq_len: {b['seq_len']} must be positive")
    _check_type("model", b.get("model"), (str,), "a model name, a config.json path or null")
    cluster = b.get("cluster", "h200-emulated")
    if cluster not in CLUSTERS:
        raise LinsConfigError(f"lins.cluster: {cluster!r} is not a built-in cluster ({', '.join(sorted(CLUSTERS))})")
    profile = b.get("profile", "measure")
    _check_type("profile", profile, (str,), "\"measure\", \"synthetic\" or a profile JSON path", nullable=False)
    if profile not in ("measure", "synthetic") and not profile.endswith(".json"):
        raise LinsConfigError(f"lins.profile: {profile!r} is not \"measure\", \"synthetic\" or a .json path")
    _check_type("profile_cache", b.get("profile_cache"), (str,), "a directory path or null")
    if b.get("grad_reduce_dtype") not in (None,) + DTYPES:
        raise LinsConfigError(f"lins.grad_reduce_dtype: {b['grad_reduce_dtype']!r} is not one of {DTYPES} or null")
    _check_type("overlap_param_sync", b.get("overlap_param_sync", True), (bool,), "true or false", nullable=False)
    if b.get("objective", "comm") not in ("comm", "step"):
        raise LinsConfigError(f"lins.objective: {b['objective']!r} is not \"comm\" or \"step\"")
    units = b.get("unit_modules")
    if units is not None and (not isinstance(units, list) or not units or not all(isinstance(u, str) for u in units)):
        raise LinsConfigError(f"lins.unit_modules: {units!r} is not a non-empty list of module class names")
    return LinsConfig(
        enabled=b.get("enabled", True), gpus_per_node=b.get("gpus_per_node"), plan=_parse_plan(b.get("plan", "solve")),
        activation_checkpointing=b.get("activation_checkpointing"),
        gpu_memory_gb=None if b.get("gpu_memory_gb") is None else float(b["gpu_memory_gb"]),
        reserved_gb=None if b.get("reserved_gb") is None else float(b["reserved_gb"]),
        seq_len=b.get("seq_len"), model=b.get("model"), cluster=cluster,
        profile=profile, profile_cache=b.get("profile_cache"),
        grad_reduce_dtype=b.get("grad_reduce_dtype"), unit_modules=None if units is None else tuple(units),
        overlap_param_sync=b.get("overlap_param_sync", True), objective=b.get("objective", "comm"),
    )


def lins_block(ds_config: dict) -> Optional[dict]:
    """The ``lins`` block if Lins should run for this DeepSpeed config, else None."""
    block = ds_config.get("lins") if isinstance(ds_config, dict) else None
    if block is None:
        return None
    if isinstance(block, dict) and block.get("enabled", True) is False:
        return None
    return block
