/* Direct convolution micro-kernels for one element type; included by _cconv.c once per type with
 * T (element type), V (a 64-byte vector of T), VU (the same, unaligned) and NAME(x) (suffixed name). */

enum { NAME(LANES) = 64 / sizeof(T) };

/* One vector of x[p], x[p + cs], ..., x[p + (L-1)*cs] for a column stride cs of 1 or 2 (stride 2: two
 * loads and a permutation keeping the even lanes; reads x[p + 2L - 1]) */
static inline __attribute__((always_inline)) V
NAME(load_cols)(const T *p, const int cs)
{
    if (cs == 1)
        return *(const VU *)p;
    return __builtin_shuffle(*(const VU *)p, *(const VU *)(p + NAME(LANES)), NAME(EVEN));
}

/* y[k, w..w+2L) = bias[k] + sum_t wp[t*F + k] * x[off[t] + cs*(w..)]   for the fb filters of one block;
 * x + xlim: the end of the readable input (stride 2 loads one element past the last one used) */
static inline __attribute__((always_inline)) void
NAME(fwd_row)(const T *x, const int64_t *off, Py_ssize_t ntap, Py_ssize_t offmax, Py_ssize_t xlim,
              const T *wp, Py_ssize_t F, T *y, Py_ssize_t fsy, Py_ssize_t cols, const T *bias, const int fb,
              const int cs)
{
    const Py_ssize_t L = NAME(LANES), step = 2 * NAME(LANES);
    Py_ssize_t w = 0;
    if (cols >= step) {
        for (;;) {
            if (offmax + cs * (w + step) > xlim) {  /* the last block would read past the input */
                for (Py_ssize_t v = w; v < w + step; v++)
                    for (int k = 0; k < fb; k++) {
                        T s = bias ? bias[k] : (T)0;
                        for (Py_ssize_t t = 0; t < ntap; t++)
                            s += x[off[t] + cs * v] * wp[t * F + k];
                        y[k * fsy + v] = s;
                    }
                goto next;
            }
            V acc[MAX_FB][2];
#pragma GCC unroll 16
            for (int k = 0; k < fb; k++) {
                const T b0 = bias ? bias[k] : (T)0;
                acc[k][0] = (V){0} + b0;
                acc[k][1] = (V){0} + b0;
            }
            const T *xw = x + cs * w;
            for (Py_ssize_t t = 0; t < ntap; t++) {
                const T *xp = xw + off[t];
                const V x0 = NAME(load_cols)(xp, cs), x1 = NAME(load_cols)(xp + cs * L, cs);
                const T *wt = wp + t * F;
#pragma GCC unroll 16
                for (int k = 0; k < fb; k++) {
                    acc[k][0] += x0 * wt[k];
                    acc[k][1] += x1 * wt[k];
                }
            }
#pragma GCC unroll 16
            for (int k = 0; k < fb; k++) {
                *(VU *)(y + k * fsy + w) = acc[k][0];
                *(VU *)(y + k * fsy + w + L) = acc[k][1];
            }
        next:
            if (w + step == cols)
                break;
            /* the last block of a row overlaps the one before when cols is not a multiple of 2L:
             * outputs are written, not accumulated, so computing a few twice is harmless */
            w = (w + 2 * step <= cols) ? w + step : cols - step;
        }
        return;
    }
    for (; w < cols; w++) {  /* rows narrower than one vector block */
        for (int k = 0; k < fb; k++) {
            T s = bias ? bias[k] : (T)0;
            for (Py_ssize_t t = 0; t < ntap; t++)
                s += x[off[t] + cs * w] * wp[t * F + k];
            y[k * fsy + w] = s;
        }
    }
}

static void
NAME(conv_fwd)(const T *x, const T *xend, const int64_t *off, Py_ssize_t ntap, Py_ssize_t rsx,
               Py_ssize_t cs, const T *wp, Py_ssize_t F, T *y, Py_ssize_t fsy, Py_ssize_t rsy,
               Py_ssize_t rows, Py_ssize_t cols, const T *bias) CLONES;

