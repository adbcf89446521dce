/* Decode attention for a batch of sequences over their pool rows, run by run (CPU; pool
 * rows fp32 or bf16, queries, scores and sums fp32).
 *
 * Built and loaded by decode_attn.py: its launcher checks every shape, stride and dtype
 * first, and its torch reference is the same math. One call serves every decoding sequence
 * of a layer:
 *
 *   o[s, b, i, :] = softmax_j(scale * sum_p q_p[s, b, i, :] . k_p[b, row_j, :]) . v[b, row_j, :]
 *
 * s: a sequence; b: a kv head (GQA) or the one latent head (MLA); i: one of the g query rows
 * that share head b; p: a key part (GQA: the keys; MLA: c_kv against the absorbed query and
 * k_pe against the rotated one); j: the sequence's rows, its runs of consecutive pool rows
 * end to end. Pool tensors are read in place through their strides: no row is copied.
 * Every width is a multiple of 16 (checked by the launcher).
 *
 * A task is (sequence, head, group of query rows, split of the rows). It takes its scores
 * into a scratch row per query, exponentiates them against their maximum, and sums the
 * values weighted by them: two passes over the rows, keys then values. Splits of one
 * (sequence, head, group) are merged by their maxima and sums (exact, as flash-decoding's
 * split-K). Four query rows (GQA's common group) score four key rows at a time: their 16
 * dot products are reduced together by one tree of shuffles, about a quarter of the
 * operations of 16 horizontal sums, with the same additions in the same order. Loops are
 * written on 16-float vectors (GCC vector extensions: AVX-512 where -march=native has it,
 * AVX2 pairs otherwise); a group size is a compile-time constant in each instance
 * (always_inline + a switch), so the accumulators stay in registers.
 */
#include <math.h>
#include <stdlib.h>

#include "vec.h"

#define MAX_PARTS 2
#define SCORE_BLOCK 128  /* rows per pass of the query groups (they stay in L2) */
#define PV_BLOCK 64      /* rows per pass of the column chunks (they stay in L2) */
#define PREFETCH_ROWS 16 /* software prefetch distance: with the hardware's alone, rows
                            streamed from memory leave these loops latency-bound */

/* exp(x) for x <= 0: 2^k * P(r), x = k ln2 + r, |r| <= ln2 / 2, P of degree 6 (relative
   error below 3e-7); x below -87 gives exp(-87) (~1.6e-38: a weight that cannot count). */
INLINE v16 vexp(v16 x) {
    const v16 lo = (v16){0} - 87.0f, magic = (v16){0} + 12582912.0f; /* 1.5 * 2^23 */
    i16v below = x < lo;
    x = (v16)(((i16v)x & ~below) | ((i16v)lo & below));
    v16 kf = (x * 1.44269504f + magic) - magic; /* round(x / ln2) */
    v16 r = x - kf * 0.693145752f - kf * 1.42860677e-06f;
    v16 p = (v16){0} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    i16v k = __builtin_convertvector(kf, i16v);
    return p * (v16)((k + 127) << 23);
}

/* ------------------------------------------------------------------------------ passes */
/* s[i][j - j0] (+)= scale * q_i . k_j for G query rows and rows [j0, j1) of one run */
INLINE void scores_g(const int G, const int BF, const float *restrict q, int64_t q_rs,
                     const void *restrict k, int64_t k_rs, int64_t j0, int64_t j1, int d,
                     float *restrict s, int64_t s_rs, int accumulate, float scale) {
    for (int64_t j = j0; j < j1; j++) {
        const void *kr = at(k, j * k_rs, BF);
        for (int c = 0; c < d; c += 16)
            __builtin_prefetch(at(kr, PREFETCH_ROWS * k_rs + c, BF));
        v16 acc[8];
        for (int i = 0; i < G; i++) acc[i] = (v16){0};
        for (int c = 0; c < d; c += 16) {
            v16 kv = ld_row(kr, c, BF);
            for (int i = 0; i < G; i++) acc[i] += ld(q + i * q_rs + c) * kv;
        }
        for (int i = 0; i < G; i++) {
            float *out = s + i * s_rs + (j - j0);
            float v = scale * hsum(acc[i]);
            *out = accumulate ? *out + v : v;
        }
    }
}

