/* The runtime's CPU kernels (inference/cpu_kernels.py): decode / verify attention, RMSNorm, RoPE and, on CPUs without
 * native bfloat16, the bfloat16 linear.
 *
 * Attention: each query row on its own, over only the keys its mask shows, in slot order. So a token's output cannot
 * depend on how many rows the forward has, on where its keys sit in the cache or on the span: decoding a token alone
 * equals verifying it in a chain or as a tree node.
 * Every sum runs in a fixed order (dot products in 8 lanes added pairwise, the softmax and the weighted values key
 * by key), and -ffp-contract=off keeps the compiler from fusing multiply-adds differently in its two clones.
 *
 * attend(q, k, v, mask, out, B, nh, kvh, T, S, hd, q_sb, q_sh, q_st, k_sb, k_sh, v_sb, v_sh, m_sb, m_st, bf16,
 *        scale)
 *   q [B, nh, T, hd], k / v [B, kvh, S, hd] (slot stride hd), float32 or bfloat16 (bf16=1), element stride 1,
 *   other strides in elements; mask [B, 1, T, S] bool (m_sb, m_st); out [B, T, nh, hd] contiguous, q's dtype.
 *   Pointers are passed as integers (torch's data_ptr()).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8
#define INLINE static inline __attribute__((always_inline))

typedef float v8 __attribute__((vector_size(32))); /* LANES floats: one AVX register, two SSE ones */

INLINE v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof(x));
    return x;
}

/* the lanes of a sum added pairwise: every sum over a row (dot products, squares) ends in this order */
INLINE float sum_lanes(v8 lane) {
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

INLINE void load_row(const void *src, int bf16, Py_ssize_t hd, float *dst) {
    if (!bf16) {
        memcpy(dst, src, (size_t)hd * sizeof(float));
        return;
    }
    const uint16_t *s = src;
    for (Py_ssize_t d = 0; d < hd; d++) {
        uint32_t u = (uint32_t)s[d] << 16;
        memcpy(dst + d, &u, sizeof(float));
    }
}

INLINE uint16_t to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) (no NaNs here) */
    uint32_t u;
    memcpy(&u, &f, sizeof(float));
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* e^x for x <= 0, to ~2 ulp: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r, 2^n by exponent bits.
 * Branch-free, so the compiler vectorizes the loop that calls it; below -87 it returns 2^-126 (not 0), which a
 * softmax over at least one key of weight 1 cannot tell from 0 after rounding. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504f + 12582912.0f; /* 1.5 * 2^23: t - that constant is round(x / ln2) */
    float n = t - 12582912.0f;
    float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666679e-2f + r * (8.33336077e-3f +
                                                                                                  r * 1.38889e-3f)))));
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof(float));
    return p * scale;
}


/* One row of the attention for head_dim HD (a constant where the caller specializes it, so q and the output
 * accumulator stay in registers). Scores: 8-lane dot products added pairwise; then the softmax weights; then the
 * weights' sum and the weighted values, key by key in slot order. */
INLINE void attend_row(const float *qf, const float *K, const float *V, const uint8_t *m, Py_ssize_t S, Py_ssize_t HD,
                       float scale, float *w, float *acc, float *total_out) {
    v8 q[32], o[32]; /* HD <= 256 */
    Py_ssize_t C = HD / LANES;
    float top = -INFINITY, total = 0.0f;
    for (Py_ssize_t c = 0; c < C; c++) q[c] = load8(qf + c * LANES), o[c] = (v8){0};
    for (Py_ssize_t s = 0; s < S; s++) {
        if (!m[s]) continue;
        v8 lane = {0};
        for (Py_ssize_t c = 0; c < C; c++) lane += q[c] * load8(K + s * HD + c * LANES);
        float x = sum_lanes(lane) * scale;
        w[s] = x;
        top = x > top ? x : top;
    }
    for (Py_ssize_t s = 0; s < S; s++) w[s] = m[s] ? exp_nonpositive(w[s] - top) : 0.0f;
    for (Py_ssize_t s = 0; s < S; s++) {
        if (!m[s]) continue;
        float x = w[s];
        total += x;
        for (Py_ssize_t c = 0; c < C; c++) o[c] += x * load8(V + s * HD + c * LANES);
    }
    for (Py_ssize_t c = 0; c < C; c++) memcpy(acc + c * LANES, &o[c], sizeof(v8));
    *total_out = total;
}

