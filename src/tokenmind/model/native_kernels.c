/* Decode kernels for AVX2 + FMA CPUs, built by model/native.py: weight-only int4 / int8 (and float32)
 * matmuls for few activation rows, paged decode attention, the small fused ops, and a whole decode step.
 *
 * PyTorch's CPU int4/int8 kernels run at 2.7-3.5 G weights/s on an AVX2-only CPU, well under what memory
 * bandwidth allows for 4-bit weights. These kernels quantize each activation row to int16 per block of 32
 * columns (scale = max|x| / XQ_MAX, so the activations keep ~15 bits against bf16's 8) and sum code x
 * activation products exactly in integers, converting to float once per block: int8 with
 * _mm256_madd_epi16; int4 with _mm256_maddubs_epi16 straight on the 4-bit codes (as unsigned bytes)
 * against the activations' two signed bytes (x = 256 hi + lo), half the instructions of widening
 * the codes to 16 bits.
 *
 * int4 reads PyTorch's own packing (`torch._convert_weight_to_int4pack_for_cpu`, layout in
 * model/quant.py's docstring): rows in blocks of B (32 or 64); block viewed as (K, B/2) bytes, byte
 * [k, j] holds row j in its low and row B/2 + j in its high nibble. Scales and zeros are the
 * (K / group, N, 2) bf16 tensor of that kernel, w = (q - 8) * s + z. So no second copy of the weights.
 * int8 reads the (N, K) int8 weight with one bf16 scale per row.
 *
 * Every output is y[m, n] = sum over 32-column blocks of s * dx * sum((q - 8) * xq) + z * sum(x)
 * (int4) or s[n] * sum(dx * sum(q * xq)) (int8), in a fixed order: a row's result does not depend on
 * how many other rows are in the call, or on the thread count.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* How far ahead of the weight bytes being summed to request memory: a single core's loads alone fetch
 * ~3 GB/s here, with these software prefetches ~10 GB/s (the machine's bandwidth; AMD EPYC, AVX2). */
#define PREFETCH_BYTES 4096

/* The largest quantized activation: x = 256 hi + lo with both bytes signed needs |x| <= 127 * 256 + 127. */
#define XQ_MAX 32639

/* Per row m and 32-column block b: xq = round(x / dx) with dx = max|x| / XQ_MAX, the exact float sum of
 * x, and 8 * sum(xq) (the int4 codes' offset of 8, taken out in integers). split: store each xq as its
 * bytes (lo, hi) with x = 256 hi + lo, both signed (what the int4 kernel multiplies the codes by):
 * x + 256 where lo is negative, i.e. x + ((x & 0x80) << 1). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int split, int16_t *xq, float *dx, float *sx,
                          int32_t *sq8) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * K + b * 32;
            int16_t *qb = xq + m * K + b * 32;
            float amax = 0.0f, sum = 0.0f;
            for (int j = 0; j < 32; j++) {
                float a = fabsf(xb[j]);
                amax = a > amax ? a : amax;
                sum += xb[j];
            }
            const float inv = amax > 0.0f ? (float)XQ_MAX / amax : 0.0f;
            int32_t qsum = 0;
            for (int j = 0; j < 32; j++) {
                long v = lrintf(xb[j] * inv);
                v = v > XQ_MAX ? XQ_MAX : (v < -XQ_MAX ? -XQ_MAX : v);
                qb[j] = (int16_t)(split ? v + ((v & 0x80) << 1) : v);
                qsum += (int32_t)v;
            }
            dx[m * nb + b] = amax / (float)XQ_MAX;
            sx[m * nb + b] = sum;
            sq8[m * nb + b] = 8 * qsum;
        }
    }
}

/* (s, z) bf16 pairs of 8 consecutive rows -> s and z as float vectors (bf16 is the top half of a float). */
static inline void load_scales(const uint16_t *sz, __m256 *s, __m256 *z) {
    __m256i v = _mm256_loadu_si256((const __m256i *)sz);
    *s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* One task's 32 rows (16 in low nibbles, 16 in high) at columns k..k+3 as maddubs operands: P[0], P[1]
 * the low-nibble rows 0-7 and 8-15, P[2], P[3] the high-nibble ones; each 16-bit lane holds one row's
 * codes (at k, at k + 2) in the low 128 bits and (at k + 1, at k + 3) in the high. `p` points at
 * column k's 16 bytes, columns `stride` bytes apart (16 in the 32-row packing: two columns per load). */
static inline __attribute__((always_inline)) void int4_codes4(const uint8_t *p, int64_t stride, __m256i P[4]) {
    __m256i a, c;
    if (stride == 16) {
        a = _mm256_loadu_si256((const __m256i *)p);
        c = _mm256_loadu_si256((const __m256i *)(p + 32));
    } else {
        a = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                    _mm_loadu_si128((const __m128i *)(p + stride)), 1);
        c = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + 2 * stride))),
                                    _mm_loadu_si128((const __m128i *)(p + 3 * stride)), 1);
    }
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i alo = _mm256_and_si256(a, mask), clo = _mm256_and_si256(c, mask);
    const __m256i ahi = _mm256_and_si256(_mm256_srli_epi16(a, 4), mask);
    const __m256i chi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
    P[0] = _mm256_unpacklo_epi8(alo, clo);
    P[1] = _mm256_unpackhi_epi8(alo, clo);
    P[2] = _mm256_unpacklo_epi8(ahi, chi);
    P[3] = _mm256_unpackhi_epi8(ahi, chi);
}

