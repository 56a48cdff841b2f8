"""Guarded training: a layer that goes bad moves to a safer format instead of ending the run.

:class:`TrainingGuard` is a step hook: after every optimizer step the trainer hands it what the
step did (:class:`StepOutcome`) and applies nothing itself; the guard answers with
:class:`GuardAction` records (what it changed, for ``events.jsonl`` and the terminal). It watches
three signals, each pointing at one Linear layer:

* **non-finite origin** -- the same Linear traced (:func:`mixprec.monitor.locate_nonfinite`) as
  the origin of the inf/NaN on ``patience`` consecutive skipped steps. A skipped step changed no
  weight, so the guard promotes the layer and training simply continues. Skips that are the loss
  scaler's search for its level do not count (:meth:`TrainingGuard.scaler_searching`): before the
  run's first taken step, at a scale above ``min_scale``, with the inf/NaN arising in the
  backward, the layer the trace finds is only where a too-large scale overflowed first. A forward
  origin, any skip after a step was taken, and a skip at ``min_scale`` count.
* **low sampled SQNR** -- at the first step and then every ``every`` steps the guard replays the
  step's forward (no backward) with a hook on each Linear not in FP32 and measures its output
  against the same GEMM in FP32 on the same input; every layer below its format's SQNR limit (or
  standing out below the other layers in its format, :func:`mixprec.monitor.gates.output_refusal`),
  or whose format flushes more than its limit of the layer's inputs (outliers: the SQNR of a
  tensor they dominate stays high while the rest of it is lost), is promoted. The limits are each
  format's own (:mod:`mixprec.formats.limits`), the planner's and the what-if's too;
  ``min_sqnr_db`` / ``max_flush`` given replace them. The steps since such a layer's
  last passing sample trained the whole model on its lost output, so when the snapshot is no
  older than that sample (a snapshot follows every sample all layers pass, and the first one is
  taken before step 1), the guard restores it first; with an older snapshot it continues (a
  restore would also undo verified steps). A layer bad from the start is thus caught at step 1
  and that step undone.
* **loss spike** -- a taken step whose loss exceeds the mean of the last ``window`` taken steps by
  more than ``spike_sigma`` standard deviations. The weights were hurt: the guard restores its
  last good snapshot (weights, optimizer state and the LR schedule's step; taken before step 1,
  after every passing SQNR sample and every ``window`` healthy steps) and, if one Linear stands
  out in an SQNR replay of the spiking step (below its format's limit, or ``MAX_SQNR_DROP_DB`` under
  the other layers' median in its format while under the format's healthy SQNR:
  :func:`mixprec.monitor.gates.output_refusal`, the same test as the samples'), promotes it. With no culprit the formats stay.

A restore takes the snapshot's state (weights, moments, step counts) but this run's settings: the
optimizer's hyper-parameters and the LR schedule's curve stay as they are and the schedule is
rewound to the snapshot's step (:func:`mixprec.optim.schedule.rewind`), so a snapshot saved in a
checkpoint before a resume that changed ``lr`` or the schedule restores no old LR. The FP8 amax
histories of delayed scaling are rewound with the weights (a spike's amax would otherwise set the
scales for ``amax_history_len`` steps); the loss scale is not: it tracks the overflows the run has
met (and the scaler's skip counts must not go back).

Promotion goes one format safer, FP8 -> BF16 -> FP32 (fp16 -> FP32) via
:meth:`mixprec.Precision.layers.set_format` (same Parameters, masters and optimizer state) and is
kept for the rest of the run (checkpoints save the current formats). When the culprit already
runs in FP32 nothing safer is left: the action is ``give-up`` and the trainer ends the run as
diverged (exit 3).

The LR schedule follows the optimizer steps that remain in the weights: a restore rewinds the
scheduler with the weights, and the rolled-back steps count against ``max_steps`` like skipped
ones (the data moves on; the spiking batches are not replayed).

Several ranks (DDP) decide alike: given ``agree`` (an element-wise MAX all-reduce,
:meth:`mixprec.strategies.Strategy.all_reduce_max`), the guard votes before every decision. The
loss it watches is the largest of the ranks' step losses; a sampled layer's SQNR is the lowest
and its flushed share the highest any rank measured on its own micro-batches; the traced origin
of a skipped step is already shared (:func:`mixprec.monitor.trace.gather_origins`). So every rank
holds the same window, promotes the same layer at the same step and restores the same snapshot
(the weights are identical across DDP ranks): the weights stay identical. A sharded model
(FSDP2) is refused by the trainer: a promotion swaps modules that FSDP2 has wrapped.

A checkpoint keeps the guard's state (:meth:`TrainingGuard.state_dict`): the loss window, the
consecutive-origin count, the steps since the last snapshot, each layer's last passing sample,
whether the first sample was taken, and the snapshot itself (one more copy of the weights and
optimizer state in the checkpoint), so a resumed run decides exactly as the uninterrupted one.

Cost: with ``every`` and no event, one host sync per step (the loss, for the spike window; under
several ranks also one all-reduce of one number); a replay forward at step 1 and every ``every``
steps (and one all-reduce of three numbers per layer), each followed by a copy of the weights and
optimizer state when every layer passes; one such copy in memory (the snapshot).
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.formats.limits import FormatLimits, format_limits
from mixprec.monitor.gates import output_refusal
from mixprec.monitor.guard_state import Snapshots, sample_layers
from mixprec.monitor.replan import FormatSwitch
from mixprec.precision import Precision

__all__ = ["TrainingGuard", "GuardConfig", "StepOutcome", "GuardAction", "safer"]


def safer(fmt: str) -> str | None:
    """The next safer format on the guard's ladder: FP8 -> bf16 -> fp32, fp16 -> fp32."""
    return {"fp32": None, "bf16": "fp32", "fp16": "fp32"}.get(fmt, "bf16")


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What the guard watches (module docstring)."""

    patience: int = 2
    """Consecutive skipped steps traced to the same Linear before it is promoted."""
    every: int = 50
    """Steps between SQNR samples, the first at step 1 (0: no sampling)."""
    min_sqnr_db: float | None = None
    """A sampled layer output below this SQNR against FP32 is promoted. None: the limit of the
    format the layer runs in (:mod:`mixprec.formats.limits`, the planner's and the what-if's
    limits too); a number: that limit for every format."""
    max_flush: float | None = None
    """... and so is one whose format flushes more than this share of its sampled inputs
    (:func:`mixprec.monitor.replan.flushed_share`: outliers keep a tensor's SQNR high while the
    rest of it is lost). None: the format's own limit (:mod:`mixprec.formats.limits`); a number: that share for every format."""
    spike_sigma: float = 6.0
    """A loss this many standard deviations above the window's mean is a spike (0: off)."""
    window: int = 50
    """Taken steps in the spike window; also the most healthy steps between snapshots."""

    def validate(self) -> None:
        if (self.patience < 1 or self.window < 2 or self.every < 0 or self.spike_sigma < 0
                or self.max_flush is not None and not 0 <= self.max_flush <= 1):
            raise ConfigError(f"guard settings: patience >= 1, window >= 2, every >= 0, "
                              f"spike_sigma >= 0 and max_flush in [0, 1], got {self}")

    def limits(self, fmt: str) -> FormatLimits:
        """The limits a layer sampled in ``fmt`` must keep (the planner's gates read the same)."""
        return format_limits(fmt, min_sqnr_db=self.min_sqnr_db, max_flush=self.max_flush)

    def describe(self, layer_formats: dict[str, str]) -> str:
        """The run's start line: what the guard watches among ``layer_formats``, with which
        limits, how often."""
        watched: dict[str, int] = {}
        for f in layer_formats.values():
            if f != "fp32":
                watched[f] = watched.get(f, 0) + 1
        parts = [f"guard: on, watching {sum(watched.values())} Linear layers"]
        if self.every and watched:
            given = " (given)" if self.min_sqnr_db is not None or self.max_flush is not None else ""
            parts.append(f"output SQNR and inputs flushed sampled at step 1 and every {self.every} "
                         f"steps, promoted when " + ", ".join(
                             f"{f} {self.limits(f).describe()}" for f in watched) + given)
        elif not self.every:
            parts.append("no SQNR samples (guard_every=0)")
        parts.append(f"non-finite origin on {self.patience} consecutive skipped steps")
        parts.append(f"loss spikes over {self.spike_sigma:g} sigma of the last {self.window} steps"
                     if self.spike_sigma else "no spike watch (guard_spike_sigma=0)")
        return "; ".join(parts)


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did, as the guard needs it."""

    step: int
    """Steps attempted so far (the one just finished included)."""
    loss: float
    skipped: bool
    origin: str | None = None
    """Module traced as the origin of this skipped step's inf/NaN (None: not skipped, not traced)."""
    direction: str | None = None
    """Where the origin's inf/NaN arose: ``forward`` or ``backward`` (None: not traced)."""
    scale_before: float | None = None
    """The loss scale this step ran at (None: the mode does not scale the loss)."""


