/* Attention of a few query rows over their cached context, for the CPU.
 *
 * Decoding and tree verification (SpecInfer Section 4.2) ask attention for one to a few dozen
 * query rows over a context of hundreds or thousands of cached keys. torch's SDPA spends most of
 * such a call on its blocked, general form. Here every query row is computed on its own, the same
 * way whatever the other rows: each of a key-value head's query heads takes its scores over the
 * keys the row may see (the mask's, or the causal ones, in context order), their maximum, exp of
 * each score less it, their sum, and the weighted sum of the values, in that order. A tree node
 * sees the very keys, in the very order, that the same token sees in plain decoding, so its output
 * is bitwise the one-token pass's; against SDPA it differs by float32 rounding.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma")))

/* exp(x) for 8 floats, x <= 0 (scores less their maximum): 2^n * p(r), |r| <= ln2 / 2, p of degree 6;
 * below -87 it is 0. Within 2 ulp of expf. */
TARGET static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 is_tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(is_tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

TARGET static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* q . k over dim (a multiple of 8): eight lanes of fused multiply-adds, then the lanes summed. */
TARGET static inline float dot(const float *q, const float *k, int64_t dim) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
    return hsum8(acc);
}

/* The eight lanes of each of four accumulators summed the way hsum8 sums them (lanes i and i + 4,
 * then those pairs 0 + 2 and 1 + 3, then the two), the four sums in one vector. */
TARGET static inline __m128 hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m128 s0 = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
    __m128 s1 = _mm_add_ps(_mm256_castps256_ps128(a1), _mm256_extractf128_ps(a1, 1));
    __m128 s2 = _mm_add_ps(_mm256_castps256_ps128(a2), _mm256_extractf128_ps(a2, 1));
    __m128 s3 = _mm_add_ps(_mm256_castps256_ps128(a3), _mm256_extractf128_ps(a3, 1));
    _MM_TRANSPOSE4_PS(s0, s1, s2, s3);
    return _mm_add_ps(_mm_add_ps(s0, s2), _mm_add_ps(s1, s3));
}

/* Scores of one query head over the visible keys, eight keys at a time (eight independent chains,
 * their sums reduced together), the last few one by one: each key's is its own eight-lane chain
 * over dim and the lanes' sum in hsum8's order, whatever its place, so a key scores the same in
 * every block size. */
TARGET static void score_keys(const float *qh, const float *k, const int64_t *keys, int64_t num_visible,
                              int64_t kv_stride, int64_t dim, float scale, float *s) {
    const __m128 scalev = _mm_set1_ps(scale);
    int64_t j = 0;
    for (; j + 8 <= num_visible; j += 8) {
        const float *k0 = k + keys[j] * kv_stride, *k1 = k + keys[j + 1] * kv_stride;
        const float *k2 = k + keys[j + 2] * kv_stride, *k3 = k + keys[j + 3] * kv_stride;
        const float *k4 = k + keys[j + 4] * kv_stride, *k5 = k + keys[j + 5] * kv_stride;
        const float *k6 = k + keys[j + 6] * kv_stride, *k7 = k + keys[j + 7] * kv_stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps(), a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qh + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
            a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4 + d), a4);
            a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k5 + d), a5);
            a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k6 + d), a6);
            a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k7 + d), a7);
        }
        _mm_storeu_ps(s + j, _mm_mul_ps(hsum8x4(a0, a1, a2, a3), scalev));
        _mm_storeu_ps(s + j + 4, _mm_mul_ps(hsum8x4(a4, a5, a6, a7), scalev));
    }
    for (; j < num_visible; j++) s[j] = dot(qh, k + keys[j] * kv_stride, dim) * scale;
}

/* The largest of s[0 .. num), eight lanes at a time (a maximum is the same in any order). */
TARGET static float max_of(const float *s, int64_t num) {
    __m256 topv = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= num; j += 8) topv = _mm256_max_ps(_mm256_loadu_ps(s + j), topv);
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, topv);
    for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    for (; j < num; j++) top = s[j] > top ? s[j] : top;
    return top;
}

/* out[d0 ...] += sum over the keys given of p[j] * v[keys[j]][d0 ...], in key order: eight (or
 * fewer) accumulators held in registers across the keys, and in out between calls (a store and a
 * load change no float, so the sums are those of one pass over all the keys). */