/* Activation columns k..k+3 (split, see quantize_rows) as int4_codes4's partners: the high bytes
 * (x_k, x_k+2 | x_k+1, x_k+3) into h and the low bytes into l, code x byte pairs summed per row. A lane
 * sums at most 16 columns of one block: |sum| <= 16 * 15 * 128 fits in 16 bits. */
static inline __attribute__((always_inline)) void int4_madd4(const __m256i P[4], const int16_t *xs, __m256i h[4],
                                                            __m256i l[4]) {
    int64_t v;
    memcpy(&v, xs, sizeof v);
    const __m256i b = _mm256_set1_epi64x(v);  /* bytes lo_k hi_k lo_k+1 hi_k+1 ... in both halves */
    const __m256i xh = _mm256_shuffle_epi8(b, _mm256_setr_epi8(1, 5, 1, 5, 1, 5, 1, 5, 1, 5, 1, 5, 1, 5, 1, 5,
                                                               3, 7, 3, 7, 3, 7, 3, 7, 3, 7, 3, 7, 3, 7, 3, 7));
    const __m256i xl = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4,
                                                               2, 6, 2, 6, 2, 6, 2, 6, 2, 6, 2, 6, 2, 6, 2, 6));
    for (int i = 0; i < 4; i++) {
        h[i] = _mm256_add_epi16(h[i], _mm256_maddubs_epi16(P[i], xh));
        l[i] = _mm256_add_epi16(l[i], _mm256_maddubs_epi16(P[i], xl));
    }
}

/* Eight rows' int32 sums 256 h + l from int4_madd4's 16-bit halves, the two column sets added. */
static inline __m256i int4_rows8(__m256i h, __m256i l) {
    const __m256i w = _mm256_set1_epi32((256 << 16) | 1);
    const __m256i a = _mm256_madd_epi16(_mm256_unpacklo_epi16(l, h), w);  /* rows 0-3 of each column set */
    const __m256i c = _mm256_madd_epi16(_mm256_unpackhi_epi16(l, h), w);  /* rows 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
}

/* One 32-column block's integer sums acc (per row: sum of code * xq) into the float results f. */
static inline void int4_finish_block(const __m256i acc[4], const uint16_t *sz, int64_t N, int64_t g, int64_t lo_row,
                                     int64_t hi_row, float dx, float sx, int32_t sq8, __m256 f[4]) {
    const __m256i off = _mm256_set1_epi32(sq8);
    const __m256 vdx = _mm256_set1_ps(dx), vsx = _mm256_set1_ps(sx);
    for (int i = 0; i < 4; i++) {
        const int64_t row = (i < 2 ? lo_row : hi_row) + 8 * (i & 1);
        __m256 s, z;
        load_scales(sz + 2 * (g * N + row), &s, &z);
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i], off)), vdx);
        f[i] = _mm256_fmadd_ps(s, t, _mm256_fmadd_ps(z, vsx, f[i]));
    }
}

/* Integer sums (per row: sum of code * xq) of one 32-column block for one activation row, the codes
 * expanded from `p` (stride as in int4_codes4) or, where p is NULL, read from `codes` (8 x 4 vectors). */
static inline __attribute__((always_inline)) void int4_block_sums(const uint8_t *p, int64_t stride,
                                                                  const __m256i codes[8][4], const int16_t *xs,
                                                                  __m256i acc[4]) {
    __m256i h[4], l[4];
    for (int i = 0; i < 4; i++)
        h[i] = l[i] = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        if (p) {
            __m256i P[4];
            int4_codes4(p + 4 * k * stride, stride, P);
            int4_madd4(P, xs + 4 * k, h, l);
        } else {
            int4_madd4(codes[k], xs + 4 * k, h, l);
        }
    }
    for (int i = 0; i < 4; i++)
        acc[i] = int4_rows8(h[i], l[i]);
}

/* Add one block's sums for activation row m into y (the running float results live in y). */
static inline void int4_add_block(const __m256i acc[4], const uint16_t *sz, int64_t N, int64_t g, int64_t lo_row,
                                  int64_t hi_row, const float *dx, const float *sx, const int32_t *sq8, int64_t i_b,
                                  float *yr) {
    __m256 f[4];
    for (int i = 0; i < 4; i++)
        f[i] = _mm256_loadu_ps(yr + (i < 2 ? lo_row : hi_row) + 8 * (i & 1));
    int4_finish_block(acc, sz, N, g, lo_row, hi_row, dx[i_b], sx[i_b], sq8[i_b], f);
    for (int i = 0; i < 4; i++)
        _mm256_storeu_ps(yr + (i < 2 ? lo_row : hi_row) + 8 * (i & 1), f[i]);
}

/* 32 output rows of one int4 block (16 in the low nibbles at `lo_row`, 16 in the high at `hi_row`)
 * for M activation rows. `blk` points at byte [0, 16c] of the block's (K, B/2) view, columns `half`
 * bytes apart. One row expands the codes in registers; more expand each 32-column block once into
 * `codes` and reuse it. */
