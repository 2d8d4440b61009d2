/* kiln's native decoding step: the MoE trunk for a batch of sequences and a few tokens each, in
 * plain C, with fp32 activations and fp32 or bf16 weight matrices.
 *
 * Decoding a tiny model one token at a time on a CPU costs hundreds of small tensor ops per token,
 * each a dispatch; this does the same math (kiln/model/moe.py; also Qwen3 dense and Llama, whose
 * layers are the same block without experts or q/k norms) in one call, straight from the model's
 * own parameter memory. A call takes B sequences (cache slots) of up to T tokens each (T each, or
 * each row its own count) and streams every weight once for all their tokens: each weight row is
 * loaded from memory once and its dot products with every input vector are computed before the next
 * row (up to four together from registers with AVX-512; one at a time, the row staying in L1, where
 * there are fewer registers), and the MoE groups the call's tokens by expert, so an expert's
 * weights are read once whichever rows chose it.
 *
 * Every output keeps one fixed accumulation order, whatever else shares the call: a dot product
 * is the same sequence of vector FMAs whether its row is paired with one input or four, a token's
 * attention reads its own slot in the same order, and a token's experts are added in the order the
 * router ranked them. So a batched call is bit-identical to one-row calls, and a k-token call
 * (speculative verification) to k one-token calls (plain decoding).
 *
 * bf16 weights (Model.wbf16) are widened to fp32 in registers as they are loaded: a bf16 value is
 * the upper half of an fp32, so widening is exact and a bf16 call is bit-identical to an fp32 call
 * on the same (rounded) values, and it reads half the bytes. The arithmetic stays fp32 (AVX-512
 * BF16's dot-product instruction would also round the activations to bf16).
 *
 * Built by kiln/engine/native.py with the system C compiler; no Python or torch headers. The
 * vectors are GCC/Clang vector extensions of the CPU's widest registers (VW below).
 */
#define _GNU_SOURCE /* sched_getaffinity */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

/* Weight matrices (void: fp32, or bf16 when wbf16) and fp32 norm weights; the embedding and output
 * head are bf16 when ebf16 (equal to wbf16 but in a bf16 drafter over an fp32 model, whose own
 * matrices are bf16 and whose embedding and head are the model's). */
typedef struct {
    int n_layers, dim, n_heads, n_kv_heads, head_dim, n_experts, top_k, moe_inner, dense_inner;
    int norm_topk, max_tokens, wbf16, ebf16;
    float eps;
    const void *embed, *head;
    const float *inv_freq;
    /* per layer (arrays of n_layers pointers); a layer is MoE when router[l] is not NULL; q_norm and
     * k_norm are NULL for a family without them */
    const float **ln1, **q_norm, **k_norm, **ln2;
    const void **wq, **wk, **wv, **wo;
    const void **router, **gate_up, **down;  /* MoE: [E, D], [E, 2I, D], [E, D, I] */
    const void **gate, **up, **down_dense;   /* dense SwiGLU: [I, D], [I, D], [D, I] */
    const float **hnorm, **enorm;             /* MTP layers only: [D], [D] */
    const void **eh_proj;                     /* MTP layers only: [D, 2D] */
} Model;

/* Vectors are the widest the target has (VW floats: AVX-512, AVX or 128-bit SSE/NEON); wider generic
 * vectors than the target's registers are kept in memory by GCC, which made every product here
 * ~10x slower on AVX2. The arithmetic is defined over 16-float chunks, each PARTS native vectors, and
 * every lane does the same operations in the same order whatever VW is: sums across lanes use
 * one fixed tree over the 16 lanes (hsum), so results do not depend on the vector width. */
#if defined(KILN_VW) /* a test forces another width: 4, 8 or 16 (wider than the CPU's is emulated) */
#define VW KILN_VW
#elif defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define PARTS (16 / VW)
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#define INLINE static inline __attribute__((always_inline))
/* input vectors sharing one pass over a weight row: their 4 x PARTS accumulators each stay in
 * registers (32 with AVX-512, 16 with AVX); a row reread from L1 for the next input costs little */
#define MAX_BLOCK (VW == 16 ? 4 : 1)

