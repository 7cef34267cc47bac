"""The static cost report (`convfirstnet kernels`): the issue estimate against counts made by hand, the
block -> stage -> model aggregation, declaration errors, and a small real run compiled for sm_90.

Compiles run in worker processes without the interpreter; the real ones here are kept to three small
variants (a test-only kernel and a stem + ConvFirst stack), a few seconds each.
"""

import json
import math
import re

import pytest
import torch
import triton
import triton.language as tl

from convfirstnet.analysis import compiled as cc
from convfirstnet.analysis import launches, report
from convfirstnet.analysis.estimate import aggregate, estimate_launch, waves_factor
from convfirstnet.analysis.targets import target
from convfirstnet.kernels._cost import KernelCost, Loop, recording
from convfirstnet.kernels._launch import launch
from convfirstnet.analysis.waterline import Kernel

H100 = target("sm_90")

# ------------------------------------------------------------------------------ SASS counted by hand

# An nvdisasm listing of the shape Triton kernels compile to: 2 straight-line instructions, an outer
# loop (label .L_x_0) whose body holds 5 instructions of its own around an inner loop (.L_x_1) of 4,
# a forward branch, a store and EXIT, then the trap (a branch to itself) and NOP padding.
NESTED = """
.text.k:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   IMAD R1, R0, 0x4, RZ ;
.L_x_0:
        /*0020*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0030*/                   IADD3 R3, R3, 0x1, RZ ;
.L_x_1:
        /*0040*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0050*/                   FFMA R5, R5, R6, R7 ;
        /*0060*/                   ISETP.NE.AND P0, PT, R3, R9, PT ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
        /*0080*/                   FADD R10, R10, R4 ;
        /*0090*/                   ISETP.NE.AND P1, PT, R11, R12, PT ;
        /*00a0*/               @P1 BRA `(.L_x_0) ;
        /*00b0*/              @!P2 BRA `(.L_x_2) ;
        /*00c0*/                   STG.E desc[UR4][R2.64], R10 ;
.L_x_2:
        /*00d0*/                   EXIT ;
.L_x_3:
        /*00e0*/                   BRA `(.L_x_3);
        /*00f0*/                   NOP;
        /*0100*/                   NOP;
.L_x_4:
"""
NESTED_LOOPS = (Loop("outer", 5, body=(Loop("inner", 3),)),)
# straight 2 + 3 (forward branch, store, exit) = 5; outer own 5 x 5 trips = 25; inner 4 x 15 = 60
NESTED_BY_HAND = 5 + 5 * 5 + 4 * 5 * 3


def test_weighted_count_by_hand():
    insns, loops = cc.parse_sass(NESTED)
    assert len(insns) == 14  # the trap and the padding are not instructions
    assert [(lp.start, lp.end, lp.shape()) for lp in loops] == [(2, 10, ((),))]
    counts, rows = cc.weighted_counts(insns, loops, NESTED_LOOPS, "k")
    assert sum(counts.values()) == NESTED_BY_HAND == 90
    assert counts["HMMA.16816.F32"] == 15 and counts["STG.E"] == 1 and counts["LDG.E"] == 5
    assert [(r["name"], r["trips"], r["instructions"], r["executions"]) for r in rows] == [
        ("outer", 5, 9, 5),
        ("inner", 3, 4, 15),
    ]
    assert cc.instruction_mix(counts)["tensor core"] == 15


def test_issue_time_by_hand():
    # 264 programs of 4 warps on H100 (132 SMs): two full waves, q = 1. Each warp issues 90
    # instructions; the SMs issue 4 warp-instructions per clock each:
    #   t_issue = 264 * 4 * 90 / (4 * 132 * clock) = 180 / clock,  clock = 989.4e12 / (132 * 4096) at the
    # low end (the datasheet peak's clock) and 1.755 GHz (sustained) at the high end
    clock = 989.4e12 / (132 * 4096)
    assert H100.clock_hz == pytest.approx(clock)
    insns, loops = cc.parse_sass(NESTED)
    counts, _ = cc.weighted_counts(insns, loops, NESTED_LOOPS, "k")
    cost = KernelCost(useful_macs=10**6, mma_macs=10**7, dram_bytes=10**5, loops=NESTED_LOOPS)
    e = estimate_launch(
        index=0,
        block="b",
        kernel="k",
        variant=0,
        grid=(132, 2),
        num_warps=4,
        occupancy=2,
        insns_per_warp=sum(counts.values()),
        cost=cost,
        target=H100,
    )
    assert e.waves == 1.0 and e.rounds == 1
    assert e.t_issue == e.terms["issue"]["low"] == pytest.approx(180 / clock)
    assert e.terms["issue"]["high"] == pytest.approx(180 / 1.755e9)
    assert e.terms["tensor"]["low"] == pytest.approx(2e7 / 989.4e12)  # 20 ns
    assert e.terms["tensor"]["high"] == pytest.approx(2e7 / 794.5e12)  # best measured matmul rate
    assert e.terms["dram"]["low"] == pytest.approx(1e5 / 3.35e12)  # 30 ns, under the 98 ns of issue
    assert e.terms["dram"]["high"] == pytest.approx(1e5 / (0.81 * 3.35e12))
    # no SASS given: no L2 traffic, no latency floor
    assert e.terms["l2"] == e.terms["latency"] == e.terms["waits"] == {"low": 0.0, "high": 0.0}
    assert e.predicted("low", None) == e.t_issue and e.bound("low") == e.bound("high") == "issue"
    # plus the launch gap: 1.26-1.37 us in a CUDA graph, 2.43-2.52 us from a stream
    assert e.predicted("low") == pytest.approx(180 / clock + 1.26e-6)
    assert e.predicted("high", "stream") == pytest.approx(180 / 1.755e9 + 2.52e-6)


