"""Barrier ordering of global round trips, read from the compiled PTX (convfirstnet.analysis.ordering).

A kernel that stores to a global buffer and loads it back in the same program (a scratch slot, a gate
slot) must put a CTA barrier between the stores and every load they may reach, loop back edges
included. The PTX of every shipped kernel has dozens of other ``bar.sync`` (layout conversions), so a
deleted ``tl.debug_barrier()`` passes every interpreter test; this check follows the control flow.

The small kernels below plant each mistake (no barrier; a barrier that only the next iteration's
store skips; a predicated barrier) and are compiled for sm_90 like the shipped ones.
"""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from convfirstnet.analysis import ordering  # noqa: E402
from convfirstnet.analysis.compiled import compile_variants, variant_of  # noqa: E402
from convfirstnet.kernels._cost import Launch, recording  # noqa: E402

B = 32  # tile edge: a [32, 32] tile stored by rows and read back transposed (other threads' elements)


@triton.jit
def _straight(scr_ptr, out_ptr, BARRIER: tl.constexpr, B: tl.constexpr):
    r = tl.arange(0, B)
    tile = r[:, None] * B + r[None, :]
    tl.store(scr_ptr + tile, tile.to(tl.float32))
    if BARRIER:
        tl.debug_barrier()
    t = tl.load(scr_ptr + r[None, :] * B + r[:, None])
    tl.store(out_ptr + tile, t)


@triton.jit
def _loop(scr_ptr, out_ptr, N, TOP: tl.constexpr, MID: tl.constexpr, B: tl.constexpr):
    """Each iteration reads back what the previous one stored: the store at the end of iteration i
    reaches the load at the start of iteration i + 1 through the back edge."""
    r = tl.arange(0, B)
    tile = r[:, None] * B + r[None, :]
    tl.store(scr_ptr + tile, tile.to(tl.float32))
    tl.debug_barrier()
    acc = tl.zeros((B, B), dtype=tl.float32)
    for _ in range(N):
        if TOP:
            tl.debug_barrier()
        t = tl.load(scr_ptr + r[None, :] * B + r[:, None])
        acc += t
        if MID:
            tl.debug_barrier()
        tl.store(scr_ptr + tile, t + 1.0)
    tl.store(out_ptr + tile, acc)


@triton.jit
def _conditional(scr_ptr, out_ptr, FLAG, B: tl.constexpr):
    """The barrier sits in one branch of a runtime condition: the other path has none."""
    r = tl.arange(0, B)
    tile = r[:, None] * B + r[None, :]
    tl.store(scr_ptr + tile, tile.to(tl.float32))
    if FLAG > 0:
        tl.debug_barrier()
    tl.store(out_ptr + tile, tl.load(scr_ptr + r[None, :] * B + r[:, None]))


@triton.jit
def _reuse(scr_ptr, out_ptr, N, BARRIER: tl.constexpr, B: tl.constexpr):
    """Store, barrier, load, and the next iteration stores again: without the barrier at the top of the
    body, a thread may overwrite the slot while others still read it (write after read)."""
    r = tl.arange(0, B)
    tile = r[:, None] * B + r[None, :]
    acc = tl.zeros((B, B), dtype=tl.float32)
    for i in range(N):
        if BARRIER:
            tl.debug_barrier()
        tl.store(scr_ptr + tile, (tile + i).to(tl.float32))
        tl.debug_barrier()
        acc += tl.load(scr_ptr + r[None, :] * B + r[:, None])
    tl.store(out_ptr + tile, acc)


@triton.jit
def _two_buffers(a_ptr, b_ptr, out_ptr, B: tl.constexpr):
    """Stores to one argument, loads from another: no round trip, nothing to order."""
    r = tl.arange(0, B)
    tile = r[:, None] * B + r[None, :]
    tl.store(a_ptr + tile, tile.to(tl.float32))
    tl.store(out_ptr + tile, tl.load(b_ptr + r[None, :] * B + r[:, None]))


