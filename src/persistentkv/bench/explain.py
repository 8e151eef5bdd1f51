"""`persistentkv explain`: what plan() makes of a step, read back from the planner's buffers.

The planner runs as it does before every step (kernels/plan.py; on the CPU through Triton's
interpreter), for a GPU of `num_sms` SMs and its shipped policy, so that a step's schedule, its
tasks, the rounds they take and the tile that reads them can be seen without that GPU. Nothing
is timed and no attention is computed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.decode import ONE_LEVEL_SPLITS
from ..planner import DecodePlan
from ..policy import StepFeatures, load_policy
from ..queries import MAX_QUERIES_PER_ROW
from ..runtime import next_power_of_2
from ..tuning import KernelConfig, default_config
from ..wrapper import DecodeWrapper
from .runner import ModelShape
from .traces import MAX_CONTEXT_LEN


@dataclass(frozen=True)
class StepPlanReport:
    """One planned step, as the kernels will run it. Tokens per task are a task's KV tokens;
    items are (task, KV head, M-block) triples; rounds = items / programs, where programs claim
    items (a balanced plan runs one chunk a program: one round)."""

    choice: str                   # the schedule and split the planner took (the policy's, or given)
    decided_by: str               # who chose: the backend given, a fitted policy, the default rule
    policy_bin: str               # the step's bin in the policy's table
    split_tokens: int             # the split size (a balanced plan's chunk size), tokens
    tasks: int
    rows_cut: int                 # rows read by two or more tasks (their partials merge)
    most_splits: int              # splits of the most-cut row
    merge_chain: tuple[int, ...]  # its merge: partials merged one after another, per level
    task_tokens: tuple[int, int, int]   # min, median, max
    items: int
    programs: int
    rounds: float
    tile_rows: int                # query tokens a row x group, padded to G_PAD >= 16 for tl.dot
    m_blocks: int                 # programs that share a task's rows, G_PAD rows each
    g_pad: int
    d_blocks: int                 # programs that share a task's output columns
    block_n: int                  # tokens per K/V tile; long_block_n for tasks of long_from tokens
    long_block_n: int
    long_from_tokens: int
    num_warps: int
    num_stages: int
    max_registers: int | None     # Triton's maxnreg of this tile (None: the compiler's choice)

    def lines(self) -> list[str]:
        lo, mid, hi = self.task_tokens
        tile = f"{self.block_n}-token K/V tiles"
        if self.long_block_n:
            tile += f", {self.long_block_n} for tasks of >= {self.long_from_tokens} tokens"
        return [f"choice {self.choice} ({self.decided_by}; policy bin {self.policy_bin}), split "
                f"{self.split_tokens} tokens",
                f"{self.tasks} tasks a KV head ({self.items} items on {self.programs} programs: "
                f"{self.rounds:.2f} rounds); {self.rows_cut} rows cut, at most "
                f"{self.most_splits} splits a row",
                _merge_text(self.merge_chain),
                f"tokens a task: min {lo}, median {mid}, max {hi}",
                f"tile: {self.tile_rows} query rows ("
                f"{f'{self.m_blocks} M-blocks of ' if self.m_blocks > 1 else ''}G_PAD "
                f"{self.g_pad}"
                f"{f', {self.d_blocks} value blocks' if self.d_blocks > 1 else ''}), {tile}, "
                f"{self.num_warps} warps, {self.num_stages} stages"
                f"{f', at most {self.max_registers} registers' if self.max_registers else ''}"]


def merge_chain(num_splits: int) -> tuple[int, ...]:
    """The partials a row of num_splits splits merges at each level, as the decode kernel does
    (kernels/decode.py `_merge_split`): none for a whole row; one level of all of them up to
    ONE_LEVEL_SPLITS; past that, groups of ceil(sqrt(S)) splits, then the groups."""
    if num_splits < 2:
        return ()
    if num_splits <= ONE_LEVEL_SPLITS.value:
        return (num_splits,)
    fanin = math.ceil(math.sqrt(num_splits))
    return (fanin, -(-num_splits // fanin))


def _merge_text(chain: tuple[int, ...]) -> str:
    if not chain:
        return "merge: none (no row is cut)"
    if len(chain) == 1:
        return f"merge: the most-cut row's {chain[0]} partials in one level"
    fanin, groups = chain
    return (f"merge: the most-cut row's partials in two levels, groups of {fanin}, then its "
            f"{groups} groups' results")


def explain_step(seq_lens: list[int], *, shape: ModelShape, num_sms: int, gpu_name: str,
                 q_len: int = 1, backend: str = "auto", split_pages: int | None = None,
                 config: KernelConfig | None = None,
                 device: torch.device | str = "cpu") -> StepPlanReport:
    """Plan one step of rows of `seq_lens` tokens (each with q_len queries) as a GPU of num_sms
    SMs would, with the policy shipped for gpu_name at the shape, and report it."""
    device = torch.device(device)
    if isinstance(q_len, bool) or not isinstance(q_len, int) \
            or not 1 <= q_len <= MAX_QUERIES_PER_ROW:
        raise ValueError(f"q_len must be an int in [1, {MAX_QUERIES_PER_ROW}], got {q_len!r}")
    lens = [int(n) for n in seq_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"seq_lens must be one or more positive lengths, got {seq_lens!r}")
    if max(lens) > MAX_CONTEXT_LEN or sum(lens) >= 2**31:   # the planner's int32 positions
        raise ValueError(f"seq_lens must be at most {MAX_CONTEXT_LEN} tokens a row and under 2^31 "
                         f"in all, got {max(lens)} at most and {sum(lens)} in all")
    page = shape.page_size
    pages = np.array([-(-n // page) for n in lens])
    # a CSR page list, as the benchmark plans (FlashInfer's form: its length is the step's pages,
    # which KernelConfig.step_size reads), its pages scattered over a pool of just the step's
    # pages (their values do not change the plan)
    kv_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32))
    kv_indices = torch.from_numpy(np.random.default_rng(0).permutation(int(pages.sum()))
                                  .astype(np.int32)).to(device)
    kv_last_page_len = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)],
                                    dtype=torch.int32)
    heads = (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim)
    policy = load_policy(gpu_name, shape=heads, kv_fp8=shape.kv_fp8 is not None)
    wrapper = DecodeWrapper(shape.layout, device=device, policy=policy, num_sms=num_sms)
    qo_indptr = None
    if q_len > 1:
        qo_indptr = torch.arange(0, (len(lens) + 1) * q_len, q_len, dtype=torch.int32)
    kv_dtype = torch.float8_e4m3fn if shape.kv_fp8 else shape.dtype
    config = config or default_config(head_dim=shape.head_dim, num_kv_heads=shape.num_kv_heads)
    plan = wrapper.plan(kv_indptr=kv_indptr, kv_indices=kv_indices,
                        kv_last_page_len=kv_last_page_len, num_qo_heads=shape.num_qo_heads,
                        num_kv_heads=shape.num_kv_heads,
                        head_dim=shape.head_dim, page_size=page, backend=backend,
                        split_pages=split_pages, config=config, qo_indptr=qo_indptr,
                        kv_data_type=kv_dtype)
    step_bin = StepFeatures.of(lens, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                               elem_size=1 if shape.kv_fp8 else 2).bin()
    if backend != "auto":
        decided_by = "given"
    elif policy.table and policy.applies_to(num_qo_heads=heads[0], num_kv_heads=heads[1],
                                            head_dim=heads[2]):
        decided_by = f"{gpu_name}'s policy at {'/'.join(map(str, heads))}"
        if step_bin not in policy.table:     # no calibration step reached the bin
            decided_by += ", which leaves this bin to the default rule"
    else:
        decided_by = f"the default rule: no {gpu_name} policy at {'/'.join(map(str, heads))}"
    return _report(plan, lens, shape=shape, q_len=q_len, decided_by=decided_by,
                   policy_bin=step_bin)


def _report(plan: DecodePlan, lens: list[int], *, shape: ModelShape, q_len: int,
            decided_by: str, policy_bin: str) -> StepPlanReport:
    info, records = plan.info(), plan.task_records()
    config = plan.config   # the step's: a small step's tile may be cut in M-blocks
    tokens = records[:, 3] - records[:, 2]
    splits = np.bincount(records[:, 0], minlength=len(lens))
    chunks = info["num_chunks"]
    rows = next_power_of_2(q_len) * (shape.num_qo_heads // shape.num_kv_heads)
    fp8 = shape.kv_fp8 is not None
    tile = config.tile_shape(tile_rows=rows, kv_fp8=fp8)
    items = (chunks or info["num_tasks"]) * shape.num_kv_heads * config.head_items(tile_rows=rows)
    return StepPlanReport(
        choice=str(info["choice"]), decided_by=decided_by, policy_bin=policy_bin,
        split_tokens=info["split_tokens"],
        tasks=info["num_tasks"], rows_cut=int((splits > 1).sum()), most_splits=int(splits.max()),
        merge_chain=merge_chain(int(splits.max())),
        task_tokens=(int(tokens.min()), int(np.median(tokens)), int(tokens.max())),
        items=items, programs=plan.programs, rounds=1.0 if chunks else items / plan.programs,
        tile_rows=rows, m_blocks=tile["m_blocks"], g_pad=tile["g_pad"], d_blocks=tile["d_blocks"],
        block_n=tile["block_n"],
        long_block_n=tile["long_block_n"], long_from_tokens=tile["long_from_tokens"],
        num_warps=config.num_warps, num_stages=config.stages(tile_rows=rows),
        max_registers=config.registers(tile_rows=rows))