static inline __attribute__((always_inline)) void int4_rows32(const uint8_t *blk, int64_t half, const uint16_t *sz,
                                                              int64_t N, int64_t K, int64_t group, int64_t M,
                                                              const int16_t *xs, const float *dx, const float *sx,
                                                              const int32_t *sq8, float *y, int64_t lo_row,
                                                              int64_t hi_row) {
    const int64_t nb = K / 32;
    __m256i codes[8][4], acc[4];
    /* The scales of successive groups are N rows apart: strided misses the prefetchers do not see, so
     * all of this task's are requested up front, to arrive while the first blocks are summed. */
    for (int64_t g = 0; g < K / group; g++) {
        _mm_prefetch((const char *)(sz + 2 * (g * N + lo_row)), _MM_HINT_T0);
        _mm_prefetch((const char *)(sz + 2 * (g * N + hi_row)), _MM_HINT_T0);
    }
    for (int64_t m = 0; m < M; m++)
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(y + m * N + (i < 2 ? lo_row : hi_row) + 8 * (i & 1), _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = blk + b * 32 * half;
        const int64_t g = (b * 32) / group;
        for (int64_t j = 0; j < 32 * half; j += 64)  /* a few KB ahead on the weight stream, as in int8_rows4 */
            _mm_prefetch((const char *)(p + PREFETCH_BYTES + j), _MM_HINT_T0);
        if (M == 1) {
            int4_block_sums(p, half, codes, xs + b * 32, acc);
            int4_add_block(acc, sz, N, g, lo_row, hi_row, dx, sx, sq8, b, y);
            continue;
        }
        for (int k = 0; k < 8; k++)
            int4_codes4(p + 4 * k * half, half, codes[k]);
        for (int64_t m = 0; m < M; m++) {
            int4_block_sums(NULL, half, codes, xs + m * K + b * 32, acc);
            int4_add_block(acc, sz, N, g, lo_row, hi_row, dx, sx, sq8, m * nb + b, y + m * N);
        }
    }
}

/* The activations as the kernels read them (see quantize_rows), in one allocation. */
struct qrows {
    int16_t *xq;
    float *dx, *sx;
    int32_t *sq8;
};

/* Allocate and fill `q`; 0, or -1 when out of memory. Free with free(q->xq). */
static int quantize_input(const float *x, int64_t M, int64_t K, int split, struct qrows *q) {
    const size_t n = (size_t)(M * K), nb = (size_t)(M * (K / 32));
    void *mem = NULL;
    if (posix_memalign(&mem, 64, sizeof(int16_t) * n + (2 * sizeof(float) + sizeof(int32_t)) * nb + 64))
        return -1;
    q->xq = mem;
    q->dx = (float *)(q->xq + n);
    q->sx = q->dx + nb;
    q->sq8 = (int32_t *)(q->sx + nb);
    quantize_rows(x, M, K, split, q->xq, q->dx, q->sx, q->sq8);
    return 0;
}

/* y (M, N) = x (M, K) @ W.T for W in PyTorch's int4pack layout with block rows B; N % 32 == 0 and
 * K % 32 == 0 (callers check). Returns 0, or -1 when out of memory. */
int tm_int4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *sz, int64_t N,
                   int64_t B, int64_t group, float *y, int threads) {
    const int64_t half = B / 2, tasks = N / 32;
    struct qrows q;
    if (quantize_input(x, M, K, 1, &q))
        return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t block = t / (half / 16), c = t % (half / 16);
        const uint8_t *blk = packed + block * B * (K / 2) + 16 * c;
        const int64_t lo_row = block * B + 16 * c, hi_row = lo_row + half;
        if (half == 16)  /* the AVX2 packing, two columns per load: a constant stride for the compiler */
            int4_rows32(blk, 16, sz, N, K, group, M, q.xq, q.dx, q.sx, q.sq8, y, lo_row, hi_row);
        else
            int4_rows32(blk, half, sz, N, K, group, M, q.xq, q.dx, q.sx, q.sq8, y, lo_row, hi_row);
    }
    free(q.xq);
    return 0;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One 32-column block of an int8 row against the quantized activations: the int32 dot product. */
static inline __m256i int8_block(const int8_t *w, __m256i x0, __m256i x1) {
    __m256i q = _mm256_loadu_si256((const __m256i *)w);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), x0),
                            _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)), x1));
}

static inline float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } s = {.u = (uint32_t)v << 16};
    return s.f;
}

/* W (N, K) float32 from PyTorch's int4pack layout (blocks of B rows, see the top): w = (q - 8) * s + z
 * with one fused multiply-add, so one rounding, as quant.py's float64 reference (Int4Linear.dequantize)
 * gives bit for bit. A prefill of more rows than the matmul kernel takes multiplies by this; PyTorch's
 * element-wise version took ~0.7 s for SmolLM2's linears on a 2-core AVX2 VM. Tiles of 32 rows x 32
 * columns: the codes are transposed into a row-major byte tile in L1, then converted a row at a time. */
