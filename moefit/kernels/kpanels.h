/* Q4_K, Q5_K, IQ4_XS and MXFP4 rows eight at a time (included by moe.c after ktiles.h; the layout: kquants.h).
 *
 * As panels.h does for int4: eight rows' bytes are transposed in registers (block_quads) so that
 * a lane is a row, and each quad of codes meets four activations broadcast; a sub-block's sums
 * stay in their lanes and are scaled by the eight rows' d sc (one vector), its mins taken off by
 * the eight rows' dmin m. The tile's work per token has no horizontal adds and no per-row
 * scale unpacking: the eight rows' super-block headers are transposed as the codes are and
 * unpacked at once (four gathers before; without them, one token from memory on the Zen 4 bench
 * machine: Q5_K 1.19-1.36 -> 1.07-1.13 ms a layer call, Q4_K 1.14-1.30 -> 0.89-1.29).
 *
 * A Q4_K or Q5_K row whose eight-row group lies in the task goes through a panel, the rows past a
 * matrix's last whole panel through ktiles.h's tile, whatever the token count: a row's
 * arithmetic does not depend on the call. The integer sums are the same on every instruction set
 * (AVX2's maddubs into int16, four quads a chain: at most 4 * 2 * 31 * 127 = 31496; VNNI's
 * dpbusd into int32) and so are the float operations on them.
 */
#if defined(__x86_64__)
/* eight rows' (row_bytes apart) super-block headers -> per sub-block j: d sc_j and dmin m_j, a lane a row */
__attribute__((target("avx2,fma,f16c"))) static inline void q4k_panel_scales(const uint8_t *blk, int64_t row_bytes,
                                                                            __m256 dsc[8], __m256 dmn[8]) {
    __m256i head[4];                                   /* d dmin | scales 0-3 | 4-7 | 8-11, a lane a row */
    block_quads(blk, row_bytes, head);
    const __m256i dd = head[0], u0 = head[1], u1 = head[2], u2 = head[3];
    const __m256i six = _mm256_set1_epi32(0x3f3f3f3f), four = _mm256_set1_epi32(0x0f0f0f0f), two = _mm256_set1_epi32(0x03030303);
    const __m256i sc[2] = {_mm256_and_si256(u0, six),                                  /* k4_unpack's, a lane a row */
                           _mm256_or_si256(_mm256_and_si256(u2, four), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), two), 4))};
    const __m256i mn[2] = {_mm256_and_si256(u1, six),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), four),
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), two), 4))};
    const __m256i halves = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dd, _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)), 0xd8);
    const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves)), dmin = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
    const __m256i byte = _mm256_set1_epi32(0xff);
    for (int j = 0; j < 8; j++) {
        const __m128i shift = _mm_cvtsi32_si128(8 * (j % 4));
        dsc[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(sc[j / 4], shift), byte)), d);
        dmn[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(mn[j / 4], shift), byte)), dmin);
    }
}

/* the next panel's super-block sb (eight rows on), asked for while this one's is read */
static inline void panel_prefetch(const uint8_t *w, int64_t row_bytes, int64_t sb, int bytes) {
    const char *next = (const char *)w + 8 * row_bytes + sb * 8 * bytes;
    for (int l = 0; l < 8 * bytes; l += 64) _mm_prefetch(next + l, _MM_HINT_T1);
}

/* one sub-block's products, per instruction set: into int16 lanes (AVX2) or int32 (VNNI) */
#define KP_ADD_AVX2(s, v, x) (s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v, x)))
#define KP_FINISH_AVX2(s) _mm256_madd_epi16(s, _mm256_set1_epi16(1))
#define KP_ADD_VNNI256(s, v, x) (s = _mm256_dpbusd_epi32(s, v, x))
#define KP_ADD_AVXVNNI(s, v, x) (s = _mm256_dpbusd_avx_epi32(s, v, x))
#define KP_FINISH_VNNI(s) (s)

/* a token's sub-block j of a panel: its sums (two halves of 16 bytes, two chains) scaled, its mins taken off */
#define KP_SCALE(acc, FINISH, s0, s1, dsc, dmn, t, b)                                                 \
    (acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(FINISH(s0), FINISH(s1))),               \
                           _mm256_mul_ps(dsc, _mm256_set1_ps(a[t].s[b])), acc),                        \
     acc = _mm256_fnmadd_ps(dmn, _mm256_set1_ps(a[t].s[b] * (float)a[t].sum[b]), acc))

