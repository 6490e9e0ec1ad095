/* Small convolutions in one call each: forward, data gradient, filter gradient, with the zero padding
 * applied inside (reads outside the input are skipped), so the caller builds no padded window.
 *
 * For convolutions whose arithmetic is a few microseconds (a 4x4x4 layer, the deep layers of a small
 * network at batch 1), the GEMM path's fixed cost (a gather, a GEMM, a dozen NumPy calls) is the whole
 * time; here each pass is one C call over the arrays as they are. Shapes are 1 to 3 spatial dimensions,
 * given as three (missing leading dimensions have size 1); groups, stride, dilation and padding (low side;
 * the high side follows from the output size) per dimension. Every array is C-contiguous (checked through
 * the buffer protocol, with its size) and of the itemsize given (4: float, 8: double).
 *
 * Order of the arithmetic: each output starts from the bias (or 0) and adds input channel by input channel,
 * tap by tap; the data gradient is a scatter over (filter, channel, tap); the filter gradient a dot over
 * (sample, output) per (filter, channel, tap). Results equal the GEMM path's to round-off.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    Py_ssize_t n, c, f, groups, s[3], k[3], o[3], t[3], d[3], p[3];
} sgeom;

/* outputs q in [*lo, *hi) whose tap at offset a (= tap * dilation - padding) reads 0 <= q*t + a < s */
static inline void
span(Py_ssize_t a, Py_ssize_t t, Py_ssize_t s, Py_ssize_t o, Py_ssize_t *lo, Py_ssize_t *hi)
{
    Py_ssize_t l = a >= 0 ? 0 : (-a + t - 1) / t;
    Py_ssize_t h = s - 1 - a >= 0 ? (s - 1 - a) / t + 1 : 0;
    if (h > o)
        h = o;
    if (l > h)
        l = h;
    *lo = l, *hi = h;
}

/* per dimension and tap: the tap's offset (tap * dilation - padding) and its span of outputs [lo, hi);
 * worked out once per call (divisions), not once per (filter, channel) */
typedef struct {
    Py_ssize_t *e[3], *lo[3], *hi[3];
} spans;

static int
spans_make(spans *sp, const sgeom *g)
{
    Py_ssize_t total = g->k[0] + g->k[1] + g->k[2], *m = malloc((size_t)(3 * total) * sizeof(Py_ssize_t));
    if (!m)
        return -1;
    for (int i = 0; i < 3; m += 3 * g->k[i], i++) {
        sp->e[i] = m, sp->lo[i] = m + g->k[i], sp->hi[i] = m + 2 * g->k[i];
        for (Py_ssize_t a = 0; a < g->k[i]; a++) {
            sp->e[i][a] = a * g->d[i] - g->p[i];
            span(sp->e[i][a], g->t[i], g->s[i], g->o[i], &sp->lo[i][a], &sp->hi[i][a]);
        }
    }
    return 0;
}

static void
spans_free(spans *sp)
{
    free(sp->e[0]);
}

/* walk every (tap, output row) pair of one (input plane, output plane): the body sees the tap's weight
 * index `tap`, the input row `xi` (offset of output column 0's tap: it may lie before the row, the body
 * starts at column l2) and the output row `yi`, and the column span [l2, h2) */
