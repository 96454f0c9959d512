// Row gather and deterministic row scatter-add for embedding tables.
#include "hpcpax_common.cuh"

// out[k, c] = table[ids[k], c]; one thread per output element.
template <typename T>
__global__ void gather_rows(const T* __restrict__ table,
                            const hp_index* __restrict__ ids,
                            hp_index n, hp_index dim, T* __restrict__ out) {
    HP_GRID_LOOP(i, n * dim) {
        const hp_index k = i / dim;
        const hp_index c = i - k * dim;
        out[i] = table[ids[k] * dim + c];
    }
}

// table[unique_ids[s], c] += values[order[k], c] for k in segment s, one add
// at a time in input order (order comes from a stable sort): bit-equal to
// np.add.at(table, ids, values). One thread per (unique row, column), so no
// two threads touch the same element and no atomics are needed. Segments
// longer than max_len are skipped: segment_sum_long (dedup_sum.cu) adds them
// in the same order.
template <typename T>
__global__ void scatter_add_sorted(T* __restrict__ table,
                                   const T* __restrict__ values,
                                   const hp_index* __restrict__ order,
                                   const hp_index* __restrict__ starts,
                                   const hp_index* __restrict__ unique_ids,
                                   hp_index n_unique, hp_index dim, hp_index max_len) {
    HP_GRID_LOOP(i, n_unique * dim) {
        const hp_index s = i / dim;
        const hp_index c = i - s * dim;
        if (starts[s + 1] - starts[s] > max_len) continue;
        T* target = table + unique_ids[s] * dim + c;
        *target = hp_sequential_sum(*target, values, order, starts[s], starts[s + 1], dim, c);
    }
}

template __global__ void gather_rows<float>(const float*, const hp_index*, hp_index, hp_index, float*);
template __global__ void gather_rows<double>(const double*, const hp_index*, hp_index, hp_index, double*);
template __global__ void scatter_add_sorted<float>(float*, const float*, const hp_index*, const hp_index*,
                                                   const hp_index*, hp_index, hp_index, hp_index);
template __global__ void scatter_add_sorted<double>(double*, const double*, const hp_index*,
                                                    const hp_index*, const hp_index*, hp_index, hp_index,
                                                    hp_index);
