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
/* eight rows' (row_bytes apart) super-block headers -> per sub-block j: d sc_j and dmin m_j, a lane a row
 * (each lane's byte j % 4 picked by a shuffle, where a shift by a register count and a mask took three
 * operations: in the cache, one thread, Q4_K 49.3 -> 46.6 ns a row of 2,048 for one token, 28.2 -> 25.0
 * a token for four, Q5_K 1.05x; bench/results/kernel-lead-round39-avx512.txt) */
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
    for (int j = 0; j < 8; j++) {                      /* byte j % 4 of each lane, zero-extended */
        const char k = (char)(j % 4), z = (char)0x80;
        const __m256i pick = _mm256_setr_epi8(k, z, z, z, k + 4, z, z, z, k + 8, z, z, z, k + 12, z, z, z,
                                              k, z, z, z, k + 4, z, z, z, k + 8, z, z, z, k + 12, z, z, z);
        dsc[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(sc[j / 4], pick)), d);
        dmn[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(mn[j / 4], pick)), dmin);
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

/* a token's sub-block j of a panel: its int32 sums (a __m256i expression) scaled, its mins taken off */
#define KP_SCALE(acc, sums, dsc, dmn, t, b)                                                           \
    (acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dsc, _mm256_set1_ps(a[t].s[b])), acc), \
     acc = _mm256_fnmadd_ps(dmn, _mm256_set1_ps(a[t].s[b] * (float)a[t].sum[b]), acc))

/* a quad vector of codes v -> the low nibbles (sub-block j) and the high ones (j + 1), Q5_K's fifth
 * bits (qh, its quads of the same bytes) put in */
#define Q45K_UNPACK(FIFTH, v, qh, j, lo, hi)                                                        \
    do {                                                                                            \
        const __m256i low_ = _mm256_set1_epi8(15), sixteen_ = _mm256_set1_epi8(16);                \
        lo = _mm256_and_si256(v, low_), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_);       \
        if (FIFTH) {                                                                                \
            lo = _mm256_or_si256(lo, FIFTH_BIT(qh, _mm256_set1_epi8((char)(1 << (j))), sixteen_));   \
            hi = _mm256_or_si256(hi, FIFTH_BIT(qh, _mm256_set1_epi8((char)(2 << (j))), sixteen_));   \
        }                                                                                           \
    } while (0)

/* A token's sums of sub-blocks j and j + 1 in chains s[t][0..4): HALVES 2, a chain a half (lo: half
 * h into s[t][h], hi into s[t][2 + h]); HALVES 1, both halves of a sub-block in one (s[t][0], s[t][1]).
 * The sums are the same integers either way; one chain a sub-block keeps four tokens' sums in
 * registers (with a chain a half the tiles held them on the stack: every quad loaded and stored
 * its tokens' sums). A chain a half is for AVX2's int16 lanes where a sub-block's 16 products a
 * lane could pass 32767: Q5_K's 31 x 127 x 16; Q4_K's 15 x 127 x 16 = 30480 fits
 * (tests/test_kernels.py's extremes); and for one token (a decode step's tile, whose four chains
 * fit in any register file: it stays as it was, its rows streaming from memory). In the cache, one thread, an AVX512 EPYC (Zen 4), Q4_K at
 * 4 / 16 / 64 tokens: 28.0 / 24.4 / 23.1 -> 21.7 / 18.9 / 17.4 ns a row of 2,048 and a token,
 * Q5_K 31.4 / 25.5 / 23.3 -> 26.3 / 19.9 / 17.6; the AVX2 bodies 1.08-1.19x (bench/kernel_rows.c,
 * best of four alternations; bench/results/kernel-rows-round41-zen4.txt). */
#define Q45K_HALVES_AVX2(FIFTH, NT) ((FIFTH) || (NT) == 1 ? 2 : 1)
#define Q45K_HALVES_VNNI(FIFTH, NT) ((NT) == 1 ? 2 : 1)

