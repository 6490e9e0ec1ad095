/* Compiled smooth activations (float32 and float64, C-contiguous flat arrays): sigmoid, SiLU, exact GELU.
 *
 * Why: the NumPy path of lbannpy.layers.kernels.activation runs one ufunc pass per arithmetic step (blocked
 * in cache, but each step still a loop of its own), while PyTorch evaluates each direction in one fused
 * loop; sigmoid, SiLU and float32 GELU stayed 1.5x to 2.6x PyTorch's forward+backward time on one thread.
 * Here each forward is one loop over the elements, the same formulas in the same order as the NumPy path
 * (built with -ffp-contract=off: every product and sum rounds as NumPy's separate ufuncs do), so the
 * results differ from it only by the exponential's rounding: exp is evaluated inline, without branches,
 * so that the loops vectorise (Cody-Waite reduction by ln 2, a Taylor polynomial of degree 13 (double) or
 * 7 (float) on |r| <= ln2/2, within about 1 ulp, the power of two applied in two halves so that subnormal
 * results and overflow to inf come out as libm's); NaN propagates, +-inf and huge inputs give exp's limits.
 * The sigmoid's forward takes a copy of exp whose polynomial and reduction may use FMA (exp_fc_*, compiled,
 * like the loop that inlines it, with fp-contract=fast: GCC inlines only between functions of the same
 * options): the loop has no product-and-sum of its own, so only exp's rounding changes (within 4 ulp of the
 * NumPy path, as before), and its polynomial takes half the instructions.
 * On x86-64 each loop is compiled for AVX-512, AVX2 + FMA and the baseline, picked at load time.
 * lbannpy.layers.kernels.activation checks dtypes and C-contiguity; every buffer's size is checked here.
 *
 *   sigmoid_fwd(isz, x, n, y)          y = 1 / (1 + exp(-x))
 *   sigmoid_bwd(isz, dy, y, n, dx)     dx = ((1 - y) * y) * dy
 *   silu_fwd(isz, x, n, y, d)          s = 1 / (exp(-x) + 1), y = x * s, d = (1 - s) * y + s (the
 *                                      derivative); d None: y = x / (exp(-x) + 1)
 *   gelu_fwd(isz, x, n, y, d, coef)    y = x Phi(x), d = Phi(x) + x phi(x) (d None: not formed); Phi from
 *                                      the tail q(|x|) = (1 + u) P(u) phi(x) with 1 + u = 8 / (4 + |x|) and
 *                                      the coefficients of P (highest first) in `coef` (float64, ncoef of
 *                                      them) for float64 (ignored for float32: Abramowitz-Stegun 7.1.26)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* ------------------------------------------------------------------------------------- exponentials */
/* exp_d and exp_f (NAME_D, NAME_F) with attributes ATTR: the plain pair, and exp_fc_d/exp_fc_f whose
 * products and sums may fuse (the sigmoid forward's, see the head of this file) */
#define DEFINE_EXP(ATTR, NAME_D, NAME_F)                                                                    \
static inline double ATTR                                                                                   \
NAME_D(double x)                                                                                            \
{                                                                                                           \
    /* clamped: above 709.8 the result overflows to inf, below -746 it rounds to 0 (NaN passes through) */  \
    double xc = x > 709.8 ? 709.8 : x;                                                                      \
    xc = xc < -746.0 ? -746.0 : xc;                                                                         \
    const double shift = 0x1.8p52;                                                                          \
    double kd = xc * 0x1.71547652b82fep0 + shift;     /* round(x / ln 2) in the low bits */                 \
    uint64_t kb, sb;                                                                                        \
    memcpy(&kb, &kd, 8);                                                                                    \
    memcpy(&sb, &shift, 8);                                                                                 \
    int64_t k = (int64_t)(kb - sb);                                                                         \
    kd -= shift;                                                                                            \
    double r = xc - kd * 6.93147180369123816490e-01;   /* ln 2's high part: k * it is exact */              \
    r = r - kd * 1.90821492927058770002e-10;                                                                \
    double p = 1.0 / 6227020800.0;                                                                          \
    p = p * r + 1.0 / 479001600.0;                                                                          \
    p = p * r + 1.0 / 39916800.0;                                                                           \
    p = p * r + 1.0 / 3628800.0;                                                                            \
    p = p * r + 1.0 / 362880.0;                                                                             \
    p = p * r + 1.0 / 40320.0;                                                                              \
    p = p * r + 1.0 / 5040.0;                                                                               \
    p = p * r + 1.0 / 720.0;                                                                                \
    p = p * r + 1.0 / 120.0;                                                                                \
    p = p * r + 1.0 / 24.0;                                                                                 \
    p = p * r + 1.0 / 6.0;                                                                                  \
    p = p * r + 0.5;                                                                                        \
    p = p * r + 1.0;                                                                                        \
    p = p * r + 1.0;                                                                                        \
    int64_t k1 = k >> 1, k2 = k - k1;                  /* 2^k in two normal halves */                       \
    uint64_t b1 = (uint64_t)(k1 + 1023) << 52, b2 = (uint64_t)(k2 + 1023) << 52;                            \
    double s1, s2;                                                                                          \
    memcpy(&s1, &b1, 8);                                                                                    \
    memcpy(&s2, &b2, 8);                                                                                    \
    return p * s1 * s2;                                                                                     \
}                                                                                                           \
                                                                                                           \
