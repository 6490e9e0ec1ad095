/* Compiled direct-convolution kernels behind lbannpy.layers.kernels.conv (float32 and float64), and the
 * max-pooling kernels behind lbannpy.layers.kernels.pool (further down).
 *
 * conv_fwd(itemsize, x, xend, off, ntap, rsx, cs, wp, F, y, fsy, rsy, rows, cols, bias):
 *     y[k*fsy + h*rsy + w] = bias[k] + sum_t wp[t*F + k] * x[off[t] + h*rsx + cs*w]
 * conv_wgrad(itemsize, x, xend, off, ntap, rsx, cs, dy, F, fsdy, rsdy, rows, cols, dw):
 *     dw[k*ntap + t] += sum_{h, w} dy[k*fsdy + h*rsdy + w] * x[off[t] + h*rsx + cs*w]
 * for 0 <= h < rows, 0 <= w < cols, 0 <= k < F, column stride cs = 1 or 2, nothing read at or past xend;
 * conv_pair(itemsize, x, off0, ntap0, off1, ntap1, rsx, wp0, wp1, F, y, fsy, rsy, rows, cols, bias):
 *     y[k*fsy + h*rsy + 2r + b] = bias[k] + sum_t wp_b[t*F + k] * x[off_b[t] + h*rsx + r]
 *     for 0 <= 2r + b < cols (the two column phases of a stride-2 data gradient, or of a transposed
 *     convolution whose stride is its kernel, written interleaved; bias 0: none);
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
    Py_ssize_t x, off0, ntap0, off1, ntap1, rsx, wp0, wp1, F, y, fsy, rsy, rows, cols, bias;
    if (!PyArg_ParseTuple(args, "innnnnnnnnnnnnnn", &isz, &x, &off0, &ntap0, &off1, &ntap1, &rsx, &wp0, &wp1,
                          &F, &y, &fsy, &rsy, &rows, &cols, &bias))
        return NULL;
    if (isz != 4 && isz != 8)
        return PyErr_Format(PyExc_ValueError, "conv_pair: itemsize %d (need 4 or 8)", isz);
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        conv_pair_f32((const float *)x, (const int64_t *)off0, ntap0, (const int64_t *)off1, ntap1, rsx,
                      (const float *)wp0, (const float *)wp1, F, (float *)y, fsy, rsy, rows, cols,
                      (const float *)bias);
    else
        conv_pair_f64((const double *)x, (const int64_t *)off0, ntap0, (const int64_t *)off1, ntap1, rsx,
                      (const double *)wp0, (const double *)wp1, F, (double *)y, fsy, rsy, rows, cols,
                      (const double *)bias);
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

/* Max pooling, over the (sample, channel) planes of 3 spatial dimensions (2-D pooling passes a leading
 * extent of 1), one call for the whole batch:
 * maxpool_fwd(itemsize, x, n, xsn, c, xsc, xs0, xs1, xs2, o0, o1, o2, k0, k1, k2, t0, t1, t2, d0, d1, d2,
 *             y, arg, argsize):
 *     for each sample s, channel q and output (i, j, l): y = max over taps (a, b, e) of
 *     x[s*xsn + q*xsc + (i*t0 + a*d0)*xs0 + (j*t1 + b*d1)*xs1 + (l*t2 + e*d2)*xs2], written C-contiguously
 *     with the row-major tap index of the winner into arg (int8 or int16, argsize bytes); ties go to the
 *     first tap, a NaN wins (the first NaN), as PyTorch's CPU kernel does. Every element from the first
 *     to the last one read may be read (a view with non-negative strides lies inside its buffer); rows
 *     whose taps are 1 or 2 elements apart run on vectors, a row's last vector spilling into the next one;
 * maxpool_bwd(itemsize, dy, arg, argsize, n, c, o0, o1, o2, k0, k1, k2, t0, t1, t2, d0, d1, d2, dx,
 *             w0, w1, w2, direct):
 *     dx (C-contiguous, (n, c, w0, w1, w2), uninitialised) gets each dy at the winner of its output.
 *     direct=0: dx is zeroed and each dy is added at its winner (overlapping windows accumulate, in the
 *     order of the earlier tap-by-tap kernel: within a row, later outputs first); direct=1 (windows tile
 *     dx exactly: kernel == stride, no dilation, w == o*t): every element is written, 0 + dy or 0. */
