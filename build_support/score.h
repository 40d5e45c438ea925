/* The row loops of pyllamacpp.scoring, over float logits as llama.cpp leaves them (one row of
 * n_vocab floats per output, row i at logits + i*stride):
 *
 * - pyl_score_rows: per row the max, the sum of exp(x - max) accumulated in double, hence the
 *   log-sum-exp, the target's log-probability, the first argmax and the top-k logits;
 * - pyl_base_rows: llama-perplexity's base-logits rows (--kl-divergence-base): the log_softmax of
 *   tools/perplexity/perplexity.cpp that quantizes a row's log-probabilities to uint16;
 * - pyl_kl_rows: that file's KL divergence rows (its log_softmax with base_log_prob), per row.
 *
 * On x86 with AVX2 and FMA (checked at run time) the exponential is ggml's ggml_v_expf
 * (ggml/src/ggml-cpu/vec.h, MIT), 8 lanes at a time; elsewhere expf. Python checks every size,
 * stride and token before calling: nothing here validates. One thread; cffi releases the GIL. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#define PYL_SCORE_X86 1
#include <immintrin.h>
#endif

static inline int pyl_score_nearest_int(float fval) {
    /* perplexity.cpp's nearest_int: round to nearest through the float mantissa */
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

/* ---- scalar loops (any compiler, any CPU) ------------------------------------------------- */
static float pyl_score_max_c(const float *x, int32_t n) {
    float m = x[0];
    for (int32_t i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

static int32_t pyl_score_first_c(const float *x, int32_t n, float v) {
    for (int32_t i = 0; i < n; ++i)
        if (x[i] == v) return i;
    return 0;
}

static double pyl_score_sumexp_c(const float *x, int32_t n, float m) {
    double s = 0.0;
    for (int32_t i = 0; i < n; ++i) s += expf(x[i] - m);
    return s;
}

static double pyl_score_kl_sum_c(const float *x, int32_t n, const uint16_t *q, float scale, float mlp, float mxl) {
    double sum = 0.0;
    for (int32_t i = 0; i < n; ++i) {
        const float plb = scale * q[i] + mlp;
        if (plb > -16.f) sum += expf(plb) * (plb - x[i] + mxl);
    }
    return sum;
}

static void pyl_score_topk_c(const float *x, int32_t n, int32_t k, int32_t *ids, float *vals, int32_t from,
                             int32_t *filled) {
    /* insertion into a sorted top-k; equal values keep index order (the lower index first) */
    int32_t m = *filled;
    for (int32_t i = from; i < n; ++i) {
        const float v = x[i];
        if (m == k && !(v > vals[k - 1])) continue;
        int32_t j = m < k ? m : k - 1;
        while (j > 0 && vals[j - 1] < v) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
            --j;
        }
        vals[j] = v;
        ids[j] = i;
        if (m < k) ++m;
    }
    *filled = m;
}

#ifdef PYL_SCORE_X86
/* ---- AVX2 + FMA loops --------------------------------------------------------------------- */
__attribute__((target("avx2,fma"))) static inline __m256 pyl_score_v_expf(__m256 x) {
    /* ggml_v_expf (ggml-cpu/vec.h): exp to about 1 ulp, the large-|x| cases handled */
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b =
        _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256i c =
        _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(126), _CMP_GT_OQ));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm256_movemask_ps(_mm256_castsi256_ps(c))) return _mm256_fmadd_ps(j, k, k);
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32((int)0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256i d =
        _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(192), _CMP_GT_OQ));
    return _mm256_or_ps(
        _mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(_mm256_castsi256_ps(d),
                         _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(c), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                      _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)))));
}

__attribute__((target("avx2,fma"))) static float pyl_score_max_v(const float *x, int32_t n) {
    int32_t i = 0;
    float m = x[0];
    if (n >= 16) {
        __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
        for (i = 16; i + 16 <= n; i += 16) {
            a = _mm256_max_ps(a, _mm256_loadu_ps(x + i));
            b = _mm256_max_ps(b, _mm256_loadu_ps(x + i + 8));
        }
        float buf[8];
        _mm256_storeu_ps(buf, _mm256_max_ps(a, b));
        for (int k = 0; k < 8; ++k) m = buf[k] > m ? buf[k] : m;
    }
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

__attribute__((target("avx2,fma"))) static int32_t pyl_score_first_v(const float *x, int32_t n, float v) {
    const __m256 vv = _mm256_set1_ps(v);
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vv, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz((unsigned)mask);
    }
    for (; i < n; ++i)
        if (x[i] == v) return i;
    return 0;
}