#define FOR_TAP_ROWS(G, SP, ...)                                                                           \
    for (Py_ssize_t a0 = 0, tap0 = 0; a0 < (G)->k[0]; a0++, tap0 += (G)->k[1] * (G)->k[2]) {               \
        const Py_ssize_t e0 = (SP)->e[0][a0], l0 = (SP)->lo[0][a0], h0 = (SP)->hi[0][a0];                  \
        for (Py_ssize_t a1 = 0; a1 < (G)->k[1]; a1++) {                                                    \
            const Py_ssize_t e1 = (SP)->e[1][a1], l1 = (SP)->lo[1][a1], h1 = (SP)->hi[1][a1];              \
            for (Py_ssize_t a2 = 0; a2 < (G)->k[2]; a2++) {                                                \
                const Py_ssize_t e2 = (SP)->e[2][a2], l2 = (SP)->lo[2][a2], h2 = (SP)->hi[2][a2];          \
                const Py_ssize_t tap = tap0 + a1 * (G)->k[2] + a2;                                         \
                for (Py_ssize_t q0 = l0; q0 < h0; q0++)                                                    \
                    for (Py_ssize_t q1 = l1; q1 < h1; q1++) {                                              \
                        const Py_ssize_t xi = ((q0 * (G)->t[0] + e0) * (G)->s[1] + q1 * (G)->t[1] + e1)    \
                                              * (G)->s[2] + e2;                                            \
                        const Py_ssize_t yi = (q0 * (G)->o[1] + q1) * (G)->o[2];                           \
                        __VA_ARGS__                                                                        \
                    }                                                                                      \
            }                                                                                              \
        }                                                                                                  \
    }

