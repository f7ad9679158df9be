"""numpy golden models of every operator (the semantics the README documents), written for
clarity, not speed.

Everything is computed in float64 from the inputs; callers round to the output dtype. Tests and
users compare the kernels against these.
"""
import numpy as np


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # stable for any |x|


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _top_k(values, k):
    """Indices of the k largest values, descending, lower index first on ties. NaN ranks above
    every number, +inf included (the kernels' order, as torch.topk)."""
    nan = np.isnan(values)
    order = np.lexsort((np.arange(values.shape[-1]), -np.where(nan, 0.0, values), ~nan))
    return order[:k]


# -- router (SPEC §1-2) --------------------------------------------------------------------------

def moe_gating_top_k(x, k, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                     norm_type=1, out_flag=True, routed_scaling_factor=1.0, eps=1e-20):
    """-> (y [M, k] float64, expert_idx [M, k] int32, x_norm [M, N] float64)."""
    x = np.asarray(x, np.float64)
    x_norm = _sigmoid(x) if norm_type == 1 else _softmax(x)
    y, idx = gating_from_scores(x_norm, k, bias, k_group, group_count, group_select_mode, renorm,
                                norm_type, routed_scaling_factor, eps)
    return y, idx, x_norm


def gating_from_scores(x_norm, k, bias=None, k_group=1, group_count=1, group_select_mode=0,
                       renorm=0, norm_type=1, routed_scaling_factor=1.0, eps=1e-20):
    """Steps 2-7 of moe_gating_top_k from given scores x_norm [M, N]: -> (y [M, k] float64,
    expert_idx [M, k] int32). The selection is exact for float32 scores, so a kernel's own
    x_norm must lead to its own expert_idx."""
    x_norm = np.asarray(x_norm, np.float64)
    m, n = x_norm.shape
    # selection scores are what the kernel sees: float32 scores plus bias
    choice = x_norm.astype(np.float32).astype(np.float64)
    if bias is not None:
        choice = (choice.astype(np.float32) + np.asarray(bias, np.float32)).astype(np.float64)
    y = np.zeros((m, k))
    idx = np.zeros((m, k), np.int32)
    per = n // group_count
    for i in range(m):
        c = choice[i]
        candidates = np.arange(n)
        if group_count > 1:
            groups = c.reshape(group_count, per)
            best = np.take_along_axis(groups, np.stack([_top_k(g, 2) for g in groups]), axis=1)
            # a group's NaN ranks first; the score of a group holding one is NaN
            score = best[:, 0] if group_select_mode == 0 else best[:, :2].sum(axis=1)
            keep = np.sort(_top_k(score.astype(np.float32), k_group))
            # only the kept groups' experts are candidates (dropped ones can never win)
            candidates = (keep[:, None] * per + np.arange(per)).reshape(-1)
        idx[i] = candidates[_top_k(c[candidates], k)]
        w = x_norm[i, idx[i]]
        if norm_type == 1 or renorm == 1:
            w = w / (w.sum() + eps)
        y[i] = w * routed_scaling_factor
    return y, idx


def _renorm_grad(w, g, renorm, eps):
    if not renorm:
        return g
    d = w.sum() + eps
    beta = (w / d * g).sum()
    return (g - beta) / d


def _router_backward(x_norm, grad_y, expert_idx, renorm, scale, eps, softmax):
    x_norm = np.asarray(x_norm, np.float64)
    grad_y = np.asarray(grad_y, np.float64)
    grad_x = np.zeros_like(x_norm)
    for i in range(x_norm.shape[0]):
        idx = expert_idx[i]
        gw = _renorm_grad(x_norm[i, idx], scale * grad_y[i], renorm, eps)
        gn = np.zeros(x_norm.shape[1])
        np.add.at(gn, idx, gw)  # an expert chosen twice gets both gradients
        xn = x_norm[i]
        grad_x[i] = xn * (gn - (xn * gn).sum()) if softmax else xn * (1 - xn) * gn
    return grad_x


def moe_gating_top_k_backward(x_norm, grad_y, expert_idx, renorm=0, norm_type=1,
                              routed_scaling_factor=1.0, eps=1e-20):
    """Sigmoid router backward (SPEC §2): -> grad_x [M, N] float64. Duplicates are summed."""
    return _router_backward(x_norm, grad_y, expert_idx, True, routed_scaling_factor, eps, False)


