/* The host kernel's dot bodies alone, one thread, on rows that stay in cache: nanoseconds a row
 * of 2048 columns for each kind moe.c multiplies. Not a test; it includes moe.c itself, so an
 * older moe.c can be timed the same way (MOE_C names it). MOEFIT_ISA caps the instruction set.
 *
 *   cc -O3 -std=gnu11 -Imoefit/kernels -o /tmp/kernel_rows bench/kernel_rows.c -lm -lpthread
 *   /tmp/kernel_rows [rows 256] [repeats 7]        (prints the best of the repeats)
 *
 * It also times int4 through matrix_rows, as the kernel calls it (in panels of eight rows where the
 * ISA has them, panels.h, rearranged per call), a row at a time (the row body), and stored as
 * panels (HostPanels, "int4p"), for 1, 4, 16 and 64 tokens; and the GGUF block types through
 * matrix_rows too (the row figures above are their portable rows), for the same token counts
 * (more than 4: a prompt chunk's decoded panels, kdecoded.h).
 */
#ifndef MOE_C
#define MOE_C "moe.c"
#endif
#include MOE_C
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* random codes, but every block's scale a plain number (random fp16 or e8m0 bytes would be
 * subnormals, infinities and NaNs, whose arithmetic is far slower than a file's) */
static void plain_scales(int quant, uint8_t *w, size_t bytes) {
    static const uint8_t one[2] = {0x00, 0x3c};                                 /* fp16 1.0 */
    const size_t block = quant == 14 ? 17 : quant == 10 ? 144 : quant == 11 ? 176 : quant == 12 ? 210 : 136;
    if (quant < 10) return;
    for (size_t b = 0; b + block <= bytes; b += block) {
        if (quant == 14) w[b] = 127;                                            /* 2^-1 */
        else if (quant == 12) memcpy(w + b + 208, one, 2);
        else {
            memcpy(w + b, one, 2);
            if (quant == 10 || quant == 11) memcpy(w + b + 2, one, 2);         /* dmin */
        }
    }
}

