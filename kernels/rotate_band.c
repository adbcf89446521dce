/* δ-rotation of cached RoPE rows on CPU (buffer fp32 or bf16; arithmetic fp32): the C
 * backend of rotate_band (rotate_band_c.py holds its launcher; the torch reference is
 * rotate_band_torch in rotate_band.py, and this computes exactly what it does).
 *
 * For every lead offset L (a layer and head of the pool) and every item k:
 *
 *   a, b = the rotary pairs of row src[k]'s band   (interleaved or split halves)
 *   row dst[k]'s band <- (a*cos - b*sin, b*cos + a*sin)   cos/sin of item k (or one row)
 *   and, when dst[k] != src[k], the rest of row dst[k] <- row src[k] (bitwise)
 *
 * Each product and each sum is rounded to fp32 separately (no fused multiply-add: the
 * torch reference runs them as separate elementwise ops), then rounded to bf16 to nearest
 * even, so the result is bitwise the reference's. One pass: each source row is read once
 * and each destination row written once. That is only right when no item reads a row that
 * another writes; the launcher sends such plans ("gather_first") to the reference.
 * Threads (OpenMP, the runtime torch loaded) take ranges of (lead, item) pairs.
 */
#pragma GCC optimize("fp-contract=off")
#include "vec.h"

/* element idx of base <- f (bf16: rounded to nearest even, as torch does) */
INLINE void st1(void *base, int64_t idx, float f, const int BF) {
    if (!BF) {
        ((float *)base)[idx] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    ((uint16_t *)base)[idx] = (u & 0x7fffffffu) > 0x7f800000u /* NaN */
                                  ? 0x7fc0
                                  : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* pair j of a band: the two element indices (from the band's start) */
INLINE void pair(int64_t j, int64_t half, int inter, int64_t *ia, int64_t *ib) {
    *ia = inter ? 2 * j : j;
    *ib = inter ? 2 * j + 1 : half + j;
}

/* one item on one lead: source row at element s, destination row at d */
INLINE void row_g(const int BF, void *restrict buf, int64_t s, int64_t d, int moved,
                  int64_t width, int64_t lo, int64_t half, int inter, const float *c,
                  const float *sn) {
    float a[half], b[half]; /* read the band before writing (in place: s == d) */
    for (int64_t j = 0; j < half; j++) {
        int64_t ia, ib;
        pair(j, half, inter, &ia, &ib);
        a[j] = ld1(buf, s + lo + ia, BF);
        b[j] = ld1(buf, s + lo + ib, BF);
    }
    if (moved) {
        size_t es = BF ? 2 : 4;
        int64_t hi = lo + 2 * half;
        memcpy((void *)at(buf, d, BF), at(buf, s, BF), (size_t)lo * es);
        memcpy((void *)at(buf, d + hi, BF), at(buf, s + hi, BF), (size_t)(width - hi) * es);
    }
    for (int64_t j = 0; j < half; j++) {
        int64_t ia, ib;
        pair(j, half, inter, &ia, &ib);
        float ac = a[j] * c[j], bs = b[j] * sn[j], bc = b[j] * c[j], as = a[j] * sn[j];
        st1(buf, d + lo + ia, ac - bs, BF);
        st1(buf, d + lo + ib, bc + as, BF);
    }
}

/* nlead lead offsets (elements), K items (src, dst rows; moved flags), row stride and width
   (elements), band [lo, lo + 2*half); cos/sin [K or 1, half] (cs_rs: 0 for one row shared
   by every item); bf16: the buffer's dtype. Returns 0. */
int ll_rotate(int64_t buf_ptr, int bf16, int64_t nlead, const int64_t *lead, int64_t K,
              const int64_t *src, const int64_t *dst, const uint8_t *moved, int64_t row_stride,
              int64_t width, int64_t lo, int64_t half, int inter, const float *cos,
              const float *sin, int64_t cs_rs, int nthreads, int64_t parallel_min) {
    int64_t total = nlead * K;
    int parallel = nthreads > 1 && total * width >= parallel_min;
#pragma omp parallel for num_threads(nthreads) if (parallel) schedule(static)
    for (int64_t t = 0; t < total; t++) {
        int64_t l = t / K, k = t % K;
        int64_t s = lead[l] + src[k] * row_stride, d = lead[l] + dst[k] * row_stride;
        const float *c = cos + k * cs_rs, *sn = sin + k * cs_rs;
        void *buf = (void *)(intptr_t)buf_ptr;
        if (bf16)
            row_g(1, buf, s, d, moved[k], width, lo, half, inter, c, sn);
        else
            row_g(0, buf, s, d, moved[k], width, lo, half, inter, c, sn);
    }
    return 0;
}
