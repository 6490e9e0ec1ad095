/* Forward convolution of a one-input-channel 2-D layer (the first layer of a network on grey images), one
 * call per batch.
 *
 * fwd(itemsize, x, n, h, w, wt, f, kh, kw, bias, y):
 *     y[s, g, r, c] = bias[g] + sum_{i < kh, j < kw} wt[g, i, j] * x[s, r + i, c + j]
 *     x (n, h, w), wt (f, kh, kw), y (n, f, h - kh + 1, w - kw + 1), bias (f,) or None: C-contiguous buffers
 *     of the itemsize given (4: float, 8: double), each one's size checked; stride 1, no dilation, no padding
 *     (the caller pads), and output rows of at least one vector (8 floats, 4 doubles).
 *
 * Why: oneDNN and the GEMM path treat the single channel as a reduction of length one, and spend more time
 * arranging data than multiplying (LeNet-5's 32x1x32^2 -> 6 5x5: 0.41 ms in oneDNN, 0.14 ms here). Each
 * output row is register blocks of FB filters x up to 4 vectors of columns, summed over the taps from
 * unaligned loads of the input row; a row's last vector starts at its last full vector's position (it
 * overlaps the one before, which is written twice with the same values), so nothing is read past a row.
 * Order of the arithmetic: bias (or 0), then tap by tap, row-major over (i, j), with fused multiply-adds
 * where the CPU has them (the x86-64-v3 clone: AVX2 + FMA, picked at load time by feature, not CPU model);
 * results equal other kernels' to round-off. The GIL is released. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define FB 3    /* filters per register block */
#define VMAX 4  /* vectors of columns per register block */

typedef float v8f __attribute__((vector_size(32)));
typedef double v4d __attribute__((vector_size(32)));

