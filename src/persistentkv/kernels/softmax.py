"""The online-softmax math, in one place, for every schedule.

Scores are kept in base 2: s = (q . k) * sm_scale * log2(e), so exp2 replaces exp. A state is
(acc, m, l) while a range of tokens is being read, and (o, lse2) once normalized: o = acc / l,
lse2 = m + log2(l); merge.py combines normalized states.
"""
import triton
import triton.language as tl


@triton.jit
def online_softmax_step(acc, m_i, l_i, scores, v, v_scale, V_SCALED: tl.constexpr):
    """Fold one tile into the running state.

    acc [M, D] fp32, m_i [M] running max, l_i [M] running sum, scores [M, N] base-2 (masked
    tokens at -inf, at least one finite per row), v [N, D]; V_SCALED: v's rows are quantized, row
    j's value is v_scale[j] * v[j] (v_scale [N] fp32): p takes each row's scale relative to the
    tile's largest, and the product the largest, so that p stays in [0, 1] where it is cast to
    fp16 or bf16 (scaled whole, the weights of a V of amax 1e-3 fall under fp16's normal range
    and lost a digit: 1.3e-2 relative error). Returns the new (acc, m_i, l_i).
    """
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if V_SCALED:
        top = tl.max(v_scale, axis=0)
        top = tl.where(top > 0, top, 1.0)
        p = p * (v_scale / top)[None, :]
    if v.dtype == tl.float32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    if V_SCALED:
        pv = pv * top
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i

