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
 * The gradient is read as fp32, or as the bf16 tensor an fp32 gradient was widened from (gk 1): the
 * widening is exact (the bf16 bits are the fp32's upper half), so the update is the same bit for bit,
 * and the step reads 2 B a parameter less: 28 B for AdamW with its shadow, as torch's kernel without.
 *
 * n is a multiple of 8; the caller keeps torch's kernel for the rest of each tensor.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

enum { KIND_ADAM = 0, KIND_SGD = 1, KIND_ADAGRAD = 2 };
enum { F_DECAY = 1, F_MAXIMIZE = 2, F_ADAMW = 4, F_LERP_SMALL = 8, F_MOMENTUM = 16, F_NESTEROV = 32 };
enum { SHADOW_BF16 = 1, SHADOW_FP16 = 2 };
enum { GRAD_FP32 = 0, GRAD_BF16 = 1 };

/* 8 gradients at element i; gk a constant wherever this is inlined (one copy of each loop per gradient dtype) */
static inline __attribute__((always_inline)) __m256 load_grad(const void *g, int64_t i, int gk) {
    if (gk == GRAD_BF16)  /* torch's cvtbf16_fp32: the 16 bits shifted into the upper half */
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i))), 16));
    return _mm256_loadu_ps((const float *)g + i);
}

static inline __m256 bc(float x) { return _mm256_set1_ps(x); }
/* maximize's grad * -1. Values: any form gives the same. NaNs: torch's build (gcc, no -ffast-math) folds
 * x * -1 into a flip of the sign bit, -g + p * wd into fmsub(p, wd, g) (which keeps g's NaN as it is) and,
 * in the loop it runs on several threads, (c * -g) * -g into (c * g) * g; the forms below are those (its
 * one-thread loop squares -g: a NaN gradient's NaN in exp_avg_sq has the other sign there). */
static inline __m256 neg(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }

/* torch's cvtfp32_bf16 (vec256_bfloat16.h), bits in the low half of each 32-bit lane: round to
 * nearest even, NaN -> 0xffff (a NaN's lanes are or-ed with all ones before the shift) */
static inline __m256i bf16_lanes(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i t = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    t = _mm256_or_si256(t, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    return _mm256_srli_epi32(t, 16);
}

/* the shadows of 16 elements (a: the first 8), one 32-byte store */
static inline void store_shadow16(void *shadow, int64_t i, __m256 a, __m256 b, int kind, int stream) {
    __m256i h;
    if (kind == SHADOW_BF16) {  /* pack the two halves' lanes in order: a0-3 b0-3 a4-7 b4-7 -> a0-7 b0-7 */
        h = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_lanes(a), bf16_lanes(b)), 0xd8);
    } else {
        h = _mm256_set_m128i(_mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
    }
    __m256i *dst = (__m256i *)((uint16_t *)shadow + i);
    if (stream) _mm256_stream_si256(dst, h); else _mm256_storeu_si256(dst, h);
}

/* the shadows of 8 elements (a range's last 8, where its length is an odd multiple of 8) */
static inline void store_shadow8(void *shadow, int64_t i, __m256 a, int kind) {
    __m128i h;
    if (kind == SHADOW_BF16) {
        __m256i t = bf16_lanes(a);
        h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(t, t), 0xd8));
    } else {
        h = _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT);
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)shadow + i), h);
}

/* Each update steps the 8 elements at i and returns the new parameters. */

typedef struct { __m256 wd, w, beta2, c2, bc2, eps, neg_step; } adam_k;

static inline __m256 adam8(const adam_k *k, int flags, int gk, float *p, const void *g, float *m, float *v, int64_t i) {
    __m256 pv = _mm256_loadu_ps(p + i), gv = load_grad(g, i, gk);
    __m256 mv = _mm256_loadu_ps(m + i), vv = _mm256_loadu_ps(v + i);
    __m256 p0 = pv, gsq = gv;  /* gsq: the gradient squared into exp_avg_sq */
    const int l2 = (flags & F_DECAY) && !(flags & F_ADAMW);
    if (l2) gv = (flags & F_MAXIMIZE) ? _mm256_fmsub_ps(pv, k->wd, gv) : _mm256_fmadd_ps(pv, k->wd, gv);
    else if (flags & F_MAXIMIZE) gv = neg(gv);
    if (l2) gsq = gv;
    if ((flags & F_DECAY) && (flags & F_ADAMW)) p0 = _mm256_mul_ps(pv, k->wd);
    __m256 diff = _mm256_sub_ps(gv, mv);  /* exp_avg.lerp_(grad, 1 - beta1) */
    __m256 m1 = _mm256_fmadd_ps(k->w, diff, (flags & F_LERP_SMALL) ? mv : gv);
    __m256 v1 = _mm256_fmadd_ps(_mm256_mul_ps(k->c2, gsq), gsq, _mm256_mul_ps(vv, k->beta2));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v1), k->bc2), k->eps);
    __m256 p1 = _mm256_add_ps(p0, _mm256_div_ps(_mm256_mul_ps(k->neg_step, m1), denom));
    _mm256_storeu_ps(p + i, p1);
    _mm256_storeu_ps(m + i, m1);
    _mm256_storeu_ps(v + i, v1);
    return p1;
}

