"""Pre-flight precision audit: find the misconfigurations that make mixed precision fail quietly.

``audit(model, policy=...)`` looks at the model, the policy, the optimizer, the loss scaler and the
hardware *before* training, and returns :class:`Finding` objects that each say what is wrong and
how to fix it. Everything is static except one opt-in probe: pass ``loss_fn`` (a zero-argument
callable running the forward on one batch) and the audit runs it once under ``torch.no_grad()`` and
the policy's autocast to see which dtype the loss really comes out in.

Checks (``code``: severity):

* ``no-master-weights``: error. Trainable parameters stored (or about to be stored, by the policy)
  in FP16/BF16 with an optimizer that keeps no FP32 masters — updates below half an ULP of the
  weight vanish. mixprec's master-weight optimizers are recognised by their ``master_grads``.
* ``double-cast``: warning. Parameters already 16-bit while the policy expects FP32 parameters
  and autocasts to 16 bits (a hand-made ``model.half()`` under ``16-mixed``).
* ``fp16-without-loss-scaler``: error. FP16 parameters or compute with no loss scaler, or one
  whose scaling is disabled — small gradients flush to zero in FP16.
* ``norm-eps-underflow``: error when a LayerNorm/RMSNorm ``eps`` rounds to zero in the dtype the
  norm computes in, warning when it is subnormal there. The rule: PyTorch's own norm layers
  (their kernels add eps in FP32 "opmath" even for 16-bit inputs, checked) and modules declaring
  ``keep_in_fp32`` (mixprec's norms upcast) compute in FP32; any other ``...Norm`` class, typically
  a hand-written ``x * rsqrt(x.pow(2).mean() + eps) * w``, computes in its parameters' effective
  dtype (as stored, or as the policy will cast them). ``var + eps`` matters only where ``var`` is ~0; there the sum *is* eps, so eps
  must survive on its own: a zero eps gives ``rsqrt(0) = inf``, a subnormal one is flushed to zero
  by kernels running flush-to-zero and has few significant bits. That ``1 + 1e-5 == 1`` in FP16 is
  harmless (eps is irrelevant when var is ~1) and is not reported.
* ``half-precision-norm`` / ``half-precision-gate``: warning. Norm or MoE gate/router parameters in
  16 bits (neither ``keep_in_fp32`` nor kept by the policy).
* ``half-precision-loss``: warning (probe only). The loss comes out in FP16/BF16.
* ``nonfinite-loss``: error (probe only). The loss of the probe batch is already NaN/Inf.
* ``fp8-unsupported``, ``bf16-emulated``, ``fp16-emulated``: warning. The policy asks for a format
  the device does not compute natively; the fix names the preset to use instead.

* ``layer-formats``: info. With per-layer formats (overrides, or FP8 in some layers only), the
  format every Linear computes in (the per-layer table's, :meth:`mixprec.Precision.resolve`: FP8
  already refused where the rules keep a layer out, before or after set-up).
* ``fp8-override-refused``: warning. An override asks FP8 for a layer the FP8 rules keep out
  (output head, gate, features not multiples of 16); the layer runs in the surrounding format.

``audit_after_first_step(model)`` adds ``no-gradient`` (warning): trainable parameters that got no
gradient from one full step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mixprec.amp.grads import HasMasterGrads
from mixprec.precision import Precision
from mixprec.errors import ConfigError
from mixprec.policy.dtypes import dtype_name, format_info
from mixprec.precision.rules import layer_kind as _layer_kind
from mixprec.precision.rules import norm_statistics_fp32 as _norm_statistics_fp32
from mixprec.policy.hardware import (bf16_is_fast, cpu_has_native_bf16, cpu_has_native_fp16,
                                       cuda_supports_fp8, describe_cpu)
from mixprec.policy.overrides import is_micro
from mixprec.policy.policy import Policy

__all__ = ["Finding", "audit", "audit_after_first_step", "format_findings"]

_LOW = (torch.float16, torch.bfloat16)
_SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One problem the audit found."""

    code: str
    """Stable identifier, e.g. ``fp16-without-loss-scaler``."""
    severity: str
    """``error`` (training will go wrong), ``warning`` (likely loss of accuracy or speed), ``info``."""
    message: str
    """What is wrong, with the names and numbers involved."""
    fix: str
    """What to change."""

    def __post_init__(self) -> None:
        if self.severity not in _SEVERITIES:
            raise ConfigError(f"Finding severity '{self.severity}' must be one of {', '.join(_SEVERITIES)}")


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _effective_dtype(fqn: str, module: nn.Module, p: torch.Tensor, precision: Precision) -> torch.dtype:
    """The dtype ``p`` trains in: as stored if already 16-bit, else what the precision casts it to."""
    if p.dtype in _LOW or not p.is_floating_point():
        return p.dtype
    return precision.layers.param_dtype_for(fqn, module)


