/* CPU code-domain decode attention over packed KV-cache codes (kvbench.kernels.cpu.native).
 *
 * One decode step reads each stored token once: its codes are decoded into a small float
 * buffer (registers / L1, never a dequantized cache) and used by all M query rows of its KV
 * head before the next token is read.
 *
 * Codes: kvbench.cache.quant.pack_bits's LSB-first bit stream, one row of `nbytes` bytes per
 * token; a "word" of BPW bytes holds CPW whole codes (2 bits: 1 byte, 4 codes; 3 bits:
 * 3 bytes, 8 codes; 16 bits: int16 codes, signed, 2 bytes each).  A token's D = CPW * W codes are decoded in *sub-code order*: position
 * i * W + w holds channel w * CPW + i (code i of word w), so that every sub-code plane is a
 * contiguous run of W floats and the decode loop vectorizes; the caller gives the query, the
 * affine terms and receives value outputs in the same order (kernels/cpu/native.py).
 *
 * Decoding (mode):
 *   MODE_AFFINE_ROWS:  x = c * A[row, k] + Z[row, k], row = t / L, terms per channel k in
 *                      sub-code order (per-channel key pages of L tokens: KIVI keys);
 *   MODE_AFFINE_GROUPS: x = c * A[t, g] + Z[t, g], g = w / WG (channel groups of WG words;
 *                      per-token keys and values);
 *   MODE_LUT:          x = LUT[c] (a table of 2^bits floats: fp8 bytes, codebooks);
 *   MODE_RAW:          x = c (the caller folded the terms into a per-row query);
 *   MODE_STREAM:       x = c, channel k's code read at bit offset OFF[k] of the row with
 *                      width WID[k] (mixed-precision classes whose boundaries are not on a
 *                      byte, kvbench.cache.mixed_channel.pack_mixed), channels in stored order.
 *
 * Keys:   out[b, h, m, t] = sum_k q[b, h, m, r, k] x[t, k]               ([B, H, M, T])
 *         with r = t / L when the query has rows (q_sr != 0: one query per key page),
 * Values: out[b, h, m, k] = sum_t p[b, h, m, t] x[t, k]                  ([B, H, M, D])
 * float32 throughout; sums in float32 (as the reference matmul).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MODE_AFFINE_ROWS 0
#define MODE_AFFINE_GROUPS 1
#define MODE_LUT 2
#define MODE_RAW 3
#define MODE_STREAM 4
#define MAXD 1024

/* Translation units: setup.py compiles this one file once per unit, in parallel, with
 * -DKV_UNIT=<unit> (units may be or-ed: -DKV_UNIT=KV_UNIT_KEYS|KV_UNIT_VALUES), and links the
 * objects into the one library.  A unit holds the functions that emit code under
 * #if KV_IN(<its bit>); the types, macros and static inline helpers are in every unit, compiled
 * where used, so each function's code is what the whole file gives it.  Without -DKV_UNIT the
 * file is the whole library in one unit (KV_UNIT_ALL).  The fused kernel's per-instruction-set
 * copies, called from another unit, are hidden: the library exports the same kv_* symbols
 * either way. */
#define KV_UNIT_KEYS 1          /* kv_keys, kv_abi_version */
#define KV_UNIT_VALUES 2        /* kv_values */
#define KV_UNIT_TABLES 4        /* kv_keys_lut_outliers, kv_keys_polar */
#define KV_UNIT_FUSED 8         /* kv_attend_fused (the build's own target), kv_fused_* */
#define KV_UNIT_FUSED_AVX2 16   /* kv_attend_fused's AVX2 copy */
#define KV_UNIT_FUSED_AVX512 32 /* kv_attend_fused's AVX-512 copy */
#define KV_UNIT_ALL 63
#ifndef KV_UNIT
#define KV_UNIT KV_UNIT_ALL
#endif
#define KV_IN(U) (((KV_UNIT) & (U)) != 0)
#define KV_HIDDEN __attribute__((visibility("hidden")))

typedef struct {
    const uint8_t *codes; /* token t of (b, h): codes + b*cs_b + h*cs_h + t*cs_t (bytes) */
    int64_t cs_b, cs_h, cs_t;
    int64_t B, H, T, W;   /* W words per token */
    int64_t M;
    int mode;
    const float *A, *Z;   /* affine terms; element (b, h, row, k): b*as_b + h*as_h + row*as_r + k */
    int64_t as_b, as_h, as_r;
    int64_t L;            /* rows: tokens per row of A/Z (MODE_AFFINE_ROWS) */
    int64_t WG;           /* words per channel group (MODE_AFFINE_GROUPS) */
    const float *lut;     /* MODE_LUT: 2^bits entries */
    const float *qp;      /* keys: query [B, H, M, (R,) D]; values: probabilities [B, H, M, T] */
    int64_t q_sm, q_sr;   /* keys: query strides (floats) over m and over rows (0: no rows) */
    const int32_t *off;   /* MODE_STREAM: bit offset of each of the D channels */
    const uint8_t *wid;   /* MODE_STREAM: code width of each channel (1..8) */
    int64_t nbytes;       /* MODE_STREAM: bytes per row (D = W, the channel count) */
    int no_tiles;         /* 0: the fastest kernel that applies; 1: the per-token loops; 2: the
                           * 8-token tiles for keys even where the vectorised kernel applies */
    float *out;           /* keys [B, H, M, T]; values [B, H, M, D] (sub-code order) */
    int64_t bit0;         /* MODE_RAW keys: codes start at this bit of the row (0..7; a class
                           * of a bit stream), the row holding `nbytes` bytes from `codes` */
    int natural;          /* keys: 1 = query and row terms in natural channel order (only the
                           * vectorised keys take it; the others: -3); values: 1 = the output
                           * in natural channel order */
    /* MODE_AFFINE_GROUPS, natural order: an upper plane of some tokens (per-token mixed
     * precision, SemKV): token t of (b, h) adds up_bits-bit codes u << up_shift to its code
     * where r = up_row[(b * H + h) * T + t] >= 0, read from row r of `up` (up_nb bytes a row,
     * pack_bits order); NULL: none */
    const uint8_t *up;
    const int32_t *up_row;
    int64_t up_nb;
    int up_bits, up_shift;
} kv_args;

/* 32 bits of a row from bit 8 * byte + sh (sh < 8; byte < nb).  Bits past the row's nb bytes
 * are the next row's (`more`: a next token follows, at least 8 bytes on) or read as 0; callers
 * give them a zero query. */
static inline __attribute__((always_inline)) uint32_t fetch32(const uint8_t *row, int64_t byte,
                                                              int sh, int64_t nb, int more) {
    uint64_t v = 0;
    if (byte + 8 <= nb || more)
        memcpy(&v, row + byte, 8);
    else
        for (int64_t i = 0; byte + i < nb && i < 8; i++) v |= (uint64_t)row[byte + i] << (8 * i);
    return (uint32_t)(v >> sh);
}