typedef struct {
    const char *q, *k, *v;
    const uint8_t *mask;
    void *out;
    Py_ssize_t B, nh, kvh, T, S, hd, q_sb, q_sh, q_st, k_sb, k_sh, v_sb, v_sh, m_sb, m_st;
    int bf16;
    float scale;
} Args;

/* One (request, kv head) at a time: its visible keys and values converted to float32 once (bf16), then row by row
 * (q and the output accumulator stay hot): the scores, the softmax weights, the weighted values and the weights'
 * sum, each over the row's visible keys in slot order. scratch: S*(2*hd + 1) + 2*hd floats. */
__attribute__((target_clones("avx2", "default")))
static void attend_all(const Args *a, float *scratch, uint8_t *seen) {
    Py_ssize_t g = a->nh / a->kvh, R = a->T * g, hd = a->hd, S = a->S, es = a->bf16 ? 2 : 4;
    float *kbuf = scratch, *vbuf = kbuf + S * hd, *w = vbuf + S * hd, *qf = w + S;
    float *acc = qf + hd;
    for (Py_ssize_t b = 0; b < a->B; b++) {
        const uint8_t *mask = a->mask + b * a->m_sb;
        for (Py_ssize_t s = 0; s < S; s++) { /* the keys some row of request b sees */
            seen[s] = 0;
            for (Py_ssize_t t = 0; t < a->T; t++) seen[s] |= mask[t * a->m_st + s];
        }
        for (Py_ssize_t j = 0; j < a->kvh; j++) {
            const char *keys = a->k + (b * a->k_sb + j * a->k_sh) * es;
            const char *values = a->v + (b * a->v_sb + j * a->v_sh) * es;
            const float *K = (const float *)keys, *V = (const float *)values;
            if (a->bf16) {
                for (Py_ssize_t s = 0; s < S; s++)
                    if (seen[s]) {
                        load_row(keys + s * hd * es, 1, hd, kbuf + s * hd);
                        load_row(values + s * hd * es, 1, hd, vbuf + s * hd);
                    }
                K = kbuf, V = vbuf;
            }
            for (Py_ssize_t r = 0; r < R; r++) {
                Py_ssize_t t = r / g, h = j * g + r % g;
                const uint8_t *m = mask + t * a->m_st;
                load_row(a->q + (b * a->q_sb + h * a->q_sh + t * a->q_st) * es, a->bf16, hd, qf);
                float total;
                if (hd == 64) /* SmolLM2, Llama 2 / 3.2 (1B, 3B) */
                    attend_row(qf, K, V, m, S, 64, a->scale, w, acc, &total);
                else if (hd == 128) /* Llama 3 8B / 70B, Qwen2 7B+ */
                    attend_row(qf, K, V, m, S, 128, a->scale, w, acc, &total);
                else
                    attend_row(qf, K, V, m, S, hd, a->scale, w, acc, &total);
                Py_ssize_t at = ((b * a->T + t) * a->nh + h) * hd;
                for (Py_ssize_t d = 0; d < hd; d++) {
                    float x = acc[d] / total;
                    if (a->bf16)
                        ((uint16_t *)a->out)[at + d] = to_bf16(x);
                    else
                        ((float *)a->out)[at + d] = x;
                }
            }
        }
    }
}

static PyObject *attend(PyObject *self, PyObject *args) {
    Py_ssize_t q, k, v, mask, out;
    Args a;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnnnnnnnnnnif", &q, &k, &v, &mask, &out, &a.B, &a.nh, &a.kvh, &a.T, &a.S,
                          &a.hd, &a.q_sb, &a.q_sh, &a.q_st, &a.k_sb, &a.k_sh, &a.v_sb, &a.v_sh, &a.m_sb, &a.m_st,
                          &a.bf16, &a.scale))
        return NULL;
    if (a.kvh <= 0 || a.nh % a.kvh || a.hd % LANES || a.hd > 256) {
        PyErr_SetString(PyExc_ValueError, "attend: num_heads must be a multiple of kv_heads, head_dim of 8 (<= 256)");
        return NULL;
    }
    a.q = (const char *)q, a.k = (const char *)k, a.v = (const char *)v;
    a.mask = (const uint8_t *)mask, a.out = (void *)out;
    float *scratch = malloc((size_t)(a.S * (2 * a.hd + 1) + 2 * a.hd) * sizeof(float));
    uint8_t *seen = malloc((size_t)a.S);
    if (!scratch || !seen) {
        free(scratch);
        free(seen);
        return PyErr_NoMemory();
    }
    attend_all(&a, scratch, seen);
    free(scratch);
    free(seen);
    Py_RETURN_NONE;
}

