"""Generation with a KV cache: `generate` (greedy or sampled decoding of a batch of prompts,
left-padded, with an attention mask) on `DecodeStep`, the model's forward over a chunk of
tokens that reads and writes static-shape cache buffers, so that in GRAPH mode the prompt is
compiled once and every later token reuses one compiled decode step."""
import contextlib

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from .._compat import amp_inner_cell
from ..ops._indexing import take_along
from .config import GQAConfig, MLAConfig

__all__ = ["generate", "DecodeStep", "new_cache", "cache_bytes_per_token"]

_MIN = float(np.finfo(np.float32).min)
# the mask's values (0 where a key may be attended, the lowest float32 elsewhere), broadcast
_ZERO, _LOWEST = Tensor(0.0, ms.float32), Tensor(_MIN, ms.float32)
# The phase a Cell runs its compiled graph under without compiling again (nn.Cell._predict: a
# Cell whose phase is "increment" and has a graph for it skips compile(), the arguments' key
# and the walk over every sub-Cell, about half a millisecond of each decoding step)
_DECODE_PHASE = "increment"


def new_cache(config, batch, length, dtype=ms.float32):
    """Zeroed cache buffers of a CausalLMConfig's model for `batch` sequences of up to `length`
    positions: a tuple with, per layer, GQA's (keys, values) [B, kv_heads, L, head_dim], or
    MLA's (normalised latent [B, 1, L, kv_lora_rank], rotary key [B, 1, L, qk_rope_head_dim])."""
    a = config.attention
    if isinstance(a, MLAConfig):
        shapes = ((batch, 1, length, a.kv_lora_rank), (batch, 1, length, a.qk_rope_head_dim))
    else:
        shapes = ((batch, a.num_kv_heads, length, a.head_dim),) * 2
    return tuple(tuple(ops.zeros(s, dtype=dtype) for s in shapes) for _ in range(config.num_layers))


def cache_bytes_per_token(config, dtype_bytes=4):
    """Bytes of cache one position takes over all layers: MLA (kv_lora_rank + qk_rope_head_dim)
    x bytes per layer, GQA 2 x kv_heads x head_dim x bytes."""
    a = config.attention
    if isinstance(a, MLAConfig):
        per_layer = a.kv_lora_rank + a.qk_rope_head_dim
    else:
        per_layer = 2 * a.num_kv_heads * a.head_dim
    return per_layer * dtype_bytes * config.num_layers


class DecodeStep(nn.Cell):
    """A MoECausalLM's forward over a chunk of S tokens written at cache slots slot .. slot+S-1:
    (ids [B, S] int32, positions [B, S] int32 (rotary positions), key_valid [B, L] bool (the
    slots holding real tokens, the chunk's included), slot and pick int32 scalars, caches from
    `new_cache`) -> (logits [B, vocab] at chunk index `pick`, the new caches).

    Every input is a Tensor of a fixed shape (caches passed as `ms.mutable(caches)`, else GRAPH
    mode takes their values for constants and compiles again), so in GRAPH mode one graph
    serves every decode step (S = 1) and one every prompt of a given shape. With
    use_cache=False, caches is () and the chunk attends only to itself (L = S: the whole
    sequence each call). absorb: MLA's attention in the latent space (kv_b_proj folded into
    queries and outputs). The step puts the net in inference mode (set_train(False))."""

    def __init__(self, net, use_cache=True, absorb=False):
        super().__init__()
        # inference mode (quantised experts run only there); the routers still count the
        # tokens each expert gets (expert_load)
        self.set_train(False)
        self.net = net = causal_lm_of(net)
        self.use_cache = use_cache
        self.absorb = absorb
        attention = net.config.attention
        self.window = attention.sliding_window if isinstance(attention, GQAConfig) else None

    def construct(self, ids, positions, key_valid, slot, pick, caches):
        model = self.net.model
        b, s = ids.shape
        length = key_valid.shape[1]
        # (the rotary embedding flattens the positions after its cast: a reshape of an input
        # of the graph is a kernel of its own)
        cos, sin = model.rotary_emb(positions)
        cos, sin = cos.reshape(b, 1, s, -1), sin.reshape(b, 1, s, -1)
        if s == 1 and self.window is None:  # a decoding step: the slots up to its own
            # (int32 like the slot: no cast)
            allowed = ops.logical_and(ops.arange(length, dtype=ms.int32) <= slot, key_valid)
        else:
            key = ops.arange(length)
            query = (slot + ops.arange(s)).reshape(-1, 1)
            allowed = key.reshape(1, -1) <= query
            if self.window is not None:
                allowed = ops.logical_and(allowed, query - key.reshape(1, -1) < self.window)
            allowed = ops.logical_and(allowed.reshape(1, 1, s, length),
                                      key_valid.reshape(b, 1, 1, length))
        mask = ops.where(allowed.reshape(b, 1, s, length), _ZERO, _LOWEST)
        x = model.embed_tokens(ids)
        new = ()
        if self.use_cache:
            # each block's output sum is taken by the next norm (one kernel for both)
            delta = None
            i = 0
            for layer in model.layers:
                x, delta, cache = layer.step(x, delta, cos, sin, mask, caches[i], slot,
                                             self.absorb)
                new = new + (cache,)
                i += 1
            if delta is None:  # (no layers)
                normed = model.norm(x)
            elif s == 1:
                normed, _ = model.norm.add_norm(x, delta)
            else:
                normed = model.norm(_pick(x + delta, pick, s))
        else:
            for layer in model.layers:
                x = layer(x, cos, sin, mask)
            normed = model.norm(_pick(x, pick, s))
        logits = self.net.head(normed)
        return logits.reshape(b, -1), new


