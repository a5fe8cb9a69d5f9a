/* Quantised matrix times a few vectors on the host: the cache-miss hot path.
 *
 *   y[t, r] = sum_c x[t, c] * W[r, c]      for t < T (T small: decode, a verify window)
 *
 * int8: W = codes[r, c] * scale[r]                  (per-output-channel)
 * int4: W = (nibble[r, c] - 8) * scale[r, c / G]    (two codes per byte, low nibble first,
 *                                                    scales per group of G inputs, as fp32)
 * Rows are split across OpenMP threads; the inner loops are written for the compiler's
 * vectoriser (int8 -> float widen + FMA). Reading 1 or 0.5 byte per weight instead of 4 is
 * where the speed over fp32 comes from: batch-1 decode is bound by memory bandwidth.
 */
#include <stdint.h>
#include <stdlib.h>

void qgemv_int8(const float *x, const int8_t *w, const float *scale, float *y,
                int64_t T, int64_t R, int64_t C) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int8_t *row = w + r * C;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * C;
            float acc = 0.0f;
            #pragma omp simd reduction(+:acc)
            for (int64_t c = 0; c < C; c++) acc += xt[c] * (float)row[c];
            y[t * R + r] = acc * scale[r];
        }
    }
}

/* One row of int4 codes (unpacked to lo/hi) against one split token, group by group. The
 * group-of-32 case keeps 16 lanes of partial sums so the compiler needs no reduction. */
static float row_dot16(const float *e, const float *o, const int8_t *lo, const int8_t *hi,
                       const float *s, int64_t groups) {
    float lanes[16] = {0};
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = g * 16;
        for (int i = 0; i < 16; i++)
            lanes[i] += (e[at + i] * lo[at + i] + o[at + i] * hi[at + i]) * s[g];
    }
    float acc = 0.0f;
    for (int i = 0; i < 16; i++) acc += lanes[i];
    return acc;
}

static float row_dot(const float *e, const float *o, const int8_t *lo, const int8_t *hi,
                     const float *s, int64_t groups, int64_t hg) {
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        float part = 0.0f;
        for (int64_t i = g * hg; i < (g + 1) * hg; i++) part += e[i] * lo[i] + o[i] * hi[i];
        acc += part * s[g];
    }
    return acc;
}

/* int4: x is split into its even and odd columns once per call, so the inner loop reads
 * both halves contiguously (low nibble = even column, high nibble = odd column). */
/* C <= 16384 (the unpacked row lives on the stack). */
void qgemv_int4(const float *x, const uint8_t *w, const float *scale, float *y,
                int64_t T, int64_t R, int64_t C, int64_t G) {
    const int64_t groups = C / G, half = C / 2, hg = G / 2;
    float *xe = malloc(sizeof(float) * T * half), *xo = malloc(sizeof(float) * T * half);
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            xe[t * half + i] = x[t * C + 2 * i];
            xo[t * half + i] = x[t * C + 2 * i + 1];
        }
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *row = w + r * half;
        const float *srow = scale + r * groups;
        int8_t lo[8192], hi[8192];                 /* this row's codes, unpacked once */
        for (int64_t i = 0; i < half; i++) {
            lo[i] = (int8_t)(row[i] & 15) - 8;
            hi[i] = (int8_t)(row[i] >> 4) - 8;
        }
        for (int64_t t = 0; t < T; t++) {
            const float *e = xe + t * half, *o = xo + t * half;
            y[t * R + r] = hg == 16 ? row_dot16(e, o, lo, hi, srow, groups)
                                    : row_dot(e, o, lo, hi, srow, groups, hg);
        }
    }
    free(xe);
    free(xo);
}
