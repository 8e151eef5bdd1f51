"""The registered op: torch.library.opcheck, and torch.compile(fullgraph=True) through run()."""
import pytest
import torch

from paged_case import ON_GPU, csr_kwargs, make_case
from persistentkv import TOLERANCE, DecodeWrapper, reference_decode, relative_error
from persistentkv.op import paged_decode

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)


def planned(backend="workqueue", layout="HND"):
    case = make_case(seq_lens=[70, 3, 40], **HEADS, layout=layout)
    wrapper = DecodeWrapper(layout)
    wrapper.plan(**csr_kwargs(case.table), **HEADS, backend=backend, split_pages=2)
    return case, wrapper


@pytest.mark.parametrize("backend", ["split", "workqueue"])
def test_opcheck(backend):
    case, w = planned(backend)
    plan = w.plan_info
    pool = case.kv_cache
    args = (case.q, pool, pool, plan.indices, plan.meta, plan.tasks, None, w._part_o, w._part_lse,
            w._counters, [pool.stride(0), pool.stride(2), pool.stride(3), pool.stride(1)],
            plan.schedule.split_tokens, plan.sm_scale, 2, 16, backend == "workqueue",
            list(plan.schedule.grid), 64, 4, 2)
    torch.library.opcheck(paged_decode, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    ref, _ = reference_decode(case.q, pool, layout="HND", **csr_kwargs(case.table))
    assert relative_error(paged_decode(*args), ref) <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_torch_compile_fullgraph(layout):
    case, w = planned("split", layout)
    backend = "inductor" if ON_GPU else "aot_eager"   # the CPU suite skips inductor's C++ build

    @torch.compile(fullgraph=True, backend=backend)
    def attend(q, kv):
        return w.run(q * 1.0, kv) + 0.0

    torch._dynamo.reset()
    out = attend(case.q, case.kv_cache)
    ref, _ = reference_decode(case.q, case.kv_cache, layout=layout, **csr_kwargs(case.table))
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]


def test_compiled_run_refuses_out_and_lse():
    case, w = planned()

    @torch.compile(fullgraph=True, backend="eager")
    def attend(q, kv, out):
        return w.run(q, kv, out=out)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="under torch.compile"):
        attend(case.q, case.kv_cache, torch.empty_like(case.q))
