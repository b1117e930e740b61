/* Matrix-vector kernels for one decode step on the CPU (see cpu_kernels.py).
 *
 * y = W x (+ y), W stored compactly (bf16 bits, or int8 with one float scale per row), x and y float32.
 * At batch 1 a decode step is memory-bound: it reads every weight once. float32 weights cost 4 bytes per
 * weight, bf16 2 (exact for bf16 checkpoints, a rounding for others), and torch's bf16 matrix-vector path
 * reaches only ~60 % of the machine's bandwidth here. These loops widen bf16 to float32 in registers (exact) and
 * multiply-add in float32, so the products equal float32 arithmetic on the same values.
 *
 * bf16 widening: a 32-bit lane holding two bf16 values (w[2i] low, w[2i+1] high) gives w[2i+1] as a float
 * by masking the low half, and w[2i] by shifting left 16. x is split into its even and odd elements once
 * per call, so each 64-byte load of weights costs one shift, one and, two FMAs.
 *
 * Threads: OpenMP. Loaded into a process whose torch uses libgomp, this library binds to the same
 * runtime (same soname), so it shares torch's thread pool instead of competing with it; cpu_kernels.py
 * checks that. Built with -march=native on the user's machine; without AVX-512 or AVX2+FMA only plain loops remain,
 * and cpu_kernels.py does not use such a build.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define PREFETCH 256 /* elements ahead (512 bytes of bf16) */
#define BLOCK 64     /* rows per OpenMP work item */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float x_at(const float *xe, const float *xo, int64_t k) { return (k & 1) ? xo[k / 2] : xe[k / 2]; }

static inline void store(float *y, int64_t r, float s, int acc) { y[r] = acc ? y[r] + s : s; }

/* ---------------------------------------------------------------------------------------- bf16 */
static void rows_bf16(const uint16_t *w, const float *xe, const float *xo, float *y, int64_t r0, int64_t r1,
                      int64_t cols, int acc) {
    int64_t r = r0;
#if defined(__AVX512F__)
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    for (; r + 8 <= r1; r += 8) {
        __m512 a[8], b[8];
        const uint16_t *p[8];
        for (int j = 0; j < 8; j++) {
            a[j] = _mm512_setzero_ps();
            b[j] = a[j];
            p[j] = w + (r + j) * cols;
        }
        int64_t k = 0;
        for (; k + 32 <= cols; k += 32) {
            __m512 ve = _mm512_loadu_ps(xe + k / 2), vo = _mm512_loadu_ps(xo + k / 2);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                _mm_prefetch((const char *)(p[j] + k + PREFETCH), _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512((const void *)(p[j] + k));
                a[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), ve, a[j]);
                b[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, hi)), vo, b[j]);
            }
        }
        for (int j = 0; j < 8; j++) {
            float s = _mm512_reduce_add_ps(_mm512_add_ps(a[j], b[j]));
            for (int64_t kk = k; kk < cols; kk++) s += bf16_to_f32(p[j][kk]) * x_at(xe, xo, kk);
            store(y, r + j, s, acc);
        }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    for (; r + 4 <= r1; r += 4) {
        __m256 a[4], b[4];
        const uint16_t *p[4];
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_setzero_ps();
            b[j] = a[j];
            p[j] = w + (r + j) * cols;
        }
        int64_t k = 0;
        for (; k + 16 <= cols; k += 16) {
            __m256 ve = _mm256_loadu_ps(xe + k / 2), vo = _mm256_loadu_ps(xo + k / 2);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                _mm_prefetch((const char *)(p[j] + k + PREFETCH), _MM_HINT_T0);
                __m256i v = _mm256_loadu_si256((const __m256i *)(p[j] + k));
                a[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), ve, a[j]);
                b[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), vo, b[j]);
            }
        }
        for (int j = 0; j < 4; j++) {
            __m256 t = _mm256_add_ps(a[j], b[j]);
            __m128 q = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
            q = _mm_add_ps(q, _mm_movehl_ps(q, q));
            q = _mm_add_ss(q, _mm_movehdup_ps(q));
            float s = _mm_cvtss_f32(q);
            for (int64_t kk = k; kk < cols; kk++) s += bf16_to_f32(p[j][kk]) * x_at(xe, xo, kk);
            store(y, r + j, s, acc);
        }
    }
#endif
    for (; r < r1; r++) {
        const uint16_t *p = w + r * cols;
        float s = 0.f;
        for (int64_t k = 0; k < cols; k++) s += bf16_to_f32(p[k]) * x_at(xe, xo, k);
        store(y, r, s, acc);
    }
}

