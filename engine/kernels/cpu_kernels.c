/* Matrix-vector kernels for one decode step on the CPU, and the whole step in one call (engine/kernels/).
 *
 * Why this file is long: one translation unit, so the compiler inlines the kernels into the fused step and
 * the build stays one `cc` call; each instruction set (AVX-512, AVX2) has its own loops.
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
 * runtime (same soname), so it shares torch's thread pool instead of competing with it; library.py
 * checks that. Built with -march=native on the user's machine; without AVX-512 or AVX2+FMA only plain loops remain,
 * and library.py does not use such a build.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define PREFETCH 256     /* long rows: elements ahead within each row (512 bytes of bf16) */
#define LINEAR_BYTES 4096 /* rows up to this many bytes are prefetched as one linear stream (see below) */
#define K_AHEAD 8192 /* bytes: how far ahead the k-quant products stream their rows into L2 */
#define AHEAD 2           /* ... that many row groups ahead */

/* Prefetching. A group of R rows is read in parallel, one vector per row per step. For short rows (the
 * default model's are 576 or 1536 columns: 1,152 / 3,072 bytes of bf16) the group is one contiguous span,
 * and per-row prefetching runs off the end of each row every few steps; instead the span AHEAD groups further
 * on is prefetched linearly into L2, as many lines per step as the step consumes (measured on the default
 * model's decode matrices, 2 cores: 21 -> 26 GB/s; into L1 instead: 23 GB/s). Long rows keep a per-row
 * prefetch into L1. `limit` is the end of this thread's rows. */
typedef struct {
    const char *next, *limit;
    int64_t step; /* group_stream: a row group's bytes per block read, times 65536 */
} Stream;

static inline Stream stream_at(const void *w, int64_t row, int64_t row_bytes, int group, const void *limit) {
    Stream st = {(const char *)w + (row + (int64_t)group * AHEAD) * row_bytes, (const char *)limit, 0};
    return st;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
static inline float hsum256(__m256 t) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
static inline void stream_to(Stream *st, const char *target) {
    if (target > st->limit) target = st->limit;
    for (; st->next < target; st->next += 64) _mm_prefetch(st->next, _MM_HINT_T1);
}

/* Prefetching for the products that read four rows of GGUF blocks at a time (rows of a few hundred bytes): the rows
 * GROUPS_AHEAD groups further on are prefetched into L2 as one linear stream, advanced by the share of the group read
 * so far (`done` of `blocks`), in place of a prefetch into L1 per row and block. Measured on the default model's
 * matrices, 2 cores, the builds taking turns in one process: the Q8_0 head 1.60 -> 0.91 ms, the layers' Q4_1
 * products 2.72 -> 2.47 ms on bf16 x and 2.64 -> 2.16 on int8 x (1 group ahead: slower than per-row prefetching).
 * Eight groups ahead against three, the step's products alone on int16 x with a read of the weights after each
 * build, thousands of rounds (benchmarks/kernels_ab.py --products): x1.03-1.04 in two runs (x1.035-1.055 in the
 * rounds whose reads were fastest, x1.015 in the slowest); 6: x1.03, 12: x0.99, 16: x0.98; no stream: x0.57. The
 * float32-x Q4 loop is bound by its instructions and lost 7 % to the stream's own work, so it keeps its per-row
 * prefetch. The AVX2 build's integer Q4 loops stream too (an AMD EPYC with AVX2 alone, the step's products on int16
 * x: x1.58 over a prefetch into L1 per row, ~2,000 paired rounds; 4 groups ahead x1.04 / x1.00 against 8, 12 x0.97,
 * both within the noise). */
#define GROUPS_AHEAD 8
/* A thread's stream over its rows r0 .. r1, their first GROUPS_AHEAD groups asked for at once (else the loop's first
 * groups wait on memory, load by load: the step's products ×1.04 faster with them asked for, docs/design.md) */
static inline Stream group_stream(const uint8_t *w, int64_t r0, int64_t r1, int64_t row_bytes, int64_t blocks) {
    Stream st = {(const char *)w + r0 * row_bytes, (const char *)(w + r1 * row_bytes),
                 (4 * row_bytes << 16) / blocks};
    stream_to(&st, (const char *)w + (r0 + 4 * GROUPS_AHEAD) * row_bytes);
    return st;
}
/* The stream advanced to where the group of rows at r has read `done` of its blocks (by a fixed-point step: no
 * 64-bit division in the loops that call this per block) */
static inline void group_stream_to(Stream *st, const uint8_t *w, int64_t r, int64_t row_bytes, int64_t done) {
    stream_to(st, (const char *)w + (r + 4 * GROUPS_AHEAD) * row_bytes + ((done * st->step) >> 16));
}
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bf16, round to nearest even (what torch's .to(torch.bfloat16) does), NaN kept a quiet NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float x_at(const float *xe, const float *xo, int64_t k) { return (k & 1) ? xo[k / 2] : xe[k / 2]; }

static inline void store(float *y, int64_t r, float s, int acc) { y[r] = acc ? y[r] + s : s; }

#if defined(__AVX512F__)
/* The sums of four rows' accumulators into y[r .. r + n - 1] (n <= 4) in one transposed reduction: 9 operations for
 * the four instead of a chain of ~8 per row. At the end of every group of rows that chain waits on the group's last
 * loads, and the GGUF products spent ~5 % of their time there (measured on the default model's matrices, 2 cores). */
static inline void store4(float *y, int64_t r, int64_t n, __m512 a0, __m512 a1, __m512 a2, __m512 a3, int acc) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    float out[4];
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    for (int64_t j = 0; j < n; j++) store(y, r + j, out[j], acc);
}
#endif

/* ---------------------------------------------------------------------------------------- bf16 */
static void rows_bf16(const uint16_t *w, const float *xe, const float *xo, float *y, int64_t r0, int64_t r1,
                      int64_t cols, int acc) {
    int64_t r = r0;
    const int64_t row_bytes = cols * 2;
    const int linear = row_bytes <= LINEAR_BYTES;
    const void *limit = w + r1 * cols;
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
        Stream st = stream_at(w, r, row_bytes, 8, limit);
        const char *base = st.next;
        int64_t k = 0;
        for (; k + 32 <= cols; k += 32) {
            __m512 ve = _mm512_loadu_ps(xe + k / 2), vo = _mm512_loadu_ps(xo + k / 2);
            if (linear) stream_to(&st, base + (k + 32) * 16); /* 8 rows x 64 bytes per step */
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                if (!linear) _mm_prefetch((const char *)(p[j] + k + PREFETCH), _MM_HINT_T0);
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
        Stream st = stream_at(w, r, row_bytes, 4, limit);
        const char *base = st.next;
        int64_t k = 0;
        for (; k + 16 <= cols; k += 16) {
            __m256 ve = _mm256_loadu_ps(xe + k / 2), vo = _mm256_loadu_ps(xo + k / 2);
            if (linear) stream_to(&st, base + (k + 16) * 8); /* 4 rows x 32 bytes per step */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                if (!linear) _mm_prefetch((const char *)(p[j] + k + PREFETCH), _MM_HINT_T0);
                __m256i v = _mm256_loadu_si256((const __m256i *)(p[j] + k));
                a[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), ve, a[j]);
                b[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), vo, b[j]);
            }
        }
        for (int j = 0; j < 4; j++) {
            float s = hsum256(_mm256_add_ps(a[j], b[j]));
            for (int64_t kk = k; kk < cols; kk++) s += bf16_to_f32(p[j][kk]) * x_at(xe, xo, kk);
            store(y, r + j, s, acc);
        }
    }
#endif
    (void)linear;
    (void)limit;
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
    const int linear = cols <= LINEAR_BYTES;
    const void *limit = w + r1 * cols;
#if defined(__AVX512F__)
    for (; r + 4 <= r1; r += 4) {
        __m512 a[4][4];
        const int8_t *p[4];
        for (int j = 0; j < 4; j++) {
            for (int u = 0; u < 4; u++) a[j][u] = _mm512_setzero_ps();
            p[j] = w + (r + j) * cols;
        }
        Stream st = stream_at(w, r, cols, 4, limit);
        const char *base = st.next;
        int64_t k = 0;
        for (; k + 64 <= cols; k += 64) {
            __m512 xv[4];
            for (int u = 0; u < 4; u++) xv[u] = _mm512_loadu_ps(x + k + 16 * u);
            if (linear) stream_to(&st, base + (k + 64) * 4); /* 4 rows x 64 bytes per step */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                if (!linear) _mm_prefetch((const char *)(p[j] + k + 2 * PREFETCH), _MM_HINT_T0);
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
        Stream st = stream_at(w, r, cols, 4, limit);
        const char *base = st.next;
        int64_t k = 0;
        for (; k + 16 <= cols; k += 16) {
            __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
            if (linear) stream_to(&st, base + (k + 16) * 4); /* 4 rows x 16 bytes per step */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                if (!linear) _mm_prefetch((const char *)(p[j] + k + 2 * PREFETCH), _MM_HINT_T0);
                __m128i v = _mm_loadu_si128((const __m128i *)(p[j] + k));
                a[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), x0, a[j][0]);
                a[j][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), x1, a[j][1]);
            }
        }
        for (int j = 0; j < 4; j++) {
            float s = hsum256(_mm256_add_ps(a[j][0], a[j][1]));
            for (int64_t kk = k; kk < cols; kk++) s += (float)p[j][kk] * x[kk];
            store(y, r + j, s * scale[r + j], acc);
        }
    }
#endif
    (void)linear;
    (void)limit;
    for (; r < r1; r++) {
        const int8_t *p = w + r * cols;
        float s = 0.f;
        for (int64_t k = 0; k < cols; k++) s += (float)p[k] * x[k];
        store(y, r, s * scale[r], acc);
    }
}

/* ---------------------------------------------------------------------------------------- float32 */
/* float32 weights (dtype="float32", or a model our packing does not cover): the same loop without widening,
 * for the fused decode step (torch's own mv is as fast in isolation, but not callable from inside it). */
static void rows_f32(const float *w, const float *x, float *y, int64_t r0, int64_t r1, int64_t cols, int acc) {
    int64_t r = r0;
    const int64_t row_bytes = cols * 4;
    const int linear = row_bytes <= LINEAR_BYTES;
    const void *limit = w + r1 * cols;
#if defined(__AVX512F__)
    for (; r + 8 <= r1; r += 8) {
        __m512 a[8];
        const float *p[8];
        for (int j = 0; j < 8; j++) {
            a[j] = _mm512_setzero_ps();
            p[j] = w + (r + j) * cols;
        }
        Stream st = stream_at(w, r, row_bytes, 8, limit);
        const char *base = st.next;
        int64_t k = 0;
        for (; k + 16 <= cols; k += 16) {
            __m512 xv = _mm512_loadu_ps(x + k);
            if (linear) stream_to(&st, base + (k + 16) * 32); /* 8 rows x 64 bytes per step */
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                if (!linear) _mm_prefetch((const char *)(p[j] + k + PREFETCH / 2), _MM_HINT_T0);
                a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(p[j] + k), xv, a[j]);
            }
        }
        for (int j = 0; j < 8; j++) {
            float s = _mm512_reduce_add_ps(a[j]);
            for (int64_t kk = k; kk < cols; kk++) s += p[j][kk] * x[kk];
            store(y, r + j, s, acc);
        }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; r + 4 <= r1; r += 4) {
        __m256 a[4];
        const float *p[4];
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_setzero_ps();
            p[j] = w + (r + j) * cols;
        }
        Stream st = stream_at(w, r, row_bytes, 4, limit);
        const char *base = st.next;
        int64_t k = 0;
        for (; k + 8 <= cols; k += 8) {
            __m256 xv = _mm256_loadu_ps(x + k);
            if (linear) stream_to(&st, base + (k + 8) * 16); /* 4 rows x 32 bytes per step */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                if (!linear) _mm_prefetch((const char *)(p[j] + k + PREFETCH / 2), _MM_HINT_T0);
                a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(p[j] + k), xv, a[j]);
            }
        }
        for (int j = 0; j < 4; j++) {
            float s = hsum256(a[j]);
            for (int64_t kk = k; kk < cols; kk++) s += p[j][kk] * x[kk];
            store(y, r + j, s, acc);
        }
    }
#endif
    (void)linear;
    (void)limit;
    for (; r < r1; r++) {
        const float *p = w + r * cols;
        float s = 0.f;
        for (int64_t k = 0; k < cols; k++) s += p[k] * x[k];
        store(y, r, s, acc);
    }
}

/* ---------------------------------------------------------------------------------------- entry points */
/* This thread's share of `rows`: a contiguous range in whole groups of 8 rows (one linear stream per thread,
 * balanced to within 8 rows). */
static void thread_rows(int64_t rows, int64_t *r0, int64_t *r1) {
    int64_t t = omp_get_thread_num(), n = omp_get_num_threads(), groups = (rows + 7) / 8;
    *r0 = groups * t / n * 8;
    *r1 = groups * (t + 1) / n * 8;
    if (*r1 > rows) *r1 = rows;
    if (*r0 > rows) *r0 = rows;
}

int dsv41_kernels_isa(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 256;
#else
    return 0;
#endif
}

/* y[rows] = W[rows, cols] x (+ y when acc); W as bf16 bits. threads: OpenMP team size. Returns 0, or -2 (y not
 * written) when a row of more than 8,192 columns found no memory for x's even / odd halves. */
int dsv41_mv_bf16(const uint16_t *w, const float *x, float *y, int64_t rows, int64_t cols, int acc, int threads) {
    int64_t half = (cols + 1) / 2;
    float stack[2 * 4096];
    float *buf = cols <= 8192 ? stack : (float *)malloc(sizeof(float) * 2 * (size_t)half);
    if (!buf) return -2;
    float *xe = buf, *xo = buf + half;
    for (int64_t k = 0; k < cols; k++) {
        if (k & 1) xo[k / 2] = x[k];
        else xe[k / 2] = x[k];
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t r0, r1;
        thread_rows(rows, &r0, &r1);
        rows_bf16(w, xe, xo, y, r0, r1, cols, acc);
    }
    if (buf != stack) free(buf);
    return 0;
}

/* y[rows] = W[rows, cols] x (+ y when acc); W as float32. */
void dsv41_mv_f32(const float *w, const float *x, float *y, int64_t rows, int64_t cols, int acc, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t r0, r1;
        thread_rows(rows, &r0, &r1);
        rows_f32(w, x, y, r0, r1, cols, acc);
    }
}

/* y[rows] = (W[rows, cols] x) * scale[rows] (+ y when acc); W as int8. */
void dsv41_mv_int8(const int8_t *w, const float *scale, const float *x, float *y, int64_t rows, int64_t cols, int acc,
                   int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t r0, r1;
        thread_rows(rows, &r0, &r1);
        rows_int8(w, scale, x, y, r0, r1, cols, acc);
    }
}

/* ---------------------------------------------------------------------------------------- GGUF blocks */
/* GGUF's own block formats, read as the file stores them (ggml's definitions; engine/kernels/gguf_blocks.py says
 * the same in words and tests/engine/test_gguf_blocks.py checks every format against the gguf package):
 *   Q4_0 (type 2)   32 weights in 18 bytes: f16 d, 16 bytes of nibbles;            w = d * (q - 8)
 *   Q4_1 (type 3)   32 in 20: f16 d, f16 m, 16 bytes of nibbles;                   w = d * q + m
 *   Q8_0 (type 8)   32 in 34: f16 d, 32 int8;                                      w = d * q
 *   Q4_K (type 12)  256 in 144: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins of 8 sub-blocks of 32,
 *                   128 bytes of nibbles;                                          w = (d * sc) * q - dmin * mn
 *   Q5_K (type 13)  256 in 176: as Q4_K, plus 32 bytes of fifth bits;              w = (d * sc) * q - dmin * mn
 *   Q6_K (type 14)  256 in 210: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales of 16 weights,
 *                   f16 d;                                                         w = (d * sc) * (q - 32)
 * gguf_block_values writes a block's weights exactly as the gguf package's dequantiser does (the same float32
 * operations in the same order: no fused multiply-add). The matrix-vector product multiplies those values by x
 * with float32 accumulation (the order of the sums is the vector lanes', as for the other formats). */

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, u;
    if (exp == 0x1F) u = sign | 0x7F800000u | (man << 13); /* inf, nan */
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* a product that the compiler may not fuse with the next addition (numpy rounds each operation) */
static inline float rounded(float v) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+x"(v));
#endif
    return v;
}

static int64_t gguf_block_weights(int64_t type) {
    return (type == 2 || type == 3 || type == 8) ? 32 : (type == 12 || type == 13 || type == 14) ? 256 : 0;
}

static int64_t gguf_block_bytes(int64_t type) {
    switch (type) {
    case 2: return 18;
    case 3: return 20;
    case 8: return 34;
    case 12: return 144;
    case 13: return 176;
    case 14: return 210;
    default: return 0;
    }
}

/* The "split" row layout of the 32-weight formats (type | GGUF_SPLIT): a row's blocks rearranged, bytes unchanged,
 * as [every block's d (f16)] [every block's m (f16), Q4_1] [every block's integers], so the kernels read a row's
 * scales as one vector instead of gathering them from 18-, 20- or 34-byte strides. Lossless both ways
 * (dsv41_gguf_split); every entry point taking a type takes the flag.
 *
 * Q4_0 / Q4_1 integers (16 bytes a block) go further: each whole group of 16 blocks (256 bytes) is interleaved by
 * 4-byte words: its chunk s (64 bytes, s = 0..3) holds bytes 4s..4s + 3 of each of the group's 16 blocks in turn
 * (block i at 4i). A vector of a chunk then has one block per 32-bit lane, the same block in
 * that lane for all four chunks: the integer dot products of a block's 32 weights add up in its lane before the one
 * conversion and multiply-add by its scale, for the 16 blocks at once (instead of a conversion, a scale pick and a
 * multiply-add per four blocks a chunk). The row's last blocks that fill no group of 16 stay block after block. */
#define GGUF_SPLIT 256
#define Q4_GROUP 16 /* blocks a group of interleaved Q4 integers */

static inline int64_t split_scale_bytes(int64_t type) { return type == 3 ? 4 : 2; } /* a block's scales */

/* Q4_K rows have a split layout where the build has AVX-512 VNNI (its int16 products read it; k4_split_at) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define K4_SPLIT 1
#endif

static inline int gguf_splittable(int64_t type) {
#if defined(K4_SPLIT)
    if (type == 12) return 1;
#endif
    return type == 2 || type == 3 || type == 8;
}

/* Whether rows of `type` have a split layout in this build (1 or 0) */
int dsv41_gguf_splittable(int64_t type) { return gguf_splittable(type); }

/* The split layout of Q4_K rows: each whole group of four blocks (576 bytes) as the four blocks' 16-byte heads (d,
 * dmin, the twelve bytes of six-bit scales and minimums) side by side, then their 512 bytes of nibbles as eight
 * 64-byte vectors: vector s holds word s (bytes 4s..4s + 3) of each block's four 32-byte chunks, block b's chunk c at
 * 4 (4b + c). A lane of a vector then holds one (block, chunk) in all eight: the low nibbles are 32 weights of one
 * sub-block, the high ones 32 of the next, so a sub-block's integer sums add up in one lane before its one scale,
 * and one 64-byte load gives the four blocks' scales, one block a 128-bit lane. The blocks past the last whole
 * group stay as in the file, at the same places. Where byte k (0..143) of block bi lies in such a row: */
static inline int64_t k4_split_at(int64_t bi, int k, int64_t blocks) {
    if (bi >= blocks / 4 * 4) return bi * 144 + k;
    const int64_t group = (bi / 4) * 576;
    const int b = (int)(bi % 4);
    if (k < 16) return group + 16 * b + k;
    const int q = k - 16;
    return group + 64 + 64 * ((q % 32) / 4) + 4 * (4 * b + q / 32) + q % 4;
}

/* Q4_K block bi of a split row into out (144 bytes, the file's order) */
static inline void k4_split_block(const uint8_t *row, int64_t blocks, int64_t bi, uint8_t *out) {
    memcpy(out, row + k4_split_at(bi, 0, blocks), 16);
    for (int k = 16; k < 144; k += 4) memcpy(out + k, row + k4_split_at(bi, k, blocks), 4);
}

/* Where byte k (0..15) of block bi's integers lies among a split Q4 row's integers (the row has `blocks` blocks) */
static inline int64_t q4_split_at(int64_t bi, int k, int64_t blocks) {
    if (bi >= blocks / Q4_GROUP * Q4_GROUP) return bi * 16 + k;
    return (bi / Q4_GROUP) * 16 * Q4_GROUP + (k / 4) * 4 * Q4_GROUP + (bi % Q4_GROUP) * 4 + k % 4;
}

/* Block bi's 16 bytes of integers from a split Q4 row's integers q (reassembled from four words in a group) */
static inline const uint8_t *q4_split_block(const uint8_t *q, int64_t bi, int64_t blocks, uint8_t *tmp) {
    if (bi >= blocks / Q4_GROUP * Q4_GROUP) return q + bi * 16;
    const uint8_t *at = q + q4_split_at(bi, 0, blocks);
    for (int s = 0; s < 4; s++) memcpy(tmp + 4 * s, at + 4 * Q4_GROUP * s, 4);
    return tmp;
}

/* block bi of a split row, reassembled in the file's order into out (gguf_block_bytes(type) bytes) */
static inline void split_block(int64_t type, const uint8_t *row, int64_t blocks, int64_t bi, uint8_t *out) {
    if (type == 12) {
        k4_split_block(row, blocks, bi, out);
        return;
    }
    const int64_t sb = split_scale_bytes(type), size = gguf_block_bytes(type);
    if (size <= sb) return;
    memcpy(out, row + 2 * bi, 2);
    if (type == 3) memcpy(out + 2, row + 2 * blocks + 2 * bi, 2);
    uint8_t q[16];
    if (type == 8)
        memcpy(out + sb, row + sb * blocks + bi * (size - sb), (size_t)(size - sb));
    else
        memcpy(out + sb, q4_split_block(row + sb * blocks, bi, blocks, q), 16);
}

static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static inline uint16_t u16_at(const uint8_t *b) { uint16_t v; memcpy(&v, b, 2); return v; }

/* One block's weights (gguf_block_weights of them) into out, exactly as the gguf package computes them. */
static void gguf_block_values(int64_t type, const uint8_t *b, float *out) {
    if (type == 2 || type == 3) {
        const float d = f16_to_f32(u16_at(b)), m = type == 3 ? f16_to_f32(u16_at(b + 2)) : 0.f;
        const uint8_t *qs = b + (type == 3 ? 4 : 2);
        for (int i = 0; i < 16; i++) {
            int lo = qs[i] & 0x0F, hi = qs[i] >> 4;
            if (type == 2) {
                out[i] = d * (float)(lo - 8);
                out[i + 16] = d * (float)(hi - 8);
            } else {
                out[i] = rounded(d * (float)lo) + m;
                out[i + 16] = rounded(d * (float)hi) + m;
            }
        }
    } else if (type == 8) {
        const float d = f16_to_f32(u16_at(b));
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int i = 0; i < 32; i++) out[i] = d * (float)qs[i];
    } else if (type == 12 || type == 13) {
        const float d = f16_to_f32(u16_at(b)), dmin = f16_to_f32(u16_at(b + 2));
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (type == 13 ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            k_scale_min(scales, j, &sc, &mn);
            const float ds = d * (float)sc, dm = dmin * (float)mn;
            const uint8_t *q = qs + (j / 2) * 32;
            const int shift = (j & 1) * 4;
            for (int i = 0; i < 32; i++) {
                int v = (q[i] >> shift) & 0x0F;
                if (type == 13) v |= ((qh[i] >> j) & 1) << 4;
                out[j * 32 + i] = rounded(ds * (float)v) - dm;
            }
        }
    } else if (type == 14) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = f16_to_f32(u16_at(b + 208));
        for (int a = 0; a < 2; a++)
            for (int t = 0; t < 128; t++) {
                const int e = a * 128 + t;
                const int lo = (ql[a * 64 + (t & 63)] >> ((t / 64) * 4)) & 0x0F;
                const int hi = (qh[a * 32 + (t & 31)] >> ((t / 32) * 2)) & 0x03;
                out[e] = (d * (float)scales[e / 16]) * (float)((lo | (hi << 4)) - 32);
            }
    }
}

#if defined(__AVX2__)
static inline __m256 barrier256(__m256 v) { /* as rounded(): the product is not fused with the next addition */
    __asm__("" : "+x"(v));
    return v;
}

/* gguf_block_values of a Q4_0 / Q4_1 / Q8_0 block, eight weights a vector (the same float32 operations) */
static inline void small_block_values(int64_t type, const uint8_t *b, float *out) {
    const __m256 d = _mm256_set1_ps(f16_to_f32(u16_at(b)));
    if (type == 8) {
        for (int i = 0; i < 32; i += 8) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + i)));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
        }
        return;
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + (type == 3 ? 4 : 2))), low = _mm_set1_epi8(0x0F);
    const __m128i nibbles[2] = {_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low)};
    const __m256 m = _mm256_set1_ps(type == 3 ? f16_to_f32(u16_at(b + 2)) : 0.f), eight = _mm256_set1_ps(8.f);
    for (int half = 0; half < 2; half++)
        for (int k = 0; k < 2; k++) {
            const __m128i bytes = k ? _mm_srli_si128(nibbles[half], 8) : nibbles[half];
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
            float *o = out + 16 * half + 8 * k;
            if (type == 2) _mm256_storeu_ps(o, _mm256_mul_ps(d, _mm256_sub_ps(q, eight)));
            else _mm256_storeu_ps(o, _mm256_add_ps(barrier256(_mm256_mul_ps(d, q)), m));
        }
}
#endif

/* One block's weights as float32: the vector path for the 32-weight formats where there is one */
#if defined(__AVX512F__)
static inline __m512 k_scales_mins(const uint8_t *b);
static inline __m512 barrier512(__m512 v);
/* A k-quant block's 256 values on 16 lanes, the same float32 operations as gguf_block_values (so bit for bit the
 * gguf package's): a prefill chunk dequantises every block of a layer, and a value at a time made that most of a
 * k-quant model's TTFT. */
static void k_block_values(int64_t type, const uint8_t *b, float *out) {
    float ds[16];
    if (type == 14) {
        const uint8_t *ql = b, *qh = b + 128;
        _mm512_storeu_ps(ds, _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(u16_at(b + 208))), _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))))));
        const __m512i m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(48), m32 = _mm512_set1_epi32(32);
        for (int half = 0; half < 2; half++)
            for (int l0 = 0; l0 < 32; l0 += 16) {
                const __m512i A = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 64 * half + l0)));
                const __m512i B = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 64 * half + 32 + l0)));
                const __m512i H = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 32 * half + l0)));
                const __m512i q[4] = {
                    _mm512_or_si512(_mm512_and_si512(A, m15), _mm512_and_si512(_mm512_slli_epi32(H, 4), m48)),
                    _mm512_or_si512(_mm512_and_si512(B, m15), _mm512_and_si512(_mm512_slli_epi32(H, 2), m48)),
                    _mm512_or_si512(_mm512_srli_epi32(A, 4), _mm512_and_si512(H, m48)),
                    _mm512_or_si512(_mm512_srli_epi32(B, 4), _mm512_and_si512(_mm512_srli_epi32(H, 2), m48))};
                for (int k = 0; k < 4; k++) {
                    const int t = 128 * half + 32 * k + l0;
                    _mm512_storeu_ps(out + t, _mm512_mul_ps(_mm512_set1_ps(ds[t / 16]),
                                                            _mm512_cvtepi32_ps(_mm512_sub_epi32(q[k], m32))));
                }
            }
        return;
    }
    _mm512_storeu_ps(ds, k_scales_mins(b)); /* d sc_j, then dmin m_j */
    const uint8_t *qh = b + 16, *qs = b + (type == 13 ? 48 : 16);
    const __m512i m15 = _mm512_set1_epi32(15), m16 = _mm512_set1_epi32(16);
    for (int c = 0; c < 4; c++)
        for (int half = 0; half < 2; half++) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c + 16 * half)));
            __m512i lo = _mm512_and_si512(v, m15), hi = _mm512_srli_epi32(v, 4);
            if (type == 13) {
                const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * half)));
                lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi32(_mm512_srl_epi32(h, _mm_cvtsi32_si128(2 * c)), 4), m16));
                hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi32(_mm512_srl_epi32(h, _mm_cvtsi32_si128(2 * c + 1)), 4), m16));
            }
            for (int u = 0; u < 2; u++) {
                const int j = 2 * c + u;
                const __m512 q = _mm512_cvtepi32_ps(u ? hi : lo);
                _mm512_storeu_ps(out + 32 * j + 16 * half, _mm512_sub_ps(
                    barrier512(_mm512_mul_ps(_mm512_set1_ps(ds[j]), q)), _mm512_set1_ps(ds[8 + j])));
            }
        }
}
#endif

static inline void block_floats(int64_t type, int64_t per, const uint8_t *b, float *out) {
#if defined(__AVX2__)
    if (per == 32) {
        small_block_values(type, b, out);
        return;
    }
#endif
#if defined(__AVX512F__)
    if (per == 256) {
        k_block_values(type, b, out);
        return;
    }
#endif
    (void)per;
    gguf_block_values(type, b, out);
}

/* Block i of n_blocks consecutive blocks (rows of row_blocks blocks when split): in place, or reassembled in tmp */
static inline const uint8_t *block_at(int64_t type, int split, const uint8_t *base, int64_t i, int64_t row_blocks,
                                      uint8_t *tmp) {
    const int64_t size = gguf_block_bytes(type);
    if (!split) return base + i * size;
    split_block(type, base + (i / row_blocks) * row_blocks * size, row_blocks, i % row_blocks, tmp);
    return tmp;
}

/* type's flags: GGUF_SPLIT for the 32-weight formats only, and rows of whole blocks */
static int gguf_type_ok(int64_t type, int64_t n_blocks, int64_t row_blocks) {
    const int64_t base = type & ~(int64_t)GGUF_SPLIT;
    if (!gguf_block_weights(base) || (type & ~(int64_t)(GGUF_SPLIT | 255))) return 0;
    return !(type & GGUF_SPLIT) || (gguf_splittable(base) && row_blocks > 0 && n_blocks % row_blocks == 0);
}

/* Dequantise n_blocks consecutive blocks of `type` into out (float32), on `threads` threads; row_blocks: blocks a
 * row (read only for the split layout). Returns 0, or -1 for a type not held. */
int dsv41_gguf_dequant(int64_t type, const void *blocks, float *out, int64_t n_blocks, int64_t row_blocks,
                       int threads) {
    if (!gguf_type_ok(type, n_blocks, row_blocks)) return -1;
    const int split = (type & GGUF_SPLIT) != 0;
    type &= 255;
    const int64_t per = gguf_block_weights(type);
    const uint8_t *base = (const uint8_t *)blocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (n_blocks >= 4096)
    for (int64_t i = 0; i < n_blocks; i++) {
        uint8_t tmp[256]; /* a block reassembled from the split layout (Q4_K: 144 bytes) */
        block_floats(type, per, block_at(type, split, base, i, row_blocks, tmp), out + i * per);
    }
    return 0;
}

/* Rows of the 32-weight formats rearranged in place between the file's layout and the split one (to_split: file ->
 * split; else back). Returns 0, -1 for a type without a split layout, -2 without memory. */
int dsv41_gguf_split(int64_t type, void *data, int64_t rows, int64_t cols, int to_split) {
    if (!gguf_splittable(type) || cols % gguf_block_weights(type)) return -1;
    const int64_t size = gguf_block_bytes(type), blocks = cols / gguf_block_weights(type), row_bytes = blocks * size,
                  sb = split_scale_bytes(type), qb = size - sb;
    uint8_t *tmp = malloc((size_t)row_bytes);
    if (!tmp) return -2;
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = (uint8_t *)data + r * row_bytes;
        memcpy(tmp, row, (size_t)row_bytes);
        for (int64_t bi = 0; bi < blocks; bi++) {
            if (to_split && type == 12) {
                const uint8_t *b = tmp + bi * size;
                memcpy(row + k4_split_at(bi, 0, blocks), b, 16);
                for (int k = 16; k < 144; k += 4) memcpy(row + k4_split_at(bi, k, blocks), b + k, 4);
            } else if (to_split) {
                const uint8_t *b = tmp + bi * size;
                memcpy(row + 2 * bi, b, 2);
                if (type == 3) memcpy(row + 2 * blocks + 2 * bi, b + 2, 2);
                if (type == 8)
                    memcpy(row + sb * blocks + bi * qb, b + sb, (size_t)qb);
                else
                    for (int s = 0; s < 4; s++) memcpy(row + sb * blocks + q4_split_at(bi, 4 * s, blocks), b + sb + 4 * s, 4);
            } else
                split_block(type, tmp, blocks, bi, row + bi * size);
        }
    }
    free(tmp);
    return 0;
}

/* The same values rounded to bf16 (round to nearest even, as torch's .to(torch.bfloat16)) into out: what a prefill
 * chunk multiplies, in one pass instead of float32 then a conversion (half the bytes written, none read back). */
#if defined(__AVX512F__)
static inline __m512 barrier512(__m512 v) { /* as barrier256 */
    __asm__("" : "+v"(v));
    return v;
}

/* bf16 of 16 floats, round to nearest even, NaN kept a quiet NaN (f32_to_bf16, sixteen at a time) */
static inline __m256i bf16_of16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_or_epi32(_mm512_srli_epi32(r, 16), nan, _mm512_srli_epi32(u, 16),
                                                      _mm512_set1_epi32(0x40)));
}

/* A Q4_0 / Q4_1 / Q8_0 block's 32 values (as gguf_block_values: d * q, then + m, two roundings) as bf16, from its
 * scale bytes d_at (and m_at, Q4_1) and its integers q (apart in the split layout, together in the file's) */
static inline void small_values_bf16(int64_t type, const uint8_t *d_at, const uint8_t *m_at, const uint8_t *q,
                                     uint16_t *o) {
    const __m512 d = _mm512_set1_ps(f16_to_f32(u16_at(d_at)));
    __m512 lo, hi;
    if (type == 8) {
        lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
        hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
    } else {
        const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        const __m512 ql = _mm512_permutexvar_ps(v, iota), qh = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), iota);
        if (type == 2) {
            const __m512 eight = _mm512_set1_ps(8.f);
            lo = _mm512_mul_ps(d, _mm512_sub_ps(ql, eight));
            hi = _mm512_mul_ps(d, _mm512_sub_ps(qh, eight));
        } else {
            const __m512 m = _mm512_set1_ps(f16_to_f32(u16_at(m_at)));
            lo = _mm512_add_ps(barrier512(_mm512_mul_ps(d, ql)), m);
            hi = _mm512_add_ps(barrier512(_mm512_mul_ps(d, qh)), m);
        }
    }
#if defined(__AVX512BF16__)
    /* one instruction for the 32 (round to nearest even as bf16_of16; it flushes float32 denormals, which
     * these values never are: products and sums of float16 numbers, zero or at least ~6e-8 apart) */
    _mm512_storeu_si512((void *)o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
    _mm256_storeu_si256((__m256i *)o, bf16_of16(lo));
    _mm256_storeu_si256((__m256i *)(o + 16), bf16_of16(hi));
#endif
}

static inline void small_block_bf16(int64_t type, const uint8_t *b, uint16_t *o) {
    small_values_bf16(type, b, b + 2, b + (type == 3 ? 4 : 2), o);
}
#endif

/* Block i's `per` weights as bf16 into o (type without the split flag; `split`: the rows' layout) */
static inline void block_bf16(int64_t type, int64_t per, int split, const uint8_t *base, int64_t i, int64_t row_blocks,
                              uint16_t *o) {
#if defined(__AVX512F__)
    if (per == 32 && split) { /* read in place: a row's scales side by side, then its blocks' integers */
        const int64_t sb = split_scale_bytes(type), qb = gguf_block_bytes(type) - sb, b = i % row_blocks;
        const uint8_t *row = base + (i / row_blocks) * row_blocks * (sb + qb);
        uint8_t q[16];
        small_values_bf16(type, row + 2 * b, row + 2 * row_blocks + 2 * b,
                          type == 8 ? row + sb * row_blocks + b * qb : q4_split_block(row + sb * row_blocks, b, row_blocks, q), o);
        return;
    }
#endif
    float vals[256];
    uint8_t tmp[256]; /* a block reassembled from the split layout (Q4_K: 144 bytes) */
    const uint8_t *b = block_at(type, split, base, i, row_blocks, tmp);
#if defined(__AVX512F__)
    if (per == 32) {
        small_block_bf16(type, b, o);
        return;
    }
#endif
    block_floats(type, per, b, vals);
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k < per; k += 16) _mm256_storeu_si256((__m256i *)(o + k), bf16_of16(_mm512_loadu_ps(vals + k)));
#endif
    for (; k < per; k++) o[k] = f32_to_bf16(vals[k]);
}

int dsv41_gguf_dequant_bf16(int64_t type, const void *blocks, uint16_t *out, int64_t n_blocks, int64_t row_blocks,
                            int threads) {
    if (!gguf_type_ok(type, n_blocks, row_blocks)) return -1;
    const int split = (type & GGUF_SPLIT) != 0;
    type &= 255;
    const int64_t per = gguf_block_weights(type);
    const uint8_t *base = (const uint8_t *)blocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (n_blocks >= 4096)
    for (int64_t i = 0; i < n_blocks; i++) block_bf16(type, per, split, base, i, row_blocks, out + i * per);
    return 0;
}

