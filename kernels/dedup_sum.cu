// Deterministic segment sums for dedup_sum (and scatter_add_rows).
// After a stable sort of the ids, segment s covers sorted positions
// [starts[s], starts[s+1]); its rows are summed one at a time in input order,
// starting from +0, so the result is bit-equal to the NumPy reference.
// Segments longer than max_len (the hot rows of a skewed batch) are left to
// segment_sum_long, which keeps the same order of adds but stages the rows
// through shared memory, so one thread's chain of adds is not bound by the
// latency of its own loads.
#include "hpcpax_common.cuh"

// One thread per (segment, column): adjacent threads read adjacent columns.
// Segments longer than max_len are skipped (segment_sum_long writes them).
template <typename T>
__global__ void segment_sum_sorted(const T* __restrict__ values,
                                   const hp_index* __restrict__ order,
                                   const hp_index* __restrict__ starts,
                                   hp_index n_unique, hp_index dim, hp_index max_len,
                                   T* __restrict__ out) {
    HP_GRID_LOOP(i, n_unique * dim) {
        const hp_index s = i / dim;
        const hp_index c = i - s * dim;
        if (starts[s + 1] - starts[s] > max_len) continue;
        out[i] = hp_sequential_sum(T(0), values, order, starts[s], starts[s + 1], dim, c);
    }
}

// Long segments: block (x, y) sums segment segments[x] over columns
// [32*y, 32*y + 32) into out row out_rows[x], starting from +0 or, when
// accumulate is set, from that row's current value (scatter-add). The adds
// are those of hp_sequential_sum, in the same order, so the result is the
// same bit for bit. Warp 0 adds one tile of rows from shared memory while
// the other warps stage the next tile (double-buffered): each loader warp
// issues all its rows' loads at once, with the order indices fetched a tile
// ahead, so a tile costs about one memory latency. Launch with HP_LONG_THREADS
// threads per block (on an H200, 512 measured 1.26-1.33x faster than 256
// and 1024 no faster; benchmarks/results/kernels_gpu-2026-12-04.json).
template <typename T>
__global__ void segment_sum_long(const T* __restrict__ values,
                                 const hp_index* __restrict__ order,
                                 const hp_index* __restrict__ starts,
                                 const hp_index* __restrict__ segments,
                                 const hp_index* __restrict__ out_rows,
                                 hp_index dim, int accumulate, T* __restrict__ out) {
    constexpr int ROWS = HP_LONG_TILE_BYTES / (HP_LONG_COLS * (int)sizeof(T));
    constexpr int LOADERS = HP_LONG_THREADS / HP_LONG_COLS - 1;  // warps 1..LOADERS
    constexpr int PER_WARP = (ROWS + LOADERS - 1) / LOADERS;     // rows a loader warp stages
    static_assert(PER_WARP <= HP_LONG_COLS, "one order index per lane");
    __shared__ T tile[2][ROWS][HP_LONG_COLS];
    const int lane = threadIdx.x % HP_LONG_COLS;
    const int warp = threadIdx.x / HP_LONG_COLS;
    const hp_index s = segments[blockIdx.x];
    const hp_index c = (hp_index)blockIdx.y * HP_LONG_COLS + lane;
    const bool in_row = c < dim;
    const hp_index begin = starts[s];
    const hp_index end = starts[s + 1];
    const hp_index num_tiles = (end - begin + ROWS - 1) / ROWS;

    // Loader warp w stages rows (w - 1) + j * LOADERS of a tile (j < PER_WARP);
    // its lane j holds the order index of its j-th row.
    const int lane_row = (warp - 1) + lane * LOADERS;
    auto fetch_index = [&](hp_index t) -> hp_index {
        const hp_index k = begin + t * ROWS + lane_row;
        return (lane < PER_WARP && lane_row < ROWS && k < end) ? order[k] : 0;
    };
    auto stage = [&](hp_index t, hp_index index) {
        T (*buffer)[HP_LONG_COLS] = tile[t & 1];
        const hp_index row0 = begin + t * ROWS;
        T v[PER_WARP];
#pragma unroll
        for (int j = 0; j < PER_WARP; ++j) {
            const int r = (warp - 1) + j * LOADERS;
            const hp_index src = __shfl_sync(0xffffffffu, index, j);
            v[j] = (r < ROWS && row0 + r < end && in_row) ? values[src * dim + c] : T(0);
        }
#pragma unroll
        for (int j = 0; j < PER_WARP; ++j) {
            const int r = (warp - 1) + j * LOADERS;
            if (r < ROWS) buffer[r][lane] = v[j];
        }
    };

    hp_index index = 0;
    if (warp > 0) {
        stage(0, fetch_index(0));
        if (num_tiles > 1) index = fetch_index(1);
    }
    __syncthreads();
    T acc = T(0);
    if (warp == 0 && in_row && accumulate) acc = out[out_rows[blockIdx.x] * dim + c];
    for (hp_index t = 0; t < num_tiles; ++t) {
        if (warp == 0) {
            const T (*buffer)[HP_LONG_COLS] = tile[t & 1];
            const hp_index row0 = begin + t * ROWS;
            const int rows = (int)(end - row0 < ROWS ? end - row0 : ROWS);
#pragma unroll 8
            for (int r = 0; r < rows; ++r) acc += buffer[r][lane];
        } else if (t + 1 < num_tiles) {
            const hp_index current = index;
            if (t + 2 < num_tiles) index = fetch_index(t + 2);
            stage(t + 1, current);
        }
        __syncthreads();
    }
    if (warp == 0 && in_row) out[out_rows[blockIdx.x] * dim + c] = acc;
}

// Heads of the runs of equal ids in a sorted array: flags[k] = 1 where a run starts.
__global__ void mark_segment_heads(const hp_index* __restrict__ sorted_ids,
                                   hp_index n, int* __restrict__ flags) {
    HP_GRID_LOOP(k, n) {
        flags[k] = (k == 0 || sorted_ids[k] != sorted_ids[k - 1]) ? 1 : 0;
    }
}

template __global__ void segment_sum_sorted<float>(const float*, const hp_index*, const hp_index*,
                                                   hp_index, hp_index, hp_index, float*);
template __global__ void segment_sum_sorted<double>(const double*, const hp_index*, const hp_index*,
                                                    hp_index, hp_index, hp_index, double*);
template __global__ void segment_sum_long<float>(const float*, const hp_index*, const hp_index*,
                                                 const hp_index*, const hp_index*, hp_index, int, float*);
template __global__ void segment_sum_long<double>(const double*, const hp_index*, const hp_index*,
                                                  const hp_index*, const hp_index*, hp_index, int, double*);
