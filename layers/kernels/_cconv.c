/* Compiled direct-convolution kernels behind lbannpy.layers.kernels.conv (float32 and float64).
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

static PyMethodDef methods[] = {
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
