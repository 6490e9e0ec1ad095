/* Compiled upsampling (nearest and linear, align_corners either way; float32 and float64; 1-D to 3-D as
 * (N, C, D, H, W) views with any element strides) of lbannpy.layers.kernels.upsample.
 *
 * Why: the NumPy path runs one strided pass per phase and dimension (and, for align_corners, gathers and
 * products over whole temporaries), so a bilinear layer went through memory several times where PyTorch's
 * kernel makes one pass; here each (sample, channel) plane is done in cache: the last dimension of every
 * input row the box reads is interpolated into a small temporary (one gather per output), then each output
 * row is a blend of two such rows (vectorised), written once. The backward is the adjoint in the reverse
 * order: each input row gathers the few output rows that read it (weighted rows, vectorised), then each
 * input element the few entries of that row that read it.
 *
 * The index tables come from Python, one set per dimension (the Plan's box and source, worked out once):
 *   itab (int64): i0[nout], i1[nout] (the two taps of each output, relative to the source's first input),
 *                 start[nin] (the first of the `taps` outputs whose gradients input j's gathers)
 *   ftab (the arrays' type): lam[nout] (output = x[i0] + lam (x[i1] - x[i0])), w[taps * nin] (the weight
 *                 of output start[j] + k in input j's gradient at w[k * nin + j]; 0 past the outputs that
 *                 read j, as the NumPy gather path weighs them)
 * and meta: per dimension (nin, nout, taps, nearest: every lam is 0).
 *
 *   forward(x, y, itab0, ftab0, itab1, ftab1, itab2, ftab2, meta)   x (N, C, nin...), y (N, C, nout...)
 *   backward(g, dx, ...same tables...)                             g (N, C, nout...), dx (N, C, nin...)
 */
#ifndef UPS_REAL
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

typedef struct {
    Py_ssize_t nin, nout, taps;
    int nearest;
    const int64_t *i0, *i1, *start;
    const void *lam, *w;
    /* the runs where the indices repeat with period 2 (scale 2: every pair of outputs reads the next
     * input; every input gathers from two outputs further on): outputs [fb, fe), inputs [bb, be), found
     * here from the tables themselves; their loops vectorise (the weights are read as they come) */
    Py_ssize_t fb, fe, bb, be;
    /* the axis a pure repeat (nearest at an integer scale from the first input: output o reads input
     * o / rep, each input's gradient the plain sum of its rep outputs): rep, else 0 */
    Py_ssize_t rep;
} Axis;

typedef struct {
    char *p;
    Py_ssize_t n[5], s[5];  /* extents and element strides */
} View;

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, UPS_SFX)

/* 64-byte vectors of either type (GCC vector extensions; each clone lowers them to its own width), the
 * lane indices that repeat each entry of a vector's low (high) half twice, and those that take the even
 * (odd) entries of two vectors */
typedef float ups_vf __attribute__((vector_size(64)));
typedef float ups_vfu __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t ups_if __attribute__((vector_size(64)));
typedef double ups_vd __attribute__((vector_size(64)));
typedef double ups_vdu __attribute__((vector_size(64), aligned(8), may_alias));
typedef int64_t ups_id __attribute__((vector_size(64)));
static const ups_if UPS_TWICE_LO_f = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
static const ups_if UPS_TWICE_HI_f = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
static const ups_if UPS_EVEN_f = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const ups_if UPS_ODD_f = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
static const ups_id UPS_TWICE_LO_d = {0, 0, 1, 1, 2, 2, 3, 3};
static const ups_id UPS_TWICE_HI_d = {4, 4, 5, 5, 6, 6, 7, 7};
static const ups_id UPS_EVEN_d = {0, 2, 4, 6, 8, 10, 12, 14};
static const ups_id UPS_ODD_d = {1, 3, 5, 7, 9, 11, 13, 15};