__attribute__((target("avx2,fma"))) static double pyl_score_sumexp_v(const float *x, int32_t n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
    int32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 e0 = pyl_score_v_expf(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        const __m256 e1 = pyl_score_v_expf(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vm));
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(e0)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(e0, 1)));
        a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(e1)));
        a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(e1, 1)));
    }
    double buf[4];
    _mm256_storeu_pd(buf, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
    double s = (buf[0] + buf[1]) + (buf[2] + buf[3]);
    for (; i < n; ++i) s += expf(x[i] - m);
    return s;
}

__attribute__((target("avx2,fma"))) static double pyl_score_kl_sum_v(const float *x, int32_t n, const uint16_t *q,
                                                                     float scale, float mlp, float mxl) {
    const __m256 vs = _mm256_set1_ps(scale), vb = _mm256_set1_ps(mlp), vx = _mm256_set1_ps(mxl);
    const __m256 lim = _mm256_set1_ps(-16.f);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(q + i))));
        const __m256 plb = _mm256_fmadd_ps(vs, qf, vb);
        const __m256 keep = _mm256_cmp_ps(plb, lim, _CMP_GT_OQ);
        const __m256 t = _mm256_mul_ps(pyl_score_v_expf(plb), _mm256_add_ps(_mm256_sub_ps(plb, _mm256_loadu_ps(x + i)), vx));
        const __m256 tk = _mm256_and_ps(keep, t);
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(tk)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(tk, 1)));
    }
    double buf[4];
    _mm256_storeu_pd(buf, _mm256_add_pd(a0, a1));
    double s = (buf[0] + buf[1]) + (buf[2] + buf[3]);
    return s + pyl_score_kl_sum_c(x + i, n - i, q + i, scale, mlp, mxl);
}

__attribute__((target("avx2,fma"))) static void pyl_score_topk_v(const float *x, int32_t n, int32_t k, int32_t *ids,
                                                                 float *vals) {
    int32_t m = 0, i = 0;
    /* fill with the first k, then skip blocks of 8 where nothing beats the k-th */
    pyl_score_topk_c(x, k < n ? k : n, k, ids, vals, 0, &m);
    i = m;
    for (; i + 8 <= n; i += 8) {
        if (!_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(vals[k - 1]), _CMP_GT_OQ))) continue;
        pyl_score_topk_c(x, i + 8, k, ids, vals, i, &m);
    }
    pyl_score_topk_c(x, n, k, ids, vals, i, &m);
}

static int pyl_score_has_simd(void) {
    static int has = -1;
    if (has < 0) has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return has;
}
#define PYL_SCORE_PICK(f) (simd ? f##_v : f##_c)
#else
static int pyl_score_has_simd(void) { return 0; }
#define PYL_SCORE_PICK(f) (f##_c)
#endif

/* 1 when the AVX2 loops run on this CPU. */
static int pyl_score_simd(void) { return pyl_score_has_simd(); }

/* Per row: lse = max + log(sum exp(x - max)); logprob = (x[target] - max) - log(sum), as
 * llama-perplexity's log_softmax (the difference taken in double, where it takes it in float); argmax = the first index of the max; top-k logits, largest first
 * (equal values in index order). Every output may be NULL but lse; targets with logprob. */
static void pyl_score_rows(const float *logits, int64_t n_rows, int64_t stride, int32_t n_vocab,
                           const int32_t *targets, double *lse, double *logprob, int32_t *argmax, int32_t top_k,
                           int32_t *top_ids, float *top_logits) {
    const int simd = pyl_score_has_simd();
    (void)simd;
    for (int64_t r = 0; r < n_rows; ++r) {
        const float *x = logits + r * stride;
        const float mx = PYL_SCORE_PICK(pyl_score_max)(x, n_vocab);
        const double s = PYL_SCORE_PICK(pyl_score_sumexp)(x, n_vocab, mx);
        const double ls = log(s);
        lse[r] = (double)mx + ls;
        if (logprob) logprob[r] = ((double)x[targets[r]] - (double)mx) - ls; /* in double: exact */
        if (argmax) argmax[r] = PYL_SCORE_PICK(pyl_score_first)(x, n_vocab, mx);
        if (top_k > 0) {
#ifdef PYL_SCORE_X86
            if (simd && top_k <= n_vocab) {
                pyl_score_topk_v(x, n_vocab, top_k, top_ids + r * top_k, top_logits + r * top_k);
                continue;
            }
#endif
            int32_t m = 0;
            pyl_score_topk_c(x, n_vocab, top_k, top_ids + r * top_k, top_logits + r * top_k, 0, &m);
        }
    }
}

