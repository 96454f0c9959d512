// Shared definitions of the hpcpax kernels. Compiled by NVRTC through
// cupy.RawModule (the loader inlines this header) and by nvcc --ptx in CI.
#pragma once

typedef long long hp_index;  // int64 ids and offsets, as NumPy's int64

// One thread per element of an [rows, dim] grid, grid-stride loop.
#define HP_GRID_LOOP(i, total)                                              \
    for (hp_index i = (hp_index)blockIdx.x * blockDim.x + threadIdx.x;     \
         i < (total); i += (hp_index)blockDim.x * gridDim.x)

// The summation order of dedup_sum and scatter_add_rows (hpcpax/ops/summation.py
// reads this value; it is defined here only): an id's rows in input order, in
// chunks of HP_SUM_CHUNK rows summed one at a time, chunk sums combined by a
// fixed pairwise tree. A power of two.
#define HP_SUM_CHUNK 64

// Rows whose loads a team issues before the adds they feed, so their latency overlaps.
#define HP_SUM_BATCH 8

// Threads per block of the row kernels; teams of `group` lanes (a power of
// two <= 32, chosen by the launcher from the row width) each own one row.
#define HP_ROW_THREADS 256
// Threads per block of segment_tree (one block per long segment).
#define HP_TREE_THREADS 256

static_assert((HP_SUM_CHUNK & (HP_SUM_CHUNK - 1)) == 0, "HP_SUM_CHUNK must be a power of two");

// VEC consecutive elements of a row, loaded and stored as one access
// (16 bytes at most; the launcher checks the alignment).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) hp_vec {
    T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ hp_vec<T, VEC> hp_load(const T* __restrict__ row, hp_index j) {
    return reinterpret_cast<const hp_vec<T, VEC>*>(row)[j];
}

template <typename T, int VEC>
__device__ __forceinline__ void hp_store(T* __restrict__ row, hp_index j, const hp_vec<T, VEC>& x) {
    reinterpret_cast<hp_vec<T, VEC>*>(row)[j] = x;
}

template <typename T, int VEC>
__device__ __forceinline__ hp_vec<T, VEC> hp_zero() {
    hp_vec<T, VEC> x;
#pragma unroll
    for (int q = 0; q < VEC; ++q) x.v[q] = T(0);
    return x;
}

// Teams of `group` lanes, one row (or segment, or chunk) per team, grid-stride.
// `team` is the item, `lane` the team's lane; no warp-level sync is used, so
// teams of one warp may diverge freely.
#define HP_TEAM_LOOP(team, lane, group, items)                                          \
    const int lane = (int)(threadIdx.x & ((group) - 1));                                \
    for (hp_index team = ((hp_index)blockIdx.x * blockDim.x + threadIdx.x) / (group);   \
         team < (items); team += ((hp_index)blockDim.x * gridDim.x) / (group))

// acc + rows order[begin], ..., order[end - 1] of `values` (vector j of each
// row, nvec vectors a row), added one at a time in k order: per column the
// same adds as a sequential CPU loop. Loads go out HP_SUM_BATCH rows ahead.
template <typename T, int VEC>
__device__ __forceinline__ hp_vec<T, VEC> hp_sequential_sum(hp_vec<T, VEC> acc,
                                                            const T* __restrict__ values,
                                                            const hp_index* __restrict__ order,
                                                            hp_index begin, hp_index end,
                                                            hp_index nvec, hp_index j) {
    hp_index k = begin;
    for (; k + HP_SUM_BATCH <= end; k += HP_SUM_BATCH) {
        hp_vec<T, VEC> batch[HP_SUM_BATCH];
#pragma unroll
        for (int b = 0; b < HP_SUM_BATCH; ++b) batch[b] = hp_load<T, VEC>(values + order[k + b] * nvec * VEC, j);
#pragma unroll
        for (int b = 0; b < HP_SUM_BATCH; ++b) {
#pragma unroll
            for (int q = 0; q < VEC; ++q) acc.v[q] += batch[b].v[q];
        }
    }
    for (; k < end; ++k) {
        const hp_vec<T, VEC> x = hp_load<T, VEC>(values + order[k] * nvec * VEC, j);
#pragma unroll
        for (int q = 0; q < VEC; ++q) acc.v[q] += x.v[q];
    }
    return acc;
}

// Explicit instantiations of a row kernel template K<T, VEC> for every
// (type, vector width) the launchers use: float x {1, 2, 4}, double x {1, 2}.
#define HP_FOR_EACH_VEC(INSTANTIATE) \
    INSTANTIATE(float, 1)            \
    INSTANTIATE(float, 2)            \
    INSTANTIATE(float, 4)            \
    INSTANTIATE(double, 1)           \
    INSTANTIATE(double, 2)
