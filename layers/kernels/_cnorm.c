/* Compiled instance, group and layer normalisation passes (float32 and float64, C-contiguous blocks).
 *
 * lbannpy.layers.kernels.norm sees a block (N, C, *spatial) as R = N*C rows of P values (instance and group
 * norm) or as N samples of E = C*P values (layer norm), and checks dtypes and C-contiguity before calling;
 * every buffer's size is checked here. Per-row and per-sample coefficients come as float64 vectors and are
 * rounded to the dtype once; sums are returned in float64. Sums are accumulated in the dtype over blocks of
 * BLOCK values in the lanes of a 64-byte vector (GCC vector extensions), and the blocks' lane sums are added
 * in float64: a float32 row keeps float32's precision whatever its length. The
 * statistics are taken about the row's first value, so the spread is exact however far the values are from
 * zero. On x86-64 each pass is compiled for AVX-512, AVX2 + FMA and the baseline, picked at load time.
 *
 *   row_stats(isz, x, R, P, out)                   out[:R] = sum x, out[R:] = sum x^2 per row
 *   row_affine(isz, x, R, P, scale, shift, y)       y = x * scale + shift per row
 *   row_bwd_sums(isz, dy, x, R, P, mean, out)       out[:R] = sum dy, out[R:] = sum dy * (x - mean) per row
 *   row_axpbyc(isz, dy, x, R, P, a, b, c, dx)       dx = a * dy + b * x + c per row
 *   ln_fwd(isz, x, N, E, scale, shift, gamma, beta, y)
 *                                                   y = (x * scale + shift) * gamma + beta: per-sample
 *                                                   scale/shift, element-wise gamma/beta (None: 1 and 0)
 *   ln_bwd_sums(isz, dy, x, N, E, scale, shift, gamma, ggrad, bgrad, out)
 *                                                   with xhat = x * scale + shift and g = dy * gamma:
 *                                                   out[:N] = sum g, out[N:] = sum g * xhat per sample;
 *                                                   ggrad += dy * xhat, bgrad += dy element-wise (gamma None:
 *                                                   g = dy, no parameter gradients)
 *   ln_bwd_data(isz, dy, x, N, E, a, b, c, gamma, dx)
 *                                                   dx = a * gamma * dy + b * x + c per sample
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define BLOCK 1024

#define DEFINE_KERNELS(T, V, SFX)                                                                           \
/* a vector of the dtype from p (unaligned), and the dtype broadcast to a vector */                      \
static inline V load_##SFX(const T *p) { V v; memcpy(&v, p, sizeof v); return v; }                       \
static inline void store_##SFX(T *p, V v) { memcpy(p, &v, sizeof v); }                                   \
static inline V bcast_##SFX(T k) { V v = {0}; return v + k; }                                           \
CLONES static void row_stats_##SFX(const T *restrict x, Py_ssize_t R, Py_ssize_t P, double *sum,           \
                                   double *sq)                                                             \
{                                                                                                           \
    const Py_ssize_t W = sizeof(V) / sizeof(T);                                                             \
    for (Py_ssize_t r = 0; r < R; r++) {                                                                    \
        const T *p = x + r * P;                                                                             \
        if (P == 0) { sum[r] = 0.0; sq[r] = 0.0; continue; }                                               \
        const T k = p[0];                                                                                   \
        const V kv = bcast_##SFX(k);                                                                        \
        double a = 0.0, b = 0.0;                                                                            \
        for (Py_ssize_t i0 = 0; i0 < P; i0 += BLOCK) {                                                      \
            Py_ssize_t i1 = i0 + BLOCK < P ? i0 + BLOCK : P, i = i0;                                        \
            V s1 = {0}, s2 = {0};                                                                           \
            for (; i + W <= i1; i += W) { V d = load_##SFX(p + i) - kv; s1 += d; s2 += d * d; }             \
            T t1 = 0, t2 = 0;                                                                               \
            for (; i < i1; i++) { T d = p[i] - k; t1 += d; t2 += d * d; }                                   \
            for (Py_ssize_t l = 0; l < W; l++) { a += (double)s1[l]; b += (double)s2[l]; }                  \
            a += (double)t1; b += (double)t2;                                                               \
        }                                                                                                   \
        const double kd = (double)k, s = a + (double)P * kd;                                                \
        sum[r] = s;                                                                                         \
        /* sum x^2 = sum (x - k)^2 + 2 k sum x - P k^2 */                                                  \
        sq[r] = b + kd * (2.0 * s - (double)P * kd);                                                        \
    }                                                                                                       \
}                                                                                                           \
CLONES static void row_affine_##SFX(const T *restrict x, Py_ssize_t R, Py_ssize_t P, const double *scale,  \
                                    const double *shift, T *restrict y)                                     \
{                                                                                                           \
    for (Py_ssize_t r = 0; r < R; r++) {                                                                    \
        const T *p = x + r * P;                                                                             \
        T *o = y + r * P;                                                                                   \
        const T s = (T)scale[r], h = (T)shift[r];                                                           \
        for (Py_ssize_t i = 0; i < P; i++) o[i] = p[i] * s + h;                                             \
    }                                                                                                       \
}                                                                                                           \
CLONES static void row_bwd_sums_##SFX(const T *restrict dy, const T *restrict x, Py_ssize_t R,             \
                                      Py_ssize_t P, const double *mean, double *sdy, double *sdyxc)        \
{                                                                                                           \
    const Py_ssize_t W = sizeof(V) / sizeof(T);                                                             \
    for (Py_ssize_t r = 0; r < R; r++) {                                                                    \
        const T *g = dy + r * P, *p = x + r * P;                                                            \
        const T m = (T)mean[r];                                                                             \
        const V mv = bcast_##SFX(m);                                                                        \
        double a = 0.0, b = 0.0;                                                                            \
        for (Py_ssize_t i0 = 0; i0 < P; i0 += BLOCK) {                                                      \
            Py_ssize_t i1 = i0 + BLOCK < P ? i0 + BLOCK : P, i = i0;                                        \
            V s1 = {0}, s2 = {0};                                                                           \
            for (; i + W <= i1; i += W) {                                                                   \
                V gv = load_##SFX(g + i);                                                                   \
                s1 += gv; s2 += gv * (load_##SFX(p + i) - mv);                                              \
            }                                                                                               \
            T t1 = 0, t2 = 0;                                                                               \
            for (; i < i1; i++) { t1 += g[i]; t2 += g[i] * (p[i] - m); }                                    \
            for (Py_ssize_t l = 0; l < W; l++) { a += (double)s1[l]; b += (double)s2[l]; }                  \
            a += (double)t1; b += (double)t2;                                                               \
        }                                                                                                   \
        sdy[r] = a;                                                                                         \
        /* the sums were taken about the mean rounded to the dtype */                                      \
        sdyxc[r] = b + ((double)m - mean[r]) * a;                                                           \
    }                                                                                                       \
}                                                                                                           \
CLONES static void row_axpbyc_##SFX(const T *restrict dy, const T *restrict x, Py_ssize_t R, Py_ssize_t P, \
                                    const double *a, const double *b, const double *c, T *restrict dx)     \
{                                                                                                           \
    for (Py_ssize_t r = 0; r < R; r++) {                                                                    \
        const T *g = dy + r * P, *p = x + r * P;                                                            \
        T *o = dx + r * P;                                                                                  \
        const T ka = (T)a[r], kb = (T)b[r], kc = (T)c[r];                                                   \
        for (Py_ssize_t i = 0; i < P; i++) o[i] = g[i] * ka + p[i] * kb + kc;                               \
    }                                                                                                       \
}                                                                                                           \
CLONES static void ln_fwd_##SFX(const T *restrict x, Py_ssize_t N, Py_ssize_t E, const double *scale,      \
                                const double *shift, const T *restrict gamma, const T *restrict beta,      \
                                T *restrict y)                                                              \
{                                                                                                           \
    for (Py_ssize_t n = 0; n < N; n++) {                                                                    \
        const T *p = x + n * E;                                                                             \
        T *o = y + n * E;                                                                                   \
        const T s = (T)scale[n], h = (T)shift[n];                                                           \
        if (gamma)                                                                                          \
            for (Py_ssize_t e = 0; e < E; e++) o[e] = (p[e] * s + h) * gamma[e] + beta[e];                  \
        else                                                                                                \
            for (Py_ssize_t e = 0; e < E; e++) o[e] = p[e] * s + h;                                         \
    }                                                                                                       \
}                                                                                                           \
CLONES static void ln_bwd_sums_##SFX(const T *restrict dy, const T *restrict x, Py_ssize_t N,              \
                                     Py_ssize_t E, const double *scale, const double *shift,               \
                                     const T *restrict gamma, T *restrict gg, T *restrict gb,              \
                                     double *s1o, double *s2o)                                              \
{                                                                                                           \
    const Py_ssize_t W = sizeof(V) / sizeof(T);                                                             \
    for (Py_ssize_t n = 0; n < N; n++) {                                                                    \
        const T *g = dy + n * E, *p = x + n * E;                                                            \
        const T s = (T)scale[n], h = (T)shift[n];                                                           \
        const V sv = bcast_##SFX(s), hv = bcast_##SFX(h);                                                   \
        double a = 0.0, b = 0.0;                                                                            \
        for (Py_ssize_t i0 = 0; i0 < E; i0 += BLOCK) {                                                      \
            Py_ssize_t i1 = i0 + BLOCK < E ? i0 + BLOCK : E, i = i0;                                        \
            V s1 = {0}, s2 = {0};                                                                           \
            T t1 = 0, t2 = 0;                                                                               \
            if (gamma) {                                                                                    \
                for (; i + W <= i1; i += W) {                                                               \
                    const V gv = load_##SFX(g + i), xh = load_##SFX(p + i) * sv + hv;                       \
                    const V v = gv * load_##SFX(gamma + i);                                                 \
                    store_##SFX(gg + i, load_##SFX(gg + i) + gv * xh);                                      \
                    store_##SFX(gb + i, load_##SFX(gb + i) + gv);                                           \
                    s1 += v; s2 += v * xh;                                                                  \
                }                                                                                           \
                for (; i < i1; i++) {                                                                       \
                    const T xh = p[i] * s + h, v = g[i] * gamma[i];                                         \
                    gg[i] += g[i] * xh; gb[i] += g[i];                                                      \
                    t1 += v; t2 += v * xh;                                                                  \
                }                                                                                           \
            } else {                                                                                        \
                for (; i + W <= i1; i += W) {                                                               \
                    const V gv = load_##SFX(g + i), xh = load_##SFX(p + i) * sv + hv;                       \
                    s1 += gv; s2 += gv * xh;                                                                \
                }                                                                                           \
                for (; i < i1; i++) { const T xh = p[i] * s + h; t1 += g[i]; t2 += g[i] * xh; }             \
            }                                                                                               \
            for (Py_ssize_t l = 0; l < W; l++) { a += (double)s1[l]; b += (double)s2[l]; }                  \
            a += (double)t1; b += (double)t2;                                                               \
        }                                                                                                   \
        s1o[n] = a; s2o[n] = b;                                                                             \
    }                                                                                                       \
}                                                                                                           \
CLONES static void ln_bwd_data_##SFX(const T *restrict dy, const T *restrict x, Py_ssize_t N, Py_ssize_t E, \
                                     const double *a, const double *b, const double *c,                    \
                                     const T *restrict gamma, T *restrict dx)                               \
{                                                                                                           \
    for (Py_ssize_t n = 0; n < N; n++) {                                                                    \
        const T *g = dy + n * E, *p = x + n * E;                                                            \
        T *o = dx + n * E;                                                                                  \
        const T ka = (T)a[n], kb = (T)b[n], kc = (T)c[n];                                                   \
        if (gamma)                                                                                          \
            for (Py_ssize_t e = 0; e < E; e++) o[e] = g[e] * (ka * gamma[e]) + p[e] * kb + kc;              \
        else                                                                                                \
            for (Py_ssize_t e = 0; e < E; e++) o[e] = g[e] * ka + p[e] * kb + kc;                           \
    }                                                                                                       \
}