/* A few rows of activations times GGUF blocks, the blocks dequantised to bf16 a tile of MM_TILE rows at a time into a
 * buffer that stays in cache (what a short prefill chunk, a follow-up's question, multiplies: dequantising a whole
 * matrix to memory and reading it back for a GEMM cost more than the products at a few rows).
 * y[t, r] (row t at y + t * y_stride) = sum_k x[t, k] * w[r, k] for x [m, cols] bf16 (rows x_stride apart) and w the
 * blocks' values rounded to bf16, as dsv41_gguf_dequant_bf16 writes them; the products are exact in float32 and
 * accumulated in float32 (the order differs from a GEMM's: within float32 rounding of the same sum). */
#define MM_TILE 16
#define MM_ROWS 4 /* weight rows and activation rows a register block */

static inline float bf16_value(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* out[i][j] = dot(w row i, x row j) for i < MM_ROWS, j < nt: the register block */
static inline __attribute__((always_inline)) void mm_block(const uint16_t *w, int64_t cols, const uint16_t *x,
                                                          int64_t x_stride, int nt, float out[MM_ROWS][MM_ROWS]) {
#if defined(__AVX512BF16__)
    __m512 acc[MM_ROWS][MM_ROWS];
    for (int i = 0; i < MM_ROWS; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < cols; k += 32) {
        __m512bh xs[MM_ROWS];
        for (int j = 0; j < nt; j++) xs[j] = (__m512bh)_mm512_loadu_si512((const void *)(x + j * x_stride + k));
        for (int i = 0; i < MM_ROWS; i++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + i * cols + k));
            for (int j = 0; j < nt; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xs[j]);
        }
    }
    for (int i = 0; i < MM_ROWS; i++)
        for (int j = 0; j < nt; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#else
    /* widened to float32, 16 partial sums a pair (independent lanes: the compiler vectorises them) */
    for (int i = 0; i < MM_ROWS; i++)
        for (int j = 0; j < nt; j++) {
            float part[16] = {0};
            const uint16_t *wr = w + i * cols, *xr = x + j * x_stride;
            for (int64_t k = 0; k < cols; k += 16)
                for (int l = 0; l < 16; l++) part[l] += bf16_value(wr[k + l]) * bf16_value(xr[k + l]);
            float s = 0.f;
            for (int l = 0; l < 16; l++) s += part[l];
            out[i][j] = s;
        }
#endif
}

int dsv41_gguf_mm_bf16(int64_t type, const void *blocks, int64_t rows, int64_t cols, const uint16_t *x, int64_t m,
                       int64_t x_stride, float *y, int64_t y_stride, int threads) {
    const int64_t per = gguf_block_weights(type & 255);
    if (!per || cols % per || rows < 0 || m < 0 || x_stride < cols || y_stride < rows) return -1;
    const int64_t row_blocks = cols / per;
    if (!gguf_type_ok(type, rows * row_blocks, row_blocks)) return -1;
    const int split = (type & GGUF_SPLIT) != 0;
    const int64_t base_type = type & 255, tiles = (rows + MM_TILE - 1) / MM_TILE;
    const uint8_t *base = (const uint8_t *)blocks;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (tiles > 1)
    {
        uint16_t *w = malloc((size_t)(MM_TILE * cols) * sizeof(uint16_t));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (!w) continue;
            const int64_t r0 = tile * MM_TILE, n = rows - r0 < MM_TILE ? rows - r0 : MM_TILE;
            for (int64_t r = 0; r < n; r++)
                for (int64_t b = 0; b < row_blocks; b++)
                    block_bf16(base_type, per, split, base, (r0 + r) * row_blocks + b, row_blocks, w + r * cols + b * per);
            for (int64_t r = n; r < MM_TILE; r++) memset(w + r * cols, 0, (size_t)cols * sizeof(uint16_t));
            for (int64_t i0 = 0; i0 < n; i0 += MM_ROWS)
                for (int64_t t0 = 0; t0 < m; t0 += MM_ROWS) {
                    float out[MM_ROWS][MM_ROWS];
                    const int nt = m - t0 < MM_ROWS ? (int)(m - t0) : MM_ROWS;
                    const uint16_t *wi = w + i0 * cols, *xt = x + t0 * x_stride;
                    switch (nt) {
                    case 4: mm_block(wi, cols, xt, x_stride, 4, out); break;
                    case 3: mm_block(wi, cols, xt, x_stride, 3, out); break;
                    case 2: mm_block(wi, cols, xt, x_stride, 2, out); break;
                    default: mm_block(wi, cols, xt, x_stride, 1, out); break;
                    }
                    for (int i = 0; i < MM_ROWS && i0 + i < n; i++)
                        for (int j = 0; j < nt; j++) y[(t0 + j) * y_stride + r0 + i0 + i] = out[i][j];
                }
        }
        free(w);
    }
    return failed ? -2 : 0;
}

static inline float f16_load(const uint8_t *b) {
#if defined(__F16C__)
    return _cvtsh_ss(u16_at(b));
#else
    return f16_to_f32(u16_at(b));
#endif
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#ifdef __AVX512F__
/* Scales d (and minimums m, or d again when the format has none) of the 16 blocks from block c of one row:
 * side by side in the split layout (plain loads), gathered from the blocks in the file's layout. */
static inline void block_scales(const uint8_t *row, int64_t c, __mmask16 live, int split, int with_min, int64_t m_at,
                                __m512i gather_at, int64_t size, __m512 *d, __m512 *m) {
    if (split) {
        *d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, row + 2 * c));
        *m = with_min ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, row + m_at + 2 * c)) : *d;
    } else {
        const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, gather_at,
                                                      (const void *)(row + c * size), 1);
        *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
        *m = with_min ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))) : *d;
    }
}
/* Four rows from r (a short last group repeats its last row; n, the real ones, are stored) and their zeroed
 * accumulators: the row loop of the Q4 products on int8 and bf16 x. */
static inline int64_t row_group4(const uint8_t *w, int64_t r, int64_t r1, int64_t row_bytes, const uint8_t **rowp,
                                 __m512 *a, __m512 *extra) {
    const int64_t n = r1 - r < 4 ? r1 - r : 4;
    for (int j = 0; j < 4; j++) {
        rowp[j] = w + (r + (j < n ? j : n - 1)) * row_bytes;
        a[j] = extra[j] = _mm512_setzero_ps();
    }
    return n;
}


#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
static inline int32_t i32_at(const uint8_t *b) { int32_t v; memcpy(&v, b, 4); return v; }
/* Block bi's 16 bytes of integers from a Q4 row's integers q: in place in the file's layout (step: the blocks'
 * stride), or from the split layout (step 0), where a block of a whole group of 16 is four words 64 bytes apart */
static inline __m128i q4_block_bytes(const uint8_t *q, int64_t bi, int64_t step, int64_t blocks) {
    if (step) return _mm_loadu_si128((const __m128i *)(q + bi * step));
    if (bi >= blocks / Q4_GROUP * Q4_GROUP) return _mm_loadu_si128((const __m128i *)(q + bi * 16));
    const uint8_t *at = q + q4_split_at(bi, 0, blocks);
    return _mm_set_epi32(i32_at(at + 12 * Q4_GROUP), i32_at(at + 8 * Q4_GROUP), i32_at(at + 4 * Q4_GROUP), i32_at(at));
}
#endif

#if defined(__AVX512F__)
/* float32 x for the whole groups of 16 interleaved Q4 blocks (the first `grouped` blocks): per group, quarter u (its
 * blocks 4u..4u + 3) and chunk s, 16 floats against the low nibbles (lane 4i + t: weight 4s + t of block 4u + i),
 * then 16 against the high ones (weight 16 + 4s + t): 512 floats a group */
static inline void q4_float_x(const float *x, int64_t grouped, float *xg) {
    for (int64_t q = 0; q < grouped / 4; q++) /* four blocks: xg + (16 (q / 4) + 4 (q % 4) + s) 32 + 16 half */
        for (int s = 0; s < 4; s++)
            for (int half = 0; half < 2; half++) {
                const float *from = x + q * 128 + 16 * half + 4 * s;
                __m512 v = _mm512_castps128_ps512(_mm_loadu_ps(from));
                v = _mm512_insertf32x4(v, _mm_loadu_ps(from + 32), 1);
                v = _mm512_insertf32x4(v, _mm_loadu_ps(from + 64), 2);
                v = _mm512_insertf32x4(v, _mm_loadu_ps(from + 96), 3);
                _mm512_storeu_ps(xg + (16 * (q / 4) + 4 * (q % 4) + s) * 32 + 16 * half, v);
            }
}
#endif

/* Q4_0 / Q4_1 rows on float32 x, 32 weights a block: sum_b d_b * (q_b . x_b) [+ m_b * sum(x_b) for Q4_1, - 8 d_b
 * sum(x_b) for Q4_0], the dot of each block's nibbles with x in float32 lanes, scaled by the block's d into the row's
 * accumulator (the values multiplied are d * q exactly; only the order of the float32 sums differs from
 * multiplying the dequantised row). xsum: x's sum over each block of 32. Q8_0 has rows_q8_0. */
static void rows_small_blocks(int64_t type, int split, const uint8_t *w, const float *x, const float *xsum,
                              const float *xperm, float *y, int64_t r0, int64_t r1, int64_t cols, int acc) {
    const int64_t size = gguf_block_bytes(type), blocks = cols / 32, row_bytes = blocks * size;
    const int with_min = type == 3;
    /* block bi's integers at row + q_at + bi * q_step; its d at row + bi * d_step, m (Q4_1) m_at after d */
    const int64_t q_at = split ? blocks * split_scale_bytes(type) : (with_min ? 4 : 2),
                  q_step = split ? size - split_scale_bytes(type) : size, d_step = split ? 2 : size,
                  m_at = split ? 2 * blocks : 2;
    int64_t r = r0;
#if defined(__AVX512F__)
    /* four rows at a time (the last group may be short): four independent accumulator chains over the same x and xsum.
     * A Q4 block's 16 bytes are widened to one byte per dword lane (lane j: byte j, whose low nibble is weight j and
     * high nibble weight j + 16), and each nibble becomes its float by a table look-up: vpermps reads only the low
     * four bits of each index lane, so the table 0..15 turns the widened bytes (and the bytes shifted right by 4)
     * into the floats of their nibbles without a mask or an int-to-float conversion. The scales of 16 blocks of a
     * row come in one gather (the first dword of each block: d, and m for Q4_1), converted from f16 together, so
     * a block's d reaches its FMA as a broadcast from memory, and the min / -8 d term is a vector FMA with xsum:
     * converting each block's f16 scales one by one cost more than the product itself. */
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i gather_at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                 _mm512_set1_epi32((int)size));
    (void)d_step;
    for (; r < r1; r += 4) {
        const int64_t n = r1 - r < 4 ? r1 - r : 4; /* the last group may be short: its missing rows repeat the
                                                     * last one and are not stored */
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        __m512 extra[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        const uint8_t *rowp[4];
        for (int j = 0; j < 4; j++) rowp[j] = w + (r + (j < n ? j : n - 1)) * row_bytes;
        for (int64_t c = 0; c < blocks; c += 16) {
            const int64_t nb = blocks - c < 16 ? blocks - c : 16;
            const __mmask16 live = (__mmask16)((1u << nb) - 1u);
            float scale[4][16];
            for (int j = 0; j < 4; j++) {
                __m512 d, m;
                block_scales(rowp[j], c, live, split, with_min, m_at, gather_at, size, &d, &m);
                _mm512_storeu_ps(scale[j], d);
                if (!with_min) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
                extra[j] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(live, xsum + c), extra[j]);
            }
            if (split && nb == Q4_GROUP) {
                /* an interleaved group, a quarter (four blocks) at a time: 16 bytes of chunk s widened are bytes
                 * 4s..4s + 3 of the quarter's blocks, against x as q4_float_x lays it out; each block's sum over its
                 * four chunks in its four lanes, then times its d */
                const float *xg = xperm + c * 32;
                for (int u = 0; u < 4; u++) {
                    __m512 t[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                    for (int s = 0; s < 4; s++) {
                        const __m512 xl = _mm512_loadu_ps(xg + (4 * u + s) * 32), xh = _mm512_loadu_ps(xg + (4 * u + s) * 32 + 16);
#pragma GCC unroll 4
                        for (int j = 0; j < 4; j++) {
                            const uint8_t *b = rowp[j] + q_at + c * 16 + 64 * s + 16 * u;
                            if (u == 0) _mm_prefetch((const char *)(b + 16 * row_bytes), _MM_HINT_T0);
                            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
                            t[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, iota), xl, t[j]);
                            t[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), iota), xh, t[j]);
                        }
                    }
                    const __m512i pick = _mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                                          _mm512_set1_epi32(4 * u));
                    for (int j = 0; j < 4; j++)
                        a[j] = _mm512_fmadd_ps(t[j], _mm512_permutexvar_ps(pick, _mm512_loadu_ps(scale[j])), a[j]);
                }
                continue;
            }
            for (int64_t k = 0; k < nb; k++) {
                const int64_t bi = c + k;
                const float *xb = x + bi * 32;
                const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const uint8_t *b = rowp[j] + q_at + bi * q_step;
                    _mm_prefetch((const char *)(b + 16 * row_bytes), _MM_HINT_T0); /* four groups of rows ahead */
                    const __m512i v = _mm512_cvtepu8_epi32(q4_block_bytes(rowp[j] + q_at, bi, split ? 0 : q_step, blocks));
                    __m512 t = _mm512_mul_ps(_mm512_permutexvar_ps(v, iota), x0);
                    t = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), iota), x1, t);
                    a[j] = _mm512_fmadd_ps(t, _mm512_set1_ps(scale[j][k]), a[j]);
                }
            }
        }
        store4(y, r, n, _mm512_add_ps(a[0], extra[0]), _mm512_add_ps(a[1], extra[1]), _mm512_add_ps(a[2], extra[2]),
               _mm512_add_ps(a[3], extra[3]), acc);
    }
#else
    /* vpermps of 8 lanes cannot look up 16 nibbles: each dword lane shifts out its own byte of the broadcast
     * nibbles instead, in xperm's order (lanes of the first vector: bytes 0 4 8 12 1 5 9 13; of the second: 2 6 10
     * 14 3 7 11 15), so no byte shuffle is needed */
    const __m256i nib = _mm256_set1_epi32(0x0F);
    const __m256i shift_a = _mm256_set_epi32(8, 8, 8, 8, 0, 0, 0, 0), shift_b = _mm256_set_epi32(24, 24, 24, 24, 16, 16, 16, 16);
    const __m256i shift_a4 = _mm256_add_epi32(shift_a, _mm256_set1_epi32(4)),
                  shift_b4 = _mm256_add_epi32(shift_b, _mm256_set1_epi32(4));
    for (; r < r1; r += 4) {
        const int64_t n = r1 - r < 4 ? r1 - r : 4; /* as above: a short last group */
        __m256 a[4][2];
        float extra[4] = {0.f, 0.f, 0.f, 0.f};
        const uint8_t *rowp[4];
        for (int j = 0; j < 4; j++) {
            rowp[j] = w + (r + (j < n ? j : n - 1)) * row_bytes;
            a[j][0] = a[j][1] = _mm256_setzero_ps();
        }
        for (int64_t bi = 0; bi < blocks; bi++) {
            const float *xp = xperm + bi * 32;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const uint8_t *b = rowp[j] + q_at + bi * q_step, *ds = rowp[j] + bi * d_step;
                _mm_prefetch((const char *)(b + 16 * row_bytes), _MM_HINT_T0); /* four groups of rows ahead */
                const float dv = f16_load(ds);
                const __m256 d = _mm256_set1_ps(dv);
                const __m256i v = _mm256_broadcastsi128_si256(q4_block_bytes(rowp[j] + q_at, bi, split ? 0 : q_step, blocks));
                __m256 t0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, shift_a), nib)),
                                          _mm256_loadu_ps(xp));
                __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, shift_b), nib)),
                                          _mm256_loadu_ps(xp + 8));
                t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, shift_a4), nib)),
                                     _mm256_loadu_ps(xp + 16), t0);
                t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, shift_b4), nib)),
                                     _mm256_loadu_ps(xp + 24), t1);
                extra[j] += (with_min ? f16_load(ds + m_at) : -8.f * dv) * xsum[bi];
                a[j][0] = _mm256_fmadd_ps(t0, d, a[j][0]);
                a[j][1] = _mm256_fmadd_ps(t1, d, a[j][1]);
            }
        }
        for (int j = 0; j < n; j++) store(y, r + j, hsum256(_mm256_add_ps(a[j][0], a[j][1])) + extra[j], acc);
    }
#endif
}
#endif

/* x for a whole group of 16 interleaved Q4 blocks (q4_split_at), `planes` bytes a value (int8 x: 1; int16 x: 2, its
 * high byte, the low one 128 bytes after): chunk s of the group's weights takes 128 planes bytes of x, for each
 * plane 64 bytes against the chunk's low nibbles (weights 4s..4s + 3 of each block, 4 bytes a block) and 64 against
 * its high ones (weights 16 + 4s..). Where weight i of block b's (high) byte lies; the group of 16 blocks takes
 * 512 planes bytes, what 16 blocks take in the layouts of one block or four after another, so a row's last blocks
 * outside the groups keep those layouts at the same places. */
static inline int64_t q4_x_at(int64_t b, int i, int planes) {
    return (b / Q4_GROUP) * 32 * Q4_GROUP * planes + ((i % 16) / 4) * 128 * planes + (i / 16) * 64 + (b % Q4_GROUP) * 4 + i % 4;
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define DSV41_Q4_INT16_AVX2 1
/* The int16 mode's Q4 product on AVX2 (no VNNI): x rounded to int16 per block of 32 as on AVX-512 (scale max |x| /
 * 32639, NaN where a value is not finite), its high and low bytes stored per block in the weights' order (32 h,
 * then 32 l); a block's 32 nibbles as unsigned bytes in one ymm (bytes 0-15 the low nibbles: weights 0-15, 16-31 the
 * high ones), vpmaddubsw against h and against l (pair sums at most 2 * 15 * 128: no saturation), widened by
 * vpmaddwd with 256 and with 1 (x16_dot_avx2): the exact integer sum of q x16 over four weights a lane, converted exactly, times
 * d dx. About half the instructions of the float32 loop above, four rows at a time over the same x, the rows ahead
 * streamed into L2 (group_stream: the step's products 11.7 -> 7.3 ms on an AMD EPYC with AVX2 alone, where a
 * prefetch into L1 per row left them at 46 % of the rate their bytes read at). The whole
 * groups of a split row (interleaved, q4_split_at) go eight blocks a ymm, a block's sums in its own lane over the
 * group's four chunks, then one conversion and multiply-add per eight blocks; their x as q4_x_at lays it out
 * (q16_blocks' `grouped`: the first blocks that many). */
/* One block of 32 x rounded for the integer routes (top: 127 or 32639 = max |x| / scale): the rounded values' 32-bit
 * integers in q[4] (weights 0-7, 8-15, 16-23, 24-31), the scale, NaN where a value is not finite (its integers then
 * 0). The rounding is the multiply and the round to nearest even of _mm256_cvtps_epi32, as lrintf rounds. */
static inline float x_block_ints(const float *xs, float top, __m256i q[4]) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps(), z = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(xs + 8 * k);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
        z = _mm256_fmadd_ps(v[k], _mm256_setzero_ps(), z); /* 0 unless some value is NaN or infinite */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const int finite = hsum256(z) == 0.f;
    const float amax = finite ? _mm_cvtss_f32(m4) : __builtin_nanf("");
    const __m256 inv = _mm256_set1_ps(finite && amax > 0.f ? top / amax : 0.f);
    for (int k = 0; k < 4; k++) q[k] = finite ? _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv)) : _mm256_setzero_si256();
    return amax / top;
}
/* 32 int32 lanes (each within int8) as 32 bytes in their order */
static inline __m256i ints_to_bytes(const __m256i q[4]) {
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0));
}
static inline int32_t isum256(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
/* The end of the Q4 blocks after the whole groups (from `grouped`) that the AVX2 integer loops take two at a time */
static inline int64_t q4_paired_end(int64_t blocks, int64_t grouped) { return grouped + (blocks - grouped) / 2 * 2; }
/* Block b's x bytes (weights 0-31 in order; one plane) where a pair of blocks from `from` takes them: the pair's
 * first 32 bytes its two blocks' weights 0-15 (the first block's, then the second's), the next 32 their weights 16-31,
 * as the pair's low and high nibbles hold the weights; int16 x's low-byte plane `plane_at` after */
static inline void xq_pair_store(int8_t *xq, int64_t b, int64_t from, int planes, int64_t plane_at, __m256i bytes) {
    int8_t *at = xq + (b - (b - from) % 2) * 32 * planes + plane_at + 16 * ((b - from) % 2);
    _mm_storeu_si128((__m128i *)at, _mm256_castsi256_si128(bytes));
    _mm_storeu_si128((__m128i *)(at + 32), _mm256_extracti128_si256(bytes, 1));
}
/* 32 bytes of block b's x (weights 0-31 in order) where q4_x_at puts them in a whole interleaved group: four bytes
 * at a time */
static inline void q4_x_scatter(int8_t *xq, int64_t b, int planes, __m256i bytes) {
    _Alignas(32) int32_t w[8];
    _mm256_store_si256((__m256i *)w, bytes);
    for (int k = 0; k < 8; k++) memcpy(xq + q4_x_at(b, 4 * k, planes), w + k, 4);
}

static void q16_blocks(const float *x, int64_t blocks, int8_t *xq, float *dx, float *xsum, float *xsum16,
                       int64_t grouped, int64_t paired) {
    const __m256i b128 = _mm256_set1_epi32(128);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i q[4], h[4], l[4];
        dx[b] = x_block_ints(x + b * 32, 32639.f, q);
        for (int k = 0; k < 4; k++) {
            h[k] = _mm256_srai_epi32(_mm256_add_epi32(q[k], b128), 8);
            l[k] = _mm256_sub_epi32(q[k], _mm256_slli_epi32(h[k], 8));
        }
        const __m256i hb = ints_to_bytes(h), lb = ints_to_bytes(l);
        if (b < grouped) { /* a whole group of interleaved Q4 integers: q4_x_at, the low bytes 128 after the high */
            q4_x_scatter(xq, b, 2, hb);
            q4_x_scatter(xq + 128, b, 2, lb);
        } else if (b < paired) { /* blocks two at a time (rows_q4_int_avx2): h planes, then l 64 after */
            xq_pair_store(xq, b, grouped, 2, 0, hb);
            xq_pair_store(xq, b, grouped, 2, 64, lb);
        } else {
            _mm256_storeu_si256((__m256i *)(xq + b * 64), hb);
            _mm256_storeu_si256((__m256i *)(xq + b * 64 + 32), lb);
        }
        const int32_t s0 = isum256(_mm256_add_epi32(q[0], q[1])), s1 = isum256(_mm256_add_epi32(q[2], q[3]));
        xsum[b] = dx[b] * (float)(s0 + s1);
        if (xsum16) { /* Q6_K's -32 against each sub-block of 16 */
            xsum16[2 * b] = 32.f * (dx[b] * (float)s0);
            xsum16[2 * b + 1] = 32.f * (dx[b] * (float)s1);
        }
    }
}

/* The exact integer sums of 32 unsigned bytes q times x's high bytes h and low bytes l (x16 = 256 h + l), four
 * weights a lane: vpmaddubsw's pair sums (at most 2 * 63 * 128: no saturation) widened by vpmaddwd with 256 and 1. */
static inline __m256i x16_dot_avx2(__m256i q, __m256i h, __m256i l) {
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(q, h), _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(q, l), _mm256_set1_epi16(1)));
}
static inline __m256i x16_dot_avx2_at(__m256i q, const int8_t *x) { /* h at x, l at x + 32 (q16_blocks' layout) */
    return x16_dot_avx2(q, _mm256_loadu_si256((const __m256i *)x), _mm256_loadu_si256((const __m256i *)(x + 32)));
}

/* Eight consecutive float16 numbers as float32 */
static inline __m256 f16x8(const uint8_t *p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = f16_to_f32(u16_at(p + 2 * i));
    return _mm256_loadu_ps(f);
#endif
}


/* The int8 mode's Q4 product on AVX2 (what llama.cpp's AVX2 Q4 x Q8 product does): x rounded to int8 per block of 32
 * (scale max |x| / 127, NaN where a value is not finite), one vpmaddubsw of the nibbles against it (pair sums at
 * most 2 * 15 * 127) where int16 x takes two and two vpmaddwd. The whole groups of a split row (q4_split_at) add
 * their four chunks' pair sums in int16 (8 * 2 * 15 * 127 = 30,480: no overflow) and widen them once per eight
 * blocks, a block in its own lane; x laid out by q4_x_at with one plane (the first `grouped` blocks), the rest 32
 * bytes a block in the weights' order. */
static void q8_blocks(const float *x, int64_t blocks, int8_t *xq, float *dx, float *xsum, int64_t grouped,
                      int64_t paired) {
    for (int64_t b = 0; b < blocks; b++) {
        __m256i q[4];
        dx[b] = x_block_ints(x + b * 32, 127.f, q);
        const __m256i bytes = ints_to_bytes(q);
        if (b < grouped) q4_x_scatter(xq, b, 1, bytes);
        else if (b < paired) xq_pair_store(xq, b, grouped, 1, 0, bytes);
        else _mm256_storeu_si256((__m256i *)(xq + b * 32), bytes);
        xsum[b] = dx[b] * (float)isum256(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    }
}

/* x rounded to int16 per block of 32 (as q16_blocks) as 32 int16 words a block, in order: what vpmaddwd takes
 * against Q8_0's integers widened to int16 (rows_q8_0_int16_avx2). */
static void x16_words(const float *x, int64_t blocks, int16_t *xw, float *dx) {
    for (int64_t b = 0; b < blocks; b++) {
        __m256i q[4];
        dx[b] = x_block_ints(x + b * 32, 32639.f, q);
        _mm256_storeu_si256((__m256i *)(xw + b * 32), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
        _mm256_storeu_si256((__m256i *)(xw + b * 32 + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
    }
}

/* Q8_0 rows on int16 x (the integer modes on AVX2): a block's 32 int8 weights widened to int16 and multiplied with
 * vpmaddwd (pair sums at most 2 * 128 * 32639: exact), its eight lanes of sums converted once and scaled by d dx;
 * four rows at a time over the same x, the rows ahead streamed into L2 (group_stream). Where the float32 loop
 * widens every weight to float32, about half the instructions. */
static void rows_q8_0_int16_avx2(int split, const uint8_t *w, const int16_t *xw, const float *dx, float *y,
                                 int64_t r0, int64_t r1, int64_t cols, int acc) {
    const int64_t blocks = cols / 32, row_bytes = blocks * 34, q_at = split ? 2 * blocks : 2, q_step = split ? 32 : 34,
                  d_step = split ? 2 : 34;
    Stream st = group_stream(w, r0, r1, row_bytes, blocks);
    for (int64_t r = r0; r < r1; r += 4) {
        const int64_t n = r1 - r < 4 ? r1 - r : 4; /* a short last group repeats its last row, not stored */
        __m256 a[4];
        const uint8_t *rowp[4];
        for (int j = 0; j < 4; j++) {
            rowp[j] = w + (r + (j < n ? j : n - 1)) * row_bytes;
            a[j] = _mm256_setzero_ps();
        }
        for (int64_t bi = 0; bi < blocks; bi++) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xw + bi * 32)),
                          x1 = _mm256_loadu_si256((const __m256i *)(xw + bi * 32 + 16));
            const float dxb = dx[bi];
            group_stream_to(&st, w, r, row_bytes, bi + 1);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const uint8_t *b = rowp[j] + q_at + bi * q_step, *ds = rowp[j] + bi * d_step;
                const __m256i t = _mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b)), x0),
                    _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 16))), x1));
                a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(f16_load(ds) * dxb), a[j]);
            }
        }
        for (int j = 0; j < n; j++) store(y, r + j, hsum256(a[j]), acc);
    }
}

/* Two neighbouring blocks' fp16 numbers (4 bytes as read) as eight floats, each block's in four lanes: lanes 0-3 the
 * first's, 4-7 the second's (the lanes a pair's integer sums land in) */
static inline __m256 f16_pair(uint32_t two) {
#if defined(__F16C__)
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)two));
#else
    const __m128 f = _mm_set_ps(0.f, 0.f, f16_to_f32((uint16_t)(two >> 16)), f16_to_f32((uint16_t)two));
#endif
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
}

/* The Q4 loop of both integer modes: x as int16 (planes 2: its high and low bytes) or as int8 (planes 1: one
 * vpmaddubsw per 32 weights). A group of four rows goes `pass` rows at a time, each pass over its rows' whole length
 * (its float sums stay in registers). In a whole group a lane's pair sums over the group's four chunks are added in
 * int16 (16 products of a nibble and a byte: at most 16 * 15 * 128 = 30,720, no overflow) and widened once a group,
 * the high bytes' by vpmaddwd with 256 and the low bytes' with 1: the same exact integer sums as x16_dot_avx2 per
 * chunk, with a third fewer instructions. The blocks after the whole groups (the default model's 576-column rows:
 * two) go two at a time: the pair's 32 bytes of integers in one ymm (in the split layout they are side by side;
 * in the file's, two loads), its low nibbles the two blocks' weights 0-15 and its high ones 16-31, against x laid
 * out to match (xq_pair_store), the pair's sums in lanes 0-3 and 4-7, scaled by the two blocks' d dx and with
 * their minimum terms in one multiply-add each; a last odd block alone. `planes` is a constant where this is
 * inlined. */
static inline __attribute__((always_inline)) void rows_q4_int_avx2(const int planes, int64_t type, int split,
                                                                   const uint8_t *w, const int8_t *xq,
                                                                   const float *dx, const float *xsum, float *y,
                                                                   int64_t r0, int64_t r1, int64_t cols, int acc) {
    const int64_t size = gguf_block_bytes(type), blocks = cols / 32, row_bytes = blocks * size;
    const int with_min = type == 3;
    const int64_t q_at = split ? blocks * split_scale_bytes(type) : (with_min ? 4 : 2),
                  q_step = split ? size - split_scale_bytes(type) : size, d_step = split ? 2 : size,
                  m_at = split ? 2 * blocks : 2;
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m256i nib32 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), w256 = _mm256_set1_epi16(256);
    const int64_t grouped = split ? blocks / Q4_GROUP * Q4_GROUP : 0, paired = q4_paired_end(blocks, grouped);
    /* int16 x: two rows a pass (four rows' int16 sums, the x vectors and the float sums do not fit in the 16 ymm
     * registers: they spilled to the stack); int8 x: four. The empty asm after a chunk keeps each row's int16 sums
     * added chunk by chunk: without it GCC kept every product apart on the stack and added them at the end. */
    const int pass = planes == 2 ? 2 : 4;
    Stream st = group_stream(w, r0, r1, row_bytes, blocks);
    for (int64_t r = r0; r < r1; r += 4) {
        const int64_t n = r1 - r < 4 ? r1 - r : 4; /* a short last group repeats its last row, not stored */
        const uint8_t *rowp[4];
        for (int j = 0; j < 4; j++) rowp[j] = w + (r + (j < n ? j : n - 1)) * row_bytes;
        for (int j0 = 0; j0 < n; j0 += pass) {
            __m256 a[4];
            float extra[4] = {0.f, 0.f, 0.f, 0.f};
            for (int j = 0; j < pass; j++) a[j] = _mm256_setzero_ps();
            for (int64_t c = 0; c < grouped; c += Q4_GROUP) /* whole groups of interleaved blocks, eight a ymm */
                for (int hv = 0; hv < 2; hv++) {
                    group_stream_to(&st, w, r, row_bytes, c + 8 * hv + 8);
                    const __m256 dxv = _mm256_loadu_ps(dx + c + 8 * hv), xs = _mm256_loadu_ps(xsum + c + 8 * hv);
                    __m256i t[4], tl[4];
                    for (int j = 0; j < pass; j++) t[j] = tl[j] = _mm256_setzero_si256();
                    for (int s = 0; s < 4; s++) {
                        /* x against the chunk's low nibbles at xg, its high ones 64 after; int16 x's low bytes 128
                         * after */
                        const int8_t *xg = xq + q4_x_at(c, 4 * s, planes) + 32 * hv;
                        const __m256i lh = _mm256_loadu_si256((const __m256i *)xg),
                                      hh = _mm256_loadu_si256((const __m256i *)(xg + 64));
                        const __m256i ll = planes == 2 ? _mm256_loadu_si256((const __m256i *)(xg + 128)) : lh,
                                      hl = planes == 2 ? _mm256_loadu_si256((const __m256i *)(xg + 192)) : hh;
#pragma GCC unroll 4
                        for (int j = 0; j < pass; j++) {
                            const uint8_t *b = rowp[j0 + j] + q_at + c * 16 + 64 * s + 32 * hv;
                            const __m256i v = _mm256_loadu_si256((const __m256i *)b);
                            const __m256i lo = _mm256_and_si256(v, nib32), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib32);
                            t[j] = _mm256_add_epi16(t[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, lh), _mm256_maddubs_epi16(hi, hh)));
                            if (planes == 2)
                                tl[j] = _mm256_add_epi16(tl[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, ll), _mm256_maddubs_epi16(hi, hl)));
                            __asm__("" : "+x"(t[j]), "+x"(tl[j]));
                        }
                    }
#pragma GCC unroll 4
                    for (int j = 0; j < pass; j++) {
                        const uint8_t *row = rowp[j0 + j];
                        const __m256 d = f16x8(row + 2 * (c + 8 * hv));
                        const __m256 m = with_min ? f16x8(row + m_at + 2 * (c + 8 * hv)) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
                        const __m256i sums = planes == 2 ? _mm256_add_epi32(_mm256_madd_epi16(t[j], w256),
                                                                            _mm256_madd_epi16(tl[j], ones))
                                                         : _mm256_madd_epi16(t[j], ones);
                        a[j] = _mm256_fmadd_ps(m, xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, dxv), a[j]));
                    }
                }
            for (int64_t bi = grouped; bi < paired; bi += 2) { /* two blocks a ymm: x as xq_pair_store lays it out */
                const int8_t *xb = xq + bi * 32 * planes;
                const __m256i xh0 = _mm256_loadu_si256((const __m256i *)xb),
                              xh1 = _mm256_loadu_si256((const __m256i *)(xb + 32));
                const __m256i xl0 = planes == 2 ? _mm256_loadu_si256((const __m256i *)(xb + 64)) : xh0,
                              xl1 = planes == 2 ? _mm256_loadu_si256((const __m256i *)(xb + 96)) : xh1;
                const __m256 dx2 = _mm256_set_m128(_mm_set1_ps(dx[bi + 1]), _mm_set1_ps(dx[bi])),
                             xs2 = _mm256_set_ps(0.f, 0.f, 0.f, xsum[bi + 1], 0.f, 0.f, 0.f, xsum[bi]);
                group_stream_to(&st, w, r, row_bytes, bi + 2);
#pragma GCC unroll 4
                for (int j = 0; j < pass; j++) {
                    const uint8_t *row = rowp[j0 + j], *b = row + q_at + bi * q_step, *ds = row + bi * d_step;
                    const __m256i v = split ? _mm256_loadu_si256((const __m256i *)b)
                                            : _mm256_loadu2_m128i((const __m128i *)(b + q_step), (const __m128i *)b);
                    const __m256i lo = _mm256_and_si256(v, nib32), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib32);
                    const __m256i th = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xh0), _mm256_maddubs_epi16(hi, xh1));
                    const __m256i sums = planes == 2
                        ? _mm256_add_epi32(_mm256_madd_epi16(th, w256),
                                           _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl0),
                                                                              _mm256_maddubs_epi16(hi, xl1)), ones))
                        : _mm256_madd_epi16(th, ones);
                    const __m256 d2 = f16_pair(split ? (uint32_t)i32_at(ds)
                                                     : (uint32_t)u16_at(ds) | (uint32_t)u16_at(ds + d_step) << 16);
                    const __m256 m2 = !with_min ? _mm256_mul_ps(d2, _mm256_set1_ps(-8.f))
                                      : f16_pair(split ? (uint32_t)i32_at(ds + m_at)
                                                       : (uint32_t)u16_at(ds + m_at) | (uint32_t)u16_at(ds + d_step + m_at) << 16);
                    a[j] = _mm256_fmadd_ps(m2, xs2, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d2, dx2), a[j]));
                }
            }
            for (int64_t bi = paired; bi < blocks; bi++) { /* int16 x: h at xb, l 32 after; int8 x: 32 bytes at xb */
                const int8_t *xb = xq + bi * 32 * planes;
                const __m256i xh = _mm256_loadu_si256((const __m256i *)xb),
                              xl = planes == 2 ? _mm256_loadu_si256((const __m256i *)(xb + 32)) : xh;
                const float dxb = dx[bi], xs = xsum[bi];
                group_stream_to(&st, w, r, row_bytes, bi + 1);
#pragma GCC unroll 4
                for (int j = 0; j < pass; j++) {
                    const uint8_t *b = rowp[j0 + j] + q_at + bi * q_step, *ds = rowp[j0 + j] + bi * d_step;
                    const __m128i v = _mm_loadu_si128((const __m128i *)b);
                    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nib), _mm_and_si128(v, nib));
                    const __m256i t = planes == 2 ? x16_dot_avx2(q, xh, xl) : _mm256_madd_epi16(_mm256_maddubs_epi16(q, xh), ones);
                    const float dv = f16_load(ds);
                    extra[j] += (with_min ? f16_load(ds + m_at) : -8.f * dv) * xs;
                    a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(dv * dxb), a[j]);
                }
            }
            for (int j = 0; j < pass && j0 + j < n; j++) store(y, r + j0 + j, hsum256(a[j]) + extra[j], acc);
        }
    }
}
static void rows_q4_int16_avx2(int64_t type, int split, const uint8_t *w, const int8_t *xq, const float *dx,
                               const float *xsum, float *y, int64_t r0, int64_t r1, int64_t cols, int acc) {
    rows_q4_int_avx2(2, type, split, w, xq, dx, xsum, y, r0, r1, cols, acc);
}
static void rows_q4_int8_avx2(int64_t type, int split, const uint8_t *w, const int8_t *xq, const float *dx,
                              const float *xsum, float *y, int64_t r0, int64_t r1, int64_t cols, int acc) {
    rows_q4_int_avx2(1, type, split, w, xq, dx, xsum, y, r0, r1, cols, acc);
}
#endif