def causal_lm_of(net):
    """net itself, or the model inside MindSpore's mixed-precision wrapper (auto_mixed_precision
    O2/O3 returns the converted model wrapped to cast its output to float32; decoding reads the
    logits as they are); TypeError for anything else."""
    inner = amp_inner_cell(net)
    if not hasattr(net, "model") and inner is not None:
        net = inner
    if not (hasattr(net, "model") and hasattr(net, "head") and hasattr(net, "config")):
        raise TypeError(f"generation takes a MoECausalLM (ms_moe_ops.models), got "
                        f"{type(net).__name__}")
    return net


def _pick(x, pick, s):
    """x [B, S, H] at chunk index pick ([B, 1, H]); one position: x itself."""
    return take_along(x, pick.reshape(1), 1) if s > 1 else x


def _scalar(value):
    return Tensor(np.int32(value))


def positions_of(attention_mask):
    """Rotary positions of left-padded sequences, as transformers computes them: the running
    count of real tokens minus one (1 on padding)."""
    positions = np.cumsum(attention_mask, -1) - 1
    return np.where(attention_mask == 0, 1, positions).astype(np.int32)


def _choose(logits, do_sample, temperature, top_k, top_p, rng):
    """The next token of each row of logits [B, vocab] (float32 numpy)."""
    if not do_sample:
        return logits.argmax(-1)
    logits = logits.astype(np.float64) / temperature
    order = np.argsort(-logits, -1, kind="stable")
    ranked = np.take_along_axis(logits, order, -1)
    keep = np.ones(ranked.shape, bool)
    if top_k > 0:
        keep[:, top_k:] = False
    probs = np.exp(ranked - ranked[:, :1]) * keep
    probs /= probs.sum(-1, keepdims=True)
    if top_p < 1.0:  # the fewest best tokens whose probability reaches top_p (at least one)
        before = np.cumsum(probs, -1) - probs
        keep &= before < top_p
        keep[:, 0] = True
        probs = probs * keep
        probs /= probs.sum(-1, keepdims=True)
    draw = rng.random((len(probs), 1))
    index = np.minimum((np.cumsum(probs, -1) < draw).sum(-1), probs.shape[1] - 1)
    index = np.where(keep[np.arange(len(probs)), index], index, 0)
    return order[np.arange(len(order)), index]