static inline float ATTR                                                                                    \
NAME_F(float x)                                                                                             \
{                                                                                                           \
    float xc = x > 88.8f ? 88.8f : x;                                                                       \
    xc = xc < -104.0f ? -104.0f : xc;                                                                       \
    const float shift = 0x1.8p23f;                                                                          \
    float kf = xc * 0x1.715476p0f + shift;                                                                  \
    uint32_t kb, sb;                                                                                        \
    memcpy(&kb, &kf, 4);                                                                                    \
    memcpy(&sb, &shift, 4);                                                                                 \
    int32_t k = (int32_t)(kb - sb);                                                                         \
    kf -= shift;                                                                                            \
    float r = xc - kf * 0.693359375f;                                                                       \
    r = r - kf * -2.12194440e-4f;                                                                           \
    float p = 1.0f / 5040.0f;                                                                               \
    p = p * r + 1.0f / 720.0f;                                                                              \
    p = p * r + 1.0f / 120.0f;                                                                              \
    p = p * r + 1.0f / 24.0f;                                                                               \
    p = p * r + 1.0f / 6.0f;                                                                                \
    p = p * r + 0.5f;                                                                                       \
    p = p * r + 1.0f;                                                                                       \
    p = p * r + 1.0f;                                                                                       \
    int32_t k1 = k >> 1, k2 = k - k1;                                                                       \
    uint32_t b1 = (uint32_t)(k1 + 127) << 23, b2 = (uint32_t)(k2 + 127) << 23;                              \
    float s1, s2;                                                                                           \
    memcpy(&s1, &b1, 4);                                                                                    \
    memcpy(&s2, &b2, 4);                                                                                    \
    return p * s1 * s2;                                                                                     \
}

#define FUSED __attribute__((optimize("fp-contract=fast")))
DEFINE_EXP(, exp_d, exp_f)
DEFINE_EXP(FUSED, exp_fc_d, exp_fc_f)