#define POOL_ROW 512 /* outputs of a row whose overlapping taps are added in reverse order */
/* by feature, not by CPU model: "arch=haswell" (CLONES) is never picked on an AMD CPU */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define POOL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define POOL_CLONES
#endif
typedef struct {
    Py_ssize_t n, c, sn, sc;                     /* samples, channels and their strides */
    Py_ssize_t s[3], o[3], k[3], t[3], d[3];     /* spatial strides, outputs, kernel, stride, dilation */
} pgeom;

typedef float pf8 __attribute__((vector_size(32)));
typedef float pf8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t pi8 __attribute__((vector_size(32)));
typedef int8_t pb8 __attribute__((vector_size(8)));
typedef int8_t pb8u __attribute__((vector_size(8), aligned(1), may_alias));
typedef int16_t ph8 __attribute__((vector_size(16)));
typedef int16_t ph8u __attribute__((vector_size(16), aligned(2), may_alias));
typedef double pd4 __attribute__((vector_size(32)));
typedef double pd4u __attribute__((vector_size(32), aligned(8), may_alias));
typedef int64_t pl4 __attribute__((vector_size(32)));
typedef int8_t pb4 __attribute__((vector_size(4)));
typedef int8_t pb4u __attribute__((vector_size(4), aligned(1), may_alias));
typedef int16_t ph4 __attribute__((vector_size(8)));
typedef int16_t ph4u __attribute__((vector_size(8), aligned(2), may_alias));
typedef int32_t pi4 __attribute__((vector_size(16)));
/* winning taps between the lane width and int8/int16, through int16 (and int32) lanes: GCC 12 turns a
 * direct int32 <-> int8 conversion into one lane at a time */
#define POOL_AI inline __attribute__((always_inline))
static POOL_AI ph8 pool_i16_f32(pi8 w) { return __builtin_convertvector(w, ph8); }
static POOL_AI pb8 pool_i8_f32(pi8 w) { return __builtin_convertvector(pool_i16_f32(w), pb8); }
static POOL_AI pi8 pool_w16_f32(const int16_t *p) { return __builtin_convertvector(*(const ph8u *)p, pi8); }
static POOL_AI pi8 pool_w8_f32(const int8_t *p)
{
    return __builtin_convertvector(__builtin_convertvector(*(const pb8u *)p, ph8), pi8);
}
static POOL_AI ph4 pool_i16_f64(pl4 w) { return __builtin_convertvector(__builtin_convertvector(w, pi4), ph4); }
static POOL_AI pb4 pool_i8_f64(pl4 w) { return __builtin_convertvector(pool_i16_f64(w), pb4); }
static POOL_AI pl4 pool_w16_f64(const int16_t *p)
{
    return __builtin_convertvector(__builtin_convertvector(*(const ph4u *)p, pi4), pl4);
}
static POOL_AI pl4 pool_w8_f64(const int8_t *p)
{
    return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(*(const pb4u *)p, ph4), pi4),
                                   pl4);
}
/* the even (odd: + 1) elements of two vectors, shuffled within 16-byte halves (one instruction), which
 * leaves the outputs in the order POUT puts right */
static const pi8 PEVEN_f32 = {0, 2, 8, 10, 4, 6, 12, 14};
static const pi8 POUT_f32 = {0, 1, 4, 5, 2, 3, 6, 7};
static const pi8 PZLO_f32 = {0, 8, 1, 9, 2, 10, 3, 11};
static const pi8 PZHI_f32 = {4, 12, 5, 13, 6, 14, 7, 15};
static const pl4 PEVEN_f64 = {0, 4, 2, 6};
static const pl4 POUT_f64 = {0, 2, 1, 3};
static const pl4 PZLO_f64 = {0, 4, 1, 5};
static const pl4 PZHI_f64 = {2, 6, 3, 7};

