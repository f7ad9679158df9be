"""KV-cache generation (ms_moe_ops.models.generate, DecodeStep) against transformers' own
generate (greedy, with its cache) on tiny random models of every family, batched with left
padding and unbatched, PyNative and GRAPH; the cached and uncached logits at every step; one
compiled decode step in GRAPH mode; seeded sampling. Nothing is downloaded."""
import numpy as np
import pytest
import mindspore as ms

from ms_moe_ops.convert import convert_checkpoint, load_pretrained
from ms_moe_ops.models import DecodeStep, cache_bytes_per_token, generate
from ms_moe_ops.models.generation import _choose

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hf_models import FAMILIES, hf_model, save  # noqa: E402

PROMPT, NEW = 6, 8
# the default run: one GQA and one MLA family in PyNative, Qwen3-MoE in GRAPH (each GRAPH case
# compiles two graphs per path, several seconds each); the rest of the matrix is slow
FAST = {("qwen3_moe", "pynative"), ("deepseek_v3", "pynative"), ("qwen3_moe", "graph")}
CASES = [pytest.param(f, m, marks=[] if (f, m) in FAST else [pytest.mark.slow])
         for f in FAMILIES for m in ("pynative", "graph")]
_MODELS = {}


def converted(family, tmp_path_factory, **overrides):
    """(transformers model, MoECausalLM of its converted checkpoint), built once per module."""
    key = (family, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        model = hf_model(family, np.random.default_rng(7), **overrides)
        path = tmp_path_factory.mktemp(family)
        save(model, path / "hf")
        convert_checkpoint(path / "hf", path / "ms")
        _MODELS[key] = model, load_pretrained(str(path / "ms"))
    return _MODELS[key]


def left_padded(rng, vocab, lengths, width):
    """ids [B, width] with rows of the given lengths, left-padded with 0, and their mask."""
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros((len(lengths), width), np.int64)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = rng.integers(1, vocab, n)
        mask[row, width - n:] = 1
    return ids, mask


def set_mode(mode):
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)


def their_tokens(model, ids, mask, new=NEW):
    eos = model.config.eos_token_id
    with torch.no_grad():
        return model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                              max_new_tokens=new, do_sample=False, use_cache=True,
                              eos_token_id=eos, pad_token_id=eos).numpy()


@pytest.mark.parametrize("family, mode", CASES)
def test_greedy_tokens_match_transformers(family, mode, tmp_path_factory):
    """Batched prompts of lengths 6, 3 and 5 (left padding) and the first alone: the tokens of
    transformers' greedy generate with its KV cache."""
    model, net = converted(family, tmp_path_factory)
    rng = np.random.default_rng(1)
    ids, mask = left_padded(rng, model.config.vocab_size, (PROMPT, 3, 5), PROMPT)
    set_mode(mode)
    step = DecodeStep(net)
    ours = generate(net, ids, NEW, model.config.eos_token_id, attention_mask=mask, step=step)
    theirs = their_tokens(model, ids, mask)
    print(f"{family} {mode}: {ours[:, PROMPT:].tolist()}")
    np.testing.assert_array_equal(ours, theirs)
    assert len(set(ours[:, PROMPT:].reshape(-1).tolist())) > 3  # not one token over and over
    if mode == "graph":  # the prompt's graph and the decode step's
        assert len(step.compile_cache) == 2
    alone = generate(net, ids[:1], NEW, model.config.eos_token_id)
    np.testing.assert_array_equal(alone, their_tokens(model, ids[:1], mask[:1]))


def test_graph_step_reused_across_shapes(tmp_path_factory):
    """GRAPH mode: within a call, every decoding step after the first runs its graph without
    compiling (the Cell's "increment" phase); a step reused by a call of another batch or
    length must not run the previous call's graph. Three prompts, then the first alone, then
    it with more new tokens (a longer cache), all through one DecodeStep: transformers'
    tokens each time, and the step left in its own phase."""
    model, net = converted("qwen3_moe", tmp_path_factory)
    rng = np.random.default_rng(11)
    ids, mask = left_padded(rng, model.config.vocab_size, (PROMPT, 3, 5), PROMPT)
    eos = model.config.eos_token_id
    set_mode("graph")
    step = DecodeStep(net)
    phase = step.phase
    for rows, new in ((3, NEW), (1, NEW), (1, NEW + 3)):
        ours = generate(net, ids[:rows], new, eos, attention_mask=mask[:rows], step=step)
        np.testing.assert_array_equal(ours, their_tokens(model, ids[:rows], mask[:rows], new))
        assert step.phase == phase and "increment" not in step.phase_cache


