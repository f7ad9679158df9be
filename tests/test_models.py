"""ms_moe_ops.models against transformers' own models: tiny random DeepSeek-V3, Qwen3-MoE (and
DeepSeek-V2, Qwen2-MoE, Mixtral) saved with save_pretrained, converted with
ms_moe_ops.convert, loaded into MoECausalLM: the same logits (float32, GRAPH and PyNative) and
the same greedy tokens as transformers' generate. Nothing is downloaded."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from ms_moe_ops.convert import convert_checkpoint, load_pretrained
from ms_moe_ops.models import CausalLMConfig, CausalLMLoss, MoECausalLM, generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hf_models import FAMILIES, hf_config, hf_model, save  # noqa: E402

# logits: max |ours - transformers| / max |transformers| (about 1.5e-6 on these models)
LOGIT_RTOL = 1e-5
REQUIRED = ("deepseek_v3", "qwen3_moe")
# the other families' GRAPH-mode runs are left to the slow run (2-4 s of compilation each)
CASES = [pytest.param(family, mode, marks=[] if family in REQUIRED or mode == "pynative"
                      else [pytest.mark.slow])
         for family in FAMILIES for mode in ("pynative", "graph")]


def converted(family, tmp_path, rng, layout="per-expert", **overrides):
    """(transformers model, MoECausalLM loaded from its converted checkpoint)."""
    model = hf_model(family, rng, **overrides)
    save(model, tmp_path / "hf", layout, shards=3)
    convert_checkpoint(tmp_path / "hf", tmp_path / "ms")
    return model, load_pretrained(str(tmp_path / "ms"))


def logits_error(model, net, ids, mode):
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    ours = net(Tensor(ids.astype(np.int32))).asnumpy()
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids)).logits.numpy()
    assert ours.shape == theirs.shape and ours.dtype == np.float32
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("family, mode", CASES)
def test_logits_match_transformers(family, mode, tmp_path, rng):
    """The logits of a batch; in GRAPH mode also greedy generation (DeepSeek-V3, Qwen3-MoE),
    whose window has the batch's shape, so that one compiled graph serves both."""
    model, net = converted(family, tmp_path, rng)
    ids = rng.integers(0, model.config.vocab_size, (2, PROMPT + NEW))
    error = logits_error(model, net, ids, mode)
    print(f"{family} {mode}: max relative logit error {error:.2e}")
    assert error < LOGIT_RTOL
    if mode == "graph" and family in REQUIRED:
        check_greedy_tokens(model, net, ids[:, :PROMPT], mode)


@pytest.mark.slow  # PyNative: about a second a token
@pytest.mark.parametrize("family", REQUIRED)
def test_greedy_generation_in_pynative_mode(family, tmp_path, rng):
    model, net = converted(family, tmp_path, rng)
    check_greedy_tokens(model, net, rng.integers(0, model.config.vocab_size, (2, PROMPT)),
                        "pynative")


PROMPT, NEW = 5, 12


def check_greedy_tokens(model, net, ids, mode):
    """generate() gives the tokens of transformers' greedy generate (with its KV cache)."""
    eos = model.config.eos_token_id
    with torch.no_grad():
        theirs = model.generate(torch.from_numpy(ids), max_new_tokens=NEW, do_sample=False,
                                attention_mask=torch.ones(ids.shape, dtype=torch.long),
                                eos_token_id=eos, pad_token_id=eos).numpy()
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    ours = generate(net, ids, NEW, eos_token_id=eos)
    print(f"greedy tokens ({mode}): {ours[:, PROMPT:].tolist()}")
    np.testing.assert_array_equal(ours, theirs)
    assert len(set(ours[:, PROMPT:].reshape(-1).tolist())) > 2  # not one token over and over


@pytest.mark.parametrize("family, options", [
    ("deepseek_v3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                          "factor": 4.0, "original_max_position_embeddings": 32,
                                          "mscale": 1.0, "mscale_all_dim": 0.8,
                                          "beta_fast": 32, "beta_slow": 1})),
    ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False)),
    ("qwen3_moe", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    ("qwen3_moe", dict(attention_bias=True, decoder_sparse_step=2, mlp_only_layers=[])),
    ("mixtral", dict(sliding_window=4)),
])
def test_variants_match_transformers(family, options, tmp_path, rng):
    """YaRN rotary embedding with DeepSeek's softmax mscale, queries without LoRA, halves-paired
    rotary dims, tied embeddings, one key/value head, attention biases, MoE every other layer,
    a sliding window."""
    model, net = converted(family, tmp_path, rng, **options)
    ids = rng.integers(0, model.config.vocab_size, (2, 11))
    error = logits_error(model, net, ids, "pynative")
    print(f"{family} {sorted(options)}: max relative logit error {error:.2e}")
    assert error < LOGIT_RTOL


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_table_is_the_models(family):
    """CausalLMConfig.parameter_shapes (what the converter plans with) lists exactly the Cells'
    parameters, routing statistics aside, and transformers' non-MoE parameters."""
    hf = hf_config(family)
    config = CausalLMConfig.from_transformers(hf)
    net = MoECausalLM(config)
    ours = {name: tuple(p.shape) for name, p in net.parameters_and_names()
            if not name.endswith(("router.tokens_per_expert", "router.aux_losses"))}
    assert ours == config.parameter_shapes()
    theirs = {k: tuple(v.shape) for k, v in
              transformers.AutoModelForCausalLM.from_config(hf).state_dict().items()
              if ".mlp.experts." not in k and ".mlp.gate." not in k and ".shared_expert" not in k}
    assert {k: v for k, v in ours.items() if not any(
        f"layers.{i}.mlp." in k for i in config.moe_layers)} == theirs


