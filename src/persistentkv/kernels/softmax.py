"""The online-softmax math, in one place, for every schedule.

Scores are kept in base 2: s = (q . k) * sm_scale * log2(e), so exp2 replaces exp. A state is
(acc, m, l) while a range of tokens is being read, and (o, lse2) once normalized: o = acc / l,
lse2 = m + log2(l); merge.py combines normalized states.
"""
import triton
import triton.language as tl


@triton.jit
def _max_pair(a, b, c, d):
    return tl.maximum(a, c), tl.maximum(b, d)


@triton.jit
def online_softmax_step(acc, m_i, l_i, r_i, scores, v, v_scale, V_SCALED: tl.constexpr):
    """Fold one tile into the running state.

    acc [M, D] fp32, m_i [M] running max, l_i [M] running sum, scores [M, N] base-2 (masked
    tokens at -inf, at least one finite per row), v [N, D]. Returns the new (acc, m_i, l_i, r_i).

    V_SCALED: v's rows are quantized, row j's value is v_scale[j] * v[j] (v_scale [N] fp32). The
    weights p * v_scale are then cast to v's dtype relative to r_i [M] (acc counts in units of
    r_i, ended by the caller's acc * r_i), at least the largest scale of the tile, found in the
    scores' own reduction: the weights stay in [0, 1] and those of the tile's largest V in fp16's
    normal range. Cast as they are, the weights of a V of amax 1e-3 fall under it and lost a digit
    (1.3e-2 relative error). Without V_SCALED, r_i is passed through.
    """
    if V_SCALED:   # one reduction for the scores' max and the scales' (a cross-warp exchange)
        tile_max, top = tl.reduce((scores, tl.broadcast_to(v_scale[None, :], scores.shape)), 1,
                                  _max_pair)
    else:
        tile_max = tl.max(scores, axis=1)
    m_new = tl.maximum(m_i, tile_max)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if V_SCALED:
        r_new = tl.maximum(r_i * alpha, top)
        inv = tl.where(r_new > 0, 1.0 / r_new, 0.0)
        alpha = r_i * alpha * inv
        p = p * (v_scale[None, :] * inv[:, None])
        r_i = r_new
    if v.dtype == tl.float32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i, r_i