def moe_gating_top_k_softmax_backward(x_norm, grad_y, expert_idx, renorm=0,
                                      routed_scaling_factor=1.0, eps=1e-20):
    """Softmax router backward: -> grad_x [M, N] float64."""
    return _router_backward(x_norm, grad_y, expert_idx, renorm == 1, routed_scaling_factor, eps,
                            True)



def moe_gating_top_k_grad(x_norm, grad_y, expert_idx, grad_x_norm=None, norm_type=1, renorm=0,
                          routed_scaling_factor=1.0, eps=1e-20):
    """The router's whole backward: the gradient through y plus the score function's derivative
    applied to grad_x_norm (the gradient of the x_norm output) -> grad_x [M, N] float64."""
    softmax = norm_type == 0
    grad_x = _router_backward(x_norm, grad_y, expert_idx, renorm == 1 or not softmax,
                              routed_scaling_factor, eps, softmax)
    if grad_x_norm is not None:
        xn, d = x_norm.astype(np.float64), np.asarray(grad_x_norm, np.float64)
        grad_x += xn * (d - (xn * d).sum(-1, keepdims=True)) if softmax else xn * (1 - xn) * d
    return grad_x

# -- MoE layer (router -> experts -> weighted sum + shared experts) -------------------------------

def _moe_activation(name, h, clamp_limit=0.0):
    if name == "swiglu":
        return swiglu_group(h, clamp_limit=clamp_limit)
    return ffn_activation(name, h)