/* quad k of half h of sub-blocks j (lo) and j + 1 (hi) against NT tokens' activations, into their chains */
#define Q45K_QUAD(ADD, NT, HALVES, s, lo, hi, sb, j, h, k)                                          \
    for (int t = 0; t < NT; t++) {                                                                  \
        const int8_t *x = a[t].q + ((sb) * 8 + (j)) * QK + 16 * (h) + 4 * (k);                      \
        ADD(s[t][(HALVES) == 2 ? (h) : 0], lo, BROADCAST4(x));                                      \
        ADD(s[t][(HALVES) == 2 ? 2 + (h) : 1], hi, BROADCAST4(x + QK));                             \
    }

/* sub-blocks j and j + 1's sums scaled into each token's accumulator, their mins taken off */
#define Q45K_PAIR_SCALE(FINISH, NT, HALVES, acc, s, dsc, dmn, sb, j)                                \
    for (int t = 0; t < NT; t++) {                                                                  \
        const int64_t b = (sb) * 8 + (j);                                                           \
        if ((HALVES) == 2) {                                                                        \
            KP_SCALE(acc[t], _mm256_add_epi32(FINISH(s[t][0]), FINISH(s[t][1])), dsc[j], dmn[j], t, b); \
            KP_SCALE(acc[t], _mm256_add_epi32(FINISH(s[t][2]), FINISH(s[t][3])), dsc[(j) + 1], dmn[(j) + 1], t, \
                     b + 1);                                                                        \
        } else {                                                                                    \
            KP_SCALE(acc[t], FINISH(s[t][0]), dsc[j], dmn[j], t, b);                                \
            KP_SCALE(acc[t], FINISH(s[t][1]), dsc[(j) + 1], dmn[(j) + 1], t, b + 1);                \
        }                                                                                           \
    }

/* the two halves (h) of a sub-block pair, BODY each: unrolled where a chain is a half, so that
 * s[t][h] is a register (kept rolled otherwise: AVX2's Q4_K unrolled computed all of a pair's
 * products first and put them through the stack, ~5 % slower) */
#define Q45K_HALVES_LOOP(HALVES, h, BODY)                                                           \
    if ((HALVES) == 2) {                                                                            \
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) { BODY }                                \
    } else {                                                                                        \
        for (int h = 0; h < 2; h++) { BODY }                                                        \
    }

/* half h of sub-blocks j and j + 1 of eight rows' codes (Q5_K: their fifth bits qh) against NT tokens */
#define Q45K_PANEL_HALF(ADD, NT, HALVES, FIFTH, s, codes, qh, row_bytes, sb, j, h)                  \
    __m256i v[4];                                                                                   \
    block_quads(codes + 16 * j + 16 * h, row_bytes, v);                                             \
    for (int k = 0; k < 4; k++) {                                                                   \
        __m256i lo, hi;                                                                             \
        Q45K_UNPACK(FIFTH, v[k], qh[h][k], j, lo, hi);                                              \
        Q45K_QUAD(ADD, NT, HALVES, s, lo, hi, sb, j, h, k)                                          \
    }

/* eight Q4_K rows (FIFTH: Q5_K's; the first at w, row_bytes apart) against NT tokens:
 * a[t].y[r..r+8). Q5_K's fifth bits (bit j of byte i: element i of sub-block j) are transposed
 * as the codes are, the quads of the same bytes. */
