"""The KV-Kaizen selector: one small network that reads a prompt and picks one action per layer (``docs/DESIGN.md``
section 8, "Selector").

Architecture (:class:`KaizenSelector`):

- **token embedding**: its *own* small embedding of the model's vocabulary (``vocab x width``), not the model's
  frozen input embeddings projected down. It is cheap (at width 64 a 152k vocabulary is 9.7M parameters, held in
  float32 apart from the model), keeps the selector independent of the backbone's weights (the backbone is trained
  jointly, so its embeddings move) and of its width, and it is what ``save_pretrained`` stores under
  ``kaizen_selector.*``. Plus a learned position embedding (``max_positions``, positions beyond it clamp to the
  last), so the order of the prompt is visible to the encoder;
- **encoder**: ``blocks`` pre-norm bidirectional transformer blocks (``width``, ``heads``, MLP ``4 width``, no
  dropout), padding masked;
- **pooling**: the mean over the prompt's non-pad tokens (``attention_mask``), then a layer norm;
- **budget conditioning**: a FiLM layer on the pooled vector, ``h <- h (1 + γ(t)) + β(t)`` with ``(γ, β)`` a linear
  function of ``t = log2(ρ*)``, the per-sequence target compression; zero-initialised, so at init the budget has
  no effect and one selector can learn to serve several budgets;
- **direct target term** (``target_head=True``, what ``kvlearn kaizen-train`` builds for several targets): the
  logits also get ``g · T_l · log2(ρ*)``, ``T [layers, actions]`` zero-initialised, with the fixed gain ``g = width``.
  With ``W_l`` and the FiLM layer both starting at zero, the FiLM layer's gradient is zero at init and the target
  reaches the logits only once ``W_l`` has grown from prompt features; ``T`` gets ``g log2(ρ*)`` times the logits'
  gradient from the first step. The gain: under Adam every parameter moves about ``lr`` per step, so ``W_l h``
  (``width`` channels of unit-scale features) can move a logit about ``width`` times further per step than one
  parameter can; without it ``T`` stayed under 0.05 in 200 CPU steps while the prompt path set the choice
  (``docs/DESIGN.md`` section 8, "Spending a loose target");
- **heads**: one linear head per layer, ``logits[:, l] = W_l h + b_l`` over that layer's allowed actions of
  :func:`~kvlearn.kaizen.actions.action_space`; disallowed ones (:func:`~kvlearn.kaizen.actions.action_mask`:
  ``share`` at layer 0, and at every layer ``share_layers`` does not list when it is given) are ``-inf``. ``W_l``
  starts at zero and ``b_l`` gives the least compressed action (index 0: 16 bits, no sharing) a margin
  ``init_margin`` over the others: at init that action is the argmax at every layer, for every prompt and target.

Sampling: during training :func:`gumbel_straight_through` (temperature annealed from 2.0 to 0.1 by the trainer,
:func:`temperature_at`): a hard one-hot forward, the Gumbel-softmax gradient backward. At evaluation the argmax of
the logits (:meth:`KaizenSelector.choose`), projected onto the budget when it lies over it
(:meth:`KaizenSelector.choose_within_budget`, what ``kvlearn eval`` runs). The selector runs once per prompt before
prefill; its choice holds for the whole generation.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import check
from .budget import selection_cost
from .actions import Backbone, KaizenConfig, action_bits, action_mask, action_space, check_axes, check_share_layers

__all__ = ["KaizenSelector", "gumbel_straight_through", "temperature_at", "SELECTOR_NAME"]

SELECTOR_NAME = "kaizen_selector"  # the model attribute, and the state-dict prefix
TAU_START, TAU_END = 2.0, 0.1


def temperature_at(fraction: float, start: float = TAU_START, end: float = TAU_END) -> float:
    """The Gumbel-softmax temperature ``fraction`` of the way through training: geometric from ``start`` to ``end``."""
    f = min(1.0, max(0.0, float(fraction)))
    return start * (end / start) ** f


def gumbel_straight_through(logits: torch.Tensor, tau: float, generator: torch.Generator | None = None,
                            noise: bool = True) -> torch.Tensor:
    """Straight-through Gumbel-softmax over the last dim of ``logits [batch, layers, actions]`` (``-inf`` = not
    allowed): forward the one-hot of ``argmax(logits + g)`` (exactly 0 and 1 up to rounding of ``1 - p + p``),
    backward the gradient of ``softmax((logits + g) / tau)``. ``noise=False``: no Gumbel noise (the argmax)."""
    check(tau > 0, f"tau={tau!r} is invalid: expected a temperature > 0")
    if noise:
        u = torch.rand(logits.shape, generator=generator, dtype=torch.float32).to(logits.device, logits.dtype)
        g = -torch.log(-torch.log(u.clamp(1e-10, 1 - 1e-7)))
        y = logits + g
    else:
        y = logits
    soft = torch.softmax(y / tau, dim=-1)
    hard = torch.nn.functional.one_hot(y.argmax(-1), logits.shape[-1]).to(soft.dtype)
    return hard - soft.detach() + soft


class KaizenSelector(nn.Module):
    """The prompt -> per-layer action selector (module docstring).

    Args:
        vocab_size: the model's vocabulary.
        backbone: the model's :class:`~kvlearn.kaizen.actions.Backbone`.
        axes: the enabled compression axes (``None``: every axis of the backbone).
        width, heads, blocks: the encoder (64, 2, 2).
        max_positions: learned positions (longer prompts reuse the last).
        init_margin: the bias margin of the least compressed action at init.
        target_head: the direct target term (module docstring).
        share_layers: the layers that may take ``share`` (``None``: every layer but 0;
            :func:`~kvlearn.kaizen.actions.check_share_layers`), e.g. from the trainer's sensitivity pass
            (:mod:`kvlearn.kaizen.share_sensitivity`).
    """

    def __init__(self, vocab_size: int, backbone: Backbone, axes=None, width: int = 64, heads: int = 2,
                 blocks: int = 2, max_positions: int = 8192, init_margin: float = 2.0, target_head: bool = False,
                 share_layers=None):
        super().__init__()
        check(isinstance(backbone, Backbone), f"backbone={backbone!r} is not a kaizen Backbone")
        check(width % heads == 0, f"width={width} is invalid: expected a multiple of heads={heads}")
        self.backbone = backbone
        self.axes = check_axes(axes, backbone)
        self.space = action_space(backbone, self.axes)
        self.share_layers = check_share_layers(share_layers, backbone)
        L, A = backbone.num_layers, len(self.space)
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(max_positions, width)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.film = nn.Linear(1, 2 * width)
        nn.init.zeros_(self.film.weight)
        nn.init.zeros_(self.film.bias)
        self.head_weight = nn.Parameter(torch.zeros(L, A, width))
        bias = torch.zeros(L, A)
        bias[:, 0] = init_margin
        self.head_bias = nn.Parameter(bias)
        self.target_weight = nn.Parameter(torch.zeros(L, A)) if target_head else None
        self.target_gain = float(width)  # the direct term's fixed gain (module docstring)
        self.register_buffer("mask", torch.tensor(action_mask(backbone, self.axes, self.share_layers)), persistent=False)
        self.register_buffer("costs", torch.tensor([float(action_bits(a, backbone, metadata=False)) for a in self.space]),
                             persistent=False)

    @property
    def num_actions(self) -> int:
        return len(self.space)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                target: torch.Tensor | float | None = None) -> torch.Tensor:
        """Logits ``[batch, layers, actions]`` (float32; ``-inf`` where :func:`action_mask` forbids) for
        ``input_ids [batch, seq]``, ``attention_mask [batch, seq]`` (1 = token, 0 = pad; ``None``: all tokens) and
        ``target``: the target compression ``ρ*`` per sequence (``[batch]`` or a number; ``None``: 1.0, no FiLM
        shift)."""
        check(input_ids.dim() == 2, f"input_ids of shape {tuple(input_ids.shape)} are invalid: expected [batch, seq]")
        B, T = input_ids.shape
        device = self.head_bias.device
        input_ids = input_ids.to(device)
        mask = torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask is None \
            else attention_mask.to(device).bool()
        check(bool(mask.any(-1).all()), "every prompt needs at least one non-pad token")
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0, max=self.pos.num_embeddings - 1)
        x = self.embed(input_ids).float() + self.pos(pos).float()
        x = self.encoder(x, src_key_padding_mask=~mask)
        m = mask[..., None].float()
        h = self.norm((x * m).sum(1) / m.sum(1))  # [B, width]
        if target is None:
            target = 1.0
        t = torch.as_tensor(target, dtype=torch.float32, device=device).reshape(-1)
        t = t.expand(B) if t.numel() == 1 else t
        check(t.numel() == B and bool((t > 0).all()),
              f"target of shape {tuple(t.shape)} is invalid: expected one compression factor > 0 per sequence ({B})")
        gamma, beta = self.film(torch.log2(t)[:, None]).chunk(2, dim=-1)
        h = h * (1 + gamma) + beta
        logits = torch.einsum("bw,law->bla", h, self.head_weight) + self.head_bias
        if self.target_weight is not None:  # the direct target term: [B, 1, 1] x [L, A], gain width (docstring)
            logits = logits + self.target_gain * torch.log2(t)[:, None, None] * self.target_weight
        return logits.masked_fill(~self.mask, float("-inf"))

    @torch.no_grad()
    def choose(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               target=None) -> torch.Tensor:
        """The evaluation choice: ``argmax`` of the logits, int64 ``[batch, layers]``."""
        return self(input_ids, attention_mask, target).argmax(-1)

    @torch.no_grad()
    def choose_within_budget(self, logits: torch.Tensor, target) -> torch.Tensor:
        """The evaluation choice under the budget, int64 ``[batch, layers]``: per row the argmax of ``logits [batch,
        layers, actions]`` when its cost (bits per token without metadata) is within ``C* = C_ref / ρ*`` (``target``:
        ``ρ*``, a number or ``[batch]``), else the selector's most likely configuration within it,
        ``argmax Σ_l log softmax(logits)_{l, a_l}`` subject to ``Σ_l c(a_l) <= C*`` over the allowed actions (the exact
        multiple-choice knapsack of :func:`~kvlearn.kaizen.dp_search.dp_search`). A selector trained on the expected
        cost meets the target in expectation, and its argmax can land on either side of it; this keeps a prompt's
        cache within what was asked. One-line error for a budget no allowed configuration meets."""
        from .dp_search import dp_search

        choice = logits.argmax(-1)
        budget = self.target_bits(torch.as_tensor(target, dtype=torch.float32).reshape(-1).expand(logits.shape[0]))
        cost = self.costs.to(logits.device)[choice].sum(-1)  # [batch]
        logp = torch.log_softmax(logits.double(), dim=-1).cpu()
        for row in (cost.cpu() > budget * (1 + 1e-9)).nonzero().flatten().tolist():
            picked = dp_search(-logp[row], self.costs.cpu(), float(budget[row]), self.mask.cpu())
            choice[row] = torch.tensor(picked.indices, device=choice.device)
        return choice

    def configs(self, indices: torch.Tensor) -> list[KaizenConfig]:
        """One :class:`KaizenConfig` per row of ``indices [batch, layers]``."""
        return [KaizenConfig.from_indices(self.backbone, row.tolist(), self.axes) for row in indices]

    def cost(self, weights: torch.Tensor) -> torch.Tensor:
        """``Ĉ [batch]``: bits per token (no metadata) of the per-layer action weights ``[batch, layers, actions]``
        (:func:`kvlearn.kaizen.budget.selection_cost`)."""
        return selection_cost(weights, self.costs)

    def target_bits(self, target: torch.Tensor) -> torch.Tensor:
        """``C* = C_ref / ρ*`` per sequence."""
        return self.backbone.reference_bits / torch.as_tensor(target, dtype=torch.float32)