class Recorder:
    """A DecodeStep that keeps the logits of every call."""

    def __init__(self, step):
        self.step, self.logits = step, []

    def __call__(self, *args):
        logits, caches = self.step(*args)
        self.logits.append(logits.asnumpy())
        return logits, caches


def step_logits(net, ids, mask, **options):
    use_cache = options.pop("use_cache", True)
    recorder = Recorder(DecodeStep(net, use_cache, **options))
    tokens = generate(net, ids, NEW, attention_mask=mask, use_cache=use_cache, step=recorder)
    return tokens, np.stack(recorder.logits)


@pytest.mark.parametrize("family, mode", [
    ("qwen3_moe", "pynative"),
    pytest.param("deepseek_v3", "pynative", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "graph", marks=pytest.mark.slow),
    pytest.param("mixtral", "pynative", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", "pynative", marks=pytest.mark.slow),
    pytest.param("deepseek_v2", "pynative", marks=pytest.mark.slow)])
def test_cached_logits_are_uncached_logits(family, mode, tmp_path_factory):
    """The logits of every step with the KV cache (MLA: the latent cache, and its absorbed
    form) and without it (the whole sequence rerun): equal within float32 rounding."""
    model, net = converted(family, tmp_path_factory)
    ids, mask = left_padded(np.random.default_rng(2), model.config.vocab_size, (PROMPT, 4),
                            PROMPT)
    set_mode(mode)
    tokens, full = step_logits(net, ids, mask, use_cache=False)
    variants = [{}] + ([{"absorb": True}] if family.startswith("deepseek") else [])
    for options in variants:
        cached_tokens, cached = step_logits(net, ids, mask, **options)
        np.testing.assert_array_equal(cached_tokens, tokens)
        error = np.abs(cached - full).max() / np.abs(full).max()
        print(f"{family} {mode} {options}: max relative logit difference {error:.1e}")
        assert error < 2e-6


def test_sliding_window_with_cache(tmp_path_factory):
    """Mixtral's sliding window of 4 over a cache longer than it: transformers' tokens."""
    model, net = converted("mixtral", tmp_path_factory, sliding_window=4)
    ids, mask = left_padded(np.random.default_rng(3), model.config.vocab_size, (PROMPT, 4),
                            PROMPT)
    set_mode("pynative")
    ours = generate(net, ids, NEW, model.config.eos_token_id, attention_mask=mask)
    np.testing.assert_array_equal(ours, their_tokens(model, ids, mask))


@pytest.mark.slow
def test_graph_mode_compiles_the_decode_step_once(tmp_path_factory):
    """GRAPH mode: one graph for the prompt and one for all the decode steps (the Cell's
    compile cache holds a graph per argument signature; a value taken for a constant would
    add one per token), reused by a second call; a new prompt length adds exactly one."""
    model, net = converted("qwen3_moe", tmp_path_factory)
    rng = np.random.default_rng(4)
    set_mode("graph")
    step = DecodeStep(net)
    generate(net, rng.integers(0, 64, (2, PROMPT)), NEW, step=step)
    assert len(step.compile_cache) == 2
    generate(net, rng.integers(0, 64, (2, PROMPT)), NEW, step=step)
    assert len(step.compile_cache) == 2
    generate(net, rng.integers(0, 64, (2, PROMPT - 1)), NEW + 1, step=step)
    assert len(step.compile_cache) == 3  # the observable does see a new signature


def test_sampling(tmp_path_factory):
    """The same seed gives the same tokens, another seed others; top_k=1 and a tiny top_p are
    greedy; the streamer receives each step's tokens."""
    model, net = converted("qwen3_moe", tmp_path_factory)
    ids = np.random.default_rng(5).integers(0, 64, (2, 4))
    set_mode("pynative")
    n = 4
    greedy = generate(net, ids, n)
    streamed = []
    a = generate(net, ids, n, do_sample=True, temperature=1.5, seed=3,
                 streamer=streamed.append)
    np.testing.assert_array_equal(a, generate(net, ids, n, do_sample=True, temperature=1.5,
                                              seed=3))
    assert not np.array_equal(a, generate(net, ids, n, do_sample=True, temperature=1.5,
                                          seed=4))
    assert not np.array_equal(a, greedy)
    np.testing.assert_array_equal(np.stack(streamed, 1), a[:, 4:])
    np.testing.assert_array_equal(generate(net, ids, n, do_sample=True, top_k=1, seed=3),
                                  greedy)
    np.testing.assert_array_equal(generate(net, ids, n, do_sample=True, top_p=1e-6, seed=3),
                                  greedy)


def test_choose_restricts_and_follows_the_distribution():
    """_choose: top_k and top_p keep only the best tokens; the frequencies of 20000 draws are
    softmax(logits / temperature)."""
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 20000))
    for kwargs, allowed in ((dict(top_k=2), {0, 1}), (dict(top_p=0.7), {0, 1}),
                            (dict(top_p=0.85), {0, 1, 2}), (dict(top_p=0.5), {0})):
        options = {"top_k": 0, "top_p": 1.0, **kwargs}
        drawn = _choose(logits[:2000], True, 1.0, options["top_k"], options["top_p"], rng)
        assert set(drawn.tolist()) == allowed, kwargs
    drawn = _choose(logits, True, 2.0, 0, 1.0, rng)
    expected = np.sqrt([0.5, 0.3, 0.15, 0.05])
    expected /= expected.sum()
    np.testing.assert_allclose(np.bincount(drawn, minlength=4) / len(drawn), expected, atol=0.015)