def _scaler_enabled(scaler) -> bool:
    if scaler is None:
        return False
    if hasattr(scaler, "is_enabled"):
        return bool(scaler.is_enabled())
    return bool(getattr(scaler, "enabled", True))


def _module_dtype(fqn: str, module: nn.Module, precision: Precision) -> torch.dtype | None:
    ps = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
    if not ps:
        return None
    dts = {_effective_dtype(fqn, module, p, precision) for p in ps}
    return min(dts, key=lambda d: format_info(d).mantissa_bits)


def _check_params(model: nn.Module, precision: Precision, optimizer, findings: list[Finding]) -> None:
    low: list[str] = []
    hand_cast: list[str] = []
    low_ids: set[int] = set()
    for fqn, module in model.named_modules():
        for pn, p in module.named_parameters(recurse=False):
            if not p.requires_grad or not p.is_floating_point():
                continue
            name = f"{fqn}.{pn}" if fqn else pn
            if _effective_dtype(fqn, module, p, precision) in _LOW:
                low.append(name)
                low_ids.add(id(p))
            if p.dtype in _LOW and not precision.recipe.stores_low_precision and precision.recipe.autocasts:
                hand_cast.append(name)
    if low:
        if optimizer is not None and not isinstance(optimizer, HasMasterGrads):
            in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
            hit = [n for n, p in model.named_parameters() if id(p) in low_ids and id(p) in in_opt]
            if hit:
                findings.append(Finding(
                    code="no-master-weights", severity="error",
                    message=f"{len(hit)} 16-bit parameters ({_names(hit)}) are stepped by "
                            f"{type(optimizer).__name__}, which keeps no FP32 master copies: updates "
                            "smaller than half a 16-bit ULP are lost",
                    fix="use mixprec.optim.AdamW(..., fp16_params=True) or mixprec.optim.MasterWeights("
                        "torch.optim.X, params), or keep the parameters in fp32 ('16-mixed'/'bf16-mixed')"))
        elif optimizer is None and precision.recipe.loses_small_updates:
            findings.append(Finding(
                code="no-master-weights", severity="error",
                message=f"precision {precision} stores parameters in {dtype_name(precision.recipe.param_dtype)} with "
                        "master_weights=False: updates smaller than half a 16-bit ULP are lost",
                fix="set master_weights=True (the default for 16-bit parameters) or use a '-mixed' preset"))
    if hand_cast:
        dts = sorted({dtype_name(p.dtype) for p in model.parameters() if p.dtype in _LOW})
        findings.append(Finding(
            code="double-cast", severity="warning",
            message=f"{len(hand_cast)} parameters ({_names(hand_cast)}) are already {'/'.join(dts)} "
                    f"but precision {precision} keeps fp32 parameters and autocasts to "
                    f"{dtype_name(precision.recipe.compute_dtype)}: the model was cast by hand, so there are no "
                    "fp32 weights to update and autocast's fp32 ops upcast 16-bit values again",
            fix="remove model.half()/.to(dtype) and let the precision cast; for 16-bit storage use the "
                "'16-true'/'bf16-true' presets, which keep fp32 masters in the optimizer"))


