"""Lins planning layer: pure Python, no torch. profile table -> cost & memory models -> solver -> Plan."""

from .clusters import CLUSTERS, ClusterModel, get_cluster
from .model import BUILTIN_MODELS, ModelSpec, load_model
from .profile_table import ProfileTable
from .solver import ComputeSpec, NoFeasiblePlan, Plan, Solution, solve
from .spec import MemorySpec, TrainingSpec
from .topology import STATES, Factor, Layout, PlanError, Topology, candidates, check_layout

__all__ = [
    "CLUSTERS", "ClusterModel", "get_cluster", "BUILTIN_MODELS", "ModelSpec", "load_model", "ProfileTable",
    "ComputeSpec", "NoFeasiblePlan", "Plan", "Solution", "solve", "MemorySpec", "TrainingSpec", "Factor",
    "Layout", "PlanError", "STATES", "Topology", "candidates", "check_layout",
]