/* ---------------------------------------------------------------------------------------- int8 */
static void rows_int8(const int8_t *w, const float *scale, const float *x, float *y, int64_t r0, int64_t r1,
                      int64_t cols, int acc) {
    int64_t r = r0;
#if defined(__AVX512F__)
    for (; r + 4 <= r1; r += 4) {
        __m512 a[4][4];
        const int8_t *p[4];
        for (int j = 0; j < 4; j++) {
            for (int u = 0; u < 4; u++) a[j][u] = _mm512_setzero_ps();
            p[j] = w + (r + j) * cols;
        }
        int64_t k = 0;
        for (; k + 64 <= cols; k += 64) {
            __m512 xv[4];
            for (int u = 0; u < 4; u++) xv[u] = _mm512_loadu_ps(x + k + 16 * u);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                _mm_prefetch((const char *)(p[j] + k + 2 * PREFETCH), _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512((const void *)(p[j] + k));
                for (int u = 0; u < 4; u++) {
                    __m128i part = _mm512_extracti32x4_epi32(v, 0);
                    if (u == 1) part = _mm512_extracti32x4_epi32(v, 1);
                    if (u == 2) part = _mm512_extracti32x4_epi32(v, 2);
                    if (u == 3) part = _mm512_extracti32x4_epi32(v, 3);
                    a[j][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(part)), xv[u], a[j][u]);
                }
            }
        }
        for (int j = 0; j < 4; j++) {
            float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[j][0], a[j][1]), _mm512_add_ps(a[j][2], a[j][3])));
            for (int64_t kk = k; kk < cols; kk++) s += (float)p[j][kk] * x[kk];
            store(y, r + j, s * scale[r + j], acc);
        }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; r + 4 <= r1; r += 4) {
        __m256 a[4][2];
        const int8_t *p[4];
        for (int j = 0; j < 4; j++) {
            a[j][0] = _mm256_setzero_ps();
            a[j][1] = a[j][0];
            p[j] = w + (r + j) * cols;
        }
        int64_t k = 0;
        for (; k + 16 <= cols; k += 16) {
            __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                _mm_prefetch((const char *)(p[j] + k + 2 * PREFETCH), _MM_HINT_T0);
                __m128i v = _mm_loadu_si128((const __m128i *)(p[j] + k));
                a[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), x0, a[j][0]);
                a[j][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), x1, a[j][1]);
            }
        }
        for (int j = 0; j < 4; j++) {
            __m256 t = _mm256_add_ps(a[j][0], a[j][1]);
            __m128 q = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
            q = _mm_add_ps(q, _mm_movehl_ps(q, q));
            q = _mm_add_ss(q, _mm_movehdup_ps(q));
            float s = _mm_cvtss_f32(q);
            for (int64_t kk = k; kk < cols; kk++) s += (float)p[j][kk] * x[kk];
            store(y, r + j, s * scale[r + j], acc);
        }
    }
#endif
    for (; r < r1; r++) {
        const int8_t *p = w + r * cols;
        float s = 0.f;
        for (int64_t k = 0; k < cols; k++) s += (float)p[k] * x[k];
        store(y, r, s * scale[r], acc);
    }
}

/* ---------------------------------------------------------------------------------------- entry points */
int dsv41_kernels_isa(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 256;
#else
    return 0;
#endif
}

/* y[rows] = W[rows, cols] x (+ y when acc); W as bf16 bits. threads: OpenMP team size. */
void dsv41_mv_bf16(const uint16_t *w, const float *x, float *y, int64_t rows, int64_t cols, int acc, int threads) {
    int64_t half = (cols + 1) / 2;
    float stack[2 * 4096];
    float *buf = cols <= 8192 ? stack : (float *)malloc(sizeof(float) * 2 * (size_t)half);
    if (!buf) return;
    float *xe = buf, *xo = buf + half;
    for (int64_t k = 0; k < cols; k++) {
        if (k & 1) xo[k / 2] = x[k];
        else xe[k / 2] = x[k];
    }
    int64_t blocks = (rows + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t r1 = (b + 1) * BLOCK;
        if (r1 > rows) r1 = rows;
        rows_bf16(w, xe, xo, y, b * BLOCK, r1, cols, acc);
    }
    if (buf != stack) free(buf);
}

/* y[rows] = (W[rows, cols] x) * scale[rows] (+ y when acc); W as int8. */
void dsv41_mv_int8(const int8_t *w, const float *scale, const float *x, float *y, int64_t rows, int64_t cols, int acc,
                   int threads) {
    int64_t blocks = (rows + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t r1 = (b + 1) * BLOCK;
        if (r1 > rows) r1 = rows;
        rows_int8(w, scale, x, y, b * BLOCK, r1, cols, acc);
    }
}