void tm_int4_dequantize(const uint8_t *packed, const uint16_t *sz, int64_t N, int64_t K, int64_t B, int64_t group,
                        float *w, int threads) {
    const int64_t half = B / 2, tasks = (N / B) * (half / 16);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t block = t / (half / 16), c = t % (half / 16);
        const uint8_t *blk = packed + block * B * (K / 2) + 16 * c;
        const int64_t lo_row = block * B + 16 * c, hi_row = lo_row + half;
        uint8_t tile[32][32];
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
            for (int k = 0; k < 32; k++)
                for (int j = 0; j < 16; j++) {
                    const uint8_t byte = blk[(k0 + k) * half + j];
                    tile[j][k] = byte & 15;
                    tile[16 + j][k] = byte >> 4;
                }
            const int64_t g = k0 / group;
            for (int r = 0; r < 32; r++) {
                const int64_t row = (r < 16 ? lo_row : hi_row) + (r & 15);
                const uint16_t *szr = sz + 2 * (g * N + row);
                const __m256 s = _mm256_set1_ps(bf16_to_float(szr[0])), z = _mm256_set1_ps(bf16_to_float(szr[1]));
                float *out = w + row * K + k0;
                for (int i = 0; i < 32; i += 8) {
                    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)&tile[r][i]));
                    const __m256 qf = _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8)));
                    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(qf, s, z));
                }
            }
        }
    }
}

/* Four rows of an int8 weight (or fewer, at the end) against one quantized activation row. */
static void int8_rows4(const int8_t *w, int64_t K, const uint16_t *scales, const int16_t *xq, const float *dx,
                       float *y, int64_t rows) {
    __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    const int8_t *w1 = w + (rows > 1 ? K : 0), *w2 = w + (rows > 2 ? 2 * K : 0), *w3 = w + (rows > 3 ? 3 * K : 0);
    for (int64_t b = 0; b < K / 32; b++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 32 * b + 16));
        const __m256 vdx = _mm256_set1_ps(dx[b]);
        /* the rows of a later task: PREFETCH_BYTES ahead on the weight stream */
        _mm_prefetch((const char *)(w + PREFETCH_BYTES + 4 * K + 128 * b), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH_BYTES + 4 * K + 128 * b + 64), _MM_HINT_T0);
        f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int8_block(w + 32 * b, x0, x1)), vdx, f0);
        f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int8_block(w1 + 32 * b, x0, x1)), vdx, f1);
        f2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int8_block(w2 + 32 * b, x0, x1)), vdx, f2);
        f3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int8_block(w3 + 32 * b, x0, x1)), vdx, f3);
    }
    const float sums[4] = {hsum(f0), hsum(f1), hsum(f2), hsum(f3)};
    for (int64_t r = 0; r < rows; r++)
        y[r] = sums[r] * bf16_to_float(scales[r]);
}

/* y (M, N) = x (M, K) @ (W * s[:, None]).T for an (N, K) int8 W and bf16 scales s; K % 32 == 0. */
int tm_int8_matmul(const float *x, int64_t M, int64_t K, const int8_t *w, const uint16_t *scales, int64_t N,
                   float *y, int threads) {
    const int64_t nb = K / 32, tasks = (N + 3) / 4;
    struct qrows q;
    if (quantize_input(x, M, K, 0, &q))
        return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n = 4 * t, rows = N - n < 4 ? N - n : 4;
        for (int64_t m = 0; m < M; m++)
            int8_rows4(w + n * K, K, scales + n, q.xq + m * K, q.dx + m * nb, y + m * N + n, rows);
    }
    free(q.xq);
    return 0;
}

/* y = x / sqrt(mean(x^2) + eps) * w over each of M rows of D floats (D % 8 == 0): RMSNorm in one call,
 * where PyTorch's CPU rms_norm dispatches ~20 operators (~40 us a row on a 2-core AVX2 VM). */
void tm_rms_norm(const float *x, const float *w, float eps, int64_t M, int64_t D, float *y) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * D;
        float *yr = y + m * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        int64_t j = 0;
        for (; j + 16 <= D; j += 16) {
            __m256 u = _mm256_loadu_ps(xr + j), v = _mm256_loadu_ps(xr + j + 8);
            a0 = _mm256_fmadd_ps(u, u, a0);
            a1 = _mm256_fmadd_ps(v, v, a1);
        }
        for (; j < D; j += 8) {
            __m256 u = _mm256_loadu_ps(xr + j);
            a0 = _mm256_fmadd_ps(u, u, a0);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(_mm256_add_ps(a0, a1)) / (float)D + eps));
        for (j = 0; j < D; j += 8)
            _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), r), _mm256_loadu_ps(w + j)));
    }
}

/* e^x for x <= 0 (softmax after subtracting the maximum), 8 at a time: x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by its Taylor series to r^7 (relative error < 2e-7), 2^n put into the exponent bits. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln2 in two parts: exact n * hi */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Eight sums of eight vectors each: (sum of a[0], ..., sum of a[7]) as one vector. */
static inline __m256 hsum8(const __m256 a[8]) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* y (M, N) = x (M, K) @ W.T for a float32 (N, K) W, K % 8 == 0: the few-row matmul of a float model's
 * decode step. MKL's sgemm reads SmolLM2's weights at 3-7 GB/s at 1-32 rows on a 2-core AVX2 VM; here
 * each task holds 4 weight rows in L1 while every activation row passes, two at a time (8 running
 * sums in registers), with the weight stream prefetched. Sums run in a fixed order per output. */