/* eight Q4_K rows (FIFTH: Q5_K's; the first at w, row_bytes apart) against NT tokens:
 * a[t].y[r..r+8). Q5_K's fifth bits (bit j of byte i: element i of sub-block j) are transposed
 * as the codes are, the quads of the same bytes. */
#define Q45K_PANEL(NAME, TARGET, ADD, FINISH, FIFTH, NT)                                            \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     const tile_row *a, int64_t r) {                \
        const int bytes = FIFTH ? 176 : 144;                                                        \
        const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);                 \
        ZEROED(acc, NT);                                                                            \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * bytes, *codes = blk + (FIFTH ? 48 : 16);                  \
            panel_prefetch(w, row_bytes, sb, bytes);                                                \
            __m256 dsc[8], dmn[8];                                                                  \
            q4k_panel_scales(blk, row_bytes, dsc, dmn);                                             \
            __m256i qh[2][4];                                   /* Q5_K: the fifth bits' quads */  \
            if (FIFTH) block_quads(blk + 16, row_bytes, qh[0]), block_quads(blk + 32, row_bytes, qh[1]); \
            for (int j = 0; j < 8; j += 2) {                                                        \
                __m256i s[NT][4];                                  /* sub-block j, j + 1; half 0, 1 */ \
                for (int t = 0; t < NT; t++)                                                        \
                    for (int i = 0; i < 4; i++) s[t][i] = _mm256_setzero_si256();                   \
                for (int h = 0; h < 2; h++) {                                                       \
                    __m256i v[4];                                                                   \
                    block_quads(codes + 16 * j + 16 * h, row_bytes, v);                             \
                    for (int k = 0; k < 4; k++) {                                                   \
                        __m256i lo = _mm256_and_si256(v[k], low), hi = _mm256_and_si256(_mm256_srli_epi16(v[k], 4), low); \
                        if (FIFTH) {                                                                \
                            lo = _mm256_or_si256(lo, FIFTH_BIT(qh[h][k], _mm256_set1_epi8((char)(1 << j)), sixteen)); \
                            hi = _mm256_or_si256(hi, FIFTH_BIT(qh[h][k], _mm256_set1_epi8((char)(2 << j)), sixteen)); \
                        }                                                                           \
                        for (int t = 0; t < NT; t++) {                                              \
                            const int8_t *x = a[t].q + (sb * 8 + j) * QK + 16 * h + 4 * k;          \
                            ADD(s[t][h], lo, BROADCAST4(x));                                        \
                            ADD(s[t][2 + h], hi, BROADCAST4(x + QK));                               \
                        }                                                                           \
                    }                                                                               \
                }                                                                                   \
                for (int t = 0; t < NT; t++) {                                                      \
                    const int64_t b = sb * 8 + j;                                                   \
                    KP_SCALE(acc[t], FINISH, s[t][0], s[t][1], dsc[j], dmn[j], t, b);               \
                    KP_SCALE(acc[t], FINISH, s[t][2], s[t][3], dsc[j + 1], dmn[j + 1], t, b + 1);   \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(a[t].y + r, acc[t]);                          \
    }

/* eight IQ4_XS rows' super-block headers -> per sub-block j: d (ls_j - 32), a lane a row (iq4_scales') */
__attribute__((target("avx2,fma,f16c"))) static inline void iq4_panel_scales(const uint8_t *blk, int64_t row_bytes,
                                                                            __m256 dsc[8]) {
    __m256i head[4];                                   /* d scales_h | scales_l | codes, a lane a row */
    block_quads(blk, row_bytes, head);
    const __m256i halves = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(head[0], _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)), 0xd8);
    const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    const __m256i high = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(halves, 1)), low = head[1];
    for (int j = 0; j < 8; j++) {                      /* ls_j: nibble j of scales_l, bits 2j, 2j + 1 of scales_h */
        const __m256i ls = _mm256_or_si256(
            _mm256_and_si256(_mm256_srl_epi32(low, _mm_cvtsi32_si128(4 * j)), _mm256_set1_epi32(15)),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(high, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi32(3)), 4));
        dsc[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))), d);
    }
}

