"""Quantized forwards for torch's attention layers, so that `tq.convert` converts them honestly.

torch's attention layers do not compute through their `nn.Linear` children:

- `nn.MultiheadAttention.forward` calls `F.multi_head_attention_forward`, which reads
  `in_proj_weight` (or `q/k/v_proj_weight`) and `out_proj.weight` directly; a converted
  `out_proj` would never run;
- `nn.TransformerEncoderLayer.forward`, in `eval()` under `no_grad`, hands every weight of the
  layer (attention, `linear1`, `linear2`) to one fused kernel (`torch._transformer_encoder_layer_fwd`);
- `nn.TransformerEncoder` then also packs a padded batch into a nested tensor.

So converting their linears alone would report layers converted whose GEMMs run in high precision.
`QuantizedMultiheadAttention` computes the input projections with `tq.nn.linear`, attention with
`F.scaled_dot_product_attention` (or, when attention weights are asked for, the explicit softmax),
and the output projection by *calling* `out_proj` (quantized when it is converted).
`QuantizedTransformerEncoderLayer` is the encoder layer with its fast path off. Both keep their
parameters and `state_dict` keys; `tq.convert` gives a module one of these classes in place.

The attention scores (q·kᵀ and softmax·v) are not linear-layer GEMMs and stay in high precision.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tqcompile.nn.base import QuantizedModule
from tqcompile.nn.functional import layer_linear
from tqcompile.nn.histories import _AmaxHistoryOwner
from tqcompile.ops.errors import raise_error, shape_str
from tqcompile.recipes import Recipe

__all__ = ["QuantizedMultiheadAttention", "QuantizedTransformerEncoderLayer", "mha_unsupported_reason"]

_KINDS = ("input", "weight", "grad")


def _projection_shapes(mha: nn.MultiheadAttention) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each GEMM of the in-projection, by history slot."""
    e = mha.embed_dim
    if mha._qkv_same_embed_dim:
        # "in_proj": self-attention, one GEMM with the packed weight; q/k/v: cross-attention, slices of it.
        return {"in_proj": (e, 3 * e), "q": (e, e), "k": (e, e), "v": (e, e)}
    return {"q": (e, e), "k": (mha.kdim, e), "v": (mha.vdim, e)}


def mha_unsupported_reason(mha: nn.MultiheadAttention, recipe: Recipe) -> str | None:
    """Why `recipe` cannot quantize the in-projection of `mha` (its out_proj is a Linear, judged on its own)."""
    for slot, (k, n) in _projection_shapes(mha).items():
        reason = recipe.unsupported_reason(k, n)
        if reason:
            return f"in-projection ({slot}, {k} -> {n}): {reason}"
    return None


