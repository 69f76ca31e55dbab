"""Dataclass configs, validated on creation.

Every config raises :class:`kvlearn.errors.KVLearnError` with a one-line message naming the bad value and the
valid range, so bad input never reaches torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import check, check_int, is_int


def retrofit_window(budget: int) -> int:
    """The protected window of a KVpop or DMS retrofit at ``budget`` tokens per KV head when none is given
    (``kvlearn retrofit`` without ``--window``, and every student of ``kvlearn reproduce kvpop``): the KVpop paper's
    256 from budget 512 up, half the budget below. At 256 this is 128, the window of Table 1's students at CR 94%
    (every windowed student gained over 64 there: docs/DESIGN.md section 5, "CR 94% with window 128 for every
    student")."""
    return 256 if budget >= 512 else max(1, budget // 2)


HARNESS_WINDOW = 32  # the harness's default protected window of a windowed method (KVpop, DMS): the eviction
# methods' default, so budgets compare like for like


def windowed_budget(method: str, budget: int, sinks: int, window: int | None) -> int:
    """The protected window of a ``sinks + window + ranked`` budget (``window`` None: :data:`HARNESS_WINDOW`), after
    one-line checks that the budget leaves at least one ranked slot; ``method`` names the method in the errors."""
    check_int("sinks", sinks, 0)
    window = HARNESS_WINDOW if window is None else window
    check_int("window", window, 1, hint=" (the protected window holds at least the query itself)")
    check_int("budget", budget, sinks + window + 1,
              hint=f" ({method} needs sinks={sinks} + window={window} and at least one long-range slot)")
    return window


@dataclass(frozen=True)
class EvictionBudget:
    """The budget every eviction method shares: ``budget`` tokens kept per (batch row, KV head), of which the first
    ``sinks`` and the ``window`` most recent ones (the query itself included) are protected.

    ``window=None`` takes the method's default (:meth:`default_window`). ``context`` (optional) is the evaluation
    context; when given, the budget must be below it (else nothing is compressed). A method whose rule needs more
    than ``sinks + window`` slots raises naming its minimum (:meth:`min_budget`).
    """

    budget: int
    sinks: int = 4
    window: int | None = None
    context: int | None = None

    def default_window(self) -> int:
        return 32

    def min_budget(self) -> int:
        """Smallest budget the method honours (default: sinks + window + one ranked slot)."""
        return self.sinks + self.window + 1

    def __post_init__(self) -> None:
        check_int("sinks", self.sinks, 0)
        check_int("budget", self.budget, 1)
        if self.window is None:
            object.__setattr__(self, "window", self.default_window())
        check_int("window", self.window, 1, hint=" (the protected window holds at least the query itself)")
        low = self.min_budget()
        check_int("budget", self.budget, low,
                  hint=f" ({type(self).__name__} needs sinks={self.sinks} + window={self.window} and its ranked slots)")
        if self.context is not None:
            check_int("context", self.context, 1)
            check(
                self.budget < self.context,
                f"budget={self.budget} is invalid: expected {low} <= budget < context = {self.context}",
            )

    @property
    def topk(self) -> int:
        """Slots left for ranked (non-protected) tokens."""
        return self.budget - self.sinks - self.window


@dataclass(frozen=True)
class StreamingConfig(EvictionBudget):
    """StreamingLLM: keep ``sinks`` first tokens and a window of the ``budget - sinks`` most recent ones.

    ``window`` is always ``budget - sinks`` (pass nothing, or exactly that).
    """

    def default_window(self) -> int:
        return max(1, self.budget - self.sinks)

    def min_budget(self) -> int:
        return self.sinks + 1

    def __post_init__(self) -> None:
        check_int("sinks", self.sinks, 0)
        check_int("budget", self.budget, self.sinks + 1, hint=f" (budget must exceed sinks={self.sinks} so the window is non-empty)")
        if self.window is not None:
            check(self.window == self.budget - self.sinks,
                  f"window={self.window!r} is invalid: StreamingConfig's window is budget - sinks = {self.budget - self.sinks}")
        super().__post_init__()


@dataclass(frozen=True)
class KVpopConfig:
    """KVpop retention: ``sinks`` + protected ``window`` + learned ``topk`` older tokens per KV head.

    budget ``B = sinks + window + topk``. ``decay_min``/``decay_max`` bound the learned per-head decay
    ``gamma_h`` (Eq. 21 of the KVpop paper): ``0 < decay_min <= decay_max < 1``; ``decay_init`` is every head's
    initial ``gamma`` (``decay_min < decay_init < decay_max``; None: the log-midpoint of the range, ``alpha = 0``,
    which the paper does not fix; it only matters for new modules). ``decay_step`` is the step
    size ``n`` of Eq. 5; only ``n = 1`` gives static priorities (appendix B.3) and is supported by the cache.
    ``context`` (optional) is the evaluation context; when given, the budget must be below it (else nothing is
    compressed). ``mlstm_matmul_dtype`` (``"float32"`` default, ``"tf32"``, ``"bfloat16"``) is the operand precision
    of the mLSTM scorer's chunk matmuls (:func:`kvlearn.ops.mlstm.mlstm_chunkwise`); not a learned field.
    ``mlstm_compile_mode`` (``"default"``, ``"reduce-overhead"``: CUDA graphs) is how the mLSTM scorer's compiled
    training forward is launched (:class:`kvlearn.kvpop.scorers.MLSTMScorer` ``compile_mode``); not a learned field.
    ``mlstm_skip`` (default True): the mLSTM scorer's skip connection from the scored token to the score (the
    paper's appendix E.5 variant; :class:`kvlearn.kvpop.scorers.MLSTMScorer` ``skip``; ``docs/DESIGN.md`` section 5, "The skip connection"); a
    learned field. Records written before it existed were built without it: read them with :meth:`from_record`.
    ``mlstm_use_norm`` (default False), ``mlstm_chunk_size`` (64), ``mlstm_value_dim`` (None: ``head_dim / 2``) and
    ``mlstm_gate_softcap`` (15.0; None: no cap) are the mLSTM scorer's ``use_norm``, ``chunk_size``, ``value_dim`` and
    ``gate_softcap`` (:class:`kvlearn.kvpop.scorers.MLSTMScorer`; the defaults are its own, so records written before
    these fields existed build the same scorer). ``mlstm_value_dim`` and ``mlstm_use_norm`` change the parameter set
    (the width of ``W_v``, ``a`` and the state; the per-head RMSNorm weight) and ``mlstm_gate_softcap`` the function
    the weights were trained under: learned fields. ``mlstm_chunk_size`` is the chunk length of the chunkwise
    forward (:func:`kvlearn.ops.mlstm.mlstm_chunkwise`; any length >= 1, a sequence need not be a multiple of it):
    numerics only, not a learned field.
    ``state_in_budget`` (default False): a stateful scorer's recurrent state counts toward the budget, so the cache
    keeps ``topk`` minus the slots the state's bytes would hold (:func:`kvlearn.kvpop.apply.make_kvpop_cache`; the
    KVpop paper's Table 1 rule, "its top-k is reduced to match the MLP variant's footprint"); not a learned field.
    ``target_aggregation``, ``target_count_normalize``, ``target_reduction``: the future-attention target the
    scorers learn (:func:`kvlearn.ops.future_target.future_attention_target`; ``"peak"`` ignores the count).
    """

    sinks: int = 4
    window: int = 256
    topk: int = 2016
    decay_min: float = 0.999
    decay_max: float = 0.999999
    decay_init: float | None = None
    decay_step: int = 1
    scorer: str = "mlstm"
    delayed_readout: bool = True
    mlstm_skip: bool = True
    state_in_budget: bool = False
    mlstm_matmul_dtype: str = "float32"
    mlstm_compile_mode: str = "default"
    mlstm_use_norm: bool = False
    mlstm_chunk_size: int = 64
    mlstm_value_dim: int | None = None
    mlstm_gate_softcap: float | None = 15.0
    target_eps: float = 1e-6
    target_aggregation: str = "max"
    target_count_normalize: bool = True
    target_reduction: str = "peak"
    loss_temperature: float = 1.0
    margin_weighting: bool = True
    margin_min_weight: float = 0.1
    margin_temperature: float = 1.0
    balance: bool = True
    balance_clip: tuple[float, float] = (0.2, 5.0)
    context: int | None = None

    SCORERS = ("linear", "mlp", "mlstm")
    # fields a recorded config (config.json, a run's saved config) may lack, with the value they had before they
    # existed: mlstm_skip came with its default True, so an older record means the scorer without the skip
    RECORD_DEFAULTS = {"mlstm_skip": False}
    MATMUL_DTYPES = ("float32", "tf32", "bfloat16")  # = kvlearn.ops.mlstm.MATMUL_DTYPES
    COMPILE_MODES = ("default", "reduce-overhead")  # = kvlearn.kvpop.scorers.COMPILE_MODES
    AGGREGATIONS = ("max", "mean")
    REDUCTIONS = ("mass", "peak")  # = kvlearn.ops.future_target.REDUCTIONS

    @classmethod
    def from_record(cls, record: dict) -> "KVpopConfig":
        """The config a recorded dict describes (``asdict`` of one, from ``config.json`` or a run's saved config),
        with :attr:`RECORD_DEFAULTS` for the fields records written before them lack."""
        return cls(**{**cls.RECORD_DEFAULTS, **record})

    def __post_init__(self) -> None:
        check_int("sinks", self.sinks, 0)
        check_int("window", self.window, 1, hint=" (the protected window must hold at least the query itself)")
        check_int("topk", self.topk, 0)
        check_int("decay_step", self.decay_step, 1)
        for name in ("decay_min", "decay_max"):
            v = getattr(self, name)
            check(
                isinstance(v, (int, float)) and 0.0 < float(v) < 1.0,
                f"{name}={v!r} is invalid: expected a decay factor in the open interval (0, 1)",
            )
        check(
            self.decay_min <= self.decay_max,
            f"decay_min={self.decay_min} > decay_max={self.decay_max}: expected 0 < decay_min <= decay_max < 1",
        )
        check(
            self.decay_init is None or (isinstance(self.decay_init, (int, float)) and not isinstance(self.decay_init, bool)
                                        and self.decay_min < float(self.decay_init) < self.decay_max),
            f"decay_init={self.decay_init!r} is invalid: expected None or a decay factor strictly between "
            f"decay_min={self.decay_min} and decay_max={self.decay_max}",
        )
        check(self.scorer in self.SCORERS, f"scorer={self.scorer!r} is unknown: expected one of {', '.join(self.SCORERS)}")
        check(isinstance(self.mlstm_skip, bool), f"mlstm_skip={self.mlstm_skip!r} is invalid: expected True or False")
        check(isinstance(self.state_in_budget, bool),
              f"state_in_budget={self.state_in_budget!r} is invalid: expected True or False")
        check(isinstance(self.mlstm_matmul_dtype, str) and self.mlstm_matmul_dtype in self.MATMUL_DTYPES,
              f"mlstm_matmul_dtype={self.mlstm_matmul_dtype!r} is unknown: expected one of {', '.join(self.MATMUL_DTYPES)}")
        check(isinstance(self.mlstm_compile_mode, str) and self.mlstm_compile_mode in self.COMPILE_MODES,
              f"mlstm_compile_mode={self.mlstm_compile_mode!r} is unknown: expected one of {', '.join(self.COMPILE_MODES)}")
        check(self.mlstm_compile_mode == "default" or self.mlstm_matmul_dtype != "tf32",
              f"mlstm_compile_mode={self.mlstm_compile_mode!r} with mlstm_matmul_dtype='tf32' is not supported: "
              "expected mlstm_compile_mode='default', or mlstm_matmul_dtype 'float32' or 'bfloat16'")
        check(isinstance(self.mlstm_use_norm, bool),
              f"mlstm_use_norm={self.mlstm_use_norm!r} is invalid: expected True or False")
        check_int("mlstm_chunk_size", self.mlstm_chunk_size, 1,
                  hint=" (the mLSTM chunk length; a sequence need not be a multiple of it)")
        check(self.mlstm_value_dim is None or (is_int(self.mlstm_value_dim) and self.mlstm_value_dim >= 1),
              f"mlstm_value_dim={self.mlstm_value_dim!r} is invalid: expected None (head_dim / 2) or an integer >= 1")
        softcap = self.mlstm_gate_softcap
        check(softcap is None or (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                  and math.isfinite(softcap) and softcap > 0),
              f"mlstm_gate_softcap={softcap!r} is invalid: expected None (no cap) or a finite number > 0")
        check(
            self.target_aggregation in self.AGGREGATIONS,
            f"target_aggregation={self.target_aggregation!r} is unknown: expected one of {', '.join(self.AGGREGATIONS)}",
        )
        check(self.target_reduction in self.REDUCTIONS,
              f"target_reduction={self.target_reduction!r} is unknown: expected one of {', '.join(self.REDUCTIONS)}")
        check(isinstance(self.target_count_normalize, bool),
              f"target_count_normalize={self.target_count_normalize!r} is invalid: expected True or False")
        check(self.target_eps > 0, f"target_eps={self.target_eps!r} is invalid: expected > 0")
        check(self.loss_temperature > 0, f"loss_temperature={self.loss_temperature!r} is invalid: expected > 0")
        check(
            0.0 <= self.margin_min_weight <= 1.0,
            f"margin_min_weight={self.margin_min_weight!r} is invalid: expected a weight in [0, 1]",
        )
        check(self.margin_temperature > 0, f"margin_temperature={self.margin_temperature!r} is invalid: expected > 0")
        check(isinstance(self.delayed_readout, bool),
              f"delayed_readout={self.delayed_readout!r} is invalid: expected True or False")
        check(isinstance(self.balance_clip, (tuple, list)) and len(self.balance_clip) == 2,
              f"balance_clip={self.balance_clip!r} is invalid: expected (c_min, c_max)")
        object.__setattr__(self, "balance_clip", tuple(self.balance_clip))  # a JSON round trip gives a list
        lo, hi = self.balance_clip
        check(0 < lo <= hi, f"balance_clip={self.balance_clip!r} is invalid: expected 0 < c_min <= c_max")
        if self.context is not None:
            check_int("context", self.context, 1)
            check(self.budget < self.context,
                  f"budget={self.budget} (sinks={self.sinks} + window={self.window} + topk={self.topk}) is invalid: "
                  f"expected budget < context = {self.context} (otherwise nothing is compressed)")

    @property
    def budget(self) -> int:
        """Per-head KV budget ``B = s + w + k``."""
        return self.sinks + self.window + self.topk


# DMS's training attention executions (kvlearn.dms.attention.dms_attention): auto (flex_channel on CUDA, dense
# elsewhere), the materialised bias, FlexAttention with the penalty in a score_mod, or as one more key channel
# (mask_mod only), and that channel under a dense mask (the CPU check of its gradients)
DMS_TRAIN_ATTENTIONS = ("auto", "dense", "flex", "flex_channel", "dense_channel")
# what DMS's compression hinge holds to the target (kvlearn.dms.attention.compression_loss): the closed fraction over
# the whole model (the reference: layers, KV heads and keys of a row), or each (row, layer, KV head)'s own, which a
# budget per KV head needs (docs/DESIGN.md section 9, "Does the cap bind?")
DMS_COMPRESSION_SCOPES = ("model", "head")
# which kept token a DMS cache evicts when a kept token leaves the window and the long-range slots are full (a serving
# rule; training never meets the budget): the one with the highest eviction logit (the least sure keep), the oldest
# kept one (the slots hold the most recent kept tokens) or the newest one (the first kept tokens stay)
DMS_OVERFLOW_ORDERS = ("highest_logit", "oldest", "newest")


@dataclass(frozen=True)
class DMSConfig:
    """Dynamic Memory Sparsification (Łańcucki et al. 2025, arXiv 2506.05345), adapter variant (paper section 3.2).

    Per layer a gate ``RMSNorm(hidden) -> Linear(hidden, kv_heads)`` (or, with ``gate_hidden > 0``, the MLP
    ``Linear(hidden, gate_hidden) -> SiLU -> Linear(gate_hidden, kv_heads)``; the last layer zero-initialised either
    way) reads the pre-layernorm residual stream; the eviction logit is ``alpha_scale * proj - alpha_offset`` (-5 at
    initialisation: keep). The decision of token ``t + 1`` applies to key ``t`` (shift by one); a key is never masked
    while ``q - t < window`` (``window`` counts the query itself, as every kvlearn method: the reference's
    ``window_size`` is ``window - 1``) nor when ``t < sinks``.

    Training: Gumbel-sigmoid with temperature ``tau`` (straight-through decisions for the compression loss), the
    one-sided hinge ``clamp(target - closed_fraction, min=0)`` with the target closed fraction ``1 - 1/cr`` and
    ``cr`` ramped linearly from 1 to ``target_cr`` over the first ``ramp_fraction`` of the run. ``compression_scope``:
    ``"model"`` (the reference) holds a row's closed fraction over all layers, KV heads and keys to the target, so
    the gates may give some heads many tokens and others none; ``"head"`` holds each layer's KV head to it (the hinge
    averaged over rows, layers and KV heads), what a ``budget`` per KV head asks.

    Inference: a key leaving the window is dropped iff its logit > 0. ``budget`` (optional): a hard per-(row, KV
    head) limit for like-for-like comparisons; when the ``topk = budget - sinks - window`` long-range slots are full,
    the kept token with the highest eviction logit is evicted (:class:`kvlearn.dms.cache.DMSPolicy`). ``None``: no
    budget (the paper); the cache then needs one (use a budget >= the sequence length to keep every kept token).
    ``overflow_evicts``: which kept token a full budget evicts, ``highest_logit`` (default), ``oldest`` or ``newest``
    (:data:`DMS_OVERFLOW_ORDERS`; a serving choice, the gates are trained without the budget).
    """

    sinks: int = 4
    window: int = 32
    budget: int | None = None
    gate_hidden: int = 0
    tau: float = 0.1
    alpha_scale: float = 100.0
    alpha_offset: float = 5.0
    target_cr: float = 4.0
    ramp_fraction: float = 0.9
    context: int | None = None
    train_attention: str = "auto"  # the training attention's execution (kvlearn.dms.attention.dms_attention's backend)
    compression_scope: str = "model"  # what the hinge holds to the target: the mean over layers and heads, or each head
    overflow_evicts: str = "highest_logit"  # which kept token a full budget evicts (DMS_OVERFLOW_ORDERS)

    def __post_init__(self) -> None:
        import math

        check(self.compression_scope in DMS_COMPRESSION_SCOPES,
              f"compression_scope={self.compression_scope!r} is invalid: expected one of "
              f"{', '.join(DMS_COMPRESSION_SCOPES)}")
        check(self.overflow_evicts in DMS_OVERFLOW_ORDERS,
              f"overflow_evicts={self.overflow_evicts!r} is invalid: expected one of {', '.join(DMS_OVERFLOW_ORDERS)}")
        check(self.train_attention in DMS_TRAIN_ATTENTIONS,
              f"train_attention={self.train_attention!r} is invalid: expected one of {', '.join(DMS_TRAIN_ATTENTIONS)}")
        check_int("sinks", self.sinks, 0)
        check_int("window", self.window, 1, hint=" (the protected window holds at least the query itself)")
        if self.budget is not None:
            check_int("budget", self.budget, self.sinks + self.window + 1,
                      hint=f" (DMS needs sinks={self.sinks} + window={self.window} and at least one long-range slot)")
        check_int("gate_hidden", self.gate_hidden, 0, hint=" (0: the reference's Linear(hidden, kv_heads) gate)")
        for name in ("tau", "alpha_scale"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
                  f"{name}={v!r} is invalid: expected a finite number > 0")
        check(isinstance(self.alpha_offset, (int, float)) and math.isfinite(self.alpha_offset),
              f"alpha_offset={self.alpha_offset!r} is invalid: expected a finite number")
        check(isinstance(self.target_cr, (int, float)) and not isinstance(self.target_cr, bool)
              and math.isfinite(self.target_cr) and self.target_cr >= 1,
              f"target_cr={self.target_cr!r} is invalid: expected a compression ratio >= 1")
        check(isinstance(self.ramp_fraction, (int, float)) and 0 < self.ramp_fraction <= 1,
              f"ramp_fraction={self.ramp_fraction!r} is invalid: expected a number in (0, 1]")
        if self.context is not None:
            check_int("context", self.context, 1)
            check(self.budget is None or self.budget < self.context,
                  f"budget={self.budget} is invalid: expected sinks + window + 1 = {self.sinks + self.window + 1} "
                  f"<= budget < context = {self.context}")

    @property
    def topk(self) -> int | None:
        """Long-range slots of the hard budget (None without one)."""
        return None if self.budget is None else self.budget - self.sinks - self.window

    def target_fraction(self, progress: float) -> float:
        """Target closed fraction ``1 - 1/cr`` at ``progress`` in [0, 1] of the run (``cr`` ramped 1 -> target_cr
        over ``ramp_fraction`` of it)."""
        cr = 1.0 + (self.target_cr - 1.0) * min(max(progress, 0.0) / self.ramp_fraction, 1.0)
        return 1.0 - 1.0 / cr