def _check_scaler(model: nn.Module, precision: Precision, scaler, findings: list[Finding]) -> None:
    # The mode says whether it needs a scaler (FP16 compute or storage, per-layer FP16 overrides
    # included); FP16 parameters a user cast by hand need one too.
    fp16_params = any(p.dtype == torch.float16 for p in model.parameters() if p.requires_grad)
    if not (precision.recipe.scales_loss or precision.policy.uses_fp16 or fp16_params):
        return
    if _scaler_enabled(scaler):
        return
    what = "no loss scaler" if scaler is None else f"{type(scaler).__name__} with scaling disabled"
    findings.append(Finding(
        code="fp16-without-loss-scaler", severity="error",
        message=f"FP16 {_fp16_what(precision, fp16_params)} with {what}: "
                "gradients below 6e-8 flush to zero and small ones lose precision",
        fix="use mixprec.amp.GradScaler.from_policy(policy) (dynamic loss scaling), or train in bf16"))


def _fp16_what(precision: Precision, fp16_params: bool) -> str:
    if precision.recipe.compute_dtype == torch.float16:
        return "compute"
    if precision.recipe.param_dtype == torch.float16 or fp16_params:
        return "parameters"
    return "layers (per-layer overrides)"


def _check_layers(model: nn.Module, precision: Precision, findings: list[Finding]) -> None:
    norms: list[str] = []
    gates: list[str] = []
    kinds = {r.name: r.kind for r in precision.resolve(model)}     # what each layer is: the table's
    for fqn, module in model.named_modules():
        dt = _module_dtype(fqn, module, precision)
        # A module without parameters has no row: the rule book's kind for it (its eps check).
        kind = kinds[fqn] if fqn in kinds else _layer_kind(fqn, module)
        is_norm, is_gate = kind == "norm", kind == "gate"
        if dt in _LOW and is_norm:
            norms.append(fqn)
        elif dt in _LOW and is_gate:
            gates.append(fqn)
        eps = getattr(module, "eps", None)
        if is_norm and isinstance(eps, float) and eps > 0:
            fp32_math = _norm_statistics_fp32(module)
            calc = torch.float32 if fp32_math or dt is None else dt
            fi = format_info(calc)
            if eps <= fi.smallest_subnormal / 2 or eps < fi.tiny:
                zero = eps <= fi.smallest_subnormal / 2
                findings.append(Finding(
                    code="norm-eps-underflow", severity="error" if zero else "warning",
                    message=f"{fqn} ({type(module).__name__}) eps={eps:g} "
                            f"{'rounds to zero' if zero else 'is subnormal'} in {dtype_name(calc)} "
                            f"(smallest normal {fi.tiny:.3g}): where the variance is ~0, "
                            "rsqrt(var + eps) becomes inf",
                    fix=f"keep the norm in fp32 (mixprec.nn norms, keep_in_fp32=True) or use eps >= {fi.tiny:.3g}"))
    if norms:
        findings.append(Finding(
            code="half-precision-norm", severity="warning",
            message=f"normalisation layers {_names(norms)} have 16-bit parameters: their statistics "
                    "lose precision (bf16) or overflow (fp16: deviations above ~256 square past 65504)",
            fix="use mixprec.nn.RMSNorm / MixedPrecisionLayerNorm (keep_in_fp32), or add their names "
                "to Policy.keep_fp32_names"))
    if gates:
        findings.append(Finding(
            code="half-precision-gate", severity="warning",
            message=f"MoE gates/routers {_names(gates)} have 16-bit parameters: near-tied routing "
                    "scores flip experts and small probabilities round away",
            fix="use mixprec.nn.MoEGate (keep_in_fp32) or set keep_in_fp32 = True on the gate module"))