#define SMALL_KERNELS(SFX, T)                                                                              \
    static void fwd_##SFX(const T *x, const T *w, const T *b, T *y, const sgeom *g, const spans *sp)                        \
    {                                                                                                      \
        const Py_ssize_t cg = g->c / g->groups, fg = g->f / g->groups, t2 = g->t[2];                       \
        const Py_ssize_t S = g->s[0] * g->s[1] * g->s[2], O = g->o[0] * g->o[1] * g->o[2];                 \
        const Py_ssize_t K = g->k[0] * g->k[1] * g->k[2];                                                  \
        for (Py_ssize_t n = 0; n < g->n; n++)                                                              \
            for (Py_ssize_t f = 0; f < g->f; f++) {                                                        \
                T *yp = y + (n * g->f + f) * O;                                                            \
                const T bv = b ? b[f] : (T)0;                                                              \
                for (Py_ssize_t i = 0; i < O; i++)                                                         \
                    yp[i] = bv;                                                                            \
                for (Py_ssize_t c = 0; c < cg; c++) {                                                      \
                    const T *xp = x + (n * g->c + (f / fg) * cg + c) * S, *wp = w + (f * cg + c) * K;      \
                    FOR_TAP_ROWS(g, sp, {                                                                      \
                        const T wv = wp[tap];                                                              \
                        const T *xr = xp + (xi + l2 * t2);                                                             \
                        T *yr = yp + (yi + l2);                                                                   \
                        if (t2 == 1)                                                                       \
                            for (Py_ssize_t q = 0; q < h2 - l2; q++)                                           \
                                yr[q] += wv * xr[q];                                                       \
                        else                                                                               \
                            for (Py_ssize_t q = 0; q < h2 - l2; q++)                                           \
                                yr[q] += wv * xr[q * t2];                                                  \
                    })                                                                                     \
                }                                                                                          \
            }                                                                                              \
    }                                                                                                      \
                                                                                                           \
    static void dgrad_##SFX(const T *dy, const T *w, T *dx, const sgeom *g, const spans *sp)                                \
    {                                                                                                      \
        const Py_ssize_t cg = g->c / g->groups, fg = g->f / g->groups, t2 = g->t[2];                       \
        const Py_ssize_t S = g->s[0] * g->s[1] * g->s[2], O = g->o[0] * g->o[1] * g->o[2];                 \
        const Py_ssize_t K = g->k[0] * g->k[1] * g->k[2];                                                  \
        memset(dx, 0, (size_t)(g->n * g->c * S) * sizeof(T));                                              \
        for (Py_ssize_t n = 0; n < g->n; n++)                                                              \
            for (Py_ssize_t f = 0; f < g->f; f++) {                                                        \
                const T *dyp = dy + (n * g->f + f) * O;                                                    \
                for (Py_ssize_t c = 0; c < cg; c++) {                                                      \
                    T *dxp = dx + (n * g->c + (f / fg) * cg + c) * S;                                      \
                    const T *wp = w + (f * cg + c) * K;                                                    \
                    FOR_TAP_ROWS(g, sp, {                                                                      \
                        const T wv = wp[tap];                                                              \
                        T *xr = dxp + (xi + l2 * t2);                                                                  \
                        const T *yr = dyp + (yi + l2);                                                            \
                        if (t2 == 1)                                                                       \
                            for (Py_ssize_t q = 0; q < h2 - l2; q++)                                           \
                                xr[q] += wv * yr[q];                                                       \
                        else                                                                               \
                            for (Py_ssize_t q = 0; q < h2 - l2; q++)                                           \
                                xr[q * t2] += wv * yr[q];                                                  \
                    })                                                                                     \
                }                                                                                          \
            }                                                                                              \
    }                                                                                                      \
                                                                                                           \
    static void wgrad_##SFX(const T *x, const T *dy, T *db, T *dw, const sgeom *g, const spans *sp)       \
    {                                                                                                      \
        const Py_ssize_t cg = g->c / g->groups, fg = g->f / g->groups, t2 = g->t[2];                       \
        const Py_ssize_t S = g->s[0] * g->s[1] * g->s[2], O = g->o[0] * g->o[1] * g->o[2];                 \
        const Py_ssize_t K = g->k[0] * g->k[1] * g->k[2];                                                  \
        memset(dw, 0, (size_t)(g->f * cg * K) * sizeof(T));                                                \
        for (Py_ssize_t f = 0; db && f < g->f; f++) { /* the bias gradient: dy summed per filter */        \
            double acc = 0;                                                                                \
            for (Py_ssize_t n = 0; n < g->n; n++)                                                          \
                for (Py_ssize_t i = 0; i < O; i++)                                                         \
                    acc += dy[(n * g->f + f) * O + i];                                                     \
            db[f] = (T)acc;                                                                                \
        }                                                                                                  \
        for (Py_ssize_t n = 0; n < g->n; n++)                                                              \
            for (Py_ssize_t f = 0; f < g->f; f++) {                                                        \
                const T *dyp = dy + (n * g->f + f) * O;                                                    \
                for (Py_ssize_t c = 0; c < cg; c++) {                                                      \
                    const T *xp = x + (n * g->c + (f / fg) * cg + c) * S;                                  \
                    T *wp = dw + (f * cg + c) * K;                                                         \
                    FOR_TAP_ROWS(g, sp, {                                                                      \
                        const T *xr = xp + (xi + l2 * t2), *yr = dyp + (yi + l2);                                             \
                        T acc = 0;                                                                         \
                        if (t2 == 1)                                                                       \
                            for (Py_ssize_t q = 0; q < h2 - l2; q++)                                           \
                                acc += yr[q] * xr[q];                                                      \
                        else                                                                               \
                            for (Py_ssize_t q = 0; q < h2 - l2; q++)                                           \
                                acc += yr[q] * xr[q * t2];                                                 \
                        wp[tap] += acc;                                                                    \
                    })                                                                                     \
                }                                                                                          \
            }                                                                                              \
    }

SMALL_KERNELS(f32, float)
SMALL_KERNELS(f64, double)

/* Average pooling of a C-contiguous window (count_include_pad: one divisor), in the NumPy path's order:
 * each output sums its taps in row-major tap order from the first, then divides; the gradient divides dy
 * first and adds it to the window tap by tap (taps outer), so both are bit for bit the NumPy path's. */
typedef struct {
    Py_ssize_t planes, s[3], o[3], k[3], t[3], d[3];
} pgeo;

