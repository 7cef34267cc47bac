"""The cost model's readings of the compiled code (issue 18): control codes, the per-warp latency floor,
L2<->SM bytes and the L1 check, each against counts made by hand; and the control-code decoding against
a compiled dependent FFMA chain (one small sm_90 compile).
"""

import pytest
import torch
import triton
import triton.language as tl

from convfirstnet.analysis import compiled as cc
from convfirstnet.analysis import launches, sass
from convfirstnet.analysis.estimate import estimate_launch
from convfirstnet.analysis.hardware import hardware
from convfirstnet.analysis.targets import target
from convfirstnet.kernels._cost import KernelCost, Loop, recording
from convfirstnet.kernels._launch import launch

H100 = target("sm_90")
HW = hardware(90)


def ctl(stall, wbar=7, rbar=7, wait=0, yield_=False):
    """The high half of an encoding with these control fields (Volta+ layout, bit 105 onwards)."""
    c = stall | ((0 if yield_ else 1) << 4) | (wbar << 5) | (rbar << 8) | (wait << 11)
    return c << 41


def listing(rows) -> str:
    """An ``nvdisasm -c -hex`` listing: (label or None, instruction text, control high word)."""
    out = []
    addr = 0
    for label, text, high in rows:
        if label:
            out.append(f"{label}:")
        out.append(f"        /*{addr:04x}*/                   {text} ;      /* 0x0000000000000000 */")
        out.append(f"                                                      /* 0x{high:016x} */")
        addr += 16
    return "\n".join(out) + "\n"


def test_control_code_fields():
    # from the sm_90 listing of the stage-1 ConvFirst kernel: `LDC R1, c[0x0][0x28]` (high half
    # 0x000e700000000800): stall 8, write barrier 1; `LDC.64 R78, c[0x0][0x250]` sets barrier 2 and
    # `VIADD R2, R78, 0xf` (0x004fe20000000000), which reads R78, waits on scoreboard 2
    c = sass.Control.decode(0x000E700000000800)
    assert (c.stall, c.write_barrier, c.read_barrier, c.wait_mask, c.yield_) == (8, 1, 7, 0, False)
    c = sass.Control.decode(0x004FE20000000000)
    assert (c.stall, c.write_barrier, c.waits_on()) == (1, 7, [2])
    assert sass.Control.decode(ctl(4, wait=0b100)).waits_on() == [2]
    c = sass.Control.decode(ctl(13, wbar=3, rbar=5, wait=0b100001, yield_=True))
    assert (c.stall, c.write_barrier, c.read_barrier, c.waits_on(), c.yield_) == (13, 3, 5, [0, 5], True)


def test_memory_classification():
    assert sass.memory_op("LDGSTS.E.BYPASS.128") == sass.MemoryOp("load", 16, False)  # cp.async.cg: skips L1
    assert sass.memory_op("LDGSTS.E.BYPASS.128.ZFILL") == sass.MemoryOp("load", 16, False)
    assert sass.memory_op("LDGSTS.E.64") == sass.MemoryOp("load", 8, True)  # cp.async.ca: allocates in L1
    assert sass.memory_op("LDG.E.128") == sass.MemoryOp("load", 16, True)
    assert sass.memory_op("LDG.E.U16") == sass.MemoryOp("load", 2, True)
    assert sass.memory_op("LDG.E.STRONG.GPU") == sass.MemoryOp("load", 4, False)  # volatile: L2
    assert sass.memory_op("STG.E.128").kind == "store" and sass.memory_op("RED.E.ADD.F32").kind == "atomic"
    assert sass.memory_op("STL.64") == sass.MemoryOp("local", 8, True, "local")
    assert sass.memory_op("LDS.128") is None and sass.memory_op("FFMA") is None


# A loop of 3 trips: a cp.async.cg of 16 B per lane and an L1 load of 4 B; the L1 load's result is
# waited on 1 + 4 = 5 cycles after it issues; then a DEPBAR waits for the one cp.async group.
LOOP = [
    (None, "S2R R0, SR_TID.X", ctl(1, wbar=0)),
    (".L_x_0", "LDG.E R2, desc[UR4][R2.64]", ctl(1, wbar=1)),
    (None, "LDGSTS.E.BYPASS.128 [R5], desc[UR4][R6.64]", ctl(4)),
    (None, "FFMA R3, R2, R2, R3", ctl(4, wait=0b10)),
    (None, "LDGDEPBAR", ctl(1)),
    (None, "DEPBAR.LE SB0, 0x0", ctl(2)),
    (None, "STG.E.128 desc[UR4][R8.64], R12", ctl(1)),
    (None, "@P0 BRA `(.L_x_0)", ctl(5)),
    (None, "EXIT", ctl(5)),
]