#if defined(__AVX512F__)
/* A Q4_K / Q5_K block's eight 6-bit scales and minimums (k_scale_min) times d and dmin, in one pass on 16 lanes:
 * lane j < 8 d sc_j, lane 8 + j dmin m_j (scalar, the unpacking cost more than a block's products). */
static inline __m512 k_scales_mins(const uint8_t *b) {
    const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 4))); /* bytes 12-15: not used */
    const __m512i at_a = _mm512_set_epi32(11, 10, 9, 8, 7, 6, 5, 4, 11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i at_b = _mm512_set_epi32(7, 6, 5, 4, 0, 0, 0, 0, 3, 2, 1, 0, 0, 0, 0, 0);
    const __m512i shift_a = _mm512_set_epi32(4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i mask_a = _mm512_set_epi32(15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63);
    const __m512i mask_b = _mm512_set_epi32(48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0);
    const __m512i part_a = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(at_a, s), shift_a), mask_a);
    const __m512i part_b = _mm512_and_si512(_mm512_slli_epi32(_mm512_srli_epi32(_mm512_permutexvar_epi32(at_b, s), 6), 4), mask_b);
    const __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16_to_f32(u16_at(b))), _mm512_set1_ps(f16_to_f32(u16_at(b + 2))));
    return _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_or_si512(part_a, part_b)));
}

/* A Q6_K block's sixteen d sc_s on 16 lanes, and which of them each lane of a half block's dot products takes:
 * pick[2 half + k] lane i: sub-block 8 half + 4 k + i / 4 (k = 0 the half's weights 0-63, 1 its weights 64-127;
 * four weights a lane). Shared by the int16 and bf16-terms Q6_K products. */
static inline __m512 q6k_scales(const uint8_t *b) {
    return _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(u16_at(b + 208))),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
}
static inline void q6k_picks(__m512i pick[4]) {
    const __m512i quads = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 2; k++) pick[2 * h + k] = _mm512_add_epi32(quads, _mm512_set1_epi32(8 * h + 4 * k));
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* k_scales_mins on 8 lanes: a Q4_K / Q5_K block's d sc_j into *ds and dmin m_j into *dm, j = 0..7, the same float32
 * products as k_scale_min's (bytes 12-15 of the load are not used). The AVX2 k-quant loop spent as long unpacking
 * them a value at a time as on its products. */
static inline void k_scales_mins8(const uint8_t *b, __m256 *ds, __m256 *dm) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 4));
    const __m256i s07 = _mm256_cvtepu8_epi32(raw), s815 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
    const __m256i lo4 = _mm256_set_epi32(15, 15, 15, 15, 63, 63, 63, 63);
    /* sc_j: j < 4 s_j & 63; else (s_{j+4} & 15) | (s_{j-4} >> 6) << 4 */
    const __m256i sc = _mm256_or_si256(_mm256_and_si256(_mm256_permute2x128_si256(s07, s815, 0x20), lo4),
                                       _mm256_slli_epi32(_mm256_srli_epi32(_mm256_permute2x128_si256(s07, s07, 0x08), 6), 4));
    /* m_j: j < 4 s_{j+4} & 63; else s_{j+4} >> 4 | (s_j >> 6) << 4 */
    const __m256i mn = _mm256_or_si256(
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_permute2x128_si256(s07, s815, 0x21), _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0)), lo4),
        _mm256_slli_epi32(_mm256_srli_epi32(_mm256_permute2x128_si256(s07, s07, 0x18), 6), 4));
    *ds = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(u16_at(b))), _mm256_cvtepi32_ps(sc));
    *dm = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(u16_at(b + 2))), _mm256_cvtepi32_ps(mn));
}
#endif

#if defined(__AVX512F__)
/* Q8_0 rows, 32 weights a block: sum_b d_b (q_b . x_b), the int8 integers widened to float32 lanes, four rows at a
 * time, the rows ahead streamed into L2 (group_stream): the loop of a Q8_0 product waits on memory, the Q4 loop of
 * rows_small_blocks on its instructions (sharing one loop, the stream cost that one 8 %). */
static void rows_q8_0(int split, const uint8_t *w, const float *x, float *y, int64_t r0, int64_t r1, int64_t cols,
                      int acc) {
    const int64_t blocks = cols / 32, row_bytes = blocks * 34, q_at = split ? 2 * blocks : 2, q_step = split ? 32 : 34;
    const __m512i gather_at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                 _mm512_set1_epi32(34));
    Stream st = group_stream(w, r0, r1, row_bytes, blocks);
    for (int64_t r = r0; r < r1; r += 4) {
        __m512 a[4], extra[4]; /* extra stays zero: Q8_0 has no minimum */
        const uint8_t *rowp[4];
        const int64_t n = row_group4(w, r, r1, row_bytes, rowp, a, extra);
        for (int64_t c = 0; c < blocks; c += 16) {
            const int64_t nb = blocks - c < 16 ? blocks - c : 16;
            const __mmask16 live = (__mmask16)((1u << nb) - 1u);
            float scale[4][16];
            for (int j = 0; j < 4; j++) {
                __m512 d, m;
                block_scales(rowp[j], c, live, split, 0, 0, gather_at, 34, &d, &m);
                _mm512_storeu_ps(scale[j], d);
            }
            for (int64_t k = 0; k < nb; k++) {
                const int64_t bi = c + k;
                const __m512 x0 = _mm512_loadu_ps(x + bi * 32), x1 = _mm512_loadu_ps(x + bi * 32 + 16);
                group_stream_to(&st, w, r, row_bytes, bi + 1);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const uint8_t *b = rowp[j] + q_at + bi * q_step;
                    const __m128i v0 = _mm_loadu_si128((const __m128i *)b), v1 = _mm_loadu_si128((const __m128i *)(b + 16));
                    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v0)), x0);
                    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v1)), x1, t);
                    a[j] = _mm512_fmadd_ps(t, _mm512_set1_ps(scale[j][k]), a[j]);
                }
            }
        }
        store4(y, r, n, a[0], a[1], a[2], a[3], acc);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same on AVX2, 8 lanes (the default model's head 1.6 -> 1.0 ms with the stream into L2 in place of per-row
 * prefetches into L1): float32 x; the integer modes take rows_q8_0_int16_avx2. */
static void rows_q8_0(int split, const uint8_t *w, const float *x, float *y, int64_t r0, int64_t r1, int64_t cols,
                      int acc) {
    const int64_t blocks = cols / 32, row_bytes = blocks * 34, q_at = split ? 2 * blocks : 2, q_step = split ? 32 : 34,
                  d_step = split ? 2 : 34;
    Stream st = group_stream(w, r0, r1, row_bytes, blocks);
    for (int64_t r = r0; r < r1; r += 4) {
        const int64_t n = r1 - r < 4 ? r1 - r : 4; /* a short last group repeats its last row, not stored */
        __m256 a[4][2];
        const uint8_t *rowp[4];
        for (int j = 0; j < 4; j++) {
            rowp[j] = w + (r + (j < n ? j : n - 1)) * row_bytes;
            a[j][0] = a[j][1] = _mm256_setzero_ps();
        }
        for (int64_t bi = 0; bi < blocks; bi++) {
            const float *xb = x + bi * 32;
            const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16),
                         x3 = _mm256_loadu_ps(xb + 24);
            group_stream_to(&st, w, r, row_bytes, bi + 1);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const uint8_t *b = rowp[j] + q_at + bi * q_step, *ds = rowp[j] + bi * d_step;
                const __m256 d = _mm256_set1_ps(f16_load(ds));
                const __m128i v0 = _mm_loadu_si128((const __m128i *)b), v1 = _mm_loadu_si128((const __m128i *)(b + 16));
                __m256 t0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0)), x0);
                __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8))), x1);
                t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1)), x2, t0);
                t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8))), x3, t1);
                a[j][0] = _mm256_fmadd_ps(t0, d, a[j][0]);
                a[j][1] = _mm256_fmadd_ps(t1, d, a[j][1]);
            }
        }
        for (int j = 0; j < n; j++) store(y, r + j, hsum256(_mm256_add_ps(a[j][0], a[j][1])), acc);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define DSV41_Q4_VNNI 1
/* The Q4 product with integer dot products (what llama.cpp does): x rounded to int8 per block of 32 (its scale
 * dx_b = max |x| / 127), each block's 32 nibbles times those int8 in one vpdpbusd, so a block costs half the
 * float path's instructions. sum_b d_b dx_b (q_b . xq_b) [+ m_b dx_b sum(xq_b) | - 8 d_b dx_b sum(xq_b)]. The weights are still the file's exactly; x carries the int8 rounding (about
 * 0.4 % of a block's largest value at most). Four blocks a zmm (rows_q4_int, q4_quads below). */
/* max |x| over n values (a multiple of 16), or NaN where one of them is not finite: the scale of the integer x
 * routes, so that a NaN or an infinity in x reaches every product it takes part in as NaN (x's integers cannot
 * carry it: rounded, a NaN became an arbitrary integer and the products finite garbage) */
static inline float block_amax(const float *x, int n) {
    const __m512 sign = _mm512_set1_ps(-0.f);
    __m512 m = _mm512_setzero_ps(), z = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        m = _mm512_max_ps(m, _mm512_andnot_ps(sign, v));
        z = _mm512_fmadd_ps(v, _mm512_setzero_ps(), z); /* 0 unless some v is NaN or infinite */
    }
    return _mm512_reduce_add_ps(z) == 0.f ? _mm512_reduce_max_ps(m) : __builtin_nanf("");
}

#define Q4_X16_MAX 32639.f

/* Four rows' scales for their blocks c .. c + 15 (live: the blocks there are) against x rounded per block: d dx into
 * scale[j], and the minimum's term (Q4_1: m; Q4_0: -8 d) times x's block sums added to extra[j]. */
static inline __attribute__((always_inline)) void q4_group_scales(const uint8_t *const *rowp, int64_t c, __mmask16 live,
                                                                  int split, int with_min, int64_t m_at,
                                                                  __m512i gather_at, int64_t size, const float *dx,
                                                                  const float *xsum, __m512 *scale, __m512 *extra) {
    const __m512 dxv = _mm512_maskz_loadu_ps(live, dx + c), xs = _mm512_maskz_loadu_ps(live, xsum + c);
    for (int j = 0; j < 4; j++) {
        __m512 d, m;
        block_scales(rowp[j], c, live, split, with_min, m_at, gather_at, size, &d, &m);
        scale[j] = _mm512_mul_ps(d, dxv);
        if (!with_min) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
        extra[j] = _mm512_fmadd_ps(m, xs, extra[j]);
    }
}

/* Sixteen bytes of x (weights 16 half .. + 15 of a block, one plane) to where the layout wants them: in place (at),
 * or for a block of a whole interleaved group four words 128 planes bytes apart (q4_x_at) */
static inline void q4_x_store(int8_t *at, __m128i v, int grouped, int planes) {
    if (!grouped) {
        _mm_storeu_si128((__m128i *)at, v);
        return;
    }
    for (int s = 0; s < 4; s++) {
        const int32_t word = _mm_cvtsi128_si32(v);
        memcpy(at + 128 * planes * s, &word, 4);
        v = _mm_srli_si128(v, 4);
    }
}

/* Q4_0 / Q4_1 on integer x, four blocks a vector: the 64 bytes of nibbles of blocks 4g .. 4g + 3 (one load where the
 * row is held split, four where the blocks keep their scales between them) give their low nibbles (each block's
 * weights 0..15) and high ones (16..31) as two vectors whose lanes 4i .. 4i + 3 both belong to block 4g + i. planes 1
 * (int8 x): two vpdpbusd, the low and high nibbles against x. planes 2 (int16 x): four, against x's high bytes, the
 * sum shifted by 8, then against its low bytes, which leave each lane the exact integer sum of q x16 over its eight
 * weights (below 2^24: 8 * 15 * 127 * 256 + 8 * 15 * 128, so its float32 conversion is exact). Then one conversion
 * and one multiply-add by d dx per 128 weights. Taking two blocks a vector instead cost twice the conversions, scale
 * picks and multiply-adds and a two-part load: the default model's matrices on int16 x, 2 cores of an AMD EPYC, 3.28
 * -> 2.86 ms a step. That loop now takes the blocks of a split row past its last whole group of 16 (and rows in the
 * file's order); a whole group, interleaved (q4_split_at), adds each block's sums in its own lane over the group's
 * four chunks and converts and multiply-adds once (design.md, "Interleaved groups"). x (q4_quads): per group of four
 * blocks 64 bytes of (int16 x: the high bytes of) weights 0..15 of each block, then 64 of 16..31; int16 x then the
 * low bytes likewise; a missing block's x is zeros; the blocks of whole interleaved groups (`grouped`) as q4_x_at
 * lays them out, in the same bytes. */
static void q4_quads(const float *x, int64_t blocks, int planes, int8_t *xq, float *dx, float *xsum, int64_t grouped) {
    const float top = planes == 2 ? Q4_X16_MAX : 127.f;
    const __m512i b128 = _mm512_set1_epi32(128);
    for (int64_t b = 0; b < blocks; b++) {
        const float amax = block_amax(x + b * 32, 32);
        const float inv = amax > 0.f ? top / amax : 0.f;
        dx[b] = amax / top;
        const int in_group = b < grouped;
        int32_t total = 0;
        for (int half = 0; half < 2; half++) { /* weights 0..15, then 16..31 */
            /* the high (or only) bytes of these 16 weights: four words of an interleaved group, or 16 in a quad */
            int8_t *at = in_group ? xq + q4_x_at(b, 16 * half, planes) : xq + (b / 4) * 128 * planes + (b % 4) * 16 + 64 * half;
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + b * 32 + 16 * half), _mm512_set1_ps(inv)));
            if (planes == 2) {
                const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, b128), 8);
                q4_x_store(at, _mm512_cvtepi32_epi8(h), in_group, planes);
                q4_x_store(at + 128, _mm512_cvtepi32_epi8(_mm512_sub_epi32(q, _mm512_slli_epi32(h, 8))), in_group, planes);
            } else {
                q4_x_store(at, _mm512_cvtsepi32_epi8(q), in_group, planes);
            }
            total += _mm512_reduce_add_epi32(q);
        }
        /* the sum of the rounded x, so that the min / offset term sees the same x as the dot */
        xsum[b] = dx[b] * (float)total;
    }
    for (int64_t b = blocks; b % 4; b++) {
        int8_t *quad = xq + (b / 4) * 128 * planes + (b % 4) * 16;
        for (int k = 0; k < 2 * planes; k++) memset(quad + 64 * k, 0, 16);
    }
}

static inline __attribute__((always_inline)) void rows_q4_int(const int planes, int64_t type, int split,
                                                               const uint8_t *w, const int8_t *xq, const float *dx,
                                                               const float *xsum, float *y, int64_t r0, int64_t r1,
                                                               int64_t cols, int acc) {
    const int64_t size = gguf_block_bytes(type), blocks = cols / 32, row_bytes = blocks * size;
    const int with_min = type == 3;
    /* as rows_small_blocks: block bi's nibbles at row + q_at + bi * q_step */
    const int64_t q_at = split ? blocks * split_scale_bytes(type) : (with_min ? 4 : 2), q_step = split ? 16 : size,
                  m_at = 2 * blocks;
    const __m512i gather_at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                 _mm512_set1_epi32((int)size));
    const __m512i nib = _mm512_set1_epi8(0x0F);
    Stream st = group_stream(w, r0, r1, row_bytes, blocks);
    for (int64_t r = r0; r < r1; r += 4) {
        __m512 a[4], extra[4];
        const uint8_t *rowp[4];
        const int64_t n = row_group4(w, r, r1, row_bytes, rowp, a, extra);
        for (int64_t c = 0; c < blocks; c += 16) {
            const int64_t nb = blocks - c < 16 ? blocks - c : 16;
            const __mmask16 live = (__mmask16)((1u << nb) - 1u);
            __m512 scale[4];
            q4_group_scales(rowp, c, live, split, with_min, m_at, gather_at, size, dx, xsum, scale, extra);
            if (split && nb == Q4_GROUP) { /* an interleaved group: lane i block c + i in all four chunks */
                __m512i th[4], tl[4];
                for (int j = 0; j < 4; j++) th[j] = tl[j] = _mm512_setzero_si512();
                for (int s = 0; s < 4; s++) {
                    group_stream_to(&st, w, r, row_bytes, c + 4 * s + 4);
                    const int8_t *xg = xq + q4_x_at(c, 4 * s, planes);
                    const __m512i hl = _mm512_loadu_si512((const void *)xg), hh = _mm512_loadu_si512((const void *)(xg + 64));
                    const __m512i ll = planes == 2 ? _mm512_loadu_si512((const void *)(xg + 128)) : hl,
                                  lh = planes == 2 ? _mm512_loadu_si512((const void *)(xg + 192)) : hh;
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) {
                        const __m512i v = _mm512_loadu_si512((const void *)(rowp[j] + q_at + c * 16 + 64 * s));
                        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                        th[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(th[j], lo, hl), hi, hh);
                        if (planes == 2) tl[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(tl[j], lo, ll), hi, lh);
                    }
                }
                for (int j = 0; j < 4; j++) {
                    const __m512i dot = planes == 2 ? _mm512_add_epi32(_mm512_slli_epi32(th[j], 8), tl[j]) : th[j];
                    a[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale[j], a[j]);
                }
                continue;
            }
            for (int64_t k = 0; k < nb; k += 4) {
                const int64_t bi = c + k, nq = nb - k < 4 ? nb - k : 4;
                const __mmask64 bytes = nq == 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * nq)) - 1);
                group_stream_to(&st, w, r, row_bytes, bi + 4);
                const int8_t *xp = xq + (bi / 4) * 128 * planes;
                const __m512i hl = _mm512_loadu_si512((const void *)xp), hh = _mm512_loadu_si512((const void *)(xp + 64));
                const __m512i ll = planes == 2 ? _mm512_loadu_si512((const void *)(xp + 128)) : hl,
                              lh = planes == 2 ? _mm512_loadu_si512((const void *)(xp + 192)) : hh;
                const __m512i pick = _mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                                      _mm512_set1_epi32((int)k));
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const uint8_t *b0 = rowp[j] + q_at + bi * q_step;
                    __m512i v;
                    if (split) {
                        v = _mm512_maskz_loadu_epi8(bytes, b0);
                    } else { /* a missing block's bytes are not read (masked) */
                        v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)b0));
                        for (int i = 1; i < 4; i++)
                            v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(i < nq ? 0xFFFF : 0, b0 + i * q_step), i);
                    }
                    const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                    __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, hl), hi, hh);
                    if (planes == 2)
                        dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 8), lo, ll), hi, lh);
                    a[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, scale[j]), a[j]);
                }
            }
        }
        store4(y, r, n, _mm512_add_ps(a[0], extra[0]), _mm512_add_ps(a[1], extra[1]), _mm512_add_ps(a[2], extra[2]),
               _mm512_add_ps(a[3], extra[3]), acc);
    }
}
static void rows_q4_vnni(int64_t type, int split, const uint8_t *w, const int8_t *xq, const float *dx,
                         const float *xsum, float *y, int64_t r0, int64_t r1, int64_t cols, int acc) {
    rows_q4_int(1, type, split, w, xq, dx, xsum, y, r0, r1, cols, acc);
}
static void rows_q4_int16(int64_t type, int split, const uint8_t *w, const int8_t *xq, const float *dx,
                          const float *xsum, float *y, int64_t r0, int64_t r1, int64_t cols, int acc) {
    rows_q4_int(2, type, split, w, xq, dx, xsum, y, r0, r1, cols, acc);
}

/* The k-quants on int16 x (the int16 mode, AVX-512 VNNI; Q4_0 / Q4_1: rows_q4_int16 above): x rounded to int16 per
 * group of n (Q4_K / Q5_K: their sub-blocks of 32; Q6_K: of 16) with the scale dx = max |x| / X16_MAX, and each
 * value split into a high byte h and a low one l, x16 = 256 h + l with both in -128..127 (h = (x16 + 128) >> 8; |x16| <= X16_MAX keeps |h| <= 127). The weights'
 * integers are vpdpbusd's unsigned bytes as they are (Q4_K's nibbles, Q6_K's 6-bit q), so a product is two
 * vpdpbusd, 256 (q . h) + (q . l): the exact integer sum of q x16 over a lane's four weights, below 2^24 (rounded
 * exactly to float32), then times d sc dx. x carries 15 bits of its group's largest value, the products none of
 * their own: half the instructions of two bf16 terms per 32 weights, and no conversion of the weights' integers
 * to floats. */
#define X16_MAX 32639.f
/* n values of x (a multiple of 16) rounded with their own scale *dx: planes 1, to int8 (max |x| / 127, the int8
 * mode), stored at hi; planes 2, to int16 (max |x| / X16_MAX) as high bytes at hi and low ones at lo. *sum: the sum
 * of the rounded integers. */
static inline void x_split(const float *x, int n, int planes, float *dx, int8_t *hi, int8_t *lo, int64_t *sum) {
    const float top = planes == 2 ? X16_MAX : 127.f;
    const float amax = block_amax(x, n), inv = amax > 0.f ? top / amax : 0.f;
    __m512i total = _mm512_setzero_si512();
    for (int i = 0; i < n; i += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)));
        if (planes == 2) {
            const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
            _mm_storeu_si128((__m128i *)(hi + i), _mm512_cvtepi32_epi8(h));
            _mm_storeu_si128((__m128i *)(lo + i), _mm512_cvtepi32_epi8(_mm512_sub_epi32(q, _mm512_slli_epi32(h, 8))));
        } else {
            _mm_storeu_si128((__m128i *)(hi + i), _mm512_cvtsepi32_epi8(q));
        }
        total = _mm512_add_epi32(total, q);
    }
    *dx = amax / top;
    *sum = _mm512_reduce_add_epi32(total);
}

/* Q4_K / Q5_K (the int8 mode: planes 1; int16: 2): a block's x as 256 bytes a plane (the int16 mode's high bytes,
 * then its low ones), the sub-blocks in the order the nibbles take them (0, 2, 1, 3, 4, 6, 5, 7: the low nibbles of
 * 64 bytes are sub-blocks 2c and 2c + 2, the high ones 2c + 1 and 2c + 3); dx[b * 8 + j] sub-block j's scale,
 * xsum[b * 16 + 8 + j] its sum as rounded (against the minimums; lanes 0-7 no offset). */
static void q4k_int_x(const float *x, int64_t blocks, int planes, int8_t *xq, float *dx, float *xsum) {
    static const int slot[8] = {0, 2, 1, 3, 4, 6, 5, 7}; /* sub-block j's place: slot[j] * 32 */
    for (int64_t b = 0; b < blocks; b++)
        for (int j = 0; j < 8; j++) {
            int8_t *at = xq + b * 256 * planes + 32 * slot[j];
            int64_t sum;
            x_split(x + b * 256 + 32 * j, 32, planes, &dx[b * 8 + j], at, at + 256, &sum);
            xsum[b * 16 + j] = 0.f;
            xsum[b * 16 + 8 + j] = dx[b * 8 + j] * (float)sum;
        }
}

/* q4k_int_x's int16 x with the first `grouped` blocks (whole groups of four) laid out for split Q4_K rows
 * (k4_group_int16): per group 2048 bytes, for each of the eight nibble vectors s 256 bytes: x's high bytes against
 * the low nibbles (lane 4b + c: weights 4s..4s + 3 of block b's sub-block 2c), against the high ones (sub-block
 * 2c + 1), then the low bytes likewise; side[64 g ..]: dx of sub-block 2c / 2c + 1 by lane, then their sums as
 * rounded. The blocks after the groups as q4k_int_x lays them out, at the same places; dx and xsum for every block. */
static void q4k_int16_x(const float *x, int64_t blocks, int64_t grouped, int8_t *xq, float *dx, float *xsum,
                        float *side) {
    q4k_int_x(x + grouped * 256, blocks - grouped, 2, xq + grouped * 512, dx + grouped * 8, xsum + grouped * 16);
    for (int64_t b = 0; b < grouped; b++)
        for (int j = 0; j < 8; j++) {
            _Alignas(16) int8_t hi[32], lo[32];
            int64_t sum;
            float *scale = &dx[b * 8 + j];
            x_split(x + b * 256 + 32 * j, 32, 2, scale, hi, lo, &sum);
            xsum[b * 16 + j] = 0.f;
            xsum[b * 16 + 8 + j] = *scale * (float)sum;
            const int lane = 4 * (int)(b % 4) + j / 2, high = j % 2;
            int8_t *at = xq + (b / 4) * 2048 + 64 * high + 4 * lane;
            for (int s = 0; s < 8; s++) {
                memcpy(at + 256 * s, hi + 4 * s, 4);
                memcpy(at + 256 * s + 128, lo + 4 * s, 4);
            }
            float *sg = side + (b / 4) * 64 + 16 * high + lane;
            sg[0] = *scale;
            sg[32] = xsum[b * 16 + 8 + j];
        }
}

/* One group of four Q4_K blocks of a split row (k4_split_at) on int16 x laid out by q4k_int16_x: the four heads as
 * one vector (block b in 128-bit lane b) give in one pass each lane 4b + c its d sc and dmin m for sub-blocks 2c and
 * 2c + 1 (vpshufb gathers each dword's scale byte and its high bits' byte; masks and shifts finish the six-bit
 * values); the eight nibble vectors add each lane's sub-block sums on x's high and low bytes; then one conversion
 * and multiply-add for each of the two sub-blocks a lane holds. side: the group's 64 floats (dx of sub-block 2c /
 * 2c + 1 by lane, then their sums as rounded). */
static inline __attribute__((always_inline)) void k4_group_int16(const uint8_t *group, const int8_t *xg,
                                                                  const float *side, __m512 *a, __m512 *off) {
#define K4_S(k) (4 + (k)) /* scale byte k of a head */
    const __m512i idx_slo = _mm512_broadcast_i32x4(_mm_setr_epi8(K4_S(0), -1, -1, -1, K4_S(2), -1, -1, -1, K4_S(8), K4_S(0), -1, -1, K4_S(10), K4_S(2), -1, -1));
    const __m512i idx_shi = _mm512_broadcast_i32x4(_mm_setr_epi8(K4_S(1), -1, -1, -1, K4_S(3), -1, -1, -1, K4_S(9), K4_S(1), -1, -1, K4_S(11), K4_S(3), -1, -1));
    const __m512i idx_mlo = _mm512_broadcast_i32x4(_mm_setr_epi8(K4_S(4), -1, -1, -1, K4_S(6), -1, -1, -1, K4_S(8), K4_S(4), -1, -1, K4_S(10), K4_S(6), -1, -1));
    const __m512i idx_mhi = _mm512_broadcast_i32x4(_mm_setr_epi8(K4_S(5), -1, -1, -1, K4_S(7), -1, -1, -1, K4_S(9), K4_S(5), -1, -1, K4_S(11), K4_S(7), -1, -1));
#undef K4_S
    const __m512i idx_d = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, -1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1, -1, -1));
    const __m512i idx_dmin = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 3, -1, -1, 2, 3, -1, -1, 2, 3, -1, -1, 2, 3, -1, -1));
    /* sub-blocks 0-3: byte & 63 (a minimum: of the byte 4 on); 4-7: byte & 15 (a minimum: byte >> 4), and the two
     * high bits of byte j - 4 (of byte j for a minimum) as bits 4-5: (dword >> 10) & 0x30 */
    const __m512i keep_a = _mm512_broadcast_i32x4(_mm_setr_epi32(63, 63, 15, 15)),
                  keep_b = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0, 0x30, 0x30)),
                  shift_m = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0, 4, 4)), nib = _mm512_set1_epi8(0x0F);
    const __m512i head = _mm512_loadu_si512((const void *)group);
    const __m512i tsl = _mm512_shuffle_epi8(head, idx_slo), tsh = _mm512_shuffle_epi8(head, idx_shi),
                  tml = _mm512_shuffle_epi8(head, idx_mlo), tmh = _mm512_shuffle_epi8(head, idx_mhi);
    const __m512i slo = _mm512_or_si512(_mm512_and_si512(tsl, keep_a), _mm512_and_si512(_mm512_srli_epi32(tsl, 10), keep_b));
    const __m512i shi = _mm512_or_si512(_mm512_and_si512(tsh, keep_a), _mm512_and_si512(_mm512_srli_epi32(tsh, 10), keep_b));
    const __m512i mlo = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(tml, shift_m), keep_a),
                                        _mm512_and_si512(_mm512_srli_epi32(tml, 10), keep_b));
    const __m512i mhi = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(tmh, shift_m), keep_a),
                                        _mm512_and_si512(_mm512_srli_epi32(tmh, 10), keep_b));
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_shuffle_epi8(head, idx_d)));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_shuffle_epi8(head, idx_dmin)));
    *off = _mm512_fmadd_ps(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mlo)), _mm512_loadu_ps(side + 32), *off);
    *off = _mm512_fmadd_ps(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mhi)), _mm512_loadu_ps(side + 48), *off);
    __m512i lh = _mm512_setzero_si512(), ll = lh, hh = lh, hl = lh;
    for (int s = 0; s < 8; s++) {
        const __m512i v = _mm512_loadu_si512((const void *)(group + 64 + 64 * s));
        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        const int8_t *xs = xg + 256 * s;
        lh = _mm512_dpbusd_epi32(lh, lo, _mm512_loadu_si512((const void *)xs));
        hh = _mm512_dpbusd_epi32(hh, hi, _mm512_loadu_si512((const void *)(xs + 64)));
        ll = _mm512_dpbusd_epi32(ll, lo, _mm512_loadu_si512((const void *)(xs + 128)));
        hl = _mm512_dpbusd_epi32(hl, hi, _mm512_loadu_si512((const void *)(xs + 192)));
    }
    /* a lane's 32 weights: at most 32 * 15 * 32767 < 2^24, converted exactly */
    const __m512 flo = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(lh, 8), ll));
    const __m512 fhi = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hh, 8), hl));
    *a = _mm512_fmadd_ps(flo, _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(slo)), _mm512_loadu_ps(side)), *a);
    *a = _mm512_fmadd_ps(fhi, _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(shi)), _mm512_loadu_ps(side + 16)), *a);
}

/* planes 1: int8 x (the int8 mode, Q4_K only: one vpdpbusd per 64 nibbles); 2: int16 x, 256 (q . h) + (q . l).
 * five: Q5_K (the same x; each nibble's fifth bit from qh, bit 2c of byte l for the low nibbles of chunk c, bit
 * 2c + 1 for its high ones, put in bit 4 of the byte as 16 + q: the same ternary-logic merge as Q6_K's pairs). */
/* grouped: the first blocks of each row in split groups of four (Q4_K on int16 x only: k4_group_int16, x and side
 * from q4k_int16_x); the rest in the file's layout (at the same places in a split row) */
static inline __attribute__((always_inline)) void rows_k4_int(const int planes, const int five, const uint8_t *w,
                                                               const int8_t *xq, const float *dx, const float *xsum,
                                                               float *y, int64_t r0, int64_t r1, int64_t cols,
                                                               int acc, int64_t grouped, const float *side) {
    const int64_t size = five ? 176 : 144, blocks = cols / 256, row_bytes = blocks * size, q_at = five ? 48 : 16;
    const __m512i nib = _mm512_set1_epi8(0x0F), keep5 = _mm512_set1_epi8(0x1F);
    const __m512i lanes8 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i pick[4];
    for (int p = 0; p < 2; p++)
        for (int hi = 0; hi < 2; hi++) pick[2 * p + hi] = _mm512_add_epi32(lanes8, _mm512_set1_epi32(4 * p + hi));
    Stream st = {(const char *)w + r0 * row_bytes, (const char *)(w + r1 * row_bytes), 0};
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), off = _mm512_setzero_ps();
        for (int64_t bi = 0; bi < grouped; bi += 4) {
            stream_to(&st, (const char *)row + bi * size + 4 * size + K_AHEAD);
            k4_group_int16(row + bi * size, xq + bi * 512, side + (bi / 4) * 64, &a0, &off);
        }
        for (int64_t bi = grouped; bi < blocks; bi++) {
            const uint8_t *b = row + bi * size;
            stream_to(&st, (const char *)b + size + K_AHEAD);
            const __m512 dsm = k_scales_mins(b);
            off = _mm512_fmadd_ps(dsm, _mm512_loadu_ps(xsum + bi * 16), off);
            const __m512 scale = _mm512_mul_ps(dsm, _mm512_maskz_loadu_ps(0xFF, dx + bi * 8)); /* d sc_j dx_j */
            const int8_t *xh = xq + bi * 256 * planes, *xl = xh + 256;
            for (int p = 0; p < 2; p++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + q_at + 64 * p));
                __m512i lo, hi;
                if (five) { /* chunk 2p's fifth bits are bits 4p, 4p + 1 of qh; chunk 2p + 1's the next two */
                    const __m256i q5 = _mm256_loadu_si256((const __m256i *)(b + 16));
                    const __m512i hv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srl_epi16(q5, _mm_cvtsi32_si128(4 * p))),
                                                          _mm256_srl_epi16(q5, _mm_cvtsi32_si128(4 * p + 2)), 1);
                    lo = _mm512_and_si512(_mm512_ternarylogic_epi32(v, _mm512_slli_epi16(hv, 4), nib, 0xE4), keep5);
                    hi = _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_slli_epi16(hv, 3), nib, 0xE4), keep5);
                } else {
                    lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                }
                const int8_t *h = xh + 128 * p, *l = xl + 128 * p;
                __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)h));
                __m512i u = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512((const void *)(h + 64)));
                if (planes == 2) {
                    t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), lo, _mm512_loadu_si512((const void *)l));
                    u = _mm512_dpbusd_epi32(_mm512_slli_epi32(u, 8), hi, _mm512_loadu_si512((const void *)(l + 64)));
                }
                a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_permutexvar_ps(pick[2 * p], scale), a0);
                a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), _mm512_permutexvar_ps(pick[2 * p + 1], scale), a1);
            }
        }
        store(y, r, _mm512_reduce_add_ps(_mm512_sub_ps(_mm512_add_ps(a0, a1), off)), acc);
    }
}
static void rows_q4k_int8(const uint8_t *w, const int8_t *xq, const float *dx, const float *xsum, float *y,
                          int64_t r0, int64_t r1, int64_t cols, int acc) {
    rows_k4_int(1, 0, w, xq, dx, xsum, y, r0, r1, cols, acc, 0, NULL);
}
static void rows_q4k_int16(const uint8_t *w, const int8_t *xq, const float *dx, const float *xsum, float *y,
                           int64_t r0, int64_t r1, int64_t cols, int acc, int64_t grouped, const float *side) {
    rows_k4_int(2, 0, w, xq, dx, xsum, y, r0, r1, cols, acc, grouped, side);
}
static void rows_q5k_int16(const uint8_t *w, const int8_t *xq, const float *dx, const float *xsum, float *y,
                           int64_t r0, int64_t r1, int64_t cols, int acc) {
    rows_k4_int(2, 1, w, xq, dx, xsum, y, r0, r1, cols, acc, 0, NULL);
}

/* Q6_K: a block's x as 256 high bytes, then 256 low ones, in the order of its weights; dx[b * 16 + s] the scale of
 * sub-block s (16 weights), xsum[b * 16 + s] 32 times its sum as rounded (the -32 of q - 32 against d sc_s). Half a
 * block at a time: its 64 bytes of low nibbles (bytes 0-31 weights 0-31 low, 64-95 high; bytes 32-63 weights 32-63
 * and 96-127) and 32 bytes of high pairs (bits 2i-2i+1 of byte l for weight l + 32 i) make the half's weights 0-63
 * and 64-127 as two 64-byte vectors of 6-bit q in order: (nibbles & 15) | (pairs << 4 & 48), the pairs of the
 * second 32 bytes taken shifted by 2. Lane i of a dot product holds four weights of sub-block 8 half + i / 4 (+ 4
 * for the weights 64-127). */
static void q6k_int16_x(const float *x, int64_t blocks, int8_t *xq, float *dx, float *xsum) {
    for (int64_t b = 0; b < blocks; b++)
        for (int s = 0; s < 16; s++) {
            int8_t *at = xq + b * 512 + 16 * s;
            int64_t sum;
            x_split(x + b * 256 + 16 * s, 16, 2, &dx[b * 16 + s], at, at + 256, &sum);
            xsum[b * 16 + s] = 32.f * (dx[b * 16 + s] * (float)sum);
        }
}