/* LlamaRMSNorm per row: float32 statistics, x * rsqrt(mean(x^2) + eps) rounded to the input dtype, times the weight
 * (a bf16 product rounded once, as torch's bf16 multiply does). The squares are summed in 8 lanes added pairwise. */
__attribute__((target_clones("avx2", "default")))
static void rms_norm_rows(const void *x, const void *weight, void *out, Py_ssize_t rows, Py_ssize_t H, int bf16,
                          float eps, float *row) {
    for (Py_ssize_t i = 0; i < rows; i++) {
        load_row((const char *)x + i * H * (bf16 ? 2 : 4), bf16, H, row);
        v8 lane = {0};
        for (Py_ssize_t d = 0; d < H; d += LANES) lane += load8(row + d) * load8(row + d);
        float inv = 1.0f / sqrtf(sum_lanes(lane) / (float)H + eps);
        if (bf16) {
            const uint16_t *w = weight;
            uint16_t *o = (uint16_t *)out + i * H;
            for (Py_ssize_t d = 0; d < H; d++) {
                uint32_t hb = (uint32_t)to_bf16(row[d] * inv) << 16, wb = (uint32_t)w[d] << 16;
                float hf, wf;
                memcpy(&hf, &hb, sizeof(float));
                memcpy(&wf, &wb, sizeof(float));
                o[d] = to_bf16(wf * hf);
            }
        } else {
            const float *w = weight;
            float *o = (float *)out + i * H;
            for (Py_ssize_t d = 0; d < H; d++) o[d] = w[d] * (row[d] * inv);
        }
    }
}

static PyObject *rms_norm(PyObject *self, PyObject *args) {
    Py_ssize_t x, weight, out, rows, H;
    int bf16;
    float eps;
    if (!PyArg_ParseTuple(args, "nnnnnif", &x, &weight, &out, &rows, &H, &bf16, &eps)) return NULL;
    if (H % LANES) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: the hidden size must be a multiple of 8");
        return NULL;
    }
    float *row = malloc((size_t)H * sizeof(float));
    if (!row) return PyErr_NoMemory();
    rms_norm_rows((const void *)x, (const void *)weight, (void *)out, rows, H, bf16, eps, row);
    free(row);
    Py_RETURN_NONE;
}

/* RoPE as the runtime's torch code computes it, x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1],
 * each product and the sum rounded to the dtype as torch's ops round them: bitwise torch's result.
 * x [B, H, T, hd] (strides x_sb, x_sh, x_st; element stride 1), cos / sin [B, T, hd] (strides c_sb, c_st),
 * out [B, T, H, hd] contiguous, all of one dtype. */
__attribute__((target_clones("avx2", "default")))
static void rope_rows(const char *x, const char *cos, const char *sin, char *out, Py_ssize_t B, Py_ssize_t H,
                      Py_ssize_t T, Py_ssize_t hd, Py_ssize_t x_sb, Py_ssize_t x_sh, Py_ssize_t x_st,
                      Py_ssize_t c_sb, Py_ssize_t c_st, int bf16, float *buf) {
    Py_ssize_t es = bf16 ? 2 : 4, half = hd / 2;
    float *xf = buf, *cf = xf + hd, *sf = cf + hd, *of = sf + hd;
    for (Py_ssize_t b = 0; b < B; b++)
        for (Py_ssize_t t = 0; t < T; t++) {
            load_row(cos + (b * c_sb + t * c_st) * es, bf16, hd, cf);
            load_row(sin + (b * c_sb + t * c_st) * es, bf16, hd, sf);
            for (Py_ssize_t h = 0; h < H; h++) {
                load_row(x + (b * x_sb + h * x_sh + t * x_st) * es, bf16, hd, xf);
                char *o = out + (((b * T + t) * H + h) * hd) * es;
                for (Py_ssize_t d = 0; d < hd; d++) {
                    float rot = d < half ? -xf[d + half] : xf[d - half];
                    float a = xf[d] * cf[d], c = rot * sf[d];
                    if (bf16) {
                        uint32_t ab = (uint32_t)to_bf16(a) << 16, cb = (uint32_t)to_bf16(c) << 16;
                        memcpy(&a, &ab, sizeof(float));
                        memcpy(&c, &cb, sizeof(float));
                    }
                    of[d] = a + c;
                }
                if (bf16)
                    for (Py_ssize_t d = 0; d < hd; d++) ((uint16_t *)o)[d] = to_bf16(of[d]);
                else
                    memcpy(o, of, (size_t)hd * sizeof(float));
            }
        }
}