static void
NAME(conv_fwd)(const T *x, const T *xend, const int64_t *off, Py_ssize_t ntap, Py_ssize_t rsx,
               Py_ssize_t cs, const T *wp, Py_ssize_t F, T *y, Py_ssize_t fsy, Py_ssize_t rsy,
               Py_ssize_t rows, Py_ssize_t cols, const T *bias)
{
    const Py_ssize_t nb = (F + MAX_FB - 1) / MAX_FB;
    Py_ssize_t offmax = 0;
    for (Py_ssize_t t = 0; t < ntap; t++)
        offmax = off[t] > offmax ? off[t] : offmax;
    for (Py_ssize_t h = 0; h < rows; h++) {
        Py_ssize_t f0 = 0;
        for (Py_ssize_t b = 0; b < nb; b++) {
            /* filters split evenly over the blocks: 16 -> 8 + 8, 18 -> 9 + 9, 64 -> 11 * 5 + 9 */
            const int fb = (int)((F - f0 + (nb - b) - 1) / (nb - b));
            const T *xr = x + h * rsx;
            const T *bb = bias ? bias + f0 : NULL;
            T *yr = y + f0 * fsy + h * rsy;
            const Py_ssize_t xlim = xend - xr;
#define FWD_CASE(n) case n: \
    if (cs == 1) \
        NAME(fwd_row)(xr, off, ntap, offmax, xlim, wp + f0, F, yr, fsy, cols, bb, n, 1); \
    else \
        NAME(fwd_row)(xr, off, ntap, offmax, xlim, wp + f0, F, yr, fsy, cols, bb, n, 2); \
    break;
            switch (fb) {
                FWD_CASE(1) FWD_CASE(2) FWD_CASE(3) FWD_CASE(4) FWD_CASE(5) FWD_CASE(6)
                FWD_CASE(7) FWD_CASE(8) FWD_CASE(9) FWD_CASE(10) FWD_CASE(11) FWD_CASE(12)
            }
#undef FWD_CASE
            f0 += fb;
        }
    }
}

/* part[k*ntap + j] (vector partial sums) += sum over rows [h0, h1) and the first nvec vectors of each row
 * of dy[k, h, :] * x[off[j] + h*rsx + cs*(:)]  for a block of fb <= WG_FB filters and tb <= WG_TB taps.
 * The registers always hold a full WG_FB x WG_TB block (one compiled variant per column stride): a short
 * block repeats its last filter and tap and keeps only the real sums. */
static inline __attribute__((always_inline)) void
NAME(wgrad_block)(const T *x, const int64_t *off, Py_ssize_t rsx, const T *dy, Py_ssize_t fsdy,
                  Py_ssize_t rsdy, Py_ssize_t h0, Py_ssize_t h1, Py_ssize_t nvec, V *part, Py_ssize_t ntap,
                  const int fb, const int tb, const int cs)
{
    const Py_ssize_t L = NAME(LANES);
    V acc[WG_FB][WG_TB];
    int64_t o[WG_TB];
    Py_ssize_t dk[WG_FB];
#pragma GCC unroll 8
    for (int j = 0; j < WG_TB; j++)
        o[j] = off[j < tb ? j : tb - 1];
#pragma GCC unroll 8
    for (int k = 0; k < WG_FB; k++)
        dk[k] = (k < fb ? k : fb - 1) * fsdy;
#pragma GCC unroll 8
    for (int k = 0; k < WG_FB; k++)
#pragma GCC unroll 8
        for (int j = 0; j < WG_TB; j++)
            acc[k][j] = (k < fb && j < tb) ? part[k * ntap + j] : (V){0};
    for (Py_ssize_t h = h0; h < h1; h++) {
        const T *xr = x + h * rsx, *dr = dy + h * rsdy;
        for (Py_ssize_t i = 0; i < nvec; i++) {
            V d[WG_FB];
#pragma GCC unroll 8
            for (int k = 0; k < WG_FB; k++)
                d[k] = *(const VU *)(dr + dk[k] + i * L);
#pragma GCC unroll 8
            for (int j = 0; j < WG_TB; j++) {
                const V xv = NAME(load_cols)(xr + o[j] + cs * i * L, cs);
#pragma GCC unroll 8
                for (int k = 0; k < WG_FB; k++)
                    acc[k][j] += d[k] * xv;
            }
        }
    }
#pragma GCC unroll 8
    for (int k = 0; k < WG_FB; k++)
#pragma GCC unroll 8
        for (int j = 0; j < WG_TB; j++)
            if (k < fb && j < tb)
                part[k * ntap + j] = acc[k][j];
}