int tm_f32_matmul(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int threads) {
    const int64_t tasks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n = 4 * t, rows = N - n < 4 ? N - n : 4;
        const float *w0 = w + n * K, *w1 = w + (n + (rows > 1)) * K, *w2 = w + (n + (rows > 2 ? 2 : 0)) * K,
                    *w3 = w + (n + (rows > 3 ? 3 : 0)) * K;
        for (int64_t m = 0; m < M; m += 2) {
            const float *x0 = x + m * K, *x1 = x + (m + 1 < M ? m + 1 : m) * K;
            __m256 a[8];
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 8) {
                if (m == 0)  /* the rows of a later task, PREFETCH_BYTES ahead on the weight stream */
                    _mm_prefetch((const char *)(w0 + 4 * K + k) + PREFETCH_BYTES, _MM_HINT_T0);
                const __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);
                const __m256 b0 = _mm256_loadu_ps(w0 + k), b1 = _mm256_loadu_ps(w1 + k);
                const __m256 b2 = _mm256_loadu_ps(w2 + k), b3 = _mm256_loadu_ps(w3 + k);
                a[0] = _mm256_fmadd_ps(u, b0, a[0]);
                a[1] = _mm256_fmadd_ps(u, b1, a[1]);
                a[2] = _mm256_fmadd_ps(u, b2, a[2]);
                a[3] = _mm256_fmadd_ps(u, b3, a[3]);
                a[4] = _mm256_fmadd_ps(v, b0, a[4]);
                a[5] = _mm256_fmadd_ps(v, b1, a[5]);
                a[6] = _mm256_fmadd_ps(v, b2, a[6]);
                a[7] = _mm256_fmadd_ps(v, b3, a[7]);
            }
            float sums[8];
            _mm256_storeu_ps(sums, hsum8(a));
            for (int64_t r = 0; r < rows; r++) {
                y[m * N + n + r] = sums[r];
                if (m + 1 < M)
                    y[(m + 1) * N + n + r] = sums[4 + r];
            }
        }
    }
    return 0;
}

/* One query token per sequence over its keys in the paged pool, read in place (no gather):
 * q (N, H, D), rows `qstride` floats apart; pools (blocks, bs, Hkv, D) and (blocks, bs, Hkv, Dv); tables (N, >= blocks used) with row
 * stride `tstride`; sequence n sees keys [max(first_key, lens[n] - window), lens[n]) (window <= 0: all).
 * out (N, H, Dv). Query heads h use key head h / (H / Hkv). D % 8 == Dv % 8 == 0. Returns -1 when out
 * of memory. Scores are made eight keys at a time (one horizontal reduction for eight dot products),
 * and each query head's weighted sum of values is held in registers, 64 columns at a time. */
int tm_decode_attention(const float *q, int64_t qstride, const float *kp, const float *vp, const int64_t *tables,
                        int64_t tstride,
                        const int64_t *lens, int64_t first_key, int64_t window, int64_t N, int64_t H, int64_t Hkv,
                        int64_t D, int64_t Dv, int64_t bs, float scale, float *out, int threads) {
    const int64_t group = H / Hkv;
    int64_t keys = 0;
    for (int64_t n = 0; n < N; n++)
        keys += lens[n];
    if (keys * H * (D + Dv) < (1 << 16) || N * Hkv < 2)  /* done before a second thread would start */
        threads = 1;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1) reduction(| : failed)
    for (int64_t t = 0; t < N * Hkv; t++) {
        const int64_t n = t / Hkv, kvh = t % Hkv, len = lens[n];
        int64_t lo = first_key;
        if (window > 0 && len - window > lo)
            lo = len - window;
        const int64_t L = len - lo, Lpad = (L + 7) & ~(int64_t)7;
        float *o = out + (n * H + kvh * group) * Dv;
        if (L <= 0) {  /* nothing visible (the caller never asks): zeros, not a division by zero */
            for (int64_t j = 0; j < group * Dv; j++)
                o[j] = 0.0f;
            continue;
        }
        void *mem = malloc(sizeof(float) * (size_t)(group * Lpad) + sizeof(int64_t) * (size_t)Lpad);
        if (!mem) {
            failed = 1;
            continue;
        }
        float *s = mem;
        int64_t *row = (int64_t *)(s + group * Lpad);  /* each visible key's entry in the pool, padded with the last */
        const int64_t *table = tables + n * tstride;
        for (int64_t pos = lo, l = 0; pos < len;) {
            const int64_t off = pos % bs, run = bs - off < len - pos ? bs - off : len - pos;
            const int64_t first = (table[pos / bs] * bs + off) * Hkv + kvh;
            for (int64_t i = 0; i < run; i++)
                row[l++] = first + i * Hkv;
            pos += run;
        }
        for (int64_t l = L; l < Lpad; l++)
            row[l] = row[L - 1];
        const float *qh = q + n * qstride + kvh * group * D;
        for (int64_t g = 0; g < group; g++) {
            float *sg = s + g * Lpad;
            const float *qg = qh + g * D;
            __m256 mx = _mm256_set1_ps(-INFINITY);
            for (int64_t l = 0; l < Lpad; l += 8) {
                __m256 a[8];
                for (int i = 0; i < 8; i++)
                    a[i] = _mm256_setzero_ps();
                for (int64_t j = 0; j < D; j += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + j);
                    for (int i = 0; i < 8; i++)
                        a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp + row[l + i] * D + j), a[i]);
                }
                __m256 sc = _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale));
                if (l + 8 > L) {  /* the padding keys: no weight */
                    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)l), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)L), idx));
                    sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, keep);
                }
                _mm256_storeu_ps(sg + l, sc);
                mx = _mm256_max_ps(mx, sc);
            }
            /* the maximum of all lanes, then probabilities (unnormalised) and their sum */
            mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 0x01));
            mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4E));
            mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xB1));
            __m256 sum = _mm256_setzero_ps();
            for (int64_t l = 0; l < Lpad; l += 8) {
                const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + l), mx));
                _mm256_storeu_ps(sg + l, p);
                sum = _mm256_add_ps(sum, p);
            }
            const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
            /* the values, weighted: 64 output columns in registers at a time */
            for (int64_t c = 0; c < Dv; c += 64) {
                const int64_t w = Dv - c < 64 ? (Dv - c) / 8 : 8;
                __m256 acc[8];
                for (int i = 0; i < 8; i++)
                    acc[i] = _mm256_setzero_ps();
                for (int64_t l = 0; l < L; l++) {
                    const __m256 p = _mm256_set1_ps(sg[l]);
                    const float *vrow = vp + row[l] * Dv + c;
                    for (int i = 0; i < w; i++)
                        acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow + 8 * i), acc[i]);
                }
                for (int i = 0; i < w; i++)
                    _mm256_storeu_ps(o + g * Dv + c + 8 * i, _mm256_mul_ps(acc[i], inv));
            }
        }
        free(mem);
    }
    return failed ? -1 : 0;
}

