"""The Cells of the whole models: RMSNorm, token embedding, rotary embedding, grouped-query and
multi-head latent attention, the dense SwiGLU MLP and the decoder layer. Parameter names and
layouts are transformers' ([out, in] projections), so checkpoints carry over unchanged."""
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ..nn._backend import project
from ..nn._precision import SelfCastingCell
from ..nn.moe_layer import MoELayer
from ..ops._attention import SCORES, attend, rotate, write_cache
from ..ops._indexing import take_rows
from ..ops._platform import device_target
from ..ops.decode_attention import decode_attention
from ..ops.rms_norm import add_rms_norm, rms_norm
from .config import GQAConfig

__all__ = ["RMSNorm", "Embedding", "RotaryEmbedding", "GQAttention", "MLAttention", "MLP",
           "DecoderLayer", "Linear", "linear", "causal_mask", "write_cache"]

_MIN = float(np.finfo(np.float32).min)


class RMSNorm(nn.Cell):
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, in float32 (float32 tokens and
    weight: the operator rms_norm, one kernel on the CPU and on Ascend)."""

    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = Parameter(ops.ones(size, dtype=ms.float32), name="weight")
        self.eps = float(eps)

    def construct(self, x):
        dtype = x.dtype
        if dtype == ms.float32 and self.weight.dtype == ms.float32:
            return rms_norm(x, self.weight, self.eps)
        if dtype != ms.float32:  # (a cast to the same dtype is a copy in the graph)
            x = x.astype(ms.float32)
        x = x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.eps)
        if dtype != ms.float32:
            x = x.astype(dtype)
        return self.weight * x

    def add_norm(self, x, residual):
        """(norm(x + residual), x + residual): for float32 the operator add_rms_norm, one
        kernel where the sum and the norm are two."""
        if x.dtype == ms.float32 and residual.dtype == ms.float32 and \
                self.weight.dtype == ms.float32:
            return add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return self.construct(total), total


class Embedding(nn.Cell):
    """Token ids -> rows of `weight` [vocab, hidden]."""

    def __init__(self, vocab_size, hidden_size):
        super().__init__()
        self.weight = Parameter(initializer(Normal(0.02), (vocab_size, hidden_size), ms.float32),
                                name="weight")

    def construct(self, ids):
        return take_rows(self.weight, ids)


# Rows up to which a float32 product on the CPU is the package's skinny product (decoding's
# shapes; custom_aot/gemm.h kSkinnyRows): it streams the weight once at memory speed, where
# MindSpore's MatMul runs at about a third of it on one row.
SKINNY_ROWS = 16
_MATMUL_T = ops.MatMul(transpose_b=True)


def linear(x, weight, skinny):
    """x [..., in] @ weight[out, in].T -> [..., out]; with `skinny` (the CPU) a float32 product
    of at most SKINNY_ROWS rows through grouped_matmul (a static choice: shapes are constants
    in a graph), else MindSpore's MatMul (no copy of the transposed weight)."""
    lead = x.shape[:-1]
    rows = 1
    for size in lead:
        rows *= size
    flat = x.reshape(rows, x.shape[-1])
    if skinny and rows <= SKINNY_ROWS and x.dtype == ms.float32 and weight.dtype == ms.float32:
        out = project(flat, weight)
    else:  # (a cast to the same dtype would be a copy in the graph)
        out = _MATMUL_T(flat, weight if weight.dtype == x.dtype else weight.astype(x.dtype))
    return out.reshape(lead + (weight.shape[0],))


def on_cpu():
    """True when the models' products may take the CPU kernels' skinny path."""
    return device_target() == "CPU"


class Linear(nn.Linear):
    """nn.Linear (torch's [out, in] weight layout) whose products of a few float32 rows on the
    CPU (a decoding step) go through `linear`'s skinny path."""

    def __init__(self, n_in, n_out, bias=False, weight_init=None):
        super().__init__(n_in, n_out, bias=bias, weight_init=weight_init)
        self.skinny = on_cpu()

    def construct(self, x):
        out = linear(x, self.weight, self.skinny)
        if self.bias is not None:
            out = out + (self.bias if self.bias.dtype == out.dtype else self.bias.astype(out.dtype))
        return out


