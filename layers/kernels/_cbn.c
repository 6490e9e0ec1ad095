/* Compiled batch-normalisation and ReLU kernels (float32 and float64, C-contiguous (N, C, P) blocks).
 *
 * Arrays come as NumPy arrays (buffers); lbannpy.layers.kernels.batchnorm checks dtypes (the block's float32
 * or float64; per-channel vectors float64), shapes and C-contiguity before calling. Accumulation is in
 * double throughout; per-channel coefficients are formed in double and rounded to the dtype once.
 *
 *   stats(isz, x, N, C, P, out)          out[:C] = sum x, out[C:] = sum x^2 per channel, one pass; each
 *                                        (sample, channel) row is accumulated about its first element (a
 *                                        shift that keeps the squares' spread exact)
 *   forward(isz, x, N, C, P, mean, var, gamma, beta, eps, relu, y)
 *                                        y = x * scale + shift per channel (dtype arithmetic), then with
 *                                        relu max(y, 0) (NaN stays NaN, as NumPy's maximum)
 *   train_fwd(isz, x, N, C, P, tot, count, gamma, beta, eps, relu, momentum, rmean, rvar, st, y)
 *                                        forward of a training step from the reduced sums: mean, variance and
 *                                        the moved running statistics into st, y as forward (sizes checked)
 *   bwd_sums(isz, dy, x, y, N, C, P, mean, var, eps, out)
 *                                        out[:C] = sum g, out[C:] = sum g * xhat, one pass, with g = dy
 *                                        where y > 0 (y None: g = dy)
 *   bwd_data(isz, dy, x, y, N, C, P, mean, var, gamma, eps, tot, count, dx)
 *                                        dx = a * g + b * x + c per channel from the reduced sums tot
 *   relu_bwd(isz, dy, y, n, dx)          dx = dy where y > 0, else 0
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8

#define DEFINE_KERNELS(T, IT, SFX)                                                                          \
/* g where y > 0, else 0, without a branch (a mask on the bits: vectorises, no misprediction) */         \
static inline T keep_##SFX(T g, T y)                                                                    \
{                                                                                                       \
    IT bits;                                                                                            \
    memcpy(&bits, &g, sizeof bits);                                                                     \
    bits &= (IT)0 - (IT)(y > (T)0);                                                                     \
    memcpy(&g, &bits, sizeof g);                                                                        \
    return g;                                                                                           \
}                                                                                                       \
static void stats_##SFX(const T *x, Py_ssize_t N, Py_ssize_t C, Py_ssize_t P, double *sum, double *sq)  \
{                                                                                                       \
    for (Py_ssize_t c = 0; c < C; c++) { sum[c] = 0.0; sq[c] = 0.0; }                                   \
    if (P == 0) return;                                                                                 \
    for (Py_ssize_t n = 0; n < N; n++) {                                                                \
        for (Py_ssize_t c = 0; c < C; c++) {                                                            \
            const T *r = x + (n * C + c) * P;                                                           \
            double k = (double)r[0], s1[LANES] = {0}, s2[LANES] = {0};                                  \
            Py_ssize_t i = 0;                                                                           \
            for (; i + LANES <= P; i += LANES)                                                          \
                for (int l = 0; l < LANES; l++) {                                                       \
                    double d = (double)r[i + l] - k;                                                    \
                    s1[l] += d; s2[l] += d * d;                                                         \
                }                                                                                       \
            for (; i < P; i++) { double d = (double)r[i] - k; s1[0] += d; s2[0] += d * d; }             \
            double a = 0.0, b = 0.0;                                                                    \
            for (int l = 0; l < LANES; l++) { a += s1[l]; b += s2[l]; }                                 \
            double rs = a + (double)P * k;                                                              \
            sum[c] += rs;                                                                               \
            /* sum x^2 = sum (x - k)^2 + 2 k sum x - P k^2 */                                          \
            sq[c] += b + k * (2.0 * rs - (double)P * k);                                                \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
static void affine_##SFX(const T *x, Py_ssize_t N, Py_ssize_t C, Py_ssize_t P, const double *scale,     \
                         const double *shift, T *y, int relu)                                           \
{                                                                                                       \
    for (Py_ssize_t n = 0; n < N; n++)                                                                  \
        for (Py_ssize_t c = 0; c < C; c++) {                                                            \
            const T *r = x + (n * C + c) * P;                                                           \
            T *o = y + (n * C + c) * P;                                                                 \
            const T s = (T)scale[c], h = (T)shift[c], z = (T)0;                                         \
            if (relu)                                                                                   \
                for (Py_ssize_t i = 0; i < P; i++) { T v = r[i] * s + h; o[i] = v < z ? z : v; }        \
            else                                                                                        \
                for (Py_ssize_t i = 0; i < P; i++) o[i] = r[i] * s + h;                                 \
        }                                                                                               \
}                                                                                                       \
static void bwd_sums_##SFX(const T *dy, const T *x, const T *y, Py_ssize_t N, Py_ssize_t C,             \
                           Py_ssize_t P, const double *mean, double *sdy, double *sdyxc)                \
{                                                                                                       \
    for (Py_ssize_t c = 0; c < C; c++) { sdy[c] = 0.0; sdyxc[c] = 0.0; }                                \
    for (Py_ssize_t n = 0; n < N; n++)                                                                  \
        for (Py_ssize_t c = 0; c < C; c++) {                                                            \
            Py_ssize_t o = (n * C + c) * P;                                                             \
            const T *g = dy + o, *r = x + o;                                                            \
            const double m = mean[c];                                                                   \
            double s1[LANES] = {0}, s2[LANES] = {0};                                                    \
            Py_ssize_t i = 0;                                                                           \
            if (y) {                                                                                    \
                const T *q = y + o;                                                                     \
                for (; i + LANES <= P; i += LANES)                                                      \
                    for (int l = 0; l < LANES; l++) {                                                   \
                        T t = keep_##SFX(g[i + l], q[i + l]);                                    \
                        double v = (double)t;                            \
                        s1[l] += v; s2[l] += v * ((double)r[i + l] - m);                                \
                    }                                                                                   \
                for (; i < P; i++) {                                                                    \
                    T t = keep_##SFX(g[i], q[i]);                                                  \
                    double v = (double)t;                                        \
                    s1[0] += v; s2[0] += v * ((double)r[i] - m);                                        \
                }                                                                                       \
            } else {                                                                                    \
                for (; i + LANES <= P; i += LANES)                                                      \
                    for (int l = 0; l < LANES; l++) {                                                   \
                        double v = (double)g[i + l];                                                    \
                        s1[l] += v; s2[l] += v * ((double)r[i + l] - m);                                \
                    }                                                                                   \
                for (; i < P; i++) {                                                                    \
                    double v = (double)g[i];                                                            \
                    s1[0] += v; s2[0] += v * ((double)r[i] - m);                                        \
                }                                                                                       \
            }                                                                                           \
            double a = 0.0, b = 0.0;                                                                    \
            for (int l = 0; l < LANES; l++) { a += s1[l]; b += s2[l]; }                                 \
            sdy[c] += a; sdyxc[c] += b;                                                                 \
        }                                                                                               \
}                                                                                                       \
static void bwd_data_##SFX(const T *dy, const T *x, const T *y, Py_ssize_t N, Py_ssize_t C,             \
                           Py_ssize_t P, const double *a, const double *b, const double *c_, T *dx)     \
{                                                                                                       \
    for (Py_ssize_t n = 0; n < N; n++)                                                                  \
        for (Py_ssize_t c = 0; c < C; c++) {                                                            \
            Py_ssize_t o = (n * C + c) * P;                                                             \
            const T *g = dy + o, *r = x + o;                                                            \
            T *d = dx + o;                                                                              \
            const T ka = (T)a[c], kb = (T)b[c], kc = (T)c_[c], z = (T)0;                                \
            if (y) {                                                                                    \
                const T *q = y + o;                                                                     \
                for (Py_ssize_t i = 0; i < P; i++) {                                                    \
                    T gi = g[i], v = q[i] > z ? gi : z;                                                          \
                    d[i] = v * ka + r[i] * kb + kc;                                                     \
                }                                                                                       \
            } else                                                                                      \
                for (Py_ssize_t i = 0; i < P; i++) d[i] = g[i] * ka + r[i] * kb + kc;                   \
        }                                                                                               \
}                                                                                                       \
static void relu_bwd_##SFX(const T *dy, const T *y, Py_ssize_t n, T *dx)                                \
{                                                                                                       \
    const T z = (T)0;                                                                                   \
    for (Py_ssize_t i = 0; i < n; i++) { T gi = dy[i]; dx[i] = y[i] > z ? gi : z; }                                    \
}

