/* Small-batch float32 matrix products for the CPU: y = x @ W.T for one to a few dozen rows of x.
 *
 * Decoding multiplies one row (a token) or a token tree's few nodes (SpecInfer Section 4.2) by
 * every weight matrix, so a step's price is mostly the time to stream the weights from memory.
 * W (n, k) is laid out once, at load, in panels of 16 output features: panel p holds
 * W[16p : 16p + 16, j] for j = 0 .. k - 1, one 64-byte line per j. A pass streams each panel
 * once, broadcasting x's elements against it, with the sums of several panels and rows in
 * registers.
 *
 * A weight whose every element is exactly a bfloat16 (checkpoints stored in bfloat16) or a float16
 * value is kept in panels of that 16-bit type and widened to float32 in registers: the widening is
 * exact, so its products are bitwise those of its float32 panels, from half the bytes of memory.
 *
 * A weight dequantized from blocks of integer codes (a GGUF's Q4_0 ... Q8_0 and K-quants: every element
 * w[i][j] = fma(scale, code, offset) with one scale and offset per row and block of inputs) is
 * kept as those codes, one byte each (two to a byte where they span 16 values at most, as 4-bit
 * formats' do), and rebuilt in registers by that very fma: the same float32 elements, so the same products,
 * from a quarter (an eighth) of the bytes and a few more instructions.
 *
 * Every output element is one chain of fused multiply-adds over j = 0 .. k - 1 in order, whatever
 * the number of rows, the tile it falls in, the thread that computes it, or the instruction set
 * (the AVX2 path holds a panel in two halves): a row of a tree pass is bitwise the row a one-token
 * pass gives, and decoding with or without speculation multiplies exactly alike.
 *
 * Called through ctypes (`cpu_gemm.py`); threads come from OpenMP, the runtime torch loads.
 */

#include <stdint.h>
#include <string.h>

#define PANEL 16 /* output features a panel holds; cpu_gemm.pack lays W out as (ceil(n / 16), k, 16) */
/* How many of a panel's 64-byte lines ahead of the one multiplied a tile asks the memory for. With
 * a few rows the arithmetic per line is small and the hardware's own prefetching lets the cores
 * wait on memory: asked ahead, two to eight rows cost about what one does (one row streams the
 * weights at the memory's speed either way). A prefetch is a hint that never faults, so asking
 * past the last panel is harmless. */
#define AHEAD 32
/* Panel element formats: float32, and the 16-bit ones widened exactly to float32 in registers. */
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_F16 2
#define FMT_CODES 3 /* int8 codes with per-block scales and offsets (specinfer_gemm_codes) */
#define FMT_NIBBLES 4 /* 4-bit codes, eight to a 32-bit lane (specinfer_gemm_nibbles) */

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

/* ---- AVX-512: a panel is one register ---- */

/* A panel's line j of 16 weights as float32: loaded as they are, or widened exactly from 16 bits. */
#define LOAD512_F32(w, i) _mm512_loadu_ps((const float *)(w) + (i))
#define LOAD512_BF16(w, i) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)(w) + (i)))), 16))
#define LOAD512_F16(w, i) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)(w) + (i))))
/* Lines of 16 bits are half a cache line: ask twice as many of them ahead. */
#define AHEAD_F32 AHEAD
#define AHEAD_BF16 (2 * AHEAD)
#define AHEAD_F16 (2 * AHEAD)
#define ELEM_F32 float
#define ELEM_BF16 uint16_t
#define ELEM_F16 uint16_t

/* A 512-bit tile's R x P accumulators, zeroed; and stored to rows 0 .. R - 1 of y at panels p0 .. p0 + P - 1,
 * the last panel cut at n. */
#define ZERO512(R, P)            \
    __m512 acc[R][P];            \
    for (int r = 0; r < R; r++)  \
        for (int q = 0; q < P; q++) acc[r][q] = _mm512_setzero_ps()
