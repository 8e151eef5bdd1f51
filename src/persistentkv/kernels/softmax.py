"""The online-softmax math, in one place, for every schedule.

Scores are kept in base 2: s = (q . k) * sm_scale * log2(e), so exp2 replaces exp. A state is
(acc, m, l) while a range of tokens is being read, and (o, lse2) once normalized: o = acc / l,
lse2 = m + log2(l).
"""
import triton
import triton.language as tl


@triton.jit
def online_softmax_step(acc, m_i, l_i, scores, v):
    """Fold one tile into the running state.

    acc [M, D] fp32, m_i [M] running max, l_i [M] running sum, scores [M, N] base-2 (masked
    tokens at -inf, at least one finite per row), v [N, D]. Returns the new (acc, m_i, l_i).
    """
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if v.dtype == tl.float32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def merge_states(o_a, lse_a, o_b, lse_b):
    """Exact merge of two normalized states over disjoint token ranges.

    o_* [M, D] fp32, lse_* [M] base 2 (lse_a may be -inf for an empty state; lse_b finite).
    """
    m = tl.maximum(lse_a, lse_b)
    w_a = tl.math.exp2(lse_a - m)
    w_b = tl.math.exp2(lse_b - m)
    total = w_a + w_b
    o = (o_a * w_a[:, None] + o_b * w_b[:, None]) / total[:, None]
    return o, m + tl.math.log2(total)