#define Q45K_PANEL(NAME, TARGET, ADD, FINISH, FIFTH, HALVES, NT)                                    \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t row_bytes, int64_t n, \
                                                     const tile_row *a, int64_t r) {                \
        const int bytes = FIFTH ? 176 : 144;                                                        \
        ZEROED(acc, NT);                                                                            \
        for (int64_t sb = 0; sb < n / QK_K; sb++) {                                                 \
            const uint8_t *blk = w + sb * bytes, *codes = blk + (FIFTH ? 48 : 16);                  \
            panel_prefetch(w, row_bytes, sb, bytes);                                                \
            __m256 dsc[8], dmn[8];                                                                  \
            q4k_panel_scales(blk, row_bytes, dsc, dmn);                                             \
            __m256i qh[2][4];                                   /* Q5_K: the fifth bits' quads */  \
            if (FIFTH) block_quads(blk + 16, row_bytes, qh[0]), block_quads(blk + 32, row_bytes, qh[1]); \
            for (int j = 0; j < 8; j += 2) {                                                        \
                __m256i s[NT][2 * (HALVES)];                       /* Q45K_QUAD's chains */         \
                for (int t = 0; t < NT; t++)                                                        \
                    for (int i = 0; i < 2 * (HALVES); i++) s[t][i] = _mm256_setzero_si256();        \
                Q45K_HALVES_LOOP(HALVES, h, Q45K_PANEL_HALF(ADD, NT, HALVES, FIFTH, s, codes, qh, row_bytes, sb, j, h)) \
                Q45K_PAIR_SCALE(FINISH, NT, HALVES, acc, s, dsc, dmn, sb, j)                        \
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

/* two quads of IQ4_XS values (v, w: a quad's low and high nibbles') against four activations each,
 * broadcast (x, y), into the int32 lanes of a token's two chains s[0], s[1] (TABLE_SCALE adds them).
 * VNNI: the values offset by 128 (the table's bytes xor 0x80: unsigned, as dpbusd wants), the
 * offset's 128 sum(x) taken off a sub-block's sums once, low and high nibbles in a chain each; AVX2:
 * |v| against x with v's sign (ktiles.h's SIGNED_DOT: maddubs of 128 + v could saturate int16), one
 * chain. The same integers either way. VNNI's eight dpbusd of a block in one chain a token waited
 * on each other: in two, in the cache, one thread (Zen 4), IQ4_XS at 1 / 4 / 16 / 64 tokens 54.4 /
 * 24.2 / 17.9 / 16.2 -> 50.0 / 23.2 / 16.9 / 15.1 ns a row of 2,048 and a token, MXFP4 54.6 / 23.9 /
 * 17.8 / 16.1 -> 49.5 / 22.8 / 17.0 / 15.2 (bench/results/kernel-rows-round41-zen4.txt). */
#define IQ4_ADD_AVX2(s, v, x, w, y) \
    ((s)[0] = _mm256_add_epi32((s)[0], _mm256_add_epi32(SIGNED_DOT(DOT_AVX2, v, x), SIGNED_DOT(DOT_AVX2, w, y))))
#define IQ4_ADD_VNNI256(s, v, x, w, y) ((s)[0] = _mm256_dpbusd_epi32((s)[0], v, x), (s)[1] = _mm256_dpbusd_epi32((s)[1], w, y))
#define IQ4_ADD_AVXVNNI(s, v, x, w, y) \
    ((s)[0] = _mm256_dpbusd_avx_epi32((s)[0], v, x), (s)[1] = _mm256_dpbusd_avx_epi32((s)[1], w, y))
/* MXFP4's values (-12..12) offset by 12 are unsigned as maddubs wants them and small (2 * 24 * 127 a
 * pair of products, two quads' pairs added in int16: no saturation): AVX2 takes them as VNNI takes
 * IQ4_XS's offset values, without SIGNED_DOT's sign operations and with one widening for two quads
 * (the offset's 12 sum(x) taken off a block's sums once). One token's MXFP4 panel, in cache
 * (bench/kernel_rows.c, an AVX2 EPYC): 90 -> 76 ns a row of 2,048; four tokens 49-50 -> 39 a token. */
#define MX_OFFSET_AVX2 12
#define MX_ADD_AVX2(s, v, x, w, y) ((s)[0] = _mm256_add_epi32((s)[0], _mm256_madd_epi16(               \
    _mm256_add_epi16(_mm256_maddubs_epi16(v, x), _mm256_maddubs_epi16(w, y)), _mm256_set1_epi16(1))))

