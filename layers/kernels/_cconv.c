/* Compiled direct-convolution kernels behind lbannpy.layers.kernels.conv (float32 and float64), and the
 * max-pooling kernels behind lbannpy.layers.kernels.pool (further down).
 *
 * conv_fwd(itemsize, x, xend, off, ntap, rsx, cs, wp, F, y, fsy, rsy, rows, cols, bias):
 *     y[k*fsy + h*rsy + w] = bias[k] + sum_t wp[t*F + k] * x[off[t] + h*rsx + cs*w]
 * conv_wgrad(itemsize, x, xend, off, ntap, rsx, cs, dy, F, fsdy, rsdy, rows, cols, dw):
 *     dw[k*ntap + t] += sum_{h, w} dy[k*fsdy + h*rsdy + w] * x[off[t] + h*rsx + cs*w]
 * for 0 <= h < rows, 0 <= w < cols, 0 <= k < F, column stride cs = 1 or 2, nothing read at or past xend;
 * conv_pair(itemsize, x, off0, ntap0, off1, ntap1, rsx, wp0, wp1, F, y, fsy, rsy, rows, cols):
 *     y[k*fsy + h*rsy + 2r + b] = sum_t wp_b[t*F + k] * x[off_b[t] + h*rsx + r]  for 0 <= 2r + b < cols
 *     (the two column phases of a stride-2 data gradient, written interleaved);
 * phase_rows(itemsize, win, n1, n2, r1, r2, ncols, s, ph, p1, p2, dp, merge):
 *     rows of a window split into (merge=0) or merged from (merge=1) their s column phases;
 * arrays are passed as addresses (integers), offsets and strides in elements, off as int64. Each tap t is a
 * plain shifted read of the input, so the caller expresses kernel size, channels, dilation and stride
 * through off, rsx and cs (larger column strides read a copy split into stride phases, made with
 * phase_rows). The GIL is released.
 *
 * Vectors are GCC vector extensions of 64 bytes; on x86-64 the entry points are compiled for AVX-512,
 * AVX2+FMA and the baseline, picked at load time (target_clones). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define CLONES
#endif

#define MAX_FB 12          /* forward: filters per register block (x 2 vectors of outputs) */
#define WG_FB 4            /* filter gradient: filters x taps per register block */
#define WG_TB 6
#define WG_TILE_PIXELS 512 /* filter gradient: outputs per cache tile */

typedef int32_t v16i __attribute__((vector_size(64)));
typedef int64_t v8i __attribute__((vector_size(64)));
static const v16i EVEN_f32 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const v8i EVEN_f64 = {0, 2, 4, 6, 8, 10, 12, 14};
static const v16i ZIP_LO_f32 = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
static const v16i ZIP_HI_f32 = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
static const v8i ZIP_LO_f64 = {0, 8, 1, 9, 2, 10, 3, 11};
static const v8i ZIP_HI_f64 = {4, 12, 5, 13, 6, 14, 7, 15};

typedef float v16f __attribute__((vector_size(64)));
typedef float v16fu __attribute__((vector_size(64), aligned(4), may_alias));
typedef double v8d __attribute__((vector_size(64)));
typedef double v8du __attribute__((vector_size(64), aligned(8), may_alias));

#define T float
#define V v16f
#define VU v16fu
#define NAME(x) x##_f32
#include "_cconv_impl.h"
#undef T
#undef V
#undef VU
#undef NAME

#define T double
#define V v8d
#define VU v8du
#define NAME(x) x##_f64
#include "_cconv_impl.h"
#undef T
#undef V
#undef VU
#undef NAME