static int
NAME(conv_wgrad)(const T *x, const T *xend, const int64_t *off, Py_ssize_t ntap, Py_ssize_t rsx,
                 Py_ssize_t cs, const T *dy, Py_ssize_t F, Py_ssize_t fsdy, Py_ssize_t rsdy, Py_ssize_t rows,
                 Py_ssize_t cols, T *dw) CLONES;

static int
NAME(conv_wgrad)(const T *x, const T *xend, const int64_t *off, Py_ssize_t ntap, Py_ssize_t rsx,
                 Py_ssize_t cs, const T *dy, Py_ssize_t F, Py_ssize_t fsdy, Py_ssize_t rsdy, Py_ssize_t rows,
                 Py_ssize_t cols, T *dw)
{
    const Py_ssize_t L = NAME(LANES), nvec = cols / NAME(LANES);
    Py_ssize_t offmax = 0, vrows = rows;
    for (Py_ssize_t t = 0; t < ntap; t++)
        offmax = off[t] > offmax ? off[t] : offmax;
    /* rows whose vectors stay inside the input (stride 2 loads one element past the last one used) */
    while (vrows > 0 && x + (vrows - 1) * rsx + offmax + cs * nvec * L > xend)
        vrows--;
    if (nvec > 0 && vrows > 0) {
        V *part = aligned_alloc(64, (size_t)(F * ntap) * sizeof(V));
        if (!part)
            return -1;
        memset(part, 0, (size_t)(F * ntap) * sizeof(V));
        /* rows per tile: about WG_TILE_PIXELS outputs, so that the tile of dy and x stays in cache while
         * every (filter block, tap block) pair sweeps it */
        Py_ssize_t rt = WG_TILE_PIXELS / cols;
        if (rt < 1)
            rt = 1;
        for (Py_ssize_t h0 = 0; h0 < vrows; h0 += rt) {
            const Py_ssize_t h1 = h0 + rt < vrows ? h0 + rt : vrows;
            for (Py_ssize_t f0 = 0; f0 < F; f0 += WG_FB) {
                const int fb = (int)(F - f0 < WG_FB ? F - f0 : WG_FB);
                for (Py_ssize_t t0 = 0; t0 < ntap; t0 += WG_TB) {
                    const int tb = (int)(ntap - t0 < WG_TB ? ntap - t0 : WG_TB);
                    const T *dyf = dy + f0 * fsdy;
                    V *pp = part + f0 * ntap + t0;
                    if (cs == 1)
                        NAME(wgrad_block)(x, off + t0, rsx, dyf, fsdy, rsdy, h0, h1, nvec, pp, ntap, fb, tb, 1);
                    else
                        NAME(wgrad_block)(x, off + t0, rsx, dyf, fsdy, rsdy, h0, h1, nvec, pp, ntap, fb, tb, 2);
                }
            }
        }
        for (Py_ssize_t i = 0; i < F * ntap; i++) {
            T s = 0;
            for (Py_ssize_t l = 0; l < L; l++)
                s += part[i][l];
            dw[i] += s;
        }
        free(part);
    }
    const Py_ssize_t done = (nvec > 0) ? nvec * L : 0;
    if (done < cols || vrows < rows) {  /* columns past the last whole vector, rows left to scalar code */
        for (Py_ssize_t k = 0; k < F; k++)
            for (Py_ssize_t t = 0; t < ntap; t++) {
                T s = 0;
                for (Py_ssize_t h = 0; h < rows; h++)
                    for (Py_ssize_t w = (h < vrows ? done : 0); w < cols; w++)
                        s += dy[k * fsdy + h * rsdy + w] * x[off[t] + h * rsx + cs * w];
                dw[k * ntap + t] += s;
            }
    }
    return 0;
}

