"""The dry run's peak extrapolation, on the probes of DeepSeek-V3 671B at 256 ranks (fake
tensors, measured 2026-11-24): 1- and 2-block copies against the full 61-block step."""

import pytest

from torchtitan.tools.memory_estimate import extrapolate, extrapolate_peak, with_exact_state

MiB = 2**20


def _mib(**gib: float) -> dict[str, int]:
    cats = {k: int(v * 1024) * MiB for k, v in gib.items()}
    return cats | {"Total": sum(cats.values())}


# EP 16: both probes peak in an MoE block's backward; FSDP's pending gradient buffers read as
# "Temp" growing by 0.87 GiB a block, which the full depth never holds (2.84 GiB there).
EP16 = (
    {
        "forward": _mib(Parameter=4.083, Activation=2.627, Optstate=0.389),
        "peak": _mib(Parameter=4.083, Gradient=1.808, Activation=5.6, Temp=1.969, Optstate=0.389),
    },
    {
        "forward": _mib(Parameter=4.251, Activation=2.682, Optstate=0.724),
        "peak": _mib(Parameter=4.251, Gradient=1.976, Activation=5.6, Temp=2.842, Optstate=0.724),
    },
    53.148,
)
# EP 8: the probes peak at different moments (the loss's temporaries with one block).
EP8 = (
    {
        "forward": _mib(Parameter=4.083, Activation=3.939, Optstate=0.389),
        "peak": _mib(Parameter=4.083, Gradient=1.808, Activation=1.593, Temp=8.422, Optstate=0.389),
    },
    {
        "forward": _mib(Parameter=4.251, Activation=3.994, Optstate=0.724),
        "peak": _mib(Parameter=4.251, Gradient=1.894, Activation=6.981, Temp=3.553, Optstate=0.724),
    },
    55.81,
)


@pytest.mark.parametrize(("one", "two", "full_gib"), [EP16, EP8], ids=["ep16", "ep8"])
def test_peak_grows_by_what_a_block_holds_not_by_its_temporaries(one, two, full_gib):
    peak = extrapolate_peak(one, two, 61)
    assert peak["Total"] == sum(v for k, v in peak.items() if k != "Total")
    assert peak["Temp"] == two["peak"]["Temp"]
    assert peak["Total"] / 2**30 == pytest.approx(full_gib, rel=0.10)
    # A line through the two peaks, per category, is far off at this depth.
    line = extrapolate(one["peak"], two["peak"], 61)["Total"] / 2**30
    assert abs(line / full_gib - 1) > 0.4


def test_held_state_is_the_models_where_its_blocks_differ_from_the_probes():
    """EP 8's probes hold 0.389 and 0.724 GiB of optimizer state: 20.49 GiB over 61 MoE
    blocks, where the model (3 dense blocks, then 58 MoE) holds 19.53."""
    one, two = EP8[0], EP8[1]
    state_one = _mib(Parameter=0.195, Optstate=0.389)
    state_two = _mib(Parameter=0.362, Optstate=0.724)
    peak = extrapolate_peak(one, two, 61)
    exact = {"Parameter": int(9.77 * 2**30), "Optstate": int(19.53 * 2**30)}
    held = with_exact_state(peak, state_one, state_two, exact, 61)
    assert held["Optstate"] == exact["Optstate"]
    # What the step gathers on top of the shards stays.
    gathered = peak["Parameter"] - extrapolate(state_one, state_two, 61)["Parameter"]
    assert held["Parameter"] == exact["Parameter"] + gathered
    assert held["Total"] == sum(v for k, v in held.items() if k != "Total")
    assert held["Activation"] == peak["Activation"]
    # Identical blocks: the extrapolation is the model; nothing moves.
    same = extrapolate(state_one, state_two, 61)
    assert with_exact_state(peak, state_one, state_two, same, 61) == peak