static PyObject *rope(PyObject *self, PyObject *args) {
    Py_ssize_t x, cos, sin, out, B, H, T, hd, x_sb, x_sh, x_st, c_sb, c_st;
    int bf16;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnnni", &x, &cos, &sin, &out, &B, &H, &T, &hd, &x_sb, &x_sh, &x_st, &c_sb,
                          &c_st, &bf16))
        return NULL;
    float *buf = malloc((size_t)(4 * hd) * sizeof(float));
    if (!buf) return PyErr_NoMemory();
    rope_rows((const char *)x, (const char *)cos, (const char *)sin, (char *)out, B, H, T, hd, x_sb, x_sh, x_st, c_sb,
              c_st, bf16, buf);
    free(buf);
    Py_RETURN_NONE;
}

/* bfloat16 linear for CPUs whose oneDNN has no native bfloat16 (AVX2 without AVX-512 BF16 / AMX), where torch's
 * bf16 GEMM ran at ~19 GFLOP/s against ~150 in float32.
 * out[r, n] = bf16(sum_k x[r, k] w[n, k] + bias[n]): each (r, n) sums in 8 float32 lanes, fused multiply-adds over k
 * in order, the lanes added pairwise, the bias added, rounded once. That sequence is the same whatever the number of
 * rows, the tile a row falls in or the thread that computes it, so a row's output is the same decoded alone or
 * verified among drafts. Threads split the output columns, on torch's own OpenMP team (GOMP_parallel looked up in
 * the OpenMP runtime torch loaded, see use_openmp), so no second pool competes with torch's for the cores.
 * x [R, K] float32 (converted by the caller's thread), w [N, K] bfloat16 row-major, bias [N] bf16 or NULL,
 * out [R, N] bfloat16; K a multiple of 8. */
#define NB 4 /* weight rows per tile */

typedef struct {
    const float *x;
    const uint16_t *w, *bias;
    uint16_t *out;
    Py_ssize_t R, K, N;
    float *scratch; /* NB * K floats per thread */
} Linear;

static void (*gomp_parallel)(void (*)(void *), void *, unsigned, unsigned);
static int (*omp_thread_num)(void);
static int (*omp_num_threads)(void);

__attribute__((target("avx2,fma"))) static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

__attribute__((target("avx2,fma"))) static inline void store_dot(const Linear *a, Py_ssize_t r, Py_ssize_t n,
                                                                  __m256 acc) {
    v8 lane;
    memcpy(&lane, &acc, sizeof(lane));
    float x = sum_lanes(lane);
    if (a->bias) {
        uint32_t u = (uint32_t)a->bias[n] << 16;
        float b;
        memcpy(&b, &u, sizeof(float));
        x += b;
    }
    a->out[r * a->N + n] = to_bf16(x);
}

/* columns [n0, n1): one row streams the weights as bf16; more rows convert a tile of NB weight rows to float32 once
 * and sweep the rows three (then two, then one) at a time over it. Both give every (r, n) the arithmetic described
 * above. */