# ptxas's form of a small runtime loop: a main loop doing 4 source iterations per trip (it counts the
# remaining iterations down by 4 while more than 3 are left), then a remainder loop (1 per trip).
UNROLLED = """
        /*0000*/                   MOV R8, c[0x0][0x220] ;
        /*0010*/                   ISETP.GT.U32.AND P1, PT, R8, 0x3, PT ;
        /*0020*/              @!P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0030*/                   LDG.E R15, desc[UR10][R14.64] ;
        /*0040*/                   LDG.E R5, desc[UR10][R4.64] ;
        /*0050*/                   LDG.E R11, desc[UR10][R10.64] ;
        /*0060*/                   LDG.E R17, desc[UR10][R16.64] ;
        /*0070*/                   IADD3 R8, P1, R8, -0x4, RZ ;
        /*0080*/                   ISETP.GT.U32.AND P1, PT, R8, 0x3, PT ;
        /*0090*/                   FADD R6, R15, R6 ;
        /*00a0*/               @P1 BRA `(.L_x_2) ;
.L_x_1:
        /*00b0*/                   ISETP.NE.U32.AND P0, PT, R8, RZ, PT ;
        /*00c0*/              @!P0 BRA `(.L_x_0) ;
.L_x_4:
        /*00d0*/                   LDG.E R5, desc[UR10][R4.64] ;
        /*00e0*/                   IADD3 R8, P0, R8, -0x1, RZ ;
        /*00f0*/                   ISETP.NE.U32.AND P0, PT, R8, RZ, PT ;
        /*0100*/               @P0 BRA `(.L_x_4) ;
.L_x_0:
        /*0110*/                   STG.E desc[UR10][R2.64], R6 ;
        /*0120*/                   EXIT ;
"""


