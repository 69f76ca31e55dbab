"""The compact-cache contract with a per-head policy that evicts without overwriting (what KVpop will need).

`KeepSetPolicy` keeps, per (batch row, KV head), a fixed random set of positions forever plus a window of recent
tokens; every other token is evicted when it leaves the window, and its slot is freed, not overwritten. Decoding
through it must equal a dense forward whose mask (one per query head) is the same per-head predicate.
"""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn.cache import NEVER, CompactCache, CompactLayer, ForwardStep, Policy, SlotPlan
from kvlearn.hf import attach


class KeepSetPolicy(Policy):
    per_head = True

    def __init__(self, keep: torch.Tensor, window: int):
        """keep: bool [batch, heads, max_len], True = kept forever."""
        n_keep = int(keep.sum(-1).max())
        super().__init__(capacity=n_keep + window)
        self.keep, self.window = keep, window
        # slot of a kept position = its rank among the kept positions of its (row, head)
        self.keep_slot = torch.where(keep, keep.long().cumsum(-1) - 1, torch.full_like(keep, -1, dtype=torch.long))
        self.n_keep = n_keep

    def _end(self, pos):  # pos [b, h, n] (-1 = none)
        kept = torch.gather(self.keep, 2, pos.clamp(min=0))
        return torch.where(kept, torch.full_like(pos, NEVER), pos + self.window)

    def plan(self, layer, step: ForwardStep, key_states=None, value_states=None) -> SlotPlan:
        b, q = step.positions.shape
        h = self.keep.shape[1]
        pos = step.positions[:, None, :].expand(b, h, q)
        end = torch.where(pos >= 0, self._end(pos), torch.zeros_like(pos))
        last = step.real_after[:, None, None] - 1
        survives = (pos >= 0) & (end > last)
        kept_slot = torch.gather(self.keep_slot, 2, pos.clamp(min=0))
        slot = torch.where(kept_slot >= 0, kept_slot, self.n_keep + pos.remainder(self.window))
        write = torch.where(survives, slot, torch.full_like(slot, -1))
        old = layer.slot_positions.long()
        old_end = torch.where(old >= 0, self._end(old), torch.zeros_like(old))
        return SlotPlan(write_slots=write, old_end=old_end, new_end=end)


def test_per_head_policy_with_freed_slots_decodes_like_dense_per_head_mask():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128, attn_implementation="sdpa")
    model = attach(Qwen3ForCausalLM(cfg).eval())
    b, h, g, t, w = 2, 2, 2, 36, 5
    keep = torch.rand(b, h, t) < 0.25
    ids = torch.randint(1, 61, (b, t))
    # dense reference: per query head mask [b, h*g, t, t]
    qpos = torch.arange(t)[:, None]
    kpos = torch.arange(t)[None, :]
    per_kv = (kpos <= qpos) & (keep[:, :, None, :] | (qpos - kpos < w))  # [b, h, t, t]
    mask = per_kv.repeat_interleave(g, dim=1)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    cache = CompactCache([CompactLayer(KeepSetPolicy(keep, w)) for _ in range(2)])
    got = []
    with torch.no_grad():
        for a, z in [(0, 9), (9, 10), (10, 22)] + [(i, i + 1) for i in range(22, t)]:
            got.append(model(input_ids=ids[:, a:z], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-5, rtol=1e-4)
    layer = cache.layers[0]
    # the buffer holds exactly the kept tokens and the last w tokens of each (row, head), nothing evicted
    for bi in range(b):
        for hi in range(h):
            stored = sorted(p for p in layer.slot_positions[bi, hi].tolist() if p >= 0)
            want = sorted(set(torch.nonzero(keep[bi, hi]).flatten().tolist()) | set(range(t - w, t)))
            assert stored == want
