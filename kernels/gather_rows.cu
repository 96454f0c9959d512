// Row gather for embedding tables: out[k] = table[ids[k]], one team of lanes
// per row, each lane VEC elements per access (16 bytes at most), so a row is
// read and written in whole, coalesced transactions. (scatter_add_rows sums in
// dedup_sum.cu: it is a segment sum that starts from the table row.)
#include "hpcpax_common.cuh"

template <typename T, int VEC>
__global__ void gather_rows(const T* __restrict__ table, const hp_index* __restrict__ ids,
                            hp_index n, hp_index nvec, int group, T* __restrict__ out) {
    HP_TEAM_LOOP(k, lane, group, n) {
        const T* src = table + ids[k] * nvec * VEC;
        T* dst = out + k * nvec * VEC;
        for (hp_index j = lane; j < nvec; j += group) hp_store<T, VEC>(dst, j, hp_load<T, VEC>(src, j));
    }
}

#define HP_GATHER_INSTANTIATE(T, VEC) \
    template __global__ void gather_rows<T, VEC>(const T*, const hp_index*, hp_index, hp_index, int, T*);
HP_FOR_EACH_VEC(HP_GATHER_INSTANTIATE)