/* Rows i*r1 + j*r2 of a window (ncols each) against their s column phases, phase b at b*dp of the phase
 * rows i*p1 + j*p2 (ceil((ncols - b)/s) each). merge = 0: split, window -> phases; 1: merge, phases ->
 * window. Each window row is read or written once, with its s phases. */
static void
NAME(phase_rows)(T *win, Py_ssize_t n1, Py_ssize_t n2, Py_ssize_t r1, Py_ssize_t r2, Py_ssize_t ncols,
                 Py_ssize_t s, T *ph, Py_ssize_t p1, Py_ssize_t p2, Py_ssize_t dp, int merge) CLONES;

static void
NAME(phase_rows)(T *win, Py_ssize_t n1, Py_ssize_t n2, Py_ssize_t r1, Py_ssize_t r2, Py_ssize_t ncols,
                 Py_ssize_t s, T *ph, Py_ssize_t p1, Py_ssize_t p2, Py_ssize_t dp, int merge)
{
    for (Py_ssize_t i = 0; i < n1; i++)
        for (Py_ssize_t j = 0; j < n2; j++) {
            T *restrict a = win + i * r1 + j * r2;
            T *restrict b = ph + i * p1 + j * p2;
            if (s == 2 && !merge) {
                T *restrict b1 = b + dp;
                for (Py_ssize_t k = 0; k < ncols / 2; k++) {
                    b[k] = a[2 * k];
                    b1[k] = a[2 * k + 1];
                }
                if (ncols & 1)
                    b[ncols / 2] = a[ncols - 1];
            } else if (s == 2) {
                const T *restrict b1 = b + dp;
                for (Py_ssize_t k = 0; k < ncols / 2; k++) {
                    a[2 * k] = b[k];
                    a[2 * k + 1] = b1[k];
                }
                if (ncols & 1)
                    a[ncols - 1] = b[ncols / 2];
            } else {
                for (Py_ssize_t q = 0; q < s; q++)
                    for (Py_ssize_t k = 0; k * s + q < ncols; k++) {
                        if (merge)
                            a[k * s + q] = b[q * dp + k];
                        else
                            b[q * dp + k] = a[k * s + q];
                    }
            }
        }
}

/* Both column phases of a stride-2 data gradient (or of a transposed convolution whose stride is its
 * kernel) at once, interleaved on the store:
 *   y[k*fsy + h*rsy + 2r + b] = bias[k] + sum_t wp_b[t*F + k] * x[off_b[t] + h*rsx + r]    (b = 0, 1)
 * (bias NULL: none)
 * for output columns 0 <= 2r + b < cols. Each 2L-column block holds L columns of either phase. */
