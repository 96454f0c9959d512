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

// packed row j = row order[j] of the input, ids packed alongside; one team
// of lanes per row, VEC elements per access.
template <typename T, int VEC>
__global__ void pack_rows(const hp_index* __restrict__ ids, const T* __restrict__ values,
                          const hp_index* __restrict__ order, hp_index n, hp_index nvec, int group,
                          hp_index* __restrict__ packed_ids, T* __restrict__ packed_values) {
    HP_TEAM_LOOP(j, lane, group, n) {
        const hp_index src = order[j];
        const T* from = values + src * nvec * VEC;
        T* to = packed_values + j * nvec * VEC;
        for (hp_index v = lane; v < nvec; v += group) hp_store<T, VEC>(to, v, hp_load<T, VEC>(from, v));
        if (lane == 0) packed_ids[j] = ids[src];
    }
}

#define HP_PACK_INSTANTIATE(T, VEC)                                                             \
    template __global__ void pack_rows<T, VEC>(const hp_index*, const T*, const hp_index*, hp_index, \
                                               hp_index, int, hp_index*, T*);
HP_FOR_EACH_VEC(HP_PACK_INSTANTIATE)