@pytest.mark.parametrize("trips", [3, 4, 7, 9])
def test_ptxas_unrolled_loop_by_hand(trips):
    insns, loops = cc.parse_sass(UNROLLED)
    assert (
        len(loops) == 2
        and cc.unroll_factor(insns, loops[0]) == 4
        and cc.unroll_factor(insns, loops[1]) is None
    )
    counts, rows = cc.weighted_counts(insns, loops, (Loop("rows", trips),), "k")
    # straight 3 + 2 + 2 = 7; main loop 8 instructions, trips // 4 times; remainder 4, trips % 4 times
    assert sum(counts.values()) == 7 + 8 * (trips // 4) + 4 * (trips % 4)
    assert counts["LDG.E"] == 4 * (trips // 4) + trips % 4 == trips  # one load per source iteration
    assert rows[0]["unroll"] == 4 and rows[0]["name"] == "rows (unrolled x4 by ptxas)"


def test_declared_loops_that_do_not_match_the_sass_are_an_error():
    insns, loops = cc.parse_sass(NESTED)
    # a SASS loop without a declared one, or nested otherwise than declared
    for declared in ((Loop("only", 5),), (Loop("a", 5), Loop("b", 3)), (), (Loop("i", 3), Loop("o", 5))):
        with pytest.raises(
            ValueError,
            match=r"my_kernel: the compiled SASS has loops \(\(\(\)\)\) but the launcher "
            r"declares .*update the declaration \(KernelCost\.loops\)",
        ):
            cc.weighted_counts(insns, loops, declared, "my_kernel")
    # a declared loop may be missing from the SASS: one trip (its bound specialised to 1), or unrolled away
    # by the compiler; its body counts as straight-line code, and the report lists it
    counts, _ = cc.weighted_counts(insns, loops, (Loop("batch", 1, body=NESTED_LOOPS),), "k")
    assert sum(counts.values()) == NESTED_BY_HAND
    w = cc.weigh(insns, loops, (Loop("o", 5, (Loop("i", 3, (Loop("taps", 9),)),)),), num_warps=4)
    assert w.per_warp == NESTED_BY_HAND and w.unrolled_away == ["taps"]


def test_ambiguous_loop_matching_is_decided_by_the_tensor_core_work():
    # One SASS loop holding one HMMA; declared: a 9-trip tap loop (which the compiler may unroll
    # completely) followed by a 1-trip chunk loop (which may vanish): either may be the SASS loop.
    listing = """
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/               @P0 BRA `(.L_x_0) ;
        /*0030*/                   EXIT ;
"""
    insns, loops = cc.parse_sass(listing)
    declared = (Loop("taps", 9), Loop("chunks", 1))
    per_hmma = 16 * 8 * 16 * 4  # MACs of one m16n8k16 per warp, 4 warps
    # without the check: the fewest loops unrolled away (the SASS loop is the tap loop)
    assert cc.weigh(insns, loops, declared, num_warps=4).per_warp == 2 + 9 * 2
    # the code issues one HMMA per program: the SASS loop is the chunk loop, the taps were unrolled
    w = cc.weigh(insns, loops, declared, num_warps=4, mma_macs_per_program=per_hmma)
    assert w.per_warp == 4 and w.tensor_macs == per_hmma and w.unrolled_away == ["taps"]
    w = cc.weigh(insns, loops, declared, num_warps=4, mma_macs_per_program=9 * per_hmma)
    assert w.per_warp == 20 and w.tensor_macs == 9 * per_hmma and w.unrolled_away == []
    # work divided unevenly (10 chunks in groups of 3, 3, 3, 1): the declaration's MACs are the programs'
    # average, the loop's trips the busiest program's, so no matching is exact; the nearest is taken
    declared = (Loop("taps", 9), Loop("chunks", 3))
    w = cc.weigh(insns, loops, declared, num_warps=4, mma_macs_per_program=2.5 * per_hmma)
    assert w.per_warp == 2 + 3 * 2 and w.unrolled_away == ["taps"]
    w = cc.weigh(insns, loops, declared, num_warps=4, mma_macs_per_program=6 * per_hmma)
    assert w.per_warp == 2 + 9 * 2 and w.unrolled_away == ["chunks"]
    with pytest.raises(ValueError, match="in 2 ways that weigh it differently"):  # equally near: a tie
        cc.weigh(insns, loops, declared, num_warps=4, mma_macs_per_program=27 ** 0.5 * per_hmma)
    # a loop whose bound the compiler cannot see (fixed) is compiled even at one trip: never elided
    w = cc.weigh(insns, loops, (Loop("taps", 9, fixed=True), Loop("chunks", 3)), num_warps=4,
                 mma_macs_per_program=2.5 * per_hmma)
    assert w.per_warp == 2 + 9 * 2 and w.unrolled_away == ["chunks"]  # not the nearer chunk reading
    # HGMMA: once per warpgroup of four warps
    counts = {"HGMMA.64x128x16.F32": 3, "HMMA.1688.F32.TF32": 2, "FFMA": 7}
    assert cc.tensor_macs_per_program(counts, 8) == 3 * 64 * 128 * 16 * 2 + 2 * 16 * 8 * 8 * 8
    assert cc.tensor_macs_per_program({"IMMA.16832.S8.S8": 1}, 4) is None


# ---------------------------------------------------------------------------------------- aggregation


def _launch(index, block, grid, warps, insns, cost):
    return estimate_launch(
        index=index,
        block=block,
        kernel=f"k{index}",
        variant=0,
        grid=grid,
        num_warps=warps,
        occupancy=2,
        insns_per_warp=insns,
        cost=cost,
        target=H100,
    )


# the constants at each end, typed again from their sources (analysis/hardware.py)
R = {"low": 989.4e12, "high": 794.5e12}
B = {"low": 3.35e12, "high": 0.81 * 3.35e12}
L2 = {"low": 10.2e12, "high": 6.9e12}
CLOCK = {"low": 989.4e12 / (132 * 4096), "high": 1.755e9}
GRAPH = {"low": 1.26e-6, "high": 1.37e-6}
STREAM = {"low": 2.43e-6, "high": 2.52e-6}


def test_aggregation_by_hand():
    # waterline kernels: "stages.0.1" must not collect "stages.0.10.*"
    layer = [
        Kernel("stem.conv", "conv", "stem", 1000, 5000),
        Kernel("stages.0.1.conv", "grouped", "stage1", 3000, 7000),
        Kernel("stages.0.1.proj", "pointwise", "stage1", 4000, 9000),
        Kernel("stages.0.10.conv", "grouped", "stage1", 2000, 4000),
        Kernel("classifier", "linear", "head", 500, 900),
    ]
    fused = [
        Kernel("stem", "stem-fused", "stem", 1000, 3000),
        Kernel("stages.0.1", "convfirst-fused", "stage1", 7000, 6000),
        Kernel("stages.0.10", "convfirst-fused", "stage1", 2000, 3500),
        Kernel("classifier", "linear", "head", 500, 900),
    ]
    c0 = KernelCost(useful_macs=1000, mma_macs=0, dram_bytes=3000)
    c1 = KernelCost(useful_macs=6000, mma_macs=12000, dram_bytes=5000)
    c2 = KernelCost(useful_macs=1000, mma_macs=3000, dram_bytes=2000)
    c3 = KernelCost(useful_macs=2000, mma_macs=2000, dram_bytes=3500)
    launches = [
        _launch(0, "stem", (133,), 4, 100, c0),  # 133 programs: q = 264 / 133
        _launch(1, "stages.0.1", (264,), 8, 1000, c1),
        _launch(2, "stages.0.1", (1,), 4, 50, c2),  # one program: q = 132
        _launch(3, "stages.0.10", (132, 3), 4, 10, c3),
    ]
    assert launches[0].waves == pytest.approx(264 / 133) == waves_factor(133, 132)
    assert launches[2].waves == 132.0
    assert launches[3].waves == 1.0
    shapes = ((264 / 133, 133, 4, 100), (1, 264, 8, 1000), (132, 1, 4, 50), (1, 396, 4, 10))
    pred, stream = [], []
    for e, (q, p, w, n), macs, nbytes in zip(
        launches, shapes, (0, 12000, 3000, 2000), (3000, 5000, 2000, 3500)
    ):
        for end in ("low", "high"):
            issue = q * p * w * n / (4 * 132 * CLOCK[end])
            tensor = q * 2 * macs / R[end]
            dram = nbytes / B[end]
            assert (e.terms["issue"][end], e.terms["tensor"][end], e.terms["dram"][end]) == pytest.approx(
                (issue, tensor, dram)
            )
        pred.append(
            {
                end: max(e.terms[t][end] for t in ("issue", "tensor", "dram")) + GRAPH[end]
                for end in ("low", "high")
            }
        )
        stream.append({end: pred[-1][end] - GRAPH[end] + STREAM[end] for end in ("low", "high")})

    def lw(ks, end, gap=GRAPH):  # the layer-wise bound with the same constants
        return sum(max(2 * k.macs / R[end], k.bytes / B[end], k.bytes / L2[end]) + gap[end] for k in ks)

    agg = aggregate(launches, layer, fused, H100)
    blocks = {b["path"]: b for b in agg["blocks"]}
    b1 = blocks["stages.0.1"]
    assert b1["launch_indices"] == [1, 2] and b1["layerwise_kernel_names"] == [
        "stages.0.1.conv",
        "stages.0.1.proj",
    ]
    assert b1["useful_macs"] == 7000 and b1["mma_macs"] == 15000 and b1["dram_bytes"] == 7000
    for end in ("low", "high"):
        assert b1["predicted_ms"][end] == pytest.approx((pred[1][end] + pred[2][end]) * 1e3)
        assert b1["predicted_stream_ms"][end] == pytest.approx((stream[1][end] + stream[2][end]) * 1e3)
        assert b1["launch_gap_ms"][end] == pytest.approx(2 * GRAPH[end] * 1e3)
        assert b1["layerwise_ms"][end] == pytest.approx(lw(layer[1:3], end) * 1e3)
        assert b1["layerwise_stream_ms"][end] == pytest.approx(lw(layer[1:3], end, STREAM) * 1e3)
    assert b1["terms_ms"]["issue"]["low"] == pytest.approx(
        (launches[1].terms["issue"]["low"] + launches[2].terms["issue"]["low"]) * 1e3
    )
    assert b1["fusion_ideal_ms"] == pytest.approx(max(14000 / 989.4e12, 6000 / 3.35e12) * 1e3)
    assert b1["bound"] == max(("issue", "tensor"), key=lambda t: launches[1].terms[t]["high"])
    assert blocks["stages.0.10"]["layerwise_kernel_names"] == ["stages.0.10.conv"]
    assert blocks["stem"]["issued_over_useful"] == 0.0
    cls = blocks["classifier"]  # no Triton kernel: its layer-wise figures (launch gap included), labelled
    assert cls["launches"] == 0 and cls["implemented_by"].startswith("waterline bound")
    for end in ("low", "high"):
        assert cls["predicted_ms"][end] == pytest.approx(lw(layer[4:], end) * 1e3) == cls["layerwise_ms"][end]

    stages = {s["stage"]: s for s in agg["stages"]}
    assert list(stages) == ["stem", "stage1", "head"]
    s1 = stages["stage1"]
    assert s1["blocks"] == ["stages.0.1", "stages.0.10"] and s1["launches"] == 3
    for end in ("low", "high"):
        assert s1["predicted_ms"][end] == pytest.approx(sum(p[end] for p in pred[1:]) * 1e3)
        assert s1["layerwise_ms"][end] == pytest.approx(lw(layer[1:4], end) * 1e3)
        assert s1["predicted_over_layerwise"][end] == pytest.approx(
            s1["predicted_ms"][end] / s1["layerwise_ms"][end]
        )
    assert s1["issued_over_useful"] == pytest.approx(17000 / 9000)
    total = agg["total"]
    assert total["useful_macs"] == 10500
    for end in ("low", "high"):
        assert total["predicted_ms"][end] == pytest.approx(
            sum(p[end] for p in pred) * 1e3 + cls["predicted_ms"][end]
        )
        assert total["layerwise_ms"][end] == pytest.approx(lw(layer, end) * 1e3)
    assert total["fusion_ideal_ms"] == pytest.approx(sum(k.t_min(H100.device) for k in fused) * 1e3)

    # declarations that do not add up to the block's MACs, launches outside every block, blocks
    # without launches: errors that say what to fix
    wrong = launches[:3] + [_launch(3, "stages.0.10", (132,), 4, 10, KernelCost(1999, 0, 1))]
    with pytest.raises(
        ValueError, match=r"block stages\.0\.10: .* declare 1,999 useful MACs .* computes 2,000"
    ):
        aggregate(wrong, layer, fused, H100)
    with pytest.raises(ValueError, match=r"kernel k9 was launched from module 'neck'"):
        aggregate(launches + [_launch(9, "neck", (1,), 4, 1, c0)], layer, fused, H100)
    with pytest.raises(ValueError, match=r"block stages\.0\.10 \(convfirst-fused\) made no kernel launch"):
        aggregate(launches[:3], layer, fused, H100)


def test_scratch_counts_as_dram_when_it_cannot_stay_in_l2():
    small = KernelCost(1, 0, 1000, l2_bytes=10**9, scratch_bytes_per_program=1024)
    big = KernelCost(1, 0, 1000, l2_bytes=10**9, scratch_bytes_per_program=H100.l2_bytes // 100)
    fits = _launch(0, "b", (10**4,), 4, 1, small)  # 2 programs x 132 SMs x 1 KB resident: in L2
    spills = _launch(1, "b", (10**4,), 4, 1, big)  # 264 x L2/100 > L2
    assert fits.scratch_in_l2 and fits.dram_bytes == 1000
    assert not spills.scratch_in_l2 and spills.dram_bytes == 1000 + 10**9


# ---------------------------------------------------------------------- a real kernel, compiled for sm_90


@triton.jit
def _dot_loop_kernel(a_ptr, b_ptr, out_ptr, K, BLOCK: tl.constexpr):
    """Test-only: out[rows, :] = a[rows, :K] @ b, one runtime loop over K in steps of 16."""
    pid = tl.program_id(0)
    rm = pid * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, 16)
    rn = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, 16):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        b = tl.load(b_ptr + (k0 + rk)[:, None] * BLOCK + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + rm[:, None] * BLOCK + rn[None, :], acc)


def _record_dot_loop(k: int, loops):
    a = torch.empty(256, k, device="meta", dtype=torch.float16)
    b = torch.empty(k, 64, device="meta", dtype=torch.float16)
    out = torch.empty(256, 64, device="meta", dtype=torch.float32)
    with recording() as rec:
        rec.block = "blk"
        launch(
            _dot_loop_kernel,
            (4,),
            a,
            b,
            out,
            k,
            BLOCK=64,
            num_warps=4,
            num_stages=1,
            cost=None
            if loops is None
            else lambda: KernelCost(
                256 * 64 * k,
                256 * 64 * 16 * (k // 16),
                (a.numel() + b.numel()) * 2 + out.numel() * 4,
                loops=loops,
            ),
        )
    return rec.launches


def _hand_count(listing: str, trips: int) -> tuple[int, int, int]:
    """Read the listing without the parser: instruction lines before the trap, the loop as the lines
    from the one label that a later branch targets to that branch. Returns (total, body, weighted)."""
    lines = []
    labels = {}
    for line in listing.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line):
            labels[m.group(1)] = len(lines)
        elif re.match(r"^\s+/\*[0-9a-f]+\*/\s+\S", line):
            if "BRA" in line and labels.get(re.search(r"\((\.L_x_\d+)\)", line).group(1)) == len(lines):
                break  # the trap after EXIT: nothing after it runs
            lines.append(line)
    back = [
        (labels[t], i)
        for i, line in enumerate(lines)
        if "BRA" in line
        for t in re.findall(r"\((\.L_x_\d+)\)", line)
        if labels.get(t, len(lines)) <= i
    ]
    assert len(back) == 1, back
    start, end = back[0]
    body = end - start + 1
    return len(lines), body, len(lines) - body + trips * body


@pytest.fixture(scope="module")
def compiled_cache():
    return {}  # variant key -> compiled result, shared by the tests of this module (one compile each)


@pytest.fixture(scope="module")
def dot_loop_estimate(compiled_cache):
    recorded = _record_dot_loop(80, (Loop("K steps", 5),))
    return launches.estimate_launches(recorded, "sm_90", compiled=compiled_cache)


@pytest.mark.compile
def test_real_kernel_issue_count_by_hand(dot_loop_estimate):
    est = dot_loop_estimate
    (v,) = est.variants
    (e,) = est.launches
    assert v["mma_kind"] == "wgmma" and v["uses"][0]["loops"][0]["trips"] == 5
    total, body, weighted = _hand_count(est.compiled[0].sass, 5)
    assert v["sass_instructions"] == total and body > 10
    assert e.insns_per_warp == weighted
    # 4 programs of 4 warps on 132 SMs: q = 33
    assert e.waves == 33 and e.t_issue == pytest.approx(33 * 4 * 4 * weighted / (4 * 132 * H100.clock_hz))


@pytest.mark.compile
def test_the_run_compiles_a_variant_once(dot_loop_estimate):
    """The test run is one ``compile_session`` (conftest): a variant compiled before comes back as it was,
    and a variant given twice is compiled once."""
    first = dot_loop_estimate.compiled[0]
    assert all(c is first for c in cc.compile_variants([first.variant, first.variant]))


@triton.jit
def _refused_kernel(out_ptr, BLOCK: tl.constexpr):
    """Test-only: does not compile for BLOCK != 32 (a static assertion)."""
    tl.static_assert(BLOCK == 32)
    tl.store(out_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), dtype=tl.float32))


