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