/* codes of one token -> float c[D] in sub-code order */
#define DEFINE_UNPACK(BITS)                                                                   \
    static inline void unpack_##BITS(const uint8_t *row, int64_t W, float *c) {                \
        enum { G = (BITS % 8 == 0) ? 8 : (BITS % 4 == 0) ? 4 : (BITS % 2 == 0) ? 2 : 1 };      \
        enum { BPW = BITS / G, CPW = 8 / G };                                                  \
        const uint32_t mask = (1u << BITS) - 1u;                                               \
        if (BPW == 1) {                                                                        \
            for (int i = 0; i < CPW; i++) {                                                    \
                float *ci = c + i * W;                                                         \
                _Pragma("omp simd")                                                            \
                for (int64_t w = 0; w < W; w++)                                                \
                    ci[w] = (float)(((uint32_t)row[w] >> (i * BITS)) & mask);                   \
            }                                                                                  \
        } else {                                                                               \
            for (int64_t w = 0; w < W; w++) {                                                  \
                uint64_t word = 0;                                                             \
                for (int k = 0; k < BPW; k++) word |= (uint64_t)row[w * BPW + k] << (8 * k);   \
                for (int i = 0; i < CPW; i++)                                                  \
                    c[i * W + w] = BITS == 16 ? (float)(int16_t)(uint16_t)word /* signed */    \
                                              : (float)((word >> (i * BITS)) & mask);          \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_UNPACK(1)
DEFINE_UNPACK(2)
DEFINE_UNPACK(3)
DEFINE_UNPACK(4)
DEFINE_UNPACK(5)
DEFINE_UNPACK(6)
DEFINE_UNPACK(7)
DEFINE_UNPACK(8)
DEFINE_UNPACK(16)

static inline __attribute__((always_inline)) void unpack_any(int bits, const uint8_t *row,
                                                             int64_t W, float *c) {
    switch (bits) {
    case 1: unpack_1(row, W, c); break;
    case 2: unpack_2(row, W, c); break;
    case 3: unpack_3(row, W, c); break;
    case 4: unpack_4(row, W, c); break;
    case 5: unpack_5(row, W, c); break;
    case 6: unpack_6(row, W, c); break;
    case 7: unpack_7(row, W, c); break;
    case 16: unpack_16(row, W, c); break;
    default: unpack_8(row, W, c); break;
    }
}

static inline int cpw_of(int bits) {
    if (bits == 0) return 1; /* MODE_STREAM: W counts channels */
    int g = (bits % 8 == 0) ? 8 : (bits % 4 == 0) ? 4 : (bits % 2 == 0) ? 2 : 1;
    return 8 / g;
}

/* decode token t of (b, h) into x[D] (sub-code order) */
static inline __attribute__((always_inline)) void decode(const kv_args *a, int bits, int64_t b,
                                                          int64_t h, int64_t t, float *x) {
    const uint8_t *row = a->codes + b * a->cs_b + h * a->cs_h + t * a->cs_t;
    const int64_t W = a->W;
    if (a->mode == MODE_STREAM) {
        const int64_t nb = a->nbytes;
        for (int64_t k = 0; k < W; k++) {
            const int32_t o = a->off[k], byte = o >> 3;
            uint32_t v = row[byte];
            if (byte + 1 < nb) v |= (uint32_t)row[byte + 1] << 8;
            x[k] = (float)((v >> (o & 7)) & ((1u << a->wid[k]) - 1u));
        }
        return;
    }
    const int cpw = cpw_of(bits);
    const int64_t D = W * cpw;
    if (a->bit0) { /* MODE_RAW, codes off the byte: channel by channel, in sub-code order */
        const uint32_t mask = (1u << bits) - 1u;
        for (int64_t p = 0; p < D; p++) {
            const int64_t bit = a->bit0 + ((p % W) * cpw + p / W) * bits;
            x[p] = (float)(fetch32(row, bit >> 3, (int)(bit & 7), a->nbytes, 0) & mask);
        }
        return;
    }
    if (a->mode == MODE_LUT) {
        uint8_t idx[MAXD];
        /* codes as integers first (reuse the float unpack, then look up) */
        float c[MAXD];
        unpack_any(bits, row, W, c);
        for (int64_t k = 0; k < D; k++) idx[k] = (uint8_t)c[k];
        for (int64_t k = 0; k < D; k++) x[k] = a->lut[idx[k]];
        return;
    }
    unpack_any(bits, row, W, x);
    if (a->mode == MODE_RAW) return;
    if (a->mode == MODE_AFFINE_ROWS) {
        const int64_t r = t / a->L;
        const float *A = a->A + b * a->as_b + h * a->as_h + r * a->as_r;
        const float *Z = a->Z + b * a->as_b + h * a->as_h + r * a->as_r;
#pragma omp simd
        for (int64_t k = 0; k < D; k++) x[k] = x[k] * A[k] + Z[k];
    } else { /* MODE_AFFINE_GROUPS */
        const float *A = a->A + b * a->as_b + h * a->as_h + t * a->as_r;
        const float *Z = a->Z + b * a->as_b + h * a->as_h + t * a->as_r;
        const int64_t WG = a->WG;
        for (int i = 0; i < cpw; i++) {
            float *xi = x + i * W;
            for (int64_t w0 = 0; w0 < W; w0 += WG) {
                const float s = A[w0 / WG], z = Z[w0 / WG];
#pragma omp simd
                for (int64_t w = w0; w < w0 + WG; w++) xi[w] = xi[w] * s + z;
            }
        }
    }
}


/* ------------------------------------------------------------------------------ tiled keys
 * Rows of whole units of codes (1, 2, 4, 8 bits: 32-bit words of 32 / BITS codes; 3, 5, 6, 7
 * bits: 32 codes in BITS words, some straddling two words): 8 tokens at a
 * time, channel by channel, with the codes of the 8 tokens in one vector and the 8 logits of
 * each query row in registers (no horizontal sums).  The query (terms folded in per row of A/Z
 * for MODE_AFFINE_ROWS) is rebuilt in natural channel order once per row. */
#define TT 8
/* a code's value from its low bits: unsigned, or signed for 16-bit codes (int16 storage) */
#define CODEF(x) (bits == 16 ? (float)(int16_t)(uint16_t)(x) : (float)((x) & mask))
/* one channel `ch` of a tile: its codes in 8 tokens' words w0 (>> sh; with the low bits of w1
 * where the code straddles two words) -> accg[m][k] += q[m, ch] x */
static inline __attribute__((always_inline)) void tile_code(
    const kv_args *a, const uint32_t *w0, const uint32_t *w1, int sh, const int straddle,
    uint32_t mask, float half, const float *an, const float *zn, const float *qn, int64_t D,
    int64_t M, int64_t ch, float accg[16][TT]) {
    float cv[TT];
#define CODE(k) (((w0[k] >> sh) | (straddle ? w1[k] << (32 - sh) : 0u)) & mask)
    if (a->mode == MODE_LUT) {
        for (int k = 0; k < TT; k++) cv[k] = a->lut[CODE(k)];
    } else if (a->mode == MODE_AFFINE_ROWS) {
        /* dequantized in registers: the reference's rounding */
        const float s = an[ch], z = zn[ch];
#pragma omp simd
        for (int k = 0; k < TT; k++) cv[k] = (float)CODE(k) * s + z;
    } else {
#pragma omp simd
        for (int k = 0; k < TT; k++) cv[k] = (float)CODE(k) - half;
    }
#undef CODE
    for (int64_t m = 0; m < M; m++) {
        const float qv = qn[m * D + ch];
#pragma omp simd
        for (int k = 0; k < TT; k++) accg[m][k] += qv * cv[k];
    }
}

static inline __attribute__((always_inline)) void keys_tiled(const kv_args *a, int bits) {
    const int cpw = cpw_of(bits);
    const int64_t W = a->W, D = W * cpw, M = a->M, T = a->T;
    /* a unit of U codes in NW 32-bit words: 32 / bits codes in one word (1, 2, 4, 8 bits), or
     * 32 codes in `bits` words (3, 5, 6, 7 bits; a code may straddle two words) */
    const int pow2 = (bits & (bits - 1)) == 0;
    const int U = pow2 && bits ? 32 / bits : 32, NW = pow2 ? 1 : bits;
    const uint32_t mask = (1u << bits) - 1u;
    const int stream = a->mode == MODE_STREAM; /* bits 0: per-channel widths and offsets */
    /* codes enter the sums centred (c - half; the offset moves into the bias): the sums of
     * q * A * c and q * (Z + half * A) then do not cancel, so float32 keeps its precision */
    const float half = bits == 16 ? 0.f : 0.5f * (float)mask; /* 16 bits: signed codes */
    int32_t pos[MAXD]; /* natural channel -> sub-code position */
    for (int64_t ch = 0; ch < D; ch++)
        pos[ch] = a->natural ? (int32_t)ch : (int32_t)((ch % cpw) * W + ch / cpw);
    float qn[16 * MAXD], bias[16], an[MAXD], zn[MAXD];
    const int64_t cg = a->mode == MODE_AFFINE_GROUPS ? a->WG * cpw : D; /* channels per group */
    const int64_t ng = D / cg;
    static __thread float qsum[16 * (MAXD / 8)];
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->H; h++) {
            const float *q = a->qp + (b * a->H + h) * M * a->q_sm;
            float *o = a->out + (b * a->H + h) * M * T;
            const uint8_t *base = a->codes + b * a->cs_b + h * a->cs_h;
            int64_t row = -1, row_end = 0;
            for (int64_t t = 0; t < T;) {
                if (t >= row_end) { /* a new row of terms / queries */
                    const int rows = a->mode == MODE_AFFINE_ROWS || a->mode == MODE_RAW || stream;
                    row = rows ? t / a->L : 0;
                    row_end = rows ? (row + 1) * a->L : T;
                    const float *qr = q + row * a->q_sr;
                    const float *A = a->A ? a->A + b * a->as_b + h * a->as_h + row * a->as_r : 0;
                    const float *Z = a->Z ? a->Z + b * a->as_b + h * a->as_h + row * a->as_r : 0;
                    for (int64_t m = 0; m < M; m++) {
                        float bm = 0.f;
                        for (int64_t ch = 0; ch < D; ch++) {
                            const float qv = qr[m * a->q_sm + pos[ch]];
                            qn[m * D + ch] = qv;
                        }
                        if (a->mode == MODE_AFFINE_ROWS && m == 0)
                            for (int64_t ch = 0; ch < D; ch++) { /* the row's terms */
                                an[ch] = A[pos[ch]];
                                zn[ch] = Z[pos[ch]];
                            }
                        if (a->mode == MODE_RAW || a->mode == MODE_AFFINE_GROUPS) {
                            /* codes are used centred: c - half */
                            float sq = 0.f;
                            for (int64_t ch = 0; ch < D; ch++) sq += qn[m * D + ch];
                            if (a->mode == MODE_RAW) bm += half * sq;
                        }
                        if (stream) /* centred per channel: c - (2^w - 1) / 2 */
                            for (int64_t ch = 0; ch < D; ch++)
                                bm += qn[m * D + ch] * 0.5f * (float)((1u << a->wid[ch]) - 1u);
                        bias[m] = bm;
                        if (a->mode == MODE_AFFINE_GROUPS) /* per group: sum of q */
                            for (int64_t g = 0; g < D / cg; g++) {
                                float sq = 0.f;
                                for (int64_t ch = g * cg; ch < (g + 1) * cg; ch++)
                                    sq += qn[m * D + ch];
                                qsum[m * (MAXD / 8) + g] = sq;
                            }
                    }
                }
                const int64_t end = row_end < T ? row_end : T;
                for (; t + TT <= end; t += TT) {
                    float acc[16][TT];
                    for (int64_t m = 0; m < M; m++)
                        for (int k = 0; k < TT; k++) acc[m][k] = bias[m];
                    for (int64_t g = 0; g < ng; g++) {
                        float accg[16][TT];
                        for (int64_t m = 0; m < M; m++)
                            for (int k = 0; k < TT; k++) accg[m][k] = 0.f;
                        for (int64_t ch = 0; stream && ch < D; ch++) { /* bit stream */
                            const int32_t o = a->off[ch], byte = o >> 3, sh = o & 7;
                            const int w = a->wid[ch];
                            const uint32_t wm = (1u << w) - 1u;
                            const float hw = 0.5f * (float)wm;
                            const uint8_t *p0 = base + t * a->cs_t + byte;
                            float cv[TT];
                            if (sh + w <= 8) /* within one byte (never reads past a row) */
                                for (int k = 0; k < TT; k++)
                                    cv[k] = (float)(((uint32_t)p0[k * a->cs_t] >> sh) & wm) - hw;
                            else
                                for (int k = 0; k < TT; k++) {
                                    const uint32_t v = (uint32_t)p0[k * a->cs_t] |
                                                       (uint32_t)p0[k * a->cs_t + 1] << 8;
                                    cv[k] = (float)((v >> sh) & wm) - hw;
                                }
                            for (int64_t m = 0; m < M; m++) {
                                const float qv = qn[m * D + ch];
#pragma omp simd
                                for (int k = 0; k < TT; k++) accg[m][k] += qv * cv[k];
                            }
                        }
                        for (int64_t j = g * cg / U; !stream && j < (g + 1) * cg / U; j++) {
                            if (pow2) { /* one word of U codes */
                                uint32_t wv[TT];
                                if (a->bit0)
                                    for (int k = 0; k < TT; k++)
                                        wv[k] = fetch32(base + (t + k) * a->cs_t, 4 * j,
                                                        (int)a->bit0, a->nbytes,
                                                        t + k + 1 < T && a->cs_t >= 8);
                                else
                                    for (int k = 0; k < TT; k++)
                                        memcpy(&wv[k], base + (t + k) * a->cs_t + 4 * j, 4);
                                /* (written out rather than through tile_code: GCC 12 compiles
                                 * this form 10-30% faster for these widths) */
                                for (int c = 0; c < U; c++) {
                                    float cv[TT];
                                    const int64_t ch = j * U + c;
                                    if (a->mode == MODE_LUT) {
                                        for (int k = 0; k < TT; k++)
                                            cv[k] = a->lut[(wv[k] >> (c * bits)) & mask];
                                    } else if (a->mode == MODE_AFFINE_ROWS) {
                                        const float s = an[ch], z = zn[ch];
#pragma omp simd
                                        for (int k = 0; k < TT; k++)
                                            cv[k] = CODEF(wv[k] >> (c * bits)) * s + z;
                                    } else {
#pragma omp simd
                                        for (int k = 0; k < TT; k++)
                                            cv[k] = CODEF(wv[k] >> (c * bits)) - half;
                                    }
                                    for (int64_t m = 0; m < M; m++) {
                                        const float qv = qn[m * D + ch];
#pragma omp simd
                                        for (int k = 0; k < TT; k++) accg[m][k] += qv * cv[k];
                                    }
                                }
                                continue;
                            }
                            uint32_t wv[8][TT]; /* 32 codes in NW words */
                            for (int k = 0; k < TT; k++)
                                for (int w = 0; w < NW; w++) {
                                    const uint8_t *rk = base + (t + k) * a->cs_t;
                                    if (a->bit0)
                                        wv[w][k] = fetch32(rk, 4 * (NW * j + w), (int)a->bit0,
                                                           a->nbytes,
                                                           t + k + 1 < T && a->cs_t >= 8);
                                    else
                                        memcpy(&wv[w][k], rk + 4 * (NW * j + w), 4);
                                }
#pragma GCC unroll 32
                            for (int c = 0; c < U; c++) { /* unrolled: lo, sh are constants */
                                const int bit = c * bits, lo = bit >> 5, sh = bit & 31;
                                if (sh + bits > 32) /* straddles words lo and lo + 1 */
                                    tile_code(a, wv[lo], wv[lo + 1], sh, 1, mask, half, an, zn, qn,
                                              D, M, j * U + c, accg);
                                else
                                    tile_code(a, wv[lo], wv[lo], sh, 0, mask, half, an, zn, qn, D,
                                              M, j * U + c, accg);
                            }
                        }
                        if (a->mode == MODE_AFFINE_GROUPS) {
                            const float *A = a->A + b * a->as_b + h * a->as_h + g;
                            const float *Z = a->Z + b * a->as_b + h * a->as_h + g;
                            for (int64_t m = 0; m < M; m++) {
                                const float sq = qsum[m * (MAXD / 8) + g];
                                for (int k = 0; k < TT; k++)
                                    acc[m][k] += A[(t + k) * a->as_r] * accg[m][k] +
                                                 (Z[(t + k) * a->as_r] +
                                                  half * A[(t + k) * a->as_r]) * sq;
                            }
                        } else {
                            for (int64_t m = 0; m < M; m++)
                                for (int k = 0; k < TT; k++) acc[m][k] += accg[m][k];
                        }
                    }
                    for (int64_t m = 0; m < M; m++)
                        for (int k = 0; k < TT; k++) o[m * T + t + k] = acc[m][k];
                }
                for (; t < end; t++) { /* the row's last tokens, one at a time */
                    float x[MAXD];
                    decode(a, bits, b, h, t, x); /* sub-code order */
                    const float *qr = q + row * a->q_sr;
                    for (int64_t m = 0; m < M; m++) {
                        const float *qm = qr + m * a->q_sm;
                        float s = 0.f;
                        for (int64_t k = 0; k < D; k++) s += qm[k] * x[k];
                        o[m * T + t] = s;
                    }
                }
            }
        }
}

static inline int tiled_ok(const kv_args *a, int bits) {
    /* whole units of codes per token and per group: 32-bit words (1, 2, 4, 8 bits) or 32 codes */
    if (a->mode == MODE_STREAM) return bits == 0 && a->M <= 16;
    if (bits < 1) return 0;
    const int64_t unit = (bits & (bits - 1)) == 0 ? 32 / bits : 32;
    return ((bits >= 1 && bits <= 8) || bits == 16) &&
           a->mode != (bits == 16 ? MODE_LUT : -1) && a->M <= 16 &&
           (a->W * cpw_of(bits)) % unit == 0 &&
           (a->mode != MODE_AFFINE_GROUPS ||
            ((a->WG * cpw_of(bits)) % unit == 0 && a->W / a->WG <= MAXD / 8));
}

/* ------------------------------------------------- vectorised values of per-token groups
 * MODE_AFFINE_GROUPS with one code word per byte (1, 2, 4, 8 bits), W and WG multiples of 8:
 *   out[m, k] = sum_t (p[m, t] A[t, g]) (c[t, k] - half) + sum_t p[m, t] (Z[t, g] + half A[t, g])
 * The second sum is one number per (m, group).  The first runs over blocks of MC query rows x
 * VC vectors of 8 channels (sub-code order), the MC x VC accumulators in registers, the codes
 * of 8 channels of a token unpacked into one vector (GCC/Clang vector extensions: SSE, AVX or
 * NEON as the machine has).  Codes enter centred, as in the tiled keys.  MODE_LUT with 1-, 2-
 * and 4-bit codes runs the same blocks with x = LUT[c] by a vector permute (no group terms). */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define VMC 4
#define VVC 2

/* 8 consecutive bytes -> 8 lanes (vpmovzxbd where the machine has AVX2) */
#if defined(__AVX2__)
#include <immintrin.h>
static inline __attribute__((always_inline)) v8u bytes8(const uint8_t *p) {
    return (v8u)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
}
#else
static inline __attribute__((always_inline)) v8u bytes8(const uint8_t *p) {
    v8u u;
    for (int l = 0; l < 8; l++) u[l] = p[l];
    return u;
}
#endif

/* sub-code `shift` of 8 consecutive code words (bytes) -> 8 centred floats */
static inline __attribute__((always_inline)) v8f codes8(const uint8_t *p, uint32_t shift,
                                                        uint32_t mask, float half) {
    const v8u u = (bytes8(p) >> shift) & mask;
    return __builtin_convertvector((v8i)u, v8f) - half;
}


/* ------------------------------------------------------------- vectorised keys (byte words)
 * Codes of 1 to 4 or 8 bits starting on a byte, D a multiple of 8,
 * in MODE_AFFINE_ROWS, MODE_AFFINE_GROUPS, MODE_RAW or MODE_LUT.  A token's D codes are read
 * as D / 8 vectors of 8 consecutive channels in natural order (their `bits` whole bytes,
 * shifted apart in 8 lanes; 8-bit codes: 8 bytes) and multiplied with MC query rows at a time
 * (the query and terms, given in sub-code order, are placed in natural order once per row);
 * the MC partial-sum vectors of 8 tokens are reduced to 8 logits each by one transpose-add.
 * Codes enter centred (c - half), the offset in the bias:
 *   ROWS:   sum_k (q_k A_k) (c_k - half) + sum_k q_k (Z_k + half A_k)   (terms of the row);
 *   GROUPS: sum_g A[t, g] sum_{k in g} q_k (c_k - half) + sum_g (Z + half A)[t, g] Q_g, Q_g the
 *           sum of q over group g;
 *   RAW:    sum_k q_k (c_k - half) + half sum_k q_k   (one query per row of L tokens, or one);
 *   LUT:    sum_k q_k LUT[c_k]. */

/* lane l of the result = the sum of the 8 lanes of v[l] */
static inline __attribute__((always_inline)) v8f hsum8(const v8f *v) {
#if defined(__AVX2__)
    const __m256 s01 = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]);
    const __m256 s23 = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
    const __m256 s45 = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]);
    const __m256 s67 = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23); /* lanes 0-3 / 4-7 of v0..v3 */
    const __m256 s4567 = _mm256_hadd_ps(s45, s67);
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                              _mm256_permute2f128_ps(s0123, s4567, 0x31));
#else
    v8f r;
    for (int l = 0; l < 8; l++) {
        float s = 0.f;
        for (int k = 0; k < 8; k++) s += v[l][k];
        r[l] = s;
    }
    return r;