DEFINE_KERNELS(float, uint32_t, f)
DEFINE_KERNELS(double, uint64_t, d)

/* Arguments are NumPy arrays (buffers): the caller checks dtype and C-contiguity. */
typedef struct { Py_buffer b[8]; int n; } Bufs;

static int
get(Bufs *bs, PyObject *o, int writable, void **p)
{
    if (o == Py_None) { *p = NULL; return 0; }
    if (PyObject_GetBuffer(o, &bs->b[bs->n], writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS
                                                       : PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    *p = bs->b[bs->n++].buf;
    return 0;
}

static void
release(Bufs *bs)
{
    for (int i = 0; i < bs->n; i++) PyBuffer_Release(&bs->b[i]);
}

/* get() of a buffer that must hold exactly `bytes` bytes (None passes where `optional`) */
static int
get_sized(Bufs *bs, PyObject *o, int writable, Py_ssize_t bytes, const char *what, int optional, void **p)
{
    if (o == Py_None && !optional) {
        PyErr_Format(PyExc_ValueError, "batchnorm: %s is required", what);
        return -1;
    }
    if (get(bs, o, writable, p) < 0)
        return -1;
    if (*p && bs->b[bs->n - 1].len != bytes) {
        PyErr_Format(PyExc_ValueError, "batchnorm: %s holds %zd bytes, not %zd", what, bs->b[bs->n - 1].len,
                     bytes);
        return -1;
    }
    return 0;
}

/* per-channel affine of the forward: scale = gamma / sqrt(var + eps), shift = beta - mean * scale */
static void
scale_shift(Py_ssize_t C, const double *mean, const double *var, const double *gamma, const double *beta,
            double eps, double *scale, double *shift)
{
    for (Py_ssize_t c = 0; c < C; c++) {
        double inv = 1.0 / sqrt(var[c] + eps);
        scale[c] = gamma[c] * inv;
        shift[c] = (beta ? beta[c] : 0.0) - mean[c] * scale[c];
    }
}

/* the forward's end: y = x * scale + shift per channel (then max(y, 0) with relu) from the statistics;
 * ss (the caller's PyMem buffer of at least 2C doubles) is freed and the buffers released here */
static PyObject *
normalise(Bufs *bs, int isz, const void *x, Py_ssize_t N, Py_ssize_t C, Py_ssize_t P, const double *mean,
          const double *var, const double *gamma, const double *beta, double eps, int relu, void *y, double *ss)
{
    scale_shift(C, mean, var, gamma, beta, eps, ss, ss + C);
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4) affine_f(x, N, C, P, ss, ss + C, y, relu);
    else affine_d(x, N, C, P, ss, ss + C, y, relu);
    Py_END_ALLOW_THREADS
    PyMem_Free(ss);
    release(bs);
    Py_RETURN_NONE;
}

static PyObject *
py_stats(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t N, C, P;
    PyObject *ox, *oo;
    void *x, *o;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOnnnO", &isz, &ox, &N, &C, &P, &oo))
        return NULL;
    if (get(&bs, ox, 0, &x) < 0 || get(&bs, oo, 1, &o) < 0) { release(&bs); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4) stats_f(x, N, C, P, o, (double *)o + C);
    else stats_d(x, N, C, P, o, (double *)o + C);
    Py_END_ALLOW_THREADS
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *
py_forward(PyObject *self, PyObject *args)
{
    int isz, relu;
    Py_ssize_t N, C, P;
    double eps;
    PyObject *ox, *om, *ov, *og, *ob, *oy;
    void *x, *m, *v, *g, *b, *y;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOnnnOOOOdiO", &isz, &ox, &N, &C, &P, &om, &ov, &og, &ob, &eps, &relu, &oy))
        return NULL;
    if (get(&bs, ox, 0, &x) < 0 || get(&bs, om, 0, &m) < 0 || get(&bs, ov, 0, &v) < 0 ||
        get(&bs, og, 0, &g) < 0 || get(&bs, ob, 0, &b) < 0 || get(&bs, oy, 1, &y) < 0) {
        release(&bs);
        return NULL;
    }
    double *ss = PyMem_Malloc(2 * (C ? C : 1) * sizeof(double));
    if (!ss) { release(&bs); return PyErr_NoMemory(); }
    return normalise(&bs, isz, x, N, C, P, m, v, g, b, eps, relu, y, ss);
}

/* The training forward from the reduced sums tot (sum x, then sum x^2 per channel, over `count` values each):
 * st[:C] = mean, st[C:2C] = biased variance (negative round-off clipped to 0), st[2C:3C] and st[3C:] the
 * running mean and unbiased variance moved from rmean, rvar by `momentum`; y as forward. gamma and beta (or
 * None) are of x's item size; every buffer's size is checked here. The arithmetic is bn_mean_var's, the
 * layer's running update's and forward's, in the same order. */
static PyObject *
py_train_fwd(PyObject *self, PyObject *args)
{
    int isz, relu;
    Py_ssize_t N, C, P;
    double count, eps, mom;
    PyObject *ox, *ot, *og, *ob, *orm, *orv, *ost, *oy;
    void *x, *t, *g, *b, *rm, *rv, *st, *y;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOnnnOdOOdidOOOO", &isz, &ox, &N, &C, &P, &ot, &count, &og, &ob, &eps, &relu,
                          &mom, &orm, &orv, &ost, &oy))
        return NULL;
    if (isz != 4 && isz != 8) {
        PyErr_Format(PyExc_ValueError, "batchnorm: itemsize %d", isz);
        return NULL;
    }
    const Py_ssize_t X = N * C * P * isz, D = C * (Py_ssize_t)sizeof(double);
    if (get_sized(&bs, ox, 0, X, "input", 0, &x) < 0 || get_sized(&bs, ot, 0, 2 * D, "sums", 0, &t) < 0
        || get_sized(&bs, og, 0, C * isz, "scale", 0, &g) < 0
        || get_sized(&bs, ob, 0, C * isz, "shift", 1, &b) < 0
        || get_sized(&bs, orm, 0, D, "running mean", 0, &rm) < 0
        || get_sized(&bs, orv, 0, D, "running variance", 0, &rv) < 0
        || get_sized(&bs, ost, 1, 4 * D, "statistics", 0, &st) < 0
        || get_sized(&bs, oy, 1, X, "output", 0, &y) < 0) {
        release(&bs);
        return NULL;
    }
    double *ss = PyMem_Malloc(4 * (C ? C : 1) * sizeof(double));
    if (!ss) { release(&bs); return PyErr_NoMemory(); }
    const double *tot = t, *rmean = rm, *rvar = rv, unb = count / (count - 1.0 > 1.0 ? count - 1.0 : 1.0);
    double *mean = st, *var = mean + C, *nrm = var + C, *nrv = nrm + C, *gd = ss + 2 * C, *bd = ss + 3 * C;
    for (Py_ssize_t c = 0; c < C; c++) {
        mean[c] = tot[c] / count;
        double v = tot[C + c] / count - mean[c] * mean[c];
        var[c] = v < 0.0 ? 0.0 : v;
        nrm[c] = (1 - mom) * rmean[c] + mom * mean[c];
        nrv[c] = (1 - mom) * rvar[c] + mom * (var[c] * unb);
        gd[c] = isz == 4 ? (double)((const float *)g)[c] : ((const double *)g)[c];
        bd[c] = !b ? 0.0 : isz == 4 ? (double)((const float *)b)[c] : ((const double *)b)[c];
    }
    return normalise(&bs, isz, x, N, C, P, mean, var, gd, bd, eps, relu, y, ss);
}