/* llama-perplexity's base-logits rows (perplexity.cpp, log_softmax with uint16_t *log_prob): per
 * row 4 uint16 (float scale, float min_log_prob), then n_vocab uint16, padded to nv with zeros;
 * nll[r] = max + log-sum-exp - x[target], in float as there. */
static void pyl_base_rows(const float *logits, int64_t n_rows, int64_t stride, int32_t n_vocab,
                          const int32_t *targets, uint16_t *out, int64_t nv, float *nll) {
    const int simd = pyl_score_has_simd();
    (void)simd;
    for (int64_t r = 0; r < n_rows; ++r) {
        const float *x = logits + r * stride;
        uint16_t *row = out + r * nv;
        float max_logit = PYL_SCORE_PICK(pyl_score_max)(x, n_vocab);
        float min_logit = x[0];
        for (int32_t i = 1; i < n_vocab; ++i) min_logit = x[i] < min_logit ? x[i] : min_logit;
        min_logit = min_logit > max_logit - 16 ? min_logit : max_logit - 16;
        const double sum_exp = PYL_SCORE_PICK(pyl_score_sumexp)(x, n_vocab, max_logit);
        const float log_sum_exp = (float)log(sum_exp);
        const float min_log_prob = min_logit - max_logit - log_sum_exp;
        const float scale = (max_logit - min_logit) / 65535.f;
        memcpy(row, &scale, sizeof(float));
        memcpy(row + 2, &min_log_prob, sizeof(float));
        uint16_t *q = row + 4;
        if (scale) {
            const float inv_scale = 1 / scale;
            for (int32_t i = 0; i < n_vocab; ++i)
                q[i] = x[i] > min_logit ? (uint16_t)pyl_score_nearest_int(inv_scale * (x[i] - min_logit)) : 0;
        } else {
            memset(q, 0, (size_t)n_vocab * sizeof(uint16_t));
        }
        for (int64_t i = 4 + n_vocab; i < nv; ++i) row[i] = 0;
        nll[r] = max_logit + log_sum_exp - x[targets[r]];
    }
}

/* llama-perplexity's KL divergence rows (perplexity.cpp, log_softmax with base_log_prob), per row:
 * nll and nll_base (float, as there), kld = sum over the base's p > exp(-16) of
 * p_base * (log p_base - log p), p_diff = p(target) - p_base(target), same_top = whether the first
 * argmax of the logits is the base's. */
static void pyl_kl_rows(const float *logits, int64_t n_rows, int64_t stride, int32_t n_vocab, const uint16_t *base,
                        int64_t nv, const int32_t *targets, float *nll, float *nll_base, double *kld, float *p_diff,
                        int8_t *same_top) {
    const int simd = pyl_score_has_simd();
    (void)simd;
    for (int64_t r = 0; r < n_rows; ++r) {
        const float *x = logits + r * stride;
        const uint16_t *row = base + r * nv;
        const int32_t tok = targets[r];
        const float max_logit = PYL_SCORE_PICK(pyl_score_max)(x, n_vocab);
        const int32_t imax = PYL_SCORE_PICK(pyl_score_first)(x, n_vocab, max_logit);
        const double sum_exp = PYL_SCORE_PICK(pyl_score_sumexp)(x, n_vocab, max_logit);
        const float log_sum_exp = (float)log(sum_exp);
        float scale, min_log_prob;
        memcpy(&scale, row, sizeof(float));
        memcpy(&min_log_prob, row + 2, sizeof(float));
        const uint16_t *q = row + 4;
        const float nl = max_logit + log_sum_exp - x[tok];
        const float nlb = -(scale * q[tok] + min_log_prob);
        const float mxl = max_logit + log_sum_exp;
        /* the base's first argmax: p_log_base rises with q (scale >= 0); scale 0 leaves index 0 */
        int32_t imax_base = 0;
        uint16_t qmax = q[0];
        for (int32_t i = 1; i < n_vocab; ++i)
            if (q[i] > qmax) {
                qmax = q[i];
                imax_base = i;
            }
        kld[r] = PYL_SCORE_PICK(pyl_score_kl_sum)(x, n_vocab, q, scale, min_log_prob, mxl);
        nll[r] = nl;
        nll_base[r] = nlb;
        p_diff[r] = expf(-nl) - expf(-nlb);
        same_top[r] = (int8_t)(imax == imax_base);
    }
}