#endif
}

/* 8 byte codes -> 8 table entries (a table of 256) */
static inline __attribute__((always_inline)) v8f gather8(const uint8_t *p, const float *lut) {
#if defined(__AVX2__)
    return (v8f)_mm256_i32gather_ps(lut, (__m256i)bytes8(p), 4);
#else
    v8f x;
    for (int l = 0; l < 8; l++) x[l] = lut[p[l]];
    return x;
#endif
}

/* the 8 codes of `bits` bits in the low 8 * bits bits of `w`, one per lane */
static inline __attribute__((always_inline)) v8u lanes8(uint32_t w, int bits) {
    const uint32_t b = (uint32_t)bits;
    const v8u sh = {0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b};
    return ((v8u){w, w, w, w, w, w, w, w} >> sh) & ((1u << bits) - 1u);
}

/* 8 codes of `bits` (<= 4) bits from `bits` whole bytes, one per lane.  3 bytes are combined
 * in a register: a 3-byte memcpy into the word goes through the stack and stalls the 4-byte
 * load after it (measured: 3-bit keys of 32 channels 0.69 -> 0.19 ms per 12K tokens and 3
 * query rows) */
static inline __attribute__((always_inline)) v8u codes_of8(const uint8_t *p, int bits) {
    uint32_t w = 0;
    if (bits == 3)
        w = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16;
    else
        memcpy(&w, p, (size_t)bits);
    return lanes8(w, bits);
}

/* codes_of8 for a width known at run time only (1..4: an upper plane, kv_args.up): the bytes
 * combined in a register, no variable-length memcpy */
static inline __attribute__((always_inline)) v8u codes_of8_rt(const uint8_t *p, int bits) {
    uint32_t w = p[0];
    if (bits > 1) w |= (uint32_t)p[1] << 8;
    if (bits > 2) w |= (uint32_t)p[2] << 16;
    if (bits > 3) w |= (uint32_t)p[3] << 24;
    return lanes8(w, bits);
}

/* table entries of 8 codes (< 16) already in lanes: `lo` holds entries 0..7, `hi` 8..15 */
static inline __attribute__((always_inline)) v8f lut8u(v8u u, uint32_t mask, v8f lo, v8f hi) {
#if defined(__AVX2__)
    const __m256 l = _mm256_permutevar8x32_ps((__m256)lo, (__m256i)u);
    if (mask < 8) return (v8f)l;
    const __m256 h = _mm256_permutevar8x32_ps((__m256)hi, (__m256i)u);
    const __m256i big = _mm256_cmpgt_epi32((__m256i)u, _mm256_set1_epi32(7));
    return (v8f)_mm256_blendv_ps(l, h, _mm256_castsi256_ps(big));
#else
    v8f x;
    for (int l = 0; l < 8; l++) x[l] = u[l] < 8 ? lo[u[l]] : hi[u[l] - 8];
    return x;
#endif
}

/* table lookup of 8 codes (< 16) at sub-code `shift` of 8 consecutive code words (bytes) */
static inline __attribute__((always_inline)) v8f lut8(const uint8_t *p, uint32_t shift,
                                                      uint32_t mask, v8f lo, v8f hi) {
    return lut8u((bytes8(p) >> shift) & mask, mask, lo, hi);
}

static inline int keys_vec_ok(const kv_args *a, int bits) {
    if (a->no_tiles || a->bit0 || a->M > 16) return 0;
    if (!(bits >= 1 && bits <= 4) && bits != 8) return 0;
    const int64_t cpw = cpw_of(bits);
    if ((a->W * cpw) % 8) return 0;
    /* per-token groups: whole vectors of channels per group */
    return a->mode != MODE_AFFINE_GROUPS || ((a->WG * cpw) % 8 == 0 && a->W % a->WG == 0);
}

/* query rows m0 .. m0 + MC - 1 of (b, h) */
static inline __attribute__((always_inline)) void keys_vec_rows(const kv_args *a, const int bits,
                                                                int64_t b, int64_t h, int64_t m0,
                                                                const int MC, const int mode) {
    const int64_t W = a->W, cpw = cpw_of(bits), D = W * cpw, nv = D / 8, T = a->T;
    const uint32_t mask = (1u << bits) - 1u;
    const float half = mode == MODE_LUT ? 0.f : 0.5f * (float)mask;
    const int64_t WG = mode == MODE_AFFINE_GROUPS ? a->WG : W, ng = W / WG;
    const int per_row = mode == MODE_AFFINE_ROWS || (mode == MODE_RAW && a->q_sr);
    const float *q = a->qp + (b * a->H + h) * a->M * a->q_sm;
    float *o = a->out + (b * a->H + h) * a->M * T;
    const uint8_t *base = a->codes + b * a->cs_b + h * a->cs_h;
    const float *A0 = a->A ? a->A + b * a->as_b + h * a->as_h : 0;
    const float *Z0 = a->Z ? a->Z + b * a->as_b + h * a->as_h : 0;
    v8f lo = {0, 0, 0, 0, 0, 0, 0, 0}, hi = lo;
    if (mode == MODE_LUT && bits < 8)
        for (int l = 0; l < 8; l++) {
            lo[l] = l < (1 << bits) ? a->lut[l] : 0.f;
            hi[l] = l + 8 < (1 << bits) ? a->lut[l + 8] : 0.f;
        }
    const int32_t *up_rows = a->up ? a->up_row + (b * a->H + h) * T : 0; /* upper_ok */
    const int ub = a->up_bits;
    const float uf = (float)(1u << a->up_shift);
    static __thread v8f qv[4][MAXD / 8];
    static __thread float qs[4][MAXD / 8];
    int32_t pos[MAXD], gi[MAXD / 8];
    for (int64_t ch = 0; ch < D; ch++)
        pos[ch] = a->natural ? (int32_t)ch : (int32_t)((ch % cpw) * W + ch / cpw);
    for (int64_t j = 0; j < nv; j++) gi[j] = (int32_t)((8 * j / cpw) / WG); /* its group */
    float bias[4];
    int64_t row_end = 0;
    for (int64_t t = 0; t < T;) {
        if (t >= row_end) { /* a new row of terms / queries */
            const int64_t row = per_row ? t / a->L : 0;
            row_end = per_row ? (row + 1) * a->L : T;
            const float *qr = q + row * a->q_sr;
            const float *A = mode == MODE_AFFINE_ROWS ? A0 + row * a->as_r : 0;
            const float *Z = mode == MODE_AFFINE_ROWS ? Z0 + row * a->as_r : 0;
            for (int m = 0; m < MC; m++) {
                const float *qm = qr + (m0 + m) * a->q_sm;
                float bm = 0.f;
                for (int64_t g = 0; g < ng; g++) qs[m][g] = 0.f;
                for (int64_t j = 0; j < nv; j++)
                    for (int l = 0; l < 8; l++) {
                        const int64_t k = pos[8 * j + l]; /* sub-code position of the channel */
                        const float v = qm[k];
                        if (mode == MODE_AFFINE_ROWS) {
                            qv[m][j][l] = v * A[k];
                            bm += v * (Z[k] + half * A[k]);
                        } else {
                            qv[m][j][l] = v;
                            bm += half * v; /* RAW; 0 for LUT; GROUPS: its terms below */
                            qs[m][gi[j]] += v;
                        }
                    }
                bias[m] = mode == MODE_AFFINE_GROUPS ? 0.f : bm;
            }
        }
        const int64_t end = row_end < T ? row_end : T;
        const int n = end - t < 8 ? (int)(end - t) : 8;
        v8f buf[4][8];
        for (int k = 0; k < 8; k++) {
            v8f acc[4];
            for (int m = 0; m < MC; m++) acc[m] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
            if (k < n) {
                const uint8_t *row = base + (t + k) * a->cs_t;
                const float *At = mode == MODE_AFFINE_GROUPS ? A0 + (t + k) * a->as_r : 0;
                const int32_t ur = mode == MODE_AFFINE_GROUPS && a->up ? up_rows[t + k] : -1;
                const uint8_t *urow = ur >= 0 ? a->up + (int64_t)ur * a->up_nb : 0;
                v8f pg[4]; /* GROUPS: the sums of the group so far, times its scale at its end */
                for (int m = 0; m < MC; m++) pg[m] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
                for (int64_t j = 0; j < nv; j++) {
                    v8f x;
                    if (bits == 8) /* 8 channels = 8 bytes */
                        x = mode == MODE_LUT ? gather8(row + 8 * j, a->lut)
                                             : codes8(row + 8 * j, 0, mask, half);
                    else { /* 8 channels = `bits` bytes */
                        const v8u u = codes_of8(row + j * bits, bits);
                        x = mode == MODE_LUT ? lut8u(u, mask, lo, hi)
                                             : __builtin_convertvector((v8i)u, v8f) - half;
                    }
                    if (urow) /* the token's upper codes: c = low + 2^s u */
                        x += __builtin_convertvector((v8i)codes_of8_rt(urow + j * ub, ub), v8f) *
                             uf;
                    if (mode != MODE_AFFINE_GROUPS) {
                        for (int m = 0; m < MC; m++) acc[m] += qv[m][j] * x;
                        continue;
                    }
                    for (int m = 0; m < MC; m++) pg[m] += qv[m][j] * x;
                    if (j + 1 == nv || gi[j + 1] != gi[j]) { /* the group ends */
                        const float s = At[gi[j]];
                        for (int m = 0; m < MC; m++) {
                            acc[m] += s * pg[m];
                            pg[m] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
                        }
                    }
                }
            }
            for (int m = 0; m < MC; m++) buf[m][k] = acc[m];
        }
        v8f e[4];
        for (int m = 0; m < MC; m++) e[m] = hsum8(buf[m]) + bias[m];
        for (int64_t g = 0; mode == MODE_AFFINE_GROUPS && g < ng; g++) {
            v8f zv = {0, 0, 0, 0, 0, 0, 0, 0}; /* (Z + half A)[t + k, g] of the 8 tokens */
            for (int k = 0; k < n; k++) {
                const int64_t r = (t + k) * a->as_r + g;
                zv[k] = Z0[r] + half * A0[r];
            }
            for (int m = 0; m < MC; m++) e[m] += qs[m][g] * zv;
        }
        for (int m = 0; m < MC; m++) {
            float *om = o + (m0 + m) * T + t;
            if (n == 8)
                memcpy(om, &e[m], 32);
            else
                for (int k = 0; k < n; k++) om[k] = e[m][k];
        }
        t += n;
    }
}

