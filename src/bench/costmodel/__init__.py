"""``python -m lbannpy.bench costmodel``: the strategy cost model against measured training steps.

For a few small models and strategies at 1, 2 and 4 ranks, the step time that
:func:`lbannpy.strategy.evaluate_strategy` predicts for a machine file (by default one that ``python -m
lbannpy.bench calibrate`` writes first, i.e. this machine) is printed next to the median step time of real
training runs (``mpiexec -n P python -m lbannpy.train CONFIG.h5``, ``summary.json``), with the relative
error and, per model and rank count, whether the predicted order of the strategies is the measured one.

The model's per-layer compute t_C comes, as in Jia et al. (2018) §4, from running each layer under each
distribution the strategies give it several times on this machine: :func:`measure_compute_table` runs the
real layer classes as each block-holding rank of that distribution on a loopback communicator (the rank's
own code path: halo packing, interior and boundary apart, with every message completing at once), forward
in layer order and backward in reverse as a step runs them, and keeps the slowest rank's time; the rows go
into the machine model's measured table (``compute.measured`` of a machine file). For P ranks the table is
then scaled by what running P ranks at once on this node costs (P processes run their ranks' stand-ins
together, as ``mpiexec -n P`` does: shared caches and memory bandwidth, and where ranks outnumber the cores,
their time slices), so that its rows are times of a rank among P on the node. Communication is the
calibrated α-β model; ranks that outnumber the cores of a node share them, and their shared-memory copies
are time-sliced too (:meth:`lbannpy.machine.Machine.compute_slowdown`). The ``roofline`` column is the same
prediction from the calibrated γ alone, without the table.

The model adds communication to compute (Jia et al. eq. 1), so the training runs reduce gradients without
the background overlap thread (``--overlap`` turns it on). Every rank runs single-threaded (OMP/OpenBLAS/MKL
threads 1), so that one rank is one core's work. The step time the model leaves out: reading the input,
the loss, the trainer's own bookkeeping.
"""
from .builders import (OPTIMIZER, STRATEGIES, BenchModel, classifier, default_models, hybrid_strategy,
                       parallel_layers, residual, segmenter, spatial_strategy, strategy_dists)
from .corun import corun_calls, shared_node_factor
from .harness import (Calls, StandIn, TableRow, block_ranks, build_chains, chains_plan, local_shapes,
                      run_chains, table_key)
from .report import TOLERANCE, Case, build_parser, format_table, main, parse_args, ranking, run_benchmark
from .runs import THREAD_VARS, OtherLoad, Quiet, measure_step, prepare, thread_env
from .table import measure_compute_table, time_input_read, with_table

__all__ = ["OPTIMIZER", "STRATEGIES", "BenchModel", "classifier", "default_models", "hybrid_strategy",
           "parallel_layers", "residual", "segmenter", "spatial_strategy", "strategy_dists", "corun_calls",
           "shared_node_factor", "Calls", "StandIn", "TableRow", "block_ranks", "build_chains", "chains_plan",
           "local_shapes", "run_chains", "table_key", "TOLERANCE", "Case", "format_table", "main",
           "parse_args", "ranking", "run_benchmark", "THREAD_VARS", "OtherLoad", "Quiet", "measure_step",
           "prepare", "thread_env", "measure_compute_table", "time_input_read", "with_table", "build_parser"]