/* the backward's local sums: out[:C] = sum g, out[C:] = sum g * xhat (g: dy masked by y when given) */
static PyObject *
py_bwd_sums(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t N, C, P;
    double eps;
    PyObject *ody, *ox, *oy, *om, *ov, *oo;
    void *dy, *x, *y, *m, *v, *o;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOOOnnnOOdO", &isz, &ody, &ox, &oy, &N, &C, &P, &om, &ov, &eps, &oo))
        return NULL;
    if (get(&bs, ody, 0, &dy) < 0 || get(&bs, ox, 0, &x) < 0 || get(&bs, oy, 0, &y) < 0 ||
        get(&bs, om, 0, &m) < 0 || get(&bs, ov, 0, &v) < 0 || get(&bs, oo, 1, &o) < 0) {
        release(&bs);
        return NULL;
    }
    double *out = o;
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4) bwd_sums_f(dy, x, y, N, C, P, m, out, out + C);
    else bwd_sums_d(dy, x, y, N, C, P, m, out, out + C);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t c = 0; c < C; c++) out[C + c] /= sqrt(((const double *)v)[c] + eps);
    release(&bs);
    Py_RETURN_NONE;
}

/* dx = k * (g - sum_dy / count - xhat * sum_dy_xhat / count), k = gamma / sigma, as a * g + b * x + c */
static PyObject *
py_bwd_data(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t N, C, P;
    double eps, count;
    PyObject *ody, *ox, *oy, *om, *ov, *og, *ot, *odx;
    void *dy, *x, *y, *m, *v, *g, *t, *dx;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOOOnnnOOOdOdO", &isz, &ody, &ox, &oy, &N, &C, &P, &om, &ov, &og, &eps, &ot,
                          &count, &odx))
        return NULL;
    if (get(&bs, ody, 0, &dy) < 0 || get(&bs, ox, 0, &x) < 0 || get(&bs, oy, 0, &y) < 0 ||
        get(&bs, om, 0, &m) < 0 || get(&bs, ov, 0, &v) < 0 || get(&bs, og, 0, &g) < 0) {
        release(&bs);
        return NULL;
    }
    Bufs bs2 = {.n = 0};
    if (get(&bs2, ot, 0, &t) < 0 || get(&bs2, odx, 1, &dx) < 0) {
        release(&bs); release(&bs2);
        return NULL;
    }
    double *abc = PyMem_Malloc(3 * (C ? C : 1) * sizeof(double));
    if (!abc) { release(&bs); release(&bs2); return PyErr_NoMemory(); }
    const double *mean = m, *var = v, *gamma = g, *tot = t;
    for (Py_ssize_t c = 0; c < C; c++) {
        double inv = 1.0 / sqrt(var[c] + eps), k = gamma[c] * inv;
        double b = -k * inv * tot[C + c] / count;
        abc[c] = k;
        abc[C + c] = b;
        abc[2 * C + c] = -k * tot[c] / count - b * mean[c];
    }
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4) bwd_data_f(dy, x, y, N, C, P, abc, abc + C, abc + 2 * C, dx);
    else bwd_data_d(dy, x, y, N, C, P, abc, abc + C, abc + 2 * C, dx);
    Py_END_ALLOW_THREADS
    PyMem_Free(abc);
    release(&bs); release(&bs2);
    Py_RETURN_NONE;
}

