"""Checkpoints that scale: each unique block written once, read back by hyperslab on any rank count.

Layout (version 3) of one checkpoint, the directory ``ckpt-<step>/``:

* ``shard-<rank>.h5``, one per writing rank: the blocks that rank writes, each a dataset named by its
  tensor key (``params/<param>``, ``optim/<param>/<slot>``, ``state/<layer>/<name>``) with its ``box`` (the
  block's place in the global tensor) as an attribute. A block is written by exactly one of the ranks
  holding it: replica 0 of the block (:func:`is_writer`), so replicated weights are written once, not P
  times. Like PyTorch Distributed Checkpoint, the reader assembles.
* with parallel HDF5 (h5py built with MPI, ``driver='mpio'``) instead one ``data.h5`` holding every tensor
  in its global shape, each writer writing its hyperslab (also used at one rank, without MPI);
* ``index.h5``, written by rank 0 once every shard is on disk: format, version, step, optimizer steps, the
  small metadata (reader position, metric rows, layer counters) as JSON, and per tensor its global shape
  and the (box, shard) table of its blocks. Rank 0 builds that table from the shard files, and checks that
  the blocks tile each tensor exactly (no block missing, none twice).

Saving moves no tensor data between ranks: a writer writes what it holds (per-rank memory: its own
shard, plus one host copy when it lives on a GPU). Restoring, each rank reads the index and then only the
parts of the shards that intersect its own boxes, so resuming on another rank count or distribution costs
each rank its own shard. :func:`save_plan` and :func:`restore_plan` are that arithmetic as pure functions
of a rank's pieces, usable for any rank of any simulated size.

Atomicity: everything is written into ``ckpt-<step>.tmp/``; after a barrier (every shard flushed and
fsynced) rank 0 writes the index, fsyncs it and renames the directory. A half-written checkpoint therefore
never carries a final name; the newest complete one wins on resume, and one that fails to read (on any
rank) is reported and the previous one tried. Nothing is pickled or evaluated: files hold datasets and
attributes, metadata is JSON, and sizes read from files are checked before anything is allocated.

Integrity (:mod:`.integrity`): every block carries its CRC32, every shard the checkpoint's identity (step,
run id, the id of this write) and its digest; the index holds each block's CRC and each shard's digest and
its own digest over all of it. Every restore (resume, ``--init``, ``export``, ``predict``) checks what it
reads on every rank; a mismatch is damage, treated like a missing shard (the previous checkpoint is tried,
with a note naming the file and block).

Which entries are checkpoints (:func:`candidates`, the one rule every reader, the pruner and the trainer
use): a directory ``ckpt-<digits>`` (eight digits written, any number read) or a regular HDF5 file
``ckpt-<digits>.h5``; never a symbolic link, a ``.tmp`` directory or anything else. Readers take the newest
that verifies, and list the directory again when the one they picked is deleted under them (a live run
pruned it). Pruning (:func:`prune`) deletes only checkpoints of the writing run (its run id) older than the
one it just wrote, and only after reading their indexes and files back: never one it cannot read, one of
another run, or what is not a checkpoint. Nothing of another run is deleted: what stands in a checkpoint's
name, or a fresh run's way, is moved aside (:func:`set_aside`).

Version 2 checkpoints (the same layout without checksums) and version 1 (one file ``ckpt-<step>.h5`` of
global tensors) are still read, unverified.
"""
from .plan import (FORMAT, VERSION, CheckpointError, Piece, SavePlan, StateReader, StateTensor, assemble,
                   blocks_meeting, is_writer, param_pieces, rank_pieces, restore_plan, save_plan)
from .read import (Checkpoint, CheckpointRefused, candidates, load, load_newest, newest_first, newest_sound,
                   resolve, restore_newest, restore_weights, resume, step_of)
from .integrity import crc32
from .write import parallel_hdf5, prune, save, set_aside, verified_identity

__all__ = ["FORMAT", "VERSION", "CheckpointError", "CheckpointRefused", "Checkpoint", "Piece", "SavePlan",
           "StateReader", "StateTensor", "assemble", "blocks_meeting", "candidates", "crc32", "is_writer",
           "load", "load_newest", "newest_first", "newest_sound", "param_pieces", "parallel_hdf5", "prune",
           "rank_pieces", "resolve", "restore_newest", "restore_plan", "restore_weights", "resume", "save",
           "save_plan", "set_aside", "step_of", "verified_identity"]