#define WEIGHTED_VALUES(CHUNKS)                                                                        \
    do {                                                                                               \
        __m256 acc[CHUNKS];                                                                            \
        for (int c = 0; c < CHUNKS; c++) acc[c] = _mm256_loadu_ps(out + d0 + 8 * c);                   \
        for (int64_t j = 0; j < num_visible; j++) {                                                    \
            const __m256 pj = _mm256_set1_ps(p[j]);                                                    \
            const float *vj = v + keys[j] * kv_stride + d0;                                            \
            for (int c = 0; c < CHUNKS; c++) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * c), acc[c]); \
        }                                                                                              \
        for (int c = 0; c < CHUNKS; c++) _mm256_storeu_ps(out + d0 + 8 * c, acc[c]);                   \
    } while (0)

TARGET static void add_weighted_values(const float *p, const float *v, const int64_t *keys, int64_t num_visible,
                                       int64_t kv_stride, int64_t dim, float *out) {
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        switch ((dim - d0 < 64 ? dim - d0 : 64) / 8) {
            case 8: WEIGHTED_VALUES(8); break;
            case 7: WEIGHTED_VALUES(7); break;
            case 6: WEIGHTED_VALUES(6); break;
            case 5: WEIGHTED_VALUES(5); break;
            case 4: WEIGHTED_VALUES(4); break;
            case 3: WEIGHTED_VALUES(3); break;
            case 2: WEIGHTED_VALUES(2); break;
            default: WEIGHTED_VALUES(1); break;
        }
    }
}

/* AVX-512 (F and DQ), where the CPU has it: two query heads at once in one register, head A in the
 * low eight lanes and head B in the high eight. Each lane does what the same lane of the AVX2
 * code does for its head (the same fused multiply-adds in the same order, the same sum of the
 * eight lanes), so the floats are the AVX2 path's, bit for bit; a CPU that retires two 512-bit
 * fused multiply-adds a cycle does the work of two heads in the time of one. */
#define TARGET512 __attribute__((target("avx512f,avx512dq,avx2,fma")))

static int attention_isa = 0; /* 0: what the CPU has; 1: AVX2 even where AVX-512 is found (tests) */

int specinfer_attention_isa(int isa) {
    if (isa >= 0) attention_isa = isa;
    return attention_isa;
}

static int use_avx512(void) {
    __builtin_cpu_init();
    return attention_isa != 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

/* Scores of heads A and B over the keys given. qq: their queries interleaved by eight (A's
 * first eight, B's first eight, A's next eight, ...), 2 * dim floats. */
TARGET512 static void score_keys_pair(const float *qq, const float *qa, const float *qb, const float *k,
                                      const int64_t *keys, int64_t num_visible, int64_t kv_stride, int64_t dim,
                                      float scale, float *sa, float *sb) {
    const __m128 scalev = _mm_set1_ps(scale);
    int64_t j = 0;
    for (; j + 8 <= num_visible; j += 8) {
        const float *kp[8];
        for (int u = 0; u < 8; u++) kp[u] = k + keys[j + u] * kv_stride;
        __m512 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 8) {
            const __m512 qv = _mm512_loadu_ps(qq + 2 * d);
            for (int u = 0; u < 8; u++)
                a[u] = _mm512_fmadd_ps(qv, _mm512_broadcast_f32x8(_mm256_loadu_ps(kp[u] + d)), a[u]);
        }
        _mm_storeu_ps(sa + j, _mm_mul_ps(hsum8x4(_mm512_castps512_ps256(a[0]), _mm512_castps512_ps256(a[1]),
                                                 _mm512_castps512_ps256(a[2]), _mm512_castps512_ps256(a[3])), scalev));
        _mm_storeu_ps(sa + j + 4, _mm_mul_ps(hsum8x4(_mm512_castps512_ps256(a[4]), _mm512_castps512_ps256(a[5]),
                                                     _mm512_castps512_ps256(a[6]), _mm512_castps512_ps256(a[7])), scalev));
        _mm_storeu_ps(sb + j, _mm_mul_ps(hsum8x4(_mm512_extractf32x8_ps(a[0], 1), _mm512_extractf32x8_ps(a[1], 1),
                                                 _mm512_extractf32x8_ps(a[2], 1), _mm512_extractf32x8_ps(a[3], 1)), scalev));
        _mm_storeu_ps(sb + j + 4, _mm_mul_ps(hsum8x4(_mm512_extractf32x8_ps(a[4], 1), _mm512_extractf32x8_ps(a[5], 1),
                                                     _mm512_extractf32x8_ps(a[6], 1), _mm512_extractf32x8_ps(a[7], 1)), scalev));
    }
    for (; j < num_visible; j++) {
        sa[j] = dot(qa, k + keys[j] * kv_stride, dim) * scale;
        sb[j] = dot(qb, k + keys[j] * kv_stride, dim) * scale;
    }
}

/* outa[d0 ...] += sum of pa[j] * v[keys[j]][d0 ...], outb likewise with pb, in key order: the
 * values' lanes read once for both heads. */
