// Lazy row-wise optimizers: only rows listed in `rows` (unique) change.
// Same formulas and operation order as hpcpax/ops/optimizers.py; the loader
// compiles with --fmad=false so no multiply-add is fused, which keeps the
// results bit-equal to NumPy. One thread per (row, column).
#include "hpcpax_common.cuh"

template <typename T>
__global__ void sgd_rows(T* __restrict__ param, const hp_index* __restrict__ rows,
                         const T* __restrict__ grads, hp_index n, hp_index dim, T lr) {
    HP_GRID_LOOP(i, n * dim) {
        const hp_index k = i / dim;
        const hp_index p = rows[k] * dim + (i - k * dim);
        param[p] = param[p] - lr * grads[i];
    }
}

template <typename T>
__global__ void momentum_rows(T* __restrict__ param, T* __restrict__ accum,
                              const hp_index* __restrict__ rows, const T* __restrict__ grads,
                              hp_index n, hp_index dim, T lr, T momentum, T lr_momentum,
                              int nesterov) {
    HP_GRID_LOOP(i, n * dim) {
        const hp_index k = i / dim;
        const hp_index p = rows[k] * dim + (i - k * dim);
        const T g = grads[i];
        const T a = momentum * accum[p] + g;
        accum[p] = a;
        param[p] = nesterov ? param[p] - (lr * g + lr_momentum * a) : param[p] - lr * a;
    }
}

template <typename T>
__global__ void adagrad_rows(T* __restrict__ param, T* __restrict__ accum,
                             const hp_index* __restrict__ rows, const T* __restrict__ grads,
                             hp_index n, hp_index dim, T lr, T eps) {
    HP_GRID_LOOP(i, n * dim) {
        const hp_index k = i / dim;
        const hp_index p = rows[k] * dim + (i - k * dim);
        const T g = grads[i];
        const T a = accum[p] + g * g;
        accum[p] = a;
        param[p] = param[p] - lr * g / (sqrt(a) + eps);
    }
}

template <typename T>
__global__ void adam_rows(T* __restrict__ param, T* __restrict__ m, T* __restrict__ v,
                          const hp_index* __restrict__ rows, const T* __restrict__ grads,
                          hp_index n, hp_index dim, T lr_t, T beta1, T one_minus_beta1,
                          T beta2, T one_minus_beta2, T eps) {
    HP_GRID_LOOP(i, n * dim) {
        const hp_index k = i / dim;
        const hp_index p = rows[k] * dim + (i - k * dim);
        const T g = grads[i];
        const T mt = beta1 * m[p] + one_minus_beta1 * g;
        const T vt = beta2 * v[p] + one_minus_beta2 * (g * g);
        m[p] = mt;
        v[p] = vt;
        param[p] = param[p] - lr_t * mt / (sqrt(vt) + eps);
    }
}

#define HP_INSTANTIATE(T)                                                                    \
    template __global__ void sgd_rows<T>(T*, const hp_index*, const T*, hp_index, hp_index, T); \
    template __global__ void momentum_rows<T>(T*, T*, const hp_index*, const T*, hp_index,     \
                                              hp_index, T, T, T, int);                        \
    template __global__ void adagrad_rows<T>(T*, T*, const hp_index*, const T*, hp_index,      \
                                             hp_index, T, T);                                 \
    template __global__ void adam_rows<T>(T*, T*, T*, const hp_index*, const T*, hp_index,     \
                                          hp_index, T, T, T, T, T, T);
HP_INSTANTIATE(float)
HP_INSTANTIATE(double)
