/* The host optimizer update and the low-precision shadow store in one pass (see shadow_kernel.py).
 *
 * Each element is computed with the float operations of torch 2.13's fused CPU kernels' vector
 * loop, in their order, with the multiply-adds torch's build contracts written as explicit FMAs
 * (the file is compiled with -ffp-contract=off and no -ffast-math, so nothing else is fused or
 * reordered). Every operation is an IEEE single-precision one, rounded once, so the vector width
 * does not change a bit. The shadow is rounded as torch's vectorized copy_ rounds it (bf16:
 * nearest-even, NaN -> 0xffff; fp16: F16C's vcvtps2ph) and written with non-temporal stores:
 * no read of the shadow line before its write, 30 B a parameter for AdamW instead of 32.
 *
 * n is a multiple of 8; the caller keeps torch's kernel for the rest of each tensor.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

enum { KIND_ADAM = 0, KIND_SGD = 1, KIND_ADAGRAD = 2 };
enum { F_DECAY = 1, F_MAXIMIZE = 2, F_ADAMW = 4, F_LERP_SMALL = 8, F_MOMENTUM = 16, F_NESTEROV = 32 };
enum { SHADOW_BF16 = 1, SHADOW_FP16 = 2 };

static inline __m256 bc(float x) { return _mm256_set1_ps(x); }
/* maximize's grad * -1. Values: any form gives the same. NaNs: torch's build (gcc, no -ffast-math) folds
 * x * -1 into a flip of the sign bit, -g + p * wd into fmsub(p, wd, g) (which keeps g's NaN as it is) and
 * (c * -g) * -g into (c * g) * g; the forms below are those, so a NaN gradient's sign comes out as torch's. */
static inline __m256 neg(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }

/* torch's cvtfp32_bf16 (vec256_bfloat16.h): round to nearest even, NaN -> 0xffff */
static inline __m128i to_bf16(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i t = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    t = _mm256_srli_epi32(t, 16);
    __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
    t = _mm256_blendv_epi8(_mm256_set1_epi32(0xffff), t, ordered);
    /* 8 x 32-bit (high halves zero) -> 8 x 16-bit, in order */
    __m256i packed = _mm256_packus_epi32(t, t);
    packed = _mm256_permute4x64_epi64(packed, 0xd8);
    return _mm256_castsi256_si128(packed);
}

static inline void store_shadow(void *shadow, int64_t i, __m256 x, int kind, int stream) {
    __m128i h = kind == SHADOW_BF16 ? to_bf16(x) : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    __m128i *dst = (__m128i *)((uint16_t *)shadow + i);
    if (stream) _mm_stream_si128(dst, h); else _mm_storeu_si128(dst, h);
}

static void adam_range(int flags, const float *sc, float *p, const float *g, float *m, float *v,
                       void *shadow, int skind, int stream, int64_t lo, int64_t hi) {
    /* sc: wd (AdamW: 1 - lr*wd), lerp weight (w or w - 1), beta2, 1 - beta2, sqrt(bc2), eps, -lr/bc1 */
    const __m256 wd = bc(sc[0]), w = bc(sc[1]), beta2 = bc(sc[2]), c2 = bc(sc[3]), bc2 = bc(sc[4]),
                 eps = bc(sc[5]), neg_step = bc(sc[6]);
    for (int64_t i = lo; i < hi; i += 8) {
        __m256 pv = _mm256_loadu_ps(p + i), gv = _mm256_loadu_ps(g + i);
        __m256 mv = _mm256_loadu_ps(m + i), vv = _mm256_loadu_ps(v + i);
        __m256 p0 = pv, gsq = gv;  /* gsq: the gradient squared into exp_avg_sq */
        const int l2 = (flags & F_DECAY) && !(flags & F_ADAMW);
        if (l2) gv = (flags & F_MAXIMIZE) ? _mm256_fmsub_ps(pv, wd, gv) : _mm256_fmadd_ps(pv, wd, gv);
        else if (flags & F_MAXIMIZE) gv = neg(gv);
        if (l2) gsq = gv;
        if ((flags & F_DECAY) && (flags & F_ADAMW)) p0 = _mm256_mul_ps(pv, wd);
        __m256 diff = _mm256_sub_ps(gv, mv);  /* exp_avg.lerp_(grad, 1 - beta1) */
        __m256 m1 = _mm256_fmadd_ps(w, diff, (flags & F_LERP_SMALL) ? mv : gv);
        __m256 v1 = _mm256_fmadd_ps(_mm256_mul_ps(c2, gsq), gsq, _mm256_mul_ps(vv, beta2));
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v1), bc2), eps);
        __m256 p1 = _mm256_add_ps(p0, _mm256_div_ps(_mm256_mul_ps(neg_step, m1), denom));
        _mm256_storeu_ps(p + i, p1);
        _mm256_storeu_ps(m + i, m1);
        _mm256_storeu_ps(v + i, v1);
        if (skind) store_shadow(shadow, i, p1, skind, stream);
    }
}