__attribute__((target("avx2,fma"))) static void linear_columns(const Linear *a, Py_ssize_t n0, Py_ssize_t n1,
                                                                float *tile) {
    Py_ssize_t K = a->K, R = a->R;
    Py_ssize_t n = n0;
    for (; n + NB <= n1; n += NB) {
        const uint16_t *w = a->w + n * K;
        if (R == 1) {
            __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
            for (Py_ssize_t k = 0; k < K; k += LANES) {
                __m256 x = _mm256_loadu_ps(a->x + k);
                c0 = _mm256_fmadd_ps(load_bf16x8(w + k), x, c0);
                c1 = _mm256_fmadd_ps(load_bf16x8(w + K + k), x, c1);
                c2 = _mm256_fmadd_ps(load_bf16x8(w + 2 * K + k), x, c2);
                c3 = _mm256_fmadd_ps(load_bf16x8(w + 3 * K + k), x, c3);
            }
            store_dot(a, 0, n, c0), store_dot(a, 0, n + 1, c1), store_dot(a, 0, n + 2, c2);
            store_dot(a, 0, n + 3, c3);
            continue;
        }
        for (Py_ssize_t k = 0; k < NB * K; k += LANES) _mm256_storeu_ps(tile + k, load_bf16x8(w + k));
        const float *t0 = tile, *t1 = tile + K, *t2 = tile + 2 * K, *t3 = tile + 3 * K;
        Py_ssize_t r = 0;
        for (; r + 3 <= R; r += 3) { /* 12 accumulators + 3 inputs + 1 weight vector: the 16 AVX2 registers */
            const float *x0 = a->x + r * K, *x1 = x0 + K, *x2 = x1 + K;
            __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00, c20 = c00,
                   c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
            for (Py_ssize_t k = 0; k < K; k += LANES) {
                __m256 y0 = _mm256_loadu_ps(x0 + k), y1 = _mm256_loadu_ps(x1 + k), y2 = _mm256_loadu_ps(x2 + k), v;
                v = _mm256_loadu_ps(t0 + k), c00 = _mm256_fmadd_ps(v, y0, c00), c01 = _mm256_fmadd_ps(v, y1, c01),
                c02 = _mm256_fmadd_ps(v, y2, c02);
                v = _mm256_loadu_ps(t1 + k), c10 = _mm256_fmadd_ps(v, y0, c10), c11 = _mm256_fmadd_ps(v, y1, c11),
                c12 = _mm256_fmadd_ps(v, y2, c12);
                v = _mm256_loadu_ps(t2 + k), c20 = _mm256_fmadd_ps(v, y0, c20), c21 = _mm256_fmadd_ps(v, y1, c21),
                c22 = _mm256_fmadd_ps(v, y2, c22);
                v = _mm256_loadu_ps(t3 + k), c30 = _mm256_fmadd_ps(v, y0, c30), c31 = _mm256_fmadd_ps(v, y1, c31),
                c32 = _mm256_fmadd_ps(v, y2, c32);
            }
            store_dot(a, r, n, c00), store_dot(a, r + 1, n, c01), store_dot(a, r + 2, n, c02);
            store_dot(a, r, n + 1, c10), store_dot(a, r + 1, n + 1, c11), store_dot(a, r + 2, n + 1, c12);
            store_dot(a, r, n + 2, c20), store_dot(a, r + 1, n + 2, c21), store_dot(a, r + 2, n + 2, c22);
            store_dot(a, r, n + 3, c30), store_dot(a, r + 1, n + 3, c31), store_dot(a, r + 2, n + 3, c32);
        }
        for (; r + 2 <= R; r += 2) {
            const float *x0 = a->x + r * K, *x1 = x0 + K;
            __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
                   c31 = c00;
            for (Py_ssize_t k = 0; k < K; k += LANES) {
                __m256 y0 = _mm256_loadu_ps(x0 + k), y1 = _mm256_loadu_ps(x1 + k), v;
                v = _mm256_loadu_ps(t0 + k), c00 = _mm256_fmadd_ps(v, y0, c00), c01 = _mm256_fmadd_ps(v, y1, c01);
                v = _mm256_loadu_ps(t1 + k), c10 = _mm256_fmadd_ps(v, y0, c10), c11 = _mm256_fmadd_ps(v, y1, c11);
                v = _mm256_loadu_ps(t2 + k), c20 = _mm256_fmadd_ps(v, y0, c20), c21 = _mm256_fmadd_ps(v, y1, c21);
                v = _mm256_loadu_ps(t3 + k), c30 = _mm256_fmadd_ps(v, y0, c30), c31 = _mm256_fmadd_ps(v, y1, c31);
            }
            store_dot(a, r, n, c00), store_dot(a, r + 1, n, c01), store_dot(a, r, n + 1, c10);
            store_dot(a, r + 1, n + 1, c11), store_dot(a, r, n + 2, c20), store_dot(a, r + 1, n + 2, c21);
            store_dot(a, r, n + 3, c30), store_dot(a, r + 1, n + 3, c31);
        }
        for (; r < R; r++) {
            const float *x0 = a->x + r * K;
            __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
            for (Py_ssize_t k = 0; k < K; k += LANES) {
                __m256 y = _mm256_loadu_ps(x0 + k);
                c0 = _mm256_fmadd_ps(_mm256_loadu_ps(t0 + k), y, c0);
                c1 = _mm256_fmadd_ps(_mm256_loadu_ps(t1 + k), y, c1);
                c2 = _mm256_fmadd_ps(_mm256_loadu_ps(t2 + k), y, c2);
                c3 = _mm256_fmadd_ps(_mm256_loadu_ps(t3 + k), y, c3);
            }
            store_dot(a, r, n, c0), store_dot(a, r, n + 1, c1), store_dot(a, r, n + 2, c2), store_dot(a, r, n + 3, c3);
        }
    }
    for (; n < n1; n++) /* the last N % NB columns of this part */
        for (Py_ssize_t r = 0; r < R; r++) {
            const uint16_t *w = a->w + n * K;
            const float *x0 = a->x + r * K;
            __m256 c = _mm256_setzero_ps();
            for (Py_ssize_t k = 0; k < K; k += LANES) c = _mm256_fmadd_ps(load_bf16x8(w + k), _mm256_loadu_ps(x0 + k), c);
            store_dot(a, r, n, c);
        }
}

