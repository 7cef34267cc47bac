"""convfirstnet.analysis.shared: bank conflicts of register -> shared copies, from the TTGIR's layouts.

The two layouts of the MBConv hidden kernel's conv operand copy (a [8 groups, 64 pixels, 16] fp16 tap pair
tile) as Triton 3.6 and 3.8 compile it: both take 16 wavefronts per warp store where 4 would do, which is
what Nsight Compute measured on an H200 (Triton 3.6: 24.6 M store wavefronts for ~1.3 M such stores per
launch, benchmarks/results/ncu/)."""

from convfirstnet.analysis.shared import lane_coords, shared_offset, shared_stores


def _ttgir(blocked: str, shared: str, shape: str = "8x64x16") -> str:
    return (f"#blocked5 = #ttg.blocked<{{{blocked}}}>\n"
            f"#shared3 = #ttg.swizzled_shared<{{{shared}}}>\n"
            f"%a0_385 = ttg.local_alloc %a0_384 : (tensor<{shape}xf16, #blocked5>) -> "
            f"!ttg.memdesc<{shape}xf16, #shared3, #smem>\n")


TRITON_36 = _ttgir("sizePerThread = [1, 1, 8], threadsPerWarp = [8, 2, 2], warpsPerCTA = [1, 8, 1], "
                   "order = [2, 0, 1]", "vec = 8, perPhase = 4, maxPhase = 2, order = [2, 1, 0]")
TRITON_38 = _ttgir("sizePerThread = [1, 1, 8], threadsPerWarp = [1, 16, 2], warpsPerCTA = [2, 4, 1], "
                   "order = [2, 1, 0]", "vec = 8, perPhase = 4, maxPhase = 2, order = [2, 0, 1]")


def test_the_conv_operand_copy_conflicts_four_ways_in_both_versions():
    for text in (TRITON_36, TRITON_38):
        (st,) = shared_stores(text)
        assert (st.shape, st.vector_bytes, st.wavefronts, st.ideal) == ((8, 64, 16), 16, 16, 4)
        assert st.conflict_factor == 4


def test_matching_layouts_are_conflict_free():
    """Lanes along the shared buffer's rows in its own order: 32 x 16 B = four 128 B wavefronts."""
    text = _ttgir("sizePerThread = [1, 1, 8], threadsPerWarp = [1, 16, 2], warpsPerCTA = [8, 1, 1], "
                  "order = [2, 1, 0]", "vec = 8, perPhase = 4, maxPhase = 2, order = [2, 1, 0]")
    (st,) = shared_stores(text)
    assert (st.wavefronts, st.ideal) == (4, 4)


def test_the_swizzle_spreads_rows_over_banks():
    """64-element rows (128 B) of one column each: without a swizzle all 8 lanes of a phase hit the same
    banks (8 wavefronts each phase); an 8-phase swizzle puts them on 8 different 16-byte bank groups."""
    blocked = "sizePerThread = [1, 8], threadsPerWarp = [32, 1], warpsPerCTA = [8, 1], order = [1, 0]"
    plain = _ttgir(blocked, "vec = 8, perPhase = 1, maxPhase = 1, order = [1, 0]", "256x64")
    swizzled = _ttgir(blocked, "vec = 8, perPhase = 1, maxPhase = 8, order = [1, 0]", "256x64")
    assert [(s.wavefronts, s.ideal) for s in shared_stores(plain)] == [(32, 4)]
    assert [(s.wavefronts, s.ideal) for s in shared_stores(swizzled)] == [(4, 4)]


def test_layout_arithmetic():
    # lane 5 in threadsPerWarp [8, 2, 2], order [2, 0, 1]: k half 1, group 2, pixel 0
    assert lane_coords(5, (1, 1, 8), (8, 2, 2), (2, 0, 1)) == [2, 0, 8]
    # [8, 64, 16], order [2, 1, 0]: row = group * 64 + pixel; phase (row // 4) % 2 flips the 8-column group
    assert shared_offset([0, 4, 0], (8, 64, 16), 8, 4, 2, (2, 1, 0)) == 4 * 16 + 8
    assert shared_offset([2, 0, 8], (8, 64, 16), 8, 4, 2, (2, 1, 0)) == 128 * 16 + 8


