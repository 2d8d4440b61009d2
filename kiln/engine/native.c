/* kiln's native decoding step: the fp32 MoE trunk for one sequence and a few tokens, in plain C.
 *
 * Decoding a tiny model one token at a time on a CPU costs hundreds of small tensor ops per token,
 * each a dispatch; this does the same math (kiln/model/moe.py; also Qwen3 dense and Llama, whose
 * layers are the same block without experts or q/k norms) in one call that reads every weight
 * once per call, straight from the model's own parameter memory. Tokens of one call are processed
 * in order with the same per-token arithmetic as a one-token call, so a k-token call (speculative
 * verification) gives bit-identical results to k one-token calls (plain decoding).
 *
 * Built by kiln/engine/native.py with the system C compiler; no Python or torch headers.
 */
#define _GNU_SOURCE /* sched_getaffinity */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int n_layers, dim, n_heads, n_kv_heads, head_dim, n_experts, top_k, moe_inner, dense_inner;
    int norm_topk, max_tokens;
    float eps;
    const float *embed, *head, *inv_freq;
    /* per layer (arrays of n_layers pointers); a layer is MoE when router[l] is not NULL; q_norm and
     * k_norm are NULL for a family without them */
    const float **ln1, **wq, **wk, **wv, **q_norm, **k_norm, **wo, **ln2;
    const float **router, **gate_up, **down;  /* MoE: [E, D], [E, 2I, D], [E, D, I] */
    const float **gate, **up, **down_dense;   /* dense SwiGLU: [I, D], [I, D], [D, I] */
    const float **hnorm, **enorm, **eh_proj;   /* MTP layers only: [D], [D], [D, 2D] */
} Model;

typedef float v8 __attribute__((vector_size(32)));  /* GCC/Clang vector extension: AVX on x86 */

/* Four independent vector accumulators hide the add latency; the order is fixed, so a dot
 * product is the same number wherever it is called from. */
static inline float dot(const float *a, const float *b, int n) {
    v8 acc[4] = {{0}};
    int i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; j++) {
            v8 x, y;
            memcpy(&x, a + i + 8 * j, sizeof x);
            memcpy(&y, b + i + 8 * j, sizeof y);
            acc[j] += x * y;
        }
    v8 s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* y[t] = W x[t] for t < T over rows r0..r1 of W [rows, cols] (row-major): each weight row is read
 * once per call. */
static void matvec_rows(const float *w, const float *x, float *y, int r0, int r1, int cols, int T, int y_stride) {
    for (int r = r0; r < r1; r++) {
        const float *wr = w + (int64_t)r * cols;
        for (int t = 0; t < T; t++) y[(int64_t)t * y_stride + r] = dot(wr, x + (int64_t)t * cols, cols);
    }
}

/* One helper thread takes the second half of the rows of large products: decoding is bound by
 * reading weights from memory, which one core does not saturate. It spins briefly between jobs
 * (the products of one token follow each other closely), then sleeps. Each row's arithmetic is
 * the same whichever thread does it, so results do not depend on the split; rows the helper has
 * not claimed by the time the caller finishes its half, the caller does itself. One caller at a time
 * uses the helper; a concurrent caller (another engine's thread) computes alone. A process confined
 * to one CPU (an RL rollout worker) starts no helper: it would only spin on the caller's core. */
#define SPLIT_MIN_FLOATS (64 * 1024)
#define SPIN_ROUNDS 20000

typedef struct { const float *w, *x; float *y; int r0, r1, cols, T, y_stride; } Rows;

static struct {
    pthread_mutex_t use, mu;
    pthread_cond_t wake;
    atomic_int posted, claimed, done, sleeping;
    int started;
    Rows job;
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
        Rows j = pool.job;
        matvec_rows(j.w, j.x, j.y, j.r0, j.r1, j.cols, j.T, j.y_stride);
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

static void matvec(const float *w, const float *x, float *y, int rows, int cols, int T, int y_stride) {
    if ((int64_t)rows * cols < SPLIT_MIN_FLOATS || pthread_mutex_trylock(&pool.use) != 0) {
        matvec_rows(w, x, y, 0, rows, cols, T, y_stride);
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
        matvec_rows(w, x, y, 0, rows, cols, T, y_stride);
        return;
    }
    int mid = rows / 2, seq = atomic_load(&pool.posted) + 1;
    pool.job = (Rows){w, x, y, mid, rows, cols, T, y_stride};
    atomic_store(&pool.posted, seq);
    if (atomic_load(&pool.sleeping)) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_signal(&pool.wake);
        pthread_mutex_unlock(&pool.mu);
    }
    matvec_rows(w, x, y, 0, mid, cols, T, y_stride);
    int expected = seq - 1;  /* a helper not yet awake (waking costs more than the rows): do them here */
    if (atomic_compare_exchange_strong(&pool.claimed, &expected, seq))
        matvec_rows(w, x, y, mid, rows, cols, T, y_stride);
    else
        while (atomic_load(&pool.done) != seq) relax();
    pthread_mutex_unlock(&pool.use);
}