typedef struct { __m256 wd, mom, damp1, neg_lr; } sgd_k;

static inline __m256 sgd8(const sgd_k *k, int flags, int gk, float *p, const void *g, float *b, int64_t i) {
    __m256 pv = _mm256_loadu_ps(p + i), gv = load_grad(g, i, gk);
    if (flags & F_MAXIMIZE) gv = neg(gv);
    if (flags & F_DECAY) gv = _mm256_fmadd_ps(pv, k->wd, gv);
    if (flags & F_MOMENTUM) {
        __m256 b1 = _mm256_fmadd_ps(k->damp1, gv, _mm256_mul_ps(_mm256_loadu_ps(b + i), k->mom));
        _mm256_storeu_ps(b + i, b1);
        gv = (flags & F_NESTEROV) ? _mm256_fmadd_ps(b1, k->mom, gv) : b1;
    }
    __m256 p1 = _mm256_fmadd_ps(gv, k->neg_lr, pv);
    _mm256_storeu_ps(p + i, p1);
    return p1;
}

typedef struct { __m256 wd, eps, clr; } adagrad_k;

static inline __m256 adagrad8(const adagrad_k *k, int flags, int gk, float *p, const void *g, float *acc, int64_t i) {
    __m256 pv = _mm256_loadu_ps(p + i), gv = load_grad(g, i, gk);
    if (flags & F_DECAY) gv = (flags & F_MAXIMIZE) ? _mm256_fmsub_ps(pv, k->wd, gv) : _mm256_fmadd_ps(pv, k->wd, gv);
    else if (flags & F_MAXIMIZE) gv = neg(gv);
    __m256 a1 = _mm256_fmadd_ps(gv, gv, _mm256_loadu_ps(acc + i));
    __m256 p1 = _mm256_sub_ps(pv, _mm256_div_ps(_mm256_mul_ps(k->clr, gv), _mm256_add_ps(_mm256_sqrt_ps(a1), k->eps)));
    _mm256_storeu_ps(p + i, p1);
    _mm256_storeu_ps(acc + i, a1);
    return p1;
}

/* Software prefetch of each stream read, PREFETCH_AHEAD elements (2 KiB) ahead: on one core of the 2-core
 * AMD EPYC this took the update with its bf16 shadow from 0.86-1.00x to 0.91-1.08x torch's fused AdamW
 * (50M parameters of GPT blocks, noisy shared machine); prefetching past an array's end is harmless (no fault). */
#define PREFETCH_AHEAD 512
static inline void prefetch(const float *x) { _mm_prefetch((const char *)(x + PREFETCH_AHEAD), _MM_HINT_T0); }
static inline void prefetch_grad(const void *g, int64_t j, int gk) {
    _mm_prefetch((const char *)g + (j + PREFETCH_AHEAD) * (gk == GRAD_BF16 ? 2 : 4), _MM_HINT_T0);
}

/* [lo, hi) of one tensor, 16 elements (a 64-byte line of each stream) an iteration: two updates, one
 * 32-byte shadow store. (32 elements an iteration, the shadow's whole line in two back-to-back stores, was
 * no better: 0.89-1.04x the speed of torch's fused AdamW against 0.96-1.01x this way over six runs, both
 * reading bf16 gradients, one core, the 16 matrices of GPT blocks of width 768 and of width 1024.) */
#define RANGE(UPDATE, PREFETCH)                                                   \
    int64_t i = lo;                                                               \
    for (; i + 16 <= hi; i += 16) {                                               \
        PREFETCH(i);                                                              \
        __m256 first_ = UPDATE(i), second_ = UPDATE(i + 8);                       \
        if (skind) store_shadow16(shadow, i, first_, second_, skind, stream);     \
    }                                                                             \
    if (i < hi) {                                                                 \
        __m256 last_ = UPDATE(i);                                                 \
        if (skind) store_shadow8(shadow, i, last_, skind);                        \
    }

