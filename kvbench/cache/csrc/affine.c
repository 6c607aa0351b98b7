/*
 * One-pass min-max affine quantization of float16 / bfloat16 / float32 K/V on the CPU.
 *
 * Loaded by kvbench/cache/native_quant.py (ctypes).  Same numbers as the torch reference
 * (kvbench.cache.quant.quantize_groups followed by pack_bits), read straight from the input dtype
 * with no float32 or int32 copy of the tensor:
 *
 *   kq_minmax: per group (a rectangle of Lt consecutive tokens x Lc consecutive channels of
 *              one (batch row, KV head)) the exact minimum and maximum, as float32.  It also
 *              reports whether any element it read is not finite (the caller then uses the
 *              torch path, whose NaN/Inf policy this file does not implement).
 *   kq_codes:  with the stored scale s and zero z of every group (float32 values of the
 *              scale_dtype numbers, computed by the caller with the torch reference's own
 *              helpers), each element's code, IEEE float32 like torch's eager kernels:
 *                asymmetric: q = rint((x - z) / s), clamp to [0, 2^b - 1]
 *                symmetric:  q = rint(x / s),       clamp to [-(2^(b-1) - 1), 2^(b-1) - 1],
 *                            plus 2^(b-1) (offset binary)
 *                1-bit midpoint (PN-Mix Eq. 7): q = (x - z >= 0.5 s)
 *              (s <= 0: code 0 before the clamp), rint rounding half to even (the default
 *              rounding mode, as torch.round), then packed per token row LSB first (code i at
 *              bits i*b .. i*b + b - 1 of the row's byte stream, zero padding to nbytes), or
 *              one code per byte (packed = 0; a mixed-precision codec packs its classes).
 *
 * Build flags keep IEEE results: no -ffast-math, -ffp-contract=off (no fused multiply-add);
 * -fno-trapping-math only lets rint and the clamps vectorize (no value changes).
 * Rows are (b, h) pairs, processed in [r0, r1) so the caller can split them across threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KQ_ABI_VERSION 4

enum { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2 };

typedef struct {
    const void *x; /* input base pointer */
    int dtype;     /* DT_* */
    int64_t B, H, T, D;
    int64_t sb, sh, st; /* element strides of batch, head, token; channels contiguous */
    int64_t Lt, Lc;     /* group rectangle: tokens x channels (T % Lt == 0, D % Lc == 0) */
    int64_t r0, r1;     /* rows (b * H + h) to process */
} kq_in;

int kq_abi_version(void) { return KQ_ABI_VERSION; }