@pytest.mark.compile
def test_a_variant_that_does_not_compile_is_named_and_the_workers_carry_on(dot_loop_estimate):
    out = torch.empty(64, device="meta", dtype=torch.float32)
    with recording() as rec:
        launch(_refused_kernel, (1,), out, BLOCK=64, cost=None)
    refused = cc.variant_of(rec.launches[0], 90)
    with pytest.raises(RuntimeError, match=r"_refused_kernel \{'BLOCK': 64\} for sm_90 does not compile: "):
        cc.compile_variants([refused])
    first = dot_loop_estimate.compiled[0]  # the session's workers still compile, and remember
    (again,) = cc.compile_variants([cc.variant_of(_record_dot_loop(80, ())[0], 80)])
    assert again.variant.arch == 80 and cc.compile_variants([first.variant]) == [first]


@pytest.mark.compile
def test_real_kernel_errors(dot_loop_estimate, compiled_cache):
    with pytest.raises(
        ValueError, match=r"no cost declaration for tests\.test_kernel_report\._dot_loop_kernel"
    ):
        launches.estimate_launches(_record_dot_loop(80, None), "sm_90")
    with pytest.raises(
        ValueError,
        match=r"_dot_loop_kernel .*block blk.* has loops \(\(\)\) but the launcher "
        r"declares \(\) \(no loops\).*KernelCost\.loops",
    ):
        launches.estimate_launches(_record_dot_loop(80, ()), "sm_90", compiled=compiled_cache)