static PyObject *
py_conv_fwd(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t x, xend, off, ntap, rsx, cs, wp, F, y, fsy, rsy, rows, cols, bias;
    if (!PyArg_ParseTuple(args, "innnnnnnnnnnnnn", &isz, &x, &xend, &off, &ntap, &rsx, &cs, &wp, &F, &y,
                          &fsy, &rsy, &rows, &cols, &bias))
        return NULL;
    if ((isz != 4 && isz != 8) || (cs != 1 && cs != 2))
        return PyErr_Format(PyExc_ValueError, "conv_fwd: itemsize %d, column stride %zd", isz, cs);
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        conv_fwd_f32((const float *)x, (const float *)xend, (const int64_t *)off, ntap, rsx, cs,
                     (const float *)wp, F, (float *)y, fsy, rsy, rows, cols, (const float *)bias);
    else
        conv_fwd_f64((const double *)x, (const double *)xend, (const int64_t *)off, ntap, rsx, cs,
                     (const double *)wp, F, (double *)y, fsy, rsy, rows, cols, (const double *)bias);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
py_conv_wgrad(PyObject *self, PyObject *args)
{
    int isz, rc;
    Py_ssize_t x, xend, off, ntap, rsx, cs, dy, F, fsdy, rsdy, rows, cols, dw;
    if (!PyArg_ParseTuple(args, "innnnnnnnnnnnn", &isz, &x, &xend, &off, &ntap, &rsx, &cs, &dy, &F, &fsdy,
                          &rsdy, &rows, &cols, &dw))
        return NULL;
    if ((isz != 4 && isz != 8) || (cs != 1 && cs != 2))
        return PyErr_Format(PyExc_ValueError, "conv_wgrad: itemsize %d, column stride %zd", isz, cs);
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        rc = conv_wgrad_f32((const float *)x, (const float *)xend, (const int64_t *)off, ntap, rsx, cs,
                            (const float *)dy, F, fsdy, rsdy, rows, cols, (float *)dw);
    else
        rc = conv_wgrad_f64((const double *)x, (const double *)xend, (const int64_t *)off, ntap, rsx, cs,
                            (const double *)dy, F, fsdy, rsdy, rows, cols, (double *)dw);
    Py_END_ALLOW_THREADS
    if (rc)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *
py_conv_pair(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t x, off0, ntap0, off1, ntap1, rsx, wp0, wp1, F, y, fsy, rsy, rows, cols;
    if (!PyArg_ParseTuple(args, "innnnnnnnnnnnnn", &isz, &x, &off0, &ntap0, &off1, &ntap1, &rsx, &wp0, &wp1,
                          &F, &y, &fsy, &rsy, &rows, &cols))
        return NULL;
    if (isz != 4 && isz != 8)
        return PyErr_Format(PyExc_ValueError, "conv_pair: itemsize %d (need 4 or 8)", isz);
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        conv_pair_f32((const float *)x, (const int64_t *)off0, ntap0, (const int64_t *)off1, ntap1, rsx,
                      (const float *)wp0, (const float *)wp1, F, (float *)y, fsy, rsy, rows, cols);
    else
        conv_pair_f64((const double *)x, (const int64_t *)off0, ntap0, (const int64_t *)off1, ntap1, rsx,
                      (const double *)wp0, (const double *)wp1, F, (double *)y, fsy, rsy, rows, cols);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
py_phase_rows(PyObject *self, PyObject *args)
{
    int isz, merge;
    Py_ssize_t win, n1, n2, r1, r2, ncols, s, ph, p1, p2, dp;
    if (!PyArg_ParseTuple(args, "innnnnnnnnnni", &isz, &win, &n1, &n2, &r1, &r2, &ncols, &s, &ph, &p1, &p2,
                          &dp, &merge))
        return NULL;
    if ((isz != 4 && isz != 8) || s < 1)
        return PyErr_Format(PyExc_ValueError, "phase_rows: itemsize %d, stride %zd", isz, s);
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        phase_rows_f32((float *)win, n1, n2, r1, r2, ncols, s, (float *)ph, p1, p2, dp, merge);
    else
        phase_rows_f64((double *)win, n1, n2, r1, r2, ncols, s, (double *)ph, p1, p2, dp, merge);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Max pooling, over planes of 3 spatial dimensions (2-D pooling passes a leading extent of 1):
 * maxpool_fwd(itemsize, x, planes, xsp, xs0, xs1, xs2, o0, o1, o2, k0, k1, k2, t0, t1, t2, d0, d1, d2,
 *             y, arg, argsize):
 *     for each plane p and output (i, j, l): y = max over taps (a, b, c) of
 *     x[p*xsp + (i*t0 + a*d0)*xs0 + (j*t1 + b*d1)*xs1 + (l*t2 + c*d2)*xs2], written C-contiguously with
 *     the row-major tap index of the winner into arg (int8 or int16, argsize bytes); ties go to the first
 *     tap, a NaN wins (the first NaN), as PyTorch's CPU kernel does;
 * maxpool_bwd(itemsize, dy, arg, argsize, planes, o0, o1, o2, k0, k1, k2, t0, t1, t2, d0, d1, d2, dx,
 *             dxsp, dxs0, dxs1, dxs2):
 *     dx[winner of each output] += dy (dx zeroed by the caller; overlapping windows accumulate). */
#define POOL_ROW 512 /* outputs of a row kept in registers/L1 at a time */
#define MAXPOOL_FWD(NAME, T)                                                                                   \
    static void NAME(const T *x, Py_ssize_t planes, Py_ssize_t xsp, Py_ssize_t xs0, Py_ssize_t xs1,            \
                     Py_ssize_t xs2, Py_ssize_t o0, Py_ssize_t o1, Py_ssize_t o2, Py_ssize_t k0,               \
                     Py_ssize_t k1, Py_ssize_t k2, Py_ssize_t t0, Py_ssize_t t1, Py_ssize_t t2, Py_ssize_t d0,  \
                     Py_ssize_t d1, Py_ssize_t d2, T *y, void *arg, int asz)                                  \
    {                                                                                                          \
        T best[POOL_ROW];                                                                                      \
        int32_t win[POOL_ROW];                                                                                 \
        Py_ssize_t n = 0;                                                                                      \
        for (Py_ssize_t p = 0; p < planes; p++)                                                                \
            for (Py_ssize_t i = 0; i < o0; i++)                                                                \
                for (Py_ssize_t j = 0; j < o1; j++)                                                            \
                    for (Py_ssize_t l0 = 0; l0 < o2; l0 += POOL_ROW) {                                         \
                        Py_ssize_t m = o2 - l0 < POOL_ROW ? o2 - l0 : POOL_ROW;                                \
                        const T *row = x + p * xsp + i * t0 * xs0 + j * t1 * xs1 + l0 * t2 * xs2;              \
                        const Py_ssize_t step = t2 * xs2;                                                      \
                        for (Py_ssize_t l = 0; l < m; l++) {                                                   \
                            best[l] = row[l * step];                                                           \
                            win[l] = 0;                                                                        \
                        }                                                                                      \
                        int32_t t = 0;                                                                         \
                        for (Py_ssize_t a = 0; a < k0; a++)                                                    \
                            for (Py_ssize_t b = 0; b < k1; b++)                                                \
                                for (Py_ssize_t c = 0; c < k2; c++, t++) {                                     \
                                    if (t == 0)                                                                \
                                        continue;                                                              \
                                    const T *tap = row + a * d0 * xs0 + b * d1 * xs1 + c * d2 * xs2;           \
                                    for (Py_ssize_t l = 0; l < m; l++) {                                       \
                                        T v = tap[l * step], cur = best[l];                                    \
                                        int take = (cur == cur) & ((v != v) | (v > cur));                      \
                                        best[l] = take ? v : cur;                                              \
                                        win[l] = take ? t : win[l];                                            \
                                    }                                                                          \
                                }                                                                              \
                        memcpy(y + n, best, (size_t)m * sizeof(T));                                            \
                        if (asz == 1)                                                                          \
                            for (Py_ssize_t l = 0; l < m; l++)                                                 \
                                ((int8_t *)arg)[n + l] = (int8_t)win[l];                                       \
                        else                                                                                   \
                            for (Py_ssize_t l = 0; l < m; l++)                                                 \
                                ((int16_t *)arg)[n + l] = (int16_t)win[l];                                     \
                        n += m;                                                                                \
                    }                                                                                          \
    }
#define MAXPOOL_BWD(NAME, T)                                                                                   \
    static void NAME(const T *dy, const void *arg, int asz, Py_ssize_t planes, Py_ssize_t o0, Py_ssize_t o1,   \
                     Py_ssize_t o2, Py_ssize_t k0, Py_ssize_t k1, Py_ssize_t k2, Py_ssize_t t0, Py_ssize_t t1, Py_ssize_t t2,  \
                     Py_ssize_t d0, Py_ssize_t d1, Py_ssize_t d2, T *dx, Py_ssize_t dxsp, Py_ssize_t dxs0,    \
                     Py_ssize_t dxs1, Py_ssize_t dxs2)                                                         \
    {                                                                                                          \
        int32_t win[POOL_ROW];                                                                                 \
        Py_ssize_t n = 0;                                                                                      \
        for (Py_ssize_t p = 0; p < planes; p++)                                                                \
            for (Py_ssize_t i = 0; i < o0; i++)                                                                \
                for (Py_ssize_t j = 0; j < o1; j++)                                                            \
                    for (Py_ssize_t l0 = 0; l0 < o2; l0 += POOL_ROW) {                                         \
                        Py_ssize_t m = o2 - l0 < POOL_ROW ? o2 - l0 : POOL_ROW;                                \
                        T *row = dx + p * dxsp + i * t0 * dxs0 + j * t1 * dxs1 + l0 * t2 * dxs2;               \
                        const T *g = dy + n;                                                                   \
                        const Py_ssize_t step = t2 * dxs2;                                                     \
                        if (asz == 1)                                                                          \
                            for (Py_ssize_t l = 0; l < m; l++)                                                 \
                                win[l] = ((const int8_t *)arg)[n + l];                                         \
                        else                                                                                   \
                            for (Py_ssize_t l = 0; l < m; l++)                                                 \
                                win[l] = ((const int16_t *)arg)[n + l];                                        \
                        int32_t t = 0;                                                                         \
                        for (Py_ssize_t a = 0; a < k0; a++)                                                    \
                            for (Py_ssize_t b = 0; b < k1; b++)                                                \
                                for (Py_ssize_t c = 0; c < k2; c++, t++) {                                     \
                                    T *tap = row + a * d0 * dxs0 + b * d1 * dxs1 + c * d2 * dxs2;              \
                                    for (Py_ssize_t l = 0; l < m; l++)                                         \
                                        tap[l * step] += win[l] == t ? g[l] : (T)0;                            \
                                }                                                                              \
                        n += m;                                                                                \
                    }                                                                                          \
    }
CLONES MAXPOOL_FWD(maxpool_fwd_f32, float)
CLONES MAXPOOL_FWD(maxpool_fwd_f64, double)
CLONES MAXPOOL_BWD(maxpool_bwd_f32, float)
CLONES MAXPOOL_BWD(maxpool_bwd_f64, double)

static PyObject *
py_maxpool_fwd(PyObject *self, PyObject *args)
{
    int isz, asz;
    Py_ssize_t x, planes, xsp, xs0, xs1, xs2, o0, o1, o2, k0, k1, k2, t0, t1, t2, d0, d1, d2, y, arg;
    if (!PyArg_ParseTuple(args, "innnnnnnnnnnnnnnnnnnni", &isz, &x, &planes, &xsp, &xs0, &xs1, &xs2, &o0, &o1,
                          &o2, &k0, &k1, &k2, &t0, &t1, &t2, &d0, &d1, &d2, &y, &arg, &asz))
        return NULL;
    if ((isz != 4 && isz != 8) || (asz != 1 && asz != 2) || k0 < 1 || k1 < 1 || k2 < 1)
        return PyErr_Format(PyExc_ValueError, "maxpool_fwd: itemsize %d, index size %d, kernel %zd x %zd x %zd",
                            isz, asz, k0, k1, k2);
    if (k0 * k1 * k2 > (asz == 1 ? 127 : 32767))
        return PyErr_Format(PyExc_ValueError, "maxpool_fwd: %zd taps do not fit the index type",
                            k0 * k1 * k2);
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        maxpool_fwd_f32((const float *)x, planes, xsp, xs0, xs1, xs2, o0, o1, o2, k0, k1, k2, t0, t1, t2, d0,
                        d1, d2, (float *)y, (void *)arg, asz);
    else
        maxpool_fwd_f64((const double *)x, planes, xsp, xs0, xs1, xs2, o0, o1, o2, k0, k1, k2, t0, t1, t2, d0,
                        d1, d2, (double *)y, (void *)arg, asz);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
py_maxpool_bwd(PyObject *self, PyObject *args)
{
    int isz, asz;
    Py_ssize_t dy, arg, planes, o0, o1, o2, k0, k1, k2, t0, t1, t2, d0, d1, d2, dx, dxsp, dxs0, dxs1, dxs2;
    if (!PyArg_ParseTuple(args, "inninnnnnnnnnnnnnnnnnn", &isz, &dy, &arg, &asz, &planes, &o0, &o1, &o2, &k0, &k1, &k2,
                          &t0, &t1, &t2, &d0, &d1, &d2, &dx, &dxsp, &dxs0, &dxs1, &dxs2))
        return NULL;
    if ((isz != 4 && isz != 8) || (asz != 1 && asz != 2) || k0 < 1 || k1 < 1 || k2 < 1)
        return PyErr_Format(PyExc_ValueError, "maxpool_bwd: itemsize %d, index size %d", isz, asz);
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        maxpool_bwd_f32((const float *)dy, (const void *)arg, asz, planes, o0, o1, o2, k0, k1, k2, t0, t1, t2, d0,
                        d1, d2, (float *)dx, dxsp, dxs0, dxs1, dxs2);
    else
        maxpool_bwd_f64((const double *)dy, (const void *)arg, asz, planes, o0, o1, o2, k0, k1, k2, t0, t1, t2, d0,
                        d1, d2, (double *)dx, dxsp, dxs0, dxs1, dxs2);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"maxpool_fwd", py_maxpool_fwd, METH_VARARGS, "Max pooling with the winning tap (see above)."},
    {"maxpool_bwd", py_maxpool_bwd, METH_VARARGS, "Max pooling gradient from the winning taps (see above)."},
    {"conv_pair", py_conv_pair, METH_VARARGS, "Two column phases of a stride-2 data gradient (see module)."},
    {"phase_rows", py_phase_rows, METH_VARARGS, "Rows split into / merged from column phases (see module)."},
    {"conv_fwd", py_conv_fwd, METH_VARARGS, "Direct convolution over a list of shifted taps (see module)."},
    {"conv_wgrad", py_conv_wgrad, METH_VARARGS, "Filter gradient over a list of shifted taps (see module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cconv", "Compiled direct-convolution kernels (see _cconv.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__cconv(void)
{
    return PyModule_Create(&module);
}