def _float_mask(mask: torch.Tensor | None, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """An additive float mask: torch's bool masks say True = do not attend; float masks are added."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"MultiheadAttention: {name} has dtype {mask.dtype}; allowed: torch.bool or a floating dtype")
    return mask.to(dtype)


def _pad_key(mask: torch.Tensor | None) -> torch.Tensor | None:
    # One more key (bias_k or the zero key): every query may attend to it.
    return None if mask is None else F.pad(mask, (0, 1))


def _mha_forward(
    mha, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal, project, qkv=None
):
    """`nn.MultiheadAttention.forward`'s semantics, with the in-projection computed by
    `project(x, weight, bias, slot)` and the out-projection by calling `mha.out_proj`. `qkv`:
    ``qkv(q, k, v) -> (q, k, v)`` on the (batch, heads, tokens, head_dim) queries, keys and values
    attended with (`tq.calibrate`'s attention quantizers), or None."""
    if query.is_nested or key.is_nested or value.is_nested:
        raise ValueError(
            "MultiheadAttention (converted by tq.convert): nested tensor inputs are not supported; pass a padded "
            "batch with key_padding_mask"
        )
    # Bad shapes go through raise_error: under torch.compile the user then sees this message, not
    # Dynamo's "Observed exception" (tqcompile.ops.errors); the placeholder has the output's shape.
    out_shape = (*query.shape[:-1], mha.embed_dim)
    batched = query.dim() == 3
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        message = (
            f"MultiheadAttention: query, key and value must all be 3-D (batched) or all 2-D (unbatched), got shapes "
            f"{shape_str(query.shape)}, {shape_str(key.shape)}, {shape_str(value.shape)}"
        )
        return raise_error(ValueError, message, like=query, shape=out_shape), None
    self_attention = query is key and key is value
    if not batched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    elif not mha.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    b, tgt_len, e = query.shape
    src_len = key.shape[1]
    h, hd = mha.num_heads, mha.head_dim
    if e != mha.embed_dim or key.shape[0] != b or value.shape[:2] != key.shape[:2]:
        message = (
            f"MultiheadAttention(embed_dim={mha.embed_dim}): query {shape_str(query.shape)}, key {shape_str(key.shape)} and "
            f"value {shape_str(value.shape)} (batch first) need query's last dim embed_dim and one batch and key/value "
            "sequence length"
        )
        return raise_error(ValueError, message, like=query, shape=out_shape), None
    if attn_mask is None and is_causal:
        raise RuntimeError("MultiheadAttention: is_causal is a hint that attn_mask is the causal mask; pass attn_mask too")
    dtype = query.dtype
    key_padding_mask = _float_mask(key_padding_mask, "key_padding_mask", dtype)
    # As torch does: with the causal hint and nothing else to mask, SDPA builds the causal mask itself.
    # nn.Transformer passes a hint it detected by comparing the mask's values (a tensor under
    # torch.compile): only a Python bool is taken, else the mask itself is used, which is equal and
    # keeps the graph free of a data-dependent branch.
    sdpa_causal = is_causal is True and key_padding_mask is None and not need_weights
    attn_mask = None if sdpa_causal else _float_mask(attn_mask, "attn_mask", dtype)
    if attn_mask is not None:
        if attn_mask.dim() == 2 and attn_mask.shape == (tgt_len, src_len):
            attn_mask = attn_mask.view(1, 1, tgt_len, src_len)
        elif attn_mask.dim() == 3 and attn_mask.shape == (b * h, tgt_len, src_len):
            attn_mask = attn_mask.view(b, h, tgt_len, src_len)
        else:
            tgt_len, src_len, bh = (int(n) for n in (tgt_len, src_len, b * h))
            message = (
                f"MultiheadAttention: attn_mask of shape {shape_str(attn_mask.shape)}; allowed: ({tgt_len}, {src_len}) or "
                f"(batch * num_heads, {tgt_len}, {src_len}) = ({bh}, {tgt_len}, {src_len})"
            )
            return raise_error(ValueError, message, like=query, shape=out_shape), None
    if key_padding_mask is not None:
        if key_padding_mask.shape != (b, src_len):
            message = (
                f"MultiheadAttention: key_padding_mask of shape {shape_str(key_padding_mask.shape)}; "
                f"expected ({int(b)}, {int(src_len)})"
            )
            return raise_error(ValueError, message, like=query, shape=out_shape), None
        key_padding_mask = key_padding_mask.view(b, 1, 1, src_len)

    bias_q = bias_k = bias_v = None
    if mha.in_proj_bias is not None:
        bias_q, bias_k, bias_v = mha.in_proj_bias.chunk(3)
    if mha._qkv_same_embed_dim and self_attention:
        q, k, v = project(query, mha.in_proj_weight, mha.in_proj_bias, "in_proj").chunk(3, dim=-1)
    elif mha._qkv_same_embed_dim:
        w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
        q, k, v = project(query, w_q, bias_q, "q"), project(key, w_k, bias_k, "k"), project(value, w_v, bias_v, "v")
    else:
        q = project(query, mha.q_proj_weight, bias_q, "q")
        k = project(key, mha.k_proj_weight, bias_k, "k")
        v = project(value, mha.v_proj_weight, bias_v, "v")

    if mha.bias_k is not None:
        k = torch.cat([k, mha.bias_k.expand(b, 1, e).to(k.dtype)], dim=1)
        v = torch.cat([v, mha.bias_v.expand(b, 1, e).to(v.dtype)], dim=1)
        attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
    # (batch, heads, sequence, head_dim)
    q, k, v = (t.unflatten(-1, (h, hd)).transpose(1, 2) for t in (q, k, v))
    if qkv is not None:
        q, k, v = qkv(q, k, v)
    if mha.add_zero_attn:
        k = torch.cat([k, k.new_zeros(b, h, 1, hd)], dim=2)
        v = torch.cat([v, v.new_zeros(b, h, 1, hd)], dim=2)
        attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
    if key_padding_mask is not None:
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    dropout_p = mha.dropout if mha.training else 0.0

    weights = None
    if need_weights:
        scores = torch.matmul(q * (1.0 / math.sqrt(hd)), k.transpose(-2, -1))
        if attn_mask is not None:
            scores = scores + attn_mask
        weights = torch.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.matmul(weights, v)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            weights = weights.squeeze(0)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=sdpa_causal)
    out = mha.out_proj(out.transpose(1, 2).reshape(b, tgt_len, e))
    if not batched:
        out = out.squeeze(0)
    elif not mha.batch_first:
        out = out.transpose(0, 1)
    return out, weights


class QuantizedMultiheadAttention(QuantizedModule, _AmaxHistoryOwner, nn.MultiheadAttention):
    """`nn.MultiheadAttention` whose in-projection GEMMs run quantized as `recipe` says, and whose
    out-projection calls `out_proj` (quantized too when `tq.convert` converted it).

    Made by `tq.convert` (in place, same parameters and `state_dict` keys). Supports what
    `nn.MultiheadAttention.forward` takes: `batch_first`, unbatched inputs, `attn_mask` (2-D or 3-D,
    bool or float), `key_padding_mask`, `need_weights`/`average_attn_weights`, `is_causal`,
    `kdim`/`vdim`, `add_bias_kv`, `add_zero_attn` and dropout. Self-attention (query, key and value
    the same tensor) with a packed `in_proj_weight` is one GEMM; otherwise one per projection.
    """

    amax_group_name: str | None

    def _init_quantized(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.amax_group_name = None
        device = (self.in_proj_weight if self._qkv_same_embed_dim else self.q_proj_weight).device
        for slot in _projection_shapes(self):
            for kind in _KINDS:
                # fp32, zeroed when materialised from meta, persistent (see tqcompile.nn.histories).
                self._register_amax_history(f"amax_history_{slot}_{kind}", recipe.amax_history_len, device)

    def _histories(self, slot: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return tuple(getattr(self, f"amax_history_{slot}_{kind}") for kind in _KINDS) if self.recipe.amax_history_len else None

    def _reset_parameters(self) -> None:
        super()._reset_parameters()
        # Start the delayed-scaling histories over with the weights (absent while nn.MultiheadAttention.__init__ runs).
        self.reset_amax_histories()

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: str) -> torch.Tensor:
        return layer_linear(
            x,
            weight,
            bias,
            self.recipe,
            amax_group=self.amax_group_name,
            amax_histories=self._histories(slot),
            update_amax_histories=self.training,  # histories roll in training mode only
            layer=self,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `nn.MultiheadAttention.forward`: (attn_output, attn_weights or None)."""
        return _mha_forward(
            self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal, self._project
        )

    def extra_repr(self) -> str:
        return f"recipe={self.recipe.name}"


class QuantizedTransformerEncoderLayer(QuantizedModule, nn.TransformerEncoderLayer):
    """`nn.TransformerEncoderLayer` without its inference fast path, so that its converted
    `self_attn`, `linear1` and `linear2` run (quantized) in `eval()` under `no_grad` too.

    Made by `tq.convert` (in place, same parameters and `state_dict` keys). The forward is the
    layer's own non-fast path: `_sa_block` and `_ff_block` with pre- or post-norm residuals.
    """

    def forward(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """As `nn.TransformerEncoderLayer.forward`, never taking the fused fast path."""
        if src.is_nested:
            raise ValueError(
                "TransformerEncoderLayer (converted by tq.convert): nested tensor input is not supported; pass a padded "
                "batch with src_key_padding_mask (tq.convert turns the nested-tensor path of the TransformerEncoder off)"
            )
        # The masks are passed on as given: self_attn (quantized or torch's) makes them additive itself.
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def extra_repr(self) -> str:
        return f"recipe={self.recipe.name}"