@triton.jit(noinline=True)
def _read_back(src_ptr, dst_ptr, B: tl.constexpr):
    """A function of its own in the PTX (a call, not inlined): loads one buffer, stores another."""
    r = tl.arange(0, B)
    tl.store(dst_ptr + r[:, None] * B + r[None, :], tl.load(src_ptr + r[None, :] * B + r[:, None]))


@triton.jit
def _call(scr_ptr, out_ptr, BARRIER: tl.constexpr, B: tl.constexpr):
    """The read back happens inside a called function: the call must follow a barrier."""
    r = tl.arange(0, B)
    tile = r[:, None] * B + r[None, :]
    tl.store(scr_ptr + tile, tile.to(tl.float32))
    if BARRIER:
        tl.debug_barrier()
    _read_back(scr_ptr, out_ptr, B)


def _variant(kernel, *args, **meta):
    return variant_of(Launch(kernel, (1,), args, dict(num_warps=4, **meta), None, None), 90)


@pytest.fixture(scope="module")
def planted():
    """{case: (round-trip buffers, hazards)} of the planted kernels compiled for sm_90."""
    buf = torch.empty(B * B, device="meta")
    cases = {
        "straight, no barrier": _variant(_straight, buf, buf, BARRIER=False, B=B),
        "straight, barrier": _variant(_straight, buf, buf, BARRIER=True, B=B),
        "loop, barrier at the top": _variant(_loop, buf, buf, 5, TOP=True, MID=False, B=B),
        "loop, barrier between load and store": _variant(_loop, buf, buf, 5, TOP=False, MID=True, B=B),
        "barrier in one branch": _variant(_conditional, buf, buf, 3, B=B),
        "two buffers": _variant(_two_buffers, buf, buf, buf, B=B),
        "reuse, barrier": _variant(_reuse, buf, buf, 4, BARRIER=True, B=B),
        "reuse, no barrier": _variant(_reuse, buf, buf, 4, BARRIER=False, B=B),
        "call, no barrier": _variant(_call, buf, buf, BARRIER=False, B=B),
        "call, barrier": _variant(_call, buf, buf, BARRIER=True, B=B),
    }
    compiled = compile_variants(list(cases.values()))
    return {name: ordering.compiled_hazards(c, write_after_read=True) for name, c in zip(cases, compiled)}


def test_a_missing_barrier_is_found(planted):
    buffers, hazards = planted["straight, no barrier"]
    assert buffers == ["scr_ptr"] and hazards
    assert {(h.buffer, h.kind) for h in hazards} == {("scr_ptr", "read after write")}
    (line,) = ordering.summarize(hazards)  # one source line of loads, one of stores
    assert line.startswith("_straight: scr_ptr: the load at test_ordering.py:")
    assert "no bar.sync in between" in line
    assert planted["straight, barrier"] == (["scr_ptr"], [])


def test_loop_back_edges_are_followed(planted):
    # the barrier between the load and the store of one iteration does not order the store with the
    # next iteration's load; one at the top of the body does
    buffers, hazards = planted["loop, barrier between load and store"]
    assert buffers == ["scr_ptr"] and hazards
    assert planted["loop, barrier at the top"] == (["scr_ptr"], [])


def test_a_barrier_on_one_path_only_is_not_enough(planted):
    assert planted["barrier in one branch"][1]


def test_write_after_read(planted):
    # reads of the previous iteration, then this iteration's stores: ordered only by the top barrier
    assert planted["reuse, barrier"] == (["scr_ptr"], [])
    _, hazards = planted["reuse, no barrier"]
    assert hazards and {h.kind for h in hazards} == {"write after read"}


def test_calls_are_followed(planted):
    # a noinline function's loads count at its call site, through the buffers it is passed
    buffers, hazards = planted["call, no barrier"]
    assert buffers == ["scr_ptr"] and {(h.buffer, h.kind) for h in hazards} == {("scr_ptr", "read after write")}
    assert planted["call, barrier"] == (["scr_ptr"], [])