/* one quad of IQ4_XS values (v) against four activations broadcast (x), into int32 lanes s. VNNI:
 * the values offset by 128 (the table's bytes xor 0x80: unsigned, as dpbusd wants), the offset's
 * 128 sum(x) taken off a sub-block's sums once; AVX2: |v| against x with v's sign (ktiles.h's
 * SIGNED_DOT: maddubs of 128 + v could saturate int16). The same integers either way. */
#define IQ4_ADD_AVX2(s, v, x) (s = _mm256_add_epi32(s, SIGNED_DOT(DOT_AVX2, v, x)))
#define IQ4_ADD_VNNI256(s, v, x) (s = _mm256_dpbusd_epi32(s, v, x))
#define IQ4_ADD_AVXVNNI(s, v, x) (s = _mm256_dpbusd_avx_epi32(s, v, x))

/* one block of 32 of eight rows (its 16 code bytes at `codes`, row_bytes apart) against NT tokens:
 * each quad of codes looked up in the table, met by four activations of block `b` broadcast
 * -> s[t], the int32 sums a lane a row (IQ4_XS's sub-blocks, MXFP4's blocks) */
#define TABLE_BLOCK_SUMS(ADD, NT, table, codes, row_bytes, a, b, s)                                 \
    do {                                                                                            \
        const __m256i low_ = _mm256_set1_epi8(15);                                                  \
        __m256i v_[4];                                                                              \
        block_quads((codes), (row_bytes), v_);                                                      \
        for (int t = 0; t < NT; t++) s[t] = _mm256_setzero_si256();                                 \
        for (int k = 0; k < 4; k++) {                                                               \
            const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v_[k], low_));           \
            const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v_[k], 4), low_)); \
            for (int t = 0; t < NT; t++) {                                                          \
                const int8_t *x = a[t].q + (b) * QK + 4 * k;                                        \
                ADD(s[t], lo, BROADCAST4(x));                                                       \
                ADD(s[t], hi, BROADCAST4(x + 16));                                                  \
            }                                                                                       \
        }                                                                                           \
    } while (0)

/* eight IQ4_XS rows against NT tokens: each quad of codes looked up in the table, met by four
 * activations broadcast (IQ4_ADD: OFFSET 128 for VNNI's unsigned values, 0 for AVX2's signed), a
 * sub-block's int32 sums in their lanes scaled by the eight rows' d (ls - 32) */
#define IQ4_PANEL(NAME, TARGET, ADD, OFFSET, NT)                                                    \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     const tile_row *a, int64_t r) {                \
        const __m256i table = _mm256_xor_si256(TABLE(IQ4NL), _mm256_set1_epi8(OFFSET ? (char)0x80 : 0)); \
        ZEROED(acc, NT);                                                                            \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * 136;                                                      \
            panel_prefetch(w, row_bytes, sb, 136);                                                  \
            __m256 dsc[8];                                                                          \
            iq4_panel_scales(blk, row_bytes, dsc);                                                  \
            for (int j = 0; j < 8; j++) {                                                           \
                __m256i s[NT];                                                                      \
                TABLE_BLOCK_SUMS(ADD, NT, table, blk + 8 + 16 * j, row_bytes, a, sb * 8 + j, s);    \
                for (int t = 0; t < NT; t++) {                                                      \
                    const int64_t b = sb * 8 + j;                                                   \
                    const __m256i sum = _mm256_sub_epi32(s[t], _mm256_set1_epi32(OFFSET * a[t].sum[b])); \
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dsc[j], _mm256_set1_ps(a[t].s[b])), \
                                             acc[t]);                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(a[t].y + r, acc[t]);                          \
    }

/* eight MXFP4 rows' block exponents e (row_bytes apart) -> 2^(e - 128), a lane a row (e8m0_half's) */
__attribute__((target("avx2,fma"))) static inline __m256 mx_panel_scales(const uint8_t *blk, int64_t row_bytes) {
    const __m256i e = _mm256_setr_epi32(blk[0], blk[row_bytes], blk[2 * row_bytes], blk[3 * row_bytes],
                                        blk[4 * row_bytes], blk[5 * row_bytes], blk[6 * row_bytes], blk[7 * row_bytes]);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);          /* e 0, 1: subnormal */
    return _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
}