#define AVGPOOL_KERNELS(SFX, T)                                                                            \
    static void avg_fwd_##SFX(const T *x, T *y, const T div, const pgeo *g)                                \
    {                                                                                                      \
        const Py_ssize_t S = g->s[0] * g->s[1] * g->s[2], O = g->o[0] * g->o[1] * g->o[2];                 \
        for (Py_ssize_t pl = 0; pl < g->planes; pl++) {                                                    \
            const T *xp = x + pl * S;                                                                      \
            T *yp = y + pl * O;                                                                            \
            for (Py_ssize_t a0 = 0, first = 1; a0 < g->k[0]; a0++)                                         \
                for (Py_ssize_t a1 = 0; a1 < g->k[1]; a1++)                                                \
                    for (Py_ssize_t a2 = 0; a2 < g->k[2]; a2++, first = 0)                                 \
                        for (Py_ssize_t q0 = 0; q0 < g->o[0]; q0++)                                        \
                            for (Py_ssize_t q1 = 0; q1 < g->o[1]; q1++) {                                  \
                                const T *xr = xp + ((q0 * g->t[0] + a0 * g->d[0]) * g->s[1] + q1 * g->t[1] \
                                                    + a1 * g->d[1]) * g->s[2] + a2 * g->d[2];              \
                                T *yr = yp + (q0 * g->o[1] + q1) * g->o[2];                                \
                                if (first)                                                                 \
                                    for (Py_ssize_t q = 0; q < g->o[2]; q++)                               \
                                        yr[q] = xr[q * g->t[2]];                                           \
                                else                                                                       \
                                    for (Py_ssize_t q = 0; q < g->o[2]; q++)                               \
                                        yr[q] += xr[q * g->t[2]];                                          \
                            }                                                                              \
            for (Py_ssize_t i = 0; i < O; i++)                                                             \
                yp[i] /= div;                                                                              \
        }                                                                                                  \
    }                                                                                                      \
                                                                                                           \
    static int avg_bwd_##SFX(const T *dy, T *dx, const T div, const pgeo *g)                               \
    {                                                                                                      \
        const Py_ssize_t S = g->s[0] * g->s[1] * g->s[2], O = g->o[0] * g->o[1] * g->o[2];                 \
        T *gd = malloc((size_t)O * sizeof(T));                                                             \
        if (!gd)                                                                                           \
            return -1;                                                                                     \
        memset(dx, 0, (size_t)(g->planes * S) * sizeof(T));                                                \
        for (Py_ssize_t pl = 0; pl < g->planes; pl++) {                                                    \
            T *xp = dx + pl * S;                                                                           \
            for (Py_ssize_t i = 0; i < O; i++)                                                             \
                gd[i] = dy[pl * O + i] / div;                                                              \
            for (Py_ssize_t a0 = 0; a0 < g->k[0]; a0++)                                                    \
                for (Py_ssize_t a1 = 0; a1 < g->k[1]; a1++)                                                \
                    for (Py_ssize_t a2 = 0; a2 < g->k[2]; a2++)                                            \
                        for (Py_ssize_t q0 = 0; q0 < g->o[0]; q0++)                                        \
                            for (Py_ssize_t q1 = 0; q1 < g->o[1]; q1++) {                                  \
                                T *xr = xp + ((q0 * g->t[0] + a0 * g->d[0]) * g->s[1] + q1 * g->t[1]       \
                                              + a1 * g->d[1]) * g->s[2] + a2 * g->d[2];                    \
                                const T *gr = gd + (q0 * g->o[1] + q1) * g->o[2];                          \
                                for (Py_ssize_t q = 0; q < g->o[2]; q++)                                   \
                                    xr[q * g->t[2]] += gr[q];                                              \
                            }                                                                              \
        }                                                                                                  \
        free(gd);                                                                                          \
        return 0;                                                                                          \
    }

AVGPOOL_KERNELS(f32, float)
AVGPOOL_KERNELS(f64, double)