def _check_formats(model: nn.Module, precision: Precision, findings: list[Finding]) -> None:
    table = [r for r in precision.resolve(model) if r.per_layer]
    formats = {r.name: r.compute for r in table}
    if len(set(formats.values())) > 1 or precision.policy.overrides:
        findings.append(Finding(
            code="layer-formats", severity="info",
            message="Linear layers compute in: " + ", ".join(f"{n}={f}" for n, f in formats.items()),
            fix="change them with per-layer overrides (precision_overrides / [overrides]) or a plan "
                "file from `mixprec plan`"))
    refused = [(r.name, r.refused) for r in table
               if r.refused and (precision.policy.override_for(r.name) or "").startswith("fp8-")]
    if refused:
        findings.append(Finding(
            code="fp8-override-refused", severity="warning",
            message="overrides ask FP8 for layers the FP8 rules keep out: " +
                    "; ".join(f"{n} ({why}), runs {formats.get(n, precision.recipe.base_format)}" for n, why in refused),
            fix="narrow the override pattern, or give these layers bf16/fp32 explicitly"))


def _check_hardware(precision: Precision, device: torch.device, findings: list[Finding]) -> None:
    on_gpu = device.type == "cuda"
    dts = {precision.recipe.param_dtype, precision.recipe.compute_dtype}
    # Advice about a CPU comes from the CPU the audit runs on, never from where the docs were measured.
    cpu_fast = "bf16-mixed" if not on_gpu and cpu_has_native_bf16() else "32-true"
    cpu = "" if on_gpu else f" ({describe_cpu()})"
    if precision.policy.allow_tf32 and not on_gpu:
        findings.append(Finding(
            code="tf32-not-here", severity="warning",
            message=f"precision {precision.name} on {device.type}: TF32 is a CUDA tensor-core format, so "
                    "this run is plain FP32 here (same numerics and speed as 32-true)",
            fix="nothing to do on this machine; tf32 takes effect on an Ampere or newer GPU"))
    # Per-layer FP8 too (a plan or overrides): the formats set up, else the ones asked for.
    asked = precision.layers.formats.values() or [f for _, f in precision.policy.overrides]
    fp8_layers = sorted({f for f in asked if f.startswith("fp8-")})
    if (precision.recipe.fp8_recipe or fp8_layers) and not (on_gpu and cuda_supports_fp8()):
        what = precision.recipe.fp8_recipe or ", ".join(fp8_layers)   # a uniform mode, or per-layer FP8
        here = "this GPU" if on_gpu else f"this CPU{cpu}"
        if precision.recipe.fp8_recipe:
            fix = f"use '{'bf16-mixed' if on_gpu else cpu_fast}' on {here}"
        else:
            # Per-layer FP8 (a plan, overrides) on a base mode: the base is not what to change (it
            # may already be the mode that would be advised); the FP8 layers are.
            other = "bf16" if on_gpu or cpu_fast == "bf16-mixed" else "fp32"
            fix = (f"take those layers out of FP8 on {here}: plan again without FP8 candidates "
                   f"(mixprec plan --candidates fp32,bf16) or override them to {other}; the base "
                   f"'{precision.name}' stays")
        findings.append(Finding(
            code="fp8-unsupported", severity="warning",
            message=f"precision {precision} uses FP8 ({what}) but " + (
                f"{device} has no FP8 tensor cores (compute capability 8.9+): FP8 GEMMs run "
                "emulated" if on_gpu else
                f"FP8 GEMMs run emulated on the {device.type.upper()} (FP8 tensor cores need a GPU "
                "of compute capability 8.9+)") + ": correct but slower than bf16",
            fix=fix))
    micro = sorted({f for f in asked if is_micro(f)} | ({precision.policy.micro_format} - {None}))
    if micro:
        findings.append(Finding(
            code="micro-emulated", severity="warning",
            message=f"precision {precision} uses block-scaled formats ({', '.join(micro)}): mixprec "
                    "emulates them on every device (exact numerics, slower than bf16)",
            fix="use them to study numerics (`mixprec whatif`), train for speed in bf16-mixed or fp8-*"))
    if torch.bfloat16 in dts and not bf16_is_fast(device):
        findings.append(Finding(
            code="bf16-emulated", severity="warning",
            message=f"precision {precision} computes in bf16 but {device} emulates bf16 "
                    f"({'GPU older than Ampere' if on_gpu else 'no AVX512-BF16/AMX'}): slower than fp32",
            fix="use '16-mixed' (fp16 with loss scaling) on this GPU" if on_gpu
                else f"use '32-true' (fp32 is the fast format on this CPU{cpu})"))
    if torch.float16 in dts and not on_gpu and not cpu_has_native_fp16():
        findings.append(Finding(
            code="fp16-emulated", severity="warning",
            message=f"precision {precision} computes in fp16 on a CPU without fp16 matrix instructions: "
                    "emulated, slower than fp32",
            fix=f"use '{cpu_fast}' on this CPU{cpu}"))