def moe_layer(x, router_weight, weight1, weight2, top_k, expert_bias=None, n_group=1,
              topk_group=1, group_select_mode=1, routed_scaling_factor=1.0, score_func="sigmoid",
              activation="swiglu", clamp_limit=0.0, bias1=None, bias2=None, shared_weight1=None,
              shared_weight2=None, expert_idx=None, norm_topk_prob=True, shared_gate=None):
    """MoELayer forward: -> (out, shape of x, float64; expert_idx [T, top_k] int32).

    out[t] = sum_k w[t,k] * (act(x[t] @ weight1[e] + bias1[e]) @ weight2[e] + bias2[e]) +
    g[t] * shared(x[t]), e = idx[t,k], with (w, idx) from moe_gating_top_k of x @ router_weight.T
    (weights renormalised when norm_topk_prob, times routed_scaling_factor). shared is a SwiGLU
    MLP with shared_weight1 [H, 2Fs] (gate | up) and shared_weight2 [Fs, H]; g[t] is 1, or
    sigmoid(x[t] . shared_gate) with shared_gate [H]. Passing expert_idx fixes the routing (for
    finite differences that must not flip a choice).
    """
    x = np.asarray(x, np.float64)
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    logits = x @ np.asarray(router_weight, np.float64).T
    norm_type = 1 if score_func == "sigmoid" else 0
    if expert_idx is None:
        _, expert_idx, _ = moe_gating_top_k(logits, top_k, bias=expert_bias, k_group=topk_group,
                                            group_count=n_group,
                                            group_select_mode=group_select_mode if n_group > 1 else 0,
                                            renorm=1, norm_type=norm_type)
    expert_idx = np.asarray(expert_idx, np.int32)
    scores = _sigmoid(logits) if norm_type == 1 else _softmax(logits)
    w = np.take_along_axis(scores, expert_idx.astype(np.int64), axis=1)
    if norm_topk_prob:
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
    w = w * routed_scaling_factor
    weight1 = np.asarray(weight1, np.float64)
    weight2 = np.asarray(weight2, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(expert_idx.shape[1]):
            e = expert_idx[t, k]
            h = x[t] @ weight1[e] + (0.0 if bias1 is None else np.asarray(bias1, np.float64)[e])
            y = _moe_activation(activation, h, clamp_limit) @ weight2[e]
            y = y + (0.0 if bias2 is None else np.asarray(bias2, np.float64)[e])
            out[t] += w[t, k] * y
    if shared_weight1 is not None:
        h = x @ np.asarray(shared_weight1, np.float64)
        shared = _moe_activation("swiglu", h) @ np.asarray(shared_weight2, np.float64)
        if shared_gate is not None:
            shared = shared * _sigmoid(x @ np.asarray(shared_gate, np.float64))[:, None]
        out += shared
    return out.reshape(shape), expert_idx


# -- router training losses (nn/losses.py) -------------------------------------------------------

def balance_probs(logits, score_func="softmax"):
    """p [T, E] float64: softmax of the logits, or sigmoid scores normalised per token."""
    logits = np.asarray(logits, np.float64)
    if score_func == "softmax":
        return _softmax(logits)
    s = _sigmoid(logits)
    return s / (s.sum(axis=-1, keepdims=True) + 1e-20)


def switch_aux_loss(logits, expert_idx, score_func="softmax"):
    """E * sum_e (count_e / T) * mean_t p_te, count_e = picks of expert e in expert_idx [T, K]."""
    p = balance_probs(logits, score_func)
    t, e = p.shape
    counts = np.bincount(np.asarray(expert_idx).reshape(-1), minlength=e)
    return float(e * (counts / t * p.mean(axis=0)).sum())


def sequence_aux_loss(logits, expert_idx, num_sequences, score_func="sigmoid"):
    """DeepSeek-V3's sequence-wise balance loss, the mean over the num_sequences consecutive
    sequences of sum_e f_e P_e, f_e = E / (K S) * count_e, P_e = mean_t p_te (in the sequence)."""
    p = balance_probs(logits, score_func)
    t, e = p.shape
    idx = np.asarray(expert_idx)
    k = idx.shape[1]
    s = t // num_sequences
    total = 0.0
    for b in range(num_sequences):
        rows = slice(b * s, (b + 1) * s)
        f = e / (k * s) * np.bincount(idx[rows].reshape(-1), minlength=e)
        total += (f * p[rows].mean(axis=0)).sum()
    return total / num_sequences


def router_z_loss(logits):
    """mean_t logsumexp(logits_t)^2."""
    logits = np.asarray(logits, np.float64)
    m = logits.max(axis=-1)
    lse = m + np.log(np.exp(logits - m[:, None]).sum(axis=-1))
    return float((lse ** 2).mean())


# -- MoeFFN quant path (SPEC §4, inference only) ---------------------------------------------------

def float_to_deq_scale(scale):
    """float32 dequant scales -> uint64 as the device takes them (low 32 bits = float32 bits)."""
    return np.asarray(scale, np.float32).view(np.uint32).astype(np.uint64)


def _deq_scale_values(deq_scale):
    """uint64 or float32 dequant scales -> the float32 values used: only the top 19 bits survive."""
    deq_scale = np.asarray(deq_scale)
    if deq_scale.dtype == np.uint64:
        bits = (deq_scale & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    else:
        bits = deq_scale.astype(np.float32).view(np.uint32)
    return (bits & np.uint32(0xFFFFE000)).view(np.float32)


def _quant_activation(name, h):
    """Activation of float32 h, computed in float64 and rounded to float32 like the kernel."""
    return ffn_activation(name, h.astype(np.float64)).astype(np.float32)


def round_to_dtype(y, dtype):
    """float32 y rounded (nearest even) to "float16", "bfloat16" or "float32"; float32 values of
    the result for bfloat16 (numpy has no bfloat16)."""
    y = np.asarray(y, np.float32)
    if dtype == "float16":
        return y.astype(np.float16)
    if dtype == "bfloat16":
        bits = y.view(np.uint32).astype(np.uint64)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
        nan = np.isnan(y)
        bits[nan] = (y[nan].view(np.uint32) | 0x400000) & 0xFFFF0000
        return bits.view(np.float32)
    return y


def cast(x, dtype):
    """cast: x (float32, float16 or bfloat16 values) rounded to nearest-even in dtype, as float64
    values."""
    with np.errstate(over="ignore"):  # (float16: past 65520 is inf)
        return round_to_dtype(np.asarray(x, np.float32), dtype).astype(np.float64)


def saturate_int8(v):
    """round half to even, then clamp to [-128, 127] (NaN -> 0): float -> int8."""
    r = np.rint(np.nan_to_num(np.asarray(v, np.float64), nan=0.0))
    return np.clip(r, -128, 127).astype(np.int8)


def _int32_sum(a, w, b, e):
    """a @ w (+ b[e]) with exact integer products, wrapped to int32 like the device's sums."""
    acc = np.asarray(a, np.int64) @ np.asarray(w, np.int64)
    if b is not None:
        acc = acc + np.asarray(b, np.int64)[e]
    return acc.astype(np.uint64).astype(np.uint32).view(np.int32)


def _quant_rows(x, expert_tokens, tokens_index_flag):
    """[(expert, rows)] of the experts with rows; counts that do not fit raise ValueError."""
    m = np.shape(x)[0]
    tokens = np.asarray(expert_tokens, np.int64)
    ends = tokens if tokens_index_flag else np.cumsum(tokens)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    if len(tokens) and ((np.diff(np.concatenate([[0], ends])) < 0).any() or ends[-1] > m):
        raise ValueError("expert_tokens do not fit the rows of x")
    return [(e, slice(starts[e], ends[e])) for e in range(len(tokens)) if starts[e] < ends[e]]


def moe_ffn_quant_hidden(x, expert_tokens, weight1, bias1, scale, offset, deq_scale1,
                         activation="fastgelu", tokens_index_flag=False):
    """The quant path's first half: (h, pre), both [M, F] float32 and zero on the rows past the
    experts. h = float(int32(x @ weight1[e]) + bias1[e]) * deq_scale1[e] (19-bit scales);
    pre = act(h) * scale[e] + offset[e] rounded once to float32, which requantises to
    saturate_int8(pre)."""
    x = np.asarray(x, np.int8)
    f = np.shape(weight1)[2]
    dq1 = _deq_scale_values(deq_scale1)
    h = np.zeros((x.shape[0], f), np.float32)
    pre = np.zeros((x.shape[0], f), np.float32)
    for e, rows in _quant_rows(x, expert_tokens, tokens_index_flag):
        h[rows] = _int32_sum(x[rows], weight1[e], bias1, e).astype(np.float32) * dq1[e]
        act = _quant_activation(activation, h[rows]).astype(np.float64)
        off = 0.0 if offset is None else float(np.float32(np.asarray(offset)[e]))
        # a * scale + offset with one rounding to float32 (the kernel's fused multiply-add)
        pre[rows] = (act * float(np.float32(np.asarray(scale)[e])) + off).astype(np.float32)
    return h, pre


def moe_ffn_quant(x, expert_tokens, weight1, weight2, bias1, bias2, scale, offset, deq_scale1,
                  deq_scale2, activation="fastgelu", tokens_index_flag=False, output_dtype=None):
    """MoeFFN int8 path: exact integer products (int32, wrapping), float32 dequantisation with
    19-bit dequant scales, round-half-even int8 requantisation. -> y [M, H] rounded to
    output_dtype (default "float16")."""
    q = saturate_int8(moe_ffn_quant_hidden(x, expert_tokens, weight1, bias1, scale, offset,
                                           deq_scale1, activation, tokens_index_flag)[1])
    dq2 = _deq_scale_values(deq_scale2)
    y = np.zeros((np.shape(x)[0], np.shape(weight2)[2]), np.float32)
    for e, rows in _quant_rows(x, expert_tokens, tokens_index_flag):
        y[rows] = _int32_sum(q[rows], weight2[e], bias2, e).astype(np.float32) * dq2[e]
    return round_to_dtype(y, output_dtype or "float16")


# -- token permutation (SPEC §5) -----------------------------------------------------------------

def moe_token_permute(x, expert_idx, num_experts):
    """-> (permuted [T*K, H] (x's values), sorted_index [T*K] int32, counts [E] int64).

    sorted_index[t*K + k] is the permuted row holding slot k of token t; rows are grouped by
    expert, in token order within an expert (stable sort)."""
    x = np.asarray(x)
    t, k = expert_idx.shape
    flat = np.asarray(expert_idx).reshape(-1)
    order = np.argsort(flat, kind="stable")  # source slot of each permuted row
    sorted_index = np.empty(t * k, np.int32)
    sorted_index[order] = np.arange(t * k)
    counts = np.bincount(flat, minlength=num_experts).astype(np.int64)
    return x[order // k], sorted_index, counts


def moe_token_unpermute(permuted, sorted_index, probs=None, top_k=0):
    """-> out [T, H] float64: out[t] = sum_k probs[t,k] * permuted[sorted_index[t*K + k]]."""
    permuted = np.asarray(permuted, np.float64)
    k = probs.shape[1] if probs is not None else (top_k or 1)
    rows = permuted[sorted_index].reshape(len(sorted_index) // k, k, permuted.shape[1])
    w = np.ones(rows.shape[:2]) if probs is None else np.asarray(probs, np.float64)
    return (rows * w[..., None]).sum(axis=1)


def moe_token_unpermute_backward(permuted, sorted_index, probs, grad_out, top_k=0):
    """-> (grad_permuted [T*K, H], grad_probs [T, K]) float64 (grad_probs 0 without probs)."""
    permuted = np.asarray(permuted, np.float64)
    g = np.asarray(grad_out, np.float64)
    t, h = g.shape
    k = probs.shape[1] if probs is not None else (top_k or 1)
    w = np.ones((t, k)) if probs is None else np.asarray(probs, np.float64)
    grad_permuted = np.zeros_like(permuted)
    grad_permuted[sorted_index] = (w[..., None] * g[:, None, :]).reshape(t * k, h)
    grad_probs = np.zeros((t, k))
    if probs is not None:
        grad_probs = (permuted[sorted_index].reshape(t, k, h) * g[:, None, :]).sum(axis=-1)
    return grad_permuted, grad_probs


# -- SwiGLU with clamp, per-token weights and group index (SPEC §3) ------------------------------

def _swiglu_rows(x, group_index):
    """(x as [T, 2H] float64, trunc = min(sum(group_index), T))."""
    x = np.asarray(x, np.float64)
    rows = x.reshape(-1, x.shape[-1])
    if group_index is None:
        return rows, rows.shape[0]
    counts = np.asarray(group_index, np.int64)
    if (counts < 0).any():
        raise ValueError("group_index: token counts must be >= 0")
    # Python integers: no wrap-around whatever the counts (int64 sums would wrap near 2**63)
    return rows, min(sum(int(c) for c in counts.reshape(-1)), rows.shape[0])


def _swiglu_halves(rows, clamp_limit):
    h = rows.shape[1] // 2
    x0, x1 = rows[:, :h], rows[:, h:]
    if clamp_limit > 0:
        x0, x1 = np.minimum(x0, clamp_limit), np.clip(x1, -clamp_limit, clamp_limit)
    return x0, x1


def swiglu_group(x, weight=None, group_index=None, clamp_limit=0.0):
    """-> y [.., H] float64. Without weight this is also the forward's y_origin."""
    rows, trunc = _swiglu_rows(x, group_index)
    x0, x1 = _swiglu_halves(rows, clamp_limit)
    y = x0 * _sigmoid(x0) * x1
    if weight is not None:
        y = y * np.asarray(weight, np.float64).reshape(-1, 1)
    y[trunc:] = 0
    return y.reshape(np.shape(x)[:-1] + (rows.shape[1] // 2,))


def swiglu_group_quant_grad(grad_y, x, weight=None, y_origin=None, group_index=None,
                            clamp_limit=0.0):
    """-> (grad_x [.., 2H] float64, grad_weight [.., 1] float64 or None)."""
    rows, trunc = _swiglu_rows(x, group_index)
    h = rows.shape[1] // 2
    g = np.asarray(grad_y, np.float64).reshape(-1, h)
    x0, x1 = _swiglu_halves(rows, clamp_limit)
    s = _sigmoid(x0)
    gy = g if weight is None else g * np.asarray(weight, np.float64).reshape(-1, 1)
    gx0 = gy * x1 * s * (1 + x0 * (1 - s))
    gx1 = gy * x0 * s
    if clamp_limit > 0:
        gx0 = gx0 * (rows[:, :h] < clamp_limit)
        gx1 = gx1 * ((rows[:, h:] > -clamp_limit) & (rows[:, h:] < clamp_limit))
    grad_x = np.concatenate([gx0, gx1], axis=1)
    grad_x[trunc:] = 0
    grad_weight = None
    if weight is not None:
        grad_weight = (g * np.asarray(y_origin, np.float64).reshape(-1, h)).sum(axis=1)
        grad_weight[trunc:] = 0
        grad_weight = grad_weight.reshape(np.shape(weight))
    return grad_x.reshape(np.shape(x)), grad_weight


# -- grouped_matmul and moe_ffn float path (SPEC §4-5) -------------------------------------------

def _group_offsets(group_list, m, cumulative, padded=True):
    """[(start, end)] of every group. The groups cover the m rows exactly, or with padded at most
    m rows: the rows past the last group (a padded batch) belong to no group (zero output rows).
    Counts that do not fit raise ValueError."""
    counts = [int(c) for c in np.asarray(group_list, np.int64).reshape(-1)]  # no int64 wrap
    ends = counts if cumulative else list(np.cumsum([0] + counts, dtype=object)[1:])
    starts = [0] + ends[:-1]
    if any(c < 0 for c in counts) or any(e < s for s, e in zip(starts, ends)) or ends[-1] > m:
        raise ValueError(f"counts {counts} do not fit the {m} rows")
    if not padded and ends[-1] != m:
        raise ValueError(f"counts {counts} cover {ends[-1]} of the {m} rows (padded=False)")
    return list(zip(starts, ends))


def grouped_matmul(x, weight, group_list, bias=None, transpose_x=False, transpose_weight=False,
                   cumulative=False, padded=True):
    """-> [M, N] (or [G, K, N] with transpose_x) float64, one product per group of rows."""
    x = np.asarray(x, np.float64)
    w = np.asarray(weight, np.float64)
    groups = _group_offsets(group_list, x.shape[0], cumulative, padded)
    if transpose_x:
        return np.stack([x[s:e].T @ w[s:e] for s, e in groups])
    if w.ndim == 2:  # one weight for every group
        w = np.broadcast_to(w, (len(groups),) + w.shape)
    if transpose_weight:
        w = w.transpose(0, 2, 1)
    out = np.zeros((x.shape[0], w.shape[2]))
    for g, (s, e) in enumerate(groups):
        out[s:e] = x[s:e] @ w[g] + (0 if bias is None else np.asarray(bias, np.float64)[g])
    return out


def ffn_activation(name, h):
    """The moe_ffn activations on float64."""
    if name == "fastgelu":
        return h * _sigmoid(1.702 * h)
    if name == "gelu":
        return h * _sigmoid(1.59576912 * (h + 0.044715 * h ** 3))
    if name == "relu":
        return np.maximum(h, 0)
    if name == "silu":
        return h * _sigmoid(h)
    raise ValueError(f"unknown activation {name!r}")


def moe_ffn(x, expert_tokens, weight1, weight2, bias1=None, bias2=None, scale=None, offset=None,
            deq_scale1=None, deq_scale2=None, activation="fastgelu", tokens_index_flag=False,
            output_dtype=None, padded=False):
    """-> y [M, H] float64. int8 x goes to moe_ffn_quant (the quant path's golden model). The
    expert tokens must cover every row unless padded (ValueError)."""
    _group_offsets(expert_tokens, np.shape(x)[0], tokens_index_flag, padded)
    if np.asarray(x).dtype == np.int8:
        quant = globals().get("moe_ffn_quant")
        if quant is None:
            raise NotImplementedError("reference.moe_ffn: the int8 path needs moe_ffn_quant, "
                                      "which this reference does not define yet")
        return quant(x, expert_tokens, weight1, weight2, bias1, bias2, scale, offset, deq_scale1,
                     deq_scale2, activation, tokens_index_flag, output_dtype)
    h = grouped_matmul(x, weight1, expert_tokens, bias1, cumulative=tokens_index_flag)
    return grouped_matmul(ffn_activation(activation, h), weight2, expert_tokens, bias2,
                          cumulative=tokens_index_flag)


# -- quantised experts (ms_moe_ops.quantize: Int8Experts, W8A16Experts) ---------------------------

def per_channel_int8(w):
    """w [E, K, N] -> (int8 [E, K, N], float32 step [E, N]): symmetric per expert and output
    column, step max|w| / 127 (1 for a zero column)."""
    w = np.asarray(w, np.float64)
    step = np.abs(w).max(axis=1) / 127
    step[step == 0] = 1.0
    step = step.astype(np.float32)
    return np.clip(np.rint(w / step[:, None, :]), -127, 127).astype(np.int8), step


def dequantize(weight, scale, index):
    """weight int8 [E, K, N], scale [E, N], index [G] -> float32 [G, K, N]: weight[index[g]] *
    scale[index[g]] per output channel (one float32 product per element)."""
    index = np.asarray(index, np.int64)
    w = np.asarray(weight, np.float32)[index]
    with np.errstate(invalid="ignore", over="ignore"):  # (inf and NaN steps stay what they are)
        return w * np.asarray(scale, np.float32)[index][:, None, :]


def weight_quant_grouped_matmul(x, weight, scale, group_list):
    """x [M, K], weight int8 [E, K, N], scale [E, N], group_list [E] rows per expert (at most M
    in all) -> float64 [M, N]: x[rows of e] @ (weight[e] * scale[e]), the rows past the last
    expert's zero."""
    w = np.asarray(weight, np.float64) * np.asarray(scale, np.float64)[:, None, :]
    return grouped_matmul(x, w, group_list)


def rms_norm(x, weight, eps=1e-6):
    """x [..., H], weight [H] -> float64 weight * x / sqrt(mean(x^2) + eps) over the last axis."""
    x = np.asarray(x, np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return np.asarray(weight, np.float64) * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def add_rms_norm(x, residual, weight, eps=1e-6):
    """(rms_norm(x + residual, weight, eps), x + residual), float64 (the sum rounded to float32 as
    the kernels store it, before the norm)."""
    total = (np.asarray(x, np.float32) + np.asarray(residual, np.float32)).astype(np.float64)
    return rms_norm(total, weight, eps), total


def decode_attention(q, k, v, cos, sin, key_cache, value_cache, mask, slot, scaling=1.0):
    """One new position of grouped-query attention over a KV cache (see
    ms_moe_ops.ops.decode_attention), float64: -> (out [B, N, 1, D], key_cache, value_cache)."""
    q, k, v, cos, sin, mask = (np.asarray(t, np.float64) for t in (q, k, v, cos, sin, mask))
    keys, values = (np.array(c, np.float64) for c in (key_cache, value_cache))
    slot = int(slot)
    if not 0 <= slot < keys.shape[2]:
        raise ValueError(f"decode_attention: slot {slot} is outside the cache's "
                         f"{keys.shape[2]} positions")

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    keys[:, :, slot] = rotate(k)[:, :, 0]
    values[:, :, slot] = v[:, :, 0]
    b, heads, _, d = q.shape
    kv_heads = keys.shape[1]
    rows = rotate(q).reshape(b, kv_heads, heads // kv_heads, d)
    scores = rows @ keys.swapaxes(-1, -2) * scaling + mask
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    return (probs @ values).reshape(b, heads, 1, d), keys, values


def _static_int8(v, step):
    return np.clip(np.rint(np.asarray(v, np.float64) / np.float64(step)), -128, 127)


def quantized_experts(x, expert_tokens, weight1_q, deq_scale1, weight2_q, deq_scale2,
                      activation="swiglu", x_step=None, a_step=None, bias1=None, bias2=None,
                      clamp_limit=0.0):
    """-> y [M, H] float64 of quantised experts, with exact integer products. W8A16 (x_step None):
    y = act(x @ (w1_q * deq1) + b1) @ (w2_q * deq2) + b2. W8A8: x_q = int8(x / x_step),
    h = (x_q @ w1_q) * deq1 + b1, a_q = int8(act(h) / a_step), y = (a_q @ w2_q) * deq2 + b2
    (int8(): round half to even, saturated to [-128, 127]; deq = activation step * weight
    step)."""
    x = np.asarray(x, np.float64)
    w1 = np.asarray(weight1_q, np.int64)
    w2 = np.asarray(weight2_q, np.int64)
    d1 = np.asarray(deq_scale1, np.float64)
    d2 = np.asarray(deq_scale2, np.float64)
    out = np.zeros((x.shape[0], w2.shape[2]))
    for e, (s, end) in enumerate(_group_offsets(expert_tokens, x.shape[0], False, True)):
        rows = x[s:end]
        if x_step is None:
            h = rows @ (w1[e] * d1[e])
        else:
            h = (_static_int8(rows, x_step).astype(np.int64) @ w1[e]) * d1[e]
        h = h + (0.0 if bias1 is None else np.asarray(bias1, np.float64)[e])
        a = _moe_activation(activation, h, clamp_limit)
        if a_step is None:
            y = a @ (w2[e] * d2[e])
        else:
            y = (_static_int8(a, a_step).astype(np.int64) @ w2[e]) * d2[e]
        out[s:end] = y + (0.0 if bias2 is None else np.asarray(bias2, np.float64)[e])
    return out
