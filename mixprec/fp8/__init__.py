"""Old import path (a shim): FP8 lives in :mod:`mixprec.formats` (docs/ARCHITECTURE.md).
``mixprec.fp8.X`` and ``mixprec.fp8.<module>`` keep working."""
from mixprec import _compat
from mixprec.formats import *  # noqa: F403 - the shim re-exports the public names
from mixprec.formats import __all__ as _formats_all

__all__ = [*_formats_all, "convert_to_fp8", "prepare_fp8", "Fp8ConversionReport"]
from mixprec.formats import emulation, fp8_config, fp8_linear, fp8_quantize
from mixprec.precision import fp8_convert
from mixprec.precision.fp8_convert import Fp8ConversionReport, convert_to_fp8  # noqa: F401
from mixprec.precision.precision import prepare_fp8  # noqa: F401

_compat.alias(__name__, config=fp8_config, convert=fp8_convert, emulation=emulation, linear=fp8_linear,
              quantize=fp8_quantize)
