"""Router training losses and the gradient scaler that applies them.

The losses never appear in a layer's output. As in Megatron's MoEAuxLossAutoScaler, an identity
`AuxLossScaler(coeffs)(x, losses)` sits on a tensor of the forward pass; its backward hands the
losses the constant gradient `coeffs`, so autodiff adds `sum_i coeffs[i] * dL_i/d(inputs)` to the
gradients of the main loss. A model trains on them by setting a coefficient, with no change to its
own code. A loss scale (TrainOneStepCell's `sens`, a dynamic loss scale) multiplies the main loss's
gradient, not these constants: `set_loss_scale(network, scale)` gives them the same scale (as
Megatron's `MoEAuxLossAutoScaler.set_loss_scale`); ExpertParallelTrainStep does it for its sens.

Notation: T tokens, E experts, K experts per token; logits [T, E] float32; counts_e = number of
(token, slot) pairs routed to expert e (the real top-k choice, bias and groups included).
"""
import mindspore as ms
from mindspore import Parameter, Tensor, ops

from ..ops._indexing import count
from ._precision import SelfCastingCell

__all__ = ["AuxLossScaler", "set_loss_scale", "balance_probs", "switch_aux_loss", "sequence_aux_loss",
           "router_z_loss"]


class AuxLossScaler(SelfCastingCell):
    """construct(x, losses [n]) -> x. Backward: x gets its own gradient unchanged, `losses` gets
    `coeffs * loss_scale` [n] (float32), so the losses' gradients reach everything they were
    computed from. `loss_scale` (a state Parameter, 1 by default) is set by set_loss_scale. Mixed
    precision leaves x as it is (the router's float32 weights)."""

    def __init__(self, coeffs):
        super().__init__()
        self.inject = _Inject(coeffs)
        self.loss_scale = Parameter(Tensor(1.0, ms.float32), name="loss_scale", requires_grad=False)

    def construct(self, x, losses):
        # a bprop cannot read a Parameter in GRAPH mode: the scale is an input of _Inject
        return self.inject(x, losses, self.loss_scale)


class _Inject(SelfCastingCell):
    """construct(x, losses, scale) -> x; backward: x's gradient, coeffs * scale, none for scale."""

    def __init__(self, coeffs):
        super().__init__()
        self.coeffs = Tensor(list(coeffs), ms.float32)

    def construct(self, x, losses, scale):
        return x

    def bprop(self, x, losses, scale, out, dout):
        return dout, (self.coeffs * scale.astype(ms.float32)).astype(losses.dtype), ops.zeros_like(scale)


def set_loss_scale(network, scale):
    """Gives the training losses of every router in `network` the loss scale of its training
    step (a number, or a scalar Tensor/Parameter read now), so that unscaling the gradients
    leaves them their coefficients. A fixed scale (TrainOneStepCell's sens) is set once; a
    dynamic one (TrainOneStepWithLossScaleCell's `scale_sense`) after every step, as the step
    may have changed it. Returns how many routers it reached (0: no training loss)."""
    value = float(scale.asnumpy().reshape(-1)[0]) if isinstance(scale, Tensor) else float(scale)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"set_loss_scale: the loss scale must be a positive finite number, got "
                         f"{value}")
    scalers = [cell for _, cell in network.cells_and_names() if isinstance(cell, AuxLossScaler)]
    for scaler in scalers:
        scaler.loss_scale.set_data(Tensor(value, ms.float32))
    return len(scalers)


def balance_probs(scores, score_func):
    """p [T, E], the routing probabilities the balance losses average: softmax scores as they
    are, sigmoid scores normalised to sum to 1 per token."""
    if score_func == "softmax":
        return scores
    return scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)


# The losses hold for any number of tokens T, also T = 0 and T known only at run time (GRAPH mode
# with set_inputs): T enters as a tensor (no branch on it, no Python arithmetic on a run-time
# value), and every sum over the tokens goes through _sum_tokens.


def _sum_tokens(x, axis=0):
    """x summed over its token axis, never an empty sum: MindSpore's CPU kernels skip a reduction
    whose input is empty and leave its output as the memory pool had it (NaN after some earlier
    graphs), so a zero slice is appended first; it adds nothing to the sum."""
    pad = list(x.shape)
    pad[axis] = 1
    return ops.concat((x, ops.zeros(tuple(pad), dtype=x.dtype)), axis).sum(axis=axis)


def _tokens(probs):
    """T as a float32 tensor, at least 1 (the losses are 0 for T = 0)."""
    return ops.maximum(ops.scalar_to_tensor(probs.shape[0], ms.float32), 1.0)


def switch_aux_loss(probs, counts):
    """Switch Transformer / GShard load-balancing loss, as transformers' load_balancing_loss_func:
    `L = E * sum_e (counts_e / T) * mean_t p_te`, which is K for perfectly uniform routing.
    Megatron's switch loss is this divided by K (1 when uniform): with Megatron's coefficients,
    divide them by K. probs [T, E], counts [E] float32; 0 for T = 0."""
    t = _tokens(probs)
    return (counts * _sum_tokens(probs)).sum() * probs.shape[1] / (t * t)


def sequence_aux_loss(probs, expert_idx, num_sequences):
    """DeepSeek-V3's complementary sequence-wise balance loss, averaged over the sequences:
    per sequence of S tokens, `sum_e f_e * P_e` with `f_e = E / (K S) * counts_e` (the
    sequence's own counts) and `P_e = mean_t p_te` (1 for uniform routing). probs [T, E],
    expert_idx [T, K] int32; T = num_sequences * S, consecutive tokens forming a sequence; 0 for
    T = 0."""
    num_experts, k = probs.shape[1], expert_idx.shape[1]
    # each sequence's (token, slot) pairs in one row, counted per expert (as flat indices s * E + e)
    slots = expert_idx.reshape(num_sequences, -1)
    flat = slots + ops.arange(num_sequences, dtype=slots.dtype).reshape(-1, 1) * num_experts
    counts = count(flat, num_sequences * num_experts).astype(ms.float32).reshape(num_sequences,
                                                                                num_experts)
    p_sum = _sum_tokens(probs.reshape(num_sequences, -1, num_experts), axis=1)
    s = _tokens(probs) / num_sequences
    return (ops.stop_gradient(counts) * p_sum).sum() * num_experts / (k * s * s * num_sequences)


def router_z_loss(logits):
    """ST-MoE router z-loss: `mean_t logsumexp(logits_t)^2`; 0 for T = 0."""
    lse = ops.logsumexp(logits, -1)
    return _sum_tokens(lse * lse) / _tokens(logits)