/* the sums of 16 vectors, lane k = sum of v[k]: a tree of pairwise half-folds (15 of two
   shuffles and an add) instead of 16 horizontal sums */
INLINE v16 hsum16(v16 *v) {
#define FOLD(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
    v16 w[8], x[4], y[2];
    for (int m = 0; m < 8; m++)
        w[m] = FOLD(v[2 * m], v[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                    23) +
               FOLD(v[2 * m], v[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                    29, 30, 31);
    for (int m = 0; m < 4; m++)
        x[m] = FOLD(w[2 * m], w[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                    26, 27) +
               FOLD(w[2 * m], w[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                    30, 31);
    for (int m = 0; m < 2; m++)
        y[m] = FOLD(x[2 * m], x[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25,
                    28, 29) +
               FOLD(x[2 * m], x[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                    30, 31);
    return FOLD(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           FOLD(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#undef FOLD
}

/* scores_g for 4 query rows (GQA's common group), four rows of keys at a time: the 16
   products of a quad reduced together (hsum16), each query row's 4 scores stored as one */
INLINE void scores_q4(const int BF, const float *restrict q, int64_t q_rs,
                      const void *restrict k, int64_t k_rs, int64_t j0, int64_t j1, int d,
                      float *restrict s, int64_t s_rs, int accumulate, float scale) {
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        v16 acc[16]; /* acc[i * 4 + r]: query row i against key row j + r */
        for (int a = 0; a < 16; a++) acc[a] = (v16){0};
        for (int r = 0; r < 4; r++) {
            const void *kr = at(k, (j + r) * k_rs, BF);
            for (int c = 0; c < d; c += 16)
                __builtin_prefetch(at(kr, PREFETCH_ROWS * k_rs + c, BF));
        }
        for (int c = 0; c < d; c += 16)
            for (int r = 0; r < 4; r++) {
                v16 kv = ld_row(at(k, (j + r) * k_rs, BF), c, BF);
                for (int i = 0; i < 4; i++) acc[i * 4 + r] += ld(q + i * q_rs + c) * kv;
            }
        float z[16];
        st(z, hsum16(acc) * scale);
        for (int i = 0; i < 4; i++) {
            float *out = s + i * s_rs + (j - j0);
            v4 zi;
            memcpy(&zi, z + 4 * i, sizeof zi);
            if (accumulate) {
                v4 old;
                memcpy(&old, out, sizeof old);
                zi += old;
            }
            memcpy(out, &zi, sizeof zi);
        }
    }
    if (j < j1)
        scores_g(4, BF, q, q_rs, k, k_rs, j, j1, d, s + (j - j0), s_rs, accumulate, scale);
}

/* blocks of SCORE_BLOCK rows, every group of 4 query rows passing over a block while it
   sits in L2; 8 query rows (MLA's heads against one latent row) in one pass, so a row
   comes from memory once */
static void scores(int gn, int bf, const float *q, int64_t q_rs, const void *k, int64_t k_rs,
                   int64_t j0, int64_t j1, int d, float *s, int64_t s_rs, int accumulate,
                   float scale) {
    for (int64_t b0 = j0; b0 < j1; b0 += SCORE_BLOCK) {
        int64_t b1 = b0 + SCORE_BLOCK < j1 ? b0 + SCORE_BLOCK : j1;
        float *sb = s + (b0 - j0);
#define SC(G, qi, si)                                                                   \
    (bf ? scores_g(G, 1, qi, q_rs, k, k_rs, b0, b1, d, si, s_rs, accumulate, scale)     \
        : scores_g(G, 0, qi, q_rs, k, k_rs, b0, b1, d, si, s_rs, accumulate, scale))
        if (gn == 8) {
            SC(8, q, sb);
            continue;
        }
        for (int i = 0; i < gn; i += 4) {
            const float *qi = q + i * q_rs;
            float *si = sb + i * s_rs;
            switch (gn - i < 4 ? gn - i : 4) {
            case 1: SC(1, qi, si); break;
            case 2: SC(2, qi, si); break;
            case 3: SC(3, qi, si); break;
            default: bf ? scores_q4(1, qi, q_rs, k, k_rs, b0, b1, d, si, s_rs, accumulate, scale)
                        : scores_q4(0, qi, q_rs, k, k_rs, b0, b1, d, si, s_rs, accumulate, scale);
            }
        }
#undef SC
    }
}

/* o[i] += sum_j w[i][j - j0] * v_j: G query rows x C vectors of columns, rows [j0, j1) */
INLINE void pv_gc(const int G, const int C, const int BF, const float *restrict w,
                  int64_t w_rs, const void *restrict v, int64_t v_rs, int64_t j0, int64_t j1,
                  float *restrict o, int64_t o_rs, int prefetch) {
    v16 acc[8][4];
    for (int i = 0; i < G; i++)
        for (int c = 0; c < C; c++) acc[i][c] = ld(o + i * o_rs + 16 * c);
    for (int64_t j = j0; j < j1; j++) {
        const void *vr = at(v, j * v_rs, BF);
        for (int c = 0; c < prefetch; c += 16)
            __builtin_prefetch(at(vr, PREFETCH_ROWS * v_rs + c, BF));
        v16 vv[4];
        for (int c = 0; c < C; c++) vv[c] = ld_row(vr, 16 * c, BF);
        for (int i = 0; i < G; i++) {
            float x = w[i * w_rs + (j - j0)];
            for (int c = 0; c < C; c++) acc[i][c] += x * vv[c];
        }
    }
    for (int i = 0; i < G; i++)
        for (int c = 0; c < C; c++) st(o + i * o_rs + 16 * c, acc[i][c]);
}

static void pv_chunk(int gn, int cn, int bf, const float *w, int64_t w_rs, const void *v,
                     int64_t v_rs, int64_t j0, int64_t j1, float *o, int64_t o_rs,
                     int prefetch) {
#define PV_CASE(G, C)                                                                      \
    (bf ? pv_gc(G, C, 1, w, w_rs, v, v_rs, j0, j1, o, o_rs, prefetch)                      \
        : pv_gc(G, C, 0, w, w_rs, v, v_rs, j0, j1, o, o_rs, prefetch))
    switch (gn * 8 + cn) {
    case 8 + 1: PV_CASE(1, 1); break;
    case 8 + 2: PV_CASE(1, 2); break;
    case 8 + 4: PV_CASE(1, 4); break;
    case 16 + 1: PV_CASE(2, 1); break;
    case 16 + 2: PV_CASE(2, 2); break;
    case 16 + 4: PV_CASE(2, 4); break;
    case 24 + 1: PV_CASE(3, 1); break;
    case 24 + 2: PV_CASE(3, 2); break;
    case 24 + 4: PV_CASE(3, 4); break;
    case 32 + 1: PV_CASE(4, 1); break;
    case 32 + 2: PV_CASE(4, 2); break;
    case 32 + 4: PV_CASE(4, 4); break;
    case 64 + 1: PV_CASE(8, 1); break;
    default: PV_CASE(8, 2); /* 64 + 2 */
    }
#undef PV_CASE
}

/* all dv columns over rows [j0, j1): blocks of PV_BLOCK rows, every column chunk passing
   over a block while it sits in L2 (chunks of 4 vectors for <= 4 query rows, 2 for 8). The
   first chunk's pass prefetches whole rows: the other chunks' lines are then in L2, not
   fetched one strided line at a time. */
static void pv(int gn, int bf, int dv, const float *w, int64_t w_rs, const void *v,
               int64_t v_rs, int64_t j0, int64_t j1, float *o, int64_t o_rs) {
    int widest = gn == 8 ? 2 : 4;
    for (int64_t b0 = j0; b0 < j1; b0 += PV_BLOCK) {
        int64_t b1 = b0 + PV_BLOCK < j1 ? b0 + PV_BLOCK : j1;
        for (int c0 = 0; c0 < dv;) {
            int left = (dv - c0) / 16, cn = left >= widest ? widest : left >= 2 ? 2 : 1;
            pv_chunk(gn, cn, bf, w + (b0 - j0), w_rs, at(v, c0, bf), v_rs,
                     b0, b1, o + c0, o_rs, c0 == 0 ? dv : 0);
            c0 += 16 * cn;
        }
    }
}

/* s[:n] = exp(s - max); returns (max, sum) */
static void exp_row(float *s, int64_t n, float *m_out, float *l_out) {
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
    v16 sum = (v16){0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        v16 e = vexp(ld(s + j) - m);
        st(s + j, e);
        sum += e;
    }
    float l = hsum(sum);
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        l += s[j];
    }
    *m_out = m;
    *l_out = l;
}

/* ------------------------------------------------------------------------------- entry */
typedef struct {
    int nparts, d[MAX_PARTS], dv, bf; /* bf: the pool's rows are bf16 (else fp32) */
    const float *q[MAX_PARTS]; /* q_p[s, b, i, :] at q[p] + s*q_ss + b*q_bs + i*q_rs */
    int64_t q_ss[MAX_PARTS], q_bs[MAX_PARTS], q_rs[MAX_PARTS];
    const void *k[MAX_PARTS]; /* k_p[b, row, :]: element k[p] + b*k_bs + row*k_rs */
    int64_t k_bs[MAX_PARTS], k_rs[MAX_PARTS];
    const void *v;
    int64_t v_bs, v_rs;
} layout;

/* the rows [j0, j1) of run r that fall in the columns [lo, hi); 0 if none */
static int run_window(int64_t lo, int64_t hi, const int64_t *cols, const int64_t *len, int r,
                      int64_t *j0, int64_t *j1) {
    *j0 = lo > cols[r] ? lo - cols[r] : 0;
    *j1 = hi < cols[r + 1] ? hi - cols[r] : len[r];
    return *j0 < *j1;
}

/* one task: sequence s's rows [lo, hi), head b, query rows gi .. gi + gn; unnormalised
   output (rows gn x dv, stride dv) and per row its max and sum */
static void task(const layout *L, int64_t s, int64_t b, int gi, int gn, const int64_t *first,
                 const int64_t *len, const int64_t *cols, int nruns, int64_t lo, int64_t hi,
                 float scale, float *o, float *m, float *l, float *buf) {
    int64_t n = hi - lo;
    for (int p = 0; p < L->nparts; p++) {
        const float *q = L->q[p] + s * L->q_ss[p] + b * L->q_bs[p] + gi * L->q_rs[p];
        const void *k = L->k[p];
        for (int r = 0; r < nruns; r++) {
            int64_t j0, j1;
            if (!run_window(lo, hi, cols, len, r, &j0, &j1)) continue;
            /* rows first[r] + j of the pool land in columns cols[r] + j - lo of buf */
            const void *kr = at(k, b * L->k_bs[p] + first[r] * L->k_rs[p], L->bf);
            scores(gn, L->bf, q, L->q_rs[p], kr, L->k_rs[p], j0, j1, L->d[p],
                   buf + (cols[r] + j0 - lo), n, p > 0, scale);
        }
    }
    for (int i = 0; i < gn; i++) exp_row(buf + i * n, n, m + i, l + i);
    memset(o, 0, sizeof(float) * gn * L->dv);
    const void *v = L->v;
    for (int r = 0; r < nruns; r++) {
        int64_t j0, j1;
        if (!run_window(lo, hi, cols, len, r, &j0, &j1)) continue;
        const void *vr = at(v, b * L->v_bs + first[r] * L->v_rs, L->bf);
        pv(gn, L->bf, L->dv, buf + (cols[r] + j0 - lo), n, vr, L->v_rs, j0, j1, o, L->dv);
    }
}

/* The batch: sequence s owns runs seq_runs[s] .. seq_runs[s+1] of (run_first, run_len);
   output o[s, b, i, :] at o + s*o_ss + b*o_bs + i*o_rs. Each (sequence, head, group) is cut
   into `splits` shares of its rows. Returns 0, or -1 if scratch memory ran out (nothing
   written then). */
int ll_decode(int nseq, int B, int g, int nparts, const int32_t *d, int dv,
              const int64_t *q_ptrs, const int64_t *q_ss, const int64_t *q_bs,
              const int64_t *q_rs, const int64_t *k_ptrs, const int64_t *k_bs,
              const int64_t *k_rs, int64_t v_ptr, int64_t v_bs, int64_t v_rs,
              const int64_t *seq_runs, const int64_t *run_first, const int64_t *run_len,
              int64_t o_ptr, int64_t o_ss, int64_t o_bs, int64_t o_rs, int splits,
              float scale, int nthreads, int64_t parallel_min_rows, int kv_bf16) {
    layout L = {.nparts = nparts, .dv = dv, .bf = kv_bf16, .v = (const void *)(intptr_t)v_ptr,
                .v_bs = v_bs, .v_rs = v_rs};
    for (int p = 0; p < nparts; p++) {
        L.d[p] = d[p];
        L.q[p] = (const float *)(intptr_t)q_ptrs[p];
        L.q_ss[p] = q_ss[p], L.q_bs[p] = q_bs[p], L.q_rs[p] = q_rs[p];
        L.k[p] = (const void *)(intptr_t)k_ptrs[p];
        L.k_bs[p] = k_bs[p], L.k_rs[p] = k_rs[p];
    }
    int gs = g % 8 == 0 ? 8 : 4, groups = (g + gs - 1) / gs;
    int64_t nruns = seq_runs[nseq];
    int64_t *cols = malloc(sizeof(int64_t) * (nruns + nseq)); /* per sequence: runs + 1 */
    int64_t ntasks = (int64_t)nseq * B * groups * splits, total = 0, longest = 0;
    float *part = malloc(sizeof(float) * ntasks * gs * (dv + 2));
    if (!cols || !part) {
        free(cols), free(part);
        return -1;
    }
    for (int64_t s = 0; s < nseq; s++) {
        int64_t *c = cols + seq_runs[s] + s;
        c[0] = 0;
        for (int64_t r = seq_runs[s]; r < seq_runs[s + 1]; r++)
            c[r - seq_runs[s] + 1] = c[r - seq_runs[s]] + run_len[r];
        int64_t n = c[seq_runs[s + 1] - seq_runs[s]];
        total += n, longest = n > longest ? n : longest;
    }
    int failed = 0;
    int parallel = nthreads > 1 && ntasks > 1 && total * B >= parallel_min_rows;
#pragma omp parallel num_threads(nthreads) if (parallel) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * gs * ((longest + splits - 1) / splits + 1));
        if (!buf) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntasks; t++) {
            if (!buf) continue;
            int64_t s = t / (B * groups * splits), rest = t % (B * groups * splits);
            int64_t b = rest / (groups * splits);
            int gi = (int)(rest / splits % groups) * gs, share = (int)(rest % splits);
            int gn = g - gi < gs ? g - gi : gs;
            const int64_t *c = cols + seq_runs[s] + s;
            int nr = (int)(seq_runs[s + 1] - seq_runs[s]);
            int64_t n = c[nr], lo = n * share / splits, hi = n * (share + 1) / splits;
            float *o = part + t * gs * (dv + 2), *m = o + gs * dv, *l = m + gs;
            if (lo >= hi) { /* an empty share: weight zero in the merge */
                for (int i = 0; i < gn; i++) m[i] = -INFINITY, l[i] = 0;
                memset(o, 0, sizeof(float) * gn * dv);
                continue;
            }
            task(&L, s, b, gi, gn, run_first + seq_runs[s], run_len + seq_runs[s], c, nr, lo,
                 hi, scale, o, m, l, buf);
        }
        free(buf);
    }
    if (!failed) { /* merge the shares of every (sequence, head, group) */
        float *out = (float *)(intptr_t)o_ptr;
        for (int64_t t0 = 0; t0 < ntasks; t0 += splits) {
            int64_t s = t0 / (B * groups * splits), rest = t0 % (B * groups * splits);
            int64_t b = rest / (groups * splits);
            int gi = (int)(rest / splits % groups) * gs, gn = g - gi < gs ? g - gi : gs;
            for (int i = 0; i < gn; i++) {
                float mx = -INFINITY, denom = 0;
                for (int k = 0; k < splits; k++) {
                    float mk = part[(t0 + k) * gs * (dv + 2) + gs * dv + i];
                    mx = mk > mx ? mk : mx;
                }
                float *dst = out + s * o_ss + b * o_bs + (gi + i) * o_rs;
                memset(dst, 0, sizeof(float) * dv);
                for (int k = 0; k < splits; k++) {
                    const float *o = part + (t0 + k) * gs * (dv + 2);
                    float mk = o[gs * dv + i], lk = o[gs * dv + gs + i];
                    if (lk == 0) continue;
                    float wgt = expf(mk - mx);
                    denom += wgt * lk;
                    for (int c = 0; c < dv; c++) dst[c] += wgt * o[i * dv + c];
                }
                for (int c = 0; c < dv; c++) dst[c] /= denom;
            }
        }
    }
    free(cols), free(part);
    return failed ? -1 : 0;
}