# --------------------------------------------------------------------- end to end: a stem + ConvFirst stack


@pytest.fixture(scope="module")
def stack_report():
    from convfirstnet.blocks import ConvFirst, Stem
    from convfirstnet.kernels.convfirst import launcher

    model = torch.nn.Sequential(Stem(3, 16), ConvFirst(16, 16, 1, 3))
    lines = []
    # one launch per block: the fused ConvFirst kernel (16-bit stride-1 blocks ship as conv + FFN)
    saved, launcher.STAGED = launcher.STAGED, False
    try:
        rep = report.build_report(model, (3, 32, 32), batch=2, arch="sm_90", progress=lines.append,
                                  name="stack")
    finally:
        launcher.STAGED = saved
    return model, rep, lines


@pytest.mark.compile
def test_end_to_end_stack(stack_report, tmp_path):
    from convfirstnet.profile import count_macs

    model, rep, lines = stack_report
    assert lines[0] == "recorded 2 launches" and re.match(r"  \[2/2\] _", lines[-1])
    assert (
        rep["format"] == report.FORMAT
        and rep["target"]["arch"] == 90
        and rep["target"]["device_key"] == "h100"
    )
    assert rep["versions"]["triton"] == triton.__version__ and rep["versions"]["torch"] == torch.__version__
    assert rep["launch_count"] == 2 and rep["variant_count"] == 2
    blocks = {b["path"]: b for b in rep["blocks"]}
    assert list(blocks) == ["0", "1"] and blocks["1"]["kind"] == "convfirst-fused"
    assert sum(b["useful_macs"] for b in rep["blocks"]) == count_macs(model, (3, 32, 32)) * 2
    ends = ("low", "high")
    for row in rep["stages"] + [rep["total"]] + rep["blocks"]:  # one launch per block: its terms and gap
        for end in ends:
            tm = row["terms_ms"]
            slowest = max(
                tm["tensor"][end],
                tm["dram"][end],
                tm["l2"][end],
                tm["lsu"][end],
                tm["issue"][end],
                tm["latency"][end] + tm["waits"][end],
            )
            assert row["layerwise_ms"][end] > 0
            assert slowest <= row["predicted_ms"][end] - row["launch_gap_ms"][end] + 1e-12
            if row in rep["blocks"]:
                assert row["predicted_ms"][end] == pytest.approx(slowest + row["launch_gap_ms"][end])
        assert row["predicted_ms"]["low"] <= row["predicted_ms"]["high"] <= row["predicted_stream_ms"]["high"]
    assert rep["stages"][0]["stage"] == "block" and rep["predicted_ms"] == rep["total"]["predicted_ms"]["low"]
    assert (rep["predicted_low_ms"], rep["predicted_high_ms"]) == tuple(rep["total"]["predicted_ms"].values())
    # whatever the kernels are: one or more variants per block kind, resources read, terms per the model
    kinds = {v["kernel"].split(".")[2] for v in rep["variants"]}
    assert kinds == {"stem", "convfirst"}  # convfirstnet.kernels.<block>.<module>.<function>
    for v in rep["variants"]:
        assert v["regs"] > 0 and v["programs_per_sm"] >= 1 and v["sass_instructions"] > 0
        assert v["mma_kind"] in ("wgmma", "mma.sync", "wgmma+mma.sync", "none") and v["uses"]
    t = rep["target"]
    for e in rep["launches"]:
        assert e["programs"] == math.prod(e["grid"]) and e["block"] in blocks
        q = math.ceil(e["programs"] / t["sms"]) * t["sms"] / e["programs"]
        assert e["waves_factor"] == pytest.approx(q)
        rounds = math.ceil(math.ceil(e["programs"] / t["sms"]) / e["programs_per_sm"])
        assert e["rounds"] == rounds
        tu, tr, lat = e["terms_us"], e["traffic_per_program"], e["latency_per_warp"]
        for end in ends:
            clock = CLOCK[end]
            assert tu["issue"][end] == pytest.approx(
                1e6 * q * e["programs"] * e["num_warps"] * e["insns_per_warp"] / (4 * t["sms"] * clock)
            )
            dense = e["mma_macs"] - e["mma_sync_macs"] + e["mma_sync_macs"] / 0.63
            assert tu["tensor"][end] == pytest.approx(1e6 * q * dense * 2 / R[end])
            assert tu["dram"][end] == pytest.approx(1e6 * e["dram_bytes"] / B[end])
            assert tu["l2"][end] == pytest.approx(1e6 * e["l2_bytes"][end] / L2[end])
            sharing = min(e["programs_per_sm"], math.ceil(e["programs"] / t["sms"])) * e["num_warps"] / 4
            assert e["warps_per_scheduler"] == pytest.approx(sharing)
            assert tu["latency"][end] == pytest.approx(1e6 * rounds * sharing * lat["stall_cycles"] / clock)
            assert tu["waits"][end] == pytest.approx(1e6 * rounds * sharing * lat["wait_cycles"][end] / clock)
            # the L1/shared data pipe: the busiest SM's programs' wavefronts at one per cycle
            lsu = tr["shared_wavefronts"] + tr["shared_conflict_wavefronts"] + tr["global_wavefronts"]
            assert tr["lsu_wavefronts"] == pytest.approx(lsu) and tr["global_wavefronts"] > 0
            assert tu["lsu"][end] == pytest.approx(1e6 * math.ceil(e["programs"] / t["sms"]) * lsu / clock)
            assert e["predicted_us"][end] == pytest.approx(
                max(
                    tu["issue"][end],
                    tu["tensor"][end],
                    tu["dram"][end],
                    tu["l2"][end],
                    tu["lsu"][end],
                    tu["latency"][end] + tu["waits"][end],
                )
                + 1e6 * GRAPH[end]
            )
        # L2 bytes: everything the SASS requests, L1 loads as declared where their working set fits
        l1 = tr["load_l1"]
        if e["l1_fits"]:
            l1 = min(l1, e["declaration"]["l1_unique_bytes_per_program"])
        assert e["l2_bytes"]["low"] == pytest.approx(
            e["programs"] * (tr["load_bypass"] + l1 + tr["store"] + tr["atomic"])
        )
        assert lat["stall_cycles"] >= e["insns_per_warp"]  # every instruction stalls at least a cycle
    assert blocks["1"]["layerwise_kernel_names"] == ["1.conv_dw", "1.conv_expand", "1.conv_project"]

    # the calibration band (benchmarks/calibration/h100.json) widens the sm_90 totals
    from convfirstnet.analysis.calibration import calibrated

    cal = rep["calibration"]
    assert cal["predicted_ms"] == pytest.approx(calibrated(rep["predicted_low_ms"], rep["predicted_high_ms"]))
    text = report.to_markdown(rep)
    assert "**Calibrated: " in text and "calibrated band = [low x 1.00, high x 1.38]" in text
    diag = report.diagnosis(rep)
    assert "| 1 | convfirst-fused |" in diag and "* model high end <= 2.5 ms: " in diag
    assert "* no spills: met." in diag or "* no spills: missed by variant" in diag
    # the design floor hides latency, issue and waits: never above the prediction, never below its terms
    floor, floor_l2 = report.design_floor_ms(rep)
    assert max(e["terms_us"]["dram"]["high"] for e in rep["launches"]) / 1e3 < floor <= floor_l2
    assert floor_l2 <= rep["predicted_high_ms"] + 1e-9 and f"plus its launch gap): {floor:.3f} ms" in diag
    assert "| **model** |" in text and "| 1 | convfirst-fused | 1 |" in text
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rep))
    assert report.static_latencies(tmp_path, "h100", 2, 32)["stack"]["predicted_ms"] == rep["predicted_ms"]
    assert report.static_latencies(tmp_path, "a100", 2, 32) == {}
    assert report.static_latencies(path, "h100", 128, 32) == {}


