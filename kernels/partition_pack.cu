// Packing of sparse rows by destination partition (for Alltoallv).
#include "hpcpax_common.cuh"

// Partition of each global row id; kind 0 = mod, 1 = range (the first
// `remainder` parts hold base + 1 rows). Same formula as hpcpax.partitioning.
__global__ void partition_of(const hp_index* __restrict__ ids, hp_index n, int kind,
                             hp_index num_parts, hp_index base, hp_index remainder,
                             hp_index* __restrict__ parts) {
    HP_GRID_LOOP(k, n) {
        const hp_index row = ids[k];
        if (kind == 0) {
            parts[k] = row % num_parts;
        } else {
            const hp_index boundary = remainder * (base + 1);
            parts[k] = row < boundary ? row / (base + 1)
                                      : remainder + (row - boundary) / base;
        }
    }
}

// packed row j = row order[j] of the input; ids packed alongside.
template <typename T>
__global__ void pack_rows(const hp_index* __restrict__ ids, const T* __restrict__ values,
                          const hp_index* __restrict__ order, hp_index n, hp_index dim,
                          hp_index* __restrict__ packed_ids, T* __restrict__ packed_values) {
    HP_GRID_LOOP(i, n * dim) {
        const hp_index j = i / dim;
        const hp_index c = i - j * dim;
        const hp_index src = order[j];
        packed_values[i] = values[src * dim + c];
        if (c == 0) packed_ids[j] = ids[src];
    }
}

template __global__ void pack_rows<float>(const hp_index*, const float*, const hp_index*, hp_index,
                                          hp_index, hp_index*, float*);
template __global__ void pack_rows<double>(const hp_index*, const double*, const hp_index*, hp_index,
                                           hp_index, hp_index*, double*);