#define UPS_REAL float
#define UPS_SFX f
#define UPS_V ups_vf
#define UPS_VU ups_vfu
#define UPS_L 16
#include "_cupsample.c"
#undef UPS_REAL
#undef UPS_SFX
#undef UPS_V
#undef UPS_VU
#undef UPS_L
#define UPS_REAL double
#define UPS_SFX d
#define UPS_V ups_vd
#define UPS_VU ups_vdu
#define UPS_L 8
#include "_cupsample.c"
#undef UPS_REAL
#undef UPS_SFX
#undef UPS_V
#undef UPS_VU
#undef UPS_L

/* ----------------------------------------------------------------------------------------- Python glue */
typedef struct {
    Py_buffer b[8];
    int n;
} Bufs;

static void
release(Bufs *bs)
{
    for (int i = 0; i < bs->n; i++) PyBuffer_Release(&bs->b[i]);
    bs->n = 0;
}

static int
get_view(Bufs *bs, PyObject *o, int writable, int isz, View *v, const char *what)
{
    Py_buffer *b = &bs->b[bs->n];
    if (PyObject_GetBuffer(o, b, writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO) < 0) return -1;
    bs->n++;
    if (b->ndim != 5 || b->itemsize != isz || !b->format || b->format[0] != (isz == 4 ? 'f' : 'd')) {
        PyErr_Format(PyExc_ValueError, "upsample: %s must be a 5-d array of float%d", what, 8 * isz);
        return -1;
    }
    v->p = b->buf;
    for (int d = 0; d < 5; d++) {
        if (b->strides[d] % isz) {
            PyErr_Format(PyExc_ValueError, "upsample: %s has strides that are not whole elements", what);
            return -1;
        }
        v->n[d] = b->shape[d];
        v->s[d] = b->strides[d] / isz;
    }
    return 0;
}

static int
get_flat(Bufs *bs, PyObject *o, Py_ssize_t bytes, const void **p, const char *what)
{
    Py_buffer *b = &bs->b[bs->n];
    if (PyObject_GetBuffer(o, b, PyBUF_SIMPLE) < 0) return -1;
    bs->n++;
    if (b->len != bytes) {
        PyErr_Format(PyExc_ValueError, "upsample: table %s holds %zd bytes, need %zd", what, b->len, bytes);
        return -1;
    }
    *p = b->buf;
    return 0;
}

/* the longest run [*b, *e) of consecutive items i with same(i) (each comparing item i with i + 1 or i + 2) */
static void
longest(const Axis *a, int (*same)(const Axis *, Py_ssize_t, int), int isz, Py_ssize_t n, Py_ssize_t *b,
        Py_ssize_t *e)
{
    Py_ssize_t best = 0, cur = 0;
    *b = *e = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        cur = same(a, i, isz) ? cur + 1 : 0;
        if (cur > best) best = cur, *e = i + 1, *b = i + 1 - cur;
    }
}

static int
same_out(const Axis *a, Py_ssize_t o, int isz)
{
    return a->i0[o + 2] == a->i0[o] + 1 && a->i1[o + 2] == a->i1[o] + 1;
}

static int
same_in(const Axis *a, Py_ssize_t j, int isz)
{
    return a->start[j + 1] == a->start[j] + 2;
}

static Py_ssize_t
pure_repeat(const Axis *a, int isz)
{
    if (!a->nearest || a->nout % a->nin || a->taps != a->nout / a->nin) return 0;
    Py_ssize_t r = a->taps;
    for (Py_ssize_t o = 0; o < a->nout; o++)
        if (a->i0[o] != o / r) return 0;
    for (Py_ssize_t j = 0; j < a->nin; j++)
        if (a->start[j] != j * r) return 0;
    for (Py_ssize_t k = 0; k < r * a->nin; k++)
        if ((isz == 4 ? ((const float *)a->w)[k] : ((const double *)a->w)[k]) != 1) return 0;
    return r;
}

static void
regular_runs(Axis *a, int isz)
{
    a->rep = pure_repeat(a, isz);
    Py_ssize_t b, e;
    longest(a, same_out, isz, a->nout - 2, &b, &e);  /* outputs [b, e + 2) repeat with period 2 */
    a->fb = b, a->fe = e > b ? b + ((e + 2 - b) & ~(Py_ssize_t)1) : b;
    longest(a, same_in, isz, a->nin - 1, &b, &e);  /* inputs [b, e + 1) */
    a->bb = b, a->be = e > b ? e + 1 : b;
}