/* Rotary embedding in HF's "rotate half" layout: y = x * cos + roll(x, D/2) * ssin, where ssin is the
 * sine with its first half negated (model/rope.py). x and y: R rows `xstride` / `ystride` floats apart,
 * each H heads of D; cos, ssin (R, D): one per row. */
void tm_rotary(const float *x, int64_t xstride, const float *cos, const float *ssin, int64_t R, int64_t H, int64_t D,
               float *y, int64_t ystride) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < R; r++) {
        const float *c = cos + r * D, *s = ssin + r * D;
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + r * xstride + h * D;
            float *yr = y + r * ystride + h * D;  /* y may be x: each pair is read before it is written */
            for (int64_t j = 0; j < half; j += 8) {
                const __m256 a = _mm256_loadu_ps(xr + j), b = _mm256_loadu_ps(xr + half + j);
                _mm256_storeu_ps(yr + j, _mm256_fmadd_ps(b, _mm256_loadu_ps(s + j),
                                                         _mm256_mul_ps(a, _mm256_loadu_ps(c + j))));
                _mm256_storeu_ps(yr + half + j, _mm256_fmadd_ps(a, _mm256_loadu_ps(s + half + j),
                                                                _mm256_mul_ps(b, _mm256_loadu_ps(c + half + j))));
            }
        }
    }
}

/* SwiGLU's gate: y = silu(g) * u for each row of gu = [g | u] (R, 2F) → y (R, F); F % 8 == 0.
 * silu(g) = g * sigmoid(g), the sigmoid from e^-|g| so the exponential never overflows. */
void tm_silu_mul(const float *gu, int64_t R, int64_t F, float *y) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < R; r++) {
        const float *g = gu + r * 2 * F, *u = g + F;
        for (int64_t j = 0; j < F; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));  /* e^-|g| */
            const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
            /* sigmoid(g) = 1 / (1 + e^-g) for g >= 0, e^g / (1 + e^g) = e^-|g| / (1 + e^-|g|) for g < 0 */
            const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), gv);
            _mm256_storeu_ps(y + r * F + j, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + j)));
        }
    }
}

/* Pointers of one layer as decode_layers reads them (an int64 row each, so Python fills one array):
 * the two norm weights, then (weight, scales) of qkv, o, gate/up and down (int4: PyTorch's packing and
 * its (groups, N, 2) scales and zeros; int8: the (N, K) codes and (N,) scales; float32: the (N, K)
 * weight and no scales; gate/up and down are a mixture of experts' shared expert, 0 where it has none),
 * then the layer's key and value pools, qkv's float32 bias or 0 (Qwen2), then a mixture of experts'
 * float32 router (E, d), experts' gate/up (E, 2 Fe, d) and down (E, d, Fe), and its shared expert's
 * gate (d) or 0 (0 in a dense layer). */
enum { P_LN1, P_LN2, P_QKV, P_QKV_SZ, P_O, P_O_SZ, P_GU, P_GU_SZ, P_DN, P_DN_SZ, P_K, P_V, P_QKV_BIAS, P_ROUTER,
       P_EXPERT_GU, P_EXPERT_DN, P_SHARED_GATE, P_COUNT };

/* The integers of one layer: its linears' kinds (int4 group size, 0 int8, -1 float32), the dense MLP's
 * (or the shared expert's) width F, 0 for none, and for a mixture of experts the number of experts E
 * (0 in a dense layer), top k, the experts' width Fe and the routing (ROUTE_*). */
enum { I_QKV, I_O, I_GU, I_DN, I_F, I_EXPERTS, I_TOPK, I_EXPERT_F, I_ROUTING, I_COUNT };

/* Mixtral, Qwen3-MoE: a softmax over the top k logits (= the full softmax renormalised over the chosen);
 * Qwen2-MoE: the full softmax's top k as they are. Either then times the routed scaling factor. */