def _dense(n_in, n_out, bias=False):
    """A projection with torch's [out, in] weight layout (nn.Linear's own), whose products of a
    few rows on the CPU (decoding) take the kernels' few-rows path (Linear)."""
    return Linear(n_in, n_out, bias=bias, weight_init=Normal(0.02))


class RotaryEmbedding(SelfCastingCell):
    """positions [S] (or any shape, flattened) -> (cos, sin) [S, dim] of the rotary embedding
    (frequencies repeated over both halves, times the YaRN attention scaling), in float32
    whatever the mixed precision (a half-precision position or angle is off by whole radians
    past a few hundred positions; the attention casts cos and sin to its own dtype)."""

    def __init__(self, rope):
        super().__init__()
        inv_freq = rope.inv_freq()
        # both halves' frequencies, so that one product makes them (the same products as
        # multiplying once and concatenating the result with itself)
        self.inv_freq = Tensor(np.concatenate([inv_freq, inv_freq])[None, :])
        self.scaling = float(rope.attention_scaling())

    def construct(self, positions):
        emb = positions.astype(ms.float32).reshape(-1, 1) * self.inv_freq
        if self.scaling == 1.0:  # (a product by 1 is a kernel of its own in a graph)
            return ops.cos(emb), ops.sin(emb)
        return ops.cos(emb) * self.scaling, ops.sin(emb) * self.scaling


def causal_mask(length, window=None):
    """[S, S] float32 added to the attention scores: 0 where key j <= query i (and i - j <
    window), the lowest float32 elsewhere."""
    i = ops.arange(length).reshape(-1, 1)
    j = ops.arange(length).reshape(1, -1)
    allowed = j <= i
    if window is not None:
        allowed = ops.logical_and(allowed, i - j < window)
    return ops.where(allowed, ops.zeros((length, length), dtype=ms.float32),
                     ops.full((length, length), _MIN, dtype=ms.float32))


def _one_position(b, s, cos, mask, slot):
    """A decoding step's arguments, as decode_attention takes them: one position, each
    sequence's rotary position and mask row, a scalar slot."""
    return (s == 1 and cos.ndim == 4 and cos.shape[0] == b and mask.ndim == 4
            and mask.shape[:3] == (b, 1, 1) and slot.ndim == 0)


def _all_float32(*tensors):
    for t in tensors:
        if t.dtype != ms.float32:
            return False
    return True


def _heads_first(x):
    """[B, S, h, d] <-> [B, h, S, d]; for one position (a decoding step) a reshape, not the
    transpose's copy."""
    if x.shape[1] == 1 or x.shape[2] == 1:
        return x.reshape(x.shape[0], x.shape[2], x.shape[1], x.shape[3])
    return x.swapaxes(1, 2)


