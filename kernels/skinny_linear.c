/* A linear layer for a few rows (CPU; weights fp32 or bf16, inputs, sums and outputs fp32):
 *
 *   y[m, o] = sum_i x[m, i] * w[o, i] (+ bias[o])     m < M <= 4
 *
 * Built and loaded by skinny_linear.py: its launcher checks every shape, stride and dtype
 * first, and its torch reference is the same math. This is a decode step's product: each
 * weight byte is used M times, so the time is the weight's read from memory. One core
 * streaming one sequence of rows is latency-bound (the hardware prefetchers work page by
 * page: measured here 7-10 GB/s), NS streams read at once keep more misses in flight
 * (13-14 GB/s): the output rows of a thread's range are cut into NS equal parts read
 * side by side, each with a software prefetch ahead. Threads (OpenMP, the runtime torch
 * loaded) take contiguous ranges of output rows. Loops are written on 16-float GCC vector
 * types; M and the weight dtype are compile-time constants in each instance.
 */
#include "vec.h"

#define NS 4            /* output rows read side by side (M x NS accumulators in registers) */
#define PREFETCH 256    /* software prefetch distance in elements of a weight row */
#define MAX_ROWS 4

/* output rows o[t] (t < S streams) for all M input rows */
INLINE void rows_g(const int M, const int S, const int BF, const float *restrict x,
                   int64_t x_rs, const void *restrict w, int64_t w_rs, int64_t n,
                   const int64_t *o, const float *restrict bias, float *restrict y,
                   int64_t y_rs) {
    const void *wr[NS];
    v16 acc[NS][MAX_ROWS];
    for (int t = 0; t < S; t++) {
        wr[t] = at(w, o[t] * w_rs, BF);
        for (int m = 0; m < M; m++) acc[t][m] = (v16){0};
    }
    int64_t c = 0;
    for (; c + 16 <= n; c += 16)
        for (int t = 0; t < S; t++) {
            __builtin_prefetch(at(wr[t], c + PREFETCH, BF));
            v16 wv = ld_row(wr[t], c, BF);
            for (int m = 0; m < M; m++) acc[t][m] += ld(x + m * x_rs + c) * wv;
        }
    for (int t = 0; t < S; t++)
        for (int m = 0; m < M; m++) {
            float s = hsum(acc[t][m]);
            for (int64_t k = c; k < n; k++) s += x[m * x_rs + k] * ld1(wr[t], k, BF);
            y[m * y_rs + o[t]] = bias ? s + bias[o[t]] : s;
        }
}

/* output rows [o0, o1): NS streams of q rows each, then the rest one at a time */
INLINE void range_g(const int M, const int BF, const float *x, int64_t x_rs, const void *w,
                    int64_t w_rs, int64_t n, int64_t o0, int64_t o1, const float *bias,
                    float *y, int64_t y_rs) {
    int64_t q = (o1 - o0) / NS, o[NS];
    for (int64_t r = 0; r < q; r++) {
        for (int t = 0; t < NS; t++) o[t] = o0 + t * q + r;
        rows_g(M, NS, BF, x, x_rs, w, w_rs, n, o, bias, y, y_rs);
    }
    for (int64_t r = o0 + NS * q; r < o1; r++) {
        o[0] = r;
        rows_g(M, 1, BF, x, x_rs, w, w_rs, n, o, bias, y, y_rs);
    }
}

static void range(int M, int bf, const float *x, int64_t x_rs, const void *w, int64_t w_rs,
                  int64_t n, int64_t o0, int64_t o1, const float *bias, float *y,
                  int64_t y_rs) {
#define RANGE(m)                                                                 \
    (bf ? range_g(m, 1, x, x_rs, w, w_rs, n, o0, o1, bias, y, y_rs)              \
        : range_g(m, 0, x, x_rs, w, w_rs, n, o0, o1, bias, y, y_rs))
    switch (M) {
    case 1: RANGE(1); break;
    case 2: RANGE(2); break;
    case 3: RANGE(3); break;
    default: RANGE(4);
    }
#undef RANGE
}

/* y[m, o] for m < M (1..4), o < out over n inputs; x rows at x + m*x_rs, weight row o at
   w + o*w_rs (elements; bf16 if w_bf16), y rows at y + m*y_rs; bias may be 0. Threads take
   contiguous ranges of output rows when the weight has at least parallel_min elements.
   Returns 0, or -1 for an M it does not take. */
int ll_linear(int M, int64_t n, int64_t out, int64_t x_ptr, int64_t x_rs, int64_t w_ptr,
              int64_t w_rs, int w_bf16, int64_t bias_ptr, int64_t y_ptr, int64_t y_rs,
              int nthreads, int64_t parallel_min) {
    if (M < 1 || M > MAX_ROWS) return -1;
    const float *x = (const float *)(intptr_t)x_ptr, *bias = (const float *)(intptr_t)bias_ptr;
    const void *w = (const void *)(intptr_t)w_ptr;
    float *y = (float *)(intptr_t)y_ptr;
    int parallel = nthreads > 1 && out * n >= parallel_min && out >= 2 * NS * nthreads;
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        int64_t k = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        int64_t k = 0, nt = 1;
#endif
        range(M, w_bf16, x, x_rs, w, w_rs, n, out * k / nt, out * (k + 1) / nt, bias, y, y_rs);
    }
    return 0;
}