/* Each range function is inlined into one copy per flag set (the dispatchers below), so that the loop
 * tests no flag per element: with the flags read at run time gcc kept their branches in the loop. On the
 * 16 weight matrices of docs/offload.md's in-fit GPT (one core, 30 rounds in random order) AdamW with its
 * bf16 shadow took 1.03x torch's fused kernel that way, 0.99x with the flags constant (inside the fit,
 * where the loop waits on memory, both 1.07-1.10x: the shadow's 2 B a parameter). */
#define RANGE_FN static inline __attribute__((always_inline)) void

RANGE_FN adam_range_f(int flags, int gk, const float *sc, float *p, const void *g, float *m, float *v,
                      void *shadow, int skind, int stream, int64_t lo, int64_t hi) {
    /* sc: wd (AdamW: 1 - lr*wd), lerp weight (w or w - 1), beta2, 1 - beta2, sqrt(bc2), eps, -lr/bc1 */
    const adam_k k = {bc(sc[0]), bc(sc[1]), bc(sc[2]), bc(sc[3]), bc(sc[4]), bc(sc[5]), bc(sc[6])};
#define ADAM8(j) adam8(&k, flags, gk, p, g, m, v, (j))
#define ADAM_PREFETCH(j) (prefetch(p + (j)), prefetch_grad(g, (j), gk), prefetch(m + (j)), prefetch(v + (j)))
    RANGE(ADAM8, ADAM_PREFETCH)
}

RANGE_FN sgd_range_f(int flags, int gk, const float *sc, float *p, const void *g, float *b, void *shadow, int skind,
                     int stream, int64_t lo, int64_t hi) {
    /* sc: wd, momentum, 1 - dampening, -lr */
    const sgd_k k = {bc(sc[0]), bc(sc[1]), bc(sc[2]), bc(sc[3])};
#define SGD8(j) sgd8(&k, flags, gk, p, g, b, (j))
#define SGD_PREFETCH(j) (prefetch(p + (j)), prefetch_grad(g, (j), gk), (flags & F_MOMENTUM) ? prefetch(b + (j)) : (void)0)
    RANGE(SGD8, SGD_PREFETCH)
}

RANGE_FN adagrad_range_f(int flags, int gk, const float *sc, float *p, const void *g, float *acc, void *shadow, int skind,
                         int stream, int64_t lo, int64_t hi) {
    /* sc: wd, eps, lr / (1 + (step - 1) * lr_decay) */
    const adagrad_k k = {bc(sc[0]), bc(sc[1]), bc(sc[2])};
#define ADAGRAD8(j) adagrad8(&k, flags, gk, p, g, acc, (j))
#define ADAGRAD_PREFETCH(j) (prefetch(p + (j)), prefetch_grad(g, (j), gk), prefetch(acc + (j)))
    RANGE(ADAGRAD8, ADAGRAD_PREFETCH)
}

/* the dispatchers: one case per combination of the flags each update reads and gradient dtype, each a constant
 * in its copy */
#define CASE(RANGE_F, F, ...) case (F): RANGE_F((F), __VA_ARGS__); return;
#define CASES4(RANGE_F, A, B, ...) CASE(RANGE_F, 0, __VA_ARGS__) CASE(RANGE_F, A, __VA_ARGS__) \
    CASE(RANGE_F, B, __VA_ARGS__) CASE(RANGE_F, (A) | (B), __VA_ARGS__)
#define CASES16(RANGE_F, A, B, C, D, ...) CASES4(RANGE_F, A, B, __VA_ARGS__) \
    CASE(RANGE_F, C, __VA_ARGS__) CASE(RANGE_F, (C) | (A), __VA_ARGS__) CASE(RANGE_F, (C) | (B), __VA_ARGS__) \
    CASE(RANGE_F, (C) | (A) | (B), __VA_ARGS__) \
    CASE(RANGE_F, D, __VA_ARGS__) CASE(RANGE_F, (D) | (A), __VA_ARGS__) CASE(RANGE_F, (D) | (B), __VA_ARGS__) \
    CASE(RANGE_F, (D) | (A) | (B), __VA_ARGS__) \
    CASE(RANGE_F, (D) | (C), __VA_ARGS__) CASE(RANGE_F, (D) | (C) | (A), __VA_ARGS__) \
    CASE(RANGE_F, (D) | (C) | (B), __VA_ARGS__) CASE(RANGE_F, (D) | (C) | (A) | (B), __VA_ARGS__)