/* the views and tables of one call: direction 0 forward (src has the inputs), 1 backward (src has the
 * outputs' gradient) */
static int
parse(PyObject *args, int dir, Bufs *bs, View *src, View *dst, Axis ax[3], int *isz)
{
    PyObject *os, *od, *it[3], *ft[3];
    Py_ssize_t m[12];
    if (!PyArg_ParseTuple(args, "iOOOOOOOO(nnnnnnnnnnnn)", isz, &os, &od, &it[0], &ft[0], &it[1], &ft[1],
                          &it[2], &ft[2], &m[0], &m[1], &m[2], &m[3], &m[4], &m[5], &m[6], &m[7], &m[8],
                          &m[9], &m[10], &m[11]))
        return -1;
    if (*isz != 4 && *isz != 8) {
        PyErr_SetString(PyExc_ValueError, "upsample: item size must be 4 or 8");
        return -1;
    }
    if (get_view(bs, os, 0, *isz, src, "source") < 0 || get_view(bs, od, 1, *isz, dst, "destination") < 0)
        return -1;
    const View *in = dir ? dst : src, *out = dir ? src : dst;
    if (in->n[0] != out->n[0] || in->n[1] != out->n[1]) {
        PyErr_SetString(PyExc_ValueError, "upsample: samples or channels differ between the arrays");
        return -1;
    }
    for (int d = 0; d < 3; d++) {
        Axis *a = &ax[d];
        a->nin = m[4 * d], a->nout = m[4 * d + 1], a->taps = m[4 * d + 2], a->nearest = (int)m[4 * d + 3];
        if (a->nin != in->n[2 + d] || a->nout != out->n[2 + d] || a->taps < 1 || a->nin < 1 || a->nout < 1) {
            PyErr_Format(PyExc_ValueError, "upsample: dimension %d: tables for %zd -> %zd, arrays %zd -> %zd",
                         d, a->nin, a->nout, in->n[2 + d], out->n[2 + d]);
            return -1;
        }
        const void *ip;
        if (get_flat(bs, it[d], 8 * (2 * a->nout + a->nin), &ip, "itab") < 0 ||
            get_flat(bs, ft[d], *isz * (a->nout + a->nin * a->taps), &a->lam, "ftab") < 0)
            return -1;
        a->i0 = ip, a->i1 = a->i0 + a->nout, a->start = a->i1 + a->nout;
        a->w = (const char *)a->lam + *isz * a->nout;
        for (Py_ssize_t o = 0; o < a->nout; o++)
            if (a->i0[o] < 0 || a->i0[o] >= a->nin || a->i1[o] < 0 || a->i1[o] >= a->nin) {
                PyErr_SetString(PyExc_ValueError, "upsample: a tap outside the source");
                return -1;
            }
        for (Py_ssize_t j = 0; j < a->nin; j++)
            if (a->start[j] < 0 || a->start[j] + a->taps > a->nout) {
                PyErr_SetString(PyExc_ValueError, "upsample: a gradient run outside the outputs");
                return -1;
            }
        regular_runs(a, *isz);
    }
    return 0;
}