/* eight MXFP4 rows (gpt-oss's experts: blocks of 32, 17 bytes) against NT tokens: IQ4_PANEL's
 * lookups and sums a block at a time, scaled by the eight rows' 2^(e - 128). Rows of 2,880 (gpt-oss's
 * hidden size) are not whole groups of eight blocks: the blocks are walked one by one. */
#define MXFP4_PANEL(NAME, TARGET, ADD, OFFSET, NT)                                                  \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     const tile_row *a, int64_t r) {                \
        const __m256i table = _mm256_xor_si256(TABLE(MXFP4X2), _mm256_set1_epi8(OFFSET ? (char)0x80 : 0)); \
        ZEROED(acc, NT);                                                                            \
        for (int64_t b = 0; b < n / QK; b++) {                                                      \
            const uint8_t *blk = w + b * 17;                                                        \
            if (b % 8 == 0) panel_prefetch(w, row_bytes, b / 8, 136);                               \
            const __m256 d = mx_panel_scales(blk, row_bytes);                                       \
            __m256i s[NT];                                                                          \
            TABLE_BLOCK_SUMS(ADD, NT, table, blk + 1, row_bytes, a, b, s);                          \
            for (int t = 0; t < NT; t++) {                                                          \
                const __m256i sum = _mm256_sub_epi32(s[t], _mm256_set1_epi32(OFFSET * a[t].sum[b])); \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(a[t].s[b])), acc[t]); \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(a[t].y + r, acc[t]);                          \
    }

/* A call of more than one tile (a prompt chunk's experts): each panel of eight Q4_K, Q5_K, IQ4_XS or MXFP4
 * rows is decoded once into the calling thread's buffer (every block of 32's eight code vectors,
 * transposed and unpacked, or looked up, as the panels above make them per tile; the eight rows'
 * scales, and Q4_K's / Q5_K's mins), and each tile reads them there. The integer sums and the
 * float operations on them are the panels', in their order: a row's outputs do not depend on the
 * call's token count. A layer call of 16 and 64 tokens, two alternated pairs each against the tiles
 * (bench/results/kernel-decoded-panels-round26-avx512.txt, an AVX512 EPYC, 2 threads): Q4_K 1.02-1.41x,
 * Q5_K 1.05-1.22x, IQ4_XS 0.90-1.31x, MXFP4 (gpt-oss's shape) 1.14-1.43x; Q6_K has no panels. */
#define IQ4_DECODE(NAME, TARGET, OFFSET)                                                            \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     __m256i *vals, __m256 *scales) {               \
        const __m256i table = _mm256_xor_si256(TABLE(IQ4NL), _mm256_set1_epi8(OFFSET ? (char)0x80 : 0)); \
        const __m256i low = _mm256_set1_epi8(15);                                                   \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * 136;                                                      \
            panel_prefetch(w, row_bytes, sb, 136);                                                  \
            iq4_panel_scales(blk, row_bytes, scales + sb * 16);                                     \
            for (int j = 0; j < 8; j++) {                                                           \
                __m256i v[4], *out = vals + (sb * 8 + j) * 8;                                       \
                block_quads(blk + 8 + 16 * j, row_bytes, v);                                        \
                for (int k = 0; k < 4; k++) {                                                       \
                    _mm256_store_si256(out + k, _mm256_shuffle_epi8(table, _mm256_and_si256(v[k], low))); \
                    _mm256_store_si256(out + 4 + k, _mm256_shuffle_epi8(table,                      \
                                       _mm256_and_si256(_mm256_srli_epi16(v[k], 4), low)));         \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }

/* eight MXFP4 rows decoded: MXFP4_PANEL's looked-up vectors, a block's eight 2^(e - 128) */
#define MX_DECODE(NAME, TARGET, OFFSET)                                                             \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     __m256i *vals, __m256 *scales) {               \
        const __m256i table = _mm256_xor_si256(TABLE(MXFP4X2), _mm256_set1_epi8(OFFSET ? (char)0x80 : 0)); \
        const __m256i low = _mm256_set1_epi8(15);                                                   \
        for (int64_t b = 0; b < n / QK; b++) {                                                      \
            const uint8_t *blk = w + b * 17;                                                        \
            if (b % 8 == 0) panel_prefetch(w, row_bytes, b / 8, 136);                               \
            scales[b] = mx_panel_scales(blk, row_bytes);                                            \
            __m256i v[4], *out = vals + b * 8;                                                      \
            block_quads(blk + 1, row_bytes, v);                                                     \
            for (int k = 0; k < 4; k++) {                                                           \
                _mm256_store_si256(out + k, _mm256_shuffle_epi8(table, _mm256_and_si256(v[k], low))); \
                _mm256_store_si256(out + 4 + k, _mm256_shuffle_epi8(table,                          \
                                   _mm256_and_si256(_mm256_srli_epi16(v[k], 4), low)));             \
            }                                                                                       \
        }                                                                                           \
    }

