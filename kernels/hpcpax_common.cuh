// Shared definitions of the hpcpax kernels. Compiled by NVRTC through
// cupy.RawModule (the loader inlines this header) and by nvcc --ptx in CI.
#pragma once

typedef long long hp_index;  // int64 ids and offsets, as NumPy's int64

// One thread per element of an [rows, dim] grid, grid-stride loop.
#define HP_GRID_LOOP(i, total)                                              \
    for (hp_index i = (hp_index)blockIdx.x * blockDim.x + threadIdx.x;     \
         i < (total); i += (hp_index)blockDim.x * gridDim.x)

// Batch of loads issued before the adds they feed, so their latency overlaps.
#define HP_SUM_BATCH 16

// Segments longer than this are summed by segment_sum_long (dedup_sum.cu):
// one block per (segment, HP_LONG_COLS columns), HP_LONG_THREADS threads,
// rows staged through two shared-memory tiles of HP_LONG_TILE_BYTES each.
#define HP_LONG_SEGMENT 256
#define HP_LONG_COLS 32
#define HP_LONG_THREADS 512
#define HP_LONG_TILE_BYTES 16384

// acc + values[order[begin]*dim + c] + ... + values[order[end-1]*dim + c],
// added one at a time in k order (so bit-equal to a sequential CPU loop).
template <typename T>
__device__ __forceinline__ T hp_sequential_sum(T acc, const T* __restrict__ values,
                                               const hp_index* __restrict__ order,
                                               hp_index begin, hp_index end,
                                               hp_index dim, hp_index c) {
    hp_index k = begin;
    for (; k + HP_SUM_BATCH <= end; k += HP_SUM_BATCH) {
        T batch[HP_SUM_BATCH];
#pragma unroll
        for (int j = 0; j < HP_SUM_BATCH; ++j) batch[j] = values[order[k + j] * dim + c];
#pragma unroll
        for (int j = 0; j < HP_SUM_BATCH; ++j) acc += batch[j];
    }
    for (; k < end; ++k) acc += values[order[k] * dim + c];
    return acc;
}