/* the row-major tap offsets a*d0*s0 + b*d1*s1 + e*d2*s2 (non-decreasing: strides are non-negative) */
static Py_ssize_t *
pool_offsets(const pgeom *g)
{
    Py_ssize_t *off = malloc((size_t)(g->k[0] * g->k[1] * g->k[2]) * sizeof(Py_ssize_t)), t = 0;
    if (off)
        for (Py_ssize_t a = 0; a < g->k[0]; a++)
            for (Py_ssize_t b = 0; b < g->k[1]; b++)
                for (Py_ssize_t e = 0; e < g->k[2]; e++)
                    off[t++] = a * g->d[0] * g->s[0] + b * g->d[1] * g->s[1] + e * g->d[2] * g->s[2];
    return off;
}

#define POOL_SEL(VI, m, a, b) (((VI)(a) & (m)) | ((VI)(b) & ~(m))) /* lanes of a where m, else b */
#define POOL_WIN(arg, asz, i) ((asz) == 1 ? ((const int8_t *)(arg))[i] : ((const int16_t *)(arg))[i])

/* SFX: type suffix; T: element; VF/VFU: a 32-byte vector of T (aligned/unaligned); VI: the integer vector
 * of the same lane width; VB/VBU, VH/VHU: int8 and int16 vectors of L lanes */