static void rms_norm(const float *x, const float *w, float *out, int n, float eps) {
    float ss = dot(x, x, n);
    float scale = 1.f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = w ? w[i] * (x[i] * scale) : x[i] * scale;
}

static float silu(float x) { return x / (1.f + expf(-x)); }

/* Rotate-half RoPE of one head in place (HF's convention: pairs i and i + hd/2). */
static void rope(float *x, int hd, int pos, const float *inv_freq) {
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        float f = (float)pos * inv_freq[i];
        float c = cosf(f), s = sinf(f), a = x[i], b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

/* Scratch floats a call needs for T tokens. */
int64_t kiln_scratch_floats(const Model *m, int T) {
    int64_t d = m->dim, q = (int64_t)m->n_heads * m->head_dim, kv = (int64_t)m->n_kv_heads * m->head_dim;
    int64_t inner = m->moe_inner > m->dense_inner ? m->moe_inner : m->dense_inner;
    return T * (d + q + 2 * kv + q + 2 * inner + m->n_experts + 2 * d) + 2 * inner + d + m->max_tokens;
}

/* Decoder layer l over T tokens of one sequence at positions pos0.., in place on hidden [T, D].
 * kc/vc: this layer's cache for the sequence, [kv_head][max_len][head_dim]. routes (may be NULL):
 * the chosen experts of token t at routes[t * route_stride + j]. */
static void block(const Model *m, int l, float *hidden, int T, int pos0, float *kc, float *vc, int max_len,
                  int32_t *routes, int route_stride, float *scratch) {
    const int D = m->dim, H = m->n_heads, KV = m->n_kv_heads, hd = m->head_dim, E = m->n_experts, K = m->top_k;
    const int Q = H * hd, KVD = KV * hd, group = H / KV;
    const float inv_sqrt = 1.f / sqrtf((float)hd);
    float *h = scratch, *q = h + (int64_t)T * D, *k = q + (int64_t)T * Q, *v = k + (int64_t)T * KVD;
    float *att = v + (int64_t)T * KVD;
    int inner = m->moe_inner > m->dense_inner ? m->moe_inner : m->dense_inner;
    float *gu = att + (int64_t)T * Q, *probs = gu + (int64_t)T * 2 * inner;
    float *act = probs + (int64_t)T * E, *y = act + 2 * inner, *scores = y + D;

    /* attention */
    for (int t = 0; t < T; t++) rms_norm(hidden + (int64_t)t * D, m->ln1[l], h + (int64_t)t * D, D, m->eps);
    matvec(m->wq[l], h, q, Q, D, T, Q);
    matvec(m->wk[l], h, k, KVD, D, T, KVD);
    matvec(m->wv[l], h, v, KVD, D, T, KVD);
    for (int t = 0; t < T; t++) {
        int pos = pos0 + t;
        for (int j = 0; j < H; j++) {
            float *qj = q + (int64_t)t * Q + j * hd;
            if (m->q_norm[l]) rms_norm(qj, m->q_norm[l], qj, hd, m->eps);  /* NULL: none (Llama) */
            rope(qj, hd, pos, m->inv_freq);
        }
        for (int j = 0; j < KV; j++) {
            float *kj = k + (int64_t)t * KVD + j * hd;
            if (m->k_norm[l]) rms_norm(kj, m->k_norm[l], kj, hd, m->eps);
            rope(kj, hd, pos, m->inv_freq);
            memcpy(kc + ((int64_t)j * max_len + pos) * hd, kj, hd * sizeof(float));
            memcpy(vc + ((int64_t)j * max_len + pos) * hd, v + (int64_t)t * KVD + j * hd, hd * sizeof(float));
        }
    }
    for (int t = 0; t < T; t++) {  /* causal: token t sees positions 0..pos0+t of its own slot */
        int n = pos0 + t + 1;
        for (int j = 0; j < H; j++) {
            const float *qj = q + (int64_t)t * Q + j * hd;
            const float *kh = kc + (int64_t)(j / group) * max_len * hd, *vh = vc + (int64_t)(j / group) * max_len * hd;
            float mx = -INFINITY, sum = 0.f;
            for (int p = 0; p < n; p++) {
                scores[p] = dot(qj, kh + (int64_t)p * hd, hd) * inv_sqrt;
                if (scores[p] > mx) mx = scores[p];
            }
            for (int p = 0; p < n; p++) sum += (scores[p] = expf(scores[p] - mx));
            float *o = att + (int64_t)t * Q + j * hd;
            memset(o, 0, hd * sizeof(float));
            for (int p = 0; p < n; p++) {
                const float w = scores[p] / sum, *vp = vh + (int64_t)p * hd;
                for (int i = 0; i < hd; i++) o[i] += w * vp[i];
            }
        }
    }
    for (int t = 0; t < T; t++) {
        matvec(m->wo[l], att + (int64_t)t * Q, y, D, Q, 1, D);
        for (int i = 0; i < D; i++) hidden[(int64_t)t * D + i] += y[i];
    }
    /* feed-forward */
    for (int t = 0; t < T; t++) rms_norm(hidden + (int64_t)t * D, m->ln2[l], h + (int64_t)t * D, D, m->eps);
    if (m->router[l] == NULL) {
        int I = m->dense_inner;
        for (int t = 0; t < T; t++) {
            const float *ht = h + (int64_t)t * D;
            matvec(m->gate[l], ht, act, I, D, 1, I);
            matvec(m->up[l], ht, act + I, I, D, 1, I);
            for (int i = 0; i < I; i++) act[i] = silu(act[i]) * act[I + i];
            matvec(m->down_dense[l], act, y, D, I, 1, D);
            for (int i = 0; i < D; i++) hidden[(int64_t)t * D + i] += y[i];
        }
        return;
    }
    int I = m->moe_inner;
    matvec(m->router[l], h, probs, E, D, T, E);
    for (int t = 0; t < T; t++) {
        float *p = probs + (int64_t)t * E, mx = -INFINITY, sum = 0.f, wsum = 0.f;
        for (int e = 0; e < E; e++) if (p[e] > mx) mx = p[e];
        for (int e = 0; e < E; e++) sum += (p[e] = expf(p[e] - mx));
        for (int e = 0; e < E; e++) p[e] /= sum;
        int chosen[16];
        float weight[16];
        for (int j = 0; j < K; j++) {  /* top-k, ties to the lower id */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int used = 0;
                for (int u = 0; u < j; u++) used |= chosen[u] == e;
                if (!used && (best < 0 || p[e] > p[best])) best = e;
            }
            chosen[j] = best;
            weight[j] = p[best];
            wsum += p[best];
        }
        float *ht = h + (int64_t)t * D, *out = hidden + (int64_t)t * D;
        for (int j = 0; j < K; j++) {
            int e = chosen[j];
            float w = m->norm_topk ? weight[j] / wsum : weight[j];
            if (routes) routes[(int64_t)t * route_stride + j] = e;
            matvec(m->gate_up[l] + (int64_t)e * 2 * I * D, ht, gu, 2 * I, D, 1, 2 * I);
            for (int i = 0; i < I; i++) act[i] = silu(gu[i]) * gu[I + i];
            matvec(m->down[l] + (int64_t)e * D * I, act, y, D, I, 1, D);
            for (int i = 0; i < D; i++) out[i] += w * y[i];
        }
    }
}

