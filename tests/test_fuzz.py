"""The sanitizer fuzz harness's short run (tools/fuzz_kernels.py, about 60 s after its build):
every kernel called through the AOT ABI with random shapes, values and broken arguments, under
AddressSanitizer and UndefinedBehaviorSanitizer, on every instruction-set path this CPU has, the
accepted results compared with the golden model. The long run is the same command with
--seconds (README, "Kernels that never trust their caller")."""
import os
import subprocess
import sys

import pytest

from conftest import DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ_SECONDS = float(os.environ.get("MS_MOE_OPS_FUZZ_SECONDS", "60"))


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "CPU", reason="CPU only: fuzzes the CPU kernels")
def test_sanitizer_fuzz_short_run():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fuzz_kernels.py"),
                           "--seconds", str(FUZZ_SECONDS)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode == 3:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "no finding" in done.stdout
