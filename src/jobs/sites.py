"""Cluster facts that job scripts depend on, one frozen record per site.

A site says what a node has (GPUs), where jobs go by default (partition), how srun starts MPI ranks
(the ``--mpi`` plugin, set once for the job through ``SLURM_MPI_TYPE`` so that no srun line repeats it) and
which lines prepare the environment (modules, conda). Job parameters that vary per run (nodes, tasks, time)
live in :class:`lbannpy.jobs.render.JobSpec`; its defaults come from here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Site:
    name: str
    description: str
    gpus_per_node: int          # GPUs on one node; 0 = CPU-only site
    partition: str | None       # default partition; None = the cluster's default partition
    mpi: str                    # srun --mpi plugin: pmi2 (MPICH from PyPI/conda) or pmix (Open MPI,
    #                             vendor MPI)
    tasks_per_node: int         # default ranks per node: one per GPU on GPU sites
    cpus_per_task: int          # default cores per rank (OMP/BLAS threads, data loading)
    time: str                   # default wall-clock limit, HH:MM:SS
    env_setup: tuple[str, ...] = ()   # shell lines run before anything else in the job


SITES: dict[str, Site] = {
    site.name: site
    for site in (
        Site(
            name="local",
            description="the one-node SLURM from jobs/local-cluster/start: CPU only, PyPI MPICH under pmi2",
            gpus_per_node=0,
            partition=None,
            mpi="pmi2",
            tasks_per_node=2,
            cpus_per_task=1,
            time="00:30:00",
            # one node: UCX's shared-memory transports only (its network addresses have failed to unpack
            # in MPI_Init under srun's PMI2 now and then; one node needs none of them)
            env_setup=('export UCX_TLS="${UCX_TLS:-self,sm}"',),
        ),
        Site(
            name="gpu-cluster",
            description="generic SLURM GPU cluster: 4 GPUs per node, conda env from environment.yml",
            gpus_per_node=4,
            partition="gpu",
            mpi="pmix",
            tasks_per_node=4,
            cpus_per_task=8,
            time="01:00:00",
            env_setup=(
                "module load gcc cuda",
                "eval \"$(conda shell.bash hook)\"",
                "conda activate lbannpy",
                "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
            ),
        ),
        Site(
            name="h100-cluster",
            description="SLURM cluster of 8x H100 nodes (NVLink within a node, InfiniBand between nodes)",
            gpus_per_node=8,
            partition="h100",
            mpi="pmix",
            tasks_per_node=8,
            cpus_per_task=12,
            time="01:00:00",
            env_setup=(
                "module load gcc cuda",
                "eval \"$(conda shell.bash hook)\"",
                "conda activate lbannpy",
                "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}",
                "export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}",
            ),
        ),
    )
}