static void rows_q6k_int16(const uint8_t *w, const int8_t *xq, const float *dx, const float *xsum, float *y,
                           int64_t r0, int64_t r1, int64_t cols, int acc) {
    const int64_t blocks = cols / 256, row_bytes = blocks * 210;
    const __m512i low = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi8(0x3F);
    __m512i pick[4];
    q6k_picks(pick);
    Stream st = {(const char *)w + r0 * row_bytes, (const char *)(w + r1 * row_bytes), 0};
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), off = _mm512_setzero_ps();
        for (int64_t bi = 0; bi < blocks; bi++) {
            const uint8_t *b = row + bi * 210;
            stream_to(&st, (const char *)b + 210 + K_AHEAD);
            const __m512 dsv = q6k_scales(b);
            off = _mm512_fmadd_ps(dsv, _mm512_loadu_ps(xsum + bi * 16), off);
            const __m512 scale = _mm512_mul_ps(dsv, _mm512_loadu_ps(dx + bi * 16)); /* d sc_s dx_s */
            const int8_t *xh = xq + bi * 512, *xl = xh + 256;
            for (int h = 0; h < 2; h++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + 64 * h));
                const __m256i pairs = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                const __m512i hv = _mm512_inserti64x4(_mm512_castsi256_si512(pairs), _mm256_srli_epi16(pairs, 2), 1);
                /* bits 0-3 from the nibbles (where `low` is set), 4-7 from the pairs, then the top two cleared */
                const __m512i q0 = _mm512_and_si512(_mm512_ternarylogic_epi32(v, _mm512_slli_epi16(hv, 4), low, 0xE4), six);
                const __m512i q1 = _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), hv, low, 0xE4), six);
                const int8_t *xhh = xh + 128 * h, *xll = xl + 128 * h;
                __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q0, _mm512_loadu_si512((const void *)xhh));
                __m512i u = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q1, _mm512_loadu_si512((const void *)(xhh + 64)));
                t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), q0, _mm512_loadu_si512((const void *)xll));
                u = _mm512_dpbusd_epi32(_mm512_slli_epi32(u, 8), q1, _mm512_loadu_si512((const void *)(xll + 64)));
                a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_permutexvar_ps(pick[2 * h], scale), a0);
                a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), _mm512_permutexvar_ps(pick[2 * h + 1], scale), a1);
            }
        }
        store(y, r, _mm512_reduce_add_ps(_mm512_sub_ps(_mm512_add_ps(a0, a1), off)), acc);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define DSV41_Q4_BF16 1
/* The Q4 product with bf16 dot products (the default on CPUs with AVX-512 BF16 but not VNNI), for rows held split.
 * x is carried as two bf16 terms, x = hi + lo (hi = bf16(x), lo = bf16(x - hi)): 16 significant bits instead of float32's 24,
 * about 1e-6 of a row's sum of |w x| apart from the float32 path (int8 x: ~0.4 %). Each 16-bit word of a row's
 * nibbles holds four weights; shifted and masked into a bf16 mantissa with a fixed exponent (0x4180 | q << 3) each
 * nibble q becomes the bf16 value 16 + q exactly, with no table look-up or conversion, and vdpbf16ps multiplies 32
 * of them by 32 x terms into 16 float32 lanes (products exact, float32 sums). The offset, 16 sum(x_b) per block, goes
 * into the min term: sum_b d_b (16 + q_b) . x_b + (m_b - 16 d_b) sum(x_b) [Q4_0: (-8 d_b - 16 d_b) sum(x_b)]. Four
 * blocks' nibbles (64 bytes) a load; x's terms are laid out once per call in the order the words hold the weights
 * (q4_bf16_terms). Against the float32 path on the default model's Q4_1 matrices: 2.11 -> 1.56-1.76 ms a step's
 * worth on 2 threads of an AMD EPYC (the nibble-to-float work was the product's bottleneck). */
#define Q4_BF16_GROUP 256 /* bf16 words of x a group of four blocks takes: 2 terms x 4 vectors x 32 */

/* 16 bf16 words as float32 (exact) */
static inline __m512 bf16_half_to_ps(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

/* x's two bf16 terms for every group of four blocks: [term][vector v][word i], where vector v word i holds the
 * weight of block i / 8 that word i of the group's nibbles carries in v: v 0 / 1 the low / high nibble of the
 * word's low byte (weights 2 (i % 8) and 2 (i % 8) + 16), v 2 / 3 those of its high byte (the odd weights). A group
 * past the last block multiplies zeros. xsum[b]: block b's sum of x as the two terms carry it. */
/* 32 consecutive values of x (zeros when x is NULL) as their two terms: *hi / *lo the bf16 words in order; f[0] /
 * f[1] the first / last 16 hi terms as float32, f[2] / f[3] their lo terms (what the sums of x as the terms carry
 * them are made of: the offsets must cancel exactly what the dot products added). */
static inline void bf16_terms32(const float *x, __m512i *hi, __m512i *lo, __m512 f[4]) {
    const __m512 a = x ? _mm512_loadu_ps(x) : _mm512_setzero_ps(), c = x ? _mm512_loadu_ps(x + 16) : _mm512_setzero_ps();
    *hi = (__m512i)_mm512_cvtne2ps_pbh(c, a);
    f[0] = bf16_half_to_ps(_mm512_castsi512_si256(*hi));
    f[1] = bf16_half_to_ps(_mm512_extracti64x4_epi64(*hi, 1));
    *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(c, f[1]), _mm512_sub_ps(a, f[0]));
    f[2] = bf16_half_to_ps(_mm512_castsi512_si256(*lo));
    f[3] = bf16_half_to_ps(_mm512_extracti64x4_epi64(*lo, 1));
}

static void q4_bf16_terms(const float *x, int64_t blocks, uint16_t *xt, float *xsum) {
    static const int16_t pick_even[32] = {0, 2, 4, 6, 8, 10, 12, 14, 32, 34, 36, 38, 40, 42, 44, 46,
                                          0, 2, 4, 6, 8, 10, 12, 14, 32, 34, 36, 38, 40, 42, 44, 46};
    const __m512i even = _mm512_loadu_si512(pick_even), one = _mm512_set1_epi16(1), half = _mm512_set1_epi16(16);
    const int64_t groups = (blocks + 3) / 4;
    for (int64_t g = 0; g < groups; g++) {
        __m512i term[2][4]; /* [hi / lo][block of the group]: its 32 weights' words in order */
        for (int k = 0; k < 4; k++) {
            const int64_t b = 4 * g + k;
            __m512 f[4];
            bf16_terms32(b < blocks ? x + b * 32 : NULL, &term[0][k], &term[1][k], f);
            if (b < blocks)
                xsum[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(f[0], f[1]), _mm512_add_ps(f[2], f[3])));
        }
        uint16_t *out = xt + g * Q4_BF16_GROUP;
        for (int t = 0; t < 2; t++)
            for (int v = 0; v < 4; v++) {
                /* weights 2 j (+ 1 for v 2 / 3, + 16 for v 1 / 3) of blocks 0, 1 (words 0-15) and 2, 3 (16-31) */
                __m512i idx = _mm512_add_epi16(even, v & 1 ? half : _mm512_setzero_si512());
                if (v >= 2) idx = _mm512_add_epi16(idx, one);
                const __m512i first = _mm512_permutex2var_epi16(term[t][0], idx, term[t][1]);
                const __m512i second = _mm512_permutex2var_epi16(term[t][2], idx, term[t][3]);
                _mm512_storeu_si512(out + t * 128 + v * 32, _mm512_mask_blend_epi16(0xFFFF0000u, first, second));
            }
    }
}

/* The dot products of four vectors of 32 bf16 weights with a group's x terms (xg: [term][vector][32 words]): t sums
 * q0's and q2's, u q1's and q3's, each over both terms. */
static inline __attribute__((always_inline)) void dot_terms(__m512bh q0, __m512bh q1, __m512bh q2, __m512bh q3,
                                                            const uint16_t *xg, __m512 *t, __m512 *u) {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(xg));
    __m512 b = _mm512_dpbf16_ps(_mm512_setzero_ps(), q1, (__m512bh)_mm512_loadu_si512(xg + 32));
    a = _mm512_dpbf16_ps(a, q2, (__m512bh)_mm512_loadu_si512(xg + 64));
    b = _mm512_dpbf16_ps(b, q3, (__m512bh)_mm512_loadu_si512(xg + 96));
    a = _mm512_dpbf16_ps(a, q0, (__m512bh)_mm512_loadu_si512(xg + 128));
    b = _mm512_dpbf16_ps(b, q1, (__m512bh)_mm512_loadu_si512(xg + 160));
    *t = _mm512_dpbf16_ps(a, q2, (__m512bh)_mm512_loadu_si512(xg + 192));
    *u = _mm512_dpbf16_ps(b, q3, (__m512bh)_mm512_loadu_si512(xg + 224));
}

static void rows_q4_bf16(int64_t type, const uint8_t *w, const uint16_t *xt, const float *xsum, float *y, int64_t r0,
                         int64_t r1, int64_t cols, int acc) {
    const int64_t size = gguf_block_bytes(type), blocks = cols / 32, row_bytes = blocks * size;
    const int with_min = type == 3;
    const int64_t q_at = blocks * split_scale_bytes(type), m_at = 2 * blocks; /* the split layout */
    const __m512i mantissa = _mm512_set1_epi16(0x78), exponent = _mm512_set1_epi16(0x4180); /* bf16(16 + q) */
    const __m512i group_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    Stream st = group_stream(w, r0, r1, row_bytes, blocks);
    for (int64_t r = r0; r < r1; r += 4) {
        __m512 a[4], extra[4];
        const uint8_t *rowp[4];
        const int64_t n = row_group4(w, r, r1, row_bytes, rowp, a, extra);
        for (int64_t c = 0; c < blocks; c += 16) {
            const int64_t nb = blocks - c < 16 ? blocks - c : 16;
            const __mmask16 live = (__mmask16)((1u << nb) - 1u);
            const __m512 xs = _mm512_maskz_loadu_ps(live, xsum + c);
            __m512 scale[4];
            for (int j = 0; j < 4; j++) {
                __m512 d, m;
                block_scales(rowp[j], c, live, 1, with_min, m_at, _mm512_setzero_si512(), size, &d, &m);
                scale[j] = d;
                if (!with_min) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
                extra[j] = _mm512_fmadd_ps(_mm512_fnmadd_ps(d, _mm512_set1_ps(16.f), m), xs, extra[j]);
            }
            for (int64_t k = 0; k < nb; k += 4) {
                const int64_t bi = c + k, left = nb - k < 4 ? nb - k : 4;
                group_stream_to(&st, w, r, row_bytes, bi + 4);
                const __mmask64 bytes = left == 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * left)) - 1);
                const uint16_t *xg = xt + (bi / 4) * Q4_BF16_GROUP;
                const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32((int)k), group_lane); /* lane: its block's d */
                /* in an interleaved group (q4_split_at) the four blocks' 16 bytes come from the four chunks: position
                 * 4i + s of the vector is chunk s's word k + i */
                const __m512i quad_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
                const __m512i from = _mm512_add_epi32(_mm512_add_epi32(quad_lane, _mm512_set1_epi32((int)k)),
                                                      _mm512_set_epi32(16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0));
                const int grouped = nb == Q4_GROUP;
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const uint8_t *b0 = rowp[j] + q_at + bi * 16, *g = rowp[j] + q_at + c * 16;
                    const __m512i v = grouped
                        ? _mm512_mask_blend_epi32(0xCCCC,
                                                  _mm512_permutex2var_epi32(_mm512_loadu_si512((const void *)g), from,
                                                                            _mm512_loadu_si512((const void *)(g + 64))),
                                                  _mm512_permutex2var_epi32(_mm512_loadu_si512((const void *)(g + 128)), from,
                                                                            _mm512_loadu_si512((const void *)(g + 192))))
                        : _mm512_maskz_loadu_epi8(bytes, b0); /* a missing block: nibbles 0, x 0 */
                    /* (shifted & 0x78) | 0x4180 */
                    const __m512bh q0 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), mantissa, exponent, 0xEA);
                    const __m512bh q1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), mantissa, exponent, 0xEA);
                    const __m512bh q2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 5), mantissa, exponent, 0xEA);
                    const __m512bh q3 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 9), mantissa, exponent, 0xEA);
                    __m512 t, u;
                    dot_terms(q0, q1, q2, q3, xg, &t, &u);
                    a[j] = _mm512_fmadd_ps(_mm512_add_ps(t, u), _mm512_permutexvar_ps(pick, scale[j]), a[j]);
                }
            }
        }
        store4(y, r, n, _mm512_add_ps(a[0], extra[0]), _mm512_add_ps(a[1], extra[1]), _mm512_add_ps(a[2], extra[2]),
               _mm512_add_ps(a[3], extra[3]), acc);
    }
}

/* Q4_K on x as two bf16 terms, as rows_q4_bf16 does Q4_0 / Q4_1 (the default where the build has it). A block's 128
 * bytes of nibbles are read 64 at a time (chunks c, c + 1: sub-blocks 2c, 2c + 1 from the first 32 bytes' low and
 * high nibbles, 2c + 2, 2c + 3 from the next); word k of the 64 bytes holds four nibbles, each turned into the bf16
 * value 16 + q by a shift and one ternary-logic op: bits 0-3 the weight 2k' of the low sub-block, 4-7 of the high,
 * 8-11 and 12-15 the weights 2k' + 1 (k' = k mod 16). vdpbf16ps sums lanes 2i and 2i + 1, so float lane i holds
 * four weights of one sub-block (lanes 0-7 chunk c's, 8-15 chunk c + 1's), scaled by that sub-block's d * scale;
 * the offset 16 d sc and the minimum d_min m against the sums of x as the terms carry it. x's terms are laid out to
 * match once per product (q4k_bf16_terms): 256 words per 128 weights, [term][nibble][word]. About half the
 * instructions of rows_k_blocks' float path. */
#define Q4K_GROUP 256
/* 32 bf16 words with the even ones in words 0-15, the odd ones in 16-31 (the k-quant kernels' nibble order) */
static inline __m512i even_odd16(__m512i v) {
    static const int16_t order[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                      1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(order), v);
}

/* x's terms as rows_k4_bf16 reads them: group g = 2 b + p (half p of block b), [term][j][k]: word k of vector j holds
 * x[b, sub, at], sub = 2 chunk + (j & 1), chunk = 2 p + (k >= 16), at = 2 (k % 16) + (j >= 2); so each sub-block's
 * even elements are one half of vector j & 1, its odd ones of vector 2 + (j & 1). xsum[b][8 + sub] the sub-block's
 * sum as the terms carry it, xsum[b][sub] that times `offset` (against d sc: 16 for Q4_K, 32 for Q5_K). */
static void q4k_bf16_terms(const float *x, int64_t blocks, uint16_t *xt, float *xsum, float offset) {
    for (int64_t b = 0; b < blocks; b++)
        for (int sub = 0; sub < 8; sub++) {
            __m512i t[2];
            __m512 f[4];
            bf16_terms32(x + b * 256 + sub * 32, &t[0], &t[1], f);
            t[0] = even_odd16(t[0]), t[1] = even_odd16(t[1]);
            const float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(f[0], f[1]), _mm512_add_ps(f[2], f[3])));
            xsum[b * 16 + 8 + sub] = sum;
            xsum[b * 16 + sub] = offset * sum;
            uint16_t *out = xt + (2 * b + sub / 4) * Q4K_GROUP + ((sub >> 1) & 1) * 16;
            for (int term = 0; term < 2; term++) {
                _mm256_storeu_si256((__m256i *)(out + 128 * term + (sub & 1) * 32), _mm512_castsi512_si256(t[term]));
                _mm256_storeu_si256((__m256i *)(out + 128 * term + (2 + (sub & 1)) * 32), _mm512_extracti64x4_epi64(t[term], 1));
            }
        }
}

/* five: Q5_K (its fifth bits from qh: bit j of qh[i] for weight i of sub-block j; each q becomes bf16 32 + q, the
 * nibble and the fifth bit put into the mantissa in two shifts and two ternary-logic ops, as Q6_K's pairs). The
 * same x terms as Q4_K, the offset 32. */
static inline __attribute__((always_inline)) void rows_k4_bf16(const int five, const uint8_t *w, const uint16_t *xt,
                                                                const float *xsum, float *y, int64_t r0, int64_t r1,
                                                                int64_t cols, int acc) {
    const int64_t size = five ? 176 : 144, blocks = cols / 256, row_bytes = blocks * size, q_at = five ? 48 : 16;
    const __m512i mantissa = _mm512_set1_epi16(0x78), exponent = _mm512_set1_epi16(0x4180); /* bf16(16 + q) */
    const __m512i nibble5 = _mm512_set1_epi16(0x3C), keep5 = _mm512_set1_epi16(0x7C), exponent5 = _mm512_set1_epi16(0x4200);
    const __m512i lanes8 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i pick[4]; /* the scale of lanes 0-7 / 8-15: sub-blocks 4p (+ 1 for u) and 4p + 2 (+ 1) */
    for (int p = 0; p < 2; p++)
        for (int hi = 0; hi < 2; hi++) pick[2 * p + hi] = _mm512_add_epi32(lanes8, _mm512_set1_epi32(4 * p + hi));
    Stream st = {(const char *)w + r0 * row_bytes, (const char *)(w + r1 * row_bytes), 0};
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), off = _mm512_setzero_ps();
        for (int64_t bi = 0; bi < blocks; bi++) {
            const uint8_t *b = row + bi * size;
            stream_to(&st, (const char *)b + size + K_AHEAD);
            const __m512 dsv = k_scales_mins(b); /* d sc_j in lanes 0-7, dmin m_j in 8-15 */
            off = _mm512_fmadd_ps(dsv, _mm512_loadu_ps(xsum + bi * 16), off);
            for (int p = 0; p < 2; p++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + q_at + 64 * p));
                const uint16_t *xg = xt + (2 * bi + p) * Q4K_GROUP;
                __m512bh q0, q1, q2, q3;
                if (five) { /* chunk 2p's fifth bits are bits 4p, 4p + 1 of qh; chunk 2p + 1's the next two */
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
                    const __m512i hv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srl_epi16(h, _mm_cvtsi32_si128(4 * p))),
                                                          _mm256_srl_epi16(h, _mm_cvtsi32_si128(4 * p + 2)), 1);
#define Q5K_BF16(vs, hs) (__m512bh)_mm512_ternarylogic_epi32( \
                    _mm512_ternarylogic_epi32(vs, hs, nibble5, 0xE4), keep5, exponent5, 0xEA)
                    q0 = Q5K_BF16(_mm512_slli_epi16(v, 2), _mm512_slli_epi16(hv, 6));
                    q1 = Q5K_BF16(_mm512_srli_epi16(v, 2), _mm512_slli_epi16(hv, 5));
                    q2 = Q5K_BF16(_mm512_srli_epi16(v, 6), _mm512_srli_epi16(hv, 2));
                    q3 = Q5K_BF16(_mm512_srli_epi16(v, 10), _mm512_srli_epi16(hv, 3));
#undef Q5K_BF16
                } else {
                    q0 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), mantissa, exponent, 0xEA);
                    q1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), mantissa, exponent, 0xEA);
                    q2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 5), mantissa, exponent, 0xEA);
                    q3 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 9), mantissa, exponent, 0xEA);
                }
                __m512 t, u;
                dot_terms(q0, q1, q2, q3, xg, &t, &u);
                a0 = _mm512_fmadd_ps(t, _mm512_permutexvar_ps(pick[2 * p], dsv), a0);
                a1 = _mm512_fmadd_ps(u, _mm512_permutexvar_ps(pick[2 * p + 1], dsv), a1);
            }
        }
        store(y, r, _mm512_reduce_add_ps(_mm512_sub_ps(_mm512_add_ps(a0, a1), off)), acc);
    }
}
static void rows_q4k_bf16(const uint8_t *w, const uint16_t *xt, const float *xsum, float *y, int64_t r0, int64_t r1,
                          int64_t cols, int acc) {
    rows_k4_bf16(0, w, xt, xsum, y, r0, r1, cols, acc);
}
static void rows_q5k_bf16(const uint8_t *w, const uint16_t *xt, const float *xsum, float *y, int64_t r0, int64_t r1,
                          int64_t cols, int acc) {
    rows_k4_bf16(1, w, xt, xsum, y, r0, r1, cols, acc);
}

/* Q6_K on x as two bf16 terms. A 6-bit q is exact in bf16 as 64 + q (bits 0x4280 | q << 1). Half a block (128
 * weights) at a time: its 64 bytes of low nibbles as 32 words (words 0-15 the bytes 0-31, quarters 0 and 2 of the
 * half; 16-31 the bytes 32-63, quarters 1 and 3) beside its 32 bytes of high pairs (as 16 words, then again shifted
 * by 2 for the second 16); each of a word's four nibbles and its two high bits become one bf16 in two shifts and
 * two ternary-logic ops. Float lane i of the dot products holds four weights of one sub-block of 16: lanes 0-15 the
 * half's sub-blocks 0,0,0,0,1,1,1,1,2,... (low nibbles) and 4,4,4,4,5,... (high). The offset 64 + 32 against the
 * sums of x over 16 as the terms carry them. */
#define Q6K_HALF 256
static void q6k_bf16_terms(const float *x, int64_t blocks, uint16_t *xt, float *xsum) {
    /* half h of block b, its quarter q (32 values): vector n = (q >> 1) (+ 2 for the odd elements), words
     * (q & 1) * 16 ..; xsum per sub-block of 16, times 64 + 32 */
    for (int64_t b = 0; b < blocks; b++)
        for (int h = 0; h < 2; h++)
            for (int q = 0; q < 4; q++) {
                __m512i t[2];
                __m512 f[4];
                bf16_terms32(x + b * 256 + 128 * h + 32 * q, &t[0], &t[1], f);
                t[0] = even_odd16(t[0]), t[1] = even_odd16(t[1]);
                for (int e = 0; e < 2; e++) /* the sums over 16 as the terms carry them */
                    xsum[b * 16 + 8 * h + 2 * q + e] = 96.f * _mm512_reduce_add_ps(_mm512_add_ps(f[e], f[2 + e]));
                uint16_t *out = xt + (2 * b + h) * Q6K_HALF + (q & 1) * 16;
                for (int term = 0; term < 2; term++) {
                    _mm256_storeu_si256((__m256i *)(out + 128 * term + (q >> 1) * 32), _mm512_castsi512_si256(t[term]));
                    _mm256_storeu_si256((__m256i *)(out + 128 * term + (2 + (q >> 1)) * 32), _mm512_extracti64x4_epi64(t[term], 1));
                }
            }
}

static void rows_q6k_bf16(const uint8_t *w, const uint16_t *xt, const float *xsum, float *y, int64_t r0, int64_t r1,
                          int64_t cols, int acc) {
    const int64_t blocks = cols / 256, row_bytes = blocks * 210;
    const __m512i low = _mm512_set1_epi16(0x1E), keep = _mm512_set1_epi16(0x7E), exponent = _mm512_set1_epi16(0x4280);
    __m512i pick[4];
    q6k_picks(pick);
    Stream st = {(const char *)w + r0 * row_bytes, (const char *)(w + r1 * row_bytes), 0};
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), off = _mm512_setzero_ps();
        for (int64_t bi = 0; bi < blocks; bi++) {
            const uint8_t *b = row + bi * 210;
            stream_to(&st, (const char *)b + 210 + K_AHEAD);
            const __m512 dsv = q6k_scales(b);
            off = _mm512_fmadd_ps(dsv, _mm512_loadu_ps(xsum + bi * 16), off);
            for (int h = 0; h < 2; h++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + 64 * h));
                const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                const __m512i hv = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 2), 1);
                const uint16_t *xg = xt + (2 * bi + h) * Q6K_HALF;
                /* nibble n at bits 4n of v, its high pair at bits 4n of hv: to bits 1-4 and 5-6, then | 0x4280 */
#define Q6K_BF16(vs, hs) (__m512bh)_mm512_ternarylogic_epi32( \
                    _mm512_ternarylogic_epi32(vs, hs, low, 0xE4), keep, exponent, 0xEA)
                const __m512bh q0 = Q6K_BF16(_mm512_slli_epi16(v, 1), _mm512_slli_epi16(hv, 5));
                const __m512bh q1 = Q6K_BF16(_mm512_srli_epi16(v, 3), _mm512_slli_epi16(hv, 1));
                const __m512bh q2 = Q6K_BF16(_mm512_srli_epi16(v, 7), _mm512_srli_epi16(hv, 3));
                const __m512bh q3 = Q6K_BF16(_mm512_srli_epi16(v, 11), _mm512_srli_epi16(hv, 7));
#undef Q6K_BF16
                __m512 t, u;
                dot_terms(q0, q1, q2, q3, xg, &t, &u);
                a0 = _mm512_fmadd_ps(t, _mm512_permutexvar_ps(pick[2 * h], dsv), a0);
                a1 = _mm512_fmadd_ps(u, _mm512_permutexvar_ps(pick[2 * h + 1], dsv), a1);
            }
        }
        store(y, r, _mm512_reduce_add_ps(_mm512_sub_ps(_mm512_add_ps(a0, a1), off)), acc);
    }
}
#endif

#if defined(DSV41_Q4_INT16_AVX2)
/* The k-quants on int16 x on AVX2: x as q16_blocks lays it out (per 32 values 32 high bytes, then 32 low ones; dx
 * and the sum of each 32 as rounded), the weights' integers as unsigned bytes 32 at a time, vpmaddubsw against the
 * two bytes and vpmaddwd with 256 and 1 as rows_q4_int16_avx2: exact integer sums of four weights a lane, converted
 * exactly, times d sc dx. A row at a time, its blocks streamed into L2 ahead.
 * Q4_K: chunk c's 32 bytes are sub-block 2c (low nibbles) and 2c + 1 (high), in order; the minimums against the
 * rounded x's sums per 32. Q6_K: a half block's 32 weights at a time, q = (nibble) | (high pair << 4), the lanes
 * 0-3 one sub-block of 16 and 4-7 the next; the -32 against the rounded x's sums per 16 (xsum16). */
/* five: Q5_K (each nibble's fifth bit from qh: bit 2c of byte l for chunk c's low nibbles, 2c + 1 for its high
 * ones, put in bit 4 of the byte) */
static inline __attribute__((always_inline)) void rows_k4_int16_avx2(const int five, const uint8_t *w,
                                                                      const int8_t *xq, const float *dx,
                                                                      const float *xsum, float *y, int64_t r0,
                                                                      int64_t r1, int64_t cols, int acc) {
    const int64_t size = five ? 176 : 144, blocks = cols / 256, row_bytes = blocks * size, q_at = five ? 48 : 16;
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i bit0 = _mm256_set1_epi8(0x01);
    Stream st = {(const char *)w + r0 * row_bytes, (const char *)(w + r1 * row_bytes), 0};
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), off = _mm256_setzero_ps();
        for (int64_t bi = 0; bi < blocks; bi++) {
            const uint8_t *b = row + bi * size;
            stream_to(&st, (const char *)b + size + K_AHEAD);
            __m256 ds, dm;
            k_scales_mins8(b, &ds, &dm);
            off = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xsum + bi * 8), off);
            const __m256 scale = _mm256_mul_ps(ds, _mm256_loadu_ps(dx + bi * 8)); /* d sc_j dx_j */
            const int8_t *xb = xq + bi * 512;
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + q_at + 32 * c));
                __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                if (five) {
                    const __m256i qh = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)), _mm_cvtsi32_si128(2 * c));
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, bit0), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), bit0), 4));
                }
                const int8_t *x0 = xb + 128 * c, *x1 = x0 + 64; /* sub-blocks 2c and 2c + 1: high bytes, low at + 32 */
                const __m256i t = x16_dot_avx2_at(lo, x0), u = x16_dot_avx2_at(hi, x1);
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(2 * c)), a0);
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(u), _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(2 * c + 1)), a1);
            }
        }
        store(y, r, hsum256(_mm256_sub_ps(_mm256_add_ps(a0, a1), off)), acc);
    }
}
static void rows_q4k_int16_avx2(const uint8_t *w, const int8_t *xq, const float *dx, const float *xsum, float *y,
                                int64_t r0, int64_t r1, int64_t cols, int acc) {
    rows_k4_int16_avx2(0, w, xq, dx, xsum, y, r0, r1, cols, acc);
}
static void rows_q5k_int16_avx2(const uint8_t *w, const int8_t *xq, const float *dx, const float *xsum, float *y,
                                int64_t r0, int64_t r1, int64_t cols, int acc) {
    rows_k4_int16_avx2(1, w, xq, dx, xsum, y, r0, r1, cols, acc);
}

static void rows_q6k_int16_avx2(const uint8_t *w, const int8_t *xq, const float *dx, const float *xsum16, float *y,
                                int64_t r0, int64_t r1, int64_t cols, int acc) {
    const int64_t blocks = cols / 256, row_bytes = blocks * 210;
    const __m256i nib = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x30);
    const __m256i halves = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
    Stream st = {(const char *)w + r0 * row_bytes, (const char *)(w + r1 * row_bytes), 0};
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        __m256 a = _mm256_setzero_ps(), off = _mm256_setzero_ps();
        for (int64_t bi = 0; bi < blocks; bi++) {
            const uint8_t *b = row + bi * 210;
            stream_to(&st, (const char *)b + 210 + K_AHEAD);
            const float d = f16_to_f32(u16_at(b + 208));
            const __m128i sc8 = _mm_loadu_si128((const __m128i *)(b + 192));
            const __m256 sc[2] = {_mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))),
                                  _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))))};
            off = _mm256_fmadd_ps(sc[0], _mm256_loadu_ps(xsum16 + bi * 16), off);
            off = _mm256_fmadd_ps(sc[1], _mm256_loadu_ps(xsum16 + bi * 16 + 8), off);
            for (int h = 0; h < 2; h++) {
                const __m256i qa = _mm256_loadu_si256((const __m256i *)(b + 64 * h)),
                              qb = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)),
                              qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                const __m256i q[4] = {
                    _mm256_or_si256(_mm256_and_si256(qa, nib), _mm256_and_si256(_mm256_slli_epi16(qh, 4), pair)),
                    _mm256_or_si256(_mm256_and_si256(qb, nib), _mm256_and_si256(_mm256_slli_epi16(qh, 2), pair)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), nib), _mm256_and_si256(qh, pair)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), nib), _mm256_and_si256(_mm256_srli_epi16(qh, 2), pair))};
                for (int g = 0; g < 4; g++) { /* weights 128 h + 32 g ..: sub-blocks 8 h + 2 g, + 1; x's block 8 bi + 4 h + g */
                    const int64_t xb = 8 * bi + 4 * h + g;
                    const int8_t *xp = xq + xb * 64;
                    const __m256i t = x16_dot_avx2_at(q[g], xp);
                    const int s = 8 * h + 2 * g; /* lanes 0-3 sub-block s, 4-7 s + 1 */
                    const __m256 scale = _mm256_mul_ps(
                        _mm256_permutevar8x32_ps(sc[s / 8], _mm256_add_epi32(halves, _mm256_set1_epi32(s % 8))),
                        _mm256_set1_ps(dx[xb]));
                    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, a);
                }
            }
        }
        store(y, r, hsum256(_mm256_sub_ps(a, off)), acc);
    }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* The k-quants (256 weights a block) on float32 x, one row at a time, a block's integers widened to one per dword
 * lane and converted to float, each sub-block's dot with x scaled by its own d * scale (the values multiplied are
 * the file's exactly; only the order of the float32 sums differs from multiplying the dequantised row):
 *   Q4_K / Q5_K: 8 sub-blocks of 32, value = d sc_j q - dmin m_j (q 4 bits; Q5_K's fifth bit from qh), the minimum
 *                term summed per block against xsum (x's sums over 16, pairs taken);
 *   Q6_K:        16 sub-blocks of 16, value = d sc_s (q - 32) (4 low bits from ql, 2 high from qh), the -32 term
 *                against xsum the same way.
 * The rows ahead are streamed into L2 (K_AHEAD bytes ahead). A block's values one at a time (rows_gguf, the
 * build without AVX2) made 1.8 GB/s for Q4_K and 0.6 for Q6_K on 2 cores of an AMD EPYC; these loops 16.0 and 16.5
 * (AVX-512), and on AVX-512 BF16 the bf16-term kernels above 23.9 and 29.9 (benchmarks/gguf_blocks.py). On AVX2 each
 * sub-block's dot is summed before its one multiply by the scale, and a block's scales and minimums (Q4_K, Q5_K:
 * k_scales_mins8) or scales (Q6_K) are unpacked and multiplied on 8 lanes, their minimum / -32 terms kept in a
 * vector to the row's end: unpacked a value at a time they took as long as the products (Q4_K / Q5_K / Q6_K 12.1 /
 * 8.6 / 11.1 GB/s then, 17.2 / 13.1 / 17.8 after, the two builds taking turns in one process, a one-off measurement). */
static void rows_k_blocks(int64_t type, const uint8_t *w, const float *x, const float *xsum, float *y, int64_t r0,
                          int64_t r1, int64_t cols, int acc) {
    const int64_t size = gguf_block_bytes(type), blocks = cols / 256, row_bytes = blocks * size;
    Stream st = {(const char *)w + r0 * row_bytes, (const char *)(w + r1 * row_bytes), 0};
#if defined(__AVX512F__)
    const __m512i m15 = _mm512_set1_epi32(15), m16 = _mm512_set1_epi32(16), m48 = _mm512_set1_epi32(48);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        __m512 off = _mm512_setzero_ps(); /* the minimum (Q4_K, Q5_K) or 32 (Q6_K) terms, subtracted at the end */
        for (int64_t bi = 0; bi < blocks; bi++) {
            const uint8_t *b = row + bi * size;
            const float *xb = x + bi * 256, *xs = xsum + bi * 16;
            stream_to(&st, (const char *)b + size + K_AHEAD);
            if (type == 14) {
                const uint8_t *ql = b, *qh = b + 128;
                const int8_t *sc = (const int8_t *)(b + 192);
                const float d = f16_to_f32(u16_at(b + 208));
                float ds[16];
                const __m512 dsv = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)sc))));
                _mm512_storeu_ps(ds, dsv);
                off = _mm512_fmadd_ps(dsv, _mm512_mul_ps(_mm512_set1_ps(32.f), _mm512_loadu_ps(xs)), off);
                for (int half = 0; half < 2; half++)
                    for (int l0 = 0; l0 < 32; l0 += 16) {
                        const __m512i A = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 64 * half + l0)));
                        const __m512i B = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 64 * half + 32 + l0)));
                        const __m512i H = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 32 * half + l0)));
                        const __m512i q1 = _mm512_or_si512(_mm512_and_si512(A, m15), _mm512_and_si512(_mm512_slli_epi32(H, 4), m48));
                        const __m512i q2 = _mm512_or_si512(_mm512_and_si512(B, m15), _mm512_and_si512(_mm512_slli_epi32(H, 2), m48));
                        const __m512i q3 = _mm512_or_si512(_mm512_srli_epi32(A, 4), _mm512_and_si512(H, m48));
                        const __m512i q4 = _mm512_or_si512(_mm512_srli_epi32(B, 4), _mm512_and_si512(_mm512_srli_epi32(H, 2), m48));
                        const float *xq = xb + 128 * half + l0;
                        const int s0 = 8 * half + l0 / 16; /* the sub-block of 16 of the first quarter */
                        a0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q1), _mm512_loadu_ps(xq)), _mm512_set1_ps(ds[s0]), a0);
                        a1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q2), _mm512_loadu_ps(xq + 32)), _mm512_set1_ps(ds[s0 + 2]), a1);
                        a2 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q3), _mm512_loadu_ps(xq + 64)), _mm512_set1_ps(ds[s0 + 4]), a2);
                        a3 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q4), _mm512_loadu_ps(xq + 96)), _mm512_set1_ps(ds[s0 + 6]), a3);
                    }
            } else {
                const uint8_t *qh = b + 16, *qs = b + (type == 13 ? 48 : 16);
                float ds[16];
                const __m512 dsm = k_scales_mins(b);
                _mm512_storeu_ps(ds, dsm);
                /* the minimums against x's sums over each sub-block of 32 (pairs of the sums over 16) */
                const __m512 xs16 = _mm512_loadu_ps(xs);
                const __m512 pairs = _mm512_add_ps(xs16, _mm512_permutexvar_ps(_mm512_set_epi32(
                    0, 15, 0, 13, 0, 11, 0, 9, 0, 7, 0, 5, 0, 3, 0, 1), xs16)); /* lane 2j: x's sum over sub-block j */
                off = _mm512_fmadd_ps(dsm, _mm512_maskz_permutexvar_ps(0xFF00, _mm512_set_epi32(
                    14, 12, 10, 8, 6, 4, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0), pairs), off);
                __m512i h0 = _mm512_setzero_si512(), h1 = h0;
                if (type == 13) {
                    h0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
                    h1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16)));
                }
                for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
                    const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c)));
                    const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * c + 16)));
                    __m512i l0 = _mm512_and_si512(v0, m15), l1 = _mm512_and_si512(v1, m15);
                    __m512i u0 = _mm512_srli_epi32(v0, 4), u1 = _mm512_srli_epi32(v1, 4);
                    if (type == 13) { /* bit 2c of qh[i] is weight i's fifth bit in sub-block 2c, bit 2c + 1 in 2c + 1 */
                        const __m128i lo_shift = _mm_cvtsi32_si128(2 * c), hi_shift = _mm_cvtsi32_si128(2 * c + 1);
                        l0 = _mm512_or_si512(l0, _mm512_and_si512(_mm512_slli_epi32(_mm512_srl_epi32(h0, lo_shift), 4), m16));
                        l1 = _mm512_or_si512(l1, _mm512_and_si512(_mm512_slli_epi32(_mm512_srl_epi32(h1, lo_shift), 4), m16));
                        u0 = _mm512_or_si512(u0, _mm512_and_si512(_mm512_slli_epi32(_mm512_srl_epi32(h0, hi_shift), 4), m16));
                        u1 = _mm512_or_si512(u1, _mm512_and_si512(_mm512_slli_epi32(_mm512_srl_epi32(h1, hi_shift), 4), m16));
                    }
                    const float *xc = xb + 64 * c;
                    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l1), _mm512_loadu_ps(xc + 16),
                                                      _mm512_mul_ps(_mm512_cvtepi32_ps(l0), _mm512_loadu_ps(xc)));
                    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u1), _mm512_loadu_ps(xc + 48),
                                                      _mm512_mul_ps(_mm512_cvtepi32_ps(u0), _mm512_loadu_ps(xc + 32)));
                    if (c & 1) {
                        a2 = _mm512_fmadd_ps(lo, _mm512_set1_ps(ds[2 * c]), a2);
                        a3 = _mm512_fmadd_ps(hi, _mm512_set1_ps(ds[2 * c + 1]), a3);
                    } else {
                        a0 = _mm512_fmadd_ps(lo, _mm512_set1_ps(ds[2 * c]), a0);
                        a1 = _mm512_fmadd_ps(hi, _mm512_set1_ps(ds[2 * c + 1]), a1);
                    }
                }
            }
        }
        store(y, r, _mm512_reduce_add_ps(_mm512_sub_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), off)),
              acc);
    }