/* one dispatcher per update and gradient dtype: a single function holding both dtypes' 16 copies took gcc
 * ten times as long to compile (13 s against 1.5 s) */
#define DISPATCHERS(GK, SUFFIX)                                                                                  \
static void adam_range_##SUFFIX(int flags, const float *sc, float *p, const void *g, float *m, float *v,        \
                                void *shadow, int skind, int stream, int64_t lo, int64_t hi) {                   \
    switch (flags & (F_DECAY | F_MAXIMIZE | F_ADAMW | F_LERP_SMALL)) {                                           \
        CASES16(adam_range_f, F_DECAY, F_MAXIMIZE, F_ADAMW, F_LERP_SMALL, GK, sc, p, g, m, v, shadow, skind, stream, lo, hi) \
    }                                                                                                            \
}                                                                                                                \
static void sgd_range_##SUFFIX(int flags, const float *sc, float *p, const void *g, float *b, void *shadow,     \
                               int skind, int stream, int64_t lo, int64_t hi) {                                  \
    switch (flags & (F_DECAY | F_MAXIMIZE | F_MOMENTUM | F_NESTEROV)) {                                          \
        CASES16(sgd_range_f, F_DECAY, F_MAXIMIZE, F_MOMENTUM, F_NESTEROV, GK, sc, p, g, b, shadow, skind, stream, lo, hi) \
    }                                                                                                            \
}                                                                                                                \
static void adagrad_range_##SUFFIX(int flags, const float *sc, float *p, const void *g, float *acc, void *shadow, \
                                   int skind, int stream, int64_t lo, int64_t hi) {                              \
    switch (flags & (F_DECAY | F_MAXIMIZE)) {                                                                    \
        CASES4(adagrad_range_f, F_DECAY, F_MAXIMIZE, GK, sc, p, g, acc, shadow, skind, stream, lo, hi)           \
    }                                                                                                            \
}

DISPATCHERS(GRAD_FP32, fp32)
DISPATCHERS(GRAD_BF16, bf16)

static void step_range(int kind, int flags, int gk, const float *sc, float *p, const void *g, float *s1, float *s2,
                       void *shadow, int skind, int stream, int64_t lo, int64_t hi) {
    if (gk == GRAD_BF16) {
        if (kind == KIND_ADAM) adam_range_bf16(flags, sc, p, g, s1, s2, shadow, skind, stream, lo, hi);
        else if (kind == KIND_SGD) sgd_range_bf16(flags, sc, p, g, s1, shadow, skind, stream, lo, hi);
        else adagrad_range_bf16(flags, sc, p, g, s1, shadow, skind, stream, lo, hi);
    } else {
        if (kind == KIND_ADAM) adam_range_fp32(flags, sc, p, g, s1, s2, shadow, skind, stream, lo, hi);
        else if (kind == KIND_SGD) sgd_range_fp32(flags, sc, p, g, s1, shadow, skind, stream, lo, hi);
        else adagrad_range_fp32(flags, sc, p, g, s1, shadow, skind, stream, lo, hi);
    }
}

/* One tensor: p, g (gk: fp32 or bf16) and the state (s1: exp_avg / momentum buffer / sum; s2: exp_avg_sq)
 * over n elements, the shadow (skind 0: none) written as it goes; n a multiple of 8, split over up to
 * nthreads OpenMP threads in ranges of whole 64-element units (each range starts 128 bytes into
 * the shadow past the previous one: a 32-byte aligned shadow stays aligned). Returns 0, or -1 for bad input. */
int la_step(int kind, int flags, const float *sc, float *p, const void *g, int gk, float *s1, float *s2,
            void *shadow, int skind, int64_t n, int nthreads) {
    if (n % 8 || (skind && !shadow) || kind < KIND_ADAM || kind > KIND_ADAGRAD || (gk != GRAD_FP32 && gk != GRAD_BF16)) return -1;
    /* the stream stores need 32-byte aligned destinations; another view keeps ordinary stores */
    const int stream = skind && ((uintptr_t)shadow % 32 == 0);
    const int64_t units = (n + 63) / 64;
    if (nthreads < 1 || n < (1 << 16)) nthreads = 1;
    if (nthreads > units) nthreads = (int)units;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t lo = units * t / nt * 64, hi = units * (t + 1) / nt * 64;
        if (hi > n) hi = n;
        if (lo < hi) step_range(kind, flags, gk, sc, p, g, s1, s2, shadow, skind, stream, lo, hi);
        if (stream) _mm_sfence();  /* the streamed lines are visible before the caller reads them */
    }
    return 0;
}