static PyObject *
py_relu_bwd(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t n;
    PyObject *ody, *oy, *odx;
    void *dy, *y, *dx;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOOnO", &isz, &ody, &oy, &n, &odx))
        return NULL;
    if (get(&bs, ody, 0, &dy) < 0 || get(&bs, oy, 0, &y) < 0 || get(&bs, odx, 1, &dx) < 0) {
        release(&bs);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4) relu_bwd_f(dy, y, n, dx);
    else relu_bwd_d(dy, y, n, dx);
    Py_END_ALLOW_THREADS
    release(&bs);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"stats", py_stats, METH_VARARGS, "per-channel sum and sum of squares (double), one pass"},
    {"forward", py_forward, METH_VARARGS, "y = gamma * (x - mean) / sigma + beta per channel, optionally max(y, 0)"},
    {"train_fwd", py_train_fwd, METH_VARARGS, "statistics, running statistics and forward from reduced sums"},
    {"bwd_sums", py_bwd_sums, METH_VARARGS, "per-channel sum g and sum g * (x - mean), one pass"},
    {"bwd_data", py_bwd_data, METH_VARARGS, "dx = a * g + b * x + c per channel"},
    {"relu_bwd", py_relu_bwd, METH_VARARGS, "dx = dy where y > 0, else 0"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cbn", "Compiled batch-normalisation and ReLU kernels (see _cbn.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__cbn(void)
{
    return PyModule_Create(&module);
}