/* ns a row of `cols` for quant code `quant` (moe.c's codes), best of `repeats` */
static double time_rows(int quant, int64_t rows, int64_t cols, int repeats) {
    const size_t rb = row_bytes(quant, cols);
    uint8_t *w = aligned_alloc(64, rows * rb + 64);
    uint16_t *s = aligned_alloc(64, rows * (cols / QK) * 2 + 64);
    float *rs = malloc(4 * rows), *x = malloc(4 * cols), *qs = malloc(4 * (cols / QK));
    int8_t *q = aligned_alloc(64, cols);
    int32_t *qsum = malloc(4 * (cols / QK));
    for (size_t i = 0; i < rows * rb; i++) w[i] = (uint8_t)rand();
    plain_scales(quant, w, rows * rb);
    for (int64_t i = 0; i < rows * (cols / QK); i++) s[i] = 0x3c00;            /* fp16 1.0 */
    for (int64_t i = 0; i < rows; i++) rs[i] = 1.0f;
    for (int64_t i = 0; i < cols; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    quantize_row(x, cols, q, qs, qsum, int4_order(quant));
    const dot_fn dot = dot_for(quant);
    const int reps = (int)(50000000 / (rows * rb)) + 1;
    volatile float sink = 0.0f;
    double best = 1e30;
    for (int r = 0; r < repeats; r++) {
        const double t0 = now();
        for (int k = 0; k < reps; k++)
            for (int64_t i = 0; i < rows; i++)
                sink += dot(w + i * rb, quant == 8 ? (const void *)(rs + i) : (const void *)(s + i * (cols / QK)),
                            q, qs, qsum, cols, QK);
        const double ns = (now() - t0) / ((double)reps * rows) * 1e9;
        best = ns < best ? ns : best;
    }
    free(w), free(s), free(rs), free(x), free(qs), free(q), free(qsum);
    return best;
}

/* ns a row and a token for `tokens` tokens through matrix_rows as the kernel chooses, a row at a
 * time, and (int4) stored as panels (0 where the ISA has none or the quant is not int4), best of `repeats` */
static void time_matrix(int quant, int64_t rows, int64_t cols, int64_t tokens, int repeats, double ns[3]) {
    const int64_t nb = cols / QK, rb = row_bytes(quant, cols);
    uint8_t *w = aligned_alloc(64, rows * rb + 64);
    uint16_t *s = aligned_alloc(64, rows * nb * 2 + 64);
    float *x = malloc(4 * tokens * cols), *qs = malloc(4 * tokens * nb), *y = malloc(4 * tokens * rows);
    int8_t *q = aligned_alloc(64, tokens * cols + 64);
    int32_t *qsum = malloc(4 * tokens * nb);
    for (int64_t i = 0; i < rows * rb; i++) w[i] = (uint8_t)rand();
    plain_scales(quant, w, rows * rb);
    for (int64_t i = 0; i < rows * nb; i++) s[i] = 0x3c00;
    for (int64_t i = 0; i < tokens * cols; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    for (int64_t t = 0; t < tokens; t++) quantize_row(x + t * cols, cols, q + t * cols, qs + t * nb, qsum + t * nb, int4_order(quant));
    const act_rows A = {q, qs, qsum, NULL, y, rows, tokens};
    const int panels = int4_panels;
    const int reps = (int)(20000000 / (rows * rb * tokens)) + 1;
    uint8_t *pw = aligned_alloc(64, rows * rb + 64);
    uint16_t *ps = aligned_alloc(64, rows * nb * 2 + 64);
    const int stored = quant == 4 && moe_to_panels(w, s, rows, cols, QK, pw, ps) == 0;
    ns[2] = 0.0;                                                  /* none stored: no figure */
    for (int way = 0; way < (stored ? 3 : 2); way++) {
        int4_panels = way == 1 ? 0 : panels;
        ns[way] = 1e30;
        for (int r = 0; r < repeats; r++) {
            const double t0 = now();
            for (int k = 0; k < reps; k++)
                if (way < 2) matrix_rows(quant, w, s, cols, QK, 0, rows, &A);
                else stored_rows(5, pw, ps, rows, cols, QK, 0, rows, &A);
            const double t = (now() - t0) / ((double)reps * rows * tokens) * 1e9;
            ns[way] = t < ns[way] ? t : ns[way];
        }
    }
    int4_panels = panels;
    free(pw), free(ps), free(w), free(s), free(x), free(qs), free(y), free(q), free(qsum);
}

int main(int argc, char **argv) {
    const int64_t rows = argc > 1 ? atoll(argv[1]) : 256;
    const int repeats = argc > 2 ? atoi(argv[2]) : 7;
    static const struct { int code; const char *name; } kinds[] = {
        {8, "int8"}, {4, "int4"}, {9, "q8_0"}, {10, "q4_k"}, {11, "q5_k"}, {12, "q6_k"}, {13, "iq4_xs"}, {14, "mxfp4"}};
    choose_isa();
    printf("isa %s; %lld rows of 2048 columns (in cache), one thread, best of %d\n", isa, (long long)rows, repeats);
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
        printf("%-7s %7.1f ns a row\n", kinds[k].name, time_rows(kinds[k].code, rows, 2048, repeats));
    printf("int4 through matrix_rows (%s), ns a row and a token:\n", int4_panels ? "panels of 8 rows" : "no panels on this isa");
    for (int64_t tokens = 1; tokens <= 64; tokens *= 4) {
        double ns[3];
        time_matrix(4, rows, 2048, tokens, repeats, ns);
        printf("  %2lld tokens: %6.1f (a row at a time %6.1f, x%.2f; stored as panels %6.1f, x%.2f)\n",
               (long long)tokens, ns[0], ns[1], ns[1] / ns[0], ns[2], ns[2] > 0 ? ns[1] / ns[2] : 0.0);
    }
    printf("GGUF blocks through matrix_rows (as the kernel calls them: panels of 8 rows or tiles), ns a row and a token,\n"
           "GB/s of weights read, multiply-adds a second:\n");
    for (size_t k = 3; k < sizeof kinds / sizeof kinds[0]; k++)
        for (int64_t tokens = 1; tokens <= 64; tokens *= 4) {
            double ns[3];
            time_matrix(kinds[k].code, rows, 2048, tokens, repeats, ns);
            printf("  %-7s %2lld tokens: %6.1f (%5.1f GB/s, %5.1f GMAC/s)\n", kinds[k].name, (long long)tokens, ns[0],
                   row_bytes(kinds[k].code, 2048) / (ns[0] * tokens), 2048 / ns[0]);
        }
    return 0;
}