/* a decoded IQ4_XS or MXFP4 panel against NT tokens: IQ4_PANEL's (MXFP4_PANEL's) sums and scaling on
 * the decoded vectors; SCALE(b): block b's scales in the buffer */
#define IQ4_SCALE(b) (b / 8 * 16 + b % 8)
#define MX_SCALE(b) (b)
#define TABLE_DECODED_PANEL(NAME, TARGET, ADD, OFFSET, SCALE, NT)                                   \
    __attribute__((target(TARGET))) static void NAME(const __m256i *vals, const __m256 *scales, int64_t n, \
                                                     const tile_row *a, int64_t r) {                \
        ZEROED(acc, NT);                                                                            \
        for (int64_t b = 0; b < n / QK; b++) {                                                      \
            __m256i s[NT];                                                                          \
            for (int t = 0; t < NT; t++) s[t] = _mm256_setzero_si256();                             \
            for (int k = 0; k < 4; k++) {                                                           \
                const __m256i lo = _mm256_load_si256(vals + b * 8 + k), hi = _mm256_load_si256(vals + b * 8 + 4 + k); \
                for (int t = 0; t < NT; t++) {                                                      \
                    const int8_t *x = a[t].q + b * QK + 4 * k;                                      \
                    ADD(s[t], lo, BROADCAST4(x));                                                   \
                    ADD(s[t], hi, BROADCAST4(x + 16));                                              \
                }                                                                                   \
            }                                                                                       \
            const __m256 dsc = scales[SCALE(b)];                                                    \
            for (int t = 0; t < NT; t++) {                                                          \
                const __m256i sum = _mm256_sub_epi32(s[t], _mm256_set1_epi32(OFFSET * a[t].sum[b])); \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dsc, _mm256_set1_ps(a[t].s[b])), acc[t]); \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(a[t].y + r, acc[t]);                          \
    }

/* eight Q4_K (FIFTH: Q5_K) rows decoded: per sub-block pair (j, j + 1) and half h, Q45K_PANEL's four
 * lo (sub-block j) and four hi (j + 1) vectors, its fifth bits in; per super-block the eight d sc,
 * then the eight dmin m */
#define Q45K_DECODE(NAME, TARGET, FIFTH)                                                            \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     __m256i *vals, __m256 *scales) {               \
        const int bytes = FIFTH ? 176 : 144;                                                        \
        const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);                 \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * bytes, *codes = blk + (FIFTH ? 48 : 16);                  \
            panel_prefetch(w, row_bytes, sb, bytes);                                                \
            q4k_panel_scales(blk, row_bytes, scales + sb * 16, scales + sb * 16 + 8);               \
            __m256i qh[2][4];                                                                       \
            if (FIFTH) block_quads(blk + 16, row_bytes, qh[0]), block_quads(blk + 32, row_bytes, qh[1]); \
            for (int j = 0; j < 8; j += 2)                                                          \
                for (int h = 0; h < 2; h++) {                                                       \
                    __m256i v[4], *out = vals + sb * 64 + j * 8 + h * 8;                            \
                    block_quads(codes + 16 * j + 16 * h, row_bytes, v);                             \
                    for (int k = 0; k < 4; k++) {                                                   \
                        __m256i lo = _mm256_and_si256(v[k], low), hi = _mm256_and_si256(_mm256_srli_epi16(v[k], 4), low); \
                        if (FIFTH) {                                                                \
                            lo = _mm256_or_si256(lo, FIFTH_BIT(qh[h][k], _mm256_set1_epi8((char)(1 << j)), sixteen)); \
                            hi = _mm256_or_si256(hi, FIFTH_BIT(qh[h][k], _mm256_set1_epi8((char)(2 << j)), sixteen)); \
                        }                                                                           \
                        _mm256_store_si256(out + k, lo), _mm256_store_si256(out + 4 + k, hi);       \
                    }                                                                               \
                }                                                                                   \
        }                                                                                           \
    }

