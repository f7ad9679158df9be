"""MoEConfig: every option of a MoELayer in one object."""
import dataclasses
from dataclasses import dataclass
from typing import Optional

__all__ = ["MoEConfig"]


@dataclass(frozen=True)
class MoEConfig:
    """The options of a MoELayer (their meaning: see MoELayer). `MoELayer.from_config(config)`
    builds a layer, `layer.config` gives it back, `config.replace(top_k=4)` makes a variant and
    `moe_config_from_transformers` reads one from a transformers model configuration.

    The defaults are DeepSeek-V3's routing (sigmoid scores, renormalised top-k) with SwiGLU experts
    and no training loss."""
    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int
    # router: score function, group-limited choice, weights
    n_group: int = 1
    topk_group: int = 1
    group_select_mode: int = 1
    routed_scaling_factor: float = 1.0
    score_func: str = "sigmoid"
    # shared experts
    n_shared_experts: int = 0
    shared_ffn_hidden_size: Optional[int] = None
    # routed experts
    activation: str = "swiglu"
    clamp_limit: float = 0.0
    # load balance: auxiliary-loss-free bias step
    bias_update_rate: float = 1e-3
    # router (continued) and shared-expert gate
    norm_topk_prob: bool = True
    shared_expert_gate: bool = False
    # training losses (0: off)
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0

    def replace(self, **changes):
        """A copy with some options changed."""
        return dataclasses.replace(self, **changes)