/* Run T tokens (ids at positions pos0.., one sequence) through the trunk.
 * k_cache/v_cache: this sequence's slot of layer 0; the layer stride and the cache length in
 * positions (max_len) locate the rest: [layer][kv_head][max_len][head_dim].
 * hidden: [T, D] out, the trunk's output before the final norm.
 * routes: [T, n_moe_layers, top_k] expert ids. */
void kiln_trunk(const Model *m, const int64_t *ids, int T, int pos0, float *k_cache, float *v_cache,
                int64_t layer_stride, int max_len, float *hidden, int32_t *routes, float *scratch) {
    const int D = m->dim, K = m->top_k;
    int n_moe = 0;
    for (int l = 0; l < m->n_layers; l++) n_moe += m->router[l] != NULL;
    for (int t = 0; t < T; t++) memcpy(hidden + (int64_t)t * D, m->embed + ids[t] * D, D * sizeof(float));
    for (int l = 0, moe_i = 0; l < m->n_layers; l++) {
        int moe = m->router[l] != NULL;
        block(m, l, hidden, T, pos0, k_cache + l * layer_stride, v_cache + l * layer_stride, max_len,
              moe ? routes + moe_i * K : NULL, n_moe * K, scratch);
        moe_i += moe;
    }
}

/* MTP layer l (kiln/model/mtp.py): out [T, D] = block_l(eh_proj(cat(hnorm(h_in), enorm(embed(ids))))),
 * with the layer's own cache (as kiln_trunk's arguments). */
void kiln_mtp_layer(const Model *m, int l, const float *h_in, const int64_t *ids, int T, int pos0, float *k_cache,
                    float *v_cache, int64_t layer_stride, int max_len, float *out, float *scratch) {
    const int D = m->dim;
    float *cat = scratch + kiln_scratch_floats(m, T) - (int64_t)T * 2 * D;  /* the tail the block leaves alone */
    for (int t = 0; t < T; t++) {
        rms_norm(h_in + (int64_t)t * D, m->hnorm[l], cat + (int64_t)t * 2 * D, D, m->eps);
        rms_norm(m->embed + ids[t] * D, m->enorm[l], cat + (int64_t)t * 2 * D + D, D, m->eps);
    }
    matvec(m->eh_proj[l], cat, out, D, 2 * D, T, D);
    block(m, l, out, T, pos0, k_cache + l * layer_stride, v_cache + l * layer_stride, max_len, NULL, 0, scratch);
}

/* logits [T, V] = head(norm(hidden [T, D])), norm the final norm's weight (or an MTP layer's). */
void kiln_head(const Model *m, const float *norm, const float *hidden, int T, int vocab, float *logits, float *scratch) {
    for (int t = 0; t < T; t++) rms_norm(hidden + (int64_t)t * m->dim, norm, scratch + (int64_t)t * m->dim, m->dim, m->eps);
    matvec(m->head, scratch, logits, vocab, m->dim, T, vocab);
}
