/* Rotary position embeddings for the CPU, bit for bit as `rope.apply_rope` computes them with
 * torch's operators, in one call.
 *
 * A node of a token tree is rotated at its own position (SpecInfer Section 4.2), as in plain
 * decoding: out = rotate_half(x) * signed_sin + x * cos, element by element, each product and the
 * sum rounded to float32 on its own (the AVX2 target has no fused multiply-add, so the compiler
 * cannot fuse them). torch spends four operators and their temporaries on this in every layer.
 */

#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

/* x: tokens x heads x dim floats, token t's heads at x + t * x_stride, each head's dim contiguous;
 * cos and signed_sin: (tokens, dim) rows of `rope.rope_tables`; out: (tokens, heads, dim) contiguous. */
__attribute__((target("avx2"))) void specinfer_rope(const float *x, int64_t x_stride, const float *cos,
                                                    const float *signed_sin, float *out, int64_t tokens,
                                                    int64_t heads, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = signed_sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * x_stride + h * dim;
            float *o = out + (t * heads + h) * dim;
            for (int64_t part = 0; part < 2; part++) {  /* the first half takes the second's, and back */
                const int64_t lo = part * half;
                const float *rot = xh + (part ? 0 : half);
                int64_t j = 0;
                for (; j + 8 <= half; j += 8) {
                    const __m256 turned = _mm256_mul_ps(_mm256_loadu_ps(rot + j), _mm256_loadu_ps(s + lo + j));
                    const __m256 kept = _mm256_mul_ps(_mm256_loadu_ps(xh + lo + j), _mm256_loadu_ps(c + lo + j));
                    _mm256_storeu_ps(o + lo + j, _mm256_add_ps(turned, kept));
                }
                for (; j < half; j++) {
                    const float turned = rot[j] * s[lo + j];
                    const float kept = xh[lo + j] * c[lo + j];
                    o[lo + j] = turned + kept;
                }
            }
        }
    }
}

#endif
