"""The per-layer precision planner: measure each Linear's sensitivity and cost, pick its format.

The calibration batches are split: the last third (at least one of two or more, or the
``heldout=`` batches given) is set aside for the whole-plan check below and seen by nothing else.

One FP32 forward and backward over the calibration batches records, for every Linear ``L``, its
input, output and output gradient, and its weight gradient. Then for every candidate format ``f``
``L`` is built as it would run in training (:class:`mixprec.Precision` with a per-layer override,
so the FP8 rules and modules are the training ones), and, with *only* ``L`` in ``f``:

* output SQNR: ``L_f(x)`` against ``L``'s FP32 output on the recorded inputs
  (:func:`mixprec.formats.sqnr_db`),
* input-gradient and weight-gradient SQNR: ``L_f``'s backward, from the recorded inputs and FP32
  output gradients, against the FP32 layer's (the input gradient is what ``L`` sends to the layers
  below, the weight gradient what its optimizer steps on),
* flushed share: of ``L``'s inputs and of its output gradients, the non-zero values ``f`` flushes
  to zero or saturates (:func:`mixprec.monitor.replan.flushed_share`, the re-planner's measure),
* loss change, measured: the model's forward loss with ``L`` swapped for ``L_f``: ``mean
  |loss_f - loss_fp32| / mean loss_fp32`` over the batches,
* loss change, estimated: the expected loss *increase* from ``L``'s output error ``e``, to second
  order with the diagonal empirical Fisher: ``1/2 * N * sum (g * e)^2`` per batch (``g`` the
  recorded gradient of the batch-mean loss w.r.t. ``L``'s output, ``N`` its rows), over the loss.

Why both loss changes: quantization noise is uncorrelated with the gradient, so the *first-order*
term ``g . e`` of a measured loss difference is zero-mean noise, and on a few calibration batches
it dominates. The estimate is free of it but sees only the forward. So the measurements are used
together (:func:`mixprec.monitor.gates.gate`): a format is refused for a layer when one of its SQNRs
is below that format's limit (:mod:`mixprec.formats.limits`, the guard's and the what-if's limits
too), or ``max_sqnr_drop_db`` below the other layers' median in that format while under 40 dB (the
layer the format treats worse than the rest: outliers), or it flushes more than the format's
limit of the layer's inputs or output gradients; the rest are ranked by the estimate
(``criterion="fisher"``, the default) or the single-layer measured change (``"measured"``).

**The promise is measured, never estimated** (:mod:`mixprec.plan.verify`): after the first choice
the whole plan is applied to a copy of the model and its loss change measured on the calibration
and the held-out batches; while either exceeds ``budget``, the layer whose move one format safer
lowers the whole plan's change the most is moved back. The table and the plan file record, per
layer and format, the estimate and the measured single-layer change, and for the plan the summed
estimate and both measured whole-plan changes.

Cost: one FP32 forward+backward, then per (layer, format) one forward over the batches plus the
layer's own GEMMs; the whole-plan check adds one forward over all batches per movable layer and
round of moving back.

Step-time model: each layer's GEMM FLOPs per token (``6 * in * out``: forward, input and weight gradient) at
the throughput of its format: measured on this machine with ``mixprec bench matmul``'s timer
(``target="measure"``), or the dense datasheet peaks of a GPU from :data:`mixprec.estimate.gpus.GPUS`
(``target="H100"``, ...). On a device without FP8 GEMMs FP8 would be emulated, so measured
targets drop the FP8 candidates (with a note). The estimated step time is the sum of the GEMM
times; the rest of the step does not depend on the plan and is left out.

First choice: every layer starts in its most accurate available candidate; then, greedily, the
move (layer -> faster format, not refused by a gate) with the largest time saved per unit of added
estimated loss change is taken while the sum stays within ``budget`` (a fraction of the loss;
default 0.1 %). Ties go to the larger saving, then to the layer name, so a plan is deterministic
for a seed and a stated throughput table. Then the whole-plan check above.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.precision import Precision
from mixprec.errors import ConfigError
from mixprec.formats import sqnr_db
from mixprec.plan.measure import (format_variants, layer_alone, losses_with, planned_layers,
                                  reference_pass)
from mixprec.monitor.gates import MAX_SQNR_DROP_DB, apply_gates
from mixprec.plan.plan import LayerMeasure, PrecisionPlan, choose, format_throughput
from mixprec.plan.verify import enforce_budget, forward_losses, fp32_copy
from mixprec.policy.overrides import parse_format

__all__ = ["plan_precision", "DEFAULT_CANDIDATES", "split_heldout"]

DEFAULT_CANDIDATES: tuple[str, ...] = ("fp32", "bf16", "fp8-tensorwise", "fp8-blockwise")


def _flushed(records: list[tuple[torch.Tensor, ...]], fmt: str, which: int) -> float:
    """Largest share over the batches of the recorded inputs (``which=0``) or output gradients
    (``which=2``) that ``fmt`` flushes to zero or saturates
    (:func:`mixprec.monitor.replan.flushed_share`, the re-planner's measurement)."""
    from mixprec.monitor.replan import flushed_share
    shares = [flushed_share(r[which], fmt, "act" if which == 0 else "grad")
              for r in records if len(r) > which]
    return float(torch.stack(shares).max()) if shares else 0.0


def _fisher_change(records: list[tuple[torch.Tensor, ...]], ref_out: torch.Tensor, out: torch.Tensor
                   ) -> float:
    """Second-order estimate of the loss increase from the layer's output error ``dy_err``:
    ``1/2 * sum_t (N * g_t)^2 . dy_err_t^2 / N`` per batch (diagonal empirical Fisher, ``g`` the
    recorded gradient of the batch-mean loss w.r.t. the output, ``N`` its rows), averaged over
    batches. Non-negative and free of the first-order noise a measured loss difference carries."""
    total, start = 0.0, 0
    for rec in records:
        if len(rec) < 3:
            return float("nan")
        g = rec[2].float().reshape(-1, rec[2].shape[-1])
        n = g.shape[0]
        err = (out[start:start + g.numel()] - ref_out[start:start + g.numel()]).reshape(g.shape)
        start += g.numel()
        total += 0.5 * n * float((g.square() * err.square()).sum())
    return total / len(records)


def split_heldout(batches: Sequence[Any], heldout: Sequence[Any] | None) -> tuple[list, list]:
    """(calibration, held-out): the held-out batches given, or the last third of ``batches`` (at
    least one when there are two or more)."""
    batches = list(batches)
    if heldout is not None:
        return batches, list(heldout)
    if len(batches) < 2:
        return batches, []
    n = max(1, len(batches) // 3)
    return batches[:-n], batches[-n:]


def _tokens(batches: Sequence[Any]) -> int:
    """Target tokens in ``batches`` (the last tensor of a tuple batch; ``labels`` of a dict)."""
    total = 0
    for b in batches:
        t = b.get("labels") if isinstance(b, dict) else (b[-1] if isinstance(b, (tuple, list)) else b)
        total += int(t.numel()) if isinstance(t, torch.Tensor) else 0
    return total


def plan_precision(model: nn.Module, batches: Sequence[Any], *,
                   candidates: Sequence[str] = DEFAULT_CANDIDATES, budget: float = 1e-3,
                   base: str = "auto", target: str | None = None,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                   layers: Sequence[str] | None = None, seed: int = 0, criterion: str = "fisher",
                   heldout: Sequence[Any] | None = None, min_sqnr_db: float | None = None,
                   max_flush: float | None = None, max_sqnr_drop_db: float = MAX_SQNR_DROP_DB,
                   progress: Callable[[str], None] | None = None) -> PrecisionPlan:
    """Measure each Linear's sensitivity to each candidate format, choose a plan, then measure the
    whole plan and move layers back until it keeps its budget (module doc).

    ``model``: an FP32 model (left untouched: the planner works on copies). ``batches``:
    calibration batches of any shape ``fit()`` takes (``(inputs, targets)``, a dict with
    ``labels``, ...), on the model's device; the loss is ``fit()``'s, from the same
    :class:`~mixprec.models.objective.Objective` (``loss_fn(outputs, targets)`` if given). ``heldout``: batches only the whole-plan check sees;
    default: the last third of ``batches`` is set aside (none with a single batch, said in the
    notes). ``budget``: the allowed relative change of the loss of the *whole plan*, as a fraction
    of the FP32 loss, on the calibration and the held-out batches. ``base``: the mode outside the
    planned Linears (``auto`` resolves to the best safe mode here). ``target``: ``"measure"``
    (this machine) or a GPU name from the ``mixprec estimate`` table; default: measure on a CUDA
    GPU with FP8, else ``H100`` (stated in the notes). ``layers``: restrict to these Linear names.
    ``criterion``: what ranks the first choice, ``fisher`` (estimated loss increase) or
    ``measured`` (single-layer measured change). A format whose output SQNR is below its limit,
    whose input- or weight-gradient SQNR is below its gradient limit, whose output SQNR is
    ``max_sqnr_drop_db`` below the other layers' median in that format, or which flushes or
    saturates more than its share of the layer's inputs or output gradients, is refused for that
    layer whatever its estimate (:func:`mixprec.monitor.gates.gate`). The limits are each format's
    own (:mod:`mixprec.formats.limits`: the guard's and the what-if's too); ``min_sqnr_db`` /
    ``max_flush`` given replace them for every format, as given (the gradient limit 5 dB below).
    """
    if criterion not in ("fisher", "measured"):
        raise ConfigError(f"criterion must be 'fisher' or 'measured', not '{criterion}'")
    t0 = time.perf_counter()
    if not batches:
        raise ConfigError("plan_precision needs at least one calibration batch")
    if not 0 <= budget < 1:
        raise ConfigError(f"budget is a fraction of the loss in [0, 1), e.g. 0.001 for 0.1 %, not {budget}")
    calib, held = split_heldout(batches, heldout)
    if not calib:
        raise ConfigError("plan_precision needs at least one calibration batch")
    cands = list(dict.fromkeys(parse_format(c) for c in candidates))
    if "fp32" not in cands:
        cands.insert(0, "fp32")            # the reference every layer may fall back to
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    from mixprec.policy import hardware
    if target is None:
        target = "measure" if device.type == "cuda" and hardware.cuda_supports_fp8() else "H100"
    throughput, notes = format_throughput(target, cands, device=device)
    if target != "measure" and device.type != "cuda":
        notes.insert(0, f"planning for {target} (datasheet throughput) while measuring numerics on "
                        f"{device.type}; target='measure' plans for this machine's own speed")
    cands = [c for c in cands if c in throughput]
    if cands == ["fp32"]:                 # nothing left to choose: a plan of fp32 only says nothing
        left_out = "; ".join(n for n in notes if " left out" in n)
        raise ConfigError(f"nothing to plan on {'this machine' if target == 'measure' else target} "
                          f"but fp32: {left_out}")
    base_precision = Precision(base, device=device)
    base_name = base_precision.name
    say = progress or (lambda s: None)

    from mixprec.models.objective import make_objective
    ref_model = fp32_copy(model)
    Precision("32-true", device=device).setup(ref_model)
    ref_model.train()
    objective = make_objective(ref_model, Precision("32-true", device=device), loss_fn)
    # The plan replaces the base's own per-layer overrides (a base given as plan:PATH): candidates
    # and current formats are those of the base mode alone.
    if base_precision.policy.overrides:
        notes.append(f"the base's {len(base_precision.policy.overrides)} per-layer overrides are "
                     f"replaced by this plan's")
    planned = planned_layers(Precision(base_precision.policy.replace(overrides=(), plan=None), device=device),
                             model, layers)
    names = planned.names
    if not names:
        raise ConfigError("the model has no Linear layer to plan: "
                          + ("; ".join(planned.notes) or "it has no nn.Linear"))
    notes += planned.notes
    ref_losses, records = reference_pass(ref_model, calib, objective, names, seed)
    ref_loss = sum(ref_losses) / len(ref_losses)
    variants, refused = format_variants(model, [f for f in cands if f != "fp32"], device)

    mods = dict(ref_model.named_modules())
    measures = [LayerMeasure(n, 6 * mods[n].in_features * mods[n].out_features,
                             current=planned.current[n]) for n in names]
    total = sum(m.flops_per_token for m in measures)
    for m in measures:
        m.flops_share = m.flops_per_token / total
    for i, m in enumerate(measures):
        rec = records[m.name]
        ref_out, ref_grad, ref_dx = layer_alone(mods[m.name], rec)
        for f in cands:
            if f == "fp32":
                m.sqnr_out[f] = m.sqnr_grad[f] = m.sqnr_dgrad[f] = float("inf")
                m.loss_change[f] = m.loss_change_est[f] = 0.0
                m.flush_in[f] = m.flush_grad[f] = 0.0
                continue
            if m.name in refused[f]:
                m.unavailable[f] = refused[f][m.name]
                continue
            variant = variants[f].get_submodule(m.name)
            out, grad, dx = layer_alone(variant, rec)
            m.sqnr_out[f] = sqnr_db(ref_out, out)
            m.loss_change_est[f] = _fisher_change(rec, ref_out, out) / ref_loss
            m.sqnr_grad[f] = sqnr_db(ref_grad, grad) if grad is not None and ref_grad is not None else float("nan")
            m.sqnr_dgrad[f] = sqnr_db(ref_dx, dx) if dx is not None and ref_dx is not None else float("nan")
            m.flush_in[f], m.flush_grad[f] = _flushed(rec, f, 0), _flushed(rec, f, 2)
            losses = losses_with(ref_model, m.name, variant, calib, objective, seed)
            m.loss_change[f] = sum(abs(a - b) for a, b in zip(losses, ref_losses)) / len(losses) / ref_loss
        say(f"[{i + 1}/{len(measures)}] {m.name}")
    del variants, records
    apply_gates(measures, cands, min_sqnr_db=min_sqnr_db, max_flush=max_flush,
                max_sqnr_drop_db=max_sqnr_drop_db)

    plan = PrecisionPlan(base=base_name, layers=measures, throughput=throughput, target=target,
                         budget=budget, criterion=criterion, loss=ref_loss, notes=notes,
                         base_format=base_precision.recipe.base_format, min_sqnr_db=min_sqnr_db,
                         max_flush=max_flush, max_sqnr_drop_db=max_sqnr_drop_db,
                         linears=[n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)])
    choose(plan, cands)
    # The estimate only ranks: the promise is the whole plan's measured loss change.
    ref_held = forward_losses(ref_model, held, objective, seed) if held else []
    enforce_budget(plan, model, calib=calib, heldout=held, ref_calib=ref_losses, ref_heldout=ref_held,
                   objective=objective, seed=seed, device=device, progress=say)
    plan.calibration_tokens, plan.heldout_tokens = _tokens(calib), _tokens(held)
    held_said = (f", {100 * plan.measured_heldout:.3g}% on {len(held)} held-out batches "
                 f"({plan.heldout_tokens} tokens)" if held else "")
    plan.notes.insert(0, f"measured: the whole plan changes the loss by "
                         f"{100 * plan.measured_calibration:.3g}% on {len(calib)} calibration batches "
                         f"({plan.calibration_tokens} tokens){held_said}, against FP32; the budget "
                         f"({100 * budget:.3g}%) applies to both")
    if not held:
        plan.notes.append("no held-out batch (one batch given): the measured loss change is that "
                          "of the calibration batch only; give more batches or heldout=")
    del ref_model
    plan.notes.append("the loss changes are those of a forward pass with the chosen formats; "
                      "training adds gradient error every step, so compare the final losses of a "
                      "short run (`mixprec report RUN_A RUN_B`) before trusting a plan")
    plan.seconds = time.perf_counter() - t0
    return plan