def test_cli_refuses_bad_arguments_before_compiling(capsys):
    from convfirstnet.commands import cli

    for args, msg in (
        (["--arch", "sm_75"], "unknown GPU target 'sm_75'"),
        (["--arch", "sm_70"], "unknown GPU target 'sm_70'"),
        (["--arch", "hopper"], "unknown GPU target 'hopper'; known: sm_90, sm_80"),
        (["--arch", "sm_9x"], "unknown GPU target 'sm_9x'; known: sm_90, sm_80"),
        (["--model", "huge"], "unknown model 'huge'"),
        (["--img-size", "16"], "--img-size must be at least 32"),
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--batch", "0"], "batch must be at least 1"),
    ):
        # bad input ends like every other command's: one line, exit status 1
        assert cli.main(["kernels", "--model", "pico", *args]) == 1
        err = capsys.readouterr().err
        assert err.startswith("convfirstnet kernels: error: ") and msg in err and err.count("\n") == 1


class _NotRecordable(torch.nn.Module):
    """A model whose forward cannot run on meta tensors (or that makes no fused launch)."""

    in_chans = 3

    def __init__(self, fail: bool):
        super().__init__()
        self.fail = fail

    def forward(self, x):
        if self.fail:
            raise NotImplementedError("this op has no meta kernel")
        return x.mean()


