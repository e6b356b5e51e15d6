"""The test suite's own promise to the edit loop: collecting it reads no vLLM.

`make test-fast` deselects the tests that need vLLM, but pytest imports
every module before it deselects anything; a module that imported vLLM at
the top would cost every fast run vLLM's import (about 12 s here), and
would fail outright where vLLM is not installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

COLLECT = """
import sys, pytest
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]])
print("vllm modules imported:", sorted(name for name in sys.modules if name.split(".")[0] == "vllm")[:5])
sys.exit(code)
"""


def test_collecting_every_test_module_imports_no_vllm():
    result = subprocess.run([sys.executable, "-c", COLLECT, str(TESTS)], capture_output=True, text=True,
                            timeout=300, cwd=TESTS.parent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "vllm modules imported: []" in result.stdout, result.stdout[-3000:]