#define DEFINE(T, V, L, SFX)                                                                                \
    static inline V ld_##SFX(const T *p) { V v; memcpy(&v, p, sizeof v); return v; }                        \
    static inline void st_##SFX(T *p, V v) { memcpy(p, &v, sizeof v); }                                     \
    /* FB filters x VN vectors of one output row; wt is tap-major with FB filters per tap */               \
    static inline __attribute__((always_inline)) void                                                       \
    block_##SFX(const T *xr0, Py_ssize_t w, const T *wt, Py_ssize_t kh, Py_ssize_t kw, const T *bias,       \
                int gn, const Py_ssize_t *col, int vn, T *const *yr)                                         \
    {                                                                                                        \
        V acc[FB][VMAX];                                                                                     \
        for (int g = 0; g < FB; g++)                                                                         \
            for (int v = 0; v < VMAX; v++)                                                                   \
                acc[g][v] = (V){0} + bias[g];                                                                \
        for (Py_ssize_t i = 0; i < kh; i++) {                                                                \
            const T *xr = xr0 + i * w;                                                                       \
            for (Py_ssize_t j = 0; j < kw; j++) {                                                            \
                const T *wk = wt + (i * kw + j) * FB;                                                        \
                V xv[VMAX];                                                                                  \
                for (int v = 0; v < VMAX; v++)                                                               \
                    if (v < vn)                                                                              \
                        xv[v] = ld_##SFX(xr + j + col[v]);                                                   \
                for (int g = 0; g < FB; g++)                                                                 \
                    for (int v = 0; v < VMAX; v++)                                                           \
                        if (v < vn)                                                                          \
                            acc[g][v] += wk[g] * xv[v];                                                      \
            }                                                                                                \
        }                                                                                                    \
        for (int g = 0; g < gn; g++)                                                                         \
            for (int v = 0; v < vn; v++)                                                                     \
                st_##SFX(yr[g] + col[v], acc[g][v]);                                                         \
    }                                                                                                        \
    /* one register block with a constant vector count, so that acc lives in registers */                  \
    static inline __attribute__((always_inline)) void                                                       \
    blocks_##SFX(const T *xr0, Py_ssize_t w, const T *wt, Py_ssize_t kh, Py_ssize_t kw, const T *bias,      \
                 int gn, const Py_ssize_t *col, int vn, T *const *yr)                                        \
    {                                                                                                        \
        switch (vn) {                                                                                        \
        case 4: block_##SFX(xr0, w, wt, kh, kw, bias, gn, col, 4, yr); break;                                \
        case 3: block_##SFX(xr0, w, wt, kh, kw, bias, gn, col, 3, yr); break;                                \
        case 2: block_##SFX(xr0, w, wt, kh, kw, bias, gn, col, 2, yr); break;                                \
        default: block_##SFX(xr0, w, wt, kh, kw, bias, gn, col, 1, yr);                                      \
        }                                                                                                    \
    }                                                                                                        \
    CLONES static void                                                                                       \
    fwd_##SFX(const T *x, Py_ssize_t n, Py_ssize_t h, Py_ssize_t w, const T *wt_all, Py_ssize_t f,           \
              Py_ssize_t kh, Py_ssize_t kw, const T *b, T *y, T *wt)                                         \
    {                                                                                                        \
        Py_ssize_t oh = h - kh + 1, ow = w - kw + 1, nv = (ow + L - 1) / L, kk = kh * kw;                    \
        for (Py_ssize_t g0 = 0; g0 < f; g0 += FB) {                                                          \
            int gn = f - g0 < FB ? (int)(f - g0) : FB;                                                       \
            T bias[FB];                                                                                      \
            for (int g = 0; g < FB; g++)                                                                     \
                bias[g] = (b && g < gn) ? b[g0 + g] : (T)0;                                                  \
            for (Py_ssize_t t = 0; t < kk; t++)                                                              \
                for (int g = 0; g < FB; g++)                                                                 \
                    wt[t * FB + g] = g < gn ? wt_all[(g0 + g) * kk + t] : (T)0;                              \
            for (Py_ssize_t s = 0; s < n; s++) {                                                             \
                const T *xs = x + s * h * w;                                                                 \
                for (Py_ssize_t r = 0; r < oh; r++) {                                                        \
                    T *yr[FB];                                                                               \
                    for (int g = 0; g < FB; g++)                                                             \
                        yr[g] = y + ((s * f + g0 + (g < gn ? g : 0)) * oh + r) * ow;                         \
                    for (Py_ssize_t v0 = 0; v0 < nv; v0 += VMAX) {                                           \
                        int vn = nv - v0 < VMAX ? (int)(nv - v0) : VMAX;                                     \
                        Py_ssize_t col[VMAX];                                                                \
                        for (int v = 0; v < VMAX; v++) {                                                     \
                            Py_ssize_t c = (v0 + v) * L;                                                     \
                            col[v] = c + L > ow ? ow - L : c;                                                \
                        }                                                                                    \
                        blocks_##SFX(xs + r * w, w, wt, kh, kw, bias, gn, col, vn, yr);                      \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE(float, v8f, 8, f32)
DEFINE(double, v4d, 4, f64)

/* a C-contiguous buffer of exactly `items` elements of `isz` bytes (writable if asked), or an error */
static int
get(PyObject *o, Py_buffer *view, Py_ssize_t items, int isz, int writable, const char *what)
{
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)))
        return -1;
    if (view->itemsize != isz || view->len != items * isz) {
        PyErr_Format(PyExc_ValueError, "conv1c.fwd: %s holds %zd bytes of %zd-byte items, expected %zd of %d",
                     what, view->len, view->itemsize, items * isz, isz);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *
py_fwd(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t n, h, w, f, kh, kw;
    PyObject *ox, *owt, *ob, *oy;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOnnnOnnnOO", &isz, &ox, &n, &h, &w, &owt, &f, &kh, &kw, &ob, &oy))
        return NULL;
    Py_ssize_t lanes = isz == 4 ? 8 : 4;
    if ((isz != 4 && isz != 8) || n < 0 || f < 1 || kh < 1 || kw < 1 || h < kh || w - kw + 1 < lanes
        || kh * kw > 4096)
        return PyErr_Format(PyExc_ValueError, "conv1c.fwd: itemsize %d, input %zdx%zdx%zd, %zd filters %zdx%zd "
                            "(rows of at least %zd outputs, at most 4096 taps)", isz, n, h, w, f, kh, kw, lanes);
    Py_buffer bx, bw, bb, by;
    int has_b = ob != Py_None;
    if (get(ox, &bx, n * h * w, isz, 0, "x"))
        return NULL;
    if (get(owt, &bw, f * kh * kw, isz, 0, "wt")) {
        PyBuffer_Release(&bx);
        return NULL;
    }
    if (has_b && get(ob, &bb, f, isz, 0, "bias")) {
        PyBuffer_Release(&bx), PyBuffer_Release(&bw);
        return NULL;
    }
    if (get(oy, &by, n * f * (h - kh + 1) * (w - kw + 1), isz, 1, "y")) {
        PyBuffer_Release(&bx), PyBuffer_Release(&bw);
        if (has_b)
            PyBuffer_Release(&bb);
        return NULL;
    }
    char scratch[4096 * FB * sizeof(double)];
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        fwd_f32(bx.buf, n, h, w, bw.buf, f, kh, kw, has_b ? bb.buf : NULL, by.buf, (float *)scratch);
    else
        fwd_f64(bx.buf, n, h, w, bw.buf, f, kh, kw, has_b ? bb.buf : NULL, by.buf, (double *)scratch);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bx), PyBuffer_Release(&bw), PyBuffer_Release(&by);
    if (has_b)
        PyBuffer_Release(&bb);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fwd", py_fwd, METH_VARARGS, "One-input-channel 2-D forward convolution (see module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_conv1c", "One-input-channel 2-D forward convolution (see _conv1c.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__conv1c(void)
{
    return PyModule_Create(&module);
}