#else /* the same on 8 lanes */
    const __m256i m15 = _mm256_set1_epi32(15), m16 = _mm256_set1_epi32(16), m48 = _mm256_set1_epi32(48);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 off = _mm256_setzero_ps(), mins = _mm256_setzero_ps(); /* Q6_K's -32 terms / 32, the minimum terms */
        for (int64_t bi = 0; bi < blocks; bi++) {
            const uint8_t *b = row + bi * size;
            const float *xb = x + bi * 256, *xs = xsum + bi * 16;
            stream_to(&st, (const char *)b + size + K_AHEAD);
            if (type == 14) {
                const uint8_t *ql = b, *qh = b + 128;
                const int8_t *sc = (const int8_t *)(b + 192);
                const __m256 d = _mm256_set1_ps(f16_to_f32(u16_at(b + 208)));
                float ds[16];
                const __m256 d0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
                const __m256 d1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8)))));
                _mm256_storeu_ps(ds, d0);
                _mm256_storeu_ps(ds + 8, d1);
                off = _mm256_fmadd_ps(d0, _mm256_loadu_ps(xs), _mm256_fmadd_ps(d1, _mm256_loadu_ps(xs + 8), off));
                for (int half = 0; half < 2; half++)
                    for (int l0 = 0; l0 < 32; l0 += 16) { /* a sub-block of 16's dots first, then its scale */
                        __m256 t[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                        for (int l = l0; l < l0 + 16; l += 8) {
                            const __m256i A = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + 64 * half + l)));
                            const __m256i B = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + 64 * half + 32 + l)));
                            const __m256i H = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + 32 * half + l)));
                            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(A, m15), _mm256_and_si256(_mm256_slli_epi32(H, 4), m48));
                            const __m256i q2 = _mm256_or_si256(_mm256_and_si256(B, m15), _mm256_and_si256(_mm256_slli_epi32(H, 2), m48));
                            const __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(A, 4), _mm256_and_si256(H, m48));
                            const __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(B, 4), _mm256_and_si256(_mm256_srli_epi32(H, 2), m48));
                            const float *xq = xb + 128 * half + l;
                            t[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), _mm256_loadu_ps(xq), t[0]);
                            t[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q2), _mm256_loadu_ps(xq + 32), t[1]);
                            t[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q3), _mm256_loadu_ps(xq + 64), t[2]);
                            t[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4), _mm256_loadu_ps(xq + 96), t[3]);
                        }
                        const int s0 = 8 * half + l0 / 16;
                        a0 = _mm256_fmadd_ps(t[0], _mm256_set1_ps(ds[s0]), a0);
                        a1 = _mm256_fmadd_ps(t[1], _mm256_set1_ps(ds[s0 + 2]), a1);
                        a2 = _mm256_fmadd_ps(t[2], _mm256_set1_ps(ds[s0 + 4]), a2);
                        a3 = _mm256_fmadd_ps(t[3], _mm256_set1_ps(ds[s0 + 6]), a3);
                    }
            } else {
                const uint8_t *qh = b + 16, *qs = b + (type == 13 ? 48 : 16);
                float ds[8];
                __m256 dsv, dmv;
                k_scales_mins8(b, &dsv, &dmv);
                _mm256_storeu_ps(ds, dsv);
                /* x's sums over each sub-block of 32: pairs of its sums over 16, in sub-block order */
                const __m256 pairs = _mm256_permutevar8x32_ps(_mm256_hadd_ps(_mm256_loadu_ps(xs), _mm256_loadu_ps(xs + 8)),
                                                              _mm256_set_epi32(7, 6, 3, 2, 5, 4, 1, 0));
                mins = _mm256_fmadd_ps(dmv, pairs, mins);
                __m256i hb[4]; /* Q5_K: qh widened once a block, each byte's bit 2c + 1 moved to bit 4 (<< 3 - 2c) */
                if (type == 13)
                    for (int k = 0; k < 4; k++)
                        hb[k] = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + 8 * k))), 4);
                for (int c = 0; c < 4; c++) { /* each sub-block's dot first, then one multiply by its scale */
                    __m256 tl = _mm256_setzero_ps(), th = _mm256_setzero_ps();
                    for (int k = 0; k < 32; k += 8) {
                        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 32 * c + k)));
                        __m256i lo = _mm256_and_si256(v, m15), hi = _mm256_srli_epi32(v, 4);
                        if (type == 13) { /* bit 2c of qh[i] is weight i's fifth bit in sub-block 2c, bit 2c + 1 in 2c + 1 */
                            const __m256i h = _mm256_srl_epi32(hb[k / 8], _mm_cvtsi32_si128(2 * c));
                            lo = _mm256_or_si256(lo, _mm256_and_si256(h, m16));
                            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi32(h, 1), m16));
                        }
                        const float *xc = xb + 64 * c + k;
                        tl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_loadu_ps(xc), tl);
                        th = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_loadu_ps(xc + 32), th);
                    }
                    if (c & 1) {
                        a2 = _mm256_fmadd_ps(tl, _mm256_set1_ps(ds[2 * c]), a2);
                        a3 = _mm256_fmadd_ps(th, _mm256_set1_ps(ds[2 * c + 1]), a3);
                    } else {
                        a0 = _mm256_fmadd_ps(tl, _mm256_set1_ps(ds[2 * c]), a0);
                        a1 = _mm256_fmadd_ps(th, _mm256_set1_ps(ds[2 * c + 1]), a1);
                    }
                }
            }
        }
        const __m256 terms = _mm256_fmadd_ps(_mm256_set1_ps(-32.f), off, _mm256_sub_ps(_mm256_add_ps(a0, a1), mins));
        store(y, r, hsum256(_mm256_add_ps(terms, _mm256_add_ps(a2, a3))), acc);
    }
#endif
}
#endif

/* Any held format a value at a time: the path of a build without AVX2 + FMA (the vector builds take
 * rows_small_blocks / rows_q8_0 / the Q4 x modes and rows_k_blocks). */
static void rows_gguf(int64_t type, int split, const uint8_t *w, const float *x, float *y, int64_t r0, int64_t r1,
                      int64_t cols, int acc) {
    const int64_t per = gguf_block_weights(type), size = gguf_block_bytes(type), blocks = cols / per;
    float vals[256];
    uint8_t tmp[256]; /* a block reassembled from the split layout (Q4_K: 144 bytes) */
    (void)size;
    for (int64_t r = r0; r < r1; r++) {
        float s = 0.f;
        for (int64_t bi = 0; bi < blocks; bi++) {
            gguf_block_values(type, block_at(type, split, w, r * blocks + bi, blocks, tmp), vals);
            for (int64_t i = 0; i < per; i++) s += vals[i] * x[bi * per + i];
        }
        store(y, r, s, acc);
    }
}

/* How Q4_0 / Q4_1 products take x: 0 float32 (rows_small_blocks, exact to float32), 1 rounded to int8 per block
 * (rows_q4_vnni, AVX-512 VNNI), 2 as two bf16 terms (rows_q4_bf16, AVX-512 BF16; rows held split), 3 rounded to
 * int16 per block with exact integer products (rows_q4_int16, AVX-512 VNNI). Q4_K follows (rows_q4k_int8,
 * rows_q4k_bf16, rows_q4k_int16); Q5_K and Q6_K take int16 x in mode 3 (rows_q5k_int16, rows_q6k_int16) and two
 * bf16 terms in modes 1 and 2 where the build has them (rows_q5k_bf16, rows_q6k_bf16); the k-quants in mode 0
 * float32 x (rows_k_blocks); Q8_0 float32 x in every mode with AVX-512. An AVX2 build has mode 3 for Q4_0 / Q4_1
 * and the k-quants (rows_q4_int16_avx2, rows_q4k_int16_avx2, rows_q5k_int16_avx2, rows_q6k_int16_avx2), mode 1 for
 * Q4_0 / Q4_1 (rows_q4_int8_avx2; the k-quants take int16 x there), and Q8_0 on int16 x in both
 * (rows_q8_0_int16_avx2). The default is 3 where the build has AVX-512 VNNI or is
 * the AVX2 build, else 2 where it has BF16; DSV41_GGUF_X (engine/kernels/library.py) or gguf_blocks.x_mode changes
 * it. */
#define X_FLOAT32 0
#define X_INT8 1
#define X_BF16 2
#define X_INT16 3
#if defined(DSV41_Q4_VNNI) || defined(DSV41_Q4_INT16_AVX2)
static int gguf_x_mode = X_INT16;
#elif defined(DSV41_Q4_BF16)
static int gguf_x_mode = X_BF16;
#else
static int gguf_x_mode = X_FLOAT32;
#endif

/* The x modes this build has, as bits (1 << mode). */
int dsv41_gguf_x_modes(void) {
    int modes = 1 << X_FLOAT32;
#if defined(DSV41_Q4_VNNI)
    modes |= (1 << X_INT8) | (1 << X_INT16);
#endif
#if defined(DSV41_Q4_INT16_AVX2)
    modes |= (1 << X_INT8) | (1 << X_INT16);
#endif
#if defined(DSV41_Q4_BF16)
    modes |= 1 << X_BF16;
#endif
    return modes;
}

/* Sets the x mode (mode >= 0) and returns the one before; -1 (nothing changed) for a mode this build lacks. */
int dsv41_gguf_x_mode(int mode) {
    const int before = gguf_x_mode;
    if (mode >= 0) {
        if (mode > X_INT16 || !(dsv41_gguf_x_modes() & (1 << mode))) return -1;
        gguf_x_mode = mode;
    }
    return before;
}

/* y[rows] = W[rows, cols] x (+ y when acc); W as GGUF blocks of `type` (each row cols / block weights blocks).
 * Returns 0, or -1 for a type not held or cols not a whole number of blocks. */
/* x prepared for a product (its bf16 terms, its int8 rounding, its sums) lives in one buffer: the caller's stack where
 * it fits (X_STACK bytes: every matrix up to 8,192 columns), else malloc'd; carve() hands out 64-byte aligned parts. */
#define X_STACK 36864
static inline char *x_scratch(char *stack, size_t need) { return need <= X_STACK ? stack : (char *)malloc(need); }
static inline void *carve(char **at, size_t bytes) {
    void *p = *at;
    *at += (bytes + 63) & ~(size_t)63;
    return p;
}
/* The rows the decode step multiplies next (mv sets them; empty outside the step): each thread that has done its
 * rows of a GGUF product asks for the first rows of its share of the next product into L2 (NEXT_ROWS: as far as
 * group_stream runs ahead), so that the next product does not begin on loads that wait on memory; they arrive while
 * the threads meet, the vector for the next product is made, the norm and the attention run. A hint only: a step
 * run at the same time in another thread (one process, two models) may see the other's, and prefetch other bytes.
 * Paired against none (docs/design.md, "Where a product begins"): the step's products ×1.026. */
#define NEXT_ROWS 32
typedef struct {
    const char *data;
    int64_t rows, row_bytes;
} NextRows;
static NextRows next_rows;

static inline void prefetch_next_rows(void) {
    const NextRows n = next_rows;
    if (!n.data) return;
    int64_t r0, r1;
    thread_rows(n.rows, &r0, &r1);
    if (r1 - r0 > NEXT_ROWS) r1 = r0 + NEXT_ROWS;
    for (const char *at = n.data + r0 * n.row_bytes, *end = n.data + r1 * n.row_bytes; at < end; at += 64)
        __builtin_prefetch(at, 0, 2);
}

/* `call` on this thread's share of the rows (r0, r1), on `threads` threads */
#define ON_ROWS(call)                                   \
    _Pragma("omp parallel num_threads(threads)") {      \
        int64_t r0, r1;                                 \
        thread_rows(rows, &r0, &r1);                    \
        call;                                           \
        prefetch_next_rows();                           \
    }

int dsv41_mv_gguf(int64_t type, const void *w, const float *x, float *y, int64_t rows, int64_t cols, int acc,
                  int threads) {
    const int64_t per = gguf_block_weights(type & 255);
    if (!per || cols % per || !gguf_type_ok(type, rows * (cols / per), cols / per)) return -1;
    const int split = (type & GGUF_SPLIT) != 0;
    type &= 255;
    const uint8_t *wb = (const uint8_t *)w;
    const size_t b32 = (size_t)(cols / 32), b256 = (size_t)(cols / 256), pad = 4 * 64;
    _Alignas(64) char stack[X_STACK];
    char *buf, *at;
    (void)b32, (void)b256, (void)pad, (void)stack, (void)buf, (void)at; /* unused in a build without AVX2 */
    if (type == 12 && split && gguf_x_mode != X_INT16) {
        /* split Q4_K rows in another x mode than int16 (whose loop reads them in place): 64 rows at a time put back
         * in the file's order, then multiplied as such */
        const int64_t blocks = cols / 256, row_bytes = blocks * 144, chunk = 64;
        uint8_t *in_order = malloc((size_t)(chunk * row_bytes));
        if (!in_order) return -2;
        int status = 0;
        for (int64_t r = 0; r < rows && !status; r += chunk) {
            const int64_t n = rows - r < chunk ? rows - r : chunk;
#pragma omp parallel for schedule(static) num_threads(threads)
            for (int64_t i = 0; i < n * blocks; i++)
                k4_split_block(wb + (r + i / blocks) * row_bytes, blocks, i % blocks, in_order + i * 144);
            status = dsv41_mv_gguf(12, in_order, x, y + r, n, cols, acc, threads);
        }
        free(in_order);
        return status;
    }
#if defined(DSV41_Q4_VNNI)
    if ((type == 12 || type == 13 || type == 14) && gguf_x_mode == X_INT16) {
        if (!(buf = at = x_scratch(stack, 512 * b256 + 64 * b256 + 64 * b256 + 64 * b256 + pad))) return -2;
        int8_t *xq = carve(&at, 512 * b256);
        float *dx = carve(&at, 64 * b256), *xsum = carve(&at, 64 * b256), *side = carve(&at, 64 * b256);
        if (type == 12) {
            const int64_t grouped = split ? (int64_t)b256 / 4 * 4 : 0; /* k4_split_at */
            q4k_int16_x(x, (int64_t)b256, grouped, xq, dx, xsum, side);
            ON_ROWS(rows_q4k_int16(wb, xq, dx, xsum, y, r0, r1, cols, acc, grouped, side))
        } else if (type == 13) {
            q4k_int_x(x, (int64_t)b256, 2, xq, dx, xsum);
            ON_ROWS(rows_q5k_int16(wb, xq, dx, xsum, y, r0, r1, cols, acc))
        } else {
            q6k_int16_x(x, (int64_t)b256, xq, dx, xsum);
            ON_ROWS(rows_q6k_int16(wb, xq, dx, xsum, y, r0, r1, cols, acc))
        }
        if (buf != stack) free(buf);
        return 0;
    }
#endif
#if defined(DSV41_Q4_BF16)
    if ((type == 2 || type == 3) && split && gguf_x_mode == X_BF16) {
        const size_t groups = (b32 + 3) / 4;
        if (!(buf = at = x_scratch(stack, 2 * Q4_BF16_GROUP * groups + 4 * b32 + pad))) return -2;
        uint16_t *xt = carve(&at, 2 * Q4_BF16_GROUP * groups);
        float *xsum = carve(&at, 4 * b32);
        q4_bf16_terms(x, (int64_t)b32, xt, xsum);
        ON_ROWS(rows_q4_bf16(type, wb, xt, xsum, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
    if (type == 14 && gguf_x_mode != X_FLOAT32) { /* int8 mode too: Q6_K has no int8 route, and the terms are finer */
        if (!(buf = at = x_scratch(stack, 4 * Q6K_HALF * b256 + 64 * b256 + pad))) return -2;
        uint16_t *xt = carve(&at, 4 * Q6K_HALF * b256);
        float *xsum = carve(&at, 64 * b256);
        q6k_bf16_terms(x, (int64_t)b256, xt, xsum);
        ON_ROWS(rows_q6k_bf16(wb, xt, xsum, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
    if ((type == 12 && gguf_x_mode == X_BF16) || (type == 13 && gguf_x_mode != X_FLOAT32)) { /* Q5_K: as Q6_K */
        if (!(buf = at = x_scratch(stack, 4 * Q4K_GROUP * b256 + 64 * b256 + pad))) return -2;
        uint16_t *xt = carve(&at, 4 * Q4K_GROUP * b256);
        float *xsum = carve(&at, 64 * b256);
        q4k_bf16_terms(x, (int64_t)b256, xt, xsum, type == 13 ? 32.f : 16.f);
        if (type == 13) ON_ROWS(rows_q5k_bf16(wb, xt, xsum, y, r0, r1, cols, acc))
        else ON_ROWS(rows_q4k_bf16(wb, xt, xsum, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
#endif
#if defined(DSV41_Q4_VNNI)
    if (type == 12 && gguf_x_mode == X_INT8) {
        if (!(buf = at = x_scratch(stack, 256 * b256 + 32 * b256 + 64 * b256 + pad))) return -2;
        int8_t *xq = carve(&at, 256 * b256);
        float *dx = carve(&at, 32 * b256), *xsum = carve(&at, 64 * b256);
        q4k_int_x(x, (int64_t)b256, 1, xq, dx, xsum);
        ON_ROWS(rows_q4k_int8(wb, xq, dx, xsum, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
    if ((type == 2 || type == 3) && (gguf_x_mode == X_INT8 || gguf_x_mode == X_INT16)) {
        const int planes = gguf_x_mode == X_INT16 ? 2 : 1;
        const size_t xq_bytes = 128 * (size_t)planes * ((b32 + 3) / 4);
        if (!(buf = at = x_scratch(stack, xq_bytes + 8 * b32 + pad))) return -2;
        int8_t *xq = carve(&at, xq_bytes);
        float *dx = carve(&at, 4 * b32), *xsum = carve(&at, 4 * b32);
        q4_quads(x, (int64_t)b32, planes, xq, dx, xsum, split ? (int64_t)b32 / Q4_GROUP * Q4_GROUP : 0);
        if (planes == 2) ON_ROWS(rows_q4_int16(type, split, wb, xq, dx, xsum, y, r0, r1, cols, acc))
        else ON_ROWS(rows_q4_vnni(type, split, wb, xq, dx, xsum, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
#endif
#if defined(DSV41_Q4_INT16_AVX2)
    if ((type == 2 || type == 3) && gguf_x_mode == X_INT16) {
        if (!(buf = at = x_scratch(stack, 64 * b32 + 8 * b32 + pad))) return -2;
        int8_t *xq = carve(&at, 64 * b32);
        float *dx = carve(&at, 4 * b32), *xsum = carve(&at, 4 * b32);
        const int64_t grouped = split ? (int64_t)b32 / Q4_GROUP * Q4_GROUP : 0;
        q16_blocks(x, (int64_t)b32, xq, dx, xsum, NULL, grouped, q4_paired_end((int64_t)b32, grouped));
        ON_ROWS(rows_q4_int16_avx2(type, split, wb, xq, dx, xsum, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
    if ((type == 2 || type == 3) && gguf_x_mode == X_INT8) {
        if (!(buf = at = x_scratch(stack, 32 * b32 + 8 * b32 + pad))) return -2;
        int8_t *xq = carve(&at, 32 * b32);
        float *dx = carve(&at, 4 * b32), *xsum = carve(&at, 4 * b32);
        const int64_t grouped = split ? (int64_t)b32 / Q4_GROUP * Q4_GROUP : 0;
        q8_blocks(x, (int64_t)b32, xq, dx, xsum, grouped, q4_paired_end((int64_t)b32, grouped));
        ON_ROWS(rows_q4_int8_avx2(type, split, wb, xq, dx, xsum, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
    if (type == 8 && gguf_x_mode != X_FLOAT32) { /* int8 mode too: the finer x costs the same here */
        if (!(buf = at = x_scratch(stack, 64 * b32 + 4 * b32 + pad))) return -2;
        int16_t *xw = carve(&at, 64 * b32);
        float *dx = carve(&at, 4 * b32);
        x16_words(x, (int64_t)b32, xw, dx);
        ON_ROWS(rows_q8_0_int16_avx2(split, wb, xw, dx, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
    if ((type == 12 || type == 13 || type == 14) && gguf_x_mode != X_FLOAT32) { /* int8 mode too: the finer x */
        if (!(buf = at = x_scratch(stack, 64 * b32 + 16 * b32 + pad))) return -2;
        int8_t *xq = carve(&at, 64 * b32);
        float *dx = carve(&at, 4 * b32), *xsum = carve(&at, 4 * b32), *xsum16 = carve(&at, 8 * b32);
        q16_blocks(x, (int64_t)b32, xq, dx, xsum, type == 14 ? xsum16 : NULL, 0, 0);
        if (type == 12) ON_ROWS(rows_q4k_int16_avx2(wb, xq, dx, xsum, y, r0, r1, cols, acc))
        else if (type == 13) ON_ROWS(rows_q5k_int16_avx2(wb, xq, dx, xsum, y, r0, r1, cols, acc))
        else ON_ROWS(rows_q6k_int16_avx2(wb, xq, dx, xsum16, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if (type == 8) {
        ON_ROWS(rows_q8_0(split, wb, x, y, r0, r1, cols, acc))
        return 0;
    }
    if (per == 32) {
        const int64_t blocks = (int64_t)b32;
#if defined(__AVX512F__)
        const int64_t grouped = split ? blocks / Q4_GROUP * Q4_GROUP : 0;
        if (!(buf = at = x_scratch(stack, 4 * b32 + 128 * (size_t)grouped + pad))) return -2;
        float *xperm = carve(&at, 128 * (size_t)grouped);
        q4_float_x(x, grouped, xperm);
#else /* x in the lane order the AVX2 Q4 loop reads nibbles in (rows_small_blocks) */
        if (!(buf = at = x_scratch(stack, 4 * b32 + 4 * (size_t)cols + pad))) return -2;
        float *xperm = carve(&at, 4 * (size_t)cols);
        for (int64_t b = 0; b < blocks; b++)
            for (int j = 0; j < 16; j++) {
                xperm[b * 32 + j] = x[b * 32 + 4 * (j % 4) + j / 4];
                xperm[b * 32 + 16 + j] = x[b * 32 + 16 + 4 * (j % 4) + j / 4];
            }
#endif
        float *xsum = carve(&at, 4 * b32);
        for (int64_t b = 0; b < blocks; b++) {
            float s = 0.f;
            for (int i = 0; i < 32; i++) s += x[b * 32 + i];
            xsum[b] = s;
        }
        ON_ROWS(rows_small_blocks(type, split, wb, x, xsum, xperm, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
    if (per == 256) {
        const int64_t n16 = cols / 16;
        if (!(buf = at = x_scratch(stack, 4 * (size_t)n16 + pad))) return -2;
        float *xsum = carve(&at, 4 * (size_t)n16);
        for (int64_t i = 0; i < n16; i++) {
            float t = 0.f;
            for (int k = 0; k < 16; k++) t += x[16 * i + k];
            xsum[i] = t;
        }
        ON_ROWS(rows_k_blocks(type, wb, x, xsum, y, r0, r1, cols, acc))
        if (buf != stack) free(buf);
        return 0;
    }
#endif
    ON_ROWS(rows_gguf(type, split, wb, x, y, r0, r1, cols, acc))
    return 0;
}

/* ---------------------------------------------------------------------------------------- fused decode step */
/* One decode step of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in one call: what
 * engine/cache/decoder.py does for one token, with the DS-V4.1 cache's dense attention and CED scoring, for
 * float32 activations, weights packed as above and a float32 KV cache. At batch 1 the per-layer work
 * besides the weight reads is a few thousand flops; issued as ~30 torch ops per layer it cost ~6 ms of a
 * 17 ms step (dispatch, allocation, threads waking). engine/kernels/fused.py decides when this runs, and the Python path
 * stays the reference (tests compare the two).
 *
 * Per layer: h = rmsnorm(x); qkv = Wqkv h (+ b); [Qwen3: rmsnorm per head of q and k]; RoPE on q and k;
 * the new k, v appended at entry `length` of the layer's storage (and its position); attention of every
 * query head over the entries of its KV head: softmax(q.k * scaling + log n) in float32; CED: scores =
 * scores * decay + the attention each entry received, summed over its group's query heads; x += Wo a (+ b);
 * h = rmsnorm(x); x += Wdown (silu(gate) * up). Then logits = Whead rmsnorm(x) (+ b). */

#include <math.h>

/* A matrix of the step: up to MAT_PARTS groups of rows stacked (q, k and v of a GGUF file may come in different
 * formats), each in its own format. */
#define MAT_PARTS 3
enum { MAT_BF16 = 0, MAT_INT8 = 1, MAT_F32 = 2, MAT_GGUF = 3 };
typedef struct {
    const void *data;
    const float *scale; /* MAT_INT8: a float32 scale per row; else NULL */
    int64_t format;     /* MAT_* */
    int64_t gguf_type;  /* MAT_GGUF: ggml's type id (the GGUF blocks above) */
    int64_t rows;
} MatPart;

typedef struct {
    MatPart part[MAT_PARTS];
    int64_t parts;
} Mat;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm / k_norm: [head_dim] or NULL */
    Mat qkv, o, gate_up, down;
    const float *qkv_bias, *o_bias; /* or NULL */
} StepLayer;

typedef struct {
    void *keys, *values;    /* [kv_heads, capacity, head_dim], float32 or bf16 (StepModel.kv_bf16) */
    int32_t *positions;     /* [kv_heads, capacity] */
    float *scores;          /* [kv_heads, capacity] (read and written only when scoring) */
    const float *log_counts; /* [kv_heads, capacity] or NULL (no merged entries) */
    int64_t length, capacity; /* entries before this step; the new one goes at `length` */
    int64_t by_callback;      /* this layer's append + attention are the caller's (see dsv41_decode_step) */
} StepCache;

/* The caller's attention for layer `layer`: reads q, k, v from the work buffer's qkv region, writes the
 * attention output into its attn region; nonzero = failed (the step stops). */
typedef int (*AttendCallback)(int64_t layer);

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, vocab, layers;
    int64_t kv_bf16; /* the KV cache holds bf16 (dtype="bfloat16"): read widened, written rounded to nearest even */
    float eps, scaling;
    const float *final_norm;
    Mat lm_head;
    const float *lm_head_bias;
} StepModel;

#define ATTN_CHUNK_MAX 256 /* entries per attention work item (attn_chunk) */
#define MAX_GROUP 64   /* query heads per KV head the fused step handles */
#define MAX_HEAD_DIM 256

/* Entry j's row of a KV head (base: that head's [capacity, d] block) as float32: in place when float32,
 * widened into `buf` when bf16. */
static inline const float *kv_row(const void *base, int64_t j, int64_t d, int bf16, float *buf) {
    if (!bf16) return (const float *)base + j * d;
    const uint16_t *r = (const uint16_t *)base + j * d;
    for (int64_t i = 0; i < d; i++) buf[i] = bf16_to_f32(r[i]);
    return buf;
}

/* y = M x (+ y when acc), part by part: each part's rows are the next rows of y. Returns 0, or the first part's
 * failure (-2: no memory for a wide row's scratch; the parts after it are not multiplied). */
static int64_t part_bytes(const MatPart *p, int64_t cols);
static int mv(const Mat *m, const float *x, float *y, int64_t cols, int acc, int threads, const Mat *next,
              int64_t next_cols) {
    for (int64_t i = 0; i < m->parts; i++) {
        const MatPart *p = m->part + i;
        const MatPart *after = i + 1 < m->parts ? p + 1 : next ? next->part : NULL;
        const int64_t after_cols = i + 1 < m->parts ? cols : next_cols;
        next_rows = after && after->rows
            ? (NextRows){(const char *)after->data, after->rows, part_bytes(after, after_cols) / after->rows}
            : (NextRows){NULL, 0, 0};
        int status = 0;
        if (p->format == MAT_INT8) dsv41_mv_int8((const int8_t *)p->data, p->scale, x, y, p->rows, cols, acc, threads);
        else if (p->format == MAT_F32) dsv41_mv_f32((const float *)p->data, x, y, p->rows, cols, acc, threads);
        else if (p->format == MAT_GGUF) status = dsv41_mv_gguf(p->gguf_type, p->data, x, y, p->rows, cols, acc, threads);
        else status = dsv41_mv_bf16((const uint16_t *)p->data, x, y, p->rows, cols, acc, threads);
        next_rows.data = NULL;
        if (status != 0) return status;
        y += p->rows;
    }
    return 0;
}

/* exp for float32, vectorisable (no libm call): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], Cephes'
 * degree-6 polynomial; relative error ~2e-7 (about one ulp) over the clamped range. */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* exp_approx on 16 / 8 lanes (the same clamp, reduction and polynomial): `omp simd` does not vectorise
 * exp_approx itself (floorf and the bit cast stay scalar). */
#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

static void rms_norm(const float *x, const float *w, float *out, int64_t n, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

/* rotate-half RoPE of one head in place; cos/sin [d] with both halves equal (only the first half is read). */
static void rope_head(float *v, const float *cs, const float *sn, int64_t d) {
    int64_t half = d / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cs[i] - b * sn[i];
        v[i + half] = b * cs[i] + a * sn[i];
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

#define PREFETCH_ROWS 64 /* KV rows ahead of the attention's reads, asked for into L2 (rows16; the AVX2 build's too) */

#if defined(__AVX512F__)
/* 16 dot products (one per vector's lanes) as one vector: v[i] lanes summed -> lane i. */
static inline __m512 sum16(__m512 *v) {
    __m512 t[8], w[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

/* The 16 rows [j, j + 16) of a KV head as float32: in place when float32, widened into buf [16 d] when bf16; the
 * rows PREFETCH_ROWS ahead are asked for meanwhile, into L2 (a work item streams one head's rows, and without it
 * the loads waited on memory: half of the attention's time at 2k entries). Into L2 rather than L1: whole decode
 * steps of the default model x1.06 at 1k entries and x1.31 at 4k (paired, one process, 2 cores); 32 or 128 rows
 * ahead instead of 64 changed them by less than 3 %. */
static inline __attribute__((always_inline)) const float *rows16(const void *base, int64_t j, int64_t d, int bf16,
                                                                 float *buf) {
    const int64_t esize = bf16 ? 2 : 4;
    const char *ahead = (const char *)base + (j + PREFETCH_ROWS) * d * esize;
    for (int64_t i = 0; i < 16 * d * esize; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T1);
    if (!bf16) return (const float *)base + j * d;
    const uint16_t *r = (const uint16_t *)base + j * d;
    for (int64_t i = 0; i < 16 * d; i += 16)
        _mm512_storeu_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r + i))), 16)));
    return buf;
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The AVX2 build's attention: 8 logits a query head from one transposing reduction (sum8) of per-row partial sums,
 * the values summed into sums held in registers; each KV row widened in registers where it is used (below), the
 * rows PREFETCH_ROWS ahead asked for into L2 as rows16 does. */
static inline __m256 sum8(const __m256 *v) { /* v[i]'s lanes summed -> lane i */
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
/* Widened in registers, never stored: on a first-generation AMD EPYC (two 128-bit halves per ymm operation, one
 * store a cycle) 8 rows widened into a buffer, stored and loaded again per query head, were most of the attention's
 * time. */
static inline __m256 kv8(const void *base, int64_t at, int bf16) { /* the 8 floats of a KV head's block at `at` */
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at))), 16))
                : _mm256_loadu_ps((const float *)base + at);
}
/* 16 bf16 numbers (a row's columns c .. c + 15) as float32 in two vectors from one load, no shuffle: the even
 * columns (each 32-bit lane's low half shifted up) and the odd ones (its high half, the low one masked off). Where
 * kv8 widens 8 with a vpmovzxwd (a shuffle) and a shift, this takes one shift and one and for 8. The keys' logits
 * use it (logits_rows8 with EO: the attention alone x1.06-1.08 in the caches, x1.02-1.03 from memory at 1k entries,
 * paired in one process on an AMD EPYC with AVX2 alone); for the values it was slower (x0.92-0.95), their sums
 * then needing more registers than there are. */
static inline void bf16x16(const uint16_t *p, __m256 *even, __m256 *odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
/* The logits of rows [j, j + 8) against GN query heads (head i's q at qh + i d): per row and head a vector of
 * partial sums (a multiply-add per 8 columns), then one sum8 per head; the logit times `scaling` plus the bias at
 * pr + i S + j (head i's row of probs), and each head's largest into mx[i]. EO (bf16 keys, d a multiple of 16):
 * the keys widened by bf16x16, q given with each 16 columns as their 8 even, then their 8 odd (qt_even_odd); else
 * 8 columns at a time in the row's order (kv8). GN and EO are constants where this is inlined. */
static inline __attribute__((always_inline)) void logits_rows8(const int GN, const int EO, const float *qh,
                                                               const void *K, int bf16, int64_t j, int64_t d,
                                                               float scaling, __m256 bias, float *pr, int64_t S,
                                                               float *mx) {
    __m256 part[4][8];
    for (int e = 0; e < 8; e++) {
        __m256 a[4];
        for (int i = 0; i < GN; i++) a[i] = _mm256_setzero_ps();
        if (EO)
            for (int64_t u = 0; u < d; u += 16) {
                __m256 ke, ko;
                bf16x16((const uint16_t *)K + (j + e) * d + u, &ke, &ko);
                for (int i = 0; i < GN; i++)
                    a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * d + u + 8), ko,
                                           _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * d + u), ke, a[i]));
            }
        else
            for (int64_t u = 0; u < d; u += 8) {
                const __m256 k = kv8(K, (j + e) * d + u, bf16);
                for (int i = 0; i < GN; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * d + u), k, a[i]);
            }
        for (int i = 0; i < GN; i++) part[i][e] = a[i];
    }
    for (int i = 0; i < GN; i++) {
        const __m256 l = _mm256_fmadd_ps(sum8(part[i]), _mm256_set1_ps(scaling), bias);
        _mm256_storeu_ps(pr + i * S + j, l);
        const float top = hmax256(l);
        mx[i] = top > mx[i] ? top : mx[i];
    }
}
/* The logits of a work item's rows from j, 8 at a time while 8 remain (returns where it stopped), for its G query
 * heads (q at qg, head i at qg + i d; with EO as qt_even_odd lays it out), up to four heads a pass, the rows
 * PREFETCH_ROWS ahead asked for into L2. EO is a constant where this is inlined. */
static inline __attribute__((always_inline)) int64_t logits_item(const int EO, const float *qg, const void *K,
                                                                 int bf16, const float *lc, int64_t G, int64_t j,
                                                                 int64_t j1, int64_t d, float scaling, float *pr,
                                                                 int64_t S, float *mx) {
    const int64_t esize = bf16 ? 2 : 4;
    for (; j + 8 <= j1; j += 8) {
        const char *ahead = (const char *)K + (j + PREFETCH_ROWS) * d * esize;
        for (int64_t i = 0; i < 8 * d * esize; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T1);
        const __m256 bias = lc ? _mm256_loadu_ps(lc + j) : _mm256_setzero_ps();
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t n = G - g0 < 4 ? G - g0 : 4;
            const float *qh = qg + g0 * d;
            float *ph = pr + g0 * S;
            if (n == 4) logits_rows8(4, EO, qh, K, bf16, j, d, scaling, bias, ph, S, mx + g0);
            else if (n == 3) logits_rows8(3, EO, qh, K, bf16, j, d, scaling, bias, ph, S, mx + g0);
            else if (n == 2) logits_rows8(2, EO, qh, K, bf16, j, d, scaling, bias, ph, S, mx + g0);
            else logits_rows8(1, EO, qh, K, bf16, j, d, scaling, bias, ph, S, mx + g0);
        }
    }
    return j;
}
/* n heads' q (head i at q + i d) as logits_rows8 takes them with EO: each 16 columns' even ones, then their odd ones */
static inline void qt_even_odd(const float *q, int64_t n, int64_t d, float *qt) {
    for (int64_t i = 0; i < n * d; i += 16)
        for (int k = 0; k < 8; k++) qt[i + k] = q[i + 2 * k], qt[i + 8 + k] = q[i + 2 * k + 1];
}
/* The values of rows [j0, j1), columns [c, c + 8 U), weighted by GN query heads' exp (head i's at p0 + i S) and added
 * into their sums (head i's at o0 + i oo): the GN x U sums stay in registers across the rows. BF16 and PF (the
 * first columns' pass asks for the rows PREFETCH_ROWS ahead) are constants where this is inlined: a test and a
 * branch on each per row were a third of the loop's instructions. */
static inline __attribute__((always_inline)) void values_cols(const int GN, const int U, const int BF16, const int PF,
                                                              const void *V, int64_t j0, int64_t j1, int64_t d,
                                                              int64_t c, const float *p0, int64_t S, float *o0,
                                                              int64_t oo) {
    const int64_t esize = BF16 ? 2 : 4;
    __m256 acc[3][4];
    for (int i = 0; i < GN; i++)
        for (int u = 0; u < U; u++) acc[i][u] = _mm256_loadu_ps(o0 + i * oo + c + 8 * u);
#pragma GCC unroll 2
    for (int64_t j = j0; j < j1; j++) {
        if (PF)
            for (int64_t b = 0; b < d * esize; b += 64)
                _mm_prefetch((const char *)V + (j + PREFETCH_ROWS) * d * esize + b, _MM_HINT_T1);
        __m256 p[3];
        for (int i = 0; i < GN; i++) p[i] = _mm256_broadcast_ss(p0 + i * S + j);
        for (int u = 0; u < U; u++) {
            const __m256 v = kv8(V, j * d + c + 8 * u, BF16);
            for (int i = 0; i < GN; i++) acc[i][u] = _mm256_fmadd_ps(p[i], v, acc[i][u]);
        }
    }
    for (int i = 0; i < GN; i++)
        for (int u = 0; u < U; u++) _mm256_storeu_ps(o0 + i * oo + c + 8 * u, acc[i][u]);
}
/* values_cols over all d columns (d a multiple of 8): 32 at a time, the rest 8 at a time; the first pass prefetches */
static inline __attribute__((always_inline)) void values_rows_of(const int GN, const int BF16, const void *V,
                                                                 int64_t j0, int64_t j1, int64_t d, const float *p0,
                                                                 int64_t S, float *o0, int64_t oo) {
    int64_t c = 0;
    if (d >= 32) values_cols(GN, 4, BF16, 1, V, j0, j1, d, 0, p0, S, o0, oo), c = 32;
    else values_cols(GN, 1, BF16, 1, V, j0, j1, d, 0, p0, S, o0, oo), c = 8;
    for (; c + 32 <= d; c += 32) values_cols(GN, 4, BF16, 0, V, j0, j1, d, c, p0, S, o0, oo);
    for (; c < d; c += 8) values_cols(GN, 1, BF16, 0, V, j0, j1, d, c, p0, S, o0, oo);
}
static inline __attribute__((always_inline)) void values_rows(const int GN, const void *V, int bf16, int64_t j0,
                                                              int64_t j1, int64_t d, const float *p0, int64_t S,
                                                              float *o0, int64_t oo) {
    if (bf16) values_rows_of(GN, 1, V, j0, j1, d, p0, S, o0, oo);
    else values_rows_of(GN, 0, V, j0, j1, d, p0, S, o0, oo);
}
#endif

/* Entries per attention work item: 256, or a quarter of a short cache (at least 16), so that a layer of a few
 * hundred entries still has work for every thread (three KV heads over two threads in one item each left one
 * thread idle a third of the time). */
static inline int64_t attn_chunk(int64_t S) {
    if (S > 4 * ATTN_CHUNK_MAX) return ATTN_CHUNK_MAX;
    int64_t c = (S + 3) / 4;
    c = (c + 15) / 16 * 16;
    return c < 16 ? 16 : c;
}

/* The most work items one head's S entries make (the work buffer's stats and partial regions are sized by it). */
static inline int64_t attn_chunks_max(int64_t S) {
    const int64_t c = (S + ATTN_CHUNK_MAX - 1) / ATTN_CHUNK_MAX;
    return c > 4 ? c : 4;
}

#if defined(__AVX512F__)
/* The values of entries [j0, j1) of one KV head (head size 16 DV: 64 or 128), weighted by the exp of GN query heads
 * (head i's at p0 + i * S, entry j at [j]) and summed into out (head i's DV vectors at o0 + i * oo). Each row is
 * widened in registers once for the GN heads, and the GN * DV sums stay in registers across the rows (GN * DV <= 16).
 * Against widening 16 rows into a buffer and summing them head by head from there: the attention alone ×1.15–1.2 at
 * 300–4,200 entries, 1 or 2 threads (the buffer's stores and reloads were a third of the value pass's work). */
static inline __attribute__((always_inline)) void values_rows(const int GN, const int DV, const void *V, int bf16,
                                                              int64_t j0, int64_t j1, const float *p0, int64_t S,
                                                              float *o0, int64_t oo) {
    __m512 acc[4][8];
    for (int i = 0; i < GN; i++)
        for (int u = 0; u < DV; u++) acc[i][u] = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        __m512 v[8];
        if (bf16) {
            const uint16_t *r = (const uint16_t *)V + j * 16 * DV;
            for (int u = 0; u < DV; u += 2) _mm_prefetch((const char *)(r + PREFETCH_ROWS * 16 * DV + 16 * u), _MM_HINT_T1);
            for (int u = 0; u < DV; u++)
                v[u] = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r + 16 * u))), 16));
        } else {
            const float *r = (const float *)V + j * 16 * DV;
            for (int u = 0; u < DV; u++) {
                _mm_prefetch((const char *)(r + PREFETCH_ROWS * 16 * DV + 16 * u), _MM_HINT_T1);
                v[u] = _mm512_loadu_ps(r + 16 * u);
            }
        }
        for (int i = 0; i < GN; i++) {
            const __m512 p = _mm512_set1_ps(p0[i * S + j]);
            for (int u = 0; u < DV; u++) acc[i][u] = _mm512_fmadd_ps(p, v[u], acc[i][u]);
        }
    }
    for (int i = 0; i < GN; i++)
        for (int u = 0; u < DV; u++) _mm512_storeu_ps(o0 + i * oo + 16 * u, acc[i][u]);
}

/* The value pass of a work item by values_rows, query heads four (head size 64) or two (128) at a time. */
static inline void values_item(const void *V, int bf16, int64_t G, int64_t g, int64_t d, int64_t S, int64_t j0,
                               int64_t j1, const float *probs, float *partial, int64_t chunks, int64_t ch) {
    const int64_t step = d == 64 ? 4 : 2, oo = chunks * d;
    for (int64_t g0 = 0; g0 < G; g0 += step) {
        const float *p0 = probs + (g * G + g0) * S;
        float *o0 = partial + ((g * G + g0) * chunks + ch) * d;
        const int64_t n = G - g0 < step ? G - g0 : step;
        if (d == 64) {
            if (n == 4) values_rows(4, 4, V, bf16, j0, j1, p0, S, o0, oo);
            else if (n == 3) values_rows(3, 4, V, bf16, j0, j1, p0, S, o0, oo);
            else if (n == 2) values_rows(2, 4, V, bf16, j0, j1, p0, S, o0, oo);
            else values_rows(1, 4, V, bf16, j0, j1, p0, S, o0, oo);
        } else {
            if (n == 2) values_rows(2, 8, V, bf16, j0, j1, p0, S, o0, oo);
            else values_rows(1, 8, V, bf16, j0, j1, p0, S, o0, oo);
        }
    }
}
#endif

/* One work item: KV head g's entries [j0, j1) against the G query heads of its group, in one pass over its keys
 * and one over its values (each row read once for the whole group, widened once when bf16): the logits, their
 * exp against the item's own maximum (cmax) and its sum (csum), and the exp-weighted values (partial); the items
 * are combined after (flash-decoding's split softmax). probs [H, S] holds the exp. d is a constant where this is
 * inlined for d == 64, so the vectors of a row stay in registers. */
static inline __attribute__((always_inline)) void attend_item(
        const float *q, const void *K, const void *V, const float *lc, int bf16, int64_t G, int64_t g, int64_t d,
        float scaling, int64_t S, int64_t j0, int64_t j1, float *probs, float *cmax, float *csum, float *partial,
        int64_t chunks, int64_t ch) {
    float mx[MAX_GROUP];
    for (int64_t gg = 0; gg < G; gg++) mx[gg] = -INFINITY;
    int64_t j = j0;
#if defined(__AVX512F__)
    float buf[16 * MAX_HEAD_DIM];
    const int64_t dv = d / 16;
#if defined(DSV41_Q4_BF16)
    if (bf16 && d == 64) {
        /* bf16 keys (a bf16 model's cache), the head size of the default model and most small ones: the logits from
         * vdpbf16ps on the keys as stored, against each query head as two bf16 terms q = hi + lo (16 significant
         * bits; each product of a key's 8 with them is exact, the sums float32), so no key row is widened to float32
         * first. Paired in one process on the AMD EPYC, 2 cores: whole decode steps ×1.08 at 4k entries, ×1.03 at
         * 1k, ×1.00 at 128 (the keys' widening, stores and reloads were most of the logits' work). */
        _Alignas(64) uint16_t qt[MAX_GROUP * 128];
        for (int64_t gg = 0; gg < G; gg++)
            for (int64_t i = 0; i < 64; i++) {
                const float v = q[(g * G + gg) * 64 + i];
                const uint16_t hi = f32_to_bf16(v);
                qt[gg * 128 + i] = hi;
                qt[gg * 128 + 64 + i] = f32_to_bf16(v - bf16_to_f32(hi));
            }
        for (; j + 16 <= j1; j += 16) {
            const char *kahead = (const char *)K + (j + PREFETCH_ROWS) * 128;
            for (int64_t i = 0; i < 16 * 128; i += 64) _mm_prefetch(kahead + i, _MM_HINT_T1);
            const uint16_t *kr = (const uint16_t *)K + j * 64;
            const __m512 bias = lc ? _mm512_loadu_ps(lc + j) : _mm512_setzero_ps();
            for (int64_t gg = 0; gg < G; gg++) {
                const uint16_t *t = qt + gg * 128;
                const __m512bh h0 = (__m512bh)_mm512_load_si512((const void *)t),
                               h1 = (__m512bh)_mm512_load_si512((const void *)(t + 32)),
                               l0 = (__m512bh)_mm512_load_si512((const void *)(t + 64)),
                               l1 = (__m512bh)_mm512_load_si512((const void *)(t + 96));
                __m512 acc[16];
                for (int e = 0; e < 16; e++) {
                    const __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void *)(kr + e * 64)),
                                   k1 = (__m512bh)_mm512_loadu_si512((const void *)(kr + e * 64 + 32));
                    acc[e] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_dpbf16_ps(
                        _mm512_setzero_ps(), k0, h0), k1, h1), k0, l0), k1, l1);
                }
                const __m512 l = _mm512_fmadd_ps(sum16(acc), _mm512_set1_ps(scaling), bias);
                _mm512_storeu_ps(probs + (g * G + gg) * S + j, l);
                const float top = _mm512_reduce_max_ps(l);
                mx[gg] = top > mx[gg] ? top : mx[gg];
            }
        }
    }
#endif
    if (d % 16 == 0)
        for (; j + 16 <= j1; j += 16) { /* 16 logits a query head, one transposing reduction (sum16) */
            const float *kf = rows16(K, j, d, bf16, buf);
            const __m512 bias = lc ? _mm512_loadu_ps(lc + j) : _mm512_setzero_ps();
            for (int64_t gg = 0; gg < G; gg++) {
                const float *qh = q + (g * G + gg) * d;
                __m512 acc[16];
                for (int e = 0; e < 16; e++) {
                    const float *kr = kf + e * d;
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kr));
                    for (int64_t u = 1; u < dv; u++)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * u), _mm512_loadu_ps(kr + 16 * u), a);
                    acc[e] = a;
                }
                const __m512 l = _mm512_fmadd_ps(sum16(acc), _mm512_set1_ps(scaling), bias);
                _mm512_storeu_ps(probs + (g * G + gg) * S + j, l);
                const float top = _mm512_reduce_max_ps(l);
                mx[gg] = top > mx[gg] ? top : mx[gg];
            }
        }
#elif defined(__AVX2__) && defined(__FMA__)
    _Alignas(32) float qt[4096]; /* the group's q reordered (16 KiB of stack: groups of up to 4,096 numbers) */
    if (bf16 && d % 16 == 0 && G * d <= 4096) { /* bf16 keys widened 16 at a time (bf16x16) */
        qt_even_odd(q + g * G * d, G, d, qt);
        j = logits_item(1, qt, K, bf16, lc, G, j, j1, d, scaling, probs + g * G * S, S, mx);
    } else if (d % 8 == 0) { /* 8 logits a query head from rows widened in registers */
        j = logits_item(0, q + g * G * d, K, bf16, lc, G, j, j1, d, scaling, probs + g * G * S, S, mx);
    }
#endif
    for (; j < j1; j++) { /* the rest one row at a time, still once for the whole group */
        float row[MAX_HEAD_DIM];
        const float *kr = kv_row(K, j, d, bf16, row), bias = lc ? lc[j] : 0.f;
        for (int64_t gg = 0; gg < G; gg++) {
            const float l = dot(q + (g * G + gg) * d, kr, d) * scaling + bias;
            probs[(g * G + gg) * S + j] = l;
            mx[gg] = l > mx[gg] ? l : mx[gg];
        }
    }
    for (int64_t gg = 0; gg < G; gg++) {
        const int64_t hq = g * G + gg;
        float *row = probs + hq * S, sum = 0.f;
        const float top = mx[gg];
        int64_t jj = j0;
#if defined(__AVX512F__)
        __m512 vsum = _mm512_setzero_ps();
        for (; jj + 16 <= j1; jj += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + jj), _mm512_set1_ps(top)));
            _mm512_storeu_ps(row + jj, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        sum = _mm512_reduce_add_ps(vsum);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 vsum = _mm256_setzero_ps();
        for (; jj + 8 <= j1; jj += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + jj), _mm256_set1_ps(top)));
            _mm256_storeu_ps(row + jj, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        sum = hsum256(vsum);
#endif
        for (; jj < j1; jj++) {
            const float e = exp_approx(row[jj] - top);
            row[jj] = e;
            sum += e;
        }
        cmax[hq * chunks + ch] = top;
        csum[hq * chunks + ch] = sum;
        float *acc = partial + (hq * chunks + ch) * d;
        for (int64_t i = 0; i < d; i++) acc[i] = 0.f;
    }
    j = j0;
#if defined(__AVX512F__)
    if (d == 64 || d == 128) {
        values_item(V, bf16, G, g, d, S, j0, j1, probs, partial, chunks, ch);
        j = j1;
    }
    if (d % 16 == 0)
        for (; j + 16 <= j1; j += 16) { /* 16 value rows, then every query head's weighted sum of them */
            const float *vf = rows16(V, j, d, bf16, buf);
            for (int64_t gg = 0; gg < G; gg++) {
                const int64_t hq = g * G + gg;
                const float *p = probs + hq * S + j;
                float *out = partial + (hq * chunks + ch) * d;
                __m512 a0[16], a1[16]; /* two chains per vector: the FMAs' latency, not their count, bound one */
                for (int64_t u = 0; u < dv; u++) {
                    a0[u] = _mm512_loadu_ps(out + 16 * u);
                    a1[u] = _mm512_setzero_ps();
                }
                for (int e = 0; e < 16; e += 2) {
                    const __m512 p0 = _mm512_set1_ps(p[e]), p1 = _mm512_set1_ps(p[e + 1]);
                    for (int64_t u = 0; u < dv; u++) {
                        a0[u] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vf + e * d + 16 * u), a0[u]);
                        a1[u] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(vf + (e + 1) * d + 16 * u), a1[u]);
                    }
                }
                for (int64_t u = 0; u < dv; u++) _mm512_storeu_ps(out + 16 * u, _mm512_add_ps(a0[u], a1[u]));
            }
        }
