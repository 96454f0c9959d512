"""Data, configs and checkpoints are data: never unpickled, evaluated or executed.

(h5py itself never unpickles: object arrays are written only as UTF-8 string
datasets, and reading one gives bytes/str, so HDF5 files need no pattern here.)"""

import re
from pathlib import Path

import hpcpax

PACKAGE = Path(hpcpax.__file__).resolve().parent
FORBIDDEN = {
    r"\bpickle\.loads?\(": "pickle.load",
    r"\bcloudpickle\b": "cloudpickle",
    r"\bmarshal\.loads?\(": "marshal.load",
    r"allow_pickle\s*=\s*True": "np.load(allow_pickle=True)",
    r"(?<![\w.])eval\(": "eval",
    r"(?<![\w.])exec\(": "exec",
    r"\byaml\.load\(": "yaml.load",
    r"\btorch\.load\(": "torch.load",
    r"\bshelve\b": "shelve",
    r"\bh5py\.vlen_dtype\(\s*object": "h5py object vlen",
}


def test_no_unpickling_or_evaluation_in_the_package():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            for pattern, what in FORBIDDEN.items():
                if re.search(pattern, code):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {what}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_np_load_calls_refuse_pickles():
    for path in sorted(PACKAGE.rglob("*.py")):
        for line in path.read_text().splitlines():
            if re.search(r"\bnp\.load\(", line):
                assert "allow_pickle=True" not in line, f"{path}: {line}"
