"""The model and data of train_moe.py: a character-level decoder-only transformer whose
feed-forward blocks are ms_moe_ops.MoELayer, and the Python documentation text as its corpus."""
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ms_moe_ops import MoELayer


class CharData:
    """pydoc_data.topics (the text of Python's `help()` topics, ~460k characters) as character
    ids; the first 90% trains, the last 10% validates."""

    def __init__(self, val_frac=0.1):
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key] for key in sorted(topics))
        text = "".join(c if c.isascii() else "?" for c in text)  # keep the vocabulary small
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = np.array([self.index[c] for c in text], np.int32)
        split = int(len(ids) * (1 - val_frac))
        self.train, self.val = ids[:split], ids[split:]

    def batch(self, split, batch_size, seq_len, rng):
        """(inputs [B, S], next-character targets [B, S]) from random offsets."""
        ids = self.train if split == "train" else self.val
        start = rng.integers(0, len(ids) - seq_len - 1, batch_size)
        rows = start[:, None] + np.arange(seq_len + 1)
        chunk = ids[rows]
        return chunk[:, :-1], chunk[:, 1:]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


class CausalSelfAttention(nn.Cell):
    def __init__(self, d_model, heads, seq_len):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Dense(d_model, 3 * d_model, has_bias=False,
                            weight_init=Normal(0.02))
        self.proj = nn.Dense(d_model, d_model, has_bias=False, weight_init=Normal(0.02))
        self.scale = float((d_model // heads) ** -0.5)
        mask = np.triu(np.full((seq_len, seq_len), -1e9, np.float32), 1)
        self.mask = Tensor(mask)

    def construct(self, x):
        b, s, d = x.shape
        # split first, then 4-D transposes: much cheaper on CPU than one 5-D transpose
        q, k, v = ops.split(self.qkv(x), d, axis=-1)
        q = q.reshape(b, s, self.heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(b, s, self.heads, -1).transpose(0, 2, 3, 1)
        v = v.reshape(b, s, self.heads, -1).transpose(0, 2, 1, 3)
        att = ops.matmul(q, k) * self.scale + self.mask[:s, :s]
        y = ops.matmul(ops.softmax(att, -1), v)
        return self.proj(y.transpose(0, 2, 1, 3).reshape(b, s, d))


class Block(nn.Cell):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MoE(norm(x))."""

    def __init__(self, heads, seq_len, moe, expert_parallel=None):
        super().__init__()
        d_model = moe.hidden_size
        self.norm1 = nn.LayerNorm((d_model,))
        self.attn = CausalSelfAttention(d_model, heads, seq_len)
        self.norm2 = nn.LayerNorm((d_model,))
        self.moe = MoELayer(moe, expert_parallel=expert_parallel)

    def construct(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoELanguageModel(nn.Cell):
    """ids [B, S] int32 -> next-character logits [B * S, vocab]. moe: the MoEConfig of every
    block's MoE layer (its hidden_size is the model width); expert_parallel: see MoELayer."""

    def __init__(self, vocab_size, seq_len, heads, layers, moe, expert_parallel=None):
        super().__init__()
        d_model = moe.hidden_size
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, d_model, embedding_table=Normal(0.02))
        self.pos = Parameter(initializer(Normal(0.02), (seq_len, d_model), ms.float32), name="pos")
        self.blocks = nn.CellList([Block(heads, seq_len, moe, expert_parallel)
                                   for _ in range(layers)])
        self.norm = nn.LayerNorm((d_model,))
        self.head = nn.Dense(d_model, vocab_size, weight_init=Normal(0.02))

    def construct(self, ids):
        s = ids.shape[1]
        x = self.embed(ids) + self.pos[:s]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).reshape(-1, self.vocab_size)

    def sample(self, data, prompt, length, rng, temperature=0.8):
        """Generates `length` characters after `prompt` (>= seq_len ids), one window at a time."""
        ids = list(prompt[-self.seq_len:])
        out = []
        for _ in range(length):
            window = Tensor(np.array(ids[-self.seq_len:], np.int32)[None])
            logits = self(window).asnumpy()[-1].astype(np.float64) / temperature
            p = np.exp(logits - logits.max())
            nxt = int(rng.choice(len(p), p=p / p.sum()))
            ids.append(nxt)
            out.append(nxt)
        return data.decode(out)


def causal_lm_config(vocab_size, seq_len, heads, layers, moe):
    """The transformers configuration (a dict, config.json's content) of a MoECausalLM with
    train_moe.py's sizes and routing: DeepSeek-V3 for the sigmoid router, DeepSeek-V2 for
    softmax (multi-head latent attention, no dense layer, one expert group)."""
    d = moe.hidden_size
    head = d // heads
    family = "deepseek_v3" if moe.score_func == "sigmoid" else "deepseek_v2"
    config = dict(
        model_type=family, vocab_size=vocab_size, hidden_size=d,
        intermediate_size=moe.ffn_hidden_size, moe_intermediate_size=moe.ffn_hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        n_shared_experts=moe.n_shared_experts, first_k_dense_replace=0, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=moe.norm_topk_prob, q_lora_rank=None,
        kv_lora_rank=d // 2, qk_nope_head_dim=head // 2, qk_rope_head_dim=head // 2,
        v_head_dim=head, max_position_embeddings=seq_len, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu")
    if family == "deepseek_v2":
        config["topk_method"] = "greedy"
    return config


class CharCausalLM(nn.Cell):
    """An ms_moe_ops.models.MoECausalLM (`lm`) with MoELanguageModel's interface: ids [B, S] ->
    logits [B * S, vocab], and `sample`. config: causal_lm_config's dict; moe_overrides: the
    MoEConfig options that are not the model's (training losses, bias_update_rate, capacity)."""

    def __init__(self, config, seq_len, **moe_overrides):
        super().__init__()
        from ms_moe_ops.models import CausalLMConfig, MoECausalLM

        self.config = config
        self.lm = MoECausalLM(CausalLMConfig.from_transformers(config, **moe_overrides))
        self.seq_len = seq_len
        self.vocab_size = config["vocab_size"]

    def construct(self, ids):
        return self.lm(ids).reshape(-1, self.vocab_size)

    sample = MoELanguageModel.sample

    def save_pretrained(self, out):
        """config.json (transformers' layout of its family) and model.safetensors in out, as
        `ms_moe_ops.convert.load_pretrained(out)` reads them (written through the package's
        export to transformers' layout, then its conversion)."""
        import os
        import shutil
        import tempfile
        from ms_moe_ops.convert import convert_checkpoint, export_checkpoint

        with tempfile.TemporaryDirectory(dir=out) as tmp:
            export_checkpoint(self.lm, os.path.join(tmp, "hf"), config=self.config)
            convert_checkpoint(os.path.join(tmp, "hf"), os.path.join(tmp, "ms"))
            for name in os.listdir(os.path.join(tmp, "ms")):
                shutil.move(os.path.join(tmp, "ms", name), os.path.join(out, name))