#define STORE512(R, P)                                                                                      \
    for (int r = 0; r < R; r++)                                                                             \
        for (int q = 0; q < P; q++) {                                                                       \
            const int64_t out = (p0 + q) * PANEL;                                                           \
            if (out + PANEL <= n)                                                                           \
                _mm512_storeu_ps(y + r * n + out, acc[r][q]);                                               \
            else                                                                                            \
                _mm512_mask_storeu_ps(y + r * n + out, (__mmask16)((1u << (n - out)) - 1u), acc[r][q]);      \
        }
/* Block b's scales and offsets for a code tile's P panels (its first at index `so`). */
#define SCALES512(P)                                                   \
    __m512 sv[P], ov[P];                                               \
    for (int q = 0; q < P; q++) {                                      \
        sv[q] = load_so512(S, half, so + (q * nb + b) * PANEL);        \
        ov[q] = load_so512(O, half, so + (q * nb + b) * PANEL);        \
    }
/* An AVX2 tile of one panel: its R rows' two halves stored at panel p0, cut at n. */
#define STORE256_PANEL(R)                                                                                   \
    for (int r = 0; r < R; r++) {                                                                           \
        const int64_t out = p0 * PANEL;                                                                     \
        float buf[PANEL];                                                                                   \
        _mm256_storeu_ps(buf, acc[r][0]);                                                                   \
        _mm256_storeu_ps(buf + 8, acc[r][1]);                                                               \
        memcpy(y + r * n + out, buf, sizeof(float) * (size_t)(out + PANEL <= n ? PANEL : n - out));          \
    }