/* a C-contiguous buffer of exactly `count` items of `isz` bytes (None allowed where `optional`) */
static int
array(PyObject *o, int writable, int isz, Py_ssize_t count, const char *what, int optional, void **out)
{
    *out = NULL;
    if (o == Py_None && optional)
        return 0;
    Py_buffer v;
    if (PyObject_GetBuffer(o, &v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const Py_ssize_t len = v.len, item = v.itemsize;
    *out = v.buf;
    PyBuffer_Release(&v);
    if (item != isz || len != count * isz) {
        PyErr_Format(PyExc_ValueError, "small conv: %s holds %zd bytes of %zd-byte items, not %zd of %d",
                     what, len, item, count * isz, isz);
        return -1;
    }
    return 0;
}

/* (isz, a, b, c, d, n, c, f, groups, s0..2, k0..2, o0..2, t0..2, d0..2, p0..2) */
static int
parse(PyObject *args, int *isz, PyObject **a, sgeom *g)
{
    if (!PyArg_ParseTuple(args, "iOOOOnnnnnnnnnnnnnnnnnnnnnn", isz, &a[0], &a[1], &a[2], &a[3], &g->n, &g->c,
                          &g->f, &g->groups, &g->s[0], &g->s[1], &g->s[2], &g->k[0], &g->k[1], &g->k[2],
                          &g->o[0], &g->o[1], &g->o[2], &g->t[0], &g->t[1], &g->t[2], &g->d[0], &g->d[1],
                          &g->d[2], &g->p[0], &g->p[1], &g->p[2]))
        return -1;
    if (*isz != 4 && *isz != 8) {
        PyErr_Format(PyExc_ValueError, "small conv: itemsize %d", *isz);
        return -1;
    }
    int ok = g->n >= 0 && g->groups >= 1 && g->c >= 1 && g->f >= 1 && g->c % g->groups == 0
             && g->f % g->groups == 0;
    for (int i = 0; i < 3; i++)
        ok = ok && g->s[i] >= 1 && g->k[i] >= 1 && g->o[i] >= 0 && g->t[i] >= 1 && g->d[i] >= 1 && g->p[i] >= 0;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "small conv: inconsistent geometry");
        return -1;
    }
    return 0;
}

#define SIZES(g)                                                                                           \
    const Py_ssize_t S = (g).s[0] * (g).s[1] * (g).s[2], O = (g).o[0] * (g).o[1] * (g).o[2];               \
    const Py_ssize_t W = (g).f * ((g).c / (g).groups) * (g).k[0] * (g).k[1] * (g).k[2]

enum { FWD, DGRAD, WGRAD };

/* one pass: operands (fwd: x, w, b or None, y; dgrad: dy, w, None, dx; wgrad: x, dy, db or None, dw), the
 * last written (and wgrad's db, the bias gradient, summed in double), the third optional */
static PyObject *
small_pass(PyObject *args, int kind)
{
    static const char *names[3][4] = {{"input", "filter", "bias", "output"},
                                      {"output gradient", "filter", "unused", "input gradient"},
                                      {"input", "output gradient", "bias gradient", "filter gradient"}};
    int isz;
    PyObject *a[4];
    sgeom g;
    void *p[4];
    if (parse(args, &isz, a, &g))
        return NULL;
    SIZES(g);
    const Py_ssize_t X = g.n * g.c * S, Y = g.n * g.f * O;
    const Py_ssize_t count[3][4] = {{X, W, g.f, Y}, {Y, W, 0, X}, {X, Y, g.f, W}};
    for (int i = 0; i < 4; i++)
        if (array(a[i], i == 3 || (kind == WGRAD && i == 2), isz, count[kind][i], names[kind][i], i == 2,
                  &p[i]))
            return NULL;
    spans sp;
    if (spans_make(&sp, &g))
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    if (kind == FWD && isz == 4)
        fwd_f32(p[0], p[1], p[2], p[3], &g, &sp);
    else if (kind == FWD)
        fwd_f64(p[0], p[1], p[2], p[3], &g, &sp);
    else if (kind == DGRAD && isz == 4)
        dgrad_f32(p[0], p[1], p[3], &g, &sp);
    else if (kind == DGRAD)
        dgrad_f64(p[0], p[1], p[3], &g, &sp);
    else if (isz == 4)
        wgrad_f32(p[0], p[1], p[2], p[3], &g, &sp);
    else
        wgrad_f64(p[0], p[1], p[2], p[3], &g, &sp);
    Py_END_ALLOW_THREADS
    spans_free(&sp);
    Py_RETURN_NONE;
}

