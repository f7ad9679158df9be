"""Between a single-process checkpoint and the per-rank shards of an expert-parallel one."""
import numpy as np
from mindspore import Parameter, Tensor

__all__ = ["is_expert_parameter", "shard_experts", "gather_experts"]

_EXPERT_PARAMS = ("weight1", "weight2", "bias1", "bias2")
# per-rank records rather than replicated weights: the router's losses of this rank's tokens
_PER_RANK = ("aux_losses",)


def is_expert_parameter(name):
    """True for the routed experts' parameters of a MoELayer (`<prefix>experts.weight1` and the
    like, also optimizer states named after them, such as Adam's `moment1.<prefix>experts.weight1`):
    the ones split over the ranks along their first (expert) axis. `shared_experts.*` are not."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in _EXPERT_PARAMS


def shard_experts(checkpoint, rank, size):
    """The checkpoint of rank `rank` of `size` from a single-process one.

    checkpoint: {name: numpy array, Tensor or Parameter} (e.g. from `mindspore.load_checkpoint`).
    Returns a new dict: the routed experts' entries sliced to experts [rank*E/n, (rank+1)*E/n),
    everything else as it is (replicated). Numpy stays numpy; Tensors and Parameters become
    Parameters of the same name, ready for `mindspore.load_param_into_net`.
    """
    if not 0 <= rank < size:
        raise ValueError(f"shard_experts: need 0 <= rank < size, got rank={rank}, size={size}")
    out = {}
    for name, value in checkpoint.items():
        if not is_expert_parameter(name):
            out[name] = value
            continue
        array = _numpy(value)
        if array.shape[0] % size:
            raise ValueError(f"shard_experts: '{name}' has {array.shape[0]} experts, not a "
                             f"multiple of size={size}")
        local = array.shape[0] // size
        out[name] = _like(value, array[rank * local:(rank + 1) * local], name)
    return out


def gather_experts(shards, check=True):
    """A single-process checkpoint from the per-rank ones (a list in rank order).

    The routed experts' entries are concatenated along the expert axis; every other entry is
    taken from rank 0. check=True: a replicated entry that differs between ranks (ranks out of
    sync) or an entry missing on a rank raises ValueError. The routers' `aux_losses` (this
    rank's last losses, different on every rank) are taken from rank 0 unchecked.
    """
    if not shards:
        raise ValueError("gather_experts: need the checkpoint of at least one rank, got none")
    first = shards[0]
    out = {}
    for name, value in first.items():
        missing = [r for r, shard in enumerate(shards) if name not in shard]
        if missing:
            raise ValueError(f"gather_experts: '{name}' is missing on ranks {missing}")
        if is_expert_parameter(name):
            full = np.concatenate([_numpy(shard[name]) for shard in shards])
            out[name] = _like(value, full, name)
            continue
        if check and name.split(".")[-1] not in _PER_RANK:
            reference = _numpy(value)
            for r, shard in enumerate(shards[1:], 1):
                if not np.array_equal(_numpy(shard[name]), reference):
                    raise ValueError(f"gather_experts: replicated '{name}' differs between rank "
                                     f"0 and rank {r} (the ranks are out of sync)")
        out[name] = value
    return out


def _numpy(value):
    return value.asnumpy() if isinstance(value, Tensor) else np.asarray(value)


def _like(value, array, name):
    """array in the kind of value (numpy, or a Parameter named name)."""
    if not isinstance(value, Tensor):
        return array
    requires_grad = value.requires_grad if isinstance(value, Parameter) else True
    return Parameter(Tensor(np.ascontiguousarray(array), value.dtype), name=name,
                     requires_grad=requires_grad)