#define TILE512(R, P, F)                                                                                     \
    __attribute__((target("avx512f"))) static void tile512_##F##_##R##x##P(const void *Wv, const float *x,  \
                                                                         float *y, int64_t n, int64_t k,      \
                                                                         int64_t p0) {                        \
        ZERO512(R, P);                                                                                   \
        const ELEM_##F *w = (const ELEM_##F *)Wv + p0 * k * PANEL;                                           \
        for (int64_t j = 0; j < k; j++) {                                                                    \
            __m512 wv[P];                                                                                    \
            for (int q = 0; q < P; q++) wv[q] = LOAD512_##F(w, (q * k + j) * PANEL);                          \
            for (int q = 0; q < P; q++) _mm_prefetch((const char *)(w + (q * k + j + AHEAD_##F) * PANEL), _MM_HINT_T0); \
            for (int r = 0; r < R; r++) {                                                                    \
                const __m512 xv = _mm512_set1_ps(x[r * k + j]);                                              \
                for (int q = 0; q < P; q++) acc[r][q] = _mm512_fmadd_ps(wv[q], xv, acc[r][q]);               \
            }                                                                                                \
        }                                                                                                    \
        STORE512(R, P)                                                                                   \
    }

#define TILES512(F)                                                                                          \
    TILE512(1, 8, F) TILE512(1, 1, F) TILE512(2, 4, F) TILE512(2, 1, F) TILE512(3, 4, F) TILE512(3, 1, F)    \
    TILE512(4, 4, F) TILE512(4, 1, F) TILE512(5, 4, F) TILE512(5, 1, F) TILE512(6, 4, F) TILE512(6, 1, F)    \
    TILE512(7, 3, F) TILE512(7, 1, F) TILE512(8, 3, F) TILE512(8, 1, F)

TILES512(F32)
TILES512(BF16)
TILES512(F16)

/* ---- AVX2 + FMA: a panel is two registers ---- */

#define LOAD256_F32(w, i) _mm256_loadu_ps((const float *)(w) + (i))
#define LOAD256_BF16(w, i) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)(w) + (i)))), 16))
#define LOAD256_F16(w, i) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(w) + (i))))

#define TILE256(R, P, F)                                                                                     \
    __attribute__((target("avx2,fma,f16c"))) static void tile256_##F##_##R##x##P(                            \
        const void *Wv, const float *x, float *y, int64_t n, int64_t k, int64_t p0) {                        \
        __m256 acc[R][2 * P];                                                                                \
        for (int r = 0; r < R; r++)                                                                          \
            for (int q = 0; q < 2 * P; q++) acc[r][q] = _mm256_setzero_ps();                                 \
        const ELEM_##F *w = (const ELEM_##F *)Wv + p0 * k * PANEL;                                           \
        for (int64_t j = 0; j < k; j++) {                                                                    \
            __m256 wv[2 * P];                                                                                \
            for (int q = 0; q < P; q++) {                                                                    \
                wv[2 * q] = LOAD256_##F(w, (q * k + j) * PANEL);                                              \
                wv[2 * q + 1] = LOAD256_##F(w, (q * k + j) * PANEL + 8);                                      \
                _mm_prefetch((const char *)(w + (q * k + j + AHEAD_##F) * PANEL), _MM_HINT_T0);             \
            }                                                                                                \
            for (int r = 0; r < R; r++) {                                                                    \
                const __m256 xv = _mm256_set1_ps(x[r * k + j]);                                              \
                for (int q = 0; q < 2 * P; q++) acc[r][q] = _mm256_fmadd_ps(wv[q], xv, acc[r][q]);           \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++)                                                                          \
            for (int q = 0; q < P; q++) {                                                                    \
                const int64_t o = (p0 + q) * PANEL;                                                          \
                float buf[PANEL];                                                                            \
                _mm256_storeu_ps(buf, acc[r][2 * q]);                                                        \
                _mm256_storeu_ps(buf + 8, acc[r][2 * q + 1]);                                                \
                memcpy(y + r * n + o, buf, sizeof(float) * (size_t)(o + PANEL <= n ? PANEL : n - o));         \
            }                                                                                                \
    }

#define TILES256(F) \
    TILE256(1, 4, F) TILE256(1, 1, F) TILE256(2, 2, F) TILE256(2, 1, F) TILE256(3, 2, F) TILE256(3, 1, F)

TILES256(F32)
TILES256(BF16)
TILES256(F16)


/* ---- Block codes: panels of int8 codes (as the float32 panels, one byte an element), and per
 * panel and block of `block` inputs one line of 16 scales and one of 16 offsets ---- */

#define AHEAD_CODES (4 * AHEAD) /* lines of 16 bytes: a quarter of a cache line */

/* A line of 16 (8) scales or offsets from element i: float32, or (half) float16 widened exactly;
 * a weight without offsets (NULL) has zeros. */
__attribute__((target("avx512f"))) static inline __m512 load_so512(const void *p, int half, int64_t i) {
    if (!p) return _mm512_setzero_ps();
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load_so256(const void *p, int half, int64_t i) {
    if (!p) return _mm256_setzero_ps();
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

#define TILEQ512(R, P)                                                                                       \
    __attribute__((target("avx512f"))) static void tileq512_##R##x##P(                                      \
        const int8_t *C, const void *S, const void *O, int64_t block, int half, const float *x, float *y, int64_t n,  \
        int64_t k, int64_t p0) {                                                                             \
        const int64_t nb = k / block;                                                                        \
        ZERO512(R, P);                                                                                   \
        const int8_t *c = C + p0 * k * PANEL;                                                                \
        const int64_t so = p0 * nb * PANEL; /* this tile's first scale and offset */                     \
        for (int64_t b = 0; b < nb; b++) {                                                                   \
            SCALES512(P);                                                                                \
            for (int64_t j = b * block; j < (b + 1) * block; j++) {                                          \
                __m512 wv[P];                                                                                \
                for (int q = 0; q < P; q++) {                                                                \
                    const __m128i code = _mm_loadu_si128((const __m128i *)(c + (q * k + j) * PANEL));         \
                    wv[q] = _mm512_fmadd_ps(sv[q], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(code)), ov[q]);   \
                    _mm_prefetch((const char *)(c + (q * k + j + AHEAD_CODES) * PANEL), _MM_HINT_T0);       \
                }                                                                                            \
                for (int r = 0; r < R; r++) {                                                                \
                    const __m512 xv = _mm512_set1_ps(x[r * k + j]);                                          \
                    for (int q = 0; q < P; q++) acc[r][q] = _mm512_fmadd_ps(wv[q], xv, acc[r][q]);           \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        STORE512(R, P)                                                                                   \
    }

TILEQ512(1, 4) TILEQ512(1, 1) TILEQ512(2, 4) TILEQ512(2, 1) TILEQ512(3, 4) TILEQ512(3, 1) TILEQ512(4, 3)
TILEQ512(4, 1) TILEQ512(5, 3) TILEQ512(5, 1) TILEQ512(6, 3) TILEQ512(6, 1) TILEQ512(7, 2) TILEQ512(7, 1)
TILEQ512(8, 2) TILEQ512(8, 1)

/* ---- 4-bit codes: a weight whose codes all lie in [bias, bias + 15] is kept as code - bias, eight
 * inputs of an output feature in one 32-bit lane: a panel's line of 16 lanes holds inputs j .. j + 7
 * (j a multiple of 8), input j + t in bits 4t .. 4t + 3. The bias goes into the offsets
 * (pack_codes checks that scale * bias + offset is exact, so fma(scale, code - bias, offset')
 * rounds the very value fma(scale, code, offset) does): the same elements, so the same products,
 * from half the codes' bytes, unpacked by a shift and a mask in each lane ---- */

/* Lines of 64 bytes, 16 KB ahead: a line serves eight inputs, so its arithmetic takes long enough
 * that nearer requests (2 KB, as for the byte codes) left a core waiting on memory, 15-20% of a
 * one-row pass. */
#define AHEAD_NIBBLES (8 * AHEAD)

/* Input j0 + t's 16 weights from a line of lanes: its four bits, then the fma that defines them. */
#define NIBBLE512(v, t, sv, ov)                                                                                \
    _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4 * (t)), _mm512_set1_epi32(15))), ov)

#define TILEN512(R, P)                                                                                       \
    __attribute__((target("avx512f"))) static void tilen512_##R##x##P(                                      \
        const uint32_t *C, const void *S, const void *O, int64_t block, int half, const float *x, float *y, int64_t n, \
        int64_t k, int64_t p0) {                                                                             \
        const int64_t nb = k / block, eighth = k / 8;                                                        \
        ZERO512(R, P);                                                                                   \
        const uint32_t *c = C + p0 * eighth * PANEL;                                                         \
        const int64_t so = p0 * nb * PANEL; /* this tile's first scale and offset */                     \
        for (int64_t b = 0; b < nb; b++) {                                                                   \
            SCALES512(P);                                                                                \
            for (int64_t j = b * block; j < (b + 1) * block; j += 8) {                                       \
                __m512i v[P];                                                                                \
                for (int q = 0; q < P; q++) {                                                                \
                    const uint32_t *line = c + (q * eighth + j / 8) * PANEL;                                 \
                    v[q] = _mm512_loadu_si512((const void *)line);                                           \
                    _mm_prefetch((const char *)(line + AHEAD_NIBBLES * PANEL), _MM_HINT_T0);                 \
                }                                                                                            \
                for (int t = 0; t < 8; t++) {                                                                \
                    __m512 wv[P];                                                                            \
                    for (int q = 0; q < P; q++) wv[q] = NIBBLE512(v[q], t, sv[q], ov[q]);                    \
                    for (int r = 0; r < R; r++) {                                                            \
                        const __m512 xv = _mm512_set1_ps(x[r * k + j + t]);                                  \
                        for (int q = 0; q < P; q++) acc[r][q] = _mm512_fmadd_ps(wv[q], xv, acc[r][q]);       \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        STORE512(R, P)                                                                                   \
    }

TILEN512(1, 4) TILEN512(1, 1) TILEN512(2, 4) TILEN512(2, 1) TILEN512(3, 4) TILEN512(3, 1) TILEN512(4, 3)
TILEN512(4, 1) TILEN512(5, 3) TILEN512(5, 1) TILEN512(6, 3) TILEN512(6, 1) TILEN512(7, 2) TILEN512(7, 1)
TILEN512(8, 2) TILEN512(8, 1)

/* AVX2: a line's 16 lanes in two halves of 8. */
#define NIBBLE256(v, t, sv, ov)                                                                                \
    _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4 * (t)), _mm256_set1_epi32(15))), ov)

#define TILEN256(R)                                                                                          \
    __attribute__((target("avx2,fma,f16c"))) static void tilen256_##R##x1(                                       \
        const uint32_t *C, const void *S, const void *O, int64_t block, int half, const float *x, float *y, int64_t n, \
        int64_t k, int64_t p0) {                                                                             \
        const int64_t nb = k / block, eighth = k / 8;                                                        \
        __m256 acc[R][2];                                                                                    \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                             \
        const uint32_t *c = C + p0 * eighth * PANEL;                                                         \
        const int64_t so = p0 * nb * PANEL; /* this tile's first scale and offset */                     \
        for (int64_t b = 0; b < nb; b++) {                                                                   \
            const __m256 s0 = load_so256(S, half, so + b * PANEL), s1 = load_so256(S, half, so + b * PANEL + 8); \
            const __m256 o0 = load_so256(O, half, so + b * PANEL), o1 = load_so256(O, half, so + b * PANEL + 8); \
            for (int64_t j = b * block; j < (b + 1) * block; j += 8) {                                       \
                const uint32_t *line = c + (j / 8) * PANEL;                                                  \
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)line);                                \
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(line + 8));                          \
                _mm_prefetch((const char *)(line + AHEAD_NIBBLES * PANEL), _MM_HINT_T0);                     \
                for (int t = 0; t < 8; t++) {                                                                \
                    const __m256 w0 = NIBBLE256(v0, t, s0, o0), w1 = NIBBLE256(v1, t, s1, o1);               \
                    for (int r = 0; r < R; r++) {                                                            \
                        const __m256 xv = _mm256_set1_ps(x[r * k + j + t]);                                  \
                        acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);                                      \
                        acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);                                      \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        STORE256_PANEL(R)                                                                                \
    }

TILEN256(1) TILEN256(2) TILEN256(3)

/* AVX2: a panel's line of 16 codes in two halves of 8. */
#define TILEQ256(R)                                                                                          \
    __attribute__((target("avx2,fma,f16c"))) static void tileq256_##R##x1(                                       \
        const int8_t *C, const void *S, const void *O, int64_t block, int half, const float *x, float *y, int64_t n,  \
        int64_t k, int64_t p0) {                                                                             \
        const int64_t nb = k / block;                                                                        \
        __m256 acc[R][2];                                                                                    \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                             \
        const int8_t *c = C + p0 * k * PANEL;                                                                \
        const int64_t so = p0 * nb * PANEL; /* this tile's first scale and offset */                     \
        for (int64_t b = 0; b < nb; b++) {                                                                   \
            const __m256 s0 = load_so256(S, half, so + b * PANEL), s1 = load_so256(S, half, so + b * PANEL + 8); \
            const __m256 o0 = load_so256(O, half, so + b * PANEL), o1 = load_so256(O, half, so + b * PANEL + 8); \
            for (int64_t j = b * block; j < (b + 1) * block; j++) {                                          \
                const int8_t *line = c + j * PANEL;                                                          \
                const __m256 w0 = _mm256_fmadd_ps(                                                           \
                    s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)line))), o0); \
                const __m256 w1 = _mm256_fmadd_ps(                                                           \
                    s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(line + 8)))), o1); \
                _mm_prefetch((const char *)(line + AHEAD_CODES * PANEL), _MM_HINT_T0);                      \
                for (int r = 0; r < R; r++) {                                                                \
                    const __m256 xv = _mm256_set1_ps(x[r * k + j]);                                          \
                    acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);                                          \
                    acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);                                          \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        STORE256_PANEL(R)                                                                                \
    }

