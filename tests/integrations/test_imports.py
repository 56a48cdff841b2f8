"""``import mixprec`` needs neither Lightning nor transformers; the integrations import them.
Nor does it load FSDP2/DTensor (about a second of every CLI call and torchrun worker): the FSDP
strategy is imported when first named."""
import subprocess
import sys


def test_import_mixprec_imports_no_framework():
    heavy = ('lightning', 'transformers', 'accelerate', 'torch.distributed.tensor', 'torch.distributed.fsdp')
    code = ("import sys, mixprec, mixprec.integrations, mixprec.integrations.common, mixprec.cli.main; "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules)); "
            "from mixprec import FSDPStrategy; from mixprec.strategies import get_strategy, fsdp_mixed_precision; "
            "print(FSDPStrategy.__module__, 'torch.distributed.fsdp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "mixprec.strategies.fsdp True"]
