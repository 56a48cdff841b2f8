"""Old import path (a shim): FP8 lives in :mod:`mixprec.formats` (docs/ARCHITECTURE.md).
``mixprec.fp8.X`` and ``mixprec.fp8.<module>`` keep working."""
from mixprec import _compat
from mixprec.formats import *  # noqa: F403 - the shim re-exports the public names
from mixprec.formats import __all__  # noqa: F401
from mixprec.formats import convert, emulation, fp8_config, fp8_linear, fp8_quantize

_compat.alias(__name__, config=fp8_config, convert=convert, emulation=emulation, linear=fp8_linear,
              quantize=fp8_quantize)
