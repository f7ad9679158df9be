"""MoECausalLM: a whole decoder-only MoE language model (DeepSeek-V3/V2, Qwen3/Qwen2-MoE,
Mixtral) on MoELayer; its training loss (generation: models/generation.py)."""
import mindspore as ms
from mindspore import nn, ops

from .config import CausalLMConfig, GQAConfig
from .generation import generate
from .layers import (DecoderLayer, Embedding, Linear, RMSNorm, RotaryEmbedding, causal_mask,
                     linear, on_cpu)

__all__ = ["MoECausalLM", "DecoderModel", "CausalLMLoss", "generate"]


class DecoderModel(nn.Cell):
    """Token embedding, the decoder layers and the final norm: ids [B, S] -> hidden [B, S, H]."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.CellList([DecoderLayer(config, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope)
        attention = config.attention
        self.window = attention.sliding_window if isinstance(attention, GQAConfig) else None

    def construct(self, ids):
        s = ids.shape[1]
        cos, sin = self.rotary_emb(ops.arange(s))
        mask = causal_mask(s, self.window)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class MoECausalLM(nn.Cell):
    """A causal language model of a CausalLMConfig: input ids [B, S] (int32/int64) -> next-token
    logits [B, S, vocab] (float32).

    Parameter names are those of transformers' `...ForCausalLM` (`model.embed_tokens.weight`,
    `model.layers.{i}.self_attn.q_proj.weight`, ..., `lm_head.weight`); each MoE block at
    `model.layers.{i}.mlp.` is a MoELayer (`router.weight`, `router.expert_bias`,
    `experts.weight1`, ...). `ms_moe_ops.convert.load_pretrained(dir)` builds the model of a
    directory written by `ms_moe_ops.convert.convert_checkpoint` and loads its weights;
    `ms_moe_ops.convert.export_checkpoint` writes them back in transformers' layout.

    A call runs the whole sequence; `generate` decodes with a KV cache (`DecodeStep`)."""

    def __init__(self, config):
        super().__init__()
        if not isinstance(config, CausalLMConfig):
            raise TypeError(f"MoECausalLM: config must be a CausalLMConfig, got "
                            f"{type(config).__name__} (CausalLMConfig.from_transformers reads one "
                            f"from a transformers config.json)")
        self.config = config
        self.model = DecoderModel(config)
        self.tied = config.tie_word_embeddings
        self.skinny = on_cpu()
        if not self.tied:
            self.lm_head = Linear(config.hidden_size, config.vocab_size)

    def construct(self, ids):
        return self.head(self.model(ids))

    def head(self, h):
        """Final hidden states [..., H] -> logits [..., vocab]."""
        if self.tied:
            return linear(h, self.model.embed_tokens.weight, self.skinny)
        return self.lm_head(h)


class CausalLMLoss(nn.Cell):
    """Mean next-token cross-entropy of a MoECausalLM on ids [B, S]: position t predicts
    token t + 1 (transformers' ForCausalLMLoss without ignored labels)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, ids):
        logits = self.net(ids)[:, :-1]
        labels = ids[:, 1:]
        # log-softmax and a gather: as fast on CPU as MindSpore's fused sparse kernel (which
        # has no Ascend kernel; nn.SoftmaxCrossEntropyWithLogits is deprecated), about 7x faster
        # than ops.cross_entropy
        log_probs = ops.log_softmax(logits.reshape(-1, logits.shape[-1]).astype(ms.float32), -1)
        picked = ops.gather_elements(log_probs, 1, labels.reshape(-1, 1).astype(ms.int32))
        return -picked.mean()
