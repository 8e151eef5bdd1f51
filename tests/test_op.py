"""The registered op: torch.library.opcheck, and torch.compile(fullgraph=True) through run()."""
import re

import pytest
import torch

from paged_case import ON_GPU, csr_kwargs, make_case
from persistentkv import TOLERANCE, DecodeWrapper, reference_decode, relative_error
from persistentkv.op import guard_pages, paged_decode
from persistentkv.tuning import KernelConfig

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)


def planned(backend="split", layout="HND", first_pages=False):
    case = make_case(seq_lens=[70, 3, 40], **HEADS, layout=layout)
    wrapper = DecodeWrapper(layout)
    wrapper.plan(**csr_kwargs(case.table), **HEADS, backend=backend,
                 split_pages=2 if backend == "split" else None,
                 config=KernelConfig(first_pages=True) if first_pages else None)
    return case, wrapper


@pytest.mark.parametrize("backend, first_pages", [("split", False), ("grouped", False),
                                                  ("split", True)],
                         ids=["split", "grouped", "split-first-pages"])
def test_opcheck(backend, first_pages):
    """The op on the plan's public buffers (plan.workspace), called as traced_decode calls it."""
    case, w = planned(backend, first_pages=first_pages)
    plan, pool = w.current_plan, case.kv_cache
    ws, cfg = plan.workspace, plan.config
    w.run(case.q, pool)               # a trusted table: the first run() makes the guarded copy
    args = (case.q, pool, pool, plan.indices, plan.indices, None, None, 1.0, 1.0, ws.tasks,
            ws.first_pages, ws.info, ws.part_o,
            ws.part_lse, ws.counters, ws.row_lens,
            [pool.stride(0), pool.stride(2), pool.stride(3), pool.stride(1)],
            plan.sm_scale, plan.num_kv_heads, plan.page_size, plan.programs, cfg.block_n,
            cfg.num_warps, cfg.num_stages, 1, -1, 0.0)
    kwargs = dict(read_first_pages=cfg.first_pages)
    torch.library.opcheck(paged_decode, args, kwargs,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    ref, _ = reference_decode(case.q, pool, layout="HND", **csr_kwargs(case.table))
    assert relative_error(paged_decode(*args, **kwargs), ref) <= TOLERANCE[torch.float16]
    assert int(ws.counters.abs().sum()) == 0 and int(ws.info[3]) == 0


def test_opcheck_guard_pages():
    """The page guard's op copies the table, an entry outside the pool replaced by page 0."""
    case, w = planned()
    plan, pool = w.current_plan, case.kv_cache
    guard = plan.guard
    table = guard.leading[0].clone()
    table[1] = pool.shape[0] + 3
    args = (table, guard.leading[1], *guard.fixed, pool.shape[0], guard.page_size, guard.csr)
    torch.library.opcheck(guard_pages, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    plan.workspace.info[6] = 0
    guard_pages(*args)
    want = table.clone()
    want[1] = 0
    assert torch.equal(plan.indices[:guard.extent], want) and int(plan.workspace.info[6]) == 1


@pytest.mark.parametrize("layout, first_pages", [("HND", False), ("NHD", False),
                                                 ("HND_VT", False), ("HND", True)],
                         ids=["HND", "NHD", "HND_VT", "HND-first-pages"])
def test_torch_compile_fullgraph(layout, first_pages):
    case, w = planned("split", layout, first_pages=first_pages)
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


@pytest.mark.parametrize("bad", ["q rows", "q heads", "q dtype", "kv heads", "pool pages",
                                 "sinks"])
def test_compiled_run_checks_as_eager(bad):
    """Under torch.compile run() refuses what the eager run() refuses, with the same message
    (nothing reaches the kernel: a q of fewer rows than planned would write past out)."""
    case, w = planned()
    w.plan(**csr_kwargs(case.table), **HEADS, backend="split", split_pages=2,
           check_page_table=True)
    q, kv, sinks = case.q, case.kv_cache, None
    if bad == "q rows":
        q = q[:1].contiguous()
    elif bad == "q heads":
        q = torch.randn(q.shape[0], 2 * HEADS["num_qo_heads"], q.shape[2], dtype=q.dtype,
                        device=q.device)
    elif bad == "q dtype":
        q = q.bfloat16()
    elif bad == "kv heads":
        kv = kv[:, :, :1].contiguous()
    elif bad == "pool pages":
        kv = kv[:1].contiguous()
    else:
        sinks = torch.zeros(HEADS["num_qo_heads"] + 1, device=q.device)
    with pytest.raises((TypeError, ValueError)) as eager:
        w.run(q, kv, sinks=sinks)

    @torch.compile(fullgraph=True, backend="eager")
    def attend(q, kv, sinks):
        return w.run(q, kv, sinks=sinks)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=re.escape(str(eager.value)[:40])):
        attend(q, kv, sinks)