#elif defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) {
        for (int64_t g0 = 0; g0 < G; g0 += 3) { /* up to three query heads a pass */
            const float *p0 = probs + (g * G + g0) * S;
            float *o0 = partial + ((g * G + g0) * chunks + ch) * d;
            const int64_t n = G - g0 < 3 ? G - g0 : 3, oo = chunks * d;
            if (n == 3) values_rows(3, V, bf16, j0, j1, d, p0, S, o0, oo);
            else if (n == 2) values_rows(2, V, bf16, j0, j1, d, p0, S, o0, oo);
            else values_rows(1, V, bf16, j0, j1, d, p0, S, o0, oo);
        }
        j = j1;
    }
#endif
    for (; j < j1; j++) {
        float row[MAX_HEAD_DIM];
        const float *v = kv_row(V, j, d, bf16, row);
        for (int64_t gg = 0; gg < G; gg++) {
            const int64_t hq = g * G + gg;
            const float p = probs[hq * S + j];
            float *acc = partial + (hq * chunks + ch) * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) acc[i] += p * v[i];
        }
    }
}

/* act = silu(gate) * up, vectorised (exp16 / exp8: the scalar exp_approx loop was 3 % of a short-context step). */
static void silu_mul(const float *gate, const float *up, float *act, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(act + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                                _mm512_loadu_ps(up + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                                _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) act[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
}

/* Query head hq's softmax over all items: its largest logit and the sum of exp(logit - that), from the items'. */
static inline void attend_totals(const float *cmax, const float *csum, int64_t hq, int64_t chunks, float *top,
                                 float *total) {
    float t = -INFINITY, z = 0.f;
    for (int64_t k = 0; k < chunks; k++) t = cmax[hq * chunks + k] > t ? cmax[hq * chunks + k] : t;
    for (int64_t k = 0; k < chunks; k++) z += csum[hq * chunks + k] * exp_approx(cmax[hq * chunks + k] - t);
    *top = t;
    *total = z;
}

/* Attention of the H query heads q [H, d] over the layer's S = length entries -> out [H, d]; with `score`,
 * scores = scores * decay + the attention each entry received, summed over its group's query heads.
 * scratch: probs [H, S], stats [2, H, chunks], partial [H, chunks, d] (chunks <= attn_chunks_max(S)). */
static void attend(const StepModel *m, StepCache *c, const float *q, float *out, float *probs, float *stats,
                   float *partial, int score, float decay, int threads) {
    const int64_t H = m->heads, h = m->kv_heads, d = m->head_dim, G = H / h, S = c->length, cap = c->capacity;
    const int64_t size = attn_chunk(S), chunks = (S + size - 1) / size, items = h * chunks;
    float *cmax = stats, *csum = stats + H * chunks;
    const int bf16 = (int)m->kv_bf16;
    const int64_t esize = bf16 ? 2 : 4;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t g = it / chunks, ch = it % chunks, j0 = ch * size, j1 = j0 + size < S ? j0 + size : S;
            const char *K = (const char *)c->keys + g * cap * d * esize, *V = (const char *)c->values + g * cap * d * esize;
            const float *lc = c->log_counts ? c->log_counts + g * cap : NULL;
            if (d == 64) /* the default model's and most small models' head size: unrolled */
                attend_item(q, K, V, lc, bf16, G, g, 64, m->scaling, S, j0, j1, probs, cmax, csum, partial, chunks, ch);
            else
                attend_item(q, K, V, lc, bf16, G, g, d, m->scaling, S, j0, j1, probs, cmax, csum, partial, chunks, ch);
        }
        if (score) {
#pragma omp for schedule(static) nowait
            for (int64_t it = 0; it < items; it++) {
                const int64_t g = it / chunks, ch = it % chunks, j0 = ch * size, j1 = j0 + size < S ? j0 + size : S;
                float *sc = c->scores + g * cap;
#pragma omp simd
                for (int64_t j = j0; j < j1; j++) sc[j] *= decay;
                for (int64_t gg = 0; gg < G; gg++) {
                    const int64_t hq = g * G + gg;
                    float top, total;
                    attend_totals(cmax, csum, hq, chunks, &top, &total);
                    const float f = exp_approx(cmax[hq * chunks + ch] - top) / total, *row = probs + hq * S;
#pragma omp simd
                    for (int64_t j = j0; j < j1; j++) sc[j] += row[j] * f;
                }
            }
        }
        /* every head's output from its items' partial sums (no barrier before it: the scores are not read) */
#pragma omp for schedule(static) nowait
        for (int64_t hq = 0; hq < H; hq++) {
            float top, total;
            attend_totals(cmax, csum, hq, chunks, &top, &total);
            float *o = out + hq * d;
            for (int64_t i = 0; i < d; i++) o[i] = 0.f;
            for (int64_t k = 0; k < chunks; k++) {
                const float *p = partial + (hq * chunks + k) * d, f = exp_approx(cmax[hq * chunks + k] - top) / total;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) o[i] += p[i] * f;
            }
        }
    }
}

/* The decode step's attention alone: the H query heads q [H, d] over the first `length` entries of one layer's cache
 * `c` -> out [H, d] (with `score`, its scores updated as the step does), nothing appended. For the tests (against a
 * float64 reference, bf16 and float32 entries). work: H * length + 2 * H * chunks + H * chunks * d
 * floats, chunks = attn_chunks_max(length). Returns 0, -1 if `work` is too small, -2 for geometry beyond the limits. */
int dsv41_step_attention(const StepModel *m, StepCache *c, const float *q, float *out, float *work, int64_t work_floats,
                         int score, float decay, int threads) {
    const int64_t H = m->heads, h = m->kv_heads, d = m->head_dim, S = c->length, chunks = attn_chunks_max(S);
    if (d > MAX_HEAD_DIM || H % h != 0 || H / h > MAX_GROUP || S < 1 || S > c->capacity) return -2;
    if (H * S + 2 * H * chunks + H * chunks * d > work_floats) return -1;
    float *probs = work, *stats = probs + H * S, *partial = stats + 2 * H * chunks;
    attend(m, c, q, out, probs, stats, partial, score, decay, threads);
    return 0;
}

/* floats of `work` one step needs when no layer holds more than max_entries entries after appending. */
int64_t dsv41_step_work_floats(const StepModel *m, int64_t max_entries) {
    const int64_t H = m->heads, d = m->head_dim, chunks = attn_chunks_max(max_entries);
    return 2 * m->hidden + (H + 2 * m->kv_heads) * d + H * d + 3 * m->inter + H * max_entries + 2 * H * chunks +
           H * chunks * d + 64;
}

/* x_in [hidden]: the token's embedding; cos/sin [head_dim] at `position`. Appends one entry to every layer's
 * cache (the caller raises its length afterwards) and writes logits [vocab]. score: fold attention into the
 * scores with `decay`. A layer marked by_callback (a CSA2 sparse layer, an INT8 cache: what only the Python
 * cache does) calls `callback` instead of appending and attending here; q, k, v (after RoPE) are then at
 * work[2 * hidden ...] ([heads + 2 * kv_heads, head_dim]) and the output is expected right after them
 * ([heads, head_dim]). Returns 0; -1 if a layer lacks room for its entry or `work` is too small; -2 for
 * head geometry beyond the limits; -3 if the callback failed; -4 if a product found no memory for its scratch
 * (the step stops there: no layer's length is raised, the caller drops what was written past it). */
int dsv41_decode_step(const StepModel *m, const StepLayer *layers, StepCache *caches, const float *x_in,
                      int32_t position, const float *cs, const float *sn, int score, float decay, float *logits,
                      float *work, int64_t work_floats, AttendCallback callback, int threads) {
    const int64_t D = m->hidden, H = m->heads, h = m->kv_heads, d = m->head_dim, I = m->inter;
    int64_t most = 0;
    if (d > MAX_HEAD_DIM || H % h != 0 || H / h > MAX_GROUP) return -2;
    for (int64_t l = 0; l < m->layers; l++) {
        if (caches[l].by_callback) {
            if (!callback) return -3;
            continue;
        }
        if (caches[l].length + 1 > caches[l].capacity) return -1;
        if (caches[l].length + 1 > most) most = caches[l].length + 1;
    }
    if (dsv41_step_work_floats(m, most) > work_floats) return -1;
    const int64_t chunks = attn_chunks_max(most);
    float *x = work, *hbuf = x + D, *qkv = hbuf + D, *attn = qkv + (H + 2 * h) * d, *gu = attn + H * d,
          *act = gu + 2 * I, *probs = act + I, *stats = probs + H * most, *partial = stats + 2 * H * chunks;
    memcpy(x, x_in, sizeof(float) * D);
    for (int64_t l = 0; l < m->layers; l++) {
        const StepLayer *L = layers + l;
        StepCache *c = caches + l;
        rms_norm(x, L->input_norm, hbuf, D, m->eps);
        if (mv(&L->qkv, hbuf, qkv, D, 0, threads, &L->o, H * d) != 0) return -4;
        if (L->qkv_bias)
            for (int64_t i = 0; i < (H + 2 * h) * d; i++) qkv[i] += L->qkv_bias[i];
        for (int64_t hd = 0; hd < H + h; hd++) {
            float *v = qkv + hd * d;
            const float *nw = hd < H ? L->q_norm : L->k_norm;
            if (nw) rms_norm(v, nw, v, d, m->eps);
            rope_head(v, cs, sn, d);
        }
        if (c->by_callback) {
            if (callback(l) != 0) return -3;
        } else {
            const int64_t n = c->length;
            for (int64_t g = 0; g < h; g++) {
                const float *k = qkv + (H + g) * d, *v = qkv + (H + h + g) * d;
                const int64_t at = (g * c->capacity + n) * d;
                if (m->kv_bf16) {
                    for (int64_t i = 0; i < d; i++) {
                        ((uint16_t *)c->keys)[at + i] = f32_to_bf16(k[i]);
                        ((uint16_t *)c->values)[at + i] = f32_to_bf16(v[i]);
                    }
                } else {
                    memcpy((float *)c->keys + at, k, sizeof(float) * d);
                    memcpy((float *)c->values + at, v, sizeof(float) * d);
                }
                c->positions[g * c->capacity + n] = position;
            }
            StepCache view = *c;
            view.length = n + 1;
            attend(m, &view, qkv, attn, probs, stats, partial, score, decay, threads);
        }
        if (mv(&L->o, attn, x, H * d, 1, threads, &L->gate_up, D) != 0) return -4;
        if (L->o_bias)
            for (int64_t i = 0; i < D; i++) x[i] += L->o_bias[i];
        rms_norm(x, L->post_norm, hbuf, D, m->eps);
        if (mv(&L->gate_up, hbuf, gu, D, 0, threads, &L->down, I) != 0) return -4;
        silu_mul(gu, gu + I, act, I);
        if (mv(&L->down, act, x, I, 1, threads, l + 1 < m->layers ? &layers[l + 1].qkv : &m->lm_head, D) != 0)
            return -4;
    }
    rms_norm(x, m->final_norm, hbuf, D, m->eps);
    if (mv(&m->lm_head, hbuf, logits, D, 0, threads, NULL, 0) != 0) return -4;
    if (m->lm_head_bias)
        for (int64_t i = 0; i < m->vocab; i++) logits[i] += m->lm_head_bias[i];
    return 0;
}

/* Every matrix-vector product of one decode step (each layer's four, then the head) and nothing else, on
 * whatever `work` holds: the ceiling of any decode step built on these kernels (the benchmark's "kernel
 * ceiling", measured without Python between the products). work: dsv41_step_work_floats(m, 1) floats;
 * logits: vocab floats. Returns 0, or -4 as dsv41_decode_step. */
int dsv41_step_matrices(const StepModel *m, const StepLayer *layers, float *logits, float *work, int threads) {
    const int64_t D = m->hidden, H = m->heads, h = m->kv_heads, d = m->head_dim, I = m->inter;
    float *x = work, *hbuf = x + D, *qkv = hbuf + D, *attn = qkv + (H + 2 * h) * d, *gu = attn + H * d,
          *act = gu + 2 * I;
    for (int64_t l = 0; l < m->layers; l++) {
        const StepLayer *L = layers + l;
        if (mv(&L->qkv, hbuf, qkv, D, 0, threads, &L->o, H * d) != 0) return -4;
        if (mv(&L->o, attn, x, H * d, 1, threads, &L->gate_up, D) != 0) return -4;
        if (mv(&L->gate_up, hbuf, gu, D, 0, threads, &L->down, I) != 0) return -4;
        if (mv(&L->down, act, x, I, 1, threads, l + 1 < m->layers ? &layers[l + 1].qkv : &m->lm_head, D) != 0)
            return -4;
    }
    if (mv(&m->lm_head, hbuf, logits, D, 0, threads, NULL, 0) != 0) return -4;
    return 0;
}

/* Bytes of one part of a matrix (rows of `cols` columns in the part's format; an int8 part's row scales aside). */
static int64_t part_bytes(const MatPart *p, int64_t cols) {
    if (p->format == MAT_GGUF) return p->rows * (cols / gguf_block_weights(p->gguf_type & 255)) *
                                      gguf_block_bytes(p->gguf_type & 255);
    if (p->format == MAT_INT8) return p->rows * cols;
    return p->rows * cols * (p->format == MAT_F32 ? 4 : 2);
}

/* Every byte of `n` read with wide loads and summed (vpsadbw: one operation per 64 bytes besides the load), the sum
 * returned: the least work that still reads each byte. */
static uint64_t read_span(const char *p, int64_t n) {
    uint64_t total = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (; i + 128 <= n; i += 128) {
        a = _mm512_add_epi64(a, _mm512_sad_epu8(_mm512_loadu_si512((const void *)(p + i)), _mm512_setzero_si512()));
        b = _mm512_add_epi64(b, _mm512_sad_epu8(_mm512_loadu_si512((const void *)(p + i + 64)), _mm512_setzero_si512()));
    }
    total = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a, b));
#elif defined(__AVX2__)
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (; i + 64 <= n; i += 64) {
        a = _mm256_add_epi64(a, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i)), _mm256_setzero_si256()));
        b = _mm256_add_epi64(b, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i + 32)), _mm256_setzero_si256()));
    }
    a = _mm256_add_epi64(a, b);
    total = (uint64_t)_mm256_extract_epi64(a, 0) + (uint64_t)_mm256_extract_epi64(a, 1) +
            (uint64_t)_mm256_extract_epi64(a, 2) + (uint64_t)_mm256_extract_epi64(a, 3);
#endif
    for (; i < n; i++) total += (uint8_t)p[i];
    return total;
}

/* The read ceiling of a decode step: every byte its products read (each layer's four matrices, then the head, in
 * the step's order), read and nothing else, each thread a contiguous share of each matrix (as the products split
 * them by rows), all in one parallel region (no fork / join between matrices). The time this takes is the bandwidth bound
 * for the weights measured on their own pages (on a VM, where a buffer's pages land changes the bandwidth by half).
 * Returns the sum of every byte read (each read once: the tests check it against the weights). */
uint64_t dsv41_step_read(const StepModel *m, const StepLayer *layers, int threads) {
    const int64_t D = m->hidden, H = m->heads, d = m->head_dim, I = m->inter;
    uint64_t seen = 0;
#pragma omp parallel num_threads(threads) reduction(+ : seen)
    {
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        for (int64_t l = 0; l <= m->layers; l++) {
            const Mat *mats[4];
            int64_t cols[4], count = 4;
            if (l < m->layers) {
                const StepLayer *L = layers + l;
                mats[0] = &L->qkv, mats[1] = &L->o, mats[2] = &L->gate_up, mats[3] = &L->down;
                cols[0] = D, cols[1] = H * d, cols[2] = D, cols[3] = I;
            } else {
                mats[0] = &m->lm_head, cols[0] = D, count = 1;
            }
            for (int64_t k = 0; k < count; k++)
                for (int64_t i = 0; i < mats[k]->parts; i++) {
                    const MatPart *p = mats[k]->part + i;
                    const int64_t bytes = part_bytes(p, cols[k]), lines = (bytes + 63) / 64;
                    const int64_t b0 = lines * t / n * 64, b1 = lines * (t + 1) / n * 64;
                    if (b0 < bytes) seen += read_span((const char *)p->data + b0, (b1 < bytes ? b1 : bytes) - b0);
                }
        }
    }
    return seen;
}

/* What the Q4 products' order of reading costs alone: every byte of `rows` split Q4_0 / Q4_1 rows (type 2 / 3,
 * `blocks` blocks a row) read with wide loads and summed (as dsv41_step_read), each thread its share of the rows
 * (thread_rows); pattern 0: linearly; 1: in the order rows_q4_int reads them, nothing computed (four rows a group:
 * each row's scales of 16 blocks, then 64 bytes of integers of each row in turn, a group's last blocks one load a
 * row, the rows ahead streamed into L2 as the product does). benchmarks/read_pattern.py times the two. Returns the
 * sum of the bytes (the same either way: each is read once), or 0 without AVX-512. */
uint64_t dsv41_q4_read_pattern(int64_t type, const uint8_t *w, int64_t rows, int64_t blocks, int pattern, int threads) {
    uint64_t total = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const int64_t size = gguf_block_bytes(type), row_bytes = blocks * size, sb = split_scale_bytes(type),
                  q_at = sb * blocks;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int64_t r0, r1;
        thread_rows(rows, &r0, &r1);
        const __m512i z = _mm512_setzero_si512();
        __m512i acc = z;
        if (pattern == 0) {
            total += read_span((const char *)w + r0 * row_bytes, (r1 - r0) * row_bytes);
        } else {
            Stream st = group_stream(w, r0, r1, row_bytes, blocks);
            for (int64_t r = r0; r < r1; r += 4) {
                const int64_t n = r1 - r < 4 ? r1 - r : 4;
                for (int64_t c = 0; c < blocks; c += 16) {
                    const int64_t nb = blocks - c < 16 ? blocks - c : 16;
                    const __mmask16 live = (__mmask16)((1u << nb) - 1u);
                    for (int64_t j = 0; j < n; j++)
                        for (int64_t k = 0; k < sb / 2; k++) /* d (and Q4_1's m) of blocks c.. */
                            acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_castsi256_si512(_mm256_maskz_loadu_epi16(
                                      live, w + (r + j) * row_bytes + 2 * blocks * k + 2 * c)), z));
                    for (int64_t at = 0; at < 16 * nb; at += 64) {
                        group_stream_to(&st, w, r, row_bytes, c + at / 16 + 4);
                        const __mmask64 bytes = 16 * nb - at >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * nb - at)) - 1);
                        for (int64_t j = 0; j < n; j++)
                            acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_maskz_loadu_epi8(
                                      bytes, w + (r + j) * row_bytes + q_at + 16 * c + at), z));
                    }
                }
            }
        }
        total += (uint64_t)_mm512_reduce_add_epi64(acc);
    }
#else
    (void)type, (void)w, (void)rows, (void)blocks, (void)pattern, (void)threads;
#endif
    return total;
}

/* ---------------------------------------------------------------------------------------------------------
 * Rows of a cache layer moved in place (engine/kernels/rows.py). A layer (hot or cold) keeps several tensors
 * laid out [heads, capacity, row] with one capacity for all (keys, values, their int8 scales, positions,
 * scores, ...); a recall moves a few rows of every one of them per head. Through torch each move is one
 * operation per tensor and per step, ~30 us apiece on this kind of machine, which made the moves most of a
 * recall; here one call moves every tensor's rows. Plain memcpy of whole rows: bit-exact, any dtype.
 */

/* Take rows `index` [heads, m] (distinct per head, each < n) out of the first n rows of every tensor: copy them
 * to outs[t] [heads, m, row] in index order, then fill the holes they leave below n - m with the rows at or past
 * n - m that stay, both in ascending order (the layout the torch path in engine/cache/cold.py makes). Returns 0,
 * or -1 for an index out of range or repeated (nothing written). */
/* gone [heads, n]: 1 at each taken row of index [heads, m]; -1 for an index out of range or repeated. */
static int mark_taken(int64_t heads, int64_t n, int64_t m, const int64_t *index, unsigned char *gone) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t j = 0; j < m; j++) {
            int64_t i = index[h * m + j];
            if (i < 0 || i >= n || gone[h * n + i]) return -1;
            gone[h * n + i] = 1;
        }
    return 0;
}

/* Head h's holes below n - m (its taken rows, marked in g [n]) get the rows at or past n - m that stay, both in
 * ascending order, in every tensor (bases[t] laid out [heads, capacity, row_bytes[t]]). */
static void fill_holes(const unsigned char *g, int64_t h, int64_t n, int64_t m, int64_t capacity, int count,
                       char *const *bases, const int64_t *row_bytes) {
    int64_t hole = 0, mover = n - m;
    for (;;) {
        while (hole < n - m && !g[hole]) hole++;
        if (hole >= n - m) break;
        while (mover < n && g[mover]) mover++;  /* as many staying rows at or past n - m as holes below it */
        for (int t = 0; t < count; t++) {
            int64_t rb = row_bytes[t];
            char *base = bases[t] + h * capacity * rb;
            memcpy(base + hole * rb, base + mover * rb, rb);
        }
        hole++;
        mover++;
    }
}