/* a decoded Q4_K / Q5_K panel against NT tokens: Q45K_PANEL's sums and scaling on Q45K_DECODE's vectors */
#define Q45K_DECODED_PANEL(NAME, TARGET, ADD, FINISH, NT)                                           \
    __attribute__((target(TARGET))) static void NAME(const __m256i *vals, const __m256 *scales, int64_t n, \
                                                     const tile_row *a, int64_t r) {                \
        ZEROED(acc, NT);                                                                            \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const __m256 *dsc = scales + sb * 16, *dmn = dsc + 8;                                   \
            for (int j = 0; j < 8; j += 2) {                                                        \
                __m256i s[NT][4];                                  /* sub-block j, j + 1; half 0, 1 */ \
                for (int t = 0; t < NT; t++)                                                        \
                    for (int i = 0; i < 4; i++) s[t][i] = _mm256_setzero_si256();                   \
                for (int h = 0; h < 2; h++) {                                                       \
                    const __m256i *v = vals + sb * 64 + j * 8 + h * 8;                              \
                    for (int k = 0; k < 4; k++) {                                                   \
                        const __m256i lo = _mm256_load_si256(v + k), hi = _mm256_load_si256(v + 4 + k); \
                        for (int t = 0; t < NT; t++) {                                              \
                            const int8_t *x = a[t].q + (sb * 8 + j) * QK + 16 * h + 4 * k;          \
                            ADD(s[t][h], lo, BROADCAST4(x));                                        \
                            ADD(s[t][2 + h], hi, BROADCAST4(x + QK));                               \
                        }                                                                           \
                    }                                                                               \
                }                                                                                   \
                for (int t = 0; t < NT; t++) {                                                      \
                    const int64_t b = sb * 8 + j;                                                   \
                    KP_SCALE(acc[t], FINISH, s[t][0], s[t][1], dsc[j], dmn[j], t, b);               \
                    KP_SCALE(acc[t], FINISH, s[t][2], s[t][3], dsc[j + 1], dmn[j + 1], t, b + 1);   \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(a[t].y + r, acc[t]);                          \
    }

typedef void (*kdecode_fn)(const uint8_t *w, int64_t row_bytes, int64_t n, __m256i *vals, __m256 *scales);
typedef void (*kdecoded_fn)(const __m256i *vals, const __m256 *scales, int64_t n, const tile_row *a, int64_t r);
typedef struct {
    kdecode_fn decode;
    kdecoded_fn tiles[KQ_TOKENS + 1];
} kdecoded_set;
#define KD_SET(DECODE, TILE) {DECODE, {NULL, TILE##1, TILE##2, TILE##3, TILE##4}}
/* per instruction set: [0] Q4_K's decoded panels, [1] Q5_K's, [2] IQ4_XS's, [3] MXFP4's */
#define KD_TILES(ISA, TARGET, ADD, FINISH, IQ4_ADD, OFFSET)                                         \
    Q45K_DECODE(q4k_decode_##ISA, TARGET, 0) Q45K_DECODE(q5k_decode_##ISA, TARGET, 1)               \
    IQ4_DECODE(iq4_decode_##ISA, TARGET, OFFSET)                                                    \
    Q45K_DECODED_PANEL(q45k_decoded_##ISA##1, TARGET, ADD, FINISH, 1)                               \
    Q45K_DECODED_PANEL(q45k_decoded_##ISA##2, TARGET, ADD, FINISH, 2)                               \
    Q45K_DECODED_PANEL(q45k_decoded_##ISA##3, TARGET, ADD, FINISH, 3)                               \
    Q45K_DECODED_PANEL(q45k_decoded_##ISA##4, TARGET, ADD, FINISH, 4)                               \
    MX_DECODE(mx_decode_##ISA, TARGET, OFFSET)                                                      \
    TABLE_DECODED_PANEL(iq4_decoded_##ISA##1, TARGET, IQ4_ADD, OFFSET, IQ4_SCALE, 1)                \
    TABLE_DECODED_PANEL(iq4_decoded_##ISA##2, TARGET, IQ4_ADD, OFFSET, IQ4_SCALE, 2)                \
    TABLE_DECODED_PANEL(iq4_decoded_##ISA##3, TARGET, IQ4_ADD, OFFSET, IQ4_SCALE, 3)                \
    TABLE_DECODED_PANEL(iq4_decoded_##ISA##4, TARGET, IQ4_ADD, OFFSET, IQ4_SCALE, 4)                \
    TABLE_DECODED_PANEL(mx_decoded_##ISA##1, TARGET, IQ4_ADD, OFFSET, MX_SCALE, 1)                  \
    TABLE_DECODED_PANEL(mx_decoded_##ISA##2, TARGET, IQ4_ADD, OFFSET, MX_SCALE, 2)                  \
    TABLE_DECODED_PANEL(mx_decoded_##ISA##3, TARGET, IQ4_ADD, OFFSET, MX_SCALE, 3)                  \
    TABLE_DECODED_PANEL(mx_decoded_##ISA##4, TARGET, IQ4_ADD, OFFSET, MX_SCALE, 4)                  \
    static const kdecoded_set kdecoded_##ISA[4] = {KD_SET(q4k_decode_##ISA, q45k_decoded_##ISA),   \
                                                   KD_SET(q5k_decode_##ISA, q45k_decoded_##ISA),   \
                                                   KD_SET(iq4_decode_##ISA, iq4_decoded_##ISA),    \
                                                   KD_SET(mx_decode_##ISA, mx_decoded_##ISA)};
KD_TILES(avx2, "avx2,fma,f16c", KP_ADD_AVX2, KP_FINISH_AVX2, IQ4_ADD_AVX2, 0)
KD_TILES(vnni256, AVX512, KP_ADD_VNNI256, KP_FINISH_VNNI, IQ4_ADD_VNNI256, 128)
#ifdef HAVE_AVXVNNI
KD_TILES(avxvnni, "avx2,fma,f16c,avxvnni", KP_ADD_AVXVNNI, KP_FINISH_VNNI, IQ4_ADD_AVXVNNI, 128)
#endif
static const kdecoded_set *kdecoded;                 /* choose_isa's, with ktiles */

/* Rows [r0, r1) of a Q4_K, Q5_K, IQ4_XS or MXFP4 matrix against a call of more than one tile, whole panels
 * decoded once each (above); returns the first row left (fewer than eight remain, or no buffer). */
static int64_t decoded_rows(int quant, const uint8_t *w, int64_t cols, int64_t r0, int64_t r1, const act_rows *A) {
    const kdecoded_set *set = &kdecoded[quant >= 13 ? quant - 11 : quant - 10];
    const int64_t nb = cols / QK, bytes = (int64_t)block_row_bytes(quant, cols);
    __m256i *vals = (__m256i *)panel_buffer(nb * 8 * 32 + nb * 2 * 32);
    if (!vals) return r0;
    __m256 *scales = (__m256 *)(vals + nb * 8);
    for (; r0 + 8 <= r1; r0 += 8) {
        set->decode(w + r0 * bytes, bytes, cols, vals, scales);
        for (int64_t i = 0; i < A->n; i += KQ_TOKENS) {
            tile_row a[KQ_TOKENS];
            const int nt = tile_of(A, i, KQ_TOKENS, cols, 0, a);
            set->tiles[nt](vals, scales, cols, a, r0);
        }
    }
    return r0;
}

typedef void (*kpanel_fn)(const uint8_t *w, int64_t row_bytes, int64_t n, const tile_row *a, int64_t r);
/* per instruction set: [0] Q4_K's panels, [1] Q5_K's, [2] IQ4_XS's, [3] MXFP4's, by token count */
#define KP_TILES(ISA, TARGET, ADD, FINISH, IQ4_ADD, OFFSET)                                         \
    Q45K_PANEL(q4k_panel1_##ISA, TARGET, ADD, FINISH, 0, 1) Q45K_PANEL(q4k_panel2_##ISA, TARGET, ADD, FINISH, 0, 2) \
    Q45K_PANEL(q4k_panel3_##ISA, TARGET, ADD, FINISH, 0, 3) Q45K_PANEL(q4k_panel4_##ISA, TARGET, ADD, FINISH, 0, 4) \
    Q45K_PANEL(q5k_panel1_##ISA, TARGET, ADD, FINISH, 1, 1) Q45K_PANEL(q5k_panel2_##ISA, TARGET, ADD, FINISH, 1, 2) \
    Q45K_PANEL(q5k_panel3_##ISA, TARGET, ADD, FINISH, 1, 3) Q45K_PANEL(q5k_panel4_##ISA, TARGET, ADD, FINISH, 1, 4) \
    IQ4_PANEL(iq4_panel1_##ISA, TARGET, IQ4_ADD, OFFSET, 1) IQ4_PANEL(iq4_panel2_##ISA, TARGET, IQ4_ADD, OFFSET, 2) \
    IQ4_PANEL(iq4_panel3_##ISA, TARGET, IQ4_ADD, OFFSET, 3) IQ4_PANEL(iq4_panel4_##ISA, TARGET, IQ4_ADD, OFFSET, 4) \
    MXFP4_PANEL(mx_panel1_##ISA, TARGET, IQ4_ADD, OFFSET, 1) MXFP4_PANEL(mx_panel2_##ISA, TARGET, IQ4_ADD, OFFSET, 2) \
    MXFP4_PANEL(mx_panel3_##ISA, TARGET, IQ4_ADD, OFFSET, 3) MXFP4_PANEL(mx_panel4_##ISA, TARGET, IQ4_ADD, OFFSET, 4) \
    static const kpanel_fn kpanels_##ISA[4][KQ_TOKENS + 1] = {                                     \
        {NULL, q4k_panel1_##ISA, q4k_panel2_##ISA, q4k_panel3_##ISA, q4k_panel4_##ISA},            \
        {NULL, q5k_panel1_##ISA, q5k_panel2_##ISA, q5k_panel3_##ISA, q5k_panel4_##ISA},            \
        {NULL, iq4_panel1_##ISA, iq4_panel2_##ISA, iq4_panel3_##ISA, iq4_panel4_##ISA},            \
        {NULL, mx_panel1_##ISA, mx_panel2_##ISA, mx_panel3_##ISA, mx_panel4_##ISA}};
KP_TILES(avx2, "avx2,fma,f16c", KP_ADD_AVX2, KP_FINISH_AVX2, IQ4_ADD_AVX2, 0)
KP_TILES(vnni256, AVX512, KP_ADD_VNNI256, KP_FINISH_VNNI, IQ4_ADD_VNNI256, 128)
#ifdef HAVE_AVXVNNI
KP_TILES(avxvnni, "avx2,fma,f16c,avxvnni", KP_ADD_AVXVNNI, KP_FINISH_VNNI, IQ4_ADD_AVXVNNI, 128)
#endif
static const kpanel_fn (*kpanels)[KQ_TOKENS + 1];   /* choose_isa's, with ktiles */

/* Rows [r0, r1) of a Q4_K, Q5_K, Q6_K, IQ4_XS or MXFP4 matrix against every activation row of A, KQ_TOKENS
 * tokens a tile; KQ_ROWS rows (a few KiB each) at a time, read again from the cache by each tile.
 * All but Q6_K's rows eight at a time where eight are left in the block (KQ_ROWS and the tasks' rows are
 * multiples of 16, so whether a row is in a panel depends only on the matrix's rows). */
#define KQ_ROWS 16
static void kquant_rows(int quant, const uint8_t *w, int64_t cols, int64_t r0, int64_t r1, const act_rows *A) {
    const size_t bytes = block_row_bytes(quant, cols);
    if (quant != 12 && A->n > KQ_TOKENS) r0 = decoded_rows(quant, w, cols, r0, r1, A);
    for (int64_t first = r0; first < r1; first += KQ_ROWS) {
        const int64_t last = first + KQ_ROWS < r1 ? first + KQ_ROWS : r1;
        for (int64_t i = 0; i < A->n; i += KQ_TOKENS) {
            tile_row a[KQ_TOKENS];
            const int nt = tile_of(A, i, KQ_TOKENS, cols, 0, a);
            const krow_fn tile = ktiles[quant - 10][nt];
            int64_t r = first;
            const kpanel_fn panel = quant != 12 ? kpanels[quant >= 13 ? quant - 11 : quant - 10][nt] : NULL;
            for (; panel && r + 8 <= last; r += 8) panel(w + r * bytes, (int64_t)bytes, cols, a, r);  /* whole panels */
            for (; r < last; r++) tile(w + r * bytes, cols, a, r);
        }
    }
}
#endif
