/* Compiled batch-normalisation and ReLU kernels (float32 and float64, C-contiguous (N, C, P) blocks).
 *
 * Every function takes raw addresses (Python ints) and sizes; lbannpy.layers.kernels.batchnorm checks
 * dtypes, shapes and contiguity before calling. Accumulation is in double throughout.
 *
 *   stats(isz, x, N, C, P, sum, sq)              per channel: sum x and sum x^2 (double (C,)), one pass;
 *                                                each (sample, channel) row is accumulated about its first
 *                                                element (a shift that keeps the squares' spread exact)
 *   affine(isz, x, N, C, P, scale, shift, y, relu)  y = x * scale + shift per channel (dtype arithmetic
 *                                                with the scale/shift rounded to the dtype), then max(y, 0)
 *                                                (NaN stays NaN, as NumPy's maximum)
 *   bwd_sums(isz, dy, x, y, N, C, P, mean, sdy, sdyxc)  per channel: sum g and sum g * (x - mean) with
 *                                                g = dy where y > 0 (y == 0 address: g = dy), one pass
 *   bwd_data(isz, dy, x, y, N, C, P, a, b, c, dx)   dx = a * g + b * x + c per channel (dtype arithmetic)
 *   relu_bwd(isz, dy, y, n, dx)                  dx = dy where y > 0, else 0
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define LANES 8

#define DEFINE_KERNELS(T, SFX)                                                                            \
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
                        double v = q[i + l] > (T)0 ? (double)g[i + l] : 0.0;                            \
                        s1[l] += v; s2[l] += v * ((double)r[i + l] - m);                                \
                    }                                                                                   \
                for (; i < P; i++) {                                                                    \
                    double v = q[i] > (T)0 ? (double)g[i] : 0.0;                                        \
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
                    T v = q[i] > z ? g[i] : z;                                                          \
                    d[i] = v * ka + r[i] * kb + kc;                                                     \
                }                                                                                       \
            } else                                                                                      \
                for (Py_ssize_t i = 0; i < P; i++) d[i] = g[i] * ka + r[i] * kb + kc;                   \
        }                                                                                               \
}                                                                                                       \
static void relu_bwd_##SFX(const T *dy, const T *y, Py_ssize_t n, T *dx)                                \
{                                                                                                       \
    const T z = (T)0;                                                                                   \
    for (Py_ssize_t i = 0; i < n; i++) dx[i] = y[i] > z ? dy[i] : z;                                    \
}

DEFINE_KERNELS(float, f)
DEFINE_KERNELS(double, d)

#define PTR(T, v) ((T *)(uintptr_t)(v))

static PyObject *
py_stats(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t x, N, C, P, s, q;
    if (!PyArg_ParseTuple(args, "innnnnn", &isz, &x, &N, &C, &P, &s, &q))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4) stats_f(PTR(float, x), N, C, P, PTR(double, s), PTR(double, q));
    else stats_d(PTR(double, x), N, C, P, PTR(double, s), PTR(double, q));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
py_affine(PyObject *self, PyObject *args)
{
    int isz, relu;
    Py_ssize_t x, N, C, P, sc, sh, y;
    if (!PyArg_ParseTuple(args, "innnnnnni", &isz, &x, &N, &C, &P, &sc, &sh, &y, &relu))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4) affine_f(PTR(float, x), N, C, P, PTR(double, sc), PTR(double, sh), PTR(float, y), relu);
    else affine_d(PTR(double, x), N, C, P, PTR(double, sc), PTR(double, sh), PTR(double, y), relu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
py_bwd_sums(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t dy, x, y, N, C, P, m, s1, s2;
    if (!PyArg_ParseTuple(args, "innnnnnnnn", &isz, &dy, &x, &y, &N, &C, &P, &m, &s1, &s2))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        bwd_sums_f(PTR(float, dy), PTR(float, x), PTR(float, y), N, C, P, PTR(double, m), PTR(double, s1),
                   PTR(double, s2));
    else
        bwd_sums_d(PTR(double, dy), PTR(double, x), PTR(double, y), N, C, P, PTR(double, m),
                   PTR(double, s1), PTR(double, s2));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
py_bwd_data(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t dy, x, y, N, C, P, a, b, c, dx;
    if (!PyArg_ParseTuple(args, "innnnnnnnnn", &isz, &dy, &x, &y, &N, &C, &P, &a, &b, &c, &dx))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        bwd_data_f(PTR(float, dy), PTR(float, x), PTR(float, y), N, C, P, PTR(double, a), PTR(double, b),
                   PTR(double, c), PTR(float, dx));
    else
        bwd_data_d(PTR(double, dy), PTR(double, x), PTR(double, y), N, C, P, PTR(double, a),
                   PTR(double, b), PTR(double, c), PTR(double, dx));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
py_relu_bwd(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t dy, y, n, dx;
    if (!PyArg_ParseTuple(args, "innnn", &isz, &dy, &y, &n, &dx))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4) relu_bwd_f(PTR(float, dy), PTR(float, y), n, PTR(float, dx));
    else relu_bwd_d(PTR(double, dy), PTR(double, y), n, PTR(double, dx));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"stats", py_stats, METH_VARARGS, "per-channel sum and sum of squares (double), one pass"},
    {"affine", py_affine, METH_VARARGS, "y = x * scale + shift per channel, optionally max(y, 0)"},
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