#define WEIGHTED_VALUES_PAIR(CHUNKS)                                                                    \
    do {                                                                                                \
        __m512 a[CHUNKS], b[CHUNKS];                                                                    \
        for (int c = 0; c < CHUNKS; c++) {                                                              \
            a[c] = _mm512_loadu_ps(outa + d0 + 16 * c);                                                 \
            b[c] = _mm512_loadu_ps(outb + d0 + 16 * c);                                                 \
        }                                                                                               \
        for (int64_t j = 0; j < num_visible; j++) {                                                     \
            const __m512 paj = _mm512_set1_ps(pa[j]), pbj = _mm512_set1_ps(pb[j]);                      \
            const float *vj = v + keys[j] * kv_stride + d0;                                             \
            for (int c = 0; c < CHUNKS; c++) {                                                          \
                const __m512 vv = _mm512_loadu_ps(vj + 16 * c);                                         \
                a[c] = _mm512_fmadd_ps(paj, vv, a[c]);                                                  \
                b[c] = _mm512_fmadd_ps(pbj, vv, b[c]);                                                  \
            }                                                                                           \
        }                                                                                               \
        for (int c = 0; c < CHUNKS; c++) {                                                              \
            _mm512_storeu_ps(outa + d0 + 16 * c, a[c]);                                                 \
            _mm512_storeu_ps(outb + d0 + 16 * c, b[c]);                                                 \
        }                                                                                               \
    } while (0)

/* dim a multiple of 16. */
TARGET512 static void add_weighted_values_pair(const float *pa, const float *pb, const float *v, const int64_t *keys,
                                               int64_t num_visible, int64_t kv_stride, int64_t dim, float *outa,
                                               float *outb) {
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        switch ((dim - d0 < 64 ? dim - d0 : 64) / 16) {
            case 4: WEIGHTED_VALUES_PAIR(4); break;
            case 3: WEIGHTED_VALUES_PAIR(3); break;
            case 2: WEIGHTED_VALUES_PAIR(2); break;
            default: WEIGHTED_VALUES_PAIR(1); break;
        }
    }
}

/* One query row's heads [0, num_heads) of one key-value head (queries dim apart from q0, outputs
 * from out). keys: the visible keys' slots, in context order. The keys go in blocks of about 16 KiB
 * of keys (or values), every head through a block before the next: a key-value head's cache is
 * read once for all the query heads taken together. scores: num_heads * padded floats. Each head's
 * floats are the same whichever heads it is taken with. */
TARGET static void attend_heads(const float *q0, int64_t num_heads, const float *k, const float *v,
                                const int64_t *keys, int64_t num_visible, int64_t kv_stride, int64_t dim, float scale,
                                int is_avx512, float *scores, float *out) {
    const int64_t padded = (num_visible + 7) / 8 * 8;
    const int64_t block = dim >= 512 ? 8 : 4096 / dim / 8 * 8;
    /* heads [0, num_pairs * 2) two at a time on AVX-512, the rest one at a time */
    const int64_t num_pairs = is_avx512 ? num_heads / 2 : 0;
    const int is_values_paired = num_pairs && dim % 16 == 0;
    float inv[num_heads];
    float qq[num_pairs > 0 ? num_pairs * 2 * dim : 1];
    for (int64_t pair = 0; pair < num_pairs; pair++)
        for (int64_t d = 0; d < dim; d += 8) {
            memcpy(qq + pair * 2 * dim + 2 * d, q0 + 2 * pair * dim + d, 8 * sizeof(float));
            memcpy(qq + pair * 2 * dim + 2 * d + 8, q0 + (2 * pair + 1) * dim + d, 8 * sizeof(float));
        }
    for (int64_t b = 0; b < num_visible; b += block) {
        const int64_t m = num_visible - b < block ? num_visible - b : block;
        for (int64_t pair = 0; pair < num_pairs; pair++)
            score_keys_pair(qq + pair * 2 * dim, q0 + 2 * pair * dim, q0 + (2 * pair + 1) * dim, k, keys + b, m,
                            kv_stride, dim, scale, scores + 2 * pair * padded + b, scores + (2 * pair + 1) * padded + b);
        for (int64_t h = 2 * num_pairs; h < num_heads; h++)
            score_keys(q0 + h * dim, k, keys + b, m, kv_stride, dim, scale, scores + h * padded + b);
    }
    for (int64_t h = 0; h < num_heads; h++) {  /* each head's softmax numerators, in place, and their sum */
        float *s = scores + h * padded;
        const __m256 topv = _mm256_set1_ps(max_of(s, num_visible));
        for (int64_t j = num_visible; j < padded; j++) s[j] = -INFINITY;
        __m256 total = _mm256_setzero_ps();
        for (int64_t j = 0; j < padded; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), topv));
            _mm256_storeu_ps(s + j, e);
            total = _mm256_add_ps(total, e);
        }
        inv[h] = 1.0f / hsum8(total);
    }
    memset(out, 0, sizeof(float) * (size_t)(num_heads * dim));
    for (int64_t b = 0; b < num_visible; b += block) {
        const int64_t m = num_visible - b < block ? num_visible - b : block;
        const int64_t first_single = is_values_paired ? 2 * num_pairs : 0;
        for (int64_t pair = 0; pair < first_single / 2; pair++)
            add_weighted_values_pair(scores + 2 * pair * padded + b, scores + (2 * pair + 1) * padded + b, v, keys + b,
                                     m, kv_stride, dim, out + 2 * pair * dim, out + (2 * pair + 1) * dim);
        for (int64_t h = first_single; h < num_heads; h++)
            add_weighted_values(scores + h * padded + b, v, keys + b, m, kv_stride, dim, out + h * dim);
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const __m256 invv = _mm256_set1_ps(inv[h]);
        for (int64_t d = 0; d < dim; d += 8)
            _mm256_storeu_ps(out + h * dim + d, _mm256_mul_ps(_mm256_loadu_ps(out + h * dim + d), invv));
    }
}

