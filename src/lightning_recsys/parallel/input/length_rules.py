"""The length rules moved to ``lightning_recsys.contracts.length_rules`` (models state them, the input guard checks them).

This module re-exports them under their old import path.
"""

from lightning_recsys.contracts.length_rules import (
    LENGTH_RULES_ATTRIBUTE,
    FeatureLengthRules,
    length_rule_problems,
    module_length_rules,
)

__all__ = ["LENGTH_RULES_ATTRIBUTE", "FeatureLengthRules", "length_rule_problems", "module_length_rules"]