TILEQ256(1) TILEQ256(2) TILEQ256(3)

/* 2: AVX-512, 1: AVX2 + FMA, 0: neither (the caller uses torch's kernels). */
int specinfer_gemm_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 1;
    return 0;
}

/* A weight as the kernel reads it: dense panels of fmt FMT_F32, FMT_BF16 or FMT_F16 at w, or
 * (FMT_CODES) int8 code panels with a line of scales and one of offsets per block of inputs, or
 * (FMT_NIBBLES) 4-bit codes, eight to a lane, with their bias in the offsets. */
typedef struct {
    const void *w;
    int fmt;
    const void *codes;
    const void *scales, *offsets; /* offsets NULL: all zero */
    int64_t block;
    int half; /* scales and offsets in float16 */
} Weights;

/* One group of `rows` rows (starting at row r) against panels [p0, p1): tiles of P panels, then
 * single panels. */
#define SWEEP_F(ISA, F, R, P)                                                                      \
    do {                                                                                           \
        int64_t p = p0;                                                                            \
        for (; p + P <= p1; p += P) tile##ISA##_##F##_##R##x##P(W->w, x + r * k, y + r * n, n, k, p); \
        for (; p < p1; p++) tile##ISA##_##F##_##R##x1(W->w, x + r * k, y + r * n, n, k, p);        \
    } while (0)