static inline __attribute__((always_inline)) void keys_vec_mode(const kv_args *a, const int bits,
                                                                const int mode) {
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->H; h++)
            for (int64_t m0 = 0; m0 < a->M; m0 += 4) {
                const int64_t mc = a->M - m0 < 4 ? a->M - m0 : 4;
                switch (mc) {
                case 1: keys_vec_rows(a, bits, b, h, m0, 1, mode); break;
                case 2: keys_vec_rows(a, bits, b, h, m0, 2, mode); break;
                case 3: keys_vec_rows(a, bits, b, h, m0, 3, mode); break;
                default: keys_vec_rows(a, bits, b, h, m0, 4, mode); break;
                }
            }
}

static inline __attribute__((always_inline)) void keys_vec(const kv_args *a, const int bits) {
    switch (a->mode) {
    case MODE_AFFINE_ROWS: keys_vec_mode(a, bits, MODE_AFFINE_ROWS); break;
    case MODE_AFFINE_GROUPS: keys_vec_mode(a, bits, MODE_AFFINE_GROUPS); break;
    case MODE_LUT: keys_vec_mode(a, bits, MODE_LUT); break;
    default: keys_vec_mode(a, bits, MODE_RAW); break;
    }
}

static inline __attribute__((always_inline)) int keys_impl(const kv_args *a, int bits) {
    const int64_t D = a->W * cpw_of(bits);
    if (D > MAXD) return -1;
    if (keys_vec_ok(a, bits)) {
        keys_vec(a, bits);
        return 0;
    }
    if (a->natural) return -3; /* the caller checks keys_vec_ok's conditions first */
    if (tiled_ok(a, bits) && a->no_tiles != 1) {
        keys_tiled(a, bits);
        return 0;
    }
    float x[MAXD];
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->H; h++) {
            const float *q = a->qp + (b * a->H + h) * a->M * a->q_sm;
            float *o = a->out + (b * a->H + h) * a->M * a->T;
            for (int64_t t = 0; t < a->T; t++) {
                decode(a, bits, b, h, t, x);
                const float *qr = q + (t / a->L) * a->q_sr;
                for (int64_t m = 0; m < a->M; m++) {
                    const float *qm = qr + m * a->q_sm;
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t k = 0; k < D; k++) acc += qm[k] * x[k];
                    o[m * a->T + t] = acc;
                }
            }
        }
    return 0;
}

static inline int values_vec_ok(const kv_args *a, int bits) {
    if (a->M > 16 || a->no_tiles == 1 || a->W % 8) return 0;
    if (a->mode == MODE_LUT) return bits == 1 || bits == 2 || bits == 4;
    /* groups of whole vectors of 8 words, or groups of 1, 2 or 4 words, a vector's lanes then
     * reading 8 / WG groups' scales (e.g. 1-bit codes in groups of 32 channels: 4 words) */
    return a->mode == MODE_AFFINE_GROUPS && (bits == 1 || bits == 2 || bits == 4 || bits == 8) &&
           (a->WG % 8 == 0 || 8 % a->WG == 0) && a->W % a->WG == 0 && a->W / a->WG <= MAXD / 8;
}

static inline __attribute__((always_inline)) void values_vec_block(
    const kv_args *a, int bits, const float *p, const uint8_t *base, const float *A,
    const float *Z, float *o, int64_t m0, int64_t v0, const int mc, const int vc) {
    (void)Z;
    const int is_lut = a->mode == MODE_LUT;
    v8f lo = {0, 0, 0, 0, 0, 0, 0, 0}, hi = lo;
    if (is_lut)
        for (int l = 0; l < 8; l++) {
            lo[l] = l < (1 << bits) ? a->lut[l] : 0.f;
            hi[l] = l + 8 < (1 << bits) ? a->lut[l + 8] : 0.f;
        }
    const int64_t W = a->W, T = a->T, D = W * (8 / bits);
    const uint32_t mask = (1u << bits) - 1u;
    const float half = 0.5f * (float)mask;
    int64_t off[VVC], gi[VVC];
    uint32_t sh[VVC];
    for (int j = 0; j < vc; j++) {
        const int64_t pos = (v0 + j) * 8; /* sub-code position: plane pos / W, word pos % W */
        off[j] = pos % W;
        sh[j] = (uint32_t)(pos / W) * (uint32_t)bits;
        gi[j] = is_lut ? 0 : off[j] / a->WG;
    }
    v8f acc[VMC][VVC];
    for (int m = 0; m < mc; m++)
        for (int j = 0; j < vc; j++) acc[m][j] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    if (is_lut)
        for (int64_t t = 0; t < T; t++) {
            const uint8_t *row = base + t * a->cs_t;
            float pm[VMC];
            for (int m = 0; m < mc; m++) pm[m] = p[(m0 + m) * T + t];
            for (int j = 0; j < vc; j++) {
                const v8f x = lut8(row + off[j], sh[j], mask, lo, hi);
                for (int m = 0; m < mc; m++) acc[m][j] += pm[m] * x;
            }
        }
    else if (a->WG % 8 == 0)
        for (int64_t t = 0; t < T; t++) {
            const uint8_t *row = base + t * a->cs_t;
            const float *At = A + t * a->as_r;
            float pm[VMC];
            for (int m = 0; m < mc; m++) pm[m] = p[(m0 + m) * T + t];
            for (int j = 0; j < vc; j++) {
                const v8f c = codes8(row + off[j], sh[j], mask, half);
                const float s = At[gi[j]];
                for (int m = 0; m < mc; m++) acc[m][j] += (pm[m] * s) * c;
            }
        }
    else /* WG in 1, 2, 4: lane l of vector j reads the scale of word off[j] + l's group */
        for (int64_t t = 0; t < T; t++) {
            const uint8_t *row = base + t * a->cs_t;
            const float *At = A + t * a->as_r;
            float pm[VMC];
            for (int m = 0; m < mc; m++) pm[m] = p[(m0 + m) * T + t];
            for (int j = 0; j < vc; j++) {
                const v8f c = codes8(row + off[j], sh[j], mask, half);
                v8f s;
                for (int l = 0; l < 8; l++) s[l] = At[(off[j] + l) / a->WG];
                const v8f cs = s * c;
                for (int m = 0; m < mc; m++) acc[m][j] += pm[m] * cs;
            }
        }
    for (int m = 0; m < mc; m++)
        for (int j = 0; j < vc; j++) memcpy(o + (m0 + m) * D + (v0 + j) * 8, &acc[m][j], 32);
}

#if KV_IN(KV_UNIT_VALUES)
static void values_groups_vec(const kv_args *a, int bits) {
    const int is_lut = a->mode == MODE_LUT; /* a table: no group terms */
    const int64_t W = a->W, D = W * (8 / bits), M = a->M, T = a->T, WG = is_lut ? W : a->WG;
    const int64_t ng = W / WG, nv = D / 8;
    const float half = 0.5f * (float)((1u << bits) - 1u);
    float zs[16 * (MAXD / 8)];
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->H; h++) {
            const float *p = a->qp + (b * a->H + h) * M * T;
            float *o = a->out + (b * a->H + h) * M * D;
            const uint8_t *base = a->codes + b * a->cs_b + h * a->cs_h;
            const float *A = is_lut ? 0 : a->A + b * a->as_b + h * a->as_h;
            const float *Z = is_lut ? 0 : a->Z + b * a->as_b + h * a->as_h;
            for (int64_t m = 0; m < M; m++)
                for (int64_t g = 0; g < ng; g++) {
                    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* 8 chains, not one */
                    for (int64_t t = 0; t < T && !is_lut; t++)
                        part[t & 7] +=
                            p[m * T + t] * (Z[t * a->as_r + g] + half * A[t * a->as_r + g]);
                    float s = 0.f;
                    for (int k = 0; k < 8; k++) s += part[k];
                    zs[m * ng + g] = s;
                }
            for (int64_t m0 = 0; m0 < M; m0 += VMC)
                for (int64_t v0 = 0; v0 < nv; v0 += VVC) {
                    const int mc = M - m0 < VMC ? (int)(M - m0) : VMC;
                    const int vc = nv - v0 < VVC ? (int)(nv - v0) : VVC;
#define VB(MC, VC)                                                                            \
    case MC * 8 + VC:                                                                         \
        values_vec_block(a, bits, p, base, A, Z, o, m0, v0, MC, VC);                          \
        break;
                    switch (mc * 8 + vc) {
                        VB(1, 1) VB(1, 2) VB(2, 1) VB(2, 2) VB(3, 1) VB(3, 2) VB(4, 1) VB(4, 2)
                    }
#undef VB
                }
            /* the group terms, added per channel (sub-code position -> word -> group) */
            for (int64_t m = 0; m < M; m++)
                for (int64_t pos = 0; pos < D; pos++) o[m * D + pos] += zs[m * ng + (pos % W) / WG];
        }
}

/* values written in sub-code order -> natural channel order, per (b, h, m) row (a->natural) */
static void values_to_natural(const kv_args *a, int bits) {
    const int64_t W = a->W, cpw = cpw_of(bits), D = W * cpw;
    float tmp[MAXD];
    for (int64_t r = 0; r < a->B * a->H * a->M; r++) {
        float *o = a->out + r * D;
        memcpy(tmp, o, sizeof(float) * (size_t)D);
        for (int64_t pos = 0; pos < D; pos++) o[(pos % W) * cpw + pos / W] = tmp[pos];
    }
}

static inline __attribute__((always_inline)) int values_impl(const kv_args *a, int bits) {
    const int64_t D = a->W * cpw_of(bits);
    if (D > MAXD) return -1;
    if (values_vec_ok(a, bits)) {
        values_groups_vec(a, bits);
        if (a->natural && cpw_of(bits) > 1) values_to_natural(a, bits);
        return 0;
    }
    float x[MAXD];
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->H; h++) {
            const float *p = a->qp + (b * a->H + h) * a->M * a->T;
            float *o = a->out + (b * a->H + h) * a->M * D;
            memset(o, 0, sizeof(float) * a->M * D);
            for (int64_t t = 0; t < a->T; t++) {
                decode(a, bits, b, h, t, x);
                for (int64_t m = 0; m < a->M; m++) {
                    const float pm = p[m * a->T + t];
                    float *om = o + m * D;
#pragma omp simd
                    for (int64_t k = 0; k < D; k++) om[k] += pm * x[k];
                }
            }
        }
    if (a->natural && a->mode != MODE_STREAM && cpw_of(bits) > 1) values_to_natural(a, bits);
    return 0;
}
#endif /* KV_IN(KV_UNIT_VALUES) */

#if KV_IN(KV_UNIT_KEYS)
#define SPECIALISE_KEYS(BITS) \
    static int keys_b##BITS(const kv_args *a) { return keys_impl(a, BITS); }
#else
#define SPECIALISE_KEYS(BITS)
#endif
#if KV_IN(KV_UNIT_VALUES)
#define SPECIALISE_VALUES(BITS) \
    static int values_b##BITS(const kv_args *a) { return values_impl(a, BITS); }
#else
#define SPECIALISE_VALUES(BITS)
#endif
#define SPECIALISE(BITS) SPECIALISE_KEYS(BITS) SPECIALISE_VALUES(BITS)
SPECIALISE(0)
SPECIALISE(1)
SPECIALISE(2)
SPECIALISE(3)
SPECIALISE(4)
SPECIALISE(5)
SPECIALISE(6)
SPECIALISE(7)
SPECIALISE(8)
SPECIALISE(16)

/* ------------------------------------------------- an upper plane of some tokens (a->up)
 * Per-token groups (MODE_AFFINE_GROUPS) where a token's code is c = low + 2^s u, u present for
 * some tokens only (SemKV's high tokens, methods/semkv.py): with x = c A[t, g] + Z[t, g] the
 * upper plane adds 2^s u A[t, g].  Keys: the vectorised keys (keys_vec_rows) add 2^s u to a
 * high token's decoded codes; values: a pass over the high tokens after the low plane's
 *   out[m, k] += 2^s sum_t p[m, t] A[t, g(k)] u[t, k].
 * Natural channel order (queries and outputs), channel groups of a multiple of 8 channels,
 * up_bits 1..4 (8 codes = up_bits bytes); a token's row r = up_row[(b * H + h) * T + t] of
 * `up` when r >= 0. */
#if KV_IN(KV_UNIT_KEYS | KV_UNIT_VALUES)
static int upper_ok(const kv_args *a, int bits) {
    const int64_t cg = a->WG * cpw_of(bits), D = a->W * cpw_of(bits);
    return a->mode == MODE_AFFINE_GROUPS && a->natural && a->up_bits >= 1 && a->up_bits <= 4 &&
           a->up_shift >= 0 && a->up_shift <= 23 &&
           cg % 8 == 0 && D % 8 == 0 && D <= MAXD && a->up_nb * 8 >= D * a->up_bits;
}
#endif