static PyObject *
py_fwd(PyObject *self, PyObject *args)
{
    return small_pass(args, FWD);
}

static PyObject *
py_dgrad(PyObject *self, PyObject *args)
{
    return small_pass(args, DGRAD);
}

static PyObject *
py_wgrad(PyObject *self, PyObject *args)
{
    return small_pass(args, WGRAD);
}

/* (isz, src, dst, divisor, planes, s0..2, o0..2, k0..2, t0..2, d0..2), fwd: src the window, dst the
 * outputs; bwd: src dy, dst the window gradient (zeroed here) */
static int
avg_parse(PyObject *args, int fwd, int *isz, void **src, void **dst, double *div, pgeo *g)
{
    PyObject *so, *dso;
    if (!PyArg_ParseTuple(args, "iOOdnnnnnnnnnnnnnnnn", isz, &so, &dso, div, &g->planes, &g->s[0], &g->s[1],
                          &g->s[2], &g->o[0], &g->o[1], &g->o[2], &g->k[0], &g->k[1], &g->k[2], &g->t[0],
                          &g->t[1], &g->t[2], &g->d[0], &g->d[1], &g->d[2]))
        return -1;
    if (*isz != 4 && *isz != 8) {
        PyErr_Format(PyExc_ValueError, "avg pool: itemsize %d", *isz);
        return -1;
    }
    int ok = g->planes >= 0;
    for (int i = 0; i < 3; i++)
        ok = ok && g->k[i] >= 1 && g->t[i] >= 1 && g->d[i] >= 1 && g->o[i] >= 1
             && (g->o[i] - 1) * g->t[i] + (g->k[i] - 1) * g->d[i] < g->s[i];
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "avg pool: inconsistent geometry");
        return -1;
    }
    const Py_ssize_t S = g->planes * g->s[0] * g->s[1] * g->s[2], O = g->planes * g->o[0] * g->o[1] * g->o[2];
    if (array(so, 0, *isz, fwd ? S : O, fwd ? "window" : "output gradient", 0, src)
        || array(dso, 1, *isz, fwd ? O : S, fwd ? "output" : "window gradient", 0, dst))
        return -1;
    return 0;
}

static PyObject *
py_avg_fwd(PyObject *self, PyObject *args)
{
    int isz;
    void *x, *y;
    double div;
    pgeo g;
    if (avg_parse(args, 1, &isz, &x, &y, &div, &g))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        avg_fwd_f32(x, y, (float)div, &g);
    else
        avg_fwd_f64(x, y, div, &g);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
py_avg_bwd(PyObject *self, PyObject *args)
{
    int isz, err;
    void *dy, *dx;
    double div;
    pgeo g;
    if (avg_parse(args, 0, &isz, &dy, &dx, &div, &g))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    err = isz == 4 ? avg_bwd_f32(dy, dx, (float)div, &g) : avg_bwd_f64(dy, dx, div, &g);
    Py_END_ALLOW_THREADS
    if (err)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"avg_fwd", py_avg_fwd, METH_VARARGS, "Average pooling, one divisor (see above)."},
    {"avg_bwd", py_avg_bwd, METH_VARARGS, "Average pooling gradient, one divisor (see above)."},
    {"fwd", py_fwd, METH_VARARGS, "Padded convolution, bias first (see module)."},
    {"dgrad", py_dgrad, METH_VARARGS, "Input gradient of a padded convolution (see module)."},
    {"wgrad", py_wgrad, METH_VARARGS, "Filter gradient of a padded convolution (see module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_csmall", "Compiled small convolutions and average pooling (see _csmall.c).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__csmall(void)
{
    return PyModule_Create(&module);
}