static inline __attribute__((always_inline)) void
NAME(pair_row)(const T *x, const int64_t *const off[2], const Py_ssize_t ntap[2], const T *const wp[2],
               Py_ssize_t F, T *y, Py_ssize_t fsy, Py_ssize_t cols, const T *bias, const int fb)
{
    const Py_ssize_t L = NAME(LANES), step = 2 * NAME(LANES);
    if (cols < step) {
        for (Py_ssize_t q = 0; q < cols; q++) {
            const int b = (int)(q & 1);
            for (int k = 0; k < fb; k++) {
                T s = bias ? bias[k] : (T)0;
                for (Py_ssize_t t = 0; t < ntap[b]; t++)
                    s += x[off[b][t] + q / 2] * wp[b][t * F + k];
                y[k * fsy + q] = s;
            }
        }
        return;
    }
    Py_ssize_t q0 = 0;
    for (;;) {
        /* columns q0, q0+2, ... are phase b0 from column (q0 - b0)/2 on; the others phase 1 - b0 */
        const int b0 = (int)(q0 & 1);
        V acc[2][MAX_FB];
        for (int p = 0; p < 2; p++) {
            const int b = p ? 1 - b0 : b0;
            const Py_ssize_t r = p ? (q0 + b0) / 2 : (q0 - b0) / 2;
#pragma GCC unroll 16
            for (int k = 0; k < fb; k++)
                acc[p][k] = (V){0} + (bias ? bias[k] : (T)0);
            const T *xr = x + r;
            for (Py_ssize_t t = 0; t < ntap[b]; t++) {
                const V xv = *(const VU *)(xr + off[b][t]);
                const T *wt = wp[b] + t * F;
#pragma GCC unroll 16
                for (int k = 0; k < fb; k++)
                    acc[p][k] += xv * wt[k];
            }
        }
#pragma GCC unroll 16
        for (int k = 0; k < fb; k++) {
            *(VU *)(y + k * fsy + q0) = __builtin_shuffle(acc[0][k], acc[1][k], NAME(ZIP_LO));
            *(VU *)(y + k * fsy + q0 + L) = __builtin_shuffle(acc[0][k], acc[1][k], NAME(ZIP_HI));
        }
        if (q0 + step == cols)
            break;
        q0 = (q0 + 2 * step <= cols) ? q0 + step : cols - step;  /* last block overlaps, as in fwd_row */
    }
}

static void
NAME(conv_pair)(const T *x, const int64_t *off0, Py_ssize_t ntap0, const int64_t *off1, Py_ssize_t ntap1,
                Py_ssize_t rsx, const T *wp0, const T *wp1, Py_ssize_t F, T *y, Py_ssize_t fsy,
                Py_ssize_t rsy, Py_ssize_t rows, Py_ssize_t cols, const T *bias) CLONES;

static void
NAME(conv_pair)(const T *x, const int64_t *off0, Py_ssize_t ntap0, const int64_t *off1, Py_ssize_t ntap1,
                Py_ssize_t rsx, const T *wp0, const T *wp1, Py_ssize_t F, T *y, Py_ssize_t fsy,
                Py_ssize_t rsy, Py_ssize_t rows, Py_ssize_t cols, const T *bias)
{
    const Py_ssize_t nb = (F + MAX_FB - 1) / MAX_FB;
    const int64_t *const off[2] = {off0, off1};
    const Py_ssize_t ntap[2] = {ntap0, ntap1};
    for (Py_ssize_t h = 0; h < rows; h++) {
        Py_ssize_t f0 = 0;
        for (Py_ssize_t b = 0; b < nb; b++) {
            const int fb = (int)((F - f0 + (nb - b) - 1) / (nb - b));
            const T *const wp[2] = {wp0 + f0, wp1 + f0};
            const T *xr = x + h * rsx;
            T *yr = y + f0 * fsy + h * rsy;
            const T *bk = bias ? bias + f0 : NULL;
#define PAIR_CASE(n) case n: NAME(pair_row)(xr, off, ntap, wp, F, yr, fsy, cols, bk, n); break;
            switch (fb) {
                PAIR_CASE(1) PAIR_CASE(2) PAIR_CASE(3) PAIR_CASE(4) PAIR_CASE(5) PAIR_CASE(6)
                PAIR_CASE(7) PAIR_CASE(8) PAIR_CASE(9) PAIR_CASE(10) PAIR_CASE(11) PAIR_CASE(12)
            }
#undef PAIR_CASE
            f0 += fb;
        }
    }
}