INLINE vf loadv(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

INLINE void storev(float *p, vf x) { memcpy(p, &x, sizeof x); }

/* VW weights from element i of an fp32 (BF = 0) or bf16 (BF = 1) matrix, as fp32. */
INLINE vf loadw(const void *w, int64_t i, const int BF) {
    if (!BF) return loadv((const float *)w + i);
    vh h;
    memcpy(&h, (const uint16_t *)w + i, sizeof h);
    return (vf)(__builtin_convertvector(h, vi) << 16);
}

INLINE float weight_at(const void *w, int64_t i, const int BF) {
    if (!BF) return ((const float *)w)[i];
    uint32_t u = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* n floats into the cache, rounded to bf16 to nearest even as torch's .to(bfloat16) does (finite values). */
static void store_kv(void *dst, const float *src, int n, int bf) {
    if (!bf) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, sizeof u);
        d[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* n bf16 values as fp32 (exact), n a multiple of VW. */
static void widen_bf16(float *dst, const void *src, int64_t n) {
    for (int64_t i = 0; i < n; i += VW) storev(dst + i, loadw(src, i, 1));
}

/* The address of element i of an fp32 or (bf) bf16 array: a weight matrix, or the KV cache. */
INLINE void *elem_ptr(const void *w, int64_t i, int bf) {
    return (char *)w + i * (bf ? 2 : 4);
}

INLINE vf selectv(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* The sum of a 16-float chunk held as PARTS vectors: lanes l and l + 8, then l and l + 4, then
 * l and l + 2, then the pair. */
INLINE float hsum(const vf *s) {
#if VW == 16
    v8 a = __builtin_shufflevector(s[0], s[0], 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(s[0], s[0], 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif VW == 8
    v8 a = s[0] + s[1];
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
    v4 b = (s[0] + s[2]) + (s[1] + s[3]);
#endif
    return (b[0] + b[2]) + (b[1] + b[3]);
}

#if VW == 16
/* hsum of each of 16 chunks, lane k of the result from s[k], by hsum's own tree (lanes l and l + 8,
 * then l and l + 4, then (0 + 2) + (1 + 3)), each level for all 16 at once: 15 adds where 16 hsums
 * take 64 instructions. Products' row blocks and attention's 16-key score blocks use it. */
INLINE vf hsum16(const vf *s) {
    vf y[8], z[4], w[2];
    for (int k = 0; k < 8; k++)
        y[k] = __builtin_shufflevector(s[2 * k], s[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(s[2 * k], s[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int k = 0; k < 4; k++)
        z[k] = __builtin_shufflevector(y[2 * k], y[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(y[2 * k], y[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int k = 0; k < 2; k++)
        w[k] = __builtin_shufflevector(z[2 * k], z[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
               + __builtin_shufflevector(z[2 * k], z[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
           + __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

/* The chunk sums of w . x_v for v < NV, x_v = x + v * xs, over the first n / 16 * 16 floats (w fp32
 * or, BF, bf16): four 16-float accumulators over 64-float strides, then 16-float steps, combined into
 * one 16-float chunk s[v] (PARTS vectors) that dotv reduces. */
INLINE void dotv_sums(const void *w, const int BF, const float *x, int64_t xs, const int NV, int n,
                      vf s[][PARTS]) {
    vf acc[MAX_BLOCK][4 * PARTS];
    for (int v = 0; v < NV; v++)
        for (int j = 0; j < 4 * PARTS; j++) acc[v][j] = (vf){0};
    int i = 0;
    for (; i + 64 <= n; i += 64)
        for (int j = 0; j < 4 * PARTS; j++) {
            vf wj = loadw(w, i + j * VW, BF);
            for (int v = 0; v < NV; v++) acc[v][j] += wj * loadv(x + v * xs + i + j * VW);
        }
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < PARTS; j++) {
            vf wj = loadw(w, i + j * VW, BF);
            for (int v = 0; v < NV; v++) acc[v][j] += wj * loadv(x + v * xs + i + j * VW);
        }
    for (int v = 0; v < NV; v++)
        for (int j = 0; j < PARTS; j++)
            s[v][j] = (acc[v][j] + acc[v][PARTS + j]) + (acc[v][2 * PARTS + j] + acc[v][3 * PARTS + j]);
}

/* out[v * os] = w . x_v for v < NV: dotv_sums, a fixed reduction (hsum), then a scalar tail. Per v the
 * arithmetic is fixed, so the result does not depend on NV or on which other vectors share the pass. */
INLINE void dotv(const void *w, const int BF, const float *x, int64_t xs, const int NV, int n, float *out,
                 int64_t os) {
    vf s[MAX_BLOCK][PARTS];
    dotv_sums(w, BF, x, xs, NV, n, s);
    const int i = n / 16 * 16;
    /* The scalar tail reads fp32 either way: bf16 weights widened into a buffer first (converting
     * inside the loop let GCC vectorise it, rounding each product before the in-order sum). */
    float tail[16];
    const float *wt = BF ? tail : (const float *)w + i;
    for (int k = i; BF && k < n; k++) tail[k - i] = weight_at(w, k, BF);
    for (int v = 0; v < NV; v++) {
        float r = hsum(s[v]);
        for (int k = i; k < n; k++) r += wt[k - i] * x[v * xs + k];
        out[v * os] = r;
    }
}

INLINE void dots_as(const void *w, const int BF, const float *x, int64_t xs, int nv, int n, float *out,
                    int64_t os) {
    for (; nv >= MAX_BLOCK; nv -= MAX_BLOCK, x += MAX_BLOCK * xs, out += MAX_BLOCK * os)
        dotv(w, BF, x, xs, MAX_BLOCK, n, out, os);
#if MAX_BLOCK == 4
    switch (nv) {
    case 3: dotv(w, BF, x, xs, 3, n, out, os); break;
    case 2: dotv(w, BF, x, xs, 2, n, out, os); break;
    case 1: dotv(w, BF, x, xs, 1, n, out, os); break;
    default: break;
    }
#endif
}

/* dots_as over an fp32 or a bf16 row, each instantiated once. */
static void dots(const float *w, const float *x, int64_t xs, int nv, int n, float *out, int64_t os) {
    dots_as(w, 0, x, xs, nv, n, out, os);
}

static void dots_bf16(const void *w, const float *x, int64_t xs, int nv, int n, float *out, int64_t os) {
    dots_as(w, 1, x, xs, nv, n, out, os);
}

static float dot(const float *a, const float *b, int n) {
    float r;
    dotv(a, 0, b, 0, 1, n, &r, 0);
    return r;
}

/* Cephes' expf on each lane (about 1 ulp); inputs below -87.3 give 0. */
INLINE vf expv(vf x) {
    const vf hi = (vf){0} + 88.3762626647949f, lo = (vf){0} + -87.3365478515625f;
    vi under = x < lo;
    x = selectv(x > hi, hi, x);
    x = selectv(under, lo, x);
    vf fx = x * 1.44269504088896341f + 0.5f;
    vi fi = __builtin_convertvector(fx, vi);
    vf t = __builtin_convertvector(fi, vf);
    vi adjust = t > fx;
    t -= (vf)((vi)((vf){0} + 1.f) & adjust); /* floor */
    x = x - t * 0.693359375f;
    x = x - t * -2.12194440e-4f;
    vf z = x * x;
    vf y = 1.9875691500E-4f * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.f;
    vi e = (__builtin_convertvector(t, vi) + 127) << 23;
    vf r = y * (vf)e;
    return (vf)((vi)r & ~under);
}

/* ---- a helper thread for the larger pieces of work -------------------------------------------
 * One helper thread takes the second half of a range (rows of a large product, or the (sequence,
 * KV head) pairs of attention): decoding is bound by reading weights and caches from memory, which
 * one core does not saturate. It spins briefly between jobs (the pieces of one step follow each
 * other closely), then sleeps. Each unit's arithmetic is the same whichever thread does it, so
 * results do not depend on the split; units the helper has not claimed by the time the caller
 * finishes its half, the caller does itself. One caller at a time uses the helper; a concurrent
 * caller (another engine's thread) computes alone. A process confined to one CPU (an RL rollout
 * worker) starts no helper: it would only spin on the caller's core. */
#define SPLIT_MIN_WORK (64 * 1024)
#define SPIN_ROUNDS 20000

typedef void (*RangeFn)(void *ctx, int lo, int hi);
typedef struct { RangeFn fn; void *ctx; int lo, hi; } Job;

static struct {
    pthread_mutex_t use, mu;
    pthread_cond_t wake;
    atomic_int posted, claimed, done, sleeping;
    int started;
    Job job;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *helper(void *arg) {
    (void)arg;
    for (int seen = 0;;) {
        for (int spins = 0; atomic_load(&pool.posted) == seen; spins++) {
            if (spins < SPIN_ROUNDS) {
                relax();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            atomic_store(&pool.sleeping, 1);
            while (atomic_load(&pool.posted) == seen) pthread_cond_wait(&pool.wake, &pool.mu);
            atomic_store(&pool.sleeping, 0);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = atomic_load(&pool.posted);
        int expected = seen - 1;
        if (!atomic_compare_exchange_strong(&pool.claimed, &expected, seen)) continue;  /* the caller took it */
        Job j = pool.job;
        j.fn(j.ctx, j.lo, j.hi);
        atomic_store(&pool.done, seen);
    }
    return NULL;
}

/* A forked child has no helper thread (and maybe a lock some other thread held): start afresh. */
static void forget_helper(void) {
    pthread_mutex_t fresh_mutex = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    pool.use = pool.mu = fresh_mutex;
    pool.wake = fresh_cond;
    atomic_store(&pool.posted, 0);
    atomic_store(&pool.claimed, 0);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.sleeping, 0);
    pool.started = 0;
}

static int one_cpu(void) {
#ifdef CPU_COUNT
    cpu_set_t set;
    return sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) < 2;
#else
    return 0;
#endif
}

/* fn(ctx, 0, n), the upper half on the helper when the work is large enough. fn must tell the two
 * halves' scratch apart by lo (0 or not). */
static void parallel(RangeFn fn, void *ctx, int n, int64_t work) {
    if (n < 2 || work < SPLIT_MIN_WORK || pthread_mutex_trylock(&pool.use) != 0) {
        fn(ctx, 0, n);
        return;
    }
    if (!pool.started) {
        pthread_t th;
        pool.started = !one_cpu() && pthread_create(&th, NULL, helper, NULL) == 0 ? 1 : -1;
        if (pool.started == 1) {
            pthread_detach(th);
            static int registered;
            if (!registered) registered = pthread_atfork(NULL, NULL, forget_helper) == 0;
        }
    }
    if (pool.started != 1) {
        pthread_mutex_unlock(&pool.use);
        fn(ctx, 0, n);
        return;
    }
    int mid = n / 2, seq = atomic_load(&pool.posted) + 1;
    pool.job = (Job){fn, ctx, mid, n};
    atomic_store(&pool.posted, seq);
    if (atomic_load(&pool.sleeping)) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_signal(&pool.wake);
        pthread_mutex_unlock(&pool.mu);
    }
    fn(ctx, 0, mid);
    int expected = seq - 1;  /* a helper not yet awake (waking costs more than the work): do it here */
    if (atomic_compare_exchange_strong(&pool.claimed, &expected, seq))
        fn(ctx, mid, n);
    else
        while (atomic_load(&pool.done) != seq) relax();
    pthread_mutex_unlock(&pool.use);
}

/* ---- products ---------------------------------------------------------------------------------- */
typedef struct { const void *w; const float *x; float *y; int cols, N, bf; int64_t xs, ys; } Product;

/* out [n] = row i of the weight matrix w ([.., n]; bf: bf16) as fp32. */
static void weight_row(const void *w, int bf, int64_t i, int n, float *out) {
    const void *row = elem_ptr(w, i * n, bf);
    if (!bf) {
        memcpy(out, row, (size_t)n * sizeof(float));
        return;
    }
    for (int j = 0; j < n; j++) out[j] = weight_at(row, j, 1);
}

#if VW == 16
/* dotv_sums of rows r..r+nr-1 (nr <= 16) of w [.., n] against x_v for v < NV: chunk k of input v in
 * s[v][k]. */
INLINE void block_sums(const void *w, const int BF, int n, const float *x, int64_t xs, const int NV, int r, int nr,
                       vf s[][16]) {
    for (int k = 0; k < nr; k++) {
        vf one[MAX_BLOCK][PARTS];
        dotv_sums(elem_ptr(w, (int64_t)(r + k) * n, BF), BF, x, xs, NV, n, one);
        for (int v = 0; v < NV; v++) s[v][k] = one[v][0];
    }
}

/* product_rows for rows a multiple of 16 floats long: the rows in blocks of 16, each block's 16
 * outputs per input reduced together (hsum16), the same bits as a row at a time. At the tiny
 * model's 256 columns a row's own reduction cost ~9 instructions against its 16 multiply-adds.
 * widen: the block's bf16 rows widened to fp32 once for all the passes over them. */
static void product_blocks(const Product *a, int r0, int r1, int widen) {
    vf s[MAX_BLOCK][16];
    float wide[widen ? 16 * a->cols : 1];
    for (int r = r0; r < r1; r += 16) {
        const int nr = r1 - r < 16 ? r1 - r : 16;
        for (int k = 0; widen && k < nr; k++) weight_row(a->w, 1, r + k, a->cols, wide + (int64_t)k * a->cols);
        const void *w = widen ? wide : a->w;
        const int bf = widen ? 0 : a->bf, at = widen ? 0 : r;
        for (int v0 = 0; v0 < a->N; v0 += MAX_BLOCK) {
            const int nv = a->N - v0 < MAX_BLOCK ? a->N - v0 : MAX_BLOCK;
            const float *x = a->x + v0 * a->xs;
            switch (nv * 2 + bf) {
#define CASE(NV, BF) case NV * 2 + BF: block_sums(w, BF, a->cols, x, a->xs, NV, at, nr, s); break;
            CASE(1, 0) CASE(2, 0) CASE(3, 0) CASE(4, 0) CASE(1, 1) CASE(2, 1) CASE(3, 1) CASE(4, 1)
#undef CASE
            default: break;
            }
            for (int v = 0; v < nv; v++) {
                for (int k = nr; k < 16; k++) s[v][k] = (vf){0};
                vf out = hsum16(s[v]);
                float *y = a->y + (v0 + v) * a->ys + r;
                if (nr == 16) storev(y, out);
                else for (int k = 0; k < nr; k++) y[k] = out[k];
            }
        }
    }
}
#endif

static void product_rows(void *c, int r0, int r1) {
    const Product *a = c;
    /* A bf16 row that several passes read is widened once (exact, so the same bits as widening
     * each load), rather than once per pass. */
    const int widen = a->bf && a->N > MAX_BLOCK;
#if VW == 16
    if (a->cols % 16 == 0) {
        product_blocks(a, r0, r1, widen);
        return;
    }
#endif
    float wide[widen ? a->cols : 1];
    for (int r = r0; r < r1; r++) {
        const void *row = elem_ptr(a->w, (int64_t)r * a->cols, a->bf);
        if (widen) {
            weight_row(a->w, 1, r, a->cols, wide);
            dots(wide, a->x, a->xs, a->N, a->cols, a->y + r, a->ys);
        } else if (a->bf) dots_bf16(row, a->x, a->xs, a->N, a->cols, a->y + r, a->ys);
        else dots(row, a->x, a->xs, a->N, a->cols, a->y + r, a->ys);
    }
}

/* Several products in one job (a layer's q, k and v, or every chosen expert's matrix): its units
 * are the parts' rows one after another, so one split with the helper covers them all (one wait
 * instead of one a matrix, and matrices too small to split alone are shared too). Each row's
 * arithmetic is product_rows' whatever the range, so the bits do not depend on the grouping. */
typedef struct { int parts; const Product *p; const int *start; } Products; /* part i: rows start[i].. */

static void products_rows(void *c, int r0, int r1) {
    const Products *a = c;
    for (int i = 0; i < a->parts; i++) {
        const int lo = r0 > a->start[i] ? r0 : a->start[i], hi = r1 < a->start[i + 1] ? r1 : a->start[i + 1];
        if (lo < hi) product_rows((void *)&a->p[i], lo - a->start[i], hi - a->start[i]);
    }
}

/* p[i]'s rows start[i]..start[i + 1] - 1: y_i[n * ys + r] = W_i[r] . x_i[n * xs] for n < N_i. Each
 * weight row is read from memory once for all of its part's inputs. */
static void products(const Product *p, const int *start, int parts) {
    int64_t floats = 0, work = 0;
    for (int i = 0; i < parts; i++) {
        floats += (int64_t)(start[i + 1] - start[i]) * p[i].cols;
        work += (int64_t)(start[i + 1] - start[i]) * p[i].cols * p[i].N;
    }
    Products a = {parts, p, start};
    parallel(products_rows, &a, start[parts], floats >= SPLIT_MIN_WORK || work >= 4 * SPLIT_MIN_WORK ? floats : 0);
}

/* y[n * ys + r] = W[r] . x[n * xs] for rows r < rows of the weight matrix W [rows, cols] (bf: bf16)
 * and n < N. */
static void matmul(int bf, const void *w, const float *x, int64_t xs, float *y, int64_t ys, int rows, int cols,
                   int N) {
    const Product a = {w, x, y, cols, N, bf, xs, ys};
    const int start[2] = {0, rows};
    products(&a, start, 1);
}

static void rms_norm(const float *x, const float *w, float *out, int n, float eps) {
    float ss = dot(x, x, n);
    float scale = 1.f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = w ? w[i] * (x[i] * scale) : x[i] * scale;
}

/* out[i] = silu(g[i]) * u[i] */
static void swiglu(const float *g, const float *u, float *out, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16)  /* 16-float chunks whatever VW is: the tail is scalar expf */
        for (int j = i; j < i + 16; j += VW) {
            vf x = loadv(g + j);
            storev(out + j, x / (1.f + expv(-x)) * loadv(u + j));
        }
    for (; i < n; i++) out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* Rotate-half RoPE of one head in place (HF's convention: pairs i and i + hd/2), from the token's
 * cos/sin table. */
static void rope(float *x, int hd, const float *cs, const float *sn) {
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        float c = cs[i], s = sn[i], a = x[i], b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

/* ---- scratch ------------------------------------------------------------------------------------
 * One call over N = B x T tokens uses, in floats: */
typedef struct { int64_t h, q, k, v, att, y, probs, xg, gu, act, route, rope, attn, attn_each, cat, total; } Layout;

static int64_t round16(int64_t n) { return (n + 15) & ~(int64_t)15; }

static Layout layout(const Model *m, int B, int T) {
    int64_t N = (int64_t)B * T, D = m->dim, Q = (int64_t)m->n_heads * m->head_dim;
    int64_t KVD = (int64_t)m->n_kv_heads * m->head_dim, K = m->top_k > 0 ? m->top_k : 1;
    int64_t inner = m->moe_inner > m->dense_inner ? m->moe_inner : m->dense_inner;
    int64_t group = m->n_heads / m->n_kv_heads, queries = T * group;
    Layout s;
    int64_t at = 0;
    s.h = at, at += round16(N * D);
    s.q = at, at += round16(N * Q);
    s.k = at, at += round16(N * KVD);
    s.v = at, at += round16(N * KVD);
    s.att = at, at += round16(N * Q);
    s.y = at, at += round16(N * K * D);          /* each (token, expert) output; o_proj and MLP outputs */
    s.probs = at, at += round16(N * m->n_experts);
    s.xg = at, at += round16(N * K * D);         /* inputs gathered for every chosen expert */
    s.gu = at, at += round16(N * K * 2 * inner);
    s.act = at, at += round16(N * K * inner);
    s.route = at, at += round16(3 * N * K);      /* chosen experts (int32), weights, gathered slots (int32) */
    s.rope = at, at += round16(N * m->head_dim); /* per token: cos then sin of each frequency */
    s.attn_each = round16(queries * m->head_dim) + queries * round16(m->max_tokens + 16) + round16(queries)
                  + 16 * m->head_dim + round16((int64_t)m->max_tokens * m->head_dim);
    /* per thread: gathered queries, their scores and sums, a block of keys, a head's values widened */
    s.attn = at, at += 2 * s.attn_each;
    s.cat = at, at += round16(N * 2 * D);        /* MTP: the normed hidden state and embedding */
    s.total = at;
    return s;
}

/* Scratch floats a call over B sequences of T tokens needs. */
int64_t kiln_scratch_floats(const Model *m, int B, int T) { return layout(m, B, T).total; }

/* ---- attention ------------------------------------------------------------------------------ */
typedef struct {
    int T, hd, group, n_heads, max_len, n_kv, max_tokens; /* T: the most tokens of any row */
    const int32_t *pos0, *off;
    const float *q;
    const void *kc, *vc; /* q [N, H*hd]; this layer's cache for sequence 0, fp32 or (kvbf) bf16 */
    int64_t slot_stride;
    float *att, *scratch; /* att [N, H*hd] */
    int64_t each;
    float scale;
    int kvbf;
} Attn;

/* acc over positions p < n of e[i][p] * v_p for NB queries at once (C 16-float chunks a head), then
 * divided by each query's sum. Per query the order is p = 0, 1, ... whatever NB is. Entries past a
 * query's own context are exactly 0 (adding 0 * v leaves a sum of positive terms unchanged). */
INLINE void attend_out(const int NB, const int C, const int BF, const float *e, int64_t ld, const void *vh, int n,
                       const float *sums, float *const *outs) {
    vf acc[4][8 * PARTS];
    for (int i = 0; i < NB; i++)
        for (int c = 0; c < C * PARTS; c++) acc[i][c] = (vf){0};
    for (int p = 0; p < n; p++) {
        vf vv[8 * PARTS];
        for (int c = 0; c < C * PARTS; c++) vv[c] = loadw(vh, (int64_t)p * C * 16 + VW * c, BF);
        for (int i = 0; i < NB; i++) {
            float w = e[i * ld + p];
            for (int c = 0; c < C * PARTS; c++) acc[i][c] += w * vv[c];
        }
    }
    for (int i = 0; i < NB; i++)
        for (int c = 0; c < C * PARTS; c++) storev(outs[i] + VW * c, acc[i][c] / sums[i]);
}

static void attend_out_any(int nb, int hd, int bf, const float *e, int64_t ld, const void *vh, int n,
                           const float *sums, float *const *outs) {
    switch (hd % 16 == 0 && hd <= 128 ? (nb * 16 + hd / 16) * 2 + bf : 0) {
#define CASE(NB, C) case (NB * 16 + C) * 2: attend_out(NB, C, 0, e, ld, vh, n, sums, outs); return; \
                    case (NB * 16 + C) * 2 + 1: attend_out(NB, C, 1, e, ld, vh, n, sums, outs); return;
    CASE(1, 1) CASE(1, 2) CASE(1, 4) CASE(1, 8) CASE(2, 1) CASE(2, 2) CASE(2, 4) CASE(2, 8)
    CASE(3, 1) CASE(3, 2) CASE(3, 4) CASE(3, 8) CASE(4, 1) CASE(4, 2) CASE(4, 4) CASE(4, 8)
#undef CASE
    default: break;
    }
    for (int i = 0; i < nb; i++) { /* a head size the vector cases do not cover */
        float *o = outs[i];
        for (int d = 0; d < hd; d++) o[d] = 0.f;
        for (int p = 0; p < n; p++) {
            float w = e[i * ld + p];
            for (int d = 0; d < hd; d++) o[d] += w * weight_at(vh, (int64_t)p * hd + d, bf);
        }
        for (int d = 0; d < hd; d++) o[d] /= sums[i];
    }
}

/* Scores of one query (C 16-float chunks, in registers) against 16 consecutive keys of hd floats:
 * scores[p] = q . k_p. Each key's 16 lane products are summed by hsum's tree (lanes l and l + 8,
 * then l and l + 4, then l and l + 2, then the pair), here for many keys at once by shuffles that
 * add the same pairs, so a score does not depend on the position of its block or on the other
 * keys. */
INLINE void scores16(const int C, const vf *q, const float *k, int hd, float scale, float *scores) {
#if VW == 16
    vf a[16];
    for (int j = 0; j < 16; j++) {
        const float *kj = k + (int64_t)j * hd;
        a[j] = q[0] * loadv(kj);
        for (int cc = 1; cc < C; cc++) a[j] += q[cc] * loadv(kj + 16 * cc);
    }
    storev(scores, hsum16(a) * scale);
#elif VW == 8
    for (int half = 0; half < 2; half++) {  /* 8 keys a pass: c holds lanes l + (l + 8) of key j */
        v8 c[8], d[4], e[2];
        for (int j = 0; j < 8; j++) {
            const float *kj = k + (int64_t)(8 * half + j) * hd;
            vf lo = q[0] * loadv(kj), hi = q[1] * loadv(kj + 8);
            for (int cc = 1; cc < C; cc++) {
                lo += q[2 * cc] * loadv(kj + 16 * cc);
                hi += q[2 * cc + 1] * loadv(kj + 16 * cc + 8);
            }
            c[j] = lo + hi;
        }
        for (int j = 0; j < 4; j++)
            d[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11)
                 + __builtin_shufflevector(c[2 * j], c[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
        for (int j = 0; j < 2; j++)
            e[j] = __builtin_shufflevector(d[2 * j], d[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13)
                 + __builtin_shufflevector(d[2 * j], d[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15);
        storev(scores + 8 * half, (__builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14)
                                   + __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15)) * scale);
    }
#else
    for (int p = 0; p < 16; p++) {
        const float *kp = k + (int64_t)p * hd;
        vf s[PARTS];
        for (int j = 0; j < PARTS; j++) {
            s[j] = q[j] * loadv(kp + VW * j);
            for (int cc = 1; cc < C; cc++) s[j] += q[cc * PARTS + j] * loadv(kp + 16 * cc + VW * j);
        }
        scores[p] = hsum(s) * scale;
    }
#endif
}

/* e[i * ld + p] = scale * (q_i . k_p) for the NQ queries qs [NQ, hd] and keys p < n of kh (fp32 or
 * (BF) bf16). A block of 16 keys is read in place (fp32) or from an fp32 copy in pad (16 * hd
 * floats): bf16 keys widened once for all the queries (exact, so a score's bits do not depend on
 * it), and the last block zero-padded. */
INLINE void scores_all(const int C, const int BF, const float *qs, int NQ, const void *kh, int n, int hd, float scale,
                       float *e, int64_t ld, float *pad) {
    for (int p0 = 0; p0 < n; p0 += 16) {
        const void *src = elem_ptr(kh, (int64_t)p0 * hd, BF);
        const float *k = src;
        const int64_t have = (int64_t)(p0 + 16 > n ? n - p0 : 16) * hd;
        if (BF || have < 16 * hd) {
            if (BF)
                widen_bf16(pad, src, have);
            else
                memcpy(pad, src, (size_t)have * sizeof(float));
            memset(pad + have, 0, (size_t)(16 * hd - have) * sizeof(float));
            k = pad;
        }
        for (int i = 0; i < NQ; i++) {
            vf q[8 * PARTS];
            for (int cc = 0; cc < C * PARTS; cc++) q[cc] = loadv(qs + (int64_t)i * hd + VW * cc);
            scores16(C, q, k, hd, scale, e + i * ld + p0);
        }
    }
}

/* Units u = (sequence b, KV head g): the group's query heads for each of the sequence's tokens
 * against its cache. Its token t sees positions 0..pos0+t of its own slot. */
static void attend_units(void *c, int lo, int hi) {
    const Attn *a = c;
    const int hd = a->hd, G = a->group, Q = a->n_heads * hd, most = a->T * G;
    const int64_t ld = round16(a->max_tokens + 16);
    float *qs = a->scratch + (lo ? a->each : 0), *e = qs + round16((int64_t)most * hd), *sums = e + most * ld;
    float *pad = sums + round16(most), *widened = pad + 16 * hd;
    for (int u = lo; u < hi; u++) {
        const int b = u / a->n_kv, g = u % a->n_kv, pos0 = a->pos0[b], first = a->off[b];
        const int T = a->off[b + 1] - first, NQ = T * G, nmax = pos0 + T;
        const int64_t at = b * a->slot_stride + (int64_t)g * a->max_len * hd;
        const void *kh = elem_ptr(a->kc, at, a->kvbf), *vh = elem_ptr(a->vc, at, a->kvbf);
        for (int t = 0; t < T; t++)
            memcpy(qs + (int64_t)t * G * hd, a->q + ((int64_t)first + t) * Q + (int64_t)g * G * hd,
                   (size_t)G * hd * sizeof(float));
        switch (hd % 16 == 0 && hd <= 128 ? hd / 16 : 0) {
#define SCORES(C) (a->kvbf ? scores_all(C, 1, qs, NQ, kh, nmax, hd, a->scale, e, ld, pad) \
                           : scores_all(C, 0, qs, NQ, kh, nmax, hd, a->scale, e, ld, pad))
        case 1: SCORES(1); break;
        case 2: SCORES(2); break;
        case 4: SCORES(4); break;
        case 8: SCORES(8); break;
#undef SCORES
        default:  /* a head size the vector cases do not cover */
            for (int p = 0; p < nmax; p++) {
                const void *kp = elem_ptr(kh, (int64_t)p * hd, a->kvbf);
                if (a->kvbf) dots_bf16(kp, qs, hd, NQ, hd, e + p, ld);
                else dots(kp, qs, hd, NQ, hd, e + p, ld);
            }
            for (int i = 0; i < NQ; i++)
                for (int p = 0; p < nmax; p++) e[i * ld + p] *= a->scale;
        }
        for (int i = 0; i < NQ; i++) {
            float *s = e + i * ld;
            const int n = pos0 + i / G + 1, padded = (int)round16(n);
            for (int p = n; p < padded; p++) s[p] = -INFINITY;
            vf mx = loadv(s);
            for (int p = VW; p < padded; p += VW) {
                vf x = loadv(s + p);
                mx = selectv(x > mx, x, mx);
            }
            float m = mx[0];
            for (int l = 1; l < VW; l++) m = mx[l] > m ? mx[l] : m;
            vf acc[PARTS] = {0};
            for (int p = 0; p < padded; p += 16)
                for (int j = 0; j < PARTS; j++) {
                    vf x = expv(loadv(s + p + VW * j) - m);
                    storev(s + p + VW * j, x);
                    acc[j] += x;
                }
            sums[i] = hsum(acc);
            for (int p = padded; p < nmax; p++) s[p] = 0.f;
        }
        /* bf16 values read by more than one pass: widened once (exact) */
        int bf = a->kvbf;
        if (bf && NQ > 4 && hd % 16 == 0) {
            widen_bf16(widened, vh, (int64_t)nmax * hd);
            vh = widened, bf = 0;
        }
        for (int i0 = 0; i0 < NQ; i0 += 4) {
            int nb = NQ - i0 < 4 ? NQ - i0 : 4;
            float *outs[4];
            for (int i = 0; i < nb; i++) {
                int t = (i0 + i) / G, h = g * G + (i0 + i) % G;
                outs[i] = a->att + ((int64_t)first + t) * Q + (int64_t)h * hd;
            }
            attend_out_any(nb, hd, bf, e + i0 * ld, ld, vh, pos0 + (i0 + nb - 1) / G + 1, sums + i0, outs);
        }
    }
}

/* ---- the decoder block ------------------------------------------------------------------------- */
typedef struct {
    int B, T, max_len;     /* T: the most tokens of any row */
    const int32_t *pos0, *off; /* row b: tokens off[b]..off[b + 1] - 1 at positions pos0[b].. */
    void *kc, *vc; /* this layer's cache, slot of sequence 0 */
    int64_t slot_stride;
    int bf;         /* the cache holds bf16 (else fp32) */
} Batch;

/* Decoder layer l over the batch's N = off[B] tokens, in place on hidden [N, D]. routes (may be
 * NULL): the chosen experts of token n at routes[n * route_stride + j]. */
/* need: NULL, or per token whether its output is used; a MoE layer skips the feed-forward of the
 * others (the drafter's last layer: its cache entries are all it keeps of them). */
static void block(const Model *m, int l, float *hidden, const Batch *bt, int32_t *routes, int route_stride,
                  float *scratch, const uint8_t *need) {
    const int D = m->dim, H = m->n_heads, KV = m->n_kv_heads, hd = m->head_dim, E = m->n_experts, K = m->top_k;
    const int Q = H * hd, KVD = KV * hd, B = bt->B, N = bt->off[B], half = hd / 2;
    const Layout s = layout(m, B, bt->T);
    float *h = scratch + s.h, *q = scratch + s.q, *k = scratch + s.k, *v = scratch + s.v, *att = scratch + s.att;
    float *y = scratch + s.y, *rope_tab = scratch + s.rope;

    /* attention */
    for (int n = 0; n < N; n++) rms_norm(hidden + (int64_t)n * D, m->ln1[l], h + (int64_t)n * D, D, m->eps);
    const Product qkv[3] = {{m->wq[l], h, q, D, N, m->wbf16, D, Q}, {m->wk[l], h, k, D, N, m->wbf16, D, KVD},
                            {m->wv[l], h, v, D, N, m->wbf16, D, KVD}};
    const int qkv_rows[4] = {0, Q, Q + KVD, Q + 2 * KVD};
    products(qkv, qkv_rows, 3);
    for (int b = 0, n = 0; n < N; n++) {
        while (n == bt->off[b + 1]) b++;
        const int pos = bt->pos0[b] + n - bt->off[b];
        const float *cs = rope_tab + (int64_t)n * hd, *sn = cs + half;
        for (int j = 0; j < H; j++) {
            float *qj = q + (int64_t)n * Q + j * hd;
            if (m->q_norm[l]) rms_norm(qj, m->q_norm[l], qj, hd, m->eps);  /* NULL: none (Llama) */
            rope(qj, hd, cs, sn);
        }
        for (int j = 0; j < KV; j++) {
            float *kj = k + (int64_t)n * KVD + j * hd;
            if (m->k_norm[l]) rms_norm(kj, m->k_norm[l], kj, hd, m->eps);
            rope(kj, hd, cs, sn);
            const int64_t at = b * bt->slot_stride + ((int64_t)j * bt->max_len + pos) * hd;
            store_kv(elem_ptr(bt->kc, at, bt->bf), kj, hd, bt->bf);
            store_kv(elem_ptr(bt->vc, at, bt->bf), v + (int64_t)n * KVD + j * hd, hd, bt->bf);
        }
    }
    Attn a = {bt->T, hd, H / KV, H, bt->max_len, KV, m->max_tokens, bt->pos0, bt->off, q, bt->kc, bt->vc,
              bt->slot_stride, att, scratch + s.attn, s.attn_each, 1.f / sqrtf((float)hd), bt->bf};
    int64_t ctx = 0;
    for (int b = 0; b < B; b++) ctx += bt->pos0[b] + bt->off[b + 1] - bt->off[b];
    parallel(attend_units, &a, B * KV, ctx * KVD * 2);
    matmul(m->wbf16, m->wo[l], att, Q, y, D, D, Q, N);
    for (int n = 0; n < N; n++)
        for (int i = 0; i < D; i++) hidden[(int64_t)n * D + i] += y[(int64_t)n * D + i];

    /* feed-forward */
    for (int n = 0; n < N; n++) rms_norm(hidden + (int64_t)n * D, m->ln2[l], h + (int64_t)n * D, D, m->eps);
    float *gu = scratch + s.gu, *act = scratch + s.act;
    if (m->router[l] == NULL) {
        int I = m->dense_inner;
        const Product gate_up[2] = {{m->gate[l], h, gu, D, N, m->wbf16, D, 2 * I},
                                    {m->up[l], h, gu + I, D, N, m->wbf16, D, 2 * I}};
        const int gate_up_rows[3] = {0, I, 2 * I};
        products(gate_up, gate_up_rows, 2);
        for (int n = 0; n < N; n++) swiglu(gu + (int64_t)n * 2 * I, gu + (int64_t)n * 2 * I + I, act + (int64_t)n * I, I);
        matmul(m->wbf16, m->down_dense[l], act, I, y, D, D, I, N);
        for (int n = 0; n < N; n++)
            for (int i = 0; i < D; i++) hidden[(int64_t)n * D + i] += y[(int64_t)n * D + i];
        return;
    }
    const int I = m->moe_inner;
    float *probs = scratch + s.probs, *xg = scratch + s.xg, *weight = scratch + s.route + (int64_t)N * K;
    int32_t *chosen = (int32_t *)(scratch + s.route), *slots = (int32_t *)(scratch + s.route + 2 * (int64_t)N * K);
    matmul(m->wbf16, m->router[l], h, D, probs, E, E, D, N);
    for (int n = 0; n < N; n++) {
        if (need && !need[n]) {  /* routed nowhere: no expert reads it */
            for (int j = 0; j < K; j++) chosen[(int64_t)n * K + j] = -1, weight[(int64_t)n * K + j] = 0.f;
            continue;
        }
        float *p = probs + (int64_t)n * E, mx = -INFINITY, sum = 0.f;
        for (int e = 0; e < E; e++) if (p[e] > mx) mx = p[e];
        for (int e = 0; e < E; e++) sum += (p[e] = expf(p[e] - mx));
        for (int e = 0; e < E; e++) p[e] /= sum;
        for (int j = 0; j < K; j++) {  /* top-k, ties to the lower id */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int used = 0;
                for (int u = 0; u < j; u++) used |= chosen[(int64_t)n * K + u] == e;
                if (!used && (best < 0 || p[e] > p[best])) best = e;
            }
            chosen[(int64_t)n * K + j] = best;
            weight[(int64_t)n * K + j] = p[best];
            if (routes) routes[(int64_t)n * route_stride + j] = best;
        }
    }
    /* Each expert once over every token that chose it, every chosen expert's matrices in one job;
     * outputs kept per (token, rank). xg: the inputs gathered expert after expert (row c from slot
     * slots[c]), then the down projections' outputs. */
    Product ups[E], downs[E];
    int rows_up[E + 1], rows_down[E + 1], parts = 0, c = 0;
    rows_up[0] = rows_down[0] = 0;
    for (int e = 0; e < E; e++) {
        const int first = c;
        for (int nj = 0; nj < N * K; nj++)
            if (chosen[nj] == e) {
                memcpy(xg + (int64_t)c * D, h + (int64_t)(nj / K) * D, D * sizeof(float));
                slots[c++] = nj;
            }
        if (c == first) continue;
        ups[parts] = (Product){elem_ptr(m->gate_up[l], (int64_t)e * 2 * I * D, m->wbf16), xg + (int64_t)first * D,
                               gu + (int64_t)first * 2 * I, D, c - first, m->wbf16, D, 2 * I};
        downs[parts] = (Product){elem_ptr(m->down[l], (int64_t)e * D * I, m->wbf16), act + (int64_t)first * I,
                                 xg + (int64_t)first * D, I, c - first, m->wbf16, I, D};
        rows_up[parts + 1] = rows_up[parts] + 2 * I;
        rows_down[parts + 1] = rows_down[parts] + D;
        parts++;
    }
    products(ups, rows_up, parts);
    for (int r = 0; r < c; r++) swiglu(gu + (int64_t)r * 2 * I, gu + (int64_t)r * 2 * I + I, act + (int64_t)r * I, I);
    products(downs, rows_down, parts); /* into xg: its inputs are no longer read */
    for (int r = 0; r < c; r++) memcpy(y + (int64_t)slots[r] * D, xg + (int64_t)r * D, D * sizeof(float));
    for (int n = 0; n < N; n++) {
        if (need && !need[n]) continue;
        float wsum = 0.f, *out = hidden + (int64_t)n * D;
        for (int j = 0; j < K; j++) wsum += weight[(int64_t)n * K + j];
        for (int j = 0; j < K; j++) {
            float w = m->norm_topk ? weight[(int64_t)n * K + j] / wsum : weight[(int64_t)n * K + j];
            const float *yj = y + ((int64_t)n * K + j) * D;
            for (int i = 0; i < D; i++) out[i] += w * yj[i];
        }
    }
}

static void rope_tables(const Model *m, const Batch *bt, float *tab) {
    const int hd = m->head_dim, half = hd / 2;
    for (int b = 0, n = 0; n < bt->off[bt->B]; n++) {
        while (n == bt->off[b + 1]) b++;
        float *cs = tab + (int64_t)n * hd, *sn = cs + half;
        int pos = bt->pos0[b] + n - bt->off[b];
        for (int i = 0; i < half; i++) {
            float f = (float)pos * m->inv_freq[i];
            cs[i] = cosf(f);
            sn[i] = sinf(f);
        }
    }
}

/* off[B + 1]: row b's tokens are off[b]..off[b + 1] - 1 of a call's N = off[B]: lens[b] each (at
 * least 1, at most T), or T each when lens is NULL. */
static void offsets(int B, int T, const int32_t *lens, int32_t *off) {
    off[0] = 0;
    for (int b = 0; b < B; b++) off[b + 1] = off[b] + (lens ? lens[b] : T);
}

/* Run B sequences through the trunk, sequence b's lens[b] tokens (all T when lens is NULL; at most
 * T) at positions pos0[b].., ids [N] row after row (N their total). A row's outputs are the same
 * bits whichever rows and lengths share the call, so a ragged call (speculative rows fed only
 * their own drafts) equals one call per row.
 * k_cache/v_cache: layer 0's cache of sequence 0's slot; sequence b's slot is slot_stride further,
 * layer l's layer_stride further: [layer][slot][kv_head][max_len][head_dim], in elements: fp32, or
 * bf16 when kv_bf16 (entries rounded to nearest even as written, widened exactly as read).
 * hidden: [N, D] out, the trunk's output before the final norm.
 * routes: [N, n_moe_layers, top_k] expert ids. */
void kiln_trunk(const Model *m, int B, int T, const int32_t *lens, const int64_t *ids, const int32_t *pos0,
                void *k_cache, void *v_cache, int64_t slot_stride, int64_t layer_stride, int max_len, int kv_bf16,
                float *hidden, int32_t *routes, float *scratch) {
    const int D = m->dim, K = m->top_k;
    int32_t off[B + 1];
    offsets(B, T, lens, off);
    int n_moe = 0;
    for (int l = 0; l < m->n_layers; l++) n_moe += m->router[l] != NULL;
    for (int n = 0; n < off[B]; n++) weight_row(m->embed, m->ebf16, ids[n], D, hidden + (int64_t)n * D);
    Batch bt = {B, T, max_len, pos0, off, k_cache, v_cache, slot_stride, kv_bf16};
    rope_tables(m, &bt, scratch + layout(m, B, T).rope);
    for (int l = 0, moe_i = 0; l < m->n_layers; l++) {
        int moe = m->router[l] != NULL;
        bt.kc = elem_ptr(k_cache, l * layer_stride, kv_bf16);
        bt.vc = elem_ptr(v_cache, l * layer_stride, kv_bf16);
        block(m, l, hidden, &bt, moe ? routes + moe_i * K : NULL, n_moe * K, scratch, NULL);
        moe_i += moe;
    }
}

/* MTP layer l (kiln/model/mtp.py): out [B*T, D] = block_l(eh_proj(cat(hnorm(h_in), enorm(embed(ids))))),
 * with the layer's own cache (as kiln_trunk's arguments); need as block's (rows left out are not outputs). */
void kiln_mtp_layer(const Model *m, int l, int B, int T, const float *h_in, const int64_t *ids, const int32_t *pos0,
                    void *k_cache, void *v_cache, int64_t slot_stride, int64_t layer_stride, int max_len, int kv_bf16,
                    float *out, float *scratch, const uint8_t *need) {
    const int D = m->dim, N = B * T;
    const Layout s = layout(m, B, T);
    int32_t off[B + 1];
    offsets(B, T, NULL, off);
    float *cat = scratch + s.cat;
    for (int n = 0; n < N; n++) {
        rms_norm(h_in + (int64_t)n * D, m->hnorm[l], cat + (int64_t)n * 2 * D, D, m->eps);
        float *e = cat + (int64_t)n * 2 * D + D;
        weight_row(m->embed, m->ebf16, ids[n], D, e);
        rms_norm(e, m->enorm[l], e, D, m->eps);  /* elementwise after the sum: in place is safe */
    }
    matmul(m->wbf16, m->eh_proj[l], cat, 2 * D, out, D, D, 2 * D, N);
    Batch bt = {B, T, max_len, pos0, off, elem_ptr(k_cache, l * layer_stride, kv_bf16),
                elem_ptr(v_cache, l * layer_stride, kv_bf16), slot_stride, kv_bf16};
    rope_tables(m, &bt, scratch + s.rope);
    block(m, l, out, &bt, NULL, 0, scratch, need);
}

/* logits [N, V] = head(norm(hidden [N, D])), norm the final norm's weight (or an MTP layer's), head
 * the model's output head, or w (V rows of it, e.g. the drafter's most frequent tokens, copied in
 * the dtype of m's own matrices: the drafter's struct) when given. */
void kiln_head(const Model *m, const float *norm, const void *w, const float *hidden, int N, int vocab, float *logits,
               float *scratch) {
    for (int n = 0; n < N; n++) rms_norm(hidden + (int64_t)n * m->dim, norm, scratch + (int64_t)n * m->dim, m->dim, m->eps);
    matmul(w ? m->wbf16 : m->ebf16, w ? w : m->head, scratch, m->dim, logits, vocab, vocab, m->dim, N);
}

/* ---- sampling one row of logits ---------------------------------------------------------------- *
 * sampling.py's rule in one pass over the row instead of a dozen torch ops: right after a decoding
 * call has streamed the weights through the caches, each op ran cold (~5x its time in a loop). */
typedef struct { float m, total; int64_t first_max, first_nan; } RowStats;

/* e[i] = exp(y_i - max y) for y = x / T (T = 0: x), per 16-float block its sum in sums[], and the
 * total of the blocks in order, then of the tail. */
static RowStats row_exp(const float *x, int V, float T, float *e, float *sums) {
    RowStats st = {-INFINITY, 0.f, -1, -1};
    const int blocks = V / 16;
    vf mx = (vf){0} - INFINITY;
    vi nan = (vi){0};
    for (int i = 0; i < blocks * 16; i += VW) {
        vf y = loadv(x + i);
        if (T > 0) y /= T;
        storev(e + i, y);
        mx = selectv(y > mx, y, mx);
        nan |= y != y;
    }
    for (int l = 0; l < VW; l++) {
        st.m = mx[l] > st.m ? mx[l] : st.m;
        st.first_nan = nan[l] ? 0 : st.first_nan;
    }
    for (int i = blocks * 16; i < V; i++) {
        e[i] = T > 0 ? x[i] / T : x[i];
        st.m = e[i] > st.m ? e[i] : st.m;
        st.first_nan = e[i] != e[i] ? 0 : st.first_nan;
    }
    if (st.first_nan >= 0) { /* torch's argmax: a NaN above all */
        for (int i = 0; i < V; i++)
            if (e[i] != e[i]) { st.first_nan = i; break; }
    }
    for (int i = 0; i < V; i++) /* the first of equal maxima */
        if (e[i] == st.m) { st.first_max = i; break; }
    for (int b = 0; b < blocks; b++) {
        vf s[PARTS];
        for (int j = 0; j < PARTS; j++) {
            s[j] = expv(loadv(e + 16 * b + VW * j) - st.m);
            storev(e + 16 * b + VW * j, s[j]);
        }
        sums[b] = hsum(s);
        st.total += sums[b];
    }
    for (int i = blocks * 16; i < V; i++) {
        e[i] = expf(e[i] - st.m);
        st.total += e[i];
    }
    return st;
}

/* log softmax(x / T)[tok] (T = 0: of x) from the row's stats. */
static float row_logprob(const float *x, float T, const RowStats *st, int64_t tok) {
    return ((T > 0 ? x[tok] / T : x[tok]) - st->m) - logf(st->total);
}

/* The token of one row of logits x [V] and its log softmax(x / T) (T = 0: the argmax, the first of
 * equal maxima and a NaN above all as torch's, with its log softmax(x)). T > 0: the first token
 * whose running sum of exp(x / T - max) passes u (in [0, 1)) times their total, leaving out `skip`
 * (>= 0: a rejected draft, drawn from the rest; -1 if the rest has no mass). scratch: V + V / 16 floats. */
int64_t kiln_sample(const float *x, int V, float T, float u, int64_t skip, float *logprob, float *scratch) {
    float *e = scratch, *sums = scratch + V;
    const RowStats st = row_exp(x, V, T, e, sums);
    const int blocks = V / 16;
    int64_t tok = st.first_nan >= 0 ? st.first_nan : st.first_max;
    if (T > 0 && st.first_nan < 0 && tok >= 0) {
        float total = st.total;
        if (skip >= 0 && skip < V) { /* the draft's share out of its block and the total */
            e[skip] = 0.f;
            total = 0.f;
            for (int b = 0; b < blocks; b++) {
                if (b == skip / 16) {
                    vf s[PARTS];
                    for (int j = 0; j < PARTS; j++) s[j] = loadv(e + 16 * b + VW * j);
                    sums[b] = hsum(s);
                }
                total += sums[b];
            }
            for (int i = blocks * 16; i < V; i++) total += e[i];
        }
        if (!(total > 0.f)) { /* nothing to draw from: the rest of a draft's row, or a row of -inf */
            *logprob = NAN;
            return skip >= 0 ? -1 : tok;
        }
        const float target = u * total;
        float run = 0.f;
        tok = -1;
        int b = 0;
        for (; b < blocks && run + sums[b] <= target; b++) run += sums[b];
        const int lo = b < blocks ? 16 * b : 16 * blocks, hi = b < blocks ? 16 * b + 16 : V;
        for (int i = lo; i < hi; i++) { /* within the block, token by token (the last with mass if rounding runs out) */
            if (e[i] > 0.f) tok = i;
            run += e[i];
            if (run > target) break;
        }
        for (int i = V - 1; tok < 0 && i >= 0; i--) /* the target fell past the last block's rounding */
            if (e[i] > 0.f) tok = i;
    }
    *logprob = row_logprob(x, T, &st, tok);
    return tok;
}

/* log softmax(x / T)[tok] (T = 0: of x), as kiln_sample reports a token's. */
float kiln_logprob(const float *x, int V, float T, int64_t tok, float *scratch) {
    const RowStats st = row_exp(x, V, T, scratch, scratch + V);
    return row_logprob(x, T, &st, tok);
}

/* ---- plain decoding, several steps a call ------------------------------------------------------ *
 * Up to n steps of B sequences in consecutive cache slots (kiln_trunk's cache arguments): a step
 * feeds each row's last token ids[b] at its next position pos0[b] (kiln_trunk, one token a row),
 * takes the logits (kiln_head with the final norm's weight `norm`) and draws the row's next token
 * (kiln_sample, temperature temps[b], uniform u[b * n + s]): the same calls, so the same bits, as n
 * rounds of the engine's Python step, without the interpreter's work between them (run cold, it cost
 * a third of a batch-1 token). ids and pos0 are advanced in place. Stops after the first step in
 * which a row draws one of its stop ids, stops[stop_off[b]..stop_off[b + 1]), or after the step in
 * which another thread set *yield (a request or new weights arrived).
 * Out, per step s and row b: tokens and logprobs [s * B + b]; routes [n, B, route_stride] (kiln_trunk's
 * per token). work: B * (D + V) + V + V / 16 floats; scratch as kiln_trunk's over B x 1 tokens.
 * -> the steps taken. */
int kiln_decode(const Model *m, const float *norm, int B, int n, int64_t *ids, int32_t *pos0, const float *temps,
                const float *u, const int64_t *stops, const int32_t *stop_off, void *k_cache, void *v_cache,
                int64_t slot_stride, int64_t layer_stride, int max_len, int kv_bf16, int vocab, int route_stride,
                int64_t *tokens, float *logprobs, int32_t *routes, const int *yield, float *work, float *scratch) {
    float *hidden = work, *logits = work + (int64_t)B * m->dim, *sampling = logits + (int64_t)B * vocab;
    for (int s = 0; s < n; s++) {
        kiln_trunk(m, B, 1, NULL, ids, pos0, k_cache, v_cache, slot_stride, layer_stride, max_len, kv_bf16, hidden,
                   routes + (int64_t)s * B * route_stride, scratch);
        kiln_head(m, norm, NULL, hidden, B, vocab, logits, scratch);
        int stop = 0;
        for (int b = 0; b < B; b++) {
            const int64_t i = (int64_t)s * B + b;
            tokens[i] = ids[b] = kiln_sample(logits + (int64_t)b * vocab, vocab, temps[b], u[(int64_t)b * n + s], -1,
                                             logprobs + i, sampling);
            pos0[b]++;
            for (int j = stop_off[b]; j < stop_off[b + 1]; j++) stop |= stops[j] == tokens[i];
        }
        if (stop || __atomic_load_n(yield, __ATOMIC_RELAXED)) return s + 1;
    }
    return n;
}

/* What the engine's emit keeps of a row's new tokens tok[0..count): each appended to hist at *known
 * until one of its stop ids (kept) or its max_tokens (*left reaching 0). -> whether the row ended. */
static int keep(const int64_t *tok, int count, int64_t *hist, int32_t *known, int32_t *left, const int64_t *stops,
                int n_stops) {
    for (int j = 0; j < count; j++) {
        int done = --*left == 0;
        hist[(*known)++] = tok[j];
        for (int q = 0; q < n_stops; q++) done |= stops[q] == tok[j];
        if (done) return 1;
    }
    return 0;
}

/* ---- greedy speculative decoding with the MTP drafter, several steps a call -------------------- *
 * speculative.py's spec_step and draft for greedy rows without stop strings, up to n steps, through
 * the same calls in the same order (so the same bits: tokens, logprobs, routes, drafts, the drafter's
 * cache): a step feeds each row its last token and its D = depth drafts at positions length[b]..,
 * takes the D + 1 logits rows, keeps the drafts up to the first that is not the argmax and the argmax
 * after them (kiln_sample at T = 0), then runs the D drafter layers over the positions just verified
 * (after the last D - 1 known ones again, from the main hidden rows kept in tail, when every row has
 * them) and proposes the next D drafts (the argmax of each layer's head over the drafter's rows).
 * A row finishes as the engine's emit ends it: on a stop id (kept), at max_tokens (left[b] more) or
 * when length[b] + D reaches max_len; the call ends after the step in which one did (drafting only if
 * another has not), or after the step in which *yield was set.
 * In and out per row: last[b], drafts [B, D], length[b], left[b], tail [B, D - 1, dim] with tail_rows[b]
 * (0: none) and drafted[b]; recent [B, D]: the row's known tokens at positions length[b] - D + 1 ..
 * length[b] (the last is last[b]). Out per step s: tokens and logprobs [n, B, D + 1] (row b's first
 * accepted[s * B + b] + 1 are its new ones), routes [n, B, D + 1, route_stride].
 * work: kiln_spec_work_floats(...) floats; scratch as kiln_trunk's over B x 2D tokens. -> steps taken. */
typedef struct {
    const Model *m, *mtp;
    const float *norm;                 /* the main final norm's weight */
    const float *const *mtp_norms;     /* each drafter layer's head norm weight */
    const void *draft_head;            /* the drafter's head rows (NULL: the whole head) */
    const int64_t *draft_ids;          /* their token ids (NULL: row j is token j) */
    int depth, draft_vocab, vocab, max_len, kv_bf16, route_stride;
    void *k_cache, *v_cache, *mk_cache, *mv_cache; /* slot 0 of the main and the drafter's cache */
    int64_t slot_stride, layer_stride, mslot_stride, mlayer_stride;
} Spec;

/* work's parts, in floats: main hidden rows, their logits, the drafter's input (main rows, the kept
 * ones first) and two buffers its layers alternate between, the rows it drafts from and their logits,
 * the sampler's; then, 8-byte aligned, int64 known tokens and token ids. */
static int64_t spec_floats(const Spec *c, int B, int64_t *ints) {
    const int64_t D = c->depth, dim = c->m->dim, T = D + 1, Tc = 2 * D;
    const int64_t floats = B * T * dim + B * T * (int64_t)c->vocab + 3 * B * Tc * dim + B * dim
                           + B * (int64_t)c->draft_vocab + c->vocab + c->vocab / 16;
    *ints = (floats + 1) & ~(int64_t)1;
    return floats;
}

int64_t kiln_spec_work_floats(const Spec *c, int B, int n) {
    int64_t ints;
    spec_floats(c, B, &ints);
    return ints + 2 * ((int64_t)B * (c->depth + (int64_t)n * (c->depth + 1)) + 2 * (int64_t)B * 2 * c->depth);
}

int kiln_spec_decode(const Spec *c, int B, int n, int64_t *last, int64_t *drafts, int32_t *length, int32_t *left,
                     float *tail, int32_t *tail_rows, int32_t *drafted, const int64_t *recent, const int64_t *stops,
                     const int32_t *stop_off, int64_t *tokens, float *logprobs, int32_t *accepted, int32_t *routes,
                     const int *yield, float *work, float *scratch) {
    const Model *m = c->m;
    const int D = c->depth, dim = m->dim, T = D + 1, Tc = 2 * D, V = c->vocab, cap = D + n * T;
    int64_t ints;
    spec_floats(c, B, &ints);
    float *hid = work, *logits = hid + (int64_t)B * T * dim, *hc = logits + (int64_t)B * T * V;
    float *h1 = hc + (int64_t)B * Tc * dim, *h2 = h1 + (int64_t)B * Tc * dim, *at = h2 + (int64_t)B * Tc * dim;
    float *dl = at + (int64_t)B * dim, *sampling = dl + (int64_t)B * c->draft_vocab;
    int64_t *hist = (int64_t *)(work + ints), *ids = hist + (int64_t)B * cap, *mids = ids + (int64_t)B * Tc;
    int32_t hpos[B], known[B], pos[B], nv[B], lastv[B];
    uint8_t need[B * Tc];
    for (int b = 0; b < B; b++) {  /* row b's known tokens: hist[b][i] at position hpos[b] + i */
        hpos[b] = length[b] - D + 1, known[b] = D;
        memcpy(hist + (int64_t)b * cap, recent + (int64_t)b * D, (size_t)D * sizeof(int64_t));
    }
    for (int s = 0; s < n; s++) {
        for (int b = 0; b < B; b++) {
            ids[b * T] = last[b];
            memcpy(ids + b * T + 1, drafts + (int64_t)b * D, (size_t)D * sizeof(int64_t));
            pos[b] = length[b];
        }
        int64_t *tok = tokens + (int64_t)s * B * T;
        float *lp = logprobs + (int64_t)s * B * T;
        kiln_trunk(m, B, T, NULL, ids, pos, c->k_cache, c->v_cache, c->slot_stride, c->layer_stride, c->max_len,
                   c->kv_bf16, hid, routes + (int64_t)s * B * T * c->route_stride, scratch);
        kiln_head(m, c->norm, NULL, hid, B * T, V, logits, scratch);
        int any_done = 0, all_done = 1;
        for (int b = 0; b < B; b++) {
            int a = 0;
            for (;; a++) {  /* the drafts up to the first that is not the argmax, then the argmax */
                const int64_t i = (int64_t)b * T + a;
                tok[i] = kiln_sample(logits + i * V, V, 0.f, 0.f, -1, lp + i, sampling);
                if (a == D || tok[i] != drafts[(int64_t)b * D + a]) break;
            }
            accepted[s * B + b] = a;
            int done = keep(tok + (int64_t)b * T, a + 1, hist + (int64_t)b * cap, &known[b], &left[b],
                            stops + stop_off[b], stop_off[b + 1] - stop_off[b]);
            last[b] = tok[(int64_t)b * T + a];
            length[b] += a + 1;
            done |= length[b] + D >= c->max_len;
            any_done |= done, all_done &= done;
        }
        if (!all_done) {  /* draft(): the drafter over the positions just verified */
            int back = D - 1;
            for (int b = 0; b < B; b++) back = pos[b] < back ? pos[b] : back;  /* pos: where this step's feed began */
            for (int b = 0; b < B && back; b++) back = tail_rows[b] >= back ? back : 0;
            const int t = T + back;
            for (int b = 0; b < B; b++) {
                float *h = hc + (int64_t)b * t * dim;
                memcpy(h, tail + ((int64_t)b * (D - 1) + tail_rows[b] - back) * dim, (size_t)back * dim * sizeof(float));
                memcpy(h + (int64_t)back * dim, hid + (int64_t)b * T * dim, (size_t)T * dim * sizeof(float));
                pos[b] -= back;
                nv[b] = accepted[s * B + b] + 1 + back;
                lastv[b] = nv[b] - 1;
                for (int i = 0; i < t; i++) need[b * t + i] = i == lastv[b];
            }
            const float *h_in = hc;
            for (int k = 1; k <= D; k++) {
                for (int b = 0; b < B; b++)
                    for (int i = 0; i < t; i++) {  /* token pos + i + k: known, else a draft so far, else 0 */
                        const int64_t p = (int64_t)pos[b] + i + k, seen = hpos[b] + known[b];
                        mids[b * t + i] = p < seen ? hist[(int64_t)b * cap + (p - hpos[b])]
                                        : p - seen < k - 1 ? drafts[(int64_t)b * D + (p - seen)] : 0;
                    }
                float *out = k % 2 ? h1 : h2;  /* never the layer's own input, nor the kept main rows */
                kiln_mtp_layer(c->mtp, k - 1, B, t, h_in, mids, pos, c->mk_cache, c->mv_cache, c->mslot_stride,
                               c->mlayer_stride, c->max_len, c->kv_bf16, out, scratch, k == D ? need : NULL);
                for (int b = 0; b < B; b++)
                    memcpy(at + (int64_t)b * dim, out + ((int64_t)b * t + lastv[b]) * dim, (size_t)dim * sizeof(float));
                kiln_head(c->mtp, c->mtp_norms[k - 1], c->draft_head, at, B, c->draft_vocab, dl, scratch);
                for (int b = 0; b < B; b++) {
                    float unused;
                    const int64_t j = kiln_sample(dl + (int64_t)b * c->draft_vocab, c->draft_vocab, 0.f, 0.f, -1, &unused,
                                                  sampling);
                    drafts[(int64_t)b * D + k - 1] = c->draft_ids ? c->draft_ids[j] : j;
                }
                h_in = out;
            }
            for (int b = 0; b < B; b++) {
                const int keep = nv[b] < D - 1 ? nv[b] : D - 1, from = nv[b] - keep;
                memcpy(tail + (int64_t)b * (D - 1) * dim, hc + ((int64_t)b * t + from) * dim, (size_t)keep * dim * sizeof(float));
                tail_rows[b] = keep;
                if (pos[b] <= drafted[b]) drafted[b] = hpos[b] + known[b] - D;
            }
        }
        if (any_done || __atomic_load_n(yield, __ATOMIC_RELAXED)) return s + 1;
    }
    return n;
}

/* ---- prompt-lookup decoding, several steps a call ---------------------------------------------- *
 * lookup.py's lookup_step, up to n steps, for rows without top-k, top-p or stop strings, through the
 * same calls in the same order (so the same bits). A step proposes each row the tokens after the
 * latest earlier occurrence of its last N known tokens: 2^m of them, m the tokens before the two
 * occurrences that match as well, and at most min(lookup, max_len - length[b] - 1). With none
 * anywhere it is a plain step (a token a row); else each row is fed its last
 * token and its drafts (one ragged kiln_trunk), and verify's rule for point-mass drafts picks its new
 * tokens: greedy, the drafts up to the first that is not the argmax, then the argmax; sampled, draft d
 * kept while the next uniform is below p(d), else a token drawn without d (with d if nothing else has
 * mass), and one drawn after the last kept draft. Uniforms come from u [B, per_row] in order (used[b]
 * counts them). Rows end as emit ends them (a stop id, kept; max_tokens: left[b] more; the cache's
 * end); the call ends after the step in which one did, or in which *yield was set.
 * hist [B, cap]: each row's known tokens (prompt and completion), known[b] of them, extended in place;
 * length[b]: its positions in the cache. Out per step s and row b (index s * B + b): fed[] the
 * tokens fed (1 + drafts), kept[] how many new tokens (a + 1); tokens, logprobs and routes [.., L + 1]
 * of them (routes route_stride ints a token: the fed positions' experts).
 * work: kiln_lookup_work_floats(...); scratch as kiln_trunk's over B x (lookup + 1) tokens. -> steps. */
typedef struct { int64_t hidden, logits, sampling, routes, ids, total; } LookupWork;

static LookupWork lookup_work(const Model *m, int B, int lookup, int vocab, int route_stride) {
    const int64_t N = (int64_t)B * (lookup + 1);
    LookupWork w;
    w.hidden = 0;
    w.logits = w.hidden + N * m->dim;
    w.sampling = w.logits + N * vocab;
    w.routes = (w.sampling + vocab + vocab / 16 + 1) & ~(int64_t)1;  /* int32s, then 8-byte aligned int64s */
    w.ids = (w.routes + N * route_stride + 1) & ~(int64_t)1;
    w.total = w.ids + 2 * N;
    return w;
}

int64_t kiln_lookup_work_floats(const Model *m, int B, int lookup, int vocab, int route_stride) {
    return lookup_work(m, B, lookup, vocab, route_stride).total;
}

int kiln_lookup_decode(const Model *m, const float *norm, int B, int n, int lookup, int ngram, int64_t *hist,
                       int32_t *known, int cap, int32_t *length, int32_t *left, const float *temps, const float *u,
                       int per_row, int32_t *used, const int64_t *stops, const int32_t *stop_off, void *k_cache,
                       void *v_cache, int64_t slot_stride, int64_t layer_stride, int max_len, int kv_bf16, int vocab,
                       int route_stride, int32_t *fed, int32_t *kept, int64_t *tokens, float *logprobs,
                       int32_t *routes, const int *yield, float *work, float *scratch) {
    const int T = lookup + 1, V = vocab;
    const LookupWork w = lookup_work(m, B, lookup, vocab, route_stride);
    float *hidden = work + w.hidden, *logits = work + w.logits, *sampling = work + w.sampling;
    int32_t *step_routes = (int32_t *)(work + w.routes), lens[B], pos[B], off[B + 1];
    int64_t *ids = (int64_t *)(work + w.ids);
    for (int s = 0; s < n; s++) {
        off[0] = 0;
        for (int b = 0; b < B; b++) {  /* propose: what followed the latest earlier occurrence of the last N */
            const int64_t *h = hist + (int64_t)b * cap;
            const int k = known[b], depth = lookup < max_len - length[b] - 1 ? lookup : max_len - length[b] - 1;
            int at = -1;
            for (int i = k - 1; depth > 0 && i >= ngram && at < 0; i--) {
                int same = 1;
                for (int j = 0; j < ngram && same; j++) same = h[i - ngram + j] == h[k - ngram + j];
                if (same) at = i;
            }
            int want = 1;  /* 2^m drafts (at most depth), m the tokens before the two n-grams that match too */
            for (int m = 0; at >= 0 && want < depth && at - ngram - 1 - m >= 0
                            && h[at - ngram - 1 - m] == h[k - ngram - 1 - m]; m++) want *= 2;
            want = want < depth ? want : depth;
            lens[b] = 1 + (at < 0 ? 0 : k - at < want ? k - at : want), pos[b] = length[b];
            fed[s * B + b] = lens[b];
            ids[off[b]] = h[k - 1];
            for (int j = 1; j < lens[b]; j++) ids[off[b] + j] = h[at + j - 1];
            off[b + 1] = off[b] + lens[b];
        }
        int most = 1;
        for (int b = 0; b < B; b++) most = lens[b] > most ? lens[b] : most;
        kiln_trunk(m, B, most, lens, ids, pos, k_cache, v_cache, slot_stride, layer_stride, max_len, kv_bf16, hidden,
                   step_routes, scratch);
        kiln_head(m, norm, NULL, hidden, off[B], V, logits, scratch);
        int ended = 0;
        for (int b = 0; b < B; b++) {
            const int d = lens[b] - 1, i0 = s * B + b;
            const float t = temps[b];
            const float *ub = u + (int64_t)b * per_row;
            int64_t *tok = tokens + (int64_t)i0 * T;
            float *lp = logprobs + (int64_t)i0 * T;
            int a = 0;
            for (;; a++) {
                const float *x = logits + (int64_t)(off[b] + a) * V;
                if (t <= 0.f) {  /* greedy */
                    tok[a] = kiln_sample(x, V, 0.f, 0.f, -1, lp + a, sampling);
                    if (a == d || tok[a] != ids[off[b] + 1 + a]) break;
                    continue;
                }
                if (a == d) {  /* after the last kept draft */
                    tok[a] = kiln_sample(x, V, t, ub[used[b]++], -1, lp + a, sampling);
                    break;
                }
                const int64_t dr = ids[off[b] + 1 + a];
                const float l = kiln_logprob(x, V, t, dr, sampling);
                if ((double)ub[used[b]++] < exp((double)l)) {
                    tok[a] = dr, lp[a] = l;
                    continue;
                }
                tok[a] = kiln_sample(x, V, t, ub[used[b]++], dr, lp + a, sampling);
                if (tok[a] < 0) tok[a] = kiln_sample(x, V, t, ub[used[b]++], -1, lp + a, sampling);
                break;
            }
            kept[i0] = a + 1;
            memcpy(routes + (int64_t)i0 * T * route_stride, step_routes + (int64_t)off[b] * route_stride,
                   (size_t)(a + 1) * route_stride * sizeof(int32_t));
            const int done = keep(tok, a + 1, hist + (int64_t)b * cap, &known[b], &left[b], stops + stop_off[b],
                                  stop_off[b + 1] - stop_off[b]);
            length[b] += a + 1;
            ended |= done || length[b] >= max_len;
        }
        if (ended || __atomic_load_n(yield, __ATOMIC_RELAXED)) return s + 1;
    }
    return n;
}