def test_eos_and_errors(tmp_path_factory):
    """A row that emitted eos is padded with it and decoding stops when all have; a mask of
    the wrong shape and a Cell that is not a model are errors."""
    model, net = converted("qwen3_moe", tmp_path_factory)
    ids = np.random.default_rng(6).integers(0, 64, (1, 4))
    set_mode("pynative")
    greedy = generate(net, ids, NEW)
    eos = int(greedy[0, 6])
    first = int(np.argmax(greedy[0, 4:] == eos)) + 4
    stopped = generate(net, ids, NEW, eos_token_id=[999, eos])
    np.testing.assert_array_equal(stopped, greedy[:, :first + 1])
    with pytest.raises(ValueError, match="attention_mask"):
        generate(net, ids, 2, attention_mask=np.ones((1, 3)))
    with pytest.raises(TypeError, match="MoECausalLM.*got Dense"):
        generate(ms.nn.Dense(2, 2), ids, 2)
    # a model in mindspore.amp's wrapper (auto_mixed_precision O2/O3) decodes as the model

    class Wrapped(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self._backbone = net

    np.testing.assert_array_equal(generate(Wrapped(), ids, 2), greedy[:, :6])


@pytest.mark.parametrize("family, per_token", [("deepseek_v3", (16 + 4) * 4 * 3),
                                               ("qwen3_moe", 2 * 2 * 8 * 4 * 3)])
def test_cache_bytes_per_token(family, per_token):
    from hf_models import hf_config
    from ms_moe_ops.models import CausalLMConfig
    assert cache_bytes_per_token(CausalLMConfig.from_transformers(hf_config(family))) == per_token


@pytest.mark.parametrize("mode", ["pynative", "graph"])
def test_a_decoding_step_runs_the_fused_operators(mode, tmp_path_factory):
    """A float32 decoding step's attention is decode_attention and its residual sums go with the
    norms (add_rms_norm), on the CPU their kernels: a model that silently fell back to the
    15-kernel composition would still give the right tokens, only slower."""
    from ms_moe_ops.ops import record_choices
    model, net = converted("qwen3_moe", tmp_path_factory)
    ids, mask = left_padded(np.random.default_rng(5), model.config.vocab_size, (PROMPT, 4), PROMPT)
    set_mode(mode)
    with record_choices() as ran:
        tokens = generate(net, ids, 3, attention_mask=mask, step=DecodeStep(net))
    np.testing.assert_array_equal(tokens, their_tokens(model, ids, mask, 3))
    assert {("decode_attention", "kernel"), ("add_rms_norm", "kernel")} <= set(ran), ran
