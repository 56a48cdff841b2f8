"""``mixprec memory``: where the bytes of a training step go, per precision mode.

The source article on hardware cost (docs/sources.md) tabulates a 67B MoE at 132 GB per GPU in
FP32 and 58 GB in "FP16+FP32" (-56 %): a headline, not a breakdown; this estimator shows the
parts. The rules it encodes:

* **States** (bytes per parameter): parameters in the param dtype, gradients in the param dtype,
  FP32 masters when the params are 16-bit, Adam's two moments (FP32, or BF16 as in DeepSeek-V3),
  and for 16-bit params the FP32 master gradients the optimizer steps on. With FP32 masters and
  FP32 Adam moments that is 16 bytes per parameter in *every* mode (4+4+8 with FP32 params;
  2+2+4+8 with 16-bit params, plus 4 of FP32 master gradients during the step). Mixed precision
  saves memory only on activations and, optionally, BF16 moments. mixprec's default **split
  masters** (mixprec/optim/split.py) store the FP32 master of a BF16 parameter as the parameter
  plus a 16-bit remainder and keep no FP32 master gradients (the step widens one bounded chunk at
  a time): 2 + 2 + 2 + 8 = 14 bytes per parameter, 10 with BF16 moments (``--full-masters``: 20).
* **Activations** per layer per token, as saved for backward by mixprec's Transformer (counted
  with ``torch.autograd.graph.saved_tensors_hooks``; ``tests/estimate/test_memory.py`` checks the
  formula against that count). With ``d`` the width, ``h`` heads, ``r`` the MLP ratio and ``c``
  the bytes of the compute dtype::

      4 * (2d + 4 + h)          FP32 in every mode: the two norm inputs (FP32 residual stream,
                                or the FP32 upcast inside the norm), their mean and 1/std, and
                                the attention log-sum-exp per head
    + c * (7 + 2r) * d          compute dtype: qkv input d, q/k/v 3d, attention output d, its
                                (B,T,C) copy d, MLP input d, GELU input r*d, GELU output r*d

  i.e. ``68d + 4h + 16`` bytes in FP32 and ``38d + 4h + 16`` in BF16 (r = 4): activations shrink
  by ~44 %, not 50 %, because norms keep FP32. (On a CPU without AMX, short sequences' attention
  runs in FP32, see ``mixprec.nn.attention``, and saves ``10d`` bytes more per layer and token;
  not counted here: the estimate is the 16-bit kernel's, as on GPUs.) With activation checkpointing a layer keeps only
  its input (``d`` in the residual dtype), and one layer's full activations exist during its
  recompute, in backward, once the loss's buffers are freed: they count against the loss
  buffers (the larger of the two), not on top of them. An MoE MLP keeps ``top_k`` experts' worth of the MLP term per token.
  The head adds the final norm, the logits' log-softmax (FP32, ``4V`` per token) and, while the
  loss backward starts, two more FP32 ``V``-wide buffers; the 16-bit logits a 16-bit head makes
  are freed once widened to FP32, before that peak, and are not counted. While a block runs backward, gradients
  shaped like its saved tensors exist next to them: one more block's worth (measured: the
  peak RSS exceeds the saved tensors by one block, 15-84 MiB for the small model at 2-8k tokens).
* **Autocast weight copies**: under ``*-mixed`` each matmul weight is cast to the compute dtype
  once per step and kept for backward (``c`` bytes per matmul parameter).

* **Per-layer formats** (a precision with overrides, mixprec's dense Transformer names
  ``blocks.{i}.attn.qkv|attn.proj|mlp.fc|mlp.proj`` and ``head``): each Linear's weight copy is
  counted in its own format (``bf16``/``fp16`` layers: 2 bytes per weight when the stored weight is
  wider; ``fp32`` layers: none, and they store FP32 parameters without masters in the 16-bit "true"
  modes; FP8 layers: like the surrounding compute dtype, as the uniform ``fp8-*`` modes always
  were), and each Linear's *saved input* (``d``, ``d``, ``d`` and ``r*d`` per token for the four
  block Linears) in its format's bytes instead of the compute dtype's (FP8 layers save their
  input in the surrounding dtype). Everything else keeps the mode's dtypes: a simple, stated
  approximation (MoE experts keep the mode's format).

Peak = parameters + masters + moments + max(activation phase, gradient/optimizer phase), where the
activation phase is weight copies + activations + the larger of the loss and block-backward buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.errors import ConfigError

__all__ = ["ModelShape", "MemoryEstimate", "estimate_memory", "activation_bytes_per_token", "dense_linears",
           "MOE_67B", "format_table"]

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes the estimate needs (a :class:`mixprec.models.TransformerConfig` maps onto it)."""

    num_layers: int
    """Transformer blocks."""
    d_model: int
    """Residual width."""
    num_heads: int
    """Attention heads."""
    vocab_size: int
    """Output classes of the head."""
    max_seq_len: int = 1024
    """Rows of the learned position embedding."""
    mlp_ratio: int = 4
    """MLP hidden width / d_model (per expert for MoE)."""
    num_experts: int = 0
    """0: dense MLPs; >0 experts per block."""
    top_k: int = 2
    """Experts per token (MoE)."""
    tie_embeddings: bool = True
    """Head shares the token embedding."""
    bias: bool = True
    """Linear and norm biases."""
    # --- fields for other architectures (Hugging Face configs); the defaults are mixprec's model --
    mlp_hidden: int = 0
    """Hidden width of a dense MLP; 0: ``mlp_ratio * d_model``."""
    expert_hidden: int = 0
    """Hidden width of one expert (and of one shared expert); 0: the dense MLP's."""
    gated_mlp: bool = False
    """Gated MLP (SwiGLU: gate, up and down matrices) instead of two matrices around a GELU."""
    shared_experts: int = 0
    """Experts every token passes through besides its ``top_k`` routed ones (DeepSeek-MoE)."""
    dense_layers: int = 0
    """Leading blocks with a dense MLP in an MoE model (DeepSeek's ``first_k_dense_replace``)."""
    attention_weights: int = 0
    """Matmul weights of one attention block; 0: ``4 * d_model**2`` (multi-head, q/k/v/o)."""
    learned_positions: bool = True
    """A learned position table of ``max_seq_len`` rows (False: rotary, no parameters)."""
    tagged_norms: bool = True
    """The norms declare ``keep_in_fp32`` (mixprec's own do): FP32 under every policy. False
    (Hugging Face models): FP32 only while the policy keeps norms FP32 (``keep_norms_fp32``)."""

    def __post_init__(self) -> None:
        for f in ("num_layers", "d_model", "num_heads", "vocab_size", "max_seq_len", "mlp_ratio"):
            if getattr(self, f) < 1:
                raise ConfigError(f"{f} must be >= 1, got {getattr(self, f)}")
        for f in ("mlp_hidden", "expert_hidden", "shared_experts", "dense_layers", "attention_weights",
                  "num_experts"):
            if getattr(self, f) < 0:
                raise ConfigError(f"{f} must be >= 0, got {getattr(self, f)}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")
        if self.dense_layers > self.num_layers:
            raise ConfigError(f"dense_layers ({self.dense_layers}) exceeds num_layers ({self.num_layers})")

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        return cls(num_layers=cfg.num_layers, d_model=cfg.d_model, num_heads=cfg.num_heads,
                   vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len, mlp_ratio=cfg.mlp_ratio,
                   num_experts=cfg.num_experts, top_k=cfg.top_k, tie_embeddings=cfg.tie_embeddings,
                   bias=cfg.bias)

    # --- parameter counts (exactly those of mixprec.models.Transformer for its configs) ---------

    @property
    def _hidden(self) -> int:
        return self.mlp_hidden or self.mlp_ratio * self.d_model

    @property
    def _ehidden(self) -> int:
        return self.expert_hidden or self._hidden

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts."""
        return self.num_layers - self.dense_layers if self.num_experts else 0

    def _mlp_weights(self, hid: int) -> int:
        return (3 if self.gated_mlp else 2) * self.d_model * hid

    def _mlp_params(self, hid: int | None = None) -> int:
        hid = self._hidden if hid is None else hid
        return self._mlp_weights(hid) + (hid + self.d_model if self.bias else 0)

    def _attn_weights(self) -> int:
        return self.attention_weights or 4 * self.d_model * self.d_model

    def _block_matmul_weights(self, moe: bool) -> int:
        if not moe:
            return self._attn_weights() + self._mlp_weights(self._hidden)
        e = self.num_experts
        return self._attn_weights() + (e + self.shared_experts) * self._mlp_weights(self._ehidden) + self.d_model * e

    def layer_matmul_weights(self) -> int:
        """Matmul weights of one block (attention + all experts, or the MLP; router included)."""
        return self._block_matmul_weights(bool(self.num_experts))

    def _block_params(self, moe: bool) -> int:
        d, b = self.d_model, self.bias
        norms = 2 * (2 * d if b else d)
        attn = self._attn_weights() + (4 * d if b else 0)
        if moe:
            e = self.num_experts
            mlp = (e + self.shared_experts) * self._mlp_params(self._ehidden) + d * e    # router: no bias
        else:
            mlp = self._mlp_params()
        return norms + attn + mlp

    def layer_params(self) -> int:
        """Parameters of one block (an MoE block in an MoE model)."""
        return self._block_params(bool(self.num_experts))

    def _blocks(self, per_block) -> int:
        dense = self.num_layers - self.moe_layers
        return dense * per_block(False) + self.moe_layers * per_block(True)

    def num_parameters(self) -> int:
        d = self.d_model
        emb = self.vocab_size * d + (self.max_seq_len * d if self.learned_positions else 0)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        final_norm = 2 * d if self.bias else d
        return emb + head + final_norm + self._blocks(self._block_params)

    def matmul_weights(self) -> int:
        """Parameters that autocast casts to the compute dtype (Linear weights and the head)."""
        return self._blocks(self._block_matmul_weights) + self.vocab_size * self.d_model

    def active_parameters(self) -> int:
        """Parameters one token's forward pass uses: the ``N`` of ``6 * N`` training FLOPs per token.

        Counted as ``Transformer.flops_per_token`` does: all parameters but the embedding look-ups
        (the head counts even when tied to the embedding) and the experts the token is not routed to.
        """
        d = self.d_model
        n = self.num_parameters() - (self.max_seq_len * d if self.learned_positions else 0)
        if not self.tie_embeddings:
            n -= self.vocab_size * d                        # the token embedding (the head stays)
        return n - self.moe_layers * (self.num_experts - self.top_k) * self._mlp_params(self._ehidden)

    def matrix_parameters(self) -> tuple[int, int]:
        """(parameters in matrices whose rows hold ``d_model`` values, in matrices whose rows hold
        the MLP's hidden width): the embedding, the head and the Linear weights; the rest are
        vectors (norms, biases). 8-bit moments cost a block scale per row's block, and vectors
        keep FP32 moments (mixprec.optim.moments)."""
        d = self.d_model
        wide = self._blocks(lambda moe: ((self.num_experts + self.shared_experts) * d * self._ehidden) if moe
                            else d * self._hidden)                              # MLP down-projections
        emb = (0 if self.tie_embeddings else self.vocab_size * d) + (self.max_seq_len * d if self.learned_positions else 0)
        return self.matmul_weights() + emb - wide, wide

    def norm_parameters(self) -> int:
        """Norm weights (and biases): FP32 unless the policy says ``keep_norms_fp32=False``."""
        per = 2 if self.bias else 1
        return (2 * self.num_layers + 1) * per * self.d_model


MOE_67B = ModelShape(num_layers=30, d_model=4096, num_heads=32, vocab_size=102400, max_seq_len=4096,
                     mlp_ratio=4, num_experts=16, top_k=2, tie_embeddings=False, bias=False)
"""A ~67B-parameter MoE (the source article's "670亿参数MoE", docs/sources.md): 30 blocks of
d=4096 with 16 experts, top-2."""

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def norms_stay_fp32(shape: ModelShape, precision) -> bool:
    """Whether ``shape``'s norm layers keep FP32 parameters under ``precision``: the rule book's
    answer (:meth:`mixprec.Precision.layers.keep_fp32_reason`) for the kind of norm the model has."""
    from mixprec.nn import RMSNorm
    norm = RMSNorm(1) if shape.tagged_norms else torch.nn.LayerNorm(1)
    return precision.layers.keep_fp32_reason("norm", norm) is not None


def dense_linears(shape: ModelShape) -> list[tuple[str, int, int, int]]:
    """(qualified name, weight elements, bias elements, saved-input width) of each Linear of
    mixprec's Transformer of ``shape`` (MoE blocks contribute their attention Linears only)."""
    d, hid, b = shape.d_model, shape._hidden, int(shape.bias)
    out = []
    for i in range(shape.num_layers):
        out += [(f"blocks.{i}.attn.qkv", 3 * d * d, b * 3 * d, d),
                (f"blocks.{i}.attn.proj", d * d, b * d, d)]
        if not (shape.num_experts and i >= shape.dense_layers):
            out += [(f"blocks.{i}.mlp.fc", d * hid, b * hid, d),
                    (f"blocks.{i}.mlp.proj", d * hid, b * d, hid)]
    return out + [("head", shape.vocab_size * d, 0, d)]


def _per_layer(shape: ModelShape, precision, *, pb: int, cb: int, copies_on: bool
               ) -> tuple[float, float, float, float] | None:
    """(weight-copy bytes change, activation bytes per token change, max change of one block,
    parameters moved to FP32) of per-layer formats against the uniform mode; None without overrides."""
    if shape is None or not precision.policy.overrides or shape.attention_weights or shape.gated_mlp:
        return None
    from mixprec.policy.overrides import format_dtype
    copy_delta = act_delta = fp32_params = 0.0
    block_delta: dict[str, float] = {}
    uniform_copy = cb if copies_on else 0
    for name, numel, bias, width in dense_linears(shape):
        fmt = precision.layers.requested_format(name)
        dt = format_dtype(fmt)
        if dt is None:                                # FP8: as the surrounding compute dtype
            continue
        fb = _BYTES[dt]
        layer_pb = 4 if fmt == "fp32" else pb
        copy_delta += numel * ((fb if fb < layer_pb else 0) - uniform_copy)
        if fmt == "fp32" and pb < 4:
            fp32_params += numel + bias
        if name != "head":
            block = name.split(".")[1]
            block_delta[block] = block_delta.get(block, 0.0) + (fb - cb) * width
    act_delta = sum(block_delta.values())
    return copy_delta, act_delta, max(block_delta.values(), default=0.0), fp32_params


def activation_bytes_per_token(shape: ModelShape, compute_bytes: int, *, residual_bytes: int = 4,
                               checkpointing: bool = False, moe: bool | None = None) -> tuple[float, float]:
    """(bytes kept per token by one block, bytes of one block during its recompute or 0).

    See the module docstring for the derivation; ``residual_bytes`` is what a checkpointed block
    keeps of its input (4 in 32-true and *-mixed, 2 in the 16-bit "true" modes). ``moe`` picks the
    block kind (default: an MoE block in an MoE model). A gated MLP keeps its input and four
    hidden-wide tensors (gate pre-activation, its SiLU, the up projection, their product) per
    copy; that variant and grouped-query/latent attention are approximations, not checked against
    autograd (only mixprec's own Transformer is).
    """
    d, h = shape.d_model, shape.num_heads
    moe = bool(shape.num_experts) if moe is None else moe
    hid = shape._ehidden if moe else shape._hidden
    mlp_copies = shape.top_k + shape.shared_experts if moe else 1
    per_copy = d + (4 if shape.gated_mlp else 2) * hid
    fp32_part = 4 * (2 * d + 4 + h)
    low_part = compute_bytes * (5 * d + mlp_copies * per_copy)
    full = fp32_part + low_part
    if checkpointing:
        return residual_bytes * d, full
    return full, 0.0


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one training step (see the module docstring)."""

    mode: str
    parameters: float
    gradients: float
    master_weights: float
    master_gradients: float
    optimizer_moments: float
    weight_copies: float
    activations: float
    loss_buffers: float
    backward_buffers: float
    optimizer_scratch: float
    num_parameters: float = 0.0
    """Parameters per device (for :meth:`bytes_per_parameter`)."""
    moments: str = "fp32"
    """Storage format of Adam's moments (mixprec.optim.moments), for the arithmetic line."""

    @property
    def bytes_per_parameter(self) -> dict[str, float]:
        """Each state's bytes per parameter (params, grads, masters, master grads at the step,
        moments), and their sum: what one parameter costs outside the activations."""
        n = self.num_parameters or 1.0
        parts = {"params": self.parameters, "grads": self.gradients, "masters": self.master_weights,
                 "mgrads": self.master_gradients, "moments": self.optimizer_moments}
        out = {k: v / n for k, v in parts.items()}
        out["total"] = sum(out.values())
        return out

    @property
    def states(self) -> float:
        """Parameters, gradients, masters and moments: the source article's "parameter storage"
        (16 bytes per parameter with FP32 masters and Adam). FP32 master gradients, alive only
        around the optimizer step, are counted in :attr:`peak`."""
        return self.parameters + self.gradients + self.master_weights + self.optimizer_moments

    @property
    def peak(self) -> float:
        resident = self.parameters + self.master_weights + self.optimizer_moments
        forward_end = self.weight_copies + self.activations + max(self.loss_buffers, self.backward_buffers)
        step = self.gradients + self.master_gradients + self.optimizer_scratch
        return resident + max(forward_end, step)


def _largest_param(shape: ModelShape) -> int:
    """Elements of the largest single parameter tensor (the embedding, or an MLP matrix)."""
    d = shape.d_model
    return max(shape.vocab_size * d, d * shape._hidden, d * shape._ehidden, 3 * d * d)


def estimate_memory(shape: ModelShape | None, precision: str, *, batch: int, seq: int, optimizer: str = "adamw",
                    moments_dtype: str | None = None, checkpointing: bool = False, shards: int = 1,
                    tp: int = 1, pp: int = 1, num_parameters: int | None = None,
                    split_masters: bool | None = None, device: str | None = None,
                    fp8_activations: bool | None = None, loss_chunk: int = 0) -> MemoryEstimate:
    """Bytes per device of a training step of ``shape`` under ``precision``.

    ``batch`` is the micro-batch per device. The states (parameters, gradients, masters, moments)
    are divided by ``shards`` (FSDP / ZeRO-3 over the data-parallel group), by ``tp`` (tensor
    parallelism splits every matmul; vocabulary-parallel embedding and head) and by ``pp``
    (pipeline stages hold ``1/pp`` of the layers; an even split is assumed, the embedding's and the
    head's stages hold more). Activations are divided by ``tp`` (tensor + sequence parallelism,
    Korthikanti et al. 2022) and *not* by ``pp``: with the 1F1B schedule the first stage keeps
    ``pp`` micro-batches in flight of ``1/pp`` of the layers each, one whole model's worth.

    ``shape=None`` with ``num_parameters`` estimates the states alone (activations 0): for a model
    known only by its parameter count.

    ``moments_dtype``, ``split_masters`` and ``fp8_activations`` default to the precision's recipe
    (:attr:`mixprec.Precision.recipe`; for a mode's name: ``fp32``, split, off).

    ``split_masters`` (mixprec's default): the FP32 master of a BF16 parameter is stored as the
    parameter plus a 16-bit remainder (2 bytes) and the step widens one chunk at a time (FP32
    master, FP32 gradient and the optimizer's FP32 temporary: 12 bytes per chunk element) instead
    of holding FP32 master gradients and a whole-model temporary. On one device mixprec's AdamW
    steps flat chunks of ``mixprec.optim.split.flat_chunk_numel(P)`` elements (mixprec.optim.flat:
    about an eighth of the parameters, at least ``CHUNK_NUMEL``); under FSDP2 torch's AdamW or the
    sharded one steps each shard.

    ``device="cpu"``: the estimate for this machine's CPU, where short sequences' 16-bit attention
    runs in FP32 (``mixprec.nn.attention.upcasts_short_attention``) and saves ``10d`` bytes more
    per layer and token. ``None`` (default): the 16-bit kernel, as on GPUs.

    ``fp8_activations`` (``mixprec.nn.fp8_activations``): the inputs Linear layers save (``3d +
    hidden`` values per dense block and token, ``d`` for the head) take ``1 + 4/128`` bytes each
    instead of the compute dtype's; blocks under activation checkpointing are unchanged.

    ``loss_chunk`` (``Transformer.loss_chunk``): the head and the FP32 loss run ``loss_chunk``
    tokens at a time and are recomputed in backward: the loss buffers are one slice's, and no
    log-softmax of the whole batch is kept (the final norm's output is, in the compute dtype).
    """
    from mixprec.precision import Precision
    from mixprec.policy.dtypes import parse_dtype
    policy = precision if isinstance(precision, Precision) else Precision(precision)
    recipe = policy.recipe
    moments_dtype = recipe.moments if moments_dtype is None else moments_dtype
    split_masters = recipe.split_masters if split_masters is None else split_masters
    fp8_activations = recipe.fp8_activations if fp8_activations is None else fp8_activations
    if optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"--optimizer must be adamw or sgd, got '{optimizer}'")
    if batch < 1 or seq < 1 or shards < 1:
        raise ConfigError("--batch-size, --seq-len and --gpus must be >= 1")
    if loss_chunk < 0:
        raise ConfigError(f"--loss-chunk must be >= 0 tokens (0: off), got {loss_chunk}")
    if tp < 1 or pp < 1:
        raise ConfigError(f"tensor and pipeline degrees must be >= 1, got tp={tp}, pp={pp}")
    from mixprec.optim.moments import MOMENTS, is_quantized, state_bytes
    if moments_dtype not in MOMENTS:
        try:
            mdt = parse_dtype(moments_dtype)
        except ConfigError:
            mdt = None
        if mdt not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"--moments-dtype must be one of {', '.join(MOMENTS)}, got '{moments_dtype}'")
        moments_dtype = "fp32" if mdt == torch.float32 else "bf16"
    if shape is None and not num_parameters:
        raise ConfigError("estimate_memory needs a model shape or num_parameters")
    P = num_parameters or shape.num_parameters()
    # Norm weights stay FP32 where the rule book says so (not with keep_norms_fp32=False).
    norms_fp32 = shape is not None and norms_stay_fp32(shape, policy)
    norm_params = shape.norm_parameters() if norms_fp32 else 0
    pb, cb = _BYTES[recipe.param_dtype], _BYTES[recipe.compute_dtype]
    mixed_copies = recipe.autocast_copies_weights
    layers = _per_layer(shape, policy, pb=pb, cb=cb, copies_on=mixed_copies)
    if layers is not None:
        norm_params += layers[3]                     # fp32 layers store FP32 params, no masters
    low_p = P - norm_params
    params = low_p * pb + norm_params * 4
    grads = params
    from mixprec.optim.split import CHUNK_NUMEL, flat_chunk_numel
    layout = recipe if split_masters == recipe.split_masters else recipe.replace(split_masters=split_masters)
    split = layout.masters == "split"            # the recipe's layout, as the params plugin reads it
    masters = low_p * (2 if split else 4) if recipe.keeps_masters else 0
    # mixprec's AdamW (one device, a mode that keeps masters or FP32 params) steps flat chunks
    # (mixprec.optim.flat): one chunk's FP32 values and gradients at a time, shared scratch.
    flat = shards == 1 and not recipe.loses_small_updates
    c = min(P, flat_chunk_numel(P, "cpu" if device == "cpu" else "cuda") if flat else CHUNK_NUMEL)
    master_grads = 4 * min(low_p, c) if split else masters
    if optimizer != "adamw":
        moments = 4 * P                                          # SGD: momentum buffer
    elif shape is not None and is_quantized(moments_dtype):
        # 8-bit moments: block scales per row's blocks; vectors (norms, biases) keep FP32 moments
        narrow, wide = shape.matrix_parameters()
        moments = (state_bytes(moments_dtype, row=shape.d_model) * narrow
                   + state_bytes(moments_dtype, row=shape._hidden) * wide + 8 * (P - narrow - wide))
    else:
        moments = state_bytes(moments_dtype) * P
    # torch's foreach AdamW holds one FP32 temporary list the size of the params during its
    # update (sqrt of the second moment); mixprec's AdamW works in bounded chunks. Split masters
    # step one chunk at a time: its widened FP32 masters and the temporary.
    # mixprec's own FP32-math AdamW (bf16 / 8-bit moments) widens both moments of a chunk and
    # keeps one temporary (12 bytes per chunk element); 8-bit codes add their packing buffers.
    if optimizer != "adamw":
        scratch = 0.0
    elif flat:
        # The chunk's FP32 values (and its gradients, unless split masters count them above),
        # then the inner math's temporaries over one flat chunk: torch's AdamW sqrt(v) and, on a
        # CPU, its quotient; mixprec's FP32-math AdamW widens both moments and keeps one
        # temporary, 8-bit codes add their decoded moments and packing buffers.
        scratch = 4 * c + (0 if split else 4 * c)
        if moments_dtype == "fp32":
            scratch += (8 if device == "cpu" else 4) * c
        else:
            scratch += (12 + (8 + 16 if is_quantized(moments_dtype) else 0)) * c
    elif moments_dtype == "fp32" and device == "cpu" and shape is not None:
        # torch's AdamW runs its per-tensor loop on a CPU (foreach kernels are for accelerators):
        # two temporaries the size of the largest tensor (sqrt(v), then its division).
        scratch = 8 * _largest_param(shape)
    elif moments_dtype == "fp32":
        scratch = 4 * (c if split else P)
    else:
        scratch = (12 + (16 if is_quantized(moments_dtype) else 0)) * c
    if split and not flat:
        scratch += 4 * min(low_p, CHUNK_NUMEL)
    if shape is None:
        copies = low_p * cb if mixed_copies else 0
        acts = loss_buffers = backward_buffers = 0.0
    else:
        copies = shape.matmul_weights() * cb if mixed_copies else 0
        if layers is not None:
            copies += layers[0]
        tokens = batch * seq
        residual = pb if recipe.stores_low_precision else 4
        kept_moe, rec_moe = activation_bytes_per_token(shape, cb, residual_bytes=residual,
                                                       checkpointing=checkpointing, moe=True)
        kept_dense, rec_dense = activation_bytes_per_token(shape, cb, residual_bytes=residual,
                                                           checkpointing=checkpointing, moe=False)
        dense_layers = shape.num_layers - shape.moe_layers
        kept = shape.moe_layers * kept_moe + dense_layers * kept_dense
        recompute = max(rec_moe if shape.moe_layers else 0, rec_dense if dense_layers else 0)
        from mixprec.nn.attention import upcasts_short_attention
        upcast = 10 * shape.d_model if device is not None and upcasts_short_attention(
            device, recipe.compute_dtype, seq, shape.d_model // shape.num_heads) else 0
        if checkpointing:
            recompute += upcast
        else:
            kept += upcast * shape.num_layers
        if layers is not None:
            if checkpointing:
                recompute += layers[2]
            else:
                kept += layers[1]
        d, V = shape.d_model, shape.vocab_size
        head_in = cb
        if fp8_activations:
            from mixprec.nn.fp8_activations import BYTES_PER_VALUE as fb
            head_in = fb
            if not checkpointing:
                kept -= (cb - fb) * (dense_layers * (3 * d + shape._hidden) + shape.moe_layers * 2 * d)
        head = 4 * (d + 2) + head_in * d + 4 * V + 8     # final norm, head input, log-softmax, token ids
        loss_tokens = tokens
        if loss_chunk:
            head = 4 * (d + 2) + cb * d + 8              # the final norm's output is the slices' input
            loss_tokens = min(tokens, loss_chunk)
        # A checkpointed block's recompute exists only in its backward, after the loss's buffers
        # are freed: it is a backward buffer (below), not an activation kept at the forward's end
        # (counting it here too over-counted the measured 32-true + checkpointing peak by 10 %).
        acts = tokens * (kept + head) / tp
        # The loss backward's peak: the kept log-softmax (in ``acts``) and these two FP32 buffers,
        # its incoming gradient and the logits' gradient. The 16-bit logits of ``head(h).float()``
        # are never alive with them: nothing saves them (the cast saves no tensor), so they are
        # freed in the forward once widened, and their 16-bit gradient is made after the two FP32
        # buffers are released (measured with the allocator's events: 12 bytes per token and
        # word at the peak in FP32 and BF16 alike; counting 2 more over-estimated the checkpointed
        # lean gpt-ref step by 9 %, docs/performance.md).
        loss_buffers = loss_tokens * 8 * V / tp
        if loss_chunk:
            # a slice's backward: its recomputed logits and log-softmax with their gradients
            # (16 bytes per token and word), and the head's weight gradient of the slice before it
            # is added to .grad (fitted to the one probe in docs/performance.md: 8 bytes per token
            # and word, without the weight gradient, under-counted 32-true by 5 %)
            loss_buffers = (loss_tokens * 16 * V + pb * V * d) / tp     # no 16-bit logits: as above
        # A block's backward materialises gradients shaped like its saved tensors before it frees them.
        biggest = max(kept_moe if shape.moe_layers else 0, kept_dense if dense_layers else 0)
        # Without recompute, a block's backward frees its saved tensors as it goes: what is in
        # flight at once is about the gradients of the MLP's hidden and output (measured on a
        # CPU with glibc's mmap threshold fixed: docs/performance.md). With recompute, the
        # recomputed block's saved tensors are alive during its backward.
        in_flight = (max(shape._hidden, shape._ehidden if shape.moe_layers else 0) + d) * cb + upcast
        if fp8_activations and not checkpointing:
            # unpacking the widest saved input (the MLP's hidden) widens its codes to FP32 and
            # multiplies by the scales (mixprec.nn.fp8_activations._unpack): about one FP32
            # temporary of it at the backward's peak (fitted to the two CPU probes in
            # docs/performance.md; two temporaries over-counted the BF16 row by 8 %)
            in_flight += 4 * max(shape._hidden, shape._ehidden if shape.moe_layers else 0)
        backward_buffers = tokens * (recompute or in_flight) / tp
    s = float(shards * tp * pp)
    name = policy.name + ("+overrides" if layers is not None else "")
    return MemoryEstimate(mode=name, parameters=params / s, gradients=grads / s,
                          master_weights=masters / s, master_gradients=master_grads / s,
                          optimizer_moments=moments / s, weight_copies=copies / s, activations=float(acts),
                          loss_buffers=float(loss_buffers), backward_buffers=float(backward_buffers),
                          optimizer_scratch=scratch / s, num_parameters=P / s,
                          moments=moments_dtype if optimizer == "adamw" else "fp32")


def format_table(rows: list[MemoryEstimate], *, unit: float = GB, unit_name: str = "GB") -> str:
    """The source article's columns (per device, parameter storage, activations, saving vs FP32),
    then the breakdown it leaves out (docs/sources.md)."""
    base = next((r for r in rows if r.mode == "32-true"), rows[0])
    out = [f"{'mode':<12} {'per device':>11} {'param+optim':>12} {'activations':>12} {'saving':>8}"
           f"   (in {unit_name}; saving of the per-device peak vs {base.mode})"]
    for r in rows:
        out.append(f"{r.mode:<12} {r.peak / unit:>11.2f} {r.states / unit:>12.2f} "
                   f"{(r.activations + r.loss_buffers) / unit:>12.2f} {1 - r.peak / base.peak:>7.0%}")
    out.append("(per device is the step's peak, not the columns' sum: activations and loss buffers live")
    out.append(" in forward/backward, the optimizer's scratch only in its step; "
               + ("GB = 10^9 bytes, as GPU datasheets count)" if unit_name == "GB" else "MiB = 2^20 bytes)"))
    out.append("")
    out.append(f"{'breakdown':<12} " + " ".join(f"{n:>10}" for n in (
        "params", "grads", "masters", "mgrads", "moments", "w.copies", "acts", "loss", "opt.tmp")))
    for r in rows:
        vals = (r.parameters, r.gradients, r.master_weights, r.master_gradients, r.optimizer_moments,
                r.weight_copies, r.activations, r.loss_buffers, r.optimizer_scratch)
        out.append(f"{r.mode:<12} " + " ".join(f"{v / unit:>10.2f}" for v in vals))
    if all(r.num_parameters for r in rows):
        out.append("")
        out.append(f"{'bytes/param':<12} " + " ".join(f"{n:>10}" for n in (
            "params", "grads", "masters", "mgrads", "moments", "total")) + "   (mgrads: FP32 master "
            "gradients at the step)")
        for r in rows:
            out.append(f"{r.mode:<12} " + " ".join(f"{v:>10.3f}" for v in r.bytes_per_parameter.values()))
        out.append("")
        out.append("kept between steps (params + grads + masters + moments; the master-gradient chunk lives "
                   "only during the step):")
        for r in rows:
            b = r.bytes_per_parameter
            kept = [b["params"], b["grads"], b["masters"], b["moments"]]
            out.append(f"  {r.mode:<12} " + " + ".join(f"{v:.3f}" for v in kept) + f" = {sum(kept):.3f}")
        from mixprec.optim.moments import arithmetic, is_quantized
        for name in dict.fromkeys(r.moments for r in rows):
            out.append(f"  moments {name}: {arithmetic(name)}")
            here = next(r for r in rows if r.moments == name)
            if is_quantized(name):
                out.append(f"  moments {name} of this model: {here.bytes_per_parameter['moments']:.4f} bytes per "
                           "parameter (its rows' blocks and its FP32 vectors counted)")
    return "\n".join(out)