static void linear_part(void *arg) {
    const Linear *a = arg;
    int part = omp_thread_num ? omp_thread_num() : 0, parts = omp_num_threads ? omp_num_threads() : 1;
    Py_ssize_t tiles = (a->N + NB - 1) / NB;
    Py_ssize_t n0 = tiles * part / parts * NB, n1 = tiles * (part + 1) / parts * NB;
    if (n1 > a->N) n1 = a->N;
    if (n0 < n1) linear_columns(a, n0, n1, a->scratch + (Py_ssize_t)part * NB * a->K);
}

static PyObject *linear_bf16(PyObject *self, PyObject *args) {
    Py_ssize_t x, w, bias, out;
    Linear a;
    int threads;
    if (!PyArg_ParseTuple(args, "nnnnnnni", &x, &w, &bias, &out, &a.R, &a.K, &a.N, &threads)) return NULL;
    if (a.K % LANES || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        PyErr_SetString(PyExc_ValueError, "linear_bf16: needs AVX2 + FMA and an input size that is a multiple of 8");
        return NULL;
    }
    if (threads < 1 || !gomp_parallel) threads = 1;
    a.x = (const float *)x, a.w = (const uint16_t *)w, a.bias = (const uint16_t *)bias, a.out = (uint16_t *)out;
    a.scratch = malloc((size_t)threads * NB * a.K * sizeof(float));
    if (!a.scratch) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    if (threads == 1)
        linear_part(&a);
    else
        gomp_parallel(linear_part, &a, (unsigned)threads, 0);
    Py_END_ALLOW_THREADS
    free(a.scratch);
    Py_RETURN_NONE;
}

static PyObject *has_avx2_fma(PyObject *self, PyObject *args) {
    return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
}

/* use_openmp(path): the OpenMP runtime torch loaded (libgomp, or libiomp / libomp, which export GOMP_parallel too);
 * returns whether its entry points were found. Without it linear_bf16 runs on the calling thread. */
static PyObject *use_openmp(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib) {
        *(void **)&gomp_parallel = dlsym(lib, "GOMP_parallel");
        *(void **)&omp_thread_num = dlsym(lib, "omp_get_thread_num");
        *(void **)&omp_num_threads = dlsym(lib, "omp_get_num_threads");
    }
    if (!gomp_parallel || !omp_thread_num || !omp_num_threads) gomp_parallel = NULL;
    return PyBool_FromLong(gomp_parallel != NULL);
}

static PyMethodDef methods[] = {
    {"attend", attend, METH_VARARGS, "attend(q, k, v, mask, out, ...): see the top of the file"},
    {"rms_norm", rms_norm, METH_VARARGS, "rms_norm(x, weight, out, rows, hidden, bf16, eps): contiguous rows"},
    {"rope", rope, METH_VARARGS, "rope(x, cos, sin, out, B, H, T, hd, x_sb, x_sh, x_st, c_sb, c_st, bf16)"},
    {"linear_bf16", linear_bf16, METH_VARARGS, "linear_bf16(x, w, bias, out, R, K, N, threads): see linear_columns"},
    {"has_avx2_fma", has_avx2_fma, METH_NOARGS, "has_avx2_fma(): whether this CPU runs linear_bf16"},
    {"use_openmp", use_openmp, METH_VARARGS, "use_openmp(path): run linear_bf16 on that OpenMP runtime's threads"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels", "The runtime's CPU kernels", -1, methods};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&module); }
