"""CUDA source handling that needs no GPU: files, names, includes, hash."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcpax.ops import _kernel_source as ks

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_file_exists_and_defines_its_kernels():
    sources = ks.kernel_sources()
    assert "hpcpax_common.cuh" in sources
    for filename, names in ks.NAME_EXPRESSIONS.items():
        assert filename in sources, filename
        code = ks.module_code(filename)
        assert "#include \"hpcpax_common.cuh\"" not in code  # pasted in
        assert "typedef long long hp_index" in code
        for name in names:
            base = name.split("<")[0]
            assert re.search(rf"__global__\s+void\s+{base}\s*\(", code), name
            if "<" in name:  # nvcc --ptx only emits explicitly instantiated templates
                assert re.search(rf"template\s+__global__\s+void\s+{base}<T, VEC>", code), name
                assert "HP_FOR_EACH_VEC(" in code.split("#define HP_FOR_EACH_VEC")[-1], name


def test_row_variants_are_the_headers_instantiations():
    header = ks.kernel_sources()["hpcpax_common.cuh"]
    listed = re.findall(r"INSTANTIATE\((\w+), (\d)\)", header.split("#define HP_FOR_EACH_VEC")[1])
    assert tuple((ctype, int(vec)) for ctype, vec in listed) == ks.ROW_VARIANTS
    # at most 16 bytes per access
    assert all(vec * {"float": 4, "double": 8}[ctype] <= 16 for ctype, vec in ks.ROW_VARIANTS)


def test_every_cu_file_is_loaded():
    on_disk = {p.name for p in (ROOT / "kernels").glob("*.cu")}
    assert on_disk == set(ks.NAME_EXPRESSIONS)


def test_includes_pasted_once():
    sources = {"a.cu": '#include "h.cuh"\n#include "h.cuh"\nA', "h.cuh": "H"}
    assert ks.module_code("a.cu", sources).split() == ["H", "A"]


def test_hash_follows_headers():
    sources = dict(ks.kernel_sources())
    before = ks.kernels_hash(sources)
    sources["hpcpax_common.cuh"] += "\n// edited\n"
    assert ks.kernels_hash(sources) != before
    assert len(before) == 16
    options = ks.compile_options()
    assert "--fmad=false" in options
    assert f"-DHPCPAX_KERNELS_HASH=0x{ks.kernels_hash()}" in options


def test_header_constants_are_read_from_the_header():
    assert ks.header_constant("HP_SUM_CHUNK") == 64
    # whole warps per block: teams of up to 32 lanes never straddle two blocks
    assert ks.header_constant("HP_ROW_THREADS") % 32 == 0
    assert ks.header_constant("HP_TREE_THREADS") % 32 == 0
    assert ks.header_constant("HP_SUM_BATCH") == 8
    with pytest.raises(KeyError, match="HP_NO_SUCH_CONSTANT"):
        ks.header_constant("HP_NO_SUCH_CONSTANT")


def test_benchmark_quick_prints_one_json_line():
    out = subprocess.run([sys.executable, "benchmarks/kernels.py", "--quick", "--repeats", "1"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert {"ratio_vs_add_at", "fraction_of_copy_bw", "dedup_sum", "adagrad_rows"} <= set(data)