def test_latency_floor_and_traffic_by_hand():
    insns, loops = cc.parse_sass(listing(LOOP))
    assert [i.control.stall for i in insns] == [1, 1, 4, 4, 1, 2, 1, 5, 5]
    w = cc.weigh(insns, loops, (Loop("k", 3),), num_warps=4)
    assert w.weights == [1, 3, 3, 3, 3, 3, 3, 3, 1]
    lat = {"low": 265.0, "high": 484.0}
    l1 = {"low": 34.0, "high": 34.0}
    mac = {"low": 2048.0, "high": 2048.0}
    f = sass.latency_floor(
        insns,
        [i.control for i in insns],
        w.weights,
        loops,
        l2_latency=lat,
        l1_latency=l1,
        wgmma_macs_per_cycle=mac,
        num_warps=4,
    )
    assert f.stall_cycles == 1 + 3 * (1 + 4 + 4 + 1 + 2 + 1 + 5) + 5
    # FFMA waits on the LDG issued 1 + 4 = 5 cycles before; the DEPBAR on the group committed by the
    # LDGDEPBAR just before it (1 cycle); each once per trip
    for end in ("low", "high"):
        assert f.wait_cycles[end] == 3 * ((lat[end] - 5) + (lat[end] - 1))
        # if the LDG hits L1 (its working set declared and fitting), its wait is an L1 hit's
        assert f.wait_cycles_l1_hit[end] == 3 * ((l1[end] - 5) + (lat[end] - 1))
    assert f.l2_waits == 6
    t = sass.traffic(insns, w.weights, num_warps=4)
    assert t.load_bypass == 3 * 16 * 32 * 4 and t.load_l1 == 3 * 4 * 32 * 4 and t.store == 3 * 16 * 32 * 4

    # the launch: 264 programs; the L1 loads count in full unless their declared working set fits
    def est(cost):
        return estimate_launch(
            index=0,
            block="b",
            kernel="k",
            variant=0,
            grid=(264,),
            num_warps=4,
            occupancy=2,
            insns_per_warp=w.per_warp,
            cost=cost,
            target=H100,
            traffic=t,
            latency=f,
            shared_bytes=100 * 1024,
        )

    plain = est(KernelCost(1, 0, 1000, loops=(Loop("k", 3),)))
    assert plain.l1_fits is None and plain.l2_bytes["low"] == 264 * (t.load_bypass + t.load_l1 + t.store)
    # 2 programs of 4 warps per SM: 2 warps per scheduler, whose stall and wait chains add
    assert plain.warps_per_scheduler == 2
    assert plain.terms["waits"]["low"] == pytest.approx(2 * f.wait_cycles["low"] / HW.clock_hz.fast)
    # two programs of 100 KB shared memory (+1 KB reserved each): carve-out 228 KB, 28 KB of L1 left,
    # 14 KB each
    fits = est(
        KernelCost(
            1, 0, 1000, loops=(Loop("k", 3),), l1_unique_bytes_per_program=512, l1_working_set_bytes=14 * 1024
        )
    )
    assert fits.l1_fits and fits.l2_bytes["low"] == 264 * (t.load_bypass + 512 + t.store)
    # the waits stay at the L2 round trip (an L1-hit price under-predicted the measured blocks)
    assert fits.terms["waits"]["high"] == pytest.approx(2 * f.wait_cycles["high"] / HW.clock_hz.slow)
    spills = est(
        KernelCost(
            1, 0, 1000, loops=(Loop("k", 3),), l1_unique_bytes_per_program=512, l1_working_set_bytes=15 * 1024
        )
    )
    assert spills.l1_fits is False and spills.l2_bytes == plain.l2_bytes
    assert HW.l1_bytes(2 * 101 * 1024) == 28 * 1024 and HW.l1_bytes(0) == 256 * 1024
    # the latency floor: one round (264 programs, 2 per SM), the stall chains of the 2 warps sharing a
    # scheduler at each end's clock
    assert plain.rounds == 1
    assert plain.terms["latency"]["high"] == pytest.approx(2 * f.stall_cycles / 1.755e9)
    # the L1/shared data pipe: 2 programs on the busiest SM, 3 trips x 4 warps x (LDG 1 + STG 4, and the
    # cp.async's 4 as it writes shared memory, counted once)
    assert t.global_wavefronts == 3 * 4 * 5 and t.shared_wavefronts == 3 * 4 * 4
    assert plain.terms["lsu"]["high"] == pytest.approx(2 * 3 * 4 * 9 / 1.755e9)


def test_wgmma_group_wait_by_hand():
    rows = [
        (None, "WARPGROUP.ARRIVE", ctl(1)),
        (None, "HGMMA.64x128x16.F32 R24, gdesc[UR4], R24", ctl(1)),
        (None, "HGMMA.64x128x16.F32 R24, gdesc[UR8], R24, gsb0", ctl(1)),
        (None, "WARPGROUP.DEPBAR.LE gsb0, 0x0", ctl(1)),
        (None, "EXIT", ctl(5)),
    ]
    insns, loops = cc.parse_sass(listing(rows))
    mac = {"low": 2048.0, "high": 1500.0}
    f = sass.latency_floor(
        insns,
        [i.control for i in insns],
        [1] * 5,
        loops,
        l2_latency={"low": 1, "high": 1},
        l1_latency={"low": 1, "high": 1},
        wgmma_macs_per_cycle=mac,
        num_warps=8,
    )
    # two 64x128x16 HGMMAs per warpgroup, two warpgroups sharing the SM's tensor cores; 2 cycles have
    # passed since the first HGMMA issued
    for end in ("low", "high"):
        assert f.wgmma_wait_cycles[end] == pytest.approx(2 * 64 * 128 * 16 * 2 / mac[end] - 2)
        assert f.wait_cycles[end] == f.wgmma_wait_cycles[end]