int dsv41_rows_take(int64_t heads, int64_t capacity, int64_t n, int64_t m, const int64_t *index, int count,
                    char *const *bases, const int64_t *row_bytes, char *const *outs) {
    if (m < 0 || m > n || n > capacity) return -1;
    unsigned char *gone = calloc((size_t)(heads * (n > 0 ? n : 1)), 1);
    if (!gone) return -2;
    if (mark_taken(heads, n, m, index, gone) != 0) { free(gone); return -1; }
    for (int64_t h = 0; h < heads; h++) {
        for (int t = 0; t < count; t++) {
            int64_t rb = row_bytes[t];
            const char *base = bases[t] + h * capacity * rb;
            for (int64_t j = 0; j < m; j++) memcpy(outs[t] + (h * m + j) * rb, base + index[h * m + j] * rb, rb);
        }
        fill_holes(gone + h * n, h, n, m, capacity, count, bases, row_bytes);
    }
    free(gone);
    return 0;
}

/* Keep only rows index [heads, k] (strictly ascending per head, < n) of the first n rows of every tensor, moved down
 * in place to rows 0..k-1 in that order (a compaction: row j takes row index[j] >= j, so a forward copy never
 * overwrites a row still to be read). Returns 0, or -1 (bad sizes or index) before anything is written. */
int dsv41_rows_keep(int64_t heads, int64_t capacity, int64_t n, int64_t k, const int64_t *index, int count,
                    char *const *bases, const int64_t *row_bytes, int threads) {
    if (k < 0 || k > n || n > capacity) return -1;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t i = index[h * k + j];
            if (i >= n || (j ? i <= index[h * k + j - 1] : i < 0)) return -1;
        }
    /* each (tensor, head) on its own; a run of consecutive kept rows moves in one memmove (rows only move down) */
#pragma omp parallel for schedule(dynamic) num_threads(threads > 0 ? threads : 1)
    for (int64_t th = 0; th < (int64_t)count * heads; th++) {
        const int64_t t = th / heads, h = th % heads, rb = row_bytes[t];
        char *base = bases[t] + h * capacity * rb;
        const int64_t *ix = index + h * k;
        for (int64_t j = 0; j < k;) {
            int64_t run = 1;
            while (j + run < k && ix[j + run] == ix[j] + run) run++;
            if (ix[j] != j) memmove(base + j * rb, base + ix[j] * rb, (size_t)(run * rb));
            j += run;
        }
    }
    return 0;
}

/* A float32 (bf16: 1) row of d rounded to int8 as quantize_int8 rounds it: q = round(x / scale), |q| <= 127, scale =
 * max |x| / 127 (at least 1e-8 / 127); returns the scale. The cold tier stores its rows so, and the reply's counts
 * hash every key so (dsv41_cold_counts). */
static float row_to_int8(const void *row, int bf16, int64_t d, int8_t *q) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* the same float32 operations lane by lane as the scalar loops (#else), the row held in registers: max of |x|
     * (NaN-free, so in any order), an IEEE division, the rounding of the current mode (nearbyintf's), the clamp */
    __m512 x[MAX_HEAD_DIM / 16], top = _mm512_setzero_ps();
    __mmask16 keep[MAX_HEAD_DIM / 16];
    const int64_t n = (d + 15) / 16;
    for (int64_t v = 0; v < n; v++) {
        const int64_t left = d - v * 16;
        keep[v] = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        x[v] = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                          keep[v], (const uint16_t *)row + v * 16)), 16))
                    : _mm512_maskz_loadu_ps(keep[v], (const float *)row + v * 16);
        top = _mm512_max_ps(_mm512_abs_ps(x[v]), top);  /* a NaN lane keeps top, as the scalar a > top does */
    }
    const float most = _mm512_reduce_max_ps(top), scale = (most > 1e-8f ? most : 1e-8f) / 127.0f;
    const __m512 by = _mm512_set1_ps(scale), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
    for (int64_t v = 0; v < n; v++) {
        __m512 r = _mm512_roundscale_ps(_mm512_div_ps(x[v], by), _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        /* a whole piece in an unmasked store: a later 16-byte load of it is forwarded from the store (a load
         * from masked byte stores waits for them to reach the cache) */
        const __m128i bytes = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r));
        if (keep[v] == (__mmask16)0xFFFF) _mm_storeu_si128((__m128i *)(q + v * 16), bytes);
        else _mm_mask_storeu_epi8(q + v * 16, keep[v], bytes);
    }
    return scale;
#else
    float x[MAX_HEAD_DIM], top = 0.f;
    for (int64_t i = 0; i < d; i++) {
        x[i] = bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
        const float a = fabsf(x[i]);
        top = a > top ? a : top;
    }
    const float scale = (top > 1e-8f ? top : 1e-8f) / 127.0f;
    for (int64_t i = 0; i < d; i++) {
        const float r = nearbyintf(x[i] / scale);
        q[i] = (int8_t)(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
    }
    return scale;
#endif
}

/* A compaction's dropped rows into the cold tier (engine/cache/cold.py ColdLayer.add): rows index [heads, m] (< n)
 * of the hot layer's keys and values [heads, hot_capacity, d] (float32, or bf16 when hot_bf16), positions and
 * scores [heads, hot_capacity], appended at rows start.. of the cold layer's, per head in index order. int8: the
 * cold keys and values are int8 with one float32 scale per row, as engine/kernels/quant.py quantize_int8 rounds
 * them (scale = max(max |x|, 1e-8) / 127, q = x / scale rounded half to even, clamped to +-127: the same float32
 * operations, so bit-equal); else they are the hot rows' bytes. Returns 0, or -1 (bad sizes or index) before
 * anything is written. */
int dsv41_cold_add(int64_t heads, int64_t d, int64_t hot_capacity, int64_t n, int64_t m, const int64_t *index,
                   const void *hot_keys, const void *hot_values, const int32_t *hot_positions, const float *hot_scores,
                   int hot_bf16, int64_t cold_capacity, int64_t start, void *cold_keys, void *cold_values,
                   float *key_scales, float *value_scales, int32_t *cold_positions, float *cold_scores, int int8,
                   int threads) {
    if (m < 0 || n > hot_capacity || start < 0 || start + m > cold_capacity || d > MAX_HEAD_DIM) return -1;
    for (int64_t i = 0; i < heads * m; i++)
        if (index[i] < 0 || index[i] >= n) return -1;
    const int64_t esize = hot_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t gj = 0; gj < heads * m; gj++) {
        const int64_t g = gj / m, j = gj % m;
        const int64_t src = g * hot_capacity + index[g * m + j], dst = g * cold_capacity + start + j;
        cold_positions[dst] = hot_positions[src];
        cold_scores[dst] = hot_scores[src];
        for (int kv = 0; kv < 2; kv++) {
            const char *row = (const char *)(kv ? hot_values : hot_keys) + src * d * esize;
            void *out = kv ? cold_values : cold_keys;
            if (!int8) {
                memcpy((char *)out + dst * d * esize, row, (size_t)(d * esize));
                continue;
            }
            (kv ? value_scales : key_scales)[dst] = row_to_int8(row, hot_bf16, d, (int8_t *)out + dst * d);
        }
    }
    return 0;
}

/* Insert m new rows per head among the first n rows of every tensor so that each head stays in position order:
 * positions [heads, capacity] int32 is the layer's (one of the tensors too), new_positions [heads, m] the new
 * rows'; news[t] [heads, m, row] holds tensor t's new rows (NULL: zeros). Ties keep the stored rows first, the
 * new ones in their given order (as a stable sort of stored then new would). Needs n + m <= capacity. Returns 0,
 * or -1 / -2 (bad sizes, no memory for the sort) before anything is written. */
int dsv41_rows_insert(int64_t heads, int64_t capacity, int64_t n, int64_t m, const int32_t *positions,
                      const int32_t *new_positions, int count, char *const *bases, const int64_t *row_bytes,
                      const char *const *news) {
    if (m < 0 || n < 0 || n + m > capacity) return -1;
    if (m == 0) return 0;
    int64_t *order = malloc((size_t)m * sizeof(int64_t));
    if (!order) return -2;
    for (int64_t h = 0; h < heads; h++) {
        const int32_t *np = new_positions + h * m;
        for (int64_t j = 0; j < m; j++) {  /* a stable insertion sort of the new rows by position (m is small) */
            int64_t k = j;
            while (k > 0 && np[order[k - 1]] > np[j]) { order[k] = order[k - 1]; k--; }
            order[k] = j;
        }
        /* merge from the end: slot s is written only after the stored row that was there has been read. A run of
         * stored rows that go up together moves in one memmove a tensor, and so does a run of new rows given in
         * order (a recall's spans): the same rows land in the same slots as a row at a time. */
        const int32_t *pos = positions + h * capacity;
        int64_t i = n - 1, j = m - 1, s = n + m - 1;
        while (j >= 0) {
            int64_t run = 0;
            if (i >= 0 && np[order[j]] < pos[i]) {  /* stored rows i - run + 1 .. i go to s - run + 1 .. s */
                while (run <= i && np[order[j]] < pos[i - run]) run++;
                for (int t = 0; t < count; t++) {
                    const int64_t rb = row_bytes[t];
                    char *base = bases[t] + h * capacity * rb;
                    memmove(base + (s - run + 1) * rb, base + (i - run + 1) * rb, (size_t)(run * rb));
                }
                i -= run;
            } else {  /* new rows order[j - run + 1 .. j], consecutive in the given rows, to s - run + 1 .. s */
                run = 1;
                while (run <= j && order[j - run] == order[j] - run && (i < 0 || np[order[j - run]] >= pos[i])) run++;
                for (int t = 0; t < count; t++) {
                    const int64_t rb = row_bytes[t];
                    char *dst = bases[t] + h * capacity * rb + (s - run + 1) * rb;
                    if (news[t]) memcpy(dst, news[t] + (h * m + order[j] - run + 1) * rb, (size_t)(run * rb));
                    else memset(dst, 0, (size_t)(run * rb));
                }
                j -= run;
            }
            s -= run;
        }
    }
    free(order);
    return 0;
}

/* A question's recall in one call (engine/cache/cold.py, ColdLayer.move_into): the cold layer's rows index [heads, m]
 * (distinct per head, < cn) are taken out, widened to the hot set's dtype (int8 rows times their scale in float32,
 * rounded to bf16 when the hot set is bf16; else copied as stored) and inserted among the hot layer's hn rows in
 * position order; the holes they leave in the cold layer are filled as dsv41_rows_take fills them. Bit-equal to
 * dsv41_rows_take, torch's float32 multiply and dtype conversion, then dsv41_rows_insert, without their
 * intermediate tensors. cold: keys, values, positions, scores, and key_scales, value_scales when int8; hot: keys,
 * values, positions, scores, then any tensors whose new rows are zeros (log counts, CSA2's projections). Returns 0,
 * -1 (bad sizes or index) or -2 (no memory) before anything is written. */
int dsv41_recall_move(int64_t heads, int64_t d, int64_t ccap, int64_t cn, int64_t m, const int64_t *index,
                      char *const *cold, int cold_int8, int64_t hcap, int64_t hn, int hot_count, char *const *hot,
                      const int64_t *hot_row_bytes, int hot_bf16) {
    const int64_t elem = hot_bf16 ? 2 : 4, kv_bytes = d * elem, ckv_bytes = cold_int8 ? d : kv_bytes;
    if (m < 0 || m > cn || cn > ccap || hn < 0 || hn + m > hcap || hot_count < 4 || hot_row_bytes[0] != kv_bytes
        || hot_row_bytes[1] != kv_bytes || hot_row_bytes[2] != 4 || hot_row_bytes[3] != 4) return -1;
    if (m == 0) return 0;
    unsigned char *gone = calloc((size_t)(heads * cn), 1);
    char *keys = malloc((size_t)(heads * m * kv_bytes)), *values = malloc((size_t)(heads * m * kv_bytes));
    int32_t *positions = malloc((size_t)(heads * m) * sizeof(int32_t));
    float *scores = malloc((size_t)(heads * m) * sizeof(float));
    const char **news = calloc((size_t)hot_count, sizeof(char *));
    int status = 0;
    if (!gone || !keys || !values || !positions || !scores || !news) { status = -2; goto done; }
    if (mark_taken(heads, cn, m, index, gone) != 0) { status = -1; goto done; }
    const int64_t cold_bytes[6] = {ckv_bytes, ckv_bytes, 4, 4, 4, 4};
    const int cold_count = cold_int8 ? 6 : 4;
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t j = 0; j < m; j++) {  /* the taken rows, in the hot set's format */
            const int64_t i = index[h * m + j], row = h * ccap + i, out = h * m + j;
            for (int kv = 0; kv < 2; kv++) {
                const char *src = cold[kv] + row * ckv_bytes;
                char *dst = (kv ? values : keys) + out * kv_bytes;
                if (!cold_int8) { memcpy(dst, src, (size_t)kv_bytes); continue; }
                const float scale = ((const float *)cold[4 + kv])[row];
                int64_t k = 0;
#if defined(__AVX512F__)
                const __m512 sv = _mm512_set1_ps(scale);  /* sixteen values at a time, the same products and rounding */
                for (; k + 16 <= d; k += 16) {
                    const __m512 f = _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + k)))), sv);
                    if (hot_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)dst + k), bf16_of16(f));
                    else _mm512_storeu_ps((float *)dst + k, f);
                }
#endif
                for (; k < d; k++) {
                    const float f = (float)((const int8_t *)src)[k] * scale;
                    if (hot_bf16) ((uint16_t *)dst)[k] = f32_to_bf16(f);
                    else ((float *)dst)[k] = f;
                }
            }
            positions[out] = ((const int32_t *)cold[2])[row];
            scores[out] = ((const float *)cold[3])[row];
        }
    }
    news[0] = keys; news[1] = values; news[2] = (const char *)positions; news[3] = (const char *)scores;
    /* the hot set first: it is the only step that can fail (no memory), and the cold layer is not touched yet */
    status = dsv41_rows_insert(heads, hcap, hn, m, (const int32_t *)hot[2], positions, hot_count, hot, hot_row_bytes,
                               news);
    if (status != 0) goto done;
    for (int64_t h = 0; h < heads; h++) fill_holes(gone + h * cn, h, cn, m, ccap, cold_count, cold, cold_bytes);
done:
    free(gone); free(keys); free(values); free(positions); free(scores); free((void *)news);
    return status;
}

/* The attention each cold entry would get from a question's queries, given their logits (engine/cache/cold.py:
 * recall_mass computes the two products with torch, this the rest in one pass per query row, in L1, instead of a
 * torch operation over the whole [heads, rows, entries] block per step). For kv head h and query row r (query
 * i = r % tq of its group): one softmax over the hot logits [h, r, :S] (+ hot_lc [h, :S] when given; only the
 * entries up to S - tq + i: the question's own later tokens are masked) and the cold logits [h, r, :C]; the cold
 * shares are summed over the rows into mass [h, C]. Returns 0. */
/* the recall's vector operations (exp16 / exp8: with exp_approx above) */
#if defined(__AVX512F__)
#define LANES 16
#define VF __m512
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET _mm512_set1_ps
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VMUL _mm512_mul_ps
#define VMAX _mm512_max_ps
#define VEXP exp16
#define VHMAX _mm512_reduce_max_ps
#define VHSUM _mm512_reduce_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
#define LANES 8
#define VF __m256
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET _mm256_set1_ps
#define VADD _mm256_add_ps
#define VSUB _mm256_sub_ps
#define VMUL _mm256_mul_ps
#define VMAX _mm256_max_ps
#define VEXP exp8
#define VHMAX hmax8
#define VHSUM hsum256
#endif

/* One query row of the recall's softmax: hot logits hr [seen] (+ lc), cold logits cr [c] (overwritten by their
 * exp), the cold shares added to acc [c]. */
static void recall_row(float *hr, const float *lc, int64_t seen, float *cr, int64_t c, float *acc) {
    float top = -INFINITY, total = 0.f;
    int64_t j = 0;
    if (lc)
        for (j = 0; j < seen; j++) hr[j] += lc[j];
#ifdef LANES
    VF best = VSET(-INFINITY), sum = VSET(0.f);
    for (j = 0; j + LANES <= seen; j += LANES) best = VMAX(best, VLOAD(hr + j));
    for (; j < seen; j++) top = fmaxf(top, hr[j]);
    for (j = 0; j + LANES <= c; j += LANES) best = VMAX(best, VLOAD(cr + j));
    for (; j < c; j++) top = fmaxf(top, cr[j]);
    top = fmaxf(top, VHMAX(best));
    VF t = VSET(top);
    for (j = 0; j + LANES <= seen; j += LANES) sum = VADD(sum, VEXP(VSUB(VLOAD(hr + j), t)));
    for (; j < seen; j++) total += exp_approx(hr[j] - top);
    for (j = 0; j + LANES <= c; j += LANES) {
        VF e = VEXP(VSUB(VLOAD(cr + j), t));
        VSTORE(cr + j, e);
        sum = VADD(sum, e);
    }
    for (; j < c; j++) {
        cr[j] = exp_approx(cr[j] - top);
        total += cr[j];
    }
    total += VHSUM(sum);
    VF inv = VSET(1.f / total);
    for (j = 0; j + LANES <= c; j += LANES) VSTORE(acc + j, VADD(VLOAD(acc + j), VMUL(VLOAD(cr + j), inv)));
    for (; j < c; j++) acc[j] += cr[j] / total;
#else
    for (j = 0; j < seen; j++) top = fmaxf(top, hr[j]);
    for (j = 0; j < c; j++) top = fmaxf(top, cr[j]);
    for (j = 0; j < seen; j++) total += exp_approx(hr[j] - top);
    for (j = 0; j < c; j++) {
        cr[j] = exp_approx(cr[j] - top);
        total += cr[j];
    }
    for (j = 0; j < c; j++) acc[j] += cr[j] / total;
#endif
}

int dsv41_recall_softmax(int64_t heads, int64_t rows, int64_t tq, int64_t s, int64_t c, float *hot,
                         const float *hot_lc, float *cold, float *mass, int threads) {
    int nt = threads > 0 ? threads : 1;
    float *partial = calloc((size_t)(nt * c > 0 ? nt * c : 1), sizeof(float));
    if (!partial) return -2;
    for (int64_t h = 0; h < heads; h++) {
        memset(partial, 0, (size_t)(nt * c) * sizeof(float));
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t r = 0; r < rows; r++)
            recall_row(hot + (h * rows + r) * s, hot_lc ? hot_lc + h * s : NULL, s - tq + r % tq + 1,
                       cold + (h * rows + r) * c, c, partial + (int64_t)omp_get_thread_num() * c);
        float *out = mass + h * c;
        memset(out, 0, (size_t)c * sizeof(float));
        for (int t = 0; t < nt; t++)
            for (int64_t j = 0; j < c; j++) out[j] += partial[t * c + j];
    }
    free(partial);
    return 0;
}

/* A question's recall scoring in one call (cold.recall_mass): per kv head, the logits of the group's query rows
 * q [heads, rows, d] (already scaled; row r is query r % tq of its head) against the hot keys [s, d] (+ hot_lc;
 * the question's own later tokens masked, as dsv41_recall_softmax) and the cold keys [c, d], read as they are
 * stored: float32, bf16, or int8 with a float32 scale per entry (widened and scaled exactly as ColdLayer.read_keys
 * does, key by key into L1, instead of a float32 copy of the whole cold tier); then one softmax per row over both
 * and the cold shares summed over the rows into mass [heads, c]. The logits are computed entries x rows (the rows
 * in vector lanes, four entries at a time: every key element is broadcast once against up to four vectors of
 * rows held in registers), each a sum over d in order, as torch's float32 matmul gives them on this CPU (tests
 * compare). Key types: 0 float32, 1 bf16, 2 int8. Returns 0, -1 where it does not apply (no vectors, d not a
 * multiple of the vector width or above RECALL_DMAX), -2 out of memory. */
#ifdef LANES
#define RECALL_DMAX 256
#if LANES == 16
#define RECALL_NV 4
#define VZERO _mm512_setzero_ps
#define VFMA _mm512_fmadd_ps
#else
#define RECALL_NV 2
#define VZERO _mm256_setzero_ps
#define VFMA _mm256_fmadd_ps
#endif

static inline void recall_key(int type, const void *base, int64_t j, int64_t d, const float *scales, float *dst) {
    if (type == 0) {
        memcpy(dst, (const float *)base + j * d, (size_t)d * sizeof(float));
    } else if (type == 1) {
        const uint16_t *k = (const uint16_t *)base + j * d;
        for (int64_t t = 0; t < d; t += LANES) {
#if LANES == 16
            __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(k + t))), 16);
            VSTORE(dst + t, _mm512_castsi512_ps(w));
#else
            __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(k + t))), 16);
            VSTORE(dst + t, _mm256_castsi256_ps(w));
#endif
        }
    } else {
        const int8_t *k = (const int8_t *)base + j * d;
        VF s = VSET(scales[j]);
        for (int64_t t = 0; t < d; t += LANES) {
#if LANES == 16
            VF f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(k + t))));
#else
            VF f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(k + t))));
#endif
            VSTORE(dst + t, VMUL(f, s));
        }
    }
}

/* out [ne][rp] (rows rb.. of entries j0..j0+ne) = kf [4][RECALL_DMAX] . qt [d][rp], NV vectors of rows. */
#define RECALL_TILE(NV)                                                                                          \
    static inline void recall_tile##NV(const float *qt, int64_t rp, int64_t d, const float *kf, int ne,        \
                                       float *out) {                                                          \
        VF acc[4][NV];                                                                                        \
        _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++)                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[e][v] = VZERO();                        \
        for (int64_t t = 0; t < d; t++) {                                                                     \
            VF qv[NV];                                                                                        \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) qv[v] = VLOAD(qt + t * rp + v * LANES);     \
            _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++) {                                            \
                VF b = VSET(kf[e * RECALL_DMAX + t]);                                                         \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[e][v] = VFMA(b, qv[v], acc[e][v]);  \
            }                                                                                                 \
        }                                                                                                     \
        for (int e = 0; e < ne; e++)                                                                          \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) VSTORE(out + e * rp + v * LANES, acc[e][v]);\
    }
RECALL_TILE(1)
RECALL_TILE(2)
#if RECALL_NV == 4
RECALL_TILE(3)
RECALL_TILE(4)
#endif

static void recall_logits4(const float *qt, int64_t rp, int64_t d, const float *kf, int ne, float *out) {
    int64_t rb = 0;
    for (; rb + RECALL_NV * LANES <= rp; rb += RECALL_NV * LANES)
#if RECALL_NV == 4
        recall_tile4(qt + rb, rp, d, kf, ne, out + rb);
#else
        recall_tile2(qt + rb, rp, d, kf, ne, out + rb);
#endif
    switch ((rp - rb) / LANES) {
    case 1: recall_tile1(qt + rb, rp, d, kf, ne, out + rb); break;
#if RECALL_NV == 4
    case 2: recall_tile2(qt + rb, rp, d, kf, ne, out + rb); break;
    case 3: recall_tile3(qt + rb, rp, d, kf, ne, out + rb); break;
#endif
    default: break;
    }
}

/* The cold logits of int8 keys against query rows rounded to int16 (cold.cold_logits defines them): per row and
 * entry the exact int32 sum over d of q16 x key, rounded once to float32, times the key's scale, times the row's.
 * qp [d / 2][rp] holds each row's int16 values in pairs (t, t + 1) in one 32-bit lane; a key's pair is broadcast
 * against them and vpdpwssd (AVX-512 VNNI) or vpmaddwd + add (AVX-512 BW, AVX2) adds both products to the row's
 * int32 sum: two values an instruction where the float32 route takes one. |q| <= 32767 and |key| <= 127, so a
 * sum over d <= RECALL_DMAX stays far inside int32. */
#if LANES == 16 && defined(__AVX512BW__)
#define RECALL_INT16 1
#define VI __m512i
#define VI_ZERO _mm512_setzero_si512
#define VI_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define VI_SET _mm512_set1_epi32
#define VI_TOF _mm512_cvtepi32_ps
#if defined(__AVX512VNNI__)
#define VI_DOT(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define VI_DOT(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
#elif LANES == 8
#define RECALL_INT16 1
#define VI __m256i
#define VI_ZERO _mm256_setzero_si256
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_SET _mm256_set1_epi32
#define VI_TOF _mm256_cvtepi32_ps
#define VI_DOT(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif

#ifdef RECALL_INT16
/* out [ne][rp] (rows rb..) = (float)(kp [4][d / 2] . qp [d / 2][rp]) * ks[e] * qs [rp], NV vectors of rows. */
#define RECALL_ITILE(NV)                                                                                         \
    static inline void recall_itile##NV(const int32_t *qp, int64_t rp, int64_t pairs, const int32_t *kp,        \
                                        const float *ks, const float *qs, int ne, float *out) {                  \
        VI acc[4][NV];                                                                                        \
        _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++)                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[e][v] = VI_ZERO();                      \
        for (int64_t t = 0; t < pairs; t++) {                                                                 \
            VI qv[NV];                                                                                        \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) qv[v] = VI_LOAD(qp + t * rp + v * LANES);   \
            _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++) {                                            \
                VI b = VI_SET(kp[e * (RECALL_DMAX / 2) + t]);                                                 \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[e][v] = VI_DOT(acc[e][v], qv[v], b);\
            }                                                                                                 \
        }                                                                                                     \
        for (int e = 0; e < ne; e++) {                                                                        \
            VF k = VSET(ks[e]);                                                                               \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                                             \
                VSTORE(out + e * rp + v * LANES, VMUL(VMUL(VI_TOF(acc[e][v]), k), VLOAD(qs + v * LANES)));   \
        }                                                                                                     \
    }
RECALL_ITILE(1)
RECALL_ITILE(2)
#if RECALL_NV == 4
RECALL_ITILE(3)
RECALL_ITILE(4)
#endif

/* The logits of cold entries j0 .. j0 + ne - 1 (ne <= 4; int8 keys [.., d] with scales) into their rows of base
 * ([entry][rp]), each row's maximum into mx [rp] (as logit_rows does for the float route). */
static void cold_rows_int16(const int32_t *qp, const float *qs, int64_t rp, int64_t d, const int8_t *keys,
                            const float *scales, int64_t j0, int ne, float *base, float *mx) {
    /* a key's values widened to int16 are its pairs (t, t + 1) as int32, little-endian */
    int32_t kp[4 * (RECALL_DMAX / 2)] __attribute__((aligned(64)));  /* written through vector stores (may alias) */
    float ks[4];
    const int64_t pairs = d / 2;
    for (int e = 0; e < 4; e++) {
        ks[e] = e < ne ? scales[j0 + e] : 0.f;
        int32_t *w32 = kp + e * (RECALL_DMAX / 2);
        if (e >= ne) { memset(w32, 0, (size_t)pairs * sizeof(int32_t)); continue; }
        char *w = (char *)w32;
        const int8_t *k = keys + (j0 + e) * d;
        for (int64_t t = 0; t < d; t += LANES)  /* d is a multiple of LANES */
#if LANES == 16
            _mm256_storeu_si256((__m256i *)(w + 2 * t), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k + t))));
#else
            _mm_storeu_si128((__m128i *)(w + 2 * t), _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(k + t))));
#endif
    }
    float *out = base + j0 * rp;
    int64_t rb = 0;
    for (; rb + RECALL_NV * LANES <= rp; rb += RECALL_NV * LANES)
#if RECALL_NV == 4
        recall_itile4(qp + rb, rp, pairs, kp, ks, qs + rb, ne, out + rb);
#else
        recall_itile2(qp + rb, rp, pairs, kp, ks, qs + rb, ne, out + rb);
#endif
    switch ((rp - rb) / LANES) {
    case 1: recall_itile1(qp + rb, rp, pairs, kp, ks, qs + rb, ne, out + rb); break;
#if RECALL_NV == 4
    case 2: recall_itile2(qp + rb, rp, pairs, kp, ks, qs + rb, ne, out + rb); break;
    case 3: recall_itile3(qp + rb, rp, pairs, kp, ks, qs + rb, ne, out + rb); break;
#endif
    default: break;
    }
    for (int e = 0; e < ne; e++) {
        const float *row = out + e * rp;
        for (int64_t v = 0; v < rp; v += LANES) VSTORE(mx + v, VMAX(VLOAD(mx + v), VLOAD(row + v)));
    }
}
#endif

/* The pieces dsv41_recall_mass and dsv41_question_attention share. */

/* qp [d / 2][rp] = the head's int16 query rows q16 [rows][d] in pairs, rows past `rows` zero. */
static void queries_pairs(const int16_t *q16, int64_t rows, int64_t d, int64_t rp, int32_t *qp) {
    memset(qp, 0, (size_t)(d / 2 * rp) * sizeof(int32_t));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < d / 2; t++)
            qp[t * rp + r] = (int32_t)((uint32_t)(uint16_t)q16[r * d + 2 * t] | ((uint32_t)(uint16_t)q16[r * d + 2 * t + 1] << 16));
}

/* qt [d][rp] = the head's query rows q [rows][d] transposed, rows past `rows` zero. */
static void queries_t(const float *q, int64_t rows, int64_t d, int64_t rp, float *qt) {
    memset(qt, 0, (size_t)(d * rp) * sizeof(float));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < d; t++) qt[t * rp + r] = q[r * d + t];
}

/* The logits of up to four entries of one head's keys (type / scales as recall_key) into their rows of `base`
 * ([entry][rp]): entries j0 .. j0 + ne - 1, or idx[0 .. ne - 1] when idx is given (computed in `tile`, 4 x rp, and
 * copied). lc (per entry) is added; with tq > 0 the question's own later tokens are masked (row r sees entries up
 * to s - tq + r % tq); each row's maximum goes into mx [rp]. */
static void logit_rows(const float *qt, int64_t rp, int64_t d, int type, const void *keys, const float *scales,
                       int64_t j0, const int64_t *idx, int ne, const float *lc, int64_t s, int64_t tq, int64_t rows,
                       float *base, float *tile, float *mx) {
    float kf[4 * RECALL_DMAX] __attribute__((aligned(64)));
    for (int e = 0; e < 4; e++) {
        if (e < ne) recall_key(type, keys, idx ? idx[e] : j0 + e, d, scales, kf + e * RECALL_DMAX);
        else memset(kf + e * RECALL_DMAX, 0, (size_t)d * sizeof(float));
    }
    recall_logits4(qt, rp, d, kf, ne, idx ? tile : base + j0 * rp);
    for (int e = 0; e < ne; e++) {
        const int64_t j = idx ? idx[e] : j0 + e;
        float *row = base + j * rp;
        if (idx) memcpy(row, tile + e * rp, (size_t)rp * sizeof(float));
        if (lc) {
            VF a = VSET(lc[j]);
            for (int64_t v = 0; v < rp; v += LANES) VSTORE(row + v, VADD(VLOAD(row + v), a));
        }
        if (tq > 0 && j > s - tq)
            for (int64_t r = 0; r < rows; r++)
                if (j > s - tq + r % tq) row[r] = -INFINITY;
        for (int64_t v = 0; v < rp; v += LANES) VSTORE(mx + v, VMAX(VLOAD(mx + v), VLOAD(row + v)));
    }
}

/* Per thread t of nt: row maxima part[t][0][rp] and sums part[t][1][rp]. Set before each parallel region (it may
 * run on fewer threads than asked); combined into top [rp] and inv [rp] (1 / sum, 0 past `rows`). */
static void partials_reset(float *part, int nt, int64_t rp) {
    for (int t = 0; t < nt; t++)
        for (int64_t r = 0; r < rp; r++) part[(int64_t)t * 2 * rp + r] = -INFINITY, part[(int64_t)t * 2 * rp + rp + r] = 0.f;
}

static void partials_top(const float *part, int nt, int64_t rp, float *top) {
    for (int64_t r = 0; r < rp; r++) {
        float m = -INFINITY;
        for (int t = 0; t < nt; t++) m = fmaxf(m, part[(int64_t)t * 2 * rp + r]);
        top[r] = m;
    }
}

static void partials_inv(const float *part, int nt, int64_t rp, int64_t rows, float *inv) {
    for (int64_t r = 0; r < rp; r++) {
        float total = 0.f;
        for (int t = 0; t < nt; t++) total += part[(int64_t)t * 2 * rp + rp + r];
        inv[r] = r < rows ? 1.f / total : 0.f;
    }
}

int dsv41_recall_mass(int64_t heads, int64_t rows, int64_t tq, int64_t d, const float *q,
                      const int16_t *q16, const float *q16_scales,
                      int64_t s, const void *hot, int hot_type, int64_t hot_stride, const float *hot_lc,
                      int64_t lc_stride, int64_t c, const void *cold, int cold_type, int64_t cold_stride,
                      const float *cold_scales, int64_t scale_stride, float *mass, float *hot_out, int threads) {
    if (d > RECALL_DMAX || d % LANES || rows < 1 || tq < 1 || tq > s) return -1;
    /* int8 cold keys are scored against the rows rounded to int16 (q16, one scale per row: cold.cold_logits) */
    if ((cold_type == 2) != (q16 != NULL)) return -1;
#ifndef RECALL_INT16
    if (q16) return -1;  /* no integer route in this build (AVX-512F without BW): torch's path */
#endif
    const int nt = threads > 0 ? threads : 1;
    const int64_t rp = (rows + LANES - 1) / LANES * LANES, n = s + c;
    const int64_t hot_blocks = (s + 3) / 4, blocks = hot_blocks + (c + 3) / 4;
    float *qt = malloc((size_t)(d * rp) * sizeof(float));
    /* the hot logits in hot_out [heads][s][rp] when given (dsv41_question_attention takes them), else here */
    const int64_t kept = hot_out ? c : n;
    float *logits = malloc((size_t)(kept * rp > 0 ? kept * rp : 1) * sizeof(float));
    float *part = malloc((size_t)(2 * nt * rp) * sizeof(float));  /* per thread: row maxima, row sums */
    float *top = malloc((size_t)(2 * rp) * sizeof(float)), *inv = top + rp;
    int32_t *qp = q16 ? malloc((size_t)(d / 2 * rp) * sizeof(int32_t)) : NULL;  /* the int16 rows in pairs */
    float *qs = q16 ? calloc((size_t)rp, sizeof(float)) : NULL;                  /* their scales, 0 past `rows` */
    if (!qt || !logits || !part || !top || (q16 && (!qp || !qs))) {
        free(qt); free(logits); free(part); free(top); free(qp); free(qs);
        return -2;
    }
    for (int64_t h = 0; h < heads; h++) {
        queries_t(q + h * rows * d, rows, d, rp, qt);
        if (q16) {
            queries_pairs(q16 + h * rows * d, rows, d, rp, qp);
            memcpy(qs, q16_scales + h * rows, (size_t)rows * sizeof(float));
        }
        const void *hk = hot_type == 1 ? (const void *)((const uint16_t *)hot + h * hot_stride)
                                       : (const void *)((const float *)hot + h * hot_stride);
        const void *ck = cold_type == 2 ? (const void *)((const int8_t *)cold + h * cold_stride)
                         : cold_type == 1 ? (const void *)((const uint16_t *)cold + h * cold_stride)
                                          : (const void *)((const float *)cold + h * cold_stride);
        const float *cs = cold_scales ? cold_scales + h * scale_stride : NULL;
        const float *lc = hot_lc ? hot_lc + h * lc_stride : NULL;
        float *hot_rows = hot_out ? hot_out + h * s * rp : logits, *cold_rows = hot_out ? logits : logits + s * rp;
        partials_reset(part, nt, rp);
#pragma omp parallel num_threads(nt)
        {
            const int me = omp_get_thread_num();
            float *mx = part + (int64_t)me * 2 * rp, *sm = mx + rp;
            /* blocks of 8 in turn, not halves: a hot block (float products) costs about twice an int8 cold one */
#pragma omp for schedule(static, 8)
            for (int64_t b = 0; b < blocks; b++) {
                if (b < hot_blocks)  /* hot: merge counts added, the question's own later tokens masked */
                    logit_rows(qt, rp, d, hot_type, hk, NULL, b * 4, NULL, s - b * 4 < 4 ? (int)(s - b * 4) : 4, lc,
                               s, tq, rows, hot_rows, NULL, mx);
                else {
                    const int64_t j0 = (b - hot_blocks) * 4;
                    const int ne = c - j0 < 4 ? (int)(c - j0) : 4;
#ifdef RECALL_INT16
                    if (q16)
                        cold_rows_int16(qp, qs, rp, d, (const int8_t *)ck, cs, j0, ne, cold_rows, mx);
                    else
#endif
                        logit_rows(qt, rp, d, cold_type, ck, cs, j0, NULL, ne, NULL, s, 0, rows, cold_rows, NULL, mx);
                }
            }
#pragma omp single
            partials_top(part, nt, rp, top);
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n; j++) {
                float *row = j < s ? hot_rows + j * rp : cold_rows + (j - s) * rp;
                for (int64_t v = 0; v < rp; v += LANES) {
                    VF e = VEXP(VSUB(VLOAD(row + v), VLOAD(top + v)));
                    if (j >= s) VSTORE(row + v, e);
                    VSTORE(sm + v, VADD(VLOAD(sm + v), e));
                }
            }
#pragma omp single
            partials_inv(part, nt, rp, rows, inv);
#pragma omp for schedule(static)
            for (int64_t j = 0; j < c; j++) {
                const float *row = cold_rows + j * rp;
                VF acc = VSET(0.f);
                for (int64_t v = 0; v < rp; v += LANES) acc = VADD(acc, VMUL(VLOAD(row + v), VLOAD(inv + v)));
                mass[h * c + j] = VHSUM(acc);
            }
        }
    }
    free(qt); free(logits); free(part); free(top); free(qp); free(qs);
    return 0;
}

/* out^T [4][rp] rows rb.. (= when first, else +=) sum over entries j0 <= j < j1 of P^T [j][rp] x
 * v [j][t0 .. t0 + 3], NV vectors of rows. */
