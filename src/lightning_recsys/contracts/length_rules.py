"""Length rules a model states for its jagged features, checked by the model and by the runtime's input guard.

A sequence model reads features that only make sense together: one action type per history item,
exactly one candidate per example. TorchRec looks each feature up on its own and never compares
their lengths, so a batch that breaks such a rule fails deep in the model's forward on one rank,
while the others wait in the next collective. A module that sets the attribute
``sparse_length_rules`` to a ``FeatureLengthRules`` has them checked on every rank before the step
(``InputValidator``), and the problem is raised on every rank together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

LENGTH_RULES_ATTRIBUTE = "sparse_length_rules"


@dataclass(frozen=True, kw_only=True)
class FeatureLengthRules:
    """Per-example length rules for jagged features.

    Args:
        aligned: groups of features whose lengths must be equal in every example (e.g. history
            item ids and their action types).
        one_per_example: features that must hold exactly one id per example (e.g. the candidate).
        owner: who states the rules (named in the error, e.g. ``"SequenceRanker"``).
    """

    aligned: tuple[tuple[str, ...], ...] = ()
    one_per_example: tuple[str, ...] = ()
    owner: str = "the model"

    def __post_init__(self) -> None:
        object.__setattr__(self, "aligned", tuple(tuple(group) for group in self.aligned))
        object.__setattr__(self, "one_per_example", tuple(self.one_per_example))
        short = [list(group) for group in self.aligned if len(group) < 2]
        if short:
            raise ValueError(f"FeatureLengthRules(aligned=...) groups {short} name fewer than 2 features; a group aligns 2 or more.")


def module_length_rules(module: nn.Module) -> list[FeatureLengthRules]:
    """The ``FeatureLengthRules`` that ``module`` and its submodules state (attribute ``sparse_length_rules``)."""
    found = [getattr(sub, LENGTH_RULES_ATTRIBUTE, None) for sub in module.modules()]
    return [rules for rules in found if isinstance(rules, FeatureLengthRules)]


def length_rule_problems(
    rules: list[FeatureLengthRules], keys: list[str], lengths: torch.Tensor, batch_size: int, batch: int | None = None
) -> list[str]:
    """What breaks ``rules`` in a KJT's ``lengths`` (``[len(keys) * batch_size]``); features it lacks are skipped.

    ``batch``: the batch's index, named in each message when given.
    """
    if not rules or batch_size == 0:
        return []
    where = "" if batch is None else f"batch {batch}: "
    per_key = lengths.view(len(keys), batch_size)
    position = {key: i for i, key in enumerate(keys)}
    problems = []
    for rule in rules:
        for group in rule.aligned:
            present = [f for f in group if f in position]
            for other in present[1:]:
                first, second = per_key[position[present[0]]], per_key[position[other]]
                bad = torch.nonzero(first != second)
                if bad.numel():
                    example = int(bad[0])
                    problems.append(
                        f"{where}features {present[0]!r} and {other!r} must have the same length in every example "
                        f"({rule.owner} reads them position by position), but example {example} has {int(first[example])} "
                        f"and {int(second[example])} ({bad.numel()} example(s) differ). Emit one {other!r} value per "
                        f"{present[0]!r} value."
                    )
        for feature in rule.one_per_example:
            if feature not in position:
                continue
            feature_lengths = per_key[position[feature]]
            bad = torch.nonzero(feature_lengths != 1)
            if bad.numel():
                example = int(bad[0])
                problems.append(
                    f"{where}feature {feature!r} must hold exactly one id per example ({rule.owner}), but example "
                    f"{example} has {int(feature_lengths[example])} ({bad.numel()} example(s) differ)."
                )
    return problems