#define SWEEP(ISA, R, P)                                        \
    do {                                                        \
        if (W->fmt == FMT_BF16)                                 \
            SWEEP_F(ISA, BF16, R, P);                           \
        else if (W->fmt == FMT_F16)                             \
            SWEEP_F(ISA, F16, R, P);                            \
        else                                                    \
            SWEEP_F(ISA, F32, R, P);                            \
    } while (0)
/* The same for block codes, KIND q (bytes) or n (4 bits). */
#define SWEEPC(KIND, ISA, R, P)                                                                                        \
    do {                                                                                                               \
        int64_t p = p0;                                                                                                \
        for (; p + P <= p1; p += P)                                                                                    \
            tile##KIND##ISA##_##R##x##P(W->codes, W->scales, W->offsets, W->block, W->half, x + r * k, y + r * n, n,   \
                                        k, p);                                                                         \
        for (; p < p1; p++)                                                                                            \
            tile##KIND##ISA##_##R##x1(W->codes, W->scales, W->offsets, W->block, W->half, x + r * k, y + r * n, n, k,  \
                                      p);                                                                              \
    } while (0)
/* A code tile also holds its panels' scales and offsets: fewer panels a tile than a dense one's. */
#define SWEEP_CODES(KIND)                                       \
    do {                                                        \
        if (isa == 2) {                                         \
            switch (rows) {                                     \
                case 1: SWEEPC(KIND, 512, 1, 4); break;         \
                case 2: SWEEPC(KIND, 512, 2, 4); break;         \
                case 3: SWEEPC(KIND, 512, 3, 4); break;         \
                case 4: SWEEPC(KIND, 512, 4, 3); break;         \
                case 5: SWEEPC(KIND, 512, 5, 3); break;         \
                case 6: SWEEPC(KIND, 512, 6, 3); break;         \
                case 7: SWEEPC(KIND, 512, 7, 2); break;         \
                default: SWEEPC(KIND, 512, 8, 2); break;        \
            }                                                   \
        } else {                                                \
            switch (rows) {                                     \
                case 1: SWEEPC(KIND, 256, 1, 1); break;         \
                case 2: SWEEPC(KIND, 256, 2, 1); break;         \
                default: SWEEPC(KIND, 256, 3, 1); break;        \
            }                                                   \
        }                                                       \
    } while (0)

