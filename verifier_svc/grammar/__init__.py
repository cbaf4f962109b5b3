"""Structured outputs on the verifier: compile constraints (backend), track them per
sequence and mask logits and drafts (matcher). See docs/architecture.md."""

from verifier_svc.grammar.backend import CompiledGrammar, GrammarBackend
from verifier_svc.grammar.matcher import (
    GrammarState,
    allocate_bitmask,
    apply_masks,
    bitmask_to_bool,
)

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarState", "allocate_bitmask", "apply_masks",
           "bitmask_to_bool"]