/* ---------------------------------------------------------------------------------------------- loops */
#define DEFINE_COMMON(T, SFX)                                                                               \
CLONES FUSED static void sigmoid_fwd_##SFX(const T *restrict x, Py_ssize_t n, T *restrict y)               \
{                                                                                                           \
    for (Py_ssize_t i = 0; i < n; i++) y[i] = (T)1 / (exp_fc_##SFX(-x[i]) + (T)1);                         \
}                                                                                                           \
CLONES static void sigmoid_bwd_##SFX(const T *restrict dy, const T *restrict y, Py_ssize_t n,              \
                                     T *restrict dx)                                                        \
{                                                                                                           \
    for (Py_ssize_t i = 0; i < n; i++) dx[i] = (((T)1 - y[i]) * y[i]) * dy[i];                             \
}                                                                                                           \
CLONES static void silu_fwd_##SFX(const T *restrict x, Py_ssize_t n, T *restrict y, T *restrict d)         \
{                                                                                                           \
    if (d == NULL) {                                                                                        \
        for (Py_ssize_t i = 0; i < n; i++) y[i] = x[i] / (exp_##SFX(-x[i]) + (T)1);                        \
        return;                                                                                             \
    }                                                                                                       \
    for (Py_ssize_t i = 0; i < n; i++) {                                                                    \
        T s = (T)1 / (exp_##SFX(-x[i]) + (T)1), yi = x[i] * s;                                              \
        y[i] = yi;                                                                                          \
        d[i] = ((T)1 - s) * yi + s;    /* s + x s (1 - s), exact where s is 1 */                            \
    }                                                                                                       \
}

DEFINE_COMMON(float, f)
DEFINE_COMMON(double, d)

#define INV_SQRT_2PI 0.3989422804014327
#define SQRT1_2 0.7071067811865476

/* y = x Phi(x), Phi = 0.5 + copysign(0.5 - q, x); d = x phi + Phi (as the NumPy path's _gelu_finish) */
#define GELU_FINISH(T, COPYSIGN)                                                                            \
    T c = COPYSIGN((T)0.5 - q, xi) + (T)0.5;                                                                \
    y[i] = xi * c;                                                                                          \
    if (grad) d[i] = xi * phi + c;

#define MAXCOEF 64
static inline void
gelu_d_body(const double *restrict x, Py_ssize_t n, double *restrict y, double *restrict d, const double *cf,
            int nc, int grad)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        double xi = x[i];
        double a = 8.0 / (fabs(xi) + 4.0);              /* 1 + u: 0 at infinity */
        double u = a - 1.0;
        double p = u * cf[0];
#pragma GCC unroll 64
        for (int k = 1; k < nc - 1; k++) p = (p + cf[k]) * u;
        p += cf[nc - 1];
        p *= a;
        double phi = exp_d(xi * xi * -0.5) * INV_SQRT_2PI;
        double q = p * phi;
        GELU_FINISH(double, copysign)
    }
}

/* the coefficient count fixed at compile time for the usual table (the inner loop unrolled) */
#define NC64 24
CLONES static void
gelu_fwd_d(const double *restrict x, Py_ssize_t n, double *restrict y, double *restrict d, const double *cf,
           int nc)
{
    if (nc == NC64) {
        if (d) gelu_d_body(x, n, y, d, cf, NC64, 1); else gelu_d_body(x, n, y, d, cf, NC64, 0);
    } else {
        if (d) gelu_d_body(x, n, y, d, cf, nc, 1); else gelu_d_body(x, n, y, d, cf, nc, 0);
    }
}

static inline void
gelu_f_body(const float *restrict x, Py_ssize_t n, float *restrict y, float *restrict d, int grad)
{
    /* q = erfc(|x| / sqrt 2) / 2 = t (c0 + c1 t + ... ) exp(-x^2 / 2), t = 1 / (1 + p |x| / sqrt 2) */
    const float kp = (float)(0.3275911 * SQRT1_2);
    const float c0 = (float)(0.5 * 1.061405429), c1 = (float)(0.5 * -1.453152027),
                c2 = (float)(0.5 * 1.421413741), c3 = (float)(0.5 * -0.284496736),
                c4 = (float)(0.5 * 0.254829592);
    for (Py_ssize_t i = 0; i < n; i++) {
        float xi = x[i];
        float t = 1.0f / (fabsf(xi) * kp + 1.0f);
        float p = t * c0;
        p = (p + c1) * t;
        p = (p + c2) * t;
        p = (p + c3) * t;
        p = (p + c4) * t;
        float e = exp_f(xi * xi * -0.5f);
        float q = p * e;
        float phi = e * (float)INV_SQRT_2PI;
        GELU_FINISH(float, copysignf)
    }
}

CLONES static void
gelu_fwd_f(const float *restrict x, Py_ssize_t n, float *restrict y, float *restrict d)
{
    if (d) gelu_f_body(x, n, y, d, 1); else gelu_f_body(x, n, y, d, 0);
}

/* ------------------------------------------------------------------------------------------ arguments */
typedef struct { Py_buffer b[4]; int n; } Bufs;

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
        PyErr_Format(PyExc_ValueError, "activation kernels: %s has %zd bytes, needs %zd", what, b->len,
                     bytes);
        return -1;
    }
    *p = b->buf;
    return 0;
}