def test_loads_in_flight_together_are_waited_for_once():
    # two loads issued back to back, then waited on one after the other: the second wait finds its load
    # already back (the first wait covered it), so only the first is exposed
    rows = [
        (None, "LDG.E R2, desc[UR4][R2.64]", ctl(1, wbar=0)),
        (None, "LDG.E R3, desc[UR4][R4.64]", ctl(2, wbar=1)),
        (None, "FADD R5, R2, R2", ctl(4, wait=0b01)),
        (None, "FADD R6, R3, R3", ctl(4, wait=0b10)),
        (None, "EXIT", ctl(5)),
    ]
    insns, loops = cc.parse_sass(listing(rows))
    lat = {"low": 265.0, "high": 484.0}
    f = sass.latency_floor(
        insns,
        [i.control for i in insns],
        [1] * 5,
        loops,
        l2_latency=lat,
        l1_latency={"low": 34.0, "high": 34.0},
        wgmma_macs_per_cycle={"low": 1, "high": 1},
        num_warps=4,
    )
    for end in ("low", "high"):
        # the loads issue at cycles 0 and 1; the first FADD is ready at 3 and waits until lat; the second
        # is ready at lat + 4, lat + 3 cycles after its load: nothing left to wait
        assert f.wait_cycles[end] == lat[end] - 3
    assert f.l2_waits == 1


@triton.jit
def _ffma_chain_kernel(x_ptr, out_ptr, a, b, BLOCK: tl.constexpr):
    """Test-only: eight dependent fused multiply-adds per element."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs)
    for _ in tl.static_range(8):
        v = v * a + b
    tl.store(out_ptr + offs, v)


@pytest.mark.compile
def test_decoded_stalls_of_a_compiled_dependent_ffma_chain():
    x = torch.empty(128, device="meta", dtype=torch.float32)
    with recording() as rec:
        rec.block = "b"
        launch(
            _ffma_chain_kernel,
            (1,),
            x,
            x,
            1.5,
            0.25,
            BLOCK=128,
            num_warps=4,
            cost=lambda: KernelCost(0, 0, 1024),
        )
    (c,) = cc.compile_variants([cc.variant_of(rec.launches[0], 90)])
    insns, _ = c.listing()
    assert all(i.high is not None for i in insns)
    chain = [i for i in insns if i.family == "FFMA"]
    assert len(chain) == 8
    # each FFMA depends on the one before: ptxas stalls 4-5 cycles between them (the fixed FMA latency)
    assert all(4 <= i.control.stall <= 5 for i in chain[:-1])
    # the load's result is waited on through its scoreboard; EXIT ends the listing with its stall
    ldg = next(i for i in insns if i.family == "LDG")
    assert ldg.control.write_barrier < 6 and chain[0].control.wait_mask >> ldg.control.write_barrier & 1


@pytest.mark.compile
def test_convfirst_tap_loads_allocate_in_l1(monkeypatch):
    # issue 18: the stage-1 ConvFirst tap loads (C = 32) used to be software-pipelined into cp.async.cg,
    # SASS LDGSTS.E.BYPASS.128, which skips L1, so every tap window was fetched from L2. They are plain
    # ld.global now (LDG.E.128 without .STRONG: allocated in L1), there is no cp.async in the kernel, and
    # the report counts those loads as the program's declared unique bytes when its working set fits L1
    from convfirstnet.analysis import report
    from convfirstnet.blocks import ConvFirst
    from convfirstnet.factory import fuse
    from convfirstnet.kernels.convfirst import launcher

    monkeypatch.setattr(launcher, "STAGED", False)  # the fused kernel (16-bit blocks ship as conv + FFN)
    block = fuse(torch.nn.Sequential(ConvFirst(32, 32, 1, 3))).half().to("meta")
    x = torch.empty(1, 32, 32, 32, device="meta", dtype=torch.float16).contiguous(
        memory_format=torch.channels_last
    )
    (lc,) = report.record_launches(block, x)
    (c,) = cc.compile_variants([cc.variant_of(lc, 90)])
    insns, _ = c.listing()
    ops = launches.memory_ops(insns)
    # five two-tap steps, each loading [G, M, 16] halves of 8 channels: 16-byte L1-allocating loads
    assert ops.get("LDG.E.128 (load, L1)", 0) >= 5
    assert not any(k.startswith("LDGSTS") for k in ops)