#define QA_TILE(NV)                                                                                              \
    static inline void qa_tile##NV(const float *pt, int64_t rp, int64_t j0, int64_t j1, const void *v, int vtype, \
                                   int64_t d, int64_t t0, float *outt, int first) {                           \
        VF acc[4][NV];                                                                                        \
        _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++)                                                   \
            _Pragma("GCC unroll 4") for (int k = 0; k < NV; k++)                                             \
                acc[e][k] = first ? VZERO() : VLOAD(outt + e * rp + k * LANES);                               \
        for (int64_t j = j0; j < j1; j++) {                                                                   \
            VF pv[NV];                                                                                        \
            _Pragma("GCC unroll 4") for (int k = 0; k < NV; k++) pv[k] = VLOAD(pt + j * rp + k * LANES);     \
            _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++) {                                            \
                const float x = vtype == 1 ? bf16_to_f32(((const uint16_t *)v)[j * d + t0 + e])               \
                                           : ((const float *)v)[j * d + t0 + e];                              \
                VF b = VSET(x);                                                                               \
                _Pragma("GCC unroll 4") for (int k = 0; k < NV; k++) acc[e][k] = VFMA(b, pv[k], acc[e][k]);  \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++)                                                   \
            _Pragma("GCC unroll 4") for (int k = 0; k < NV; k++) VSTORE(outt + e * rp + k * LANES, acc[e][k]);\
    }
QA_TILE(1)
QA_TILE(2)
#define QA_BLOCK 64
#if RECALL_NV == 4
QA_TILE(3)
QA_TILE(4)
#endif

/* A scored chunk's attention (attention.question_attention): per kv head, the group's query rows q [heads,
 * rows = groups x t, d] (scaled) against keys / values [s, d] (float32 or bf16, the chunk's t entries the last;
 * + lc), causal over the chunk, one softmax per row; out [heads x groups, t, d] = probs . values and mass [heads, s]
 * = the probs of each group's last `last` queries summed. The logits as dsv41_recall_mass computes them; the
 * product with the values sums over the entries in order. Returns 0, -1 where it does not apply, -2 out of memory. */
int dsv41_question_attention(int64_t heads, int64_t groups, int64_t t, int64_t d, const float *q, int64_t s,
                             const void *keys, const void *values, int kv_type, int64_t kv_stride,
                             const float *lc, int64_t lc_stride, int64_t last, const float *hot_logits,
                             int64_t hot_s, const int32_t *hot_pos, const int32_t *pos, int64_t pos_stride,
                             float *out, float *mass, int threads) {
    const int64_t rows = groups * t;
    if (d > RECALL_DMAX || d % 4 || d % LANES || t < 1 || t > s || kv_type > 1 || (hot_logits && lc)) return -1;
    const int nt = threads > 0 ? threads : 1;
    const int64_t rp = (rows + LANES - 1) / LANES * LANES, blocks = (s + 3) / 4;
    const int64_t w = last < t ? last : t;
    float *qt = malloc((size_t)(d * rp) * sizeof(float));
    float *pt = malloc((size_t)(s * rp) * sizeof(float));
    float *part = malloc((size_t)(2 * nt * rp) * sizeof(float));
    float *top = malloc((size_t)(3 * rp) * sizeof(float)), *inv = top + rp, *sel = top + 2 * rp;
    float *outt = malloc((size_t)(d * rp) * sizeof(float));
    /* with hot_logits: each entry's row there (-1: one the recall brought, computed here), those entries */
    int64_t *src = malloc((size_t)(s + 4) * sizeof(int64_t)), *todo = malloc((size_t)(s + 4) * sizeof(int64_t));
    float *scratch = malloc((size_t)(nt * 4 * rp) * sizeof(float));  /* per thread: 4 entries' rows */
    if (!qt || !pt || !part || !top || !outt || !src || !todo || !scratch) {
        free(qt); free(pt); free(part); free(top); free(outt); free(src); free(todo); free(scratch);
        return -2;
    }
    for (int64_t r = 0; r < rp; r++) sel[r] = r < rows && r % t >= t - w ? 1.f : 0.f;
    const int64_t row_blocks = (rp / LANES + RECALL_NV - 1) / RECALL_NV, tiles = (d / 4) * row_blocks;
    for (int64_t h = 0; h < heads; h++) {
        queries_t(q + h * rows * d, rows, d, rp, qt);
        const size_t el = kv_type == 1 ? 2 : 4;
        const void *hk = (const char *)keys + (size_t)(h * kv_stride) * el;
        const void *hv = (const char *)values + (size_t)(h * kv_stride) * el;
        const float *hl = lc ? lc + h * lc_stride : NULL;
        int64_t computed = 0;
        if (hot_logits) {
            /* both in position order (the recall's insert merges by position): one walk pairs them */
            const int32_t *was = hot_pos + h * hot_s, *now = pos + h * pos_stride;
            int64_t i = 0;
            for (int64_t m = 0; m < s; m++) {
                if (i < hot_s && now[m] == was[i]) src[m] = i++;
                else src[m] = -1, todo[computed++] = m;
            }
            if (i != hot_s) {  /* not the layout the recall left: compute every logit instead */
                for (int64_t m = 0; m < s; m++) src[m] = -1, todo[m] = m;
                computed = s;
            }
        }
        partials_reset(part, nt, rp);
#pragma omp parallel num_threads(nt)
        {
            const int me = omp_get_thread_num();
            float *mx = part + (int64_t)me * 2 * rp, *sm = mx + rp;
            if (hot_logits) {
                /* the rows dsv41_recall_mass computed (the same products of the same rows, masked the same), and
                 * the logits of the entries it recalled (older than the question) from their hot keys */
#pragma omp for schedule(static) nowait
                for (int64_t m = 0; m < s; m++) {
                    const int64_t from = src[m];
                    if (from < 0) continue;
                    float *row = pt + m * rp;
                    memcpy(row, hot_logits + (h * hot_s + from) * rp, (size_t)rp * sizeof(float));
                    for (int64_t v = 0; v < rp; v += LANES) VSTORE(mx + v, VMAX(VLOAD(mx + v), VLOAD(row + v)));
                }
#pragma omp for schedule(static)
                for (int64_t b = 0; b < (computed + 3) / 4; b++)
                    logit_rows(qt, rp, d, kv_type, hk, NULL, 0, todo + b * 4,
                               computed - b * 4 < 4 ? (int)(computed - b * 4) : 4, NULL, s, t, rows, pt,
                               scratch + (int64_t)me * 4 * rp, mx);
            } else {
#pragma omp for schedule(static)
                for (int64_t b = 0; b < blocks; b++)
                    logit_rows(qt, rp, d, kv_type, hk, NULL, b * 4, NULL, s - b * 4 < 4 ? (int)(s - b * 4) : 4, hl,
                               s, t, rows, pt, NULL, mx);
            }
#pragma omp single
            partials_top(part, nt, rp, top);
#pragma omp for schedule(static)
            for (int64_t j = 0; j < s; j++) {
                float *row = pt + j * rp;
                for (int64_t v = 0; v < rp; v += LANES) {
                    /* a masked logit (-inf) gives exactly 0, as torch's softmax does (exp16 alone would clamp) */
                    VF x = VLOAD(row + v), e = VEXP(VSUB(x, VLOAD(top + v)));
#if LANES == 16
                    e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, VSET(-INFINITY), _CMP_NEQ_OQ), e);
#else
                    e = _mm256_and_ps(e, _mm256_cmp_ps(x, VSET(-INFINITY), _CMP_NEQ_OQ));
#endif
                    VSTORE(row + v, e);
                    VSTORE(sm + v, VADD(VLOAD(sm + v), e));
                }
            }
#pragma omp single
            partials_inv(part, nt, rp, rows, inv);
#pragma omp for schedule(static)
            for (int64_t j = 0; j < s; j++) {
                float *row = pt + j * rp;
                VF acc = VSET(0.f);
                for (int64_t v = 0; v < rp; v += LANES) {
                    VF p = VMUL(VLOAD(row + v), VLOAD(inv + v));
                    VSTORE(row + v, p);
                    acc = VADD(acc, VMUL(p, VLOAD(sel + v)));
                }
                mass[h * s + j] = VHSUM(acc);
            }
            /* the products with the values: each thread a share of the (value columns, row block) tiles, the
             * entries in blocks of QA_BLOCK so a block's probabilities and values stay in L1 across its tiles (all
             * entries per tile read the probabilities from L2 / L3 once per tile: most of the call's time) */
            const int64_t team = omp_get_num_threads(), per = (tiles + team - 1) / team, first_tile = me * per;
            const int64_t last_tile = first_tile + per < tiles ? first_tile + per : tiles;
            for (int64_t j0 = 0; j0 < s; j0 += QA_BLOCK) {
                const int64_t j1 = j0 + QA_BLOCK < s ? j0 + QA_BLOCK : s;
                for (int64_t tile = first_tile; tile < last_tile; tile++) {
                    const int64_t t0 = (tile / row_blocks) * 4, rb = (tile % row_blocks) * RECALL_NV * LANES;
                    const int64_t nv = (rp - rb) / LANES < RECALL_NV ? (rp - rb) / LANES : RECALL_NV;
                    float *o = outt + t0 * rp + rb;
                    const int f = j0 == 0;
                    switch (nv) {
                    case 1: qa_tile1(pt + rb, rp, j0, j1, hv, kv_type, d, t0, o, f); break;
                    case 2: qa_tile2(pt + rb, rp, j0, j1, hv, kv_type, d, t0, o, f); break;
#if RECALL_NV == 4
                    case 3: qa_tile3(pt + rb, rp, j0, j1, hv, kv_type, d, t0, o, f); break;
                    case 4: qa_tile4(pt + rb, rp, j0, j1, hv, kv_type, d, t0, o, f); break;
#endif
                    default: break;
                    }
                }
            }
        }
        for (int64_t r = 0; r < rows; r++)  /* row r = g * t + i: head h * groups + g, query i */
            for (int64_t k = 0; k < d; k++) out[(h * rows + r) * d + k] = outt[k * rp + r];
    }
    free(qt); free(pt); free(part); free(top); free(outt); free(src); free(todo); free(scratch);
    return 0;
}
#else
int dsv41_recall_mass(int64_t heads, int64_t rows, int64_t tq, int64_t d, const float *q,
                      const int16_t *q16, const float *q16_scales,
                      int64_t s, const void *hot, int hot_type, int64_t hot_stride, const float *hot_lc,
                      int64_t lc_stride, int64_t c, const void *cold, int cold_type, int64_t cold_stride,
                      const float *cold_scales, int64_t scale_stride, float *mass, float *hot_out, int threads) {
    return -1;
}
int dsv41_question_attention(int64_t heads, int64_t groups, int64_t t, int64_t d, const float *q, int64_t s,
                             const void *keys, const void *values, int kv_type, int64_t kv_stride,
                             const float *lc, int64_t lc_stride, int64_t last, const float *hot_logits,
                             int64_t hot_s, const int32_t *hot_pos, const int32_t *pos, int64_t pos_stride,
                             float *out, float *mass, int threads) {
    return -1;
}
#endif

/* A recall's choice (cold.recall_layer after its scoring): per head, rank the c cold entries by mass [heads, c]
 * (span > 1: by their span's total mass over span + 1e-3 x their own, cold.span_ranking's float32 operations in
 * its order), keep the `take` best (ties to the lower index) and write their indices in position order to
 * out [heads, take]. positions: int32 rows of pos_stride, >= 0. Keys (rank, index) and (position, index) are
 * packed into 64-bit integers: a selection and a sort without comparator calls. Returns 0, -1 where it does not
 * apply, -2 out of memory. */
static inline void u64_swap(uint64_t *a, uint64_t *b) { uint64_t t = *a; *a = *b; *b = t; }

/* the k smallest of v [n] to its front (unordered) */
static void u64_select(uint64_t *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (hi > lo) {
        const int64_t mid = lo + (hi - lo) / 2;  /* median of three as the pivot */
        if (v[mid] < v[lo]) u64_swap(v + mid, v + lo);
        if (v[hi] < v[lo]) u64_swap(v + hi, v + lo);
        if (v[hi] < v[mid]) u64_swap(v + hi, v + mid);
        const uint64_t pivot = v[mid];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] < pivot) i++;
            while (v[j] > pivot) j--;
            if (i <= j) u64_swap(v + i++, v + j--);
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

static void u64_sort(uint64_t *v, int64_t n) {
    while (n > 16) {
        const int64_t mid = n / 2;
        if (v[mid] < v[0]) u64_swap(v + mid, v);
        if (v[n - 1] < v[0]) u64_swap(v + n - 1, v);
        if (v[n - 1] < v[mid]) u64_swap(v + n - 1, v + mid);
        const uint64_t pivot = v[mid];
        int64_t i = 0, j = n - 1;
        while (i <= j) {
            while (v[i] < pivot) i++;
            while (v[j] > pivot) j--;
            if (i <= j) u64_swap(v + i++, v + j--);
        }
        if (j + 1 < n - i) {  /* the smaller side by recursion, the larger by the loop */
            u64_sort(v, j + 1);
            v += i;
            n -= i;
        } else {
            u64_sort(v + i, n - i);
            n = j + 1;
        }
    }
    for (int64_t a = 1; a < n; a++)
        for (int64_t b = a; b > 0 && v[b] < v[b - 1]; b--) u64_swap(v + b, v + b - 1);
}

int dsv41_recall_select(int64_t heads, int64_t c, const int32_t *positions, int64_t pos_stride, const float *mass,
                        int64_t span, int64_t take, int64_t *out) {
    if (take > c || take < 0 || c >= ((int64_t)1 << 32)) return -1;
    float *total = NULL;
    uint64_t *keys = malloc((size_t)(c > 0 ? c : 1) * sizeof(uint64_t));
    uint32_t *ids = malloc((size_t)(c > 0 ? c : 1) * sizeof(uint32_t));
    if (!keys || !ids) {
        free(keys); free(ids);
        return -2;
    }
    const int shift = span > 1 && (span & (span - 1)) == 0 ? __builtin_ctzll((unsigned long long)span) : -1;
    for (int64_t h = 0; h < heads; h++) {
        const int32_t *pos = positions + h * pos_stride;
        const float *m = mass + h * c;
        if (span > 1 && c > 0) {
            uint32_t lo = UINT32_MAX, hi = 0;
            for (int64_t j = 0; j < c; j++) {  /* the span of each entry (positions >= 0), its lowest and highest */
                const uint32_t id = shift >= 0 ? (uint32_t)pos[j] >> shift : (uint32_t)pos[j] / (uint32_t)span;
                ids[j] = id;
                lo = id < lo ? id : lo;
                hi = id > hi ? id : hi;
            }
            free(total);
            total = calloc((size_t)(hi - lo + 1), sizeof(float));
            if (!total) {
                free(keys); free(ids);
                return -2;
            }
            for (int64_t j = 0; j < c; j++) ids[j] -= lo;
            for (int64_t j = 0; j < c; j++) total[ids[j]] += m[j];
        }
        const float fspan = (float)span;
        for (int64_t j = 0; j < c; j++) {
            float r = m[j];
            if (total) {
                /* rounded as torch rounds them: the share, then the own term, then the sum (no fused multiply-add) */
                volatile float share = total[ids[j]] / fspan, own = 1e-3f * m[j];
                r = share + own;
            }
            uint32_t bits;
            memcpy(&bits, &r, 4);
            bits = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;  /* ascending as the floats */
            keys[j] = ((uint64_t)(~bits) << 32) | (uint64_t)j;  /* the largest rank first, then the lower index */
        }
        u64_select(keys, c, take);
        for (int64_t k = 0; k < take; k++) {
            const uint64_t j = keys[k] & 0xFFFFFFFFu;
            keys[k] = ((uint64_t)(uint32_t)pos[j] << 32) | j;
        }
        u64_sort(keys, take);
        for (int64_t k = 0; k < take; k++) out[h * take + k] = (int64_t)(keys[k] & 0xFFFFFFFFu);
    }
    free(total);
    free(keys);
    free(ids);
    return 0;
}

/* The reply's counts of the cold tier (counts.cold_counts): locality-sensitive hashing by random hyperplanes. Each
 * key [d] (key type 0 float32, 1 bf16, both rounded to int8 first exactly as quantize_int8 and dsv41_cold_add round
 * them; 2 int8, as the cold tier stores it) is multiplied by the int8 hyperplanes planes [tables * bits, d] in
 * integers (exact: no float order can flip a sign), and table t's bucket is t << bits | sum over b < bits of
 * (product with plane t * bits + b > 0) << b. With AVX-512 VNNI the products are vpdpbusd (the key's bytes offset by
 * 128 to be unsigned, the offset's share, 128 * sum(plane), taken off after), 16 planes a vector: a key is d / 4
 * broadcasts times tables * bits / 16 products, a quarter of the float multiply-adds' instructions and none of
 * their rounding. */
#define LSH_MAX_PLANES 512
#define LSH_CHUNK 5  /* groups of 16 planes summed at once: independent chains for the 4-byte steps */
#define LSH_TABLE_GROUP 4  /* tables counted by one task of the counts */

typedef struct {
    const int8_t *planes;
    int64_t d, p, groups, tables, bits;
    int8_t *packed;  /* VNNI: the planes as [group][d / 4][16 planes][4 bytes], zero planes past p; NULL: scalar */
    int32_t offset[LSH_MAX_PLANES + 16];
} LshPlanes;

/* 0, -1 (sizes out of range) or -2 (no memory); lsh_free after */
static int lsh_prepare(LshPlanes *lp, const int8_t *planes, int64_t d, int64_t tables, int64_t bits) {
    lp->planes = planes, lp->d = d, lp->tables = tables, lp->bits = bits, lp->p = tables * bits;
    lp->groups = (lp->p + 15) / 16, lp->packed = NULL;
    if (d <= 0 || d > MAX_HEAD_DIM || lp->p <= 0 || lp->p > LSH_MAX_PLANES || bits <= 0 || bits > 16) return -1;
    memset(lp->offset, 0, sizeof(lp->offset));
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (d % 4 == 0) {
        lp->packed = calloc((size_t)(lp->groups * 16 * d), 1);
        if (!lp->packed) return -2;
        for (int64_t k = 0; k < lp->p; k++) {
            int32_t sum = 0;
            for (int64_t j = 0; j < d; j++) {
                lp->packed[((k / 16) * (d / 4) + j / 4) * 64 + (k % 16) * 4 + j % 4] = planes[k * d + j];
                sum += planes[k * d + j];
            }
            lp->offset[k] = 128 * sum;
        }
    }
#endif
    return 0;
}

static void lsh_free(LshPlanes *lp) { free(lp->packed); }

/* The buckets of the key at keys + at (elements of key_type) into codes[tables] */
static void lsh_codes(const LshPlanes *lp, const void *keys, int key_type, int64_t at, int32_t *codes) {
    const int64_t d = lp->d;
    int8_t q[MAX_HEAD_DIM];
    if (key_type == 2)
        memcpy(q, (const int8_t *)keys + at, (size_t)d);
    else
        row_to_int8((const char *)keys + at * (key_type == 1 ? 2 : 4), key_type == 1, d, q);
    uint64_t word[LSH_MAX_PLANES / 64 + 1] = {0};  /* the signs as one bit string, plane k at bit k */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (lp->packed) {
        uint8_t u[MAX_HEAD_DIM];
        int64_t i = 0;
        for (; i + 16 <= d; i += 16)  /* q + 128, in the 16-byte pieces row_to_int8 stored */
            _mm_storeu_si128((__m128i *)(u + i),
                             _mm_xor_si128(_mm_loadu_si128((const __m128i *)(q + i)), _mm_set1_epi8((char)0x80)));
        for (; i < d; i++) u[i] = (uint8_t)(q[i] ^ 0x80);
        for (int64_t g0 = 0; g0 < lp->groups; g0 += LSH_CHUNK) {
            __m512i acc[LSH_CHUNK];
            for (int c = 0; c < LSH_CHUNK; c++) acc[c] = _mm512_setzero_si512();
            const int64_t m = lp->groups - g0 < LSH_CHUNK ? lp->groups - g0 : LSH_CHUNK;
            for (int64_t j = 0; j < d / 4; j++) {
                int32_t four;
                memcpy(&four, u + 4 * j, 4);
                const __m512i b = _mm512_set1_epi32(four);
                const int8_t *w = lp->packed + (g0 * (d / 4) + j) * 64;
                for (int c = 0; c < LSH_CHUNK; c++)
                    if (c < m) acc[c] = _mm512_dpbusd_epi32(acc[c], b, _mm512_loadu_si512(w + c * (d / 4) * 64));
            }
            for (int64_t c = 0; c < m; c++) {
                const int64_t g = g0 + c;
                const __m512i sum = _mm512_sub_epi32(acc[c], _mm512_loadu_si512(lp->offset + g * 16));
                const uint64_t mask = _mm512_cmpgt_epi32_mask(sum, _mm512_setzero_si512());
                word[g / 4] |= mask << (16 * (g % 4));
            }
        }
    } else
#endif
    {
        for (int64_t k = 0; k < lp->p; k++) {
            int32_t sum = 0;
            for (int64_t j = 0; j < d; j++) sum += (int32_t)q[j] * lp->planes[k * d + j];
            if (sum > 0) word[k / 64] |= (uint64_t)1 << (k % 64);
        }
    }
    for (int64_t t = 0; t < lp->tables; t++) {
        const int64_t o = t * lp->bits, lo = o % 64;
        uint64_t code = word[o / 64] >> lo;
        if (lo && lo + lp->bits > 64) code |= word[o / 64 + 1] << (64 - lo);
        codes[t] = (int32_t)((t << lp->bits) | (int64_t)(code & ((1u << lp->bits) - 1)));
    }
}

/* counts.cold_counts in one call: out [heads, s] float32, log(1 + c) for each of the s hot keys, c the mean over the
 * tables of its bucket's cold keys over its bucket's hot keys (every bucket of a head counted over that head's keys).
 * hot / cold keys: heads of s / c rows of d, `hot_stride` / `cold_stride` elements apart, of key type 0
 * float32, 1 bf16, 2 int8. cold_given [heads, tables << bits]: the cold keys' bucket sizes as dsv41_lsh_tally keeps
 * them (then the cold keys are not read, c and cold may be 0 / NULL); NULL: hashed here. Returns 0, -1
 * (sizes out of range), -2 (no memory). */
int dsv41_cold_counts(int64_t heads, int64_t d, int64_t s, const void *hot, int hot_type, int64_t hot_stride,
                      int64_t c, const void *cold, int cold_type, int64_t cold_stride, const uint16_t *cold_given,
                      const int8_t *planes, int64_t tables, int64_t bits, float *out, int threads) {
    LshPlanes lp;
    int status = lsh_prepare(&lp, planes, d, tables, bits);
    if (status == 0 && (hot_type < 0 || hot_type > 2 || cold_type < 0 || cold_type > 2 || s < 0 || c < 0))
        status = -1;
    if (cold_given) c = 0;
    const int64_t slots = tables << bits, total = heads * (s + c);
    int32_t *codes = status ? NULL : malloc((size_t)(total * tables + 1) * sizeof(int32_t));
    int32_t *sizes = status ? NULL : malloc((size_t)(2 * heads * slots + 1) * sizeof(int32_t));  /* [hot, cold][h][slot] */
    float *shares = status ? NULL : malloc((size_t)(heads * slots + 1) * sizeof(float));  /* [h][slot], where hot > 0 */
    if (status == 0 && (!codes || !sizes || !shares)) status = -2;
    if (status != 0) {
        free(codes), free(sizes), free(shares), lsh_free(&lp);
        return status;
    }
    const int nt = threads > 0 ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t e = 0; e < total; e++) {  /* keys e < heads * s hot, the rest cold */
            const int is_cold = e >= heads * s;
            const int64_t r = is_cold ? e - heads * s : e, n = is_cold ? c : s;
            lsh_codes(&lp, is_cold ? cold : hot, is_cold ? cold_type : hot_type,
                      (r / n) * (is_cold ? cold_stride : hot_stride) + (r % n) * d, codes + e * tables);
        }
        /* each (head, group of LSH_TABLE_GROUP tables) its own slice of the bucket sizes: no two threads write
         * one; a key's codes are one row, so a group reads each row once for all its tables */
        const int64_t groups = (tables + LSH_TABLE_GROUP - 1) / LSH_TABLE_GROUP, width = (int64_t)1 << bits;
#pragma omp for schedule(static)
        for (int64_t hg = 0; hg < heads * groups; hg++) {
            const int64_t h = hg / groups, t0 = (hg % groups) * LSH_TABLE_GROUP;
            const int64_t t1 = t0 + LSH_TABLE_GROUP < tables ? t0 + LSH_TABLE_GROUP : tables;
            int32_t *hot_sizes = sizes + h * slots, *cold_sizes = sizes + (heads + h) * slots;
            float *share = shares + h * slots;
            memset(hot_sizes + t0 * width, 0, (size_t)((t1 - t0) * width) * sizeof(int32_t));
            if (cold_given)
                for (int64_t k = t0 * width; k < t1 * width; k++) cold_sizes[k] = cold_given[h * slots + k];
            else
                memset(cold_sizes + t0 * width, 0, (size_t)((t1 - t0) * width) * sizeof(int32_t));
            for (int64_t i = h * s; i < (h + 1) * s; i++)
                for (int64_t t = t0; t < t1; t++) hot_sizes[codes[i * tables + t]]++;
            const int32_t *held = codes + heads * s * tables;
            for (int64_t i = h * c; i < (h + 1) * c; i++)
                for (int64_t t = t0; t < t1; t++) cold_sizes[held[i * tables + t]]++;
            /* a bucket's share, once: the division each of its hot keys made */
            for (int64_t k = t0 * width; k < t1 * width; k++)
                if (hot_sizes[k]) share[k] = (float)cold_sizes[k] / (float)hot_sizes[k];
        }
#pragma omp for schedule(static)
        for (int64_t e0 = 0; e0 < heads * s; e0 += 16) {
            const int64_t m = heads * s - e0 < 16 ? heads * s - e0 : 16;
            float sums[16];
#if defined(__AVX512F__)
            if (m == 16) { /* 16 keys' sums side by side: one gather a table, the same additions in table order */
                int32_t base[16];
                for (int k = 0; k < 16; k++) base[k] = (int32_t)(((e0 + k) / s) * slots);
                const __m512i at = _mm512_loadu_si512(base);
                const __m512i row = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                       _mm512_set1_epi32((int)tables));
                __m512 sum = _mm512_setzero_ps();
                for (int64_t t = 0; t < tables; t++) {
                    const __m512i code = _mm512_i32gather_epi32(_mm512_add_epi32(row, _mm512_set1_epi32((int)t)),
                                                                codes + e0 * tables, 4);
                    sum = _mm512_add_ps(sum, _mm512_i32gather_ps(_mm512_add_epi32(code, at), shares, 4));
                }
                _mm512_storeu_ps(sums, sum);
            } else
#endif
                for (int64_t k = 0; k < m; k++) {
                    const int32_t *b = codes + (e0 + k) * tables;
                    const float *share = shares + ((e0 + k) / s) * slots;
                    float sum = 0.f;
                    for (int64_t t = 0; t < tables; t++) sum += share[b[t]];  /* in table order, as before */
                    sums[k] = sum;
                }
            for (int64_t k = 0; k < m; k++) out[e0 + k] = log1pf(sums[k] / (float)tables);
        }
    }
    free(codes), free(sizes), free(shares), lsh_free(&lp);
    return 0;
}

/* Keep a cold layer's bucket sizes as its entries come and go (cold.ColdLayer.bucket_sizes): hash the m keys at
 * rows index[h * m + j] (each < n) of each head h (keys [heads, rows of d], `stride` elements a head, key type as
 * above) and add `sign` (+1 or -1) to sizes [heads, tables << bits] (uint16, as dsv41_cold_counts takes them).
 * Returns 0, -1 (sizes out of range), -2 (no memory), -3 (a size would leave 0..65535: nothing changed). */
int dsv41_lsh_tally(int64_t heads, int64_t d, int64_t n, int64_t m, const int64_t *index, const void *keys, int key_type,
                    int64_t stride, const int8_t *planes, int64_t tables, int64_t bits, int sign, uint16_t *sizes,
                    int threads) {
    LshPlanes lp;
    int status = lsh_prepare(&lp, planes, d, tables, bits);
    if (status == 0 && (key_type < 0 || key_type > 2 || m < 0 || (sign != 1 && sign != -1))) status = -1;
    for (int64_t i = 0; status == 0 && i < heads * m; i++)
        if (index[i] < 0 || index[i] >= n) status = -1;
    const int64_t slots = tables << bits, total = heads * m;
    int32_t *codes = status ? NULL : malloc((size_t)(total * tables + 1) * sizeof(int32_t));
    if (status == 0 && !codes) status = -2;
    if (status != 0) {
        free(codes), lsh_free(&lp);
        return status;
    }
    const int nt = threads > 0 ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t e = 0; e < total; e++)
        lsh_codes(&lp, keys, key_type, (e / m) * stride + index[e] * d, codes + e * tables);
    /* all or nothing: the (key, table) pairs in order; if one would leave 0..65535, the ones before are undone */
    int64_t applied = 0;
    for (int64_t e = 0; e < total && status == 0; e++) {
        uint16_t *head = sizes + (e / m) * slots;
        for (int64_t t = 0; t < tables; t++, applied++) {
            const int32_t next = (int32_t)head[codes[e * tables + t]] + sign;
            if (next < 0 || next > 65535) { status = -3; break; }
            head[codes[e * tables + t]] = (uint16_t)next;
        }
    }
    for (int64_t i = 0; status == -3 && i < applied; i++)
        sizes[(i / tables / m) * slots + codes[i]] -= (uint16_t)sign;  /* undone (rare: the sizes are dropped after) */
    free(codes), lsh_free(&lp);
    return status;
}

/* ---------------------------------------------------------------------------------------------------------
 * Top-k / top-p sampling of one logits vector on the CPU (engine/sampling.py's head_probs and a draw), in one call:
 * through torch it was ~12 ops a token (the repetition penalty's gather / scatter, topk, softmax, cumsum, masks,
 * multinomial), 0.55 ms a token more than greedy on the default model in a decode loop, where each op finds its
 * data evicted by the weights the step has just streamed.
 *
 * The repetition penalty (value / penalty where positive, value * penalty otherwise, once per distinct seen id)
 * only lowers values, so the top k after it are among the top K = k + s before it (s = distinct seen ids): at least
 * k of those are not seen and keep their values, which no value outside reaches. One pass finds the top K: the
 * first K values, then every value above the K-th best so far (compared 8 or 16 at a time) appended to a buffer of
 * 2K, which is cut back to its K best (a quickselect) when full, the threshold raised to the K-th; the order is
 * descending value, then ascending id (of equal values the earlier stays). Then the seen ones are penalised (a hash
 * set of the seen ids), the k best taken in descending order, and softmax(value / temperature) over them, the
 * smallest prefix whose mass reaches top_p kept (as head_probs: a token stays while the mass before it is at most
 * top_p), renormalised, and the token drawn at u in [0, 1) of the kept mass. A min-heap of the top K took 100 us a
 * call on the default model's 49,152 logits on an AVX2 CPU (a scalar scan) and 240 us with the app's penalty window
 * (K ~ 300: ~1,500 insertions of ~8 levels each). Returns the token id; -1 for arguments out of range, -2 for a NaN
 * or +inf logit (the caller's torch path decides those), -3 for no memory. */
typedef struct {
    float v;
    int64_t id;
} Candidate;

static inline int better(Candidate a, Candidate b) { /* a before b: descending by value, then ascending by id */
    return a.v > b.v || (a.v == b.v && a.id < b.id);
}

/* c[0 .. n) rearranged so that its `want` best (better()) come first, in no order (quickselect; want <= n) */
static void best_first(Candidate *c, int64_t n, int64_t want) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi && want > lo && want <= hi) {
        const Candidate pivot = c[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (better(c[i], pivot)) i++;
            while (better(pivot, c[j])) j--;
            if (i <= j) {
                const Candidate t = c[i];
                c[i++] = c[j], c[j--] = t;
            }
        }
        /* [lo, j] before the pivot or equal to it, [i, hi] after it or equal, (j, i) equal to it */
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return;
    }
}

/* c[0 .. n) sorted by better() (insertion sort: n is the few dozen of top k) */
static void sort_best(Candidate *c, int64_t n) {
    for (int64_t i = 1; i < n; i++) {
        const Candidate x = c[i];
        int64_t j = i;
        for (; j > 0 && better(x, c[j - 1]); j--) c[j] = c[j - 1];
        c[j] = x;
    }
}

/* The value of the K-th best of c once best_first(c, n, K) has run: the least of the first K */
static float kth_value(const Candidate *c, int64_t K) {
    float w = c[0].v;
    for (int64_t i = 1; i < K; i++) w = c[i].v < w ? c[i].v : w;
    return w;
}

/* slot of `id` in the seen ids' open-addressing set (id + 1 in a slot, 0 empty; `slots` a power of two) */
static inline int64_t seen_slot(int64_t id, int64_t slots) {
    return (int64_t)(((uint64_t)id * 0x9E3779B97F4A7C15ull) >> 40) & (slots - 1);
}

int64_t dsv41_sample_head(const float *logits, int64_t n, const int64_t *seen, int64_t n_seen, float penalty,
                          int64_t k, float temperature, float top_p, double u) {
    if (n < 1 || k < 1 || k > n || n_seen < 0 || !(penalty >= 1.f) || !(top_p > 0.f) || !(u >= 0.0 && u < 1.0))
        return -1;
    for (int64_t i = 0; i < n_seen; i++)
        if (seen[i] < 0 || seen[i] >= n) return -1;
    if (penalty == 1.f) n_seen = 0;
    int64_t slots = 1, s = 0;
    while (slots < 2 * n_seen) slots *= 2;
    int64_t *set = n_seen ? calloc((size_t)slots, sizeof(int64_t)) : NULL;
    if (n_seen && !set) return -3;
    for (int64_t i = 0; i < n_seen; i++)
        for (int64_t h = seen_slot(seen[i], slots);; h = (h + 1) & (slots - 1)) {
            if (set[h] == seen[i] + 1) break;
            if (!set[h]) { set[h] = seen[i] + 1, s++; break; }
        }
    const int64_t K = k + s < n ? k + s : n;
    Candidate *c = malloc((size_t)(2 * K) * sizeof(Candidate));
    if (!c) { free(set); return -3; }
    int bad = 0;
    for (int64_t i = 0; i < K; i++) {
        c[i].v = logits[i], c[i].id = i;
        bad |= !(logits[i] < INFINITY) && !(logits[i] == -INFINITY);
    }
    int64_t m = K;
    float t = kth_value(c, K); /* a value above t enters (of equal values the earlier stays) */
#define SAMPLE_TAKE(at)                                        \
    do {                                                       \
        const int64_t at_ = (at);                              \
        if (logits[at_] > t) {                                 \
            c[m].v = logits[at_], c[m].id = at_, m++;          \
            if (m == 2 * K) {                                  \
                best_first(c, m, K);                           \
                m = K;                                         \
                t = kth_value(c, K);                           \
            }                                                  \
        }                                                      \
    } while (0)
    int64_t j = K;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) {
        const __m512 x = _mm512_loadu_ps(logits + j);
        /* NaN or +inf: not ordered below +inf */
        bad |= _mm512_cmp_ps_mask(x, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ) != 0;
        for (unsigned over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_GT_OQ); over; over &= over - 1)
            SAMPLE_TAKE(j + __builtin_ctz(over));
    }
#elif defined(__AVX2__)
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(logits + j);
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ)) != 0;
        for (unsigned over = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(t), _CMP_GT_OQ)); over;
             over &= over - 1)
            SAMPLE_TAKE(j + __builtin_ctz(over));
    }
#endif
    for (; j < n; j++) {
        bad |= !(logits[j] < INFINITY) && !(logits[j] == -INFINITY);
        SAMPLE_TAKE(j);
    }
#undef SAMPLE_TAKE
    if (bad) { free(set), free(c); return -2; }
    best_first(c, m, K); /* the top K first */
    for (int64_t i = 0; i < K && s; i++) /* the seen ones penalised */
        for (int64_t h = seen_slot(c[i].id, slots); set[h]; h = (h + 1) & (slots - 1))
            if (set[h] == c[i].id + 1) {
                c[i].v = c[i].v > 0.f ? c[i].v / penalty : c[i].v * penalty;
                break;
            }
    free(set);
    best_first(c, K, k); /* the k best, descending (ties by the lower id) */
    sort_best(c, k);
    if (c[0].v == -INFINITY) { free(c); return -2; } /* nothing has any probability */
    const float tt = temperature > 1e-5f ? temperature : 1e-5f, top = c[0].v / tt;
    double total = 0.0;
    float *v = malloc((size_t)k * sizeof(float));
    if (!v) { free(c); return -3; }
    for (int64_t a = 0; a < k; a++) {
        v[a] = expf(c[a].v / tt - top);
        total += v[a];
    }
    double mass = 0.0, kept = 0.0;
    int64_t keep = 0;
    for (; keep < k; keep++) { /* head_probs: removed where (cumulative - p) > top_p */
        const double p = v[keep] / total;
        if (top_p < 1.f && mass > top_p) break;
        mass += p;
        kept += v[keep];
    }
    double at = u * kept, run = 0.0;
    int64_t token = c[keep - 1].id;
    for (int64_t a = 0; a < keep; a++) {
        run += v[a];
        if (at < run) { token = c[a].id; break; }
    }
    free(v), free(c);
    return token;
}
