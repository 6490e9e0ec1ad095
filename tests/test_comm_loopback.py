"""The loopback communicator: one process plays one rank, every operation completes at once, and a layer
run on it takes its real distributed code path (what the cost model's stand-ins time)."""
from __future__ import annotations

import numpy as np
import pytest

from lbannpy.bench import costmodel as cm
from lbannpy.comm import CommError, LoopbackCommunicator
from lbannpy.dist import Distribution
from lbannpy.layers.context import LayerContext
from lbannpy.strategy import build_graph


def test_identity_groups_and_refusals():
    c = LoopbackCommunicator(4, 2)
    assert (c.rank, c.size) == (2, 4)
    g = c.group([3, 2, 0])  # ranked by world rank, as split(colour, key=rank) ranks them
    assert (g.rank, g.size) == (1, 3)
    with pytest.raises(CommError, match="not in the group"):
        c.group([0, 1])
    with pytest.raises(CommError, match="split cannot know"):
        c.split(0, 2)
    with pytest.raises(CommError, match="outside a group"):
        LoopbackCommunicator(2, 2)
    with pytest.raises(CommError, match="does not exist"):
        c.isend(np.zeros(3), 4)
    with pytest.raises(CommError, match="loopback rank 2 of 4: alltoallv.*3 counts given for 4 ranks"):
        c.ialltoallv(np.zeros(4), [1, 1, 2], [1, 1, 2])


def test_results_have_the_real_shapes_and_hold_this_ranks_part():
    c = LoopbackCommunicator(3, 1)
    x = np.arange(4, dtype=np.float32)
    out = np.full(4, 7, np.float32)
    assert c.iallreduce(x, out=out).wait() is out and np.array_equal(out, x)
    g = c.iallgather(x).wait()
    assert g.shape == (3, 4) and np.array_equal(g[1], x) and not g[0].any() and not g[2].any()
    v = c.iallgatherv(x[:2], [1, 2, 3]).wait()
    assert v.shape == (6,) and np.array_equal(v[1:3], x[:2]) and not v[0] and not v[3:].any()
    rs = c.ireduce_scatter(np.arange(6, dtype=np.float32), [1, 2, 3]).wait()
    assert np.array_equal(rs, [1, 2])
    a = c.ialltoallv(np.arange(6, dtype=np.float32), [1, 2, 3], [2, 2, 1]).wait()
    assert a.shape == (5,) and np.array_equal(a[2:4], [1, 2]) and not a[:2].any() and not a[4:].any()
    buf = np.ones(5, np.float32)
    assert c.irecv(buf, 0).wait() is buf and not buf.any()
    assert c.isend(x, 2).wait() is None
    assert c.allgather_obj("a") == ["a", "a", "a"] and c.bcast_obj(5, root=2) == 5


def test_a_layer_context_builds_its_groups_without_a_collective():
    ctx = LayerContext(LoopbackCommunicator(4, 3))
    d = Distribution.make(4, 4, n=2, h=2)
    g = ctx.grid_comm(d, ["h"])
    assert (g.size, g.rank) == (2, 1)
    assert ctx.grid_comm(d, ["h"]) is g  # cached, as on a real world


@pytest.mark.parametrize("stride", [1, 2])
def test_a_spatially_split_conv_on_loopback_takes_the_halo_path(stride):
    """Rank r of an h-split conv on loopback: its halo arrives as zeros, so its output block is exactly that
    of the whole-tensor conv of an input whose other ranks' rows are zero; the interior and boundary are
    computed apart (the timer sees the halo wait of the split path)."""
    spec = {"input": {"channels": 3, "spatial": [12, 8]},
            "layers": [{"name": "c", "type": "conv", "filters": 4, "kernel": 3, "padding": 1,
                        "stride": stride}]}
    node = next(iter(build_graph(spec, 2)))
    whole = cm.StandIn(node, Distribution.make(4, 1), 0)
    for rank in range(2):
        d = Distribution.make(4, 2, h=2)
        si = cm.StandIn(node, d, rank)
        assert si.matches
        si.layer.w.value[...] = whole.layer.w.value
        if si.layer.b is not None:
            si.layer.b.value[...] = whole.layer.b.value
        rows = d.box(node.in_shape, rank)[2]
        x = np.zeros(node.in_shape, np.float32)
        x[:, :, rows[0]:rows[1]] = si.xs[0].local
        whole.xs[0].local[...] = x
        y = si.layer.forward(si.xs).local
        ref = whole.layer.forward(whole.xs).local
        orow = d.box(node.out_shape, rank)[2]
        np.testing.assert_allclose(y, ref[:, :, orow[0]:orow[1]], rtol=1e-5, atol=1e-5)
        assert ("c", "halo_wait") in si.ctx.timer.totals


def test_block_ranks_one_per_block_and_capped():
    assert cm.block_ranks(Distribution.make(4, 4, n=2)) == [0, 1]  # two replicas of two blocks
    assert cm.block_ranks(Distribution.make(4, 4, h=4)) == [0, 1, 2, 3]
    capped = cm.block_ranks(Distribution.make(4, 16, h=16), limit=4)
    assert capped[0] == 0 and capped[-1] == 15 and len(capped) == 4
