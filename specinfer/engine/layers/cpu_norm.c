/* RMSNorm rows for the CPU, bit for bit as torch computes F.rms_norm in float32, in one call.
 *
 * Verification must see the LLM's own logits (SpecInfer Section 4.3), so the decoder's norms are
 * torch's arithmetic exactly: y = (x * r) * w with r = 1 / sqrt(sum(x * x) / h + eps), every
 * operation rounded to float32 on its own, and the sum of squares taken in the order torch's
 * float32 reduction takes it (eight lanes, four interleaved accumulators, its cascade of levels,
 * then the lanes one by one). torch spends about ten operators on this; a decoding pass runs it
 * twice a layer. `norms.py` checks, once per row size, that these rows equal torch's before it
 * uses them, and keeps torch's operators where they do not.
 *
 * Every operation is a separate add or multiply (the AVX2 target has no fused multiply-add, so
 * the compiler cannot fuse them). Rows are independent: a row's result does not depend on how
 * many rows a call holds or which thread takes it.
 */

#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define LANES 8  /* the float32 vector torch's reduction sums in */
#define ILP 4    /* its interleaved accumulators */
#define LEVELS 4 /* its cascade's levels */

static int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(x - 1)); }

__attribute__((target("avx2"))) static inline __m256 square(const float *x) {
    const __m256 v = _mm256_loadu_ps(x);
    return _mm256_mul_ps(v, v);
}

/* sum(x[j] * x[j]) over j < h, in torch's order for a contiguous float32 row. */
__attribute__((target("avx2"))) static float sum_of_squares(const float *x, int64_t h) {
    const int64_t num_vectors = h / LANES, num_groups = num_vectors / ILP;
    const int64_t level_power = ceil_log2(num_groups) / LEVELS > 4 ? ceil_log2(num_groups) / LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    __m256 acc[LEVELS][ILP];
    for (int l = 0; l < LEVELS; l++)
        for (int k = 0; k < ILP; k++) acc[l][k] = _mm256_setzero_ps();
    int64_t i = 0;
    while (i + level_step <= num_groups) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < ILP; k++) acc[0][k] = _mm256_add_ps(acc[0][k], square(x + (i * ILP + k) * LANES));
        for (int l = 1; l < LEVELS; l++) {
            for (int k = 0; k < ILP; k++) {
                acc[l][k] = _mm256_add_ps(acc[l][k], acc[l - 1][k]);
                acc[l - 1][k] = _mm256_setzero_ps();
            }
            if ((i & (level_mask << (l * level_power))) != 0) break;
        }
    }
    for (; i < num_groups; i++)
        for (int k = 0; k < ILP; k++) acc[0][k] = _mm256_add_ps(acc[0][k], square(x + (i * ILP + k) * LANES));
    for (int l = 1; l < LEVELS; l++)
        for (int k = 0; k < ILP; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[l][k]);
    for (int64_t v = num_groups * ILP; v < num_vectors; v++) acc[0][0] = _mm256_add_ps(acc[0][0], square(x + v * LANES));
    for (int k = 1; k < ILP; k++) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
    float total = 0.0f;
    for (int64_t j = num_vectors * LANES; j < h; j++) {
        const float sq = x[j] * x[j];
        total += sq;
    }
    float lanes[LANES];
    _mm256_storeu_ps(lanes, acc[0][0]);
    for (int k = 0; k < LANES; k++) total += lanes[k];
    return total;
}

__attribute__((target("avx2"))) static void norm_row(const float *x, const float *w, float *y, int64_t h, float eps) {
    const float mean = sum_of_squares(x, h) / (float)h;
    const float r = 1.0f / sqrtf(mean + eps);
    const __m256 rv = _mm256_set1_ps(r);
    int64_t j = 0;
    for (; j + LANES <= h; j += LANES)
        _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), rv), _mm256_loadu_ps(w + j)));
    for (; j < h; j++) {
        const float scaled = x[j] * r;
        y[j] = scaled * w[j];
    }
}

/* y (rows, h) = RMSNorm of x (rows, h) with weight w (h), all contiguous float32. */
void specinfer_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t h, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && rows * h >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * h, w, y + r * h, h, eps);
}

#endif
