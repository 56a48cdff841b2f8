"""``import mixprec`` needs neither Lightning nor transformers; the integrations import them."""
import subprocess
import sys


def test_import_mixprec_imports_no_framework():
    code = ("import sys, mixprec, mixprec.integrations, mixprec.integrations.common; "
            "print(sorted(m for m in ('lightning', 'transformers', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
