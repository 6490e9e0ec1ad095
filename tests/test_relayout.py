"""``lbannpy.packing.relayout``: the compiled tiled copy between layouts gives NumPy's assignment bit for bit
(every fastest-axis pair, item sizes 4 and 8, views with offsets and negative strides, odd extents), and
the cases it does not take (same fastest axis, other item sizes, overlapping or cast copies) fall back."""
import numpy as np
import pytest

from lbannpy import packing


def _channels_last(shape, dtype):
    """An NCHW-shaped channels-last view, inside a larger buffer (the window's interior, as a layer has)."""
    nd = len(shape)
    buf = np.zeros((shape[0],) + tuple(n + 2 for n in shape[2:]) + (shape[1],), dtype)
    view = buf.transpose((0, nd - 1) + tuple(range(1, nd - 1)))
    return view[(slice(None), slice(None)) + (slice(1, -1),) * (nd - 2)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.complex64])
@pytest.mark.parametrize("shape", [(1, 18, 33, 17), (2, 3, 5, 7), (3, 17, 9, 5, 4), (1, 1, 4, 4),
                                   (2, 40, 1, 19), (1, 5, 0, 3)])
def test_both_directions_equal_numpy(shape, dtype):
    rng = np.random.default_rng(0)
    src = (rng.standard_normal(shape) * 100).astype(dtype)
    dst = _channels_last(shape, dtype)
    assert packing.relayout(dst, src) is dst
    np.testing.assert_array_equal(dst, src)
    back = np.empty(shape, dtype)
    packing.relayout(back, dst)
    assert back.tobytes() == src.tobytes()


def test_compiled_copy_takes_transposes_only():
    if packing._crelayout is None:
        pytest.skip("the compiled copy is not built here")
    a = np.arange(24.0).reshape(2, 3, 4)
    same = np.zeros_like(a)
    assert packing._crelayout.copy(same, a) is False  # same fastest axis: left to NumPy, nothing written
    assert not same.any()
    t = np.empty((2, 4, 3)).transpose(0, 2, 1)
    assert packing._crelayout.copy(t, a) is True
    np.testing.assert_array_equal(t, a)
    assert packing._crelayout.copy(np.zeros((3, 2), np.int16).T, np.zeros((2, 3), np.int16)) is False
    with pytest.raises(ValueError, match="differ in shape"):
        packing._crelayout.copy(np.empty((2, 3)), np.empty((3, 2)))


def test_negative_strides_and_fallbacks():
    rng = np.random.default_rng(1)
    src = rng.standard_normal((2, 6, 5, 4))[:, ::-1, :, ::-1]
    dst = _channels_last((2, 6, 5, 4), np.float64)
    packing.relayout(dst, src)
    np.testing.assert_array_equal(dst, src)
    cast = np.empty((2, 6, 5, 4), np.float32)  # a cast: NumPy's assignment
    packing.relayout(cast, src)
    np.testing.assert_array_equal(cast, src.astype(np.float32))
    over = np.arange(16.0).reshape(4, 4)  # overlapping source and destination: NumPy's assignment
    expect = over.T.copy()
    packing.relayout(over, over.T)
    np.testing.assert_array_equal(over, expect)