#define MAXPOOL_KERNELS(SFX, T, VF, VFU, VI, VB, VBU, VH, VHU, L)                                         \
    /* p[0], p[step], ..., L lanes (step 2: in the order of PEVEN) */                                     \
    static inline __attribute__((always_inline)) VF pool_load_##SFX(const T *p, const Py_ssize_t step)     \
    {                                                                                                      \
        if (step == 1)                                                                                     \
            return *(const VFU *)p;                                                                        \
        return __builtin_shuffle(*(const VFU *)p, *(const VFU *)(p + L), PEVEN_##SFX);                     \
    }                                                                                                      \
    static inline __attribute__((always_inline)) void pool_take_##SFX(VF v, int t, VF *best, VI *w)        \
    {                                                                                                      \
        VI take = (*best == *best) & ~(v <= *best); /* best is no NaN, and v is greater or NaN */           \
        *best = (VF)POOL_SEL(VI, take, v, *best);                                                          \
        *w = (take & ((VI){0} + t)) | (*w & ~take);                                                        \
    }                                                                                                      \
    /* L outputs of a row at once: p is its first output's window, step the column step (1 or 2); pair:    \
       the taps come in adjacent pairs (kernel 2, step 2), both lanes of one pair of loads */              \
    static inline __attribute__((always_inline)) void pool_fwd_vec_##SFX(                                  \
        const T *p, const Py_ssize_t *off, Py_ssize_t nt, Py_ssize_t step, int pair, T *y, void *arg, int asz) \
    {                                                                                                      \
        VF best;                                                                                           \
        VI w = {0};                                                                                        \
        if (pair) {                                                                                        \
            VF u0 = *(const VFU *)(p + off[0]), u1 = *(const VFU *)(p + off[0] + L);                       \
            best = __builtin_shuffle(u0, u1, PEVEN_##SFX);                                                 \
            pool_take_##SFX(__builtin_shuffle(u0, u1, PEVEN_##SFX + 1), 1, &best, &w);                     \
            for (Py_ssize_t t = 2; t < nt; t += 2) {                                                       \
                u0 = *(const VFU *)(p + off[t]), u1 = *(const VFU *)(p + off[t] + L);                      \
                pool_take_##SFX(__builtin_shuffle(u0, u1, PEVEN_##SFX), (int)t, &best, &w);                \
                pool_take_##SFX(__builtin_shuffle(u0, u1, PEVEN_##SFX + 1), (int)t + 1, &best, &w);        \
            }                                                                                              \
        } else {                                                                                           \
            best = pool_load_##SFX(p + off[0], step);                                                      \
            for (Py_ssize_t t = 1; t < nt; t++)                                                            \
                pool_take_##SFX(pool_load_##SFX(p + off[t], step), (int)t, &best, &w);                     \
        }                                                                                                  \
        if (step == 2) { /* lanes back in order */                                                         \
            best = __builtin_shuffle(best, POUT_##SFX);                                                    \
            w = __builtin_shuffle(w, POUT_##SFX);                                                          \
        }                                                                                                  \
        *(VFU *)y = best;                                                                                  \
        if (asz == 1)                                                                                      \
            *(VBU *)arg = pool_i8_##SFX(w);                                                                \
        else                                                                                               \
            *(VHU *)arg = pool_i16_##SFX(w);                                                               \
    }                                                                                                      \
    static inline __attribute__((always_inline)) void pool_fwd_one_##SFX(                                 \
        const T *p, const Py_ssize_t *off, Py_ssize_t nt, T *y, void *arg, int asz, Py_ssize_t n)          \
    {                                                                                                      \
        T best = p[off[0]];                                                                                \
        int32_t w = 0;                                                                                     \
        for (Py_ssize_t t = 1; t < nt; t++) {                                                              \
            T v = p[off[t]];                                                                               \
            if ((best == best) & ((v != v) | (v > best))) {                                                \
                best = v;                                                                                  \
                w = (int32_t)t;                                                                            \
            }                                                                                              \
        }                                                                                                  \
        y[n] = best;                                                                                       \
        if (asz == 1)                                                                                      \
            ((int8_t *)arg)[n] = (int8_t)w;                                                                \
        else                                                                                               \
            ((int16_t *)arg)[n] = (int16_t)w;                                                              \
    }                                                                                                      \
    POOL_CLONES static void maxpool_fwd_##SFX(const T *x, const pgeom *g, const Py_ssize_t *off, T *y, void *arg, \
                                         int asz)                                                          \
    {                                                                                                      \
        const Py_ssize_t nt = g->k[0] * g->k[1] * g->k[2], o2 = g->o[2], step = g->t[2] * g->s[2];         \
        const Py_ssize_t total = g->n * g->c * g->o[0] * g->o[1] * o2;                                     \
        Py_ssize_t last = (g->n - 1) * g->sn + (g->c - 1) * g->sc, n = 0;                                  \
        for (int q = 0; q < 3; q++)                                                                        \
            last += ((g->o[q] - 1) * g->t[q] + (g->k[q] - 1) * g->d[q]) * g->s[q];                         \
        const Py_ssize_t reach = off[nt - 1] + L * step - 1; /* of a vector, past its first window */     \
        const int vec = step == 1 || step == 2;                                                            \
        const int pair = step == 2 && g->k[2] == 2 && g->d[2] * g->s[2] == 1;                                                            \
        for (Py_ssize_t ps = 0; ps < g->n; ps++)                                                           \
            for (Py_ssize_t pc = 0; pc < g->c; pc++)                                                       \
                for (Py_ssize_t i = 0; i < g->o[0]; i++)                                                   \
                    for (Py_ssize_t j = 0; j < g->o[1]; j++, n += o2) {                                    \
                        const Py_ssize_t r = ps * g->sn + pc * g->sc + i * g->t[0] * g->s[0] +             \
                                             j * g->t[1] * g->s[1];                                        \
                        Py_ssize_t l = 0;                                                                  \
                        for (; vec && l < o2 && n + l + L <= total && r + l * step + reach <= last; l += L) \
                            pool_fwd_vec_##SFX(x + r + l * step, off, nt, step, pair, y + n + l,           \
                                               (char *)arg + (n + l) * asz, asz);                          \
                        for (; l < o2; l++)                                                                \
                            pool_fwd_one_##SFX(x + r + l * step, off, nt, y, arg, asz, n + l);             \
                    }                                                                                      \
    }                                                                                                      \
    /* zeroes dx as it goes, in memory order, up to the end of the last row an output row adds to */       \
    POOL_CLONES static void maxpool_scatter_##SFX(const T *dy, const void *arg, int asz, const pgeom *g,   \
                                                  const Py_ssize_t *off, T *dx)                            \
    {                                                                                                      \
        const Py_ssize_t o2 = g->o[2], step = g->t[2] * g->s[2];                                           \
        const Py_ssize_t reach = (g->k[0] - 1) * g->d[0] * g->s[0] + (g->k[1] - 1) * g->d[1] * g->s[1]     \
                                 + g->s[1];                                                                \
        T *zeroed = dx;                                                                                    \
        Py_ssize_t n = 0;                                                                                  \
        for (Py_ssize_t ps = 0; ps < g->n; ps++)                                                           \
            for (Py_ssize_t pc = 0; pc < g->c; pc++)                                                       \
                for (Py_ssize_t i = 0; i < g->o[0]; i++)                                                   \
                    for (Py_ssize_t j = 0; j < g->o[1]; j++, n += o2) {                                    \
                        T *row = dx + ps * g->sn + pc * g->sc + i * g->t[0] * g->s[0]                      \
                                 + j * g->t[1] * g->s[1];                                                  \
                        if (row + reach > zeroed) {                                                        \
                            memset(zeroed, 0, (size_t)(row + reach - zeroed) * sizeof(T));                 \
                            zeroed = row + reach;                                                          \
                        }                                                                                  \
                        for (Py_ssize_t l0 = 0; l0 < o2; l0 += POOL_ROW) {                                 \
                            Py_ssize_t m = o2 - l0 < POOL_ROW ? o2 - l0 : POOL_ROW;                        \
                            const int8_t *w8 = (const int8_t *)arg + n;                                    \
                            const int16_t *w16 = (const int16_t *)arg + n;                                 \
                            if (asz == 1)                                                                  \
                                for (Py_ssize_t l = l0 + m - 1; l >= l0; l--)                              \
                                    row[l * step + off[w8[l]]] += dy[n + l];                               \
                            else                                                                           \
                                for (Py_ssize_t l = l0 + m - 1; l >= l0; l--)                              \
                                    row[l * step + off[w16[l]]] += dy[n + l];                              \
                        }                                                                                  \
                    }                                                                                      \
        memset(zeroed, 0, (size_t)(dx + g->n * g->sn - zeroed) * sizeof(T));                               \
    }                                                                                                      \
    /* the k1 rows of dx (w2 apart) of one output row, whose windows tile them (kernel k2 == stride): taps \
       tb.. of the outputs g[0..o2). Vectors (nvec outputs may use them) from the last: a row's last one   \
       spills into the next row, whose first is written after it */                                        \
    static inline __attribute__((always_inline)) void pool_put_rows_##SFX(                                 \
        const T *g, const void *arg, int asz, Py_ssize_t n, Py_ssize_t nvec, Py_ssize_t o2, Py_ssize_t k2, \
        Py_ssize_t k1, Py_ssize_t w2, int32_t tb, T *row)                                                  \
    {                                                                                                      \
        Py_ssize_t lv = k2 == 2 ? (nvec + L - 1) / L * L : 0;                                              \
        for (Py_ssize_t l = lv - L; l >= 0; l -= L) {                                                      \
            VF v = *(const VFU *)(g + l) + (T)0;                                                           \
            VI w = asz == 1 ? pool_w8_##SFX((const int8_t *)arg + n + l)                                   \
                            : pool_w16_##SFX((const int16_t *)arg + n + l);                                \
            for (Py_ssize_t b = 0; b < k1; b++) {                                                          \
                int32_t t = tb + 2 * (int32_t)b;                                                           \
                VF e0 = (VF)((VI)v & (w == t)), e1 = (VF)((VI)v & (w == t + 1));                           \
                *(VFU *)(row + b * w2 + 2 * l) = __builtin_shuffle(e0, e1, PZLO_##SFX);                    \
                *(VFU *)(row + b * w2 + 2 * l + L) = __builtin_shuffle(e0, e1, PZHI_##SFX);                \
            }                                                                                              \
        }                                                                                                  \
        for (Py_ssize_t b = 0; b < k1; b++)                                                                \
            for (Py_ssize_t l = lv; l < o2; l++) {                                                         \
                int32_t w = POOL_WIN(arg, asz, n + l) - tb - (int32_t)(b * k2);                            \
                for (Py_ssize_t e = 0; e < k2; e++)                                                        \
                    row[b * w2 + l * k2 + e] = w == e ? g[l] + (T)0 : (T)0;                                \
            }                                                                                              \
    }                                                                                                      \
    POOL_CLONES static void maxpool_put_##SFX(const T *dy, const void *arg, int asz, const pgeom *g,       \
                                              T *dx)                                                       \
    {                                                                                                      \
        const Py_ssize_t o2 = g->o[2], k2 = g->k[2], k1 = g->k[1], w2 = o2 * k2;                           \
        const Py_ssize_t total = g->n * g->c * g->o[0] * g->o[1] * o2, end = total * g->k[0] * k1 * k2;    \
        Py_ssize_t n = 0, at = 0; /* dx is written in memory order */                                      \
        for (Py_ssize_t p = 0; p < g->n * g->c * g->o[0]; p++, n += g->o[1] * o2)                          \
            for (Py_ssize_t a = 0; a < g->k[0]; a++)                                                       \
                for (Py_ssize_t j = 0; j < g->o[1]; j++, at += k1 * w2) {                                  \
                    Py_ssize_t nj = n + j * o2, nvec = o2; /* vectors that stay inside dy and dx */        \
                    while (nvec > 0 && (nj + nvec - 1 + L > total                                          \
                                        || at + (k1 - 1) * w2 + 2 * (nvec - 1 + L) > end))                 \
                        nvec -= nvec > L ? L : 1;                                                          \
                    pool_put_rows_##SFX(dy + nj, arg, asz, nj, nvec, o2, k2, k1, w2,                       \
                                        (int32_t)(a * k1 * k2), dx + at);                                  \
                }                                                                                          \
    }