static int
check(int isz, Py_ssize_t n)
{
    if (isz != 4 && isz != 8) {
        PyErr_Format(PyExc_ValueError, "activation kernels: item size %d (float32 or float64 only)", isz);
        return -1;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "activation kernels: negative size");
        return -1;
    }
    return 0;
}

#define DISPATCH(call_f, call_d)                                                                            \
    Py_BEGIN_ALLOW_THREADS                                                                                  \
    if (isz == 4) call_f; else call_d;                                                                      \
    Py_END_ALLOW_THREADS

static PyObject *
py_sigmoid_fwd(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t n;
    PyObject *ox, *oy;
    void *x, *y;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOnO", &isz, &ox, &n, &oy) || check(isz, n) < 0) return NULL;
    if (get(&bs, ox, 0, n * isz, "input", 0, &x) < 0 || get(&bs, oy, 1, n * isz, "output", 0, &y) < 0) {
        release(&bs);
        return NULL;
    }
    DISPATCH(sigmoid_fwd_f(x, n, y), sigmoid_fwd_d(x, n, y))
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *
py_sigmoid_bwd(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t n;
    PyObject *ody, *oy, *odx;
    void *dy, *y, *dx;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOOnO", &isz, &ody, &oy, &n, &odx) || check(isz, n) < 0) return NULL;
    if (get(&bs, ody, 0, n * isz, "gradient", 0, &dy) < 0 || get(&bs, oy, 0, n * isz, "output", 0, &y) < 0 ||
        get(&bs, odx, 1, n * isz, "input gradient", 0, &dx) < 0) {
        release(&bs);
        return NULL;
    }
    DISPATCH(sigmoid_bwd_f(dy, y, n, dx), sigmoid_bwd_d(dy, y, n, dx))
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *
py_silu_fwd(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t n;
    PyObject *ox, *oy, *od;
    void *x, *y, *d;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOnOO", &isz, &ox, &n, &oy, &od) || check(isz, n) < 0) return NULL;
    if (get(&bs, ox, 0, n * isz, "input", 0, &x) < 0 || get(&bs, oy, 1, n * isz, "output", 0, &y) < 0 ||
        get(&bs, od, 1, n * isz, "derivative", 1, &d) < 0) {
        release(&bs);
        return NULL;
    }
    DISPATCH(silu_fwd_f(x, n, y, d), silu_fwd_d(x, n, y, d))
    release(&bs);
    Py_RETURN_NONE;
}

static PyObject *
py_gelu_fwd(PyObject *self, PyObject *args)
{
    int isz;
    Py_ssize_t n, nc = 0;
    PyObject *ox, *oy, *od, *oc;
    void *x, *y, *d, *cf = NULL;
    Bufs bs = {.n = 0};
    if (!PyArg_ParseTuple(args, "iOnOOO", &isz, &ox, &n, &oy, &od, &oc) || check(isz, n) < 0) return NULL;
    if (get(&bs, ox, 0, n * isz, "input", 0, &x) < 0 || get(&bs, oy, 1, n * isz, "output", 0, &y) < 0 ||
        get(&bs, od, 1, n * isz, "derivative", 1, &d) < 0 || get(&bs, oc, 0, 0, "coefficients", 1, &cf) < 0) {
        release(&bs);
        return NULL;
    }
    if (isz == 8) {
        nc = cf == NULL ? 0 : bs.b[bs.n - 1].len / 8;
        if (nc < 2 || nc > MAXCOEF) {
            PyErr_Format(PyExc_ValueError, "activation kernels: float64 GELU needs 2 to %d float64 "
                         "coefficients, got %zd", MAXCOEF, nc);
            release(&bs);
            return NULL;
        }
    }
    DISPATCH(gelu_fwd_f(x, n, y, d), gelu_fwd_d(x, n, y, d, cf, (int)nc))
    release(&bs);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sigmoid_fwd", py_sigmoid_fwd, METH_VARARGS, "y = 1 / (1 + exp(-x))"},
    {"sigmoid_bwd", py_sigmoid_bwd, METH_VARARGS, "dx = ((1 - y) * y) * dy"},
    {"silu_fwd", py_silu_fwd, METH_VARARGS, "SiLU and (d not None) its derivative"},
    {"gelu_fwd", py_gelu_fwd, METH_VARARGS, "exact GELU and (d not None) its derivative"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cact", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__cact(void)
{
    return PyModule_Create(&module);
}
