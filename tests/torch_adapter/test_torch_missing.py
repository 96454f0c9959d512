"""Without PyTorch, ``import hpcpax`` works and ``import hpcpax.torch`` names the fix."""

import subprocess
import sys


def test_missing_torch_is_named():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import hpcpax\n"
            "try:\n"
            "    import hpcpax.torch\n"
            "except hpcpax.DependencyError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "hpcpax.torch needs PyTorch: pip install hpcpax[torch]" in out.stdout