class GQAttention(nn.Cell):
    """Grouped-query attention (Qwen3-MoE with q/k RMSNorm, Qwen2-MoE with q/k/v biases,
    Mixtral; see GQAConfig). x [B, S, H] -> [B, S, H]; with a cache (k, v), each
    [B, kv_heads, L, head_dim], the new keys and values are written at `slot` and the queries
    attend over the whole cache (mask [B, 1, S, L]): -> (out, the new cache). One position in
    float32 (a decoding step) takes the operator decode_attention: one kernel on the CPU."""

    def __init__(self, config, hidden_size):
        super().__init__()
        a = config
        self.q_proj = _dense(hidden_size, a.num_heads * a.head_dim, a.qkv_bias)
        self.k_proj = _dense(hidden_size, a.num_kv_heads * a.head_dim, a.qkv_bias)
        self.v_proj = _dense(hidden_size, a.num_kv_heads * a.head_dim, a.qkv_bias)
        self.o_proj = _dense(a.num_heads * a.head_dim, hidden_size, a.o_bias)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.norm_eps)
        self.qk_norm = a.qk_norm
        self.head_dim = a.head_dim
        self.scaling = float(a.scaling)

    def construct(self, x, cos, sin, mask, cache=None, slot=None):
        b, s, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).reshape(b, s, -1, d)
        k = self.k_proj(x).reshape(b, s, -1, d)
        v = _heads_first(self.v_proj(x).reshape(b, s, -1, d))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cache is not None and _one_position(b, s, cos, mask, slot) and \
                _all_float32(q, k, v, cos, sin, mask, *cache):
            # a decoding step: rotation, cache write and attention in one operator
            out, k, v = decode_attention(_heads_first(q), _heads_first(k), v, cos, sin, cache[0],
                                         cache[1], mask, slot, scaling=self.scaling)
            return self.o_proj(out.reshape(b, s, -1)), (k, v)
        q = rotate(_heads_first(q), cos, sin)
        k = rotate(_heads_first(k), cos, sin)
        if cache is not None:
            k, v = write_cache(cache[0], k, slot), write_cache(cache[1], v, slot)
            cache = (k, v)
        out = self.o_proj(_heads_first(attend(q, k, v, mask, self.scaling)).reshape(b, s, -1))
        if cache is None:
            return out
        return out, cache


