"""A short run of the checkpoint fuzzer (benchmarks/checkpoint_fuzz.py) under hypothesis: 200 mutated checkpoints.

Every mutation of ``.metadata``, the shard, ``host_state.pt`` or ``meta.json`` either loads or is refused
with a documented error, with the model unchanged; never a raw exception or a hang. The long run
(``benchmarks/checkpoint_fuzz.py --count 10000``, in a worker process that also counts crashes) is a
benchmark; its count is in docs/checkpoints.md.
"""

from __future__ import annotations

import signal
from typing import Any

import checkpoint_fuzz as fuzz  # benchmarks/checkpoint_fuzz.py
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return fuzz.Harness(tmp_path_factory.mktemp("fuzz"))


_MUTATION = st.tuples(st.sampled_from(fuzz.OPS), st.floats(0, 1, exclude_max=True), st.integers(0, 255), st.integers(0, 1 << 16))


def test_mutations_are_pure_functions_of_their_arguments() -> None:
    blob = bytes(range(100))
    assert fuzz.apply_mutations(blob, [("flip", 0.5, 0, 0)]) == blob[:50] + bytes([blob[50] ^ 1]) + blob[51:]
    assert fuzz.apply_mutations(blob, [("truncate", 0.1, 0, 0)]) == blob[:10]
    assert fuzz.random_case(0, 7) == fuzz.random_case(0, 7) and fuzz.random_case(0, 7) != fuzz.random_case(0, 8)


def test_an_unmutated_checkpoint_loads(harness: Any) -> None:
    assert harness.run(".metadata", harness.original[".metadata"], also_dict=True) == "loaded"


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(target=st.sampled_from(fuzz.TARGETS), mutations=st.lists(_MUTATION, min_size=1, max_size=4))
def test_every_mutation_loads_or_is_refused_with_the_model_unchanged(harness: Any, target: str, mutations: list) -> None:
    mutated = fuzz.apply_mutations(harness.original[target], mutations)

    def hang(*_: Any) -> None:
        raise TimeoutError(f"a load of a mutated {target} blocked")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)
    try:
        outcome = harness.run(target, mutated)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert outcome == "loaded" or outcome.startswith("refused:"), (target, mutations, outcome)
