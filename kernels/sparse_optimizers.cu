// Lazy row-wise optimizers: only rows listed in `rows` (unique) change.
// Same formulas and operation order as hpcpax/ops/optimizers.py; the loader
// compiles with --fmad=false so no multiply-add is fused, which keeps the
// results bit-equal to NumPy. One team of lanes per row, VEC elements per
// access (the math is per element, so vector width changes no result).
#include "hpcpax_common.cuh"

// Loop over the vectors of row k (lanes of its team) with p = table row
// offset and i = gradient row offset, both in vectors.
#define HP_OPT_ROWS(n, nvec, group)                                        \
    HP_TEAM_LOOP(k, lane, group, n)                                        \
        for (hp_index j = lane, p = rows[k] * (nvec) + lane, i = k * (nvec) + lane; j < (nvec); \
             j += (group), p += (group), i += (group))

template <typename T, int VEC>
__global__ void sgd_rows(T* __restrict__ param, const hp_index* __restrict__ rows,
                         const T* __restrict__ grads, hp_index n, hp_index nvec, int group, T lr) {
    HP_OPT_ROWS(n, nvec, group) {
        hp_vec<T, VEC> w = hp_load<T, VEC>(param, p);
        const hp_vec<T, VEC> g = hp_load<T, VEC>(grads, i);
#pragma unroll
        for (int q = 0; q < VEC; ++q) w.v[q] = w.v[q] - lr * g.v[q];
        hp_store<T, VEC>(param, p, w);
    }
}

template <typename T, int VEC>
__global__ void momentum_rows(T* __restrict__ param, T* __restrict__ accum,
                              const hp_index* __restrict__ rows, const T* __restrict__ grads,
                              hp_index n, hp_index nvec, int group, T lr, T momentum,
                              T lr_momentum, int nesterov) {
    HP_OPT_ROWS(n, nvec, group) {
        hp_vec<T, VEC> w = hp_load<T, VEC>(param, p);
        hp_vec<T, VEC> a = hp_load<T, VEC>(accum, p);
        const hp_vec<T, VEC> g = hp_load<T, VEC>(grads, i);
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
            a.v[q] = momentum * a.v[q] + g.v[q];
            w.v[q] = nesterov ? w.v[q] - (lr * g.v[q] + lr_momentum * a.v[q]) : w.v[q] - lr * a.v[q];
        }
        hp_store<T, VEC>(accum, p, a);
        hp_store<T, VEC>(param, p, w);
    }
}

template <typename T, int VEC>
__global__ void adagrad_rows(T* __restrict__ param, T* __restrict__ accum,
                             const hp_index* __restrict__ rows, const T* __restrict__ grads,
                             hp_index n, hp_index nvec, int group, T lr, T eps) {
    HP_OPT_ROWS(n, nvec, group) {
        hp_vec<T, VEC> w = hp_load<T, VEC>(param, p);
        hp_vec<T, VEC> a = hp_load<T, VEC>(accum, p);
        const hp_vec<T, VEC> g = hp_load<T, VEC>(grads, i);
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
            a.v[q] = a.v[q] + g.v[q] * g.v[q];
            w.v[q] = w.v[q] - lr * g.v[q] / (sqrt(a.v[q]) + eps);
        }
        hp_store<T, VEC>(accum, p, a);
        hp_store<T, VEC>(param, p, w);
    }
}

template <typename T, int VEC>
__global__ void adam_rows(T* __restrict__ param, T* __restrict__ m, T* __restrict__ v,
                          const hp_index* __restrict__ rows, const T* __restrict__ grads,
                          hp_index n, hp_index nvec, int group, T lr_t, T beta1,
                          T one_minus_beta1, T beta2, T one_minus_beta2, T eps) {
    HP_OPT_ROWS(n, nvec, group) {
        hp_vec<T, VEC> w = hp_load<T, VEC>(param, p);
        hp_vec<T, VEC> mt = hp_load<T, VEC>(m, p);
        hp_vec<T, VEC> vt = hp_load<T, VEC>(v, p);
        const hp_vec<T, VEC> g = hp_load<T, VEC>(grads, i);
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
            mt.v[q] = beta1 * mt.v[q] + one_minus_beta1 * g.v[q];
            vt.v[q] = beta2 * vt.v[q] + one_minus_beta2 * (g.v[q] * g.v[q]);
            w.v[q] = w.v[q] - lr_t * mt.v[q] / (sqrt(vt.v[q]) + eps);
        }
        hp_store<T, VEC>(m, p, mt);
        hp_store<T, VEC>(v, p, vt);
        hp_store<T, VEC>(param, p, w);
    }
}

#define HP_OPT_INSTANTIATE(T, VEC)                                                                    \
    template __global__ void sgd_rows<T, VEC>(T*, const hp_index*, const T*, hp_index, hp_index, int, T); \
    template __global__ void momentum_rows<T, VEC>(T*, T*, const hp_index*, const T*, hp_index,       \
                                                   hp_index, int, T, T, T, int);                      \
    template __global__ void adagrad_rows<T, VEC>(T*, T*, const hp_index*, const T*, hp_index,        \
                                                  hp_index, int, T, T);                               \
    template __global__ void adam_rows<T, VEC>(T*, T*, T*, const hp_index*, const T*, hp_index,       \
                                               hp_index, int, T, T, T, T, T, T);
HP_FOR_EACH_VEC(HP_OPT_INSTANTIATE)