@dataclass(frozen=True)
class GuardAction:
    """One thing the guard did: ``promote``, ``restore``, ``spike`` (seen, nothing to blame) or
    ``give-up`` (the trainer ends the run)."""

    kind: str
    step: int
    message: str
    switch: FormatSwitch | None = None

    def to_dict(self) -> dict:
        if self.switch is not None:
            return {**self.switch.to_dict(), "guard": self.kind}
        return {"kind": "guard", "action": self.kind, "step": self.step, "message": self.message}


class TrainingGuard:
    """See the module docstring. ``model`` is the unwrapped, set-up model."""

    def __init__(self, precision: Precision, model: nn.Module, optimizer: Any, scheduler: Any, *,
                 config: GuardConfig | None = None,
                 agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.config = config or GuardConfig()
        self.config.validate()
        if not precision.layers.formats:
            raise ConfigError("guard=true needs a model set up by the Precision (call setup first)")
        self.precision, self.model = precision, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.agree = agree
        """Element-wise MAX over ranks (module docstring); None in one process."""
        self.losses: deque[float] = deque(maxlen=self.config.window)
        self._origin: str | None = None
        self._origin_count = 0
        self._snaps = Snapshots(model, optimizer, scheduler)
        """The last good snapshot, the taken steps since, each layer's last passing sample."""
        self._sampled = False
        """Whether the first SQNR sample (at the first step) was taken."""
        self._taken_any = False
        """Whether a step of the run was taken (the loss scaler found a level it can step at)."""
        self.last_sqnr: dict[str, float] = {}
        self.last_flush: dict[str, float] = {}
        self.actions: list[GuardAction] = []

    def describe(self) -> str:
        """The run's start line: what the guard watches, with which limits, how often."""
        return self.config.describe(self.precision.layers.formats)

    # ----------------------------------------------------------------- the hook

    def after_step(self, outcome: StepOutcome, probe: Callable[[], Any] | None = None
                   ) -> list[GuardAction]:
        """React to one step. ``probe`` replays the step's forward (no backward) on the model;
        the guard calls it when it samples SQNR or looks for a spike's culprit."""
        cfg, step = self.config, outcome.step
        done: list[GuardAction] = []
        if outcome.skipped:
            self._snaps.healthy = 0
            if outcome.origin is None or self.scaler_searching(outcome):
                return done
            name = self.linear_of(outcome.origin)
            if name is None:
                return done
            self._origin_count = self._origin_count + 1 if name == self._origin else 1
            self._origin = name
            if self._origin_count >= cfg.patience:
                self._origin, self._origin_count = None, 0
                done.append(self._promote(step, name, f"origin of non-finite values on "
                                                      f"{cfg.patience} consecutive skipped steps"))
            return self._record(done)
        self._origin, self._origin_count = None, 0
        self._taken_any = True
        if self.agree is not None:          # the worst rank's loss: every rank holds one window
            outcome = dataclasses.replace(outcome, loss=float(
                self.agree(torch.tensor([outcome.loss], dtype=torch.float64))[0]))
        if cfg.spike_sigma and len(self.losses) == self.losses.maxlen and self._is_spike(outcome.loss):
            return self._record(self._spike(outcome, probe))
        if not math.isfinite(outcome.loss):
            return done
        self.losses.append(outcome.loss)
        self._snaps.healthy += 1
        if cfg.every and probe is not None and (step % cfg.every == 0 or not self._sampled):
            self._sampled = True
            done += self._check_layers(step, probe)
            if not done:                     # every layer passed: these weights are verified
                self._snaps.take(step)
        if not done and (self._snaps.snapshot is None or self._snaps.healthy >= cfg.window):
            self._snaps.take(step)
        return self._record(done)

    def before_step(self, step: int) -> None:
        """Called before step ``step`` (1-based) is taken: the first call takes the first snapshot,
        of the weights no step of this run has touched yet (a resumed run brings its own)."""
        if self._snaps.snapshot is None:
            self._snaps.take(step - 1)

    def _check_layers(self, step: int, probe: Callable[[], Any]) -> list[GuardAction]:
        """One SQNR sample: promote every layer under the limits. The steps since a failing layer's
        last passing sample ran it in a format that lost its output, so when the snapshot is no
        older than that sample (the first snapshot, before step 1, for a layer bad from the start),
        the guard restores it first; an older snapshot would also undo verified steps: it
        continues."""
        cfg = self.config
        sqnr = self.sample_sqnr(probe)
        failing = []
        peers = self._peers(sqnr)
        for name, db in sorted(sqnr.items(), key=lambda kv: kv[1]):
            flushed = self.last_flush.get(name, 0.0)
            fmt = self.precision.layers.formats[name]
            limits = cfg.limits(fmt)
            why = []
            bad = output_refusal(db, fmt, peers[name], min_sqnr_db=cfg.min_sqnr_db)
            if bad:
                why.append(f"sampled output {bad[0]} ({fmt}'s {'given ' if limits.given else ''}limits)")
            if flushed > limits.max_flush:
                why.append(f"{100 * flushed:.1f}% of its sampled inputs flush to zero in "
                           f"{fmt} (limit {100 * limits.max_flush:.3g}%)")
            if why:
                failing.append((name, "; ".join(why)))
            else:
                self._snaps.passed[name] = step
        if not failing:
            return []
        done = []
        since = max(self._snaps.passed.get(name, 0) for name, _ in failing)
        if self._snaps.taken_between(since, step):
            names = ", ".join(name for name, _ in failing)
            passed = f"step {since}" if since else "never"
            done.append(self._restore(step, f"{names} failed the SQNR sample of step {step} "
                                            f"(last passed: {passed})"))
        return done + [self._promote(step, name, why) for name, why in failing]

    # ----------------------------------------------------------------- signals

    def linear_of(self, module: str) -> str | None:
        """The Linear (a key of the precision's layer formats) that ``module`` is or lies in."""
        names = self.precision.layers.formats
        if module in names:
            return module
        inside = [n for n in names if module.startswith(n + ".")]
        return max(inside, key=len) if inside else None

    def _is_spike(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        mean = sum(self.losses) / len(self.losses)
        std = math.sqrt(sum((v - mean) ** 2 for v in self.losses) / (len(self.losses) - 1))
        return loss > mean + self.config.spike_sigma * max(std, 1e-12)

    def sample_sqnr(self, probe: Callable[[], Any]) -> dict[str, float]:
        """Output SQNR (dB) of every Linear not in FP32 against its GEMM in FP32 on the same
        inputs, over one replay of the forward (one host sync); also sets :attr:`last_flush`
        (the share of each layer's inputs its format flushes). :func:`sample_layers`."""
        sampled = sample_layers(self.precision, self.model, probe, self.agree)
        if sampled is None:
            return {}
        self.last_sqnr, self.last_flush = sampled
        return self.last_sqnr

    def _peers(self, sqnr: dict[str, float]) -> dict[str, list[float]]:
        """Per sampled layer, the other sampled layers' SQNRs in the same format."""
        fmt = self.precision.layers.formats
        return {n: [v for o, v in sqnr.items() if o != n and fmt[o] == fmt[n]] for n in sqnr}

    def _spike(self, outcome: StepOutcome, probe: Callable[[], Any] | None) -> list[GuardAction]:
        step = outcome.step
        mean = sum(self.losses) / len(self.losses)
        what = (f"loss {outcome.loss:.4g} at step {step}, {self.config.spike_sigma:g} sigma above "
                f"the last {len(self.losses)} steps' mean {mean:.4g}")
        culprit = None
        if probe is not None:
            sqnr = self.sample_sqnr(probe)         # on the hurt weights: what made the spike
            peers = self._peers(sqnr)
            worst = None
            for n, db in sqnr.items():
                bad = output_refusal(db, self.precision.layers.formats[n], peers[n],
                                     min_sqnr_db=self.config.min_sqnr_db)
                if bad and (worst is None or bad[1] > worst[1]):
                    worst = (n, bad[1], bad[0])
            culprit = worst
        done = [self._restore(step, what)]
        if culprit is not None:
            name, _, why = culprit
            done.append(self._promote(step, name, f"{what}; its output {why}"))
        else:
            done.append(GuardAction("spike", step, f"{what}; no Linear stands out in an SQNR "
                                                   "replay: formats unchanged"))
        return done

    # ----------------------------------------------------------------- actions

    def _promote(self, step: int, name: str, reason: str) -> GuardAction:
        current = self.precision.layers.formats[name]
        new = safer(current)
        if new is None:
            return GuardAction("give-up", step, f"guard: {name} is the culprit ({reason}) and already "
                                                f"runs in {current}, the safest format: nothing "
                                                "safer is left")
        got = self.precision.layers.set_format(self.model, name, new)
        switch = FormatSwitch(step, name, current, got, f"guard: {reason}")
        self._snaps.healthy = 0
        return GuardAction("promote", step, switch.message, switch)

    def _restore(self, step: int, what: str) -> GuardAction:
        restored = self._snaps.restore()
        if restored is None:
            return GuardAction("spike", step, f"{what}; no snapshot yet to restore")
        self.losses.clear()
        return GuardAction("restore", step, f"guard: {what}: weights, optimizer state and LR "
                                            f"schedule restored to step {restored}")

    def scaler_searching(self, outcome: StepOutcome) -> bool:
        """Whether a skipped step is the loss scaler's normal search for its level, not a layer's
        fault (module docstring): no step of the run was taken yet, the step ran at a scale above
        ``min_scale`` (so it backed off), and the inf/NaN arose in the backward (the scale
        multiplies only the backward: a forward origin is the layer's whatever the scale).

        ``16-mixed guard=true init_scale=1e6`` moved two layers to FP32 in its first 4 steps while
        the scale halved from 1e6 to 62500, and the loss ended worse (a new-user trial)."""
        if outcome.scale_before is None or self._taken_any or outcome.direction == "forward":
            return False
        return outcome.scale_before > self.precision.scaler.config.min_scale

    def _record(self, done: list[GuardAction]) -> list[GuardAction]:
        self.actions += done
        return done

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """What the next decisions depend on, for a checkpoint: the loss window, the
        consecutive-origin count, the taken steps since the last snapshot, whether the first
        sample was taken, each layer's last passing sample, and the snapshot (weights, amax
        histories, optimizer state, LR schedule; None before the first). Promotions are the
        precision's layer formats, saved beside it. Tensors and plain values only
        (``torch.load(weights_only=True)`` reads it)."""
        return {"losses": list(self.losses), "origin": self._origin,
                "origin_count": self._origin_count, **self._snaps.state_dict(),
                "sampled": self._sampled, "taken_any": self._taken_any}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (a window longer than ``window`` keeps its newest)."""
        self.losses.clear()
        self.losses.extend(float(v) for v in state["losses"])
        self._origin, self._origin_count = state["origin"], int(state["origin_count"])
        self._snaps.load_state_dict(state)
        self._sampled = bool(state.get("sampled", True))      # (older checkpoints: sampled)
        self._taken_any = bool(state.get("taken_any", True))  # (older checkpoints: past the search)
