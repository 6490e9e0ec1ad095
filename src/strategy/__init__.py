"""Strategy selection: model graph, cost model, candidates and searches (all pure; no MPI).

>>> from lbannpy import zoo
>>> from lbannpy.strategy import plan
>>> p = plan(zoo.get_spec("mesh_tiny", batch_size=4), ranks=4, machine="p100")   # doctest: +SKIP
>>> p.parallel_layers()["conv1_1"]                                              # doctest: +SKIP
"""
from .graph import ModelGraph, Node, ShapeError, build_graph
from ..machine import DEFAULT_MACHINE, Machine, MachineError, load_machine
from .planner import Plan, PlanError, baseline_strategies, evaluate_strategy, plan

__all__ = ["ModelGraph", "Node", "ShapeError", "build_graph", "DEFAULT_MACHINE", "Machine", "MachineError",
           "load_machine", "Plan", "PlanError", "baseline_strategies", "evaluate_strategy", "plan"]