enum { ROUTE_TOPK_SOFTMAX, ROUTE_SOFTMAX_TOPK };

/* One of a layer's linears: int4 with this group size, int8 where group is 0, float32 where it is -1. */
static int linear(const float *x, int64_t M, int64_t K, const int64_t *p, int w, int64_t group, int64_t N,
                  int64_t B, float *y, int threads) {
    const void *weight = (const void *)(intptr_t)p[w], *scales = (const void *)(intptr_t)p[w + 1];
    if (group < 0)
        return tm_f32_matmul(x, M, K, weight, N, y, threads);
    return group ? tm_int4_matmul(x, M, K, weight, scales, N, B, group, y, threads)
                 : tm_int8_matmul(x, M, K, weight, scales, N, y, threads);
}

/* SwiGLU over M rows h (M, d) with the layer's gate/up and down linears: out (M, d). gu, act: scratch. */
static int swiglu(const float *h, int64_t M, int64_t d, int64_t F, const int64_t *p, const int64_t *info, int64_t B,
                  float *gu, float *act, float *out, int threads) {
    int status = linear(h, M, d, p, P_GU, info[I_GU], 2 * F, B, gu, threads);
    tm_silu_mul(gu, M, F, act);
    return status | linear(act, M, F, p, P_DN, info[I_DN], d, B, out, threads);
}

/* The k experts of each row of h (N, d) and their weights, as `Router.route` picks them (torch.topk's
 * order: the largest first, the lower index first among equals). */
static void route(const float *logits, int64_t N, int64_t E, int64_t k, int64_t routing, float scaling,
                  int64_t *chosen, float *weights) {
    for (int64_t n = 0; n < N; n++) {
        const float *z = logits + n * E;
        int64_t *c = chosen + n * k;
        float *w = weights + n * k, zmax = z[0], total = 0.0f, picked = 0.0f;
        for (int64_t e = 1; e < E; e++)
            zmax = z[e] > zmax ? z[e] : zmax;
        for (int64_t e = 0; e < E; e++)
            total += expf(z[e] - zmax);
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++)
                    taken |= c[i] == e;
                if (!taken && (best < 0 || z[e] > z[best]))
                    best = e;
            }
            c[j] = best;
            w[j] = expf(z[best] - zmax);
            picked += w[j];
        }
        const float norm = routing == ROUTE_TOPK_SOFTMAX ? picked : total;
        for (int64_t j = 0; j < k; j++)
            w[j] = w[j] / norm * scaling;
    }
}

/* A sparse mixture of experts over the rows of h (N, d) → out (N, d): the router's logits, each row's
 * top k experts (`route`), then expert by expert the rows that chose it as one few-row SwiGLU, each
 * result added to its row with the router's weight (in expert order, as `Experts.forward` adds them);
 * plus the shared expert, scaled by the sigmoid of its gate where it has one. Returns -1 when out of memory. */
static int mixture(const float *h, int64_t N, int64_t d, const int64_t *p, const int64_t *info, float scaling,
                   int64_t B, float *out, int threads) {
    const int64_t E = info[I_EXPERTS], k = info[I_TOPK], Fe = info[I_EXPERT_F], F = info[I_F];
    const int64_t width = 2 * (Fe > F ? Fe : F);
    float *logits = malloc(sizeof(float) * (size_t)(N * E + N * k + N * d + N * width + N * width / 2 + N * d));
    int64_t *chosen = malloc(sizeof(int64_t) * (size_t)(N * k + N));
    if (!logits || !chosen) {
        free(logits);
        free(chosen);
        return -1;
    }
    float *weights = logits + N * E, *rows = weights + N * k, *gu = rows + N * d, *act = gu + N * width,
          *y = act + N * width / 2;
    int64_t *members = chosen + N * k;
    const float *experts_gu = (const float *)(intptr_t)p[P_EXPERT_GU];
    const float *experts_dn = (const float *)(intptr_t)p[P_EXPERT_DN];
    int status = tm_f32_matmul(h, N, d, (const float *)(intptr_t)p[P_ROUTER], E, logits, 1);
    route(logits, N, E, k, info[I_ROUTING], scaling, chosen, weights);
    memset(out, 0, sizeof(float) * (size_t)(N * d));
    for (int64_t e = 0; e < E; e++) {
        int64_t count = 0;
        for (int64_t i = 0; i < N * k; i++)
            if (chosen[i] == e) {
                members[count] = i;
                memcpy(rows + count * d, h + (i / k) * d, sizeof(float) * (size_t)d);
                count++;
            }
        if (!count)
            continue;
        status |= tm_f32_matmul(rows, count, d, experts_gu + e * 2 * Fe * d, 2 * Fe, gu, threads);
        tm_silu_mul(gu, count, Fe, act);
        status |= tm_f32_matmul(act, count, Fe, experts_dn + e * d * Fe, d, y, threads);
        for (int64_t c = 0; c < count; c++) {
            float *o = out + (members[c] / k) * d;
            const float w = weights[members[c]];
            for (int64_t j = 0; j < d; j++)
                o[j] += w * y[c * d + j];
        }
    }
    if (F) {
        status |= swiglu(h, N, d, F, p, info, B, gu, act, y, threads);
        const float *gate = (const float *)(intptr_t)p[P_SHARED_GATE];
        for (int64_t n = 0; n < N; n++) {
            float g = 1.0f;
            if (gate) {
                float z = 0.0f;
                for (int64_t j = 0; j < d; j++)
                    z += gate[j] * h[n * d + j];
                g = 1.0f / (1.0f + expf(-z));
            }
            for (int64_t j = 0; j < d; j++)
                out[n * d + j] += g * y[n * d + j];
        }
    }
    free(logits);
    free(chosen);
    return status ? -1 : 0;
}