/* 64-byte vectors: one AVX-512 register, two AVX2 or four SSE registers in the other clones */
typedef float vf_t __attribute__((vector_size(64)));
typedef double vd_t __attribute__((vector_size(64)));

DEFINE_KERNELS(float, vf_t, f)
DEFINE_KERNELS(double, vd_t, d)

/* ------------------------------------------------------------------------------------------ arguments */
typedef struct { Py_buffer b[12]; int n; } Bufs;

static void
release(Bufs *bs)
{
    for (int i = 0; i < bs->n; i++) PyBuffer_Release(&bs->b[i]);
    bs->n = 0;
}

/* the buffer of o (None allowed when optional: *p = NULL) of at least `bytes` bytes, C-contiguous */
static int
get(Bufs *bs, PyObject *o, int writable, Py_ssize_t bytes, const char *what, int optional, void **p)
{
    if (o == Py_None && optional) { *p = NULL; return 0; }
    Py_buffer *b = &bs->b[bs->n];
    if (PyObject_GetBuffer(o, b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) return -1;
    bs->n++;
    if (b->len < bytes) {
        PyErr_Format(PyExc_ValueError, "norm kernels: %s has %zd bytes, needs %zd", what, b->len, bytes);
        return -1;
    }
    *p = b->buf;
    return 0;
}

static int
item_size(int isz)
{
    if (isz != 4 && isz != 8) {
        PyErr_Format(PyExc_ValueError, "norm kernels: item size %d (float32 or float64 only)", isz);
        return -1;
    }
    return 0;
}

#define DISPATCH(call_f, call_d)                                                                            \
    Py_BEGIN_ALLOW_THREADS                                                                                  \
    if (isz == 4) call_f; else call_d;                                                                      \
    Py_END_ALLOW_THREADS

static PyObject *
py_row_stats(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t R, P;
    PyObject *ox, *oo;
    void *x, *o;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOnnO", &isz, &ox, &R, &P, &oo) || item_size(isz) < 0) return NULL;
    if (get(&bs, ox, 0, R * P * isz, "input", 0, &x) < 0 || get(&bs, oo, 1, 2 * R * 8, "out", 0, &o) < 0) {
        release(&bs);
        return NULL;
    }
    double *out = o;
    DISPATCH(row_stats_f(x, R, P, out, out + R), row_stats_d(x, R, P, out, out + R))
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *
py_row_affine(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t R, P;
    PyObject *ox, *os, *oh, *oy;
    void *x, *s, *h, *y;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOnnOOO", &isz, &ox, &R, &P, &os, &oh, &oy) || item_size(isz) < 0)
        return NULL;
    if (get(&bs, ox, 0, R * P * isz, "input", 0, &x) < 0 || get(&bs, os, 0, R * 8, "scale", 0, &s) < 0 ||
        get(&bs, oh, 0, R * 8, "shift", 0, &h) < 0 || get(&bs, oy, 1, R * P * isz, "output", 0, &y) < 0) {
        release(&bs);
        return NULL;
    }
    DISPATCH(row_affine_f(x, R, P, s, h, y), row_affine_d(x, R, P, s, h, y))
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *
py_row_bwd_sums(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t R, P;
    PyObject *ody, *ox, *om, *oo;
    void *dy, *x, *m, *o;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOOnnOO", &isz, &ody, &ox, &R, &P, &om, &oo) || item_size(isz) < 0)
        return NULL;
    if (get(&bs, ody, 0, R * P * isz, "gradient", 0, &dy) < 0 || get(&bs, ox, 0, R * P * isz, "input", 0, &x) < 0
        || get(&bs, om, 0, R * 8, "mean", 0, &m) < 0 || get(&bs, oo, 1, 2 * R * 8, "out", 0, &o) < 0) {
        release(&bs);
        return NULL;
    }
    double *out = o;
    DISPATCH(row_bwd_sums_f(dy, x, R, P, m, out, out + R), row_bwd_sums_d(dy, x, R, P, m, out, out + R))
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *
py_row_axpbyc(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t R, P;
    PyObject *ody, *ox, *oa, *ob, *oc, *odx;
    void *dy, *x, *a, *b, *c, *dx;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOOnnOOOO", &isz, &ody, &ox, &R, &P, &oa, &ob, &oc, &odx) ||
        item_size(isz) < 0)
        return NULL;
    if (get(&bs, ody, 0, R * P * isz, "gradient", 0, &dy) < 0 || get(&bs, ox, 0, R * P * isz, "input", 0, &x) < 0
        || get(&bs, oa, 0, R * 8, "a", 0, &a) < 0 || get(&bs, ob, 0, R * 8, "b", 0, &b) < 0
        || get(&bs, oc, 0, R * 8, "c", 0, &c) < 0 || get(&bs, odx, 1, R * P * isz, "output", 0, &dx) < 0) {
        release(&bs);
        return NULL;
    }
    DISPATCH(row_axpbyc_f(dy, x, R, P, a, b, c, dx), row_axpbyc_d(dy, x, R, P, a, b, c, dx))
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *
py_ln_fwd(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t N, E;
    PyObject *ox, *os, *oh, *og, *ob, *oy;
    void *x, *s, *h, *g, *b, *y;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOnnOOOOO", &isz, &ox, &N, &E, &os, &oh, &og, &ob, &oy) || item_size(isz) < 0)
        return NULL;
    if (get(&bs, ox, 0, N * E * isz, "input", 0, &x) < 0 || get(&bs, os, 0, N * 8, "scale", 0, &s) < 0 ||
        get(&bs, oh, 0, N * 8, "shift", 0, &h) < 0 || get(&bs, og, 0, E * isz, "gamma", 1, &g) < 0 ||
        get(&bs, ob, 0, E * isz, "beta", 1, &b) < 0 || get(&bs, oy, 1, N * E * isz, "output", 0, &y) < 0) {
        release(&bs);
        return NULL;
    }
    if ((g == NULL) != (b == NULL)) {
        release(&bs);
        PyErr_SetString(PyExc_ValueError, "norm kernels: gamma and beta go together");
        return NULL;
    }
    DISPATCH(ln_fwd_f(x, N, E, s, h, g, b, y), ln_fwd_d(x, N, E, s, h, g, b, y))
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *
py_ln_bwd_sums(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t N, E;
    PyObject *ody, *ox, *os, *oh, *og, *ogg, *ogb, *oo;
    void *dy, *x, *s, *h, *g, *gg, *gb, *o;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOOnnOOOOOO", &isz, &ody, &ox, &N, &E, &os, &oh, &og, &ogg, &ogb, &oo) ||
        item_size(isz) < 0)
        return NULL;
    if (get(&bs, ody, 0, N * E * isz, "gradient", 0, &dy) < 0 || get(&bs, ox, 0, N * E * isz, "input", 0, &x) < 0
        || get(&bs, os, 0, N * 8, "scale", 0, &s) < 0 || get(&bs, oh, 0, N * 8, "shift", 0, &h) < 0
        || get(&bs, og, 0, E * isz, "gamma", 1, &g) < 0 || get(&bs, ogg, 1, E * isz, "gamma grad", 1, &gg) < 0
        || get(&bs, ogb, 1, E * isz, "beta grad", 1, &gb) < 0 || get(&bs, oo, 1, 2 * N * 8, "out", 0, &o) < 0) {
        release(&bs);
        return NULL;
    }
    if ((g == NULL) != (gg == NULL) || (g == NULL) != (gb == NULL)) {
        release(&bs);
        PyErr_SetString(PyExc_ValueError, "norm kernels: gamma and its gradients go together");
        return NULL;
    }
    double *out = o;
    DISPATCH(ln_bwd_sums_f(dy, x, N, E, s, h, g, gg, gb, out, out + N),
             ln_bwd_sums_d(dy, x, N, E, s, h, g, gg, gb, out, out + N))
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *
py_ln_bwd_data(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t N, E;
    PyObject *ody, *ox, *oa, *ob, *oc, *og, *odx;
    void *dy, *x, *a, *b, *c, *g, *dx;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOOnnOOOOO", &isz, &ody, &ox, &N, &E, &oa, &ob, &oc, &og, &odx) ||
        item_size(isz) < 0)
        return NULL;
    if (get(&bs, ody, 0, N * E * isz, "gradient", 0, &dy) < 0 || get(&bs, ox, 0, N * E * isz, "input", 0, &x) < 0
        || get(&bs, oa, 0, N * 8, "a", 0, &a) < 0 || get(&bs, ob, 0, N * 8, "b", 0, &b) < 0
        || get(&bs, oc, 0, N * 8, "c", 0, &c) < 0 || get(&bs, og, 0, E * isz, "gamma", 1, &g) < 0
        || get(&bs, odx, 1, N * E * isz, "output", 0, &dx) < 0) {
        release(&bs);
        return NULL;
    }
    DISPATCH(ln_bwd_data_f(dy, x, N, E, a, b, c, g, dx), ln_bwd_data_d(dy, x, N, E, a, b, c, g, dx))
    release(&bs);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"row_stats", py_row_stats, METH_VARARGS, "per-row sum and sum of squares (float64)"},
    {"row_affine", py_row_affine, METH_VARARGS, "y = x * scale + shift per row"},
    {"row_bwd_sums", py_row_bwd_sums, METH_VARARGS, "per-row sum dy and sum dy * (x - mean) (float64)"},
    {"row_axpbyc", py_row_axpbyc, METH_VARARGS, "dx = a * dy + b * x + c per row"},
    {"ln_fwd", py_ln_fwd, METH_VARARGS, "layer norm forward with an element-wise scale and shift"},
    {"ln_bwd_sums", py_ln_bwd_sums, METH_VARARGS, "layer norm backward sums and parameter gradients"},
    {"ln_bwd_data", py_ln_bwd_data, METH_VARARGS, "layer norm data gradient"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cnorm", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__cnorm(void)
{
    return PyModule_Create(&module);
}