static void sgd_range(int flags, const float *sc, float *p, const float *g, float *b, void *shadow, int skind,
                      int stream, int64_t lo, int64_t hi) {
    /* sc: wd, momentum, 1 - dampening, -lr */
    const __m256 wd = bc(sc[0]), mom = bc(sc[1]), damp1 = bc(sc[2]), neg_lr = bc(sc[3]);
    for (int64_t i = lo; i < hi; i += 8) {
        __m256 pv = _mm256_loadu_ps(p + i), gv = _mm256_loadu_ps(g + i);
        if (flags & F_MAXIMIZE) gv = neg(gv);
        if (flags & F_DECAY) gv = _mm256_fmadd_ps(pv, wd, gv);
        if (flags & F_MOMENTUM) {
            __m256 b1 = _mm256_fmadd_ps(damp1, gv, _mm256_mul_ps(_mm256_loadu_ps(b + i), mom));
            _mm256_storeu_ps(b + i, b1);
            gv = (flags & F_NESTEROV) ? _mm256_fmadd_ps(b1, mom, gv) : b1;
        }
        __m256 p1 = _mm256_fmadd_ps(gv, neg_lr, pv);
        _mm256_storeu_ps(p + i, p1);
        if (skind) store_shadow(shadow, i, p1, skind, stream);
    }
}

static void adagrad_range(int flags, const float *sc, float *p, const float *g, float *acc, void *shadow, int skind,
                          int stream, int64_t lo, int64_t hi) {
    /* sc: wd, eps, lr / (1 + (step - 1) * lr_decay) */
    const __m256 wd = bc(sc[0]), eps = bc(sc[1]), clr = bc(sc[2]);
    for (int64_t i = lo; i < hi; i += 8) {
        __m256 pv = _mm256_loadu_ps(p + i), gv = _mm256_loadu_ps(g + i);
        if (flags & F_DECAY) gv = (flags & F_MAXIMIZE) ? _mm256_fmsub_ps(pv, wd, gv) : _mm256_fmadd_ps(pv, wd, gv);
        else if (flags & F_MAXIMIZE) gv = neg(gv);
        __m256 a1 = _mm256_fmadd_ps(gv, gv, _mm256_loadu_ps(acc + i));
        __m256 p1 = _mm256_sub_ps(pv, _mm256_div_ps(_mm256_mul_ps(clr, gv), _mm256_add_ps(_mm256_sqrt_ps(a1), eps)));
        _mm256_storeu_ps(p + i, p1);
        _mm256_storeu_ps(acc + i, a1);
        if (skind) store_shadow(shadow, i, p1, skind, stream);
    }
}

/* One tensor: p, g and the state (s1: exp_avg / momentum buffer / sum; s2: exp_avg_sq) over n
 * elements, the shadow (skind 0: none) written as it goes; n a multiple of 8, split over up to
 * nthreads OpenMP threads in ranges of whole 64-element units. Returns 0, or -1 for bad input. */
int la_step(int kind, int flags, const float *sc, float *p, const float *g, float *s1, float *s2,
            void *shadow, int skind, int64_t n, int nthreads) {
    if (n % 8 || (skind && !shadow) || kind < KIND_ADAM || kind > KIND_ADAGRAD) return -1;
    /* the stream stores need 16-byte aligned destinations; an odd view keeps ordinary stores */
    const int stream = skind && ((uintptr_t)shadow % 16 == 0);
    const int64_t units = (n + 63) / 64;
    if (nthreads < 1 || n < (1 << 16)) nthreads = 1;
    if (nthreads > units) nthreads = (int)units;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t lo = units * t / nt * 64, hi = units * (t + 1) / nt * 64;
        if (hi > n) hi = n;
        if (lo < hi) {
            if (kind == KIND_ADAM) adam_range(flags, sc, p, g, s1, s2, shadow, skind, stream, lo, hi);
            else if (kind == KIND_SGD) sgd_range(flags, sc, p, g, s1, shadow, skind, stream, lo, hi);
            else adagrad_range(flags, sc, p, g, s1, shadow, skind, stream, lo, hi);
        }
        if (stream) _mm_sfence();  /* the streamed lines are visible before the caller reads them */
    }
    return 0;
}