/* query rows m0 .. m0 + MC - 1, output vectors j0 .. j0 + VC - 1 of (b, h): accumulators in
 * registers over the high tokens */
static inline __attribute__((always_inline)) void values_upper_block(
    const kv_args *a, const int ub, const int32_t *rows, const float *p, const float *A0,
    const int32_t *gi, float f, float *o, int64_t D, int64_t m0, int64_t j0, const int MC,
    const int VC) {
    const int64_t T = a->T;
    v8f acc[4][4];
    for (int m = 0; m < MC; m++)
        for (int j = 0; j < VC; j++) acc[m][j] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t t = 0; t < T; t++) {
        if (rows[t] < 0) continue;
        const uint8_t *u8 = a->up + (int64_t)rows[t] * a->up_nb + j0 * ub;
        const float *At = A0 + t * a->as_r;
        v8f x[4];
        for (int j = 0; j < VC; j++)
            x[j] = __builtin_convertvector((v8i)codes_of8(u8 + j * ub, ub), v8f) *
                   (At[gi[j0 + j]] * f);
        for (int m = 0; m < MC; m++) {
            const float pm = p[(m0 + m) * T + t];
            for (int j = 0; j < VC; j++) acc[m][j] += pm * x[j];
        }
    }
    for (int m = 0; m < MC; m++)
        for (int j = 0; j < VC; j++) {
            float *om = o + (m0 + m) * D + (j0 + j) * 8;
            v8f ov;
            memcpy(&ov, om, 32);
            ov += acc[m][j];
            memcpy(om, &ov, 32);
        }
}

static inline __attribute__((always_inline)) void values_upper_ub(const kv_args *a, int bits,
                                                                  const int ub) {
    const int64_t D = a->W * cpw_of(bits), nv = D / 8, cg = a->WG * cpw_of(bits), T = a->T;
    const float f = (float)(1u << a->up_shift);
    int32_t gi[MAXD / 8];
    for (int64_t j = 0; j < nv; j++) gi[j] = (int32_t)(8 * j / cg);
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->H; h++) {
            const int32_t *rows = a->up_row + (b * a->H + h) * T;
            const float *p = a->qp + (b * a->H + h) * a->M * T;
            float *o = a->out + (b * a->H + h) * a->M * D;
            const float *A0 = a->A + b * a->as_b + h * a->as_h;
            for (int64_t m0 = 0; m0 < a->M; m0 += 4)
                for (int64_t j0 = 0; j0 < nv; j0 += 4) {
                    const int mc = a->M - m0 < 4 ? (int)(a->M - m0) : 4;
                    const int vc = nv - j0 < 4 ? (int)(nv - j0) : 4;
#define UB(MC, VC)                                                                            \
    case MC * 8 + VC:                                                                         \
        values_upper_block(a, ub, rows, p, A0, gi, f, o, D, m0, j0, MC, VC);                  \
        break;
                    switch (mc * 8 + vc) {
                        UB(1, 1) UB(1, 2) UB(1, 3) UB(1, 4) UB(2, 1) UB(2, 2) UB(2, 3) UB(2, 4)
                        UB(3, 1) UB(3, 2) UB(3, 3) UB(3, 4) UB(4, 1) UB(4, 2) UB(4, 3) UB(4, 4)
                    }
#undef UB
                }
        }
}

#if KV_IN(KV_UNIT_VALUES)
static void values_upper(const kv_args *a, int bits) {
    switch (a->up_bits) {
    case 1: values_upper_ub(a, bits, 1); break;
    case 2: values_upper_ub(a, bits, 2); break;
    case 3: values_upper_ub(a, bits, 3); break;
    default: values_upper_ub(a, bits, 4); break;
    }
}
#endif

/* bits 1..8, 16 (signed int16 codes, affine modes), or 0 for MODE_STREAM.  Returns 0, or -1
 * for an unsupported width or size (D above MAXD), -4 for an upper plane (a->up) the
 * post-pass does not take (upper_ok) */
#if KV_IN(KV_UNIT_KEYS)
int kv_keys(const kv_args *a, int bits) {
    static int (*const fn[9])(const kv_args *) = {keys_b0, keys_b1, keys_b2, keys_b3, keys_b4,
                                                   keys_b5, keys_b6, keys_b7, keys_b8};
    if (a->up && (bits > 8 || !upper_ok(a, bits))) return -4;
    if (bits == 16) return a->mode == MODE_LUT ? -1 : keys_b16(a);
    if (bits < 0 || bits > 8) return -1;
    return fn[bits](a); /* the upper plane: read in keys_vec_rows */
}
#endif

#if KV_IN(KV_UNIT_VALUES)
int kv_values(const kv_args *a, int bits) {
    static int (*const fn[9])(const kv_args *) = {values_b0, values_b1, values_b2, values_b3,
                                                   values_b4, values_b5, values_b6, values_b7,
                                                   values_b8};
    if (a->up && (bits > 8 || !upper_ok(a, bits))) return -4;
    if (bits == 16) return a->mode == MODE_LUT ? -1 : values_b16(a);
    if (bits < 0 || bits > 8) return -1;
    const int rc = fn[bits](a);
    if (rc == 0 && a->up) values_upper(a, bits);
    return rc;
}
#endif

/* code `d` of a row in kvbench.cache.quant.pack_bits order (bits d*bits .. d*bits + bits - 1) */
static inline __attribute__((always_inline)) uint32_t code_at(const uint8_t *row, int64_t d,
                                                              int bits, uint32_t mask) {
    const int64_t bit = d * bits, byte = bit >> 3;
    const int sh = (int)(bit & 7);
    uint32_t v = row[byte];
    if (sh + bits > 8) v |= (uint32_t)row[byte + 1] << 8; /* within the row */
    return (v >> sh) & mask;
}

/* ------------------------------------------------- table codes with sparse outliers (KVQuant)
 * KVQuant's keys (methods/kvquant.py, LUTAttention; Hooper et al., arXiv 2401.18079 §3.1,
 * §3.4): channel d of token t is x_d = lut[c_d] * HS[h, d] + HZ[h, d] (a shared table of
 * 2^bits levels, per-channel half-range and centre), except the sparse outliers, stored
 * exactly: out_val[k] at flat position out_idx[k] of [T, B, H, D] (ascending).  Without
 * rotation the logit of query row m is q_m . x.  Pre-RoPE keys are read rotated by RoPE at
 * their positions: pair p of channels (i_p, j_p) turns by the angle with cosine C[t, p] and
 * sine S[t, p], so with (a, b) = (x_i, x_j):
 *   q . R k = sum_p C (q_i a + q_j b) + S (q_j a - q_i b).
 * The key is dequantized and turned in registers, one token at a time; nothing is written back.
 * Codes in kvbench.cache.quant.pack_bits order (code d at bits d*bits .. d*bits + bits - 1). */
typedef struct {
    const uint8_t *codes;
    int64_t cs_b, cs_h, cs_t;
    int64_t B, H, T, M, D;
    const float *lut;       /* 2^bits levels */
    const float *hs, *hz;   /* [H, D] half-range and centre */
    const int64_t *out_idx; /* [N] ascending flat positions in [T, B, H, D] */
    const float *out_val;   /* [N] */
    int64_t N;
    const float *qp;   /* [B, H, M, D]; rotated: [B, H, M, 2, D/2] = (q_i, q_j) in pair order */
    const float *cosv; /* [T, D/2], or NULL: no rotation */
    const float *sinv; /* [T, D/2] */
    const int32_t *pi; /* [D/2] first channel of each pair */
    const int32_t *pj; /* [D/2] second channel */
    float *out;        /* [B, H, M, T] */
    int scalar;        /* 1: the scalar loop even where the vectorised one applies (checks) */
} kv_lut_args;

/* a key's RoPE pairs (x_i, x_j) as two rows: the halves of x (rotate_half pairs, no copy), or
 * gathered into xa, xb by the pair indices */
static inline __attribute__((always_inline)) void rope_pairs_of(const kv_lut_args *a,
                                                                const float *x, int halves,
                                                                float *xa, float *xb,
                                                                const float **pa,
                                                                const float **pb) {
    const int64_t P = a->D / 2;
    if (halves) {
        *pa = x;
        *pb = x + P;
        return;
    }
    for (int64_t p = 0; p < P; p++) {
        xa[p] = x[a->pi[p]];
        xb[p] = x[a->pj[p]];
    }
    *pa = xa;
    *pb = xb;
}

/* lane l of the result = the sum of the 8 lanes of v */
static inline __attribute__((always_inline)) float hsum1(v8f v) {
#if defined(__AVX2__)
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1)));
#else
    float s = 0.f;
    for (int l = 0; l < 8; l++) s += v[l];
    return s;
#endif
}

static inline __attribute__((always_inline)) v8f loadv(const float *p) {
    v8f v;
    memcpy(&v, p, 32);
    return v;
}

/* The sparse outliers of the vectorised KVQuant keys, added after the dense pass as logit
 * terms: an outlier at channel d of token (t, b, h) replaces the table value x_d by its exact
 * value, so its logits change by (out_val - x_d) times d's weight: q_d unrotated; for a RoPE
 * pair (i, j) turned by (C, S), q_i C + q_j S for d = i and q_j C - q_i S for d = j (q in
 * pair order).  One pass over the outliers, no per-token branch in the dense loop (about half
 * the token rows of a real model's keys hold an outlier at 1%). */
#if KV_IN(KV_UNIT_TABLES)
static void lut_outlier_terms(const kv_lut_args *a, const int bits) {
    const int64_t D = a->D, P = D / 2, M = a->M, T = a->T, BHD = a->B * a->H * D;
    const uint32_t mask = (1u << bits) - 1u;
    int32_t pair[MAXD];
    uint8_t second[MAXD];
    for (int64_t p = 0; a->cosv && p < P; p++) {
        pair[a->pi[p]] = (int32_t)p, second[a->pi[p]] = 0;
        pair[a->pj[p]] = (int32_t)p, second[a->pj[p]] = 1;
    }
    for (int64_t k = 0; k < a->N; k++) {
        const int64_t pos = a->out_idx[k];
        if (pos < 0 || pos >= T * BHD) continue;
        const int64_t t = pos / BHD, bh = (pos % BHD) / D, d = pos % D;
        const int64_t b = bh / a->H, h = bh % a->H;
        const uint8_t *row = a->codes + b * a->cs_b + h * a->cs_h + t * a->cs_t;
        const uint32_t c = code_at(row, d, bits, mask);
        const float delta = a->out_val[k] - (a->lut[c] * a->hs[h * D + d] + a->hz[h * D + d]);
        const float *q = a->qp + bh * M * D;
        float *o = a->out + bh * M * T + t;
        if (!a->cosv) {
            for (int64_t m = 0; m < M; m++) o[m * T] += q[m * D + d] * delta;
            continue;
        }
        const int64_t p = pair[d];
        const float C = a->cosv[t * P + p], S = a->sinv[t * P + p];
        for (int64_t m = 0; m < M; m++) {
            const float qi = q[m * D + p], qj = q[m * D + P + p];
            o[m * T] += (second[d] ? qj * C - qi * S : qi * C + qj * S) * delta;
        }
    }
}

/* KVQuant keys with 1- to 4-bit codes and head_dim a multiple of 8 (16 when rotated): 8
 * channels' codes are `bits` whole bytes, shifted apart in 8 lanes and looked up in the table
 * by a vector permute, times the channels' half-range plus centre; a pre-RoPE key is turned
 * once per token, (a C - b S, b C + a S) per pair, and then dotted with every query row; the
 * outliers are added afterwards as logit terms (lut_outlier_terms). */
static inline __attribute__((always_inline)) int lut_keys_vec(const kv_lut_args *a, const int bits) {
    const int64_t D = a->D, P = D / 2, M = a->M, T = a->T, BHD = a->B * a->H * D, nv = D / 8;
    const uint32_t mask = (1u << bits) - 1u;
    v8f lo = {0, 0, 0, 0, 0, 0, 0, 0}, hi = lo;
    for (int l = 0; l < 8; l++) {
        lo[l] = l <= (int)mask ? a->lut[l] : 0.f;
        hi[l] = l + 8 <= (int)mask ? a->lut[l + 8] : 0.f;
    }
    int halves = a->cosv != 0;
    for (int64_t p = 0; halves && p < P; p++) halves = a->pi[p] == p && a->pj[p] == P + p;
    float x[MAXD] __attribute__((aligned(32))), ra[MAXD / 2], rb[MAXD / 2];
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < a->B; b++)
            for (int64_t h = 0; h < a->H; h++) {
                const uint8_t *row = a->codes + b * a->cs_b + h * a->cs_h + t * a->cs_t;
                const float *hs = a->hs + h * D, *hz = a->hz + h * D;
                for (int64_t j = 0; j < nv; j++) {
                    const v8u u = codes_of8(row + j * bits, bits); /* 8 codes */
                    const v8f v = lut8u(u, mask, lo, hi) * loadv(hs + 8 * j) + loadv(hz + 8 * j);
                    memcpy(x + 8 * j, &v, 32);
                }
                const float *q = a->qp + (b * a->H + h) * M * D;
                float *o = a->out + (b * a->H + h) * M * T + t;
                if (!a->cosv) {
                    for (int64_t m = 0; m < M; m++) {
                        v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
                        for (int64_t j = 0; j < nv; j++) acc += loadv(q + m * D + 8 * j) * loadv(x + 8 * j);
                        o[m * T] = hsum1(acc);
                    }
                    continue;
                }
                const float *C = a->cosv + t * P, *S = a->sinv + t * P, *pa, *pb;
                rope_pairs_of(a, x, halves, ra, rb, &pa, &pb);
                float kr[MAXD] __attribute__((aligned(32))); /* the turned key, pair order */
                for (int64_t i = 0; i < P / 8; i++) {
                    const v8f av = loadv(pa + 8 * i), bv = loadv(pb + 8 * i);
                    const v8f c = loadv(C + 8 * i), s = loadv(S + 8 * i);
                    const v8f r1 = av * c - bv * s, r2 = bv * c + av * s;
                    memcpy(kr + 8 * i, &r1, 32);
                    memcpy(kr + P + 8 * i, &r2, 32);
                }
                for (int64_t m = 0; m < M; m++) {
                    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
                    for (int64_t j = 0; j < nv; j++) acc += loadv(q + m * D + 8 * j) * loadv(kr + 8 * j);
                    o[m * T] = hsum1(acc);
                }
            }
    lut_outlier_terms(a, bits);
    return 0;
}