@pytest.mark.parametrize(
    "fail, msg",
    [
        (
            True,
            "cannot record the kernel launches of convfirstnet_pico (float16, batch 128, 256x256): "
            "NotImplementedError: this op has no meta kernel",
        ),
        (False, "convfirstnet_pico made no Triton kernel launch while recording"),
    ],
)
def test_cli_refuses_a_model_it_cannot_record(capsys, monkeypatch, fail, msg):
    from convfirstnet.analysis import report
    from convfirstnet.commands import cli, kernels

    monkeypatch.setattr(kernels, "create_model", lambda name: _NotRecordable(fail))
    monkeypatch.setattr(report, "fuse", lambda model: model)  # as if it were fused: the forward fails
    assert cli.main(["kernels", "--model", "pico"]) == 1
    err = capsys.readouterr().err
    # one line, before anything is compiled (no progress lines)
    assert err.startswith("convfirstnet kernels: error: ") and msg in err and err.count("\n") == 1


def test_cli_refuses_a_model_it_cannot_fuse(capsys, monkeypatch):
    from convfirstnet.commands import cli, kernels

    monkeypatch.setattr(kernels, "create_model", lambda name: _NotRecordable(False))
    assert cli.main(["kernels", "--model", "pico"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("convfirstnet kernels: error: cannot record the kernel launches of convfirstnet_pico")
    assert "TypeError" in err and "no ConvFirstNet block to fuse" in err and err.count("\n") == 1


def test_cli_reports_an_ambiguous_loop_matching_in_one_line(capsys, monkeypatch):
    # one SASS loop; declared: a 3-trip and a 5-trip loop, either of which the compiler may have unrolled
    # away: two matchings that weigh the listing differently (3 or 5 trips of the body)
    from convfirstnet.commands import cli, kernels

    listing = """
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0010*/                   FFMA R1, R1, R1, R1 ;
        /*0020*/               @P0 BRA `(.L_x_0) ;
        /*0030*/                   EXIT ;
"""

    def ambiguous(*args, **kwargs):
        insns, loops = cc.parse_sass(listing)
        cc.weigh(insns, loops, (Loop("a", 3), Loop("b", 5)), num_warps=4, what="kernel k (bfloat16)")

    monkeypatch.setattr(kernels, "build_report", ambiguous)
    assert cli.main(["kernels", "--model", "pico", "--dtype", "bfloat16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("convfirstnet kernels: error: kernel k (bfloat16): the declared loops (a, b) fit ")
    assert "in 2 ways that weigh it differently" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def pico_analysis():
    from convfirstnet.analysis import waterline

    return waterline.analyze("pico", "h100", batch=8, resolution=64)


def test_gap_plot_draws_the_static_estimate(tmp_path, monkeypatch, pico_analysis):
    pytest.importorskip("matplotlib")
    from convfirstnet.commands import waterline

    a = pico_analysis
    figures = []
    real = waterline._pyplot

    def keep():
        plt = real()
        figures.append(plt)
        return plt

    monkeypatch.setattr(waterline, "_pyplot", keep)
    monkeypatch.setattr("matplotlib.pyplot.close", lambda fig=None: None)
    waterline.plot_efficiency_gap([a], tmp_path / "gap.png", static={"convfirstnet_pico": 3.0})
    fig = figures[0].gcf()
    monkeypatch.undo()
    label = "fused kernels as compiled (static estimate)"
    assert label in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == label)
    assert list(line.get_xdata()) == [3.0]
    figures[0].close(fig)


def test_waterline_gap_plot_reads_saved_reports(tmp_path, capsys, monkeypatch, pico_analysis):
    pytest.importorskip("matplotlib")
    from convfirstnet.commands import waterline

    monkeypatch.setattr(
        waterline, "analyze", lambda *args, **kwargs: pico_analysis
    )  # the plot, not the sizes

    def saved(name, model, created, ms, device_key="h100"):
        target = dict(arch=90, device_key=device_key)
        rep = dict(
            format=report.FORMAT,
            model=model,
            created=created,
            batch=8,
            img_size=256,
            elem_bytes=2,
            target=target,
            predicted_ms=ms,
            layerwise_ms=2 * ms,
        )
        (tmp_path / name).write_text(json.dumps(rep))

    saved("old.json", "convfirstnet_pico", "2026-01-01T00:00:00+00:00", 9.0)
    saved("new.json", "convfirstnet_pico", "2026-02-01T00:00:00+00:00", 4.0)
    saved("a100.json", "convfirstnet_nano", "2026-02-01T00:00:00+00:00", 5.0, device_key="a100")
    (tmp_path / "other.json").write_text(json.dumps({"mode": "network"}))
    png = tmp_path / "gap.png"
    args = [
        "--device",
        "h100",
        "--batch",
        "8",
        "--gap-plot",
        str(png),
        "--records",
        str(tmp_path / "none"),
        "--static-records",
        str(tmp_path),
    ]
    assert waterline.main(args) == 0
    out = capsys.readouterr().out
    assert "static estimates used: {'convfirstnet_pico': '4.000 ms (" in out and "nano" not in out
    assert png.read_bytes()[:4] == b"\x89PNG"