def _check_loss(loss_fn: Callable[[], torch.Tensor], precision: Precision,
                findings: list[Finding]) -> None:
    with torch.no_grad(), precision.autocast():
        loss = loss_fn()
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"audit loss_fn must return the loss tensor, got {type(loss).__name__}")
    if loss.dtype in _LOW:
        findings.append(Finding(
            code="half-precision-loss", severity="warning",
            message=f"the loss comes out in {dtype_name(loss.dtype)}: log-softmax/cross-entropy in 16 "
                    "bits loses the small probabilities that carry the gradient",
            fix="compute the loss on logits.float() (mixprec.models.Transformer does), or cast the "
                "output with policy.output_dtype=fp32"))
    if not bool(torch.isfinite(loss).all()):
        findings.append(Finding(
            code="nonfinite-loss", severity="error",
            message=f"the loss of the probe batch is already {float(loss.float().mean())} before any update",
            fix="find the layer with mixprec.monitor.locate_nonfinite(model, step_fn); check inputs and init"))


def audit(model: nn.Module, *, policy: Policy | str | bool | None = None,
          precision: Precision | None = None, optimizer=None, scaler=None,
          loss_fn: Callable[[], torch.Tensor] | None = None,
          device: torch.device | str | None = None) -> list[Finding]:
    """Return everything that looks wrong with this precision setup, errors first (see module doc).

    Pass the run's :class:`~mixprec.Precision` (its scaler is then the one checked), or a
    ``policy`` with the ``scaler`` you use.
    """
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    if precision is None:
        if policy is None:
            raise ConfigError("audit() needs the precision (a mixprec.Precision) or a policy name")
        precision = Precision(policy, device=device)
    elif scaler is None:
        scaler = precision.scaler
    findings: list[Finding] = []
    _check_params(model, precision, optimizer, findings)
    _check_scaler(model, precision, scaler, findings)
    _check_layers(model, precision, findings)
    _check_hardware(precision, device, findings)
    _check_formats(model, precision, findings)
    if loss_fn is not None:
        _check_loss(loss_fn, precision, findings)
    return sorted(findings, key=lambda f: _SEVERITIES.index(f.severity))


def audit_after_first_step(model: nn.Module) -> list[Finding]:
    """Trainable parameters that received no gradient in the step just taken (call before zero_grad)."""
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if not missing:
        return []
    return [Finding(
        code="no-gradient", severity="warning",
        message=f"{len(missing)} trainable parameters got no gradient in the first step: {_names(missing)}",
        fix="they are not used by forward (a dead branch or unused head): remove them or set "
            "requires_grad=False; under DDP this also needs find_unused_parameters=True")]


def format_findings(findings: list[Finding]) -> str:
    """Human-readable report, one finding per two lines; says so when there is nothing to report."""
    if not findings:
        return "audit: no precision problems found"
    lines = []
    for f in findings:
        lines.append(f"{f.severity.upper():7} [{f.code}] {f.message}")
        lines.append(f"        fix: {f.fix}")
    counts = {s: sum(f.severity == s for f in findings) for s in _SEVERITIES}
    lines.append("audit: " + ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n))
    return "\n".join(lines)