MAXPOOL_KERNELS(f32, float, pf8, pf8u, pi8, pb8, pb8u, ph8, ph8u, 8)
MAXPOOL_KERNELS(f64, double, pd4, pd4u, pl4, pb4, pb4u, ph4, ph4u, 4)

/* the first element of an array (numpy: of any strides); the caller keeps it alive for the call */
static char *
pool_data(PyObject *a, int writable)
{
    Py_buffer v;
    if (PyObject_GetBuffer(a, &v, PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    char *p = v.buf;
    PyBuffer_Release(&v);
    return p;
}

static int
pool_geom(pgeom *g, Py_ssize_t k0, Py_ssize_t k1, Py_ssize_t k2, int asz)
{
    if (asz != 1 && asz != 2) {
        PyErr_Format(PyExc_ValueError, "maxpool: index size %d", asz);
        return -1;
    }
    if (k0 < 1 || k1 < 1 || k2 < 1 || k0 * k1 * k2 > (asz == 1 ? 127 : 32767)) {
        PyErr_Format(PyExc_ValueError, "maxpool: a %zd x %zd x %zd kernel (or its taps do not fit the index "
                     "type)", k0, k1, k2);
        return -1;
    }
    g->k[0] = k0, g->k[1] = k1, g->k[2] = k2;
    return 0;
}

static PyObject *
py_maxpool_fwd(PyObject *self, PyObject *args)
{
    int isz, asz;
    pgeom g;
    Py_ssize_t k0, k1, k2;
    PyObject *xo, *yo, *argo;
    if (!PyArg_ParseTuple(args, "iOnnnnnnnnnnnnnnnnnnnOOi", &isz, &xo, &g.n, &g.sn, &g.c, &g.sc, &g.s[0],
                          &g.s[1], &g.s[2], &g.o[0], &g.o[1], &g.o[2], &k0, &k1, &k2, &g.t[0], &g.t[1],
                          &g.t[2], &g.d[0], &g.d[1], &g.d[2], &yo, &argo, &asz))
        return NULL;
    char *x = pool_data(xo, 0), *y = pool_data(yo, 1), *arg = pool_data(argo, 1);
    if (!x || !y || !arg)
        return NULL;
    if (isz != 4 && isz != 8)
        return PyErr_Format(PyExc_ValueError, "maxpool_fwd: itemsize %d", isz);
    if (pool_geom(&g, k0, k1, k2, asz))
        return NULL;
    if (g.n * g.c * g.o[0] * g.o[1] * g.o[2] <= 0)
        Py_RETURN_NONE;
    Py_ssize_t *off = pool_offsets(&g);
    if (!off)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4)
        maxpool_fwd_f32((const float *)x, &g, off, (float *)y, (void *)arg, asz);
    else
        maxpool_fwd_f64((const double *)x, &g, off, (double *)y, (void *)arg, asz);
    Py_END_ALLOW_THREADS
    free(off);
    Py_RETURN_NONE;
}

static PyObject *
py_maxpool_bwd(PyObject *self, PyObject *args)
{
    int isz, asz, direct;
    pgeom g;
    Py_ssize_t k0, k1, k2, w[3];
    PyObject *dyo, *argo, *dxo;
    if (!PyArg_ParseTuple(args, "iOOinnnnnnnnnnnnnnOnnni", &isz, &dyo, &argo, &asz, &g.n, &g.c, &g.o[0], &g.o[1],
                          &g.o[2], &k0, &k1, &k2, &g.t[0], &g.t[1], &g.t[2], &g.d[0], &g.d[1], &g.d[2], &dxo,
                          &w[0], &w[1], &w[2], &direct))
        return NULL;
    char *dy = pool_data(dyo, 0), *arg = pool_data(argo, 0), *dx = pool_data(dxo, 1);
    if (!dy || !arg || !dx)
        return NULL;
    if (isz != 4 && isz != 8)
        return PyErr_Format(PyExc_ValueError, "maxpool_bwd: itemsize %d", isz);
    if (pool_geom(&g, k0, k1, k2, asz))
        return NULL;
    for (int q = 0; q < 3 && direct; q++)
        if (g.k[q] != g.t[q] || (g.k[q] > 1 && g.d[q] != 1) || w[q] != g.o[q] * g.t[q])
            return PyErr_Format(PyExc_ValueError, "maxpool_bwd: windows that do not tile dx, written directly");
    g.s[2] = 1, g.s[1] = w[2], g.s[0] = w[1] * w[2], g.sc = w[0] * w[1] * w[2], g.sn = g.c * g.sc;
    if (g.n * g.c * g.o[0] * g.o[1] * g.o[2] <= 0)
        Py_RETURN_NONE;
    Py_ssize_t *off = pool_offsets(&g);
    if (!off)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    if (isz == 4 && direct)
        maxpool_put_f32((const float *)dy, (const void *)arg, asz, &g, (float *)dx);
    else if (isz == 4)
        maxpool_scatter_f32((const float *)dy, (const void *)arg, asz, &g, off, (float *)dx);
    else if (direct)
        maxpool_put_f64((const double *)dy, (const void *)arg, asz, &g, (double *)dx);
    else
        maxpool_scatter_f64((const double *)dy, (const void *)arg, asz, &g, off, (double *)dx);
    Py_END_ALLOW_THREADS
    free(off);
    Py_RETURN_NONE;
}

/* wide_vectors(): whether the conv entry points run their AVX-512 clone. Their register blocks (MAX_FB
 * filters x 2 vectors of 64 bytes, and the filter gradient's WG_FB x WG_TB) are sized for 32 registers of
 * 64 bytes; compiled for AVX2 or the baseline the same blocks spill, and the direct kernels run 2-25x slower
 * than the GEMM path (measured on an AVX2 AMD EPYC core), so the caller takes them only where this is true. */
static PyObject *py_wide_vectors(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx512f"));
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"maxpool_fwd", py_maxpool_fwd, METH_VARARGS, "Max pooling with the winning tap (see above)."},
    {"maxpool_bwd", py_maxpool_bwd, METH_VARARGS, "Max pooling gradient from the winning taps (see above)."},
    {"conv_pair", py_conv_pair, METH_VARARGS, "Two column phases of a stride-2 data gradient (see module)."},
    {"phase_rows", py_phase_rows, METH_VARARGS, "Rows split into / merged from column phases (see module)."},
    {"conv_fwd", py_conv_fwd, METH_VARARGS, "Direct convolution over a list of shifted taps (see module)."},
    {"conv_wgrad", py_conv_wgrad, METH_VARARGS, "Filter gradient over a list of shifted taps (see module)."},
    {"wide_vectors", py_wide_vectors, METH_NOARGS, "Whether the conv kernels run with AVX-512 (see above)."},
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