def test_separate_arguments_are_separate_buffers(planted):
    assert planted["two buffers"] == ([], [])


def _shipped_variants():
    """Distinct sm_90 variants of every launch of fused Small, fp16, at 256x256 (exact tiles) and 224x224
    (the general path), of its MBConv blocks' training forward, and of the training layer's gconv3x3
    forward, dgrad and wgrad (both strides)."""
    import convfirstnet

    fused = convfirstnet.fuse(convfirstnet.create_model("small")).to(device="meta", dtype=torch.float16)
    launches = []
    for size in (256, 224):
        x = torch.empty(2, 3, size, size, device="meta", dtype=torch.float16)
        with recording() as rec:
            fused(x.contiguous(memory_format=torch.channels_last))
        launches += rec.launches
    # fused Small's 16x16 stride-1 MBConv block at batch 128 as the hidden kernel (which takes it with
    # launcher.STAGED False, and past the staged expand's 32-bit offsets): each hidden item holds all the
    # chunks of its image, so the hidden kernel computes the SE gates (GATE, in a called function)
    from convfirstnet.kernels.mbconv import launcher

    c, r, s = 256, 1024, 64
    x = torch.empty(128, c, 16, 16, device="meta", dtype=torch.float16).contiguous(memory_format=torch.channels_last)

    def m(*shape):
        return torch.empty(shape, device="meta", dtype=torch.float16)

    saved, launcher.STAGED = launcher.STAGED, False
    try:
        with recording() as rec:
            torch.ops.convfirstnet.mbconv(x, m(r, c), m(r), m(r, 8, 3, 3), m(r), m(s, r), m(s), m(r, s), m(r),
                                          m(c, r), m(c), 1)
    finally:
        launcher.STAGED = saved
    assert rec.launches[0].meta.get("GATE")
    launches += rec.launches
    # the MBConv training forward: the stride-2 BN_d pass writes the full-resolution g in place of u and
    # blurs it back
    from .test_mbconv_fused_forward import SMALL_SHAPES, record_forward

    for shape in SMALL_SHAPES:
        launches += record_forward(*shape, n=8)
    for stride in (1, 2):
        x = torch.empty(2, 64, 32, 32, device="meta", dtype=torch.float16)
        x = x.contiguous(memory_format=torch.channels_last)
        w = torch.empty(64, 8, 3, 3, device="meta", dtype=torch.float16)
        with recording() as rec:
            y = torch.ops.convfirstnet.gconv3x3(x, w, stride)
            torch.ops.convfirstnet.gconv3x3_dgrad(y, w, 32, 32, stride)
            torch.ops.convfirstnet.gconv3x3_wgrad(y, x, torch.float16, stride)
        launches += rec.launches
    found = {}
    for lc in launches:
        v = variant_of(lc, 90)
        found.setdefault(v.key, v)
    return list(found.values())


def test_shipped_kernels_order_their_round_trips():
    """Every kernel of the fused model (stem, ConvFirst, MBConv, head) and of the training layer
    (gconv), compiled for sm_90: each load of a round-trip buffer comes after a barrier that follows
    every store to it. Each round trip has its own argument (ordering's module docstring); the MBConv
    kernels have four today (with GATE, the SE partials are a fifth, read back by a called function)."""
    variants = _shipped_variants()
    names = {v.name for v in variants}
    assert {"_stem_kernel", "_mbconv_hidden_kernel", "_head_kernel", "_gconv_wgrad_kernel",
            "_bn_silu_pool_kernel"} <= names
    results = [(c.variant.name, *ordering.compiled_hazards(c)) for c in compile_variants(variants)]
    buffers = {(name, b) for name, bufs, _ in results for b in bufs}
    assert buffers, "no kernel has a round trip: the check would pass vacuously"
    problems = ordering.summarize([h for _, _, hazards in results for h in hazards])
    assert not problems, "\n".join(problems)