static inline __attribute__((always_inline)) int lut_keys_impl(const kv_lut_args *a, int bits) {
    const int64_t D = a->D, P = D / 2, M = a->M, T = a->T, BHD = a->B * a->H * D;
    if (D > MAXD || (a->cosv && D % 2) || M < 1) return -1;
    for (int64_t k = 1; k < a->N; k++)
        if (a->out_idx[k] <= a->out_idx[k - 1]) return -2; /* not ascending */
    if (bits <= 4 && D % (a->cosv ? 16 : 8) == 0 && !a->scalar) return lut_keys_vec(a, bits);
    const uint32_t mask = (1u << bits) - 1u;
    const int64_t K = (int64_t)1 << bits;
    float x[MAXD], xa[MAXD / 2], xb[MAXD / 2];
    /* per head and channel, the dequantized value of every code: x_d = TD[h][d][c_d] */
    float *td = (float *)malloc(sizeof(float) * (size_t)(a->H * D * K));
    if (!td) return -1;
    for (int64_t h = 0; h < a->H; h++)
        for (int64_t d = 0; d < D; d++)
            for (int64_t l = 0; l < K; l++)
                td[(h * D + d) * K + l] = a->lut[l] * a->hs[h * D + d] + a->hz[h * D + d];
    /* rotate_half pairs (i, i + D/2): the halves of x, no gather */
    int halves = a->cosv != 0;
    for (int64_t p = 0; halves && p < P; p++) halves = a->pi[p] == p && a->pj[p] == P + p;
    int64_t k = 0; /* next outlier */
    while (k < a->N && a->out_idx[k] < 0) k++;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t b = 0; b < a->B; b++)
            for (int64_t h = 0; h < a->H; h++) {
                const uint8_t *row = a->codes + b * a->cs_b + h * a->cs_h + t * a->cs_t;
                const float *tdh = td + h * D * K;
                if (8 % bits == 0) { /* whole codes per byte */
                    const int cpb = 8 / bits;
                    for (int64_t j = 0; j < D / cpb; j++) {
                        const uint32_t v = row[j];
                        for (int c = 0; c < cpb; c++) {
                            const int64_t d = j * cpb + c;
                            x[d] = tdh[d * K + ((v >> (c * bits)) & mask)];
                        }
                    }
                } else
                    for (int64_t d = 0; d < D; d++) x[d] = tdh[d * K + code_at(row, d, bits, mask)];
                const int64_t base = t * BHD + (b * a->H + h) * D;
                for (; k < a->N && a->out_idx[k] < base + D; k++)
                    if (a->out_idx[k] >= base) x[a->out_idx[k] - base] = a->out_val[k];
                const float *q = a->qp + (b * a->H + h) * M * D;
                float *o = a->out + (b * a->H + h) * M * T + t;
                if (!a->cosv) {
                    for (int64_t m = 0; m < M; m++) {
                        const float *qm = q + m * D;
                        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                        for (int64_t d = 0; d < D; d++) acc += qm[d] * x[d];
                        o[m * T] = acc;
                    }
                    continue;
                }
                const float *C = a->cosv + t * P, *S = a->sinv + t * P, *pa, *pb;
                rope_pairs_of(a, x, halves, xa, xb, &pa, &pb);
                for (int64_t m = 0; m < M; m++) {
                    const float *qi = q + m * D, *qj = qi + P; /* pair order */
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t p = 0; p < P; p++)
                        acc += C[p] * (qi[p] * pa[p] + qj[p] * pb[p]) +
                               S[p] * (qj[p] * pa[p] - qi[p] * pb[p]);
                    o[m * T] = acc;
                }
            }
    }
    free(td);
    return 0;
}

#define SPECIALISE_LUT(BITS) \
    static int lut_keys_b##BITS(const kv_lut_args *a) { return lut_keys_impl(a, BITS); }
SPECIALISE_LUT(1)
SPECIALISE_LUT(2)
SPECIALISE_LUT(3)
SPECIALISE_LUT(4)
SPECIALISE_LUT(5)
SPECIALISE_LUT(6)
SPECIALISE_LUT(7)
SPECIALISE_LUT(8)

/* bits 1..8.  Returns 0; -1 for an unsupported width or size; -2 for outliers not ascending */
int kv_keys_lut_outliers(const kv_lut_args *a, int bits) {
    static int (*const fn[9])(const kv_lut_args *) = {0,           lut_keys_b1, lut_keys_b2,
                                                       lut_keys_b3, lut_keys_b4, lut_keys_b5,
                                                       lut_keys_b6, lut_keys_b7, lut_keys_b8};
    return (bits < 1 || bits > 8) ? -1 : fn[bits](a);
}

/* ------------------------------------------------------------------- polar keys (PolarQuant)
 * PolarQuant's keys (methods/polarquant.py, PolarAttention; Wu et al., arXiv 2502.00527 §3):
 * per RoPE pair j of token t a radius code cr and an angle code ca, each with per-channel
 * terms per page of L tokens.  The caller builds, per page P, query row m and angle level l,
 * the table TAB[P, m, l, j] = qa_j cos(theta_l) + qb_j sin(theta_l) over the page's 2^abits
 * levels; the logit is sum_j (cr_j AR[P, j] + BR[P, j]) TAB[P, m, ca_j, j].
 * Vectorised (pairs a multiple of 8, radius and angle codes of at most 4 bits): 8 pairs'
 * codes are `bits` whole bytes shifted apart in 8 lanes; the table entries of 1- and 2-bit
 * angles are selected from the 2 or 4 level rows by the code's bits, wider angles gathered. */
typedef struct {
    const uint8_t *rc, *ac; /* radius and angle codes, pack_bits order, rows of tokens */
    int64_t rs_b, rs_h, rs_t, as_b, as_h, as_t;
    int64_t B, H, T, M, P, L, NP;
    const float *ar, *br; /* [B, H, NP, P] radius scale and zero per page */
    const float *tab;     /* [B, H, NP, M, 2^abits, P] */
    float *out;           /* [B, H, M, T] */
    int scalar;           /* 1: the scalar loop even where the vectorised one applies (checks) */
} kv_polar_args;

/* lanes of `a1` where bit `k` of `c` is set, else of `a0` */
static inline __attribute__((always_inline)) v8f select_bit(v8u c, int k, v8f a0, v8f a1) {
#if defined(__AVX2__)
    return (v8f)_mm256_blendv_ps((__m256)a0, (__m256)a1, (__m256)(c << (31 - k)));
#else
    v8f x;
    for (int l = 0; l < 8; l++) x[l] = (c[l] >> k) & 1u ? a1[l] : a0[l];
    return x;
#endif
}

static inline __attribute__((always_inline)) int polar_impl(const kv_polar_args *a, int rbits,
                                                            int abits) {
    const int64_t P = a->P, M = a->M, T = a->T, K = (int64_t)1 << abits, nv = P / 8;
    const uint32_t rmask = (1u << rbits) - 1u, amask = (1u << abits) - 1u;
    const int vec = P % 8 == 0 && rbits <= 4 && abits <= 4 && !a->scalar;
    float r[MAXD / 2];
    int32_t ca[MAXD / 2];
    v8f rv[MAXD / 16];
    v8u cv[MAXD / 16];
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->H; h++) {
            const int64_t bh = b * a->H + h;
            float *o = a->out + bh * M * T;
            for (int64_t t = 0; t < T; t++) {
                const int64_t pg = t / a->L;
                const uint8_t *rr = a->rc + b * a->rs_b + h * a->rs_h + t * a->rs_t;
                const uint8_t *ra = a->ac + b * a->as_b + h * a->as_h + t * a->as_t;
                const float *ar = a->ar + (bh * a->NP + pg) * P, *br = a->br + (bh * a->NP + pg) * P;
                const float *tab = a->tab + (bh * a->NP + pg) * M * K * P;
                if (vec) {
                    for (int64_t i = 0; i < nv; i++) {
                        const v8u cr = codes_of8(rr + i * rbits, rbits);
                        rv[i] = __builtin_convertvector((v8i)cr, v8f) * loadv(ar + 8 * i) +
                                loadv(br + 8 * i);
                        cv[i] = codes_of8(ra + i * abits, abits);
                    }
                    for (int64_t m = 0; m < M; m++) {
                        const float *tm = tab + m * K * P;
                        v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
                        for (int64_t i = 0; i < nv; i++) {
                            v8f tv;
                            if (abits == 1) {
                                tv = select_bit(cv[i], 0, loadv(tm + 8 * i), loadv(tm + P + 8 * i));
                            } else if (abits == 2) {
                                const v8f lo = select_bit(cv[i], 0, loadv(tm + 8 * i),
                                                          loadv(tm + P + 8 * i));
                                const v8f hi = select_bit(cv[i], 0, loadv(tm + 2 * P + 8 * i),
                                                          loadv(tm + 3 * P + 8 * i));
                                tv = select_bit(cv[i], 1, lo, hi);
                            } else {
                                const v8u j = {0, 1, 2, 3, 4, 5, 6, 7};
                                const v8u idx = cv[i] * (uint32_t)P + j + (uint32_t)(8 * i);
#if defined(__AVX2__)
                                tv = (v8f)_mm256_i32gather_ps(tm, (__m256i)idx, 4);
#else
                                for (int l = 0; l < 8; l++) tv[l] = tm[idx[l]];
#endif
                            }
                            acc += rv[i] * tv;
                        }
                        o[m * T + t] = hsum1(acc);
                    }
                    continue;
                }
                for (int64_t j = 0; j < P; j++) {
                    r[j] = (float)code_at(rr, j, rbits, rmask) * ar[j] + br[j];
                    ca[j] = (int32_t)code_at(ra, j, abits, amask);
                }
                for (int64_t m = 0; m < M; m++) {
                    const float *tm = tab + m * K * P;
                    float acc = 0.f;
                    for (int64_t j = 0; j < P; j++) acc += r[j] * tm[ca[j] * P + j];
                    o[m * T + t] = acc;
                }
            }
        }
    return 0;
}

#define SPECIALISE_POLAR(R, A) \
    case R * 16 + A: return polar_impl(a, R, A);

int kv_keys_polar(const kv_polar_args *a, int rbits, int abits) {
    const int64_t P = a->P, M = a->M, T = a->T;
    if (rbits < 1 || rbits > 8 || abits < 1 || abits > 8 || P > MAXD / 2 || M < 1 || a->L < 1)
        return -1;
    if ((T + a->L - 1) / a->L > a->NP) return -1;
    switch (rbits * 16 + abits) { /* the widths of the vectorised loop as constants */
        SPECIALISE_POLAR(2, 2) SPECIALISE_POLAR(2, 3) SPECIALISE_POLAR(2, 4)
        SPECIALISE_POLAR(3, 2) SPECIALISE_POLAR(3, 3) SPECIALISE_POLAR(3, 4)
        SPECIALISE_POLAR(4, 2) SPECIALISE_POLAR(4, 3) SPECIALISE_POLAR(4, 4)
        SPECIALISE_POLAR(1, 1) SPECIALISE_POLAR(1, 2) SPECIALISE_POLAR(2, 1)
    default: {
        kv_polar_args s = *a; /* other widths: the scalar loop */
        s.scalar = 1;
        return polar_impl(&s, rbits, abits);
    }
    }
}
#endif /* KV_IN(KV_UNIT_TABLES) */