def test_shared_wavefronts_per_instruction_and_store_conflicts():
    from types import SimpleNamespace

    from convfirstnet.analysis.launches import store_conflict
    from convfirstnet.analysis.sass import shared_wavefronts, traffic

    ops = ("STS.128", "STS.64", "STS", "STS.U16", "LDS.128", "LDSM.16.M88.4", "LDSM.16.MT88.2",
           "STSM.16.M88.1", "LDG.E.128", "HMMA.16816.F32")
    assert [shared_wavefronts(op) for op in ops] == [4, 2, 1, 1, 4, 4, 2, 1, 0, 0]
    ops = ("STS.128", "LDSM.16.M88.4", "LDGSTS.E.BYPASS.128", "LDG.E.128")
    listing = [SimpleNamespace(opcode=op) for op in ops]
    t = traffic(listing, [10, 10, 2, 5], num_warps=8, store_conflict={16: 4.0})
    assert t.shared_wavefronts == (10 * 4 + 10 * 4 + 2 * 4) * 8  # the cp.async writes its 512 B too
    assert t.shared_conflict_wavefronts == 10 * 4 * 8 * 3  # only the STS, three extra per ideal one
    assert t.load_bypass == 2 * 16 * 32 * 8 and t.load_l1 == 5 * 16 * 32 * 8
    # per store width, the factor of the largest copy (the tap pairs, 16-byte vectors), not of the worst
    # one (the weights, once per chunk); a width without a copy stores conflict-free
    stores = [dict(shape=[8, 16, 8], vector_bytes=8, wavefronts=16, ideal=2),
              dict(shape=[8, 64, 16], vector_bytes=16, wavefronts=16, ideal=4),
              dict(shape=[8, 32, 16], vector_bytes=16, wavefronts=8, ideal=4)]
    assert store_conflict(stores) == {8: 8.0, 16: 4.0} and store_conflict([]) == {}
    ops = ("STS.128", "STS.64", "STS")
    t = traffic([SimpleNamespace(opcode=op) for op in ops], [10, 10, 10], num_warps=1,
                store_conflict=store_conflict(stores[:2]))
    assert t.shared_conflict_wavefronts == 10 * 4 * 3 + 10 * 2 * 7  # STS.128 at 4x, STS.64 at 8x, STS at 1x
    # the conflict-free tap order: only the weights' 8-byte copy is left in the TTGIR
    t = traffic([SimpleNamespace(opcode=op) for op in ops], [10, 10, 10], num_warps=1,
                store_conflict=store_conflict(stores[:1]))
    assert t.shared_conflict_wavefronts == 10 * 2 * 7


def test_ldmatrix_and_global_accesses_in_the_data_pipe():
    """The L1/shared data pipe's wavefronts of one program (the report's "lsu" term): LDSM at the
    conflict factor of the PTX's ldmatrix reads, and one wavefront per 128 bytes of each warp's global
    request; a hand-made PTX whose rows all sit 256 bytes apart reads each 8x8 matrix in 8 wavefronts."""
    from types import SimpleNamespace

    from convfirstnet.analysis.launches import ldsm_conflict
    from convfirstnet.analysis.sass import traffic

    ops = ("STS.128", "LDSM.16.M88.4", "LDG.E.128", "LDG.E", "STG.E.64", "LDL")
    listing = [SimpleNamespace(opcode=op) for op in ops]
    t = traffic(listing, [10, 10, 5, 3, 2, 1], num_warps=4, store_conflict={16: 2.0}, ldsm_conflict=6.0)
    assert t.shared_wavefronts == (10 * 4 + 10 * 4) * 4
    assert t.shared_conflict_wavefronts == (10 * 4 * 1 + 10 * 4 * 5) * 4  # STS one extra, LDSM five
    assert t.global_wavefronts == (5 * 4 + 3 * 1 + 2 * 2 + 1 * 1) * 4  # 512, 128, 256 and 128 B per warp
    assert t.lsu_wavefronts == t.shared_wavefronts + t.shared_conflict_wavefronts + t.global_wavefronts

    def ptx(stride: int) -> str:  # lane l gives row l: address l * stride
        return (f"mov.u32 %r1, %tid.x;\nmul.lo.s32 %r2, %r1, {stride};\n"
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r3, %r4, %r5, %r6}, [%r2];\n")

    assert ldsm_conflict(ptx(16)) == 1.0  # 8 rows of 16 B side by side: one wavefront per matrix
    assert ldsm_conflict(ptx(256)) == 8.0  # every row in the same four banks
    assert ldsm_conflict("st.shared.v4.b32 [%r1], {%r2, %r3, %r4, %r5};\n") == 1.0  # no ldmatrix