def test_loss_is_transformers_loss(tmp_path, rng):
    """CausalLMLoss is transformers' loss with labels = ids."""
    model, net = converted("qwen3_moe", tmp_path, rng)
    ids = rng.integers(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        theirs = float(model(torch.from_numpy(ids), labels=torch.from_numpy(ids)).loss)
    ours = float(CausalLMLoss(net)(Tensor(ids.astype(np.int32))).asnumpy())
    assert abs(ours - theirs) < 1e-5 * abs(theirs), (ours, theirs)


@pytest.mark.slow
def test_training_step_matches_transformers(tmp_path, rng):
    """One GRAPH-mode SGD step of CausalLMLoss on a converted DeepSeek-V3 (bias update off) and
    one torch SGD step of transformers' model on the same tokens: the same loss before, the
    same weights after (gradients through attention, the dense and MoE blocks, the router)."""
    model, net = converted("deepseek_v3", tmp_path, rng)
    ids = rng.integers(0, model.config.vocab_size, (2, 12))
    lr = 0.1
    ms.set_context(mode=ms.GRAPH_MODE)
    step = ms.nn.TrainOneStepCell(CausalLMLoss(net), ms.nn.SGD(net.trainable_params(),
                                                               learning_rate=lr))
    ours = float(step(Tensor(ids.astype(np.int32))).asnumpy())
    model.train()
    loss = model(torch.from_numpy(ids), labels=torch.from_numpy(ids)).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    assert abs(ours - loss.item()) < 1e-5 * loss.item()
    theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = dict(net.parameters_and_names())
    for name in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.layers.2.self_attn.kv_b_proj.weight", "model.embed_tokens.weight"):
        np.testing.assert_allclose(params[name].asnumpy(), theirs[name], rtol=1e-4, atol=1e-6)
    router = params["model.layers.1.mlp.router.weight"].asnumpy()
    np.testing.assert_allclose(router, theirs["model.layers.1.mlp.gate.weight"], rtol=1e-4,
                               atol=1e-6)
    up = params["model.layers.2.mlp.experts.weight1"].asnumpy()[:, :, 16:]  # [E, H, I]
    their_up = theirs["model.layers.2.mlp.experts.gate_up_proj"][:, 16:]  # [E, I, H]
    np.testing.assert_allclose(up, their_up.transpose(0, 2, 1), rtol=1e-4, atol=1e-6)


def test_config_json_of_older_transformers():
    """config.json as the Hub's DeepSeek-V3 has it (rope_theta and rope_scaling with "type",
    num_experts instead of num_local_experts for Qwen3-MoE) reads as transformers 5's form."""
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
            "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
    new = hf_config("deepseek_v3", rope_parameters={"rope_type": "yarn", "rope_theta": 5e4,
                                                    **yarn}).to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=5e4, rope_scaling={"type": "yarn", **yarn})
    config = CausalLMConfig.from_transformers(old)
    assert config == CausalLMConfig.from_transformers(new)
    assert config.rope.kind == "yarn" and config.rope.theta == 5e4
    assert config.attention.scaling != (8 ** -0.5)  # YaRN's mscale_all_dim
    qwen = hf_config("qwen3_moe").to_dict()
    qwen["num_experts"] = qwen.pop("num_local_experts")
    assert CausalLMConfig.from_transformers(qwen).moe.num_experts == 8


# config.json of two released models, as on the Hugging Face Hub (DeepSeek-V3's without its FP8
# quantization_config, which a float copy of the weights does not have)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


@pytest.mark.parametrize("config, billions", [(QWEN3_30B_A3B, 30.53), (DEEPSEEK_V3, 671.03)])
def test_released_configurations_have_their_published_size(config, billions):
    """The parameter table of Qwen3-30B-A3B and DeepSeek-V3 from their config.json files adds up
    to their published sizes (30.5B; 671B without the multi-token-prediction layer), computed
    from shapes only."""
    table = CausalLMConfig.from_transformers(config).parameter_shapes()
    total = sum(int(np.prod(s)) for name, s in table.items() if not name.endswith("expert_bias"))
    assert round(total / 1e9, 2) == billions


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="model_type must be one of"):
        CausalLMConfig.from_transformers({"model_type": "llama"})
    with pytest.raises(ValueError, match="without"):
        CausalLMConfig.from_transformers({"model_type": "qwen3_moe", "hidden_size": 8})
    with pytest.raises(ValueError, match="rotary embedding 'llama3'"):
        CausalLMConfig.from_transformers(hf_config("qwen3_moe", rope_parameters={
            "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="quantized"):
        CausalLMConfig.from_transformers({**hf_config("deepseek_v3").to_dict(),
                                          "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(FileNotFoundError, match="config.json"):
        CausalLMConfig.from_transformers(tmp_path)
    with pytest.raises(TypeError, match="CausalLMConfig"):
        MoECausalLM(hf_config("qwen3_moe"))