def generate(net, ids, max_new_tokens, eos_token_id=None, *, attention_mask=None,
             do_sample=False, temperature=1.0, top_k=0, top_p=1.0, seed=None, streamer=None,
             use_cache=True, step=None):
    """Decoding: ids [B, S0] (numpy or Tensor; rows shorter than S0 left-padded, with
    attention_mask [B, S0] 1 on real tokens) -> numpy int64 [B, S0 + n], n <= max_new_tokens.

    Greedy by default (each token the argmax, transformers' `do_sample=False`); do_sample draws
    from softmax(logits / temperature) restricted to the top_k best tokens (0: all) and to the
    fewest best whose probability reaches top_p, with numpy's Generator of `seed`. eos_token_id
    (an int or a list): a sequence that emitted it is padded with it, and decoding stops when
    all have. streamer(tokens): called with each step's new tokens (numpy int64 [B]).

    use_cache: the prompt runs once, then each token is one DecodeStep over a KV cache of
    S0 + max_new_tokens positions (in GRAPH mode: one compiled graph for the prompt, one for
    every later token). Without it, every token reruns the whole sequence in a buffer of that
    size (one graph too, cost growing with the square of the length). step: a DecodeStep of net
    to reuse (its compiled graphs) across calls."""
    net = causal_lm_of(net)
    ids = ids.asnumpy() if isinstance(ids, Tensor) else np.asarray(ids)
    batch, start = ids.shape
    total = start + max_new_tokens
    mask = np.ones((batch, start), np.int64) if attention_mask is None else (
        attention_mask.asnumpy() if isinstance(attention_mask, Tensor)
        else np.asarray(attention_mask))
    if mask.shape != ids.shape:
        raise ValueError(f"generate: attention_mask is {list(mask.shape)}, ids {list(ids.shape)}")
    if do_sample and temperature <= 0:
        raise ValueError(f"generate: temperature must be > 0 when sampling, got {temperature}")
    eos = [] if eos_token_id is None else np.atleast_1d(eos_token_id).tolist()
    rng = np.random.default_rng(seed)
    if step is None:
        step = DecodeStep(net, use_cache)
    buffer = np.zeros((batch, total), np.int32)
    buffer[:, :start] = ids
    # the new slots are valid from the start: a query never sees a later slot (causal mask),
    # so one Tensor serves every step
    key_valid = np.ones((batch, total), bool)
    key_valid[:, :start] = mask != 0
    key_valid = Tensor(key_valid)
    positions = np.empty((batch, total), np.int32)
    positions[:, :start] = positions_of(mask)
    positions[:, start:] = positions[:, start - 1:start] + np.arange(1, max_new_tokens + 1)

    if use_cache:
        caches = new_cache(net.config, batch, total, net.model.embed_tokens.weight.dtype)
        logits, caches = step(Tensor(buffer[:, :start]), Tensor(positions[:, :start]), key_valid,
                              _scalar(0), _scalar(start - 1), ms.mutable(caches))
    with _steps_of_one_shape(step):
        return _decode(step, buffer, key_valid, positions, start, caches if use_cache else None,
                       logits if use_cache else None, eos, do_sample, temperature, top_k,
                       top_p, rng, streamer)


@contextlib.contextmanager
def _steps_of_one_shape(step):
    """Within it, the calls of a DecodeStep Cell all have one argument signature: the first
    compiles (or finds) their graph and the others run it directly. Forgotten before and
    after, as another call's shapes may differ."""
    if not isinstance(step, nn.Cell):
        yield
        return
    phase = step.phase
    step.phase_cache.pop(_DECODE_PHASE, None)
    step.phase = _DECODE_PHASE
    try:
        yield
    finally:
        step.phase = phase
        step.phase_cache.pop(_DECODE_PHASE, None)


def _decode(step, buffer, key_valid, positions, start, caches, logits, eos, do_sample,
            temperature, top_k, top_p, rng, streamer):
    """generate's loop over the new positions start .. total - 1 (caches None: no cache)."""
    use_cache = caches is not None
    batch, total = buffer.shape
    done = np.zeros(batch, bool)
    first = _scalar(0)
    if not use_cache:
        positions = Tensor(positions)

    for pos in range(start, total):
        if not use_cache:
            logits, _ = step(Tensor(buffer), positions, key_valid, first, _scalar(pos - 1), ())
        token = _choose(logits.asnumpy(), do_sample, temperature, top_k, top_p, rng)
        if eos:
            token = np.where(done, eos[0], token)
            done |= np.isin(token, eos)
        buffer[:, pos] = token
        if streamer is not None:
            streamer(token.astype(np.int64))
        if done.all():
            return buffer[:, :pos + 1].astype(np.int64)
        if use_cache and pos + 1 < total:
            logits, caches = step(Tensor(buffer[:, pos:pos + 1]), Tensor(positions[:, pos:pos + 1]),
                                  key_valid, _scalar(pos), first, ms.mutable(caches))
    return buffer.astype(np.int64)