/* One all-decode step of a plain pre-norm block (Llama family: RMSNorm, fused qkv, rotate-half RoPE,
 * GQA attention over the paged pool, o, then a SwiGLU MLP with fused gate/up or a mixture of SwiGLU
 * experts; int4, int8 or float32 linears, no bias) for N tokens, one per sequence: x (N, d) += attention,
 * then += MLP, in place. Each piece is the kernel the layer's modules call one by one
 * (model/transformer.py), so a dense layer's output equals theirs. The new keys and values go to their
 * `slots` in the pools before attention reads them. `p`: the layer's pointers (P_*), `info` its integers
 * (I_*); `mem` holds the intermediates (decode_layers sizes it). Returns 0, or -1 when out of memory. */
static int decode_layer(float *x, int64_t N, int64_t d, const int64_t *p, const int64_t *info, float eps, int64_t B,
                        int64_t F, const float *cos, const float *ssin, const int64_t *slots, const int64_t *tables,
                        int64_t tstride, const int64_t *lens, int64_t first_key, int64_t window, int64_t H,
                        int64_t Hkv, int64_t D, int64_t bs, float scale, float scaling, int threads, float *mem) {
    const int64_t row = (H + 2 * Hkv) * D;
    float *h = mem, *qkv = h + N * d, *att = qkv + N * row, *o = att + N * H * D, *gu = o + N * d, *act = gu + N * 2 * F;
    float *kpool = (float *)(intptr_t)p[P_K], *vpool = (float *)(intptr_t)p[P_V];
    int status = 0;
    tm_rms_norm(x, (const float *)(intptr_t)p[P_LN1], eps, N, d, h);
    status |= linear(h, N, d, p, P_QKV, info[I_QKV], row, B, qkv, threads);
    const float *bias = (const float *)(intptr_t)p[P_QKV_BIAS];
    if (bias)
        for (int64_t n = 0; n < N; n++)
            for (int64_t j = 0; j < row; j++)
                qkv[n * row + j] += bias[j];
    tm_rotary(qkv, row, cos, ssin, N, H + Hkv, D, qkv, row);  /* q and k heads, in place */
    for (int64_t n = 0; n < N; n++) {
        const float *k = qkv + n * row + H * D, *v = k + Hkv * D;
        float *kd = kpool + slots[n] * Hkv * D, *vd = vpool + slots[n] * Hkv * D;
        for (int64_t j = 0; j < Hkv * D; j++) {
            kd[j] = k[j];
            vd[j] = v[j];
        }
    }
    status |= tm_decode_attention(qkv, row, kpool, vpool, tables, tstride, lens, first_key, window, N, H, Hkv, D, D,
                                  bs, scale, att, threads);
    status |= linear(att, N, H * D, p, P_O, info[I_O], d, B, o, threads);
    for (int64_t j = 0; j < N * d; j++)
        x[j] += o[j];
    tm_rms_norm(x, (const float *)(intptr_t)p[P_LN2], eps, N, d, h);
    if (info[I_EXPERTS])
        status |= mixture(h, N, d, p, info, scaling, B, o, threads);
    else
        status |= swiglu(h, N, d, info[I_F], p, info, B, gu, act, o, threads);
    for (int64_t j = 0; j < N * d; j++)
        x[j] += o[j];
    return status ? -1 : 0;
}

/* An all-decode step of L such blocks in one call (the arguments of decode_layer, per layer in `ptrs`
 * (L, P_COUNT) and `info` (L, I_COUNT); `scaling`: the routed experts' scaling factor). One call per step
 * instead of one per layer removes the Python between layers, a sixth of a 135M model's batch-1 step. */
int tm_decode_layers(float *x, int64_t N, int64_t d, int64_t L, const int64_t *ptrs, const int64_t *info,
                     float eps, int64_t B, const float *cos, const float *ssin, const int64_t *slots,
                     const int64_t *tables, int64_t tstride, const int64_t *lens, int64_t first_key, int64_t window,
                     int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, float scaling, int threads) {
    const int64_t row = (H + 2 * Hkv) * D;
    int64_t F = 0;
    for (int64_t l = 0; l < L; l++)
        F = info[l * I_COUNT + I_F] > F ? info[l * I_COUNT + I_F] : F;
    float *mem = malloc(sizeof(float) * (size_t)(N * (d + row + H * D + d + 2 * F + F)));
    if (!mem)
        return -1;
    int status = 0;
    for (int64_t l = 0; l < L && !status; l++)
        status = decode_layer(x, N, d, ptrs + l * P_COUNT, info + l * I_COUNT, eps, B, F, cos, ssin, slots, tables,
                              tstride, lens, first_key, window, H, Hkv, D, bs, scale, scaling, threads, mem);
    free(mem);
    return status;
}