class MLAttention(nn.Cell):
    """DeepSeek's multi-head latent attention (see MLAConfig). x [B, S, H] -> [B, S, H]; with a
    cache (normalised latent [B, 1, L, kv_lora_rank], rotary key [B, 1, L, qk_rope_head_dim]),
    the chunk's are written at `slot` and the queries attend over the whole cache, its keys and
    values rebuilt with kv_b_proj, or (absorb) in the latent space: -> (out, the new cache)."""

    def __init__(self, config, hidden_size):
        super().__init__()
        a = config
        qk_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank is None:
            self.q_proj = _dense(hidden_size, a.num_heads * qk_head_dim)
        else:
            self.q_a_proj = _dense(hidden_size, a.q_lora_rank, a.bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank)
            self.q_b_proj = _dense(a.q_lora_rank, a.num_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = _dense(hidden_size, a.kv_lora_rank + a.qk_rope_head_dim, a.bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank)
        self.kv_b_proj = _dense(a.kv_lora_rank, a.num_heads * (a.qk_nope_head_dim + a.v_head_dim))
        self.o_proj = _dense(a.num_heads * a.v_head_dim, hidden_size, a.bias)
        self.q_lora = a.q_lora_rank is not None
        self.heads = a.num_heads
        self.nope, self.rope, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.latent = a.kv_lora_rank
        self.interleave = a.interleave
        self.scaling = float(a.scaling)

    def construct(self, x, cos, sin, mask, cache=None, slot=None, absorb=False):
        b, s, _ = x.shape
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = _heads_first(q.reshape(b, s, self.heads, -1))
        q_nope, q_rot = ops.split(q, (self.nope, self.rope), -1)
        latent, k_rot = ops.split(self.kv_a_proj_with_mqa(x), (self.latent, self.rope), -1)
        latent = self.kv_a_layernorm(latent)
        q_rot = rotate(q_rot, cos, sin, self.interleave)
        k_rot = rotate(k_rot.reshape(b, 1, s, -1), cos, sin, self.interleave)  # one head, shared
        if cache is not None:  # the cache holds the latent and the rotary key, not k and v
            latent = write_cache(cache[0], latent.reshape(b, 1, s, -1), slot)
            k_rot = write_cache(cache[1], k_rot, slot)
            cache = (latent, k_rot)
            if absorb:
                out = self._absorbed(q_nope, q_rot, latent, k_rot, mask)
                return self.o_proj(_heads_first(out).reshape(b, s, -1)), cache
        length = k_rot.shape[2]
        kv = self.kv_b_proj(latent.reshape(b, length, -1))
        kv = kv.reshape(b, length, self.heads, -1).swapaxes(1, 2)
        k_nope, v = ops.split(kv, (self.nope, self.v_dim), -1)
        q = ops.cat((q_nope, q_rot), -1)
        k = ops.cat((k_nope, ops.broadcast_to(k_rot, (b, self.heads, length, self.rope))), -1)
        out = self.o_proj(_heads_first(attend(q, k, v, mask, self.scaling)).reshape(b, s, -1))
        if cache is None:
            return out
        return out, cache

    def _absorbed(self, q_nope, q_rot, latent, k_rot, mask):
        """Attention in the latent space (DeepSeek-V2's absorbed projections): kv_b_proj's key
        half folded into the queries, its value half applied after the softmax, so no
        per-head key or value of the cached positions is ever formed, and every head reads the
        one latent and rotary key as they are (the heads' queries stacked as the rows of one
        product, as grouped-query attention's are). latent [B, 1, L, r], k_rot [B, 1, L, rope]
        -> [B, heads, S, v_head_dim]."""
        w = self.kv_b_proj.weight.reshape(self.heads, self.nope + self.v_dim, self.latent)
        w_k, w_v = ops.split(w, (self.nope, self.v_dim), 1)  # [h, nope, r], [h, v, r]
        b, h, s = q_nope.shape[0], self.heads, q_nope.shape[2]
        length = latent.shape[2]
        q_latent = ops.matmul(q_nope, ops.broadcast_to(w_k, (b, h, self.nope, self.latent)))
        scores = (SCORES(q_latent.reshape(b, 1, h * s, self.latent), latent)
                  + SCORES(q_rot.reshape(b, 1, h * s, self.rope), k_rot))
        scores = scores.reshape(b, h, s, length) * self.scaling + mask
        probs = ops.softmax(scores.astype(ms.float32), -1).astype(latent.dtype)
        read = ops.matmul(probs.reshape(b, 1, h * s, length), latent)
        w_v = ops.broadcast_to(w_v.swapaxes(-1, -2), (b, h, self.latent, self.v_dim))
        return ops.matmul(read.reshape(b, h, s, self.latent), w_v)


class MLP(nn.Cell):
    """The dense SwiGLU feed-forward block: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = _dense(hidden_size, intermediate_size)
        self.up_proj = _dense(hidden_size, intermediate_size)
        self.down_proj = _dense(intermediate_size, hidden_size)

    def construct(self, x):
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Cell):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)), mlp a MoELayer or MLP."""

    def __init__(self, config, index):
        super().__init__()
        h = config.hidden_size
        attention = GQAttention if isinstance(config.attention, GQAConfig) else MLAttention
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = attention(config.attention, h)
        self.mla = attention is MLAttention
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        if index in config.moe_layers:
            self.mlp = MoELayer.from_config(config.moe)
        else:
            self.mlp = MLP(h, config.intermediate_size)

    def construct(self, x, cos, sin, mask, cache=None, slot=None, absorb=False):
        """With a cache (see the attention Cells): -> (x, the new cache)."""
        if cache is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        out, delta, cache = self.step(x, None, cos, sin, mask, cache, slot, absorb)
        return out + delta, cache

    def step(self, x, delta, cos, sin, mask, cache, slot, absorb=False):
        """The block with a cache, its input x + delta (delta None: x) and its output left as
        (residual, delta), so that each residual sum is taken by the next norm
        (RMSNorm.add_norm: one kernel for the sum and the norm): -> (residual, delta, cache)."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            h, x = self.input_layernorm.add_norm(x, delta)
        if self.mla:
            h, cache = self.self_attn(h, cos, sin, mask, cache, slot, absorb)
        else:
            h, cache = self.self_attn(h, cos, sin, mask, cache, slot)
        h, x = self.post_attention_layernorm.add_norm(x, h)
        return x, self.mlp(h), cache