/* out (n, heads * dim) = attention of the n query rows q (row i at q + i * q_stride, its heads
 * contiguous) over num_keys keys of the cache k, v (slots, kv_heads, dim): key j is slot
 * slots[j], or first_slot + j where slots is NULL. Row i sees key j where mask[i * num_keys + j]
 * (mask not NULL), else where j <= num_keys - n + i (is_causal), else every key. dim a multiple
 * of 8, heads a multiple of kv_heads. Returns 0, or -1 where scratch memory ran out. */
TARGET int specinfer_attention(const float *q, int64_t q_stride, const float *k, const float *v, const int64_t *slots,
                               int64_t first_slot, int64_t num_keys, const uint8_t *mask, int is_causal, float *out,
                               int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, float scale, int num_threads) {
    const int64_t group = heads / kv_heads, kv_stride = kv_heads * dim;
    const int64_t padded = (num_keys + 7) / 8 * 8;
    int failed = 0;
/* A task is a query row's key-value head, or a part of its query heads where there are too few
 * tasks to keep the threads busy otherwise (one row of 9 heads over 3 key-value heads, on two
 * threads: 6 tasks of 1-2 heads, 5 and 4 heads a thread). A thread's tasks are consecutive, so it
 * gathers a row's visible keys once for all of that row's tasks it takes. */
    const int is_avx512 = use_avx512();
    const int64_t num_groups = n * kv_heads;
    int64_t split = 1;  /* tasks per key-value head */
    if (num_threads > 1 && num_groups < 2 * num_threads) {
        split = (2 * num_threads + num_groups - 1) / num_groups;
        split = split < group ? split : group;
    }
    const int64_t num_tasks = num_groups * split;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_tasks > 1 && num_keys * n * heads >= 1024)
    {
        int64_t *keys = malloc(sizeof(int64_t) * (size_t)(num_keys > 0 ? num_keys : 1));
        float *scores = malloc(sizeof(float) * (size_t)(group * (padded > 0 ? padded : 8)));
        if (!keys || !scores) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t row = -1, num_visible = 0;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (!keys || !scores) continue;
            const int64_t i = task / (kv_heads * split), g = task % (kv_heads * split) / split, part = task % split;
            const int64_t h0 = g * group + part * group / split, h1 = g * group + (part + 1) * group / split;
            if (h1 == h0) continue;
            if (i != row) {
                row = i;
                num_visible = 0;
                const int64_t last = is_causal ? num_keys - n + i : num_keys - 1;
                for (int64_t j = 0; j <= last && j < num_keys; j++)
                    if (!mask || mask[i * num_keys + j]) keys[num_visible++] = slots ? slots[j] : first_slot + j;
            }
            float *o = out + i * heads * dim + h0 * dim;
            if (num_visible == 0) {  /* a row that sees nothing (never asked for): zeros, not NaN */
                memset(o, 0, sizeof(float) * (size_t)((h1 - h0) * dim));
                continue;
            }
            attend_heads(q + i * q_stride + h0 * dim, h1 - h0, k + g * dim, v + g * dim, keys, num_visible, kv_stride,
                         dim, scale, is_avx512, scores, o);
        }
        free(keys);
        free(scores);
    }
    return failed ? -1 : 0;
}

#endif