static PyObject *
run(PyObject *args, int dir)
{
    View src, dst;
    Axis ax[3];
    int isz;
    Bufs bs = {.n = 0};
    if (parse(args, dir, &bs, &src, &dst, ax, &isz) < 0) {
        release(&bs);
        return NULL;
    }
    /* temporaries: forward, the W pass (Din x Hin x OW) and the H pass (Din x OH x OW); backward, the D
     * adjoint (Din x OH x OW) and one row (OW) */
    Py_ssize_t OW = ax[2].nout, a1 = ax[0].nin * ax[1].nin * OW, a2 = ax[0].nin * ax[1].nout * OW;
    void *t = malloc((size_t)(a1 + a2 + OW + 16) * isz);
    if (!t) {
        release(&bs);
        return PyErr_NoMemory();
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        err = dir ? backward_f(&src, &dst, ax, t) : forward_f(&src, &dst, ax, t);
    else
        err = dir ? backward_d(&src, &dst, ax, t) : forward_d(&src, &dst, ax, t);
    Py_END_ALLOW_THREADS
    (void)err;
    free(t);
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *py_forward(PyObject *self, PyObject *args) { return run(args, 0); }
static PyObject *py_backward(PyObject *self, PyObject *args) { return run(args, 1); }

static PyMethodDef methods[] = {
    {"forward", py_forward, METH_VARARGS, "upsample a (N, C, D, H, W) view into another"},
    {"backward", py_backward, METH_VARARGS, "the adjoint: output gradient to input gradient"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cupsample", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__cupsample(void)
{
    return PyModule_Create(&module);
}

#else /* ------------------------------------------------------------- the kernels, once per float type */
#define R UPS_REAL
#define V UPS_V
#define VU UPS_VU

/* dst[0:n] (stride ds) = a + l (b - a), or a copy of a where l is 0 (a, b contiguous) */
static inline void
FN(blend)(R *restrict dst, Py_ssize_t ds, const R *a, const R *b, R l, Py_ssize_t n)
{
    if (ds == 1) {
        if (l == 0) {
            memcpy(dst, a, n * sizeof(R));
            return;
        }
        for (Py_ssize_t i = 0; i < n; i++) dst[i] = a[i] + l * (b[i] - a[i]);
        return;
    }
    if (l == 0) {
        for (Py_ssize_t i = 0; i < n; i++) dst[i * ds] = a[i];
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) dst[i * ds] = a[i] + l * (b[i] - a[i]);
}

/* the last dimension of one input row (stride s) into a contiguous row of the outputs */
CLONES static void
FN(row_forward)(R *restrict dst, const R *src, Py_ssize_t s, const Axis *ax)
{
    const int64_t *i0 = ax->i0, *i1 = ax->i1;
    const R *lam = ax->lam;
    Py_ssize_t n = ax->nout, fb = ax->fb, fe = ax->fe;
    if (s == 1 && fe > fb) {  /* the period-2 run, then the outputs around it */
        const R *a0 = src + i0[fb], *a1 = src + i0[fb + 1];
        const R *b0 = src + i1[fb], *b1 = src + i1[fb + 1];
        const R *l = lam + fb;
        R *d = dst + fb;
        Py_ssize_t m = (fe - fb) / 2;
        if (ax->nearest)
            for (Py_ssize_t q = 0; q < m; q++) d[2 * q] = a0[q], d[2 * q + 1] = a1[q];
        else
            for (Py_ssize_t q = 0; q < m; q++) {
                d[2 * q] = a0[q] + l[2 * q] * (b0[q] - a0[q]);
                d[2 * q + 1] = a1[q] + l[2 * q + 1] * (b1[q] - a1[q]);
            }
        for (Py_ssize_t o = 0; o < n; o++) {
            if (o == fb) o = fe;
            if (o >= n) break;
            R a = src[i0[o]], b = src[i1[o]];
            dst[o] = a + lam[o] * (b - a);
        }
        return;
    }
    if (ax->nearest) {
        if (s == 1)
            for (Py_ssize_t o = 0; o < n; o++) dst[o] = src[i0[o]];
        else
            for (Py_ssize_t o = 0; o < n; o++) dst[o] = src[i0[o] * s];
        return;
    }
    if (s == 1) {
        for (Py_ssize_t o = 0; o < n; o++) {
            R a = src[i0[o]], b = src[i1[o]];
            dst[o] = a + lam[o] * (b - a);
        }
        return;
    }
    for (Py_ssize_t o = 0; o < n; o++) {
        R a = src[i0[o] * s], b = src[i1[o] * s];
        dst[o] = a + lam[o] * (b - a);
    }
}

/* one (sample, channel) plane; t: Din*Hin*OW + Din*OH*OW elements */
CLONES static void
FN(plane_forward)(const R *x, const Py_ssize_t *xs, R *y, const Py_ssize_t *ys, const Axis ax[3], R *t)
{
    const Axis *D = &ax[0], *H = &ax[1], *W = &ax[2];
    Py_ssize_t OW = W->nout, OH = H->nout;
    R *t1 = t, *t2 = t + D->nin * H->nin * OW;
    const R *lh = H->lam, *ld = D->lam;
    for (Py_ssize_t d = 0; d < D->nin; d++)
        for (Py_ssize_t h = 0; h < H->nin; h++)
            FN(row_forward)(t1 + (d * H->nin + h) * OW, x + d * xs[0] + h * xs[1], xs[2], W);
    if (D->nin == 1 && D->nout == 1) {  /* at most two dimensions: the H pass writes the outputs */
        for (Py_ssize_t oh = 0; oh < OH; oh++)
            FN(blend)(y + oh * ys[1], ys[2], t1 + H->i0[oh] * OW, t1 + H->i1[oh] * OW, lh[oh], OW);
        return;
    }
    for (Py_ssize_t d = 0; d < D->nin; d++)
        for (Py_ssize_t oh = 0; oh < OH; oh++)
            FN(blend)(t2 + (d * OH + oh) * OW, 1, t1 + (d * H->nin + H->i0[oh]) * OW,
                      t1 + (d * H->nin + H->i1[oh]) * OW, lh[oh], OW);
    for (Py_ssize_t od = 0; od < D->nout; od++)
        for (Py_ssize_t oh = 0; oh < OH; oh++)
            FN(blend)(y + od * ys[0] + oh * ys[1], ys[2], t2 + (D->i0[od] * OH + oh) * OW,
                      t2 + (D->i1[od] * OH + oh) * OW, ld[od], OW);
}

/* every axis a pure repeat: each input row is written once, as the first of the output rows that read it
 * (its entries repeated), and the others are copies of that row */
CLONES static void
FN(plane_forward_rep)(const R *x, const Py_ssize_t *xs, R *y, const Py_ssize_t *ys, const Axis ax[3])
{
    Py_ssize_t sd = ax[0].rep, sh = ax[1].rep, sw = ax[2].rep, IW = ax[2].nin, OW = ax[2].nout;
    if (sd <= 2 && sh == 2 && sw == 2 && xs[2] == 1 && ys[2] == 1) {
        /* scale 2 in H and W (and D or not): each input row written straight into the output rows it
         * fills, one pass */
        for (Py_ssize_t d = 0; d < ax[0].nin; d++)
            for (Py_ssize_t h = 0; h < ax[1].nin; h++) {
                const R *src = x + d * xs[0] + h * xs[1];
                R *rows[4] = {y + d * sd * ys[0] + h * 2 * ys[1]};
                rows[1] = rows[0] + ys[1], rows[2] = rows[0] + ys[0], rows[3] = rows[1] + ys[0];
                const int nr = (int)(2 * sd);
                for (int k = 0; k < nr; k++) { /* row by row: the output is written in memory order */
                    R *row = rows[k];
                    Py_ssize_t w = 0;
                    for (; w + UPS_L <= IW; w += UPS_L) {
                        const V v = *(const VU *)(src + w);
                        *(VU *)(row + 2 * w) = __builtin_shuffle(v, FN(UPS_TWICE_LO));
                        *(VU *)(row + 2 * w + UPS_L) = __builtin_shuffle(v, FN(UPS_TWICE_HI));
                    }
                    for (; w < IW; w++) row[2 * w] = row[2 * w + 1] = src[w];
                }
            }
        return;
    }
    for (Py_ssize_t d = 0; d < ax[0].nin; d++)
        for (Py_ssize_t h = 0; h < ax[1].nin; h++) {
            const R *src = x + d * xs[0] + h * xs[1];
            R *first = y + d * sd * ys[0] + h * sh * ys[1];
            if (xs[2] == 1 && ys[2] == 1 && sw == 2)
                for (Py_ssize_t w = 0; w < IW; w++) first[2 * w] = first[2 * w + 1] = src[w];
            else
                for (Py_ssize_t w = 0; w < IW; w++)
                    for (Py_ssize_t j = 0; j < sw; j++) first[(w * sw + j) * ys[2]] = src[w * xs[2]];
            for (Py_ssize_t jd = 0; jd < sd; jd++)
                for (Py_ssize_t jh = 0; jh < sh; jh++) {
                    if (!jd && !jh) continue;
                    R *dst = first + jd * ys[0] + jh * ys[1];
                    if (ys[2] == 1)
                        memcpy(dst, first, OW * sizeof(R));
                    else
                        for (Py_ssize_t o = 0; o < OW; o++) dst[o * ys[2]] = first[o * ys[2]];
                }
        }
}

static int
FN(forward)(const View *x, const View *y, const Axis ax[3], void *t)
{
    if (ax[0].rep && ax[1].rep && ax[2].rep) {
        for (Py_ssize_t n = 0; n < x->n[0]; n++)
            for (Py_ssize_t c = 0; c < x->n[1]; c++)
                FN(plane_forward_rep)((const R *)x->p + n * x->s[0] + c * x->s[1], x->s + 2,
                                      (R *)y->p + n * y->s[0] + c * y->s[1], y->s + 2, ax);
        return 0;
    }
    for (Py_ssize_t n = 0; n < x->n[0]; n++)
        for (Py_ssize_t c = 0; c < x->n[1]; c++)
            FN(plane_forward)((const R *)x->p + n * x->s[0] + c * x->s[1], x->s + 2,
                              (R *)y->p + n * y->s[0] + c * y->s[1], y->s + 2, ax, t);
    return 0;
}

/* dst[0:n] = sum over k < T of w[k * ws] * src[k * step + i * s] */
static inline void
FN(combine)(R *restrict dst, const R *src, Py_ssize_t step, Py_ssize_t s, const R *w, Py_ssize_t ws,
            Py_ssize_t T, Py_ssize_t n)
{
    R w0 = w[0];
    if (s == 1 && T <= 4) {  /* one pass */
        const R *r1 = src + step, *r2 = src + 2 * step, *r3 = src + 3 * step;
        R w1 = T > 1 ? w[ws] : 0, w2 = T > 2 ? w[2 * ws] : 0, w3 = T > 3 ? w[3 * ws] : 0;
        if (T == 1)
            for (Py_ssize_t i = 0; i < n; i++) dst[i] = w0 * src[i];
        else if (T == 2)
            for (Py_ssize_t i = 0; i < n; i++) dst[i] = w0 * src[i] + w1 * r1[i];
        else if (T == 3)
            for (Py_ssize_t i = 0; i < n; i++) dst[i] = w0 * src[i] + w1 * r1[i] + w2 * r2[i];
        else
            for (Py_ssize_t i = 0; i < n; i++) dst[i] = w0 * src[i] + w1 * r1[i] + w2 * r2[i] + w3 * r3[i];
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) dst[i] = w0 * src[i * s];
    for (Py_ssize_t k = 1; k < T; k++) {
        const R *r = src + k * step;
        R wk = w[k * ws];
        for (Py_ssize_t i = 0; i < n; i++) dst[i] += wk * r[i * s];
    }
}

/* the adjoint of row_forward: each input of the row (stride ds) from the outputs that read it */
CLONES static void
FN(row_backward)(R *restrict dst, Py_ssize_t ds, const R *g, const Axis *ax)
{
    const int64_t *st = ax->start;
    const R *w = ax->w;
    Py_ssize_t T = ax->taps, bb = ax->bb, be = ax->be, m = ax->nin;
    if (ds == 1 && be > bb && (T == 2 || T == 4)) {  /* the period-2 run */
        const R *gj = g + st[bb], *w0 = w + bb, *w1 = w0 + m;
        R *d = dst + bb;
        Py_ssize_t r = be - bb;
        if (T == 2)
            for (Py_ssize_t q = 0; q < r; q++) d[q] = w0[q] * gj[2 * q] + w1[q] * gj[2 * q + 1];
        else {
            const R *w2 = w1 + m, *w3 = w2 + m;
            for (Py_ssize_t q = 0; q < r; q++)
                d[q] = w0[q] * gj[2 * q] + w1[q] * gj[2 * q + 1] + w2[q] * gj[2 * q + 2] + w3[q] * gj[2 * q + 3];
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            if (j == bb) j = be;
            if (j >= m) break;
            R acc = 0;
            for (Py_ssize_t k = 0; k < T; k++) acc += w[k * m + j] * g[st[j] + k];
            dst[j] = acc;
        }
        return;
    }
    if (T == 4)  /* a gather per tap, vectorised over the inputs */
        for (Py_ssize_t j = 0; j < m; j++) {
            const R *gj = g + st[j];
            dst[j * ds] = w[j] * gj[0] + w[m + j] * gj[1] + w[2 * m + j] * gj[2] + w[3 * m + j] * gj[3];
        }
    else if (T == 2)
        for (Py_ssize_t j = 0; j < m; j++) {
            const R *gj = g + st[j];
            dst[j * ds] = w[j] * gj[0] + w[m + j] * gj[1];
        }
    else
        for (Py_ssize_t j = 0; j < m; j++) {
            R acc = 0;
            for (Py_ssize_t k = 0; k < T; k++) acc += w[k * m + j] * g[st[j] + k];
            dst[j * ds] = acc;
        }
}

CLONES static void
FN(plane_backward)(const R *g, const Py_ssize_t *gs, R *dx, const Py_ssize_t *xs, const Axis ax[3], R *t)
{
    const Axis *D = &ax[0], *H = &ax[1], *W = &ax[2];
    Py_ssize_t OW = W->nout, OH = H->nout;
    const R *wd = D->w, *wh = H->w;
    R *row = t + D->nin * OH * OW;
    const R *g2 = g;
    Py_ssize_t g2d = gs[0], g2h = gs[1], g2w = gs[2];
    if (!(D->nin == 1 && D->nout == 1)) {  /* three dimensions: the D adjoint into a temporary first */
        for (Py_ssize_t d = 0; d < D->nin; d++)
            for (Py_ssize_t oh = 0; oh < OH; oh++)
                FN(combine)(t + (d * OH + oh) * OW, g + D->start[d] * gs[0] + oh * gs[1], gs[0], gs[2],
                            wd + d, D->nin, D->taps, OW);
        g2 = t, g2d = OH * OW, g2h = OW, g2w = 1;
    }
    for (Py_ssize_t d = 0; d < D->nin; d++)
        for (Py_ssize_t h = 0; h < H->nin; h++) {
            FN(combine)(row, g2 + d * g2d + H->start[h] * g2h, g2h, g2w, wh + h, H->nin, H->taps, OW);
            FN(row_backward)(dx + d * xs[0] + h * xs[1], xs[2], row, W);
        }
}

/* the adjoint of plane_forward_rep, summed in the order of the general path (over D, then H, then W, each
 * from its first output): row = the H sum of the D sums of the output rows an input row feeds, then each
 * input the sum of its sw entries of row; t: two rows of OW */
CLONES static void
FN(plane_backward_rep)(const R *g, const Py_ssize_t *gs, R *dx, const Py_ssize_t *xs, const Axis ax[3], R *t)
{
    Py_ssize_t sd = ax[0].rep, sh = ax[1].rep, sw = ax[2].rep, IW = ax[2].nin, OW = ax[2].nout;
    if (sd <= 2 && sh == 2 && sw == 2 && gs[2] == 1 && xs[2] == 1) {
        /* scale 2 in H and W (and D or not), one pass in the same order: each of the two rows' entries
         * summed over D, the two rows added, then each input's pair */
        for (Py_ssize_t d = 0; d < ax[0].nin; d++)
            for (Py_ssize_t h = 0; h < ax[1].nin; h++) {
                const R *r0 = g + d * sd * gs[0] + h * 2 * gs[1], *r1 = r0 + gs[1];
                const R *q0 = r0 + gs[0], *q1 = r1 + gs[0];
                R *out = dx + d * xs[0] + h * xs[1];
                Py_ssize_t w = 0;
                for (; w + UPS_L <= IW; w += UPS_L) {
                    /* the rows two pairs on, requested ahead: with dy out of the cache this pass ran
                     * slower than PyTorch's channels-last one without it (bench layers --new) */
                    __builtin_prefetch(r0 + 4 * gs[1] + 2 * w);
                    __builtin_prefetch(r0 + 4 * gs[1] + 2 * w + UPS_L);
                    __builtin_prefetch(r1 + 4 * gs[1] + 2 * w);
                    __builtin_prefetch(r1 + 4 * gs[1] + 2 * w + UPS_L);
                    V a = *(const VU *)(r0 + 2 * w), b = *(const VU *)(r0 + 2 * w + UPS_L);
                    V c = *(const VU *)(r1 + 2 * w), e = *(const VU *)(r1 + 2 * w + UPS_L);
                    if (sd == 2) {
                        a += *(const VU *)(q0 + 2 * w), b += *(const VU *)(q0 + 2 * w + UPS_L);
                        c += *(const VU *)(q1 + 2 * w), e += *(const VU *)(q1 + 2 * w + UPS_L);
                    }
                    a += c, b += e;
                    *(VU *)(out + w) = __builtin_shuffle(a, b, FN(UPS_EVEN)) + __builtin_shuffle(a, b, FN(UPS_ODD));
                }
                for (; w < IW; w++) {
                    R e0 = r0[2 * w], e1 = r0[2 * w + 1], f0 = r1[2 * w], f1 = r1[2 * w + 1];
                    if (sd == 2)
                        e0 += q0[2 * w], e1 += q0[2 * w + 1], f0 += q1[2 * w], f1 += q1[2 * w + 1];
                    out[w] = (e0 + f0) + (e1 + f1);
                }
            }
        return;
    }
    R *row = t, *part = t + OW;
    for (Py_ssize_t d = 0; d < ax[0].nin; d++)
        for (Py_ssize_t h = 0; h < ax[1].nin; h++) {
            const R *g0 = g + d * sd * gs[0] + h * sh * gs[1];
            for (Py_ssize_t jh = 0; jh < sh; jh++) {
                R *acc = jh ? part : row;
                const R *r = g0 + jh * gs[1];
                if (gs[2] == 1) {
                    if (sd == 1)
                        memcpy(acc, r, OW * sizeof(R));
                    else
                        for (Py_ssize_t o = 0; o < OW; o++) acc[o] = r[o] + r[gs[0] + o];
                    for (Py_ssize_t jd = 2; jd < sd; jd++)
                        for (Py_ssize_t o = 0; o < OW; o++) acc[o] += r[jd * gs[0] + o];
                } else {
                    for (Py_ssize_t o = 0; o < OW; o++) acc[o] = r[o * gs[2]];
                    for (Py_ssize_t jd = 1; jd < sd; jd++)
                        for (Py_ssize_t o = 0; o < OW; o++) acc[o] += r[jd * gs[0] + o * gs[2]];
                }
                if (jh)
                    for (Py_ssize_t o = 0; o < OW; o++) row[o] += part[o];
            }
            R *out = dx + d * xs[0] + h * xs[1];
            if (sw == 2 && xs[2] == 1)
                for (Py_ssize_t w = 0; w < IW; w++) out[w] = row[2 * w] + row[2 * w + 1];
            else
                for (Py_ssize_t w = 0; w < IW; w++) {
                    R v = row[w * sw];
                    for (Py_ssize_t j = 1; j < sw; j++) v += row[w * sw + j];
                    out[w * xs[2]] = v;
                }
        }
}

static int
FN(backward)(const View *g, const View *dx, const Axis ax[3], void *t)
{
    if (ax[0].rep && ax[1].rep && ax[2].rep) {
        for (Py_ssize_t n = 0; n < g->n[0]; n++)
            for (Py_ssize_t c = 0; c < g->n[1]; c++)
                FN(plane_backward_rep)((const R *)g->p + n * g->s[0] + c * g->s[1], g->s + 2,
                                       (R *)dx->p + n * dx->s[0] + c * dx->s[1], dx->s + 2, ax, t);
        return 0;
    }
    for (Py_ssize_t n = 0; n < g->n[0]; n++)
        for (Py_ssize_t c = 0; c < g->n[1]; c++)
            FN(plane_backward)((const R *)g->p + n * g->s[0] + c * g->s[1], g->s + 2,
                               (R *)dx->p + n * dx->s[0] + c * dx->s[1], dx->s + 2, ax, t);
    return 0;
}

#undef R
#undef V
#undef VU
#endif