/* a quad vector of 4-bit indices v -> the table's values of its low nibbles and of its high ones */
#define TABLE_LOOKUP(table, v, lo, hi)                                                              \
    (lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, _mm256_set1_epi8(15))),                    \
     hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15))))

/* quad k of block b's values (lo: elements 4k.., hi: 16 + 4k..) against NT tokens' activations, into
 * s[t]'s chains */
#define TABLE_QUAD(ADD, NT, s, lo, hi, a, b, k)                                                     \
    for (int t = 0; t < NT; t++) {                                                                  \
        const int8_t *x = a[t].q + (b) * QK + 4 * (k);                                              \
        ADD(s[t], lo, BROADCAST4(x), hi, BROADCAST4(x + 16));                                       \
    }

/* block b's int32 sums (a token's two chains), less OFFSET times the activations' sum, scaled by d
 * and each token's scale */
#define TABLE_SCALE(NT, acc, s, d, a, b, OFFSET)                                                    \
    for (int t = 0; t < NT; t++) {                                                                  \
        const __m256i sum_ = _mm256_sub_epi32(_mm256_add_epi32(s[t][0], s[t][1]),                  \
                                              _mm256_set1_epi32((OFFSET) * a[t].sum[b]));           \
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_), _mm256_mul_ps(d, _mm256_set1_ps(a[t].s[b])), acc[t]); \
    }

/* one block of 32 of eight rows (its 16 code bytes at `codes`, row_bytes apart) against NT tokens:
 * each quad of codes looked up in the table, met by four activations of block `b` broadcast
 * -> s[t], the int32 sums a lane a row (IQ4_XS's sub-blocks, MXFP4's blocks) */