static void sweep(const Weights *W, const float *x, float *y, int64_t r, int64_t rows, int64_t n, int64_t k,
                  int64_t p0, int64_t p1, int isa) {
    if (W->fmt == FMT_NIBBLES) {
        SWEEP_CODES(n);
    } else if (W->fmt == FMT_CODES) {
        SWEEP_CODES(q);
    } else if (isa == 2) {
        switch (rows) {
            case 1: SWEEP(512, 1, 8); break;
            case 2: SWEEP(512, 2, 4); break;
            case 3: SWEEP(512, 3, 4); break;
            case 4: SWEEP(512, 4, 4); break;
            case 5: SWEEP(512, 5, 4); break;
            case 6: SWEEP(512, 6, 4); break;
            case 7: SWEEP(512, 7, 3); break;
            default: SWEEP(512, 8, 3); break;
        }
    } else {
        switch (rows) {
            case 1: SWEEP(256, 1, 4); break;
            case 2: SWEEP(256, 2, 2); break;
            default: SWEEP(256, 3, 2); break;
        }
    }
}

/* How many groups m rows split into: at most 8 rows a group with AVX-512, 3 with AVX2. */
static int64_t row_groups(int64_t m, int isa) {
    const int64_t most = isa == 2 ? 8 : 3;
    return (m + most - 1) / most;
}