/* ================================================ fused decode attention (one call a layer)
 * kv_attend_fused: the whole attention of a layer's decode step over a cache read as up to
 * FUSED_MAX_SEGS segments in token order (sinks, the quantized blocks, the residual; keys and
 * values each split at their own tokens, the segments at the union of both), for every
 * (batch row, KV head) and its M query rows (GQA: the rows of one KV head share every loaded
 * token):
 *   out[b, h, m, :] = sum_t softmax_t(q[b, h, m] . k_t) v_t      over t < lim(b, m)
 * with lim(b, m) = len_b - nq + (m % nq) + 1 (len_b = lengths[b], else T; the causal mask of
 * nq queries aligned to the row's end, kvbench.attention.reference.length_mask).
 * Each side (keys, values) of a segment is one of (kind, pack_bits's LSB-first codes c):
 *   FZ_F32:  float32 rows;
 *   FZ_SYM:  symmetric block codes of 4 or 8 bits, one float16 scale d per token per group of
 *            cg channels (llama.cpp q4_0 / q8_0 as stored by methods/int_block.py):
 *            x = (c - 2^(bits-1)) * d;
 *   FZ_TOK:  affine codes of 2 or 4 bits, scale s and zero z per token per group of cg
 *            channels (KIVI's per-token values): x = c * s + z;
 *   FZ_CHAN: affine codes of 2 or 4 bits, s and z per channel per row of G tokens, token t of
 *            the segment in row (phase + t) / G (KIVI's per-channel keys): x = c * s + z;
 * scales and zeros float16, float32 or bfloat16 (sdt).  Every x is the dequantized value
 * exactly as kvbench.cache.quant.dequantize_groups computes it in float32 (a product, then a
 * sum: this file is compiled without FMA contraction, -std=c11).
 * One pass over the tokens in tiles of FUSED_TT: the keys of a tile are decoded in registers
 * and dotted with FUSED_MR query rows at a time (logits of the tile: one vector per row), an
 * online softmax (running max and sum, Milakov & Gimelshein arXiv 1805.02867; FlashAttention)
 * rescales the accumulators, then the tile's values are decoded once and accumulated into the
 * rows' outputs.  Sums in float32; exp by a Cody-Waite reduction and a degree-6 polynomial
 * (Cephes expf, within 2 ulp); logits below -87.3 under the max give exactly 0.
 * Vector code in GCC/Clang vector extensions (16 floats), compiled three times: AVX-512,
 * AVX2+FMA (target attributes added to the build's flags) and the build's own target; the
 * widest the CPU supports runs (__builtin_cpu_supports), or the one `isa` asks for. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vectors of inlined helpers, any target */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

#define FUSED_MAX_SEGS 6
#define FUSED_MR 4  /* query rows per pass over the tokens */
#define FUSED_TT 16 /* tokens per tile: one vector of logits */
#define FZ_F32 0    /* side kinds (kv_fused_side.kind) */
#define FZ_SYM 1
#define FZ_TOK 2
#define FZ_CHAN 3
/* a side's (kind, bits) as one constant: the compile-time parameter of the decode */
#define FZ_CODE(KIND, BITS) ((KIND) * 16 + (BITS))
#define FZ_KIND(C) ((C) >> 4)
#define FZ_BITS(C) ((C) & 15)
/* whether a side of code C has terms per token (its scale row is the token) */
#define FZ_TOKEN_TERMS(C) (FZ_KIND(C) == FZ_SYM || FZ_KIND(C) == FZ_TOK)

typedef struct {
    int kind, bits;              /* FZ_*; code width (0 for FZ_F32) */
    int sdt;                     /* scale / zero dtype: 0 float16, 1 float32, 2 bfloat16 */
    const uint8_t *x;            /* token t of (b, h): x + b*xs[0] + h*xs[1] + t*xs[2] (bytes) */
    int64_t xs[3];
    const uint8_t *s, *z;        /* scale / zero (z: affine kinds) of (b, h, row r, group g):
                                  * s + b*ss[0] + h*ss[1] + r*ss[2] + g*(element size) (bytes);
                                  * row r: the token (FZ_SYM, FZ_TOK), (phase + t) / G (FZ_CHAN);
                                  * group g: of cg channels (FZ_SYM, FZ_TOK), the channel
                                  * (FZ_CHAN) */
    int64_t ss[3], zs[3];
    int64_t cg;                  /* FZ_SYM, FZ_TOK: channels per group (16k dividing D) */
    int64_t G, phase;            /* FZ_CHAN: tokens per row; tokens of the first row before
                                  * the segment's first token */
} kv_fused_side;

typedef struct {
    int64_t n;                   /* tokens of the segment */
    kv_fused_side k, v;
} kv_fused_seg;

typedef struct {
    int64_t B, H, M, D, nq;      /* D: 32, 64 or 128; M = (H_q / H_kv) * nq rows per KV head */
    const float *q;              /* [B, H, M, D] contiguous, the logit scale applied */
    const int64_t *lengths;      /* [B] valid tokens of each row, or NULL (all) */
    int64_t nseg;
    kv_fused_seg seg[FUSED_MAX_SEGS];
    float *out;                  /* [B, H, M, D] contiguous */
} kv_fused_args;

static inline __attribute__((always_inline)) v16f fz_bits(v16i x) { return (v16f)x; }

/* lanes of a where mask (all ones), else b */
static inline __attribute__((always_inline)) v16f fz_select(v16i mask, v16f a, v16f b) {
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}

/* exp(x) lane by lane (x <= 0 here; NaN stays NaN; below -87.3: 0) */
static inline __attribute__((always_inline)) v16f fz_exp(v16f x) {
    const v16i tiny = (v16i)(x < -87.3f);
    const v16f xc = fz_select(tiny, (v16f){0} - 87.3f, x);
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const v16f t = xc * 1.44269504088896341f + magic;
    const v16f n = t - magic;
    const v16i ni = (v16i)t - (v16i)((v16f){0} + magic);
    v16f r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const v16f e = p * fz_bits((ni + 127) << 23);
    return fz_select(tiny, (v16f){0}, e);
}

static inline __attribute__((always_inline)) float fz_exp1(float x) {
    return fz_exp((v16f){0} + x)[0];
}

/* lane j = the sum of the 16 lanes of v[j] (a transpose-add of 16 vectors) */
static inline __attribute__((always_inline)) v16f fz_hsum16(v16f *v) {
    const v16i l0 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const v16i h0 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    const v16i l1 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const v16i h1 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const v16i l2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const v16i h2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const v16i l3 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i h3 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    v16f r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++)
        r1[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], l0) +
                __builtin_shuffle(v[2 * i], v[2 * i + 1], h0);
    for (int i = 0; i < 4; i++)
        r2[i] = __builtin_shuffle(r1[2 * i], r1[2 * i + 1], l1) +
                __builtin_shuffle(r1[2 * i], r1[2 * i + 1], h1);
    for (int i = 0; i < 2; i++)
        r3[i] = __builtin_shuffle(r2[2 * i], r2[2 * i + 1], l2) +
                __builtin_shuffle(r2[2 * i], r2[2 * i + 1], h2);
    return __builtin_shuffle(r3[0], r3[1], l3) + __builtin_shuffle(r3[0], r3[1], h3);
}

/* lanes i and i ^ k of x swapped, for k = 8, 4, 2, 1 */
static inline __attribute__((always_inline)) v16f fz_swap(v16f x, int k) {
    const v16i s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const v16i s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const v16i s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const v16i s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    return __builtin_shuffle(x, k == 8 ? s8 : k == 4 ? s4 : k == 2 ? s2 : s1);
}

/* the largest lane (a NaN lane may be skipped: its exp is NaN and the row's sum with it) */
static inline __attribute__((always_inline)) float fz_hmax(v16f x) {
    for (int k = 8; k >= 1; k /= 2) {
        const v16f y = fz_swap(x, k);
        x = fz_select((v16i)(x > y), x, y);
    }
    return x[0];
}

static inline __attribute__((always_inline)) float fz_hadd(v16f x) {
    for (int k = 8; k >= 1; k /= 2) x += fz_swap(x, k);
    return x[0];
}

static inline __attribute__((always_inline)) float fz_half(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* element i of a scale / zero array of dtype sdt (0 float16, 1 float32, 2 bfloat16) */
static inline __attribute__((always_inline)) float fz_term(const uint8_t *p, int64_t i,
                                                           int sdt) {
    if (sdt == 0) return fz_half(p + 2 * i);
    uint32_t w = 0;
    if (sdt == 1) memcpy(&w, p + 4 * i, 4);
    else {
        uint16_t u;
        memcpy(&u, p + 2 * i, 2);
        w = (uint32_t)u << 16;
    }
    float f;
    memcpy(&f, &w, 4);
    return f;
}

/* the D = 16 DV terms of a per-channel row as vectors */
static inline __attribute__((always_inline)) void fz_row_terms(v16f *o, const uint8_t *p,
                                                               int sdt, const int DV) {
    float f[16 * 8];
    for (int i = 0; i < 16 * DV; i++) f[i] = fz_term(p, i, sdt);
    memcpy(o, f, 64 * (size_t)DV);
}

/* the unsigned codes of channels 16 v .. 16 v + 15 of a token row of `bits`-bit codes (each
 * 32-bit word of codes in the lanes of its codes, shifted apart; lanes set from scalars: a
 * shuffle of a narrower vector goes through the stack) */
static inline __attribute__((always_inline)) v16i fz_codes(const uint8_t *row, int v,
                                                           const int bits) {
    if (bits == 2) {
        uint32_t w;
        memcpy(&w, row + 4 * v, 4);
        const v16u x = {w, w, w, w, w, w, w, w, w, w, w, w, w, w, w, w};
        const v16u sh = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
        return (v16i)((x >> sh) & 3u);
    }
    if (bits == 4) {
        uint32_t w[2];
        memcpy(w, row + 8 * v, 8);
        const v16u x = {w[0], w[0], w[0], w[0], w[0], w[0], w[0], w[0],
                        w[1], w[1], w[1], w[1], w[1], w[1], w[1], w[1]};
        const v16u sh = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
        return (v16i)((x >> sh) & 15u);
    }
    uint32_t w[4];
    memcpy(w, row + 16 * v, 16);
    const v16u x = {w[0], w[0], w[0], w[0], w[1], w[1], w[1], w[1],
                    w[2], w[2], w[2], w[2], w[3], w[3], w[3], w[3]};
    const v16u sh = {0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24};
    return (v16i)((x >> sh) & 255u);
}

/* the D / 16 vectors of token row `row` of a side of code C (FZ_CODE): float32 rows; codes
 * with the token's scales `sc` / zeros `zr` (FZ_SYM, FZ_TOK: one per cg channels, dtype sdt;
 * FZ_SYM: float16); FZ_CHAN: the row's terms as vectors `cs` / `cz` */
static inline __attribute__((always_inline)) void fz_decode(v16f *x, const uint8_t *row,
                                                            const uint8_t *sc,
                                                            const uint8_t *zr, int sdt,
                                                            const v16f *cs, const v16f *cz,
                                                            const int C, const int DV,
                                                            int64_t cg) {
    const int kind = FZ_KIND(C), bits = FZ_BITS(C);
    if (kind == FZ_F32) {
        for (int v = 0; v < DV; v++) memcpy(&x[v], row + 64 * v, 64);
        return;
    }
    if (kind == FZ_CHAN) {
        for (int v = 0; v < DV; v++)
            x[v] = __builtin_convertvector(fz_codes(row, v, bits), v16f) * cs[v] + cz[v];
        return;
    }
    const int64_t vpg = cg / 16; /* vectors per scale group */
    for (int v = 0; v < DV; v++) {
        const v16i c = fz_codes(row, v, bits);
        if (kind == FZ_SYM) {
            const float d = fz_half(sc + 2 * (v / vpg));
            x[v] = __builtin_convertvector(c - (1 << (bits - 1)), v16f) * d;
        } else {
            const float s = fz_term(sc, v / vpg, sdt), z = fz_term(zr, v / vpg, sdt);
            x[v] = __builtin_convertvector(c, v16f) * s + z;
        }
    }
}

typedef struct {
    float mx[FUSED_MR], l[FUSED_MR];
    v16f acc[FUSED_MR][8];
} fz_state;

/* the bytes of side `sd` at (b, h): codes / rows, scales, zeros */
typedef struct {
    const uint8_t *x, *s, *z;
} fz_base;

static inline __attribute__((always_inline)) fz_base fz_at(const kv_fused_side *sd, int64_t b,
                                                          int64_t h) {
    fz_base o = {sd->x + b * sd->xs[0] + h * sd->xs[1], NULL, NULL};
    if (sd->kind != FZ_F32) o.s = sd->s + b * sd->ss[0] + h * sd->ss[1];
    if (sd->kind == FZ_TOK || sd->kind == FZ_CHAN) o.z = sd->z + b * sd->zs[0] + h * sd->zs[1];
    return o;
}

/* one segment (tokens t0 + [0, n) of the cache) for rows [0, mr) of a pass; KC, VC: the
 * sides' codes (FZ_CODE) */
static inline __attribute__((always_inline)) void fz_segment(
    fz_state *st, const kv_fused_seg *s, int64_t b, int64_t h, const v16f (*q)[8],
    const int64_t *lim, int mr, int64_t t0, const int KC, const int VC, const int DV) {
    const kv_fused_side *ks = &s->k, *vs = &s->v;
    const fz_base kb = fz_at(ks, b, h), vb = fz_at(vs, b, h);
    int64_t end = 0; /* tokens any row sees */
    for (int m = 0; m < mr; m++) end = lim[m] > end ? lim[m] : end;
    end = end - t0 < s->n ? end - t0 : s->n;
    float mx[FUSED_MR], l[FUSED_MR];
    v16f acc[FUSED_MR][8];
    for (int m = 0; m < FUSED_MR; m++) {
        mx[m] = st->mx[m];
        l[m] = st->l[m];
        for (int v = 0; v < DV; v++) acc[m][v] = st->acc[m][v];
    }
    v16f kcs[8], kcz[8]; /* FZ_CHAN keys: the terms of the row being read */
    int64_t left = 0;    /* tokens of that row still to read */
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t j0 = 0; j0 < end; j0 += FUSED_TT) {
        const int cnt = end - j0 < FUSED_TT ? (int)(end - j0) : FUSED_TT;
        v16f part[FUSED_MR][FUSED_TT];
        for (int j = 0; j < cnt; j++) {
            const int64_t t = j0 + j;
            if (FZ_KIND(KC) == FZ_CHAN) {
                if (left == 0) {
                    const int64_t p = ks->phase + t, r = p / ks->G;
                    left = ks->G - p % ks->G;
                    fz_row_terms(kcs, kb.s + r * ks->ss[2], ks->sdt, DV);
                    fz_row_terms(kcz, kb.z + r * ks->zs[2], ks->sdt, DV);
                }
                left--;
            }
            v16f x[8];
            const uint8_t *sc = FZ_TOKEN_TERMS(KC) ? kb.s + t * ks->ss[2] : NULL;
            const uint8_t *zr = FZ_KIND(KC) == FZ_TOK ? kb.z + t * ks->zs[2] : NULL;
            fz_decode(x, kb.x + t * ks->xs[2], sc, zr, ks->sdt, kcs, kcz, KC, DV, ks->cg);
            for (int m = 0; m < FUSED_MR; m++) {
                if (m >= mr) break;
                v16f sum = q[m][0] * x[0];
                for (int v = 1; v < DV; v++) sum += q[m][v] * x[v];
                part[m][j] = sum;
            }
        }
        for (int m = 0; m < FUSED_MR; m++) {
            if (m >= mr) break;
            for (int j = cnt; j < FUSED_TT; j++) part[m][j] = (v16f){0};
        }
        float pb[FUSED_MR][FUSED_TT];
        for (int m = 0; m < FUSED_MR; m++) {
            if (m >= mr) break;
            const int64_t vis = lim[m] - t0 - j0; /* lanes below it are visible */
            const int vn = vis < cnt ? (vis < 0 ? 0 : (int)vis) : cnt;
            const v16i ok = (v16i)(lane < vn);
            const v16f sc = fz_select(ok, fz_hsum16(part[m]), (v16f){0} - __builtin_inff());
            if (vn == 0) {
                memset(pb[m], 0, sizeof pb[m]);
                continue;
            }
            const float tmax = fz_hmax(sc);
            const float mnew = tmax > mx[m] ? tmax : mx[m];
            const float corr = mx[m] == -__builtin_inff() ? 0.f : fz_exp1(mx[m] - mnew);
            const v16f p = fz_exp(sc - mnew);
            l[m] = l[m] * corr + fz_hadd(p);
            for (int v = 0; v < DV; v++) acc[m][v] *= corr;
            mx[m] = mnew;
            memcpy(pb[m], &p, sizeof pb[m]);
        }
        for (int j = 0; j < cnt; j++) {
            const int64_t t = j0 + j;
            v16f x[8];
            const uint8_t *sc = FZ_TOKEN_TERMS(VC) ? vb.s + t * vs->ss[2] : NULL;
            const uint8_t *zr = FZ_KIND(VC) == FZ_TOK ? vb.z + t * vs->zs[2] : NULL;
            fz_decode(x, vb.x + t * vs->xs[2], sc, zr, vs->sdt, NULL, NULL, VC, DV, vs->cg);
            for (int m = 0; m < FUSED_MR; m++) {
                if (m >= mr) break;
                const float p = pb[m][j];
                for (int v = 0; v < DV; v++) acc[m][v] += p * x[v];
            }
        }
    }
    for (int m = 0; m < FUSED_MR; m++) {
        st->mx[m] = mx[m];
        st->l[m] = l[m];
        for (int v = 0; v < DV; v++) st->acc[m][v] = acc[m][v];
    }
}

