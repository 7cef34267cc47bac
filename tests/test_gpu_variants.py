"""scripts/gpu_variants.py without a GPU: a variant's overrides reach the module they name and are restored."""

import pytest

from tests._scripts import load_script

variants = load_script("gpu_variants")


def test_overrides_reach_their_modules_and_are_restored():
    from convfirstnet.kernels import _carveout
    from convfirstnet.kernels.mbconv import launcher

    warps, policy = launcher.HIDDEN_WARPS, _carveout.POLICY
    with variants.overridden({"HIDDEN_WARPS": 16, **variants.VARIANTS["L1 carveout triton"]}):
        assert (launcher.HIDDEN_WARPS, _carveout.POLICY) == (16, "triton")
    assert (launcher.HIDDEN_WARPS, _carveout.POLICY) == (warps, policy)


def test_an_unknown_constant_is_an_error():
    with pytest.raises(AttributeError, match="has no constant NO_SUCH"):
        with variants.overridden({"_carveout.NO_SUCH": 1}):
            pass


def test_every_variant_names_existing_constants():
    for name, values in variants.VARIANTS.items():
        with variants.overridden(values):
            pass


def test_switches_restore_the_forms_before():
    """"ffn unpipelined" and "conv G 8 small maps" give back the configs the shipped ones replaced."""
    import torch

    from convfirstnet.kernels.convfirst import staged
    from convfirstnet.kernels.gconv import launcher as gconv

    f16 = torch.float16
    shipped = (staged.ffn_config(64, 384, f16), gconv.fwd_tile_config(1024, 8, 8, f16).g,
               gconv.backward_config(128, 1024, 8, 8, f16)[0].g)
    assert (shipped[0].stages, shipped[0].programs_per_sm, shipped[1], shipped[2]) == (3, 1, 16, 16)
    before = {**variants.VARIANTS["ffn unpipelined"], **variants.VARIANTS["conv G 8 small maps"]}
    with variants.overridden(before):
        cfg = staged.ffn_config(64, 384, f16)
        assert (cfg.stages, cfg.programs_per_sm) == (1, staged.FFN_PROGRAMS_PER_SM)
        assert gconv.fwd_tile_config(1024, 8, 8, f16).g == 8
        assert gconv.backward_config(128, 1024, 8, 8, f16)[0].g == 4
    assert staged.ffn_config(64, 384, f16) == shipped[0]