#define TABLE_BLOCK_SUMS(ADD, NT, table, codes, row_bytes, a, b, s)                                 \
    do {                                                                                            \
        __m256i v_[4];                                                                              \
        block_quads((codes), (row_bytes), v_);                                                      \
        for (int t = 0; t < NT; t++) s[t][0] = s[t][1] = _mm256_setzero_si256();                   \
        for (int k = 0; k < 4; k++) {                                                               \
            __m256i lo, hi;                                                                         \
            TABLE_LOOKUP(table, v_[k], lo, hi);                                                     \
            TABLE_QUAD(ADD, NT, s, lo, hi, a, b, k)                                                 \
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
                __m256i s[NT][2];                                                                   \
                TABLE_BLOCK_SUMS(ADD, NT, table, blk + 8 + 16 * j, row_bytes, a, sb * 8 + j, s);    \
                TABLE_SCALE(NT, acc, s, dsc[j], a, sb * 8 + j, OFFSET)                              \
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
        const __m256i table = _mm256_add_epi8(TABLE(MXFP4X2), _mm256_set1_epi8((char)(OFFSET)));     \
        ZEROED(acc, NT);                                                                            \
        for (int64_t b = 0; b < n / QK; b++) {                                                      \
            const uint8_t *blk = w + b * 17;                                                        \
            if (b % 8 == 0) panel_prefetch(w, row_bytes, b / 8, 136);                               \
            const __m256 d = mx_panel_scales(blk, row_bytes);                                       \
            __m256i s[NT][2];                                                                       \
            TABLE_BLOCK_SUMS(ADD, NT, table, blk + 1, row_bytes, a, b, s);                          \
            TABLE_SCALE(NT, acc, s, d, a, b, OFFSET)                                                \
        }                                                                                           \
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(a[t].y + r, acc[t]);                          \
    }

typedef void (*kpanel_fn)(const uint8_t *w, int64_t row_bytes, int64_t n, const tile_row *a, int64_t r);
/* per instruction set: [0] Q4_K's panels, [1] Q5_K's, [2] IQ4_XS's, [3] MXFP4's, by token count */
#define KP_TILES(ISA, TARGET, ADD, FINISH, HALVES, IQ4_ADD, OFFSET, MX_ADD, MX_OFFSET)             \
    Q45K_PANEL(q4k_panel1_##ISA, TARGET, ADD, FINISH, 0, HALVES(0, 1), 1)                           \
    Q45K_PANEL(q4k_panel2_##ISA, TARGET, ADD, FINISH, 0, HALVES(0, 2), 2)                           \
    Q45K_PANEL(q4k_panel3_##ISA, TARGET, ADD, FINISH, 0, HALVES(0, 3), 3)                           \
    Q45K_PANEL(q4k_panel4_##ISA, TARGET, ADD, FINISH, 0, HALVES(0, 4), 4)                           \
    Q45K_PANEL(q5k_panel1_##ISA, TARGET, ADD, FINISH, 1, HALVES(1, 1), 1)                           \
    Q45K_PANEL(q5k_panel2_##ISA, TARGET, ADD, FINISH, 1, HALVES(1, 2), 2)                           \
    Q45K_PANEL(q5k_panel3_##ISA, TARGET, ADD, FINISH, 1, HALVES(1, 3), 3)                           \
    Q45K_PANEL(q5k_panel4_##ISA, TARGET, ADD, FINISH, 1, HALVES(1, 4), 4)                           \
    IQ4_PANEL(iq4_panel1_##ISA, TARGET, IQ4_ADD, OFFSET, 1) IQ4_PANEL(iq4_panel2_##ISA, TARGET, IQ4_ADD, OFFSET, 2) \
    IQ4_PANEL(iq4_panel3_##ISA, TARGET, IQ4_ADD, OFFSET, 3) IQ4_PANEL(iq4_panel4_##ISA, TARGET, IQ4_ADD, OFFSET, 4) \
    MXFP4_PANEL(mx_panel1_##ISA, TARGET, MX_ADD, MX_OFFSET, 1) MXFP4_PANEL(mx_panel2_##ISA, TARGET, MX_ADD, MX_OFFSET, 2) \
    MXFP4_PANEL(mx_panel3_##ISA, TARGET, MX_ADD, MX_OFFSET, 3) MXFP4_PANEL(mx_panel4_##ISA, TARGET, MX_ADD, MX_OFFSET, 4) \
    static const kpanel_fn kpanels_##ISA[4][KQ_TOKENS + 1] = {                                     \
        {NULL, q4k_panel1_##ISA, q4k_panel2_##ISA, q4k_panel3_##ISA, q4k_panel4_##ISA},            \
        {NULL, q5k_panel1_##ISA, q5k_panel2_##ISA, q5k_panel3_##ISA, q5k_panel4_##ISA},            \
        {NULL, iq4_panel1_##ISA, iq4_panel2_##ISA, iq4_panel3_##ISA, iq4_panel4_##ISA},            \
        {NULL, mx_panel1_##ISA, mx_panel2_##ISA, mx_panel3_##ISA, mx_panel4_##ISA}};
KP_TILES(avx2, "avx2,fma,f16c", KP_ADD_AVX2, KP_FINISH_AVX2, Q45K_HALVES_AVX2, IQ4_ADD_AVX2, 0, MX_ADD_AVX2, MX_OFFSET_AVX2)
KP_TILES(vnni256, AVX512, KP_ADD_VNNI256, KP_FINISH_VNNI, Q45K_HALVES_VNNI, IQ4_ADD_VNNI256, 128, IQ4_ADD_VNNI256, 128)
#ifdef HAVE_AVXVNNI
KP_TILES(avxvnni, "avx2,fma,f16c,avxvnni", KP_ADD_AVXVNNI, KP_FINISH_VNNI, Q45K_HALVES_VNNI, IQ4_ADD_AVXVNNI, 128,
         IQ4_ADD_AVXVNNI, 128)
#endif
static const kpanel_fn (*kpanels)[KQ_TOKENS + 1];   /* choose_isa's, with ktiles */

#endif