/* the (key, value) side codes kv_attend_fused reads, as X(key code, value code): float32 rows;
 * q4_0 / q8_0 blocks (int4-block, int8-block); KIVI's per-channel keys with float32 values
 * (values kept in full precision, or the value residual beside a key block) or per-token
 * values, and float32 keys (the key residual) with per-token values */
#define FZ_PAIRS(X)                                                                            \
    X(FZ_CODE(FZ_F32, 0), FZ_CODE(FZ_F32, 0))                                                  \
    X(FZ_CODE(FZ_SYM, 4), FZ_CODE(FZ_SYM, 4))                                                  \
    X(FZ_CODE(FZ_SYM, 4), FZ_CODE(FZ_SYM, 8))                                                  \
    X(FZ_CODE(FZ_SYM, 8), FZ_CODE(FZ_SYM, 4))                                                  \
    X(FZ_CODE(FZ_SYM, 8), FZ_CODE(FZ_SYM, 8))                                                  \
    X(FZ_CODE(FZ_CHAN, 2), FZ_CODE(FZ_F32, 0))                                                 \
    X(FZ_CODE(FZ_CHAN, 4), FZ_CODE(FZ_F32, 0))                                                 \
    X(FZ_CODE(FZ_CHAN, 2), FZ_CODE(FZ_TOK, 2))                                                 \
    X(FZ_CODE(FZ_CHAN, 2), FZ_CODE(FZ_TOK, 4))                                                 \
    X(FZ_CODE(FZ_CHAN, 4), FZ_CODE(FZ_TOK, 2))                                                 \
    X(FZ_CODE(FZ_CHAN, 4), FZ_CODE(FZ_TOK, 4))                                                 \
    X(FZ_CODE(FZ_F32, 0), FZ_CODE(FZ_TOK, 2))                                                  \
    X(FZ_CODE(FZ_F32, 0), FZ_CODE(FZ_TOK, 4))

#define FZ_PAIR_KEY(KC, VC) ((KC) * 256 + (VC))
#define FZ_SEG(KC, VC, DV) fz_segment(&st, s, b, h, q, lim, mr, t0, KC, VC, DV)
#define FZ_CASE(KC, VC)                                                                        \
    case FZ_PAIR_KEY(KC, VC):                                                                  \
        if (dv == 2) FZ_SEG(KC, VC, 2);                                                        \
        else if (dv == 4) FZ_SEG(KC, VC, 4);                                                   \
        else FZ_SEG(KC, VC, 8);                                                                \
        break;
#define FZ_LISTED(KC, VC) case FZ_PAIR_KEY(KC, VC):

static inline int fz_side_code(const kv_fused_side *sd) { return FZ_CODE(sd->kind, sd->bits); }

static inline __attribute__((always_inline)) void fused_impl(const kv_fused_args *a) {
    const int dv = (int)(a->D / 16);
    int64_t T = 0;
    for (int64_t i = 0; i < a->nseg; i++) T += a->seg[i].n;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t len = a->lengths ? a->lengths[b] : T;
        for (int64_t h = 0; h < a->H; h++) {
            for (int64_t m0 = 0; m0 < a->M; m0 += FUSED_MR) {
                const int mr = a->M - m0 < FUSED_MR ? (int)(a->M - m0) : FUSED_MR;
                v16f q[FUSED_MR][8];
                int64_t lim[FUSED_MR];
                fz_state st;
                for (int m = 0; m < FUSED_MR; m++) {
                    const float *qr = a->q + ((b * a->H + h) * a->M + m0 + (m < mr ? m : 0)) * a->D;
                    for (int v = 0; v < dv; v++) memcpy(&q[m][v], qr + 16 * v, 64);
                    lim[m] = len - a->nq + (m0 + m) % a->nq + 1;
                    st.mx[m] = -__builtin_inff();
                    st.l[m] = 0.f;
                    for (int v = 0; v < 8; v++) st.acc[m][v] = (v16f){0};
                }
                int64_t t0 = 0;
                for (int64_t i = 0; i < a->nseg; i++) {
                    const kv_fused_seg *s = &a->seg[i];
                    switch (FZ_PAIR_KEY(fz_side_code(&s->k), fz_side_code(&s->v))) {
                        FZ_PAIRS(FZ_CASE)
                    default: break; /* not reached: kv_attend_fused checked the pairs */
                    }
                    t0 += s->n;
                }
                for (int m = 0; m < mr; m++) {
                    float *o = a->out + ((b * a->H + h) * a->M + m0 + m) * a->D;
                    const v16f inv = (v16f){0} + 1.0f / st.l[m];
                    for (int v = 0; v < dv; v++) {
                        const v16f r = st.acc[m][v] * inv;
                        memcpy(o + 16 * v, &r, 64);
                    }
                }
            }
        }
    }
}

/* the per-instruction-set copies: each in its own unit (KV_UNIT_FUSED_*), called by
 * kv_attend_fused in KV_UNIT_FUSED (hidden: not exported) */
#define FZ_AVX512 target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#define FZ_AVX2 target("avx2,fma,f16c,bmi2")
__attribute__((FZ_AVX512)) KV_HIDDEN void fused_avx512(const kv_fused_args *a);
__attribute__((FZ_AVX2)) KV_HIDDEN void fused_avx2(const kv_fused_args *a);

#if KV_IN(KV_UNIT_FUSED_AVX512)
__attribute__((FZ_AVX512)) KV_HIDDEN void fused_avx512(const kv_fused_args *a) { fused_impl(a); }
#endif

#if KV_IN(KV_UNIT_FUSED_AVX2)
__attribute__((FZ_AVX2)) KV_HIDDEN void fused_avx2(const kv_fused_args *a) { fused_impl(a); }
#endif

#if KV_IN(KV_UNIT_FUSED)
static void fused_base(const kv_fused_args *a) { fused_impl(a); }
#endif

#pragma GCC diagnostic pop

#if KV_IN(KV_UNIT_FUSED)
/* the instruction set kv_attend_fused uses for `isa` (0: the widest the CPU has; 1: the
 * build's own target; 2: AVX2; 3: AVX-512), or -1 when the CPU lacks the one asked for */
int kv_fused_isa(int isa) {
    __builtin_cpu_init();
    const int has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const int has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
    if (isa == 0) return has512 ? 3 : has2 ? 2 : 1;
    if (isa == 3) return has512 ? 3 : -1;
    if (isa == 2) return has2 ? 2 : -1;
    return isa == 1 ? 1 : -1;
}

/* whether kv_attend_fused takes the (key, value) pair of side codes (FZ_PAIRS) */
int kv_fused_pair(int kcode, int vcode) {
    switch (FZ_PAIR_KEY(kcode, vcode)) {
        FZ_PAIRS(FZ_LISTED)
        return 1;
    default: return 0;
    }
}

/* whether side `sd` fits head_dim D (group widths, scale dtype, rows of G tokens) */
static int fz_side_ok(const kv_fused_side *sd, int64_t D) {
    if (sd->kind == FZ_SYM && sd->sdt != 0) return 0;
    if (sd->kind != FZ_F32 && (sd->sdt < 0 || sd->sdt > 2)) return 0;
    if (sd->kind == FZ_SYM || sd->kind == FZ_TOK)
        return sd->cg >= 16 && sd->cg % 16 == 0 && D % sd->cg == 0;
    if (sd->kind == FZ_CHAN) return sd->G >= 1 && sd->phase >= 0;
    return 1;
}

/* Returns 0, -1 for shapes it does not take (D not 32/64/128, groups not whole vectors, side
 * pairs not in FZ_PAIRS, segment count), -2 for an instruction set the CPU lacks */
int kv_attend_fused(const kv_fused_args *a, int isa) {
    if (!(a->D == 32 || a->D == 64 || a->D == 128) || a->nseg < 1 || a->nseg > FUSED_MAX_SEGS ||
        a->nq < 1 || a->M < 1)
        return -1;
    for (int64_t i = 0; i < a->nseg; i++) {
        const kv_fused_seg *s = &a->seg[i];
        if (s->n < 0 || !kv_fused_pair(fz_side_code(&s->k), fz_side_code(&s->v)) ||
            !fz_side_ok(&s->k, a->D) || !fz_side_ok(&s->v, a->D))
            return -1;
    }
    switch (kv_fused_isa(isa)) {
    case 3: fused_avx512(a); return 0;
    case 2: fused_avx2(a); return 0;
    case 1: fused_base(a); return 0;
    default: return -2;
    }
}
#endif /* KV_IN(KV_UNIT_FUSED) */

#if KV_IN(KV_UNIT_KEYS)
int kv_abi_version(void) { return 12; }
#endif
