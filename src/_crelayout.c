/* A copy between two host arrays of the same shape whose fastest-varying axes differ (NCHW <-> channels-last,
 * of lbannpy.packing.relayout), in cache-sized tiles.
 *
 * Why: NumPy's strided assignment between the two layouts walks the destination in order and the source
 * across its rows, one cache line per element, several times slower than the memory allows; a convolution
 * that runs channels-last on the host (oneDNN's faster layout for some channel counts) pays such a copy on
 * its window, its output, its output gradient and its input gradient. Here the two fast axes are copied in
 * 16 x 16 tiles, so each cache line of either side is touched once per tile. A copy moves bits: the result
 * is what NumPy's assignment gives, for any element type of 4 or 8 bytes.
 *
 *   copy(dst, src) -> bool   both arrays of the same shape (at most 8 dimensions) and item size; False
 *                            (nothing written) where the two have the same fastest axis or an item size
 *                            other than 4 or 8, for the caller's plain assignment
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAXD 8
#ifndef TILE_IN
#define TILE_IN 16
#endif

#define TILED(T)                                                                                           \
    static void tiled_##T(char *dst, const char *src, const Py_ssize_t *n, const Py_ssize_t *ds,          \
                          const Py_ssize_t *ss, int nd, int a, int b)                                      \
    {                                                                                                      \
        /* the inner loop runs along the axis contiguous on the side whose other stride is the larger */  \
        int inner_b = (ss[a] < 0 ? -ss[a] : ss[a]) >= (ds[b] < 0 ? -ds[b] : ds[b]);                        \
        int o = inner_b ? a : b, in = inner_b ? b : a;                                                     \
        Py_ssize_t idx[MAXD] = {0}, no = n[o], ni = n[in];                                                 \
        Py_ssize_t dso = ds[o], dsi = ds[in], sso = ss[o], ssi = ss[in];                                   \
        for (;;) {                                                                                         \
            T *d0 = (T *)dst;                                                                              \
            const T *s0 = (const T *)src;                                                                  \
            for (int k = 0; k < nd; k++) d0 += idx[k] * ds[k], s0 += idx[k] * ss[k];                       \
            for (Py_ssize_t i0 = 0; i0 < ni; i0 += TILE_IN) {                                              \
                Py_ssize_t i1 = i0 + TILE_IN < ni ? i0 + TILE_IN : ni;                                     \
                for (Py_ssize_t p = 0; p < no; p++) {                                                      \
                    T *d = d0 + p * dso;                                                                   \
                    const T *s = s0 + p * sso;                                                             \
                    for (Py_ssize_t i = i0; i < i1; i++) d[i * dsi] = s[i * ssi];                          \
                }                                                                                          \
            }                                                                                              \
            int k = nd - 1;                                                                                \
            for (; k >= 0; k--) {                                                                          \
                if (k == a || k == b) continue;                                                            \
                if (++idx[k] < n[k]) break;                                                                \
                idx[k] = 0;                                                                                \
            }                                                                                              \
            if (k < 0) return;                                                                             \
        }                                                                                                  \
    }

TILED(uint32_t)
TILED(uint64_t)

/* the axis of the smallest nonzero stride magnitude among those of more than one element (-1: none) */
static int
fastest(const Py_buffer *v)
{
    int best = -1;
    Py_ssize_t bs = 0;
    for (int k = 0; k < v->ndim; k++) {
        Py_ssize_t s = v->strides[k] < 0 ? -v->strides[k] : v->strides[k];
        if (v->shape[k] > 1 && s > 0 && (best < 0 || s < bs)) best = k, bs = s;
    }
    return best;
}

static PyObject *
py_copy(PyObject *self, PyObject *args)
{
    PyObject *od, *os;
    if (!PyArg_ParseTuple(args, "OO", &od, &os)) return NULL;
    Py_buffer d, s;
    if (PyObject_GetBuffer(od, &d, PyBUF_RECORDS) < 0) return NULL;
    if (PyObject_GetBuffer(os, &s, PyBUF_RECORDS_RO) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    PyObject *res = Py_False;
    int nd = d.ndim, a = fastest(&d), b = fastest(&s);
    int same = nd == s.ndim && d.itemsize == s.itemsize && nd <= MAXD && nd >= 2;
    for (int k = 0; same && k < nd; k++) same = d.shape[k] == s.shape[k];
    for (int k = 0; same && k < nd; k++)
        same = d.strides[k] % d.itemsize == 0 && s.strides[k] % s.itemsize == 0;
    if (!same) {
        PyBuffer_Release(&d);
        PyBuffer_Release(&s);
        PyErr_SetString(PyExc_ValueError, "relayout: the arrays differ in shape or item size, or have "
                                          "more than 8 dimensions");
        return NULL;
    }
    Py_ssize_t count = 1;
    for (int k = 0; k < nd; k++) count *= d.shape[k];
    if (count == 0) res = Py_True;  /* nothing to copy */
    else if (a >= 0 && b >= 0 && a != b && (d.itemsize == 4 || d.itemsize == 8)) {
        Py_ssize_t ds[MAXD], ss[MAXD];
        for (int k = 0; k < nd; k++) ds[k] = d.strides[k] / d.itemsize, ss[k] = s.strides[k] / s.itemsize;
        Py_BEGIN_ALLOW_THREADS
        if (d.itemsize == 4)
            tiled_uint32_t(d.buf, s.buf, d.shape, ds, ss, nd, a, b);
        else
            tiled_uint64_t(d.buf, s.buf, d.shape, ds, ss, nd, a, b);
        Py_END_ALLOW_THREADS
        res = Py_True;
    }
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    Py_INCREF(res);
    return res;
}

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS, "copy src into dst (same shape, other fastest axis) in tiles"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_crelayout", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__crelayout(void)
{
    return PyModule_Create(&module);
}