#if defined(__FLT16_MAX__) && !defined(KQ_NO_FLOAT16)
#define KQ_FLOAT16 1 /* the compiler's _Float16 conversion */
#else
/* float16 bits -> float32 without compiler support for _Float16 (exact) */
static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0x1f) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        bits = sign | ((e + 112) << 23) | (m << 13);
    } else if (m) { /* subnormal: normalize */
        e = 113;
        while (!(m & 0x400)) {
            m <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((m & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* one token row of D channels as float32 (exact for every input dtype) */
static void load_row(const kq_in *a, int64_t off, float *restrict out) {
    const int64_t D = a->D;
    if (a->dtype == DT_F32) {
        memcpy(out, (const float *)a->x + off, (size_t)D * 4);
    } else if (a->dtype == DT_BF16) {
        const uint16_t *p = (const uint16_t *)a->x + off;
        for (int64_t c = 0; c < D; c++) {
            uint32_t u = (uint32_t)p[c] << 16;
            memcpy(out + c, &u, 4);
        }
    } else {
#if defined(KQ_FLOAT16)
        const _Float16 *p = (const _Float16 *)a->x + off;
        for (int64_t c = 0; c < D; c++) out[c] = (float)p[c];
#else
        const uint16_t *p = (const uint16_t *)a->x + off;
        for (int64_t c = 0; c < D; c++) out[c] = f16_to_f32(p[c]);
#endif
    }
}

/* mn, mx: float32 [B * H, T / Lt, D / Lc] contiguous.  Returns 1 when an element read is not
 * finite (mn, mx then unspecified), -1 when out of memory, else 0. */
int kq_minmax(const kq_in *a, float *mn, float *mx) {
    const int64_t D = a->D, NT = a->T / a->Lt, NC = D / a->Lc;
    float *row = malloc((size_t)D * 4), *cmn = malloc((size_t)D * 4);
    float *cmx = malloc((size_t)D * 4), *chk = malloc((size_t)D * 4);
    int bad = 0;
    if (!row || !cmn || !cmx || !chk) {
        bad = -1;
        goto done;
    }
    for (int64_t r = a->r0; r < a->r1 && !bad; r++) {
        const int64_t base = (r / a->H) * a->sb + (r % a->H) * a->sh;
        for (int64_t p = 0; p < NT; p++) {
            for (int64_t c = 0; c < D; c++) {
                cmn[c] = INFINITY;
                cmx[c] = -INFINITY;
                chk[c] = 0.0f;
            }
            for (int64_t t = p * a->Lt; t < (p + 1) * a->Lt; t++) {
                load_row(a, base + t * a->st, row);
                for (int64_t c = 0; c < D; c++) {
                    const float v = row[c];
                    cmn[c] = v < cmn[c] ? v : cmn[c];
                    cmx[c] = v > cmx[c] ? v : cmx[c];
                    chk[c] += v * 0.0f; /* NaN once an Inf or NaN was seen, else +-0 */
                }
            }
            for (int64_t c = 0; c < D; c++) bad |= chk[c] != 0.0f;
            float *omn = mn + (r * NT + p) * NC, *omx = mx + (r * NT + p) * NC;
            for (int64_t g = 0; g < NC; g++) {
                float lo = cmn[g * a->Lc], hi = cmx[g * a->Lc];
                for (int64_t j = 1; j < a->Lc; j++) {
                    const float u = cmn[g * a->Lc + j], w = cmx[g * a->Lc + j];
                    lo = u < lo ? u : lo;
                    hi = w > hi ? w : hi;
                }
                omn[g] = lo;
                omx[g] = hi;
            }
        }
    }
done:
    free(row);
    free(cmn);
    free(cmx);
    free(chk);
    return bad;
}

static void pack_row(const uint8_t *restrict c, int64_t D, int bits, uint8_t *restrict o,
                     int64_t nbytes) {
    int64_t j = 0;
    if (bits == 8) {
        memcpy(o, c, (size_t)D);
        j = D;
    } else if ((bits == 1 || bits == 2 || bits == 4) && D % (8 / bits) == 0) {
        const int per = 8 / bits;
        for (j = 0; j < D / per; j++) {
            unsigned v = 0;
            for (int k = 0; k < per; k++) v |= (unsigned)c[j * per + k] << (k * bits);
            o[j] = (uint8_t)v;
        }
    } else {
        uint64_t acc = 0;
        int n = 0;
        for (int64_t i = 0; i < D; i++) {
            acc |= (uint64_t)c[i] << n;
            n += bits;
            while (n >= 8) {
                o[j++] = (uint8_t)(acc & 0xff);
                acc >>= 8;
                n -= 8;
            }
        }
        if (n > 0) o[j++] = (uint8_t)(acc & 0xff);
    }
    for (; j < nbytes; j++) o[j] = 0;
}

/* s, z: float32 scale and zero of row r's groups at s + (r / H) * ssb + (r % H) * ssh, then
 * [T / Lt, D / Lc] contiguous (ssb = ssh = 0: one set shared by every row); z unused when
 * symmetric.  out: uint8 [B * H, T, nbytes] contiguous (nbytes = D when not packed).
 * Returns -1 when out of memory. */
int kq_codes(const kq_in *a, const float *s, const float *z, int64_t ssb, int64_t ssh, int bits,
             int symmetric, int midpoint, int packed, uint8_t *out, int64_t nbytes) {
    const int64_t D = a->D, NT = a->T / a->Lt, NC = D / a->Lc;
    const float lo = symmetric ? -(float)((1 << (bits - 1)) - 1) : 0.0f;
    const float hi = symmetric ? (float)((1 << (bits - 1)) - 1) : (float)((1 << bits) - 1);
    const float off = symmetric ? (float)(1 << (bits - 1)) : 0.0f;
    float *row = malloc((size_t)D * 4), *zr = malloc((size_t)D * 4);
    float *sr = malloc((size_t)D * 4), *keep = malloc((size_t)D * 4);
    uint8_t *codes = malloc((size_t)D);
    int rc = 0;
    if (!row || !zr || !sr || !keep || !codes) {
        rc = -1;
        goto done;
    }
    for (int64_t r = a->r0; r < a->r1; r++) {
        const int64_t base = (r / a->H) * a->sb + (r % a->H) * a->sh;
        const float *rs = s + (r / a->H) * ssb + (r % a->H) * ssh;
        const float *rz = symmetric ? NULL : z + (r / a->H) * ssb + (r % a->H) * ssh;
        for (int64_t p = 0; p < NT; p++) {
            for (int64_t c = 0; c < D; c++) {
                const float sc = rs[p * NC + c / a->Lc];
                keep[c] = sc > 0.0f ? 1.0f : 0.0f;
                sr[c] = sc > 0.0f ? sc : 1.0f;
                zr[c] = symmetric ? 0.0f : rz[p * NC + c / a->Lc];
            }
            for (int64_t t = p * a->Lt; t < (p + 1) * a->Lt; t++) {
                load_row(a, base + t * a->st, row);
                uint8_t *o = out + (r * a->T + t) * nbytes, *dst = packed ? codes : o;
                if (midpoint) {
                    for (int64_t c = 0; c < D; c++) /* 0.5 s is exact; sr == s where s > 0 */
                        dst[c] = (uint8_t)(keep[c] > 0.0f && row[c] - zr[c] >= 0.5f * sr[c]);
                } else {
                    for (int64_t c = 0; c < D; c++) {
                        /* symmetric: zr is +0, and x - (+0) == x for every x (-0 - +0 == -0) */
                        float q = rintf((row[c] - zr[c]) / sr[c]);
                        q = keep[c] > 0.0f ? q : 0.0f;
                        q = q < lo ? lo : (q > hi ? hi : q);
                        dst[c] = (uint8_t)(int)(q + off);
                    }
                }
                if (packed) pack_row(codes, D, bits, o, nbytes);
            }
        }
    }
done:
    free(row);
    free(zr);
    free(sr);
    free(keep);
    free(codes);
    return rc;
}

#if defined(KQ_FLOAT16)
/* want (>= 0) cast to float16 rounding *up*: the nearest float16, or the next one up when the
 * nearest is below; its bits in *bits, its float32 value returned. */
static float f16_round_up(float want, uint16_t *bits) {
    _Float16 sh = (_Float16)want;
    uint16_t sb;
    memcpy(&sb, &sh, 2);
    if ((float)sh < want) {
        sb = (uint16_t)(sb + 1);
        memcpy(&sh, &sb, 2);
    }
    *bits = sb;
    return (float)sh;
}
#endif

/* kq_affine_terms: the stored terms of n asymmetric min-max groups from their float32 min
 * and max, as kvbench.cache.quant.affine_terms computes them (for inputs small enough that its
 * dozen torch operations cost more than the quantization: a decode step's one-token flush):
 *   zero  = the min cast to the scale dtype (float16: round to nearest even),
 *   scale = (max - float(zero)) clamped at 0, / (2^bits - 1) in float32, cast to the scale
 *           dtype rounding *up* (the next float16 when the nearest is below),
 *   s, z  = their float32 values.
 * sdt: 0 float16 (stored as its bits), 2 float32.  Returns 0; 1 when a zero or scale is not
 * finite (an overflow: the caller's torch path raises the reference's error); -1 without
 * float16 support or for another dtype (the caller uses the torch helpers). */
int kq_affine_terms(const float *mn, const float *mx, int64_t n, int bits, int sdt, void *scale,
                    void *zero, float *s, float *z) {
    const float qmax = (float)((1 << bits) - 1);
    int bad = 0;
    if (sdt == DT_F32) {
        float *sc = (float *)scale, *ze = (float *)zero;
        for (int64_t i = 0; i < n; i++) {
            float r = mx[i] - mn[i];
            r = r < 0.f ? 0.f : r;
            ze[i] = z[i] = mn[i];
            sc[i] = s[i] = r / qmax;
            bad |= !isfinite(s[i]);
        }
        return bad;
    }
#if defined(KQ_FLOAT16)
    if (sdt != DT_F16) return -1;
    uint16_t *sc = (uint16_t *)scale, *ze = (uint16_t *)zero;
    for (int64_t i = 0; i < n; i++) {
        const _Float16 zh = (_Float16)mn[i];
        const float zf = (float)zh;
        float r = mx[i] - zf;
        r = r < 0.f ? 0.f : r;
        memcpy(&ze[i], &zh, 2);
        s[i] = f16_round_up(r / qmax, &sc[i]);
        z[i] = zf;
        bad |= !isfinite(zf) || !isfinite(s[i]);
    }
    return bad;
#else
    (void)mn, (void)mx, (void)n, (void)scale, (void)zero, (void)s, (void)z, (void)qmax, (void)bad;
    return -1;
#endif
}

/* kq_symmetric_terms: the stored scale of n absmax groups from their float32 min and max, as
 * kvbench.cache.quant.symmetric_terms computes them (for a decode step's one-token flush, where
 * its torch operations cost more than the quantization):
 *   scale = max(mx, -mn) in magnitude, / (2^(bits-1) - 1) in float32, cast to the scale dtype
 *           rounding *up* (the next float16 when the nearest is below),
 *   s     = its float32 value.
 * sdt: 0 float16 (stored as its bits), 2 float32.  Returns 0; 1 when a scale is not finite (an
 * overflow: the caller's torch path raises the reference's error); -1 without float16 support
 * or for another dtype (the caller uses the torch helper). */
int kq_symmetric_terms(const float *mn, const float *mx, int64_t n, int bits, int sdt, void *scale,
                       float *s) {
    const float qmax = (float)((1 << (bits - 1)) - 1);
    int bad = 0;
    if (sdt == DT_F32) {
        float *sc = (float *)scale;
        for (int64_t i = 0; i < n; i++) {
            const float nm = -mn[i];
            sc[i] = s[i] = fabsf(mx[i] >= nm ? mx[i] : nm) / qmax;
            bad |= !isfinite(s[i]);
        }
        return bad;
    }
#if defined(KQ_FLOAT16)
    if (sdt != DT_F16) return -1;
    uint16_t *sc = (uint16_t *)scale;
    for (int64_t i = 0; i < n; i++) {
        const float nm = -mn[i];
        s[i] = f16_round_up(fabsf(mx[i] >= nm ? mx[i] : nm) / qmax, &sc[i]);
        bad |= !isfinite(s[i]);
    }
    return bad;
#else
    (void)mn, (void)mx, (void)n, (void)scale, (void)s, (void)qmax, (void)bad;
    return -1;
#endif
}

/* kq_q4_0: llama.cpp's q4_0 rule (ggml-quants.c quantize_row_q4_0_ref) on n rows of D
 * contiguous float32 channels in blocks of bs channels, as the torch path of
 * kvbench/methods/int_block.py (LlamaCppQ4Codec) computes it, bit for bit (tested):
 *   m  = the block's element of largest magnitude (the first on ties), d = m / -8,
 *   id = 1 / d (0 when d == 0), q = floor(x * id + 8.5) (the product and the sum rounded
 *        apart, as torch's mul then add_) clamped to [0, 15],
 * codes packed two a byte LSB first (code 2j in the low nibble: pack_bits' order) into
 * codes [n, D / 2], d cast to float16 (round to nearest even) into d16 [n, D / bs] (bits).
 * Returns 0; 1 when the torch path must run instead (an element that is not finite: its NaN
 * policy is not implemented here; a subnormal d, whose reciprocal may overflow); 2 when a d
 * overflows float16 (the caller raises the torch path's error); -1 without float16 support.
 * Outputs are unspecified unless it returns 0. */
int kq_q4_0(const float *x, int64_t n, int64_t D, int64_t bs, uint8_t *codes, uint16_t *d16) {
#if defined(KQ_FLOAT16)
    const int64_t nb = D / bs;
    int over = 0;
    for (int64_t r = 0; r < n; r++) {
        const float *row = x + r * D;
        for (int64_t c = 0; c < D; c++)
            if (!isfinite(row[c])) return 1;
        uint8_t *o = codes + r * (D / 2);
        memset(o, 0, (size_t)(D / 2));
        for (int64_t b = 0; b < nb; b++) {
            const float *v = row + b * bs;
            int64_t at = 0;
            float best = fabsf(v[0]);
            for (int64_t j = 1; j < bs; j++) {
                const float a = fabsf(v[j]);
                if (a > best) best = a, at = j;
            }
            const float d = v[at] / -8.0f;
            if (d != 0.f && fabsf(d) < 1.17549435e-38f) return 1; /* subnormal d */
            const float id = d != 0.f ? 1.0f / d : 0.f;
            for (int64_t j = 0; j < bs; j++) {
                float q = v[j] * id;
                q = q + 8.5f;
                q = floorf(q);
                q = q < 0.f ? 0.f : (q > 15.f ? 15.f : q);
                const int64_t c = b * bs + j;
                o[c >> 1] |= (uint8_t)((uint8_t)q << ((c & 1) * 4));
            }
            const _Float16 dh = (_Float16)d;
            memcpy(&d16[r * nb + b], &dh, 2);
            over |= !isfinite((float)dh);
        }
    }
    return over ? 2 : 0;
#else
    (void)x, (void)n, (void)D, (void)bs, (void)codes, (void)d16;
    return -1;
#endif
}