/* Rows [0, m) of x against panels [p0, p1), in groups of rows of near-equal size (at most 8 with
 * AVX-512, 3 with AVX2), each group one pass over the panels. */
static void panels(const Weights *W, const float *x, float *y, int64_t m, int64_t n, int64_t k, int64_t p0,
                   int64_t p1, int isa) {
    const int64_t groups = row_groups(m, isa);
    for (int64_t g = 0, r = 0; g < groups; g++) {
        const int64_t rows = (m - r) / (groups - g) + ((m - r) % (groups - g) ? 1 : 0);
        sweep(W, x, y, r, rows, n, k, p0, p1, isa);
        r += rows;
    }
}

/* y (m, n) = x (m, k) @ W.T. Threads take whole chunks of panels, so the split changes which
 * thread computes an element, never how. */
static void gemm(const Weights *W, const float *x, float *y, int64_t m, int64_t n, int64_t k, int isa,
                 int num_threads) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    if (m <= 0 || n <= 0) return; /* no rows (an empty pass) or no outputs: nothing to compute */
    /* Each thread takes an equal share of the panels (a few panels more or less would leave one
     * thread streaming alone at the end), in chunks of whole tiles but for a share's last, so that
     * every group of rows reads a chunk's panels while they are in the cache: for dense panels 6
     * where every group has 7-8 rows (tiles of 3 panels), else 8; for codes of either width 12
     * (tiles of 4, 3, 2). */
    const int64_t chunk = W->fmt == FMT_CODES || W->fmt == FMT_NIBBLES ? 12 : isa == 2 && m / row_groups(m, isa) >= 7 ? 6 : 8;
    const int64_t threads = num_threads > 1 ? num_threads : 1;
    const int64_t share = (num_panels + threads - 1) / threads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t t = 0; t < threads; t++) {
        const int64_t end = (t + 1) * share < num_panels ? (t + 1) * share : num_panels;
        for (int64_t p0 = t * share; p0 < end; p0 += chunk)
            panels(W, x, y, m, n, k, p0, p0 + chunk < end ? p0 + chunk : end, isa);
    }
}

/* y (m, n) = x (m, k) @ W.T, with W (n, k) laid out by cpu_gemm.pack in format fmt (FMT_F32,
 * FMT_BF16, FMT_F16); isa from specinfer_gemm_isa(). */
void specinfer_gemm(const void *Wp, int fmt, const float *x, float *y, int64_t m, int64_t n, int64_t k, int isa,
                    int num_threads) {
    const Weights W = {Wp, fmt, NULL, NULL, NULL, 0, 0};
    gemm(&W, x, y, m, n, k, isa, num_threads);
}

/* The same for W given as block codes laid out by cpu_gemm.pack_codes: W[i][j] = fma(scale, code,
 * offset) of row i's block j / block; k a multiple of block. Scales and offsets are float32, or
 * float16 with `half` (where each is one exactly); O is NULL where every offset is zero. */
void specinfer_gemm_codes(const int8_t *C, const void *S, const void *O, int64_t block, int half, const float *x, float *y,
                          int64_t m, int64_t n, int64_t k, int isa, int num_threads) {
    const Weights W = {NULL, FMT_CODES, C, S, O, block, half};
    gemm(&W, x, y, m, n, k, isa, num_threads);
}

/* The same for 4-bit codes laid out by cpu_gemm.pack_codes: lane i of line j / 8 of panel p holds
 * the codes (less their bias, which the offsets hold) of output 16p + i at inputs j .. j + 7, input
 * j + t in bits 4t .. 4t + 3; k and block multiples of 8. */
void specinfer_gemm_nibbles(const uint32_t *C, const void *S, const void *O, int64_t block, int half, const float *x,
                            float *y, int64_t m, int64_t n, int64_t k, int isa, int num_threads) {
    const Weights W = {NULL, FMT_NIBBLES, C, S, O, block, half};
    gemm(&W, x, y, m, n, k, isa, num_threads);
}

#else /* not x86-64: no kernel, and specinfer_gemm_isa() says so */
int specinfer_gemm_isa(void) { return 0; }
#endif
