// Deterministic segment sums for dedup_sum.
// After a stable sort of the ids, segment s covers sorted positions
// [starts[s], starts[s+1]); its rows are summed one at a time in input order,
// starting from +0, so the result is bit-equal to the NumPy reference.
#include "hpcpax_common.cuh"

// One thread per (segment, column): adjacent threads read adjacent columns.
template <typename T>
__global__ void segment_sum_sorted(const T* __restrict__ values,
                                   const hp_index* __restrict__ order,
                                   const hp_index* __restrict__ starts,
                                   hp_index n_unique, hp_index dim,
                                   T* __restrict__ out) {
    HP_GRID_LOOP(i, n_unique * dim) {
        const hp_index s = i / dim;
        const hp_index c = i - s * dim;
        out[i] = hp_sequential_sum(T(0), values, order, starts[s], starts[s + 1], dim, c);
    }
}

// Heads of the runs of equal ids in a sorted array: flags[k] = 1 where a run starts.
__global__ void mark_segment_heads(const hp_index* __restrict__ sorted_ids,
                                   hp_index n, int* __restrict__ flags) {
    HP_GRID_LOOP(k, n) {
        flags[k] = (k == 0 || sorted_ids[k] != sorted_ids[k - 1]) ? 1 : 0;
    }
}

template __global__ void segment_sum_sorted<float>(const float*, const hp_index*, const hp_index*,
                                                   hp_index, hp_index, float*);
template __global__ void segment_sum_sorted<double>(const double*, const hp_index*, const hp_index*,
                                                    hp_index, hp_index, double*);
